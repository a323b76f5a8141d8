"""Successive halving of the critical-batch sweep: stop the LR cells that can no longer be the fastest of their batch.

The schedule is successive halving (Jamieson & Talwalkar 2016, arXiv 1502.07943), as Hyperband runs it (Li et al.
2018, JMLR 18(185), arXiv 1603.06560) and ASHA asynchronously (Li et al. 2020, MLSys, arXiv 1810.05934): every cell
trains to rungs at budget·η^−k (η = 3: 1/9 and 1/3 of the budget, each moved to the next held-out evaluation
position so the loss is read there), a rule stops some cells at each rung, the others resume from their checkpoint
(:func:`globalbatch.lab.sweep.trial.run_trial` with ``pause_at``) and go on. Where those papers keep the best 1/η by
one metric, this sweep needs, for every batch, the LR that reaches each common held-out target in the fewest steps
(McCandlish et al. 2018, App. A.3), so the rule keeps every cell that may still be that LR for a target the rung
already shows:

At rung u_r (units), for batch b and seed s, with m_c(u) the non-increasing (isotonic) fit of cell c's held-out
loss at the evaluations u ≤ u_r (all cells of b share the positions: equal tokens):

* the *band*: the losses the common targets can take, as far as the rung shows — at most floor + 0.75·(ceiling −
  floor) (the analysis' rule, :func:`globalbatch.critical.seeds.common_targets`), with floor = the worst over
  batches × seeds of the best m_c(u_r) and ceiling = the lowest over batches × seeds of the best loss at the end of
  LR warmup so far; both can only fall by the end of the sweep, so this bounds the loosest target from above;
  P = the evaluations after warmup where the batch's best m(u) is at or below that bound; P empty (no batch past
  warmup, or this batch not yet down to a possible target): nothing stops;
* the *margin* δ = 2σ, σ the spread of the loss between seeds: the standard deviation over seeds of the batch's best
  m(u_r), median over batches (≥ 2 seeds); with one seed there is no seed spread in the run, and σ is √2 × the
  scatter of the held-out loss about its monotone fit over P, pooled over every cell (the noise of a difference
  of two cells' read-outs) — a smaller margin than a seed spread, stated as such;
* cell c *can still be fastest* to a target in the band when at some u ∈ P its m_c(u) is within δ of the best cell's
  (a monotone curve lowest at u is the first to reach the loss there);
* it is *stopped* when it cannot, unless it is protected: the best cell at u_r, and the cell the optimizer's LR rule
  predicts from the best cell of each neighbouring batch (:meth:`SweepConfig.transfer_lr`); with several seeds an LR
  is stopped only where the rule stops it at every seed (all seeds keep the same LRs).

A stopped cell keeps its pause (its tokens are counted in the design's compute, :func:`trained_units`). When a
batch's best cell at a rung is the lowest or highest LR it ran, one LR beyond that edge joins at that rung (trained
from the start to it), up to ``lr_edge_extend`` per side, as the full design widens its grids. What is not
guarded: a cell behind at every evaluation so far that would overtake later (a small LR at the tightest targets);
the benchmark (``benchmarks/critical_cost.py``) measures what that costs against the full sweep.

Locally the runner runs rung by rung (:func:`run_rungs`); with Ray Tune the same rule decides inside Ray's own
scheduler API (:func:`ray_scheduler`, a ``FIFOScheduler`` whose ``on_trial_result`` returns PAUSE until the rung
can be decided, then STOP or CONTINUE).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from globalbatch._util import atomic_write_json
from globalbatch.lab.sweep.config import SweepConfig, TrialSpec

__all__ = ["spent_text", "rung_positions", "RungCell", "RungDecision", "read_cell", "decide_rung", "trained_units", "run_rungs",
           "probe_cells", "middle_first", "run_statement",
           "ray_scheduler", "LOG_NAME"]

LOG_NAME = "halving.json"
"""The decisions of every rung, in the sweep directory (rewritten after each rung)."""
MARGIN_Z = 2.0
BAND_TOP = 0.75  # the analysis' default (critical.seeds.common_targets ``top``)


def rung_positions(config: SweepConfig, fractions: Sequence[float]) -> list[int]:
    """The rungs in units: for each fraction of the budget, the first held-out evaluation position at or past it
    (below the budget; duplicates dropped)."""
    pos = config.eval_positions()
    out: list[int] = []
    for f in fractions:
        p = next((x for x in pos if x >= f * config.budget), config.budget)
        if p < config.budget and p not in out:
            out.append(p)
    return sorted(out)


@dataclass(kw_only=True, frozen=True)
class RungCell:
    """One cell's held-out curve up to a rung."""

    spec: TrialSpec
    consumed: np.ndarray
    """Units at each evaluation after the first step (≤ the rung)."""
    loss: np.ndarray
    warmup_units: float


def read_cell(trial_dir: Path, spec: TrialSpec, rung: int) -> Optional[RungCell]:
    """The held-out evaluations of ``spec`` up to the first one at or past ``rung`` (from its pause or its finished
    records); None when it has not reached the rung."""
    from globalbatch.lab.sweep.trial import trial_done, trial_paused

    paused = trial_paused(trial_dir, spec)
    if trial_done(trial_dir, spec):
        path = trial_dir / "metrics.jsonl"
    elif paused is not None and paused["consumed"] >= rung:
        path = trial_dir / paused["records"]
    else:
        return None
    recs = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    head: dict[str, Any] = next((r for r in recs if r.get("kind") == "header"), {})
    ev = [(int(r["consumed"]), r["val_loss"]) for r in recs if r.get("val_loss") is not None and r.get("consumed", 0) > 0]
    upto = next((c for c, _ in ev if c >= rung), None)
    if upto is None:
        return None
    ev = [(c, v) for c, v in ev if c <= upto]
    loss = np.array([float(v) if isinstance(v, (int, float)) and math.isfinite(v) else math.nan for _, v in ev])
    return RungCell(spec=spec, consumed=np.array([c for c, _ in ev], dtype=float), loss=loss,
                    warmup_units=float(head.get("warmup_units", 0.0)))


@dataclass(kw_only=True)
class RungDecision:
    """What the rule decided at one rung."""

    rung: int
    margin: float
    spread: float
    """σ (the margin is 2σ)."""
    margin_source: str
    band: Optional[tuple[float, float]]
    """(floor, top): the worst batch's best loss at the rung, and the bound on the loosest common target; None: no
    batch past its warmup (nothing stops)."""
    stopped: list[str]
    protected: list[str]
    best: dict[str, float]
    """"batch/seed" → the best cell's LR at the rung."""
    losses: dict[str, float]
    """Cell name → its monotone held-out loss at the rung."""

    def to_json(self) -> dict[str, Any]:
        return {"rung": self.rung, "margin": self.margin, "spread": self.spread, "margin_source": self.margin_source,
                "band": list(self.band) if self.band else None, "stopped": self.stopped, "protected": self.protected,
                "best": self.best, "losses": self.losses}


def _mono(c: RungCell) -> np.ndarray:
    from globalbatch.critical.readout import monotone_fit

    m = monotone_fit(c.loss)
    return np.where(np.isfinite(m), m, np.inf)  # a diverged reading is worse than any finite one


def decide_rung(cells: Sequence[RungCell], config: SweepConfig, rung: int, *, probes: Sequence[RungCell] = (),
                sigma: Optional[tuple[float, str]] = None) -> RungDecision:
    """The rule of the module docstring over every cell that reached ``rung``. ``probes``: cells of another seed that
    only measure the seed spread (never stopped, never kept); ``sigma``: the spread and its source, measured at an
    earlier rung."""
    groups: dict[tuple[int, int], list[RungCell]] = {}
    for c in cells:
        groups.setdefault((c.spec.batch, c.spec.seed), []).append(c)
    mono = {c.spec.name: _mono(c) for c in cells}
    at_rung = {n: float(m[-1]) for n, m in mono.items()}
    best: dict[tuple[int, int], RungCell] = {
        g: min(cs, key=lambda c: (at_rung[c.spec.name], c.spec.lr)) for g, cs in groups.items()}

    def after_warmup(c: RungCell) -> np.ndarray:
        return c.consumed >= max(c.warmup_units, float(c.consumed[0]))

    def at_warmup_end(c: RungCell) -> float:
        m = mono[c.spec.name][after_warmup(c)]
        return float(m[0]) if m.size else math.inf

    # The band's top: floor + 0.75·(ceiling − floor) with floor = the worst group's best at the rung and ceiling =
    # the lowest best loss at the end of warmup so far; both can only fall by the end, so this bounds the top target.
    floor = max(at_rung[b.spec.name] for b in best.values())
    ceiling = min(min(at_warmup_end(c) for c in cs) for cs in groups.values())
    top = floor + BAND_TOP * (ceiling - floor)
    band = (floor, top) if math.isfinite(top) else None

    # The margin: the seed spread (SD over seeds of one cell's loss at the rung, median over cells), else the
    # read-out scatter of one cell's held-out loss (√2: a difference).
    by_cell: dict[tuple[int, float], list[float]] = {}
    for c in list(cells) + list(probes):
        by_cell.setdefault((c.spec.batch, c.spec.lr), []).append(float(_mono(c)[-1]))
    spreads = [statistics.stdev(v) for v in by_cell.values() if len(v) >= 2 and all(math.isfinite(x) for x in v)]
    if sigma is not None:
        spread, source = sigma
    elif spreads:
        n_seeds = len({c.spec.seed for c in list(cells) + list(probes)})
        spread, source = statistics.median(spreads), f"seed spread: {len(spreads)} cells at {n_seeds} seeds"
    else:
        res = [float(x) for c in cells for x in (c.loss - mono[c.spec.name])[after_warmup(c)] if math.isfinite(x)]
        spread = math.sqrt(2.0) * float(np.sqrt(np.mean(np.square(res)))) if res else 0.0
        source = "no seed spread: √2 × the held-out read-out's scatter about its monotone fit"
    margin = MARGIN_Z * spread

    batches = sorted(config.batches)
    protected: set[str] = set()
    stop_votes: dict[tuple[int, float], list[bool]] = {}
    for (b, s), cs in groups.items():
        protected.add(best[(b, s)].spec.name)
        i = batches.index(b)
        for nb in (batches[i - 1] if i > 0 else None, batches[i + 1] if i + 1 < len(batches) else None):
            if nb is not None and (nb, s) in best:
                lr = config.transfer_lr(best[(nb, s)].spec.lr, nb, b)
                protected |= {c.spec.name for c in cs
                              if abs(c.spec.lr - lr) <= 0.01 * lr and math.isfinite(at_rung[c.spec.name])}
        grid = np.array(cs[0].consumed)
        if band is None or any(c.consumed.shape != grid.shape or not np.array_equal(c.consumed, grid) for c in cs):
            for c in cs:
                stop_votes.setdefault((b, c.spec.lr), []).append(False)
            continue
        curves = np.vstack([mono[c.spec.name] for c in cs])
        lead = curves.min(axis=0)
        in_p = after_warmup(cs[0]) & (lead <= band[1])
        for k, c in enumerate(cs):
            can_win = bool(np.any(curves[k][in_p] <= lead[in_p] + margin)) if in_p.any() else True
            stop_votes.setdefault((b, c.spec.lr), []).append(not can_win)
    stopped = sorted(c.spec.name for c in cells if c.spec.name not in protected
                     and all(stop_votes.get((c.spec.batch, c.spec.lr), [False])))
    return RungDecision(rung=rung, margin=margin, spread=spread, margin_source=source, band=band, stopped=stopped,
                        protected=sorted(protected),
                        best={f"{g[0]}/{g[1]}": b.spec.lr for g, b in sorted(best.items())},
                        losses=dict(sorted(at_rung.items())))


def _edge_cells(config: SweepConfig, cells: Sequence[RungCell], decision: RungDecision,
                known: set[str]) -> list[TrialSpec]:
    """One LR beyond the edge of every LR a batch ran (``known`` cells, stopped ones included), where its best cell at
    the rung sits at that edge (every seed); never a cell already known."""
    if config.lr_edge_extend <= 0:
        return []
    ratio, seeds = config.lr_ratio(), config.seed_list()
    out: list[TrialSpec] = []
    for b in sorted({c.spec.batch for c in cells}):
        live = sorted({c.spec.lr for c in cells if c.spec.batch == b})
        ran = sorted({_spec(n).lr for n in known if _spec(n).batch == b})
        by_lr = {lr: statistics.median(decision.losses[c.spec.name] for c in cells if c.spec.batch == b
                                       and c.spec.lr == lr) for lr in live}
        best = min(live, key=lambda lr: (by_lr[lr], lr))
        grid = config.lrs_for(b)
        if len(ran) < 2:
            continue
        if best == ran[0] and sum(lr < min(grid) for lr in ran) < config.lr_edge_extend:
            new = float(f"{ran[0] / ratio:.4g}")
        elif best == ran[-1] and sum(lr > max(grid) for lr in ran) < config.lr_edge_extend:
            new = float(f"{ran[-1] * ratio:.4g}")
        else:
            continue
        out += [t for s in seeds if (t := TrialSpec(batch=b, lr=new, seed=s)).name not in known]
    return out


def probe_cells(config: SweepConfig) -> list[TrialSpec]:
    """A one-seed design's seed-spread probes: every batch at the middle LR of its grid, at a second seed (the grid's
    second, else the first + 1), trained to the first rung only; none when the design has several seeds."""
    seeds = config.seed_list()
    if len(seeds) > 1:
        return []
    every = list(config.seeds) if config.seeds is not None else [config.seed]
    probe = every[1] if len(every) > 1 else seeds[0] + 1
    return [TrialSpec(batch=b, lr=(g := config.lrs_for(b))[(len(g) - 1) // 2], seed=probe) for b in sorted(config.batches)]


def _cells(out: Path, specs: Sequence[TrialSpec], rung: int) -> list[RungCell]:
    return [c for t in specs if (c := read_cell(out / "trials" / t.name, t, rung)) is not None]


def run_rungs(config: SweepConfig, out: Path, rungs: Sequence[int],
              run_to: Callable[[Sequence[TrialSpec], Optional[int]], None]) -> dict[str, Any]:
    """Run the grid rung by rung: every live cell to each rung (``run_to(cells, units)``), the rule, edge cells at the
    rung, then the survivors to the budget (``run_to(cells, None)``). With one seed the probes
    (:func:`probe_cells`) run to the first rung and measure the seed spread every rung's margin uses. Decisions are
    pure functions of the trials' records (deterministic), so a resumed sweep repeats them and retrains nothing.
    Returns the log (also in ``halving.json``)."""
    live: list[TrialSpec] = list(config.trials())
    known = {t.name for t in live}  # every cell ever run: a stopped one never rejoins
    log: dict[str, Any] = {"rungs": list(rungs), "decisions": [], "stopped": []}
    probes = probe_cells(config) if rungs else []
    sigma: Optional[tuple[float, str]] = None
    for rung in rungs:
        while True:
            todo = live + (probes if sigma is None else [])
            run_to([t for t in todo if read_cell(out / "trials" / t.name, t, rung) is None], rung)
            cells = _cells(out, live, rung)
            decision = decide_rung(cells, config, rung, probes=_cells(out, probes, rung) if sigma is None else (),
                                   sigma=sigma)
            new = _edge_cells(config, cells, decision, known)
            if not new:
                break
            live += new
            known |= {t.name for t in new}
        live = [t for t in live if t.name not in decision.stopped]
        if sigma is None:
            sigma = (decision.spread, decision.margin_source + f", at rung {rung}")
        log["decisions"].append(decision.to_json())
        log["stopped"] += decision.stopped
        atomic_write_json(out / LOG_NAME, log)
    from globalbatch.lab.sweep.trial import trial_done

    run_to([t for t in live if not trial_done(out / "trials" / t.name, t)], None)
    log["finished"] = [t.name for t in live]
    atomic_write_json(out / LOG_NAME, log)
    return log


def trained_units(out: Path) -> dict[str, float]:
    """Units trained by every cell of a sweep directory: ``finished`` (``summary.json``), ``stopped`` (a pause never
    resumed: a cell the rule stopped, or one still running from a pause) and their ``total``."""
    finished = stopped = 0.0
    for d in sorted((Path(out) / "trials").glob("*")):
        s, p = d / "summary.json", d / "paused.json"
        try:
            if s.is_file():
                finished += float(json.loads(s.read_text())["consumed"])
            elif p.is_file():
                stopped += float(json.loads(p.read_text())["consumed"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return {"finished": finished, "stopped": stopped, "total": finished + stopped}


def _probe_sigma(out: Path, config: SweepConfig, rung: int) -> Optional[tuple[float, str]]:
    """The seed spread from the probes that reached the first rung and their first-seed cells there (None: none yet)."""
    probes = _cells(out, probe_cells(config), rung)
    twins = _cells(out, [TrialSpec(batch=c.spec.batch, lr=c.spec.lr, seed=config.seed_list()[0]) for c in probes], rung)
    pairs = {(c.spec.batch, c.spec.lr) for c in twins}
    if not pairs:
        return None
    d = decide_rung(twins, config, rung, probes=[c for c in probes if (c.spec.batch, c.spec.lr) in pairs])
    return d.spread, d.margin_source + f", at rung {rung}"


def middle_first(config: SweepConfig, specs: Sequence[TrialSpec]) -> list[TrialSpec]:
    """The cells in the order an asynchronous scheduler should start them: per seed and batch, the middle LR of the
    grid first (the probes' twin, the likeliest best), so the others meet a rival at their rungs."""
    def key(t: TrialSpec) -> tuple[int, int, bool, float]:
        grid = config.lrs_for(t.batch)
        return (t.seed, t.batch, abs(t.lr - grid[(len(grid) - 1) // 2]) > 1e-12, t.lr)

    return sorted(specs, key=key)


def run_statement(out_dir: str | Path) -> str:
    """What a halving sweep stopped and trained, for the report ("" before its first rung is decided)."""
    path = Path(out_dir) / LOG_NAME
    if not path.is_file():
        return ""
    log, units = json.loads(path.read_text()), trained_units(Path(out_dir))
    return (f"It stopped {len(log['stopped'])} cell(s) at rungs of {', '.join(f'{r:,}' for r in log['rungs'])} units; "
            f"it trained {units['total']:,.0f} units, {units['stopped']:,.0f} of them in stopped cells and probes. ")


def ray_scheduler(config: SweepConfig, out: Path, rungs: Sequence[int]):
    """A Ray Tune ``FIFOScheduler`` whose ``on_trial_result`` applies :func:`decide_rung` (built lazily: Ray is
    optional)."""
    from ray.tune.schedulers import FIFOScheduler, TrialScheduler

    class HalvingScheduler(FIFOScheduler):
        """Asynchronous successive halving (ASHA, Li et al. 2020): each trial reports ``rung`` (its index) once
        paused there (checkpoint on disk) and is decided at once, by the rule of :func:`decide_rung`, against every
        cell that has reached that rung so far (finished ones included); STOP ends it there, CONTINUE resumes it.
        Nothing stops before the margin is measured (the probes, or a second seed, at the first rung). A cell that
        arrives first at its rung is its batch's best so far and continues: with fewer workers than LRs per batch
        the decisions match the local runner's for every cell but the first of each batch."""

        def __init__(self) -> None:
            super().__init__()
            self.specs = [t for t in config.trials()]
            self.log: dict[str, Any] = {"rungs": list(rungs), "mode": "asynchronous (Ray Tune scheduler)",
                                        "decisions": [], "stopped": []}

        def on_trial_result(self, tune_controller, trial, result: dict) -> str:
            if "rung" not in result:
                return TrialScheduler.CONTINUE
            name, k = result["trial"], int(result["rung"])
            if name in self.log["stopped"]:
                return TrialScheduler.STOP
            sigma = _probe_sigma(out, config, rungs[0]) if probe_cells(config) else None
            cells = _cells(out, self.specs, rungs[k])
            if (probe_cells(config) and sigma is None) or not any(c.spec.name == name for c in cells):
                return TrialScheduler.CONTINUE  # no margin measured yet: nothing stops
            d = decide_rung(cells, config, rungs[k], sigma=sigma)
            stop = name in d.stopped
            self.log["decisions"].append({"trial": name, **d.to_json(), "stopped": [name] if stop else []})
            if stop:
                self.log["stopped"].append(name)
            atomic_write_json(out / LOG_NAME, self.log)
            return TrialScheduler.STOP if stop else TrialScheduler.CONTINUE

    return HalvingScheduler()


def _spec(name: str) -> TrialSpec:
    """``b8_lr0.003_s1`` → its TrialSpec."""
    b, lr, s = name.split("_")
    return TrialSpec(batch=int(b[1:]), lr=float(lr[2:]), seed=int(s[1:]))


def spent_text(out: Path | str, config: SweepConfig, unit: str = "unit") -> str:
    """What a sweep directory trained against its full design: ``"trained 1.2M tokens, 10.7 % of the full design's
    11.2M (edge and refinement cells included)"`` — beside the plan, which counts the base cells only."""
    n_seeds = len(config.seeds) if config.seeds is not None else 1  # the full design's (seed_list(): the design's)
    full = float(len(config.batches) * len(config.lrs) * n_seeds * config.budget)
    spent = trained_units(Path(str(out)))["total"]
    return (f"trained {spent:,.0f} {unit}s, {spent / full:.1%} of the full design's {full:,.0f} (edge and refinement "
            "cells included)")
