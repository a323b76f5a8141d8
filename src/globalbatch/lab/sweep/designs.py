"""Cheaper designs of the critical-batch sweep, and the one ``globalbatch sweep --budget`` plans.

The full design (every batch × its LR grid × every seed, McCandlish et al. 2018, arXiv 1812.06162,
App. A.3: "tune the LR per batch") is what the others are measured against
(``benchmarks/critical_cost.py``: each cheap design three times with independent seeds against one full
5-seed sweep; the ratio of its B_crit to the full sweep's at every common target). Every design trains
through the same runner and the same trial (:func:`globalbatch.lab.sweep.trial.run_trial`): a design only
chooses which cells run.

* ``full``: every cell (LR-edge extensions and falling-LR refinements included).
* ``seeds1``: the full LR grid of every batch, the first seed only.
* ``narrow1`` / ``narrow2``: the LR grid at one base batch (the middle of the swept batches), widened at an
  edge of that grid only (:attr:`SweepConfig.lr_edge_extend`); every other batch runs one LR, the base
  batch's LR as the analysis over seeds chooses it (:func:`globalbatch.critical.lr_choice.chosen_lr_per_batch`:
  the least median held-out steps to the primary target, the final analysis' rule) moved by the optimizer's rule
  (√k Adam-type, ×k SGD: :meth:`SweepConfig.lrs_for`), re-derived whenever that choice changes
  (:func:`~globalbatch.lab.sweep.lr_edges.transfer_cells`); the first one / two seeds.
* ``halving``: the full LR grid of every batch, the first seed, by successive halving
  (:mod:`globalbatch.lab.sweep.halving`): every cell pauses at rungs of 1/9 and 1/3 of the budget, and a cell that
  can no longer be the fastest LR of its batch to a target the rung shows stops there; the others resume from their
  checkpoints. Its compute is what actually trained, stopped cells' tokens included.

What each design gave against the full sweep is kept in one place, :mod:`globalbatch.lab.sweep.measured` (the
output of ``benchmarks/critical_cost.py --record``, with its provenance): a design's ``measured`` statement and its
``holds`` flag are derived from those numbers (:func:`agreement_text`, :func:`shown_to_hold`), not written here.

Fewer seeds, honestly: with one seed there is no seed-to-seed spread to state; the interval is that
seed's fit (its profile-likelihood interval), which does not contain the spread the benchmark measured
(B_crit max/min over 5 seeds 1.25–1.40 on the demo task), and the report says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["Design", "DESIGNS", "DESIGN_NAMES", "plan_for_budget", "BudgetPlan", "agreement_text", "shown_to_hold"]

TASK_LABELS = {"tinygpt": "demo tinygpt", "mnist": "MNIST"}
"""The benchmark's tasks, each of which a design must hold on to be shown to hold."""
MAX_RATIO = 2.0
"""Within this factor of the full sweep's B_crit (either way) at every target: the benchmark's criterion."""


def _cells(design: str, measured: dict) -> dict[str, tuple[dict, dict]]:
    """Task → (the reference's record, the design's record) for the tasks where ``design`` was measured."""
    return {task: (m["reference"], m["designs"][design]) for task, m in measured.items() if design in m["designs"]}


def shown_to_hold(design: str, measured: Optional[dict] = None) -> bool:
    """Measured on every benchmark task (:data:`TASK_LABELS`), and at every target where the full sweep has a point
    estimate every repetition has one too, within :data:`MAX_RATIO` of the full sweep's (worst over repetitions). A
    one-seed fit whose B_crit lies beyond the swept batches is a bound, not shown within anything."""
    from globalbatch.lab.sweep.measured import MEASURED

    cells = _cells(design, MEASURED if measured is None else measured)
    if set(cells) != set(TASK_LABELS):
        return False
    for ref, row in cells.values():
        for b_ref, cell in zip(ref["b_crit"], row["per_target"]):
            if b_ref is not None and (cell is None or cell[2] < row["reps"] or cell[1] > MAX_RATIO):
                return False
    return True


def agreement_text(design: str, measured: Optional[dict] = None) -> Optional[str]:
    """What the benchmark measured for ``design``, per task: its compute as a share of the full 5-seed sweep's units
    and its B_crit ÷ the full sweep's at the targets where the full sweep has a point estimate (median range, worst
    over repetitions, per target and from the joint fit B_crit(L)); None when it was not measured."""
    from globalbatch.lab.sweep.measured import MEASURED, SOURCE

    cells = _cells(design, MEASURED if measured is None else measured)
    if not cells:
        return None
    parts = []
    for task, label in TASK_LABELS.items():
        if task not in cells:
            parts.append(f"{label}: not measured")
            continue
        ref, row = cells[task]
        at = [i for i, b in enumerate(ref["b_crit"]) if b is not None]
        pts = [row["per_target"][i] for i in at if row["per_target"][i] is not None]
        short = [f"{ref['targets'][i]:g}" for i in at if (row["per_target"][i] or (0, 0, 0))[2] < row["reps"]]
        joint = [row["joint"][i][1] for i in at if row["joint"] and row["joint"][i] is not None]
        compute = sorted(row["compute"])
        text = (f"{label}: {compute[len(compute) // 2]:.1%} of the full sweep's units; B_crit ÷ the full sweep's at "
                f"{len(at)} target(s): " + (f"median {min(c[0] for c in pts):.2f}–{max(c[0] for c in pts):.2f}, worst "
                                             f"{max(c[1] for c in pts):.2f}× per target" if pts else "no point estimate")
                + (f" (a point in fewer than {row['reps']} repetitions at {', '.join(short)})" if short else "")
                + (f", {max(joint):.2f}× joint fit" if joint else ""))
        parts.append(text)
    reps = max(row["reps"] for _, row in cells.values())
    return "; ".join(parts) + f" (worst of {reps} repetitions; {SOURCE})"


@dataclass(kw_only=True, frozen=True, slots=True)
class Design:
    """Which cells of the sweep's grid run."""

    name: str
    seeds: Optional[int]
    """How many of the grid's seeds run (the first ones); None: all."""
    narrow: bool
    """The LR grid at the base batch only; every other batch at the rule's LR from the base batch's best."""
    summary: str
    """One line: what the design runs."""
    measured: Optional[str] = None
    """Its agreement with the full 5-seed sweep as ``benchmarks/critical_cost.py`` measured it (:func:`agreement_text`
    of :mod:`globalbatch.lab.sweep.measured`; None: not measured)."""
    holds: bool = False
    """The benchmark found its B_crit within 2× of the full sweep's at every target where the full sweep has a point
    estimate, on every task and repetition (:func:`shown_to_hold`)."""
    rungs: tuple[float, ...] = ()
    """Successive halving: the rungs as fractions of the budget (:mod:`globalbatch.lab.sweep.halving`); () none."""

    def planned_cells(self, n_batches: int, n_lrs: int, n_seeds: int) -> int:
        """Trials planned before any edge extension or refinement (a halving design: every cell starts)."""
        s = n_seeds if self.seeds is None else min(self.seeds, n_seeds)
        return s * (n_lrs + n_batches - 1) if self.narrow else s * n_batches * n_lrs

    def planned_fraction(self, n_batches: int, n_lrs: int, n_seeds: int) -> float:
        """Planned trials (all of the same budget) ÷ the full design's. A halving design plans every cell to the
        budget (its most: what it trains when nothing stops); what it trains is measured (``measured``)."""
        return self.planned_cells(n_batches, n_lrs, n_seeds) / (n_batches * n_lrs * n_seeds)


_SUMMARIES = (
    ("full", None, False, (), "every batch × its LR grid × every seed (the reference)"),
    ("seeds1", 1, False, (), "every batch × its LR grid, the first seed only"),
    ("narrow2", 2, True, (), "the LR grid at the middle batch only, every other batch at its best LR moved by the "
                             "optimizer's rule; the first two seeds"),
    ("narrow1", 1, True, (), "the LR grid at the middle batch only, every other batch at its best LR moved by the "
                             "optimizer's rule; the first seed only"),
    ("halving", 1, False, (1 / 9, 1 / 3), "every batch × its LR grid, the first seed, by successive halving: cells "
                                          "pause at 1/9 and 1/3 of the budget and stop where they can no longer be "
                                          "their batch's fastest LR to a target the rung shows"),
)
DESIGNS: dict[str, Design] = {
    name: Design(name=name, seeds=seeds, narrow=narrow, rungs=rungs, summary=summary,
                 measured="the reference of benchmarks/critical_cost.py" if name == "full" else agreement_text(name),
                 holds=name == "full" or shown_to_hold(name))
    for name, seeds, narrow, rungs, summary in _SUMMARIES}
DESIGN_NAMES = tuple(DESIGNS)


@dataclass(kw_only=True, frozen=True, slots=True)
class BudgetPlan:
    """What ``--budget`` chose and why."""

    design: Design
    fraction: float
    """The budget as a fraction of the full design's tokens."""
    planned_fraction: float
    """The chosen design's planned tokens ÷ the full design's (edge extensions may add a little)."""
    statement: str


def plan_for_budget(fraction: float, n_batches: int, n_lrs: int, n_seeds: int) -> Optional[BudgetPlan]:
    """The full design when ``fraction`` ≥ 1; else the cheapest design that fits ``fraction`` of the full design's
    tokens and that the benchmark shows to hold; when none of those fits, the cheapest that fits, stated as not
    shown to hold; None when nothing fits."""
    fits = [d for d in DESIGNS.values() if d.planned_fraction(n_batches, n_lrs, n_seeds) <= fraction + 1e-12]
    if not fits:
        return None
    cost = lambda d: d.planned_fraction(n_batches, n_lrs, n_seeds)  # noqa: E731
    holding = [d for d in fits if d.holds]
    chosen = DESIGNS["full"] if fraction >= 1 else min(holding or fits, key=cost)  # the whole budget: the full design
    planned = cost(chosen)
    if chosen.name == "full":
        how = "the full design fits the budget"
    elif chosen.holds:
        how = f"measured agreement with a full 5-seed sweep: {chosen.measured}"
    else:
        how = (f"NOT shown to hold (no design that fits this budget is measured within {MAX_RATIO:g}× of the full sweep at every "
               "target on both benchmark tasks)" + (f"; measured: {chosen.measured}" if chosen.measured else ""))
    statement = (f"design {chosen.name} for a budget of {fraction:.1%} of the full design's tokens: {chosen.summary}; "
                 f"planned {planned:.1%} of the full design's tokens; {how}")
    return BudgetPlan(design=chosen, fraction=fraction, planned_fraction=planned, statement=statement)


def budget_fraction(text: object, full_units: int, field: str = "sweep_budget") -> float:
    """``--budget``: a fraction of the full design's units (``0.1``, ``10%``) or a number of units (``1.2M``,
    every trial together) → the fraction of the full design's units (> 0; may exceed 1)."""
    from globalbatch.errors import SettingError
    from globalbatch.units import parse_count

    allowed = "a fraction of the full design's tokens, 0 < F ≤ 1 (e.g. 0.1 or 10%), or a token count (e.g. 1.2M)"
    raw = str(text).strip()
    as_fraction = raw.endswith("%") or ("." in raw and not raw[-1:].isalpha())
    try:
        if raw.endswith("%"):
            value = float(raw[:-1]) / 100.0
        elif as_fraction:
            value = float(raw)
        else:
            value = parse_count(raw, field) / float(full_units)
    except (ValueError, OverflowError):
        raise SettingError(field, text, allowed) from None
    if not (math.isfinite(value) and value > 0):
        raise SettingError(field, text, allowed)
    if as_fraction and value > 1:
        raise SettingError(field, text, allowed, why="a fraction above 1; a token count may ask for more than the full "
                                                      "design")
    return value


def design_statement(name: str, n_batches: int, n_lrs: int, n_seeds: int, ran: str = "") -> str:
    """The report's line about the design a sweep ran; ``ran``: what a halving sweep stopped and trained
    (:func:`globalbatch.lab.sweep.halving.run_statement`), said instead of its plan."""
    d = DESIGNS[name]
    if d.name == "full":
        return ""
    frac = d.planned_fraction(n_batches, n_lrs, n_seeds)
    if d.rungs and ran:
        return f"Design {d.name}: {d.summary}. " + ran + _agreement(d) + seeds_text(d)
    return _statement(d, frac) + seeds_text(d)


def seeds_text(d: Design) -> str:
    """The one-seed caveat of a design (empty with several seeds)."""
    return "" if d.seeds is None or d.seeds > 1 else (
        " One seed: the intervals are that seed's fit alone and do not contain the seed-to-seed spread "
        "(B_crit max/min over 5 seeds was 1.25–1.40 on the demo task).")


def _agreement(d: Design) -> str:
    return ((f"Measured agreement with a full 5-seed sweep: {d.measured}." if d.measured
             else "Its agreement with a full sweep is not measured.")
            + ("" if d.holds else f" NOT shown to hold: the benchmark did not find it within {MAX_RATIO:g}× of the "
                                  "full sweep's B_crit at every target, in every repetition, on both tasks."))


def _statement(d: Design, frac: float) -> str:
    return f"Design {d.name}: {d.summary} — {frac:.0%} of the full design's tokens as planned. " + _agreement(d)
