"""Loss curves of a batch sweep and the steps each run needs to reach a loss target.

A :class:`Curve` is one trial's loss against optimizer steps and examples; :func:`steps_to_target`
reads where it first crosses a target (the EMA-smoothed training loss, or the monotone fit of the
held-out loss, :mod:`globalbatch.critical.readout`). Units: "examples" are whatever the sweep counts
per step — tokens for language models, samples otherwise (``unit``). Pure numpy; no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, cast

import numpy as np

from globalbatch.errors import Raw, SettingError

__all__ = ["Curve", "READOUTS", "ema_smooth", "steps_to_target"]


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
                raise SettingError("eval_loss", Raw(f"shape {self.eval_loss.shape}"), f"a 1-D array as long as eval_examples "
                                   f"{self.eval_examples.shape} and eval_steps {self.eval_steps.shape}")
        if not self.batch_size > 0:
            raise SettingError("batch_size", self.batch_size, "> 0")
        if not self.lr > 0:
            raise SettingError("lr", self.lr, "> 0")
        if self.examples.ndim != 1 or self.examples.shape != self.loss.shape:
            raise SettingError("loss", Raw(f"shape {self.loss.shape}"),
                               f"a 1-D array as long as examples {self.examples.shape}")
        if self.examples.size and np.any(np.diff(self.examples) <= 0):
            raise SettingError("examples", self.examples.tolist()[:8], "strictly increasing cumulative examples "
                                                                         "after each step")
        if self.examples_per_s is not None and not self.examples_per_s > 0:
            raise SettingError("examples_per_s", self.examples_per_s, "> 0 or None")


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
        raise SettingError("halflife_steps", halflife_steps, "> 0")
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
    covers so little data that its first crossing lands in a noise dip (measured: 55.7 steps
    where the held-out loss says ≈115).

    ``readout="heldout"``: the held-out evaluations of the curve instead
    (:func:`globalbatch.critical.readout.heldout_crossing`: a monotone fit, interpolated in log
    examples); the smoothing settings do not apply.
    """
    if readout not in READOUTS:
        raise SettingError("readout", readout, ", ".join(READOUTS))
    if readout == "heldout":
        from globalbatch.critical.readout import heldout_crossing

        if curve.eval_loss is None:
            raise SettingError("readout", "heldout", f"train (curve {curve.label!r} has no held-out evaluations)")
        c = heldout_crossing(cast(np.ndarray, curve.eval_examples), cast(np.ndarray, curve.eval_steps), curve.eval_loss, target)
        return None if c is None else (c.steps, c.examples)
    if curve.loss.size == 0:
        return None
    floor = (min_window_examples / curve.batch_size) if min_window_examples else 0.0
    if halflife_steps is not None:
        return _crossing(curve, target, max(halflife_steps, floor))
    if not 0 < ema_fraction < 1:
        raise SettingError("ema_fraction", ema_fraction, "in (0, 1), e.g. 0.05")
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
