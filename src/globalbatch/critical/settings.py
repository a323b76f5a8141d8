"""The analysis settings of a critical-batch sweep, in one place.

:func:`globalbatch.critical.analyze` (one seed, training-loss read-out),
:func:`globalbatch.critical.seeds.analyze_seeds` (over seeds), ``lab.sweep.store.analyze_sweep(_seeds)`` and
``lab.report.write_report`` take one :class:`AnalysisSettings` (``settings=``). Their old keywords
(``n_targets=``, ``objective=`` …) still work for one release through :func:`settings_from`, with a
``FutureWarning``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Optional

from globalbatch.errors import SettingError
from globalbatch.validate import number, positive, whole

__all__ = ["AnalysisSettings", "settings_from", "check_analysis_settings", "OBJECTIVES", "LR_SELECTIONS",
           "FIRST_SEED_NAMES"]

OBJECTIVES = ("time", "cost")
LR_SELECTIONS = ("auto", "per_batch", "per_target")
"""How the analysis chooses the LR each batch is read at: ``per_batch`` — one LR per batch for every target
(chosen at the primary target); ``per_target`` — re-chosen at every target (McCandlish et al.'s definition);
``auto`` (default) — one LR per batch, re-chosen at a target only where the one LR leaves seeds non-monotone
there and the re-chosen LRs leave fewer."""


def check_analysis_settings(*, objective: str = "time", tolerance: float = 0.05, ema_fraction: float = 0.05,
                            halflife_steps: Optional[float] = None) -> None:
    """Raise a :class:`~globalbatch.errors.SettingError` for the first bad analysis setting."""
    if objective not in OBJECTIVES:
        raise SettingError("objective", objective, ", ".join(OBJECTIVES))
    number(tolerance, "tolerance", low=0.0, high=1.0, high_open=True,
           allowed="a fraction, 0 ≤ tolerance < 1 (0.05 = within 5%)")
    number(ema_fraction, "ema_fraction", low=0.0, high=1.0, low_open=True, high_open=True,
           allowed="a fraction, 0 < ema_fraction < 1 (e.g. 0.05)")
    if halflife_steps is not None:
        positive(halflife_steps, "halflife_steps", allowed="a number of steps > 0")


@dataclass(kw_only=True, frozen=True, slots=True)
class AnalysisSettings:
    """How a sweep's curves become targets, steps to target, B_crit and a recommendation."""

    objective: str = "time"
    """``time`` (wall-clock to target, from the measured throughput) or ``cost`` (units to target)."""
    tolerance: float = 0.05
    """Batches within this fraction of the best time (or cost) to target tie; the most data-efficient wins."""
    readout: str = "heldout"
    """``heldout`` (the monotone fit of the held-out evaluations) or ``train`` (the EMA of the training loss)."""
    n_targets: int = 5
    """Common targets over seeds (:func:`globalbatch.critical.seeds.common_targets`)."""
    targets: Optional[tuple[float, ...]] = None
    """Loss targets over seeds instead of the automatic ones."""
    lr_selection: str = "auto"
    """How each batch's LR is chosen over seeds (:data:`globalbatch.critical.seeds.LR_SELECTIONS`)."""
    min_window_fraction: float = 0.02
    """``readout="train"`` over seeds: the EMA window is at least this fraction of the budget, in units."""
    ema_fraction: float = 0.05
    """First-seed training read-out: EMA half-life as a fraction of each trial's steps to the target."""
    halflife_steps: Optional[float] = None
    """First-seed training read-out: a fixed EMA half-life in steps instead (biases B_crit low)."""
    first_seed_n_targets: int = 4
    """First-seed analysis: the primary target and the looser ones (:func:`globalbatch.critical.default_targets`)."""
    n_tighter: int = 2
    """First-seed analysis: targets below the primary one."""
    first_seed_targets: Optional[tuple[float, ...]] = None
    """First-seed analysis: loss targets instead of the automatic ones."""

    def __post_init__(self) -> None:
        from globalbatch.critical.curves import READOUTS

        check_analysis_settings(objective=self.objective, tolerance=self.tolerance, ema_fraction=self.ema_fraction,
                                halflife_steps=self.halflife_steps)
        if self.readout not in READOUTS:
            raise SettingError("readout", self.readout, ", ".join(READOUTS))
        if self.lr_selection not in LR_SELECTIONS:
            raise SettingError("lr_selection", self.lr_selection, ", ".join(LR_SELECTIONS))
        for name, low in (("n_targets", 2), ("first_seed_n_targets", 1), ("n_tighter", 0)):
            whole(getattr(self, name), name, minimum=low)
        number(self.min_window_fraction, "min_window_fraction", low=0.0, high=1.0, high_open=True,
               allowed="a fraction, 0 ≤ x < 1")
        for name in ("targets", "first_seed_targets"):
            v = getattr(self, name)
            if v is None:
                continue
            allowed = "finite loss values, at least one"
            if isinstance(v, (str, bytes)) or not hasattr(v, "__len__") or len(v) == 0:
                raise SettingError(name, v, allowed)
            object.__setattr__(self, name, tuple(number(x.item() if hasattr(x, "item") else x, name, allowed=allowed)
                                                 for x in v))  # numpy scalars as Python numbers


_NAMES = frozenset(f.name for f in fields(AnalysisSettings))


FIRST_SEED_NAMES = {"targets": "first_seed_targets", "n_targets": "first_seed_n_targets"}
"""The old keywords of the first-seed analyses (``analyze``, ``analyze_sweep``) → the settings' fields."""


def settings_from(settings: Optional[AnalysisSettings], old: Mapping[str, Any], *, caller: str,
                  renames: Mapping[str, str] = {}) -> AnalysisSettings:
    """The settings an analysis runs with: ``settings`` (default: the defaults).

    ``old``: the keywords of the API before :class:`AnalysisSettings` (``n_targets=4``), deprecated: each is
    renamed by ``renames`` and replaces that field (None: not given), with one ``FutureWarning`` naming
    ``caller``. A keyword that names no field is the ``TypeError`` Python gives an unknown keyword."""
    base = settings if settings is not None else AnalysisSettings()
    if not old:
        return base
    changes = {renames.get(k, k): v for k, v in old.items()}
    unknown = sorted(k for k, v in old.items() if renames.get(k, k) not in _NAMES)
    if unknown:
        raise TypeError(f"{caller}() got unexpected keyword argument(s): {', '.join(unknown)}")
    warnings.warn(f"{caller}({', '.join(f'{k}=' for k in old)}) is deprecated: pass "
                  f"settings=AnalysisSettings({', '.join(f'{k}=' for k in changes)})", FutureWarning, stacklevel=3)
    changes = {k: (tuple(v) if k in ("targets", "first_seed_targets") else v)
               for k, v in changes.items() if v is not None}
    return replace(base, **changes)
