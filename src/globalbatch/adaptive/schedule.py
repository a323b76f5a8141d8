"""The adaptive schedule: a :class:`~globalbatch.schedule.BatchSchedule` decided online by a policy, and
its history of :class:`BatchChange` s (the module docstring of :mod:`globalbatch.adaptive` has the steps)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

from globalbatch.adaptive.policies import BatchPolicy, Observation, _RunPoint
from globalbatch.adaptive.rules import ADAPTIVE_LR_RULES, FeasibleBatches, lr_multiplier
from globalbatch.errors import SettingError
from globalbatch.schedule import BatchSchedule, _check_unit
from globalbatch.validate import whole

logger = logging.getLogger("globalbatch.adaptive")  # the package's one logger


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
