"""The driver's state and the first half of a window: counters, callbacks, ``micro_step`` and ``backward``.

:class:`_WindowAccumulator` holds what a :class:`~globalbatch.step.StepDriver` is built from and what it
counts, and accumulates this rank's window on the device (summed loss, loss-bearing units) and on the host
(samples, FLOPs) without a host sync; :mod:`globalbatch.step.driver` adds the window's end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import warnings
from typing import Any, Iterator, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from globalbatch.errors import Raw, SettingError
from globalbatch.parallel import inspect_parallel
from globalbatch.plan import BatchGeometry, fmt_int
from globalbatch.schedule import LRSchedule
from globalbatch.step.callbacks import _CallbackList, _check_callback
from globalbatch.step.config import StepConfig, plan_for_world
from globalbatch.step.inputs import mean_reduction
from globalbatch.validate import number, whole

logger = logging.getLogger("globalbatch.step")  # one logger for the whole driver (users configure this name)

_STATE_VERSION = 1
_Self = TypeVar("_Self", bound="_WindowAccumulator")


class _WindowAccumulator:
    """The driver's construction, counters, callbacks and the accumulation of a window (see :class:`StepDriver`)."""

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
            raise SettingError("lr_scheduler", Raw(type(lr_scheduler).__name__),
                               "None when StepConfig.lr_schedule is set (at most one of them)")
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
                raise SettingError("dp_group", Raw(repr(dp_group)), "None for a plain module; a group only with a "
                                   "DistributedDataParallel or fully_shard module",
                                   why=f"a plain {type(model).__name__}'s gradients are never synced")
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
            try:
                plan_for_world(gb, config.micro_batch, self.dp_world_size)
            except SettingError as exc:
                if config.batch_schedule is None:
                    raise
                raise SettingError("batch_schedule", gb, exc.allowed,
                                   why=f"a global batch the schedule reaches; {exc.why}") from None

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
    def micro_step(self: _Self, *, last: bool) -> Iterator[_Self]:
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
        else:
            whole(samples, "samples", minimum=0, maximum=self.config.micro_batch, allowed=f"a whole number in [0, "
                  f"StepConfig.micro_batch {self.config.micro_batch}] (the samples of this micro-batch)")
        if self._micro_index == 0 and not self._in_micro:
            self._begin_window()
        loss_d = loss_sum.detach()
        if isinstance(count, torch.Tensor):
            if count.numel() != 1:
                raise SettingError("count shape", Raw(str(tuple(count.shape))), "one number (a 0-d tensor or an int)")
            count_t = count.detach().reshape(())
            if count_t.device != loss_d.device:
                count_t = count_t.to(loss_d.device, non_blocking=True)
        else:
            number(count, "count", low=0.0, allowed="a number >= 0 of loss-bearing units")
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
            number(flops, "flops", low=0.0, allowed="a host number >= 0 (FLOPs of this micro-batch)")
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
            raise SettingError("driver state version", state.get("version"), str(_STATE_VERSION))
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
