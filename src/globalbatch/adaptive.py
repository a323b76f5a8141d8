"""An adaptive global batch: the next batch decided online from the measured noise scale or goodput.

:class:`AdaptiveBatchSchedule` is a :class:`~globalbatch.schedule.BatchSchedule` (so it plugs
into :class:`~globalbatch.step.StepDriver` like the fixed ones) and a driver callback. Every
``decide_every`` applied steps it

1. reads an :class:`Observation` — B_simple with its interval from a
   :class:`~globalbatch.noise.NoiseScaleMonitor` (``estimate()`` only), the driver's units/s and
   units per sample;
2. makes it one value all ranks share: the float64 vector is all-reduced (mean over the DP
   group) and then broadcast from rank 0, so every rank feeds bit-identical numbers to the
   policy and takes the same decision (two tiny collectives per decision, none per micro-batch);
3. asks the policy (:class:`BatchPolicy`) for a batch; snaps it to :class:`FeasibleBatches`
   (multiples of micro-batch × DP ranks, optionally powers of two, within bounds);
4. applies hysteresis — the same direction ``patience`` decisions in a row — a minimum of
   ``min_interval_steps`` steps between changes, and, by default, never shrinks;
5. records the change (position, old → new batch, LR multiplier, reason) in its history,
   logs it, and moves the driver to it (:meth:`StepDriver.refresh_batch`), which rescales the LR.

``batch_at(position)`` reads the history, so the driver re-derives the batch from the
schedule position on resume exactly as for a fixed schedule; the history and the policy's state
travel in the driver's ``state_dict`` (hence in :func:`globalbatch.checkpoint.save_checkpoint`):
resume across a change is bitwise.

Policies:

* :class:`NoiseTrackingPolicy` — B = c · B_simple (McCandlish et al. 2018, arXiv 1812.06162,
  B_crit ≈ B_noise), using the EMA estimate's Fieller interval: grow only when c × the *lower*
  bound clears the next feasible batch (shrink only when c × the upper bound is below the
  current one).
* :class:`GoodputPolicy` — Pollux (Qiao et al., OSDI 2021): goodput = throughput × statistical
  efficiency, E(B) = (B_noise + B₀)/(B_noise + B) (McCandlish's form, B₀ the initial batch), with the
  throughput at B (a measured table — e.g. the sweep's timing pass — updated online with the
  batches actually run); the feasible batch maximising goodput = throughput × E is chosen when it
  beats the current goodput by ``min_gain`` (Pollux: 5 %).
* any object with ``propose(observation, feasible) -> Proposal`` (:class:`BatchPolicy`).

LR rules at a change (relative to the first batch B₀, S = B/B₀): ``sqrt`` (× √S, Adam-type),
``linear`` (× S, SGD), ``adascale`` (the gain ratio of AdaScale SGD, Johnson et al., ICML 2020:
r = (σ² + μ²)/(σ²/S + μ²) = S·(B_simple + B₀)/(B_simple + B), B_simple in samples, evaluated at
the change and then held), ``none``.

Pure Python except the collectives (torch imported lazily); no lab imports.
"""

from __future__ import annotations

from globalbatch.errors import SettingError
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

from globalbatch.schedule import BatchSchedule, _check_unit
from globalbatch.validate import whole

__all__ = [
    "ADAPTIVE_LR_RULES",
    "FeasibleBatches",
    "Observation",
    "Proposal",
    "BatchPolicy",
    "NoiseTrackingPolicy",
    "GoodputPolicy",
    "BatchChange",
    "AdaptiveBatchSchedule",
    "statistical_efficiency",
    "adascale_gain",
    "lr_multiplier",
    "loglog_interpolate",
]

logger = logging.getLogger(__name__)

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


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchChange(_RunPoint):
    """One decided change, in the schedule's history (from ``position`` on)."""

    old_batch: int
    """The global batch before (samples)."""
    new_batch: int
    """The global batch from ``position`` on (samples)."""
    lr_mult: float
    """LR multiplier (relative to the first batch) from this change on."""
    reason: str
    """The policy's reason, one line."""


class AdaptiveBatchSchedule(BatchSchedule):
    """A batch schedule decided online by a policy; the driver calls its ``on_step_end`` after its callbacks.

    Pass it once, as ``StepConfig(batch_schedule=...)``, with the noise monitor among the driver's callbacks.

    Args:
        policy: a :class:`BatchPolicy`.
        feasible: the allowed batches (its ``quantum`` must match the driver's micro-batch × DP).
        initial_batch: the first batch B₀ (must be feasible).
        monitor: an object with ``estimate()`` returning ``b_simple``, ``low``, ``high``, ``unit`` and ``ok``
            (a :class:`~globalbatch.noise.NoiseScaleMonitor`); None: the driver gives it the noise monitor
            among its callbacks.
        lr_rule: ``sqrt``, ``linear``, ``adascale`` or ``none``.
        unit: deprecated (FutureWarning): positions count the run's unit, ``StepConfig.unit``.
        decide_every: applied steps between decisions.
        min_interval_steps: applied steps between two changes.
        patience: consecutive decisions in the same direction before a change (hysteresis).
        allow_decrease: let the batch shrink (default: non-decreasing).
    """

    def __init__(self, policy: BatchPolicy, feasible: FeasibleBatches, initial_batch: int, *, monitor: Any = None,
                 lr_rule: str = "sqrt", unit: Optional[str] = None, decide_every: int = 10, min_interval_steps: int = 50,
                 patience: int = 2, allow_decrease: bool = False) -> None:
        _check_unit(unit, "AdaptiveBatchSchedule")
        if lr_rule not in ADAPTIVE_LR_RULES:
            raise SettingError("lr_rule", lr_rule, ", ".join(ADAPTIVE_LR_RULES))
        if not callable(getattr(policy, "propose", None)):
            raise SettingError("policy", policy, "an object with propose(observation, feasible)")
        if not feasible.contains(initial_batch):
            raise SettingError("initial_batch", initial_batch, f"a feasible batch, one of {feasible.candidates()}")
        self.policy = policy
        self.feasible = feasible
        self.initial_batch = int(initial_batch)
        self.monitor = monitor
        self.lr_rule = lr_rule
        self.unit = unit
        self.decide_every = whole(decide_every, "decide_every")
        self.min_interval_steps = whole(min_interval_steps, "min_interval_steps", minimum=0)
        self.patience = whole(patience, "patience")
        self.allow_decrease = bool(allow_decrease)
        self.history: list[BatchChange] = []
        self.decisions: list[dict[str, Any]] = []
        """Every decision taken (observation, proposal, outcome): for logs and tests."""
        self._streak = 0  # signed count of consecutive proposals in one direction
        self._last_change_step = 0
        self.last_local: list[float] = []

    def attach(self, monitor: Any) -> "AdaptiveBatchSchedule":
        """Set the noise monitor explicitly; returns self. Usually not needed: the driver gives a schedule
        without a monitor the noise monitor among its callbacks."""
        self.monitor = monitor
        return self

    # ------------------------------------------------------------------ BatchSchedule

    def _current(self, position: int) -> Optional[BatchChange]:
        last = None
        for ch in self.history:
            if ch.position <= position:
                last = ch
            else:
                break
        return last

    def batch_at(self, position: int) -> int:
        if position < 0:
            raise SettingError("position", position, ">= 0")
        ch = self._current(position)
        return ch.new_batch if ch is not None else self.initial_batch

    def all_batches(self) -> list[int]:
        return self.feasible.candidates()

    @property
    def first_batch(self) -> int:
        return self.initial_batch

    def lr_multiplier(self, global_batch: int) -> float:
        """The multiplier recorded with the latest change to ``global_batch`` (1 for the first batch)."""
        for ch in reversed(self.history):
            if ch.new_batch == global_batch:
                return ch.lr_mult
        if global_batch == self.initial_batch:
            return 1.0
        return lr_multiplier("sqrt" if self.lr_rule == "adascale" else self.lr_rule, global_batch, self.initial_batch)

    # ------------------------------------------------------------------ deciding

    def _local_observation(self, driver: Any, result: Any) -> list[float]:
        nan = math.nan
        b, lo, hi = nan, nan, nan
        ups = result.global_units / result.global_samples if result.global_samples else nan
        if self.monitor is not None:
            try:
                est = self.monitor.estimate()  # host sync: decision steps only
            except ValueError:
                est = None
            # act on any estimate with a positive |G|² (a "too_noisy" one has a wide or unbounded interval, which the
            # interval-based policies handle); none before the first windows
            if est is not None and not {"no_windows", "g_sq_nonpositive"} & set(est.flags):
                # the estimate's unit -> samples
                to_samples = 1.0 if est.unit == "sample" else (1.0 / ups if ups > 0 else nan)
                b, lo, hi = est.b_simple * to_samples, est.low * to_samples, est.high * to_samples
        return [b, lo, hi, float(result.units_per_s), ups]

    def _shared(self, driver: Any, values: list[float]) -> list[float]:
        """Mean over the DP group, then rank 0's copy broadcast: every rank holds the same bits."""
        world = getattr(driver, "dp_world_size", 1)
        if world <= 1:
            return values
        import torch
        import torch.distributed as dist

        params = [p for p in driver.model.parameters()]
        device = params[0].device if params else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, group=driver.dp_group)
        t /= world
        src = dist.get_global_rank(driver.dp_group, 0) if driver.dp_group is not None else 0
        dist.broadcast(t, src=src, group=driver.dp_group)
        return t.tolist()  # host sync: decision steps only

    def on_step_end(self, driver: Any, result: Any) -> None:
        """Driver callback: every ``decide_every`` applied steps, decide and maybe change the batch."""
        if result.skipped or driver.optimizer_steps % self.decide_every:
            return
        self.last_local = self._local_observation(driver, result)  # this rank's own numbers (before sharing)
        b, lo, hi, ups_rate, ups = self._shared(driver, self.last_local)
        obs = Observation(step=driver.optimizer_steps, position=driver.schedule_position,
                          global_batch=driver.global_batch, base_batch=self.initial_batch, b_simple=b,
                          b_simple_low=lo, b_simple_high=hi, units_per_s=ups_rate, units_per_sample=ups)
        prop = self.policy.propose(obs, self.feasible)
        proposed = int(prop.batch)
        if not self.feasible.contains(proposed):  # a user policy's slip: snap rather than break the run
            proposed = self.feasible.floor(proposed)
        cur = driver.global_batch
        direction = (proposed > cur) - (proposed < cur)
        if direction < 0 and not self.allow_decrease:
            direction = 0
        self._streak = (self._streak + direction if direction and (self._streak * direction) > 0
                        else direction)
        waited = driver.optimizer_steps - self._last_change_step
        outcome = "hold"
        if direction and abs(self._streak) >= self.patience and waited >= self.min_interval_steps:
            mult = lr_multiplier(self.lr_rule, proposed, self.initial_batch, b)
            change = BatchChange(position=driver.schedule_position, step=driver.optimizer_steps, old_batch=cur,
                                 new_batch=proposed, lr_mult=mult, reason=prop.reason)
            self.history.append(change)
            self._streak = 0
            self._last_change_step = driver.optimizer_steps
            outcome = "change"
            if getattr(driver, "_log", True):
                logger.info("adaptive batch %d -> %d at step %d (%s): %s", cur, proposed, driver.optimizer_steps,
                            self.lr_rule, prop.reason)
            driver.refresh_batch()
        elif direction:
            outcome = "wait"
        self.decisions.append({**obs.as_dict(), "proposed": proposed, "outcome": outcome, "reason": prop.reason})

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (``weights_only`` loadable): history, hysteresis state, the policy's state."""
        pol = self.policy.state_dict() if hasattr(self.policy, "state_dict") else None
        return {"history": [c.as_dict() for c in self.history], "streak": self._streak,
                "last_change_step": self._last_change_step, "initial_batch": self.initial_batch, "policy": pol,
                "decisions": len(self.decisions)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["initial_batch"]) != self.initial_batch:
            raise SettingError("checkpoint initial_batch", state["initial_batch"],
                               f"the schedule's initial batch {self.initial_batch}")
        self.history = [BatchChange(**c) for c in state["history"]]
        self._streak = int(state["streak"])
        self._last_change_step = int(state["last_change_step"])
        if state.get("policy") is not None and hasattr(self.policy, "load_state_dict"):
            self.policy.load_state_dict(state["policy"])

    def summary(self) -> list[dict[str, Any]]:
        """The changes, as dicts (for reports)."""
        return [c.as_dict() for c in self.history]

    def __repr__(self) -> str:
        """The settings that define the run, never its decisions so far: checkpoints compare this text on resume
        (:func:`globalbatch.checkpoint.run_definition`), and the history is state, restored from the checkpoint."""
        name = getattr(self.policy, "name", type(self.policy).__name__)
        c = getattr(self.policy, "c", None)
        return (f"AdaptiveBatchSchedule(policy={name}{f', c={c!r}' if c is not None else ''}, feasible={self.feasible!r}, "
                f"initial_batch={self.initial_batch}, lr_rule={self.lr_rule}, "
                f"decide_every={self.decide_every}, min_interval_steps={self.min_interval_steps}, "
                f"patience={self.patience}, allow_decrease={self.allow_decrease})")
