"""From the points of a batch sweep to an answer: steps and examples per batch at each target, the
hyperbola fit of :mod:`globalbatch.critical.fit` per target, and the recommended batch (the one
that reaches the target fastest, or cheapest, with ties stated as ties). Pure numpy; no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Generic, Optional, Sequence, TypeVar

import numpy as np

from globalbatch.critical.curves import Curve, ema_smooth, steps_to_target
from globalbatch.critical.errors import NoAnswerError
from globalbatch.critical.fit import HyperbolaFit, fit_hyperbola
from globalbatch.critical.settings import (FIRST_SEED_NAMES, OBJECTIVES, AnalysisSettings, check_analysis_settings,
                                          settings_from)
from globalbatch.errors import SettingError

__all__ = ["BatchPoint", "TargetResult", "BatchChoice", "Recommendation", "AnalysisResult", "Analysis", "OBJECTIVES", "points_for_target",
           "check_analysis_settings", "smoothing_halflife", "default_targets", "recommend", "analyze"]




# ---------------------------------------------------------------------------
# Per-target points, throughput, recommendation
# ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class BatchPoint:
    """One batch size at one loss target, with its best LR."""

    batch_size: float
    lr: float
    """The LR of the fastest trial at this batch (fewest steps to target)."""
    steps: float
    examples: float
    examples_per_s: Optional[float] = None
    """Median throughput of this batch's trials (throughput does not depend on the LR)."""
    time_s: Optional[float] = None
    """Wall-clock to target = examples / examples_per_s."""
    cost: Optional[float] = None
    """examples × cost_per_example, when the cost per example is known."""


@dataclass(kw_only=True)
class TargetResult:
    target: float
    points: list[BatchPoint]
    unreached: list[float]
    """Batch sizes none of whose trials reached the target within the budget."""
    fit: Optional[HyperbolaFit] = None
    fit_error: Optional[str] = None
    cbs_20: Optional[float] = None
    """Zhang et al. 2024 CBS (20% step overhead over E_min/B), = 0.2·B_crit."""
    se_cbs_20: Optional[float] = None
    b_crit_ci95: Optional[tuple[float, float]] = None
    """Two-sided 95% CI of B_crit; None when B_crit is extrapolated (see ``b_crit_bound``)."""
    b_crit_bound: Optional[tuple[str, float]] = None
    """When B_crit lies outside the swept batches: ``("lower", X)`` (B_crit > X, every batch in
    the perfect-scaling regime) or ``("upper", Y)`` (B_crit < Y, every batch saturated), a
    one-sided 95% bound — the point estimate and a two-sided CI mean little there."""


@dataclass(kw_only=True)
class BatchChoice:
    """The batch to use at one target, with its LR and the reasons in words (:meth:`text`); what
    :class:`Recommendation` (one seed) and :class:`~globalbatch.critical.seeds.SeedRecommendation` (over seeds) share."""

    batch_size: float
    """The recommended batch, in units per step."""
    lr: float
    """Its LR (over seeds: the most common best LR)."""
    target: float
    reasons: list[str] = field(default_factory=list)

    def text(self) -> str:
        return "\n".join(self.reasons)


@dataclass(kw_only=True)
class Recommendation(BatchChoice):
    objective: str
    tolerance: float


TargetT = TypeVar("TargetT")
ChoiceT = TypeVar("ChoiceT", bound=BatchChoice)


@dataclass(kw_only=True)
class AnalysisResult(Generic[TargetT, ChoiceT]):
    """What :class:`Analysis` (one seed) and :class:`~globalbatch.critical.seeds.SeedAnalysis` (over seeds) share:
    the results per target, the recommendation and the caveats."""

    unit: str
    """What the batches count per step: ``example`` (samples) or ``token``."""
    targets: list[TargetT]
    recommendation: Optional[ChoiceT] = None
    """None when the objective needs a throughput some batch lacks, or no batch reached the primary target."""
    warnings: list[str] = field(default_factory=list)
    """Caveats of the measurement (e.g. in-trial throughput that varied with machine load)."""


@dataclass(kw_only=True)
class Analysis(AnalysisResult[TargetResult, Recommendation]):
    primary_target: float
    ema_fraction: float
    """EMA half-life as a fraction of each trial's steps to the target (the default smoothing)."""
    halflife_steps: Optional[float] = None
    """A fixed EMA half-life in steps, when one was asked for instead."""

    def halflife_for(self, n_steps: int) -> float:
        return smoothing_halflife(n_steps, ema_fraction=self.ema_fraction, halflife_steps=self.halflife_steps)

    def to_dict(self) -> dict:
        """JSON-ready dict (the summary a report or a script reads)."""
        return asdict(self)


def _throughput(curves: Sequence[Curve]) -> dict[float, tuple[Optional[float], Optional[float]]]:
    out: dict[float, tuple[Optional[float], Optional[float]]] = {}
    for b in sorted({c.batch_size for c in curves}):
        tp = [c.examples_per_s for c in curves if c.batch_size == b and c.examples_per_s]
        cp = [c.cost_per_example for c in curves if c.batch_size == b and c.cost_per_example is not None]
        out[b] = (float(np.median(tp)) if tp else None, float(np.median(cp)) if cp else None)
    return out


def points_for_target(
    curves: Sequence[Curve], target: float, *, ema_fraction: float = 0.05, halflife_steps: Optional[float] = None,
    readout: str = "train", min_window_examples: Optional[float] = None,
) -> TargetResult:
    """For each batch size, the fastest LR's steps and examples to ``target``, and the fit (see :func:`steps_to_target`)."""
    tput = _throughput(curves)
    points: list[BatchPoint] = []
    unreached: list[float] = []
    for b in sorted(tput):
        best: Optional[tuple[float, float, float]] = None
        for c in curves:
            if c.batch_size != b:
                continue
            r = steps_to_target(c, target, ema_fraction=ema_fraction, halflife_steps=halflife_steps, readout=readout,
                                min_window_examples=min_window_examples)
            if r is not None and (best is None or r[0] < best[0]):
                best = (r[0], r[1], c.lr)
        if best is None:
            unreached.append(b)
            continue
        eps, cpe = tput[b]
        points.append(
            BatchPoint(
                batch_size=b,
                lr=best[2],
                steps=best[0],
                examples=best[1],
                examples_per_s=eps,
                time_s=best[1] / eps if eps else None,
                cost=best[1] * cpe if cpe is not None else None,
            )
        )
    if any(p.steps <= 0 for p in points):  # a batch is at or below it before its first step
        start = min(float(c.eval_loss[0]) if readout == "heldout" and c.eval_loss is not None and c.eval_loss.size
                    else float(c.loss[0]) for c in curves if c.loss.size)
        raise SettingError("targets", target, f"losses below where the trials start (≈ {start:.4f})",
                           why="a batch reaches it before its first step")
    result = TargetResult(target=float(target), points=points, unreached=unreached)
    try:
        fit = fit_hyperbola([p.batch_size for p in points], [p.steps for p in points])
    except NoAnswerError as exc:
        result.fit_error = str(exc)
    else:
        if fit.degenerate is not None:
            result.fit_error = f"fit failed (degenerate: {fit.degenerate})"
            return result
        result.fit = fit
        result.cbs_20 = fit.cbs(overhead=0.2)
        result.se_cbs_20 = 0.2 * fit.se_b_crit
        result.b_crit_bound = fit.b_crit_bound(0.95)
        if not fit.extrapolated:
            result.b_crit_ci95 = fit.b_crit_interval(0.95)
    return result


def smoothing_halflife(n_steps: int, *, ema_fraction: float = 0.05, halflife_steps: Optional[float] = None) -> float:
    """Half-life (steps) used to smooth a whole curve of ``n_steps`` for display and targets."""
    return halflife_steps if halflife_steps is not None else max(0.5, ema_fraction * n_steps)


def default_targets(
    curves: Sequence[Curve],
    *,
    n_targets: int = 4,
    n_tighter: int = 2,
    min_points: int = 4,
    ema_fraction: float = 0.05,
    halflife_steps: Optional[float] = None,
) -> list[float]:
    """Loss targets; the first is the primary one (the recommendation's).

    * primary: the best smoothed loss that *every* batch reaches — max over batches of
      (min over that batch's trials of its lowest smoothed loss). In a fixed-token sweep
      it is set by the batch that learns least per token (usually the largest).
    * ``n_targets − 1`` looser targets, up to a quarter of the way back to the initial loss;
    * ``n_tighter`` tighter targets, down to the best loss that ``min_points`` batches
      reach (enough for a fit): the batches that miss them count as "not reached".

    Returns the primary target, then the others from tightest to loosest.
    """
    if n_targets < 1:
        raise SettingError("n_targets", n_targets, ">= 1")
    if n_tighter < 0:
        raise SettingError("n_tighter", n_tighter, ">= 0")
    per_batch: dict[float, float] = {}
    starts = []
    for c in curves:
        sm, _ = ema_smooth(c.loss, smoothing_halflife(c.loss.size, ema_fraction=ema_fraction, halflife_steps=halflife_steps))
        finite = sm[np.isfinite(sm)]
        if finite.size == 0:
            continue
        per_batch[c.batch_size] = min(per_batch.get(c.batch_size, math.inf), float(finite.min()))
        starts.append(float(finite[0]))
    if not per_batch:
        raise NoAnswerError("curves: no finite loss in any trial")

    def nudge(x: float) -> float:  # up by a hair, so the batch that defines a target registers a crossing
        return x + 1e-9 * max(1.0, abs(x))

    best = sorted(per_batch.values())
    primary = nudge(best[-1])
    start = float(np.median(starts))
    looser = [] if start <= primary else [float(primary + f * (start - primary)) for f in np.linspace(0.0, 0.25, n_targets)[1:]]
    tighter: list[float] = []
    floor = nudge(best[min(min_points, len(best)) - 1])
    if n_tighter and floor < primary:
        tighter = [float(primary - f * (primary - floor)) for f in np.linspace(0.0, 1.0, n_tighter + 1)[1:]]
    return [primary] + sorted(tighter + looser)


def recommend(
    points: Sequence[BatchPoint],
    *,
    objective: str = "time",
    tolerance: float = 0.05,
    target: float = math.nan,
    unit: str = "example",
    label: Optional[Callable[[float], str]] = None,
    throughput_source: Optional[Callable[[float], str]] = None,
) -> Recommendation:
    """The batch that reaches the target fastest (or cheapest), within a tolerance.

    Rule: rank the batches that reach the target by ``objective`` ("time": wall-clock
    to target; "cost": cost to target, falling back to examples consumed when no cost per
    example is known). Every batch within ``tolerance`` (relative) of the best is a tie,
    broken by a secondary criterion (then by the primary one):

    * "time": the lowest cost to target when every batch has a cost, otherwise the fewest
      examples to target (least compute and data);
    * "cost": the shortest wall-clock to target when every batch has a throughput,
      otherwise the fewest examples.

    So a bigger batch that is only marginally faster but burns many more tokens loses: this
    is "the highest-throughput batch that reaches the target", not the largest that fits.

    ``throughput_source(batch)`` says where a batch's throughput comes from (e.g. "timed
    pass"); without it the text says "median over its trials".
    """
    check_analysis_settings(objective=objective, tolerance=tolerance)
    pts = list(points)
    if not pts:
        raise NoAnswerError("points: no batch size reached the target; lower the target or raise the token budget")

    def primary(p: BatchPoint) -> float:
        if objective == "time":
            if p.time_s is None:
                raise SettingError("objective", "time", "cost", why=f"batch {p.batch_size:g} has no throughput")
            return p.time_s
        return p.cost if p.cost is not None else p.examples

    all_cost = all(q.cost is not None for q in pts)
    all_time = all(q.time_s is not None for q in pts)
    if objective == "time":
        sec_name = "cost" if all_cost else f"{unit}s"
    else:
        sec_name = "wall-clock" if all_time else f"{unit}s"

    def secondary(p: BatchPoint) -> float:
        if sec_name == "cost":
            return p.cost  # type: ignore[return-value]
        if sec_name == "wall-clock":
            return p.time_s  # type: ignore[return-value]
        return p.examples

    best_val = min(primary(p) for p in pts)
    ties = [p for p in pts if primary(p) <= best_val * (1.0 + tolerance)]
    winner = min(ties, key=lambda p: (secondary(p), primary(p)))
    fastest = min(pts, key=primary)
    what = "wall-clock to target" if objective == "time" else "cost to target"
    name = label if label is not None else (lambda b: f"batch {b:,.0f}")

    def desc(p: BatchPoint) -> str:
        parts = [f"{name(p.batch_size)}, lr {p.lr:g}: {p.steps:,.1f} steps, {p.examples:,.0f} {unit}s"]
        if p.examples_per_s:
            source = throughput_source(p.batch_size) if throughput_source is not None else "median over its trials"
            parts.append(f"{p.examples_per_s:,.0f} {unit}/s ({source})")
        if p.time_s is not None:
            parts.append(f"{p.time_s:,.1f} s")
        if p.cost is not None:
            parts.append(f"cost {p.cost:,.4g}")
        return ", ".join(parts)

    reasons = [f"target loss {target:.4f}; objective: {what}, tolerance {tolerance:.0%}"]
    reasons += ["  " + desc(p) for p in sorted(pts, key=lambda p: p.batch_size)]
    if winner is fastest:
        reasons.append(f"recommend {name(winner.batch_size)}: best {what}")
    else:
        gap = primary(winner) / primary(fastest) - 1.0
        saving = 1.0 - secondary(winner) / secondary(fastest)
        reasons.append(
            f"recommend {name(winner.batch_size)}: {name(fastest.batch_size)} is best on {what} "
            f"but only by {gap:.1%} (within {tolerance:.0%}), and {name(winner.batch_size)} needs "
            f"{saving:.0%} {'less' if sec_name in ('cost', 'wall-clock') else 'fewer'} {sec_name}"
        )
    bigger = [p for p in pts if p.batch_size > winner.batch_size]
    for p in sorted(bigger, key=lambda p: p.batch_size):
        if p is fastest:
            continue
        reasons.append(
            f"  {name(p.batch_size)} needs {p.examples / winner.examples - 1:+.0%} {unit}s for "
            f"{primary(p) / primary(winner) - 1:+.0%} {what}"
        )
    return Recommendation(
        batch_size=winner.batch_size, lr=winner.lr, objective=objective, tolerance=tolerance, target=float(target), reasons=reasons
    )


def analyze(
    curves: Sequence[Curve],
    *,
    settings: Optional[AnalysisSettings] = None,
    unit: str = "example",
    label: Optional[Callable[[float], str]] = None,
    throughput_source: Optional[Callable[[float], str]] = None,
    warnings: Sequence[str] = (),
    **old: Any,
) -> Analysis:
    """Fits at every target and the recommendation at the primary (first) target (see :func:`default_targets`).

    ``warnings`` (e.g. unreliable throughput) are kept in :attr:`Analysis.warnings` and
    added to the recommendation's text. ``settings``: a :class:`globalbatch.critical.AnalysisSettings` (its
    ``first_seed_targets``, ``first_seed_n_targets``, ``n_tighter``, smoothing, objective and tolerance).
    ``old``: the keywords before ``settings`` (deprecated, :func:`~globalbatch.critical.settings.settings_from`;
    ``targets`` and ``n_targets`` are the ``first_seed_`` ones).
    """
    s = settings_from(settings, old, caller="analyze", renames=FIRST_SEED_NAMES)
    targets: Optional[Sequence[float]] = s.first_seed_targets
    ema_fraction, halflife_steps, objective, tolerance = s.ema_fraction, s.halflife_steps, s.objective, s.tolerance
    curves = list(curves)
    if not curves:
        raise SettingError("curves", curves, "at least one Curve")
    if targets is None:
        targets = default_targets(curves, n_targets=s.first_seed_n_targets, n_tighter=s.n_tighter,
                                  ema_fraction=ema_fraction, halflife_steps=halflife_steps)
    targets = [float(t) for t in targets]
    results = [points_for_target(curves, t, ema_fraction=ema_fraction, halflife_steps=halflife_steps) for t in targets]
    rec = None
    primary = results[0]
    no_throughput = objective == "time" and any(p.time_s is None for p in primary.points)
    if primary.points and not no_throughput:  # without throughput the fit stands, no time recommendation
        rec = recommend(primary.points, objective=objective, tolerance=tolerance, target=primary.target,
                        unit=unit, label=label, throughput_source=throughput_source)
        rec.reasons += [f"warning: {w}" for w in warnings]
    return Analysis(unit=unit, targets=results, primary_target=targets[0], recommendation=rec,
                    ema_fraction=ema_fraction, halflife_steps=halflife_steps, warnings=list(warnings))
