"""torchrun (2 gloo ranks): every rank takes the same adaptive-batch decisions.

Each rank trains a DDP replica on its own half of every window (rank-dependent micro-batches of
a shared order) *and* its data is perturbed per rank, so local numbers differ: the driver's
units/s is measured per rank. The schedule shares one observation (all-reduce + broadcast), so the
decisions, the batch of every window and the parameters must be identical. Each rank writes
``rank<r>.json`` into the directory given as argv[1].
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import adaptive_common as ac  # noqa: E402


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    x, y = ac.make_data(3)
    # each rank sees different data: its own noise on the targets
    g = torch.Generator().manual_seed(1000 + rank)
    y = y + 0.3 * torch.randn(y.shape, generator=g)
    model = DDP(ac.make_model(0))
    driver, sched, mon = ac.build(model, micro=2, world=world, min_batch=8, max_batch=128, initial=8, c=3.0)
    local_rates = []
    orig = sched.on_step_end

    def spy(drv, res):
        if rank == 1:
            time.sleep(0.002)  # rank 1 is slower: its local units/s differs from rank 0's
        orig(drv, res)
        if sched.last_local and sched.decisions and sched.decisions[-1]["step"] == drv.optimizer_steps:
            local_rates.append(sched.last_local[3])

    # swap only the schedule's own step-end hook (the driver calls it after the callbacks)
    assert getattr(driver._schedule_hook, "__self__", None) is sched
    driver._schedule_hook = spy
    batches = ac.run_steps(driver, x, y, 50, rank=rank, world=world)
    first = x[rank * 2:(rank + 1) * 2].sum().item() + y[:8].sum().item()
    rec = {"rank": rank, "history": sched.summary(), "decisions": sched.decisions, "batches": batches,
           "params": ac.params_vector(model.module).tolist(), "local_rates": local_rates, "first_micro_sum": first}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f, default=float, allow_nan=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from clean_exit import clean_exit

    main()
    clean_exit()  # every rank wrote its record: skip gloo's teardown (see clean_exit.py)
