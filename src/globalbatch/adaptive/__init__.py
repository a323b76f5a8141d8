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

Modules: :mod:`~globalbatch.adaptive.rules` (statistical efficiency, the LR rules, the feasible batches),
:mod:`~globalbatch.adaptive.policies` (the observation, the policy protocol and the two policies) and
:mod:`~globalbatch.adaptive.schedule` (the schedule, its decisions and history). Pure Python except the
collectives (torch imported lazily); no lab imports.
"""

from globalbatch.adaptive.policies import (
    BatchPolicy,
    GoodputPolicy,
    NoiseTrackingPolicy,
    Observation,
    Proposal,
)
from globalbatch.adaptive.rules import (
    ADAPTIVE_LR_RULES,
    FeasibleBatches,
    adascale_gain,
    loglog_interpolate,
    lr_multiplier,
    statistical_efficiency,
)
from globalbatch.adaptive.schedule import AdaptiveBatchSchedule, BatchChange

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

