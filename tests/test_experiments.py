"""Every reproduction script runs end to end in its tiny mode (seconds) and writes its plot and JSON.

The committed numbers come from the full runs listed in docs/reproductions.md; these tests only
prove the scripts work from a fresh clone (numbers in tiny mode are meaningless)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = {
    "a_accumulation_bn": "repro_a_accumulation_bn.png",
    "b_lr_scaling": "repro_b_lr_scaling.png",
    "c_generalization_gap": "repro_c_generalization_gap.png",
    "d_batch_increase": "repro_d_batch_increase.png",
    "e_large_batch_optimizers": "repro_e_large_batch_optimizers.png",
}


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - {"a_accumulation_bn"}))  # (a): the test below
def test_experiment_tiny_mode(name, tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    env = dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / f"{name}.py"), "--tiny", "--seeds", "2",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    png = tmp_path / SCRIPTS[name]
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["seeds"] == 2
    assert "tiny mode" in proc.stderr


def test_large_batch_optimizers_tinygpt_tiny_mode(tmp_path):
    # the tinygpt part of (e) runs through the lab's one loop (globalbatch.lab.loop.Experiment)
    env = dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "e_large_batch_optimizers.py"), "--task",
                           "tinygpt", "--tiny", "--seeds", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "e_large_batch_optimizers_tinygpt.json").read_text())
    assert set(data["results"]) == {"sgd @ 8", "lars @ 8", "adamw @ 8", "lamb @ 8"}
    assert all(0 < r["test_loss"][0] < 10 for r in data["results"].values())  # nats/byte, 256 symbols: < ln 256 + slack
    assert (tmp_path / "repro_e_large_batch_optimizers_tinygpt.png").read_bytes()[:4] == b"\x89PNG"


def test_accumulation_experiment_measures_float_agreement(tmp_path):
    # Even in tiny mode (3 steps) experiment (a) must show the three facts it reports: accumulation
    # equals the big batch without BatchNorm and with Ghost BN at the micro size (float64 rounding),
    # and differs with plain BatchNorm.
    env = dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "a_accumulation_bn.py"), "--tiny", "--seeds",
                           "2", "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / SCRIPTS["a_accumulation_bn"]).read_bytes()[:4] == b"\x89PNG"
    s = json.loads((tmp_path / "a_accumulation_bn.json").read_text())["summary"]
    assert s["no BatchNorm: big vs accum"]["final_max_abs_worst"] < 1e-12
    assert s["Ghost BN 8 (big) vs BN (accum)"]["final_max_abs_worst"] < 1e-12
    assert s["Ghost BN 8 (big) vs BN (accum)"]["running_stats_max_abs_worst"] < 1e-12
    assert s["BatchNorm: big vs accum"]["final_max_abs_worst"] > 1e-4
