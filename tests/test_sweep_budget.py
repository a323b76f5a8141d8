"""``globalbatch sweep --budget``: the design it plans, what it runs, and the report's statement of it."""

from __future__ import annotations

import html
import json

import pytest

from globalbatch.lab.sweep.designs import DESIGNS, agreement_text, budget_fraction, plan_for_budget, shown_to_hold
from globalbatch.lab.sweep.measured import MEASURED
from test_sweep import TINY_ARGS, _cli


@pytest.mark.parametrize("fraction", [0.05, 0.2, 0.34, 0.5, 0.7, 1.0])
def test_the_plan_is_the_cheapest_holding_design_that_fits(fraction):
    n_b, n_lr, n_s = 5, 3, 5
    plan = plan_for_budget(fraction, n_b, n_lr, n_s)
    cost = {d.name: d.planned_fraction(n_b, n_lr, n_s) for d in DESIGNS.values()}
    fits = [name for name, c in cost.items() if c <= fraction]
    if not fits:
        assert plan is None
        return
    assert plan.design.name in fits and plan.planned_fraction == cost[plan.design.name] <= fraction
    holding = [n for n in fits if DESIGNS[n].holds]
    if fraction >= 1:
        assert plan.design.name == "full"
    elif holding:
        assert plan.design.holds and cost[plan.design.name] == min(cost[n] for n in holding)
    else:
        assert "NOT shown to hold" in plan.statement
    assert plan.design.name in plan.statement and f"{plan.planned_fraction:.1%}" in plan.statement


def _measured(tiny_worst: float, mnist_cells=((1.0, 1.5, 3), (1.1, 1.9, 3), None)) -> dict:
    """Two tasks as benchmarks/critical_cost.py --record writes them; MNIST has a point at its first two targets."""
    def task(b_crit, cells):
        return {"reference": {"dir": "x", "seeds": 5, "units": 1000, "targets": [3.0, 2.9, 2.8][:len(b_crit)],
                              "b_crit": b_crit},
                "designs": {"d": {"reps": 3, "compute": [0.05, 0.06, 0.07], "per_target": list(cells),
                                  "joint": [(0.9, 1.2, 3)] * len(cells)}}}
    return {"tinygpt": task([500.0, 600.0], [(0.8, 1.3, 3), (0.7, tiny_worst, 3)]),
            "mnist": task([200.0, 190.0, None], mnist_cells)}


def test_holds_is_derived_from_the_recorded_measurements():
    """Within 2× at every target where the reference has a point, every repetition with a point, both tasks."""
    assert shown_to_hold("d", _measured(1.99))
    assert not shown_to_hold("d", _measured(2.09))  # one target of one task beyond 2×
    assert not shown_to_hold("d", _measured(1.5, ((1.0, 1.5, 3), (1.1, 1.9, 2), None)))  # a bound in one repetition
    assert not shown_to_hold("d", _measured(1.5, ((1.0, 1.5, 3), None, None)))  # no point where the reference has one
    one_task = _measured(1.5)
    del one_task["mnist"]
    assert not shown_to_hold("d", one_task) and "MNIST: not measured" in agreement_text("d", one_task)
    text = agreement_text("d", _measured(2.09))
    assert "demo tinygpt: 6.0%" in text and "worst 2.09× per target" in text and "1.20× joint fit" in text
    assert "MNIST: 6.0%" in text and "at 2 target(s)" in text and "worst 1.90× per target" in text
    assert agreement_text("nothing", _measured(1.0)) is None
    for name, d in DESIGNS.items():  # the registry's flags and statements are these functions of the record
        if name != "full":
            assert d.holds == shown_to_hold(name, MEASURED) and d.measured == agreement_text(name, MEASURED)


def test_planned_fractions_count_cells():
    assert DESIGNS["full"].planned_fraction(5, 3, 5) == 1.0
    assert DESIGNS["seeds1"].planned_cells(5, 3, 5) == 15
    assert DESIGNS["narrow1"].planned_cells(5, 3, 5) == 7 and DESIGNS["narrow2"].planned_cells(5, 3, 5) == 14
    assert budget_fraction("10%", 1000) == pytest.approx(0.1) and budget_fraction("250", 1000) == 0.25
    assert budget_fraction("2K", 1000) == 2.0  # a token count may ask for more than the full design


def test_budget_runs_the_planned_design_and_the_report_says_so(tmp_path, capsys):
    """3 batches × 2 LRs × 2 seeds at 2K tokens: a 40 % budget fits narrow1 (4 of 12 cells) and seeds1 (6 of 12)."""
    out = tmp_path / "s"
    args = ["sweep", *TINY_ARGS, "--batches", "2,4,8", "--lrs", "1e-3,3e-3", "--tokens", "2K", "--seeds", "0,1",
            "--workers", "1", "--threads", "1", "--eval-points", "6", "--val-samples", "16", "--lr-edge-extend", "0",
            "--budget", "0.4", "--out", str(out), "--json"]
    code, stdout, err = _cli(args, capsys)
    assert code == 0, err
    doc = json.loads(stdout)
    plan = plan_for_budget(0.4, 3, 2, 2)
    assert doc["design"]["name"] == plan.design.name and doc["design"]["statement"] == plan.statement
    assert plan.statement in err  # said before it runs
    ran = set(doc["ran"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["grid"]["design"] == plan.design.name
    if plan.design.narrow:  # the base batch's two LRs, then one LR at each other batch; the first seed only
        assert len(ran) == 4 and all(name.endswith("_s0") for name in ran)
        assert sum(name.startswith("b4_") for name in ran) == 2
    code, stdout, err = _cli(["report", str(out), "--json"], capsys)
    assert code == 0, err
    report = json.loads(stdout)
    # one answer: sweep --json's recommendation is the report's (the seeds' held-out analysis), the first seed's
    # training-loss pick is the comparison beside it
    assert doc["recommendation"] is not None and doc["recommendation"] == report["recommendation"]
    assert doc["first_seed_recommendation"] == report["first_seed_recommendation"]
    assert report["design"]["name"] == plan.design.name and plan.design.summary in report["design"]["statement"]
    assert report["design"]["holds"] == plan.design.holds == doc["design"]["holds"]
    assert report["design"]["measured"] == plan.design.measured and plan.design.measured in report["design"]["statement"]
    if not plan.design.holds:
        assert "NOT shown to hold" in report["design"]["statement"] and "NOT shown to hold" in plan.statement
    page = (out / "report" / "report.html").read_text()
    assert html.escape(plan.design.summary) in page and html.escape(plan.design.measured) in page
    # what it trained, beside the plan: the trials' tokens over the full design's (3 × 2 × 2 × 2K = 24K)
    spent = sum(json.loads((out / "trials" / n / "summary.json").read_text())["consumed"] for n in ran)
    want = f"trained {spent:,.0f} tokens, {spent / 24_000:.1%} of the full design's 24,000"
    assert doc["design"]["spent"].startswith(want) and html.escape(want) in page
