"""The arithmetic of an adaptive batch: statistical efficiency, the LR rules, the feasible batches.

E(B) = (B_noise + B₀)/(B_noise + B) (McCandlish et al. 2018, arXiv 1812.06162; Pollux, Qiao et al.,
OSDI 2021); the AdaScale gain r = S·E(B) (Johnson et al., ICML 2020).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from globalbatch.errors import SettingError
from globalbatch.validate import whole

ADAPTIVE_LR_RULES = ("sqrt", "linear", "adascale", "none")
"""How the LR follows an adaptive change (see the module docstring)."""


def statistical_efficiency(batch: float, b_noise: float, base_batch: float) -> float:
    """McCandlish/Pollux E(B) = (B_noise + B₀)/(B_noise + B): progress per sample at B relative to B₀."""
    return (b_noise + base_batch) / (b_noise + batch)


def adascale_gain(batch: float, b_noise: float, base_batch: float) -> float:
    """AdaScale gain r = (σ² + μ²)/(σ²/S + μ²), S = B/B₀, σ²/μ² = B_noise/B₀: equals S·E(B) (1 ≤ r ≤ S)."""
    return (batch / base_batch) * statistical_efficiency(batch, b_noise, base_batch)


def lr_multiplier(rule: str, batch: float, base_batch: float, b_noise: float = math.nan) -> float:
    """The factor on the base LR at ``batch`` under ``rule`` (adascale needs a finite ``b_noise`` in samples,
    else falls back to sqrt)."""
    s = batch / base_batch
    if rule == "sqrt":
        return math.sqrt(s)
    if rule == "linear":
        return s
    if rule == "none":
        return 1.0
    if rule == "adascale":
        return adascale_gain(batch, b_noise, base_batch) if math.isfinite(b_noise) and b_noise >= 0 else math.sqrt(s)
    raise SettingError("lr_rule", rule, ", ".join(ADAPTIVE_LR_RULES))


def loglog_interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """y at ``x`` from points ``(x_i, y_i > 0)`` sorted by x: linear in log-log between the two that bracket
    it, the end point's y beyond either end (flat: no extrapolation); NaN without points or for a NaN ``x``."""
    if not points or math.isnan(x):
        return math.nan
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp((1 - w) * math.log(y0) + w * math.log(y1))
    raise RuntimeError(f"points not sorted by x: {list(points)}")


def _usable(b_noise: float) -> bool:
    """A noise scale a policy may act on: finite and >= 0."""
    return math.isfinite(b_noise) and b_noise >= 0


@dataclass(frozen=True, kw_only=True, slots=True)
class FeasibleBatches:
    """The global batches (samples) a run may take: multiples of micro_batch × dp_world_size in bounds."""

    micro_batch: int
    """Samples per forward/backward on one rank."""
    dp_world_size: int = 1
    """Data-parallel ranks."""
    min_batch: int
    """Smallest allowed global batch (samples)."""
    max_batch: int
    """Largest allowed global batch (samples)."""
    powers_of_two: bool = False
    """Only batches that are powers of two."""

    def __post_init__(self) -> None:
        whole(self.micro_batch, "micro_batch")
        whole(self.dp_world_size, "dp_world_size")
        whole(self.min_batch, "min_batch")
        whole(self.max_batch, "max_batch")
        if self.max_batch < self.min_batch:
            raise SettingError("max_batch", self.max_batch, f">= min_batch {self.min_batch}")
        if not self.candidates():
            raise SettingError(
                "max_batch", self.max_batch, f"a range [min_batch, max_batch] holding a multiple of micro_batch "
                f"{self.micro_batch} × dp_world_size {self.dp_world_size} = {self.quantum}"
                + (" that is a power of two" if self.powers_of_two else ""),
                why=f"no feasible global batch in [{self.min_batch}, {self.max_batch}]")

    @property
    def quantum(self) -> int:
        """micro_batch × dp_world_size: every feasible batch is a multiple of it."""
        return self.micro_batch * self.dp_world_size

    def candidates(self) -> list[int]:
        """Every feasible batch, ascending."""
        q = self.quantum
        first = -(-self.min_batch // q) * q
        out = list(range(first, self.max_batch + 1, q))
        if self.powers_of_two:
            out = [b for b in out if b & (b - 1) == 0]
        return out

    def contains(self, batch: int) -> bool:
        """True when ``batch`` is feasible."""
        return batch in set(self.candidates())

    def floor(self, batch: float) -> int:
        """The largest feasible batch <= ``batch`` (the smallest feasible one when none is; NaN: the smallest)."""
        c = self.candidates()
        if not math.isfinite(batch) and batch > 0:
            return c[-1]
        below = [b for b in c if b <= batch]
        return below[-1] if below else c[0]

    def ceil(self, batch: float) -> int:
        """The smallest feasible batch >= ``batch`` (the largest feasible one when none is)."""
        c = self.candidates()
        above = [b for b in c if b >= batch]
        return above[0] if above else c[-1]

    def next_above(self, batch: int) -> Optional[int]:
        """The next feasible batch above ``batch`` (None at the top)."""
        return next((b for b in self.candidates() if b > batch), None)

