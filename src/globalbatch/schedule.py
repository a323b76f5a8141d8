"""Batch-size and learning-rate schedules measured in consumed tokens or samples.

Two kinds of schedule, both functions of the *schedule position*: the loss-bearing
tokens (or samples) of the optimizer steps applied so far. Skipped windows do not
advance it (Megatron-LM does the same for its LR scheduler).

* **Batch schedules** give the global batch (in samples/sequences) at a position:

  - :class:`StepBatchSchedule`, Megatron-LM's ``--step-batch-size-schedule``
    semantics: ``"0:256 2B:512 8B:1024"`` means 256 sequences per step until 2
    billion units are consumed, 512 until 8 billion, then 1,024. Thresholds take
    K/M/B/T (decimal) suffixes, the first must be 0, they strictly increase, and the
    batch only grows.
  - :class:`RampupBatchSchedule`, Megatron-LM's ``--rampup-batch-size start incr
    ramp`` semantics: ``batch = start + floor(position / (ramp / n)) × incr`` with
    ``n = (final − start) / incr`` increments, and ``final`` from ``ramp`` on.

  At every change the learning rate is multiplied by ``scale_lr`` of
  :mod:`globalbatch.plan` (``sqrt`` for Adam-type optimizers, ``linear`` for SGD,
  ``none``) relative to the schedule's first batch, and the change is logged::

      global batch 256 -> 512 at 2,000,000,000 tokens; lr 3e-4 -> 4.24e-4 (sqrt)

* **LR schedules** (:class:`TokenLRSchedule`: constant, linear, cosine, WSD =
  warmup-stable-decay) are defined over the same position, so a batch change moves
  along the curve at a different pace but neither stretches nor breaks it: the LR
  after 1M tokens is the same whatever batch sizes got there.

Pure Python, no torch import.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

from globalbatch.errors import Raw, SettingError
from globalbatch.plan import LR_RULES, fmt_int, parse_count, scale_lr
from globalbatch.validate import whole

__all__ = [
    "SCHEDULE_UNITS",
    "BatchSchedule",
    "StepBatchSchedule",
    "RampupBatchSchedule",
    "constant_batch",
    "parse_step_schedule",
    "format_batch_change",
    "format_lr",
    "format_lrs",
    "LRSchedule",
    "TokenLRSchedule",
    "LR_SHAPES",
    "list_lr_shapes",
]

SCHEDULE_UNITS = ("token", "sample")
"""What a schedule position counts: loss-bearing tokens or samples (sequences). Said once, in
``StepConfig.unit``; the schedules themselves carry no unit."""


def _check_unit(unit: Optional[str], owner: str = "a schedule") -> None:
    """The deprecated per-schedule ``unit=``: None (the run's unit, ``StepConfig.unit``) or a warned legacy value."""
    if unit is None:
        return
    if unit not in SCHEDULE_UNITS:
        raise SettingError("unit", unit, ", ".join(SCHEDULE_UNITS))
    warnings.warn(f"unit= on {owner} is deprecated: say the unit once, in StepConfig(unit={unit!r}); the schedule "
                  "then counts the run's unit", FutureWarning, stacklevel=4)


def _whole_count(value: object, field_name: str, allowed: str) -> int:
    """An int as is; an integral float or a count string (``"2B"``, ``"375M"``) via ``plan.parse_count``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SettingError(field_name, value, allowed)
    if isinstance(value, int):
        return value
    return parse_count(value, field_name)


def _check_rule(rule: str) -> None:
    if rule not in LR_RULES:
        raise SettingError("lr_rule", rule, ", ".join(LR_RULES))


def _fixed_ok(lr: float) -> bool:
    """True when ``lr`` reads well in plain ``.3g`` notation (0, or 1e-3 <= |lr| < 1e3 after rounding)."""
    r = abs(float(f"{lr:.3g}"))
    return r == 0 or 1e-3 <= r < 1e3


def _format_sci(lr: float) -> str:
    """3 significant digits in scientific notation, trailing zeros and the exponent's padding dropped."""
    if lr == 0:
        return "0"
    mantissa, exponent = f"{lr:.2e}".split("e")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def format_lr(lr: float) -> str:
    """``3e-4`` → ``'3e-4'``, ``4.2426e-4`` → ``'4.24e-4'``, ``0.01`` → ``'0.01'``."""
    return f"{lr:.3g}" if _fixed_ok(lr) else _format_sci(lr)


def format_lrs(*lrs: float) -> list[str]:
    """Several LRs in one notation: plain ``.3g`` when all read well that way, else all scientific.

    ``(0.01, 0.0141)`` → ``['0.01', '0.0141']``; ``(9.93e-4, 1.4e-3)`` → ``['9.93e-4', '1.4e-3']``
    (never ``9.93e-4 -> 0.0014``).
    """
    if all(_fixed_ok(x) for x in lrs):
        return [f"{x:.3g}" for x in lrs]
    return [_format_sci(x) for x in lrs]


def format_batch_change(
    old_batch: int, new_batch: int, position: int, unit: str, lr_old: float, lr_new: float, rule: str
) -> str:
    """The log line of a batch change, e.g. ``global batch 256 -> 512 at 2,000,000,000 tokens; lr 3e-4 -> 4.24e-4 (sqrt)``.

    Both LRs use the same notation (see :func:`format_lrs`).
    """
    old_s, new_s = format_lrs(lr_old, lr_new)
    return (
        f"global batch {fmt_int(old_batch)} -> {fmt_int(new_batch)} at {fmt_int(position)} {unit}s; "
        f"lr {old_s} -> {new_s} ({rule})"
    )


class BatchSchedule:
    """A global batch (samples per optimizer step) as a function of the schedule position.

    Subclasses set :attr:`unit` and :attr:`lr_rule` and implement :meth:`batch_at`
    and :meth:`all_batches`.
    """

    unit: Optional[str]
    """Deprecated: None — positions count the run's unit (``StepConfig.unit``)."""
    lr_rule: str
    """How the LR follows the batch: ``"sqrt"``, ``"linear"`` or ``"none"``."""

    def batch_at(self, position: int) -> int:
        """The global batch, in samples, once ``position`` units have been trained on."""
        raise NotImplementedError

    def all_batches(self) -> list[int]:
        """Every global batch this schedule can produce, ascending (for up-front geometry checks)."""
        raise NotImplementedError

    @property
    def first_batch(self) -> int:
        """The batch at position 0; LR multipliers are relative to it."""
        return self.batch_at(0)

    def lr_multiplier(self, global_batch: int) -> float:
        """``scale_lr(1, first_batch, global_batch, lr_rule)``: the factor on the base LR."""
        return scale_lr(1.0, self.first_batch, global_batch, self.lr_rule)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepBatchSchedule(BatchSchedule):
    """Piecewise-constant global batch (Megatron-LM ``--step-batch-size-schedule``)."""

    steps: tuple[tuple[int, int], ...]
    """``(threshold, global_batch)`` pairs: from ``threshold`` consumed units on, use ``global_batch``."""
    unit: Optional[str] = None
    """Deprecated (FutureWarning): thresholds count the run's unit, ``StepConfig.unit``."""
    lr_rule: str = "sqrt"
    """LR rule applied at each change: ``"sqrt"`` (Adam-type), ``"linear"`` (SGD) or ``"none"``."""

    def __post_init__(self) -> None:
        _check_unit(self.unit, "StepBatchSchedule")
        _check_rule(self.lr_rule)
        if not self.steps:
            raise SettingError("batch schedule", Raw("()"), "at least one THRESHOLD:BATCH entry starting at 0",
                               why="it is empty")
        for t, b in self.steps:
            whole(t, "batch schedule threshold", minimum=0)
            whole(b, "batch schedule batch")
        if self.steps[0][0] != 0:
            raise SettingError("batch schedule first threshold", Raw(fmt_int(self.steps[0][0])), "0")
        for (t0, b0), (t1, b1) in zip(self.steps, self.steps[1:]):
            if t1 <= t0:
                raise SettingError("batch schedule thresholds", Raw(f"{fmt_int(t0)} then {fmt_int(t1)}"),
                                   "strictly increasing thresholds", why="they are not strictly increasing")
            if b1 <= b0:
                raise SettingError("batch schedule batch", Raw(f"{b0} then {b1} at {fmt_int(t1)}"),
                                   "each batch > the previous", why="it does not grow")

    def batch_at(self, position: int) -> int:
        if position < 0:
            raise SettingError("position", position, ">= 0")
        batch = self.steps[0][1]
        for threshold, b in self.steps:
            if position >= threshold:
                batch = b
            else:
                break
        return batch

    def all_batches(self) -> list[int]:
        return [b for _, b in self.steps]

    def stages(self, *, total: int, micro_batch: int, dp_world_size: int,
               units_per_sample: int = 1) -> list["BatchStage"]:
        """The schedule's stages up to ``total`` units: each one's geometry (checked: every batch must divide
        by micro × dp) and its optimizer steps as the driver takes them: a stage's batch from the first step that
        starts at or past its threshold, so a step that overshoots a threshold counts in the stage before (full
        steps of ``units_per_sample`` units per sample)."""
        from globalbatch.plan import solve_geometry

        whole(total, "total", minimum=1)
        whole(units_per_sample, "units_per_sample")
        out = []
        ends = [t for t, _ in self.steps[1:]] + [total]
        position = 0  # as the driver runs it: a stage's batch from the first step that starts at or past its threshold
        for (start, batch), end in zip(self.steps, ends):
            if start >= total:
                break
            geo = solve_geometry(global_batch=batch, micro_batch=micro_batch, dp_world_size=dp_world_size)
            per_step = batch * units_per_sample
            steps = max(0, -(-(min(end, total) - position) // per_step))  # 0: the last step before overshot it
            position += steps * per_step
            out.append(BatchStage(start=start, end=min(end, total), global_batch=batch,
                                  grad_accum_steps=geo.grad_accum_steps, units_per_step=per_step,
                                  optimizer_steps=steps))
        return out

    def __str__(self) -> str:
        return " ".join(f"{t}:{b}" for t, b in self.steps)


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchStage:
    """One stage of a batch schedule over a run (:meth:`StepBatchSchedule.stages`)."""

    start: int
    """First consumed unit of the stage."""
    end: int
    """Consumed units at its end (the next threshold, or the run's total)."""
    global_batch: int
    """Samples per optimizer step in the stage."""
    grad_accum_steps: int
    """Micro-batches per step per rank: global_batch ÷ (micro_batch × dp_world_size)."""
    units_per_step: int
    """global_batch × units per sample (tokens for a language model)."""
    optimizer_steps: int
    """Steps at this batch: from where the previous stage's last step ended, ⌈(end − that) ÷ units_per_step⌉
    (0 when that step already passed ``end``)."""


_ENTRY = re.compile(r"^\s*([^:\s]+)\s*:\s*([^:\s]+)\s*$")


def parse_step_schedule(text: str, *, unit: Optional[str] = None, lr_rule: str = "sqrt") -> StepBatchSchedule:
    """Parse ``"0:256 2B:512 8B:1024"`` (spaces or commas between entries).

    Thresholds accept K/M/B/T decimal suffixes and count the run's unit (``StepConfig.unit``; ``unit=`` is
    deprecated); batches are whole samples.
    Raises a one-line ``ValueError`` naming the offending entry.
    """
    if not isinstance(text, str) or not text.strip():
        raise SettingError("batch schedule", text, "entries THRESHOLD:BATCH, e.g. '0:256 2B:512'", why="it is empty")
    steps = []
    for entry in re.split(r"[\s,]+", text.strip()):
        m = _ENTRY.match(entry)
        if m is None:
            raise SettingError("batch schedule entry", entry, "THRESHOLD:BATCH, e.g. '0:256 2B:512 8B:1024'",
                               why="it is not THRESHOLD:BATCH")
        threshold = parse_count(m.group(1), "batch schedule threshold")
        batch = parse_count(m.group(2), "batch schedule batch")
        steps.append((threshold, batch))
    return StepBatchSchedule(steps=tuple(steps), unit=unit, lr_rule=lr_rule)


def constant_batch(global_batch: int, *, unit: Optional[str] = None) -> StepBatchSchedule:
    """A schedule that never changes: ``0:global_batch``."""
    return StepBatchSchedule(steps=((0, global_batch),), unit=unit, lr_rule="none")


@dataclass(frozen=True, kw_only=True, slots=True)
class RampupBatchSchedule(BatchSchedule):
    """Linear batch ramp-up in equal increments (Megatron-LM ``--rampup-batch-size``)."""

    start: int
    """Global batch (samples) at position 0."""
    increment: int
    """Samples added at each ramp step."""
    ramp: int
    """Units of the run (``StepConfig.unit``: tokens or samples) over which the batch grows from ``start`` to ``final``.
    All four numbers also take a count string (``"300K"``) or an integral float, stored as an int."""
    final: int
    """Global batch from ``ramp`` units on."""
    unit: Optional[str] = None
    """Deprecated (FutureWarning): ``ramp`` counts the run's unit, ``StepConfig.unit``."""
    lr_rule: str = "sqrt"
    """LR rule applied at each change: ``"sqrt"``, ``"linear"`` or ``"none"``."""

    def __post_init__(self) -> None:
        _check_unit(self.unit, "RampupBatchSchedule")
        _check_rule(self.lr_rule)
        for name in ("start", "increment", "ramp", "final"):
            allowed = "a whole number >= 1 (or a count such as '300K')"
            v = _whole_count(getattr(self, name), f"rampup {name}", allowed)
            if v < 1:
                raise SettingError(f"rampup {name}", v, allowed)
            object.__setattr__(self, name, v)  # frozen: store the parsed int
        if self.final <= self.start:
            raise SettingError("rampup final", self.final, f"> start {self.start}")
        if (self.final - self.start) % self.increment:
            raise SettingError("rampup increment", self.increment, "a divisor of final − start",
                               why=f"rampup interval final {self.final} - start {self.start} = {self.final - self.start} "
                                   f"is not divisible by increment {self.increment}")

    @property
    def num_increments(self) -> int:
        """``(final − start) / increment``."""
        return (self.final - self.start) // self.increment

    def batch_at(self, position: int) -> int:
        if position < 0:
            raise SettingError("position", position, ">= 0")
        if position >= self.ramp:
            return self.final
        # floor(position / (ramp / n)) in exact integer arithmetic
        steps = position * self.num_increments // self.ramp
        return min(self.start + steps * self.increment, self.final)

    def all_batches(self) -> list[int]:
        return list(range(self.start, self.final + 1, self.increment))


# ---------------------------------------------------------------------------
# LR schedules over tokens (or samples)
# ---------------------------------------------------------------------------


def _shape_constant(progress: float, decay_fraction: float) -> float:
    return 1.0


def _shape_linear(progress: float, decay_fraction: float) -> float:
    return 1.0 - progress


def _shape_cosine(progress: float, decay_fraction: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _shape_wsd(progress: float, decay_fraction: float) -> float:
    # stable until the last `decay_fraction` of the post-warmup span, then linear to 0
    start = 1.0 - decay_fraction
    if progress <= start:
        return 1.0
    return max(0.0, (1.0 - progress) / decay_fraction)


LR_SHAPES: dict[str, Callable[[float, float], float]] = {
    "constant": _shape_constant,
    "linear": _shape_linear,
    "cosine": _shape_cosine,
    "wsd": _shape_wsd,
}
"""Post-warmup shapes: progress in [0, 1] → factor in [0, 1], mapped onto [min_lr_ratio, 1]."""


def list_lr_shapes() -> list[str]:
    """Names accepted by :attr:`TokenLRSchedule.shape`."""
    return sorted(LR_SHAPES)


@dataclass(frozen=True, kw_only=True, slots=True)
class LRSchedule:
    """Learning rate as a function of the trained units of the run (tokens or samples: ``StepConfig.unit``),
    not of optimizer steps.

    ``lr_at(p)``: linear warmup ``peak_lr × p / warmup`` for ``p < warmup``; then
    ``peak_lr × (r + (1 − r) × shape(progress))`` with ``r = min_lr_ratio`` and
    ``progress = (p − warmup) / (total − warmup)`` clamped to [0, 1]. The step driver
    evaluates it at the position *after* the step it applies to, so the first step
    of a warmup has a small non-zero LR.
    """

    peak_lr: float
    """LR after warmup (before any batch-schedule multiplier)."""
    total: int
    """Units (tokens or samples) at which the decay ends; beyond it the LR stays at ``min_lr_ratio × peak_lr``.
    A count string (``"2B"``) or an integral float (``1e9``) is accepted and stored as an int."""
    warmup: int = 0
    """Units of linear warmup from 0 to ``peak_lr`` (``"375M"`` and integral floats accepted, as for ``total``)."""
    shape: str = "cosine"
    """Post-warmup shape: ``"constant"``, ``"linear"``, ``"cosine"`` or ``"wsd"`` (warmup-stable-decay)."""
    min_lr_ratio: float = 0.0
    """Final LR as a fraction of ``peak_lr``."""
    decay_fraction: float = 0.2
    """WSD only: fraction of the post-warmup span spent decaying (linearly) at the end."""
    unit: Optional[str] = None
    """Deprecated (FutureWarning): positions count the run's unit, ``StepConfig.unit``."""

    def __post_init__(self) -> None:
        _check_unit(self.unit, "the LR schedule")
        if self.shape not in LR_SHAPES:
            raise SettingError("lr shape", self.shape, ", ".join(list_lr_shapes()))
        if not (isinstance(self.peak_lr, (int, float)) and self.peak_lr > 0 and math.isfinite(self.peak_lr)):
            raise SettingError("peak_lr", self.peak_lr, "a finite number > 0")
        for name in ("total", "warmup"):
            allowed = "a whole number of units >= 0 (or a count such as '2B' or '375M')"
            v = _whole_count(getattr(self, name), name, allowed)
            if v < 0:
                raise SettingError(name, v, allowed)
            object.__setattr__(self, name, v)  # frozen: store the parsed int
        if self.total < 1:
            raise SettingError("total", self.total, ">= 1")
        if self.warmup > self.total:
            raise SettingError("warmup", Raw(fmt_int(self.warmup)), f"<= total {fmt_int(self.total)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise SettingError("min_lr_ratio", self.min_lr_ratio, "0 <= ratio <= 1")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise SettingError("decay_fraction", self.decay_fraction, "0 < fraction <= 1")

    def factor_at(self, position: float) -> float:
        """``lr_at(position) / peak_lr``."""
        if position < 0:
            raise SettingError("position", position, ">= 0")
        if position < self.warmup:
            return position / self.warmup
        span = self.total - self.warmup
        progress = 1.0 if span == 0 else min(1.0, (position - self.warmup) / span)
        r = self.min_lr_ratio
        return r + (1.0 - r) * LR_SHAPES[self.shape](progress, self.decay_fraction)

    def lr_at(self, position: float) -> float:
        """The learning rate once ``position`` units have been trained on."""
        return self.peak_lr * self.factor_at(position)



@dataclass(frozen=True, kw_only=True, slots=True)
class TokenLRSchedule(LRSchedule):
    """Deprecated name of :class:`LRSchedule` (FutureWarning): its positions count the run's unit, which may be
    samples, so the name no longer says it."""

    def __post_init__(self) -> None:
        warnings.warn("TokenLRSchedule is deprecated: use LRSchedule (its positions count the run's unit, "
                      "StepConfig.unit)", FutureWarning, stacklevel=3)
        LRSchedule.__post_init__(self)
