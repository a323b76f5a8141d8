"""The noise monitor's cost budget: how often to measure (``every``) from the cost it measured.

The monitor times its own work with a host clock (``time.perf_counter``): the parameter hooks,
its callbacks and the folds. No device sync is added: on an accelerator this is the host time of
its launches and Python, not the device time of its norm kernels. :class:`EveryController`
turns those timings into ``every``: with c_m the monitor's seconds in a measured window, c_u in a
window it leaves out and T the bare step (the window's wall time less the monitor's), one window
in n costs (c_m + (n − 1)·c_u) / (n·T). The smallest n within the budget is

    n* = ⌈(c_m − c_u) / (budget·T − c_u)⌉           (every_max when budget·T ≤ c_u)

``every`` rises (at most doubling per measured window) when the cost at the current n is over the
budget, and falls only when the cost at a smaller n is under budget / (1 + hysteresis): a cost
that stays in that band leaves ``every`` where it is. c_m, c_u and T are means of recent
readings. Which windows are measured depends on time only, never on a gradient, so the measured
windows are a subsample of the windows and the estimate stays unbiased.
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
    """The monitor's seconds in a measured window (smoothed; folds amortized in), NaN before one."""
    unmeasured_window_s: float
    """The monitor's seconds in a window left out (smoothed), NaN before one."""
    every_changes: tuple[tuple[int, int], ...] = field(default=())
    """(window, every) at each change the budget made: ``every`` from that window on."""

    def text(self) -> str:
        frac = "–" if math.isnan(self.fraction) else f"{self.fraction:.2%}"
        budget = "no budget" if self.budget is None else f"budget {self.budget:.2%}"
        if self.budget is not None and not math.isnan(self.fraction_now):
            budget = f"{self.fraction_now:.2%} now at every {self.every}, {budget}"
        return (f"noise monitor cost {frac} of the bare step over its windows ({budget}); every {self.every}; "
                f"{self.windows_measured:,} of {self.windows:,} windows measured, {self.windows_unmeasured:,} left out")

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


class EveryController:
    """``every`` from the measured cost, within ``budget`` (see the module docstring).

    c_m, c_u and T are the means of their last ``samples`` readings. On a shared machine a region of
    a few microseconds sometimes reads milliseconds (the process was descheduled inside it); the
    steps are descheduled as often per second, so the ratio of means prices that at its rate, where
    medians would leave it out of the monitor's regions and keep it in the (long) steps. ``every``
    at most doubles per decision, so one such reading moves it by a factor 2 at most.

    Args:
        budget: the cost allowed, a fraction of the bare step time (0 < budget < 1).
        every: the starting value.
        hysteresis: ``every`` falls only when a smaller one costs ≤ budget / (1 + hysteresis).
        samples: readings of c_m, c_u and T kept (the means are over these).
        warmup: measured windows left out of c_m at the start (the first builds buffers).
    """

    def __init__(self, budget: float, *, every: int = 1, hysteresis: float = 0.25, samples: int = 64,
                 warmup: int = 1, every_max: int = EVERY_MAX) -> None:
        self.budget = budget
        self.every = every
        self.hysteresis = hysteresis
        self.warmup = warmup
        self.every_max = every_max
        self._cm: deque[float] = deque(maxlen=samples)   # the monitor's seconds in measured windows (no folds)
        self._cu: deque[float] = deque(maxlen=samples)   # ... in windows left out
        self._t: deque[float] = deque(maxlen=samples)    # bare step seconds
        self._fold = 0.0
        self._seen_measured = 0

    @property
    def c_measured(self) -> float | None:
        """c_m: the mean of the measured windows' seconds, plus the folds' seconds per measured window."""
        return statistics.fmean(self._cm) + self._fold if self._cm else None

    @property
    def c_unmeasured(self) -> float | None:
        return statistics.fmean(self._cu) if self._cu else None

    @property
    def step(self) -> float | None:
        return statistics.fmean(self._t) if self._t else None

    def cost_at(self, n: int) -> float:
        """The fraction of the bare step that one window in ``n`` costs, from the current estimates."""
        cm, cu, t = self.c_measured, self.c_unmeasured or 0.0, self.step
        if cm is None or not t:
            return math.nan
        return (cm + (n - 1) * cu) / (n * t)

    def needed(self, budget: float) -> int:
        """The smallest ``every`` whose cost is within ``budget``."""
        cm, cu, t = self.c_measured, self.c_unmeasured or 0.0, self.step
        if cm is None or not t:
            return self.every
        if cm <= budget * t:
            return 1
        room = budget * t - cu
        if room <= 0:
            return self.every_max
        return max(1, min(self.every_max, math.ceil((cm - cu) / room - 1e-12)))

    def update(self, *, measured: bool, monitor_s: float, step_s: float | None, fold_s_per_window: float = 0.0) -> int:
        """One window's timings: the monitor's seconds in it (folds excluded), its bare step seconds
        (None for the first window), and the folds' seconds per measured window so far. Returns
        ``every`` for the windows that follow; it changes only after a measured window."""
        if step_s is not None and step_s > 0:
            self._t.append(step_s)
        if not measured:
            self._cu.append(monitor_s)
            return self.every
        self._seen_measured += 1
        if self._seen_measured <= self.warmup:
            return self.every
        self._cm.append(monitor_s)
        self._fold = fold_s_per_window
        if not self._t:
            return self.every
        if self.cost_at(self.every) > self.budget:
            self.every = min(max(self.every, self.needed(self.budget)), 2 * self.every)
        else:
            lower = self.needed(self.budget / (1.0 + self.hysteresis))
            if lower < self.every:
                self.every = lower
        return self.every
