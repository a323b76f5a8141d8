"""Step time of the StepDriver against a hand-written exact accumulation loop, same run.

Both loops do the same math on the tinygpt task: backward on each micro-batch's summed
loss, divide the accumulated gradients by the window's token count, clip once, step
AdamW. The driver adds its bookkeeping: the count/flag vector, the finiteness check, the
single host read per step, LR-schedule updates and counters. Two identical model copies
see identical pre-collated windows; the two loops alternate (ABAB…, order swapped every
pair) so machine load drifts hit both. Prints the median step times and their ratio.

    python benchmarks/step_overhead.py            # ~1 min on 2 CPU cores
    python benchmarks/step_overhead.py --pairs 60 --micro-batch 8
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import time

import torch

from globalbatch.schedule import TokenLRSchedule
from globalbatch.step import StepConfig, StepDriver
from globalbatch.tasks import load_task


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=40, help="timed (driver, hand) step pairs")
    ap.add_argument("--warmup", type=int, default=4, help="untimed pairs first")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    task = load_task("tinygpt", n_layer=args.n_layer, d_model=args.d_model, seq_len=args.seq_len,
                     max_corpus_bytes=1_000_000)
    base = task.build_model(0)
    m_drv, m_hand = copy.deepcopy(base), copy.deepcopy(base)
    opt_drv = torch.optim.AdamW(m_drv.parameters(), lr=1e-3, weight_decay=0.1)
    opt_hand = torch.optim.AdamW(m_hand.parameters(), lr=1e-3, weight_decay=0.1)
    clip = 1.0
    driver = StepDriver(m_drv, opt_drv, StepConfig(micro_batch=args.micro_batch, global_batch=args.global_batch,
                                                   max_grad_norm=clip),
                        lr_schedule=TokenLRSchedule(peak_lr=1e-3, total=10**9, shape="constant"))
    params_hand = [p for p in m_hand.parameters() if p.requires_grad]

    n_windows = args.pairs + args.warmup
    order = task.sample_order(0)
    windows = []
    for _ in range(n_windows):  # collate up front: time the step mechanism, not the data
        idx = list(itertools.islice(order, args.global_batch))
        windows.append([task.collate(idx[i:i + args.micro_batch]) for i in range(0, len(idx), args.micro_batch)])

    def run_driver(w):
        t = time.perf_counter()
        driver.run_window(w, task.loss_sum)
        return time.perf_counter() - t

    def run_hand(w):
        t = time.perf_counter()
        hand_written_step(m_hand, opt_hand, params_hand, w, task.loss_sum, clip)
        return time.perf_counter() - t

    t_drv, t_hand = [], []
    for i, w in enumerate(windows):
        if i % 2 == 0:
            a, b = run_driver(w), run_hand(w)
        else:
            b, a = run_hand(w), run_driver(w)
        if i >= args.warmup:
            t_drv.append(a)
            t_hand.append(b)

    # same data, same math: the two models must still agree (float32, different op order)
    with torch.no_grad():
        max_diff = max(float((p - q).abs().max()) for p, q in zip(m_drv.parameters(), m_hand.parameters()))
    med_d, med_h = statistics.median(t_drv), statistics.median(t_hand)
    paired = statistics.median(a / b for a, b in zip(t_drv, t_hand))
    q = lambda xs: statistics.quantiles(xs, n=4)  # noqa: E731
    print(f"tinygpt n_layer {args.n_layer} d_model {args.d_model} seq_len {args.seq_len}; global {args.global_batch} "
          f"= {args.global_batch // args.micro_batch} accum × {args.micro_batch} seq; {args.pairs} timed pairs; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"driver      median {med_d * 1e3:8.2f} ms/step  (IQR {q(t_drv)[0] * 1e3:.2f}–{q(t_drv)[2] * 1e3:.2f})")
    print(f"hand loop   median {med_h * 1e3:8.2f} ms/step  (IQR {q(t_hand)[0] * 1e3:.2f}–{q(t_hand)[2] * 1e3:.2f})")
    print(f"ratio driver/hand: {med_d / med_h:.3f} (ratio of medians), {paired:.3f} (median of paired ratios); "
          f"target <= 1.02")
    print(f"max |param difference| after {n_windows} steps: {max_diff:.2e}")


if __name__ == "__main__":
    main()
