"""Successive halving of the sweep (lab/sweep/halving.py): a trial that pauses at a rung and resumes from its
checkpoint equals an uninterrupted one; the stopping rule on synthetic rungs; the design end to end."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from globalbatch._util import read_jsonl
from globalbatch.lab.sweep import SweepConfig, run_trial
from globalbatch.lab.sweep.trial import PAUSE_MARKER, trial_paused

TINY = dict(n_layer=1, d_model=16, n_head=2, seq_len=16, max_corpus_bytes=100_000)
TIMING = {"units_per_s", "train_time_s"}


def tiny_config(**kw) -> SweepConfig:
    base = dict(task="tinygpt", task_overrides=TINY, batches=[4, 8], lrs=[1e-3, 3e-3], budget=6000,
                max_val_samples=16, eval_every=1000, lr_rule="none", lr_edge_extend=0)
    base.update(kw)
    return SweepConfig(**base)


def numeric(trial_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_jsonl(trial_dir / "metrics.jsonl")
            if r["kind"] != "header"]


@pytest.mark.slow
@pytest.mark.parametrize("noise", [False, True])
def test_a_trial_paused_at_two_rungs_and_resumed_equals_the_uninterrupted_trial(tmp_path, noise):
    cfg = asdict(tiny_config(noise=noise))
    spec = {"batch": 4, "lr": 3e-3, "seed": 1}
    whole = run_trial(cfg, spec, str(tmp_path / "a"), threads=1)
    name = "b4_lr0.003_s1"
    first = run_trial(cfg, spec, str(tmp_path / "b"), threads=1, pause_at=2000)
    b = tmp_path / "b" / "trials" / name
    assert first["paused"] and 2000 <= first["consumed"] < 2000 + 4 * 16 and not (b / "summary.json").exists()
    # Something else trains in this process meanwhile (it reseeds torch): the resume must not depend on it.
    run_trial(cfg, {"batch": 8, "lr": 1e-3, "seed": 0}, str(tmp_path / "c"), threads=1)
    assert run_trial(cfg, spec, str(tmp_path / "b"), threads=1, pause_at=2000) == first  # already there: no training
    second = run_trial(cfg, spec, str(tmp_path / "b"), threads=1, pause_at=4000)
    assert second["consumed"] >= 4000 and trial_paused(b, tiny_spec(spec)) == second
    assert sorted(p.name for p in b.glob("paused-*")) == [f"paused-{second['consumed']}.jsonl",
                                                           f"paused-{second['consumed']}.pt"]  # older rung dropped
    # A crash between the rungs: a killed writer's records and a checkpoint written before its marker. The marker is
    # written last, so the resume starts from the pause it names and the leftovers are ignored, then removed.
    (b / "metrics.jsonl.tmp-999999999").write_text('{"kind": "header"}\n')
    (b / "paused-5000.pt").write_bytes(b"torn")
    done = run_trial(cfg, spec, str(tmp_path / "b"), threads=1)
    assert numeric(b) == numeric(tmp_path / "a" / "trials" / name)  # bitwise: every loss, norm, LR, val loss
    if noise:
        assert any("b_simple" in r for r in numeric(b))
    for k in ("steps", "consumed", "consumed_samples", "final_val_loss", "windows", "skipped_windows"):
        assert done[k] == whole[k], k
    assert not (b / PAUSE_MARKER).exists() and not list(b.glob("paused-*"))  # spent on completion


def tiny_spec(spec):
    from globalbatch.lab.sweep import TrialSpec

    return TrialSpec(**spec)


def test_pause_at_must_be_an_evaluation_position(tmp_path):
    with pytest.raises(ValueError, match="pause_at 1500"):
        run_trial(asdict(tiny_config()), {"batch": 4, "lr": 1e-3, "seed": 0}, str(tmp_path), threads=1, pause_at=1500)


# --- the rule on synthetic rungs ------------------------------------------------------------------------------------

def _cell(batch, lr, seed, losses, warmup=100.0):
    import numpy as np

    from globalbatch.lab.sweep import TrialSpec
    from globalbatch.lab.sweep.halving import RungCell

    n = len(losses)
    return RungCell(spec=TrialSpec(batch=batch, lr=lr, seed=seed), consumed=np.arange(1, n + 1) * 100.0,
                    loss=np.array(losses, dtype=float), warmup_units=warmup)


GRID = dict(task="tinygpt", batches=[4, 8, 16], lrs=[1e-3, 2e-3, 4e-3], budget=900, lr_rule="none")


def test_a_cell_behind_by_more_than_the_margin_everywhere_is_stopped_the_best_and_rule_neighbour_kept():
    from globalbatch.lab.sweep.halving import decide_rung

    cfg = SweepConfig(**GRID)
    # Every batch's best is 4e-3. Batch 4: 1e-3 is 0.3 behind everywhere (stopped); 2e-3 led at an early evaluation
    # inside the band (kept: it may be the fastest to a loose target). Batch 16: 2e-3 is 0.01 behind (within the
    # margin, kept).
    lead = [3.0, 2.6, 2.4, 2.3, 2.2]
    cells = [_cell(4, 4e-3, 0, lead), _cell(4, 1e-3, 0, [x + 0.3 for x in lead]),
             _cell(4, 2e-3, 0, [2.9, 2.55, 2.5, 2.45, 2.4]),
             _cell(8, 4e-3, 0, lead), _cell(8, 1e-3, 0, [x + 0.3 for x in lead]), _cell(8, 2e-3, 0, [9.0] * 5),
             _cell(16, 4e-3, 0, lead), _cell(16, 2e-3, 0, [x + 0.01 for x in lead]),
             _cell(16, 1e-3, 0, [x + 0.5 for x in lead])]
    d = decide_rung(cells, cfg, 500, sigma=(0.02, "given"))
    assert d.margin == pytest.approx(0.04) and d.band == pytest.approx((2.2, 2.2 + 0.75 * 0.7))
    assert d.stopped == ["b16_lr0.001_s0", "b4_lr0.001_s0", "b8_lr0.001_s0", "b8_lr0.002_s0"]
    assert d.protected == ["b16_lr0.004_s0", "b4_lr0.004_s0", "b8_lr0.004_s0"]
    # A larger margin keeps the cells 0.3 behind.
    assert decide_rung(cells, cfg, 500, sigma=(0.2, "given")).stopped == ["b16_lr0.001_s0", "b8_lr0.002_s0"]


def test_the_lr_the_rule_predicts_from_a_neighbouring_batch_is_kept():
    from globalbatch.lab.sweep.halving import decide_rung

    cfg = SweepConfig(**{**GRID, "lr_rule": "sqrt", "base_batch": 4})  # grids: 1e-3·√(b/4) …
    lead = [3.0, 2.6, 2.4, 2.3, 2.2]
    behind = [x + 0.3 for x in lead]
    # Batch 4's best is its middle LR 2e-3; batch 8's best its top LR (5.657e-3): at batch 4 the rule predicts the
    # top LR (4e-3) from batch 8 — kept although 0.3 behind; batch 4's lowest LR, as far behind, is stopped.
    cells = [_cell(4, 2e-3, 0, lead), _cell(4, 4e-3, 0, behind), _cell(4, 1e-3, 0, behind),
             _cell(8, 5.657e-3, 0, lead), _cell(8, 2.828e-3, 0, behind), _cell(8, 1.414e-3, 0, behind)]
    d = decide_rung(cells, SweepConfig(**{**GRID, "batches": [4, 8], "lr_rule": "sqrt", "base_batch": 4}), 500,
                    sigma=(0.02, "given"))
    assert "b4_lr0.004_s0" in d.protected and "b4_lr0.001_s0" in d.stopped
    assert "b8_lr0.002828_s0" in d.protected and d.stopped == ["b4_lr0.001_s0", "b8_lr0.001414_s0"]
    assert cfg.lrs_for(8) == [0.001414, 0.002828, 0.005657]


def test_nothing_stops_without_a_band_and_the_margin_is_the_seed_spread():
    from globalbatch.lab.sweep.halving import decide_rung

    cfg = SweepConfig(**GRID)
    # Still in warmup at the rung: no target is within reach yet, nothing stops.
    warm = [_cell(4, lr, 0, [2.0] * 5, warmup=900) for lr in (1e-3, 2e-3)] + [_cell(4, 4e-3, 0, [2.5] * 5, warmup=900)]
    assert decide_rung(warm, cfg, 500).band is None and decide_rung(warm, cfg, 500).stopped == []
    # A batch whose best is still above every possible target (the band's top) stops nothing either.
    slow = [_cell(8, 2e-3, 0, [4.0, 3.9, 3.8, 3.7, 3.6]), _cell(8, 1e-3, 0, [5.0] * 5),
            _cell(4, 2e-3, 0, [3.0, 2.6, 2.4, 2.3, 2.2]), _cell(4, 1e-3, 0, [3.5, 3.4, 3.3, 3.2, 3.1])]
    d = decide_rung(slow, SweepConfig(**{**GRID, "batches": [4, 8]}), 500, sigma=(0.02, "given"))
    assert d.band == pytest.approx((3.6, 3.6 + 0.75 * (3.0 - 3.6))) and d.stopped == ["b4_lr0.001_s0"]
    lead = [3.0, 2.6, 2.4, 2.3, 2.2]
    cells = [_cell(4, 4e-3, 0, lead), _cell(4, 1e-3, 0, [x + 0.3 for x in lead]), _cell(4, 2e-3, 0, lead)]
    probes = [_cell(4, 2e-3, 1, [x + 0.1 for x in lead])]  # one cell at a second seed: SD 0.0707 → margin 0.141
    d = decide_rung(cells, cfg, 500, probes=probes)
    assert d.spread == pytest.approx(0.1 / 2 ** 0.5) and "seed spread" in d.margin_source
    assert d.stopped == ["b4_lr0.001_s0"]


def test_with_several_seeds_an_lr_is_stopped_only_where_every_seed_stops_it():
    from globalbatch.lab.sweep.halving import decide_rung

    cfg = SweepConfig(**{**GRID, "batches": [4]})
    lead = [3.0, 2.6, 2.4, 2.3, 2.2]
    cells = [_cell(4, 4e-3, s, lead) for s in (0, 1)] + [_cell(4, 1e-3, 0, [x + 0.3 for x in lead]),
                                                         _cell(4, 1e-3, 1, [x + 0.01 for x in lead]),
                                                         _cell(4, 2e-3, 0, [x + 0.3 for x in lead]),
                                                         _cell(4, 2e-3, 1, [x + 0.3 for x in lead])]
    assert decide_rung(cells, cfg, 500, sigma=(0.02, "given")).stopped == ["b4_lr0.002_s0", "b4_lr0.002_s1"]


# --- the design end to end ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_halving_design_stops_a_hopeless_lr_at_the_first_rung_counts_its_tokens_and_resumes_to_nothing(tmp_path,
                                                                                                          capsys):
    import json

    from globalbatch.lab.sweep import analyze_sweep_seeds, run_sweep
    from globalbatch.lab.sweep.halving import LOG_NAME, rung_positions, trained_units

    cfg = tiny_config(lrs=[1e-5, 1e-3, 3e-3], eval_every=500, design="halving", seeds=[0, 1])
    assert rung_positions(cfg, (1 / 9, 1 / 3)) == [1000, 2000]
    res = run_sweep(cfg, tmp_path, workers=1, threads=1, progress=True, timing_steps=0)
    log = json.loads((tmp_path / LOG_NAME).read_text())
    first = log["decisions"][0]
    err = capsys.readouterr().err  # the progress display: a line per cell that reached its rung or finished
    assert all(f"{n} paused at 1,0" in err for n in first["stopped"])  # paused at the first rung, never stuck
    assert all(f"{n} done (" in err for n in log["finished"])
    assert {"b4_lr1e-05_s0", "b8_lr1e-05_s0"} <= set(first["stopped"])  # 100× too small an LR: far behind
    assert "seed spread" in first["margin_source"] and first["margin"] > 0  # the probes at seed 1 measured it
    assert sorted(res.ran)[:2] == ["b4_lr0.001_s0", "b4_lr0.001_s1"]  # the probe of batch 4: its middle LR, seed 1
    finished = {s["trial"] for s in res.summaries}
    assert finished == set(log["finished"]) and not finished & set(log["stopped"])
    units = trained_units(tmp_path)
    assert units["finished"] == 6016 * len(finished) or units["finished"] == sum(s["consumed"] for s in res.summaries)
    paused = [json.loads((tmp_path / "trials" / n / "paused.json").read_text())["consumed"] for n in log["stopped"]]
    assert units["stopped"] >= sum(paused) and units["stopped"] > 0  # stopped cells and the probes are counted
    _, sa = analyze_sweep_seeds(tmp_path)  # the analysis reads the finished cells only (the first seed)
    assert sa.seeds == [0]
    from globalbatch.lab.sweep.designs import design_statement
    from globalbatch.lab.sweep.halving import run_statement

    said = design_statement("halving", 2, 3, 2, ran=run_statement(tmp_path))  # the report's line
    assert f"It stopped {len(log['stopped'])} cell(s) at rungs of 1,000, 2,000 units" in said and "One seed" in said
    again = run_sweep(cfg, tmp_path, workers=1, threads=1, progress=False, timing_steps=0)
    assert again.ran == [] and json.loads((tmp_path / LOG_NAME).read_text()) == log  # same decisions, nothing retrained


@pytest.mark.slow
def test_with_ray_the_scheduler_stops_the_hopeless_lr_by_the_same_rule(tmp_path):
    """Ray Tune's own scheduler API (a FIFOScheduler whose on_trial_result returns STOP): one batch, the middle LR
    first (it runs to the end), the probe measures the margin, the 100×-too-small LR stops at the first rung."""
    import json

    pytest.importorskip("ray.tune")
    from globalbatch.lab.sweep import run_sweep
    from globalbatch.lab.sweep.halving import LOG_NAME, trained_units

    cfg = tiny_config(batches=[4], lrs=[1e-5, 1e-3, 3e-3], budget=2000, eval_every=250, design="halving")
    res = run_sweep(cfg, tmp_path, workers=1, threads=1, backend="ray", progress=False, timing_steps=0)
    log = json.loads((tmp_path / LOG_NAME).read_text())
    assert log["stopped"] == ["b4_lr1e-05_s0"] and log["mode"].startswith("asynchronous")
    assert "seed spread" in log["decisions"][0]["margin_source"]
    assert sorted(s["trial"] for s in res.summaries) == ["b4_lr0.001_s0", "b4_lr0.003_s0"]
    stopped = json.loads((tmp_path / "trials" / "b4_lr1e-05_s0" / "paused.json").read_text())
    assert stopped["consumed"] in (256, 768)  # at a rung: 1/9 or 1/3 of the budget, at the next evaluation
    assert trained_units(tmp_path)["stopped"] == stopped["consumed"] + 256  # the stopped cell and the probe
    # Ray only schedules: the cell that ran to the end has the losses of the same cell run by the local backend
    from globalbatch.lab.sweep import load_sweep

    local = tmp_path / "local"
    run_sweep(tiny_config(batches=[4], lrs=[1e-3], budget=2000, eval_every=250), local, backend="local", workers=1,
              threads=1, progress=False, timing_steps=0)
    ray_losses = [r.get("loss") for r in load_sweep(tmp_path).trials["b4_lr0.001_s0"] if r.get("kind") == "step"]
    local_losses = [r.get("loss") for r in load_sweep(local).trials["b4_lr0.001_s0"] if r.get("kind") == "step"]
    assert ray_losses and ray_losses == local_losses


def test_an_lr_beyond_the_edge_joins_where_the_best_at_the_rung_is_the_edge_never_a_cell_already_run():
    from globalbatch.lab.sweep.halving import _edge_cells, decide_rung

    cfg = SweepConfig(**{**GRID, "batches": [4], "lr_edge_extend": 1})
    lead = [3.0, 2.6, 2.4, 2.3, 2.2]
    cells = [_cell(4, 4e-3, 0, lead), _cell(4, 2e-3, 0, [x + 0.3 for x in lead]),
             _cell(4, 1e-3, 0, [x + 0.5 for x in lead])]
    d = decide_rung(cells, cfg, 500, sigma=(0.02, "given"))
    known = {c.spec.name for c in cells}
    assert [t.name for t in _edge_cells(cfg, cells, d, known)] == ["b4_lr0.008_s0"]  # 4e-3 × the grid's ratio 2
    assert _edge_cells(cfg, cells, d, known | {"b4_lr0.008_s0"}) == []  # run (and perhaps stopped) already
    assert _edge_cells(SweepConfig(**{**GRID, "batches": [4], "lr_edge_extend": 0}), cells, d, known) == []
