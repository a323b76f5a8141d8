"""Micro-batches and whole rank windows without a target (count 0) on 2 gloo ranks, every integration.

One torchrun launch runs all four cases (tests/dist/integrations_empty.py: prompt-masked instruction rows
on a tiny GPT-NeoX, float64): the plain StepDriver with NoiseScaleMonitor (micro and rank sources),
GlobalBatchTrainer, ExactAccumulation under Accelerate and the Lightning mixin under Lightning's DDP.
Each is exact against one full batch (≤ 1e-10) and logs B_simple from the windows it could use, with
the window that had one small batch over all ranks and the window with no target anywhere counted as
skipped, the same on every rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")


@pytest.mark.dist
@pytest.mark.slow  # one torchrun launch, ~6 s alone
def test_count_zero_micro_batches_and_rank_windows_on_two_ranks(tmp_path):
    from conftest import run_torchrun

    proc = run_torchrun(Path(__file__).parents[1] / "dist" / "integrations_empty.py", str(tmp_path))
    for check in ("driver-empty", "hf-empty", "accelerate-empty", "lightning-empty"):
        assert f"PASS {check}" in proc.stdout, proc.stdout[-3000:]
    assert "2 windows, 2 skipped" in proc.stdout and "ZeroDivisionError" not in proc.stderr
