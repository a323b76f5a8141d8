"""The sequential timing pass: each batch size trained alone, on all the sweep's threads.

Trials run side by side and compete for the cores, so their in-trial units/s depends on
what else ran at the same time. After the trials, this pass trains each batch size alone —
the best-LR config of that batch, ``warmup`` untimed steps, then ``steps`` timed ones — and
writes ``timing/b<batch>.json`` atomically (skipped on a rerun when present). The analysis
uses it for throughput, time and cost to target.
"""

from __future__ import annotations

import math
import os
import platform
import time
from pathlib import Path
from typing import Sequence

from globalbatch._util import atomic_write_json, read_json_checked
from globalbatch.lab.rundir import append_event
from globalbatch.lab.sweep.config import SweepConfig

__all__ = ["run_timing_pass", "timing_path"]


def timing_path(out: Path, batch: int) -> Path:
    return Path(out) / "timing" / f"b{batch}.json"


def run_timing_pass(config: SweepConfig, out_dir: str | os.PathLike, summaries: Sequence[dict], *, threads: int,
                    steps: int = 8, warmup: int = 2) -> dict[int, dict]:
    """Time each batch size alone, sequentially, in this process; resumable (recorded batches are skipped).

    For each batch: the best-LR config of that batch (lowest final validation loss among
    its finished trials), a fresh model on the sweep's device and precision, ``warmup``
    untimed steps, then ``steps`` timed steps on the sweep's data order; units/s = timed
    units ÷ timed seconds (each step ends in the driver's host sync, so GPU time is inside).
    Units are loss-bearing, so for a token task units/s is the valid (non-padding) tokens/s. The
    model FLOPs of the timed windows (counted at set-up, :mod:`globalbatch.lab.throughput`) over the
    timed seconds and the device peak (a matmul measured on the same threads) give ``mfu``.
    """
    import torch

    from globalbatch.lab.loop import Experiment
    from globalbatch.lab.tasks import load_task

    out = Path(out_dir)
    result: dict[int, dict] = {}
    todo = []
    for b in config.all_batches():  # batch-edge extensions too, once they have trials
        path = timing_path(out, b)
        if path.is_file():
            result[b] = read_json_checked(path)
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
            exp = Experiment(task, batch=b, micro_batch=config.micro_batch_for(b), optimizer=config.optimizer, lr=lr,
                             weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm, seed=config.seed_list()[0],
                             device=config.device, precision=config.precision, measure_flops=True)
            order = task.sample_order(config.seed_list()[0])
            units = secs = 0.0
            flops: float | None = 0.0
            rates = []
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                res = exp.train_window(order).result
                dt = time.perf_counter() - t0
                if i >= warmup:
                    units += res.global_units
                    secs += dt
                    flops = None if flops is None or res.model_flops is None else flops + res.model_flops
                    rates.append(res.global_units / dt if dt > 0 else math.nan)
            rec = {"batch": b, "lr": lr, "threads": torch.get_num_threads(), "warmup_steps": warmup, "steps": steps,
                   "units": units, "seconds": secs, "units_per_s": units / secs if secs > 0 else math.nan,
                   "step_units_per_s": rates, "unit": task.unit, "device": str(exp.device),
                   "precision": config.precision, "host": platform.node(), "recorded_at": time.time()}
            peak = exp.peak.flops_per_s if exp.peak is not None else None
            flops_per_s = flops / secs if flops is not None and secs > 0 else None
            rec.update({"valid_tokens_per_s": rec["units_per_s"] if task.unit == "token" else None,
                        "model_flops_per_s": flops_per_s, "peak_flops_per_s": peak,
                        "peak_flops_source": exp.peak.source if exp.peak is not None else None,
                        "mfu": flops_per_s / peak if flops_per_s is not None and peak else None})
            atomic_write_json(timing_path(out, b), rec)
            append_event(out, event="timed", batch=b)
            result[b] = rec
    finally:
        torch.set_num_threads(old)
    return result
