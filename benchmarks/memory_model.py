"""Memory model vs probe: the predicted largest micro-batch of tinygpt at 3 model sizes against the probe's.

For each size: (1) the memory model (globalbatch.plan.memory) predicts the largest micro-batch under
--memory-limit from the parameter count (AdamW, fp32: 16 bytes/param) and activations measured from
two forward+backward peaks (micro-batch 8 and 16); (2) the probe (real AdamW steps) measures it.
Prints a markdown table: predicted, measured, error, and the formula's static bytes against the
intercept of the probe's fitted line.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory_model.py
"""

from __future__ import annotations

import argparse
import time

import torch

from globalbatch.plan.memory import MemoryConfig, breakdown, largest_micro_batch
from globalbatch.plan import parse_bytes
from globalbatch.lab.probe_run import probe_task
from globalbatch.probe.activations import task_memory_inputs
from globalbatch.lab.tasks import load_task

SIZES = [  # (task overrides, memory limit)
    ({"n_layer": 2, "d_model": 64, "n_head": 4}, "128MiB"),
    ({"n_layer": 4, "d_model": 128, "n_head": 4}, "512MiB"),
    ({"n_layer": 4, "d_model": 384, "n_head": 6}, "512MiB"),
]


def _probe_with(task, limit: int, optimizer: str, steps_per_trial: int):
    """probe_task's batches and loss, with another optimizer (plain SGD, or SGD with momentum 0.9)."""
    from itertools import islice

    from globalbatch.probe import probe

    model = task.build_model(0)
    pool = list(islice(task.sample_order(0), 8192))
    momentum = 0.9 if optimizer == "sgd-momentum" else 0.0  # sgd-plain: no momentum buffer

    def make_batch(n):
        return task.collate([pool[i % len(pool)] for i in range(n)], "cpu")

    def loss_fn(m, batch):
        loss_sum, count = task.loss_sum(m, batch)
        return loss_sum / count.clamp(min=1)

    return probe(model, make_batch, loss_fn, memory_limit_bytes=limit, steps_per_trial=steps_per_trial,
                 optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=momentum))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps-per-trial", type=int, default=1)
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd-plain", "sgd-momentum"],
                    help="the probe's optimizer and the model's state term (the probe_task default is AdamW)")
    ap.add_argument("--sizes", default="0,1,2", help="which of the 3 sizes to run, e.g. 2")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for overrides, limit_text in [SIZES[int(i)] for i in args.sizes.split(",")]:
        limit = parse_bytes(limit_text)
        task = load_task("tinygpt", **overrides)
        t0 = time.perf_counter()
        params, shapes, acts = task_memory_inputs(task, device="cpu")
        cfg = MemoryConfig(params=params, optimizer=args.optimizer, precision="fp32", param_shapes=shapes)
        predicted = largest_micro_batch(cfg, acts, limit)
        static = breakdown(cfg, acts, 0)
        t1 = time.perf_counter()
        if args.optimizer == "adamw":
            result = probe_task(task, memory_limit_bytes=limit, device="cpu", steps_per_trial=args.steps_per_trial)
        else:
            result = _probe_with(task, limit, args.optimizer, args.steps_per_trial)
        t2 = time.perf_counter()
        measured = result.largest_fit
        line = result.memory_model
        rows.append((overrides, limit_text, params, acts.bytes_per_sample, static.static_bytes,
                     line.intercept_bytes if line else float("nan"),
                     line.bytes_per_sample if line else float("nan"), predicted, measured,
                     (predicted - measured) / measured, result.num_trials, t1 - t0, t2 - t1))
        print(rows[-1], flush=True)
    mib = 2 ** 20
    print("\n| tinygpt | limit | params | act/sample (fwd+bwd, 8→16) | probe slope | formula static + workspace | "
          "probe intercept | predicted | measured | error | probe trials |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for o, lim, n, aps, st, icpt, slope, pred, meas, err, trials, tp, tr in rows:
        name = f"{o['n_layer']}×{o['d_model']}"
        print(f"| {name} | {lim} | {n:,} | {aps / mib:.3f} MiB | {slope / mib:.3f} MiB | {st / mib:.2f} MiB | "
              f"{icpt / mib:.2f} MiB | {pred} | {meas} | {err:+.1%} | {trials} |")


if __name__ == "__main__":
    main()
