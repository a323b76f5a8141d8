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
