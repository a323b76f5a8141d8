"""B_simple along one run, calibrated to B_crit against a sweep that measured both.

McCandlish et al. 2018 (arXiv 1812.06162), §2.2 and eq. 2.11: B_simple = tr(Σ)/|G|² equals the critical batch
B_crit = E_min/S_min only when the Hessian is well conditioned; in general B_crit ≈ B_noise ≠ B_simple by a
task-dependent factor (their fig. 4 and 7 show B_simple within about an order of magnitude of B_crit). B_simple
also depends on the learning rate and on the point of training. So a B_simple curve says something about B_crit
only through a factor measured where both are known: a batch × LR sweep run with ``--noise`` gives, at each of its
common targets, B_crit (``critical.seeds``) and the B_simple of the chosen-LR trials at their crossing
(``SeedAnalysis.b_simple``, "local": interpolated between the trial's unflagged readings around the crossing,
none where the crossing lies outside them). :func:`calibrate` takes the factor F = B_crit / B_simple per target, its
median and its range over the targets; :func:`calibrated_curve` multiplies another run's B_simple curve (the
``globalbatch noise`` rows) by F, the range carried along, every row labelled with the sweep it was calibrated
against. It is an estimate of B_crit only as far as F transfers: same task, comparable LR and loss range.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from globalbatch.critical.errors import NoAnswerError
from globalbatch.errors import SettingError

__all__ = ["Calibration", "calibrate", "calibrate_from_sweep", "calibrated_curve"]

KINDS = ("local", "path_averaged")


@dataclass(kw_only=True, frozen=True)
class Calibration:
    """B_crit ≈ factor × B_simple, measured on one sweep."""

    factor: float
    """Median over the sweep's targets of B_crit / B_simple."""
    low: float
    """The smallest per-target factor (the spread over the targets; over seeds it is wider)."""
    high: float
    """The largest per-target factor."""
    per_target: dict[float, float]
    """Target loss → B_crit / B_simple there."""
    loss_range: tuple[float, float]
    """The losses the factor was measured at (lowest, highest)."""
    source: str
    """What it was calibrated against (the sweep, its seeds and design)."""
    kind: str = "local"
    """Which B_simple of the sweep: ``local`` (at the target's crossing) or ``path_averaged`` (the mean up to it)."""
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return (f"B_crit ≈ {self.factor:.3g} × B_simple (calibrated against {self.source}; factor "
                f"{self.low:.3g}–{self.high:.3g} over {len(self.per_target)} targets at losses "
                f"{self.loss_range[0]:.4g}–{self.loss_range[1]:.4g}; {self.kind} B_simple at the sweep's LRs)")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["per_target"] = {f"{t:.6g}": f for t, f in self.per_target.items()}
        d["label"] = self.label
        return d


def calibrate(analysis: Any, *, source: str, kind: str = "local") -> Calibration:
    """The factor B_crit / B_simple over a seed analysis's targets (a :class:`~globalbatch.critical.seeds.SeedAnalysis`
    of a sweep run with ``noise``): per target where both are known, then the median and the range.

    Raises:
        SettingError: ``kind`` unknown.
        NoAnswerError: no target with both a B_crit point estimate and a B_simple.
    """
    if kind not in KINDS:
        raise SettingError("kind", kind, ", ".join(KINDS))
    per: dict[float, float] = {}
    notes = []
    for st in analysis.targets:
        b_simple = (analysis.b_simple.get(st.target) or {}).get(kind)
        if st.b_crit is None or not b_simple or not math.isfinite(b_simple) or b_simple <= 0:
            notes.append(f"target {st.target:.4g} left out: "
                         + ("no B_crit point estimate" if st.b_crit is None
                            else f"no {kind} B_simple within the unflagged readings around its crossings"))
            continue
        per[st.target] = float(st.b_crit) / float(b_simple)
    if not per:
        raise NoAnswerError("analysis: no target with both a B_crit point estimate and a B_simple between the "
                            "unflagged B_simple readings around its crossings (was the sweep run with noise=True / "
                            "--noise? are its late readings all flagged?)")
    values = list(per.values())
    return Calibration(factor=float(statistics.median(values)), low=min(values), high=max(values), per_target=per,
                       loss_range=(min(per), max(per)), source=source, kind=kind, notes=notes)


def calibrate_from_sweep(run_dir: str, *, kind: str = "local", settings: Optional[Any] = None) -> Calibration:
    """:func:`calibrate` over a finished sweep directory (its seeds, its targets), labelled with the directory."""
    from globalbatch.lab.sweep import analyze_sweep_seeds

    _, analysis = analyze_sweep_seeds(run_dir, settings=settings)
    return calibrate(analysis, kind=kind,
                     source=f"the sweep {run_dir} ({len(analysis.seeds)} seed(s), {len(analysis.targets)} targets)")


def calibrated_curve(rows: Sequence[dict[str, Any]], calibration: Calibration, *,
                     key: str = "b_simple_micro_token") -> list[dict[str, Any]]:
    """Another run's B_simple curve (``globalbatch noise`` rows) times the factor: per row ``b_crit_calibrated``,
    ``b_crit_calibrated_low`` / ``_high`` (the factor's range over targets; the row's own B_simple interval is not
    folded in), ``in_calibrated_range`` (the row's loss lies within the losses the factor was measured at) and
    ``calibration`` (the label)."""
    lo_loss, hi_loss = calibration.loss_range
    out = []
    for r in rows:
        raw = r.get(key)
        b = float(raw) if raw is not None else math.nan
        ok = math.isfinite(b) and b > 0
        loss = r.get("loss", math.nan)
        out.append({"step": r.get("step"), "units_seen": r.get("units_seen"), "loss": loss,
                    "b_simple": b if ok else math.nan,
                    "b_crit_calibrated": calibration.factor * b if ok else math.nan,
                    "b_crit_calibrated_low": calibration.low * b if ok else math.nan,
                    "b_crit_calibrated_high": calibration.high * b if ok else math.nan,
                    "in_calibrated_range": bool(lo_loss <= loss <= hi_loss),
                    "calibration": calibration.label})
    return out
