"""A short training run that measures B_simple along the way (what ``globalbatch noise`` calls)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from globalbatch._util import atomic_write_text
from globalbatch.noise.estimator import NEEDS_TWO_BATCH_SIZES, NoiseScaleEstimate
from globalbatch.noise.monitor import NoiseConfig, NoiseScaleMonitor

__all__ = ["NoiseRunConfig", "NoiseRunResult", "measure_noise", "format_estimate"]

@dataclass(kw_only=True)
class NoiseRunConfig:
    """A short training run of a task that measures B_simple along the way."""

    task: str = "tinygpt"
    """``tinygpt``, ``mnist``, ``package.module:function`` or ``path/file.py:function``."""
    task_overrides: dict[str, Any] = field(default_factory=dict)
    """Keyword overrides for the task (e.g. ``d_model=64``)."""
    micro_batch: int = 8
    """Samples (sequences) per forward/backward on one rank."""
    grad_accum_steps: int = 4
    """Micro-batches per optimizer step on one rank (the small batches of the ``micro`` source)."""
    steps: int = 50
    """Optimizer steps (windows)."""
    lr: float = 1e-3
    """Learning rate, constant (B_simple depends on it: it is logged beside every estimate)."""
    optimizer: str = "adamw"
    """``adamw`` or ``sgd``."""
    seed: int = 0
    """Model init and data order."""
    log_every: int = 5
    """Steps between estimates (each one is a host sync)."""
    half_life_windows: float = 10.0
    """EMA half-life, in windows of the (constant) global batch."""
    adam_variant: bool = False
    """Also report the Adam-preconditioned variant (needs ``optimizer="adamw"``)."""
    device: str | None = None
    """``cpu``, ``cuda``...; default cuda when available."""

    def __post_init__(self) -> None:
        for name, low in (("micro_batch", 1), ("grad_accum_steps", 1), ("steps", 1), ("log_every", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}: {v!r}: must be an int >= {low}")
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr: {self.lr!r}: must be a finite number >= 0")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer: {self.optimizer!r}: expected 'adamw' or 'sgd'")
        if self.adam_variant and self.optimizer != "adamw":
            raise ValueError("adam_variant: True: needs optimizer 'adamw' (its exp_avg_sq)")
        if not self.half_life_windows > 0:
            raise ValueError(f"half_life_windows: {self.half_life_windows!r}: must be > 0")


@dataclass
class NoiseRunResult:
    """Logged rows (one per ``log_every`` steps) and the final estimates."""

    rows: list[dict[str, Any]]
    final: dict[str, NoiseScaleEstimate]
    unit: str
    dp_world_size: int
    csv_path: str | None = None


def _row(step: int, res: Any, estimates: dict[str, NoiseScaleEstimate], keys: Sequence[str]) -> dict[str, Any]:
    row: dict[str, Any] = {"step": step, "units_seen": res.consumed_units, "lr": res.lr,
                           "loss": res.loss_per_unit, "batch_units": res.global_units,
                           "batch_samples": res.global_samples}
    for key in keys:
        e = estimates.get(key)
        name = key.replace("/", "_")
        row.update({f"b_simple_{name}": e.b_simple if e else math.nan, f"stderr_{name}": e.stderr if e else math.nan,
                    f"low_{name}": e.low if e else math.nan, f"high_{name}": e.high if e else math.nan,
                    f"flags_{name}": ("|".join(e.flags) if e else "no_windows")})
    return row


def _csv_text(rows: list[dict[str, Any]]) -> str:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def _tensorboard_writer(log_dir: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # tensorboard is an optional extra
        raise ImportError("tensorboard is not installed: pip install 'globalbatch[tensorboard]'") from exc
    return SummaryWriter(log_dir=log_dir)


def measure_noise(config: NoiseRunConfig, *, out_dir: str | None = None, tensorboard: bool = False,
                  on_row: Any = None) -> NoiseRunResult:
    """Train ``config.steps`` steps of a task through the StepDriver and measure B_simple.

    Runs on one process, or on every rank when launched by ``torchrun`` (gloo on CPU, NCCL
    on GPU; the model is wrapped in DDP and the ``rank`` source is added). Writes
    ``<out_dir>/noise.csv`` (atomically, at every log step) and, with ``tensorboard``,
    scalars under ``<out_dir>/tb``. ``on_row(row)`` is called at every log step on rank 0.

    Raises:
        ValueError: one micro-batch on one rank (:data:`NEEDS_TWO_BATCH_SIZES`), bad config.
        ImportError: ``tensorboard`` requested but not installed.
    """
    import os

    import torch.distributed as dist

    from globalbatch.step import StepConfig, StepDriver
    from globalbatch.tasks import load_task

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if config.grad_accum_steps * world < 2:
        raise ValueError(f"grad_accum_steps: {config.grad_accum_steps}: noise scale {NEEDS_TWO_BATCH_SIZES} "
                         f"(dp_world_size={world})")
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    own_group = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        own_group = True
    rank = dist.get_rank() if world > 1 else 0
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    writer = _tensorboard_writer(os.path.join(out_dir or "runs/noise", "tb")) if tensorboard and rank == 0 else None
    try:
        task = load_task(config.task, **config.task_overrides)
        model = task.build_model(config.seed).to(device)
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = (torch.optim.AdamW(model.parameters(), lr=config.lr) if config.optimizer == "adamw"
               else torch.optim.SGD(model.parameters(), lr=config.lr))
        monitor = NoiseScaleMonitor(model, optimizer=opt, unit=task.unit,
                                    config=NoiseConfig(half_life_windows=config.half_life_windows,
                                                       adam=config.adam_variant))
        driver = StepDriver(model, opt, StepConfig(micro_batch=config.micro_batch,
                                                   global_batch=config.micro_batch * config.grad_accum_steps * world),
                            callbacks=[monitor])
        units = [task.unit] + (["sample"] if task.unit == "token" else [])
        keys = [f"{v}/{u}" for v in monitor._variants() for u in units]
        order = task.sample_order(config.seed)
        rows: list[dict[str, Any]] = []
        csv_path = os.path.join(out_dir, "noise.csv") if out_dir and rank == 0 else None
        for step in range(1, config.steps + 1):
            for i in range(config.grad_accum_steps):
                draw = [next(order) for _ in range(config.micro_batch * world)]  # same stream on every rank
                idx = draw[rank * config.micro_batch:(rank + 1) * config.micro_batch]
                batch = task.collate(idx, device)
                with driver.micro_step(last=i == config.grad_accum_steps - 1):
                    loss_sum, count = task.loss_sum(model, batch)
                    driver.backward(loss_sum, count, samples=len(idx))
            res = driver.step()
            if step % config.log_every == 0 or step == config.steps:
                estimates = monitor.estimates()  # host sync: log steps only
                if rank == 0:
                    row = _row(step, res, estimates, keys)
                    rows.append(row)
                    if csv_path:
                        atomic_write_text(csv_path, _csv_text(rows))
                    if writer is not None:
                        for key, e in estimates.items():
                            for tag, value in e.as_dict(prefix=f"noise/{key.split('/')[0]}/").items():
                                writer.add_scalar(tag, value, step)
                        writer.add_scalar("batch/global_units", res.global_units, step)
                        writer.add_scalar("train/loss_per_unit", res.loss_per_unit, step)
                        writer.add_scalar("train/lr", res.lr, step)
                    if on_row is not None:
                        on_row(row)
        return NoiseRunResult(rows=rows, final=monitor.estimates(), unit=task.unit, dp_world_size=world,
                              csv_path=csv_path)
    finally:
        if writer is not None:
            writer.close()
        if own_group:
            dist.destroy_process_group()


def format_estimate(e: NoiseScaleEstimate, *, digits: int = 3) -> str:
    """``1,234 tokens [95% 1,010–1,530], SE 130`` or the flags when not reportable."""
    def fmt(x: float) -> str:
        if not math.isfinite(x):
            return "n/a"
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.{digits}g}"

    text = f"{fmt(e.b_simple)} {e.unit}s"
    if math.isfinite(e.low):
        text += f" [{e.confidence:.0%} {fmt(e.low)}–{fmt(e.high)}], SE {fmt(e.stderr)}"
    if e.flags:
        text += f" — not reportable: {', '.join(e.flags)}"
    return text
