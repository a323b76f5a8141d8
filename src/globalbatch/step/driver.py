"""The driver: :class:`StepDriver` ends each window (sync, normalize, unscale, clip, skip or step) and
follows the batch schedule; :class:`StepCallback` is what its callbacks may implement."""

from __future__ import annotations

import logging
import math
import time
import warnings
from typing import Any, Callable, Optional, Protocol, Sequence, cast, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from globalbatch.errors import Raw, SettingError
from globalbatch.parallel import unwrap_model
from globalbatch.schedule import format_batch_change
from globalbatch.step.accumulate import _WindowAccumulator
from globalbatch.step.config import NonFiniteError, StepResult
from globalbatch.step.inputs import batch_samples

logger = logging.getLogger("globalbatch.step")  # the driver's one logger (see globalbatch.step.accumulate)


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


class StepDriver(_WindowAccumulator):
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

        Raises ``SettingError`` (on every rank, before the optimizer step, driver left ready for the
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
            raise SettingError("window samples", samples, f"at most the planned global batch {planned_batch} (a "
                               "shorter last window is fine)",
                               why=f"window {self.windows + 1}, all ranks: more than the planned global batch")

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
