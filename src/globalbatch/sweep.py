"""Batch × LR sweeps: every trial on the same data order and the same token budget.

The measurement McCandlish et al. 2018 (arXiv 1812.06162, §3) base their critical
batch on: train at several batch sizes, tune the LR at each, and record the loss
against examples consumed. Each trial here

* trains ``task.build_model(seed)`` with AdamW (or SGD) through the exact step driver
  (:class:`globalbatch.step.StepDriver`: token-normalised accumulation, non-finite
  windows skipped) on ``task.sample_order(seed)`` — one seeded order shared by every
  trial, so at equal tokens all trials have seen the same data;
* uses a token-indexed LR schedule (linear warmup, then constant by default), so the
  LR at a given number of tokens does not depend on the batch;
* stops at the first step at which ``budget`` loss-bearing units (tokens, or samples)
  are trained;
* writes one JSONL line per optimizer step (loss, gradient norm, LR, batch, consumed
  units, skipped windows, units/s, train time) with the validation loss every
  ``eval_every`` units (evaluation is excluded from the timing).

Throughput is measured separately (``timing_steps``): trials run side by side and
compete for the cores, so their in-trial units/s depends on what else ran at the same
time (the demo's recommendation flipped from batch 4 to 32 under load). After the
trials, a sequential timing pass trains each batch size alone — one process with all
the sweep's threads, the best-LR config of that batch, ``timing_warmup`` untimed steps
then ``timing_steps`` timed ones — and writes ``timing/b<batch>.json`` atomically
(skipped on a rerun when present). The analysis uses it for throughput, time and cost
to target; the in-trial units/s stays in each ``summary.json`` as a secondary number.

Crash safety (a ``kill -9`` at any moment loses no finished result and leaves no
corrupt file): a trial appends to ``metrics.jsonl.tmp-<pid>``; at the end it
``os.replace``-s it to ``metrics.jsonl`` and then writes ``summary.json`` atomically
(tmp + fsync + replace). ``summary.json`` is the done marker. Rerunning the sweep
skips trials that have one and restarts the others from scratch (trials are
deterministic, so a restarted trial gives the same numbers). ``manifest.json``
describes the grid; rerunning into the same directory with a different grid is an
error, never a silent mix.

Backends: ``local`` runs trials in spawned processes (``workers`` at a time, torch
threads = cores ÷ workers); ``ray`` runs them as Ray Tune trials (``pip install
'globalbatch[ray]'``), each writing into the same output directory (a shared file
system on a multi-node cluster).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Sequence

from globalbatch._util import (  # noqa: F401 (atomic_write_*, read_jsonl, parse_*: re-exported)
    SettingError,
    atomic_write_json,
    load_task_checked,
    atomic_write_text,
    parse_list,
    parse_task_args,
    read_jsonl,
)
from globalbatch._util import json_default as _json_default

__all__ = [
    "SweepConfig",
    "TrialSpec",
    "SweepResult",
    "SweepData",
    "run_sweep",
    "run_trial",
    "load_sweep",
    "analyze_sweep",
    "run_timing_pass",
    "atomic_write_text",
    "atomic_write_json",
    "read_jsonl",
]

MANIFEST_VERSION = 1
OPTIMIZERS = ("adamw", "sgd")
BACKENDS = ("local", "ray")
RAY_HINT = "pip install 'globalbatch[ray]'"


# ---------------------------------------------------------------------------
# Event log
# ---------------------------------------------------------------------------


def _append_event(out_dir: Path, **event: Any) -> None:
    """One line in ``events.jsonl`` (O_APPEND: concurrent writers never interleave a short line)."""
    event = {"time": time.time(), "pid": os.getpid(), **event}
    fd = os.open(out_dir / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(event, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class SweepConfig:
    """The grid and the training recipe shared by every trial. Everything here is in the manifest."""

    task: str = "tinygpt"
    """Task name or ``module:function`` (see :func:`globalbatch.tasks.load_task`)."""
    task_overrides: dict[str, Any] = field(default_factory=dict)
    """Keyword overrides for the task, e.g. ``{"d_model": 64}``."""
    batches: list[int]
    """Global batch sizes in samples (sequences) per optimizer step."""
    lrs: list[float]
    """Peak learning rates; every batch is trained at every LR."""
    budget: int
    """Loss-bearing units (tokens for a token task, samples otherwise) each trial trains on."""
    seed: int = 0
    """Seed of the model initialisation and of the shared data order."""
    micro_batch: Optional[int] = None
    """Samples per forward/backward; None: min(batch, 16) (must divide every batch)."""
    eval_every: Optional[int] = None
    """Units between validation evaluations; None: budget ÷ 8."""
    max_val_samples: int = 256
    """Evaluate on the first this many validation samples (same ones every time)."""
    optimizer: str = "adamw"
    """``"adamw"`` (betas 0.9/0.95, weight decay ``weight_decay``) or ``"sgd"`` (momentum 0.9)."""
    weight_decay: float = 0.0
    warmup_fraction: float = 0.05
    """Linear LR warmup over this fraction of ``budget`` (in units, so the same for every batch)."""
    lr_shape: str = "constant"
    """Post-warmup LR shape over the budget (``constant``, ``cosine``, ``linear``, ``wsd``)."""
    max_grad_norm: Optional[float] = 1.0
    """Clip the global gradient norm to this (None: no clipping); the logged norm is before clipping."""
    noise: bool = False
    """Also measure the gradient noise scale B_simple (:class:`globalbatch.noise.NoiseScaleMonitor`,
    micro-batch source) and log it at every evaluation. Needs ≥ 2 micro-batches per step, so the
    micro-batch is capped at batch ÷ 2."""

    def __post_init__(self) -> None:
        E = SettingError
        if not self.batches or any(isinstance(b, bool) or int(b) != b or b < 1 for b in self.batches) \
                or len(set(self.batches)) != len(self.batches):
            raise E("batches", list(self.batches), "distinct whole numbers ≥ 1, e.g. 16,32,64")
        self.batches = [int(b) for b in self.batches]
        if not self.lrs or any(not (float(x) > 0 and math.isfinite(float(x))) for x in self.lrs) \
                or len(set(self.lrs)) != len(self.lrs):
            raise E("lrs", [float(x) for x in self.lrs], "distinct finite numbers > 0, e.g. 3e-4,1e-3")
        self.lrs = [float(x) for x in self.lrs]
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or int(self.budget) != self.budget \
                or self.budget < 1:
            raise E("budget", self.budget, "a whole number of units ≥ 1, e.g. 2M")
        self.budget = int(self.budget)
        if isinstance(self.seed, bool) or int(self.seed) != self.seed or self.seed < 0:
            raise E("seed", self.seed, "a whole number ≥ 0")
        if self.micro_batch is not None:
            bad = [b for b in self.batches if b % self.micro_batch and b > self.micro_batch] if self.micro_batch >= 1 else []
            if self.micro_batch < 1:
                raise E("micro_batch", self.micro_batch, "a whole number ≥ 1")
            if bad:
                raise E("micro_batch", self.micro_batch, "a whole number ≥ 1 that divides every batch larger than it",
                        why=f"does not divide batch {', '.join(map(str, bad))}")
        if self.eval_every is not None and self.eval_every < 1:
            raise E("eval_every", self.eval_every, "a whole number of units ≥ 1")
        if self.max_val_samples < 1:
            raise E("max_val_samples", self.max_val_samples, "a whole number ≥ 1")
        if self.optimizer not in OPTIMIZERS:
            raise E("optimizer", self.optimizer, ", ".join(OPTIMIZERS))
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise E("warmup_fraction", self.warmup_fraction, "0 ≤ warmup_fraction < 1")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise E("max_grad_norm", self.max_grad_norm, "a number > 0, or None (no clipping)")
        if not isinstance(self.task_overrides, dict):
            raise E("task_overrides", self.task_overrides, "a dict of task overrides")

    def micro_batch_for(self, batch: int) -> int:
        """Samples per micro-batch for a trial of ``batch`` samples."""
        m = self.micro_batch if self.micro_batch is not None else 16
        micro = batch if batch <= m else math.gcd(batch, m)
        if self.noise and micro == batch and batch > 1:  # the noise scale needs two micro-batches per step
            micro = max(d for d in range(1, batch) if batch % d == 0)
        return micro

    def eval_every_units(self) -> int:
        return self.eval_every if self.eval_every is not None else max(1, self.budget // 8)

    def trials(self) -> list["TrialSpec"]:
        """Every (batch, LR) pair, smallest batch and LR first."""
        return [TrialSpec(batch=b, lr=lr) for b, lr in itertools.product(sorted(self.batches), sorted(self.lrs))]

    def manifest(self) -> dict[str, Any]:
        """The grid as stored in ``manifest.json`` (what a resumed sweep must match)."""
        d = asdict(self)
        d["batches"] = sorted(d["batches"])
        d["lrs"] = sorted(d["lrs"])
        return {"version": MANIFEST_VERSION, "grid": d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SweepConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(kw_only=True, frozen=True)
class TrialSpec:
    batch: int
    """Global batch in samples per step."""
    lr: float

    @property
    def name(self) -> str:
        return f"b{self.batch}_lr{self.lr:g}"


# ---------------------------------------------------------------------------
# One trial
# ---------------------------------------------------------------------------


def _build_optimizer(name: str, params, lr: float, weight_decay: float):
    import torch

    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)


def _evaluate(task, model, micro_batch: int, max_samples: int) -> float:
    """Loss per unit over the first ``max_samples`` validation samples (no grad, eval mode)."""
    import torch

    total = torch.zeros((), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    seen = 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch in task.val_batches(micro_batch):
            loss_sum, n = task.loss_sum(model, batch)
            total += loss_sum.double()
            count += n.double() if hasattr(n, "double") else float(n)
            first = next(iter(batch.values()))
            seen += int(first.shape[0])
            if seen >= max_samples:
                break
    model.train(was_training)
    return float(total / count.clamp(min=1.0))


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie — killed, not yet reaped — counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            return "\nState:\tZ" not in f.read()
    except OSError:  # no procfs (macOS): trust kill(0)
        return True


def _remove_stale_tmp(trial_dir: Path, *, also_own: bool = False) -> None:
    """Delete ``metrics.jsonl.tmp-<pid>`` files of killed attempts (writer gone; never a live writer's)."""
    for stale in trial_dir.glob("metrics.jsonl.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or not _pid_alive(int(pid)) or (also_own and int(pid) == os.getpid()):
            stale.unlink(missing_ok=True)


def _trial_done(trial_dir: Path, spec: TrialSpec) -> bool:
    summary = trial_dir / "summary.json"
    if not summary.is_file() or not (trial_dir / "metrics.jsonl").is_file():
        return False
    try:
        s = json.loads(summary.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return bool(s.get("completed")) and s.get("batch") == spec.batch and s.get("lr") == spec.lr


def run_trial(
    config: dict[str, Any],
    spec: dict[str, Any],
    out_dir: str,
    *,
    threads: Optional[int] = None,
    parent_pid: Optional[int] = None,
) -> dict[str, Any]:
    """Train one (batch, LR) trial to the budget; returns its summary (also in ``summary.json``).

    Plain-dict arguments so that it pickles into spawned processes and Ray workers. When
    ``parent_pid`` is given and that process disappears (the sweep was killed), the trial
    stops at the next step instead of finishing as an orphan.
    """
    import torch

    from globalbatch.schedule import TokenLRSchedule
    from globalbatch.step import StepConfig, StepDriver
    from globalbatch.tasks import load_task

    cfg = SweepConfig.from_dict(config)
    trial = TrialSpec(**spec)
    out = Path(out_dir)
    trial_dir = out / "trials" / trial.name
    trial_dir.mkdir(parents=True, exist_ok=True)
    if threads is not None:
        torch.set_num_threads(max(1, int(threads)))
    _remove_stale_tmp(trial_dir, also_own=True)

    task = load_task(cfg.task, **cfg.task_overrides)
    unit = task.unit
    micro = cfg.micro_batch_for(trial.batch)
    torch.manual_seed(cfg.seed)
    model = task.build_model(cfg.seed)
    model.train()
    opt = _build_optimizer(cfg.optimizer, model.parameters(), trial.lr, cfg.weight_decay)
    warmup = int(cfg.warmup_fraction * cfg.budget)
    lr_schedule = TokenLRSchedule(peak_lr=trial.lr, total=cfg.budget, warmup=warmup, shape=cfg.lr_shape, unit=unit)
    monitor = None
    if cfg.noise:
        from globalbatch.noise import NoiseScaleMonitor

        monitor = NoiseScaleMonitor(model, optimizer=opt, unit=unit)
    driver = StepDriver(
        model, opt, StepConfig(micro_batch=micro, global_batch=trial.batch, max_grad_norm=cfg.max_grad_norm),
        lr_schedule=lr_schedule, callbacks=[monitor] if monitor is not None else (),
    )
    order = task.sample_order(cfg.seed)
    eval_every = cfg.eval_every_units()
    val_micro = max(micro, 16)

    tmp = trial_dir / f"metrics.jsonl.tmp-{os.getpid()}"
    _append_event(out, event="start", trial=trial.name)
    started = time.time()
    header = {
        "kind": "header",
        "trial": trial.name,
        "batch": trial.batch,
        "lr": trial.lr,
        "micro_batch": micro,
        "unit": unit,
        "task": task.name,
        "grid": cfg.manifest()["grid"],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "host": platform.node(),
        "started_at": started,
    }
    train_time = 0.0
    eval_time = 0.0
    rates: list[float] = []
    last_val = math.nan
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        t0 = time.perf_counter()
        last_val = _evaluate(task, model, val_micro, cfg.max_val_samples)
        eval_time += time.perf_counter() - t0
        f.write(json.dumps({"kind": "eval", "step": 0, "consumed": 0, "val_loss": last_val}) + "\n")
        f.flush()
        next_eval = eval_every
        step = 0
        while driver.trained_units < cfg.budget:
            if parent_pid is not None and os.getppid() != parent_pid:
                raise SystemExit(f"sweep process {parent_pid} is gone; trial {trial.name} stops unfinished")
            t0 = time.perf_counter()
            idx = list(itertools.islice(order, trial.batch))
            micros = [task.collate(idx[i:i + micro]) for i in range(0, trial.batch, micro)]
            res = driver.run_window(micros, task.loss_sum, samples_per_micro=[len(idx[i:i + micro]) for i in range(0, trial.batch, micro)])
            dt = time.perf_counter() - t0
            train_time += dt
            step += 1
            rate = res.global_units / dt if dt > 0 else math.nan
            rates.append(rate)
            rec = {
                "kind": "step",
                "step": res.step,
                "window": res.window,
                "consumed": driver.trained_units,
                "consumed_samples": driver.trained_samples,
                "batch": trial.batch,
                "batch_units": res.global_units,
                # The forward pass of this step, i.e. the loss at the parameters after step − 1
                # updates, while "consumed" counts this step's units too (critical.Curve's convention).
                "loss": res.loss_per_unit,
                "grad_norm": res.grad_norm,
                "lr": res.lr,
                "skipped": res.skipped,
                "skipped_total": driver.skipped_windows,
                "units_per_s": rate,
                "train_time_s": train_time,
            }
            if driver.trained_units >= next_eval or driver.trained_units >= cfg.budget:
                t1 = time.perf_counter()
                last_val = _evaluate(task, model, val_micro, cfg.max_val_samples)
                eval_time += time.perf_counter() - t1
                rec["val_loss"] = last_val
                if monitor is not None:
                    est = monitor.estimate()  # host sync: at evaluations only
                    rec["b_simple"] = est.b_simple
                    rec["b_simple_low"], rec["b_simple_high"] = est.low, est.high
                    rec["b_simple_flags"] = list(est.flags)
                while next_eval <= driver.trained_units:
                    next_eval += eval_every
            f.write(json.dumps(rec) + "\n")
            f.flush()
        os.fsync(f.fileno())

    final = trial_dir / "metrics.jsonl"
    os.replace(tmp, final)
    steady = rates[2:] if len(rates) > 4 else rates  # the first steps pay one-off costs
    threads_used = torch.get_num_threads()
    import statistics

    units_per_s = float(statistics.median(steady)) if steady else math.nan
    summary = {
        "completed": True,
        "trial": trial.name,
        "batch": trial.batch,
        "lr": trial.lr,
        "micro_batch": micro,
        "unit": unit,
        "steps": driver.optimizer_steps,
        "windows": driver.windows,
        "skipped_windows": driver.skipped_windows,
        "consumed": driver.trained_units,
        "consumed_samples": driver.trained_samples,
        "mean_batch_units": driver.trained_units / max(driver.optimizer_steps, 1),
        "final_val_loss": last_val,
        "units_per_s": units_per_s,
        "core_s_per_unit": threads_used / units_per_s if units_per_s > 0 else math.nan,
        "threads": threads_used,
        "train_time_s": train_time,
        "eval_time_s": eval_time,
        "wall_time_s": time.time() - started,
        "started_at": started,
        "finished_at": time.time(),
        "pid": os.getpid(),
    }
    atomic_write_json(trial_dir / "summary.json", summary)
    _append_event(out, event="done", trial=trial.name)
    return summary


# ---------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class SweepResult:
    out_dir: str
    summaries: list[dict[str, Any]]
    ran: list[str]
    """Trials run by this call."""
    skipped: list[str]
    """Trials already finished by an earlier call (not rerun)."""
    wall_time_s: float
    workers: int
    threads_per_worker: int
    timing: dict[int, dict] = field(default_factory=dict)
    """Batch (samples) → its sequential timing record (``timing/b<batch>.json``); empty if disabled."""
    timing_s: float = 0.0
    """Seconds spent in the timing pass by this call (0 when it was already recorded)."""


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def _check_manifest(out: Path, config: SweepConfig) -> None:
    path = out / "manifest.json"
    want = json.loads(json.dumps(config.manifest(), default=_json_default))
    if path.is_file():
        have = json.loads(path.read_text())
        if have != want:
            g_have, g_want = have.get("grid", {}), want["grid"]
            diffs = [f"{k}: {g_have.get(k)!r} -> {g_want.get(k)!r}" for k in sorted(set(g_have) | set(g_want)) if g_have.get(k) != g_want.get(k)]
            raise SettingError("out", str(out), "a new directory, or the original grid to resume",
                               why=f"holds a sweep with a different grid: {'; '.join(diffs) or 'version'}")
        return
    atomic_write_json(path, want)


class _Progress:
    """Rich progress bars fed by polling each running trial's temporary JSONL (works for every backend)."""

    def __init__(self, out: Path, pending: Sequence[TrialSpec], budget: int, unit: str, enabled: bool) -> None:
        self.out, self.pending, self.budget, self.enabled = out, list(pending), budget, enabled
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.unit = unit

    def __enter__(self) -> "_Progress":
        if not self.enabled or not self.pending:
            return self
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("{task.description:>16}"), BarColumn(), MofNCompleteColumn(), TextColumn(self.unit + "s"),
            TimeElapsedColumn(), transient=False, console=Console(stderr=True),
        )
        self._ids = {t.name: self._progress.add_task(t.name, total=self.budget) for t in self.pending}
        self._progress.start()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _consumed(self, trial: str) -> Optional[int]:
        d = self.out / "trials" / trial
        if (d / "summary.json").is_file():
            return self.budget
        try:
            tmps = sorted(d.glob("metrics.jsonl.tmp-*"), key=lambda p: p.stat().st_mtime)
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

    def refresh(self) -> None:
        for name, tid in self._ids.items():
            c = self._consumed(name)
            if c is not None:
                self._progress.update(tid, completed=min(c, self.budget))

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.refresh()
            self._progress.stop()


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
    if threads is not None and (isinstance(threads, bool) or threads < 1):
        raise SettingError("threads", threads, "a whole number ≥ 1")
    if address is not None and backend != "ray":
        raise SettingError("address", address, "an address only with backend ray")
    if backend == "ray":
        try:
            import ray  # noqa: F401
            from ray import tune  # noqa: F401
        except ImportError:
            raise SettingError("backend", "ray", f"local, or ray after {RAY_HINT}", why="Ray Tune is not installed") from None
    unit = load_task_checked(config.task, config.task_overrides).unit  # fails here, not in a worker
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise SettingError("out", str(out), "a directory (this is a file)")
    out.mkdir(parents=True, exist_ok=True)
    _check_manifest(out, config)
    trials = config.trials()
    done = [t for t in trials if _trial_done(out / "trials" / t.name, t)]
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
    if pending:
        with _Progress(out, pending, config.budget, unit, progress):
            if backend == "ray":
                _run_ray(cfg_dict, pending, out, n_workers, threads, address)
            elif requested == 1:
                import torch

                old = torch.get_num_threads()
                try:
                    for t in pending:
                        run_trial(cfg_dict, asdict(t), str(out), threads=threads)
                finally:
                    torch.set_num_threads(old)
            else:
                _run_pool(cfg_dict, pending, out, n_workers, threads)
    for t in trials:  # an orphan of a killed earlier run may have left one after this run began
        _remove_stale_tmp(out / "trials" / t.name)
    summaries = [json.loads((out / "trials" / t.name / "summary.json").read_text()) for t in trials]
    timing: dict[int, dict] = {}
    t_timing = time.time()
    if timing_steps > 0:
        # All the sweep's threads in one process, nothing else of the sweep running.
        timing = run_timing_pass(config, out, summaries, threads=min(cores, max(1, requested * threads)),
                                 steps=timing_steps, warmup=timing_warmup)
    return SweepResult(
        out_dir=str(out), summaries=summaries, ran=[t.name for t in pending], skipped=[t.name for t in done],
        wall_time_s=time.time() - t0, workers=n_workers, threads_per_worker=threads, timing=timing,
        timing_s=time.time() - t_timing,
    )


def _timing_path(out: Path, batch: int) -> Path:
    return out / "timing" / f"b{batch}.json"


def run_timing_pass(config: SweepConfig, out_dir: str | os.PathLike, summaries: Sequence[dict], *, threads: int,
                    steps: int = 8, warmup: int = 2) -> dict[int, dict]:
    """Time each batch size alone, sequentially, in this process; resumable (recorded batches are skipped).

    For each batch: the best-LR config of that batch (lowest final validation loss among
    its finished trials), a fresh model, ``warmup`` untimed steps, then ``steps`` timed
    steps on the sweep's data order; units/s = timed units ÷ timed seconds. Written to
    ``timing/b<batch>.json`` atomically.
    """
    import torch

    from globalbatch.step import StepConfig, StepDriver
    from globalbatch.tasks import load_task

    out = Path(out_dir)
    result: dict[int, dict] = {}
    todo = []
    for b in sorted(config.batches):
        path = _timing_path(out, b)
        if path.is_file():
            result[b] = json.loads(path.read_text())
            continue
        mine = [x for x in summaries if int(x["batch"]) == b]
        if not mine:
            continue  # no finished trial at this batch (yet)
        best = min(mine, key=lambda x: (not math.isfinite(float(x.get("final_val_loss", math.nan))),
                                        float(x.get("final_val_loss", math.inf)), float(x["lr"])))
        todo.append((b, float(best["lr"])))
    if not todo:
        return result
    task = load_task(config.task, **config.task_overrides)
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, int(threads)))
    try:
        for b, lr in todo:
            micro = config.micro_batch_for(b)
            torch.manual_seed(config.seed)
            model = task.build_model(config.seed)
            model.train()
            opt = _build_optimizer(config.optimizer, model.parameters(), lr, config.weight_decay)
            driver = StepDriver(model, opt, StepConfig(micro_batch=micro, global_batch=b, max_grad_norm=config.max_grad_norm))
            order = task.sample_order(config.seed)
            units = secs = 0.0
            rates = []
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                idx = list(itertools.islice(order, b))
                micros = [task.collate(idx[j:j + micro]) for j in range(0, b, micro)]
                res = driver.run_window(micros, task.loss_sum, samples_per_micro=[len(idx[j:j + micro]) for j in range(0, b, micro)])
                dt = time.perf_counter() - t0
                if i >= warmup:
                    units += res.global_units
                    secs += dt
                    rates.append(res.global_units / dt if dt > 0 else math.nan)
            rec = {"batch": b, "lr": lr, "threads": torch.get_num_threads(), "warmup_steps": warmup, "steps": steps,
                   "units": units, "seconds": secs, "units_per_s": units / secs if secs > 0 else math.nan,
                   "step_units_per_s": rates, "unit": task.unit, "host": platform.node(), "recorded_at": time.time()}
            atomic_write_json(_timing_path(out, b), rec)
            _append_event(out, event="timed", batch=b)
            result[b] = rec
    finally:
        torch.set_num_threads(old)
    return result


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker as soon as the sweep process is gone (``kill -9`` leaves pool workers orphaned)."""
    while True:
        time.sleep(0.2)
        if os.getppid() != parent_pid:
            os._exit(3)  # a running trial leaves only its metrics.jsonl.tmp-<pid>, removed on resume


def _worker_init(threads: int) -> None:
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="watch-parent").start()
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass


def _run_pool(cfg: dict, pending: Sequence[TrialSpec], out: Path, n_workers: int, threads: int) -> None:
    import multiprocessing as mp
    from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=n_workers, mp_context=ctx, initializer=_worker_init, initargs=(threads,)) as ex:
        futures = {
            ex.submit(run_trial, cfg, asdict(t), str(out), threads=threads, parent_pid=os.getpid()): t for t in pending
        }
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for fut in finished:
            exc = fut.exception()
            if exc is not None:
                for other in futures:
                    other.cancel()
                raise RuntimeError(f"trial {futures[fut].name} failed: {exc}") from exc


def _run_ray(cfg: dict, pending: Sequence[TrialSpec], out: Path, n_workers: int, threads: int, address: Optional[str]) -> None:
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
        summary = run_trial(cfg, params["trial"], out_abs, threads=threads)
        metrics = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        report = getattr(tune, "report", None)
        if report is None:  # older Ray
            from ray import train

            report = train.report
        report(metrics)

    try:
        tuner = tune.Tuner(
            tune.with_resources(trainable, {"cpu": threads}),
            param_space={"trial": tune.grid_search([asdict(t) for t in pending])},
            tune_config=tune.TuneConfig(max_concurrent_trials=n_workers if address is None else None),
            run_config=_ray_run_config(out_abs),
        )
        results = tuner.fit()
        errors = [str(r.error) for r in results if r.error is not None]
        if errors:
            raise RuntimeError(f"{len(errors)} Ray trial(s) failed; first: {errors[0]}")
    finally:
        if started_here:
            ray.shutdown()


def _ray_run_config(out_abs: str):
    try:
        from ray.tune import RunConfig
    except ImportError:  # Ray < 2.40
        from ray.air import RunConfig
    return RunConfig(name="ray", storage_path=os.path.join(out_abs, "ray_results"), verbose=0)


# ---------------------------------------------------------------------------
# Reading a sweep back
# ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class SweepData:
    """A finished (or partly finished) sweep read from disk."""

    out_dir: str
    config: SweepConfig
    unit: str
    trials: dict[str, list[dict]]
    """Trial name → its step/eval records (finished trials only)."""
    summaries: dict[str, dict]
    missing: list[str]
    """Trials of the grid without a finished result."""
    timing: dict[int, dict] = field(default_factory=dict)
    """Batch (samples) → the sequential timing pass's record (``timing/b<batch>.json``), when run."""

    def units_per_s(self, batch: int) -> Optional[float]:
        """Throughput at ``batch`` for the analysis: the timing pass's, else the median in-trial one."""
        t = self.timing.get(int(batch))
        if t is not None and t.get("units_per_s") and math.isfinite(t["units_per_s"]) and t["units_per_s"] > 0:
            return float(t["units_per_s"])
        return self.in_trial_units_per_s(batch)

    def in_trial_units_per_s(self, batch: int) -> Optional[float]:
        """Median over the batch's trials of their in-trial units/s (measured while trials shared the cores)."""
        import statistics

        rates = [float(s["units_per_s"]) for s in self.summaries.values()
                 if int(s["batch"]) == int(batch) and s.get("units_per_s") and math.isfinite(s["units_per_s"]) and s["units_per_s"] > 0]
        return float(statistics.median(rates)) if rates else None

    def _batch_of(self, units: float) -> Optional[int]:
        pairs = list(self.batch_units().items())
        return min(pairs, key=lambda kv: abs(kv[1] - units))[0] if pairs else None

    def throughput_source(self, units: float) -> str:
        """Where the analysis' throughput of the batch with ``units`` per step comes from."""
        b = self._batch_of(units)
        t = self.timing.get(int(b)) if b is not None else None
        if t is not None and t.get("units_per_s") and math.isfinite(t["units_per_s"]) and t["units_per_s"] > 0:
            return "timed pass"
        return "in-trial, median over its LRs"

    def throughput_warnings(self, max_ratio: float = 1.5) -> list[str]:
        """One line per batch whose in-trial units/s differs by more than ``max_ratio``× across its LRs.

        Throughput does not depend on the LR, so such a spread is machine load (trials
        competing for the cores, or something else running): the in-trial numbers are
        unreliable, and the timing pass — when recorded — is what the analysis uses.
        """
        out = []
        for b in sorted(self.batch_units()):
            rates = {float(s["lr"]): float(s["units_per_s"]) for s in self.summaries.values()
                     if int(s["batch"]) == b and s.get("units_per_s") and math.isfinite(s["units_per_s"])
                     and s["units_per_s"] > 0}
            if len(rates) < 2:
                continue
            lo, hi = min(rates.values()), max(rates.values())
            if hi > max_ratio * lo:
                spread = ", ".join(f"lr {lr:g}: {r:,.0f}" for lr, r in sorted(rates.items()))
                used = "the timed pass is used" if b in self.timing else "time to target uses their median"
                out.append(f"batch {b}: in-trial {self.unit}s/s vary {hi / lo:.1f}× across its LRs ({spread}) — "
                           f"machine load, not the LR; {used}")
        return out

    def batch_units(self) -> dict[int, float]:
        """Mean loss-bearing units per step at each batch (samples), over its trials."""
        out: dict[int, list[float]] = {}
        for s in self.summaries.values():
            out.setdefault(int(s["batch"]), []).append(float(s["mean_batch_units"]))
        return {b: sum(v) / len(v) for b, v in sorted(out.items())}

    def label(self, units: float) -> str:
        """``"batch 64 (≈2,030 tokens)"`` for a token task, ``"batch 64"`` for a sample task."""
        pairs = list(self.batch_units().items())
        b = min(pairs, key=lambda kv: abs(kv[1] - units))[0] if pairs else None
        if b is None:
            return f"batch {units:,.0f}"
        return f"batch {b} (≈{units:,.0f} tokens)" if self.unit == "token" else f"batch {b}"


def load_sweep(out_dir: str | os.PathLike) -> SweepData:
    """Read ``manifest.json`` and every finished trial; unfinished ones are listed in ``missing``."""
    out = Path(out_dir)
    manifest = out / "manifest.json"
    allowed = "a sweep directory (written by globalbatch sweep)"
    if not manifest.is_file():
        raise SettingError("run_dir", str(out), allowed, why="no manifest.json")
    try:
        doc = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SettingError("run_dir", str(out), allowed, why=f"manifest.json is unreadable: {exc}") from None
    if isinstance(doc, dict) and "grid" not in doc and "branch" in doc:
        raise SettingError("run_dir", str(out), allowed, why="it is a branch test, not a sweep")
    if not isinstance(doc, dict) or not isinstance(doc.get("grid"), dict):
        raise SettingError("run_dir", str(out), allowed, why="manifest.json has no sweep grid")
    try:
        config = SweepConfig.from_dict(doc["grid"])
    except (TypeError, ValueError) as exc:
        raise SettingError("run_dir", str(out), allowed, why=f"manifest.json holds an invalid grid: {exc}") from None
    trials: dict[str, list[dict]] = {}
    summaries: dict[str, dict] = {}
    missing = []
    unit = None
    for t in config.trials():
        d = out / "trials" / t.name
        if not _trial_done(d, t):
            missing.append(t.name)
            continue
        summaries[t.name] = json.loads((d / "summary.json").read_text())
        trials[t.name] = read_jsonl(d / "metrics.jsonl")
        unit = summaries[t.name]["unit"]
    timing = {}
    for b in config.batches:
        path = _timing_path(out, b)
        if path.is_file():
            timing[b] = json.loads(path.read_text())
    return SweepData(out_dir=str(out), config=config, unit=unit or "unit", trials=trials, summaries=summaries, missing=missing,
                     timing=timing)


def curves_from_sweep(data: SweepData):
    """One :class:`globalbatch.critical.Curve` per finished trial; batch in units per step."""
    import numpy as np

    from globalbatch.critical import Curve

    units = data.batch_units()
    curves = []
    for name, recs in data.trials.items():
        s = data.summaries[name]
        steps = [r for r in recs if r.get("kind") == "step" and not r.get("skipped")]
        if not steps:
            continue
        tput = data.units_per_s(int(s["batch"]))  # the sequential timing pass when recorded
        curves.append(
            Curve(
                batch_size=units[int(s["batch"])],
                lr=float(s["lr"]),
                examples=np.array([r["consumed"] for r in steps], dtype=float),
                loss=np.array([r["loss"] for r in steps], dtype=float),
                examples_per_s=tput if tput and math.isfinite(tput) and tput > 0 else None,
                label=name,
            )
        )
    return curves


def analyze_sweep(
    out_dir: str | os.PathLike,
    *,
    targets: Optional[Sequence[float]] = None,
    n_targets: int = 4,
    n_tighter: int = 2,
    ema_fraction: float = 0.05,
    halflife_steps: Optional[float] = None,
    objective: str = "time",
    tolerance: float = 0.05,
):
    """Load a sweep and run :func:`globalbatch.critical.analyze` on it; returns ``(data, analysis)``."""
    from globalbatch.critical import analyze, check_analysis_settings

    check_analysis_settings(objective=objective, tolerance=tolerance, ema_fraction=ema_fraction,
                            halflife_steps=halflife_steps)
    data = load_sweep(out_dir)
    curves = curves_from_sweep(data)
    if not curves:
        raise SettingError("run_dir", data.out_dir, "a sweep with at least one finished trial",
                           why=f"no finished trial yet, {len(data.missing)} pending")
    analysis = analyze(
        curves, targets=targets, n_targets=n_targets, n_tighter=n_tighter, ema_fraction=ema_fraction, halflife_steps=halflife_steps,
        objective=objective, tolerance=tolerance, unit=data.unit, label=data.label,
        throughput_source=data.throughput_source, warnings=data.throughput_warnings(),
    )
    return data, analysis


def demo_config() -> SweepConfig:
    """The ``globalbatch demo`` sweep: a 2-layer, width-64 tinygpt, 5 batches × 3 LRs, 300K tokens each.

    Sized for ≤ 5 minutes on 2 CPU cores (docs/sweep.md has the measured time).
    """
    return SweepConfig(
        task="tinygpt",
        task_overrides={"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 64, "max_corpus_bytes": 2_000_000},
        batches=[4, 8, 16, 32, 64],
        lrs=[1e-3, 3e-3, 1e-2],
        budget=300_000,
        max_val_samples=128,
    )
