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
  batch's best (lowest median final held-out loss over seeds) moved by the optimizer's rule
  (√k Adam-type, ×k SGD: :meth:`SweepConfig.lrs_for`); the first one / two seeds.
* ``halving``: the full LR grid of every batch, the first seed, by successive halving
  (:mod:`globalbatch.lab.sweep.halving`): every cell pauses at rungs of 1/9 and 1/3 of the budget, and a cell that
  can no longer be the fastest LR of its batch to a target the rung shows stops there; the others resume from their
  checkpoints. Its compute is what actually trained, stopped cells' tokens included.

Fewer seeds, honestly: with one seed there is no seed-to-seed spread to state; the interval is that
seed's fit (its profile-likelihood interval), which does not contain the spread the benchmark measured
(B_crit max/min over 5 seeds 1.25–1.40 on the demo task), and the report says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["Design", "DESIGNS", "DESIGN_NAMES", "plan_for_budget", "BudgetPlan"]


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
    """Its agreement with the full 5-seed sweep, as measured by ``benchmarks/critical_cost.py`` (None: not measured)."""
    holds: bool = False
    """The benchmark found its B_crit within 2× of the full sweep's at every common target, on every task and
    repetition."""
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


DESIGNS: dict[str, Design] = {d.name: d for d in (
    Design(name="full", seeds=None, narrow=False, holds=True,
           summary="every batch × its LR grid × every seed (the reference)",
           measured="the reference of benchmarks/critical_cost.py"),
    Design(name="seeds1", seeds=1, narrow=False,
           summary="every batch × its LR grid, the first seed only",
           measured="MNIST only: B_crit within 1.87× (per target) / 1.71× (joint fit) at the 3 targets where the full "
                    "sweep has a point estimate, 17 % of its compute; not measured on tinygpt"),
    Design(name="narrow2", seeds=2, narrow=True,
           summary="the LR grid at the middle batch only, every other batch at its best LR moved by the optimizer's "
                   "rule; the first two seeds",
           measured="MNIST only: within 1.80× (per target) / 1.40× (joint fit) at the 3 targets with a point "
                    "estimate, 11 % of the compute; not measured on tinygpt"),
    Design(name="narrow1", seeds=1, narrow=True,
           summary="the LR grid at the middle batch only, every other batch at its best LR moved by the optimizer's "
                   "rule; the first seed only",
           measured="demo tinygpt: B_crit within 2.21× (per target, worst of 3 repetitions) / 2.12× (joint fit "
                    "B_crit(L)) of the full 5-seed sweep, reading it low (median ratios 0.53–1.01), for 6.1 % of its "
                    "tokens; MNIST: within 1.51× / 1.43× at the 3 targets where the full sweep has a point estimate, "
                    "for 5.7 %; one seed: no seed-to-seed spread is stated"),
    Design(name="halving", seeds=1, narrow=False, rungs=(1 / 9, 1 / 3),
           summary="every batch × its LR grid, the first seed, by successive halving: cells pause at 1/9 and 1/3 of "
                   "the budget and stop where they can no longer be their batch's fastest LR to a target the rung "
                   "shows",
           measured="MNIST: B_crit within 1.33× (per target) / 2.02× (joint fit) of the full 5-seed sweep at the 4 "
                    "targets where it has a point estimate, for 11.5 % (9.7–12.3 %) of its compute; demo tinygpt: "
                    "within 1.97× per target (against the documented full sweep), reading it low (median ratios "
                    "0.55–1.14), for 12.7 % (10.5–13.6 %); one seed: no seed-to-seed spread is stated"),
)}
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
        how = ("NOT shown to hold (no design that fits this budget is measured within 2× of the full sweep at every "
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
    return (f"Measured agreement with a full 5-seed sweep: {d.measured}." if d.measured
            else "Its agreement with a full sweep is not measured.")


def _statement(d: Design, frac: float) -> str:
    return f"Design {d.name}: {d.summary} — {frac:.0%} of the full design's tokens as planned. " + _agreement(d)
