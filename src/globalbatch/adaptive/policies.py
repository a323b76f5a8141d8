"""What a policy decides from (:class:`Observation`), what it answers (:class:`Proposal`), the protocol
(:class:`BatchPolicy`) and the two policies: noise tracking (McCandlish et al. 2018, B = c·B_simple) and
goodput (Pollux, Qiao et al., OSDI 2021)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from globalbatch.adaptive.rules import FeasibleBatches, _usable, loglog_interpolate, statistical_efficiency
from globalbatch.errors import SettingError


@dataclass(frozen=True, kw_only=True, slots=True)
class _RunPoint:
    """Where in the run a decision is taken: what an :class:`Observation` and a :class:`BatchChange` share."""

    step: int
    """Optimizer steps applied so far (when the policy was asked)."""
    position: int
    """Schedule position (trained units in the schedule's unit); a change applies from it."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class Observation(_RunPoint):
    """What a policy decides from: globally shared values (identical on every rank)."""

    global_batch: int
    """Current global batch (samples)."""
    base_batch: int
    """The first batch B₀ (samples)."""
    b_simple: float
    """B_simple EMA in samples (NaN when unknown or not reportable)."""
    b_simple_low: float
    """Lower end of its interval, samples (NaN when unbounded)."""
    b_simple_high: float
    """Upper end of its interval, samples (NaN when unbounded)."""
    units_per_s: float
    """Units/s of the current batch (mean over ranks of the driver's last-step rate; NaN unknown)."""
    units_per_sample: float
    """Loss-bearing units per sample in the last window (tokens per sequence)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Proposal:
    """A policy's answer: the batch it wants (samples) and why."""

    batch: int
    reason: str


@runtime_checkable
class BatchPolicy(Protocol):
    """A user-pluggable policy: ``propose`` returns a feasible batch (it may return the current one).

    Optional ``state_dict()`` / ``load_state_dict(d)`` (plain Python values) are checkpointed with the
    schedule. ``propose`` must be deterministic in its arguments and its state: every rank calls it with
    the same observation and must answer the same.
    """

    name: str

    def propose(self, obs: Observation, feasible: FeasibleBatches) -> Proposal: ...


@dataclass(kw_only=True)
class NoiseTrackingPolicy:
    """B = c · B_simple, acting on the interval: grow only when c × the lower bound clears a larger batch."""

    c: float = 1.0
    """Target multiple of B_simple (McCandlish: B_crit ≈ B_noise; B_simple over-estimates B_noise under Adam-type
    preconditioning, so c < 1 may fit better — tune on separate seeds)."""
    use_interval: bool = True
    """Grow on the lower bound of the interval (False: on the point estimate)."""
    name: str = "noise"

    def __post_init__(self) -> None:
        if not (self.c > 0 and math.isfinite(self.c)):
            raise SettingError("c", self.c, "a finite number > 0")

    def propose(self, obs: Observation, feasible: FeasibleBatches) -> Proposal:
        cur = obs.global_batch
        grow_on = obs.b_simple_low if self.use_interval else obs.b_simple
        shrink_on = obs.b_simple_high if self.use_interval else obs.b_simple
        if not _usable(obs.b_simple):
            return Proposal(batch=cur if feasible.contains(cur) else feasible.floor(cur),
                            reason="hold: no reportable B_simple yet")
        up = self.c * grow_on if math.isfinite(grow_on) else math.nan
        nxt = feasible.next_above(cur)
        if nxt is not None and math.isfinite(up) and up >= nxt:
            b = feasible.floor(up)
            return Proposal(batch=b, reason=(f"grow: {self.c:g}×B_simple {'low ' if self.use_interval else ''}"
                                             f"{up:.1f} samples >= {b}"))
        down = self.c * shrink_on if math.isfinite(shrink_on) else math.nan
        if math.isfinite(down) and down < cur:
            b = feasible.ceil(down)
            return Proposal(batch=b, reason=(f"shrink: {self.c:g}×B_simple {'high ' if self.use_interval else ''}"
                                             f"{down:.1f} samples < {cur}"))
        return Proposal(batch=feasible.floor(cur) if not feasible.contains(cur) else cur,
                        reason=f"hold: {self.c:g}×B_simple {self.c * obs.b_simple:.1f} samples")


@dataclass(kw_only=True)
class GoodputPolicy:
    """Pollux goodput: throughput(B) × (B_noise + B₀)/(B_noise + B), maximised over the feasible batches."""

    throughput: dict[int, float] = field(default_factory=dict)
    """Samples/s per global batch (e.g. from the sweep's timing pass); batches in between are interpolated
    in log-log, beyond the measured ones held flat (no extrapolated speed-up)."""
    online: bool = True
    """Fold the measured rate of the running batch into the table (EMA with ``online_weight``)."""
    online_weight: float = 0.2
    """EMA weight of a new online measurement."""
    min_gain: float = 0.05
    """Change only when the best goodput beats the current one by this fraction (Pollux: 5 %)."""
    name: str = "goodput"

    def __post_init__(self) -> None:
        self.throughput = {int(k): float(v) for k, v in self.throughput.items()}
        if any(not (v > 0 and math.isfinite(v)) for v in self.throughput.values()):
            raise SettingError("throughput", self.throughput, "samples/s > 0 per batch")
        if not 0 < self.online_weight <= 1:
            raise SettingError("online_weight", self.online_weight, "0 < w <= 1")
        if not self.min_gain >= 0:
            raise SettingError("min_gain", self.min_gain, ">= 0")

    def samples_per_s(self, batch: int) -> float:
        """Interpolated throughput (log-log between measured batches, flat beyond them; NaN with none)."""
        return loglog_interpolate(sorted(self.throughput.items()), batch)

    def goodput(self, batch: int, b_noise: float, base_batch: int) -> float:
        return self.samples_per_s(batch) * statistical_efficiency(batch, b_noise, base_batch)

    def propose(self, obs: Observation, feasible: FeasibleBatches) -> Proposal:
        cur = obs.global_batch
        if self.online and math.isfinite(obs.units_per_s) and obs.units_per_s > 0 and obs.units_per_sample > 0:
            rate = obs.units_per_s / obs.units_per_sample
            old = self.throughput.get(cur)
            self.throughput[cur] = rate if old is None else (1 - self.online_weight) * old + self.online_weight * rate
        if not _usable(obs.b_simple) or not self.throughput:
            return Proposal(batch=feasible.floor(cur) if not feasible.contains(cur) else cur,
                            reason="hold: no B_simple or throughput yet")
        scores = {b: self.goodput(b, obs.b_simple, obs.base_batch) for b in feasible.candidates()}
        best = max(scores, key=lambda b: (scores[b], -b))
        now = scores.get(cur, self.goodput(cur, obs.b_simple, obs.base_batch))
        if best != cur and scores[best] > now * (1 + self.min_gain):
            return Proposal(batch=best, reason=(f"goodput {scores[best]:.4g} at {best} vs {now:.4g} at {cur} "
                                                f"(B_simple {obs.b_simple:.1f} samples)"))
        return Proposal(batch=cur if feasible.contains(cur) else feasible.floor(cur),
                        reason=f"hold: goodput {now:.4g} within {self.min_gain:.0%} of best")

    def state_dict(self) -> dict[str, Any]:
        return {"throughput": [[int(k), float(v)] for k, v in sorted(self.throughput.items())]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.throughput = {int(k): float(v) for k, v in state["throughput"]}

