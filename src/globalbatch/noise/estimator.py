"""The two-batch estimator of tr(Σ) and |G|², its EMA, and the interval and flags of B_simple.

McCandlish et al. 2018 (arXiv 1812.06162), App. A.1, for one window of B units partitioned
into k small batches of b_i units (Σ b_i = B, G_big = Σ b_i g_i / B):

    tr(Σ)^ = (Σ_i b_i |g_i|² − B |G_big|²) / (k − 1)
    |G|²^  = |G_big|² − tr(Σ)^ / B

B_simple = tr(Σ)/|G|² (eq. 2.8) is the ratio of separate EMAs of the two, with a
delta-method standard error and Fieller's interval (the package docstring has the details).
Pure tensor code: no training loop, no hooks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from globalbatch.errors import Raw, SettingError

__all__ = [
    "NEEDS_TWO_BATCH_SIZES",
    "WindowStats",
    "NoiseScaleEstimate",
    "NoiseScaleEstimator",
    "window_estimates",
    "fieller_interval",
    "ema_fold",
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
        raise SettingError("small_counts", Raw(f"with {counts.numel()} values for {sq.numel()} small_sq_norms"),
                           f"one count per small batch ({sq.numel()})")
    k = sq.numel()
    if k < 2:
        raise SettingError("small batches", Raw(f"k={k}"), f"k ≥ 2 (the noise scale {NEEDS_TWO_BATCH_SIZES})")
    total = counts.sum()
    big = total if big_count is None else _as_tensor(big_count, sq.device).reshape(())
    if counts.device.type == "cpu" and big.device.type == "cpu":  # validation only where it costs no sync
        if bool((counts <= 0).any()):
            raise SettingError("small_counts", counts.tolist(), "every count > 0")
        if not math.isclose(float(total), float(big), rel_tol=1e-9):
            raise SettingError("big_count", Raw(f"{float(big):g}"), f"sum(small_counts) = {float(total):g} "
                               "(the small batches partition the big one)")
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
    """Measured windows left out: a norm was not finite (e.g. AMP overflow), or the step driver
    skipped the optimizer step (non-finite loss or gradient on some rank)."""
    effective_windows: float
    """n_eff = (Σw)²/Σw² of the EMA weights."""
    big_count: float
    """B of the last window (global batch in ``unit``s), logged beside the estimate."""
    lr: float
    """Learning rate of the last window (NaN when not given): B_simple ∝ 1/temperature."""
    flags: tuple[str, ...]
    """Why the estimate should not be reported: ``"no_windows"``, ``"few_windows"``,
    ``"g_sq_nonpositive"``, ``"too_noisy"`` (|G|² not significantly > 0, or relative error
    above the limit), ``"wide_interval"`` (high/low of the interval above ``max_interval_ratio``,
    2 by default: the answer is not known to within a factor of 2). Empty when reportable."""

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


def ema_fold(state: torch.Tensor, tg: torch.Tensor, big: torch.Tensor, decay: torch.Tensor,
             present: torch.Tensor | None = None, *, lr: Any = None) -> None:
    """Fold m windows, in order, into n estimators at once: one small op chain, no host sync.

    The EMA S_i = d_i·S_(i−1) + new_i unrolled: S_m = (Π d)·S_0 + Σ_i (Π_(l>i) d_l)·new_i, the
    products taken as exponentials of suffix sums of log d (so m windows cost what one does).

    Args:
        state: (n, 12) float64 estimator states, updated in place.
        tg: (m, n, 2) each window's (tr(Σ)^, |G|²^) for each estimator.
        big: (m, n) each window's units B; decay: (m, n) its EMA decay d ∈ (0, 1].
        present: (m, n) bool, False where an estimator has no value in a window (left out, not
            counted); None: all present. A present window whose tg is not finite is skipped and
            counted in the skip counter.
        lr: the last window's learning rate, logged (None: unchanged).
    """
    finite = torch.isfinite(tg).all(2)
    valid = finite if present is None else finite & present
    t = torch.where(valid, tg[..., 0], 0.0)
    g = torch.where(valid, tg[..., 1], 0.0)
    d = torch.where(valid, decay, 1.0)
    # Weight of a window: 1 − d (≈ B·ln2/half_life: proportional to its units); 1 for a plain mean (d = 1).
    w = torch.where(valid, torch.where(d < 1, 1 - d, 1.0), 0.0)
    log_d = torch.log(d)
    after = log_d.sum(0, keepdim=True) - log_d.cumsum(0)        # Σ_(l>i) log d_l
    c = torch.exp(after)
    wc, wt, wg = w * c, w * t, w * g
    new = torch.stack([wc, w * w * c * c, wt * c, wg * c, wt * t * c, wg * g * c, wt * g * c], 2).sum(0)  # (n, 7)
    total = torch.exp(log_d.sum(0))
    dec = torch.stack([total, total * total, total, total, total, total, total], 1)
    state[:, :_N].mul_(dec).add_(new)
    skipped = ~finite if present is None else present & ~finite
    state[:, _N:_SKIP + 1].add_(torch.stack([valid.sum(0), skipped.sum(0)], 1).to(state.dtype))
    # B of the last valid window (unchanged when none): position of the last True along windows.
    m = tg.shape[0]
    order = torch.arange(1, m + 1, device=state.device, dtype=torch.float64)[:, None]
    last = (valid * order).argmax(0)
    big_last = big.gather(0, last[None])[0]
    state[:, _BIG] = torch.where(valid.any(0), big_last.to(state.dtype), state[:, _BIG])
    if lr is not None:
        state[:, _LR] = _as_tensor(lr, state.device).reshape(())


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
        max_interval_ratio: high/low of the interval above this flags ``"wide_interval"``
            (``math.inf``: never).
        device: where the state lives (the gradients' device).
    """

    def __init__(self, *, unit: str = "token", half_life: float | None = None, half_life_windows: float = 20.0,
                 confidence: float = 0.95, min_windows: int = 3, max_relative_stderr: float = 0.5,
                 max_interval_ratio: float = 2.0, device: torch.device | str | None = None,
                 state: torch.Tensor | None = None) -> None:
        if unit not in ("token", "sample"):
            raise SettingError("unit", unit, "'token' or 'sample'")
        if half_life is not None and not half_life > 0:
            raise SettingError("half_life", half_life, "> 0 units, None or math.inf")
        if not half_life_windows > 0:
            raise SettingError("half_life_windows", half_life_windows, "> 0")
        if not 0.0 < confidence < 1.0:
            raise SettingError("confidence", confidence, "0 < confidence < 1")
        if min_windows < 2:
            raise SettingError("min_windows", min_windows, "≥ 2 (a variance needs two windows)")
        if not max_relative_stderr > 0:
            raise SettingError("max_relative_stderr", max_relative_stderr, "> 0")
        if not max_interval_ratio > 1:
            raise SettingError("max_interval_ratio", max_interval_ratio, "> 1 (or math.inf)")
        self.unit = unit
        self.half_life = half_life
        self.half_life_windows = float(half_life_windows)
        self.confidence = float(confidence)
        self.min_windows = int(min_windows)
        self.max_relative_stderr = float(max_relative_stderr)
        self.max_interval_ratio = float(max_interval_ratio)
        # ``state``: a caller-owned row (the monitor keeps every estimator's state in one matrix and
        # updates them all with one op chain); by default a tensor of its own.
        self.state = torch.zeros(_STATE_LEN, dtype=torch.float64, device=device) if state is None else state
        self.state.zero_()
        self.state[_LR] = math.nan
        self._started = False  # host-side: B0 set (for half_life=None)

    # -- updates (no host sync) ------------------------------------------------------------

    def update(self, small_sq_norms: Any, small_counts: Any, big_sq_norm: Any, big_count: Any = None, *,
               lr: Any = None) -> WindowStats:
        """Fold in one window given the small-batch norms and counts (see :func:`window_estimates`)."""
        stats = window_estimates(small_sq_norms, small_counts, big_sq_norm, big_count)
        self.update_window(stats, lr=lr)
        return stats

    def decay_for(self, big_count: torch.Tensor, windows: float = 1.0) -> torch.Tensor:
        """EMA decay for ``windows`` windows of ``big_count`` units: 0.5^(windows·B/half_life) (a device
        tensor). ``windows`` > 1 when only one window in n is measured (``NoiseConfig.every``)."""
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
        return torch.exp2(-big * windows / half) if windows != 1.0 else torch.exp2(-big / half)

    def update_window(self, stats: WindowStats, *, lr: Any = None, decay: torch.Tensor | None = None) -> None:
        """Fold in one window's estimates. Non-finite windows are skipped (counted), on the device."""
        s = self.state
        tg = torch.stack([stats.tr_sigma.reshape(()), stats.g_sq.reshape(())]).to(device=s.device,
                                                                                  dtype=torch.float64)
        big = stats.big_count.to(device=s.device, dtype=torch.float64).reshape(1, 1)
        d = self.decay_for(big[0, 0]) if decay is None else decay.to(device=s.device, dtype=torch.float64)
        ema_fold(s[None], tg.reshape(1, 1, 2), big, d.reshape(1, 1), lr=lr)

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
                if not high <= self.max_interval_ratio * low:  # low 0: unbounded ratio; NaN: flagged too
                    flags.append("wide_interval")
        return NoiseScaleEstimate(unit=self.unit, b_simple=ratio, stderr=stderr, low=low, high=high,
                                  confidence=self.confidence, tr_sigma=t, g_sq=g, windows=int(N),
                                  skipped_windows=int(SKIP), effective_windows=n_eff, big_count=BIG, lr=LR,
                                  flags=tuple(flags))

    # -- checkpointing -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.state.detach().cpu().clone(), "started": self._started, "unit": self.unit}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("unit", self.unit) != self.unit:
            raise SettingError("checkpoint unit", sd.get("unit"), f"{self.unit!r} (this estimator's unit)")
        self.state.copy_(sd["state"].to(self.state.device))
        self._started = bool(sd["started"])


def _normal_quantile(p: float) -> float:
    """Φ⁻¹(p), the standard normal quantile."""
    from statistics import NormalDist

    return NormalDist().inv_cdf(p)
