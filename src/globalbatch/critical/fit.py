"""The critical batch from a batch sweep: fits, loss targets and a recommendation.

McCandlish, Kaplan, Amodei 2018, "An Empirical Model of Large-Batch Training"
(arXiv 1812.06162), eq. 2.11: to reach a given loss, the optimizer steps S and the
examples E = B·S trade off along the hyperbola

    (S / S_min − 1)(E / E_min − 1) = 1,        B_crit = E_min / S_min,

which, with E = B·S, is S(B) = S_min·(1 + B_crit / B). They tune the LR at each batch,
take the fastest run at each batch for each target of an EMA-smoothed loss, fit the
hyperbola in log space and report B_crit with its standard error. This module does the
same: the fit is ``scipy.optimize.curve_fit`` of log S = log S_min + log(1 + B_crit/B)
with parameters (log S_min, log B_crit), so the covariance of log B_crit comes straight
out of the fit and SE(B_crit) = B_crit·SE(log B_crit) (delta method).

Zhang et al. 2024, "How Does Critical Batch Size Scale in Pre-training?" (arXiv
2410.21676) define a different number, the CBS: the batch at which the steps exceed the
linear-scaling ideal by 20%. From S(B) = a + b/B (a = S_min, b = E_min) and the ideal
S_ideal(B) = S(B0)·B0/B: CBS = 0.2·b/a + 1.2·B0, i.e. 0.2·B_crit in the B0 → 0 limit.
The two definitions differ by ~5×; every number here says which one it is.

Units: "examples" are whatever the sweep counts per step — tokens for language models,
samples otherwise (``unit``). Pure numpy/scipy; no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from globalbatch.critical.errors import NoAnswerError
from globalbatch.errors import Raw, SettingError

import numpy as np

__all__ = ["HyperbolaFit", "fit_hyperbola", "zhang_cbs", "nested_f_test"]





# ---------------------------------------------------------------------------
# The hyperbola fit (McCandlish eq. 2.11) and the 20%-overhead CBS (Zhang 2024)
# ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class HyperbolaFit:
    """Least-squares fit of S(B) = S_min·(1 + B_crit/B) in log space, with standard errors."""

    s_min: float
    """Fewest steps that can reach the target (B → ∞)."""
    e_min: float
    """Fewest examples that can reach the target (B → 0), = S_min·B_crit."""
    b_crit: float
    """McCandlish critical batch E_min/S_min, in examples per step."""
    se_log_s_min: float
    se_log_b_crit: float
    """Standard error of ln B_crit from the fit covariance (residual-variance scaled)."""
    se_b_crit: float
    """SE(B_crit) = B_crit·SE(ln B_crit) (delta method)."""
    se_e_min: float
    cov_log: list[list[float]]
    """Covariance of (ln S_min, ln B_crit)."""
    n_points: int
    dof: int
    residual_std_log: float
    """Standard deviation of the log-space residuals (≈ relative scatter of S)."""
    batch_range: tuple[float, float]
    """Smallest and largest batch that went into the fit."""
    degenerate: Optional[str] = None
    """Why the fit cannot be read as a critical batch (non-finite, or S_min ≈ 0: steps fall
    faster than 1/batch), or None. A degenerate fit reports no B_crit and no bound."""
    data: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
    """The fitted (batches, steps): what the profile-likelihood bounds are computed from."""

    def steps(self, batch_size: np.ndarray | float) -> np.ndarray:
        """Predicted steps to target at ``batch_size``."""
        return self.s_min * (1.0 + self.b_crit / np.asarray(batch_size, dtype=float))

    def examples(self, batch_size: np.ndarray | float) -> np.ndarray:
        """Predicted examples to target at ``batch_size`` (E = B·S = E_min·(1 + B/B_crit))."""
        return np.asarray(batch_size, dtype=float) * self.steps(batch_size)

    def b_crit_interval(self, level: float = 0.95) -> tuple[float, float]:
        """Confidence interval of B_crit: symmetric in ln B_crit with a Student-t quantile (dof of the fit).

        Raises :class:`~globalbatch.critical.errors.NoAnswerError` for a degenerate fit or one whose B_crit lies outside the swept
        batches: there the curvature was not observed and only :meth:`b_crit_bound` (or
        nothing) can be said.
        """
        from scipy import stats

        if self.degenerate is not None:
            raise NoAnswerError(f"b_crit_interval: the fit is degenerate ({self.degenerate}); no interval")
        if self.extrapolated:
            raise NoAnswerError(f"b_crit_interval: B_crit {self.b_crit:.3g} lies outside the swept batches "
                                f"{self.batch_range[0]:g}–{self.batch_range[1]:g}; use b_crit_bound()")
        q = float(stats.t.ppf(0.5 + level / 2.0, max(self.dof, 1)))
        half = min(q * self.se_log_b_crit, 700.0)  # exp(700) ~ 1e304: an unbounded interval, not an overflow
        return self.b_crit * math.exp(-half), self.b_crit * math.exp(half)

    @property
    def extrapolated(self) -> bool:
        """True when B_crit lies outside the swept batch range (the curvature was not observed)."""
        return not (self.batch_range[0] <= self.b_crit <= self.batch_range[1])

    def profile_limits(self, level: float = 0.95, *, one_sided: bool = True) -> tuple[Optional[float], Optional[float]]:
        """Profile-likelihood confidence limits of B_crit: ``(low, high)``, None where the data set no limit.

        For each trial B_crit the best S_min is closed-form in log space (the mean residual),
        so the profile SSE(B_crit) is exact. The limits are where it exceeds the minimum by
        the F-test margin SSE_min·q²/dof (q the Student-t quantile, one-sided by default).
        Unlike the Wald interval this stays finite and sane when B_crit is pinned far outside
        the swept batches: flat steps bound B_crit from above, S ∝ 1/B from below.
        """
        from scipy import stats

        b = np.asarray(self.data[0], dtype=float)
        s = np.asarray(self.data[1], dtype=float)
        if b.size < 3 or self.degenerate is not None:
            return None, None
        y = np.log(s)
        lo, hi = math.log(b.min()) - 12.0, math.log(b.max()) + 12.0
        grid = np.linspace(lo, hi, 2401)
        r = y[None, :] - np.log1p(np.exp(grid)[:, None] / b[None, :])
        sse = np.sum((r - r.mean(axis=1, keepdims=True)) ** 2, axis=1)
        sse_min = float(min(sse.min(), self.residual_std_log ** 2 * max(self.dof, 1)))
        dof = max(self.dof, 1)
        q = float(stats.t.ppf(level if one_sided else 0.5 + level / 2.0, dof))
        # A floor on the residual scale (1e-4 in log steps) keeps exact synthetic data from
        # claiming a limit at the point estimate itself.
        threshold = sse_min + max(sse_min, 1e-8 * dof) * q * q / dof
        inside = np.flatnonzero(sse <= threshold)
        if inside.size == 0:
            return None, None
        low = None if inside[0] == 0 else float(math.exp(grid[inside[0]]))
        high = None if inside[-1] == grid.size - 1 else float(math.exp(grid[inside[-1]]))
        return low, high

    def b_crit_bound(self, level: float = 0.95) -> Optional[tuple[str, float]]:
        """The one-sided bound to report instead of a two-sided interval when B_crit is extrapolated.

        Above the swept range every batch is in the perfect-scaling regime (S ∝ 1/B): the
        data only say B_crit is large, so the answer is ``("lower", X)``, X = the smaller of
        the one-sided ``level`` profile-likelihood lower limit (:meth:`profile_limits`) and
        the largest swept batch. Below the range every batch is in the saturated regime
        (S ≈ S_min): ``("upper", Y)``, Y = the larger of the upper limit and the smallest
        swept batch. A bound is stated only where the data support it: None when B_crit
        lies inside the range (then :meth:`b_crit_interval` stands), when the fit is
        degenerate, or when the limit does not exist or lies on the wrong side of the swept
        batches (a "lower bound" below the smallest batch says nothing; see
        :meth:`bound_missing`).
        """
        if not self.extrapolated or self.degenerate is not None:
            return None
        low, high = self.profile_limits(level, one_sided=True)
        if self.b_crit > self.batch_range[1]:
            if low is None or low < self.batch_range[0]:
                return None
            return "lower", min(low, self.batch_range[1])
        if high is None or high > self.batch_range[1]:
            return None
        return "upper", max(high, self.batch_range[0])

    def bound_missing(self, level: float = 0.95) -> bool:
        """True when B_crit is extrapolated and the data support no one-sided bound."""
        return self.degenerate is None and self.extrapolated and self.b_crit_bound(level) is None

    def b_crit_text(self, level: float = 0.95) -> str:
        """``"1,600 (95% CI 1,500–1,700)"``, the one-sided bound when extrapolated, or why there is none."""
        if self.degenerate is not None:
            return f"fit failed (degenerate: {self.degenerate}); no bound"
        if not self.extrapolated:
            lo, hi = self.b_crit_interval(level)
            return f"{self.b_crit:,.0f} ({level:.0%} CI {lo:,.0f}–{hi:,.0f})"
        bound = self.b_crit_bound(level)
        if bound is None:
            side = "above" if self.b_crit > self.batch_range[1] else "below"
            return (f"B_crit {side} the swept batches {self.batch_range[0]:,.0f}–{self.batch_range[1]:,.0f}; "
                    f"the scatter of the steps supports no bound")
        kind, x = bound
        if kind == "lower":
            return f"B_crit > {x:,.0f} (lower bound; all batches in the perfect-scaling regime)"
        return f"B_crit < {x:,.0f} (upper bound; all batches in the saturated regime)"

    def cbs(self, *, overhead: float = 0.2, base_batch: float = 0.0) -> float:
        """Zhang et al. 2024 critical batch for this fit; see :func:`zhang_cbs`."""
        return zhang_cbs(self.s_min, self.e_min, overhead=overhead, base_batch=base_batch)


def zhang_cbs(s_min: float, e_min: float, *, overhead: float = 0.2, base_batch: float = 0.0) -> float:
    """Batch where steps exceed the linear-scaling ideal from ``base_batch`` by ``overhead``.

    With S(B) = a + b/B (a = S_min, b = E_min), linear scaling from B0 predicts
    S(B0)·B0/B steps; S(B) = (1 + overhead)·S(B0)·B0/B solves to
    B = overhead·b/a + (1 + overhead)·B0. With the default B0 = 0 (ideal = E_min/B,
    perfect data efficiency) this is 0.2·B_crit — Zhang et al. 2024's CBS, not McCandlish's.
    """
    if not overhead > 0:
        raise SettingError("overhead", overhead, "> 0 (0.2 = 20%)")
    if base_batch < 0:
        raise SettingError("base_batch", base_batch, ">= 0")
    return overhead * e_min / s_min + (1.0 + overhead) * base_batch


def _degenerate(s_min: float, e_min: float, b_crit: float, b: np.ndarray, s: np.ndarray) -> Optional[str]:
    """Why a fit says nothing about B_crit, or None (see :attr:`HyperbolaFit.degenerate`).

    Unit-free: only ratios to the data enter (the same steps in thousands of samples get the
    same verdict). B_crit pinned far below or above the swept batches is *not* degenerate:
    it is the saturated or perfect-scaling regime, and :meth:`HyperbolaFit.b_crit_bound`
    says what the data support.
    """
    if not all(math.isfinite(v) for v in (s_min, e_min, b_crit)):
        return "non-finite S_min, E_min or B_crit"
    if s_min <= 0 or s_min < 1e-6 * float(s.min()):
        return f"S_min = {s_min:.3g} ≈ 0 (a {s_min / float(s.min()):.1e} fraction of the fewest steps): steps fall faster than 1/batch"
    slope = float(np.polyfit(np.log(b), np.log(s), 1)[0])
    if slope < -1.1:  # the hyperbola's steepest is −1 (S ∝ 1/B); 10 % slack for noise
        return f"steps fall as batch^{slope:.2f}, faster than 1/batch: no hyperbola describes them"
    return None


def _log_model(batch: np.ndarray, log_s_min: float, log_b_crit: float) -> np.ndarray:
    return log_s_min + np.log1p(np.exp(log_b_crit) / batch)


def _log_model_jac(batch: np.ndarray, log_s_min: float, log_b_crit: float) -> np.ndarray:
    """∂/∂(ln S_min, ln B_crit) of :func:`_log_model`: (1, r/(1+r)) with r = B_crit/B (exact, and a third faster than
    curve_fit's finite differences)."""
    r = np.exp(log_b_crit) / batch
    return np.column_stack([np.ones_like(batch), r / (1.0 + r)])


def fit_hyperbola(batch_sizes: Sequence[float], steps: Sequence[float]) -> HyperbolaFit:
    """Fit S(B) = S_min·(1 + B_crit/B) to steps-to-target at each batch.

    Args:
        batch_sizes: examples per step of each point (each batch once, its best LR).
        steps: steps to reach the target at that batch.

    The fit is in log space (relative errors, as McCandlish); the covariance is scaled
    by the residual variance (``absolute_sigma=False``), so use a Student-t quantile with
    ``dof = n − 2`` for intervals (:meth:`HyperbolaFit.b_crit_interval`). Raises
    :class:`~globalbatch.critical.errors.NoAnswerError` with fewer than 3 points (a 2-parameter fit needs a
    residual) or when no start converges; a :class:`~globalbatch.errors.SettingError` for bad input.
    """
    from scipy.optimize import curve_fit

    b = np.asarray(batch_sizes, dtype=float)
    s = np.asarray(steps, dtype=float)
    if b.shape != s.shape or b.ndim != 1:
        raise SettingError("steps", Raw(f"shape {s.shape}"), f"a 1-D sequence as long as batch_sizes {b.shape}")
    if b.size < 3:
        raise NoAnswerError(f"points: {b.size}: the hyperbola fit needs at least 3 batch sizes that reach the target")
    for name, v in (("batch_sizes", b), ("steps", s)):
        if np.any(~np.isfinite(v) | (v <= 0)):
            raise SettingError(name, v.tolist()[:8], "finite numbers > 0")
    y = np.log(s)
    lo, hi = math.log(b.min()), math.log(b.max())
    bounds = ([-np.inf, lo - 12.0], [np.inf, hi + 12.0])
    best = None
    # A few starting points for ln B_crit across (and beyond) the swept range: the
    # objective is not convex in ln B_crit and a single start can stall on a plateau.
    for log_bc0 in np.linspace(lo - 2.0, hi + 2.0, 5):
        log_s0 = float(np.median(y - np.log1p(math.exp(log_bc0) / b)))
        try:
            popt, pcov = curve_fit(_log_model, b, y, p0=[log_s0, log_bc0], bounds=bounds, method="trf", maxfev=5000,
                                   jac=_log_model_jac)
        except (RuntimeError, ValueError):
            continue
        sse = float(np.sum((y - _log_model(b, *popt)) ** 2))
        if best is None or sse < best[0] - 1e-12:
            best = (sse, popt, pcov)
    if best is None:
        raise NoAnswerError("fit: curve_fit did not converge from any starting point")
    sse, popt, pcov = best
    dof = b.size - 2
    if not np.all(np.isfinite(pcov)):
        pcov = np.full((2, 2), np.inf)
    log_s_min, log_b_crit = (float(v) for v in popt)
    s_min, b_crit = math.exp(log_s_min), math.exp(log_b_crit)
    se_ls, se_lb = math.sqrt(max(pcov[0, 0], 0.0)), math.sqrt(max(pcov[1, 1], 0.0))
    # ln E_min = ln S_min + ln B_crit: its variance includes the covariance term.
    var_le = pcov[0, 0] + pcov[1, 1] + 2.0 * pcov[0, 1]
    e_min = s_min * b_crit
    return HyperbolaFit(
        degenerate=_degenerate(s_min, e_min, b_crit, b, s),
        data=(tuple(float(x) for x in b), tuple(float(x) for x in s)),
        s_min=s_min,
        e_min=e_min,
        b_crit=b_crit,
        se_log_s_min=se_ls,
        se_log_b_crit=se_lb,
        se_b_crit=b_crit * se_lb,
        se_e_min=e_min * math.sqrt(max(var_le, 0.0)) if np.isfinite(var_le) else math.inf,
        cov_log=[[float(v) for v in row] for row in pcov],
        n_points=int(b.size),
        dof=dof,
        residual_std_log=math.sqrt(sse / dof) if dof > 0 else 0.0,
        batch_range=(float(b.min()), float(b.max())),
    )


def nested_f_test(sse_shared: float, sse_own: float, seeds: int, batches: int) -> tuple[float, float]:
    """The extra-sum-of-squares F-test of ``seeds`` hyperbola fits at ``batches`` batches each sharing one parameter
    against each its own (Motulsky & Christopoulos 2004, ch. 22): F = ((SSE_shared − SSE_own)/(K − 1)) /
    (SSE_own/(n − 2K)) with n = K·m points, and P(F_{K−1, n−2K} ≥ F). Exact data (SSE_own ≈ 0): F = 0 where the shared
    fit is exact too, else ∞ (p = 0). Returns ``(f_stat, p_value)``."""
    from scipy import stats

    n, dof_num, dof_den = seeds * batches, seeds - 1, seeds * batches - 2 * seeds
    if sse_own <= 1e-12 * n:
        f_stat = 0.0 if sse_shared <= 1e-10 * n else math.inf
    else:
        f_stat = max(sse_shared - sse_own, 0.0) / dof_num / (sse_own / dof_den)
    return float(f_stat), (float(stats.f.sf(f_stat, dof_num, dof_den)) if math.isfinite(f_stat) else 0.0)
