"""The branch test's statistics: the verdict per k at one branch point, and B_crit(L) over several points.

Pure functions of the branch losses (no training; :mod:`globalbatch.lab.branch` runs the branches).
Merrill et al. 2025, "Critical Batch Size Revisited" (arXiv 2505.23971), §3; McCandlish et al. 2018
(arXiv 1812.06162), eq. 2.11, for the half-window tolerance.

The decision: for each k > 1, with d = L_k − L_1 over seeds, a one-sided t-test of H0:
E[d] ≤ tolerance against H1: E[d] > tolerance at ``alpha`` (``paired``, the default,
uses the per-seed differences — valid because each seed's branches saw the same data;
``welch`` the unpaired Welch t-test). k **passes** only when it is not significantly
worse AND its mean difference is within the tolerance (Merrill et al.: the loss stays
within the tolerance of the k = 1 branch); with few seeds the test alone has no power,
so a k whose mean loss is several tolerances worse must not pass just because p ≥
alpha. The critical k is the largest k such that every k' ≤ k passes (the scan stops
at the first failing k). Per k the verdict is ``within tolerance`` (the upper bound is
≤ tolerance: shown not worse), ``inconclusive`` (mean within tolerance, not shown
either way; passes), ``beyond tolerance (not significant)`` (mean difference > tolerance,
p ≥ alpha; fails) or ``worse`` (significant; fails).

B_crit(L): with two or more branch points (``--points K``: K evenly spaced up to the last one) each point gives
B_crit at the loss the k = 1 branches reach at the end of its window (the batch where the mean difference
crosses the tolerance, interpolated in ln k between the critical k and the first failing k), and
:func:`branch_curve` fits the sweep's joint form B_crit(L) = b_ref·(L/L_ref)^k (Kaplan et al. 2020; the
:class:`~globalbatch.critical.seeds.JointFit` of ``critical/seeds.py``) over the points, with the hull of its
covariance interval and a bootstrap over the branch seeds. A point where every k passed is a lower bound and
stays out of the fit.

The half-window tolerance (``tolerance_rule="half_window"``): McCandlish et al. 2018 (arXiv 1812.06162, eq. 2.11)
write the examples to a loss at batch B as E = E_min·(1 + B/B_crit). Over a window of W examples from one
checkpoint a branch at batch b therefore makes the progress of W·(1 + B/B_crit)/(1 + b/B_crit) small-batch
examples; at b = B_crit + 2B that is W/2. So the branch at B_crit ends where the k = 1 branch stood half-way
through its window, and its loss difference is the k = 1 branch's drop over the window's second half. With
that drop (mean over seeds, measured on the k = 1 branches' validation loss half-way) as the tolerance at each
point, the largest k·B that passes reads McCandlish's B_crit (to the k grid), where Merrill's fixed 0.01 reads a
batch that depends on the window and on how fast the loss falls there. It assumes B_crit roughly constant over
the window; on a convex loss curve the second half drops less than the first, so it errs towards a larger
batch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import numpy as np

from globalbatch._util import SettingError
from globalbatch.errors import Raw

__all__ = ["KVerdict", "Verdicts", "CurvePoint", "BranchCurve", "branch_verdicts", "branch_curve",
           "evenly_spaced_points", "TESTS"]

TESTS = ("paired", "welch")


# ---------------------------------------------------------------------------
# The statistics (pure)
# ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class KVerdict:
    k: int
    mean: float
    std: float
    n: int
    diff: float
    """mean(L_k) − mean(L_1)."""
    upper: float
    """One-sided (1 − alpha) upper confidence bound of E[L_k − L_1]."""
    t: float
    p_value: float
    """One-sided p-value of H0: E[L_k − L_1] ≤ tolerance."""
    worse: bool
    """H0 rejected at alpha: k is worse than k = 1 by more than the tolerance."""
    passes: bool
    """Not significantly worse AND mean difference ≤ tolerance (k = 1: True)."""
    status: str
    """``reference`` (k = 1), ``worse`` (significant), ``beyond tolerance (not significant)``
    (diff > tolerance, p ≥ alpha: fails), ``within tolerance`` (upper bound ≤ tolerance:
    shown not worse) or ``inconclusive`` (diff ≤ tolerance, not shown either way: passes)."""


@dataclass(kw_only=True)
class Verdicts:
    per_k: list[KVerdict]
    critical_k: int
    """Largest k such that every k' ≤ k passes (not significantly worse and mean diff ≤ tolerance)."""
    critical_k_shown: int
    """Largest k such that every k' ≤ k is *shown* within tolerance (conservative; 1 if none)."""


def branch_verdicts(
    losses: dict[int, Sequence[float]], *, tolerance: float = 0.01, alpha: float = 0.05, test: str = "paired"
) -> Verdicts:
    """Per-k one-sided t-tests against k = 1 and the critical k.

    Args:
        losses: k → final losses, one per seed (index i = seed i for every k when paired).
        tolerance: allowed loss increase over k = 1.
        alpha: significance level of each one-sided test.
        test: ``"paired"`` (per-seed differences, df = n − 1) or ``"welch"`` (unequal
            variances, Welch–Satterthwaite df).
    """
    from scipy import stats

    if 1 not in losses:
        raise SettingError("losses", Raw(f"keys {sorted(losses)}"), "k → final losses with k = 1 among the keys")
    if test not in TESTS:
        raise SettingError("test", test, ", ".join(TESTS))
    ref = np.asarray(losses[1], dtype=float)
    out = []
    for k in sorted(losses):
        x = np.asarray(losses[k], dtype=float)
        if x.size < 2 or ref.size < 2:
            raise SettingError("losses", Raw(f"{min(x.size, ref.size)} value(s) at k = {k if x.size < 2 else 1}"),
                               "at least 2 seeds at every k (a t-test)")
        diff = float(x.mean() - ref.mean())
        if k == 1:
            out.append(KVerdict(k=1, mean=float(x.mean()), std=float(x.std(ddof=1)), n=x.size, diff=0.0, upper=0.0,
                                t=math.nan, p_value=math.nan, worse=False, passes=True, status="reference"))
            continue
        if test == "paired":
            if x.size != ref.size:
                raise SettingError("losses", Raw(f"{x.size} values at k = {k}, {ref.size} at k = 1"),
                                   "as many seeds at every k as at k = 1 (a paired test)")
            d = x - ref
            se = float(d.std(ddof=1) / math.sqrt(d.size))
            df = d.size - 1
        else:
            vx, vr = x.var(ddof=1) / x.size, ref.var(ddof=1) / ref.size
            se = float(math.sqrt(vx + vr))
            df = (vx + vr) ** 2 / (vx ** 2 / (x.size - 1) + vr ** 2 / (ref.size - 1)) if se > 0 else 1.0
        if se == 0.0:  # no spread at all: the sign decides
            t = math.inf if diff > tolerance else -math.inf
            p = 0.0 if diff > tolerance else 1.0
            upper = diff
        else:
            t = (diff - tolerance) / se
            p = float(stats.t.sf(t, df))
            upper = diff + float(stats.t.ppf(1.0 - alpha, df)) * se
        worse = bool(p < alpha)
        if worse:
            status = "worse"
        elif diff > tolerance:
            status = "beyond tolerance (not significant)"
        else:
            status = "within tolerance" if upper <= tolerance else "inconclusive"
        out.append(KVerdict(k=k, mean=float(x.mean()), std=float(x.std(ddof=1)), n=x.size, diff=diff, upper=upper,
                            t=float(t), p_value=p, worse=worse, passes=not worse and diff <= tolerance, status=status))
    critical = shown = 1
    for v in out:
        if not v.passes:
            break
        critical = v.k
    for v in out:
        if v.status not in ("reference", "within tolerance"):
            break
        shown = v.k
    return Verdicts(per_k=out, critical_k=critical, critical_k_shown=shown)


# ---------------------------------------------------------------------------
# B_crit(L) over several branch points (pure)
# ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class CurvePoint:
    """One branch point on the B_crit(L) curve."""

    branch_at: int
    loss: float
    """The loss the k = 1 branches reach at the end of the window (mean over seeds, the compared metric): the
    target every k·B branch is compared at."""
    critical_k: int
    b_crit_units: float
    """The batch, in units (tokens) per step, where the mean loss difference crosses the tolerance: interpolated
    in ln k between the critical k and the first failing k (the grid answer is critical_k × base batch); with the
    half-window rule less 2 base batches (McCandlish's B_crit, module docstring)."""
    censored: bool
    """Left out of the fit: ``bound`` says which way."""
    bound: str = ""
    """``≥``: every k passed (B_crit is at least the largest k·B); ``<``: below the grid's resolution (the
    half-window rule's B_crit under the base batch); empty: a point estimate."""


@dataclass(kw_only=True)
class BranchCurve:
    """B_crit(L) from the branch test at several points of one base run, fitted in the sweep's joint form
    B_crit(L) = b_ref·(L/L_ref)^k (:class:`globalbatch.critical.seeds.JointFit`)."""

    points: list[CurvePoint]
    fit: Optional[Any]
    """The :class:`~globalbatch.critical.seeds.JointFit` (``boot_*``: the same fit on seed resamples); None with
    ``note`` when fewer than 2 uncensored points with distinct losses."""
    unit: str
    note: str = ""

    def to_dict(self) -> dict:
        return {"points": [asdict(p) for p in self.points], "unit": self.unit, "note": self.note,
                "fit": None if self.fit is None else {
                    **asdict(self.fit), "interval_95": {f"{p.loss:.6g}": list(self.fit.interval(p.loss))
                                                        for p in self.points}}}

    def text(self) -> str:
        pts = "; ".join(f"{p.loss:.4f}: {p.bound + ' ' if p.bound else ''}{p.b_crit_units:,.0f}" for p in self.points)
        lines = [f"B_crit(L) over {len(self.points)} branch points (loss reached by k = 1: B_crit in {self.unit}s): {pts}"]
        f = self.fit
        if f is None:
            lines.append(f"  no fit: {self.note}")
            return "\n".join(lines)
        lo, hi = f.interval(f.loss_ref)
        lines.append(f"  fit B_crit(L) = {f.b_ref:,.0f}·(L/{f.loss_ref:.4f})^{f.k:.2f} (SE of k {f.se_k:.2f}; "
                     f"95% interval at L_ref {lo:,.0f}–{hi:,.0f}, covariance and a bootstrap over the branch seeds; "
                     f"{f.n_points} points, {f.dof} dof)" + (f"; {self.note}" if self.note else ""))
        return "\n".join(lines)


def _curve_fit(losses: Sequence[float], b_crits: Sequence[float], boot: Sequence[tuple[Sequence[float], Sequence[float]]]):
    """ln B = ln b_ref + k·ln(L/L_ref) by least squares: the joint fit's form with one B_crit per loss."""
    from globalbatch.critical.seeds import JointFit

    x_loss, y = np.log(np.asarray(losses, dtype=float)), np.log(np.asarray(b_crits, dtype=float))
    loss_ref = float(np.exp(x_loss.mean()))
    X = np.column_stack([np.ones_like(x_loss), x_loss - math.log(loss_ref)])
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ beta
    dof = len(y) - 2
    sigma2 = float(resid @ resid) / dof if dof > 0 else 0.0
    cov = np.linalg.pinv(X.T @ X) * sigma2
    fit = JointFit(b_ref=float(math.exp(beta[0])), loss_ref=loss_ref, k=float(beta[1]),
                   se_log_b_ref=float(math.sqrt(max(cov[0, 0], 0.0))), se_k=float(math.sqrt(max(cov[1, 1], 0.0))),
                   cov=[[float(v) for v in row] for row in cov], n_points=len(y), dof=dof,
                   residual_std_log=math.sqrt(sigma2))
    for bl, bb in boot:
        xb = np.log(np.asarray(bl, dtype=float)) - math.log(loss_ref)
        if np.ptp(xb) <= 0:
            continue
        kb, ab = np.polyfit(xb, np.log(np.asarray(bb, dtype=float)), 1)
        fit.boot_log_b_ref.append(float(ab))
        fit.boot_k.append(float(kb))
    return fit


def evenly_spaced_points(branch_at: Sequence[int], points: int) -> list[int]:
    """``--points K``: K branch points evenly spaced up to the one last point (``last·i/K``, i = 1…K).

    Raises:
        SettingError: ``points`` not a whole number in 2…64, or ``branch_at`` already a list of several points.
    """
    from globalbatch.validate import whole

    whole(points, "points", minimum=2, maximum=64, allowed="a whole number of branch points, 2 to 64")
    if len(branch_at) != 1:
        raise SettingError("points", points, "one last branch point to space the points up to",
                           why=f"{len(branch_at)} branch points were given; give one, or the list without points")
    last = int(branch_at[0])
    out = sorted({round(last * i / points) for i in range(1, points + 1)})
    if len(out) < points or out[0] < 1:
        raise SettingError("points", points, f"at most {last} points up to {last:,} units")
    return out


def _crossing(v: Verdicts, tolerance: float, base_batch_units: float, half_window: bool) -> tuple[float, str]:
    """(B_crit in units, bound) at one point: the batch where the mean difference crosses the tolerance,
    interpolated in ln k between the critical k (which passed: diff ≤ tolerance) and the next k (which failed:
    a failing k always has diff > tolerance); ``≥`` the largest k when every k passed."""
    ks = [x.k for x in v.per_k]
    i = ks.index(v.critical_k)
    if i == len(ks) - 1:
        return v.critical_k * base_batch_units, "≥"
    a, b = v.per_k[i], v.per_k[i + 1]
    t = min(max((tolerance - a.diff) / (b.diff - a.diff), 0.0), 1.0) if b.diff > a.diff else 0.0
    k_star = math.exp(math.log(a.k) + t * (math.log(b.k) - math.log(a.k)))
    if not half_window:
        return k_star * base_batch_units, ""
    value = (k_star - 2.0) * base_batch_units  # the branch at B_crit + 2B ends where k = 1 stood half-way
    return (value, "") if value > 0.5 * base_batch_units else (base_batch_units, "<")


def branch_curve(losses_by_point: dict[int, dict[int, Sequence[float]]], *, base_batch_units: float,
                 tolerance: float = 0.01, alpha: float = 0.05, test: str = "paired", unit: str = "token",
                 n_boot: int = 200, rng_seed: int = 0,
                 drops_by_point: Optional[dict[int, Sequence[float]]] = None) -> BranchCurve:
    """B_crit(L) from branch points: per point the critical k (:func:`branch_verdicts`) at the loss the k = 1
    branches reach, then the joint form B_crit(L) = b_ref·(L/L_ref)^k fitted over the points.

    A point whose critical k is the largest k tried is a lower bound and stays out of the fit. The
    uncertainty is the hull (``JointFit.interval``) of the fit's covariance and a bootstrap that resamples
    each point's seeds (the same seed indices for every k: the test is paired) and decides again.

    Args:
        losses_by_point: branch point → k → final losses, one per seed.
        base_batch_units: the base batch in units (tokens) per step; B_crit = critical k × this.
        drops_by_point: the half-window rule: point → per seed, the k = 1 branch's loss drop over the second half
            of its window; the tolerance at a point is their mean (≥ 0), in the bootstrap that of the seeds drawn.
    """
    def tol(p: int, idx: Any = None) -> float:
        if drops_by_point is None:
            return tolerance
        d = np.asarray(drops_by_point[p], dtype=float)
        return max(float((d if idx is None else d[idx]).mean()), 0.0)

    pts = sorted(losses_by_point)
    points = []
    half = drops_by_point is not None
    for p in pts:
        v = branch_verdicts(losses_by_point[p], tolerance=tol(p), alpha=alpha, test=test)
        value, bound = _crossing(v, tol(p), base_batch_units, half)
        points.append(CurvePoint(branch_at=p, loss=v.per_k[0].mean, critical_k=v.critical_k, b_crit_units=value,
                                 censored=bool(bound), bound=bound))
    used = [q for q in points if not q.censored and math.isfinite(q.loss)]
    left_out = len(points) - len(used)
    note = f"{left_out} point(s) left out (bounds: every k passed, or below the base batch)" if left_out else ""
    if len({q.loss for q in used}) < 2:
        return BranchCurve(points=points, fit=None, unit=unit,
                           note=(note + "; " if note else "") + "fewer than 2 points with a B_crit below the largest k")
    rng = np.random.default_rng(rng_seed)
    boot = []
    for _ in range(n_boot):
        bl, bb = [], []
        for q in used:
            losses = losses_by_point[q.branch_at]
            n = len(losses[1])
            idx = rng.integers(0, n, n)
            t_b = tol(q.branch_at, idx)
            v = branch_verdicts({k: np.asarray(x, dtype=float)[idx].tolist() for k, x in losses.items()},
                                tolerance=t_b, alpha=alpha, test=test)
            bl.append(v.per_k[0].mean)
            bb.append(_crossing(v, t_b, base_batch_units, half)[0])
        boot.append((bl, bb))
    return BranchCurve(points=points, fit=_curve_fit([q.loss for q in used], [q.b_crit_units for q in used], boot),
                       unit=unit, note=note)
