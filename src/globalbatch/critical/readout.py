"""Steps and examples to a loss target from a held-out loss curve: monotone fit, log-space interpolation.

McCandlish et al. 2018 (arXiv 1812.06162, §3, App. A) read "steps to reach a loss" off
each run's loss curve. The read-out decides whether that number is signal or noise: the
training loss of one step is one minibatch's loss (≈0.25 nats of scatter per step at
batch 4 on tinygpt), and its first crossing of a target, even after smoothing, lands in
the dips — earlier for small batches, whose steps are noisier. The held-out read-out
here removes both problems:

1. the loss is a fixed held-out set's (the same samples for every trial), evaluated at
   log-spaced positions, so the scatter is the set's and not the minibatch's;
2. the curve is replaced by its monotone (non-increasing) least-squares fit in log
   examples (pool-adjacent-violators, ``scipy.optimize.isotonic_regression``), so a noise
   bump cannot make a crossing, and the crossing is unique;
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

__all__ = ["Crossing", "monotone_fit", "heldout_crossing"]


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


def heldout_crossing(examples: np.ndarray, steps: np.ndarray, loss: np.ndarray, target: float) -> Optional[Crossing]:
    """Steps and examples at which the monotone fit of a held-out curve reaches ``target``.

    Args:
        examples: cumulative examples at each evaluation (0 for the initial one), increasing.
        steps: optimizer updates done at each evaluation.
        loss: held-out loss after those updates (NaN where it diverged).
        target: the loss to reach.

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
    fit = monotone_fit(y)
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
