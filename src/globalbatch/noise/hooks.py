"""The monitor's construction, its parameter hooks and what it records per micro-batch.

:class:`_MicroHooks` is the first half of :class:`~globalbatch.noise.NoiseScaleMonitor`: it checks the
model and the settings, installs (and removes, with ``every``) the tensor hooks that take the norm of
each micro-batch's gradient as it arrives, and records each micro-batch's count, multiplier and samples
without a host sync. :mod:`globalbatch.noise.fold` turns a window into its statistics vector and folds
queued windows into the estimators; :mod:`globalbatch.noise.monitor` ends windows, is the driver's
callback and reads the estimates out.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable

import torch

from globalbatch.errors import Raw, SettingError
from globalbatch.noise.budget import EveryController
from globalbatch.noise.config import NoiseConfig, _check_every
from globalbatch.noise.estimator import _STATE_LEN, NEEDS_TWO_BATCH_SIZES, NoiseScaleEstimator
from globalbatch.noise.sources import _CommHookDispatch, _fsdp_unsharded_params, _NormSlots, _vector_norm
from globalbatch.parallel import inspect_parallel


class _MicroHooks:
    """Construction, hooks and the per-micro-batch record of :class:`~globalbatch.noise.NoiseScaleMonitor`
    (its docstring has the arguments)."""

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
        self._left_out: list[int] = []                 # windows after which one was left out at every 1
        self._arm_s = self._arm_mark = self._arm_carry = 0.0  # seconds spent adding and removing hooks
        self._micros_seen = 0                          # micro-batch calls in this window (measured or not)
        self._time_hooks = True                        # the hooks read the clock (the window's first micro-batch)
        self._hooks_timed = 0.0                        # ... and the seconds they read
        self._t_first = self._own_first = 0.0          # clock and own seconds at this window's first one
        self._t_last = 0.0                             # clock at its latest micro-batch's callback
        self._account_at_step_end = False              # on_window_end: the window's books close in on_step_end
        self._to_account: bool | None = None           # ... with this (measured or not)
        self._decide_carry = [0.0, 0.0]                # seconds of budget decisions after windows left out and
        # measured, carried to the next window of that kind
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
        self._hooked: list[torch.Tensor] = []          # the tensors they are registered on
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

    # -- every, detach, attach ---------------------------------------------------------------

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
        self._hooked = list(targets)
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
            for p in self._hooked:
                # An empty hook dict still costs the autograd engine a call into Python per gradient (≈ 1 µs
                # each): with no other hook left, clear it, as before the first register_hook (leaves only:
                # a non-leaf's dict is also registered on its grad_fn).
                if p.grad_fn is None and p._backward_hooks is not None and not p._backward_hooks:
                    p._backward_hooks = None
            self._hooks, self._hooked = [], []
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
            is_last: deprecated and ignored (FutureWarning): there is no snapshot to save.
        """
        if is_last is not None:
            warnings.warn("micro_backward(is_last=...) is deprecated and ignored: the hooks read each micro-batch's "
                          "gradient as it arrives; drop the argument", FutureWarning, stacklevel=2)
        t0 = self._clock()
        if not self._micros_seen:
            self._t_first, self._own_first = t0, self._own
            self._time_hooks = False
        self._micros_seen += 1
        self._t_last = t0
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
