"""How the driver forms a step (:class:`StepConfig`) and what one step did (:class:`StepResult`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, cast

from globalbatch.errors import SettingError
from globalbatch.plan import BatchGeometry, solve_geometry
from globalbatch.schedule import SCHEDULE_UNITS, BatchSchedule, LRSchedule, constant_batch
from globalbatch.validate import choice, number, whole


class NonFiniteError(RuntimeError):
    """Raised after ``max_consecutive_skips`` windows in a row were skipped."""


def plan_for_world(global_batch: int, micro_batch: int, dp_world_size: int) -> BatchGeometry:
    """The geometry of a fixed global batch on ``dp_world_size`` ranks.

    ``grad_accum_steps = global_batch / (micro_batch × dp_world_size)``; a world size
    that does not divide is a ``ValueError`` quoting the numbers, never a silent change.
    """
    return solve_geometry(global_batch=global_batch, micro_batch=micro_batch, dp_world_size=dp_world_size)


@dataclass(kw_only=True, frozen=True, slots=True)
class StepConfig:
    """How the driver forms one optimizer step: every quantity of the batch is given here, once."""

    micro_batch: int
    """Samples (sequences) per forward/backward on one DP rank: the most any micro-batch may hold
    (:func:`globalbatch.windows.rank_windows` cuts windows to it; ``backward(samples=)`` above it is an error)."""
    global_batch: Optional[int] = None
    """Samples per optimizer step over all ranks and micro-steps (fixed). Give this or ``batch_schedule``."""
    batch_schedule: Optional[BatchSchedule] = None
    """A global batch that grows with the trained units (see :mod:`globalbatch.schedule`); an adaptive
    schedule (:mod:`globalbatch.adaptive`) is also the driver's last ``on_step_end`` callback: pass it here only."""
    lr_schedule: Optional[LRSchedule] = None
    """The LR over trained units; sets every param group's LR before each step (groups keep
    their initial LR ratios to the first group)."""
    unit: str = "token"
    """The run's unit, said once: what ``count`` counts (``"token"``: the loss-bearing tokens, and
    ``valid_tokens_per_s`` is reported; ``"sample"``: a per-sample loss) and what the positions of both
    schedules count."""
    max_grad_norm: Optional[float] = None
    """Clip the global gradient norm (after accumulation and unscaling) to this; None: no clipping."""
    max_consecutive_skips: int = 8
    """Raise :class:`NonFiniteError` when this many windows in a row were skipped."""
    flops_per_sample: Optional[float] = None
    """Model FLOPs (forward + backward) per sample, for micro-batches whose ``backward`` gets no
    ``flops=`` (e.g. ``globalbatch.flops.transformer_flops_per_token(...) × seq_len``, or a
    :class:`globalbatch.flops.FlopsCounter` count ÷ micro_batch); None: no FLOPs unless given per micro-batch."""
    peak_flops_per_s: Optional[float] = None
    """Peak FLOP/s of one device (``globalbatch.flops.peak_flops_per_s``); with FLOPs it gives ``mfu``."""
    seq_len: Optional[int] = None
    """Token slots per sample (the padded context), for the batch arithmetic printed at start; None: not shown."""
    print_geometry: bool = True
    """Print the batch arithmetic once, on rank 0, when the first window starts
    (``global batch 16 seq = 2 ranks × 4 accum × 2 seq; tokens per step ≤ …``) to stdout, like nanoGPT's
    "tokens per iteration will be". False: silent (:meth:`StepDriver.describe` returns the line)."""
    check_summed_loss: bool = True
    """Refuse a loss whose last operation is a mean (``.mean()``, a ``reduction="mean"`` loss such as
    ``F.cross_entropy``'s default, a division such as ``loss_sum / count``): the driver needs the sum. Read from
    the autograd graph (no host sync). False: no check (a loss that legitimately ends in a division)."""
    loss_unit: Optional[str] = None
    """Deprecated alias of ``unit`` (FutureWarning)."""

    def __post_init__(self) -> None:
        whole(self.micro_batch, "micro_batch")
        if (self.global_batch is None) == (self.batch_schedule is None):
            raise SettingError("global_batch", self.global_batch,
                               "exactly one of global_batch and batch_schedule", why=f"batch_schedule {self.batch_schedule!r}")
        if self.global_batch is not None:
            whole(self.global_batch, "global_batch")
        if self.batch_schedule is not None and not isinstance(self.batch_schedule, BatchSchedule):
            raise SettingError("batch_schedule", self.batch_schedule,
                               "a BatchSchedule (parse strings with globalbatch.schedule.parse_step_schedule)")
        if self.max_grad_norm is not None:
            number(self.max_grad_norm, "max_grad_norm", low=0.0, low_open=True, allowed="a finite number > 0 or None")
        if self.lr_schedule is not None and not isinstance(self.lr_schedule, LRSchedule):
            raise SettingError("lr_schedule", self.lr_schedule, "an LRSchedule or None")
        if self.loss_unit is not None:
            choice(self.loss_unit, "loss_unit", SCHEDULE_UNITS)
            warnings.warn("StepConfig(loss_unit=...) is deprecated; use StepConfig(unit=...): one unit for the loss "
                          "count and the schedules", FutureWarning, stacklevel=3)
            if self.unit != "token" and self.unit != self.loss_unit:
                raise SettingError("loss_unit", self.loss_unit, f"the same as unit {self.unit!r} (loss_unit is its "
                                   "deprecated alias)")
            object.__setattr__(self, "unit", self.loss_unit)  # frozen: the alias becomes the one field
            object.__setattr__(self, "loss_unit", None)
        choice(self.unit, "unit", SCHEDULE_UNITS)
        legacy = [(name, s.unit) for name, s in (("lr_schedule", self.lr_schedule), ("batch_schedule", self.batch_schedule))
                  if s is not None and s.unit is not None]
        if len(legacy) == 2 and legacy[0][1] != legacy[1][1]:
            raise SettingError("lr_schedule unit", legacy[0][1], f"batch_schedule unit {legacy[1][1]!r} (one unit for "
                               "both: say it once, in StepConfig.unit)")
        whole(self.max_consecutive_skips, "max_consecutive_skips")
        for name in ("flops_per_sample", "peak_flops_per_s"):
            v = getattr(self, name)
            if v is not None:
                number(v, name, low=0.0, low_open=True, allowed="a finite number > 0 or None")
        if self.seq_len is not None:
            whole(self.seq_len, "seq_len")

    @property
    def position_unit(self) -> str:
        """What the schedule positions count: ``unit``, or the deprecated ``unit=`` a schedule was built with."""
        for s in (self.lr_schedule, self.batch_schedule):
            if s is not None and s.unit is not None:
                return s.unit
        return self.unit

    def schedule(self) -> BatchSchedule:
        """The batch schedule (a constant one for a fixed ``global_batch``)."""
        if self.batch_schedule is not None:
            return self.batch_schedule
        return constant_batch(cast(int, self.global_batch))  # one of the two is set (checked in __post_init__)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """What one call of :meth:`StepDriver.step` did. All values were read in the step's single host sync."""

    step: int
    """Optimizer steps applied so far (after this window)."""
    window: int
    """Windows seen so far, skipped ones included (after this window)."""
    skipped: bool
    """True when the window was skipped (non-finite loss/gradient on some rank, or no loss-bearing units)."""
    loss_per_unit: float
    """Global summed loss / global loss-bearing units (the token-mean loss of this global batch)."""
    global_units: int
    """Loss-bearing units (tokens, or samples for per-sample losses) in the window, all ranks."""
    global_samples: int
    """Samples (sequences) in the window, all ranks."""
    grad_norm: float
    """Global L2 norm of the normalized, unscaled gradient *before* clipping (after the DP all-reduce)."""
    lr: float
    """Learning rate of the first param group used by this step (unchanged when skipped)."""
    global_batch: int
    """Planned global batch (samples) of this window."""
    units_per_s: float
    """Loss-bearing units per second since the previous step returned."""
    consumed_units: int
    """Loss-bearing units drawn so far, skipped windows included."""
    valid_tokens_per_s: Optional[float] = None
    """Non-padding tokens per second, all ranks (= ``units_per_s`` when ``StepConfig.unit`` is
    ``"token"``; None for a per-sample loss)."""
    model_flops: Optional[float] = None
    """Model FLOPs of this window, all ranks (forward + backward; None when no FLOPs were supplied)."""
    model_flops_per_s: Optional[float] = None
    """``model_flops`` over the seconds since the previous step returned."""
    mfu: Optional[float] = None
    """Model FLOPs utilization: ``model_flops_per_s / (dp_world_size × peak_flops_per_s)`` (needs both)."""
