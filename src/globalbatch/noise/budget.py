"""The noise monitor's cost budget: how often to measure (``every``) from the cost it measured.

The monitor's cost is read two ways, both with a host clock (``time.perf_counter``) and without a
device sync. *Timed*: the seconds of its own regions (parameter hooks, callbacks, folds, the hooks'
(un)registration). *By the windows' wall times*: each window's span (from its first micro-batch's
end to the step's end, plus one micro-batch's mean duration for the first one; under the
StepDriver the end is read in ``on_step_end``, after the driver's one host sync per step, so on an
accelerator the span holds the device's work without a sync of its own). A measured window costs
what its span exceeds the span of a window left out by, plus what a window left out costs: that
sees what the timed regions leave out (the autograd engine's dispatch to the Python hooks, the
calls around the regions, cache effects). :class:`EveryController` takes, per measured window,

    c_m = max(timed c_m, IQM(W_m − W_u) + c_u) + (un)hooking + folds per measured window,

with W_m − W_u the difference of the spans of a measured window and of a window left out beside it
(each pair of neighbours once: a drift of the step time drops out; the interquartile mean of the last 64
pairs: a window in which the process was descheduled is an outlier; until 8 pairs are known, timed c_m
alone), c_u the timed seconds of a window left out and T the bare step (the mean span less the timed
seconds, over the recent windows). At ``every = 1`` it leaves one window in 16 out (one in 4 until 8
pairs are known) to keep the pairs coming. One window in n costs (c_m + (n − 1)·c_u) / (n·T). The smallest n within the
budget is

    n* = ⌈(c_m − c_u) / (budget·T − c_u)⌉           (every_max when budget·T ≤ c_u)

The budget is a ceiling, so the decisions price a measured window at the upper end of its interval: the
wall-time difference at its interquartile mean plus two standard errors (Tukey & McLaughlin 1963: the
25 %-winsorized SD over (1 − 2·0.25)·√k for k pairs), which on a step of a few milliseconds is as large as
the difference itself; the reported cost (``fraction_now``, ``measured_window_s``) is the point estimate.
``every`` rises (at most doubling per measured window) when the cost at the current n is over the
budget, and falls only when the cost at a smaller n is under budget / (1 + hysteresis): a cost
that stays in that band leaves ``every`` where it is. Which windows are measured depends on time and
counts only, never on a gradient, so the measured windows are a subsample of the windows and the
estimate stays unbiased.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EveryController", "MonitorCost", "EVERY_MAX", "parse_budget"]

EVERY_MAX = 1024
"""The most windows one measured window may stand for under a budget."""


@dataclass(kw_only=True, frozen=True, slots=True)
class MonitorCost:
    """What the monitor measured of its own cost (``NoiseScaleMonitor.cost()``)."""

    budget: float | None
    """The budget (a fraction of the bare step time), None: every ``every``-th window measured."""
    every: int
    """One window in ``every`` measured now."""
    windows: int
    """Windows seen (the monitor's ``window_end`` calls)."""
    windows_measured: int
    """Windows measured (their norms entered the estimate)."""
    windows_unmeasured: int
    """Windows left out by ``every`` (or detached); no estimate reads them."""
    monitor_s: float
    """Seconds the monitor spent in its hooks, callbacks and folds, over the timed windows."""
    step_s: float
    """Bare step seconds over the same windows (wall time between window ends less the monitor's)."""
    fraction: float
    """monitor_s / step_s: the cost measured over every window so far, as a fraction of the bare step (NaN
    before a window); with a budget it includes the first windows, measured before the cost was known."""
    fraction_now: float
    """With a budget: the cost at the current ``every`` from the recent readings (what the budget is held
    to); NaN without one."""
    measured_window_s: float
    """With a budget: what a measured window costs over the bare step, the larger of the timed seconds and
    the windows' wall times (:attr:`wall_extra_s` + the seconds of a window left out), (un)hooking and folds
    amortized in; NaN before one."""
    unmeasured_window_s: float
    """With a budget: the monitor's seconds in a window left out (timed, smoothed), NaN before one."""
    wall_extra_s: float = math.nan
    """With a budget: how much longer a measured window's span is than a neighbouring window left out's
    (interquartile mean of the recent pairs' differences, (un)hooking and folds taken out); NaN until 8
    pairs are known."""
    timed_window_s: float = math.nan
    """With a budget: the monitor's timed seconds in a measured window (its own regions only), NaN before one."""
    fraction_all: float = math.nan
    """With a budget, once the spans are known: :attr:`fraction` with, per measured window, what the spans show
    beyond its timed seconds (at the current estimate) added — the cost its timed regions miss included."""
    every_changes: tuple[tuple[int, int], ...] = field(default=())
    """(window, every) at each change the budget made: ``every`` from that window on."""
    left_out_at_every_1: tuple[int, ...] = field(default=())
    """With a budget: windows (counted from 1) after which, at ``every = 1``, one window was left out to keep
    the span of a window left out measured."""

    def text(self) -> str:
        """One line: the cost over every window so far, what the budget holds now, the windows measured, and what
        the spans saw (a measured window's span beside one left out's)."""
        frac = "–" if math.isnan(self.fraction) else f"{self.fraction:.2%}"
        if self.budget is None:
            return (f"noise monitor cost {frac} of the bare step over its windows (no budget); every {self.every}; "
                    f"{self.windows_measured:,} of {self.windows:,} windows measured, {self.windows_unmeasured:,} left out")
        parts = []
        if not math.isnan(self.fraction_all):
            parts.append(f"noise monitor cost {self.fraction_all:.2%} of the bare step over all {self.windows:,} windows "
                         f"({frac} in its timed regions), the first ones measured before the cost was known")
        else:
            parts.append(f"noise monitor cost {frac} of the bare step over all {self.windows:,} windows, the first "
                         "ones measured before the cost was known")
        now = "" if math.isnan(self.fraction_now) else f"{self.fraction_now:.2%} "
        parts.append(f"now {now}at every {self.every}, budget {self.budget:.2%}")
        parts.append(f"{self.windows_measured:,} of {self.windows:,} windows measured, {self.windows_unmeasured:,} left out")
        if not math.isnan(self.wall_extra_s):
            longer = "longer" if self.wall_extra_s >= 0 else "shorter (inside the steps' jitter)"
            parts.append(f"spans: a measured window {abs(self.wall_extra_s) * 1e6:,.0f} µs {longer} than one left out, "
                         f"{self.timed_window_s * 1e6:,.0f} µs in timed regions")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]


def parse_budget(text: object, field: str = "budget") -> float:
    """A budget typed as a fraction (``0.02``) or a percentage (``2%``) → the fraction, 0 < budget < 1.

    Raises:
        SettingError: naming ``field`` (the CLI renames it to its flag), with what is allowed.
    """
    from globalbatch.errors import Raw, SettingError

    allowed = "a fraction of the step time, 0 < budget < 1 (0.02 or 2%)"
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100.0 if raw.endswith("%") else float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0.0 < value < 1.0):  # "nan", "inf", "0", "150%", "2 %%"
        raise SettingError(field, Raw(raw), allowed)
    return value


def _iqm(values: deque[float]) -> float:
    """The interquartile mean: the mean of the middle half (a descheduled window is an outlier)."""
    v = sorted(values)
    q = len(v) // 4
    return statistics.fmean(v[q:len(v) - q])


def _iqm_se(values: deque[float]) -> float:
    """The standard error of :func:`_iqm` (Tukey–McLaughlin): the SD of the values winsorized at the same
    quartiles over (1 − 2·0.25)·√k."""
    v = sorted(values)
    k, q = len(v), len(v) // 4
    if k < 2:
        return 0.0
    w = [min(max(x, v[q]), v[k - 1 - q]) for x in v]
    return statistics.stdev(w) / (0.5 * math.sqrt(k))


class EveryController:
    """``every`` from the measured cost, within ``budget`` (see the module docstring).

    The timed seconds c_m, c_u are the means of their last ``samples`` readings. On a shared machine a
    region of a few microseconds sometimes reads milliseconds (the process was descheduled inside it);
    the steps are descheduled as often per second, so the ratio of means prices that at its rate, where
    medians would leave it out of the monitor's regions and keep it in the (long) steps. The spans are
    compared in neighbouring pairs (a measured window and the window left out just before or after it),
    so that a drift of the step time (load, sequence length, a schedule) drops out, and the pairs'
    differences are averaged over their middle half (interquartile mean of the last ``samples``): a window
    in which the process was descheduled is an outlier. ``every`` at most doubles per decision, so one outlier moves it by
    a factor 2 at most.

    Args:
        budget: the cost allowed, a fraction of the bare step time (0 < budget < 1).
        every: the starting value.
        hysteresis: ``every`` falls only when a smaller one costs ≤ budget / (1 + hysteresis).
        samples: readings kept of each kind (the means are over these).
        warmup: measured windows left out of c_m at the start (the first builds buffers); the first
            ``warmup + 1`` windows give no span.
        min_spans: pairs of neighbouring spans (one measured, one left out) needed before they price a
            measured window.
        probe_every: at ``every = 1``, one window in this many is left out (one in 4 until ``min_spans``
            spans of windows left out are known), so that W_u stays measured.
    """

    def __init__(self, budget: float, *, every: int = 1, hysteresis: float = 0.25, samples: int = 64,
                 warmup: int = 1, every_max: int = EVERY_MAX, min_spans: int = 8, probe_every: int = 16) -> None:
        self.budget = budget
        self.every = every
        self.hysteresis = hysteresis
        self.warmup = warmup
        self.every_max = every_max
        self.min_spans = min_spans
        self.probe_every = probe_every
        self._cm: deque[float] = deque(maxlen=samples)   # the monitor's timed seconds in measured windows
        self._cu: deque[float] = deque(maxlen=samples)   # ... in windows left out
        self._t: deque[float] = deque(maxlen=samples)    # spans less the timed seconds
        self._pairs: deque[float] = deque(maxlen=samples)  # span of a measured window − span of a neighbour left out
        self._prev: tuple[bool, float] | None = None       # the previous window: measured?, its span
        self._arm: deque[float] = deque(maxlen=samples)  # (un)hooking seconds per measured window
        self._fold = 0.0
        self._seen_measured = 0
        self._seen = 0
        self._since_left_out = 0                         # measured windows in a row

    @property
    def timed_measured(self) -> float | None:
        """The timed seconds of a measured window (its own regions, (un)hooking included; no folds)."""
        if not self._cm:
            return None
        return statistics.fmean(self._cm) + (statistics.fmean(self._arm) if self._arm else 0.0)

    @property
    def wall_extra(self) -> float | None:
        """How much longer a measured window's span is than a neighbouring window left out's: the IQM of
        the differences of neighbouring pairs (None before ``min_spans`` pairs)."""
        if len(self._pairs) < self.min_spans:
            return None
        return _iqm(self._pairs)

    @property
    def c_measured(self) -> float | None:
        """c_m: a measured window's cost over the bare step (the larger of the timed seconds and the spans'
        difference plus c_u), (un)hooking and the folds' seconds per measured window included."""
        return self._c_measured(upper=False)

    @property
    def c_measured_upper(self) -> float | None:
        """c_m with the spans' difference at its IQM + 2 standard errors: what the decisions price."""
        return self._c_measured(upper=True)

    def _c_measured(self, *, upper: bool) -> float | None:
        timed = self.timed_measured
        if timed is None:
            return None
        extra = self.wall_extra
        if extra is not None and upper:
            extra += 2.0 * _iqm_se(self._pairs)
        arm = statistics.fmean(self._arm) if self._arm else 0.0
        by_walls = extra + (self.c_unmeasured or 0.0) + arm if extra is not None else -math.inf
        return max(timed, by_walls) + self._fold

    @property
    def untimed(self) -> float | None:
        """What the spans show a measured window to cost beyond its timed seconds (≥ 0; None before they are known)."""
        extra, timed = self.wall_extra, self.timed_measured
        if extra is None or timed is None:
            return None
        arm = statistics.fmean(self._arm) if self._arm else 0.0
        return max(0.0, extra + (self.c_unmeasured or 0.0) + arm - timed)

    @property
    def c_unmeasured(self) -> float | None:
        return statistics.fmean(self._cu) if self._cu else None

    @property
    def step(self) -> float | None:
        """T, the bare step: the mean span less the timed seconds, over the recent windows of both kinds."""
        return statistics.fmean(self._t) if self._t else None

    def cost_at(self, n: int, *, upper: bool = False) -> float:
        """The fraction of the bare step that one window in ``n`` costs, from the current estimates (``upper``:
        at :attr:`c_measured_upper`)."""
        cm, cu, t = self._c_measured(upper=upper), self.c_unmeasured or 0.0, self.step
        if cm is None or not t:
            return math.nan
        return (cm + (n - 1) * cu) / (n * t)

    def needed(self, budget: float) -> int:
        """The smallest ``every`` whose cost (at :attr:`c_measured_upper`) is within ``budget``."""
        cm, cu, t = self.c_measured_upper, self.c_unmeasured or 0.0, self.step
        if cm is None or not t:
            return self.every
        if cm <= budget * t:
            return 1
        room = budget * t - cu
        if room <= 0:
            return self.every_max
        return max(1, min(self.every_max, math.ceil((cm - cu) / room - 1e-12)))

    def leave_out_next(self) -> bool:
        """After a measured window at ``every = 1``: leave the next window out (to keep W_u measured)."""
        if self.every != 1:
            return False
        return self._since_left_out >= (self.probe_every if len(self._pairs) >= self.min_spans else 4)

    def update(self, *, measured: bool, monitor_s: float, step_s: float | None, fold_s_per_window: float = 0.0,
               arm_s: float = 0.0) -> int:
        """One window's readings: the monitor's timed seconds in it (folds and (un)hooking excluded), its
        span less those seconds (None when unknown: the first window), the folds' seconds per measured
        window so far and, for a measured window, the seconds of the hooks' (un)registration it caused.
        Returns ``every`` for the windows that follow; it changes only after a measured window."""
        self._seen += 1
        span_ok = step_s is not None and step_s > 0 and self._seen > self.warmup + 1
        span = (step_s or 0.0) + monitor_s  # the window's span: its bare step and the timed seconds
        if step_s is not None and step_s > 0:
            self._t.append(step_s)
        prev, self._prev = self._prev, ((measured, span) if span_ok else None)
        if span_ok and prev is not None and prev[0] != measured:  # a measured window beside one left out
            self._pairs.append(span - prev[1] if measured else prev[1] - span)
        if not measured:
            self._cu.append(monitor_s)
            self._since_left_out = 0
            return self.every
        self._since_left_out += 1
        self._seen_measured += 1
        if self._seen_measured <= self.warmup:
            return self.every
        self._cm.append(monitor_s)
        self._arm.append(arm_s)
        self._fold = fold_s_per_window
        if not self._t:
            return self.every
        if self.cost_at(self.every, upper=True) > self.budget:
            self.every = min(max(self.every, self.needed(self.budget)), 2 * self.every)
        else:
            lower = self.needed(self.budget / (1.0 + self.hysteresis))
            if lower < self.every:
                self.every = lower
        return self.every
