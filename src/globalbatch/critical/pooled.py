"""Per-seed critical batches with one S_min shared by the seeds, where an F-test allows it.

McCandlish et al. 2018 (arXiv 1812.06162, eq. 2.11): to reach a loss, S(B) = S_min·(1 + B_crit/B). Fitted
per seed (:func:`~globalbatch.critical.fit.fit_hyperbola`) each seed spends two parameters on five or six
noisy points, and where B_crit lies near or beyond the largest batch the curvature that separates S_min
from B_crit is barely seen: the per-seed B_crit scatters more than the seeds differ. S_min is a nuisance
parameter here — the question is B_crit per seed — so this module fits the seeds together with one S_min
and a B_crit of their own (ln S_ks = a + ln(1 + B_crit,s / B_k), ``scipy.optimize.least_squares``): every
B_crit stays a per-seed measurement (nothing pools B_crit itself), while the shared S_min is pinned by all
seeds' large batches.

Sharing is an assumption, so it is tested: the extra-sum-of-squares F-test of the nested models (one S_min
against one per seed; e.g. Motulsky & Christopoulos, *Fitting models to biological data using linear and
nonlinear regression*, 2004, ch. 22), F = ((SSE_shared − SSE_own)/(K − 1)) / (SSE_own/(n − 2K)) with K seeds
and n points. Where it rejects sharing (p < ``alpha``, default :data:`POOL_ALPHA`) the per-seed fits stand. Measured
against ground truth in ``tests/test_critical_pooled.py`` and ``benchmarks/critical_pooled.py`` (docs/critical.md,
§1b). Partial pooling instead of this all-or-nothing gate — each seed's ln S_min shrunk toward the shared one by a
James–Stein / empirical-Bayes weight (Morris 1983; DerSimonian & Laird 1986), its B_crit refitted there — was
measured beside it and not adopted: more accurate where the seeds share S_min or nearly, less where one seed's
S_min really is 2–3× the others'. Pure numpy/scipy; no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from globalbatch.critical.errors import NoAnswerError
from globalbatch.critical.fit import fit_hyperbola

__all__ = ["POOL_ALPHA", "PooledFit", "fit_shared_s_min", "pooled_for_target"]

POOL_ALPHA = 0.2
"""Significance level of the F-test: sharing S_min is rejected where p < this. 0.2 rather than 0.05: on synthetic
tables with the real runs' noise (docs/critical.md §1b, ``benchmarks/critical_pooled.py``) a seed whose S_min lags
the others by 1.3–2×, or a spread of 0.2 in ln S_min, slips through a 5 % test often enough to cost up to 26 % more
RMS error in ln B_crit than the per-seed fits; at 0.2 that cost is ≤ 10 % while the gain where the seeds share S_min
(or nearly: a spread ≤ 0.05) stays 14–26 %."""


@dataclass(kw_only=True)
class PooledFit:
    """One S_min for every seed, a B_crit per seed, and the F-test of sharing against per-seed S_min."""

    seeds: list[int]
    batches: tuple[float, ...]
    s_min: float
    """The shared S_min (steps)."""
    b_crit: dict[int, float]
    """Seed → its B_crit under the shared S_min (examples per step)."""
    se_log_b_crit: dict[int, float]
    """Seed → SE of its ln B_crit (residual-scaled covariance of the shared fit)."""
    sse_shared: float
    sse_own: float
    """Sum of squared log residuals of the shared fit and of the per-seed fits together."""
    dof_num: int
    """K − 1: the parameters sharing saves."""
    dof_den: int
    """n − 2K: the per-seed fits' residual degrees of freedom."""
    f_stat: float
    p_value: float
    """P(F ≥ f_stat) under "the seeds share S_min"."""
    alpha: float = POOL_ALPHA

    @property
    def shared(self) -> bool:
        """True when the F-test does not reject sharing (p ≥ alpha): the pooled B_crit are used."""
        return self.p_value >= self.alpha

    def inside(self, seed: int) -> bool:
        """True when the seed's pooled B_crit lies within the swept batches (a point estimate, not a bound)."""
        return min(self.batches) <= self.b_crit[seed] <= max(self.batches)

    def interval(self, seed: int, level: float = 0.95) -> tuple[float, float]:
        """The seed's B_crit interval: symmetric in ln B_crit, Student-t with the shared fit's n − K − 1 dof."""
        from scipy import stats

        q = float(stats.t.ppf(0.5 + level / 2.0, max(len(self.seeds) * len(self.batches) - len(self.seeds) - 1, 1)))
        half = min(q * self.se_log_b_crit[seed], 700.0)
        return self.b_crit[seed] * math.exp(-half), self.b_crit[seed] * math.exp(half)

    def text(self) -> str:
        """One line: what the test said and what the analysis used."""
        verdict = ("not rejected: per-seed B_crit with one S_min" if self.shared
                   else "rejected: per-seed fits")
        return (f"shared S_min over {len(self.seeds)} seeds: F({self.dof_num},{self.dof_den}) = {self.f_stat:.2f}, "
                f"p = {self.p_value:.3f} (alpha {self.alpha:g}) — {verdict}")

    def as_json(self) -> dict:
        return {"seeds": self.seeds, "shared": self.shared, "p_value": self.p_value,
                "f_stat": self.f_stat if math.isfinite(self.f_stat) else None,
                "dof": [self.dof_num, self.dof_den], "alpha": self.alpha, "s_min": self.s_min,
                "b_crit_per_seed": {str(s): v for s, v in self.b_crit.items()},
                "se_log_b_crit_per_seed": {str(s): v for s, v in self.se_log_b_crit.items()},
                "model": "ln S = ln S_min + ln(1 + B_crit,seed/B), one S_min for every seed", "text": self.text()}


def fit_shared_s_min(batches: Sequence[float], steps: Mapping[int, Sequence[float]], *,
                     alpha: float = POOL_ALPHA) -> PooledFit:
    """Fit every seed's steps-to-target at ``batches`` with one S_min and a B_crit per seed; test sharing.

    ``steps``: seed → steps at each of ``batches`` (every seed at every batch, all > 0). Raises
    :class:`~globalbatch.critical.errors.NoAnswerError` with fewer than 2 seeds or 3 batches (no residual for
    the per-seed fits) or when no start converges.
    """
    from scipy import stats
    from scipy.optimize import least_squares

    b = np.asarray(batches, dtype=float)
    seeds = sorted(steps)
    if len(seeds) < 2 or b.size < 3:
        raise NoAnswerError(f"shared S_min: {len(seeds)} seed(s) × {b.size} batch(es); needs ≥ 2 seeds and ≥ 3 batches")
    y = np.log(np.array([[float(v) for v in steps[s]] for s in seeds]))
    if y.shape != (len(seeds), b.size) or not np.all(np.isfinite(y)):
        raise NoAnswerError("shared S_min: every seed needs finite steps > 0 at every batch")
    k, m = y.shape
    own = [fit_hyperbola(b.tolist(), np.exp(y[i]).tolist()) for i in range(k)]
    sse_own = float(sum(f.residual_std_log ** 2 * f.dof for f in own))
    lo, hi = math.log(b.min()) - 12.0, math.log(b.max()) + 12.0

    def resid(p: np.ndarray) -> np.ndarray:
        return (p[0] + np.log1p(np.exp(p[1:])[:, None] / b[None, :]) - y).ravel()

    starts = [np.clip([math.log(f.b_crit) for f in own], lo, hi)]
    starts += [np.full(k, t) for t in np.linspace(math.log(b.min()) - 2.0, math.log(b.max()) + 2.0, 5)]
    best = None
    for th in starts:
        a0 = float(np.mean(y - np.log1p(np.exp(th)[:, None] / b[None, :])))
        try:
            r = least_squares(resid, np.r_[a0, th], bounds=([-np.inf] + [lo] * k, [np.inf] + [hi] * k), method="trf")
        except (ValueError, np.linalg.LinAlgError):
            continue
        if best is None or r.cost < best.cost - 1e-12:
            best = r
    if best is None:
        raise NoAnswerError("shared S_min: least_squares did not converge from any start")
    sse_sh = float(2.0 * best.cost)
    n = k * m
    dof_num, dof_den = k - 1, n - 2 * k
    scale = max(sse_own, 0.0)
    if scale <= 1e-12 * n:  # exact data: sharing holds iff the shared fit is exact too
        f_stat = 0.0 if sse_sh <= 1e-10 * n else math.inf
    else:
        f_stat = max(sse_sh - sse_own, 0.0) / dof_num / (scale / dof_den)
    p_value = float(stats.f.sf(f_stat, dof_num, dof_den)) if math.isfinite(f_stat) else 0.0
    jac = best.jac
    s2 = sse_sh / max(n - k - 1, 1)
    try:
        cov = np.linalg.pinv(jac.T @ jac) * s2
        se = np.sqrt(np.maximum(np.diag(cov)[1:], 0.0))
    except np.linalg.LinAlgError:
        se = np.full(k, math.inf)
    return PooledFit(seeds=seeds, batches=tuple(float(x) for x in b), s_min=float(math.exp(best.x[0])),
                     b_crit={s: float(math.exp(best.x[1 + i])) for i, s in enumerate(seeds)},
                     se_log_b_crit={s: float(se[i]) for i, s in enumerate(seeds)},
                     sse_shared=sse_sh, sse_own=sse_own, dof_num=dof_num, dof_den=dof_den, f_stat=float(f_stat),
                     p_value=p_value, alpha=alpha)


def pooled_for_target(batches: Sequence[float], steps: Mapping[float, Mapping[int, Optional[float]]],
                      seeds: Sequence[int], *, alpha: float = POOL_ALPHA) -> Optional[PooledFit]:
    """The shared-S_min fit of ``seeds`` (those to pool: monotone, every batch reached) at one target's steps
    (batch → seed → steps); None when fewer than 2 seeds or 3 batches qualify, or the fit fails."""
    use = [s for s in seeds if all(steps[bb].get(s) for bb in batches)]
    if len(use) < 2 or len(batches) < 3:
        return None
    try:
        return fit_shared_s_min(batches, {s: [float(steps[bb][s]) for bb in batches] for s in use},  # type: ignore[arg-type]
                                alpha=alpha)
    except NoAnswerError:
        return None
