"""The critical batch from a batch sweep (a measurement: pure numpy/scipy, no torch).

- :mod:`~globalbatch.critical.curves`: loss curves and steps to a loss target.
- :mod:`~globalbatch.critical.readout`: the held-out read-out (a monotone fit of the eval loss).
- :mod:`~globalbatch.critical.fit`: the steps–examples hyperbola (McCandlish et al. 2018, eq. 2.11) and Zhang's CBS.
- :mod:`~globalbatch.critical.recommend`: points per target, the fits and the recommended batch of one seed.
- :mod:`~globalbatch.critical.settings`: :class:`AnalysisSettings`, every analysis' settings in one dataclass.
- :mod:`~globalbatch.critical.seeds`: the analysis over seeds and its recommendation with its uncertainty, from
  :mod:`~globalbatch.critical.seed_targets` (common targets, per-target results over seeds),
  :mod:`~globalbatch.critical.lr_choice` (one LR per batch and its flags), :mod:`~globalbatch.critical.pooled`
  (per-seed B_crit with S_min partially pooled), :mod:`~globalbatch.critical.seed_spread` (do the seeds' B_crit
  differ beyond their noise?) and :mod:`~globalbatch.critical.joint` (the joint B_crit(L) fit).
- :mod:`~globalbatch.critical.errors`: :class:`NoAnswerError`, what the data cannot answer (user errors are
  :class:`globalbatch.errors.SettingError`).
"""

from globalbatch.critical.curves import READOUTS, Curve, ema_smooth, steps_to_target
from globalbatch.critical.errors import NoAnswerError
from globalbatch.critical.fit import HyperbolaFit, fit_hyperbola, zhang_cbs
from globalbatch.critical.settings import AnalysisSettings
from globalbatch.critical.recommend import (
    OBJECTIVES,
    Analysis,
    BatchPoint,
    Recommendation,
    TargetResult,
    analyze,
    check_analysis_settings,
    default_targets,
    points_for_target,
    recommend,
    smoothing_halflife,
)

__all__ = ["AnalysisSettings", "NoAnswerError", "Curve", "READOUTS", "ema_smooth", "steps_to_target", "HyperbolaFit", "fit_hyperbola", "zhang_cbs",
           "BatchPoint", "TargetResult", "Recommendation", "Analysis", "OBJECTIVES", "points_for_target",
           "check_analysis_settings", "smoothing_halflife", "default_targets", "recommend", "analyze"]
