"""torchrun (2 gloo ranks): the noise monitor's micro source on FSDP2 (fully_shard) models.

On the same windows and the same data per rank, at fixed parameters (SGD lr 0), an FSDP2 model
gives the monitor the same micro-source estimate as DDP (each rank's micro-batch gradients are
caught on FSDP2's unsharded parameters before the reduce-scatter; |G_big|² is the global norm of
the sharded gradient), and that estimate agrees with the single-process per-example truth.
Rank 0 prints one line ``NOISE_FSDP2 {json}``.
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

MICRO, ACCUM = 32, 2


def _fsdp_model():
    from torch.distributed.fsdp import fully_shard

    model = nc.make_model(0)
    for sub in (model[0], model[2]):
        fully_shard(sub)
    fully_shard(model)
    return model


def _run(model, x, y, rank: int, windows: int, *, plain_loop: bool = False, attach_after: int = 0) -> dict:
    """``windows`` windows; the monitor joins after ``attach_after`` of them (micro source only)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    world = dist.get_world_size()
    driver = StepDriver(model, opt, StepConfig(micro_batch=MICRO, global_batch=MICRO * ACCUM * world))
    gen = torch.Generator().manual_seed(7 + rank)
    mon = None
    for w in range(windows):
        if w == attach_after:
            mon = NoiseScaleMonitor(model, optimizer=opt, unit="sample",
                                    config=NoiseConfig(half_life=math.inf, sources=("micro",)))
            if plain_loop:  # the monitor outside the driver: it reads the (sharded) .grad itself
                driver.callbacks.append(type("End", (), {"on_window_end": lambda self, d, g, l: mon.window_end()})())
            else:
                driver.callbacks.append(mon)
        for i in range(ACCUM):
            idx = torch.randint(0, len(x), (MICRO,), generator=gen)  # with replacement: population Σ
            with driver.micro_step(last=i == ACCUM - 1):
                loss, count = nc.loss_sum(model, x[idx], y[idx])
                driver.backward(loss, count, samples=MICRO)
            if plain_loop and mon is not None:
                mon.micro_backward(count, samples=MICRO)
        driver.step()
    e = mon.estimate("micro")
    return {"b_simple": e.b_simple, "tr_sigma": e.tr_sigma, "g_sq": e.g_sq, "low": e.low, "high": e.high,
            "windows": e.windows, "flags": list(e.flags)}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    windows = int(sys.argv[1]) if len(sys.argv) > 1 else 150
    x, y = nc.make_data()
    tr, g_sq = nc.truth(nc.make_model(0), x, y)
    out = {"truth": tr / g_sq, "world": dist.get_world_size()}
    # The FSDP2 monitor misses the first window (FSDP2 creates its unsharded parameters at the first
    # forward, so their hooks start at the second window): the DDP reference joins after one window.
    out["fsdp2"] = _run(_fsdp_model(), x, y, rank, windows + 1)
    out["ddp"] = _run(DDP(nc.make_model(0)), x, y, rank, windows + 1, attach_after=1)
    out["fsdp2_plain_loop"] = _run(_fsdp_model(), x, y, rank, 21, plain_loop=True)
    out["ddp_plain_loop"] = _run(DDP(nc.make_model(0)), x, y, rank, 21, plain_loop=True, attach_after=1)
    if rank == 0:
        print("NOISE_FSDP2 " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from clean_exit import clean_exit

    main()
    clean_exit()  # every check passed: skip gloo's teardown (see clean_exit.py)
