"""A short training run that measures B_simple along the way (what ``globalbatch noise`` calls), through the lab's one loop."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from globalbatch._util import atomic_write_text
from globalbatch.noise.budget import MonitorCost
from globalbatch.noise.estimator import NoiseScaleEstimate
from globalbatch.noise.monitor import NoiseConfig, NoiseScaleMonitor
from globalbatch.optim import optimizer_names

__all__ = ["NoiseRunConfig", "NoiseRunResult", "measure_noise", "format_estimate", "format_number",
           "format_interval", "check_noise_settings"]

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
    """A name in the optimizer registry (:mod:`globalbatch.optim`), the same recipe as ``sweep``."""
    seed: int = 0
    """Model init and data order."""
    log_every: int = 5
    """Steps between estimates (each one is a host sync)."""
    half_life_windows: float = 10.0
    """EMA half-life, in windows of the (constant) global batch."""
    adam_variant: bool = False
    """Also report the Adam-preconditioned variant (needs ``optimizer="adamw"``)."""
    device: str | None = None
    """``cpu``, ``cuda``, ``cuda:N``, ``mps``; default cuda when available (under torchrun: ``cuda:LOCAL_RANK``)."""
    precision: str = "fp32"
    """``fp32``, ``bf16`` (autocast) or ``fp16`` (autocast + GradScaler)."""
    budget: float | None = None
    """The monitor's cost allowed, a fraction of the bare step time (``NoiseConfig.budget``: it picks how often to
    measure); None: every window is measured."""

    def __post_init__(self) -> None:
        from globalbatch.validate import whole

        whole(self.seed, "seed", minimum=0)  # before anything is created
        if self.budget is not None:
            NoiseConfig(budget=self.budget)  # the one check of a budget
        check_noise_settings(micro_batch=self.micro_batch, grad_accum_steps=self.grad_accum_steps, steps=self.steps,
                             lr=self.lr, optimizer=self.optimizer, log_every=self.log_every,
                             half_life_windows=self.half_life_windows, adam_variant=self.adam_variant)


def check_noise_settings(*, micro_batch: int = 8, grad_accum_steps: int = 4, steps: int = 50, lr: float = 1e-3,
                         optimizer: str = "adamw", log_every: int = 5, half_life_windows: float = 10.0,
                         adam_variant: bool = False, threads: int | None = None, world_size: int | None = None,
                         names: dict[str, str] | None = None) -> None:
    """Raise a :class:`~globalbatch.errors.SettingError` for the first bad setting, before anything runs.

    ``names`` maps a setting to how the user wrote it (the CLI passes its typer-derived flags); a
    setting not in it is named by its field name. ``world_size`` (processes, ``WORLD_SIZE``)
    enables the check that a window has at least two small batches.
    """
    from globalbatch import validate as V
    from globalbatch.errors import SettingError, flag_names

    with flag_names(names or {}):  # the CLI's flags for the fields it knows
        for setting, value in (("micro_batch", micro_batch), ("grad_accum_steps", grad_accum_steps), ("steps", steps),
                               ("log_every", log_every), ("threads", threads)):
            if value is not None or setting != "threads":
                V.whole(value, setting)
        V.number(lr, "lr", low=0.0)
        V.choice(optimizer, "optimizer", optimizer_names())
        if adam_variant and optimizer != "adamw":
            raise SettingError("adam_variant", True, "optimizer adamw (the variant needs its exp_avg_sq)",
                               why=f"with optimizer {optimizer}", see={"optimizer": "optimizer"})
        if half_life_windows != math.inf:  # inf: no decay, a plain mean over every window
            V.positive(half_life_windows, "half_life_windows", allowed="a number > 0 (windows)")
        if world_size is not None and grad_accum_steps * world_size < 2:
            raise SettingError("grad_accum_steps", grad_accum_steps, "≥ 2, or ≥ 2 processes (torchrun)",
                               why="one process gives no second batch size")


@dataclass
class NoiseRunResult:
    """Logged rows (one per ``log_every`` steps) and the final estimates."""

    rows: list[dict[str, Any]]
    final: dict[str, NoiseScaleEstimate]
    unit: str
    dp_world_size: int
    csv_path: str | None = None
    cost: MonitorCost | None = None
    """What the monitor measured of its own cost and the windows it measured (rank 0)."""


def _row(step: int, res: Any, estimates: dict[str, NoiseScaleEstimate], keys: Sequence[str]) -> dict[str, Any]:
    row: dict[str, Any] = {"step": step, "units_seen": res.consumed_units, "lr": res.lr,
                           "loss": res.loss_per_unit, "batch_units": res.global_units,
                           "batch_samples": res.global_samples,
                           # this window's throughput (noise monitoring included); nan when not known
                           "valid_tokens_per_s": math.nan if res.valid_tokens_per_s is None else res.valid_tokens_per_s,
                           "mfu": math.nan if res.mfu is None else res.mfu}
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

    from globalbatch.lab.device import resolve_device
    from globalbatch.lab.loop import Experiment
    from globalbatch.lab.tasks import load_task_checked

    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_noise_settings(grad_accum_steps=config.grad_accum_steps, world_size=world)
    device = resolve_device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    own_group = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        own_group = True
    rank = dist.get_rank() if world > 1 else 0
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    task = load_task_checked(config.task, config.task_overrides)  # before the TensorBoard writer makes files
    writer = _tensorboard_writer(os.path.join(out_dir or "runs/noise", "tb")) if tensorboard and rank == 0 else None
    try:
        noise_config = NoiseConfig(half_life_windows=config.half_life_windows, adam=config.adam_variant,
                                   budget=config.budget)
        exp = Experiment(task, batch=config.micro_batch * config.grad_accum_steps * world, micro_batch=config.micro_batch,
                         optimizer=config.optimizer, lr=config.lr, seed=config.seed, device=device,
                         precision=config.precision, ddp=world > 1, measure_flops=True,
                         callbacks=lambda model, opt: [NoiseScaleMonitor(model, optimizer=opt, unit=task.unit,
                                                                         config=noise_config)])
        monitor = exp.driver.callbacks[0]
        units = [task.unit] + (["sample"] if task.unit == "token" else [])
        keys = [f"{v}/{u}" for v in monitor._variants() for u in units]
        order = task.sample_order(config.seed)
        rows: list[dict[str, Any]] = []
        csv_path = os.path.join(out_dir, "noise.csv") if out_dir and rank == 0 else None
        for step in range(1, config.steps + 1):
            res = exp.train_window(order).result  # every rank draws the same stream and trains its own slice
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
        final = monitor.estimates()
        final = {**{k: final[k] for k in keys if k in final}, **final}  # the curve's column order: loss unit first
        return NoiseRunResult(rows=rows, final=final, unit=task.unit, dp_world_size=world, csv_path=csv_path,
                              cost=monitor.cost())
    finally:
        if writer is not None:
            writer.close()
        if own_group:
            dist.destroy_process_group()


def format_number(x: float, digits: int = 3) -> str:
    """``10689.3`` → ``'10,700'``, ``262.4`` → ``'262'``, ``0.4697`` → ``'0.47'``: ``digits`` significant
    figures, thousands separators, never an exponent from 1e-4 up; ``'n/a'`` when not finite."""
    if not math.isfinite(x):
        return "n/a"
    if x == 0:
        return "0"
    rounded = float(f"{x:.{digits}g}")
    if abs(rounded) >= 10 ** (digits - 1):
        return f"{rounded:,.0f}"
    decimals = digits - 1 - math.floor(math.log10(abs(rounded)))
    if decimals > 8:  # tiny: keep the exponent rather than a run of zeros
        return f"{rounded:.{digits - 1}e}"
    return f"{rounded:.{decimals}f}".rstrip("0").rstrip(".")


_FLAG_TEXT = {"no_windows": "no windows yet", "few_windows": "few windows", "g_sq_nonpositive": "|G|² ≤ 0: no signal",
              "too_noisy": "too noisy", "wide_interval": "interval wider than 2×"}


def format_interval(b_simple: float, low: float, high: float, flags: Sequence[str] | str = ()) -> str:
    """``'262 [160, 1,070]'``, or the flags instead of an interval that is not bounded:
    ``'262 (too noisy: interval unbounded)'``, ``'262 [0, 3,150] (too noisy)'``."""
    if isinstance(flags, str):
        flags = [f for f in flags.split("|") if f]
    bounded = math.isfinite(low) and math.isfinite(high)
    text = format_number(b_simple)
    if bounded:
        text += f" [{format_number(low)}, {format_number(high)}]"
    notes = [_FLAG_TEXT.get(f, f) for f in flags]
    if not bounded and "no_windows" not in flags:
        if "too_noisy" in flags:
            notes[notes.index("too noisy")] = "too noisy: interval unbounded"
        else:
            notes.append("interval unbounded")
    return text + (f" ({'; '.join(notes)})" if notes else "")


def format_estimate(e: NoiseScaleEstimate, *, digits: int = 3) -> str:
    """``1,230 tokens [95% 1,010, 1,530], SE 130``, or the flags instead of an unbounded interval:
    ``262 tokens (too noisy: interval unbounded; not reportable)``."""
    text = f"{format_number(e.b_simple, digits)} {e.unit}s"
    if math.isfinite(e.low) and math.isfinite(e.high):
        text += f" [{e.confidence:.0%} {format_number(e.low, digits)}, {format_number(e.high, digits)}]"
        if math.isfinite(e.stderr):
            text += f", SE {format_number(e.stderr, digits)}"
    notes = [_FLAG_TEXT.get(f, f) for f in e.flags]
    if not (math.isfinite(e.low) and math.isfinite(e.high)) and "no_windows" not in e.flags:
        if "too_noisy" in e.flags:
            notes[notes.index("too noisy")] = "too noisy: interval unbounded"
        else:
            notes.append("interval unbounded")
    if notes:
        text += f" ({'; '.join(notes)}; not reportable)"
    return text
