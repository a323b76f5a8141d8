"""2-rank gloo: a gradient made non-finite on ONE rank after the sync skips the step on EVERY rank.

Run inside tests/dist/step_equivalence_script.py (tests/test_core_two_ranks.py's launch), or alone under torchrun. Prints
``PASS <name>`` on rank 0 or raises.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
import step_common as sc  # noqa: E402

from globalbatch.step import StepConfig, StepDriver  # noqa: E402


class InfOnRankOne:
    """``on_window_end`` (after the all-reduce): writes inf into one gradient element on rank 1, once."""

    def __init__(self) -> None:
        self.armed = True

    def on_window_end(self, driver, global_count, local_count) -> None:
        if self.armed and dist.get_rank() == 1:
            next(p for p in driver.model.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        self.armed = False


def params_agree(model) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    other = flat.clone()
    dist.broadcast(other, src=0)
    return torch.equal(flat, other)


def check_inf_after_sync() -> None:
    """The check, in a running 2-rank gloo group (step_equivalence_script.py runs it in its launch)."""
    rank = dist.get_rank()
    model, opt = sc.clone_model_opt(sc.build_model())
    ddp = DDP(model)
    drv = StepDriver(ddp, opt, StepConfig(micro_batch=2, global_batch=16, max_grad_norm=1.0),
                     callbacks=[InfOnRankOne()])
    seqs = sc.make_sequences(64, seed=21)
    before = [p.detach().clone() for p in model.parameters()]
    res = drv.run_window(sc.micro_batches(seqs[8 * rank:8 * rank + 8], 2), sc.loss_fn)
    flags = torch.tensor([float(res.skipped)])
    dist.all_reduce(flags)
    assert res.skipped and flags.item() == 2, f"rank {rank}: skipped={res.skipped}, ranks skipping={flags.item()}"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), f"rank {rank}: params changed"
    assert params_agree(model), f"rank {rank}: parameters differ across ranks"
    res = drv.run_window(sc.micro_batches(seqs[16 + 8 * rank:16 + 8 * rank + 8], 2), sc.loss_fn)  # a clean window
    assert not res.skipped and drv.optimizer_steps == 1, f"rank {rank}: {res}"
    assert params_agree(model), f"rank {rank}: parameters differ across ranks after a clean step"
    if rank == 0:
        print("PASS ddp-inf-after-sync-skips-on-every-rank", flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    logging.basicConfig(level=logging.WARNING)
    check_inf_after_sync()
    dist.destroy_process_group()


if __name__ == "__main__":
    from clean_exit import clean_exit

    main()
    clean_exit()  # every check passed: skip gloo's teardown (see clean_exit.py)
