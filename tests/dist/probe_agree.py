"""Run under torchrun (2 gloo ranks): all ranks agree on every trial of the probe.

Checks, printed as ``CHECK <name> ok`` by rank 0 (tests/test_core_two_ranks.py::test_dist_probe_ranks_agree):

1. oom_min: rank 0 runs out of memory above 100, rank 1 above 37 → both return 37,
   with identical trial lists (sizes and outcomes).
2. budget_min: linear memory, rank 1 needs 2× the per-sample bytes; a shared memory limit →
   both return rank 1's boundary, and agreed peaks are the MAX over ranks.
3. fatal: rank 1 raises a non-OOM error at micro-batch 8 → rank 1 re-raises it, rank 0 raises
   "another rank failed" at the same size instead of waiting or retrying.
4. real: TrainStepRunner on a small MLP, rank 1's batches carry 4× the features → the agreed
   largest fit is what rank 1 alone fits, and weights are restored on both ranks.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from globalbatch.probe import TrialResult, TrainStepRunner, TrialConfig, probe, probe_micro_batch

CUDA_OOM = "CUDA out of memory. Tried to allocate 1.00 GiB"


def check(name: str, condition: bool, detail: str = "") -> None:
    flags = torch.tensor([0.0 if condition else 1.0])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags.item() != 0.0:
        raise SystemExit(f"rank {dist.get_rank()}: CHECK {name} failed {detail}")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def same_on_all_ranks(obj) -> bool:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return all(g == gathered[0] for g in gathered)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    # 1. OOM thresholds differ by rank.
    threshold = 100 if rank == 0 else 37
    ran = []

    def run_oom(size: int) -> TrialResult:
        ran.append(size)
        if size > threshold:
            raise RuntimeError(CUDA_OOM)
        return TrialResult(micro_batch=size, step_time_s=0.001 * (1 + rank) * size)

    result = probe_micro_batch(run_oom, max_micro_batch=8192)
    outcomes = [(t.micro_batch, t.oom) for t in result.trials]
    check("oom_min", result.largest_fit == 37 and same_on_all_ranks(outcomes) and ran == [s for s, _ in outcomes],
          f"largest {result.largest_fit}, trials {outcomes}")
    check("oom_min_timing", same_on_all_ranks([t.step_time_s for t in result.trials])
          and result.trials[0].step_time_s == 0.004)  # MAX over ranks: rank 1's 4 ms at size 2 (the start)

    # 2. Linear memory, per-rank slope, one shared budget.
    a, b = 1_000_000, 1000 * (1 + rank)
    limit = 1_000_000 + 1000 * 2 * 300 + 500  # rank 1's boundary: 300; rank 0's would be 600

    def run_mem(size: int) -> TrialResult:
        return TrialResult(micro_batch=size, peak_memory_bytes=a + b * size, step_time_s=0.01)

    result = probe_micro_batch(run_mem, max_micro_batch=8192, memory_limit_bytes=limit)
    peaks = [t.peak_memory_bytes for t in result.trials]
    check("budget_min", result.largest_fit == 300 and same_on_all_ranks(peaks)
          and all(p == 1_000_000 + 2000 * t.micro_batch for p, t in zip(peaks, result.trials)),
          f"largest {result.largest_fit}")

    # 3. A non-OOM error on one rank stops both, without retries.
    def run_fatal(size: int) -> TrialResult:
        if rank == 1 and size == 8:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return TrialResult(micro_batch=size, step_time_s=0.01)

    try:
        probe_micro_batch(run_fatal, max_micro_batch=64)
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    expected = "illegal memory access" if rank == 1 else "another rank failed at micro_batch 8"
    check("fatal", expected in message, message)

    # 4. Real training steps; rank 1's samples are 4× wider, so it fits fewer.
    torch.manual_seed(0)
    width = 64 if rank == 0 else 256
    model = nn.Sequential(nn.LazyLinear(32), nn.GELU(), nn.Linear(32, 1))
    model(torch.zeros(1, width))  # materialise the lazy layer with this rank's width
    rank1_alone = 256 * 4 * 40  # bytes of rank 1's input at 40 samples, the scale of the limit below

    def make_batch(size: int) -> torch.Tensor:
        return torch.randn(size, width)

    runner = TrainStepRunner(model, make_batch, lambda m, x: m(x).square().mean(),
                             config=TrialConfig(steps_per_trial=1, warmup_steps=2))
    base = runner(1).peak_memory_bytes  # rank-local peak at size 1, to place the shared limit
    base_max = torch.tensor([float(base)])
    dist.all_reduce(base_max, op=dist.ReduceOp.MAX)
    limit = int(base_max.item()) + rank1_alone
    before = [p.detach().clone() for p in model.parameters()]  # after runner(1): a bare runner trains the model
    result = probe(model, make_batch, lambda m, x: m(x).square().mean(), memory_limit_bytes=limit,
                   max_micro_batch=4096, steps_per_trial=1, global_batch=4096, dp_world_size=2)
    restored = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    outcomes = [(t.micro_batch, t.oom, t.peak_memory_bytes) for t in result.trials]
    check("real", same_on_all_ranks(outcomes) and 0 < result.largest_fit < 4096 and restored
          and all(t.fits == (t.peak_memory_bytes <= limit) for t in result.trials),
          f"largest {result.largest_fit} restored {restored}")
    # Re-measure locally: the agreed size fits on every rank; one more sample is over the limit on rank 1.
    fits_here = runner(result.largest_fit).peak_memory_bytes <= limit
    over_here = runner(result.largest_fit + 1).peak_memory_bytes > limit
    check("real_min_rank", same_on_all_ranks(True) and fits_here and (over_here if rank == 1 else True),
          f"rank {rank}: fits {fits_here} over {over_here}")
    largest = result.choices[0].usable
    check("real_geometry", largest is not None and largest.dp_world_size == 2
          and largest.micro_batch * largest.grad_accum_steps * 2 == 4096)
    if rank == 0:
        print(f"real: largest {result.largest_fit} in {result.num_trials} trials, limit {limit}", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from clean_exit import clean_exit

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    rc = main()
    if rc:
        sys.exit(rc)
    clean_exit()
