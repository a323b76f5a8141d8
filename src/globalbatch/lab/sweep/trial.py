"""One sweep trial: train one (batch, LR) cell to the token budget through the lab's loop, crash-safely.

A trial appends to ``metrics.jsonl.tmp-<pid>``; at the end it ``os.replace``-s it to
``metrics.jsonl`` and then writes ``summary.json`` atomically — the done marker.
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
from globalbatch.lab.records import TrialSummary
from globalbatch.lab.rundir import append_event, remove_stale_tmp
from globalbatch.lab.sweep.config import SweepConfig, TrialSpec

__all__ = ["run_trial", "trial_done"]


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


def run_trial(
    config: dict[str, Any],
    spec: dict[str, Any],
    out_dir: str,
    *,
    threads: Optional[int] = None,
    parent_pid: Optional[int] = None,
    device: Any = None,
) -> dict[str, Any]:
    """Train one (batch, LR) trial to the budget; returns its summary (also in ``summary.json``).

    Plain-dict arguments so that it pickles into spawned processes and Ray workers. When
    ``parent_pid`` is given and that process disappears (the sweep was killed), the trial
    stops at the next step instead of finishing as an orphan. ``device`` overrides the
    grid's device (a pool worker's own GPU).
    """
    import torch

    from globalbatch.lab.loop import Experiment
    from globalbatch.lab.tasks import load_task
    from globalbatch.schedule import LRSchedule

    cfg = SweepConfig.from_dict(config)
    trial = TrialSpec(**spec)
    out = Path(out_dir)
    trial_dir = out / "trials" / trial.name
    exit_if_orphaned(parent_pid)  # a worker whose sweep died starts no trial
    trial_dir.mkdir(parents=True, exist_ok=True)
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
    positions = cfg.eval_positions()

    tmp = trial_dir / f"metrics.jsonl.tmp-{os.getpid()}"
    append_event(out, event="start", trial=trial.name)
    started = time.time()
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
    train_time = 0.0
    eval_time = 0.0
    rates: list[float] = []
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        t0 = time.perf_counter()
        last_val = exp.evaluate(cfg.max_val_samples, cfg.eval_batch)
        eval_time += time.perf_counter() - t0
        f.write(json.dumps({"kind": "eval", "step": 0, "consumed": 0, "val_loss": last_val}) + "\n")
        f.flush()
        next_eval = 0  # index into positions
        while driver.trained_units < cfg.budget:
            exit_if_orphaned(parent_pid)
            t0 = time.perf_counter()
            res = exp.train_window(order).result
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
    append_event(out, event="done", trial=trial.name)
    return summary
