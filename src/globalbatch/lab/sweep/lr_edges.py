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

Pure functions of the finished summaries, so a resumed sweep derives the same cells.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Iterable, Optional

from globalbatch.lab.sweep.config import SweepConfig, TrialSpec

__all__ = ["finished_summaries", "lr_losses", "edge_cells", "best_lr_at_edge"]


def finished_summaries(out: Path, config: SweepConfig) -> list[dict[str, Any]]:
    """Every finished trial under ``out/trials`` of this grid's batches and seeds (base cells and extensions)."""
    from globalbatch.lab.sweep.trial import trial_done

    seeds, batches = set(config.seed_list()), set(config.batches)
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
    never rests on a partial set of seeds.
    """
    if config.lr_edge_extend <= 0:
        return []
    seeds = config.seed_list()
    ratio = config.lr_ratio()
    out: list[TrialSpec] = []
    for b in sorted(config.batches):
        mine = [s for s in summaries if int(s["batch"]) == b]
        lrs = sorted({float(s["lr"]) for s in mine})
        if not lrs or any(len([s for s in mine if float(s["lr"]) == lr]) < len(seeds) for lr in lrs):
            continue  # some seed of some LR still running
        base = config.lrs_for(b)
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
