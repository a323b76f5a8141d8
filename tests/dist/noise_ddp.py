"""torchrun (2 gloo ranks): the noise monitor under DDP + accumulation, through the StepDriver.

Phase 1 — plumbing, exact: over a few windows of ragged micro-batches, the monitor's mean
tr(Σ)^ and |G|²^ for every source (micro pooled over ranks; rank from the DDP comm hook;
their Adam variants) equal a reference built from each micro-batch's own gradient,
computed on a plain copy of the model and gathered over the ranks.

Phase 2 — statistics: at fixed parameters (SGD with lr 0), B_simple from the micro source
(accumulation + DDP, k = 4 per window) and from the rank source (DDP, k = 2) against the
brute-force per-example truth; their intervals must overlap.

Rank 0 prints one line ``NOISE_DDP {json}``; the pytest side asserts on it.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import noise_common as nc  # noqa: E402

from globalbatch.noise import NoiseConfig, NoiseScaleMonitor, window_estimates  # noqa: E402
from globalbatch.step import StepConfig, StepDriver  # noqa: E402


def _gather(values: list[float], world: int) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return torch.cat(out)


def _adam_precond(opt, params) -> torch.Tensor | None:
    if not opt.state:
        return None
    beta2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
    out = []
    for p in params:
        st = opt.state[p]
        bc = 1 - beta2 ** float(st["step"])
        out.append((1.0 / ((st["exp_avg_sq"] / bc).sqrt() + eps)).reshape(-1))
    return torch.cat(out).double()


def phase1(x, y, rank: int, world: int) -> dict:
    ddp = DDP(nc.make_model(1))
    opt = torch.optim.Adam(ddp.parameters(), lr=0.0)  # lr 0: parameters fixed, v̂ moves
    mon = NoiseScaleMonitor(ddp, optimizer=opt, unit="sample", config=NoiseConfig(half_life=math.inf, adam=True))
    accum = 3
    driver = StepDriver(ddp, opt, StepConfig(micro_batch=14, global_batch=14 * accum * world), callbacks=[mon])
    gen = torch.Generator().manual_seed(100 + rank)
    ref: dict[str, list] = {"micro": [], "rank": [], "micro_adam": [], "rank_adam": []}
    for _ in range(4):
        pc = _adam_precond(opt, list(ddp.parameters()))
        sizes = [int(s) for s in torch.randint(2, 15, (accum,), generator=gen)]
        local_sum = None
        sq, sq_adam = [], []
        for i, b in enumerate(sizes):
            idx = torch.randint(0, len(x), (b,), generator=gen)
            ref_model = copy.deepcopy(ddp.module)
            (nc.loss_sum(ref_model, x[idx], y[idx])[0] / b).backward()
            g = torch.cat([p.grad.reshape(-1) for p in ref_model.parameters()]).double()
            sq.append(float(g.square().sum()))
            sq_adam.append(float((g * pc).square().sum()) if pc is not None else 0.0)
            local_sum = g * b if local_sum is None else local_sum + g * b
            with driver.micro_step(last=i == accum - 1):
                loss, count = nc.loss_sum(ddp, x[idx], y[idx])
                driver.backward(loss, count, samples=b)
        driver.step()
        b_r = float(sum(sizes))
        g_r = local_sum / b_r
        total = local_sum.clone()
        dist.all_reduce(total)
        bs, ranks_b = _gather([float(s) for s in sizes], world), _gather([b_r], world)
        big = total / ranks_b.sum()
        ref["micro"].append(window_estimates(_gather(sq, world), bs, big.square().sum()))
        ref["rank"].append(window_estimates(_gather([float(g_r.square().sum())], world), ranks_b,
                                            big.square().sum()))
        if pc is not None:
            ref["micro_adam"].append(window_estimates(_gather(sq_adam, world), bs, (big * pc).square().sum()))
            ref["rank_adam"].append(window_estimates(_gather([float((g_r * pc).square().sum())], world), ranks_b,
                                                     (big * pc).square().sum()))
    worst = 0.0
    for name, windows in ref.items():
        est = mon.estimate(name.split("_")[0], adam=name.endswith("_adam"))
        want_t = sum(float(w.tr_sigma) for w in windows) / len(windows)
        want_g = sum(float(w.g_sq) for w in windows) / len(windows)
        if est.windows != len(windows):
            raise AssertionError(f"{name}: {est.windows} windows, want {len(windows)}")
        worst = max(worst, abs(est.tr_sigma / want_t - 1), abs(est.g_sq - want_g) / abs(want_t))
    return {"phase1_worst_rel_err": worst}


def phase2(x, y, rank: int, world: int, windows: int) -> dict:
    model = nc.make_model(0)
    tr, g_sq = nc.truth(model, x, y)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    mon = NoiseScaleMonitor(ddp, optimizer=opt, unit="sample", config=NoiseConfig(half_life=math.inf))
    micro, accum = 32, 2
    driver = StepDriver(ddp, opt, StepConfig(micro_batch=micro, global_batch=micro * accum * world), callbacks=[mon])
    gen = torch.Generator().manual_seed(7 + rank)
    for _ in range(windows):
        for i in range(accum):
            idx = torch.randint(0, len(x), (micro,), generator=gen)  # with replacement: population Σ
            with driver.micro_step(last=i == accum - 1):
                driver.backward(*nc.loss_sum(ddp, x[idx], y[idx]), samples=micro)
        driver.step()
    out = {"truth": tr / g_sq, "truth_tr_sigma": tr, "truth_g_sq": g_sq}
    for source in ("micro", "rank"):
        e = mon.estimate(source)
        out[source] = {"b_simple": e.b_simple, "low": e.low, "high": e.high, "stderr": e.stderr,
                       "tr_sigma": e.tr_sigma, "g_sq": e.g_sq, "flags": list(e.flags), "windows": e.windows}
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = nc.make_data()
    out = {"world": world}
    out.update(phase1(x, y, rank, world))
    out.update(phase2(x, y, rank, world, int(sys.argv[1]) if len(sys.argv) > 1 else 300))
    if rank == 0:
        print("NOISE_DDP " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from clean_exit import clean_exit

    main()
    clean_exit()  # every check passed: skip gloo's teardown (see clean_exit.py)
