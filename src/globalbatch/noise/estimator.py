"""The gradient noise scale B_simple = tr(Σ)/|G|², online, unbiased, with its uncertainty.

McCandlish, Kaplan, Amodei 2018, "An Empirical Model of Large-Batch Training"
(arXiv 1812.06162), §2.2 eq. 2.8 (B_simple) and App. A.1 (the unbiased two-batch
estimators). Σ is the per-unit (per sample, or per loss-bearing token) gradient
covariance and G the true gradient; a mean over b independent units has
E|g_b|² = |G|² + tr(Σ)/b.

Estimator (one *window* = one optimizer step = one big batch of B units that is
partitioned into k small batches of b_i units, Σ b_i = B, G_big = Σ b_i g_i / B):

    tr(Σ)^ = (Σ_i b_i |g_i|² − B |G_big|²) / (k − 1)      = Σ_i b_i |g_i − G_big|² / (k − 1)
    |G|²^  = |G_big|² − tr(Σ)^ / B

Both are exactly unbiased for any counts b_i (proof in docs/noise.md: take
expectations of b_i|g_i|² and B|G_big|² and subtract); with equal b_i they are
McCandlish's A.1 formulas with B_small = b, B_big = k·b. B_simple is the ratio of
separate EMAs of the two (the ratio of unbiased estimates is itself biased).

The small batches come from the training step itself, at no extra forward/backward:

* ``"micro"`` — the micro-batches of an accumulation window, pooled over all data-
  parallel ranks (k = grad_accum_steps × dp_world_size). |g_micro|² comes from the
  difference of the accumulated gradient before and after each micro backward
  (sum-loss accumulation: a_new − a_old = count · g_micro), kept as one snapshot copy
  of the gradients. Under DDP the last micro-batch's difference is taken inside a
  DDP communication hook, before the all-reduce.
* ``"rank"`` — each rank's whole-window gradient before the all-reduce (k = dp_world_size),
  its squared norm taken per bucket in a DDP communication hook (AdaptDL's source).

Norms are taken after unscaling (loss scale) and before clipping. The EMA forgets per
unit, not per step: decay = 0.5^(B / half_life), so it means the same at any batch.

Uncertainty: each window gives an independent unbiased pair (tr(Σ)^, |G|²^); the EMA
also tracks their weighted second moments, hence the standard errors of both EMA means
and their covariance (effective sample size n_eff = (Σw)²/Σw²). The interval for the
ratio is Fieller's; it is unbounded exactly when |G|² is not significantly above
zero — then the estimate is flagged as not reportable. The standard error is the
delta-method one.

Variant (labelled as such everywhere): ``adam=True`` also estimates the noise scale of
the Adam-preconditioned gradient g / (√v̂ + eps), v̂ = the optimizer's bias-corrected
``exp_avg_sq`` from the previous step (AdaptDL's AdamGradientNoiseScale; McCandlish
call such results "mixed").

Host syncs: none in :meth:`NoiseScaleMonitor.micro_backward` / ``window_end``; the
only ones are in :meth:`NoiseScaleEstimator.estimate` (one ``.tolist()``), to be
called at log steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "NEEDS_TWO_BATCH_SIZES",
    "WindowStats",
    "NoiseScaleEstimate",
    "NoiseScaleEstimator",
    "NoiseConfig",
    "NoiseScaleMonitor",
    "window_estimates",
    "fieller_interval",
    "NoiseRunConfig",
    "NoiseRunResult",
    "measure_noise",
    "format_estimate",
]

NEEDS_TWO_BATCH_SIZES = "needs at least two batch sizes: use grad_accum_steps ≥ 2 or dp_world_size ≥ 2"
"""The one error for a window with a single small batch (one micro-batch on one rank)."""

# ---------------------------------------------------------------------------
# The pure per-window estimator
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WindowStats:
    """The unbiased estimates from one window (0-d tensors, on the device of the inputs)."""

    tr_sigma: torch.Tensor
    """tr(Σ)^, per unit of the counts."""
    g_sq: torch.Tensor
    """|G|²^."""
    big_count: torch.Tensor
    """B, units in the window."""


def _as_tensor(x: Any, device: torch.device | None = None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(dtype=torch.float64)
    return torch.as_tensor(x, dtype=torch.float64, device=device)


def window_estimates(small_sq_norms: Any, small_counts: Any, big_sq_norm: Any, big_count: Any = None) -> WindowStats:
    """Unbiased tr(Σ) and |G|² from one window: k small batches that partition a big one.

    Args:
        small_sq_norms: |g_i|² of each small-batch *mean* gradient, shape (k,).
        small_counts: b_i, units (samples or tokens) in each small batch, shape (k,).
        big_sq_norm: |G_big|², the squared norm of the count-weighted mean of the g_i.
        big_count: B = Σ b_i (units); computed from ``small_counts`` when omitted.

    Returns:
        :class:`WindowStats` with tr(Σ)^ = (Σ b_i|g_i|² − B|G_big|²)/(k−1) and
        |G|²^ = |G_big|² − tr(Σ)^/B. No host sync when the inputs are device tensors.

    Raises:
        ValueError: k < 2 (:data:`NEEDS_TWO_BATCH_SIZES`), mismatched shapes, or (for
            inputs on the CPU) counts that are not positive or do not sum to ``big_count``.
    """
    sq = _as_tensor(small_sq_norms).reshape(-1)
    counts = _as_tensor(small_counts, sq.device).reshape(-1)
    if sq.numel() != counts.numel():
        raise ValueError(f"small_counts: {counts.numel()} values for {sq.numel()} small_sq_norms: need one count each")
    k = sq.numel()
    if k < 2:
        raise ValueError(f"small batches: k={k}: noise scale {NEEDS_TWO_BATCH_SIZES}")
    total = counts.sum()
    big = total if big_count is None else _as_tensor(big_count, sq.device).reshape(())
    if counts.device.type == "cpu" and big.device.type == "cpu":  # validation only where it costs no sync
        if bool((counts <= 0).any()):
            raise ValueError(f"small_counts: {counts.tolist()}: every count must be > 0")
        if not math.isclose(float(total), float(big), rel_tol=1e-9):
            raise ValueError(f"big_count: {float(big):g}: must equal sum(small_counts) = {float(total):g} "
                             "(the small batches must partition the big one)")
    return _window_from_sums((counts * sq).sum(), torch.tensor(float(k), dtype=torch.float64, device=sq.device),
                             _as_tensor(big_sq_norm, sq.device).reshape(()), big)


def _window_from_sums(weighted_small_sq: torch.Tensor, k: torch.Tensor, big_sq: torch.Tensor,
                      big_count: torch.Tensor) -> WindowStats:
    """The estimator from sufficient statistics: Σ b_i|g_i|², k, |G_big|², B (all float64 tensors)."""
    tr_sigma = (weighted_small_sq - big_count * big_sq) / (k - 1)
    return WindowStats(tr_sigma=tr_sigma, g_sq=big_sq - tr_sigma / big_count, big_count=big_count)


# ---------------------------------------------------------------------------
# Ratio statistics
# ---------------------------------------------------------------------------


def fieller_interval(mean_num: float, mean_den: float, var_num: float, var_den: float, cov: float,
                     z: float) -> tuple[float, float] | None:
    """Fieller's confidence interval for mean_num/mean_den (both means normal, correlated).

    The set of ratios r with (mean_num − r·mean_den)² ≤ z²·(var_num − 2r·cov + r²·var_den).
    Returns None when that set is unbounded, i.e. when the denominator is not significantly
    different from zero (mean_den² ≤ z²·var_den): the ratio cannot be reported.
    """
    a = mean_den * mean_den - z * z * var_den
    if a <= 0.0:
        return None
    b = mean_num * mean_den - z * z * cov
    c = mean_num * mean_num - z * z * var_num
    disc = b * b - a * c
    root = math.sqrt(max(disc, 0.0))
    return ((b - root) / a, (b + root) / a)


@dataclass(frozen=True)
class NoiseScaleEstimate:
    """B_simple with its uncertainty, read from a :class:`NoiseScaleEstimator` (host values)."""

    unit: str
    """Unit of every count here: ``"token"`` or ``"sample"``."""
    b_simple: float
    """tr(Σ)/|G|² as the ratio of the two EMAs, in ``unit``s (NaN before any window)."""
    stderr: float
    """Delta-method standard error of ``b_simple`` (NaN when not computable)."""
    low: float
    """Lower end of the Fieller interval at ``confidence``, clipped at 0 (NaN when unbounded)."""
    high: float
    """Upper end of the Fieller interval (NaN when unbounded)."""
    confidence: float
    """Two-sided level of [low, high], e.g. 0.95."""
    tr_sigma: float
    """EMA of tr(Σ)^ (per unit)."""
    g_sq: float
    """EMA of |G|²^."""
    windows: int
    """Windows folded in (non-finite ones excluded)."""
    skipped_windows: int
    """Windows skipped because a norm was not finite (e.g. AMP overflow steps)."""
    effective_windows: float
    """n_eff = (Σw)²/Σw² of the EMA weights."""
    big_count: float
    """B of the last window (global batch in ``unit``s), logged beside the estimate."""
    lr: float
    """Learning rate of the last window (NaN when not given): B_simple ∝ 1/temperature."""
    flags: tuple[str, ...]
    """Why the estimate should not be reported: ``"no_windows"``, ``"few_windows"``,
    ``"g_sq_nonpositive"``, ``"too_noisy"`` (|G|² not significantly > 0, or relative error
    above the limit). Empty when reportable."""

    @property
    def ok(self) -> bool:
        """True when there is nothing in :attr:`flags`."""
        return not self.flags

    def as_dict(self, prefix: str = "noise/") -> dict[str, float]:
        """Flat scalars for loggers, e.g. ``noise/b_simple_tokens``."""
        u = self.unit + "s"
        return {
            f"{prefix}b_simple_{u}": self.b_simple, f"{prefix}b_simple_stderr_{u}": self.stderr,
            f"{prefix}b_simple_low_{u}": self.low, f"{prefix}b_simple_high_{u}": self.high,
            f"{prefix}tr_sigma_per_{self.unit}": self.tr_sigma, f"{prefix}g_sq": self.g_sq,
            f"{prefix}windows": float(self.windows), f"{prefix}effective_windows": self.effective_windows,
            f"{prefix}batch_{u}": self.big_count, f"{prefix}lr": self.lr, f"{prefix}ok": float(self.ok),
        }


# State vector layout (float64): sums of weights, weighted first and second moments.
_W, _Q, _ST, _SG, _MTT, _MGG, _MTG, _N, _SKIP, _BIG, _LR, _B0 = range(12)
_STATE_LEN = 12


class NoiseScaleEstimator:
    """EMA of the per-window unbiased estimates, with per-unit forgetting and uncertainty.

    Pure state machine: feed it windows with :meth:`update` (small norms and counts) or
    :meth:`update_window` (already-reduced :class:`WindowStats`); read with :meth:`estimate`.
    All state is one float64 tensor on ``device``; updates never sync with the host.

    Args:
        unit: ``"token"`` or ``"sample"`` (labels only; counts must be in this unit).
        half_life: EMA half-life in units (tokens or samples). ``None``: ``half_life_windows``
            times the first window's batch. ``math.inf``: a plain mean over all windows.
        half_life_windows: used when ``half_life`` is None.
        confidence: two-sided level of the interval.
        min_windows: fewer windows than this flags ``"few_windows"``.
        max_relative_stderr: stderr/B_simple above this flags ``"too_noisy"``.
        device: where the state lives (the gradients' device).
    """

    def __init__(self, *, unit: str = "token", half_life: float | None = None, half_life_windows: float = 20.0,
                 confidence: float = 0.95, min_windows: int = 3, max_relative_stderr: float = 0.5,
                 device: torch.device | str | None = None) -> None:
        if unit not in ("token", "sample"):
            raise ValueError(f"unit: {unit!r}: expected 'token' or 'sample'")
        if half_life is not None and not half_life > 0:
            raise ValueError(f"half_life: {half_life!r}: must be > 0 units (or None, or math.inf)")
        if not half_life_windows > 0:
            raise ValueError(f"half_life_windows: {half_life_windows!r}: must be > 0")
        if not 0.0 < confidence < 1.0:
            raise ValueError(f"confidence: {confidence!r}: must be in (0, 1)")
        if min_windows < 2:
            raise ValueError(f"min_windows: {min_windows!r}: must be >= 2 (a variance needs two windows)")
        if not max_relative_stderr > 0:
            raise ValueError(f"max_relative_stderr: {max_relative_stderr!r}: must be > 0")
        self.unit = unit
        self.half_life = half_life
        self.half_life_windows = float(half_life_windows)
        self.confidence = float(confidence)
        self.min_windows = int(min_windows)
        self.max_relative_stderr = float(max_relative_stderr)
        self.state = torch.zeros(_STATE_LEN, dtype=torch.float64, device=device)
        self.state[_LR] = math.nan
        self._started = False  # host-side: B0 set (for half_life=None)

    # -- updates (no host sync) ------------------------------------------------------------

    def update(self, small_sq_norms: Any, small_counts: Any, big_sq_norm: Any, big_count: Any = None, *,
               lr: Any = None) -> WindowStats:
        """Fold in one window given the small-batch norms and counts (see :func:`window_estimates`)."""
        stats = window_estimates(small_sq_norms, small_counts, big_sq_norm, big_count)
        self.update_window(stats, lr=lr)
        return stats

    def decay_for(self, big_count: torch.Tensor) -> torch.Tensor:
        """EMA decay for a window of ``big_count`` units: 0.5^(B/half_life) (a device tensor)."""
        big = big_count.to(device=self.state.device, dtype=torch.float64)
        if self.half_life is None:
            if not self._started:
                self.state[_B0] = big
                self._started = True
            half = self.state[_B0] * self.half_life_windows
        elif math.isinf(self.half_life):
            return torch.ones((), dtype=torch.float64, device=self.state.device)
        else:
            half = torch.tensor(self.half_life, dtype=torch.float64, device=self.state.device)
        return torch.exp2(-big / half)

    def update_window(self, stats: WindowStats, *, lr: Any = None, decay: torch.Tensor | None = None) -> None:
        """Fold in one window's estimates. Non-finite windows are skipped (counted), on the device."""
        s = self.state
        tg = torch.stack([stats.tr_sigma.reshape(()), stats.g_sq.reshape(())]).to(device=s.device,
                                                                                  dtype=torch.float64)
        big = stats.big_count.to(device=s.device, dtype=torch.float64).reshape(())
        d = self.decay_for(big) if decay is None else decay.to(device=s.device, dtype=torch.float64)
        finite = torch.isfinite(tg).all()
        fin = finite.to(torch.float64)
        tg = torch.nan_to_num(tg, nan=0.0, posinf=0.0, neginf=0.0) * fin
        d = torch.where(finite, d, 1.0)
        # Weight of the new window: 1 − d (≈ B·ln2/half_life: proportional to its units); 1 for a plain mean.
        w = torch.where(d < 1, 1 - d, 1.0) * fin
        t, g = tg[0], tg[1]
        # [W, Q, ΣT, ΣG, ΣT², ΣG², ΣTG] ← decay · old + weight · new
        dec = torch.stack([d, d * d, d, d, d, d, d])
        new = torch.stack([w, w * w, w * t, w * g, w * t * t, w * g * g, w * t * g])
        s[:_N].mul_(dec).add_(new)
        s[_N] += fin
        s[_SKIP] += 1.0 - fin
        s[_BIG] = torch.where(finite, big, s[_BIG])
        if lr is not None:
            s[_LR] = _as_tensor(lr, s.device).reshape(())

    # -- read-out (one host sync) ----------------------------------------------------------

    def estimate(self) -> NoiseScaleEstimate:
        """B_simple, its standard error and Fieller interval, and flags. Syncs with the host once."""
        W, Q, ST, SG, MTT, MGG, MTG, N, SKIP, BIG, LR, _ = self.state.tolist()  # host sync (log steps only)
        nan = math.nan
        z = _normal_quantile(0.5 + self.confidence / 2)
        flags: list[str] = []
        if N < 1 or W <= 0:
            return NoiseScaleEstimate(unit=self.unit, b_simple=nan, stderr=nan, low=nan, high=nan,
                                      confidence=self.confidence, tr_sigma=nan, g_sq=nan, windows=int(N),
                                      skipped_windows=int(SKIP), effective_windows=0.0, big_count=BIG, lr=LR,
                                      flags=("no_windows",))
        t, g = ST / W, SG / W
        n_eff = W * W / Q
        ratio = t / g if g != 0 else nan
        stderr, low, high = nan, nan, nan
        if N < self.min_windows or n_eff < 1.5:
            flags.append("few_windows")
        if g <= 0:
            flags.append("g_sq_nonpositive")
        if n_eff > 1.0 + 1e-9:
            # Reliability-weighted sample (co)variances of the per-window estimates, then of their means.
            corr = 1.0 - Q / (W * W)
            v_t = max(MTT / W - t * t, 0.0) / corr
            v_g = max(MGG / W - g * g, 0.0) / corr
            c_tg = (MTG / W - t * g) / corr
            vm_t, vm_g, cm = v_t / n_eff, v_g / n_eff, c_tg / n_eff
            if g != 0:
                var_r = (vm_t - 2 * ratio * cm + ratio * ratio * vm_g) / (g * g)
                stderr = math.sqrt(max(var_r, 0.0))
            interval = fieller_interval(t, g, vm_t, vm_g, cm, z)
            if interval is None:
                if "g_sq_nonpositive" not in flags:
                    flags.append("too_noisy")
            else:
                low, high = max(interval[0], 0.0), interval[1]  # B_simple ≥ 0: clip to the parameter space
                if ratio > 0 and stderr / ratio > self.max_relative_stderr and "too_noisy" not in flags:
                    flags.append("too_noisy")
        return NoiseScaleEstimate(unit=self.unit, b_simple=ratio, stderr=stderr, low=low, high=high,
                                  confidence=self.confidence, tr_sigma=t, g_sq=g, windows=int(N),
                                  skipped_windows=int(SKIP), effective_windows=n_eff, big_count=BIG, lr=LR,
                                  flags=tuple(flags))

    # -- checkpointing -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.state.detach().cpu().clone(), "started": self._started, "unit": self.unit}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("unit", self.unit) != self.unit:
            raise ValueError(f"unit: {sd.get('unit')!r}: checkpoint is for another unit than {self.unit!r}")
        self.state.copy_(sd["state"].to(self.state.device))
        self._started = bool(sd["started"])


def _normal_quantile(p: float) -> float:
    """Φ⁻¹(p), the standard normal quantile."""
    from statistics import NormalDist

    return NormalDist().inv_cdf(p)


# ---------------------------------------------------------------------------
# The monitor: gradient sources for a real training step
# ---------------------------------------------------------------------------

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
            raise ValueError(f"sources: {self.sources!r}: expected a non-empty subset of {SOURCES}")
        if self.half_life is not None and not self.half_life > 0:
            raise ValueError(f"half_life: {self.half_life!r}: must be > 0 units, None or math.inf")
        if not self.half_life_windows > 0:
            raise ValueError(f"half_life_windows: {self.half_life_windows!r}: must be > 0")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence: {self.confidence!r}: must be in (0, 1)")
        if isinstance(self.min_windows, bool) or not isinstance(self.min_windows, int) or self.min_windows < 2:
            raise ValueError(f"min_windows: {self.min_windows!r}: must be an int >= 2")
        if not self.max_relative_stderr > 0:
            raise ValueError(f"max_relative_stderr: {self.max_relative_stderr!r}: must be > 0")


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
            raise ValueError(f"unit: {unit!r}: expected 'token' or 'sample'")
        self.unit = unit
        self.optimizer = optimizer
        if self.config.adam and optimizer is None:
            raise ValueError("optimizer: None: adam=True needs the Adam/AdamW optimizer (its exp_avg_sq)")
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        self.model = model
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        import torch.distributed as dist

        self._group = process_group if process_group is not None else (model.process_group if ddp else None)
        self.dp_world_size = dist.get_world_size(self._group) if self._group is not None else 1
        if process_group is not None and not ddp:
            raise ValueError("process_group: given for a plain module: the monitor needs a DDP model to see "
                             "each rank's gradient before the all-reduce")
        self.sources = tuple(s for s in self.config.sources if s != "rank" or self.dp_world_size > 1)
        if not self.sources:
            raise ValueError(f"sources: {self.config.sources!r}: 'rank' {NEEDS_TWO_BATCH_SIZES} "
                             f"(dp_world_size={self.dp_world_size}); add 'micro' with grad_accum_steps ≥ 2")
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
            raise ValueError(f"optimizer: holds {len(vs)} of the model's {len(self._params)} trainable parameters; "
                             "adam=True needs them all")
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

                logging.getLogger(__name__).warning(
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
            raise ValueError(f"noise scale {NEEDS_TWO_BATCH_SIZES} (got grad_accum_steps={k_local}, "
                             f"dp_world_size={self.dp_world_size})")
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
            raise ValueError(f"estimate: {key!r}: not measured (have {sorted(self.estimators) or 'none'}); "
                             f"the noise scale {NEEDS_TWO_BATCH_SIZES}")
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


# ---------------------------------------------------------------------------
# A short measurement run (what `globalbatch noise` calls)
# ---------------------------------------------------------------------------


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
    """``adamw`` or ``sgd``."""
    seed: int = 0
    """Model init and data order."""
    log_every: int = 5
    """Steps between estimates (each one is a host sync)."""
    half_life_windows: float = 10.0
    """EMA half-life, in windows of the (constant) global batch."""
    adam_variant: bool = False
    """Also report the Adam-preconditioned variant (needs ``optimizer="adamw"``)."""
    device: str | None = None
    """``cpu``, ``cuda``...; default cuda when available."""

    def __post_init__(self) -> None:
        for name, low in (("micro_batch", 1), ("grad_accum_steps", 1), ("steps", 1), ("log_every", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}: {v!r}: must be an int >= {low}")
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr: {self.lr!r}: must be a finite number >= 0")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer: {self.optimizer!r}: expected 'adamw' or 'sgd'")
        if self.adam_variant and self.optimizer != "adamw":
            raise ValueError("adam_variant: True: needs optimizer 'adamw' (its exp_avg_sq)")
        if not self.half_life_windows > 0:
            raise ValueError(f"half_life_windows: {self.half_life_windows!r}: must be > 0")


@dataclass
class NoiseRunResult:
    """Logged rows (one per ``log_every`` steps) and the final estimates."""

    rows: list[dict[str, Any]]
    final: dict[str, NoiseScaleEstimate]
    unit: str
    dp_world_size: int
    csv_path: str | None = None


def _row(step: int, res: Any, estimates: dict[str, NoiseScaleEstimate], keys: Sequence[str]) -> dict[str, Any]:
    row: dict[str, Any] = {"step": step, "units_seen": res.consumed_units, "lr": res.lr,
                           "loss": res.loss_per_unit, "batch_units": res.global_units,
                           "batch_samples": res.global_samples}
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

    from .step import StepConfig, StepDriver
    from .tasks import load_task

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if config.grad_accum_steps * world < 2:
        raise ValueError(f"grad_accum_steps: {config.grad_accum_steps}: noise scale {NEEDS_TWO_BATCH_SIZES} "
                         f"(dp_world_size={world})")
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    own_group = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        own_group = True
    rank = dist.get_rank() if world > 1 else 0
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    writer = _tensorboard_writer(os.path.join(out_dir or "runs/noise", "tb")) if tensorboard and rank == 0 else None
    try:
        task = load_task(config.task, **config.task_overrides)
        model = task.build_model(config.seed).to(device)
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = (torch.optim.AdamW(model.parameters(), lr=config.lr) if config.optimizer == "adamw"
               else torch.optim.SGD(model.parameters(), lr=config.lr))
        monitor = NoiseScaleMonitor(model, optimizer=opt, unit=task.unit,
                                    config=NoiseConfig(half_life_windows=config.half_life_windows,
                                                       adam=config.adam_variant))
        driver = StepDriver(model, opt, StepConfig(micro_batch=config.micro_batch,
                                                   global_batch=config.micro_batch * config.grad_accum_steps * world),
                            callbacks=[monitor])
        units = [task.unit] + (["sample"] if task.unit == "token" else [])
        keys = [f"{v}/{u}" for v in monitor._variants() for u in units]
        order = task.sample_order(config.seed)
        rows: list[dict[str, Any]] = []
        csv_path = os.path.join(out_dir, "noise.csv") if out_dir and rank == 0 else None
        for step in range(1, config.steps + 1):
            for i in range(config.grad_accum_steps):
                draw = [next(order) for _ in range(config.micro_batch * world)]  # same stream on every rank
                idx = draw[rank * config.micro_batch:(rank + 1) * config.micro_batch]
                batch = task.collate(idx, device)
                with driver.micro_step(last=i == config.grad_accum_steps - 1):
                    loss_sum, count = task.loss_sum(model, batch)
                    driver.backward(loss_sum, count, samples=len(idx))
            res = driver.step()
            if step % config.log_every == 0 or step == config.steps:
                estimates = monitor.estimates()  # host sync: log steps only
                if rank == 0:
                    row = _row(step, res, estimates, keys)
                    rows.append(row)
                    if csv_path:
                        from .sweep import atomic_write_text

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
        return NoiseRunResult(rows=rows, final=monitor.estimates(), unit=task.unit, dp_world_size=world,
                              csv_path=csv_path)
    finally:
        if writer is not None:
            writer.close()
        if own_group:
            dist.destroy_process_group()


def format_estimate(e: NoiseScaleEstimate, *, digits: int = 3) -> str:
    """``1,234 tokens [95% 1,010–1,530], SE 130`` or the flags when not reportable."""
    def fmt(x: float) -> str:
        if not math.isfinite(x):
            return "n/a"
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.{digits}g}"

    text = f"{fmt(e.b_simple)} {e.unit}s"
    if math.isfinite(e.low):
        text += f" [{e.confidence:.0%} {fmt(e.low)}–{fmt(e.high)}], SE {fmt(e.stderr)}"
    if e.flags:
        text += f" — not reportable: {', '.join(e.flags)}"
    return text
