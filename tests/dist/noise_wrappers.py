"""torchrun (2 gloo ranks): the noise monitor through wrappers and beside the user's comm hook.

Phase 1 — wrappers: ``torch.compile(DDP(m))`` (backend "eager": it builds the same
``OptimizedModule`` wrapper without the inductor compile time) gives the monitor the same micro
and rank estimates as ``DDP(m)``, on the same windows (issue 9 measured B_simple ≈ 82 instead of
≈ 12 when the monitor missed the DDP inside the compile wrapper).

Phase 2 — comm hooks: the monitor wraps a user hook (fp16 compression) instead of replacing it;
the estimates under compression are compared with the exact all-reduce on the same windows; two
monitors share one DDP model; a hook registered before the monitor is refused with a clear error.

Rank 0 prints one line ``NOISE_WRAPPERS {json}``; the pytest side asserts on it.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import noise_common as nc  # noqa: E402

from globalbatch.noise import NoiseConfig, NoiseScaleMonitor  # noqa: E402
from globalbatch.step import StepConfig, StepDriver  # noqa: E402

MICRO, ACCUM = 16, 2


def _run(model, x, y, rank: int, windows: int, monitors_kwargs: list[dict], seed: int = 3) -> list[dict]:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # fixed parameters: a plain mean over windows
    mons = [NoiseScaleMonitor(model, optimizer=opt, unit="sample", **kw) for kw in monitors_kwargs]
    world = dist.get_world_size()
    driver = StepDriver(model, opt, StepConfig(micro_batch=MICRO, global_batch=MICRO * ACCUM * world),
                        callbacks=mons)
    gen = torch.Generator().manual_seed(seed + rank)
    for _ in range(windows):
        for i in range(ACCUM):
            idx = torch.randint(0, len(x), (MICRO,), generator=gen)
            with driver.micro_step(last=i == ACCUM - 1):
                driver.backward(*nc.loss_sum(model, x[idx], y[idx]), samples=MICRO)
        driver.step()
    out = []
    for mon in mons:
        row = {}
        for source in ("micro", "rank"):
            e = mon.estimate(source)
            row[source] = {"b_simple": e.b_simple, "tr_sigma": e.tr_sigma, "g_sq": e.g_sq, "windows": e.windows,
                           "low": e.low, "high": e.high}
        out.append(row)
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    windows = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    x, y = nc.make_data()
    base = nc.make_model(0)
    tr, g_sq = nc.truth(base, x, y)
    cfg = {"config": NoiseConfig(half_life=math.inf)}
    out: dict = {"truth": tr / g_sq}

    # Phase 1: DDP(m) against torch.compile(DDP(m)) on the same windows.
    out["ddp"] = _run(DDP(nc.make_model(0)), x, y, rank, windows, [cfg])[0]
    compiled = torch.compile(DDP(nc.make_model(0)), backend="eager")
    out["compiled_type"] = type(compiled).__name__
    out["compiled_ddp"] = _run(compiled, x, y, rank, windows, [cfg])[0]

    # Phase 2: fp16 compression wrapped by the monitor; two monitors on one model.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    out["fp16"] = _run(DDP(nc.make_model(0)), x, y, rank, windows,
                       [dict(cfg, comm_hook=default_hooks.fp16_compress_hook, comm_state=None)])[0]
    out["two_monitors"] = _run(DDP(nc.make_model(0)), x, y, rank, windows, [cfg, cfg])
    ddp = DDP(nc.make_model(0))
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    try:
        NoiseScaleMonitor(ddp)
        out["refused"] = ""
    except ValueError as exc:
        out["refused"] = str(exc)
    if rank == 0:
        print("NOISE_WRAPPERS " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from clean_exit import clean_exit

    main()
    clean_exit()  # every check passed: skip gloo's teardown (see clean_exit.py)
