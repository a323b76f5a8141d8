"""Steps and examples to a loss target from a held-out loss curve: monotone fit, log-space interpolation.

McCandlish et al. 2018 (arXiv 1812.06162, §3, App. A) read "steps to reach a loss" off
each run's loss curve. The read-out decides whether that number is signal or noise: the
training loss of one step is one minibatch's loss (≈0.25 nats of scatter per step at
batch 4 on tinygpt), and its first crossing of a target, even after smoothing, lands in
the dips — earlier for small batches, whose steps are noisier. The held-out read-out
here removes both problems:

1. the loss is a fixed held-out set's (the same samples for every trial), evaluated at
   log-spaced positions, so the scatter is the set's and not the minibatch's;
2. the curve is smoothed by a local-linear regression in log examples (tricube weights,
   half-width :data:`SMOOTH_HALFWIDTH` in ln examples, the same for every batch: Cleveland
   1979's LOWESS without the robustness passes), then replaced by its monotone
   (non-increasing) least-squares fit (pool-adjacent-violators,
   ``scipy.optimize.isotonic_regression``), so a noise bump cannot make a crossing, and the
   crossing is unique. The held-out loss of one evaluation carries the iterate's own
   fluctuation (measured: 0.025–0.034 nats on MNIST, 0.015–0.04 on tinygpt, from second
   differences); the isotonic fit alone keeps the first downward dip it meets, which read
   the steps with a noise comparable to the seed-to-seed spread on MNIST (split-half
   estimate 0.07–0.2 in ln steps against 0.14–0.25 across seeds). A window fixed in ln
   examples reads every batch late by the same fraction, which moves S_min and not B_crit;
3. the crossing is interpolated linearly in (log examples, loss) between the two
   evaluations that bracket it; steps are interpolated in log steps against log examples
   (exact for a fixed batch, where steps ∝ examples).

Pure numpy/scipy; no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from globalbatch.errors import Raw, SettingError

__all__ = ["Crossing", "monotone_fit", "heldout_fit", "heldout_crossing", "SMOOTH_HALFWIDTH"]

SMOOTH_HALFWIDTH = 0.5
"""Half-width of the held-out smoother in ln examples (≈ 3 evaluation spacings at 30 log-spaced points over a
100× range; 0 turns smoothing off). Chosen on synthetic curves with a known B_crit
(``tests/test_critical_stability_readout.py``), not on the real runs."""


@dataclass(frozen=True)
class Crossing:
    """Where a curve reaches a target."""

    steps: float
    examples: float
    before_first_eval: bool = False
    """The first evaluation after 0 was already at or below the target: the crossing is only bounded."""


def monotone_fit(loss: np.ndarray) -> np.ndarray:
    """The non-increasing least-squares fit of ``loss`` (in the given order; non-finite values dropped → NaN)."""
    from scipy.optimize import isotonic_regression

    y = np.asarray(loss, dtype=float)
    out = np.full(y.shape, np.nan)
    ok = np.isfinite(y)
    if ok.any():
        out[ok] = isotonic_regression(y[ok], increasing=False).x
    return out


def _local_linear(x: np.ndarray, y: np.ndarray, halfwidth: float) -> np.ndarray:
    """Local-linear regression of ``y`` on ``x`` with tricube weights of radius ``halfwidth`` (at every x)."""
    d = (x[None, :] - x[:, None]) / halfwidth
    w = np.where(np.abs(d) < 1.0, (1.0 - np.abs(d) ** 3) ** 3, 0.0)
    dx = x[None, :] - x[:, None]
    s0, s1, s2 = w.sum(1), (w * dx).sum(1), (w * dx * dx).sum(1)
    t0, t1 = (w * y[None, :]).sum(1), (w * dx * y[None, :]).sum(1)
    det = s0 * s2 - s1 * s1
    # Weighted least squares of y ≈ a + b·(x − x_i), value a at x_i; fewer than two distinct points: keep y.
    ok = (np.count_nonzero(w, axis=1) >= 3) & (det > 1e-12 * np.maximum(s0 * s2, 1e-300))
    return np.divide(s2 * t0 - s1 * t1, det, out=y.copy(), where=ok)


def heldout_fit(examples: np.ndarray, loss: np.ndarray, *, halfwidth: float = SMOOTH_HALFWIDTH) -> np.ndarray:
    """The read-out's curve: local-linear smoothing in ln examples (evaluations after the start), then the
    non-increasing least-squares fit of the whole curve (in the given order; non-finite values → NaN).

    ``halfwidth`` in ln examples (:data:`SMOOTH_HALFWIDTH`); 0: the isotonic fit of the raw values."""
    if not halfwidth >= 0:
        raise SettingError("halfwidth", halfwidth, ">= 0 (ln examples; 0: no smoothing)")
    e = np.asarray(examples, dtype=float)
    y = np.asarray(loss, dtype=float).copy()
    if e.shape != y.shape or e.ndim != 1:
        raise SettingError("loss", Raw(f"shape {y.shape}"), f"a 1-D array as long as examples {e.shape}")
    pos = np.isfinite(y) & np.isfinite(e) & (e > 0)
    if halfwidth > 0 and np.count_nonzero(pos) >= 3:
        y[pos] = _local_linear(np.log(e[pos]), y[pos], halfwidth)
    return monotone_fit(y)


def heldout_crossing(examples: np.ndarray, steps: np.ndarray, loss: np.ndarray, target: float, *,
                     halfwidth: float = SMOOTH_HALFWIDTH) -> Optional[Crossing]:
    """Steps and examples at which the smoothed monotone fit (:func:`heldout_fit`) of a held-out curve reaches ``target``.

    Args:
        examples: cumulative examples at each evaluation (0 for the initial one), increasing.
        steps: optimizer updates done at each evaluation.
        loss: held-out loss after those updates (NaN where it diverged).
        target: the loss to reach.
        halfwidth: of the smoother, in ln examples (:data:`SMOOTH_HALFWIDTH`; 0: the isotonic fit alone).

    Returns None when the fitted curve never reaches ``target`` within the evaluations.
    """
    e = np.asarray(examples, dtype=float)
    s = np.asarray(steps, dtype=float)
    y = np.asarray(loss, dtype=float)
    if not (e.shape == s.shape == y.shape) or e.ndim != 1:
        raise SettingError("loss", Raw(f"shape {y.shape}"), f"a 1-D array as long as examples {e.shape} and steps {s.shape}")
    keep = np.isfinite(y) & np.isfinite(e)
    e, s, y = e[keep], s[keep], y[keep]
    if e.size == 0:
        return None
    order = np.argsort(e, kind="stable")
    e, s, y = e[order], s[order], y[order]
    fit = heldout_fit(e, y, halfwidth=halfwidth)
    below = np.flatnonzero(fit <= target)
    if below.size == 0:
        return None
    i = int(below[0])
    pos = np.flatnonzero(e > 0)
    if pos.size == 0:
        return None
    first = int(pos[0])
    if i <= first:  # reached by the first evaluation after the start: only bounded above
        return Crossing(steps=float(s[first]), examples=float(e[first]), before_first_eval=True)
    l0, l1 = fit[i - 1], fit[i]
    frac = 1.0 if l0 == l1 else (l0 - target) / (l0 - l1)
    le = math.log(e[i - 1]) + frac * (math.log(e[i]) - math.log(e[i - 1]))
    ex = math.exp(le)
    if s[i - 1] > 0 and s[i] > 0:
        st = math.exp(math.log(s[i - 1]) + frac * (math.log(s[i]) - math.log(s[i - 1])))
    else:
        st = float(s[i - 1] + frac * (s[i] - s[i - 1]))
    return Crossing(steps=float(st), examples=float(ex))
