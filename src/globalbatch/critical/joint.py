"""One fit of B_crit(L) across targets and seeds (Kaplan et al. 2020: B_crit as a power law of the loss).

McCandlish et al. 2018 (arXiv 1812.06162) show B_crit growing as the loss falls (their fig. 7);
Kaplan et al. 2020 ("Scaling Laws for Neural Language Models", arXiv 2001.08361, eq. 1.4) write that
dependence as B_crit(L) = B*/L^(1/α_B). :func:`fit_joint` fits, over every target and seed,
log S = a_t + log(1 + B_crit(L_t)/B) with B_crit(L) = B_ref·(L/L_ref)^k (``scipy.optimize.least_squares``),
with the SE from the residual-scaled covariance and a bootstrap over seeds (the seed-to-seed spread,
which the covariance alone does not see). α_B = −1/k in Kaplan's notation. Pure numpy/scipy; no torch.

:func:`joint_flags` says when the fit is not the answer: a **lack of fit** when its 95 % band excludes the
per-target medians over seeds at more targets than a 5 % miss rate explains (a one-sided binomial test,
P(≥ misses of n) < 5 %: 2 or more of 5 targets), and a **sign** flag when the exponent says B_crit falls as the
loss falls (k ≥ 2 SE above 0) or leaves the sign undetermined (|k| < 2 SE). A flagged fit is a comparison, never
the answer: the per-target medians are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from globalbatch.critical.errors import NoAnswerError
from globalbatch.critical.seed_targets import N_BOOT, bootstrap_rng

__all__ = ["JointFit", "fit_joint", "joint_flags", "outside_band", "LACK_OF_FIT_P"]

LACK_OF_FIT_P = 0.05
"""A lack of fit is flagged when P(≥ the observed misses | each target missed with probability 5 %) is below this."""


@dataclass(kw_only=True)
class JointFit:
    """log S = a_t + log(1 + B_crit(L_t)/B), B_crit(L) = b_ref·(L/loss_ref)^k, over every target and seed."""

    b_ref: float
    """B_crit at ``loss_ref``."""
    loss_ref: float
    """Reference loss: the geometric mean of the targets."""
    k: float
    """d ln B_crit / d ln L (negative: B_crit rises as the loss falls). Kaplan's α_B = −1/k."""
    se_log_b_ref: float
    se_k: float
    cov: list[list[float]]
    """Covariance of (ln b_ref, k)."""
    n_points: int
    dof: int
    residual_std_log: float
    boot_log_b_ref: list[float] = field(default_factory=list)
    boot_k: list[float] = field(default_factory=list)
    """The same fit on bootstrap resamples of the seeds."""

    @property
    def alpha_b(self) -> float:
        return -1.0 / self.k if self.k != 0 else math.inf

    def b_crit(self, loss: float) -> float:
        return self.b_ref * (loss / self.loss_ref) ** self.k

    def se_log_b_crit(self, loss: float) -> float:
        g = np.array([1.0, math.log(loss / self.loss_ref)])
        return float(math.sqrt(max(g @ np.asarray(self.cov) @ g, 0.0)))

    def interval(self, loss: float, level: float = 0.95) -> tuple[float, float]:
        """Hull of the covariance interval and the seed-bootstrap percentiles of B_crit(loss)."""
        from scipy import stats

        q = float(stats.t.ppf(0.5 + level / 2, max(self.dof, 1)))
        c = self.b_crit(loss)
        half = min(q * self.se_log_b_crit(loss), 700.0)
        lo, hi = c * math.exp(-half), c * math.exp(half)
        if self.boot_k:
            x = math.log(loss / self.loss_ref)
            boot = np.exp(np.asarray(self.boot_log_b_ref) + np.asarray(self.boot_k) * x)
            a = (1 - level) / 2 * 100
            lo, hi = min(lo, float(np.percentile(boot, a))), max(hi, float(np.percentile(boot, 100 - a)))
        return lo, hi


def _joint_once(rows: list[tuple[int, float, float, float]], targets: list[float], loss_ref: float):
    from scipy.optimize import least_squares

    t_idx = np.array([r[0] for r in rows])
    b = np.array([r[1] for r in rows])
    y = np.log(np.array([r[2] for r in rows]))
    x = np.log(np.array([targets[i] for i in t_idx]) / loss_ref)
    nt = len(targets)
    lb0 = math.log(float(np.median(b)))

    def resid(p):
        return p[t_idx] + np.log1p(np.exp(p[nt] + p[nt + 1] * x) / b) - y

    best = None
    for start in (lb0 - 2, lb0, lb0 + 2):
        p0 = np.zeros(nt + 2)
        p0[nt], p0[nt + 1] = start, -2.0
        for i in range(nt):
            sel = t_idx == i
            p0[i] = float(np.mean(y[sel] - np.log1p(math.exp(start) / b[sel]))) if sel.any() else 0.0
        try:
            r = least_squares(resid, p0, method="trf", x_scale="jac", max_nfev=4000)
        except (ValueError, np.linalg.LinAlgError):
            continue
        if best is None or r.cost < best.cost:
            best = r
    return best


def fit_joint(points: Sequence[tuple[float, int, float, float]], *, n_boot: int = N_BOOT, rng_seed: int = 0) -> JointFit:
    """Fit B_crit(L) jointly over ``(target, seed, batch, steps)`` points (one per monotone cell × batch)."""
    targets = sorted({p[0] for p in points})
    if len(targets) < 2:
        raise NoAnswerError(f"targets: {len(targets)}: the joint fit needs at least 2 targets")
    index = {t: i for i, t in enumerate(targets)}
    rows = [(index[t], b, s, seed) for t, seed, b, s in points]
    if len(rows) < len(targets) + 3:
        raise NoAnswerError(f"points: {len(rows)}: too few for {len(targets) + 2} parameters and a residual")
    loss_ref = float(np.exp(np.mean(np.log(targets))))
    r = _joint_once([(i, b, s, 0) for i, b, s, _ in rows], targets, loss_ref)
    if r is None:
        raise NoAnswerError("fit: least_squares did not converge")
    nt = len(targets)
    dof = len(rows) - (nt + 2)
    sse = float(np.sum(r.fun ** 2))
    try:
        cov = np.linalg.pinv(r.jac.T @ r.jac) * (sse / max(dof, 1))
    except np.linalg.LinAlgError:
        cov = np.full((nt + 2, nt + 2), np.inf)
    sub = cov[np.ix_([nt, nt + 1], [nt, nt + 1])]
    fit = JointFit(b_ref=float(math.exp(r.x[nt])), loss_ref=loss_ref, k=float(r.x[nt + 1]),
                   se_log_b_ref=float(math.sqrt(max(sub[0, 0], 0.0))), se_k=float(math.sqrt(max(sub[1, 1], 0.0))),
                   cov=[[float(v) for v in row] for row in sub], n_points=len(rows), dof=dof,
                   residual_std_log=math.sqrt(sse / dof) if dof > 0 else 0.0)
    seeds = sorted({row[3] for row in rows})
    if len(seeds) >= 2 and n_boot > 0:
        gen = bootstrap_rng(rng_seed)
        cache: dict[tuple, Optional[tuple[float, float]]] = {}  # least squares depends only on the multiset drawn
        for _ in range(n_boot):
            draw = tuple(sorted(int(x) for x in gen.choice(seeds, size=len(seeds), replace=True)))
            if draw not in cache:
                boot_rows: list[tuple[int, float, float, float]] = [(i, b, s, 0) for d in draw for i, b, s, seed in rows
                                                                    if seed == d]
                rb = _joint_once(boot_rows, targets, loss_ref) if len(set(draw)) > 0 else None
                cache[draw] = None if rb is None else (float(rb.x[nt]), float(rb.x[nt + 1]))
            pair = cache[draw]
            if pair is not None:
                fit.boot_log_b_ref.append(pair[0])
                fit.boot_k.append(pair[1])
    return fit


def outside_band(value: Optional[float], band: Optional[tuple[float, float]]) -> bool:
    """A per-target median outside the joint fit's band (False when either is missing)."""
    return value is not None and band is not None and not band[0] <= value <= band[1]


def joint_flags(fit: JointFit, medians: Sequence[tuple[float, Optional[float]]], level: float = 0.95) -> list[str]:
    """Why ``fit`` is not the answer (empty: it may stand as the trend). ``medians``: (target, median B_crit over
    seeds or None) per target. The rules: the module's docstring."""
    from scipy import stats

    flags = []
    misses = [t for t, m in medians if outside_band(m, fit.interval(t, level))]
    n = sum(m is not None for _, m in medians)
    if misses and n:
        p = float(stats.binom.sf(len(misses) - 1, n, 1 - level))
        if p < LACK_OF_FIT_P:
            flags.append(f"lack of fit: the joint fit's {level:.0%} band excludes the median over seeds at "
                         f"{len(misses)} of {n} targets ({', '.join(f'{t:.4f}' for t in sorted(misses, reverse=True))}); "
                         f"a {1 - level:.0%} miss rate explains that with P = {p:.1%} (< {LACK_OF_FIT_P:.0%})")
    if not abs(fit.k) >= 2 * fit.se_k:
        flags.append(f"sign undetermined: exponent k = {fit.k:.2f} with SE {fit.se_k:.2f} (|k| < 2 SE): the fit cannot "
                     "say whether B_crit rises or falls as the loss falls")
    elif fit.k > 0:
        flags.append(f"B_crit falls as the loss falls: exponent k = {fit.k:.2f} with SE {fit.se_k:.2f} (k > 2 SE), "
                     "against the rise McCandlish et al. and Kaplan et al. measured")
    return flags
