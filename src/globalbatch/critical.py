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
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

__all__ = [
    "Curve",
    "HyperbolaFit",
    "BatchPoint",
    "TargetResult",
    "Recommendation",
    "Analysis",
    "ema_smooth",
    "steps_to_target",
    "fit_hyperbola",
    "zhang_cbs",
    "default_targets",
    "smoothing_halflife",
    "points_for_target",
    "recommend",
    "analyze",
    "check_analysis_settings",
]


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class Curve:
    """One trial's training curve: a batch size, an LR and the loss after each step."""

    batch_size: float
    """Examples per optimizer step, in ``unit`` (tokens or samples)."""
    lr: float
    """Peak learning rate of the trial."""
    examples: np.ndarray
    """Cumulative examples consumed after each optimizer step (1-D, increasing): ``examples[i]``
    after update i + 1."""
    loss: np.ndarray
    """Training loss (mean per example) of each optimizer step, same length as ``examples``:
    ``loss[i]`` is the loss of step i + 1's forward pass, i.e. at the parameters after i
    updates (``loss[0]`` is the initial model's loss). This is what a training loop logs."""
    examples_per_s: Optional[float] = None
    """Measured training throughput in examples/s (evaluation excluded); None if unknown."""
    cost_per_example: Optional[float] = None
    """Cost (any currency or device-seconds) of one example at this batch; None if unknown."""
    label: str = ""
    """Free-form trial name, e.g. ``b64_lr0.001``."""
    seed: int = 0
    """Seed of the trial (model init and data order)."""
    eval_examples: Optional[np.ndarray] = None
    """Held-out evaluations: cumulative examples at each (0 for the initial model), or None."""
    eval_steps: Optional[np.ndarray] = None
    """Optimizer updates done at each held-out evaluation."""
    eval_loss: Optional[np.ndarray] = None
    """Held-out loss after those updates."""
    warmup_examples: float = 0.0
    """Examples of LR warmup: a target reached before this is flagged."""
    b_simple: list = field(default_factory=list)
    """``(examples, B_simple)`` pairs logged at evaluations (``--noise``), unflagged ones."""

    def __post_init__(self) -> None:
        self.examples = np.asarray(self.examples, dtype=float)
        self.loss = np.asarray(self.loss, dtype=float)
        if self.eval_loss is not None:
            self.eval_examples = np.asarray(self.eval_examples, dtype=float)
            self.eval_steps = np.asarray(self.eval_steps, dtype=float)
            self.eval_loss = np.asarray(self.eval_loss, dtype=float)
            if not (self.eval_examples.shape == self.eval_steps.shape == self.eval_loss.shape):
                raise ValueError("eval_examples/eval_steps/eval_loss: must be equal 1-D arrays")
        if not self.batch_size > 0:
            raise ValueError(f"batch_size: {self.batch_size}: must be > 0")
        if not self.lr > 0:
            raise ValueError(f"lr: {self.lr}: must be > 0")
        if self.examples.ndim != 1 or self.examples.shape != self.loss.shape:
            raise ValueError(
                f"examples/loss: shapes {self.examples.shape} and {self.loss.shape}: must be equal 1-D arrays"
            )
        if self.examples.size and np.any(np.diff(self.examples) <= 0):
            raise ValueError("examples: must be strictly increasing (cumulative examples after each step)")
        if self.examples_per_s is not None and not self.examples_per_s > 0:
            raise ValueError(f"examples_per_s: {self.examples_per_s}: must be > 0 or None")


# ---------------------------------------------------------------------------
# Smoothing and steps to a target
# ---------------------------------------------------------------------------


def ema_smooth(values: np.ndarray, halflife_steps: float) -> tuple[np.ndarray, np.ndarray]:
    """Bias-corrected EMA of ``values`` and the centre of mass of its weights.

    Returns ``(smoothed, lag_steps)``: ``smoothed[t]`` averages values[0..t] with weights
    decaying by half every ``halflife_steps`` (normalised, so no start-up bias), and
    ``lag_steps[t]`` is the weighted mean distance of those values behind step t. A
    smoothed value estimates the loss at step ``t − lag_steps[t]``, not at step t: using
    it at step t would add ~halflife/ln 2 steps to every batch's steps-to-target and bias
    S_min up and B_crit down. Non-finite values (skipped steps) get zero weight.
    """
    if not halflife_steps > 0:
        raise ValueError(f"halflife_steps: {halflife_steps}: must be > 0")
    x = np.asarray(values, dtype=float)
    beta = 0.5 ** (1.0 / halflife_steps)
    out = np.full(x.shape, np.nan)
    lag = np.zeros(x.shape)
    s_w = s_wx = s_wd = 0.0  # sums of weights, weight·value, weight·distance
    for t, v in enumerate(x):
        # Every older weight decays by beta and moves one step further away.
        s_wd = beta * (s_wd + s_w)
        s_w *= beta
        s_wx *= beta
        if math.isfinite(v):
            s_w += 1.0
            s_wx += v
        if s_w > 0:
            out[t] = s_wx / s_w
            lag[t] = s_wd / s_w
    return out, lag


def _crossing(curve: Curve, target: float, halflife_steps: float) -> Optional[tuple[float, float]]:
    """First crossing of ``target`` by the lag-corrected EMA, interpolated; ``(steps, examples)`` or None."""
    n = curve.loss.size
    smooth, lag = ema_smooth(curve.loss, halflife_steps)
    # loss[i] is measured at the parameters after i updates (the forward pass before update
    # i + 1), so the smoothed value i describes the parameters after i − lag[i] updates.
    step = np.arange(0, n, dtype=float) - lag
    below = np.flatnonzero(np.isfinite(smooth) & (smooth <= target))
    if below.size == 0:
        return None
    i = int(below[0])
    if i == 0:
        s = step[0]
    else:
        l0, l1 = smooth[i - 1], smooth[i]
        frac = 1.0 if not np.isfinite(l0) or l0 == l1 else (l0 - target) / (l0 - l1)
        s = step[i - 1] + frac * (step[i] - step[i - 1])
    # Examples consumed by the first s updates, interpolated on the recorded cumulative
    # examples (examples[j] after update j + 1; 0 before the first): exact E = B·S when
    # every step carries B examples, honest when counts vary.
    steps_axis = np.arange(0, n + 1, dtype=float)
    e = float(np.interp(s, steps_axis, np.concatenate([[0.0], curve.examples])))
    return float(s), e


READOUTS = ("heldout", "train")


def steps_to_target(
    curve: Curve,
    target: float,
    *,
    ema_fraction: float = 0.05,
    halflife_steps: Optional[float] = None,
    readout: str = "train",
    min_window_examples: Optional[float] = None,
) -> Optional[tuple[float, float]]:
    """Steps and examples the trial needed to bring its smoothed loss to ``target``.

    The first crossing of the lag-corrected EMA (see :func:`ema_smooth`) is linearly
    interpolated between steps, so the result is fractional. Returns ``(steps,
    examples)`` or None if the smoothed loss never reaches ``target``.

    Smoothing: by default the EMA half-life is ``ema_fraction`` × the steps to the
    target (found by fixed-point iteration, starting from ``ema_fraction`` × all the
    trial's steps so that noise dips of the raw loss do not count as crossings). Any smoother of a
    convex loss curve reads it late by ~½·|L''/L'|·(window)² steps; with a window
    proportional to S that error is the same *fraction* of S at every batch, which
    rescales S_min but leaves B_crit unchanged. A fixed ``halflife_steps`` instead
    biases B_crit low (the large batches, with few steps, have the most curvature per
    step): measured on synthetic curves with B_crit = 1,600, half-life 8 steps gave
    1,390 while ``ema_fraction`` 0.02–0.1 gave 1,598–1,629 (docs/critical.md).

    ``min_window_examples``: the half-life is at least this many examples (÷ the batch, in
    steps), the same amount of data for every batch — without it a small batch's window
    covers so little data that its first crossing lands in a noise dip (issue 10: read 55.7
    steps where the held-out loss says ≈115).

    ``readout="heldout"``: the held-out evaluations of the curve instead
    (:func:`globalbatch.readout.heldout_crossing`: a monotone fit, interpolated in log
    examples); the smoothing settings do not apply.
    """
    if readout not in READOUTS:
        raise ValueError(f"readout: {readout!r}: expected one of {', '.join(READOUTS)}")
    if readout == "heldout":
        from globalbatch.readout import heldout_crossing

        if curve.eval_loss is None:
            raise ValueError(f"readout: 'heldout' needs held-out evaluations; curve {curve.label!r} has none")
        c = heldout_crossing(curve.eval_examples, curve.eval_steps, curve.eval_loss, target)
        return None if c is None else (c.steps, c.examples)
    if curve.loss.size == 0:
        return None
    floor = (min_window_examples / curve.batch_size) if min_window_examples else 0.0
    if halflife_steps is not None:
        return _crossing(curve, target, max(halflife_steps, floor))
    if not 0 < ema_fraction < 1:
        raise ValueError(f"ema_fraction: {ema_fraction}: must be in (0, 1), e.g. 0.05")
    # Start from the heaviest smoothing this fraction allows (of the whole trial) so that a
    # noise dip of the raw loss cannot set the first crossing; then shrink to frac × S.
    # A trial whose heavily smoothed loss never reaches the target did not reach it: a
    # lighter smoothing would only let single noisy steps dip below (measured: a batch-4
    # trial "reached" a loss 0.17 below its smoothed minimum at step 215 of 1,621).
    r = _crossing(curve, target, max(0.5, floor, ema_fraction * curve.loss.size))
    for _ in range(4):
        if r is None:
            return None
        r_next = _crossing(curve, target, max(0.5, floor, ema_fraction * r[0]))
        if r_next is None:  # heavier smoothing no longer reaches a target at the edge: keep the last
            return r
        if abs(r_next[0] - r[0]) <= 1e-3 * r[0]:
            return r_next
        r = r_next
    return r


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

        Raises ValueError for a degenerate fit or one whose B_crit lies outside the swept
        batches: there the curvature was not observed and only :meth:`b_crit_bound` (or
        nothing) can be said.
        """
        from scipy import stats

        if self.degenerate is not None:
            raise ValueError(f"b_crit_interval: the fit is degenerate ({self.degenerate}); no interval")
        if self.extrapolated:
            raise ValueError(f"b_crit_interval: B_crit {self.b_crit:.3g} lies outside the swept batches "
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
        raise ValueError(f"overhead: {overhead}: must be > 0 (0.2 = 20%)")
    if base_batch < 0:
        raise ValueError(f"base_batch: {base_batch}: must be >= 0")
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


def fit_hyperbola(batch_sizes: Sequence[float], steps: Sequence[float]) -> HyperbolaFit:
    """Fit S(B) = S_min·(1 + B_crit/B) to steps-to-target at each batch.

    Args:
        batch_sizes: examples per step of each point (each batch once, its best LR).
        steps: steps to reach the target at that batch.

    The fit is in log space (relative errors, as McCandlish); the covariance is scaled
    by the residual variance (``absolute_sigma=False``), so use a Student-t quantile with
    ``dof = n − 2`` for intervals (:meth:`HyperbolaFit.b_crit_interval`). Raises
    ValueError with fewer than 3 points (a 2-parameter fit needs a residual).
    """
    from scipy.optimize import curve_fit

    b = np.asarray(batch_sizes, dtype=float)
    s = np.asarray(steps, dtype=float)
    if b.shape != s.shape or b.ndim != 1:
        raise ValueError(f"batch_sizes/steps: shapes {b.shape} and {s.shape}: must be equal 1-D")
    if b.size < 3:
        raise ValueError(f"points: {b.size}: the hyperbola fit needs at least 3 batch sizes that reach the target")
    if np.any(b <= 0) or np.any(s <= 0) or not np.all(np.isfinite(s)):
        raise ValueError("batch_sizes/steps: must be positive and finite")
    y = np.log(s)
    lo, hi = math.log(b.min()), math.log(b.max())
    bounds = ([-np.inf, lo - 12.0], [np.inf, hi + 12.0])
    best = None
    # A few starting points for ln B_crit across (and beyond) the swept range: the
    # objective is not convex in ln B_crit and a single start can stall on a plateau.
    for log_bc0 in np.linspace(lo - 2.0, hi + 2.0, 5):
        log_s0 = float(np.median(y - np.log1p(math.exp(log_bc0) / b)))
        try:
            popt, pcov = curve_fit(_log_model, b, y, p0=[log_s0, log_bc0], bounds=bounds, method="trf", maxfev=5000)
        except (RuntimeError, ValueError):
            continue
        sse = float(np.sum((y - _log_model(b, *popt)) ** 2))
        if best is None or sse < best[0] - 1e-12:
            best = (sse, popt, pcov)
    if best is None:
        raise ValueError("fit: curve_fit did not converge from any starting point")
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


# ---------------------------------------------------------------------------
# Per-target points, throughput, recommendation
# ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class BatchPoint:
    """One batch size at one loss target, with its best LR."""

    batch_size: float
    lr: float
    """The LR of the fastest trial at this batch (fewest steps to target)."""
    steps: float
    examples: float
    examples_per_s: Optional[float] = None
    """Median throughput of this batch's trials (throughput does not depend on the LR)."""
    time_s: Optional[float] = None
    """Wall-clock to target = examples / examples_per_s."""
    cost: Optional[float] = None
    """examples × cost_per_example, when the cost per example is known."""


@dataclass(kw_only=True)
class TargetResult:
    target: float
    points: list[BatchPoint]
    unreached: list[float]
    """Batch sizes none of whose trials reached the target within the budget."""
    fit: Optional[HyperbolaFit] = None
    fit_error: Optional[str] = None
    cbs_20: Optional[float] = None
    """Zhang et al. 2024 CBS (20% step overhead over E_min/B), = 0.2·B_crit."""
    se_cbs_20: Optional[float] = None
    b_crit_ci95: Optional[tuple[float, float]] = None
    """Two-sided 95% CI of B_crit; None when B_crit is extrapolated (see ``b_crit_bound``)."""
    b_crit_bound: Optional[tuple[str, float]] = None
    """When B_crit lies outside the swept batches: ``("lower", X)`` (B_crit > X, every batch in
    the perfect-scaling regime) or ``("upper", Y)`` (B_crit < Y, every batch saturated), a
    one-sided 95% bound — the point estimate and a two-sided CI mean little there."""


@dataclass(kw_only=True)
class Recommendation:
    batch_size: float
    lr: float
    objective: str
    tolerance: float
    target: float
    reasons: list[str] = field(default_factory=list)

    def text(self) -> str:
        return "\n".join(self.reasons)


@dataclass(kw_only=True)
class Analysis:
    unit: str
    targets: list[TargetResult]
    primary_target: float
    recommendation: Optional[Recommendation]
    ema_fraction: float
    """EMA half-life as a fraction of each trial's steps to the target (the default smoothing)."""
    halflife_steps: Optional[float] = None
    """A fixed EMA half-life in steps, when one was asked for instead."""
    warnings: list[str] = field(default_factory=list)
    """Caveats of the measurement (e.g. in-trial throughput that varied with machine load)."""

    def halflife_for(self, n_steps: int) -> float:
        return smoothing_halflife(n_steps, ema_fraction=self.ema_fraction, halflife_steps=self.halflife_steps)

    def to_dict(self) -> dict:
        """JSON-ready dict (the summary a report or a script reads)."""
        return asdict(self)


def _throughput(curves: Sequence[Curve]) -> dict[float, tuple[Optional[float], Optional[float]]]:
    out: dict[float, tuple[Optional[float], Optional[float]]] = {}
    for b in sorted({c.batch_size for c in curves}):
        tp = [c.examples_per_s for c in curves if c.batch_size == b and c.examples_per_s]
        cp = [c.cost_per_example for c in curves if c.batch_size == b and c.cost_per_example is not None]
        out[b] = (float(np.median(tp)) if tp else None, float(np.median(cp)) if cp else None)
    return out


def points_for_target(
    curves: Sequence[Curve], target: float, *, ema_fraction: float = 0.05, halflife_steps: Optional[float] = None,
    readout: str = "train", min_window_examples: Optional[float] = None,
) -> TargetResult:
    """For each batch size, the fastest LR's steps and examples to ``target``, and the fit (see :func:`steps_to_target`)."""
    tput = _throughput(curves)
    points: list[BatchPoint] = []
    unreached: list[float] = []
    for b in sorted(tput):
        best: Optional[tuple[float, float, float]] = None
        for c in curves:
            if c.batch_size != b:
                continue
            r = steps_to_target(c, target, ema_fraction=ema_fraction, halflife_steps=halflife_steps, readout=readout,
                                min_window_examples=min_window_examples)
            if r is not None and (best is None or r[0] < best[0]):
                best = (r[0], r[1], c.lr)
        if best is None:
            unreached.append(b)
            continue
        eps, cpe = tput[b]
        points.append(
            BatchPoint(
                batch_size=b,
                lr=best[2],
                steps=best[0],
                examples=best[1],
                examples_per_s=eps,
                time_s=best[1] / eps if eps else None,
                cost=best[1] * cpe if cpe is not None else None,
            )
        )
    result = TargetResult(target=float(target), points=points, unreached=unreached)
    try:
        fit = fit_hyperbola([p.batch_size for p in points], [p.steps for p in points])
    except ValueError as exc:
        result.fit_error = str(exc)
    else:
        if fit.degenerate is not None:
            result.fit_error = f"fit failed (degenerate: {fit.degenerate})"
            return result
        result.fit = fit
        result.cbs_20 = fit.cbs(overhead=0.2)
        result.se_cbs_20 = 0.2 * fit.se_b_crit
        result.b_crit_bound = fit.b_crit_bound(0.95)
        if not fit.extrapolated:
            result.b_crit_ci95 = fit.b_crit_interval(0.95)
    return result


OBJECTIVES = ("time", "cost")


def check_analysis_settings(*, objective: str = "time", tolerance: float = 0.05, ema_fraction: float = 0.05,
                            halflife_steps: Optional[float] = None) -> None:
    """Raise a :class:`~globalbatch._util.SettingError` for the first bad analysis setting."""
    from globalbatch._util import SettingError

    if objective not in OBJECTIVES:
        raise SettingError("objective", objective, ", ".join(OBJECTIVES))
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise SettingError("tolerance", tolerance, "a fraction, 0 ≤ tolerance < 1 (0.05 = within 5%)")
    if isinstance(ema_fraction, bool) or not isinstance(ema_fraction, (int, float)) or not 0 < ema_fraction < 1:
        raise SettingError("ema_fraction", ema_fraction, "a fraction, 0 < ema_fraction < 1 (e.g. 0.05)")
    if halflife_steps is not None and not (isinstance(halflife_steps, (int, float)) and halflife_steps > 0
                                           and math.isfinite(halflife_steps)):
        raise SettingError("halflife_steps", halflife_steps, "a number of steps > 0")


def smoothing_halflife(n_steps: int, *, ema_fraction: float = 0.05, halflife_steps: Optional[float] = None) -> float:
    """Half-life (steps) used to smooth a whole curve of ``n_steps`` for display and targets."""
    return halflife_steps if halflife_steps is not None else max(0.5, ema_fraction * n_steps)


def default_targets(
    curves: Sequence[Curve],
    *,
    n_targets: int = 4,
    n_tighter: int = 2,
    min_points: int = 4,
    ema_fraction: float = 0.05,
    halflife_steps: Optional[float] = None,
) -> list[float]:
    """Loss targets; the first is the primary one (the recommendation's).

    * primary: the best smoothed loss that *every* batch reaches — max over batches of
      (min over that batch's trials of its lowest smoothed loss). In a fixed-token sweep
      it is set by the batch that learns least per token (usually the largest).
    * ``n_targets − 1`` looser targets, up to a quarter of the way back to the initial loss;
    * ``n_tighter`` tighter targets, down to the best loss that ``min_points`` batches
      reach (enough for a fit): the batches that miss them count as "not reached".

    Returns the primary target, then the others from tightest to loosest.
    """
    if n_targets < 1:
        raise ValueError(f"n_targets: {n_targets}: must be >= 1")
    if n_tighter < 0:
        raise ValueError(f"n_tighter: {n_tighter}: must be >= 0")
    per_batch: dict[float, float] = {}
    starts = []
    for c in curves:
        sm, _ = ema_smooth(c.loss, smoothing_halflife(c.loss.size, ema_fraction=ema_fraction, halflife_steps=halflife_steps))
        finite = sm[np.isfinite(sm)]
        if finite.size == 0:
            continue
        per_batch[c.batch_size] = min(per_batch.get(c.batch_size, math.inf), float(finite.min()))
        starts.append(float(finite[0]))
    if not per_batch:
        raise ValueError("curves: no finite loss in any trial")

    def nudge(x: float) -> float:  # up by a hair, so the batch that defines a target registers a crossing
        return x + 1e-9 * max(1.0, abs(x))

    best = sorted(per_batch.values())
    primary = nudge(best[-1])
    start = float(np.median(starts))
    looser = [] if start <= primary else [float(primary + f * (start - primary)) for f in np.linspace(0.0, 0.25, n_targets)[1:]]
    tighter: list[float] = []
    floor = nudge(best[min(min_points, len(best)) - 1])
    if n_tighter and floor < primary:
        tighter = [float(primary - f * (primary - floor)) for f in np.linspace(0.0, 1.0, n_tighter + 1)[1:]]
    return [primary] + sorted(tighter + looser)


def recommend(
    points: Sequence[BatchPoint],
    *,
    objective: str = "time",
    tolerance: float = 0.05,
    target: float = math.nan,
    unit: str = "example",
    label: Optional[Callable[[float], str]] = None,
    throughput_source: Optional[Callable[[float], str]] = None,
) -> Recommendation:
    """The batch that reaches the target fastest (or cheapest), within a tolerance.

    Rule: rank the batches that reach the target by ``objective`` ("time": wall-clock
    to target; "cost": cost to target, falling back to examples consumed when no cost per
    example is known). Every batch within ``tolerance`` (relative) of the best is a tie,
    broken by a secondary criterion (then by the primary one):

    * "time": the lowest cost to target when every batch has a cost, otherwise the fewest
      examples to target (least compute and data);
    * "cost": the shortest wall-clock to target when every batch has a throughput,
      otherwise the fewest examples.

    So a bigger batch that is only marginally faster but burns many more tokens loses: this
    is "the highest-throughput batch that reaches the target", not the largest that fits.

    ``throughput_source(batch)`` says where a batch's throughput comes from (e.g. "timed
    pass"); without it the text says "median over its trials".
    """
    check_analysis_settings(objective=objective, tolerance=tolerance)
    pts = list(points)
    if not pts:
        raise ValueError("points: no batch size reached the target; lower the target or raise the token budget")

    def primary(p: BatchPoint) -> float:
        if objective == "time":
            if p.time_s is None:
                raise ValueError(f"examples_per_s: batch {p.batch_size:g} has no throughput; objective 'time' needs it")
            return p.time_s
        return p.cost if p.cost is not None else p.examples

    all_cost = all(q.cost is not None for q in pts)
    all_time = all(q.time_s is not None for q in pts)
    if objective == "time":
        sec_name = "cost" if all_cost else f"{unit}s"
    else:
        sec_name = "wall-clock" if all_time else f"{unit}s"

    def secondary(p: BatchPoint) -> float:
        if sec_name == "cost":
            return p.cost  # type: ignore[return-value]
        if sec_name == "wall-clock":
            return p.time_s  # type: ignore[return-value]
        return p.examples

    best_val = min(primary(p) for p in pts)
    ties = [p for p in pts if primary(p) <= best_val * (1.0 + tolerance)]
    winner = min(ties, key=lambda p: (secondary(p), primary(p)))
    fastest = min(pts, key=primary)
    what = "wall-clock to target" if objective == "time" else "cost to target"
    name = label if label is not None else (lambda b: f"batch {b:,.0f}")

    def desc(p: BatchPoint) -> str:
        parts = [f"{name(p.batch_size)}, lr {p.lr:g}: {p.steps:,.1f} steps, {p.examples:,.0f} {unit}s"]
        if p.examples_per_s:
            source = throughput_source(p.batch_size) if throughput_source is not None else "median over its trials"
            parts.append(f"{p.examples_per_s:,.0f} {unit}/s ({source})")
        if p.time_s is not None:
            parts.append(f"{p.time_s:,.1f} s")
        if p.cost is not None:
            parts.append(f"cost {p.cost:,.4g}")
        return ", ".join(parts)

    reasons = [f"target loss {target:.4f}; objective: {what}, tolerance {tolerance:.0%}"]
    reasons += ["  " + desc(p) for p in sorted(pts, key=lambda p: p.batch_size)]
    if winner is fastest:
        reasons.append(f"recommend {name(winner.batch_size)}: best {what}")
    else:
        gap = primary(winner) / primary(fastest) - 1.0
        saving = 1.0 - secondary(winner) / secondary(fastest)
        reasons.append(
            f"recommend {name(winner.batch_size)}: {name(fastest.batch_size)} is best on {what} "
            f"but only by {gap:.1%} (within {tolerance:.0%}), and {name(winner.batch_size)} needs "
            f"{saving:.0%} {'less' if sec_name in ('cost', 'wall-clock') else 'fewer'} {sec_name}"
        )
    bigger = [p for p in pts if p.batch_size > winner.batch_size]
    for p in sorted(bigger, key=lambda p: p.batch_size):
        if p is fastest:
            continue
        reasons.append(
            f"  {name(p.batch_size)} needs {p.examples / winner.examples - 1:+.0%} {unit}s for "
            f"{primary(p) / primary(winner) - 1:+.0%} {what}"
        )
    return Recommendation(
        batch_size=winner.batch_size, lr=winner.lr, objective=objective, tolerance=tolerance, target=float(target), reasons=reasons
    )


def analyze(
    curves: Sequence[Curve],
    *,
    targets: Optional[Sequence[float]] = None,
    n_targets: int = 4,
    n_tighter: int = 2,
    ema_fraction: float = 0.05,
    halflife_steps: Optional[float] = None,
    objective: str = "time",
    tolerance: float = 0.05,
    unit: str = "example",
    label: Optional[Callable[[float], str]] = None,
    throughput_source: Optional[Callable[[float], str]] = None,
    warnings: Sequence[str] = (),
) -> Analysis:
    """Fits at every target and the recommendation at the primary (first) target (see :func:`default_targets`).

    ``warnings`` (e.g. unreliable throughput) are kept in :attr:`Analysis.warnings` and
    added to the recommendation's text.
    """
    check_analysis_settings(objective=objective, tolerance=tolerance, ema_fraction=ema_fraction,
                            halflife_steps=halflife_steps)
    curves = list(curves)
    if not curves:
        raise ValueError("curves: empty; nothing to analyze")
    if targets is None:
        targets = default_targets(curves, n_targets=n_targets, n_tighter=n_tighter, ema_fraction=ema_fraction,
                                  halflife_steps=halflife_steps)
    targets = [float(t) for t in targets]
    if not targets:
        raise ValueError("targets: empty")
    results = [points_for_target(curves, t, ema_fraction=ema_fraction, halflife_steps=halflife_steps) for t in targets]
    rec = None
    primary = results[0]
    no_throughput = objective == "time" and any(p.time_s is None for p in primary.points)
    if primary.points and not no_throughput:  # without throughput the fit stands, no time recommendation
        rec = recommend(primary.points, objective=objective, tolerance=tolerance, target=primary.target,
                        unit=unit, label=label, throughput_source=throughput_source)
        rec.reasons += [f"warning: {w}" for w in warnings]
    return Analysis(unit=unit, targets=results, primary_target=targets[0], recommendation=rec,
                    ema_fraction=ema_fraction, halflife_steps=halflife_steps, warnings=list(warnings))
