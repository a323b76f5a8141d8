"""Cost of one LARS/LAMB step against AdamW/SGD and against the reference libraries, beside a training step.

On the built-in tinygpt model (4 layers, width 128, context 128: the step benchmark's model)
with fixed random gradients, each optimizer's ``step()`` is timed in interleaved rounds (one
step of each per round, order rotated every round) so that machine load hits all alike; the
figure is the median per-step time and its ratio to AdamW (torch's foreach path). For context,
one forward+backward of a micro-batch of 16 sequences on the same model. Usage::

    OMP_NUM_THREADS=1 python benchmarks/large_batch_optimizers.py           # ~1 min
    OMP_NUM_THREADS=1 python benchmarks/large_batch_optimizers.py --rounds 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from globalbatch.lab.tasks import load_task
from globalbatch.optim import build_optimizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    task = load_task("tinygpt", max_corpus_bytes=400_000)
    base = task.build_model(0)
    n_params = sum(p.numel() for p in base.parameters())

    makers = {
        "adamw (torch)": lambda m: build_optimizer("adamw", m, lr=1e-3),
        "sgd (torch)": lambda m: build_optimizer("sgd", m, lr=1e-2),
        "lamb (ours)": lambda m: build_optimizer("lamb", m, lr=1e-3),
        "lars (ours)": lambda m: build_optimizer("lars", m, lr=1.0),
    }
    try:
        import torch_optimizer

        makers["lamb (torch-optimizer)"] = lambda m: torch_optimizer.Lamb(m.parameters(), lr=1e-3)
    except ImportError:
        pass
    try:
        import pytorch_optimizer

        makers["lars (pytorch-optimizer)"] = lambda m: pytorch_optimizer.LARS(m.parameters(), lr=1.0)
    except ImportError:
        pass

    gen = torch.Generator().manual_seed(0)
    runs = {}
    for name, make in makers.items():
        model = task.build_model(0)
        for q in model.parameters():
            q.grad = torch.randn(q.shape, generator=gen) * 1e-3
        runs[name] = (model, make(model), [])
    for _ in range(3):  # warm-up: state allocation
        for model, opt, _ in runs.values():
            opt.step()
    names = list(runs)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            _, opt, times = runs[name]
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)

    model = task.build_model(0)
    order = task.sample_order(0)
    batch = task.collate([next(order) for _ in range(16)])
    fb = []
    for _ in range(max(5, args.rounds // 4)):
        t0 = time.perf_counter()
        loss, _ = task.loss_sum(model, batch)
        loss.backward()
        fb.append(time.perf_counter() - t0)
    fwd_bwd = statistics.median(fb)

    ref = statistics.median(runs["adamw (torch)"][2])
    print(f"tinygpt 4x128, {n_params:,} parameters, {torch.get_num_threads()} thread(s); median of {args.rounds} "
          "interleaved steps (machine shared with other jobs: ratios, not absolute times, are the result)")
    print(f"{'optimizer':26s} {'ms/step':>8s} {'÷ adamw':>8s} {'÷ fwd+bwd(16 seq)':>18s}")
    for name, (_, _, times) in runs.items():
        t = statistics.median(times)
        print(f"{name:26s} {t * 1e3:8.2f} {t / ref:8.2f} {t / fwd_bwd:18.3f}")
    print(f"{'forward+backward, 16 seq':26s} {fwd_bwd * 1e3:8.2f}")


if __name__ == "__main__":
    main()
