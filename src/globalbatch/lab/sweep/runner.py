"""Running a sweep: every pending trial of the grid (local processes or Ray Tune), then the timing pass.

Backends: ``local`` runs trials in spawned processes (``workers`` at a time, torch
threads = cores ÷ workers; with ``device="cuda"`` each worker takes its own GPU, round
robin); ``ray`` runs them as Ray Tune trials (``pip install 'globalbatch[ray]'``), each
with ``threads`` CPUs and, on CUDA, one GPU from Ray's resources, writing into the same
output directory (a shared file system on a multi-node cluster). Workers cannot outlive
the sweep: a thread in each exits it as soon as the parent is gone.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from globalbatch._util import SettingError
from globalbatch.critical.lr_choice import chosen_lr_per_batch
from globalbatch.critical.settings import AnalysisSettings
from globalbatch.lab.tasks import load_task_checked
from globalbatch.lab.device import check_device
from globalbatch.lab.rundir import check_manifest, lock_run_dir, remove_stale_tmp, tmp_writer
from globalbatch.validate import make_out_dir
from globalbatch.validate import out_dir as out_dir_checked
from globalbatch.lab.sweep.config import BACKENDS, RAY_HINT, SweepConfig, TrialSpec
from globalbatch.lab.sweep.designs import DESIGNS
from globalbatch.lab.sweep.halving import middle_first, probe_cells, ray_scheduler, rung_positions, run_rungs
from globalbatch.lab.sweep.lr_edges import (BatchEdge, batch_edge_cells, edge_cells, finished_summaries, refine_cells,
                                            transfer_cells)
from globalbatch.lab.sweep.store import analyze_sweep_seeds, analyze_sweep_seeds_or_train
from globalbatch.lab.sweep.timing import run_timing_pass
from globalbatch.lab.sweep.trial import exit_if_orphaned, run_trial, trial_done, trial_paused

__all__ = ["SweepResult", "run_sweep"]


@dataclass(kw_only=True)
class SweepResult:
    out_dir: str
    summaries: list[dict[str, Any]]
    ran: list[str]
    """Trials run by this call."""
    skipped: list[str]
    """Trials already finished by an earlier call (not rerun): every finished trial of the run directory this call did
    not run, edge and refinement cells included."""
    wall_time_s: float
    workers: int
    threads_per_worker: int
    timing: dict[int, dict] = field(default_factory=dict)
    """Batch (samples) → its sequential timing record (``timing/b<batch>.json``); empty if disabled."""
    timing_s: float = 0.0
    """Seconds spent in the timing pass by this call (0 when it was already recorded)."""


def analysis_edges(out: Path) -> Optional[dict[int, str]]:
    """Batch (samples) → "low"/"high" where the analysis over seeds puts the best LR at an edge; None if it cannot run."""
    return analysis_flags(out)[0]


def analysis_flags(out: Path) -> tuple[Optional[dict[int, str]], Optional[list[tuple[int, int, float, float]]]]:
    """The analysis' LR-edge flags (batch → "low"/"high") and falling-LR pairs ``(batch_low, batch_high, lr_low,
    lr_high)``, batches in samples; ``(None, None)`` when the sweep cannot be analysed yet."""
    return _analysis_flags(out)[:2]  # type: ignore[return-value]


def _beyond_largest(sa: Any) -> BatchEdge:
    """At the primary target: how many monotone seeds put B_crit beyond the largest batch, and its chosen LR."""
    from collections import Counter

    st = sa.primary
    top = max(st.steps)
    beyond = fitted = 0
    for s, ok in st.monotone.items():
        if not ok:
            continue
        pooled = st.pooled if st.pooled is not None and s in st.pooled.b_crit else None  # the values the analysis reads
        fit = st.per_seed[s].fit
        v = pooled.b_crit[s] if pooled is not None else (fit.b_crit if fit is not None and fit.degenerate is None else None)
        if v is not None:
            fitted += 1
            beyond += v > top
    lrs = [x for x in st.best_lr.get(top, {}).values() if x is not None]
    return BatchEdge(beyond=beyond, seeds=fitted, lr=Counter(lrs).most_common(1)[0][0] if lrs else None)


def _analysis_flags(out: Path, *, train_fallback: bool = False) -> tuple[
        Optional[dict[int, str]], Optional[list[tuple[int, int, float, float]]], Optional[BatchEdge],
        Optional[dict[int, float]]]:
    """:func:`analysis_flags`, the batch-edge verdict (:func:`_beyond_largest`) and each batch's chosen LR
    (:func:`~globalbatch.critical.lr_choice.chosen_lr_per_batch`); all None when not analysable.
    ``train_fallback``: with too few held-out evaluations read the training loss, as the report does."""
    s = AnalysisSettings(objective="cost")
    try:
        if train_fallback:
            data, sa, _ = analyze_sweep_seeds_or_train(out, s)
        else:
            data, sa = analyze_sweep_seeds(out, settings=s)
    except SettingError:  # not analysable yet (too few finished cells, no common target): the final loss decides
        return None, None, None, None
    units = data.batch_units()

    def samples(u: float) -> int:
        return min(units, key=lambda b: abs(units[b] - u))

    edges = {samples(u): e for u, e in sa.lr_edges.items()}
    falls = [(samples(f.batch_low), samples(f.batch_high), f.lr_low, f.lr_high) for f in sa.lr_falls]
    chosen = {samples(u): lr for u, lr in chosen_lr_per_batch(sa.primary).items()}
    return edges, falls, _beyond_largest(sa), chosen


def narrow_choice(out: Path, config: SweepConfig) -> Optional[tuple[float, Optional[str]]]:
    """A narrow design's base batch: ``(lr, edge)`` as the analysis over seeds chooses and flags it (the final
    analysis' rule), or None while the sweep cannot be analysed (:func:`transfer_cells` then reads the final loss)."""
    edges, _, _, chosen = _analysis_flags(out, train_fallback=True)
    base = config.narrow_base()
    if chosen is None or base not in chosen:
        return None
    return chosen[base], (edges or {}).get(base)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


class _Progress:
    """Rich progress fed by polling each running trial's temporary JSONL (works for every backend): one bar for the
    trials done, one bar per running trial, a printed line per finished trial. Rendering costs CPU the trials share:
    45 bars redrawn 10 times a second took a fifth of a core on a terminal, so only the running trials have bars,
    redrawn :data:`PROGRESS_REFRESH_PER_S` times a second (``benchmarks/progress_overhead.py``)."""

    def __init__(self, out: Path, pending: Sequence[TrialSpec], budget: int, unit: str, enabled: bool,
                 pause_at: Optional[int] = None) -> None:
        self.out, self.pending, self.budget, self.enabled = out, list(pending), budget, enabled
        self.pause_at = pause_at
        """The rung these trials run to (successive halving), None: the budget."""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.unit = unit
        self._running: dict[str, Any] = {}
        self._done: set[str] = set()

    def __enter__(self) -> "_Progress":
        if not self.enabled or not self.pending:
            return self
        from rich.console import Console

        self._progress = progress_display(Console(stderr=True))
        self._overall = self._progress.add_task("trials", total=len(self.pending), unit="trials")
        self._t0 = time.time()
        self._progress.start()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _consumed(self, trial: str) -> Optional[int]:
        """Units a running trial has reported in its temporary JSONL (None: none yet; a killed earlier attempt's file,
        its writer gone, is not this trial's progress); :meth:`_finished` reads ends."""
        d = self.out / "trials" / trial
        try:
            tmps = sorted((p for p in d.glob("metrics.jsonl.tmp-*") if tmp_writer(p) is not None),
                          key=lambda p: p.stat().st_mtime)
            if not tmps:
                return None
            with open(tmps[-1], "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4096))
                lines = f.read().split(b"\n")
            for line in reversed(lines[:-1]):
                rec = json.loads(line)
                if "consumed" in rec:
                    return int(rec["consumed"])
        except (OSError, ValueError):
            return None
        return None

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            self.refresh()

    def _finished(self, t: TrialSpec) -> Optional[str]:
        """How a trial of this display ended: ``"done"`` (its summary), ``"paused at N"`` (at this display's rung),
        or None (not yet)."""
        d = self.out / "trials" / t.name
        if (d / "summary.json").is_file():
            return "done"
        if self.pause_at is not None:
            marker = trial_paused(d, t)
            if marker is not None and marker["consumed"] >= self.pause_at:
                return f"paused at {marker['consumed']:,}"
        return None

    def refresh(self) -> None:
        target = self.pause_at or self.budget
        for t in self.pending:
            name = t.name
            if name in self._done:
                continue
            end = self._finished(t)
            if end is None:
                c = self._consumed(name)
                if c is None:
                    continue
                if name not in self._running:
                    self._running[name] = self._progress.add_task(name, total=target, unit=self.unit + "s")
                self._progress.update(self._running[name], completed=min(c, target))
                continue
            self._done.add(name)
            if name in self._running:
                self._progress.remove_task(self._running.pop(name))
            self._progress.update(self._overall, completed=len(self._done))
            self._progress.console.print(f"  {name} {end} ({len(self._done)}/{len(self.pending)}, "
                                         f"{time.time() - self._t0:,.0f} s)", highlight=False)

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.refresh()
            self._progress.stop()


PROGRESS_REFRESH_PER_S = 2
"""Redraws per second of the sweep's progress display (rich's default is 10)."""


def progress_display(console: Any) -> Any:
    """The sweep's rich progress display: description, bar, done / total (each task's ``unit`` field), elapsed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description:>16}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[unit]}"),
                    TimeElapsedColumn(), transient=False, console=console,
                    refresh_per_second=PROGRESS_REFRESH_PER_S)


def run_sweep(
    config: SweepConfig,
    out_dir: str | os.PathLike,
    *,
    workers: Optional[int] = None,
    backend: str = "local",
    address: Optional[str] = None,
    threads: Optional[int] = None,
    progress: bool = True,
    timing_steps: int = 8,
    timing_warmup: int = 2,
) -> SweepResult:
    """Run (or resume) every trial of the grid into ``out_dir``, then the timing pass.

    Args:
        workers: trials at once; None: min(pending trials, CPU cores). Each gets
            ``cores ÷ workers`` torch threads (at least 1). ``workers=1`` runs in-process.
        threads: torch threads per trial, overriding ``cores ÷ workers``. CPU results
            depend on it in the last bits: resume with the same value.
        backend: ``"local"`` (spawned processes) or ``"ray"`` (Ray Tune; ``address`` of an
            existing cluster, or None to start a local Ray).
        progress: rich progress bars on the terminal.
        timing_steps: steps timed per batch size in the sequential timing pass after the
            trials (after ``timing_warmup`` untimed ones), alone on all the sweep's threads;
            0 disables it (the analysis then falls back to the in-trial units/s).
    """
    # Every setting is checked, and the task built with its overrides, before anything is
    # written: a rejected run leaves no manifest behind to refuse the corrected rerun.
    if timing_steps < 0 or timing_warmup < 0:
        raise SettingError("timing_steps", timing_steps if timing_steps < 0 else timing_warmup, "a whole number ≥ 0")
    if backend not in BACKENDS:
        raise SettingError("backend", backend, ", ".join(BACKENDS))
    if workers is not None and (isinstance(workers, bool) or workers < 1):
        raise SettingError("workers", workers, "a whole number ≥ 1")
    most = 8 * _cpu_count()  # beyond it the OpenMP pools of the workers kill them (100,000 did) and nothing gains
    if threads is not None and (isinstance(threads, bool) or not 1 <= threads <= most):
        raise SettingError("threads", threads, f"a whole number from 1 to {most} (8 × the {_cpu_count()} cores here)")
    if workers is not None and workers > 64 * _cpu_count() and backend != "ray":
        raise SettingError("workers", workers, f"a whole number from 1 to {64 * _cpu_count()} on this machine's "
                           f"{_cpu_count()} cores (more across machines: --backend ray)")
    if address is not None and backend != "ray":
        raise SettingError("address", address, "an address only with backend ray")
    if backend == "ray":
        try:
            import ray  # noqa: F401
            from ray import tune  # noqa: F401
        except ImportError:
            raise SettingError("backend", "ray", f"local, or ray after {RAY_HINT}", why="Ray Tune is not installed") from None
    check_device(config.device, config.precision)  # a device that does not exist: one line, nothing written
    task = load_task_checked(config.task, config.task_overrides)  # fails here, not in a worker
    unit = task.unit
    per_sample = (task.seq_len or 1) if unit == "token" else 1
    step_units = max(config.batches) * per_sample
    if config.budget < 2 * step_units:  # a trial of fewer than two steps of the largest batch reads no steps to target
        raise SettingError("budget", config.budget, f"at least 2 steps of the largest batch: ≥ {2 * step_units:,} "
                           f"{unit}s (batch {max(config.batches)}" + (f" × {per_sample} tokens" if per_sample > 1 else "")
                           + " × 2)")
    out = out_dir_checked(out_dir, "out")
    make_out_dir(out, "out")
    with lock_run_dir(out):  # a second sweep into this directory: one error line, exit 2
        return _run_locked(config, out, unit, workers=workers, backend=backend, address=address, threads=threads,
                           progress=progress, timing_steps=timing_steps, timing_warmup=timing_warmup)


def _run_locked(config: SweepConfig, out: Path, unit: str, *, workers: Optional[int], backend: str,
                address: Optional[str], threads: Optional[int], progress: bool, timing_steps: int,
                timing_warmup: int) -> SweepResult:
    """:func:`run_sweep` once the settings are checked and ``out`` is locked."""
    check_manifest(out, config.manifest(), section="grid")
    trials = config.trials()
    done = [t for t in trials if trial_done(out / "trials" / t.name, t)]
    pending = [t for t in trials if t not in done]
    cores = _cpu_count()
    # Threads per trial follow from the requested workers and the whole grid, not from
    # what is left: a resumed sweep then runs its trials with the same thread count
    # (CPU float reductions depend on it) and reproduces an uninterrupted sweep.
    requested = workers if workers is not None else min(len(trials), cores)
    threads = threads if threads is not None else max(1, cores // requested)
    n_workers = max(1, min(len(pending) or 1, requested))
    t0 = time.time()
    cfg_dict = asdict(config)
    ran: list[TrialSpec] = []
    pool = _WorkerPool(cfg_dict, max(1, requested), threads)  # local backend, more than one worker

    def run_cells(cells: Sequence[TrialSpec], pause_at: Optional[int] = None, scheduler: Any = None) -> None:
        if not cells:
            return
        with _Progress(out, cells, config.budget, unit, progress, pause_at):
            if backend == "ray":
                _run_ray(cfg_dict, cells, out, max(1, min(len(cells), requested)), threads, address, rungs=rungs,
                         scheduler=scheduler, probes=probe_cells(config) if scheduler is not None else ())
            elif requested == 1:
                import torch

                old = torch.get_num_threads()
                try:
                    for t in cells:
                        run_trial(cfg_dict, asdict(t), str(out), threads=threads, pause_at=pause_at)
                finally:
                    torch.set_num_threads(old)
            else:
                pool.run(cells, out, pause_at)
        ran.extend(cells)

    try:
        # Successive halving (lab/sweep/halving.py): rung by rung, locally; in Ray's scheduler with --backend ray.
        rungs = rung_positions(config, DESIGNS[config.design].rungs)
        if rungs and backend == "ray":
            run_cells(middle_first(config, pending), scheduler=ray_scheduler(config, out, rungs))
        elif rungs:
            run_rungs(config, out, rungs, run_cells)
        elif pending:
            run_cells(pending)
        # LR grid per batch: while the best LR of a batch sits at an edge of what it ran, one more
        # LR beyond it (every seed); derived from the finished results, so a resume repeats it.
        # A narrow design: the base batch's grid (widened at an edge of the analysis' choice), then the other batches
        # at that choice moved by the rule, again whenever the choice changes. A chosen LR that falls as the batch grows: the rule's LR from the
        # neighbour (full-grid designs).
        narrow = DESIGNS[config.design].narrow
        while not rungs:  # a halving design widens its grids at the rungs
            done_now = finished_summaries(out, config)
            complete = all(trial_done(out / "trials" / t.name, t) for t in trials)
            if narrow:  # the base batch's LR and edge as the analysis chooses them, re-read on every pass
                choice = narrow_choice(out, config)
                base_edge = None if choice is None else ({config.narrow_base(): choice[1]} if choice[1] else {})
                extra = [t for t in edge_cells(config, done_now, base_edge) + transfer_cells(config, done_now, choice)
                         if not trial_done(out / "trials" / t.name, t)]  # a transfer lists its finished cells too
                if complete and not extra and choice is not None:  # B_crit beyond the largest batch: as the full design
                    extra = batch_edge_cells(config, done_now, _analysis_flags(out)[2], narrow_lr=choice[0])
            else:
                edges, falls, beyond, _ = _analysis_flags(out) if complete else (None, None, None, None)
                extra = edge_cells(config, done_now, edges)
                if complete and not extra:
                    extra = refine_cells(config, done_now, falls)
                if complete and not extra:  # B_crit beyond the largest batch: the next batch (×2), capped
                    extra = batch_edge_cells(config, done_now, beyond)
            extra = [t for t in {t.name: t for t in extra}.values() if not trial_done(out / "trials" / t.name, t)]
            if not extra:
                break
            run_cells(extra)
    finally:
        pool.close()
    for t in trials:  # an orphan of a killed earlier run may have left one after this run began
        remove_stale_tmp(out / "trials" / t.name)
    summaries = finished_summaries(out, config)
    timing: dict[int, dict] = {}
    t_timing = time.time()
    if timing_steps > 0:
        # All the sweep's threads in one process, nothing else of the sweep running.
        timing = run_timing_pass(config, out, summaries, threads=min(cores, max(1, requested * threads)),
                                 steps=timing_steps, warmup=timing_warmup)
    ran_names = list(dict.fromkeys(t.name for t in ran))
    this_call = set(ran_names)
    return SweepResult(
        out_dir=str(out), summaries=summaries, ran=ran_names,
        skipped=[str(s["trial"]) for s in summaries if s.get("trial") not in this_call],  # edge cells too
        wall_time_s=time.time() - t0, workers=n_workers, threads_per_worker=threads, timing=timing,
        timing_s=time.time() - t_timing,
    )


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker as soon as the sweep process is gone (``kill -9`` leaves pool workers orphaned)."""
    while True:
        time.sleep(0.2)
        if os.getppid() != parent_pid:
            os._exit(3)  # a running trial leaves only its metrics.jsonl.tmp-<pid>, removed on resume


_WORKER_DEVICE: Optional[str] = None
"""This pool worker's device (one GPU per worker for ``device="cuda"``), set by :func:`_worker_init`."""
_WORKER_STOP: Any = None
"""The sweep's stop event in a pool worker (set when the sweep closes its pool: no further trial starts)."""


def _die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this worker the moment the sweep process dies (``PR_SET_PDEATHSIG``).

    Polling the parent (below, and :func:`exit_if_orphaned` at every step) leaves a window between
    a check and the write after it; a pending SIGKILL closes it: the worker never returns to user
    space after its parent is gone, so no trial starts and no result is written afterwards.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # no prctl: the polling below still applies
        pass


def _worker_init(threads: int, device: str = "cpu", counter: Any = None, stop: Any = None) -> None:
    global _WORKER_DEVICE, _WORKER_STOP
    _WORKER_STOP = stop
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(3)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="watch-parent").start()
    if counter is not None:
        with counter.get_lock():
            index = counter.value
            counter.value += 1
        from globalbatch.lab.device import device_for_worker

        _WORKER_DEVICE = str(device_for_worker(device, index))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass


def _pool_trial(cfg: dict, spec: dict, out: str, threads: int, parent_pid: int, pause_at: Optional[int] = None) -> dict:
    """``run_trial`` in a pool worker, on the worker's own device; an orphaned worker starts nothing, nor one whose
    sweep is stopping (a cell already handed to the worker's queue, which cancelling cannot reach)."""
    exit_if_orphaned(parent_pid)
    if _WORKER_STOP is not None and _WORKER_STOP.is_set():
        return {"stopped": spec.get("name", "")}
    return run_trial(cfg, spec, out, threads=threads, parent_pid=parent_pid, device=_WORKER_DEVICE, pause_at=pause_at)


class _WorkerPool:
    """The sweep's worker processes (spawned), started on first use and kept across its rounds — the base cells,
    then the LR-edge, refinement and batch-edge cells, or the rungs of successive halving: a start imports torch
    and builds the task again in every worker (about 4 s on the demo's 2 cores). Workers start on demand, so a
    round of one cell starts one."""

    def __init__(self, cfg: dict, n_workers: int, threads: int) -> None:
        self.cfg, self.n_workers, self.threads = cfg, n_workers, threads
        self._executor: Any = None
        self._stop: Any = None

    def run(self, cells: Sequence[TrialSpec], out: Path, pause_at: Optional[int] = None) -> None:
        from concurrent.futures import FIRST_EXCEPTION, wait

        if self._executor is None:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            ctx = mp.get_context("spawn")
            self._stop = ctx.Event()
            self._executor = ProcessPoolExecutor(max_workers=self.n_workers, mp_context=ctx, initializer=_worker_init,
                                                 initargs=(self.threads, self.cfg["device"], ctx.Value("i", 0),
                                                           self._stop))
        futures = {self._executor.submit(_pool_trial, self.cfg, asdict(t), str(out), self.threads, os.getpid(),
                                         pause_at): t for t in cells}
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for fut in finished:
            exc = fut.exception()
            if exc is not None:
                for other in futures:
                    other.cancel()
                raise RuntimeError(f"trial {futures[fut].name} failed: {exc}") from exc

    def close(self) -> None:
        """Wait for the running trials (a failed round's others finish; on Ctrl-C each worker's trial is interrupted
        too, and resumes from its checkpoint on the next run), start no other — neither those cancelling reaches nor
        the one a worker already holds queued — and stop the workers."""
        if self._executor is not None:
            self._stop.set()
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


def _run_ray(cfg: dict, pending: Sequence[TrialSpec], out: Path, n_workers: int, threads: int, address: Optional[str],
             rungs: Sequence[int] = (), scheduler: Any = None, probes: Sequence[TrialSpec] = ()) -> None:
    """The cells as Ray Tune trials; with ``rungs`` and a halving ``scheduler`` each trial pauses at every rung (its
    checkpoint on disk), reports it, and goes on only when the scheduler lets it; ``probes`` run first, to the first
    rung only."""
    try:
        import ray
        from ray import tune
    except ImportError:
        raise SettingError("backend", "ray", f"local, or ray after {RAY_HINT}", why="Ray Tune is not installed") from None
    started_here = False
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address is not None:
            kwargs["address"] = address
        else:
            kwargs["num_cpus"] = n_workers * threads
        ray.init(**kwargs)
        started_here = True
    out_abs = str(out.resolve())

    def trainable(params: dict) -> None:
        report = getattr(tune, "report", None)
        if report is None:  # older Ray
            from ray import train

            report = train.report
        spec = {k: v for k, v in params["trial"].items() if k not in ("name", "probe")}
        if params["trial"].get("probe"):  # a seed-spread probe: to the first rung only
            mark = run_trial(cfg, spec, out_abs, threads=threads, pause_at=rungs[0])
            report({"probe": 1, "consumed": mark["consumed"]})
            return
        for k, rung in enumerate(rungs):  # a resumed (unpaused) trial reports the rungs it passed again: idempotent
            mark = run_trial(cfg, spec, out_abs, threads=threads, pause_at=rung)
            report({"trial": params["trial"]["name"], "rung": k, "consumed": mark["consumed"],
                    "val_loss": mark["val_loss"]})
        summary = run_trial(cfg, spec, out_abs, threads=threads)
        metrics = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        report(metrics)

    try:
        tuner = tune.Tuner(
            tune.with_resources(trainable, {"cpu": threads, **({"gpu": 1} if cfg["device"].startswith("cuda") else {})}),
            param_space={"trial": tune.grid_search([{**asdict(t), "name": t.name, "probe": True} for t in probes]
                                                   + [{**asdict(t), "name": t.name} for t in pending])},
            tune_config=tune.TuneConfig(max_concurrent_trials=n_workers if address is None else None,
                                        scheduler=scheduler),
            run_config=_ray_run_config(out_abs),
        )
        results = tuner.fit()
        errors = [str(r.error) for r in results if r.error is not None]  # type: ignore[attr-defined]  # ResultGrid iterates
        if errors:
            raise RuntimeError(f"{len(errors)} Ray trial(s) failed; first: {errors[0]}")
    finally:
        if started_here:
            ray.shutdown()


def _ray_run_config(out_abs: str):
    try:
        from ray.tune import RunConfig
    except ImportError:  # Ray < 2.40
        from ray.air import RunConfig  # type: ignore[assignment]
    return RunConfig(name="ray", storage_path=os.path.join(out_abs, "ray_results"), verbose=0)


