"""The exact global-batch optimizer step: a driver that plugs into the user's own loop.

The user keeps the loop and the data loader. For each micro-batch they compute the
**summed** loss and its count of loss-bearing units (the tokens that are *targets* of the
loss, or samples) and hand both to the driver; after the last micro-batch of the window they call
:meth:`StepDriver.step`. The result is the optimizer step of the token-mean loss
over the whole global batch, whatever the padding, the micro-batch sizes, the
number of DP ranks or a short last window::

    driver = StepDriver(ddp_model, opt, StepConfig(micro_batch=2, global_batch=16, max_grad_norm=1.0))
    for window in rank_windows(documents, driver, collate=collate):   # this rank's micro-batches
        result = driver.run_window(window, causal_lm_loss)            # (globalbatch.windows, .losses)

    # run_window, written out:
    for i, micro in enumerate(window):
        with driver.micro_step(last=i == len(window) - 1):   # DDP no_sync around fwd AND bwd
            loss_sum, count = loss_fn(ddp_model, micro)
            driver.backward(loss_sum, count, samples=window.samples[i])
    result = driver.step()                           # sync, normalize, clip, skip or step

Per window the driver

1. runs micro-steps 0..M−2 without gradient sync (DDP ``no_sync`` around forward
   *and* backward, FSDP2 ``set_requires_gradient_sync(False)``) and syncs on the last;
2. back-propagates the summed loss, so ``.grad`` accumulates Σ ∇loss_sum;
3. under DP, all-reduces once a float64 vector ``[count, loss sum, samples, flops]`` (a non-finite
   loss anywhere makes the global sum non-finite: it is the flag; a rank without a FLOPs count
   sends −inf) over the DP group (kept on the device), then multiplies the gradients by
   ``dp_world_size / global_count`` with one ``torch._foreach_mul_`` (DDP/FSDP2
   averaged over ranks, which the factor undoes) — the gradient of the global
   token-mean loss;
4. unscales (GradScaler), calls ``on_window_end`` callbacks, clips once; under DP a second,
   one-element all-reduce sums the flag "this rank's gradient norm is non-finite", so every
   rank skips or none does;
5. reads **one** small tensor to the host (``[count, loss, samples, flops, grad_norm]``):
   the skip decision needs it, exactly as ``GradScaler.step`` does. This is the only
   host sync per step; the reported numbers ride along with it;
6. refuses a window of more samples (all ranks) than the planned global batch with a
   ``ValueError`` before the optimizer step (a shorter window is fine);
7. on a non-finite loss or gradient on any rank (or an empty window), skips the step on
   every rank: parameters, optimizer state and LR schedule untouched, a counter
   increased, a warning naming the step; ``max_consecutive_skips`` in a row raise
   :class:`NonFiniteError`.

See ``docs/step.md`` for the state of ``.grad`` at each callback and the measured
overhead against a hand-written loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, Sequence, cast, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from globalbatch.errors import Raw, SettingError
from globalbatch.parallel import inspect_parallel, unwrap_model
from globalbatch.plan import BatchGeometry, fmt_int, solve_geometry
from globalbatch.schedule import (
    SCHEDULE_UNITS,
    BatchSchedule,
    LRSchedule,
    constant_batch,
    format_batch_change,
)
from globalbatch.validate import choice, number, whole

__all__ = [
    "StepCallback",
    "CALLBACK_HOOKS",
    "StepConfig",
    "StepDriver",
    "StepResult",
    "NonFiniteError",
    "plan_for_world",
    "unwrap_model",
]

logger = logging.getLogger(__name__)

_STATE_VERSION = 1


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


_PASS_THROUGH = frozenset({"ToCopyBackward0", "CloneBackward0", "ViewBackward0", "ReshapeAliasBackward0",
                           "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0",
                           "AliasBackward0", "SelectBackward0"})
_MEAN_REDUCTION = 1  # at::Reduction::Mean, as saved by the loss nodes (None 0, Mean 1, Sum 2)


def mean_reduction(loss: torch.Tensor) -> Optional[str]:
    """How ``loss`` was averaged, read from its autograd graph (no host sync), or None when it was not.

    Looks through casts and views at the last operation: ``.mean()`` (``MeanBackward``), a loss built with
    ``reduction="mean"`` (``F.cross_entropy``'s and ``F.mse_loss``'s default, and every loss node that saves
    its reduction), or a division (``loss_sum / count``, ``kl_div(reduction="batchmean")``). A summed loss,
    a product or anything else is None."""
    node = loss.grad_fn
    for _ in range(8):
        if node is None:
            return None
        name = type(node).__name__
        if name not in _PASS_THROUGH:
            break
        nxt = [f for f, _ in node.next_functions if f is not None]
        node = nxt[0] if len(nxt) == 1 else None
    if node is None:
        return None
    name = type(node).__name__
    if name.startswith("MeanBackward"):
        return "a .mean()"
    if getattr(node, "_saved_reduction", None) == _MEAN_REDUCTION:
        return f"a reduction='mean' loss ({name})"
    if name.startswith("DivBackward"):
        return "a division (e.g. loss_sum / count)"
    return None


def batch_samples(batch: Any) -> Optional[int]:
    """Samples in a collated micro-batch: the first dimension of a tensor, or of every tensor of a dict
    or tuple when they agree; None when it cannot be read."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    values = list(batch.values()) if isinstance(batch, Mapping) else list(batch) if isinstance(batch, tuple) else []
    sizes = {int(v.shape[0]) for v in values if isinstance(v, torch.Tensor) and v.dim()}
    return sizes.pop() if len(sizes) == 1 else None


CALLBACK_HOOKS = ("on_micro_backward", "on_window_end", "on_step_end")
"""The hooks a :class:`StepCallback` may implement; the driver calls those a callback has."""


@runtime_checkable
class StepCallback(Protocol):
    """What a driver callback may implement: any of the three hooks (the driver calls the ones it has).

    :class:`~globalbatch.noise.NoiseScaleMonitor` implements all three; an adaptive batch schedule
    (:class:`~globalbatch.adaptive.AdaptiveBatchSchedule`) ``on_step_end`` only. A callback with
    ``state_dict()``/``load_state_dict()`` is saved and restored by
    :func:`globalbatch.checkpoint.save_checkpoint`/``load_checkpoint``. A method named ``on_…`` that is
    not one of the hooks is refused when the callback is added (a misspelled hook would never run).

    The driver's loop, per window, on every rank (``driver.run_window`` does exactly this)::

        for m, micro in enumerate(micro_batches):            # this rank's micro-batches
            with driver.micro_step(last=m == M - 1):           # no DP sync before the last
                loss_sum, count = loss_fn(model, micro)
                driver.backward(loss_sum, count, samples=…)    # backward of the SUM
                #   -> cb.on_micro_backward(driver, m, count)   .grad: this rank's running sum
        driver.step():
            all-reduce [count, loss, samples, flops]; grads *= W / N; unscale
            #   -> cb.on_window_end(driver, N, local_count)     .grad: the global token-mean gradient
            clip once; one host read; skip, or set the LR and optimizer.step()
            #   -> cb.on_step_end(driver, result)              .grad: None; result.skipped
            #   -> the batch schedule's on_step_end (adaptive), always last

    ``docs/step.md`` has the state of ``.grad`` at each hook under DDP and FSDP2.
    """

    def on_micro_backward(self, driver: "StepDriver", micro_index: int, local_count: Any) -> None:
        """After each micro-batch's backward (``local_count``: its count as a tensor; the host number as
        given is ``driver.last_micro_count``, its samples ``driver.last_micro_samples``)."""

    def on_window_end(self, driver: "StepDriver", global_count: torch.Tensor, local_window_count: torch.Tensor) -> None:
        """After the sync, normalization and unscale, before clipping (0-d float64 device tensors: no sync)."""

    def on_step_end(self, driver: "StepDriver", result: "StepResult") -> None:
        """After the step or the skip (``result.skipped``)."""


def _check_callback(cb: Any) -> None:
    hooks = [h for h in CALLBACK_HOOKS if callable(getattr(cb, h, None))]
    odd = sorted(n for n in dir(type(cb)) if n.startswith("on_") and n not in CALLBACK_HOOKS
                 and callable(getattr(cb, n, None)))
    if odd:
        raise SettingError("callbacks", Raw(f"{type(cb).__name__} with {', '.join(odd)}"),
                           f"hooks named {', '.join(CALLBACK_HOOKS)} (StepCallback)")
    if not hooks:
        raise SettingError("callbacks", Raw(type(cb).__name__), f"an object with any of {', '.join(CALLBACK_HOOKS)} "
                           "(StepCallback)")


class _CallbackList(list):
    """``driver.callbacks``: a list whose every change refreshes the driver's cached hook lists, so a
    callback appended, inserted or removed after construction takes effect at the next hook call."""

    def __init__(self, driver: "StepDriver", items: Sequence[Any] = ()) -> None:
        super().__init__(items)
        self._driver = driver

    def _changed(self) -> None:
        self._driver._refresh_callbacks()


def _refreshing(name: str) -> Callable[..., Any]:
    base = getattr(list, name)

    def method(self: _CallbackList, *args: Any, **kwargs: Any) -> Any:
        out = base(self, *args, **kwargs)
        self._changed()
        return out if name != "__iadd__" else self

    method.__name__ = name
    return method


for _name in ("append", "extend", "insert", "remove", "pop", "clear", "__setitem__", "__delitem__", "__iadd__",
              "sort", "reverse"):
    setattr(_CallbackList, _name, _refreshing(_name))


class StepDriver:
    """Accumulate micro-batches into one exact global-batch optimizer step.

    Args:
        model: the module whose ``.grad`` the driver manages; a ``DistributedDataParallel``
            or FSDP2 (``fully_shard``) module is detected and synced once per window.
        optimizer: any ``torch.optim.Optimizer``.
        config: the batch geometry, clipping and skip policy.
        lr_schedule: deprecated alias of ``StepConfig.lr_schedule`` (the LR schedule lives beside
            the batch schedule in the config).
        lr_scheduler: optional step-based torch LR scheduler, stepped after applied steps only.
        scaler: optional ``torch.amp.GradScaler``; the driver scales, unscales and steps through it.
        callbacks: :class:`StepCallback` objects (any of ``on_micro_backward``, ``on_window_end``,
            ``on_step_end``), called in order; an adaptive batch schedule is not one of them (it is
            called after them, from ``config.batch_schedule``), and it takes its noise monitor from
            here when it has none (the one callback with ``estimate()``).
        dp_group: process group of the data-parallel ranks; default: DDP's group, or the
            default group for FSDP2. A plain module is one replica (dp_world_size 1).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: StepConfig,
        *,
        lr_schedule: Optional[LRSchedule] = None,
        lr_scheduler: Any = None,
        scaler: Any = None,
        callbacks: Sequence[Any] = (),
        dp_group: Any = None,
    ) -> None:
        if lr_schedule is not None:
            if config.lr_schedule is not None:
                raise SettingError("lr_schedule", Raw("in StepConfig and as a StepDriver argument"),
                                   "StepConfig.lr_schedule only (the argument is a deprecated alias)")
            warnings.warn("StepDriver(lr_schedule=...) is deprecated; use StepConfig(lr_schedule=...)",
                          FutureWarning, stacklevel=2)
            config = dataclasses.replace(config, lr_schedule=lr_schedule)
        lr_schedule = config.lr_schedule
        if lr_schedule is not None and lr_scheduler is not None:
            raise ValueError("lr_schedule and lr_scheduler are both set; allowed: at most one of them")
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.lr_schedule = lr_schedule
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler if (scaler is not None and scaler.is_enabled()) else None
        self.schedule = config.schedule()
        self.position_unit = config.position_unit
        """What the schedule positions count (``config.unit``)."""
        # A stateful batch schedule with a step-end hook (adaptive) is called after every callback. Passing it in
        # ``callbacks`` as well (the old way) still works for one release: it is then called there, in its place.
        self._schedule_hook = getattr(self.schedule, "on_step_end", None)
        callbacks = list(callbacks)
        if self._schedule_hook is not None and any(c is self.schedule for c in callbacks):
            warnings.warn("the batch schedule is also in callbacks: pass it once, as StepConfig.batch_schedule "
                          "(the driver calls it after the callbacks)", FutureWarning, stacklevel=2)
            self._schedule_hook = None
        if getattr(self.schedule, "monitor", False) is None:  # an adaptive schedule without its monitor
            monitors = [c for c in callbacks if callable(getattr(c, "estimate", None))]
            if len(monitors) > 1:
                raise SettingError("callbacks", Raw(f"{len(monitors)} noise monitors"),
                                   "at most one for an adaptive batch schedule without a monitor (or attach one: "
                                   "AdaptiveBatchSchedule(..., monitor=...))")
            if monitors:
                setattr(self.schedule, "monitor", monitors[0])  # noqa: B010 - any BatchSchedule with a monitor slot
        self._callbacks = _CallbackList(self, callbacks)
        self._refresh_callbacks()

        # One inspection of the wrappers (globalbatch.parallel): torch.compile(DDP(m)) or a compiled
        # fully_shard module must not pass for a plain module, or ranks would silently diverge.
        info = inspect_parallel(model)
        self._sync_module: Any = info.sync_module  # DDP or the fully_shard module (their methods, untyped)
        if info.kind == "ddp":
            self.parallel = "ddp"
            self.dp_group = dp_group if dp_group is not None else info.process_group
        elif info.kind == "fsdp2":
            self.parallel = "fsdp2"
            self.dp_group = dp_group
        else:
            if dp_group is not None:
                raise ValueError(
                    f"dp_group {dp_group!r} given for a plain {type(model).__name__}; allowed: only with a "
                    "DistributedDataParallel or fully_shard module (a plain module's gradients are never synced)"
                )
            self.parallel = "none"
            self.dp_group = None
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                msg = (
                    f"StepDriver got a plain {type(info.module).__name__} while a process group of "
                    f"{dist.get_world_size()} ranks is initialized: its gradients are never synced and each rank "
                    "steps on its own data (dp_world_size 1). Wrap the model in DDP or fully_shard for data parallelism."
                )
                logger.warning(msg)
                warnings.warn(msg, stacklevel=2)
        self.dp_world_size = dist.get_world_size(self.dp_group) if self.parallel != "none" else 1
        self.dp_rank = dist.get_rank(self.dp_group) if self.parallel != "none" else 0
        """This rank's index in the DP group (0 for a plain module: one replica)."""

        for gb in self.schedule.all_batches():  # every batch the run can reach must divide: fail now
            plan_for_world(gb, config.micro_batch, self.dp_world_size)

        self._params = [p for p in model.parameters() if p.requires_grad]
        self._initial_lrs = [float(g["lr"]) for g in optimizer.param_groups]

        # counters (host ints; see state_dict)
        self.consumed_units = 0
        self.consumed_samples = 0
        self.trained_units = 0
        self.trained_samples = 0
        self.optimizer_steps = 0
        self.windows = 0
        self.skipped_windows = 0
        self.consecutive_skips = 0
        self.global_batch = self.schedule.batch_at(0)
        self.batch_lr_mult = 1.0
        self.last_micro_samples = config.micro_batch
        self.last_micro_count: Any = None
        self._geometry_shown = not config.print_geometry
        self._warned_samples = False

        self._reset_window()
        self._batchnorm_checked = False
        self._t_last: Optional[float] = None
        # log on rank 0 only: skips and batch changes are agreed on by all ranks
        self._log = dist.get_rank() == 0 if dist.is_available() and dist.is_initialized() else True

    # ------------------------------------------------------------------ callbacks

    @property
    def callbacks(self) -> list[Any]:
        """The callbacks, in call order. Changing this list (``append``, ``remove``, ...) or assigning a
        new one takes effect at the next hook call; a callback added inside a window sees only the rest
        of it (:class:`~globalbatch.noise.NoiseScaleMonitor` then starts measuring at the next window)."""
        return self._callbacks

    @callbacks.setter
    def callbacks(self, value: Sequence[Any]) -> None:
        self._callbacks = _CallbackList(self, value)
        self._refresh_callbacks()

    def _refresh_callbacks(self) -> None:
        cbs = self._callbacks
        for c in cbs:
            _check_callback(c)
        self._cb_micro = [c.on_micro_backward for c in cbs if hasattr(c, "on_micro_backward")]
        self._cb_window = [c.on_window_end for c in cbs if hasattr(c, "on_window_end")]
        self._cb_step = [c.on_step_end for c in cbs if hasattr(c, "on_step_end")]

    # ------------------------------------------------------------------ plan

    @property
    def geometry(self) -> BatchGeometry:
        """The planned geometry of the next window (global batch from the schedule position)."""
        return plan_for_world(self.global_batch, self.config.micro_batch, self.dp_world_size)

    def describe(self) -> str:
        """The batch arithmetic in one line (printed once at the first window on rank 0 unless
        ``StepConfig.print_geometry`` is False)::

            globalbatch: global batch 16 seq = 2 ranks × 4 accum × 2 seq; tokens per step ≤ 8,192 = 16 seq × 512 seq_len
        """
        g = self.geometry
        line = f"globalbatch: global batch {g.arithmetic()}"
        if self.config.seq_len is not None:
            line += (f"; tokens per step ≤ {fmt_int(g.tokens(self.config.seq_len))} = {fmt_int(g.global_batch)} seq × "
                     f"{fmt_int(self.config.seq_len)} seq_len (padding included)")
        batches = self.schedule.all_batches()
        if len(batches) > 1:
            line += (f"; batch schedule over trained {self.position_unit}s, {fmt_int(batches[0])}…"
                     f"{fmt_int(batches[-1])} seq")
        unit = "loss-bearing tokens" if self.config.unit == "token" else "samples"
        return line + f"; loss normalized by the {unit} of the whole window"

    @property
    def schedule_position(self) -> int:
        """Trained units in the run's unit (tokens or samples: ``position_unit``)."""
        return self.trained_units if self.position_unit == "token" else self.trained_samples

    # ------------------------------------------------------------ micro-steps

    def _reset_window(self) -> None:
        self._micro_index = 0
        self._acc_units: Optional[torch.Tensor] = None  # float64 0-d, this rank's loss-bearing units
        self._acc_loss: Optional[torch.Tensor] = None  # float64 0-d, this rank's summed loss (non-finite if any term is)
        self._samples_local = 0  # host int
        self._flops_local = 0.0  # host float: model FLOPs of this rank's micro-batches so far
        self._flops_known = self.config.flops_per_sample is not None  # every micro-batch has a count
        self._units_host: float = 0  # host number: counts passed as Python numbers
        self._unscaled = False
        self._last_synced = False
        self._in_micro = False
        self._sync_now = True

    @contextlib.contextmanager
    def micro_step(self, *, last: bool) -> Iterator["StepDriver"]:
        """Context for one micro-batch's forward *and* backward.

        ``last=False`` disables the DP gradient sync (DDP ``no_sync`` must cover the
        forward too: it arms its reducer during forward); ``last=True`` syncs.
        """
        if self._in_micro:
            raise RuntimeError("micro_step is already open; close it before the next micro-batch")
        if self._micro_index == 0:
            self._begin_window()
        self._in_micro = True
        self._sync_now = bool(last)
        try:
            if self.parallel == "ddp" and not last:
                with self._sync_module.no_sync():
                    yield self
            else:
                if self.parallel == "fsdp2":
                    self._sync_module.set_requires_gradient_sync(bool(last))
                yield self
        finally:
            self._in_micro = False
            self._sync_now = True

    def _begin_window(self) -> None:
        # Clear whatever .grad the user or the last window left (cheap: sets None).
        for p in self._params:
            p.grad = None
        if not self._geometry_shown:
            self._geometry_shown = True
            if self._log:
                print(self.describe(), flush=True)  # stdout only: a logging handler on stdout would show it twice
        if self._t_last is None:
            self._t_last = time.perf_counter()

    def backward(self, loss_sum: torch.Tensor, count: Any, *, samples: Optional[int] = None,
                 flops: Optional[float] = None) -> None:
        """Back-propagate one micro-batch's **summed** loss.

        Args:
            loss_sum: 0-d sum of per-unit losses of this micro-batch (not a mean).
            count: loss-bearing units in it: the targets the loss was summed over (or samples).
                For a causal LM whose model shifts the labels internally (Hugging Face
                ``labels=input_ids``) that is ``labels[..., 1:] != ignore_index``, one fewer per
                sequence than ``labels != ignore_index``; take both from
                :func:`globalbatch.losses.causal_lm_loss_sum`. A device tensor avoids a
                host-to-device copy.
            samples: samples (sequences) in this micro-batch, at most ``config.micro_batch``
                (:meth:`run_window` passes them). Omitted: ``config.micro_batch`` is assumed, with a
                FutureWarning (it becomes required: a short micro-batch would be miscounted).
            flops: model FLOPs (forward + backward) of this micro-batch, a host number (e.g. from
                :class:`globalbatch.flops.FlopsCounter`, cached per shape); default
                ``config.flops_per_sample × samples``.
        """
        if loss_sum.dim() != 0:
            raise SettingError("loss_sum shape", tuple(loss_sum.shape), "a 0-d summed loss")
        if self.config.check_summed_loss:
            how = mean_reduction(loss_sum)
            if how is not None:
                raise SettingError("loss_sum", Raw(f"from {how}"), "the SUM of the per-unit losses "
                                   "(reduction='sum'; with its count: globalbatch.losses.causal_lm_loss_sum), or "
                                   "StepConfig(check_summed_loss=False) for a loss that really ends in a division",
                                   why="the driver divides by the global count: a mean would be divided twice")
        if samples is None:
            if not self._warned_samples:
                self._warned_samples = True
                warnings.warn(f"backward() without samples= assumes a full micro-batch of StepConfig.micro_batch "
                              f"{self.config.micro_batch} samples; pass samples= (it will be required), or use "
                              "run_window / globalbatch.windows.rank_windows", FutureWarning, stacklevel=2)
            samples = self.config.micro_batch
        elif isinstance(samples, bool) or not isinstance(samples, int) or not 0 <= samples <= self.config.micro_batch:
            raise SettingError("samples", samples, f"a whole number in [0, StepConfig.micro_batch "
                               f"{self.config.micro_batch}] (the samples of this micro-batch)")
        if self._micro_index == 0 and not self._in_micro:
            self._begin_window()
        loss_d = loss_sum.detach()
        if isinstance(count, torch.Tensor):
            if count.numel() != 1:
                raise ValueError(
                    f"count shape {tuple(count.shape)} is not allowed; allowed: one number (a 0-d tensor or an int)"
                )
            count_t = count.detach().reshape(())
            if count_t.device != loss_d.device:
                count_t = count_t.to(loss_d.device, non_blocking=True)
        else:
            if isinstance(count, bool) or not isinstance(count, (int, float)) or count < 0:
                raise SettingError("count", count, "a number >= 0 of loss-bearing units")
            # A host number stays on the host: torch.tensor(int, device=cuda) would copy from
            # pageable memory and synchronize the stream on every micro-batch.
            self._units_host += count
            count_t = torch.tensor(count, dtype=torch.float64)  # CPU scalar, for callbacks only
        # Tiny device adds per micro-batch. A non-finite term makes the float sum
        # non-finite (NaN propagates, inf + finite = inf, inf - inf = NaN), so the summed
        # loss doubles as the non-finite flag.
        if self._acc_loss is None:
            self._acc_loss = loss_d.to(torch.float64, copy=True)
        else:
            self._acc_loss.add_(loss_d)
        if isinstance(count, torch.Tensor):
            if self._acc_units is None:
                self._acc_units = count_t.to(torch.float64, copy=True)
            else:
                self._acc_units.add_(count_t)
        self.last_micro_samples = samples  # for callbacks
        self.last_micro_count = count  # for callbacks: the host number as given (no tensor to read back)
        self._samples_local += self.last_micro_samples
        if flops is not None:
            if isinstance(flops, bool) or not isinstance(flops, (int, float)) or not flops >= 0:
                raise SettingError("flops", flops, "a host number >= 0 (FLOPs of this micro-batch)")
            self._flops_local += float(flops)
            if self._micro_index == 0:
                self._flops_known = True
        elif self.config.flops_per_sample is not None:
            self._flops_local += self.config.flops_per_sample * self.last_micro_samples
        else:
            self._flops_known = False  # a micro-batch without a count: no FLOPs for this window
        if self.scaler is not None:
            self.scaler.scale(loss_sum).backward()
        else:
            loss_sum.backward()
        self._last_synced = self._sync_now or self.parallel == "none"
        for cb in self._cb_micro:
            cb(self, self._micro_index, count_t)
        self._micro_index += 1

    # ------------------------------------------------------------------ step

    def _warn_batchnorm(self) -> None:
        from globalbatch.nn.ghost_bn import batchnorm_accumulation_warning

        msg = batchnorm_accumulation_warning(
            unwrap_model(self.model), micro_batch=self.config.micro_batch, global_batch=self.global_batch,
            micro_steps=self._micro_index, dp_world_size=self.dp_world_size)
        if msg is not None and self._log:
            logger.warning(msg)
            warnings.warn(msg, stacklevel=3)

    def _params_with_grad(self) -> list[nn.Parameter]:
        return [p for p in self._params if p.grad is not None]

    def _local_grads(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        if self.parallel == "fsdp2":  # DTensor gradients: scale the local shard in place
            return [cast(torch.Tensor, getattr(p.grad, "_local_tensor", p.grad)) for p in params]
        return [cast(torch.Tensor, p.grad) for p in params]  # params with a gradient (_params_with_grad)

    def step(self) -> StepResult:
        """Finish the window: sync counts, normalize, unscale, clip, then step or skip.

        Raises ``ValueError`` (on every rank, before the optimizer step, driver left ready for the
        next window) when the window's samples over all ranks exceed the planned ``global_batch``;
        a shorter window is fine.
        """
        if self._micro_index == 0 or self._acc_loss is None:
            raise RuntimeError("step() called with no micro-batch since the last step; call backward() first")
        if not self._last_synced:
            raise RuntimeError(
                "the last micro-batch ran without gradient sync; open it with micro_step(last=True)"
            )
        if not self._batchnorm_checked:  # once per driver: BatchNorm statistics under accumulation
            self._batchnorm_checked = True
            self._warn_batchnorm()
        device = self._acc_loss.device
        local_count = self._acc_units if self._acc_units is not None else torch.zeros((), dtype=torch.float64, device=device)
        if self._units_host:
            local_count = local_count + self._units_host  # host counts folded in once per window
        # samples and FLOPs are host numbers: torch.full is a fill kernel, no copy from pageable memory
        # (no sync). A rank without a FLOPs count sends -inf so the window's sum says "unknown" everywhere.
        samples_t = torch.full((), float(self._samples_local), dtype=torch.float64, device=device)
        flops_t = torch.full((), self._flops_local if self._flops_known else -math.inf, dtype=torch.float64,
                             device=device)
        stats = torch.stack([local_count, self._acc_loss, samples_t, flops_t])  # [units, loss sum, samples, flops]
        if self.dp_world_size > 1:
            dist.all_reduce(stats, group=self.dp_group)  # one collective for count, loss (= flag), samples, flops
        global_count = stats[0]

        # DDP/FSDP2 averaged Σ∇loss_sum over ranks; × W / N gives ∇(global loss sum / N).
        factor = self.dp_world_size / global_count.clamp(min=1.0)
        params = self._params_with_grad()
        if params:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for g in self._local_grads(params):
                by_dtype.setdefault(g.dtype, []).append(g)
            for dtype, group in by_dtype.items():
                # fp32/fp64 grads: the factor in their dtype keeps the fused foreach kernel;
                # half-precision grads keep an fp32 factor (a bf16 factor would be off by up to 0.4 %).
                f = factor.to(dtype) if dtype in (torch.float32, torch.float64) else factor.to(torch.float32)
                torch._foreach_mul_(group, f)
        self._unscaled = False
        if self.scaler is not None and params:
            self.scaler.unscale_(self.optimizer)
            self._unscaled = True
        for cb in self._cb_window:
            cb(self, global_count, local_count)

        grad_norm = self._clip(params)
        norm64 = grad_norm.detach().reshape(1).to(device=stats.device, dtype=torch.float64)
        if self.dp_world_size > 1:
            # The norm is computed on each rank after the gradient sync: a gradient made non-finite on
            # one rank afterwards (a callback, a hook) would skip there and step elsewhere. Its
            # non-finite flag joins an all-reduce so the step is applied on every rank or on none.
            bad = (~torch.isfinite(norm64)).to(torch.float64)
            dist.all_reduce(bad, group=self.dp_group)  # tiny collective; no host sync (read below with the rest)
            norm64 = torch.where(bad > 0, torch.full_like(norm64, math.inf), norm64)
        packed = torch.cat([stats, norm64])
        # HOST SYNC (the only one per step): the skip decision needs these numbers.
        units_f, loss_f, samples_f, flops_f, norm_f = packed.tolist()
        units, samples = int(round(units_f)), int(round(samples_f))
        planned_batch = self.global_batch
        if samples > planned_batch:
            # A misuse, not a data accident: refuse before the optimizer step, identically on every
            # rank (the numbers come from the all-reduce), and leave the driver ready for the next window.
            self._abandon_window()
            raise ValueError(
                f"window {self.windows + 1} has {samples} samples (all ranks), more than the planned global batch "
                f"{planned_batch}; allowed: at most the planned global batch (a shorter last window is fine)"
            )

        self.windows += 1
        self.consumed_units += units
        self.consumed_samples += samples
        reasons = []
        if not math.isfinite(loss_f):
            reasons.append("non-finite loss")
        if not math.isfinite(norm_f):
            reasons.append("non-finite gradient")
        if units == 0:
            reasons.append("no loss-bearing units")

        lr_used = float(self.optimizer.param_groups[0]["lr"])
        if reasons:
            self._skip(reasons)
        else:
            lr_used = self._apply(units, samples)

        for p in self._params:
            p.grad = None
        self._reset_window()
        now = time.perf_counter()
        dt = now - self._t_last if self._t_last is not None else float("nan")
        self._t_last = now
        ups = units / dt if dt > 0 else float("nan")
        flops_window = flops_f if math.isfinite(flops_f) else None
        flops_per_s = flops_window / dt if flops_window is not None and dt > 0 else None
        peak = self.config.peak_flops_per_s
        result = StepResult(
            step=self.optimizer_steps,
            window=self.windows,
            skipped=bool(reasons),
            loss_per_unit=loss_f / units_f if units_f > 0 else float("nan"),
            global_units=units,
            global_samples=samples,
            grad_norm=norm_f,
            lr=lr_used,
            global_batch=planned_batch,
            units_per_s=ups,
            consumed_units=self.consumed_units,
            valid_tokens_per_s=ups if self.config.unit == "token" else None,
            model_flops=flops_window,
            model_flops_per_s=flops_per_s,
            mfu=flops_per_s / (self.dp_world_size * peak) if flops_per_s is not None and peak else None,
        )
        for cb in self._cb_step:
            cb(self, result)
        if self._schedule_hook is not None:
            self._schedule_hook(self, result)
        if self.consecutive_skips >= self.config.max_consecutive_skips:
            raise NonFiniteError(
                f"{self.consecutive_skips} consecutive windows skipped (max_consecutive_skips "
                f"{self.config.max_consecutive_skips}); last: window {self.windows} "
                f"(optimizer steps so far: {self.optimizer_steps}): {'; '.join(reasons)}"
            )
        return result

    def _abandon_window(self) -> None:
        """Drop the current window: no optimizer step, no counter moves, gradients cleared."""
        for p in self._params:
            p.grad = None
        if self.scaler is not None and self._unscaled:
            # Forget this window's unscale_ record without update(): the loss scale is left as it was,
            # and the next window may call unscale_ again.
            states = getattr(self.scaler, "_per_optimizer_states", None)
            if states is not None:
                states.pop(id(self.optimizer), None)
        self._reset_window()

    def _clip(self, params: list[nn.Parameter]) -> torch.Tensor:
        if not params:
            return torch.zeros((), dtype=torch.float64)
        max_norm = self.config.max_grad_norm
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        elif hasattr(torch.nn.utils, "get_total_norm"):
            norm = torch.nn.utils.get_total_norm([cast(torch.Tensor, p.grad) for p in params], foreach=True)
        else:  # pragma: no cover - torch < 2.6
            norm = torch.nn.utils.clip_grad_norm_(params, float("inf"), foreach=True)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        return norm

    def _skip(self, reasons: list[str]) -> None:
        self.skipped_windows += 1
        self.consecutive_skips += 1
        if self.scaler is not None and self._unscaled:
            self.scaler.update()  # back off the loss scale; no optimizer step
        if self._log:
            logger.warning(
                "window %d skipped on all ranks (optimizer steps so far: %d): %s (%d consecutive, %d total)",
                self.windows, self.optimizer_steps, "; ".join(reasons), self.consecutive_skips, self.skipped_windows,
            )

    def _apply(self, units: int, samples: int) -> float:
        """Set the LR, step the optimizer, advance the schedule position; returns the LR used."""
        after_units = self.trained_units + units
        after_samples = self.trained_samples + samples
        if self.lr_schedule is not None:
            pos = after_units if self.position_unit == "token" else after_samples
            lr = self.lr_schedule.lr_at(pos) * self.batch_lr_mult
            # Groups keep their initial LR ratios to the first group with a non-zero LR;
            # a group that started at lr 0 (frozen) stays at 0.
            base0 = next((x for x in self._initial_lrs if x > 0), 0.0)
            for g, lr0 in zip(self.optimizer.param_groups, self._initial_lrs):
                g["lr"] = lr * (lr0 / base0) if base0 > 0 else 0.0
        lr_used = float(self.optimizer.param_groups[0]["lr"])
        # The window is known to be finite here (the norm was read above), so step the optimizer
        # directly: GradScaler.step would read found_inf with a second host sync.
        self.optimizer.step()
        if self.scaler is not None and self._unscaled:
            self.scaler.update()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.trained_units = after_units
        self.trained_samples = after_samples
        self.optimizer_steps += 1
        self.consecutive_skips = 0
        self._follow_batch_schedule()
        return lr_used

    def refresh_batch(self) -> None:
        """Re-read the batch schedule at the current position (between windows) and, on a change, rescale
        the LR and log it. The driver does this after every applied step; an adaptive schedule
        (:mod:`globalbatch.adaptive`) calls it right after deciding, so the next window uses the new batch."""
        if self._micro_index:
            raise RuntimeError("refresh_batch() inside a window; call it between step() and the next micro-batch")
        self._follow_batch_schedule()

    def _follow_batch_schedule(self) -> None:
        pos = self.schedule_position
        new_batch = self.schedule.batch_at(pos)
        if new_batch == self.global_batch:
            return
        new_mult = self.schedule.lr_multiplier(new_batch)
        ratio = new_mult / self.batch_lr_mult
        lr_old = float(self.optimizer.param_groups[0]["lr"])
        if self.lr_schedule is not None:
            unit_pos = self.schedule_position
            lr_old = self.lr_schedule.lr_at(unit_pos) * self.batch_lr_mult
            lr_new = self.lr_schedule.lr_at(unit_pos) * new_mult
        else:
            for g in self.optimizer.param_groups:
                g["lr"] = float(g["lr"]) * ratio
            if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "base_lrs"):
                # Closed-form torch schedulers (LambdaLR, CosineAnnealingLR, …) recompute the LR
                # from base_lrs at their next step(): rescale those too or the change is lost.
                self.lr_scheduler.base_lrs = [float(b) * ratio for b in self.lr_scheduler.base_lrs]
            lr_new = float(self.optimizer.param_groups[0]["lr"])
        if self._log:
            logger.info(format_batch_change(
                self.global_batch, new_batch, pos, self.position_unit, lr_old, lr_new, self.schedule.lr_rule))
        self.global_batch = new_batch
        self.batch_lr_mult = new_mult

    # ------------------------------------------------------------------ loop helper

    def run_window(
        self,
        micro_batches: Sequence[Any],
        loss_fn: Callable[[nn.Module, Any], tuple[torch.Tensor, Any]],
        *,
        samples_per_micro: Optional[Sequence[int]] = None,
        flops_per_micro: Optional[Sequence[float]] = None,
    ) -> StepResult:
        """One whole window: ``loss_fn(model, micro)`` → ``(loss_sum, count)`` per micro-batch, then :meth:`step`.

        The samples of each micro-batch come from ``samples_per_micro``, else from ``micro_batches.samples``
        (a :class:`globalbatch.windows.MicroBatches`, what :func:`~globalbatch.windows.rank_windows` yields),
        else from the micro-batch itself (the first dimension of a tensor, or of a dict's or tuple's tensors
        when they agree); a micro-batch whose size cannot be read counts as a full ``micro_batch``."""
        n = len(micro_batches)
        if n == 0:
            raise SettingError("micro_batches", Raw("[]"), "at least one micro-batch per window")
        if samples_per_micro is None:
            samples_per_micro = getattr(micro_batches, "samples", None)
        if samples_per_micro is not None and len(samples_per_micro) != n:
            raise SettingError("samples_per_micro", Raw(f"{len(samples_per_micro)} entries"),
                               f"one per micro-batch ({n})")
        if flops_per_micro is not None and len(flops_per_micro) != n:
            raise SettingError("flops_per_micro", Raw(f"{len(flops_per_micro)} entries"), f"one per micro-batch ({n})")
        for i, micro in enumerate(micro_batches):
            with self.micro_step(last=i == n - 1):
                loss_sum, count = loss_fn(self.model, micro)
                samples = samples_per_micro[i] if samples_per_micro is not None else batch_samples(micro)
                self.backward(loss_sum, count, samples=self.config.micro_batch if samples is None else samples,
                              flops=None if flops_per_micro is None else flops_per_micro[i])
        return self.step()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Counters and schedule position: Python ints/floats only (``weights_only`` loadable)."""
        if self._micro_index:
            raise RuntimeError("state_dict() inside a window; call it between step() and the next micro-batch")
        state = {
            "version": _STATE_VERSION,
            "consumed_units": self.consumed_units,
            "consumed_samples": self.consumed_samples,
            "trained_units": self.trained_units,
            "trained_samples": self.trained_samples,
            "optimizer_steps": self.optimizer_steps,
            "windows": self.windows,
            "skipped_windows": self.skipped_windows,
            "consecutive_skips": self.consecutive_skips,
            "global_batch": self.global_batch,
            "batch_lr_mult": self.batch_lr_mult,
            "initial_lrs": list(self._initial_lrs),
        }
        if hasattr(self.schedule, "state_dict"):  # a stateful (adaptive) batch schedule: its decisions so far
            state["batch_schedule"] = self.schedule.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters; the global batch is re-derived from the schedule position."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"driver state version {state.get('version')!r} is not allowed; allowed: {_STATE_VERSION}")
        for key in ("consumed_units", "consumed_samples", "trained_units", "trained_samples",
                    "optimizer_steps", "windows", "skipped_windows", "consecutive_skips"):
            setattr(self, key, int(state[key]))
        self._initial_lrs = [float(x) for x in state["initial_lrs"]]
        if state.get("batch_schedule") is not None and hasattr(self.schedule, "load_state_dict"):
            self.schedule.load_state_dict(state["batch_schedule"])  # before the batch is re-derived from it
        self.global_batch = self.schedule.batch_at(self.schedule_position)
        self.batch_lr_mult = self.schedule.lr_multiplier(self.global_batch)
        if self.global_batch != int(state["global_batch"]):
            logger.warning(
                "checkpoint global batch %d differs from the schedule's %d at %d %ss; using the schedule",
                int(state["global_batch"]), self.global_batch, self.schedule_position, self.position_unit,
            )
        self._reset_window()
        self._t_last = None
