"""Per-seed critical batches with each seed's S_min partially pooled toward one shared by the seeds.

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
and n points, reported with its p-value. The per-seed B_crit the analysis uses are partially pooled rather than
all or nothing: each seed's ln S_min moves from its own fit's value toward the shared one by the fraction 1 − w,
w = max(0, 1 − 1/F) — the positive-part James–Stein / empirical-Bayes weight with the moment estimate of the
between-seed variance (Morris 1983, "Parametric empirical Bayes inference", JASA 78:47–55) — but by no more than
:data:`SHRINK_LIMIT_SE` of that seed's own standard error of ln S_min: Efron & Morris's *limited translation*
(1972, "Limiting the risk of Bayes and empirical Bayes estimators — Part II", JASA 67:130–139), which keeps a seed
whose S_min really differs near its own fit. That seed's B_crit is then refitted with its S_min held (one
parameter). Measured against ground truth, beside the all-or-nothing F-test gate it replaces and three other
shrinkage rules, in ``benchmarks/critical_pooled.py`` and ``tests/test_critical_pooled.py`` (docs/critical.md §1b).
Pure numpy/scipy; no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from globalbatch.critical.errors import NoAnswerError
from globalbatch.critical.fit import fit_hyperbola, nested_f_test

__all__ = ["POOL_ALPHA", "SHRINK_LIMIT_SE", "PooledFit", "fit_shared_s_min", "pooled_for_target", "seeds_table"]

POOL_ALPHA = 0.2
"""Level at which the F-test's verdict on one shared S_min is stated (:attr:`PooledFit.shared`). The per-seed B_crit
do not switch on it (they are partially pooled whatever the verdict); the batch-edge check reads it."""
SHRINK_LIMIT_SE = 0.5
"""Limited translation: no seed's ln S_min moves further from its own fit's value than this many of that fit's
standard errors. 0.5 rather than 1 (the two measured, docs/critical.md §1b): at 1 a seed whose S_min really is 2–3×
the others' is pulled far enough to cost more than the gate; at 0.5 no setting measured is worse than the gate."""


@dataclass(kw_only=True)
class PooledFit:
    """One S_min shared by the seeds, the F-test of sharing, and each seed's B_crit at its partially pooled S_min."""

    seeds: list[int]
    batches: tuple[float, ...]
    s_min: float
    """The shared S_min (steps)."""
    b_crit: dict[int, float]
    """Seed → its B_crit at its partially pooled S_min (:attr:`s_min_per_seed`; examples per step): what the
    analysis uses."""
    se_log_b_crit: dict[int, float]
    """Seed → SE of that ln B_crit (the shared and the own fit's variances mixed by :attr:`weight_per_seed`, with the
    pooled residual variance SSE_own/(n − 2K))."""
    b_crit_shared: dict[int, float]
    """Seed → its B_crit under the one shared S_min (the fully pooled fit)."""
    s_min_per_seed: dict[int, float]
    """Seed → its partially pooled S_min."""
    weight: float
    """w = max(0, 1 − 1/F): the James–Stein fraction of each seed's own deviation of ln S_min from the shared kept."""
    weight_per_seed: dict[int, float]
    """Seed → the fraction it kept after the limited translation (≥ :attr:`weight`; 1 = its own fit)."""
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
    limit_se: float = SHRINK_LIMIT_SE

    @property
    def shared(self) -> bool:
        """True when the F-test does not reject one shared S_min at :attr:`alpha` (p ≥ alpha)."""
        return self.p_value >= self.alpha

    def inside(self, seed: int) -> bool:
        """True when the seed's B_crit lies within the swept batches (a point estimate, not a bound)."""
        return min(self.batches) <= self.b_crit[seed] <= max(self.batches)

    def interval(self, seed: int, level: float = 0.95) -> tuple[float, float]:
        """The seed's B_crit interval: symmetric in ln B_crit, Student-t with the per-seed fits' n − 2K dof."""
        from scipy import stats

        q = float(stats.t.ppf(0.5 + level / 2.0, max(self.dof_den, 1)))
        half = min(q * self.se_log_b_crit[seed], 700.0)
        return self.b_crit[seed] * math.exp(-half), self.b_crit[seed] * math.exp(half)

    def text(self) -> str:
        """One line: what the test said and how far each seed's S_min was pooled."""
        kept = self.weight_per_seed.values()
        return (f"shared S_min over {len(self.seeds)} seeds: F({self.dof_num},{self.dof_den}) = {self.f_stat:.2f}, "
                f"p = {self.p_value:.3f} ({'not rejected' if self.shared else 'rejected'} at {self.alpha:g}); "
                f"S_min partially pooled: each seed keeps {self.weight:.2f} of its own deviation, limited to "
                f"{self.limit_se:g} SE (kept {min(kept):.2f}–{max(kept):.2f})")

    def as_json(self) -> dict:
        def per(d: Mapping[int, float]) -> dict[str, float]:
            return {str(s): v for s, v in d.items()}

        return {"seeds": self.seeds, "shared": self.shared, "p_value": self.p_value,
                "f_stat": self.f_stat if math.isfinite(self.f_stat) else None,
                "dof": [self.dof_num, self.dof_den], "alpha": self.alpha, "s_min": self.s_min,
                "weight": self.weight, "limit_se": self.limit_se, "weight_per_seed": per(self.weight_per_seed),
                "s_min_per_seed": per(self.s_min_per_seed), "b_crit_per_seed": per(self.b_crit),
                "se_log_b_crit_per_seed": per(self.se_log_b_crit), "b_crit_shared_s_min_per_seed": per(self.b_crit_shared),
                "model": "ln S = ln S_min,seed + ln(1 + B_crit,seed/B); ln S_min,seed moved from its own fit toward one "
                         "shared S_min by 1 − weight, at most limit_se of its own SE", "text": self.text()}


def _js_weight(f_stat: float) -> float:
    """max(0, 1 − 1/F); 1 where F is infinite (exact data that do not share), 0 where F = 0."""
    if not math.isfinite(f_stat):
        return 1.0
    return max(0.0, 1.0 - 1.0 / f_stat) if f_stat > 0 else 0.0


def _unscaled_cov(batches: np.ndarray, ln_b_crit: float) -> np.ndarray:
    """(JᵀJ)⁻¹ of one seed's log-space fit in (ln S_min, ln B_crit) at ``ln_b_crit``."""
    x = math.exp(ln_b_crit) / batches
    j = np.column_stack([np.ones_like(batches), x / (1.0 + x)])
    return np.linalg.pinv(j.T @ j)


def _ln_b_crit_at(batches: np.ndarray, y: np.ndarray, ln_s_min: float, starts: Sequence[float], lo: float,
                  hi: float) -> float:
    """ln B_crit that fits one seed's ln steps ``y`` best with ln S_min held at ``ln_s_min``."""
    from scipy.optimize import least_squares

    best = None
    for t0 in starts:
        r = least_squares(lambda t: ln_s_min + np.log1p(np.exp(t[0]) / batches) - y, [min(max(t0, lo), hi)],
                          bounds=([lo], [hi]), method="trf")
        if best is None or r.cost < best.cost:
            best = r
    return float(best.x[0]) if best is not None else float(starts[0])


def fit_shared_s_min(batches: Sequence[float], steps: Mapping[int, Sequence[float]], *,
                     alpha: float = POOL_ALPHA) -> PooledFit:
    """Fit every seed's steps-to-target at ``batches`` with one S_min and a B_crit per seed, test sharing, and
    refit each seed's B_crit at its partially pooled S_min (the module's docstring).

    ``steps``: seed → steps at each of ``batches`` (every seed at every batch, all > 0). Raises
    :class:`~globalbatch.critical.errors.NoAnswerError` with fewer than 2 seeds or 3 batches (no residual for
    the per-seed fits) or when no start converges.
    """
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
    f_stat, p_value = nested_f_test(sse_sh, scale, k, m)
    s2 = scale / dof_den  # the pooled residual variance of the per-seed fits
    try:
        cov_shared = np.linalg.pinv(best.jac.T @ best.jac)
    except np.linalg.LinAlgError:
        cov_shared = np.full((k + 1, k + 1), np.inf)
    w = _js_weight(f_stat)
    a_shared = float(best.x[0])
    b_crit, se, s_min_s, kept = {}, {}, {}, {}
    for i, s in enumerate(seeds):
        ln_own, th_own = math.log(own[i].s_min), math.log(own[i].b_crit)
        cov_own = _unscaled_cov(b, th_own)
        limit = SHRINK_LIMIT_SE * math.sqrt(max(cov_own[0, 0], 0.0) * s2)
        move = float(np.clip((1.0 - w) * (a_shared - ln_own), -limit, limit))
        th_s = th_own if move == 0.0 else _ln_b_crit_at(b, y[i], ln_own + move, (float(best.x[1 + i]), th_own), lo, hi)
        lam = 1.0 - move / (a_shared - ln_own) if a_shared != ln_own else 1.0
        b_crit[s], s_min_s[s], kept[s] = math.exp(th_s), math.exp(ln_own + move), lam
        se[s] = math.sqrt(max(lam * _unscaled_cov(b, th_s)[1, 1] + (1.0 - lam) * cov_shared[1 + i, 1 + i], 0.0) * s2)
    return PooledFit(seeds=seeds, batches=tuple(float(x) for x in b), s_min=float(math.exp(a_shared)),
                     b_crit=b_crit, se_log_b_crit=se, b_crit_shared={s: float(math.exp(best.x[1 + i]))
                                                                     for i, s in enumerate(seeds)},
                     s_min_per_seed=s_min_s, weight=w, weight_per_seed=kept, sse_shared=sse_sh, sse_own=sse_own,
                     dof_num=dof_num, dof_den=dof_den, f_stat=float(f_stat), p_value=p_value, alpha=alpha)


def seeds_table(batches: Sequence[float], steps: Mapping[float, Mapping[int, Optional[float]]],
                seeds: Sequence[int]) -> Optional[dict[int, list[float]]]:
    """Seed → its steps at each of ``batches`` for the ``seeds`` that reached every batch (one target's steps: batch →
    seed → steps); None when fewer than 2 seeds or 3 batches qualify (a multi-seed fit has no residual)."""
    use = [s for s in seeds if all(steps[bb].get(s) for bb in batches)]
    if len(use) < 2 or len(batches) < 3:
        return None
    return {s: [float(steps[bb][s]) for bb in batches] for s in use}  # type: ignore[arg-type]


def pooled_for_target(batches: Sequence[float], steps: Mapping[float, Mapping[int, Optional[float]]],
                      seeds: Sequence[int], *, alpha: float = POOL_ALPHA) -> Optional[PooledFit]:
    """The partially pooled fit of ``seeds`` (those to pool: monotone) at one target's steps (:func:`seeds_table`);
    None when fewer than 2 seeds or 3 batches qualify, or the fit fails."""
    table = seeds_table(batches, steps, seeds)
    try:
        return None if table is None else fit_shared_s_min(batches, table, alpha=alpha)
    except NoAnswerError:
        return None
