"""Train the byte-level tinygpt task with the exact global-batch step driver.

Single process (gradient accumulation only)::

    python examples/train_tinygpt.py

Two data-parallel ranks (gloo on CPU, NCCL on GPU)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/train_tinygpt.py

The loop below is the user's: :func:`globalbatch.windows.rank_windows` draws each global batch
(following the batch schedule) from the task's seeded sample order, the same on every rank, and
gives this rank its micro-batches, each padded on its own (documents are ragged);
``driver.run_window`` hands each micro-batch's *summed* loss and token count to
:class:`globalbatch.step.StepDriver`. Whatever the world size, the global batch, and therefore
the optimizer step, is the same.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from globalbatch.flops import SequenceFlops, peak_flops_per_s
from globalbatch.plan import fmt_int
from globalbatch.schedule import LRSchedule, constant_batch, parse_step_schedule
from globalbatch.checkpoint import RunMismatch, load_checkpoint, save_checkpoint
from globalbatch.optim import build_optimizer
from globalbatch.step import StepConfig, StepDriver, unwrap_model
from globalbatch.windows import rank_windows
from globalbatch.lab.tasks import load_task


PROG = "train_tinygpt.py"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``train_tinygpt.py: error: ...`` and exit code 2 (no usage block)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(message: str) -> int:
    """Print a one-line error and return the exit code 2 (for errors found after argument parsing)."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps to run (in total, resumes included)")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, all ranks")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per forward/backward per rank")
    p.add_argument("--batch-schedule", default=None,
                   help="Megatron-style step schedule in loss-bearing tokens, e.g. '0:8 20K:16' (replaces --global-batch)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate at the first global batch")
    p.add_argument("--lr-shape", default="cosine", choices=["constant", "linear", "cosine", "wsd"])
    p.add_argument("--warmup-tokens", type=int, default=5_000, help="linear warmup, in loss-bearing tokens")
    p.add_argument("--total-tokens", type=int, default=None,
                   help="LR decay length in loss-bearing tokens (default: estimated from --steps; fix it when resuming)")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint", default=None, help="write a checkpoint here every --checkpoint-every steps")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", default=None, help="resume from this checkpoint")
    p.add_argument("--override", action="store_true",
                   help="resume even though the batch or LR schedule (e.g. --total-tokens) differs from the checkpoint's")
    p.add_argument("--val-batches", type=int, default=8, help="validation micro-batches at the end (0: none)")
    args = p.parse_args(argv)
    for flag, low in (("steps", 1), ("global_batch", 1), ("micro_batch", 1), ("warmup_tokens", 0), ("n_layer", 1),
                      ("d_model", 1), ("seq_len", 2), ("log_every", 1), ("checkpoint_every", 0), ("val_batches", 0)):
        value = getattr(args, flag)
        if value < low:
            p.error(f"--{flag.replace('_', '-')} {value} is not allowed; allowed: a whole number >= {low}")
    if args.total_tokens is not None and args.total_tokens < 1:
        p.error(f"--total-tokens {args.total_tokens} is not allowed; allowed: a whole number >= 1")
    for flag in ("lr", "max_grad_norm"):
        value = getattr(args, flag)
        if not (math.isfinite(value) and value > 0):
            p.error(f"--{flag.replace('_', '-')} {value} is not allowed; allowed: a finite number > 0")
    if bool(args.checkpoint) != bool(args.checkpoint_every):
        p.error(f"--checkpoint {args.checkpoint!r} and --checkpoint-every {args.checkpoint_every} are not allowed; "
                "allowed: both (a path and N >= 1) or neither")
    if args.batch_schedule:
        try:
            parse_step_schedule(args.batch_schedule, lr_rule="sqrt")
        except ValueError as e:
            p.error(f"--batch-schedule: {e}")
    if args.resume and not os.path.isfile(args.resume):
        p.error(f"--resume {args.resume!r} is not allowed; allowed: an existing checkpoint file "
                "(written by --checkpoint); no such file")
    return args


def setup_distributed() -> tuple[int, int, torch.device]:
    """Initialise the process group when launched by torchrun; pick the device."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local_rank)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def main(argv=None) -> int:
    args = parse_args(argv)  # argument errors: one line on stderr, exit code 2
    rank, world, device = setup_distributed()
    try:
        return train(args, rank, world, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}{'…' if len(text) > 300 else ''}"


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> int:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    say = print if rank == 0 else (lambda *a, **k: None)

    try:  # the settings checked by the library (task shape, batch geometry, LR schedule): one-line errors
        task = load_task("tinygpt", n_layer=args.n_layer, d_model=args.d_model, seq_len=args.seq_len,
                         max_corpus_bytes=1_000_000)
        model = task.build_model(args.seed).to(device)
        # Model FLOPs of any (batch, padded width): two FlopCounterMode counts of the plain model, before DDP.
        seq_flops = SequenceFlops(
            model, lambda w: {"input_ids": torch.zeros(1, w, dtype=torch.long, device=device),
                              "labels": torch.zeros(1, w, dtype=torch.long, device=device)},
            lambda m, b: task.loss_sum(m, b)[0], widths=(max(1, task.seq_len // 2), task.seq_len))
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None)
        optimizer = build_optimizer("adamw", model, lr=args.lr, weight_decay=0.1)  # the registry's AdamW (betas 0.9/0.95)

        schedule = (parse_step_schedule(args.batch_schedule, lr_rule="sqrt")
                    if args.batch_schedule else constant_batch(args.global_batch))
        # total tokens for the LR decay: steps × batch × mean loss-bearing tokens per document (an estimate)
        mean_units = float(task.train_lengths.mean()) - 1.0
        total_tokens = (args.total_tokens if args.total_tokens is not None
                        else max(int(args.steps * schedule.batch_at(0) * mean_units), args.warmup_tokens + 1))
        lr_schedule = LRSchedule(peak_lr=args.lr, warmup=args.warmup_tokens, total=total_tokens,
                                 shape=args.lr_shape, min_lr_ratio=0.1)
        try:  # CPU: a measured matmul; CUDA: the A100/H100/H200 table (fp32 here); another GPU: no MFU
            peak = peak_flops_per_s(device=str(device), dtype="fp32")
        except ValueError:
            peak = None
        config = StepConfig(micro_batch=args.micro_batch, batch_schedule=schedule, max_grad_norm=args.max_grad_norm,
                            lr_schedule=lr_schedule, unit="token", seq_len=task.seq_len,
                            peak_flops_per_s=None if peak is None else peak.flops_per_s)
        driver = StepDriver(model, optimizer, config)
    except ValueError as e:
        return fail(str(e))

    if args.resume:
        try:
            load_checkpoint(args.resume, driver, map_location=device, override=args.override)
        except RunMismatch as e:
            shown = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in e.diffs.items())
            return fail(f"--resume {args.resume!r} is not allowed with these settings ({shown}); allowed: the "
                        "checkpoint's values (e.g. --total-tokens as it was), or --override to change them on purpose")
        except Exception as e:  # noqa: BLE001 - a file from elsewhere: corrupt, another model, another version
            return fail(f"--resume {args.resume!r}: cannot resume from it ({_one_line(e)}); allowed: a checkpoint "
                        "written by this script with the same model flags")
        say(f"resumed from {args.resume} at step {driver.optimizer_steps}, "
            f"{fmt_int(driver.consumed_samples)} samples consumed")

    say(f"task {task.name}: {fmt_int(task.num_train_samples)} documents, seq_len {task.seq_len}, "
        f"{fmt_int(sum(p.numel() for p in model.parameters()))} parameters, device {device}; "
        f"~{fmt_int(round(driver.global_batch * mean_units))} loss-bearing tokens per step")
    say(f"peak {peak.flops_per_s / 1e9:,.1f} GFLOP/s per device ({peak.source}); model FLOPs counted "
        f"with FlopCounterMode at widths {seq_flops.widths}" if peak is not None else "peak FLOP/s unknown: no MFU")
    say(f"batch schedule [{schedule}] in tokens, lr {lr_schedule.shape} peak {args.lr:g}, "
        f"warmup {fmt_int(args.warmup_tokens)} tokens, decay over {fmt_int(total_tokens)} tokens")

    # every rank reads the same seeded order of indices; the collate loads only this rank's documents
    windows = rank_windows(task.sample_order(args.seed), driver, collate=lambda ix: task.collate(ix, device),
                           start=driver.consumed_samples)  # resume: skip what was drawn
    t0 = time.perf_counter()
    while driver.optimizer_steps < args.steps:
        window = next(windows)  # this rank's micro-batches at the current global batch (the schedule moves it)
        result = driver.run_window(window, task.loss_sum,
                                   flops_per_micro=[seq_flops(*b["input_ids"].shape) for b in window])
        if result.step % args.log_every == 0 or result.skipped or result.step == args.steps:
            say(f"step {result.step:4d} | loss/token {result.loss_per_unit:.4f} | tokens {result.global_units:5d} "
                f"| grad norm {result.grad_norm:.3f} | lr {result.lr:.2e} | batch {result.global_batch} "
                f"| {result.valid_tokens_per_s:,.0f} valid tok/s"
                + (f" | MFU {result.mfu:.1%}" if result.mfu is not None else "")
                + (" | SKIPPED" if result.skipped else ""))
        if args.checkpoint and args.checkpoint_every and result.step % args.checkpoint_every == 0 \
                and not result.skipped:
            save_checkpoint(args.checkpoint, driver)
    elapsed = time.perf_counter() - t0

    if args.val_batches:
        net = unwrap_model(model).eval()
        loss_total, units_total = 0.0, 0
        with torch.no_grad():
            for batch in itertools.islice(task.val_batches(args.micro_batch * 4), args.val_batches):
                batch = {k: v.to(device) for k, v in batch.items()}
                loss, count = task.loss_sum(net, batch)
                loss_total += float(loss)  # host sync: evaluation, outside the training hot path
                units_total += int(count)
        say(f"validation loss/token {loss_total / units_total:.4f} over {fmt_int(units_total)} tokens")
    say(f"done: {driver.optimizer_steps} steps, {driver.skipped_windows} skipped, "
        f"{fmt_int(driver.consumed_units)} tokens in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
