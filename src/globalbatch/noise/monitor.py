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
one matrix). The norm slots, the FSDP2 parameters and the DDP comm hook live in
:mod:`globalbatch.noise.sources`; the host arithmetic in :mod:`globalbatch.noise.window`.
``every=n`` measures one window in n: between measured windows the parameter hooks are
removed, so the skipped windows cost a few Python calls. The monitor times its own work (hooks,
callbacks, folds; a host clock, no device sync) and reports it (:meth:`NoiseScaleMonitor.cost`);
with ``NoiseConfig(budget=...)`` it picks ``every`` from that cost
(:class:`globalbatch.noise.budget.EveryController`).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from globalbatch.errors import Raw, SettingError
from globalbatch.noise.estimator import (
    _B0,
    _STATE_LEN,
    NEEDS_TWO_BATCH_SIZES,
    NoiseScaleEstimate,
    NoiseScaleEstimator,
    _as_tensor,
    ema_fold,
)
from globalbatch.noise.budget import EveryController, MonitorCost
from globalbatch.noise.config import SOURCES, NoiseConfig, _check_every
from globalbatch.noise.sources import _FOLD_EVERY_HOST, _CommHookDispatch, _fsdp_unsharded_params, _NormSlots, _vector_norm
from globalbatch.noise.window import _host_numbers, _host_weights, _scalars, raw_vectors
from globalbatch.parallel import inspect_parallel

__all__ = ["SOURCES", "NoiseConfig", "NoiseScaleMonitor"]

_FOLD_EVERY = 32  # measured windows queued (one small vector each) before they are folded in on the device


class NoiseScaleMonitor:
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

    def __init__(self, model: torch.nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
                 config: NoiseConfig | None = None, unit: str | None = None, process_group: Any = None,
                 comm_hook: Callable[..., Any] | None = None, comm_state: Any = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.config = config if config is not None else NoiseConfig()
        # The monitor's own cost: seconds in its hooks, callbacks and folds (host clock, no device sync).
        self._clock = clock if clock is not None else time.perf_counter
        self._own = 0.0                                # seconds of the monitor's own work so far
        self._fold_s, self._fold_windows = 0.0, 0      # ... of which folds, and the windows they folded
        self._own_mark = self._fold_mark = 0.0         # the totals at the last window's end
        self._boundary: float | None = None            # clock at the last window's end
        self._in_window_end = False
        self._n_windows = self._n_measured = 0
        self._cost_own = self._cost_step = 0.0         # over windows with a previous boundary
        self._every_changes: list[tuple[int, int]] = []
        self._arm_s = self._arm_mark = self._arm_carry = 0.0  # seconds spent adding and removing hooks
        self._micros_seen = 0                          # micro-batch calls in this window (measured or not)
        self._time_hooks = True                        # the hooks read the clock (the window's first micro-batch)
        self._hooks_timed = 0.0                        # ... and the seconds they read
        self._t_first = self._own_first = 0.0          # clock and own seconds at this window's first one
        if unit not in (None, "token", "sample"):
            raise SettingError("unit", unit, "'token', 'sample' or None (follow the loss)")
        self._unit = unit
        self.optimizer = optimizer
        if self.config.adam and optimizer is None:
            raise SettingError("optimizer", None, "the Adam/AdamW optimizer (the variant needs its exp_avg_sq)",
                               why="with adam=True")
        info = inspect_parallel(model)
        ddp = info.sync_module if info.kind == "ddp" else None
        self._fsdp = info.sync_module if info.kind == "fsdp2" else None
        if self._fsdp is not None and self.config.adam:
            raise SettingError("adam", True, "adam False (the variant is measured on plain and DDP models only)",
                               why="with an FSDP2 model")
        if process_group is not None and ddp is None and self._fsdp is None:
            raise SettingError("process_group", Raw(repr(process_group)), "None with a plain module, or a DDP model (the "
                               "monitor sees each rank's gradient before the all-reduce)")
        if comm_hook is not None and ddp is None:
            raise SettingError("comm_hook", Raw(getattr(comm_hook, "__name__", type(comm_hook).__name__)),
                               "None with a plain module, or a DDP model")
        self.model = model
        self._ddp = ddp
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        import torch.distributed as dist

        self._group: Any = process_group if process_group is not None else (ddp.process_group if ddp is not None else None)
        self.dp_world_size = dist.get_world_size(self._group) if (ddp is not None or self._fsdp is not None) else 1  # type: ignore[arg-type]
        # FSDP2 has no comm hook to wrap: its "rank" source is left out (the micro source pools ranks).
        self.sources = tuple(s for s in self.config.sources
                             if s != "rank" or (self.dp_world_size > 1 and self._fsdp is None))
        if not self.sources:
            raise SettingError("sources", self.config.sources, f"add 'micro' with grad_accum_steps ≥ 2 (the noise scale "
                               f"{NEEDS_TWO_BATCH_SIZES})", why=f"with dp_world_size {self.dp_world_size}")
        self._micro = "micro" in self.sources
        self._adam_on = self.config.adam
        self._every = _check_every(self.config.every)
        self._controller = (EveryController(self.config.budget, every=self._every)
                            if self.config.budget is not None else None)
        self.estimators: dict[str, NoiseScaleEstimator] = {}
        self._state: torch.Tensor | None = None        # (n_estimators, 12): one row per estimator
        self._device: torch.device | None = None
        self._precond: Any = None  # list[torch.Tensor] once built (:meth:`_ensure_precond`), indexed in the hooks
        self._precond_ready = False
        self._pending: list[dict[str, Any]] = []          # measured windows not yet folded in
        self._unit_gap: torch.Tensor | None = None     # Σ|units − samples| over windows (unit=None)
        self._unit_checks = 0
        # Filled by the parameter hooks during a micro backward (persistent lists: the hooks bind them).
        self._slots = _NormSlots()                     # |Δ| per (micro, parameter), written by the hooks
        self._slots_adam = _NormSlots()
        self._hooks: list[Any] = []
        self._installed = False                        # the parameter hooks are in place
        self._attached = True
        self._countdown = 0                            # windows to leave out before the next measured one
        self._elapsed = 1                              # windows since the last measured one, this one included
        self._in_window = False
        self._measuring = False
        self._last_measured = False
        self._armed = True
        self._host_path = True                         # CPU, one replica: window statistics on the host
        # ... and, under the StepDriver without Adam variant or loss scale, computed at the fold
        self._deferrable = self.dp_world_size == 1 and self.sources == ("micro",) and not self.config.adam
        self._fast_micro = self._deferrable and self._fsdp is None  # on_micro_backward's short path applies
        self._reset_window()
        if self._micro:
            self._add_param_hooks()
        if ddp is not None and ("rank" in self.sources or comm_hook is not None):
            _CommHookDispatch.attach(ddp, self._group, self, comm_hook, comm_state)

    # -- attach, detach, every ---------------------------------------------------------------

    @property
    def unit(self) -> str:
        """The loss's unit: as given, else followed from the loss (see the ``unit`` argument)."""
        if self._unit is not None:
            return self._unit
        self._flush()
        if self._unit_gap is None:
            return "token"
        return "sample" if float(self._unit_gap) == 0.0 else "token"  # host sync: read-out only

    @property
    def every(self) -> int:
        """Measure one window in ``every``. Setting it takes effect from the next window."""
        return self._every

    @every.setter
    def every(self, n: int) -> None:
        self._every = _check_every(n)
        if self._controller is not None:  # with a budget: the value from now on, until the cost moves it
            self._controller.every = n
        self._countdown = min(self._countdown, n - 1)
        if not self._in_window:
            self._arm(self._countdown <= 0)

    def detach(self) -> None:
        """Stop measuring: remove the parameter hooks (the estimates stay readable). Under DDP the
        comm hook keeps running the wrapped (or default) all-reduce without measuring."""
        self._attached = False
        self._measuring = False  # a window in progress is left out
        self._arm(False)

    def attach(self) -> None:
        """Measure again after :meth:`detach`, from the next window that starts."""
        self._attached = True
        if not self._in_window:
            self._arm(self._countdown <= 0)

    def _add_param_hooks(self) -> None:
        if self._installed:
            return
        slots, slots_adam = self._slots, self._slots_adam
        mon = self
        clock = self._clock

        def make(i: int) -> Callable[[torch.Tensor], None]:
            def hook(grad: torch.Tensor) -> None:
                # Δ of this parameter as it arrives, before AccumulateGrad adds it into .grad and before
                # any DP all-reduce: its norm now, while the gradient is still in cache; nothing is held.
                # (Lean on purpose: this runs once per parameter per micro-batch. Timed in a window's first
                # micro-batch only; the window's end extrapolates to the others.)
                timed = mon._time_hooks
                if timed:
                    t0 = clock()
                j = slots.n
                views = slots.views
                if j < len(views) and grad.dtype is views[j].dtype:
                    try:
                        _vector_norm(grad, 2, None, False, out=views[j])
                        slots.n = j + 1
                    except RuntimeError:  # another device than the buffer's
                        slots.put(grad)
                else:
                    slots.put(grad)
                if mon._adam_on and mon._ensure_precond():
                    slots_adam.put(grad * mon._precond[i])
                if timed:
                    dt = clock() - t0
                    mon._own += dt
                    mon._hooks_timed += dt
            return hook

        targets = self._params if self._fsdp is None else _fsdp_unsharded_params(self._fsdp)
        if targets is None:  # FSDP2 before its first forward: the unsharded parameters do not exist yet
            return
        self._hooks = [p.register_hook(make(i)) for i, p in enumerate(targets)]
        self._installed = True

    def _arm(self, on: bool) -> None:
        """Hooks in place exactly when the next window is measured (skipped windows cost nothing)."""
        on = on and self._attached
        if on and self._micro and not self._installed:
            t0 = self._clock()
            self._add_param_hooks()
            self._arm_s += self._clock() - t0
        elif not on and self._installed:
            t0 = self._clock()
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self._installed = False
            self._arm_s += self._clock() - t0
        self._slots.drop()
        self._slots_adam.drop()
        self._armed = on

    # -- names ---------------------------------------------------------------------------

    def _variants(self) -> list[str]:
        names = list(self.sources)
        if self.config.adam:
            names += [s + "_adam" for s in self.sources]
        return names

    def _units(self) -> list[str]:
        return ["sample"] if self._unit == "sample" else ["token", "sample"]

    def _estimator(self, key: str) -> NoiseScaleEstimator:
        est = self.estimators.get(key)
        if est is None:
            c = self.config
            est = NoiseScaleEstimator(unit=key.split("/")[1], half_life=c.half_life,
                                      half_life_windows=c.half_life_windows, confidence=c.confidence,
                                      min_windows=c.min_windows, max_relative_stderr=c.max_relative_stderr,
                                      max_interval_ratio=c.max_interval_ratio, device=self._device)
            self.estimators[key] = est
        return est

    def _rows(self, names: list[str]) -> torch.Tensor:
        """The state matrix of the estimators ``names``, in order (each estimator's ``state`` is a
        view of its row, so the estimators read what one fold writes)."""
        for n in names:
            self._estimator(n)
        if self._state is None or self._state.device != self._device or \
                any(self.estimators[n].state.data_ptr() != self._state[j].data_ptr() for j, n in enumerate(names)):
            state = torch.zeros(len(names), _STATE_LEN, dtype=torch.float64, device=self._device)
            for j, n in enumerate(names):
                state[j].copy_(self.estimators[n].state)
                self.estimators[n].state = state[j]
            self._state = state
        return self._state

    # -- window state ------------------------------------------------------------------------

    def _reset_window(self) -> None:
        self._slots.reset()
        self._slots_adam.reset()
        self._per_micro: list[int] = []                # how many norms each micro-batch added
        self._empty_micros = 0                         # micro-batches without loss-bearing units (left out)
        self._counts: list[Any] = []
        self._mults: list[Any] = []
        self._samples: list[float] = []
        self._samples_known = True
        self._hook_rank: list[torch.Tensor] = []      # filled by the comm hook during a syncing backward
        self._hook_rank_adam: list[torch.Tensor] = []
        self._synced_micro = -1
        self._precond_ready = False

    def _start_window(self, *, usable: bool = True) -> None:
        self._in_window = True
        if self._installed and self._slots.n - self._slots.mark > len(self._hooks):
            # More norms than one backward writes: backward passes ran with the hooks in place before this
            # window while nobody fed the monitor (built, then appended to a driver's callbacks later).
            # Their norms are not this window's: it is left out, and the next one starts clean.
            usable = False
        self._measuring = self._armed and usable

    def _ensure_precond(self) -> bool:
        """1/(√v̂ + eps) per parameter from the optimizer (state of the previous step). False if none yet."""
        if self._precond_ready:
            return self._precond is not None
        self._precond_ready = True
        opt: Any = self.optimizer  # set: the Adam variant needs it (checked when built)
        vs, bcs, epss = [], [], []
        for group in opt.param_groups:
            beta2, eps = group.get("betas", (None, 0.999))[1], group.get("eps", 1e-8)
            for p in group["params"]:
                if id(p) not in self._index:
                    continue
                st = opt.state.get(p, {})
                if "exp_avg_sq" not in st:
                    self._precond = None
                    return False
                step = st.get("step", 1)
                if isinstance(step, torch.Tensor):
                    step = step.item() if step.device.type == "cpu" else step  # CPU scalar: no device sync
                vs.append((self._index[id(p)], st["exp_avg_sq"]))
                bcs.append((1.0 - beta2 ** step) ** 0.5)
                epss.append(eps)
        if len(vs) != len(self._params):
            raise SettingError("optimizer", Raw(f"holding {len(vs)} of the model's {len(self._params)} trainable parameters"),
                               "an optimizer over all of them", why="with adam=True")
        if self._precond is None:
            self._precond = [torch.empty_like(p) for p in self._params]
        order = sorted(range(len(vs)), key=lambda j: vs[j][0])
        dst = [self._precond[vs[j][0]] for j in order]
        torch._foreach_copy_(dst, [vs[j][1] for j in order])
        torch._foreach_sqrt_(dst)
        for t, j in zip(dst, order):  # per-parameter bias correction and eps: once per window, not per micro
            t.div_(bcs[j]).add_(epss[j])
        torch._foreach_reciprocal_(dst)
        return True

    # -- per micro-batch (no host sync) ------------------------------------------------------------

    def micro_backward(self, count: Any, *, samples: float | None = None, grad_multiplier: Any = None,
                       is_last: bool | None = None) -> None:
        """Record |g_micro|² of the micro-batch whose backward just ran.

        Args:
            count: its loss-bearing units b_i (a device tensor avoids a copy).
            samples: its samples (sequences), for the sample-unit estimate; omit if unknown.
            grad_multiplier: m_i with Δ.grad = m_i · (mean gradient of the micro-batch), before
                loss scaling; default ``count`` (backward on the *summed* loss). For a loop that
                back-propagates ``loss.mean() / k``, pass ``1 / k``.
            is_last: accepted for compatibility; no longer needed (there is no snapshot to save).
        """
        t0 = self._clock()
        if not self._micros_seen:
            self._t_first, self._own_first = t0, self._own
            self._time_hooks = False
        self._micros_seen += 1
        try:
            self._micro_backward(count, samples, grad_multiplier)
        finally:
            self._own += self._clock() - t0

    def _micro_backward(self, count: Any, samples: float | None, grad_multiplier: Any) -> None:
        if not self._in_window:
            self._start_window()
        if self._micro and self._armed and not self._installed:  # FSDP2: hooks possible after the first forward
            self._add_param_hooks()
            self._measuring = False  # this window's earlier backward passes were not seen
        if not self._measuring:
            self._slots.drop()
            self._slots_adam.drop()
            return
        if self._synced_micro >= 0:
            raise SettingError("micro_backward", Raw(f"micro-batch {len(self._counts)} after a DDP gradient sync in "
                                                     f"micro-batch {self._synced_micro}"),
                               "all but the last micro-batch under model.no_sync()")
        if self._hook_rank:
            self._synced_micro = len(self._counts)
        if isinstance(count, torch.Tensor) and count.device.type == "cpu":
            count = count.item()  # a CPU tensor (the driver's host counts): no device sync
        if isinstance(grad_multiplier, torch.Tensor) and grad_multiplier.device.type == "cpu":
            grad_multiplier = grad_multiplier.item()
        if not isinstance(count, torch.Tensor) and count == 0:
            # No loss-bearing units (every target masked, or padding): it added nothing and is no small batch.
            # Under DP each rank leaves its own out and the window's k is summed over ranks by the all-reduce,
            # so every rank folds the same window (a device count: the same, on the device, at the window end).
            self._slots.drop()
            self._slots_adam.drop()
            self._empty_micros += 1
            return
        if self._micro:
            self._per_micro.append(self._slots.close_micro())  # norms the hooks wrote in this backward
            self._slots_adam.close_micro()
        self._counts.append(count)
        self._mults.append(count if grad_multiplier is None else grad_multiplier)
        if samples is None:
            self._samples_known = False
        else:
            self._samples.append(float(samples))

    def _hook_bucket(self, bucket: Any) -> None:
        """Inside the DDP comm hook, before the all-reduce: this rank's norm of the bucket."""
        t0 = self._clock()
        try:
            self._measure_bucket(bucket)
        finally:
            self._own += self._clock() - t0

    def _measure_bucket(self, bucket: Any) -> None:
        if not self._in_window:  # one micro-batch per window: the sync runs before micro_backward
            self._start_window()
        if not self._measuring or "rank" not in self.sources:
            return
        self._hook_rank.append(torch.linalg.vector_norm(bucket.buffer(), dtype=torch.float64))
        if self.config.adam and self._ensure_precond():
            idx = [self._index[id(p)] for p in bucket.parameters()]
            self._hook_rank_adam.append(
                torch.linalg.vector_norm(torch.stack(torch._foreach_norm(
                    torch._foreach_mul(bucket.gradients(), [self._precond[i] for i in idx]))).double()))

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
        self._account(t1, measured)

    def _account(self, now: float, measured: bool) -> None:
        """Close a window's books: its own seconds and bare step seconds; under a budget, ``every`` for
        the windows that follow (it changes only after a measured window)."""
        k, self._micros_seen = self._micros_seen, 0
        if k > 1:  # the hooks of micro-batches 2..k: as long as the first's (timed) — no clock in them
            self._own += self._hooks_timed * (k - 1)
        self._hooks_timed, self._time_hooks = 0.0, True
        own, fold = self._own - self._own_mark, self._fold_s - self._fold_mark
        self._own_mark, self._fold_mark = self._own, self._fold_s
        if k >= 2:  # the window's own compute: from its first micro-batch's end, scaled by k / (k − 1); what the
            # loop does between steps (data, evaluation, another model) is no part of the step the budget is of
            step: float | None = max(now - self._t_first - (self._own - self._own_first), 0.0) * k / (k - 1)
        else:       # one micro-batch per rank: from the previous window's end
            step = None if self._boundary is None else max(now - self._boundary - own, 0.0)
        self._boundary = now
        self._n_windows += 1
        self._n_measured += measured
        if step is not None:
            self._cost_own += own
            self._cost_step += step
        ctl = self._controller
        if ctl is None:
            return
        per_fold = self._fold_s / self._fold_windows if self._fold_windows else 0.0
        # (un)hooking before and after a measured window is part of that window's cost, wherever it ran
        arm, self._arm_mark = self._arm_s - self._arm_mark, self._arm_s
        self._arm_carry += arm
        sample = max(own - fold - arm, 0.0)  # (hooks added by ``monitor.every = n`` ran outside the window)
        if measured:
            sample, self._arm_carry = sample + self._arm_carry, 0.0
        n = ctl.update(measured=measured, monitor_s=sample, step_s=step, fold_s_per_window=per_fold)
        if n != self._every:  # as ``monitor.every = n`` between windows
            self._every = n
            self._every_changes.append((self._n_windows, n))
            self._countdown = min(self._countdown, n - 1)
            self._arm(self._countdown <= 0)

    def cost(self) -> MonitorCost:
        """What the monitor measured of its own cost: seconds in its hooks, callbacks and folds against
        the bare step, and the windows it measured and left out (no host sync)."""
        ctl = self._controller
        nan = math.nan
        return MonitorCost(
            budget=self.config.budget, every=self._every, windows=self._n_windows, windows_measured=self._n_measured,
            windows_unmeasured=self._n_windows - self._n_measured, monitor_s=self._cost_own, step_s=self._cost_step,
            fraction=self._cost_own / self._cost_step if self._cost_step > 0 else nan,
            fraction_now=ctl.cost_at(self._every) if ctl is not None else nan,
            measured_window_s=(ctl.c_measured if ctl is not None and ctl.c_measured is not None else nan),
            unmeasured_window_s=(ctl.c_unmeasured if ctl is not None and ctl.c_unmeasured is not None else nan),
            every_changes=tuple(self._every_changes))

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

    def _measure_window(self, loss_scale: Any, lr: Any, big_grad_multiplier: Any, *, big_from_driver: bool) -> None:
        """The window's sufficient statistics as one float64 vector (a short op chain), queued."""
        k_local = len(self._counts)
        if k_local * self.dp_world_size < 2:
            if not (self._empty_micros and (k_local + self._empty_micros) * self.dp_world_size >= 2):
                raise SettingError("grad_accum_steps", k_local, f"≥ 2 small batches per window (the noise scale "
                                   f"{NEEDS_TWO_BATCH_SIZES})", why=f"with dp_world_size {self.dp_world_size}")
            if self.dp_world_size == 1:
                self._last_measured = False  # empty micro-batches left fewer than two small batches: not measured
                return
            # Under DP the other ranks' small batches count too (k is summed by the all-reduce): this rank sends
            # its vector, all zeros when its whole window was empty; < 2 over all ranks is skipped at the fold.
        if self._device is None:
            g0 = next((p.grad for p in self._params if p.grad is not None), None)
            g0 = getattr(g0, "_local_tensor", g0)
            self._device = g0.device if g0 is not None else torch.device("cpu")
        dev = self._device
        buf = self._slots.buf
        if self._deferrable and big_from_driver and big_grad_multiplier is None and loss_scale is None \
                and dev.type == "cpu" and buf is not None and buf.device.type == "cpu" and self._host_path \
                and _host_numbers(self._counts) \
                and (self._mults is self._counts or _host_numbers(self._mults)):
            # CPU, one replica, under the StepDriver (|G_big|² from its on_step_end): leave the norms in
            # their ring row and keep the window's lists; the fold computes hundreds of windows' vectors
            # at once (:meth:`_raw_vectors`). Nothing here touches a tensor.
            samples_known = self._samples_known and len(self._samples) == k_local
            raw: Any = (self._slots.advance(), self._per_micro, self._counts, self._mults,
                   self._samples if samples_known else None)
            self._queue(None, None, samples_known, False, lr, True, raw=raw)
            return
        adam = self.config.adam and self._ensure_precond()
        # |G_big|²: under the StepDriver, its pre-clip gradient norm (read in its one host sync) arrives
        # in on_step_end at no cost; otherwise one read of .grad here.
        big_later = big_from_driver and big_grad_multiplier is None
        samples_known = self._samples_known and len(self._samples) == k_local
        local_samples = sum(self._samples) if samples_known else 0.0
        hw = _host_weights(self._counts, self._mults, self._samples if samples_known else None)
        if hw is not None and dev.type == "cpu" and self.dp_world_size == 1 and self._host_path:
            # CPU, one replica: the same vector with host arithmetic (reading a CPU tensor is no device
            # sync) — a few tensor calls instead of a chain of ~20 tiny ones, which cost more than the
            # arithmetic on small models.
            vec: Any = self._host_vector(hw, local_samples, k_local, big_later, adam, loss_scale, big_grad_multiplier)
            self._queue(None, vec, samples_known, adam, lr, big_later)
            return
        active = [i for i, p in enumerate(self._params) if p.grad is not None]
        grads: list[Any] = [self._params[i].grad for i in active]  # not None: active
        if self._fsdp is not None:  # sharded: local shard norms, × replicas so that Σ over ranks / R = |G|²
            local = [getattr(g, "_local_tensor", g) for g in grads]
            big = [torch.zeros((), dtype=torch.float64, device=dev) if big_later else
                   torch.linalg.vector_norm(torch.stack(torch._foreach_norm(local)), dtype=torch.float64)
                   * math.sqrt(self.dp_world_size)]
        else:
            big = [torch.zeros((), dtype=torch.float64, device=dev) if big_later else
                   torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)), dtype=torch.float64)]
        if self.config.adam:
            big.append(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(torch._foreach_mul(
                grads, [self._precond[i] for i in active]))), dtype=torch.float64) if adam else big[0])
        if hw is not None:  # counts on the host (numbers or CPU tensors): the weights in Python, one tensor
            units_f, w_rows, mult_sum_t_host = hw
            mult_sum_t: Any = mult_sum_t_host
            head = torch.tensor([units_f, local_samples, float(k_local), 1.0], dtype=torch.float64, device=dev)
            w = torch.tensor(w_rows, dtype=torch.float64, device=dev)
        else:  # device tensors: the same on the device, no host sync
            counts = _scalars(self._counts, dev)
            mults = counts if all(m is c for m, c in zip(self._mults, self._counts)) else _scalars(self._mults, dev)
            smp = torch.tensor(self._samples if samples_known else [0.0] * k_local, dtype=torch.float64, device=dev)
            # b_i/m_i² and s_i/m_i² turn |Δ_i|² = m_i²|g_i|² into b_i|g_i|² and s_i|g_i|²; a micro-batch with
            # count 0 (known only on the device here) is no small batch: weight 0, not counted in k
            nonempty = counts > 0
            w = torch.where(nonempty, torch.stack([counts, smp]) / mults.square(), 0.0)
            mult_sum_t = mults.sum()
            head = torch.stack([counts.sum(), (smp * nonempty).sum(), nonempty.sum().to(torch.float64),
                                torch.ones((), dtype=torch.float64, device=dev)])
        # Layout (summed over ranks): 0 units, 1 samples, 2 k, 3 replicas (1 per rank), 4 |G_big|² × replicas,
        # 5 its Adam variant × replicas, then per configured variant: [Σ b_i|g_i|², Σ s_i|g_i|²].
        big_sq = torch.stack(big if self.config.adam else big * 2).square()  # [|G_big|², its Adam variant]
        if big_grad_multiplier is not None:
            big_sq = big_sq / _as_tensor(big_grad_multiplier, dev) ** 2
        parts = [head, big_sq]
        for name in self._variants():
            source, is_adam = name.split("_")[0], name.endswith("_adam")
            if is_adam and not adam:
                parts.append(torch.zeros(2, dtype=torch.float64, device=dev))  # not present this window
            elif source == "micro":
                norms = (self._slots_adam if is_adam else self._slots).written()
                per = self._per_micro
                if not per:                                                 # DP: this rank's window was empty
                    per_micro = torch.zeros(0, dtype=torch.float64, device=dev)
                elif all(n == per[0] for n in per):                         # the usual case: same parameters
                    per_micro = torch.linalg.vector_norm(norms.view(k_local, per[0]), dim=1, dtype=torch.float64)
                else:
                    per_micro = torch.stack([torch.linalg.vector_norm(c, dtype=torch.float64) for c in norms.split(per)])
                parts.append(w @ per_micro.square())
            else:  # a_r = S·M_r·g_r with M_r = Σ m_i (= B_r for sum-loss): b_r|g_r|² = b_r·raw/(S·M_r)²
                hooked = self._hook_rank_adam if is_adam else self._hook_rank
                if not hooked:
                    raise RuntimeError("source 'rank': the DDP comm hook did not run in this window "
                                       "(was the last micro-batch run outside no_sync()?)")
                # A rank whose window had no loss-bearing unit (M_r = 0) is no small batch of this source,
                # and k here is the replicas: the window is left out of the rank source (NaN: skipped, all ranks).
                m_r = _as_tensor(mult_sum_t, dev).reshape(())
                raw = torch.where(m_r != 0, torch.stack(hooked).square().sum() / m_r ** 2, math.nan)
                parts.append(raw * head[0:2])
        vec = torch.cat(parts)
        if loss_scale is not None:  # the small norms carry S²; counts and the (unscaled) big norm do not
            vec = torch.cat([vec[:6], vec[6:] / _as_tensor(loss_scale, dev).reshape(()) ** 2])
        work = None
        if self.dp_world_size > 1:
            import torch.distributed as dist

            work = dist.all_reduce(vec, group=self._group, async_op=True)  # waited on at the fold
        self._queue(work, vec, samples_known, adam, lr, big_later)

    def _host_vector(self, hw: tuple[float, list[list[float]], float], local_samples: float, k_local: int,
                     big_later: bool, adam: bool, loss_scale: Any, big_grad_multiplier: Any) -> list[float]:
        """:meth:`_measure_window`'s vector from host arithmetic (CPU, one replica), as a list; equal to
        the tensor path's to rounding (``tests/test_noise.py::test_host_path_equals_tensor_path``).
        Measured in place after a backward, every torch call here costs 5–15 µs (cold caches), so
        the norms are read with one ``tolist()`` and the rest is Python."""
        units_f, (w_units, w_samples), _ = hw
        if big_later:
            big = [0.0, 0.0]
        else:
            active = [i for i, p in enumerate(self._params) if p.grad is not None]
            grads: list[Any] = [self._params[i].grad for i in active]  # not None: active
            b = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)), dtype=torch.float64))
            b_adam = b
            if self.config.adam and adam:
                b_adam = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(torch._foreach_mul(
                    grads, [self._precond[i] for i in active]))), dtype=torch.float64))
            big = [b * b, b_adam * b_adam]
        if big_grad_multiplier is not None:
            m2 = float(big_grad_multiplier) ** 2
            big = [x / m2 for x in big]
        vec = [units_f, local_samples, float(k_local), 1.0, *big]
        inv_s2 = 1.0 / float(loss_scale) ** 2 if loss_scale is not None else 1.0
        per = self._per_micro
        for name in self._variants():  # one replica: "micro" and "micro_adam" only
            if name.endswith("_adam") and not adam:
                vec += [0.0, 0.0]
                continue
            slots = self._slots_adam if name.endswith("_adam") else self._slots
            vals = slots.buf.tolist() if slots.buf is not None else []  # one call: the whole small buffer
            sq, pos = [], 0
            for n in per:
                sq.append(sum(x * x for x in vals[pos:pos + n]))
                pos += n
            vec += [sum(w * x for w, x in zip(w_units, sq)) * inv_s2, sum(w * x for w, x in zip(w_samples, sq)) * inv_s2]
        return vec

    def _queue(self, work: Any, vec: torch.Tensor | list[float] | None, samples_known: bool, adam: bool, lr: Any,
               big_later: bool, raw: tuple[Any, ...] | None = None) -> None:
        entry = {"work": work, "vec": vec, "raw": raw, "samples_known": samples_known, "adam": adam, "lr": lr,
                 "windows": float(self._elapsed), "dropped": False}
        if big_later:
            entry["big_sq"] = None  # filled by on_step_end; a window the driver never finished stays out
        self._pending.append(entry)
        limit = _FOLD_EVERY if isinstance(vec, torch.Tensor) else \
            _FOLD_EVERY_HOST if raw is None else min(_FOLD_EVERY_HOST, self._slots.capacity)
        if len(self._pending) > limit:  # the newest may still await on_step_end (a raw entry's ring row stays
            # valid: the ring has a row for each queued window, one awaiting its step and the next)
            self._flush(keep_last=True)

    def _raw_vectors(self, raws: list[tuple[Any, ...]]) -> torch.Tensor:
        """The deferred CPU windows' vectors, from the norms kept in the slots' ring."""
        return raw_vectors(self._slots.ring, raws)  # type: ignore[arg-type]  # a queued window: the ring exists

    def _flush(self, keep_last: bool = False) -> None:
        """Fold every queued window into the estimators at once (one op chain, no host sync). A window
        still waiting for the driver's on_step_end (its |G_big|²) stays queued. Timed: a fold is part
        of the monitor's cost, amortized over the windows it folds."""
        if not self._pending:
            return
        t0 = self._clock()
        n = len(self._pending)
        try:
            self._fold(keep_last)
        finally:
            dt = self._clock() - t0
            self._fold_s += dt
            self._fold_windows += n - len(self._pending)
            if not self._in_window_end:  # a read-out's fold (window_end's own time holds its folds)
                self._own += dt

    def _fold(self, keep_last: bool) -> None:
        if self._pending and self._last_measured and self._pending[-1].get("big_sq", 0.0) is None:
            keep_last = True
        pend = self._pending[:-1] if keep_last else self._pending
        if not pend:
            return
        self._pending = self._pending[-1:] if keep_last else []
        for p in pend:
            if p["work"] is not None:
                p["work"].wait()
        vecs = [p["vec"] for p in pend]
        raw = [p["raw"] for p in pend if p["raw"] is not None]
        if raw:                                                   # deferred CPU windows: computed together
            R = self._raw_vectors(raw)
            if len(raw) == len(pend):
                V = R
            else:
                rows = iter(R)
                V = torch.stack([next(rows) if v is None else torch.as_tensor(v, dtype=torch.float64) for v in vecs])
        elif all(isinstance(v, list) for v in vecs):              # the CPU host path: one tensor for all
            V = torch.tensor(vecs, dtype=torch.float64)
        else:
            V = torch.stack([v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64) for v in vecs])
        dev = V.device
        if any("big_sq" in p for p in pend):  # |G_big|² from the driver's host-side norm (× replicas, as summed)
            for p in pend:
                if p.get("big_sq", 0.0) is None:
                    p["dropped"] = True  # the driver refused the window before its step: never applied
            host = torch.tensor([[p.get("big_sq") or 0.0, float("big_sq" in p)] for p in pend], dtype=torch.float64,
                                device=dev)
            from_driver = (host[:, 1:2] * V[:, 3:4]) * host[:, 0:1]
            V[:, 4:6] = torch.where(host[:, 1:2] > 0, from_driver, V[:, 4:6])  # (no Adam variant on this path)
        names, idx, need_smp, need_adam = self._layout(dev)
        if self._unit is None and self._unit_checks < 4:
            known = [p["samples_known"] for p in pend]
            if any(known):
                gap = (V[known, 0] - V[known, 1]).abs().sum()
                self._unit_gap = gap if self._unit_gap is None else self._unit_gap + gap
                self._unit_checks += 1
        present = torch.tensor([[(p["samples_known"] or not s) and (p["adam"] or not a)
                                 for s, a in zip(need_smp, need_adam)] for p in pend], device=dev)
        vals = V[:, idx]                                           # (m, 4, n): Σ-terms, k or replicas, B, R·|G_big|²
        if any(p["dropped"] for p in pend):                       # the driver skipped these steps: not measured
            bad = torch.tensor([math.nan if p["dropped"] else 1.0 for p in pend], dtype=torch.float64, device=dev)
            vals = vals * bad[:, None, None]
        weighted, n_small, units, big_sq = vals.unbind(1)
        big_sq = big_sq / V[:, 3:4]
        # fewer than two small batches over all ranks (count-0 micro-batches left out under DP): skipped
        tr = torch.where(n_small >= 2, (weighted - units * big_sq) / (n_small - 1), math.nan)
        tg = torch.stack([tr, big_sq - tr / units], 2)
        state = self._rows(names)
        windows = torch.tensor([p["windows"] for p in pend], dtype=torch.float64, device=dev)[:, None]
        ema_fold(state, tg, units, self._decay(state, units, present, windows), present, lr=pend[-1]["lr"])

    def _layout(self, device: torch.device) -> tuple[list[str], torch.Tensor, list[bool], list[bool]]:
        """Estimator names and their gather indices into a window vector (fixed per monitor)."""
        hit = getattr(self, "_layout_cache", None)
        if hit is None or hit[1].device != device:
            units = (("sample", 0),) if self._unit == "sample" else (("token", 0), ("sample", 1))
            pairs = [(j, v, u, c) for j, v in enumerate(self._variants()) for u, c in units]
            idx = torch.tensor([[6 + 2 * j + c for j, v, u, c in pairs],                   # Σ b_i|g_i|² (or s_i)
                                [2 if v.startswith("micro") else 3 for j, v, u, c in pairs],  # k, or replicas
                                [c for j, v, u, c in pairs],                                 # B in the unit
                                [5 if v.endswith("_adam") else 4 for j, v, u, c in pairs]],  # R·|G_big|²
                               device=device)
            hit = self._layout_cache = ([f"{v}/{u}" for j, v, u, c in pairs], idx,
                                        [c == 1 for j, v, u, c in pairs], [v.endswith("_adam") for j, v, u, c in pairs])
        return hit

    def _decay(self, state: torch.Tensor, units: torch.Tensor, present: torch.Tensor,
               windows: torch.Tensor) -> torch.Tensor:
        """(m, n) EMA decays 0.5^(windows·B/half_life), on the device."""
        c = self.config
        if c.half_life is not None and math.isinf(c.half_life):
            return torch.ones_like(units)
        if c.half_life is None:  # half_life_windows × the first window's B of each estimator (kept in state)
            first = units.gather(0, present.to(torch.int8).argmax(0)[None])[0]
            b0 = torch.where((state[:, _B0] > 0) | ~present.any(0), state[:, _B0], first)
            state[:, _B0] = b0
            half = b0 * c.half_life_windows
        else:
            half = torch.full_like(units[0], c.half_life)
        return torch.exp2(-units * windows / half)

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
        if self._last_measured and self._pending:
            last = self._pending[-1]
            if result.skipped:
                last["dropped"] = True
            if "big_sq" in last and last["big_sq"] is None:
                last["big_sq"] = result.grad_norm ** 2  # pre-clip, unscaled, after the sync: host float
            self._last_measured = False
        self._slots.drop()
        self._slots_adam.drop()  # nothing from between windows reaches the next one
        self._own += self._clock() - t0

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
        self._state = None  # rebuilt (rows copied) at the next fold
