"""2-rank gloo checks of the step driver (launched by tests/dist/core_all.py for tests/test_core_two_ranks.py).

Each check prints ``PASS <name>`` on rank 0 or raises (non-zero exit fails the test).
The reference is one process taking the whole global batch in one forward, computed
on every rank from the same seeds. Argument 1: a scratch directory for checkpoints.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
import step_common as sc  # noqa: E402

from globalbatch.schedule import LRSchedule  # noqa: E402
from globalbatch.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from globalbatch.step import (  # noqa: E402
    NonFiniteError,
    StepConfig,
    StepDriver,
)

RANK = WORLD = 0


def log(msg: str) -> None:
    if RANK == 0:
        print(msg, flush=True)


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(f"rank {RANK}: {msg}")


def split_for_rank(window: list, sizes_per_rank: list[list[int]]) -> list[list]:
    """Contiguous split: rank 0 takes the first sum(sizes[0]) samples, in micro-batches of those sizes."""
    start = sum(sum(s) for s in sizes_per_rank[:RANK])
    out = []
    for n in sizes_per_rank[RANK]:
        out.append(window[start:start + n])
        start += n
    return out


def ddp_vs_full(name: str, dtype: torch.dtype, windows: list[list[list[int]]], *, clip: float | None,
                grad_tol: dict, param_tol: dict, expect_naive_gap: bool = False) -> None:
    """Train DDP(micro-batches per rank given by ``windows``) against full-batch steps of the same samples."""
    base = sc.build_model(dtype=dtype)
    ours, opt = sc.clone_model_opt(base)
    ddp = DDP(ours)
    probe = sc.GradProbe(ours)
    drv = StepDriver(ddp, opt, StepConfig(micro_batch=2, global_batch=16, max_grad_norm=clip), callbacks=[probe])
    ref, ref_opt = sc.clone_model_opt(base)
    total = sum(sum(sum(s) for s in w) for w in windows)
    seqs = sc.make_sequences(total, seed=11)
    start = 0
    for w_i, sizes in enumerate(windows):
        n = sum(sum(s) for s in sizes)
        window = seqs[start:start + n]
        start += n
        mine = split_for_rank(window, sizes)
        mbs = [sc.collate(m) for m in mine]
        res = drv.run_window(mbs, sc.loss_fn, samples_per_micro=[len(m) for m in mine])
        check(not res.skipped and res.global_samples == n, f"{name}: window {w_i} {res}")
        want = sc.reference_step(ref, ref_opt, window, clip)
        got = probe.window[-1]
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, **grad_tol, msg=lambda m: f"{name} window {w_i} grad: {m}")
        if clip is not None:
            check(res.grad_norm > clip, f"{name}: clipping inactive (norm {res.grad_norm})")
        if expect_naive_gap and w_i == 0:
            # naive: every rank averages its micro-batch means, DDP averages ranks
            local = sc.naive_grads(copy.deepcopy(base), mine)
            for t in local:
                dist.all_reduce(t)
                t /= WORLD
            exact = sc.full_batch_grads(copy.deepcopy(base), window)
            gap = sc.max_rel_diff(local, exact)
            check(gap > 1e-3, f"{name}: naive mean-of-means gap only {gap:.2e}")
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **param_tol, msg=lambda m: f"{name} params: {m}")
    log(f"PASS {name}")


FULL = [[2, 2, 2, 2], [2, 2, 2, 2]]  # micro 2 × accum 4 × DP 2 = 16


def main(scratch: Path) -> None:
    global RANK, WORLD
    dist.init_process_group("gloo")
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.WARNING)

    f64 = dict(atol=1e-10, rtol=0)
    ddp_vs_full("ddp-float64", torch.float64, [FULL] * 3, clip=0.2, grad_tol=f64, param_tol=f64,
                expect_naive_gap=True)
    ddp_vs_full("ddp-float32", torch.float32, [FULL] * 3, clip=0.2,
                grad_tol=dict(atol=1e-6, rtol=1e-5), param_tol=dict(atol=1e-5, rtol=1e-5))
    # short last window: accum 3 instead of 4, then fewer samples
    ddp_vs_full("ddp-short-window", torch.float64, [FULL, FULL, [[2, 2, 2], [2, 2, 2]], [[2, 1], [2, 2, 1]]],
                clip=0.2, grad_tol=f64, param_tol=f64)
    # ranks with different numbers of micro-steps (7 vs 3 samples)
    ddp_vs_full("ddp-uneven-ranks", torch.float64, [[[2, 2, 2, 1], [2, 1]], FULL], clip=None,
                grad_tol=f64, param_tol=f64)

    check_no_sync_deferred()
    check_flops()
    check_nan_skip()
    check_resume(scratch)
    check_fsdp2()
    from step_skip_agree import check_inf_after_sync  # one launch for every 2-rank step check

    check_inf_after_sync()
    dist.destroy_process_group()


def check_flops() -> None:
    """Model FLOPs are summed over ranks in the step's one all-reduce; a rank without a count makes it None."""
    base = sc.build_model(dtype=torch.float32)
    ours, opt = sc.clone_model_opt(base)
    drv = StepDriver(DDP(ours), opt, StepConfig(micro_batch=2, global_batch=16, peak_flops_per_s=1e9))
    seqs = sc.make_sequences(16, seed=13)
    sizes = [[2, 2, 2, 1], [2, 2, 1]]  # uneven ranks: 7 and 5 samples
    mine = split_for_rank(seqs, sizes)
    per_micro = 100.0 if RANK == 0 else 1000.0
    for i, m in enumerate(mine):
        with drv.micro_step(last=i == len(mine) - 1):
            loss_sum, count = sc.loss_fn(drv.model, sc.collate(m))
            drv.backward(loss_sum, count, samples=len(m), flops=per_micro * len(m))
    res = drv.step()
    want = 100.0 * 7 + 1000.0 * 5
    check(res.model_flops == want, f"flops: model_flops {res.model_flops} != {want}")
    dt = res.global_units / res.units_per_s
    check(abs(res.mfu - want / dt / (2 * 1e9)) <= 1e-9 * res.mfu, f"flops: mfu {res.mfu} (dp 2 × peak)")
    check(res.valid_tokens_per_s == res.units_per_s, "flops: valid tokens/s")
    for i, m in enumerate(mine):  # rank 1 gives no count for its micro-batches: unknown on both ranks
        with drv.micro_step(last=i == len(mine) - 1):
            loss_sum, count = sc.loss_fn(drv.model, sc.collate(m))
            drv.backward(loss_sum, count, samples=len(m), flops=None if RANK == 1 else 5.0)
    res = drv.step()
    check(res.model_flops is None and res.mfu is None, f"flops: partial counts gave {res.model_flops}")
    log("PASS ddp-flops")


def check_no_sync_deferred() -> None:
    """DDP communicates only on the last micro-step: the comm hook fires as often for accum 4 as for accum 1."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = [0]

    def counting_hook(state, bucket):
        calls[0] += 1
        return allreduce_hook(state, bucket)

    model, opt = sc.clone_model_opt(sc.build_model())
    ddp = DDP(model, bucket_cap_mb=1e-4)  # tiny buckets: several per step
    ddp.register_comm_hook(None, counting_hook)
    drv = StepDriver(ddp, opt, StepConfig(micro_batch=2, global_batch=16))
    seqs = sc.make_sequences(32, seed=12)
    for _ in range(2):  # DDP rebuilds its buckets after the first iteration: measure after that
        calls[0] = 0
        drv.run_window(sc.micro_batches(seqs[8 * RANK:8 * RANK + 2], 2), sc.loss_fn)  # accum 1
    per_sync = calls[0]
    calls[0] = 0
    drv.run_window(sc.micro_batches(seqs[16 + 8 * RANK:16 + 8 * RANK + 8], 2), sc.loss_fn)  # accum 4
    check(per_sync >= 2 and calls[0] == per_sync, f"hook calls: accum 1 {per_sync}, accum 4 {calls[0]}")
    # forgetting last=True is an error, not a silently unsynced step
    with drv.micro_step(last=False):
        loss, count = sc.loss_fn(ddp, sc.collate(seqs[:2]))
        drv.backward(loss, count, samples=2)
    try:
        drv.step()
    except RuntimeError as e:
        check("micro_step(last=True)" in str(e), str(e))
    else:
        raise AssertionError("step() after an unsynced last micro-batch did not raise")
    log("PASS ddp-no-sync-deferred")


def check_nan_skip() -> None:
    model, opt = sc.clone_model_opt(sc.build_model())
    ddp = DDP(model)
    sched = LRSchedule(peak_lr=1e-2, warmup=300, total=3000)
    drv = StepDriver(ddp, opt, StepConfig(micro_batch=2, global_batch=16, max_grad_norm=1.0,
                                          max_consecutive_skips=2, lr_schedule=sched))
    seqs = sc.make_sequences(64, seed=13)
    drv.run_window(sc.micro_batches(seqs[8 * RANK:8 * RANK + 8], 2), sc.loss_fn)
    params = [p.detach().clone() for p in model.parameters()]
    opt_state = copy.deepcopy(opt.state_dict())
    lr, trained = opt.param_groups[0]["lr"], drv.trained_units

    def poisoned(m, batch, _i=[0]):  # NaN in micro-batch 2 on rank 1 only
        loss, count = sc.loss_fn(m, batch)
        if RANK == 1 and _i[0] % 4 == 2:
            loss = loss * float("nan")
        _i[0] += 1
        return loss, count

    res = drv.run_window(sc.micro_batches(seqs[16 + 8 * RANK:16 + 8 * RANK + 8], 2), poisoned)
    check(res.skipped and drv.skipped_windows == 1 and drv.optimizer_steps == 1, f"{res}")
    check(all(torch.equal(p, q) for p, q in zip(model.parameters(), params)), "params changed")
    twin = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    twin.load_state_dict(opt_state)
    check(sc.optimizer_state_equal(opt, twin), "optimizer state changed")
    check(opt.param_groups[0]["lr"] == lr and drv.trained_units == trained, "LR schedule advanced")
    log("PASS ddp-nan-skip")
    try:
        drv.run_window(sc.micro_batches(seqs[32 + 8 * RANK:32 + 8 * RANK + 8], 2), poisoned)
    except NonFiniteError as e:
        check("2 consecutive windows skipped" in str(e), str(e))
    else:
        raise AssertionError("2 consecutive skips did not raise")
    log("PASS ddp-k-skips-raise")


def check_resume(scratch: Path) -> None:
    seqs = sc.make_sequences(16 * 5, seed=14)
    sched = LRSchedule(peak_lr=1e-2, warmup=100, total=1000, shape="wsd")

    def fresh():
        model, opt = sc.clone_model_opt(sc.build_model(dtype=torch.float32))
        ddp = DDP(model)
        drv = StepDriver(ddp, opt, StepConfig(micro_batch=2, global_batch=16, max_grad_norm=0.5, lr_schedule=sched))
        return model, ddp, opt, drv

    def run(drv, windows):
        for _ in range(windows):
            s = drv.consumed_samples + 8 * RANK
            drv.run_window(sc.micro_batches(seqs[s:s + 8], 2), sc.loss_fn)

    m1, _, o1, d1 = fresh()
    run(d1, 5)
    m2, ddp2, o2, d2 = fresh()
    run(d2, 2)
    path = scratch / "resume.pt"
    save_checkpoint(path, ddp2, o2, d2)
    m3, ddp3, o3, d3 = fresh()
    load_checkpoint(path, ddp3, o3, d3)
    run(d3, 3)
    check(all(torch.equal(p, q) for p, q in zip(m1.parameters(), m3.parameters())), "resumed params differ")
    check(sc.optimizer_state_equal(o1, o3), "resumed optimizer state differs")
    check(d1.state_dict() == d3.state_dict(), "driver state differs")
    log("PASS ddp-resume")


def check_fsdp2() -> None:
    """FSDP2 (fully_shard) on gloo: accumulation with set_requires_gradient_sync equals the full batch."""
    from torch.distributed.fsdp import fully_shard

    base = sc.build_model()
    model = copy.deepcopy(base)
    for sub in (model.emb, model.mix, model.out):
        fully_shard(sub)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    drv = StepDriver(model, opt, StepConfig(micro_batch=2, global_batch=16, max_grad_norm=0.2))
    check(drv.parallel == "fsdp2" and drv.dp_world_size == WORLD, drv.parallel)
    ref, ref_opt = sc.clone_model_opt(base)
    seqs = sc.make_sequences(48, seed=15)
    for w in range(3):
        window = seqs[16 * w:16 * (w + 1)]
        mine = split_for_rank(window, FULL)
        res = drv.run_window([sc.collate(m) for m in mine], sc.loss_fn)
        sc.reference_step(ref, ref_opt, window, 0.2)
        check(not res.skipped and res.grad_norm > 0.2, f"{res}")
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, atol=1e-10, rtol=0)
    log("PASS fsdp2-float64")


if __name__ == "__main__":
    from clean_exit import clean_exit

    # every rank must see the same scratch directory (the test passes its tmp_path)
    default = Path(tempfile.gettempdir()) / f"step_equiv_{os.environ.get('TORCHELASTIC_RUN_ID', 'manual')}"
    scratch = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    scratch.mkdir(parents=True, exist_ok=True)
    main(scratch)
    clean_exit()  # every check passed: skip gloo's teardown (see clean_exit.py)
