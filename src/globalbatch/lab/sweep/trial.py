"""One sweep trial: train one (batch, LR) cell to the token budget through the lab's loop, crash-safely.

A trial appends to ``metrics.jsonl.tmp-<pid>``; at the end it ``os.replace``-s it to
``metrics.jsonl`` and then writes ``summary.json`` atomically — the done marker.

A trial may pause at a rung (``pause_at``, one of the grid's held-out evaluation positions: successive halving,
:mod:`globalbatch.lab.sweep.halving`): it saves a checkpoint of everything the run holds
(:func:`globalbatch.checkpoint.save_checkpoint`: model, optimizer, driver, noise monitor, RNG) with the samples it
drew and its loop state, its records so far, and last ``paused.json`` (the pause marker, naming both files). A
later call resumes from that checkpoint and continues the same records; the result equals an uninterrupted trial's
(``tests/test_sweep_halving.py``). A trial killed while running from a pause resumes from the same pause.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Optional

from globalbatch._util import atomic_write_json
from globalbatch.errors import SettingError
from globalbatch.lab.records import TrialSummary
from globalbatch.lab.rundir import append_event, remove_stale_tmp
from globalbatch.lab.sweep.config import SweepConfig, TrialSpec

__all__ = ["run_trial", "trial_done", "trial_paused", "PAUSE_MARKER"]

PAUSE_MARKER = "paused.json"
"""A paused trial's marker: where it stopped (``consumed`` units, ``val_loss`` there) and its checkpoint and records."""


def exit_if_orphaned(parent_pid: Optional[int]) -> None:
    """End this process at once if the sweep process ``parent_pid`` is gone.

    ``os._exit``, not ``SystemExit``: a pool worker catches ``SystemExit`` from its task,
    reports it and takes the next trial — an orphan must start and write nothing more.
    """
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(3)


def trial_done(trial_dir: Path, spec: TrialSpec) -> bool:
    """True when ``trial_dir`` holds a finished result of ``spec`` (``summary.json`` is the done marker)."""
    summary = trial_dir / "summary.json"
    if not summary.is_file() or not (trial_dir / "metrics.jsonl").is_file():
        return False
    try:
        s = json.loads(summary.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return (isinstance(s, dict) and bool(s.get("completed")) and s.get("batch") == spec.batch and s.get("lr") == spec.lr
            and s.get("seed", 0) == spec.seed)


def trial_paused(trial_dir: Path, spec: TrialSpec) -> Optional[dict[str, Any]]:
    """The pause marker of ``spec`` in ``trial_dir`` (``consumed``, ``val_loss``, ``checkpoint``, ``records``) when it
    is paused there and both files exist; None otherwise (not started, running, finished or damaged)."""
    try:
        m = json.loads((trial_dir / PAUSE_MARKER).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not (isinstance(m, dict) and m.get("batch") == spec.batch and m.get("lr") == spec.lr
            and m.get("seed", 0) == spec.seed and isinstance(m.get("consumed"), int)):
        return None
    if not all(isinstance(m.get(k), str) and (trial_dir / m[k]).is_file() for k in ("checkpoint", "records")):
        return None
    return m


def _drop_pauses(trial_dir: Path, keep: tuple[str, ...] = ()) -> None:
    """Remove pause files other than ``keep`` (older rungs' checkpoints and records)."""
    for old in list(trial_dir.glob("paused-*.pt")) + list(trial_dir.glob("paused-*.jsonl")):
        if old.name not in keep:
            old.unlink(missing_ok=True)


def run_trial(
    config: dict[str, Any],
    spec: dict[str, Any],
    out_dir: str,
    *,
    threads: Optional[int] = None,
    parent_pid: Optional[int] = None,
    device: Any = None,
    pause_at: Optional[int] = None,
) -> dict[str, Any]:
    """Train one (batch, LR) trial to the budget; returns its summary (also in ``summary.json``).

    Plain-dict arguments so that it pickles into spawned processes and Ray workers. When
    ``parent_pid`` is given and that process disappears (the sweep was killed), the trial
    stops at the next step instead of finishing as an orphan. ``device`` overrides the
    grid's device (a pool worker's own GPU).

    ``pause_at``: stop after the first step at or past this many units (one of
    :meth:`SweepConfig.eval_positions`, so the held-out loss is read there), save a checkpoint and return the
    pause marker (``paused`` true, ``consumed``, ``val_loss``); a trial already paused at or past it returns its
    marker without training. Without ``pause_at`` a paused trial resumes from its checkpoint to the budget.
    """
    import torch

    from globalbatch.checkpoint import load_checkpoint, save_checkpoint

    from globalbatch.lab.loop import Experiment
    from globalbatch.lab.tasks import load_task
    from globalbatch.schedule import LRSchedule

    cfg = SweepConfig.from_dict(config)
    trial = TrialSpec(**spec)
    out = Path(out_dir)
    trial_dir = out / "trials" / trial.name
    exit_if_orphaned(parent_pid)  # a worker whose sweep died starts no trial
    trial_dir.mkdir(parents=True, exist_ok=True)
    positions = cfg.eval_positions()
    stop_at = cfg.budget if pause_at is None else min(int(pause_at), cfg.budget)
    if stop_at < cfg.budget and stop_at not in positions:
        raise SettingError("pause_at", pause_at, "one of the grid's evaluation positions (SweepConfig.eval_positions())")
    paused = trial_paused(trial_dir, trial)
    if paused is not None and paused["consumed"] >= stop_at:
        return paused
    if threads is not None:
        torch.set_num_threads(max(1, int(threads)))
    remove_stale_tmp(trial_dir, also_own=True)

    task = load_task(cfg.task, **cfg.task_overrides)
    unit = task.unit
    micro = cfg.micro_batch_for(trial.batch)
    warmup = cfg.warmup_units(trial.batch * ((task.seq_len or 1) if unit == "token" else 1))
    lr_schedule = LRSchedule(peak_lr=trial.lr, total=cfg.budget, warmup=warmup, shape=cfg.lr_shape)  # the task's unit

    def noise_monitor(model, opt):
        if not cfg.noise:
            return []
        from globalbatch.noise import NoiseScaleMonitor

        return [NoiseScaleMonitor(model, optimizer=opt, unit=unit)]

    exp = Experiment(task, batch=trial.batch, micro_batch=micro, optimizer=cfg.optimizer, lr=trial.lr,
                     weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm, seed=trial.seed,
                     lr_schedule=lr_schedule, callbacks=noise_monitor,
                     device=device if device is not None else cfg.device, precision=cfg.precision)
    driver = exp.driver
    monitor = driver.callbacks[0] if cfg.noise else None
    order = task.sample_order(trial.seed)
    state: dict[str, Any] = {"samples_drawn": 0, "next_eval": 0, "train_time": 0.0, "eval_time": 0.0, "rates": [],
                             "started": time.time()}
    if paused is not None:  # resume exactly where the pause left it (model, optimizer, driver, RNG, data order)
        state = dict(load_checkpoint(trial_dir / paused["checkpoint"], driver, map_location=exp.device) or {})
        for _ in range(int(state["samples_drawn"])):
            next(order)

    tmp = trial_dir / f"metrics.jsonl.tmp-{os.getpid()}"
    append_event(out, event="resume" if paused is not None else "start", trial=trial.name)
    started = float(state["started"])
    header = {
        "kind": "header",
        "trial": trial.name,
        "batch": trial.batch,
        "lr": trial.lr,
        "seed": trial.seed,
        "micro_batch": micro,
        "unit": unit,
        "task": task.name,
        "warmup_units": warmup,
        "grid": cfg.manifest()["grid"],
        "device": str(exp.device),
        "precision": cfg.precision,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "host": platform.node(),
        "started_at": started,
    }
    train_time, eval_time = float(state["train_time"]), float(state["eval_time"])
    rates: list[float] = [float(x) for x in state["rates"]]
    drawn = int(state["samples_drawn"])
    with open(tmp, "w", encoding="utf-8") as f:
        if paused is not None:  # the records up to the pause, then this run's
            f.write((trial_dir / paused["records"]).read_text(encoding="utf-8"))
            last_val = float(paused["val_loss"])
        else:
            f.write(json.dumps(header) + "\n")
            t0 = time.perf_counter()
            last_val = exp.evaluate(cfg.max_val_samples, cfg.eval_batch)
            eval_time += time.perf_counter() - t0
            f.write(json.dumps({"kind": "eval", "step": 0, "consumed": 0, "val_loss": last_val}) + "\n")
        f.flush()
        next_eval = int(state["next_eval"])  # index into positions
        while driver.trained_units < stop_at:
            exit_if_orphaned(parent_pid)
            t0 = time.perf_counter()
            window = exp.train_window(order)
            res = window.result
            drawn += len(window.drawn)
            dt = time.perf_counter() - t0
            train_time += dt
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
            if (next_eval < len(positions) and driver.trained_units >= positions[next_eval]) \
                    or driver.trained_units >= cfg.budget:
                t1 = time.perf_counter()
                last_val = exp.evaluate(cfg.max_val_samples, cfg.eval_batch)
                eval_time += time.perf_counter() - t1
                rec["val_loss"] = last_val
                if monitor is not None:
                    est = monitor.estimate()  # host sync: at evaluations only
                    rec["b_simple"] = est.b_simple
                    rec["b_simple_low"], rec["b_simple_high"] = est.low, est.high
                    rec["b_simple_flags"] = list(est.flags)
                while next_eval < len(positions) and positions[next_eval] <= driver.trained_units:
                    next_eval += 1
            f.write(json.dumps(rec) + "\n")
            f.flush()
        os.fsync(f.fileno())

    exit_if_orphaned(parent_pid)  # an orphan publishes nothing (its tmp file is removed on resume)
    if driver.trained_units < cfg.budget:  # paused at a rung: checkpoint, records, then the marker (last, atomic)
        at = driver.trained_units
        ckpt, records = f"paused-{at}.pt", f"paused-{at}.jsonl"
        save_checkpoint(trial_dir / ckpt, driver, extra={
            "samples_drawn": drawn, "next_eval": next_eval, "train_time": train_time, "eval_time": eval_time,
            "rates": rates, "started": started})
        os.replace(tmp, trial_dir / records)
        marker = {"paused": True, "trial": trial.name, "batch": trial.batch, "lr": trial.lr, "seed": trial.seed,
                  "consumed": at, "consumed_samples": driver.trained_samples, "steps": driver.optimizer_steps,
                  "val_loss": last_val, "checkpoint": ckpt, "records": records, "paused_at": time.time()}
        exit_if_orphaned(parent_pid)
        atomic_write_json(trial_dir / PAUSE_MARKER, marker)
        _drop_pauses(trial_dir, keep=(ckpt, records))
        append_event(out, event="paused", trial=trial.name, consumed=at)
        return marker
    os.replace(tmp, trial_dir / "metrics.jsonl")
    steady = rates[2:] if len(rates) > 4 else rates  # the first steps pay one-off costs
    threads_used = torch.get_num_threads()
    units_per_s = float(statistics.median(steady)) if steady else math.nan
    summary = TrialSummary(
        completed=True,
        trial=trial.name,
        batch=trial.batch,
        lr=trial.lr,
        seed=trial.seed,
        micro_batch=micro,
        unit=unit,
        device=str(exp.device),
        precision=cfg.precision,
        steps=driver.optimizer_steps,
        windows=driver.windows,
        skipped_windows=driver.skipped_windows,
        consumed=driver.trained_units,
        consumed_samples=driver.trained_samples,
        mean_batch_units=driver.trained_units / max(driver.optimizer_steps, 1),
        final_val_loss=last_val,
        units_per_s=units_per_s,
        core_s_per_unit=threads_used / units_per_s if units_per_s > 0 else math.nan,
        threads=threads_used,
        train_time_s=train_time,
        eval_time_s=eval_time,
        wall_time_s=time.time() - started,
        started_at=started,
        finished_at=time.time(),
        pid=os.getpid(),
    ).to_json()
    exit_if_orphaned(parent_pid)
    atomic_write_json(trial_dir / "summary.json", summary)
    (trial_dir / PAUSE_MARKER).unlink(missing_ok=True)  # finished: the pause files are spent
    _drop_pauses(trial_dir)
    append_event(out, event="done", trial=trial.name)
    return summary
