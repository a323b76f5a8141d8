"""Do the seeds' critical batches differ, or only their estimates? The F-test of one B_crit shared by the seeds.

McCandlish et al. 2018 (arXiv 1812.06162, eq. 2.11): to reach a loss, S(B) = S_min·(1 + B_crit/B). Fitted per seed,
B_crit scatters across seeds for two reasons: each seed's fit is noisy (a few batches, tens of per cent of scatter in
steps-to-target), and the seeds' training runs may really differ (an initialisation that plateaus, a data order).
The max/min of the per-seed values mixes both. This module separates them with the extra-sum-of-squares F-test of
nested models (Motulsky & Christopoulos, *Fitting models to biological data using linear and nonlinear regression*,
2004, ch. 22), the same test :mod:`globalbatch.critical.pooled` applies to S_min:

* own: every seed its own S_min and B_crit (2K parameters, SSE_own on n − 2K dof);
* shared B_crit: every seed its own S_min, one B_crit (K + 1 parameters, SSE_shared);
* F = ((SSE_shared − SSE_own)/(K − 1)) / (SSE_own/(n − 2K)), p = P(F_{K−1, n−2K} ≥ F).

A small p says the seeds' B_crit differ beyond what their fits' residual scatter explains: the spread is the
seeds', and no estimator of a per-seed B_crit can make it smaller without hiding it. A large p says the spread is
within the estimates' noise. The shared fit profiles ln B_crit (for a fixed B_crit every seed's ln S_min is its
mean residual, exact in log space) with ``scipy.optimize.minimize_scalar``. The test assumes the log-steps residuals
are independent with one variance across seeds; its size and power were measured on synthetic sweeps with
known B_crit (``benchmarks/critical_seed_spread.py``, held to in ``tests/test_critical_seed_spread.py``;
docs/critical.md). Pure numpy/scipy; no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from globalbatch.critical.errors import NoAnswerError
from globalbatch.errors import SettingError
from globalbatch.critical.fit import nested_f_test
from globalbatch.critical.pooled import seeds_table

__all__ = ["SPREAD_ALPHA", "SeedSpread", "shared_b_crit_f_test", "seed_spread_for_target"]

SPREAD_ALPHA = 0.05
"""Level at which a target states that its seeds' B_crit differ beyond their noise."""


@dataclass(kw_only=True, frozen=True, slots=True)
class SeedSpread:
    """The F-test of one B_crit shared by the seeds at one target."""

    seeds: tuple[int, ...]
    b_crit_shared: float
    """The one B_crit of the shared fit (units per step)."""
    sse: tuple[float, float]
    """Sums of squared log residuals: with one B_crit, and with each seed's own (each seed its own S_min in both)."""
    dof: tuple[int, int]
    """(K − 1, n − 2K)."""
    f_stat: float
    p_value: float
    """P(F ≥ f_stat) under "the seeds share B_crit"."""
    alpha: float = SPREAD_ALPHA

    @property
    def differ(self) -> bool:
        """True when the test rejects one shared B_crit at :attr:`alpha`: the seeds' B_crit really differ."""
        return self.p_value < self.alpha

    def text(self) -> str:
        """One line: the verdict and the test behind it."""
        verdict = ("the seeds' B_crit differ beyond their fits' noise" if self.differ
                   else "the seeds' B_crit spread is within their fits' noise")
        return (f"{verdict}: F({self.dof[0]},{self.dof[1]}) = {self.f_stat:.2f}, p = {self.p_value:.3g} "
                f"(one B_crit for {len(self.seeds)} seeds, each its own S_min; level {self.alpha:g})")

    def as_json(self) -> dict:
        return {"seeds": list(self.seeds), "differ": self.differ, "p_value": self.p_value,
                "f_stat": self.f_stat if math.isfinite(self.f_stat) else None, "dof": list(self.dof),
                "alpha": self.alpha, "b_crit_shared": self.b_crit_shared, "sse_shared": self.sse[0],
                "sse_own": self.sse[1], "text": self.text(),
                "model": "ln S = ln S_min,seed + ln(1 + B_crit/B) against ln S = ln S_min,seed + ln(1 + B_crit,seed/B)"}


def _profile_sse(theta: float, b: np.ndarray, y: np.ndarray) -> float:
    """SSE with one ln B_crit ``theta`` for the rows of ``y`` and each row's ln S_min at its mean residual (exact in
    log space)."""
    r = y - np.log1p(math.exp(theta) / b)[None, :]
    return float(np.sum((r - r.mean(axis=1, keepdims=True)) ** 2))


def _profile_min(grid: np.ndarray, sse: np.ndarray, b: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """The least of ``sse`` (``_profile_sse`` of ``y`` on ``grid``), refined between the grid's neighbours."""
    from scipy.optimize import minimize_scalar

    i = int(np.argmin(sse))
    res = minimize_scalar(_profile_sse, bounds=(grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]), args=(b, y),
                          method="bounded", options={"xatol": 1e-9})
    return (float(res.x), float(res.fun)) if res.fun <= sse[i] else (float(grid[i]), float(sse[i]))


def shared_b_crit_f_test(batches: Sequence[float], steps: Mapping[int, Sequence[float]], *,
                         alpha: float = SPREAD_ALPHA) -> SeedSpread:
    """The F-test of one B_crit shared by the seeds (the module's docstring).

    ``steps``: seed → steps to the target at each of ``batches`` (every seed at every batch, all > 0). Both models
    are fitted by the same profile over ln B_crit (within the batches' range ± 12 in ln), so the nested one cannot
    fit better. Raises :class:`~globalbatch.critical.errors.NoAnswerError` with fewer than 2 seeds or 3 batches (the
    per-seed fits have no residual) or non-finite steps, and :class:`~globalbatch.errors.SettingError` for batches that are
    not finite and > 0, a seed whose steps do not match the batches, or ``alpha`` outside (0, 1)."""
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 < alpha < 1):
        raise SettingError("alpha", alpha, "a level between 0 and 1, e.g. 0.05")
    try:
        b = np.asarray(batches, dtype=float).ravel()
    except (TypeError, ValueError):
        raise SettingError("batches", batches, "batch sizes > 0") from None
    if not (b.size and np.all(np.isfinite(b)) and np.all(b > 0)):
        raise SettingError("batches", list(batches), "finite batch sizes > 0")
    seeds = tuple(sorted(steps, key=str))
    if len(seeds) < 2 or np.unique(b).size < 3:
        raise NoAnswerError(f"shared B_crit: {len(seeds)} seed(s) × {np.unique(b).size} distinct batch(es); needs ≥ 2 "
                            "seeds and ≥ 3 batches")
    try:
        rows = [[float(v) for v in steps[s]] for s in seeds]
    except (TypeError, ValueError):
        raise NoAnswerError("shared B_crit: every seed needs finite steps > 0 at every batch") from None
    if any(len(r) != b.size for r in rows):
        raise SettingError("steps", {s: len(r) for s, r in zip(seeds, rows)}, f"{b.size} steps per seed, one per batch")
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.log(np.array(rows))
    if not np.all(np.isfinite(y)):
        raise NoAnswerError("shared B_crit: every seed needs finite steps > 0 at every batch")
    k, m = y.shape
    grid = np.linspace(math.log(b.min()) - 12.0, math.log(b.max()) + 12.0, 481)
    r = y[None, :, :] - np.log1p(np.exp(grid)[:, None] / b[None, :])[:, None, :]  # grid × seed × batch
    per_seed = np.sum((r - r.mean(axis=2, keepdims=True)) ** 2, axis=2)  # grid × seed
    sse_own = sum(_profile_min(grid, per_seed[:, i], b, y[i:i + 1])[1] for i in range(k))
    theta, sse_sh = _profile_min(grid, per_seed.sum(axis=1), b, y)
    sse_own = min(sse_own, sse_sh)  # a refinement's last digits
    f_stat, p_value = nested_f_test(sse_sh, sse_own, k, m)
    return SeedSpread(seeds=seeds, b_crit_shared=float(math.exp(theta)), sse=(sse_sh, sse_own),
                      dof=(k - 1, k * m - 2 * k), f_stat=f_stat, p_value=p_value, alpha=alpha)


def seed_spread_for_target(batches: Sequence[float], steps: Mapping[float, Mapping[int, Optional[float]]],
                           seeds: Sequence[int], *, alpha: float = SPREAD_ALPHA) -> Optional[SeedSpread]:
    """The test for ``seeds`` (monotone) at one target's steps (batch → seed → steps; the seeds that reached every
    batch, :func:`~globalbatch.critical.pooled.seeds_table`); None when fewer than 2 seeds or 3 batches qualify."""
    table = seeds_table(batches, steps, seeds)
    try:
        return None if table is None else shared_b_crit_f_test(batches, table, alpha=alpha)
    except NoAnswerError:  # a non-finite step count
        return None
