"""Every reproduction script runs end to end in its tiny mode (seconds) and writes its plot and JSON.

The committed numbers come from the full runs listed in docs/reproductions.md; these tests only
prove the scripts work from a fresh clone (numbers in tiny mode are meaningless)."""

from __future__ import annotations

import json
import runpy
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


def run_script(name: str, *args: str, monkeypatch, capsys) -> str:
    """Run ``experiments/<name>.py`` in this process (no second torch import); returns its stderr."""
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *args])
    import torch

    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(REPO / "experiments" / f"{name}.py"), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - {"a_accumulation_bn"}))  # (a): the test below
def test_experiment_tiny_mode(name, tmp_path, monkeypatch, capsys):
    err = run_script(name, "--tiny", "--seeds", "2", "--out", str(tmp_path), monkeypatch=monkeypatch, capsys=capsys)
    png = tmp_path / SCRIPTS[name]
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["seeds"] == 2
    assert "tiny mode" in err


def test_large_batch_optimizers_tinygpt_tiny_mode(tmp_path, monkeypatch, capsys):
    # the tinygpt part of (e) runs through the lab's one loop (globalbatch.lab.loop.Experiment)
    run_script("e_large_batch_optimizers", "--task", "tinygpt", "--tiny", "--seeds", "2", "--out", str(tmp_path),
               monkeypatch=monkeypatch, capsys=capsys)
    data = json.loads((tmp_path / "e_large_batch_optimizers_tinygpt.json").read_text())
    assert set(data["results"]) == {"sgd @ 8", "lars @ 8", "adamw @ 8", "lamb @ 8"}
    assert all(0 < r["test_loss"][0] < 10 for r in data["results"].values())  # nats/byte, 256 symbols: < ln 256 + slack
    assert (tmp_path / "repro_e_large_batch_optimizers_tinygpt.png").read_bytes()[:4] == b"\x89PNG"


def test_accumulation_experiment_measures_float_agreement(tmp_path, monkeypatch, capsys):
    # Even in tiny mode (3 steps) experiment (a) must show the three facts it reports: accumulation
    # equals the big batch without BatchNorm and with Ghost BN at the micro size (float64 rounding),
    # and differs with plain BatchNorm.
    import logging

    level = logging.getLogger("globalbatch.step").level
    try:
        run_script("a_accumulation_bn", "--tiny", "--seeds", "2", "--out", str(tmp_path), monkeypatch=monkeypatch,
                   capsys=capsys)
    finally:
        logging.getLogger("globalbatch.step").setLevel(level)  # the script silences the BatchNorm warning
    assert (tmp_path / SCRIPTS["a_accumulation_bn"]).read_bytes()[:4] == b"\x89PNG"
    s = json.loads((tmp_path / "a_accumulation_bn.json").read_text())["summary"]
    assert s["no BatchNorm: big vs accum"]["final_max_abs_worst"] < 1e-12
    assert s["Ghost BN 8 (big) vs BN (accum)"]["final_max_abs_worst"] < 1e-12
    assert s["Ghost BN 8 (big) vs BN (accum)"]["running_stats_max_abs_worst"] < 1e-12
    assert s["BatchNorm: big vs accum"]["final_max_abs_worst"] > 1e-4
