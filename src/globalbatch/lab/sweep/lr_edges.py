"""An LR grid per batch that follows the best LR: extra cells when the best LR sits at an edge.

Each batch gets its own LR grid, centred by a scaling rule from a base batch
(:meth:`SweepConfig.lrs_for`: √batch for Adam-type optimizers, ∝ batch for SGD —
Malladi et al. 2022 and Goyal et al. 2017). A rule is only a guess: when the best LR of
a batch — the analysis' own choice (:func:`analysis_edges`: the batch's one LR for every
seed, the least median steps over seeds to the primary held-out target), or, when the sweep cannot be analysed
yet, the lowest median over seeds of the final held-out loss — is the smallest or the
largest LR of its grid, the optimum may lie beyond it, and the steps-to-target of that
batch — hence B_crit — would be biased. The sweep then runs one more LR beyond that edge
(a factor :meth:`SweepConfig.lr_ratio` further, for every seed), up to
``lr_edge_extend`` per side; a batch whose best LR is still at an edge is flagged.

A chosen LR that *falls* as the batch grows (``critical.seeds.LrFall``) is refined: each batch of the pair
gets the half-step between its LR and the one the rule predicts from the other batch's (:func:`refine_cells`),
up to ``lr_refine`` such LRs per batch. A narrow design (:mod:`~globalbatch.lab.sweep.designs`) runs the grid at
one base batch and moves the LR the analysis chooses there to the other batches by the rule (:func:`transfer_cells`),
again whenever that choice changes.

Where B_crit at the primary target lies beyond the largest batch (a one-sided bound for most seeds), the grid
is extended at the batch end the same way (:func:`batch_edge_cells`): the next batch (×2) at the LR grid the rule
gives it — and the rule's move of the largest batch's chosen LR where that lies outside it — for every seed, up to
``batch_edge_extend`` doublings; its LR edges then widen like any batch's.

Pure functions of the finished summaries (and the analysis of them), so a resumed sweep derives the same cells.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from globalbatch.lab.sweep.config import SweepConfig, TrialSpec

__all__ = ["finished_summaries", "lr_losses", "edge_cells", "best_lr_at_edge", "refine_cells", "transfer_cells",
           "BatchEdge", "batch_edge_cells"]


def finished_summaries(out: Path, config: SweepConfig) -> list[dict[str, Any]]:
    """Every finished trial under ``out/trials`` of this grid's batches and seeds (base cells and extensions)."""
    from globalbatch.lab.sweep.trial import trial_done

    seeds, batches = set(config.seed_list()), set(config.all_batches())
    found = []
    for path in sorted((out / "trials").glob("*/summary.json")):
        try:
            s = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if not isinstance(s, dict) or s.get("batch") not in batches or s.get("seed", 0) not in seeds:
            continue
        spec = TrialSpec(batch=int(s["batch"]), lr=float(s["lr"]), seed=int(s.get("seed", 0)))
        if path.parent.name == spec.name and trial_done(path.parent, spec):
            found.append(s)
    return found


def _final_loss(s: dict[str, Any]) -> float:
    x = s.get("final_val_loss")
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else math.inf  # diverged: worst


def lr_losses(summaries: Iterable[dict[str, Any]], batch: int) -> dict[float, float]:
    """LR → median over seeds of the final held-out loss, for one batch."""
    by_lr: dict[float, list[float]] = {}
    for s in summaries:
        if int(s["batch"]) == batch:
            by_lr.setdefault(float(s["lr"]), []).append(_final_loss(s))
    return {lr: statistics.median(v) for lr, v in sorted(by_lr.items())}


def best_lr_at_edge(summaries: Iterable[dict[str, Any]], batch: int) -> Optional[str]:
    """``"low"`` / ``"high"`` when the batch's best LR is the smallest / largest it ran, else None."""
    losses = lr_losses(list(summaries), batch)
    if len(losses) < 2:
        return None
    best = min(losses, key=lambda lr: (losses[lr], lr))
    if best == min(losses):
        return "low"
    if best == max(losses):
        return "high"
    return None


def edge_cells(config: SweepConfig, summaries: list[dict[str, Any]],
               edges: Optional[dict[int, str]] = None) -> list[TrialSpec]:
    """The extension cells the finished trials ask for (every seed), none beyond ``lr_edge_extend`` per side.

    ``edges``: batch → "low"/"high" from the analysis (``runner.analysis_edges``); None: the
    final held-out loss decides (:func:`best_lr_at_edge`).

    A batch is considered only once all its cells for every seed are finished, so the decision
    never rests on a partial set of seeds. An extension cell (an LR outside the batch's grid) that some seeds
    finished and others did not — a sweep stopped while it ran — is completed first, for the seeds it lacks.
    """
    if config.lr_edge_extend <= 0:
        return []
    seeds = config.seed_list()
    ratio = config.lr_ratio()
    out: list[TrialSpec] = []
    for b in config.all_batches():  # a batch-edge extension's batch once it ran
        mine = [s for s in summaries if int(s["batch"]) == b]
        lrs = sorted({float(s["lr"]) for s in mine})
        base = config.lrs_for(b)
        started = {lr: {int(s.get("seed", 0)) for s in mine if float(s["lr"]) == lr} for lr in lrs}
        if lrs and all(len(started.get(lr, ())) == len(seeds) for lr in base):
            out += [TrialSpec(batch=b, lr=lr, seed=s) for lr in lrs if lr not in base for s in seeds
                    if s not in started[lr]]  # an interrupted extension: its missing seeds
        if not lrs or any(len(started[lr]) < len(seeds) for lr in lrs):
            continue  # some seed of some LR still running
        if any(lr not in lrs for lr in base):
            continue
        edge = edges.get(b) if edges is not None else best_lr_at_edge(mine, b)
        if edge == "low" and sum(lr < min(base) for lr in lrs) < config.lr_edge_extend:
            new = float(f"{min(lrs) / ratio:.4g}")
        elif edge == "high" and sum(lr > max(base) for lr in lrs) < config.lr_edge_extend:
            new = float(f"{max(lrs) * ratio:.4g}")
        else:
            continue
        out += [TrialSpec(batch=b, lr=new, seed=s) for s in seeds]
    return out


@dataclass(frozen=True)
class BatchEdge:
    """What the analysis says at the primary target about the largest batch (for :func:`batch_edge_cells`)."""

    beyond: int
    """Seeds whose B_crit (point estimate of their fit, pooled where pooling holds) lies beyond the largest batch."""
    seeds: int
    """Seeds with a monotone fit there."""
    lr: Optional[float]
    """The largest batch's chosen LR (the one for every seed)."""

    @property
    def extend(self) -> bool:
        """At least half the seeds put B_crit beyond the largest batch."""
        return self.seeds > 0 and 2 * self.beyond >= self.seeds


def batch_edge_cells(config: SweepConfig, summaries: list[dict[str, Any]], edge: Optional[BatchEdge],
                     narrow_lr: Optional[float] = None) -> list[TrialSpec]:
    """The batch-edge extension's cells: an edge batch that started completes its grid (every seed); else, when
    ``edge.extend`` and fewer than ``batch_edge_extend`` doublings ran, the next one — batch 2·largest, at
    :meth:`SweepConfig.lrs_for` plus the rule's move of ``edge.lr`` where that lies outside, for every seed.

    A narrow design (``narrow_lr``: its base batch's chosen LR) runs the new batch at that LR moved by the rule
    only, like its other batches; :func:`transfer_cells` completes and re-derives it from then on."""
    seeds = config.seed_list()
    ran = {int(s["batch"]) for s in summaries}
    done = {(int(s["batch"]), float(s["lr"]), int(s.get("seed", 0))) for s in summaries}
    for b in config.edge_batches() if narrow_lr is None else ():
        if b in ran:
            todo = [TrialSpec(batch=b, lr=lr, seed=s) for lr in config.lrs_for(b) for s in seeds
                    if (b, lr, s) not in done]
            if todo:
                return todo
    if edge is None or not edge.extend:
        return []
    new = 2 * max(ran | set(config.batches))
    if new not in config.edge_batches():
        return []  # the cap
    if narrow_lr is not None:
        return [TrialSpec(batch=new, lr=config.transfer_lr(narrow_lr, config.narrow_base(), new), seed=s)
                for s in seeds]
    lrs = list(config.lrs_for(new))
    if edge.lr is not None:
        moved = float(f"{edge.lr * 2 ** config.rule_power():.4g}")
        if not _near(moved, lrs) and not (min(lrs) <= moved <= max(lrs)):
            lrs.append(moved)
    return [TrialSpec(batch=new, lr=lr, seed=s) for lr in lrs for s in seeds]


def _edge_values(config: SweepConfig, batch: int) -> set[float]:
    """The LRs an edge extension of ``batch`` may run (beyond either end of its grid)."""
    grid, ratio = config.lrs_for(batch), config.lr_ratio()
    out = set()
    lo, hi = min(grid), max(grid)
    for _ in range(config.lr_edge_extend):
        lo, hi = float(f"{lo / ratio:.4g}"), float(f"{hi * ratio:.4g}")
        out |= {lo, hi}
    return out


def _near(lr: float, lrs: Iterable[float], rel: float = 0.01) -> bool:
    return any(abs(lr - x) <= rel * x for x in lrs)


def refine_cells(config: SweepConfig, summaries: list[dict[str, Any]],
                 falls: Optional[list[tuple[int, int, float, float]]]) -> list[TrialSpec]:
    """Cells that refine the neighbourhood of a falling chosen LR: for each ``(batch_low, batch_high, lr_low,
    lr_high)`` (samples), at each batch of the pair, the geometric midpoint between its chosen LR and the LR the
    rule predicts from the other batch's (on a grid that follows the rule both were run already: the fall is
    the grid's coarseness or noise, so the half-step between them decides; when the fall spans several grid
    steps that midpoint was run too, and the interval is halved towards the chosen LR), for every seed — unless
    already run (within 1 %) or the batch already holds ``lr_refine`` LRs outside its grid and edge extensions."""
    if not falls or config.lr_refine <= 0:
        return []
    seeds = config.seed_list()
    p = config.rule_power()
    out: dict[str, TrialSpec] = {}
    for b_lo, b_hi, lr_lo, lr_hi in falls:
        for b, chosen, rule in ((b_hi, lr_hi, lr_lo * (b_hi / b_lo) ** p), (b_lo, lr_lo, lr_hi * (b_lo / b_hi) ** p)):
            ran = {float(s["lr"]) for s in summaries if int(s["batch"]) == b}
            known = set(config.lrs_for(b)) | _edge_values(config, b)
            extra = [x for x in ran if not _near(x, known)]
            lr = float(f"{math.sqrt(chosen * rule):.4g}")
            for _ in range(3):  # a fall over several grid steps: the midpoint was run; halve towards the chosen LR
                if not _near(lr, ran):
                    break
                lr = float(f"{math.sqrt(chosen * lr):.4g}")
            if _near(lr, ran) or len(extra) >= config.lr_refine:
                continue
            for s in seeds:
                t = TrialSpec(batch=b, lr=lr, seed=s)
                out[t.name] = t
    return list(out.values())


def transfer_cells(config: SweepConfig, summaries: list[dict[str, Any]],
                   choice: Optional[tuple[float, Optional[str]]] = None) -> list[TrialSpec]:
    """A narrow design's other batches: once the base batch's grid (and its edge extensions) is finished for every
    seed and its chosen LR is not at an edge it may still extend, each other batch (a batch-edge extension's
    included, once it ran: :func:`batch_edge_cells`) at that LR moved by the rule, for every seed.

    ``choice``: ``(lr, edge)``, the base batch's LR as the analysis over seeds reads it
    (:func:`globalbatch.critical.lr_choice.chosen_lr_per_batch` at the primary target: the least median held-out
    steps over seeds, the final analysis' own rule) and its ``"low"``/``"high"`` edge flag or None; None when the
    sweep cannot be analysed yet: the lowest median final held-out loss decides. Called on every pass, so when the
    analysis' choice changes once the other batches ran (its primary target moves with them), they run the new LR
    moved by the rule; a transferred LR some seeds finished and others did not is completed first."""
    base = config.narrow_base()
    seeds = config.seed_list()
    mine = [s for s in summaries if int(s["batch"]) == base]
    lrs = sorted({float(s["lr"]) for s in mine})
    if not lrs or any(lr not in lrs for lr in config.lrs_for(base)) \
            or any(len([s for s in mine if float(s["lr"]) == lr]) < len(seeds) for lr in lrs):
        return []
    started: dict[tuple[int, float], set[int]] = {}
    for s in summaries:
        if int(s["batch"]) != base:
            started.setdefault((int(s["batch"]), float(s["lr"])), set()).add(int(s.get("seed", 0)))
    partial = [TrialSpec(batch=b, lr=lr, seed=s) for (b, lr), ran in sorted(started.items()) for s in seeds
               if s not in ran]  # an interrupted transfer: its missing seeds
    if partial:
        return partial
    if choice is None:
        losses = lr_losses(mine, base)
        best, edge = min(losses, key=lambda lr: (losses[lr], lr)), best_lr_at_edge(mine, base)
    else:
        best, edge = choice
    grid = config.lrs_for(base)
    if (edge == "low" and sum(lr < min(grid) for lr in lrs) < config.lr_edge_extend) or \
            (edge == "high" and sum(lr > max(grid) for lr in lrs) < config.lr_edge_extend):
        return []  # the base batch's grid widens first (edge_cells)
    extended = {int(s["batch"]) for s in summaries} & set(config.edge_batches())  # a batch-edge extension ran
    return [TrialSpec(batch=b, lr=config.transfer_lr(best, base, b), seed=s)
            for b in sorted(set(config.batches) | extended) if b != base for s in seeds]
