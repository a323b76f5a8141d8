"""NoiseScaleMonitor: the small-batch gradient norms of a real training step.

McCandlish, Kaplan, Amodei 2018 (arXiv 1812.06162), App. A.1 (the estimator is in
:mod:`globalbatch.noise.estimator`). Sources, at no extra forward/backward:

* ``"micro"``: the micro-batches of an accumulation window, pooled over ranks. A tensor hook on
  every trainable parameter sees the gradient each micro backward *adds* to ``.grad``
  (Δ = m_i·g_i, before accumulation and before any DP all-reduce) and takes its norm at once,
  while it is in cache, into a preallocated buffer slot. One in-cache read of the gradient per
  micro-batch; no snapshot copy, no gradient held, no tensor created per norm.
  Under FSDP2 the hooks sit on its unsharded parameters (before the reduce-scatter).
* ``"rank"``: each DP rank's window gradient before the all-reduce, one norm per bucket in a DDP
  comm hook that wraps the user's own hook (or DDP's default all-reduce). Not under FSDP2.

``adam=True`` adds the Adam-preconditioned variant g/(√v̂ + eps). The per-window statistics
are one small tensor chain on an accelerator or under DP, and host arithmetic on CPU with one
replica (measured in place after a backward, each small torch call costs 5–15 µs): under the
StepDriver the window only copies its norms into a ring row and the fold computes hundreds of
windows at once (:func:`globalbatch.noise.window.raw_vectors`); otherwise one ``tolist()`` of the
norm buffer. Under the StepDriver |G_big|² is its pre-clip norm, read in its one host sync.
Windows are queued and folded into every estimator at once (each estimator's state is a row of
one matrix). The monitor's construction, its parameter hooks and the per-micro-batch record are in
:mod:`globalbatch.noise.hooks`; a window's vector and the fold in :mod:`globalbatch.noise.fold`; the norm
slots, the FSDP2 parameters and the DDP comm hook in :mod:`globalbatch.noise.sources`; the host arithmetic
in :mod:`globalbatch.noise.window`. This module ends windows, is the driver's callback and reads out.
``every=n`` measures one window in n: between measured windows the parameter hooks are
removed, so the skipped windows cost a few Python calls. The monitor times its own work (hooks,
callbacks, folds; a host clock, no device sync) and reports it (:meth:`NoiseScaleMonitor.cost`);
with ``NoiseConfig(budget=...)`` it picks ``every`` from that cost
(:class:`globalbatch.noise.budget.EveryController`).
"""

from __future__ import annotations

import math
from typing import Any

from globalbatch.errors import SettingError
from globalbatch.noise.budget import MonitorCost
from globalbatch.noise.config import SOURCES, NoiseConfig
from globalbatch.noise.estimator import NEEDS_TWO_BATCH_SIZES, NoiseScaleEstimate
from globalbatch.noise.fold import _WindowFold

__all__ = ["SOURCES", "NoiseConfig", "NoiseScaleMonitor"]


def _nan_if_none(x: float | None) -> float:
    return math.nan if x is None else x


class NoiseScaleMonitor(_WindowFold):
    """Measure B_simple during training: a step-driver callback, or called from a plain loop.

    With :class:`globalbatch.step.StepDriver`: ``StepDriver(..., callbacks=[monitor])``, or
    ``driver.callbacks.append(monitor)`` at any time (it starts at the next window), and
    ``driver.callbacks.remove(monitor); monitor.detach()`` to stop. In a plain loop (sum-loss
    accumulation, gradients normalized to the mean before ``window_end``)::

        monitor = NoiseScaleMonitor(model, optimizer=opt)      # between windows
        for window in windows:
            for micro in window:
                loss_sum, count = loss_fn(model, micro)
                loss_sum.backward()                             # under no_sync() except the last (DDP)
                monitor.micro_backward(count, samples=len(micro))
            normalize_to_mean(model)                            # p.grad = mean gradient of the window
            monitor.window_end(lr=opt.param_groups[0]["lr"])
            opt.step(); opt.zero_grad()
        print(monitor.estimate())                               # host sync: at log steps only

    Hook order inside a window: the parameter hooks during each micro backward,
    ``micro_backward`` after it, the DDP comm hook during the syncing backward (before the
    all-reduce), ``window_end`` after sync, normalization and unscaling, before clipping.
    Every backward through the parameters between two ``micro_backward`` calls is counted as
    part of that micro-batch (``torch.autograd.grad`` over the parameters too).

    Args:
        model: the module, or its DDP / FSDP2 / ``torch.compile`` wrappers at any depth
            (:func:`globalbatch.parallel.inspect_parallel`). Under DDP with the ``rank`` source
            a comm hook is registered now: build the monitor before the first backward. FSDP2:
            the micro source only, from the second window (FSDP2's unsharded parameters, which
            the hooks attach to, appear at the first forward).
        optimizer: needed for ``adam=True`` (its ``exp_avg_sq``) and to log the LR.
        config: :class:`NoiseConfig`.
        unit: the loss's unit, ``"token"`` or ``"sample"``; None: follow the loss — ``"sample"``
            when every window's loss-bearing units equal its samples (a per-sample loss), else
            ``"token"`` (decided at read-out, no extra host sync). A sample-unit estimate is
            added whenever sample counts are known.
        process_group: the DP group (default: DDP's group, else none: one replica).
        comm_hook: your own DDP comm hook ``hook(state, bucket) -> Future`` (PowerSGD, fp16
            compression, ...): the monitor's hook measures the bucket, then calls yours. DDP
            takes one comm hook per model, so register yours through the monitor.
        comm_state: the ``state`` argument of ``comm_hook``.
        clock: the clock the monitor times its own work with (seconds; default
            ``time.perf_counter``). Tests inject one to give the monitor a synthetic cost.
    """


    @property
    def unit(self) -> str:
        """The loss's unit: as given, else followed from the loss (see the ``unit`` argument)."""
        if self._unit is not None:
            return self._unit
        self._flush()
        if self._unit_gap is None:
            return "token"
        return "sample" if float(self._unit_gap) == 0.0 else "token"  # host sync: read-out only

    # -- per window (no host sync; one small async all-reduce under DP) ---------------------------

    def window_end(self, *, loss_scale: Any = None, lr: Any = None, big_grad_multiplier: Any = None,
                   _big_from_driver: bool = False) -> None:
        """Fold in the window. ``.grad`` must hold the window's mean gradient (all ranks), unscaled,
        not yet clipped.

        Args:
            loss_scale: the AMP loss scale S the micro backward passes ran with (a device tensor
                is fine); the micro and rank norms are divided by S². None: 1.
            lr: learning rate of this step, logged beside the estimate.
            big_grad_multiplier: if ``.grad`` is m × the mean gradient, m (default 1).
        """
        t0 = self._clock()
        self._in_window_end = True
        try:
            measured = self._window_end(loss_scale, lr, big_grad_multiplier, _big_from_driver)
        finally:
            self._in_window_end = False
        t1 = self._clock()
        self._own += t1 - t0
        if self._account_at_step_end:  # under the StepDriver: the window ends with its step (on_step_end)
            self._account_at_step_end, self._to_account = False, measured
        else:
            self._account(t1, measured)

    def _account(self, now: float, measured: bool) -> None:
        """Close a window's books: its own seconds and its span; under a budget, ``every`` for the windows
        that follow (it changes only after a measured window)."""
        k, self._micros_seen = self._micros_seen, 0
        if k > 1:  # the hooks of micro-batches 2..k: as long as the first's (timed) — no clock in them
            self._own += self._hooks_timed * (k - 1)
        self._hooks_timed, self._time_hooks = 0.0, True
        own, fold = self._own - self._own_mark, self._fold_s - self._fold_mark
        self._own_mark, self._fold_mark = self._own, self._fold_s
        if k >= 2:  # the window's span: from its first micro-batch's end, plus one micro-batch's mean duration for
            # the first; what the loop does between steps (data, evaluation, another model) is no part of it
            span: float | None = now - self._t_first + (self._t_last - self._t_first) / (k - 1)
        else:       # one micro-batch per rank: from the previous window's end
            span = None if self._boundary is None else now - self._boundary
        step = None if span is None else max(span - own, 0.0)
        self._boundary = now
        self._n_windows += 1
        self._n_measured += measured
        if step is not None:
            self._cost_own += own
            self._cost_step += step
        ctl = self._controller
        if ctl is None:
            return
        t0 = self._clock()
        per_fold = self._fold_s / self._fold_windows if self._fold_windows else 0.0
        # (un)hooking before and after a measured window is part of that window's cost, wherever it ran; so is
        # the last decision (this method, untimed by the window it follows)
        arm, self._arm_mark = self._arm_s - self._arm_mark, self._arm_s
        self._arm_carry += arm
        sample = max(own - fold - arm, 0.0)  # (hooks added by ``monitor.every = n`` ran outside the window)
        arm_s = 0.0
        if measured:
            arm_s, self._arm_carry = self._arm_carry, 0.0
        carry = self._decide_carry
        sample, carry[measured] = sample + carry[measured], 0.0
        n = ctl.update(measured=measured, monitor_s=sample, step_s=step, fold_s_per_window=per_fold, arm_s=arm_s)
        if n != self._every:  # as ``monitor.every = n`` between windows
            self._every = n
            self._every_changes.append((self._n_windows, n))
            self._countdown = min(self._countdown, n - 1)
            self._arm(self._countdown <= 0)
        if measured and self._countdown <= 0 and ctl.leave_out_next():  # at every 1: one window left out now and then
            self._countdown = 1
            self._arm(False)
            self._left_out.append(self._n_windows)
        dt = self._clock() - t0  # outside every span: in the books, and in the next window's sample of its kind
        self._own += dt
        self._own_mark += dt
        self._cost_own += dt
        self._decide_carry[measured] += dt

    def cost(self) -> MonitorCost:
        """What the monitor measured of its own cost: seconds in its hooks, callbacks and folds against
        the bare step, and the windows it measured and left out (no host sync)."""
        ctl = self._controller
        nan = math.nan
        untimed = ctl.untimed if ctl is not None else None
        fraction_all = ((self._cost_own + untimed * self._n_measured) / self._cost_step
                        if untimed is not None and self._cost_step > 0 else nan)
        return MonitorCost(
            budget=self.config.budget, every=self._every, windows=self._n_windows, windows_measured=self._n_measured,
            windows_unmeasured=self._n_windows - self._n_measured, monitor_s=self._cost_own, step_s=self._cost_step,
            fraction=self._cost_own / self._cost_step if self._cost_step > 0 else nan,
            fraction_now=ctl.cost_at(self._every) if ctl is not None else nan,
            measured_window_s=_nan_if_none(ctl.c_measured if ctl is not None else None),
            unmeasured_window_s=_nan_if_none(ctl.c_unmeasured if ctl is not None else None),
            every_changes=tuple(self._every_changes), left_out_at_every_1=tuple(self._left_out), fraction_all=fraction_all,
            wall_extra_s=_nan_if_none(ctl.wall_extra if ctl is not None else None),
            timed_window_s=_nan_if_none(ctl.timed_measured if ctl is not None else None))

    def _window_end(self, loss_scale: Any, lr: Any, big_grad_multiplier: Any, _big_from_driver: bool) -> bool:
        if not self._in_window:
            raise RuntimeError("window_end() before any micro_backward() in this window")
        measured = self._measuring
        self._in_window = self._measuring = False
        self._last_measured = measured
        try:
            if measured:
                self._measure_window(loss_scale, lr, big_grad_multiplier, big_from_driver=_big_from_driver)
                measured = self._last_measured  # False: empty micro-batches left nothing to measure
        finally:
            self._reset_window()
            if measured:
                self._countdown, self._elapsed = self._every - 1, 1
            else:
                self._countdown -= 1
                self._elapsed += 1
            self._arm(self._countdown <= 0)
        return measured

    # -- step-driver callbacks ---------------------------------------------------------------------

    def on_micro_backward(self, driver: Any, micro_index: int, local_count: Any) -> None:
        """:class:`~globalbatch.step.StepDriver` callback.

        The micro-batch's samples come from ``driver.last_micro_samples`` (what was passed as
        ``backward(..., samples=)``, set before the callbacks run), so short and ragged
        micro-batches are weighted by their real size in the per-sample estimate. A monitor
        added in the middle of a window starts at the next one."""
        clock = self._clock
        t0 = clock()
        if not self._micros_seen:
            self._t_first, self._own_first = t0, self._own
            self._time_hooks = False
        self._micros_seen += 1
        self._t_last = t0
        if not self._measuring and self._in_window and not self._installed and not self._armed:
            self._own += clock() - t0  # a window left out, no hooks in place: nothing to record
            return
        counts = self._counts
        seen = len(counts) + self._empty_micros  # micro-batches of this window so far
        if self._fast_micro and self._measuring and self._in_window and self._installed and micro_index == seen:
            count = driver.last_micro_count
            if (type(count) is int or type(count) is float) and count:  # the usual case, in a few Python operations
                # (what micro_backward does for one replica, no Adam variant, a host count)
                slots = self._slots
                n = slots.n
                self._per_micro.append(n - slots.mark)
                slots.mark = n
                counts.append(count)
                self._mults.append(count)
                self._samples.append(float(driver.last_micro_samples))
                self._own += clock() - t0
                return
        try:
            if not self._in_window:
                self._start_window(usable=micro_index == 0)
            elif micro_index != seen:  # attached in the middle of this window: start at the next
                self._measuring = False
            count = getattr(driver, "last_micro_count", None)
            self._micro_backward(count if isinstance(count, (int, float)) else local_count,
                                 driver.last_micro_samples, None)
        finally:
            self._own += clock() - t0

    def on_window_end(self, driver: Any, global_count: Any, local_window_count: Any) -> None:
        """:class:`~globalbatch.step.StepDriver` callback: after sync, normalization, unscale."""
        self._account_at_step_end = True  # its span ends after the step (and the driver's one host sync)
        if not self._measuring:
            if self._in_window:
                self.window_end()
            return
        scaler = driver.scaler
        scale = scaler._scale if scaler is not None else None  # a device tensor: no sync
        opt: Any = driver.optimizer or self.optimizer
        self.window_end(loss_scale=scale, lr=opt.param_groups[0]["lr"], _big_from_driver=not self.config.adam)

    def on_step_end(self, driver: Any, result: Any) -> None:
        """:class:`~globalbatch.step.StepDriver` callback: a window whose step the driver skipped
        (non-finite loss or gradient on some rank) is left out of the estimate."""
        t0 = self._clock()
        self._account_at_step_end = False
        if self._last_measured and self._pending:
            last = self._pending[-1]
            if result.skipped:
                last["dropped"] = True
            if "big_sq" in last and last["big_sq"] is None:
                last["big_sq"] = result.grad_norm ** 2  # pre-clip, unscaled, after the sync: host float
            self._last_measured = False
        self._slots.drop()
        self._slots_adam.drop()  # nothing from between windows reaches the next one
        t1 = self._clock()
        self._own += t1 - t0
        measured, self._to_account = self._to_account, None
        if measured is not None:
            self._account(t1, measured)

    # -- read-out (host sync) -------------------------------------------------------------------

    def estimate(self, source: str | None = None, unit: str | None = None, *, adam: bool = False) -> NoiseScaleEstimate:
        """The estimate of one source (default: the first configured) in one unit (default: the loss's).

        Before any window it returns an estimate flagged ``"no_windows"``. Raises ValueError for a
        source or unit this monitor does not measure.
        """
        self._flush()
        source = source or self.sources[0]
        unit = unit or self.unit
        key = f"{source}{'_adam' if adam else ''}/{unit}"
        allowed = self._keys()
        if key not in allowed:
            raise SettingError("estimate", key, f"{', '.join(allowed)} (the noise scale {NEEDS_TWO_BATCH_SIZES})",
                               why="not measured")
        est = self.estimators.get(key)
        if est is None:
            est = self._estimator(key)
        return est.estimate()

    def _keys(self) -> list[str]:
        units = self._units()
        if self._unit is None and self.unit == "sample":
            units = ["sample"]  # a per-sample loss: its "token" numbers are the same counts
        return [f"{v}/{u}" for v in self._variants() for u in units]

    def estimates(self) -> dict[str, NoiseScaleEstimate]:
        """Every estimate measured so far, keyed ``"micro/token"``, ``"rank/sample"``, ``"micro_adam/token"``, ..."""
        self._flush()
        keys = set(self._keys())
        out = {k: e.estimate() for k, e in sorted(self.estimators.items()) if k in keys}
        return {k: e for k, e in out.items() if e.windows or e.skipped_windows}  # never fed: not measured

    def state_dict(self) -> dict[str, Any]:
        self._flush()
        return {k: e.state_dict() for k, e in self.estimators.items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for k, v in sd.items():
            self._estimator(k).load_state_dict(v)
