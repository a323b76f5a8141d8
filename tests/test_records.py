"""lab/records: files read back from a run directory are validated field by field; typed summaries round-trip."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from globalbatch._util import atomic_write_json
from globalbatch.errors import SettingError
from globalbatch.lab.records import ArmSummary, TrialSummary, read_records
from test_report import write_synthetic_sweep

TRIAL = dict(trial="b4_lr0.001_s0", batch=4, lr=1e-3, seed=0, unit="token", steps=32, consumed=2048,
             mean_batch_units=64.0, units_per_s=37_000.0, final_val_loss=4.98, train_time_s=0.12)


def test_trial_summary_round_trips_and_keeps_nan():
    s = TrialSummary(**TRIAL)
    assert TrialSummary.from_json(json.loads(json.dumps(s.to_json())), path=Path("x/summary.json"), run_dir="x") == s
    nan = TrialSummary(**{**TRIAL, "units_per_s": math.nan})  # a trial too short to time: NaN is a valid reading
    back = TrialSummary.from_json(json.loads(json.dumps(nan.to_json())), path=Path("x/summary.json"), run_dir="x")
    assert math.isnan(back.units_per_s) and back.rate() is None and s.rate() == 37_000.0
    with pytest.raises(AttributeError):
        s.batch = 8  # type: ignore[misc]  # frozen


@pytest.mark.parametrize("change, says", [
    (lambda d: d.pop("unit"), "summary.json: no unit"),
    (lambda d: d.update(mean_batch_units="lots"), "summary.json: mean_batch_units is 'lots', not a number"),
    (lambda d: d.update(batch=4.0), "summary.json: batch is 4.0, not a whole number"),
    (lambda d: d.update(batch=True), "summary.json: batch is True, not a whole number"),
    (lambda d: d.update(final_val_loss="low"), "summary.json: final_val_loss is 'low', not a number or null"),
    (lambda d: d.update(completed="yes"), "summary.json: completed is 'yes', not a true or false"),
])
def test_a_damaged_trial_summary_names_the_run_dir_the_file_and_the_field(change, says):
    doc = TrialSummary(**TRIAL).to_json()
    change(doc)
    with pytest.raises(SettingError) as exc:
        TrialSummary.from_json(doc, path=Path("run/trials/b4_lr0.001_s0/summary.json"), run_dir="run")
    assert exc.value.field == "run_dir" and exc.value.value == "run"
    assert str(exc.value).startswith("run_dir 'run' is not allowed (run/trials/b4_lr0.001_s0/") and says in str(exc.value)


def test_arm_summary_reads_the_old_key_names():
    old = {"completed": True, "arm": "b4", "seed": 1, "batch": 4, "lr": 1e-3, "steps": 10, "consumed": 640,
           "skipped_windows": 0, "train_s": 1.5, "units_per_s": 426.0, "final_batch": 4, "changes": [], "decisions": 0,
           "wall_s": 2.0}
    s = ArmSummary.from_json(old, path=Path("o/runs/b4/s1/summary.json"), run_dir="o")
    assert s.train_time_s == 1.5 and s.wall_time_s == 2.0
    doc = s.to_json()
    assert "train_s" not in doc and doc["train_time_s"] == 1.5  # one name from now on
    assert ArmSummary.from_json(doc, path=Path("o/runs/b4/s1/summary.json"), run_dir="o") == s


def test_metrics_lines_are_checked_by_kind(tmp_path):
    p = tmp_path / "metrics.jsonl"
    good = [{"kind": "header", "unit": "token"}, {"kind": "eval", "step": 0, "consumed": 0, "val_loss": 5.0},
            {"kind": "step", "step": 1, "consumed": 64, "loss": 5.1, "val_loss": None}]
    p.write_text("".join(json.dumps(r) + "\n" for r in good))
    assert read_records(p, run_dir=tmp_path) == good
    for line, says in [({"kind": "step", "step": 2, "consumed": 128}, "line 4: no loss"),
                       ({"kind": "step", "step": 2, "consumed": 128, "loss": "x"}, "line 4: loss is 'x', not a number"),
                       ({"kind": "eval", "step": 2.5, "consumed": 1, "val_loss": 1.0}, "line 4: step is 2.5"),
                       ({"kind": "noise"}, "line 4: kind is 'noise', not one of")]:
        p.write_text("".join(json.dumps(r) + "\n" for r in good + [line]))
        with pytest.raises(SettingError, match="metrics.jsonl " + says.replace("(", r"\(")):
            read_records(p, run_dir=tmp_path)


def test_load_sweep_refuses_damage_naming_the_run_dir(tmp_path):
    from globalbatch.lab.sweep import load_sweep

    write_synthetic_sweep(tmp_path)
    data = load_sweep(tmp_path)
    assert not data.missing and all(isinstance(s, TrialSummary) for s in data.summaries.values())
    first = sorted((tmp_path / "trials").iterdir())[0]
    doc = json.loads((first / "summary.json").read_text())
    # Before: a summary whose batch was not a whole number was read as a missing trial and the report went on.
    atomic_write_json(first / "summary.json", {**doc, "batch": str(doc["batch"])})
    with pytest.raises(SettingError) as exc:
        load_sweep(tmp_path)
    assert str(exc.value).startswith(f"run_dir '{tmp_path}' is not allowed ({first}/summary.json: batch is '128'")
    # A summary of another cell copied into this trial's directory.
    atomic_write_json(first / "summary.json", {**doc, "lr": 3e-3})
    with pytest.raises(SettingError, match="it names trial"):
        load_sweep(tmp_path)


def test_adaptive_timing_and_arm_summaries_are_refused_when_damaged(tmp_path):
    from globalbatch.lab.adaptive_run import AdaptiveConfig, load_runs, throughput_from_timing
    from globalbatch.lab.sweep.timing import timing_path

    atomic_write_json(timing_path(tmp_path / "sweep", 4), {"batch": 4, "steps": "eight", "seconds": 2.0})
    with pytest.raises(SettingError, match=r"throughput_from .*b4.json: steps is 'eight'"):
        throughput_from_timing(tmp_path / "sweep")  # before: skipped silently

    cfg = AdaptiveConfig(task_overrides=dict(n_layer=1, d_model=16, n_head=2, seq_len=16), batches=[4, 8], budget=3000,
                         seeds=[0], micro_batch=4, base_batch=8)
    out = tmp_path / "a"
    atomic_write_json(out / "manifest.json", cfg.manifest())
    run = out / "runs" / "b4" / "s0"
    arm = ArmSummary(arm="b4", seed=0, batch=4, lr=1e-3, steps=3, consumed=192, units_per_s=100.0).to_json()
    atomic_write_json(run / "summary.json", {**arm, "consumed": None})
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 0, "consumed": 0, "val_loss": 5.0}) + "\n")
    with pytest.raises(SettingError, match=r"^out .*summary.json: consumed is None, not a number"):
        load_runs(out)
    atomic_write_json(run / "summary.json", {**arm, "arm": "b8"})
    with pytest.raises(SettingError, match="it names arm 'b8'"):
        load_runs(out)
    atomic_write_json(run / "summary.json", arm)
    (run / "metrics.jsonl").write_text('{"kind": "eval", "step": 0, "consumed": 0, "val_loss": "x"}\n')
    with pytest.raises(SettingError, match="metrics.jsonl line 1: val_loss is 'x'"):
        load_runs(out)
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 0, "consumed": 0, "val_loss": 5.0}) + "\n")
    cfg_back, curves, _ = load_runs(out)
    assert curves["b4"][0][0]["val_loss"] == 5.0


def test_branch_records_read_the_old_key_and_refuse_damage(tmp_path):
    from globalbatch.lab.branch import _read_base_meta, _read_branch

    rec = {"name": "p600_k2_s0", "branch_at": 600, "k": 2, "seed": 0, "batch": 8, "val_loss": 4.2,
           "train_tail_loss": 4.3, "train_s": 1.25}  # a file written before train_time_s
    atomic_write_json(tmp_path / "branches" / "p600_k2_s0.json", rec)
    assert _read_branch(tmp_path / "branches" / "p600_k2_s0.json", tmp_path)["train_time_s"] == 1.25
    atomic_write_json(tmp_path / "branches" / "p600_k2_s0.json", {**rec, "val_loss": "low"})
    with pytest.raises(SettingError, match=r"^out .*p600_k2_s0.json: val_loss is 'low', not a number or null"):
        _read_branch(tmp_path / "branches" / "p600_k2_s0.json", tmp_path)
    atomic_write_json(tmp_path / "base" / "base.json", {"units_per_sample": 16.0, "unit": "token"})
    with pytest.raises(SettingError, match=r"base.json: no train_time_s"):
        _read_base_meta(tmp_path / "base" / "base.json", tmp_path)


def test_a_damaged_probe_json_is_refused_by_the_scale_planner(tmp_path):
    from globalbatch.scale.cluster import mfu_curve_from_probe

    good = {"trials": [{"micro_batch": 2, "tokens_per_step": 128, "mfu": 0.3}, {"micro_batch": 4, "oom": True,
                                                                                 "tokens_per_step": 256, "mfu": None}]}
    (tmp_path / "p.json").write_text(json.dumps(good))
    assert mfu_curve_from_probe(str(tmp_path / "p.json")).mfu == (0.3,)
    good["trials"][0]["mfu"] = "fast"  # before: the trial was skipped and the curve built from the rest
    (tmp_path / "p.json").write_text(json.dumps(good))
    with pytest.raises(SettingError, match=r"trials\[0\]\.mfu is 'fast', not a number"):
        mfu_curve_from_probe(str(tmp_path / "p.json"))
