"""The LR each batch is read at: one per batch, re-chosen per target where that fails, falling LRs flagged and refined.

Ground truth as in tests/test_critical_seeds.py: S(B, L) = S_min(L)·(1 + B_crit(L)/B), B_crit(L) = 500·(L/3)^-4,
held-out noise 0.005 nats, 5 % seed-to-seed scatter. An LR multiplies a trial's steps by a factor that may
depend on the loss (an LR that starts fast and ends slow, or the reverse): the true steps of a batch at a target
are those of its best LR there.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from globalbatch.critical import AnalysisSettings, Curve
from globalbatch.errors import SettingError
from globalbatch.critical.seeds import analyze_seeds, lr_falls, lr_selection_text, seed_analysis_json
from test_critical_seeds import BATCHES, BUDGET, b_crit_true, s_min_true


def curve(batch: float, seed: int, lr: float, factor, *, seed_sd: float = 0.05, eval_sd: float = 0.005) -> Curve:
    """A held-out curve whose steps to loss L are factor(L)·S_true(B, L)·(this seed's draw)."""
    rng = np.random.default_rng([int(batch), seed, int(lr * 1e7)])
    draw = math.exp(rng.normal(0, seed_sd))
    grid = np.linspace(3.995, 2.05, 4000)
    f = np.array([factor(x) for x in grid]) if callable(factor) else np.full(grid.size, float(factor))
    steps_grid = np.maximum.accumulate(draw * f * s_min_true(grid) * (1 + b_crit_true(grid) / batch))
    n = int(BUDGET // batch)
    steps = np.arange(1, n + 1, dtype=float)
    loss_after = np.interp(np.concatenate([[0.0], steps]), np.concatenate([[0.0], steps_grid]),
                           np.concatenate([[4.0], grid]))
    pos = np.unique(np.ceil(np.geomspace(BUDGET / 100, BUDGET, 30) / batch))
    ev = np.concatenate([[0.0], pos])
    ev_loss = loss_after[ev.astype(int)] + rng.normal(0, eval_sd, ev.size)
    return Curve(batch_size=batch, lr=lr, examples=batch * steps, loss=loss_after[:-1], examples_per_s=batch ** 0.5,
                 seed=seed, eval_examples=batch * ev, eval_steps=ev, eval_loss=ev_loss)


def slow_start(x: float) -> float:
    """An LR too small for the early targets: 1.6× the steps at high losses, 1.0× at the tightest."""
    return float(np.interp(x, [2.8, 3.4], [1.0, 1.6]))


def fast_start(x: float) -> float:
    """An LR fast early, 10 % slow at the end."""
    return float(np.interp(x, [2.8, 3.4], [1.1, 0.95]))


def two_lr_curves(seeds=(0, 1, 2)):
    """Every batch at two LRs; batch 4000's best LR at the tightest target starts slowly."""
    out = []
    for s in seeds:
        for b in BATCHES:
            if b == 4000.0:
                out += [curve(b, s, 1e-3, slow_start), curve(b, s, 2e-3, fast_start)]
            else:
                out += [curve(b, s, 1e-3, 1.0), curve(b, s, 2e-3, 1.3)]
    return out


def test_one_lr_per_batch_is_kept_where_it_serves_every_target():
    """Every batch's best LR is the same at every target: auto = per batch at every target, and says so."""
    curves = [curve(b, s, lr, f) for s in (0, 1, 2) for b in BATCHES for lr, f in ((1e-3, 1.0), (2e-3, 1.25))]
    a = analyze_seeds(curves, settings=AnalysisSettings(n_targets=5))
    assert all(st.lr_selection == "per_batch" for st in a.targets)
    assert a.lr_falls == []
    assert "one LR per batch at every target" in lr_selection_text(a)
    # A cell left non-monotone by the 5 % seed scatter stays so: re-choosing picks the same LR there.
    for st in a.targets:
        if not st.all_monotone:
            assert "kept" in st.lr_selection_reason


def test_lr_rechosen_per_target_where_one_lr_per_batch_leaves_seeds_non_monotone():
    """The issue's failure on synthetic curves with a known answer: batch 4000's LR (best at the tightest target)
    needs 1.6× the steps at the loose targets, more than batch 2000 there. One LR per batch leaves those
    targets non-monotone; auto re-chooses the LR there (≥ 90 % of cells monotone, from < 90 %), and the statement
    says where and why."""
    curves = two_lr_curves()
    one = analyze_seeds(curves, settings=AnalysisSettings(n_targets=5, lr_selection="per_batch"))
    auto = analyze_seeds(curves, settings=AnalysisSettings(n_targets=5))
    assert [st.target for st in one.targets] == [st.target for st in auto.targets]
    early = [st for st in one.targets if not st.all_monotone]
    assert len(early) >= 2 and all(st.target > 2.9 for st in early)  # the failure one LR per batch has
    assert one.primary.best_lr[4000.0][0] == 1e-3  # chosen at the primary target: the slow starter
    assert auto.monotone_share() >= 0.9 > one.monotone_share()
    switched = [st for st in auto.targets if st.lr_selection == "per_target"]
    assert {st.target for st in switched} >= {st.target for st in early}
    for st in switched:
        assert st.best_lr[4000.0][0] == 2e-3 and "non-monotone" in st.lr_selection_reason
    assert auto.primary.lr_selection == "per_batch"  # served by its own LR
    # B_crit at the switched targets agrees with the truth (the per-batch read was not even fitted there).
    for st in switched:
        assert st.b_crit is not None and abs(math.log(st.b_crit / b_crit_true(st.target))) < math.log(1.5)
    doc = seed_analysis_json(auto, lambda u: int(u))
    assert doc["lr_selection"] == "auto" and "re-chosen" in doc["lr_selection_text"]
    assert {t["lr_selection"] for t in doc["targets"]} == {"per_batch", "per_target"}
    per_target = analyze_seeds(curves, settings=AnalysisSettings(n_targets=5, lr_selection="per_target"))
    assert all(st.lr_selection == "per_target" for st in per_target.targets)
    with pytest.raises(SettingError, match="lr_selection"):
        AnalysisSettings(n_targets=5, lr_selection="best")


def test_a_chosen_lr_that_falls_as_the_batch_grows_is_flagged():
    """Batch 1000 best at its higher LR, batch 2000 at its lower one (the LR falls with the batch): flagged once,
    with both batches and LRs; a monotone choice is not flagged."""
    curves = []
    for s in (0, 1, 2):
        for b in BATCHES:
            lo, hi = {1000.0: (1.3, 1.0), 2000.0: (1.0, 1.3)}.get(b, (1.0, 1.3))
            curves += [curve(b, s, 1e-3 * math.sqrt(b / 250), lo), curve(b, s, 2e-3 * math.sqrt(b / 250), hi)]
    a = analyze_seeds(curves, settings=AnalysisSettings(n_targets=4))
    falls = a.lr_falls
    assert len(falls) == 1
    f = falls[0]
    assert (f.batch_low, f.batch_high) == (1000.0, 2000.0)
    assert f.lr_low == pytest.approx(2e-3 * 2) and f.lr_high == pytest.approx(1e-3 * math.sqrt(8))
    assert set(f.targets) == {st.target for st in a.targets}
    assert any("falls as the batch grows" in w for w in a.warnings)
    assert seed_analysis_json(a, lambda u: int(u))["lr_falls"][0]["batch_low"] == 1000
    # The same LR rising with the batch: nothing flagged.
    good = [c for c in curves if c.batch_size not in (1000.0, 2000.0)]
    good += [curve(b, s, 1e-3 * math.sqrt(b / 250), 1.0) for s in (0, 1, 2) for b in (1000.0, 2000.0)]
    assert lr_falls(analyze_seeds(good, settings=AnalysisSettings(n_targets=4)).targets) == []


def test_refine_cells_run_the_rules_lr_from_the_neighbour_once():
    from globalbatch.lab.sweep.config import SweepConfig
    from globalbatch.lab.sweep.lr_edges import refine_cells

    cfg = SweepConfig(task="tinygpt", batches=[2, 4, 8], lrs=[1e-3, 2e-3, 4e-3], budget=1000, seeds=[0, 1],
                      lr_edge_extend=1, lr_refine=1)
    summaries = [{"batch": b, "lr": lr, "seed": s} for b in cfg.batches for lr in cfg.lrs_for(b) for s in (0, 1)]
    # Batch 4 chose 5.657e-3 (its top), batch 8 chose 4e-3 (its middle): the LR falls. The rule from batch 4 says
    # 8e-3 at batch 8, from batch 8 2.828e-3 at batch 4 (both on the grids, both run): the half-steps decide.
    falls = [(4, 8, 5.657e-3, 4e-3)]
    cells = refine_cells(cfg, summaries, falls)
    assert {(t.batch, t.lr) for t in cells} == {(8, 5.657e-3), (4, 4e-3)}
    assert sorted(t.seed for t in cells) == [0, 0, 1, 1]
    # Once run, nothing more; lr_refine caps the extra LRs per batch; 0 only flags.
    summaries += [{"batch": t.batch, "lr": t.lr, "seed": t.seed} for t in cells]
    assert refine_cells(cfg, summaries, falls) == []
    assert refine_cells(cfg, summaries, [(4, 8, 5.657e-3, 2e-3)]) == []  # each batch already holds one extra LR
    # A fall over two grid steps (batch 4 at its top 5.657e-3, batch 8 at its bottom 2e-3): the midpoints are grid
    # LRs both batches ran, so the interval is halved towards each chosen LR.
    two = refine_cells(cfg, summaries[:18], [(4, 8, 5.657e-3, 2e-3)])
    assert {(t.batch, t.lr) for t in two} == {(8, 2.828e-3), (4, 4e-3)}
    assert refine_cells(SweepConfig(**{**cfg.__dict__, "lr_refine": 0}), summaries[:12], falls) == []


def test_narrow_design_runs_the_base_grid_then_the_rules_lr_elsewhere():
    from globalbatch.lab.sweep.config import SweepConfig
    from globalbatch.lab.sweep.lr_edges import transfer_cells

    cfg = SweepConfig(task="tinygpt", batches=[2, 4, 8, 16, 32], lrs=[1e-3, 2e-3, 4e-3], budget=1000,
                      seeds=[5, 6, 7], design="narrow1", lr_edge_extend=1)
    assert cfg.seed_list() == [5] and cfg.narrow_base() == 8
    assert [(t.batch, t.lr, t.seed) for t in cfg.trials()] == [(8, 2e-3, 5), (8, 4e-3, 5), (8, 8e-3, 5)]
    summ = [{"batch": 8, "lr": lr, "seed": 5, "final_val_loss": loss} for lr, loss in ((2e-3, 3.0), (4e-3, 2.9),
                                                                                      (8e-3, 2.95))]
    cells = transfer_cells(cfg, summ)
    assert {t.batch: t.lr for t in cells} == {2: 2e-3, 4: 2.828e-3, 16: 5.657e-3, 32: 8e-3}  # 4e-3 × √(B/8)
    # Best at the top edge: the base grid widens first (edge_cells), no transfer yet.
    edge = [dict(s, final_val_loss=3.0 - s["lr"] * 10) for s in summ]
    assert transfer_cells(cfg, edge) == []
    assert cfg.manifest()["grid"]["design"] == "narrow1"
    assert "design" not in SweepConfig(task="tinygpt", batches=[2], lrs=[1e-3], budget=10).manifest()["grid"]


def test_narrow_transfer_follows_the_analysis_choice_and_is_re_derived_when_it_changes():
    """``choice`` (the analysis' LR for the base batch and its edge) overrides the final loss; when it changes after
    the other batches ran, they run the new LR moved by the rule; a transfer some seeds lack is completed first;
    an edge the analysis flags widens the base grid before any transfer."""
    from globalbatch.lab.sweep.config import SweepConfig
    from globalbatch.lab.sweep.lr_edges import transfer_cells

    cfg = SweepConfig(task="tinygpt", batches=[2, 4, 8, 16, 32], lrs=[1e-3, 2e-3, 4e-3], budget=1000,
                      seeds=[5, 6], design="narrow2", lr_edge_extend=1)
    assert cfg.seed_list() == [5, 6]
    summ = [{"batch": 8, "lr": lr, "seed": s, "final_val_loss": loss} for lr, loss in ((2e-3, 3.0), (4e-3, 2.9),
                                                                                      (8e-3, 2.95)) for s in (5, 6)]
    assert {t.lr for t in transfer_cells(cfg, summ) if t.batch == 32} == {8e-3}  # no analysis yet: final loss
    first = transfer_cells(cfg, summ, (2e-3, None))  # the analysis reads batch 8 at 2e-3
    assert {(t.batch, t.lr) for t in first} == {(2, 1e-3), (4, 1.414e-3), (16, 2.828e-3), (32, 4e-3)}
    assert sorted({t.seed for t in first}) == [5, 6]
    ran = summ + [{"batch": t.batch, "lr": t.lr, "seed": t.seed, "final_val_loss": 3.0} for t in first]
    assert {(t.batch, t.lr) for t in transfer_cells(cfg, ran, (2e-3, None))} == {(t.batch, t.lr) for t in first}
    # The other batches moved the primary target: the analysis now reads batch 8 at 4e-3; the transfer follows.
    again = transfer_cells(cfg, ran, (4e-3, None))
    assert {(t.batch, t.lr) for t in again} == {(2, 2e-3), (4, 2.828e-3), (16, 5.657e-3), (32, 8e-3)}
    # Interrupted: batch 32's transfer finished for seed 5 only; seed 6 runs first, nothing else.
    cut = [r for r in ran if not (r["batch"] == 32 and r["seed"] == 6)]
    assert [(t.batch, t.lr, t.seed) for t in transfer_cells(cfg, cut, (4e-3, None))] == [(32, 4e-3, 6)]
    # The analysis' choice at the base grid's top edge: the grid widens first (edge_cells), no transfer yet.
    assert transfer_cells(cfg, summ, (8e-3, "high")) == []


def test_one_settings_dataclass_for_every_analysis_and_the_old_keywords_still_work():
    from dataclasses import FrozenInstanceError

    from globalbatch.critical import analyze
    from globalbatch.critical.settings import settings_from

    s = AnalysisSettings(objective="cost", tolerance=0.1, n_targets=3)
    with pytest.raises(FrozenInstanceError):
        s.tolerance = 0.2
    for bad in (dict(objective="speed"), dict(tolerance=-1), dict(readout="eval"), dict(n_targets=1),
                dict(lr_selection="best"), dict(ema_fraction=0), dict(halflife_steps=0), dict(targets=[]),
                dict(targets=[float("nan")]), dict(min_window_fraction=1.5)):
        with pytest.raises(SettingError, match=next(iter(bad))):
            AnalysisSettings(**bad)
    assert settings_from(s, {}, caller="f") is s
    with pytest.warns(FutureWarning, match=r"f\(tolerance=\) is deprecated: pass settings=AnalysisSettings\(tolerance="):
        assert settings_from(s, {"tolerance": 0.2}, caller="f").tolerance == 0.2
    with pytest.raises(TypeError, match="f\\(\\) got unexpected keyword argument\\(s\\): n_tagrets"):
        settings_from(s, {"n_tagrets": 3}, caller="f")
    curves = [curve(b, sd, lr, f) for sd in (0, 1) for b in BATCHES for lr, f in ((1e-3, 1.0), (2e-3, 1.25))]
    with pytest.warns(FutureWarning, match="analyze_seeds"):  # the old keywords: one release, with a warning
        by_kw = analyze_seeds(curves, n_targets=3, objective="cost", tolerance=0.1)
    by_settings = analyze_seeds(curves, settings=s)
    assert [t.target for t in by_kw.targets] == [t.target for t in by_settings.targets]
    assert [t.b_crit for t in by_kw.targets] == [t.b_crit for t in by_settings.targets]
    assert by_kw.recommendation.batch_size == by_settings.recommendation.batch_size
    first = [c for c in curves if c.seed == 0]
    with pytest.warns(FutureWarning, match="analyze"):
        a1 = analyze(first, n_targets=3, n_tighter=1, objective="cost")
    a2 = analyze(first, settings=AnalysisSettings(first_seed_n_targets=3, n_tighter=1, objective="cost"))
    assert [t.target for t in a1.targets] == [t.target for t in a2.targets] and len(a1.targets) == 4
