"""MFU of the tinygpt training step on CPU, against the measured matmul peak of the same thread count.

Model FLOPs per micro-batch are counted with FlopCounterMode (globalbatch.flops.FlopsCounter, once
per padded shape) and passed to the StepDriver with each backward; the driver reports model FLOP/s,
MFU and valid (non-padding) tokens/s per step from its one host sync. Also prints PaLM's formula
6·N + 12·L·d·T per token against the count.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mfu.py
"""

from __future__ import annotations

import argparse
import statistics
from itertools import islice

import torch

from globalbatch.flops import FlopsCounter, measure_matmul_peak, transformer_flops_per_token
from globalbatch.step import StepConfig, StepDriver
from globalbatch.lab.tasks import load_task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    task = load_task("tinygpt")
    model = task.build_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(m, batch):
        return task.loss_sum(m, batch)

    counter = FlopsCounter(model, lambda m, b: loss_fn(m, b)[0])
    peak_before = measure_matmul_peak("fp32", size=512, repeats=10)
    driver = StepDriver(model, opt, StepConfig(micro_batch=args.micro_batch, global_batch=args.global_batch,
                                               peak_flops_per_s=peak_before))
    order = task.sample_order(0)
    accum = args.global_batch // args.micro_batch
    results = []
    padded_tokens = 0
    for _ in range(args.steps + 1):  # the first step is warm-up (optimizer state, first counts)
        mbs = [task.collate(list(islice(order, args.micro_batch))) for _ in range(accum)]
        flops = [counter(mb) for mb in mbs]  # cached per shape: counted before the window, not inside it
        for i, mb in enumerate(mbs):
            with driver.micro_step(last=i == accum - 1):
                loss_sum, count = loss_fn(model, mb)
                driver.backward(loss_sum, count, samples=args.micro_batch, flops=flops[i])
        results.append(driver.step())
        padded_tokens = sum(mb["input_ids"].numel() for mb in mbs)
    timed = results[1:]
    mfu = [r.mfu for r in timed]
    # the same peak measured again after the run: the spread says how loaded the machine was
    from globalbatch import flops as F

    F._MEASURED.clear()  # the measurement is cached per process
    peak_after = measure_matmul_peak("fp32", size=512, repeats=10)
    n_non_emb = sum(p.numel() for name, p in model.named_parameters() if "emb" not in name)
    cfg = task.config if hasattr(task, "config") else None
    L = getattr(cfg, "n_layer", 4)
    d = getattr(cfg, "d_model", 128)
    T = task.seq_len
    per_token_formula = transformer_flops_per_token(params_non_embedding=n_non_emb, n_layer=L, seq_len=T, d_model=d)
    print(f"threads {args.threads}, micro {args.micro_batch}, global {args.global_batch}, {len(timed)} timed steps")
    print(f"matmul peak fp32 512: {peak_before / 1e9:.2f} GFLOP/s before, {peak_after / 1e9:.2f} after")
    print(f"model FLOP/s median {statistics.median(r.model_flops_per_s for r in timed) / 1e9:.2f} G; "
          f"MFU median {statistics.median(mfu):.3f} (min {min(mfu):.3f}, max {max(mfu):.3f})")
    print(f"valid tokens/s median {statistics.median(r.valid_tokens_per_s for r in timed):,.0f}; "
          f"last window {timed[-1].global_units} valid of {padded_tokens} padded tokens")
    counted_per_token = timed[-1].model_flops / padded_tokens
    print(f"FLOPs per padded token: counted {counted_per_token:,.0f}; formula 6N+12LdT {per_token_formula:,.0f} "
          f"(N non-embedding {n_non_emb:,}); {len(counter.cache)} shape(s) counted")


if __name__ == "__main__":
    main()
