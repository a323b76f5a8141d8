"""NoiseConfig: what :class:`~globalbatch.noise.NoiseScaleMonitor` measures and how it smooths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from globalbatch.errors import SettingError
from globalbatch.validate import number, whole

__all__ = ["SOURCES", "NoiseConfig"]

SOURCES = ("micro", "rank")


def _check_every(every: Any) -> int:
    return whole(every, "every", allowed="a whole number ≥ 1 (measure one window in n)")


@dataclass(kw_only=True)
class NoiseConfig:
    """What :class:`NoiseScaleMonitor` measures and how it smooths."""

    sources: tuple[str, ...] = SOURCES
    """Small-batch sources: ``"micro"`` (micro-batches of the accumulation window, pooled over
    ranks) and/or ``"rank"`` (each DP rank's window gradient before the all-reduce). A source
    that cannot apply (``"rank"`` on one process) is left out; none left is a ValueError."""
    half_life: float | None = None
    """EMA half-life in units of the loss (tokens for a token-mean loss); None: ``half_life_windows``
    times the first window's global batch. ``math.inf``: the **plain mean over every measured
    window** — the read-out to use at fixed parameters (lr 0, a frozen checkpoint), where there is
    no drift to forget and the plain mean is the most precise estimate."""
    half_life_windows: float = 20.0
    """Half-life in windows of the first global batch, used when ``half_life`` is None."""
    every: int = 1
    """Measure one window in ``every`` (the others cost nearly nothing); changeable at any time
    through ``monitor.every``. The EMA still forgets per trained unit. With a ``budget``: the
    starting value, which the monitor then adapts."""
    budget: float | None = None
    """The monitor's cost allowed, as a fraction of the bare step time (``0.02``: 2 %). The monitor
    times its own hooks, callbacks and folds (host clock, no device sync) and picks ``every`` — the
    smallest within the budget, with hysteresis — after each measured window
    (:mod:`globalbatch.noise.budget`); ``monitor.cost()`` reports what it measured. None (the
    default): every ``every``-th window is measured, whatever it costs (the cost is still reported)."""
    adam: bool = False
    """Also estimate the *Adam-preconditioned variant*, g/(√v̂ + eps), from the optimizer's
    ``exp_avg_sq`` (costs one more gradient-sized buffer and one multiply per norm)."""
    confidence: float = 0.95
    """Two-sided level of the Fieller interval."""
    min_windows: int = 3
    """Fewer windows than this flags an estimate ``"few_windows"``."""
    max_relative_stderr: float = 0.5
    """stderr / B_simple above this flags ``"too_noisy"``."""
    max_interval_ratio: float = 2.0
    """high / low of the interval above this flags ``"wide_interval"`` (``math.inf``: never)."""

    def __post_init__(self) -> None:
        if isinstance(self.sources, str):
            self.sources = (self.sources,)
        bad = [s for s in self.sources if s not in SOURCES]
        if bad or not self.sources:
            raise SettingError("sources", self.sources, f"a non-empty subset of {SOURCES}")
        if self.half_life is not None and not self.half_life > 0:
            raise SettingError("half_life", self.half_life, "> 0 units, None or math.inf")
        if not self.half_life_windows > 0:
            raise SettingError("half_life_windows", self.half_life_windows, "> 0")
        _check_every(self.every)
        if self.budget is not None:
            number(self.budget, "budget", low=0.0, high=1.0, low_open=True, high_open=True,
                   allowed="a fraction of the step time, 0 < budget < 1 (0.02: 2 %), or None")
        if not 0.0 < self.confidence < 1.0:
            raise SettingError("confidence", self.confidence, "0 < confidence < 1")
        whole(self.min_windows, "min_windows", minimum=2)
        if not self.max_relative_stderr > 0:
            raise SettingError("max_relative_stderr", self.max_relative_stderr, "> 0")
        if not self.max_interval_ratio > 1:
            raise SettingError("max_interval_ratio", self.max_interval_ratio, "> 1 (or math.inf)")
