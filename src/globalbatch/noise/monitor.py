"""NoiseScaleMonitor: the small-batch gradient norms of a real training step.

Sources (no extra forward/backward): ``"micro"``, the micro-batches of an accumulation
window pooled over ranks (|g_micro|² from the difference of the accumulated gradient
before and after each micro backward, one snapshot copy of the gradients), and ``"rank"``,
each DP rank's window gradient before the all-reduce, measured per bucket in a DDP comm
hook. ``adam=True`` adds the Adam-preconditioned variant g/(√v̂ + eps). The reduced
sufficient statistics go to one :class:`~globalbatch.noise.estimator.NoiseScaleEstimator`
per (source, variant, unit).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from globalbatch.noise.estimator import (
    NEEDS_TWO_BATCH_SIZES,
    NoiseScaleEstimate,
    NoiseScaleEstimator,
    _as_tensor,
    _window_from_sums,
)

__all__ = ["SOURCES", "NoiseConfig", "NoiseScaleMonitor"]

SOURCES = ("micro", "rank")


@dataclass(kw_only=True)
class NoiseConfig:
    """What :class:`NoiseScaleMonitor` measures and how it smooths."""

    sources: tuple[str, ...] = SOURCES
    """Small-batch sources: ``"micro"`` (micro-batches of the accumulation window, pooled over
    ranks) and/or ``"rank"`` (each DP rank's window gradient before the all-reduce). A source
    that cannot apply (``"rank"`` on one process) is left out; none left is a ValueError."""
    half_life: float | None = None
    """EMA half-life in units of the loss (tokens for a token-mean loss); None: ``half_life_windows``
    times the first window's global batch; ``math.inf``: plain mean over all windows."""
    half_life_windows: float = 20.0
    """Half-life in windows of the first global batch, used when ``half_life`` is None."""
    adam: bool = False
    """Also estimate the *Adam-preconditioned variant*, g/(√v̂ + eps), from the optimizer's
    ``exp_avg_sq`` (costs one more gradient-sized buffer and one multiply per norm)."""
    confidence: float = 0.95
    """Two-sided level of the Fieller interval."""
    min_windows: int = 3
    """Fewer windows than this flags an estimate ``"few_windows"``."""
    max_relative_stderr: float = 0.5
    """stderr / B_simple above this flags ``"too_noisy"``."""

    def __post_init__(self) -> None:
        if isinstance(self.sources, str):
            self.sources = (self.sources,)
        bad = [s for s in self.sources if s not in SOURCES]
        if bad or not self.sources:
            raise ValueError(f"sources {self.sources!r} is not allowed; allowed: a non-empty subset of {SOURCES}")
        if self.half_life is not None and not self.half_life > 0:
            raise ValueError(f"half_life {self.half_life!r} is not allowed; allowed: > 0 units, None or math.inf")
        if not self.half_life_windows > 0:
            raise ValueError(f"half_life_windows {self.half_life_windows!r} is not allowed; allowed: > 0")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence {self.confidence!r} is not allowed; allowed: 0 < confidence < 1")
        if isinstance(self.min_windows, bool) or not isinstance(self.min_windows, int) or self.min_windows < 2:
            raise ValueError(f"min_windows {self.min_windows!r} is not allowed; allowed: an int ≥ 2")
        if not self.max_relative_stderr > 0:
            raise ValueError(f"max_relative_stderr {self.max_relative_stderr!r} is not allowed; allowed: > 0")


def _sq_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ|t|² over tensors in float32 (grouped kernels via ``_foreach_norm``); 0-d tensor."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(list(tensors))
    return torch.stack(norms).float().square().sum()


class NoiseScaleMonitor:
    """Measure B_simple during training: a step-driver callback, or called from a plain loop.

    With :class:`globalbatch.step.StepDriver`: ``StepDriver(..., callbacks=[monitor])``. In a
    plain loop (sum-loss accumulation, gradients normalized to the mean before ``window_end``)::

        monitor = NoiseScaleMonitor(model, optimizer=opt)      # before the first backward (DDP hook)
        for window in windows:
            for i, micro in enumerate(window):
                loss_sum, count = loss_fn(model, micro)
                loss_sum.backward()                             # under no_sync() except the last (DDP)
                monitor.micro_backward(count, samples=len(micro))
            normalize_to_mean(model)                            # p.grad = mean gradient of the window
            monitor.window_end(lr=opt.param_groups[0]["lr"])
            opt.step(); opt.zero_grad()
        print(monitor.estimate())                               # host sync: at log steps only

    Hook order inside a window: ``micro_backward`` after every micro backward (``.grad`` holds
    the running accumulation), the DDP comm hook during the syncing backward (before the
    all-reduce), ``window_end`` after sync, normalization and unscaling, before clipping.

    Args:
        model: the module (or its DDP wrapper: then a comm hook is registered now, so build the
            monitor before the first backward; DDP allows one comm hook per model).
        optimizer: needed for ``adam=True`` (its ``exp_avg_sq``) and to log the LR.
        config: :class:`NoiseConfig`.
        unit: the loss's unit, ``"token"`` or ``"sample"``; a sample-unit estimate is added
            whenever sample counts are known.
        process_group: the DP group (default: DDP's group, else none: one replica).
    """

    def __init__(self, model: torch.nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
                 config: NoiseConfig | None = None, unit: str = "token", process_group: Any = None) -> None:
        self.config = config if config is not None else NoiseConfig()
        if unit not in ("token", "sample"):
            raise ValueError(f"unit {unit!r} is not allowed; allowed: 'token' or 'sample'")
        self.unit = unit
        self.optimizer = optimizer
        if self.config.adam and optimizer is None:
            raise ValueError("optimizer None is not allowed with adam=True; allowed: the Adam/AdamW optimizer "
                             "(the variant needs its exp_avg_sq)")
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        self.model = model
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        import torch.distributed as dist

        self._group = process_group if process_group is not None else (model.process_group if ddp else None)
        self.dp_world_size = dist.get_world_size(self._group) if self._group is not None else 1
        if process_group is not None and not ddp:
            raise ValueError("process_group is not allowed with a plain module; allowed: a DDP model (the monitor "
                             "sees each rank's gradient before the all-reduce)")
        self.sources = tuple(s for s in self.config.sources if s != "rank" or self.dp_world_size > 1)
        if not self.sources:
            raise ValueError(f"sources {self.config.sources!r} is not allowed with dp_world_size {self.dp_world_size}; "
                             f"allowed: add 'micro' with grad_accum_steps ≥ 2 (the noise scale {NEEDS_TWO_BATCH_SIZES})")
        self._ddp = ddp
        if ddp:
            model.register_comm_hook(self._group, _comm_hook(self))
        self.estimators: dict[str, NoiseScaleEstimator] = {}
        self._device: torch.device | None = None
        self._reset_window()
        self._pending: tuple | None = None
        self._snap: dict[int, torch.Tensor] = {}       # persistent snapshot buffers, one per parameter
        self._snap_list: tuple[tuple[int, ...], list[torch.Tensor]] = ((), [])
        self._checked_sharding = False
        self._precond: list[torch.Tensor] | None = None
        self._precond_ready = False

    # -- names ---------------------------------------------------------------------------

    def _variants(self) -> list[str]:
        names = list(self.sources)
        if self.config.adam:
            names += [s + "_adam" for s in self.sources]
        return names

    def _estimator(self, key: str) -> NoiseScaleEstimator:
        est = self.estimators.get(key)
        if est is None:
            c = self.config
            est = NoiseScaleEstimator(unit=key.split("/")[1], half_life=c.half_life,
                                      half_life_windows=c.half_life_windows, confidence=c.confidence,
                                      min_windows=c.min_windows, max_relative_stderr=c.max_relative_stderr,
                                      device=self._device)
            self.estimators[key] = est
        return est

    # -- window state ------------------------------------------------------------------------

    def _reset_window(self) -> None:
        self._micro_index = 0
        self._micro_sq: list[torch.Tensor] = []        # raw |Δa|² of each micro (loss-scaled, × multiplier²)
        self._micro_sq_adam: list[torch.Tensor] = []
        self._micro_weight: list[torch.Tensor] = []    # b_i / m_i² (turns raw |Δa|² into b_i|g_i|²)
        self._micro_sample_weight: list[torch.Tensor] = []
        self._local_count: list[torch.Tensor] = []
        self._local_mult: list[torch.Tensor] = []
        self._local_samples = 0.0
        self._samples_known = True
        self._snap_valid = False                       # self._snap holds a_old of this window
        self._hook_micro: list[torch.Tensor] = []     # filled by the comm hook during a syncing backward
        self._hook_micro_adam: list[torch.Tensor] = []
        self._hook_rank: list[torch.Tensor] = []
        self._hook_rank_adam: list[torch.Tensor] = []
        self._hook_fired = False
        self._synced_micro = -1                        # micro index whose backward ran the DDP sync
        self._after_last = False                       # a micro declared last skipped the snapshot copy
        self._poisoned = False                         # a micro came after that: this window is unusable
        self._precond_ready = False

    def _active(self) -> list[int]:
        """Indices of the parameters that hold a gradient now."""
        out = [i for i, p in enumerate(self._params) if p.grad is not None]
        if out and not self._checked_sharding:
            if hasattr(self._params[out[0]].grad, "_local_tensor"):
                raise ValueError("model: FSDP2 (sharded) gradients: the noise monitor supports plain and DDP "
                                 "models only; a local norm would be a shard norm")
            self._checked_sharding = True
        return out

    def _ensure_precond(self) -> bool:
        """1/(√v̂ + eps) per parameter from the optimizer (state of the previous step). False if none yet."""
        if self._precond_ready:
            return self._precond is not None
        self._precond_ready = True
        opt = self.optimizer
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
            raise ValueError(f"optimizer holding {len(vs)} of the model's {len(self._params)} trainable parameters is "
                             "not allowed with adam=True; allowed: an optimizer over all of them")
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
            is_last: True on the window's last micro-batch saves one gradient copy (optional).
        """
        active = self._active()
        if self._device is None and active:
            self._device = self._params[active[0]].grad.device
            for est in self.estimators.values():
                est.state = est.state.to(self._device)
        count_t = _as_tensor(count, self._device).reshape(())
        mult = count_t if grad_multiplier is None else _as_tensor(grad_multiplier, self._device).reshape(())
        if self._synced_micro >= 0:
            raise ValueError(f"micro_backward: micro-batch {self._micro_index} follows a DDP gradient sync in "
                             f"micro-batch {self._synced_micro}: run all but the last under model.no_sync()")
        if self._after_last:  # told "last" before, so a_old was not kept: Δ is unknown, drop the window
            if not self._poisoned:
                import logging

                logging.getLogger("globalbatch.noise").warning(
                    "noise: micro-batch %d came after one declared last; this window is not measured",
                    self._micro_index)
            self._poisoned = True
        if self._hook_fired:
            # DDP synced in this backward: .grad is already reduced; the hook measured the local Δ.
            sq = torch.stack(self._hook_micro).sum() if self._hook_micro else None
            sq_adam = torch.stack(self._hook_micro_adam).sum() if self._hook_micro_adam else None
            self._synced_micro = self._micro_index
        else:
            sq, sq_adam = self._micro_delta(active, copy=is_last is not True)
            self._after_last = is_last is True
        if "micro" in self.sources:
            if sq is None:
                raise RuntimeError("no micro-batch norm was recorded (the DDP comm hook did not run)")
            self._micro_sq.append(sq)
            if sq_adam is not None:
                self._micro_sq_adam.append(sq_adam)
        self._micro_weight.append(count_t / (mult * mult))
        if samples is None:
            self._samples_known = False
        else:
            self._micro_sample_weight.append(float(samples) / (mult * mult))
            self._local_samples += float(samples)
        self._local_count.append(count_t)
        self._local_mult.append(mult)
        self._micro_index += 1

    def _micro_delta(self, active: list[int], *, copy: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """|a_new − a_old|² from the snapshot (a_old = 0 on the first micro), then snapshot ← a_new."""
        if "micro" not in self.sources:
            return None, None
        grads = [self._params[i].grad for i in active]
        adam = self.config.adam and self._ensure_precond()
        if not self._snap_valid:  # first micro-batch: a_old = 0, Δ = a_new
            sq = _sq_sum(grads)
            sq_adam = _sq_sum(torch._foreach_mul(grads, [self._precond[i] for i in active])) if adam else None
            if copy:
                torch._foreach_copy_(self._snap_buffers(active, zero=False), grads)  # the one gradient copy
                self._snap_valid = True
            return sq, sq_adam
        snaps = self._snap_buffers(active, zero=True)
        torch._foreach_sub_(snaps, grads)  # snapshot := a_old − a_new = −Δ (in place, no allocation)
        sq = _sq_sum(snaps)
        sq_adam = None
        if adam:
            torch._foreach_mul_(snaps, [self._precond[i] for i in active])
            sq_adam = _sq_sum(snaps)
        if copy:
            torch._foreach_copy_(snaps, grads)
        self._snap_valid = copy
        return sq, sq_adam

    def _snap_buffers(self, active: list[int], *, zero: bool) -> list[torch.Tensor]:
        """The persistent snapshot buffers of ``active`` (allocated once; a parameter whose
        gradient appears mid-window gets a zero a_old when ``zero``)."""
        key = tuple(active)
        if self._snap_list[0] == key:  # the usual case: same parameters as last time, buffers exist
            return self._snap_list[1]
        out = []
        for i in active:
            buf = self._snap.get(i)
            g = self._params[i].grad
            if buf is None or buf.shape != g.shape or buf.dtype != g.dtype:
                buf = torch.zeros_like(g) if zero else torch.empty_like(g)
                self._snap[i] = buf
            out.append(buf)
        self._snap_list = (key, out)
        return out

    def _hook_bucket(self, bucket: Any) -> None:
        """Inside the DDP comm hook, before the all-reduce: local norms of this bucket."""
        params, grads = bucket.parameters(), bucket.gradients()
        idx = [self._index[id(p)] for p in params]
        adam = self.config.adam and self._ensure_precond()
        local_sq = _sq_sum(grads)
        self._hook_rank.append(local_sq)
        if adam:
            local_adam = _sq_sum(torch._foreach_mul(grads, [self._precond[i] for i in idx]))
            self._hook_rank_adam.append(local_adam)
        if "micro" in self.sources:
            if not self._snap_valid:
                self._hook_micro.append(local_sq)
                if adam:
                    self._hook_micro_adam.append(local_adam)
            else:
                snaps = [self._snap[i] for i in idx]
                torch._foreach_sub_(snaps, grads)  # the snapshot is not needed after the last micro
                self._hook_micro.append(_sq_sum(snaps))
                if adam:
                    torch._foreach_mul_(snaps, [self._precond[i] for i in idx])
                    self._hook_micro_adam.append(_sq_sum(snaps))
        self._hook_fired = True

    # -- per window (no host sync; one small async all-reduce under DP) ---------------------------

    def window_end(self, *, loss_scale: Any = None, lr: Any = None, big_grad_multiplier: Any = None) -> None:
        """Fold in the window. ``.grad`` must hold the window's mean gradient (all ranks), unscaled,
        not yet clipped.

        Args:
            loss_scale: the AMP loss scale S the micro backward passes ran with (a device tensor
                is fine); the micro and rank norms are divided by S². None: 1.
            lr: learning rate of this step, logged beside the estimate.
            big_grad_multiplier: if ``.grad`` is m × the mean gradient, m (default 1).
        """
        k_local = self._micro_index
        if k_local == 0:
            raise RuntimeError("window_end() before any micro_backward() in this window")
        if k_local * self.dp_world_size < 2:
            raise ValueError(f"grad_accum_steps {k_local} with dp_world_size {self.dp_world_size} is not allowed; "
                             f"allowed: ≥ 2 small batches per window (the noise scale {NEEDS_TWO_BATCH_SIZES})")
        self._flush()
        active = self._active()
        grads = [self._params[i].grad for i in active]
        dev = self._device
        big_sq = {"": _sq_sum(grads).to(torch.float64)}
        if self.config.adam and self._ensure_precond():
            big_sq["_adam"] = _sq_sum(torch._foreach_mul(grads, [self._precond[i] for i in active])).double()
        if big_grad_multiplier is not None:
            m2 = _as_tensor(big_grad_multiplier, dev) ** 2
            big_sq = {k: v / m2 for k, v in big_sq.items()}
        inv_s2 = torch.ones((), dtype=torch.float64, device=dev) if loss_scale is None else \
            1.0 / _as_tensor(loss_scale, dev).reshape(()) ** 2
        if self._poisoned:
            inv_s2 = inv_s2 * math.nan  # non-finite: every estimator skips this window (on the device)
        w_tok = torch.stack(self._micro_weight)
        local_count = torch.stack(self._local_count).sum()
        local_mult = torch.stack(self._local_mult).sum()
        samples_known = self._samples_known
        w_smp = (torch.stack([_as_tensor(w, dev) for w in self._micro_sample_weight]) if samples_known
                 else torch.zeros_like(w_tok))
        # Local sufficient statistics, summed over ranks (in this order):
        # 0 units, 1 samples, 2 k, then per (variant, unit): Σ b_i|g_i|² for micro, b_r|g_r|² for rank.
        parts = [local_count, torch.tensor(self._local_samples, dtype=torch.float64, device=dev),
                 torch.tensor(float(k_local), dtype=torch.float64, device=dev)]
        keys = []
        for name in self._variants():
            source, adam = name.split("_")[0], name.endswith("_adam")
            if adam and "_adam" not in big_sq:
                continue
            if source == "micro":
                raw = torch.stack(self._micro_sq_adam if adam else self._micro_sq).to(torch.float64)
                parts += [(raw * w_tok).sum() * inv_s2, (raw * w_smp).sum() * inv_s2]
            else:  # a_r = S·M_r·g_r with M_r = Σ m_i (= B_r for sum-loss): b_r|g_r|² = b_r·raw/(S·M_r)²
                hooked = self._hook_rank_adam if adam else self._hook_rank
                if not hooked:
                    raise RuntimeError("source 'rank': the DDP comm hook did not run in this window "
                                       "(was the last micro-batch run outside no_sync()?)")
                raw = torch.stack(hooked).sum().to(torch.float64) * inv_s2 / local_mult ** 2
                parts += [raw * local_count, raw * self._local_samples]
            keys.append(name)
        vec = torch.stack([p.to(torch.float64) for p in parts])
        work = None
        if self.dp_world_size > 1:
            import torch.distributed as dist

            work = dist.all_reduce(vec, group=self._group, async_op=True)  # consumed at the next flush
        self._pending = (work, vec, keys, big_sq, samples_known, lr)
        self._reset_window()
        self._snap_valid = False

    def _flush(self) -> None:
        """Wait for the pending all-reduce (long done by now) and update the estimators."""
        if self._pending is None:
            return
        work, vec, keys, big_sq, samples_known, lr = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        units, samples, k = vec[0], vec[1], vec[2]
        r = torch.tensor(float(self.dp_world_size), dtype=torch.float64, device=vec.device)
        for j, name in enumerate(keys):
            source, suffix = name.split("_")[0], name[len(name.split("_")[0]):]
            n_small = k if source == "micro" else r
            big = big_sq[suffix]
            tok = _window_from_sums(vec[3 + 2 * j], n_small, big, units)
            est = self._estimator(f"{name}/{self.unit}")
            decay = est.decay_for(units)
            est.update_window(tok, lr=lr, decay=decay)
            if samples_known and self.unit == "token":
                smp = _window_from_sums(vec[4 + 2 * j], n_small, big, samples)
                self._estimator(f"{name}/sample").update_window(smp, lr=lr, decay=decay)

    # -- step-driver callbacks ---------------------------------------------------------------------

    def on_micro_backward(self, driver: Any, micro_index: int, local_count: Any) -> None:
        """:class:`~globalbatch.step.StepDriver` callback.

        The micro-batch's samples come from ``driver.last_micro_samples`` (what was passed as
        ``backward(..., samples=)``, set before the callbacks run), so short and ragged
        micro-batches are weighted by their real size in the per-sample estimate; a driver
        without it falls back to ``driver.config.micro_batch``.

        The planned ``driver.geometry.grad_accum_steps`` tells which micro-batch is the last,
        which saves the snapshot copy there (a window longer than planned is dropped, with a
        warning; a shorter one only costs the copy)."""
        if micro_index == 0:
            geometry = getattr(driver, "geometry", None)
            self._planned_accum = getattr(geometry, "grad_accum_steps", None)
        samples = getattr(driver, "last_micro_samples", None)
        if samples is None:
            samples = getattr(getattr(driver, "config", None), "micro_batch", None)
        planned = getattr(self, "_planned_accum", None)
        self.micro_backward(local_count, samples=samples,
                            is_last=(micro_index == planned - 1) if planned else None)

    def on_window_end(self, driver: Any, global_count: Any, local_window_count: Any) -> None:
        """:class:`~globalbatch.step.StepDriver` callback: after sync, normalization, unscale."""
        scaler = getattr(driver, "scaler", None)
        scale = getattr(scaler, "_scale", None) if scaler is not None else None  # device tensor: no sync
        opt = getattr(driver, "optimizer", None) or self.optimizer
        lr = opt.param_groups[0]["lr"] if opt is not None else None
        self.window_end(loss_scale=scale, lr=lr)

    # -- read-out (host sync) -------------------------------------------------------------------

    def estimate(self, source: str | None = None, unit: str | None = None, *, adam: bool = False) -> NoiseScaleEstimate:
        """The estimate of one source (default: the first configured) in one unit (default: the loss's).

        Raises ValueError naming the fix when no window could be measured.
        """
        self._flush()
        source = source or self.sources[0]
        unit = unit or self.unit
        key = f"{source}{'_adam' if adam else ''}/{unit}"
        if key not in self.estimators:
            raise ValueError(f"estimate {key!r} is not allowed: not measured; allowed: "
                             f"{', '.join(sorted(self.estimators)) or 'none yet'} (the noise scale {NEEDS_TWO_BATCH_SIZES})")
        return self.estimators[key].estimate()

    def estimates(self) -> dict[str, NoiseScaleEstimate]:
        """Every estimate, keyed ``"micro/token"``, ``"rank/sample"``, ``"micro_adam/token"``, ..."""
        self._flush()
        return {k: e.estimate() for k, e in sorted(self.estimators.items())}

    def state_dict(self) -> dict[str, Any]:
        self._flush()
        return {k: e.state_dict() for k, e in self.estimators.items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for k, v in sd.items():
            self._estimator(k).load_state_dict(v)


def _comm_hook(monitor: NoiseScaleMonitor):
    """A DDP comm hook: the bucket's local squared norms, then DDP's default all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(process_group, bucket):  # no annotations: DDP checks them (and ours are postponed strings)
        monitor._hook_bucket(bucket)
        return default_hooks.allreduce_hook(process_group, bucket)

    return hook
