"""The branch test: measure the critical batch directly from checkpoints of one small-batch run.

Merrill et al. 2025, "Critical Batch Size Revisited: A Simple Empirical Approach to
Large-Batch Language Model Training" (AI2, arXiv 2505.23971), §3: from a checkpoint of a
run at a small batch B, branch short runs at k·B with the learning rate scaled by √k
(Adam; × k for SGD), train every branch on the same number of tokens, and compare the
smoothed losses. The critical batch at that checkpoint is the largest k·B whose loss
stays within a tolerance (they used 0.01) of the k = 1 branch. They found it far above
the gradient noise scale for Adam, and growing from near 0 to a plateau during training.

Here every branch point (``branch_at``, units trained by the base run, after the base
run's LR warmup) gets ``seeds`` branches per k. Seed s fixes the order of the data the
branch sees after the checkpoint, the same for every k. The window is counted in
samples: ``window`` units are converted with the base run's measured units per sample
and rounded **up** to a multiple of max(ks)·base_batch samples, so every k-branch takes a
whole number of steps, all branches of a seed train on exactly the same samples and stop
at the same sample (the k-branch consumes the 1-branch's samples k steps' worth at a
time). The rounded window is stated in the output.

The loss compared is, by default, the validation loss at the end of the window on a
fixed set of held-out samples (``metric="val"``): every branch is scored at its final
parameters on the same data. ``metric="train"`` (the token-weighted training loss of
the steps in the last quarter of the window) is kept as an option but is **biased
against large k**: each step's loss is measured before its update, so a k-branch's
tail losses are taken at parameters that are up to one (k times larger) step staler.

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

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from globalbatch._util import SettingError, atomic_write_json, read_json_checked
from globalbatch.errors import Raw
from globalbatch.lab.tasks import load_task_checked
from globalbatch.lab.device import PRECISIONS, check_device
from globalbatch.lab.loop import default_micro_batch
from globalbatch.lab.rundir import check_manifest, known_fields, lock_run_dir
from globalbatch.validate import make_out_dir, whole
from globalbatch.validate import out_dir as out_dir_checked
from globalbatch.optim import lr_scaling_rule, optimizer_names

__all__ = ["BranchConfig", "KVerdict", "Verdicts", "PointResult", "BranchResult", "CurvePoint", "BranchCurve",
           "branch_verdicts", "branch_curve", "evenly_spaced_points", "run_branch_test", "load_branch_results"]

METRICS = ("val", "train")
TOLERANCE_RULES = ("absolute", "half_window")
SECOND_MOMENTS = ("keep", "scaled")
TESTS = ("paired", "welch")
MANIFEST_VERSION = 3  # 2: the window in samples, rounded up to max(ks)·base_batch; 3: device, precision, registry optimizers


@dataclass(kw_only=True)
class BranchConfig:
    """One base run and its branches; everything here is in ``manifest.json``."""

    task: str = "tinygpt"
    task_overrides: dict[str, Any] = field(default_factory=dict)
    base_batch: int = 16
    """Global batch of the base run, in samples (sequences) per step."""
    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """Batch multipliers; must include 1 (the reference branch)."""
    lr: float = 1e-3
    """Peak LR of the base run at ``base_batch``; a k-branch scales it by the optimizer's rule (√k for adamw, k for sgd)."""
    optimizer: str = "adamw"
    """A name in the optimizer registry (:mod:`globalbatch.optim`)."""
    branch_at: list[int]
    """Units (tokens or samples) the base run has trained at each branch point."""
    window: int
    """Units every branch trains after its branch point."""
    window_fraction: Optional[float] = None
    """Instead of ``window``: each point's window is this fraction of that point's units (rounded up the same
    way), so early points get short windows and late ones long (B_crit is read locally at every point)."""
    seeds: int = 3
    """Branches per (point, k), each with its own data order; at least 2 for the test."""
    seed: int = 0
    """Seed of the model initialisation and the base run's data order."""
    micro_batch: Optional[int] = None
    """Samples per forward/backward; None: min(batch, 16)."""
    base_warmup_fraction: float = 0.05
    """The base run warms its LR up linearly over this fraction of the last branch point."""
    tolerance: float = 0.01
    """Loss (per unit) a k-branch may lose against k = 1 before it counts as worse (Merrill: 0.01)."""
    tolerance_rule: str = "absolute"
    """``absolute``: ``tolerance`` at every point (Merrill et al.). ``half_window``: at each point the loss the
    k = 1 branches drop over the second half of the window (mean over seeds) — the loss a branch at
    McCandlish et al.'s B_crit gives up (it needs twice the examples), so the critical k·B reads B_crit
    (module docstring); needs ``metric="val"``."""
    alpha: float = 0.05
    metric: str = "val"
    test: str = "paired"
    max_val_samples: int = 256
    max_grad_norm: Optional[float] = 1.0
    device: str = "cpu"
    """``cpu``, ``cuda``, ``cuda:N`` or ``mps``; in the manifest."""
    precision: str = "fp32"
    """``fp32``, ``bf16`` or ``fp16``; in the manifest."""
    second_moment: str = "keep"
    """The base run's Adam second moments at a k-branch: ``keep`` them (the checkpoint as it is), or ``scaled``:
    divided by k, the noise-dominated limit E[g²] ≈ tr Σ / batch (a diagnostic: a large-k branch otherwise starts
    with the small batch's larger ``exp_avg_sq``, which shrinks its first ≈ 1/(1 − β₂) steps)."""

    def __post_init__(self) -> None:
        self.ks = sorted(int(k) for k in self.ks)
        self.branch_at = sorted(int(x) for x in self.branch_at)
        E = SettingError
        if not 0.0 <= self.base_warmup_fraction < 1.0:
            raise E("base_warmup_fraction", self.base_warmup_fraction, "0 ≤ base_warmup_fraction < 1")
        if 1 not in self.ks or any(k < 1 for k in self.ks) or len(set(self.ks)) != len(self.ks) or len(self.ks) < 2:
            raise E("ks", self.ks, "distinct whole numbers ≥ 1 including 1 (the reference branch) and at least one k > 1, "
                    "e.g. 1,2,4,8")
        if self.base_batch < 1:
            raise E("base_batch", self.base_batch, "a whole number ≥ 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise E("lr", self.lr, "a finite number > 0")
        if self.optimizer not in optimizer_names():
            raise E("optimizer", self.optimizer, ", ".join(f"{n} (LR × {'√k' if lr_scaling_rule(n) == 'sqrt' else 'k'})"
                                                           for n in optimizer_names()))
        if self.precision not in PRECISIONS:
            raise E("precision", self.precision, ", ".join(PRECISIONS))
        if not self.branch_at or self.branch_at[0] < 1:
            raise E("branch_at", self.branch_at, "one or more branch points ≥ 1 unit")
        if self.window < 1:
            raise E("window", self.window, "a whole number of units ≥ 1")
        if self.window_fraction is not None and not (0 < self.window_fraction <= 100 and math.isfinite(self.window_fraction)):
            raise E("window_fraction", self.window_fraction, "a fraction of each branch point's units, 0 < f ≤ 100")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise E("micro_batch", self.micro_batch, "a whole number ≥ 1")
        warm = self.base_warmup_units()
        early = [p for p in self.branch_at if p < warm]
        if early:
            raise E("branch_at", early, "branch points after the base run's LR warmup (branches train at the constant "
                    "peak LR × multiplier)",
                    why=f"inside the warmup: the first {warm:,} units = base_warmup_fraction {self.base_warmup_fraction} "
                        f"× the last branch point {self.branch_at[-1]:,}")
        if self.seeds < 2:
            raise E("seeds", self.seeds, "a whole number ≥ 2 (the test needs two seeds per k)")
        if not self.tolerance >= 0 or not math.isfinite(self.tolerance):
            raise E("tolerance", self.tolerance, "a loss difference ≥ 0 (Merrill et al.: 0.01)")
        if not 0 < self.alpha < 1:
            raise E("alpha", self.alpha, "0 < alpha < 1 (e.g. 0.05)")
        if self.metric not in METRICS:
            raise E("metric", self.metric, ", ".join(METRICS))
        if self.tolerance_rule not in TOLERANCE_RULES:
            raise E("tolerance_rule", self.tolerance_rule, ", ".join(TOLERANCE_RULES))
        if self.tolerance_rule == "half_window" and self.metric != "val":
            raise E("tolerance_rule", self.tolerance_rule, "absolute with metric train",
                    why="the half-window rule reads the k = 1 branches' validation loss half-way through the window")
        if self.test not in TESTS:
            raise E("test", self.test, ", ".join(TESTS))
        if self.second_moment not in SECOND_MOMENTS:
            raise E("second_moment", self.second_moment, ", ".join(SECOND_MOMENTS))

    def base_warmup_units(self) -> int:
        """Units over which the base run warms its LR up (branch points must not be earlier)."""
        return int(self.base_warmup_fraction * self.branch_at[-1]) if self.branch_at else 0

    def window_samples(self, units_per_sample: float, point: Optional[int] = None) -> int:
        """The window in samples: ``window`` units (or ``window_fraction`` × ``point``) rounded up to a multiple of
        max(ks)·base_batch."""
        quantum = max(self.ks) * self.base_batch
        units = self.window if self.window_fraction is None or point is None else self.window_fraction * point
        samples = math.ceil(units / max(float(units_per_sample), 1e-12) - 1e-9)
        return max(1, math.ceil(samples / quantum)) * quantum

    def lr_for(self, k: int) -> float:
        """The branch LR: √k scaling for Adam-type optimizers, linear for SGD."""
        from globalbatch.plan import scale_lr

        return float(scale_lr(self.lr, self.base_batch, k * self.base_batch, lr_scaling_rule(self.optimizer)))

    def micro_batch_for(self, batch: int) -> int:
        return default_micro_batch(batch, self.micro_batch)

    def manifest(self) -> dict[str, Any]:
        d = asdict(self)
        # The decision settings do not change any run: they may differ on a rerun.
        for key in ("tolerance", "tolerance_rule", "alpha", "metric", "test"):
            d.pop(key)
        if d["window_fraction"] is None:  # as before it existed: older directories stay resumable
            d.pop("window_fraction")
        if d["second_moment"] == "keep":
            d.pop("second_moment")
        return {"version": MANIFEST_VERSION, "branch": d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BranchConfig":
        return cls(**known_fields(cls, d))


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


# ---------------------------------------------------------------------------
# Running the base run and the branches
# ---------------------------------------------------------------------------


def _train(exp, order, batch: int, until_units: Optional[int] = None, n_steps: Optional[int] = None,
           tail_from_step: Optional[int] = None, after_step: Optional[Any] = None) -> tuple[float, float, list[int]]:
    """Train ``exp`` (a :class:`globalbatch.lab.loop.Experiment`) until ``trained_units >= until_units`` (the
    base run) or for exactly ``n_steps`` windows of ``batch`` samples (a branch); returns (token-weighted
    training loss of the windows from index ``tail_from_step`` on, seconds, the sample ids drawn)."""

    tail_loss = tail_units = 0.0
    drawn: list[int] = []
    t0 = time.perf_counter()
    i_step = 0
    driver = exp.driver
    while (driver.trained_units < until_units) if n_steps is None else (i_step < n_steps):
        w = exp.train_window(order, batch)
        drawn.extend(w.drawn)
        res = w.result
        if tail_from_step is not None and i_step >= tail_from_step and not res.skipped:
            tail_loss += res.loss_per_unit * res.global_units
            tail_units += res.global_units
        i_step += 1
        if after_step is not None:  # an evaluation: its seconds are not training
            t_eval = time.perf_counter()
            after_step(i_step)
            t0 += time.perf_counter() - t_eval
    return (tail_loss / tail_units if tail_units else math.nan), time.perf_counter() - t0, drawn


@dataclass(kw_only=True)
class PointResult:
    branch_at: int
    verdicts: list[KVerdict]
    critical_k: int
    """Largest k not significantly worse than k = 1 (every smaller k too)."""
    critical_k_shown: int
    """Largest k *shown* within tolerance (every smaller k too); ≤ critical_k."""
    critical_batch: int
    """critical_k × base_batch, in samples per step."""
    critical_batch_units: float
    """The same in units (tokens) per step, from the measured mean units per sample."""
    tolerance: float = math.nan
    """The tolerance the decision used here (``tolerance``, or the half-window rule's drop)."""


@dataclass(kw_only=True)
class BranchResult:
    out_dir: str
    config: BranchConfig
    unit: str
    points: list[PointResult]
    branches: list[dict]
    window_samples: int = 0
    """The window every branch trained on, in samples (``window`` rounded up to a multiple of max(ks)·base_batch)."""
    window_units: float = 0.0
    """The same in units, from the base run's units per sample."""
    window_samples_by_point: dict[int, int] = field(default_factory=dict)
    """Branch point → its window in samples (all equal to ``window_samples`` unless ``window_fraction``; then
    ``window_samples`` is the last point's)."""
    compute_s: float
    """Training seconds of the base run and every branch (evaluation excluded), summed."""
    wall_s: float
    """Wall-clock of this call (0 work when everything was already done)."""
    curve: Optional[BranchCurve] = None
    """B_crit(L) over the branch points (two or more points), :func:`branch_curve`."""

    def to_dict(self) -> dict:
        return {**asdict(self), "curve": None if self.curve is None else self.curve.to_dict()}

    def text(self) -> str:
        c = self.config
        metric = ("validation loss (fixed held-out samples, end of window)" if c.metric == "val"
                  else "training loss of the last quarter (biased against large k)")
        window = (f"window {c.window:,} {self.unit}s → {self.window_samples:,} samples (≈{self.window_units:,.0f} "
                  f"{self.unit}s; " if c.window_fraction is None else
                  f"window {c.window_fraction:g} × each point's {self.unit}s → "
                  f"{', '.join(f'{w:,}' for w in self.window_samples_by_point.values())} samples (")
        lines = [f"branch test: base batch {c.base_batch}, lr {c.lr:g} ({c.optimizer}: LR × {'√k' if c.optimizer == 'adamw' else 'k'}), "
                 + window +
                 f"rounded up to a multiple of max k × base batch = {max(c.ks) * c.base_batch}, the same samples for every k), "
                 f"{c.seeds} seeds, {c.test} one-sided t-test, alpha {c.alpha}, "
                 + (f"tolerance {c.tolerance}" if c.tolerance_rule == "absolute" else
                    "tolerance at each point = the k = 1 branches' loss drop over the window's second half "
                    "(half-window rule: the critical k·B reads McCandlish's B_crit)")
                 + f" on the {metric}",
                 "a k passes when it is not significantly worse AND its mean loss is within the tolerance of k = 1"]
        for p in self.points:
            lines.append(f"at {p.branch_at:,} {self.unit}s: critical k = {p.critical_k} → batch {p.critical_batch} "
                         f"(≈{p.critical_batch_units:,.0f} {self.unit}s); shown within tolerance up to k = {p.critical_k_shown}"
                         + (f"; tolerance {p.tolerance:.4f}" if c.tolerance_rule != "absolute" else ""))
            for v in p.verdicts:
                if v.k == 1:
                    lines.append(f"  k=1: loss {v.mean:.4f} ± {v.std:.4f} (reference)")
                else:
                    lines.append(f"  k={v.k}: loss {v.mean:.4f} ± {v.std:.4f}, diff {v.diff:+.4f} "
                                 f"(upper {1 - c.alpha:.0%} bound {v.upper:+.4f}), p = {v.p_value:.3g} → {v.status} "
                                 f"({'pass' if v.passes else 'fail'})")
        if self.curve is not None:
            lines.append(self.curve.text())
        lines.append(f"compute: {self.compute_s:,.1f} s of training")
        return "\n".join(lines)


def _branch_name(point: int, k: int, seed: int) -> str:
    return f"p{point}_k{k}_s{seed}"


def run_branch_test(config: BranchConfig, out_dir: str | os.PathLike, *, threads: Optional[int] = None,
                    progress: bool = True) -> BranchResult:
    """Run the base run (checkpointing at every branch point) and every branch; resumable.

    Finished branches (``branches/<name>.json``) and base checkpoints are reused on a
    rerun into the same ``out_dir``; a different ``seeds`` adds (or leaves out) seeds'
    branches, any other changed run setting is an error. Settings and the task are
    checked before anything is written.
    """
    # Every setting is checked, and the task built, before anything is written.
    if threads is not None:
        whole(threads, "threads")
    check_device(config.device, config.precision)
    task = load_task_checked(config.task, config.task_overrides)
    out = out_dir_checked(out_dir, "out")
    make_out_dir(out, "out")
    with lock_run_dir(out):  # a second branch test into this directory: one error line, exit 2
        return _run_locked(config, out, task, threads=threads, progress=progress)


def _run_locked(config: BranchConfig, out: Path, task: Any, *, threads: Optional[int], progress: bool) -> BranchResult:
    """:func:`run_branch_test` once the settings are checked and ``out`` is locked."""
    import torch

    from globalbatch.checkpoint import load_checkpoint, save_checkpoint
    from globalbatch.lab.loop import Experiment
    from globalbatch.schedule import LRSchedule

    check_manifest(out, config.manifest(), section="branch", mutable=("seeds",))
    if threads is not None:
        torch.set_num_threads(int(threads))
    t_wall = time.time()
    unit = task.unit

    def fresh(batch: int, lr: float, lr_schedule=None):
        return Experiment(task, batch=batch, micro_batch=config.micro_batch_for(batch), optimizer=config.optimizer,
                          lr=lr, max_grad_norm=config.max_grad_norm, seed=config.seed, lr_schedule=lr_schedule,
                          device=config.device, precision=config.precision)

    n_total = len(config.branch_at) * len(config.ks) * config.seeds
    bar = _bar(progress, n_total + 1)

    # 1. The base run, checkpointing at every branch point (one run; resumed from its last checkpoint).
    ckpt_dir = out / "base"
    base_meta_path = ckpt_dir / "base.json"
    base_meta = (_read_base_meta(base_meta_path, out) if base_meta_path.is_file()
                 else {"train_time_s": 0.0, "units_per_sample": None, "unit": unit})
    missing_ckpts = [p for p in config.branch_at if not (ckpt_dir / f"ckpt_{p}.pt").is_file()]
    if missing_ckpts:
        warm = config.base_warmup_units()
        sched = LRSchedule(peak_lr=config.lr, total=config.branch_at[-1], warmup=warm, shape="constant")  # in the task's unit
        exp = fresh(config.base_batch, config.lr, sched)
        model, opt, driver = exp.model, exp.optimizer, exp.driver
        order = task.sample_order(config.seed)
        done = [p for p in config.branch_at if p not in missing_ckpts]
        if done:  # resume the base run from its latest checkpoint
            extra = load_checkpoint(ckpt_dir / f"ckpt_{done[-1]}.pt", driver, map_location=exp.device)
            for _ in range(int((extra or {})["samples_drawn"])):
                next(order)
        for p in config.branch_at:
            if p in done:
                continue
            _, secs, _ = _train(exp, order, config.base_batch, until_units=p)
            base_meta["train_time_s"] += secs
            base_meta["units_per_sample"] = driver.trained_units / max(driver.trained_samples, 1)
            save_checkpoint(ckpt_dir / f"ckpt_{p}.pt", driver,
                            extra={"samples_drawn": driver.consumed_samples, "trained_units": driver.trained_units})
            atomic_write_json(base_meta_path, base_meta)
    bar.advance()

    # 2. The branches: every one trains on exactly ``w_samples`` samples (a whole number of steps for every k).
    ups = float(base_meta.get("units_per_sample") or 1.0)
    quantum = max(config.ks) * config.base_batch
    branches: list[dict] = []
    for p in config.branch_at:
        w_samples = config.window_samples(ups, p)
        # metric="train": the steps over the last quarter, starting at the same sample for every k.
        tail_sample = min(math.ceil(0.75 * w_samples / quantum) * quantum, w_samples - quantum)
        for k in config.ks:
            for s in range(config.seeds):
                name = _branch_name(p, k, s)
                path = out / "branches" / f"{name}.json"
                if path.is_file():
                    branches.append(_read_branch(path, out))
                    bar.advance()
                    continue
                batch = k * config.base_batch
                lr_k = config.lr_for(k)
                exp = fresh(batch, lr_k)
                model, opt, driver = exp.model, exp.optimizer, exp.driver
                state = torch.load(ckpt_dir / f"ckpt_{p}.pt", map_location=exp.device, weights_only=True)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])  # Adam moments continue; the LR is set next
                if config.second_moment == "scaled" and k > 1:
                    for st in opt.state.values():
                        if "exp_avg_sq" in st:
                            st["exp_avg_sq"].div_(k)
                for g in opt.param_groups:
                    g["lr"] = lr_k
                # Same order for every k at this seed: k-branches consume the 1-branch's samples k at a time,
                # and all stop after the same w_samples samples.
                order = task.sample_order(config.seed + 1 + 1000 * (config.branch_at.index(p)) + s)
                mid: dict[str, float] = {}
                n_steps = w_samples // batch

                def at_mid(i: int, n_half: int = n_steps // 2, exp: Any = exp, mid: dict = mid) -> None:
                    if i == n_half:  # the k = 1 branch half-way: the half-window tolerance rule reads it
                        mid["val"] = exp.evaluate(config.max_val_samples)

                tail, secs, drawn = _train(exp, order, batch, n_steps=n_steps, tail_from_step=tail_sample // batch,
                                           after_step=at_mid if k == 1 and n_steps >= 2 else None)
                val = exp.evaluate(config.max_val_samples)
                rec = {"name": name, "branch_at": p, "k": k, "seed": s, "batch": batch, "lr": lr_k,
                       "units": driver.trained_units, "samples": driver.trained_samples, "steps": driver.optimizer_steps,
                       "window_samples": w_samples, "samples_sha1": hashlib.sha1(json.dumps(drawn).encode()).hexdigest(),
                       "skipped": driver.skipped_windows, "val_loss": val, "train_tail_loss": tail, "train_time_s": secs}
                if "val" in mid:
                    rec["val_loss_mid"] = mid["val"]
                atomic_write_json(path, rec)
                branches.append(rec)
                bar.advance()
    bar.stop()
    return _summarise(out, config, unit, branches, base_meta, time.time() - t_wall)


def _summarise(out: Path, config: BranchConfig, unit: str, branches: list[dict], base_meta: dict, wall: float) -> BranchResult:
    key = "val_loss" if config.metric == "val" else "train_tail_loss"
    points = []
    ups = base_meta.get("units_per_sample") or 1.0
    by_point: dict[int, dict[int, Sequence[float]]] = {}
    drops: Optional[dict[int, Sequence[float]]] = {} if config.tolerance_rule == "half_window" else None
    for p in config.branch_at:
        losses: dict[int, Sequence[float]] = {}
        for k in config.ks:
            rows = sorted((b for b in branches if b["branch_at"] == p and b["k"] == k), key=lambda b: b["seed"])
            losses[k] = [b[key] for b in rows]
            if k == 1 and drops is not None:
                if any(b.get("val_loss_mid") is None for b in rows):
                    raise SettingError("tolerance_rule", config.tolerance_rule, "absolute",
                                       why=f"the k = 1 branches at {p:,} have no mid-window validation loss "
                                           "(a window of one step, or trained before it was recorded)")
                drops[p] = [float(b["val_loss_mid"]) - float(b["val_loss"]) for b in rows]
        by_point[p] = losses
        tol = config.tolerance if drops is None else max(float(np.mean(drops[p])), 0.0)
        v = branch_verdicts(losses, tolerance=tol, alpha=config.alpha, test=config.test)
        kc = v.critical_k
        points.append(PointResult(branch_at=p, verdicts=v.per_k, critical_k=kc, critical_k_shown=v.critical_k_shown,
                                  critical_batch=kc * config.base_batch,
                                  critical_batch_units=kc * config.base_batch * ups, tolerance=tol))
    compute = float(base_meta.get("train_time_s", 0.0)) + sum(float(b["train_time_s"]) for b in branches)
    by_point_w = {p: config.window_samples(ups, p) for p in config.branch_at}
    w_samples = by_point_w[config.branch_at[-1]]
    curve = (branch_curve(by_point, base_batch_units=config.base_batch * ups, tolerance=config.tolerance,
                          alpha=config.alpha, test=config.test, unit=unit, drops_by_point=drops)
             if len(config.branch_at) >= 2 else None)
    result = BranchResult(out_dir=str(out), config=config, unit=unit, points=points, branches=branches,
                          window_samples=w_samples, window_units=w_samples * ups, window_samples_by_point=by_point_w,
                          compute_s=compute, wall_s=wall,
                          curve=curve)
    atomic_write_json(out / "result.json", result.to_dict())
    return result


def load_branch_results(out_dir: str | os.PathLike, **decision: Any) -> BranchResult:
    """Re-decide a finished branch test (e.g. another ``tolerance``/``alpha``/``test``) without training."""
    out = Path(out_dir)
    path = out / "manifest.json"
    if not path.is_file():
        raise SettingError("out", str(out), "a branch-test directory", why="no manifest.json")
    doc = read_json_checked(path, field="out")
    stored = doc.get("branch") if isinstance(doc, dict) else None
    if not isinstance(stored, dict):
        raise SettingError("out", str(out), "a branch-test directory", why=f"{path} holds no branch test")
    cfg = BranchConfig.from_dict({**stored, **decision})
    branches = []
    for f in sorted((out / "branches").glob("*.json")):
        b = _read_branch(f, out)
        if b["seed"] < cfg.seeds:
            branches.append(b)
    base_meta = _read_base_meta(out / "base" / "base.json", out)
    return _summarise(out, cfg, base_meta.get("unit", "unit"), branches, base_meta, 0.0)


def _read_branch(path: Path, out: Path) -> dict[str, Any]:
    """A branch record, every field the decision reads checked (``train_s`` of older files read as ``train_time_s``)."""
    from globalbatch.lab.records import BRANCH, read_renamed

    return read_renamed(path, BRANCH, run_dir=out, field="out", old_names={"train_s": "train_time_s"})


def _read_base_meta(path: Path, out: Path) -> dict[str, Any]:
    from globalbatch.lab.records import BRANCH_BASE, read_renamed

    return read_renamed(path, BRANCH_BASE, run_dir=out, field="out", old_names={"train_s": "train_time_s"})


class _NoBar:
    def advance(self) -> None: ...

    def stop(self) -> None: ...


class _Bar:
    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import Progress

        self.p = Progress(transient=False, console=Console(stderr=True))
        self.id = self.p.add_task("branch test (base run + branches)", total=total)
        self.p.start()

    def advance(self) -> None:
        self.p.advance(self.id)

    def stop(self) -> None:
        self.p.stop()


def _bar(enabled: bool, total: int):
    return _Bar(total) if enabled else _NoBar()
