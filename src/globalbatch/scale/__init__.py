"""``globalbatch scale``: from a small sweep to the batch schedule and GPU count that reach a target loss.

- :mod:`~globalbatch.scale.convergence`: steps and tokens to a loss for a constant batch or a ramp
  (McCandlish et al. 2018 eq. 2.11 and App. D) from B_crit(L) and S_min(L): a sweep's fit or a labelled prior.
- :mod:`~globalbatch.scale.cluster`: the step time on a cluster (compute from an MFU curve, α–β collectives as
  NCCL's model, overlap, pipeline bubble, the memory bound on the micro-batch), presets and YAML clusters.
- :mod:`~globalbatch.scale.search`: GPU counts × geometries × batches and ramps, for time, cost or the Pareto front.

Pure arithmetic (numpy, scipy): no torch; imports only ``globalbatch.plan``, ``globalbatch._util`` and
``globalbatch.validate`` from the project.
"""

from globalbatch.scale.cluster import (
    PRESETS,
    Cluster,
    ModelSpec,
    StepTime,
    ThroughputCurve,
    allreduce_time,
    cluster_from_mapping,
    default_mfu_curve,
    dp_bookkeeping_time,
    dp_comm_time,
    largest_micro,
    load_cluster,
    mfu_curve_from_probe,
    ring_collective_time,
    step_overhead_time,
    step_time,
    tree_allreduce_time,
)
from globalbatch.scale.convergence import (
    BCritLaw,
    ConvergenceModel,
    ScheduleCost,
    SMinLaw,
    deepseek_batch_prior,
    fit_s_min,
    kaplan_prior,
)
from globalbatch.scale.search import (
    OBJECTIVES,
    Choice,
    RampChoice,
    ScaleConfig,
    ScaleResult,
    format_count,
    gpu_counts,
    scale,
    schedule_string,
)

__all__ = ["PRESETS", "Cluster", "ModelSpec", "StepTime", "ThroughputCurve", "allreduce_time", "cluster_from_mapping",
           "default_mfu_curve", "dp_bookkeeping_time", "dp_comm_time", "largest_micro", "load_cluster", "mfu_curve_from_probe",
           "ring_collective_time", "tree_allreduce_time", "step_time", "step_overhead_time", "BCritLaw", "ConvergenceModel", "ScheduleCost",
           "SMinLaw", "deepseek_batch_prior", "fit_s_min", "kaplan_prior", "OBJECTIVES", "Choice", "RampChoice",
           "ScaleConfig", "ScaleResult", "format_count", "gpu_counts", "scale", "schedule_string"]
