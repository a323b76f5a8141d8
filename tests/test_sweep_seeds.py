"""Seeds, the LR grid per batch with edge extensions, warmup in units and the log-spaced evaluations."""

from __future__ import annotations

import json

import pytest

from globalbatch._util import SettingError
from globalbatch.lab.sweep import SweepConfig, load_sweep, run_sweep
from globalbatch.lab.sweep.config import TrialSpec, demo_config
from globalbatch.lab.sweep.lr_edges import BatchEdge, batch_edge_cells, best_lr_at_edge, edge_cells
from globalbatch.lab.tasks import load_task
from globalbatch.lab.tasks.base import val_order

TINY = dict(n_layer=1, d_model=16, n_head=2, seq_len=16, max_corpus_bytes=100_000)


def test_lr_grid_follows_the_optimizer_rule():
    cfg = SweepConfig(batches=[4, 16, 64], lrs=[1e-3, 2e-3], budget=10_000)
    assert cfg.lr_rule_resolved() == "sqrt"  # adamw
    assert cfg.lrs_for(4) == [1e-3, 2e-3] and cfg.lrs_for(16) == [2e-3, 4e-3] and cfg.lrs_for(64) == [4e-3, 8e-3]
    sgd = SweepConfig(batches=[4, 16], lrs=[0.1], budget=10_000, optimizer="sgd")
    assert sgd.lr_rule_resolved() == "linear" and sgd.lrs_for(16) == [0.4]
    assert SweepConfig(batches=[4, 16], lrs=[0.1], budget=10_000, lr_rule="none").lrs_for(16) == [0.1]
    assert SweepConfig(batches=[4, 16], lrs=[0.1], budget=10_000, base_batch=16).lrs_for(4) == [0.05]
    # An old manifest (no lr_rule) keeps one grid for every batch.
    assert SweepConfig.from_dict({"batches": [4, 16], "lrs": [0.1], "budget": 10}).lr_rule == "none"


def test_seeds_are_an_axis_of_the_grid():
    cfg = SweepConfig(batches=[4, 8], lrs=[1e-3], budget=10_000, seeds=[0, 3], lr_rule="none")
    assert [t.name for t in cfg.trials()] == ["b4_lr0.001_s0", "b8_lr0.001_s0", "b4_lr0.001_s3", "b8_lr0.001_s3"]
    assert SweepConfig(batches=[4], lrs=[1e-3], budget=10, seed=5).seed_list() == [5]
    for bad in ([], [1, 1], [-1], ["a"]):
        with pytest.raises(SettingError, match="^seeds "):
            SweepConfig(batches=[4], lrs=[1e-3], budget=10, seeds=bad)


def test_warmup_is_in_units_and_independent_of_the_budget():
    a = SweepConfig(batches=[4], lrs=[1e-3], budget=100_000, warmup=5000)
    b = SweepConfig(batches=[4], lrs=[1e-3], budget=900_000, warmup=5000)
    assert a.warmup_units() == b.warmup_units() == 5000
    assert SweepConfig(batches=[4], lrs=[1e-3], budget=100_000).warmup_units() == 5000  # 5 % fallback
    with pytest.raises(SettingError, match="^warmup 100000 is not allowed"):
        SweepConfig(batches=[4], lrs=[1e-3], budget=100_000, warmup=100_000)


def test_warmup_min_steps_gives_every_batch_that_many_steps():
    cfg = SweepConfig(batches=[2, 32], lrs=[1e-3], budget=150_000, warmup=10_000, warmup_min_steps=20)
    assert cfg.warmup_units(2 * 64) == 10_000          # 78 steps of 128 tokens: the units rule is longer
    assert cfg.warmup_units(32 * 64) == 40_960         # 20 steps of 2,048 tokens
    assert cfg.warmup_units(512 * 64) == 75_000        # capped at half the budget
    assert cfg.warmup_units() == 10_000                # no batch given: the units rule
    assert "warmup_min_steps" in cfg.manifest()["grid"]
    # The default (0) is left out of the manifest, so sweeps written before the field still resume.
    assert "warmup_min_steps" not in SweepConfig(batches=[2], lrs=[1e-3], budget=10_000).manifest()["grid"]
    for bad in (-1, 2.5, True):
        with pytest.raises(SettingError, match="^warmup_min_steps "):
            SweepConfig(batches=[2], lrs=[1e-3], budget=10_000, warmup_min_steps=bad)


def test_warmup_min_steps_reaches_the_trials_and_the_analysis(tmp_path):
    """Each trial warms up over max(warmup, warmup_min_steps × its units per step): recorded in its header
    and used by the analysis (targets reached during warmup are judged per batch)."""
    from globalbatch.lab.sweep.store import curves_from_sweep

    cfg = SweepConfig(task="tinygpt", task_overrides=TINY, batches=[2, 8], lrs=[1e-4], budget=2000, warmup=200,
                      warmup_min_steps=5, eval_points=4, max_val_samples=16, lr_rule="none", lr_edge_extend=0)
    run_sweep(cfg, tmp_path, workers=1, threads=1, progress=False, timing_steps=0)
    data = load_sweep(tmp_path)
    # batch 2: 5 steps × 2 × 16 = 160 < 200 units; batch 8: 5 × 8 × 16 = 640
    assert {n: r[0]["warmup_units"] for n, r in data.trials.items()} == {"b2_lr0.0001_s0": 200, "b8_lr0.0001_s0": 640}
    assert sorted(c.warmup_examples for c in curves_from_sweep(data)) == [200.0, 640.0]


def test_eval_positions_are_log_spaced_and_end_at_the_budget():
    cfg = demo_config()
    pos = cfg.eval_positions()
    assert len(pos) >= 30 and pos[-1] == cfg.budget and pos[0] == cfg.budget // 100
    ratios = [b / a for a, b in zip(pos, pos[1:])]
    assert max(ratios) / min(ratios) < 1.01  # evenly spaced in log


def test_held_out_draw_spans_the_corpus_and_is_fixed():
    task = load_task("tinygpt", **TINY)
    first = [int(x) for x in val_order(task.num_val_samples)[:64]]
    assert first == [int(x) for x in val_order(task.num_val_samples)[:64]]
    # The first 64 of the draw reach the last quarter of the validation documents (the corpus order).
    assert max(first) > 0.75 * task.num_val_samples and min(first) < 0.25 * task.num_val_samples
    mnist = load_task("mnist")
    import torch

    y = next(iter(mnist.val_batches(128)))["y"]
    assert len(torch.unique(y)) == 10  # the class-sorted hold-out no longer starts with one class


def _summary(batch, lr, seed, loss):
    return {"completed": True, "batch": batch, "lr": lr, "seed": seed, "final_val_loss": loss}


def test_edge_cells_extend_the_side_the_best_lr_sits_on():
    cfg = SweepConfig(batches=[4, 16], lrs=[1e-3, 2e-3], budget=10_000, seeds=[0, 1], lr_edge_extend=1)
    s = [_summary(4, 1e-3, 0, 3.0), _summary(4, 1e-3, 1, 3.1), _summary(4, 2e-3, 0, 2.9), _summary(4, 2e-3, 1, 2.8),
         _summary(16, 2e-3, 0, 2.5), _summary(16, 2e-3, 1, 2.6), _summary(16, 4e-3, 0, 2.7), _summary(16, 4e-3, 1, 2.7)]
    assert best_lr_at_edge(s, 4) == "high" and best_lr_at_edge(s, 16) == "low"
    cells = edge_cells(cfg, s)
    assert set(cells) == {TrialSpec(batch=4, lr=4e-3, seed=0), TrialSpec(batch=4, lr=4e-3, seed=1),
                          TrialSpec(batch=16, lr=1e-3, seed=0), TrialSpec(batch=16, lr=1e-3, seed=1)}
    # Once the one allowed extension ran and is still best, no more cells (the analysis flags the edge).
    s2 = s + [_summary(4, 4e-3, 0, 2.0), _summary(4, 4e-3, 1, 2.0)]
    assert all(c.batch != 4 for c in edge_cells(cfg, s2))
    # A batch with a seed still missing is not decided.
    assert all(c.batch != 4 for c in edge_cells(cfg, s[1:]))
    # An extension stopped after one seed (a killed sweep) is completed on resume, and nothing else is decided there.
    assert [c for c in edge_cells(cfg, s + [_summary(4, 4e-3, 0, 2.0)]) if c.batch == 4] == [
        TrialSpec(batch=4, lr=4e-3, seed=1)]
    # A diverged trial (NaN loss) counts as the worst.
    s3 = [dict(x, final_val_loss=float("nan")) if x["lr"] == 2e-3 and x["batch"] == 4 else x for x in s]
    assert best_lr_at_edge(s3, 4) == "low"


def test_batch_edge_cells_add_the_next_batch_where_b_crit_lies_beyond_the_largest():
    cfg = SweepConfig(batches=[4, 8, 16], lrs=[1e-3, 2e-3, 4e-3], budget=10_000, seeds=[0, 1])
    assert cfg.edge_batches() == [32] and cfg.all_batches() == [4, 8, 16, 32]
    assert "batch_edge_extend" not in cfg.manifest()["grid"]  # the default: older manifests still match
    s = [_summary(b, lr, seed, 2.0) for b in (4, 8, 16) for lr in cfg.lrs_for(b) for seed in (0, 1)]
    # 1 of 3 seeds beyond the largest batch: no extension; 2 of 3: batch 32 at its rule grid, every seed
    assert batch_edge_cells(cfg, s, BatchEdge(beyond=1, seeds=3, lr=8e-3)) == []
    assert batch_edge_cells(cfg, s, None) == []
    cells = batch_edge_cells(cfg, s, BatchEdge(beyond=2, seeds=3, lr=8e-3))  # 8e-3 × √2 = 0.01131: on the grid
    assert set(cells) == {TrialSpec(batch=32, lr=lr, seed=seed) for lr in cfg.lrs_for(32) for seed in (0, 1)}
    # the largest batch's chosen LR off its grid (an LR-edge extension won): its move by the rule joins
    moved = batch_edge_cells(cfg, s, BatchEdge(beyond=2, seeds=2, lr=0.032))
    assert {c.lr for c in moved} == set(cfg.lrs_for(32)) | {0.04525}
    # a started edge batch completes its grid whatever the analysis says now (a resume); then the cap holds
    half = s + [_summary(32, c.lr, c.seed, 2.0) for c in cells[:3]]
    assert set(batch_edge_cells(cfg, half, None)) == set(cells[3:])
    full = s + [_summary(32, c.lr, c.seed, 2.0) for c in cells]
    assert batch_edge_cells(cfg, full, BatchEdge(beyond=2, seeds=2, lr=0.01131)) == []
    assert SweepConfig(batches=[4, 8, 16], lrs=[1e-3], budget=10_000, batch_edge_extend=0).edge_batches() == []
    with pytest.raises(SettingError, match="batch_edge_extend"):
        SweepConfig(batches=[4], lrs=[1e-3], budget=10, batch_edge_extend=-1)


def test_a_narrow_design_extends_the_batch_edge_at_the_rules_lr_and_transfers_to_it():
    """A narrow design reads B_crit beyond its largest batch as the full design does, and runs the next batch at
    the base batch's chosen LR moved by the rule only (not a grid); from then on the transfer re-derives it."""
    from globalbatch.lab.sweep.lr_edges import transfer_cells

    cfg = SweepConfig(batches=[4, 8, 16], lrs=[1e-3, 2e-3, 4e-3], budget=10_000, seeds=[0, 1], design="narrow2",
                      lr_rule="sqrt")
    base = cfg.narrow_base()
    s = [_summary(base, lr, seed, 2.0) for lr in cfg.lrs_for(base) for seed in (0, 1)]
    s += [_summary(b, cfg.transfer_lr(2e-3, base, b), seed, 2.0) for b in (4, 16) for seed in (0, 1)]
    edge = BatchEdge(beyond=2, seeds=2, lr=cfg.transfer_lr(2e-3, base, 16))
    assert batch_edge_cells(cfg, s, BatchEdge(beyond=0, seeds=2, lr=None), narrow_lr=2e-3) == []
    cells = batch_edge_cells(cfg, s, edge, narrow_lr=2e-3)
    assert set(cells) == {TrialSpec(batch=32, lr=cfg.transfer_lr(2e-3, base, 32), seed=seed) for seed in (0, 1)}
    ran = s + [_summary(32, c.lr, c.seed, 2.0) for c in cells]
    assert batch_edge_cells(cfg, ran, edge, narrow_lr=2e-3) == []  # the cap: one doubling
    moved = transfer_cells(cfg, ran, (4e-3, None))  # the choice moved: every other batch follows, batch 32 too
    assert {(c.batch, c.lr) for c in moved} == {(b, cfg.transfer_lr(4e-3, base, b)) for b in (4, 16, 32)}


def test_the_analysis_verdict_counts_seeds_whose_b_crit_lies_beyond_the_largest_batch():
    from dataclasses import replace
    from types import SimpleNamespace

    from globalbatch.critical.fit import fit_hyperbola
    from globalbatch.critical.pooled import fit_shared_s_min
    from globalbatch.lab.sweep.runner import _beyond_largest

    b = [100.0, 200.0, 400.0, 800.0]
    steps = {0: [1000 * (1 + 3000 / x) for x in b], 1: [1000 * (1 + 300 / x) * (1.01, 0.99)[i % 2] for i, x in enumerate(b)],
             2: [1000 * (1 + 2000 / x) for x in b]}
    per_seed = {s: SimpleNamespace(fit=fit_hyperbola(b, v)) for s, v in steps.items()}
    st = SimpleNamespace(steps={x: {} for x in b}, monotone={0: True, 1: True, 2: False}, pooled=None,
                         per_seed=per_seed, best_lr={800.0: {0: 4e-3, 1: 4e-3, 2: None}})
    edge = _beyond_largest(SimpleNamespace(primary=st))
    assert (edge.beyond, edge.seeds, edge.lr) == (1, 2, 4e-3) and edge.extend  # seed 2 is non-monotone: not counted
    pooled = fit_shared_s_min(b, {0: steps[0], 1: steps[1]})
    st.pooled = replace(pooled, b_crit={0: 500.0, 1: 300.0}, p_value=0.9)  # the pooled values count, as the
    assert _beyond_largest(SimpleNamespace(primary=st)).beyond == 0     # analysis reads them (partially pooled
    st.pooled = replace(pooled, b_crit={0: 500.0, 1: 300.0}, p_value=0.01)  # whatever the F-test says)
    assert _beyond_largest(SimpleNamespace(primary=st)).beyond == 0
    st.pooled = replace(pooled, b_crit={0: 5000.0, 1: 300.0}, p_value=0.01)
    assert _beyond_largest(SimpleNamespace(primary=st)).beyond == 1


def test_two_seed_sweep_with_edge_extension_resumes_and_reports(tmp_path):
    """A real (tiny) sweep: two seeds, the LR grid per batch, edge cells; a rerun runs nothing new."""
    cfg = SweepConfig(task="tinygpt", task_overrides=TINY, batches=[4, 8], lrs=[1e-4, 2e-4], budget=2000,
                      seeds=[0, 1], warmup=200, eval_points=8, max_val_samples=32, lr_edge_extend=1)
    res = run_sweep(cfg, tmp_path, workers=1, threads=1, progress=False, timing_steps=0)
    names = set(res.ran)
    assert {t.name for t in cfg.trials()} <= names
    extra = names - {t.name for t in cfg.trials()}
    # LRs this small are too small at this budget: the best sits on the high edge and one more LR ran per batch and seed.
    assert extra == {"b4_lr0.0004_s0", "b4_lr0.0004_s1", "b8_lr0.0005656_s0", "b8_lr0.0005656_s1"}  # 2.828e-4 × 2, extra
    data = load_sweep(tmp_path)
    assert set(data.summaries) == names and data.missing == []
    recs = data.trials["b4_lr0.0001_s1"]
    assert recs[0]["seed"] == 1 and recs[0]["warmup_units"] == 200
    evals = [r for r in recs if r.get("val_loss") is not None]
    assert len(evals) >= 8 and evals[0]["consumed"] == 0 and evals[-1]["consumed"] >= 2000
    # Different seeds train on different data orders from different initialisations.
    loss0 = [r["loss"] for r in data.trials["b4_lr0.0001_s0"] if r.get("kind") == "step"]
    loss1 = [r["loss"] for r in data.trials["b4_lr0.0001_s1"] if r.get("kind") == "step"]
    assert loss0[:5] != loss1[:5]
    again = run_sweep(cfg, tmp_path, workers=1, threads=1, progress=False, timing_steps=0)
    assert again.ran == [] and len(again.skipped) == len(again.summaries) > len(cfg.trials())  # the edge cells too


@pytest.mark.slow
def test_demo_command_runs_seeds_and_prints_the_recommendation(tmp_path, monkeypatch, capsys):
    """`globalbatch demo` end to end on a tiny stand-in for the demo grid (the real one is minutes)."""
    import globalbatch.lab.sweep as sweep_pkg
    from globalbatch.cli import main

    tiny = SweepConfig(task="tinygpt", task_overrides=TINY, batches=[2, 4, 8], lrs=[3e-3], budget=3000, seeds=[0, 1],
                       warmup=200, eval_points=12, max_val_samples=32, lr_rule="none", lr_edge_extend=0)
    monkeypatch.setattr(sweep_pkg, "demo_config", lambda: tiny)
    # One torch thread per trial (demo has no --threads; cores ÷ workers = 2 here): beside the other xdist worker on
    # the 2-core machine two threads of tiny tensors spin (44 s of CPU in a suite run; alone 5.8 s, one thread 4.8 s).
    monkeypatch.setattr("globalbatch.lab.sweep.runner._cpu_count", lambda: 1)
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--out", str(tmp_path), "--workers", "1"])
    out = capsys.readouterr()
    assert exc.value.code in (0, None), out.err
    assert "seeds [0, 1]" in out.err and "winner per seed: seed 0:" in out.out and "P(fastest)" in out.out
    doc = json.loads((tmp_path / "report" / "analysis.json").read_text())["seeds"]
    assert doc["seeds"] == [0, 1] and doc["recommendation"]["batch"] in (2, 4, 8)
    assert (tmp_path / "report" / "b_crit_vs_loss.png").is_file()
