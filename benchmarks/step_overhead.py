"""Step time of the StepDriver against a hand-written exact accumulation loop, same run.

Both loops do the same math on the tinygpt task: backward on each micro-batch's summed
loss, multiply the accumulated gradients by 1/count, clip once, step AdamW. The driver
adds its bookkeeping: the count/loss accumulators, the finiteness check, the single
host read per step, the LR-schedule update and counters.

Three identical model copies see identical pre-collated windows: the driver, the hand
loop, and a second hand loop as an A/A control (its ratio to the first shows the noise
floor of the measurement). Within every window the three run in a seeded random order,
so load drifts and cache effects hit all of them. Reported: median step times, the
median of the per-window ratios with a bootstrap 95 % interval, for wall-clock and for
process CPU time (less hurt by other processes on a shared machine).

    python benchmarks/step_overhead.py                 # ~1-2 min on 2 CPU cores
    python benchmarks/step_overhead.py --pairs 200 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import itertools
import random
import statistics
import time

import torch

from globalbatch.schedule import TokenLRSchedule
from globalbatch.step import StepConfig, StepDriver
from globalbatch.lab.tasks import load_task


def hand_written_step(model, optimizer, params, micro_batches, loss_sum_fn, max_grad_norm) -> None:
    """The baseline: exact token-mean accumulation written out by hand (no skip, no sync)."""
    for p in params:
        p.grad = None
    count_total = None
    for batch in micro_batches:
        loss, count = loss_sum_fn(model, batch)
        loss.backward()
        count_total = count if count_total is None else count_total + count
    grads = [p.grad for p in params if p.grad is not None]
    torch._foreach_mul_(grads, 1.0 / count_total.to(torch.float64))
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=True)
    optimizer.step()


def paired_ratio(a: list[float], b: list[float], rng: random.Random, reps: int = 2000) -> tuple[float, float, float]:
    """Median of a_i / b_i with a bootstrap 95 % interval."""
    ratios = [x / y for x, y in zip(a, b)]
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(reps))
    return statistics.median(ratios), boot[int(0.025 * reps)], boot[int(0.975 * reps)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=40, help="timed windows (each runs driver, hand, hand-control)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed windows first")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=4, help="default: the built-in tinygpt (4 layers, width 128, context 128)")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (each timed window ends in a device sync)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if args.threads:
        torch.set_num_threads(args.threads)

    task = load_task("tinygpt", n_layer=args.n_layer, d_model=args.d_model, seq_len=args.seq_len,
                     max_corpus_bytes=1_000_000)
    base = task.build_model(0).to(device)
    models = {k: copy.deepcopy(base) for k in ("driver", "hand", "control")}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for k, m in models.items()}
    clip = 1.0
    driver = StepDriver(models["driver"], opts["driver"],
                        StepConfig(micro_batch=args.micro_batch, global_batch=args.global_batch, max_grad_norm=clip,
                                   lr_schedule=TokenLRSchedule(peak_lr=1e-3, total=10**9, shape="constant")))
    params = {k: [p for p in m.parameters() if p.requires_grad] for k, m in models.items()}

    order = task.sample_order(0)
    windows = []
    for _ in range(args.pairs + args.warmup):  # collate up front: time the step mechanism, not the data
        idx = list(itertools.islice(order, args.global_batch))
        windows.append([task.collate(idx[i:i + args.micro_batch], device) for i in range(0, len(idx), args.micro_batch)])

    runners = {
        "driver": lambda w: driver.run_window(w, task.loss_sum),
        "hand": lambda w: hand_written_step(models["hand"], opts["hand"], params["hand"], w, task.loss_sum, clip),
        "control": lambda w: hand_written_step(models["control"], opts["control"], params["control"], w,
                                               task.loss_sum, clip),
    }
    wall = {k: [] for k in runners}
    cpu = {k: [] for k in runners}
    rng = random.Random(args.seed)
    for i, w in enumerate(windows):
        keys = list(runners)
        rng.shuffle(keys)
        for k in keys:
            w0, c0 = time.perf_counter(), time.process_time()
            runners[k](w)
            sync()  # host sync: outside the step, so both loops are timed to completion
            if i >= args.warmup:
                wall[k].append(time.perf_counter() - w0)
                cpu[k].append(time.process_time() - c0)

    with torch.no_grad():  # same data, same math: the three models must agree
        max_diff = max(float((p - q).abs().max()) for p, q in zip(models["driver"].parameters(),
                                                                   models["hand"].parameters()))
    print(f"tinygpt n_layer {args.n_layer} d_model {args.d_model} seq_len {args.seq_len}; global {args.global_batch} "
          f"= {args.global_batch // args.micro_batch} accum × {args.micro_batch} seq; {args.pairs} timed windows; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}")
    for k in runners:
        print(f"{k:8s} median {statistics.median(wall[k]) * 1e3:8.2f} ms/step wall, "
              f"{statistics.median(cpu[k]) * 1e3:8.2f} ms/step CPU")
    boot = random.Random(args.seed + 1)
    for label, times in (("wall", wall), ("CPU", cpu)):
        r, lo, hi = paired_ratio(times["driver"], times["hand"], boot)
        c, clo, chi = paired_ratio(times["control"], times["hand"], boot)
        print(f"ratio driver/hand ({label}): {r:.3f} [95% CI {lo:.3f}–{hi:.3f}]   "
              f"A/A control hand2/hand: {c:.3f} [{clo:.3f}–{chi:.3f}]   target <= 1.02")
    print(f"max |param difference| driver vs hand after {len(windows)} steps: {max_diff:.2e}")


if __name__ == "__main__":
    main()
