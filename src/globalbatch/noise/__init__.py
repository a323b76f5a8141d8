"""The gradient noise scale B_simple = tr(Σ)/|G|², online, unbiased, with its uncertainty.

McCandlish, Kaplan, Amodei 2018, "An Empirical Model of Large-Batch Training"
(arXiv 1812.06162), §2.2 eq. 2.8 (B_simple) and App. A.1 (the unbiased two-batch
estimators). Σ is the per-unit (per sample, or per loss-bearing token) gradient
covariance and G the true gradient; a mean over b independent units has
E|g_b|² = |G|² + tr(Σ)/b.

Estimator (one *window* = one optimizer step = one big batch of B units that is
partitioned into k small batches of b_i units, Σ b_i = B, G_big = Σ b_i g_i / B):

    tr(Σ)^ = (Σ_i b_i |g_i|² − B |G_big|²) / (k − 1)      = Σ_i b_i |g_i − G_big|² / (k − 1)
    |G|²^  = |G_big|² − tr(Σ)^ / B

Both are exactly unbiased for any counts b_i (proof in docs/noise.md: take
expectations of b_i|g_i|² and B|G_big|² and subtract); with equal b_i they are
McCandlish's A.1 formulas with B_small = b, B_big = k·b. B_simple is the ratio of
separate EMAs of the two (the ratio of unbiased estimates is itself biased).

The small batches come from the training step itself, at no extra forward/backward:

* ``"micro"`` — the micro-batches of an accumulation window, pooled over all data-
  parallel ranks (k = grad_accum_steps × dp_world_size). |g_micro|² is the norm of the
  gradient each micro backward adds to ``.grad`` (sum-loss accumulation: Δ = count · g_micro),
  taken in a tensor hook on every parameter as it arrives, before accumulation and before any
  DDP all-reduce (no snapshot copy).
* ``"rank"`` — each rank's whole-window gradient before the all-reduce (k = dp_world_size),
  its squared norm taken per bucket in a DDP communication hook (AdaptDL's source) that wraps
  the user's own hook or DDP's default all-reduce.

Norms are taken after unscaling (loss scale) and before clipping. The EMA forgets per
unit, not per step: decay = 0.5^(B / half_life), so it means the same at any batch
(with ``every=n``, a measured window stands for the n windows since the last one).

Uncertainty: each window gives an independent unbiased pair (tr(Σ)^, |G|²^); the EMA
also tracks their weighted second moments, hence the standard errors of both EMA means
and their covariance (effective sample size n_eff = (Σw)²/Σw²). The interval for the
ratio is Fieller's; it is unbounded exactly when |G|² is not significantly above
zero — then the estimate is flagged as not reportable. The standard error is the
delta-method one.

Variant (labelled as such everywhere): ``adam=True`` also estimates the noise scale of
the Adam-preconditioned gradient g / (√v̂ + eps), v̂ = the optimizer's bias-corrected
``exp_avg_sq`` from the previous step (AdaptDL's AdamGradientNoiseScale; McCandlish
call such results "mixed").

Host syncs: none in :meth:`NoiseScaleMonitor.micro_backward` / ``window_end``; the
only ones are in :meth:`NoiseScaleEstimator.estimate` (one ``.tolist()``), to be
called at log steps.

Layout: :mod:`~globalbatch.noise.estimator` (the per-window estimator, the EMA and its
interval and flags), :mod:`~globalbatch.noise.monitor` (:class:`NoiseScaleMonitor`: the
``micro`` and ``rank`` sources, the DDP comm hook, the Adam variant; built from
:mod:`~globalbatch.noise.hooks` and :mod:`~globalbatch.noise.fold`); the run behind
``globalbatch noise`` is an experiment of the lab (:mod:`globalbatch.lab.noise_run`).
"""

from globalbatch.noise.estimator import (
    NEEDS_TWO_BATCH_SIZES,
    NoiseScaleEstimate,
    NoiseScaleEstimator,
    WindowStats,
    fieller_interval,
    window_estimates,
)
from globalbatch.noise.budget import MonitorCost
from globalbatch.noise.monitor import SOURCES, NoiseConfig, NoiseScaleMonitor  # noqa: F401 (SOURCES: not in __all__)

__all__ = [
    "NEEDS_TWO_BATCH_SIZES",
    "WindowStats",
    "NoiseScaleEstimate",
    "NoiseScaleEstimator",
    "NoiseConfig",
    "NoiseScaleMonitor",
    "MonitorCost",
    "window_estimates",
    "fieller_interval",
]
