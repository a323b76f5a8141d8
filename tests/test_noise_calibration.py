"""lab/noise_calibration.py: the factor B_crit / B_simple from a sweep's targets, applied to another run's curve."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from globalbatch.lab.noise_calibration import calibrate, calibrated_curve


def _analysis(b_crit: dict, b_simple: dict):
    targets = [SimpleNamespace(target=t, b_crit=b) for t, b in b_crit.items()]
    return SimpleNamespace(targets=targets, b_simple={t: {"local": v, "path_averaged": 2 * v} for t, v in b_simple.items()})


def test_factor_is_the_median_ratio_with_its_range_and_label():
    a = _analysis({3.0: 400.0, 2.8: 600.0, 2.6: 900.0, 2.4: None}, {3.0: 100.0, 2.8: 200.0, 2.6: 200.0, 2.4: 300.0})
    cal = calibrate(a, source="the sweep runs/x (2 seeds)")
    assert cal.per_target == {3.0: 4.0, 2.8: 3.0, 2.6: 4.5}  # 2.4 has no B_crit point: left out, with a note
    assert cal.factor == 4.0 and (cal.low, cal.high) == (3.0, 4.5) and cal.loss_range == (2.6, 3.0)
    assert any("2.4 left out" in n for n in cal.notes)
    assert "calibrated against the sweep runs/x (2 seeds)" in cal.label and "3–4.5 over 3 targets" in cal.label
    assert calibrate(a, source="s", kind="path_averaged").factor == pytest.approx(2.0)
    assert cal.to_dict()["label"] == cal.label and cal.to_dict()["per_target"]["2.8"] == 3.0


def test_no_target_with_both_is_an_error_naming_noise():
    with pytest.raises(ValueError, match="noise"):
        calibrate(_analysis({3.0: 400.0}, {}), source="s")
    with pytest.raises(ValueError, match="kind"):
        calibrate(_analysis({3.0: 400.0}, {3.0: 1.0}), source="s", kind="median")


def test_calibrated_curve_multiplies_each_row_and_flags_losses_outside_the_calibration():
    cal = calibrate(_analysis({3.0: 400.0, 2.6: 900.0}, {3.0: 100.0, 2.6: 300.0}), source="s")  # factors 4 and 3
    rows = [{"step": 5, "units_seen": 100, "loss": 3.5, "b_simple_micro_token": 50.0},
            {"step": 10, "units_seen": 200, "loss": 2.8, "b_simple_micro_token": 120.0},
            {"step": 15, "units_seen": 300, "loss": 2.7, "b_simple_micro_token": math.nan}]
    out = calibrated_curve(rows, cal)
    assert out[1]["b_crit_calibrated"] == pytest.approx(3.5 * 120.0)
    assert (out[1]["b_crit_calibrated_low"], out[1]["b_crit_calibrated_high"]) == (360.0, 480.0)
    assert [r["in_calibrated_range"] for r in out] == [False, True, True]
    assert math.isnan(out[2]["b_crit_calibrated"]) and out[0]["calibration"] == cal.label


def test_noise_cli_calibrate_from_labels_the_curve(tmp_path, capsys, monkeypatch):
    """``noise --calibrate-from DIR``: the run's B_simple curve times the sweep's factor, labelled, in text and JSON
    (the calibration itself is stubbed here: a sweep with --noise takes minutes; the benchmark measures it)."""
    import json

    import globalbatch.lab.noise_calibration as nc
    from globalbatch.cli import main

    cal = calibrate(_analysis({6.0: 400.0, 4.0: 900.0}, {6.0: 100.0, 4.0: 300.0}), source="the sweep S (1 seed)")
    seen = []
    monkeypatch.setattr(nc, "calibrate_from_sweep", lambda run_dir: seen.append(run_dir) or cal)
    tiny = ["--task-arg", "d_model=16", "--task-arg", "n_layer=1", "--task-arg", "n_head=2", "--task-arg", "seq_len=16",
            "--task-arg", "max_corpus_bytes=200000"]
    args = ["noise", *tiny, "--micro-batch", "2", "--grad-accum", "3", "--steps", "6", "--log-every", "3", "--threads", "1",
            "--calibrate-from", str(tmp_path / "sweep")]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--out", str(tmp_path / "a"), "--json"])
    assert exc.value.code == 0 and seen == [str(tmp_path / "sweep")]
    doc = json.loads(capsys.readouterr().out)
    assert doc["calibrated"]["calibration"]["label"] == cal.label and cal.factor == 3.5
    for row, c in zip(doc["rows"], doc["calibrated"]["rows"]):
        b = row["b_simple_micro_token"]
        if b > 0:
            assert c["b_crit_calibrated"] == pytest.approx(3.5 * b) and c["b_crit_calibrated_low"] == pytest.approx(3 * b)
        assert c["in_calibrated_range"] == (4.0 <= row["loss"] <= 6.0) and c["calibration"] == cal.label
    with pytest.raises(SystemExit) as exc:
        main([*args, "--out", str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "calibrated against the sweep S (1 seed)" in out and "→ B_crit ≈" in out


def test_noise_cli_calibrate_from_a_directory_that_is_no_sweep_is_one_line(tmp_path, capsys):
    from globalbatch.cli import main

    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["noise", "--calibrate-from", str(tmp_path / "empty"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("error: --calibrate-from ") and err.count("\n") == 1
    assert "a sweep directory run with --noise" in err and not (tmp_path / "o").exists()
