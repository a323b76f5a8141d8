"""The critical batch over seeds: common targets, per-seed fits, one fit across targets, a recommendation.

What a single run gives is one noisy draw: the data order and the initialisation move steps-to-target by
tens of per cent (a 4.5× range of B_crit over five seeds with a training-loss read-out, measured on the
demo task). :func:`analyze_seeds` reads a sweep run with several seeds in four steps, each in its module:

1. **Common targets** and 2. **per target** results over seeds at each batch's one LR
   (:mod:`globalbatch.critical.seed_targets`; the LR choice and its flags: :mod:`globalbatch.critical.lr_choice`).
3. **Jointly** across targets, B_crit(L) as a power law (:mod:`globalbatch.critical.joint`, Kaplan et al. 2020).
4. **Recommendation** (:func:`recommend_over_seeds`, here): the winner per seed, the probability
   that each batch is the fastest (bootstrap over seeds of the median time to target), time
   to target per batch with its range over seeds, and ties stated as ties.

Everything those modules export is importable from here too. Pure numpy/scipy; no torch.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, cast

import numpy as np

from globalbatch.critical.curves import Curve
from globalbatch.critical.errors import NoAnswerError
from globalbatch.critical.joint import JointFit, fit_joint, joint_flags
from globalbatch.critical.lr_choice import LrFall, choose_lr_per_target, lr_edges, lr_falls, one_lr_per_batch
from globalbatch.critical.recommend import AnalysisResult, BatchChoice, recommend
from globalbatch.critical.seed_targets import (MONOTONE_SLACK, N_BOOT, SeedTarget, bootstrap_rng, check_targets_reached,
                                               common_lr, common_targets, is_monotone, pooling_summary, target_over_seeds)
from globalbatch.critical.settings import LR_SELECTIONS, AnalysisSettings, settings_from
from globalbatch.errors import SettingError

__all__ = ["SeedTarget", "JointFit", "SeedRecommendation", "SeedAnalysis", "LrFall", "common_targets", "is_monotone",
           "common_lr", "fit_joint", "recommend_over_seeds", "analyze_seeds", "lr_falls", "lr_selection_text", "MONOTONE_SLACK",
           "LR_SELECTIONS", "N_BOOT", "target_over_seeds", "seed_analysis_json"]


@dataclass(kw_only=True)
class SeedRecommendation(BatchChoice):
    """The batch to use at one target, with what the seeds say about it (:func:`recommend_over_seeds`); its LR is
    the most common best LR over seeds."""

    per_seed: dict[int, Optional[float]]
    """Seed → the batch (units per step) recommended on that seed alone."""
    probability_fastest: dict[float, float]
    """Batch → share of bootstrap resamples of the seeds in which its median time to target is the least."""
    time_to_target: dict[float, tuple[float, float, float]]
    """Batch → (median, min, max) over seeds of seconds to target (examples ÷ throughput)."""
    tie: list[float]
    """Batches the data cannot separate from the winner (within the tolerance, or fastest in ≥ 20 % of resamples)."""


def recommend_over_seeds(st: SeedTarget, throughput: dict[float, Optional[float]], *, tolerance: float = 0.05,
                         objective: str = "time", unit: str = "example",
                         label: Optional[Callable[[float], str]] = None, rng_seed: int = 0) -> Optional[SeedRecommendation]:
    """The batch to use at ``st``'s target, with the winner per seed and the probability of being fastest."""
    name = label if label is not None else (lambda b: f"batch {b:,.0f}")
    seeds = sorted(st.monotone)
    batches = [b for b in sorted(st.steps) if all(st.examples[b][s] is not None for s in seeds)]
    if not batches or (objective == "time" and any(not throughput.get(b) for b in batches)):
        return None

    def cost(b: float, s: int) -> float:
        e = cast(float, st.examples[b][s])  # batches: every seed reached the target
        return e / cast(float, throughput[b]) if objective == "time" else e

    per_seed: dict[int, Optional[float]] = {}
    for s in seeds:
        tr = st.per_seed[s]
        pts = [p for p in tr.points if p.batch_size in batches]
        try:
            per_seed[s] = recommend(pts, objective=objective, tolerance=tolerance, target=st.target,
                                    unit=unit).batch_size
        except NoAnswerError:
            per_seed[s] = None
    times = {b: [cost(b, s) for s in seeds] for b in batches}
    med = {b: float(np.median(v)) for b, v in times.items()}
    gen = bootstrap_rng(rng_seed)
    wins: Counter[float] = Counter()
    for _ in range(1000):
        draw = gen.integers(0, len(seeds), size=len(seeds))
        m = {b: float(np.median([times[b][i] for i in draw])) for b in batches}
        wins[min(m, key=lambda b: m[b])] += 1
    prob = {b: wins[b] / 1000 for b in batches}
    best = min(med.values())
    tie = [b for b in batches if med[b] <= best * (1 + tolerance) or prob[b] >= 0.2]
    ex_med = {b: float(np.median([cast(float, st.examples[b][s]) for s in seeds])) for b in batches}
    winner = min(tie, key=lambda b: (ex_med[b], med[b]))  # among ties: the fewest examples (least data and compute)
    lrs = [st.best_lr[winner][s] for s in seeds if st.best_lr[winner][s] is not None]
    lr = Counter(lrs).most_common(1)[0][0]
    what = "seconds to target" if objective == "time" else f"{unit}s to target"
    reasons = [f"target loss {st.target:.4f} (held-out); {len(seeds)} seed(s); {what}: median [min–max over seeds]"]
    for b in batches:
        v = times[b]
        reasons.append(f"  {name(b)}: {med[b]:,.1f} [{min(v):,.1f}–{max(v):,.1f}], {ex_med[b]:,.0f} {unit}s, "
                       f"P(fastest) {prob[b]:.0%}")
    reasons.append("winner per seed: " + ", ".join(f"seed {s}: {name(b) if b else '–'}" for s, b in per_seed.items()))
    if len(tie) > 1:
        reasons.append(f"tie: {', '.join(name(b) for b in tie)} cannot be separated (within {tolerance:.0%} or "
                       f"fastest in ≥ 20% of seed resamples); recommend {name(winner)}, the fewest {unit}s among them")
    else:
        reasons.append(f"recommend {name(winner)} at lr {lr:g}")
    return SeedRecommendation(batch_size=winner, lr=float(cast(float, lr)), target=st.target, per_seed=per_seed,
                              probability_fastest=prob,
                              time_to_target={b: (med[b], float(min(times[b])), float(max(times[b]))) for b in batches},
                              tie=tie, reasons=reasons)

@dataclass(kw_only=True)
class SeedAnalysis(AnalysisResult[SeedTarget, SeedRecommendation]):
    """What :func:`analyze_seeds` found: the results per target (:attr:`targets`: loosest first; the last is the
    primary target, :attr:`primary`), the joint fit, the flags and the recommendation."""

    readout: str
    """``heldout`` (the monotone fit of the held-out evaluations) or ``train`` (the EMA of the training loss)."""
    seeds: list[int]
    joint: Optional[JointFit] = None
    """The fit of B_crit(L) across targets and seeds; None when it could not be made (:attr:`joint_error`)."""
    joint_error: Optional[str] = None
    joint_flags: list[str] = field(default_factory=list)
    """Why the joint fit is only a flagged comparison (:func:`~globalbatch.critical.joint.joint_flags`); empty: it
    stands as the trend across targets. The answer per target is always the median over seeds."""
    lr_edges: dict[float, str] = field(default_factory=dict)
    """Batch → "low"/"high" when its LR (the one for every seed, chosen at the primary target) is the edge of the LRs it ran."""
    lr_selection: str = "auto"
    """The rule of :data:`LR_SELECTIONS` the analysis ran with (each target says which it used: ``SeedTarget.lr_selection``)."""
    lr_falls: list["LrFall"] = field(default_factory=list)
    """Neighbouring batches whose chosen LR falls as the batch grows (at any target), against the optimizer's rule."""
    b_simple: dict[float, dict[str, Optional[float]]] = field(default_factory=dict)
    """Target → {"local": median B_simple at the crossing, "path_averaged": median mean B_simple up to it}."""

    @property
    def primary(self) -> SeedTarget:
        """The tightest target: the recommendation's."""
        return self.targets[-1]

    def monotone_share(self) -> float:
        cells = [m for t in self.targets for m in t.monotone.values()]
        return sum(cells) / len(cells) if cells else math.nan


def _b_simple_at(curve: Curve, examples: float) -> tuple[Optional[float], Optional[float]]:
    """(local, path-averaged) B_simple of ``curve`` at ``examples``: log-log interpolation between the two readings
    around it, and the mean of the readings up to it. (None, None) when ``examples`` lies outside the (unflagged)
    readings: no value is taken from a distant reading (late in a run most readings can be flagged, and the last
    unflagged one may lie far before the crossing)."""
    pts = sorted(p for p in curve.b_simple if p[0] > 0 and p[1] > 0)
    if not pts or not pts[0][0] <= examples <= pts[-1][0]:
        return None, None
    e = np.array([p[0] for p in pts])
    v = np.array([p[1] for p in pts])
    local = float(np.exp(np.interp(math.log(examples), np.log(e), np.log(v))))
    return local, float(np.mean(v[e <= examples]))


def _b_simple_by_target(results: Sequence[SeedTarget], curves: Sequence[Curve],
                        seeds: Sequence[int]) -> dict[float, dict[str, Optional[float]]]:
    """Target → the median B_simple (local and path-averaged) where the best-LR trials cross it (LR-dependent)."""
    by_label = {(c.batch_size, c.seed, c.lr): c for c in curves}
    out: dict[float, dict[str, Optional[float]]] = {}
    for st in results:
        loc, path = [], []
        for b in st.steps:
            for seed in seeds:
                e, lr_b = st.examples[b][seed], st.best_lr[b][seed]
                c = by_label.get((b, seed, cast(float, lr_b))) if e is not None else None
                if c is not None and e is not None and c.b_simple:
                    lo, pa = _b_simple_at(c, e)
                    if lo is not None:
                        loc.append(lo)
                    if pa is not None:
                        path.append(pa)
        if loc or path:
            out[st.target] = {"local": float(np.median(loc)) if loc else None,
                              "path_averaged": float(np.median(path)) if path else None}
    return out


def analyze_seeds(curves: Sequence[Curve], *, settings: Optional[AnalysisSettings] = None,
                  min_window_examples: Optional[float] = None, unit: str = "example",
                  label: Optional[Callable[[float], str]] = None, warnings: Sequence[str] = (),
                  **old: Any) -> SeedAnalysis:
    """Targets, per-target results over seeds, the joint fit, LR-edge and falling-LR flags and the recommendation.

    ``settings``: a :class:`globalbatch.critical.AnalysisSettings` (targets, n_targets, readout, tolerance,
    objective, lr_selection). ``old``: the keywords before ``settings`` (deprecated,
    :func:`~globalbatch.critical.settings.settings_from`).

    ``lr_selection`` (:data:`LR_SELECTIONS`): where one LR per batch cannot serve every target — it
    leaves seeds non-monotone at a target (measured on a non-demo tinygpt: batch 16's LR 0.0020 below
    batch 8's 0.0042, so batch 16 needed more steps than batch 8 at the early targets) — ``auto`` reads
    that target at LRs re-chosen there, when that leaves fewer seeds non-monotone; each target states
    which rule it used and why (``SeedTarget.lr_selection``/``lr_selection_reason``).
    """
    cfg = settings_from(settings, old, caller="analyze_seeds")
    n_targets, readout, lr_selection = cfg.n_targets, cfg.readout, cfg.lr_selection
    curves = list(curves)
    if not curves:
        raise SettingError("curves", curves, "at least one Curve")
    if cfg.targets is not None:
        check_targets_reached(curves, cfg.targets, readout=readout, min_window_examples=min_window_examples)
    given = cfg.targets if cfg.targets is not None else common_targets(curves, n_targets, readout=readout,
                                                                      min_window_examples=min_window_examples)
    seeds = sorted({c.seed for c in curves})
    chosen, targets = one_lr_per_batch(curves, sorted(given, reverse=True), fixed=cfg.targets is not None,
                                       n_targets=n_targets, readout=readout, min_window_examples=min_window_examples)
    results = [target_over_seeds(chosen, t, readout=readout, min_window_examples=min_window_examples) for t in targets]
    results = choose_lr_per_target(results, curves, lr_selection, readout=readout,
                                   min_window_examples=min_window_examples)
    name = label if label is not None else (lambda b: f"batch {b:,.0f}")
    out = SeedAnalysis(unit=unit, readout=readout, seeds=seeds, targets=results, warnings=list(warnings),
                       lr_selection=lr_selection)
    out.lr_falls = lr_falls(results)
    for f in out.lr_falls:
        out.warnings.append(f.text(name))
    for st in results:
        if st.reached_in_warmup:
            out.warnings.append(f"target {st.target:.4f} reached during LR warmup by {', '.join(st.reached_in_warmup)}")
        bad = [s for s, m in st.monotone.items() if not m]
        if bad:
            out.warnings.append(f"target {st.target:.4f}: non-monotone or unreached steps for seed(s) "
                                f"{', '.join(map(str, bad))}: left out of the fits")
        if st.seed_spread is not None and st.seed_spread.differ:
            out.warnings.append(f"target {st.target:.4f}: {st.seed_spread.text()} — the seed range is the seeds' "
                                "own; more seeds narrow the median's interval, not that range")
    pts = [(st.target, s, b, cast(float, st.steps[b][s])) for st in results for s in seeds if st.monotone[s]
           for b in st.steps if st.steps[b][s] is not None]
    try:
        out.joint = fit_joint(pts)
        for st in results:
            st.joint_b_crit = out.joint.b_crit(st.target)
            st.joint_interval = out.joint.interval(st.target)
        out.joint_flags = joint_flags(out.joint, [(st.target, st.b_crit) for st in results])
        out.warnings += [f"joint fit B_crit(L): {f}; the answer is the median over seeds per target" for f in out.joint_flags]
    except NoAnswerError as exc:
        out.joint_error = str(exc)
    primary = out.primary
    out.lr_edges, edge_warnings = lr_edges(primary, curves, name)
    out.warnings += edge_warnings
    out.b_simple = _b_simple_by_target(results, curves, seeds)
    tput: dict[float, Optional[float]] = {}
    for b in primary.steps:
        v = [c.examples_per_s for c in curves if c.batch_size == b and c.examples_per_s]
        tput[b] = float(np.median(v)) if v else None
    out.recommendation = recommend_over_seeds(primary, tput, tolerance=cfg.tolerance, objective=cfg.objective,
                                              unit=unit, label=label)
    return out


def lr_selection_text(a: SeedAnalysis) -> str:
    """One line: which LR rule the targets were read with, and why where it differs."""
    per_target = [st for st in a.targets if st.lr_selection == "per_target"]
    if not per_target:
        return (f"LR selection {a.lr_selection}: one LR per batch at every target (chosen at the primary target, "
                f"the same for every seed)")
    parts = "; ".join(f"target {st.target:.4f}: {st.lr_selection_reason}" for st in per_target)
    return (f"LR selection {a.lr_selection}: one LR per batch except at {len(per_target)} of {len(a.targets)} "
            f"target(s), where it is re-chosen per batch at that target — {parts}")


def seed_analysis_json(a: SeedAnalysis, batch_key: Callable[[float], int]) -> dict:
    """The ``globalbatch report --json`` document: batches keyed by samples per step (as strings)."""

    def k(b: float) -> str:
        return str(batch_key(b))

    def num(x):
        return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x

    targets = []
    for st in a.targets:
        targets.append({
            "target_loss": st.target,
            "b_crit": num(st.b_crit),
            "b_crit_median_bound": list(st.b_crit_median_bound) if st.b_crit_median_bound else None,
            "b_crit_median_text": st.median_text,
            "b_crit_bound_per_seed": {str(s): list(b) for s, b in st.b_crit_bound_per_seed.items()},
            "b_crit_interval_source": st.interval_source,
            "b_crit_per_seed": {str(s): num(v) for s, v in st.b_crit_per_seed.items()},
            "b_crit_text_per_seed": {str(s): v for s, v in st.b_crit_text_per_seed.items()},
            "b_crit_range": list(st.b_crit_range) if st.b_crit_range else None,
            "b_crit_bootstrap_95": list(st.b_crit_boot) if st.b_crit_boot else None,
            "b_crit_interval": list(iv) if (iv := st.interval()) else None,
            "b_crit_joint": num(st.joint_b_crit),
            "b_crit_joint_95": list(st.joint_interval) if st.joint_interval else None,
            "steps_to_target": {k(b): {str(s): num(v) for s, v in d.items()} for b, d in st.steps.items()},
            "units_to_target": {k(b): {str(s): num(v) for s, v in d.items()} for b, d in st.examples.items()},
            "best_lr": {k(b): {str(s): num(v) for s, v in d.items()} for b, d in st.best_lr.items()},
            "monotone": st.all_monotone,
            "monotone_per_seed": {str(s): m for s, m in st.monotone.items()},
            "reached_in_warmup": st.reached_in_warmup,
            "lr_selection": st.lr_selection,
            "lr_selection_reason": st.lr_selection_reason,
            "b_crit_own_per_seed": {str(s): num(v) for s, v in st.b_crit_own_per_seed.items()},
            "pooling": st.pooled.as_json() if st.pooled is not None else None,
            "pooling_text": st.pooling_text,
            "seed_spread": st.seed_spread.as_json() if st.seed_spread is not None else None,
            "b_simple": a.b_simple.get(st.target),
        })
    rec = a.recommendation
    pst = a.primary
    doc = {
        "b_crit_answer": {"source": "median over seeds, per target (targets[].b_crit)", "target_loss": pst.target,
                          "b_crit": num(pst.b_crit), "b_crit_interval": list(iv) if (iv := pst.interval()) else None,
                          "b_crit_median_bound": list(pst.b_crit_median_bound) if pst.b_crit_median_bound else None,
                          "text": pst.median_text, "interval_source": pst.interval_source},
        "unit": a.unit, "readout": a.readout, "seeds": a.seeds, "targets": targets,
        "monotone_share": num(a.monotone_share()),
        "joint": None if a.joint is None else {
            "b_crit_at_ref": a.joint.b_ref, "loss_ref": a.joint.loss_ref, "k": a.joint.k, "se_k": a.joint.se_k,
            "se_log_b_ref": a.joint.se_log_b_ref, "alpha_b": num(a.joint.alpha_b), "n_points": a.joint.n_points,
            "dof": a.joint.dof, "residual_std_log": a.joint.residual_std_log,
            "model": "ln S = a_t + ln(1 + B_crit(L_t)/B), B_crit(L) = b_crit_at_ref·(L/loss_ref)^k"},
        "joint_error": a.joint_error,
        "joint_flags": a.joint_flags,
        "joint_role": None if a.joint is None else ("comparison (flagged)" if a.joint_flags else "trend"),
        "lr_edges": {k(b): v for b, v in a.lr_edges.items()},
        "lr_selection": a.lr_selection,
        "lr_selection_text": lr_selection_text(a),
        "pooling_text": pooling_summary(a.targets),
        "lr_falls": [{"batch_low": batch_key(f.batch_low), "batch_high": batch_key(f.batch_high), "lr_low": f.lr_low,
                      "lr_high": f.lr_high, "targets": list(f.targets)} for f in a.lr_falls],
        "recommendation": None if rec is None else {
            "batch": batch_key(rec.batch_size), "batch_units": rec.batch_size, "lr": rec.lr, "target_loss": rec.target,
            "per_seed": {str(s): (batch_key(b) if b is not None else None) for s, b in rec.per_seed.items()},
            "probability_fastest": {k(b): p for b, p in rec.probability_fastest.items()},
            "time_to_target_s": {k(b): {"median": v[0], "min": v[1], "max": v[2]} for b, v in rec.time_to_target.items()},
            "tie": [batch_key(b) for b in rec.tie], "text": rec.text()},
        "warnings": a.warnings,
    }
    return doc
