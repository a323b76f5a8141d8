"""The integrations on 2 gloo ranks: HF Trainer and Lightning under DDP, under FSDP2, and with micro-batches and whole
rank windows without a target.

One torchrun launch (tests/dist/integrations_all.py) runs the checks of tests/dist/integrations_ddp.py,
integrations_empty.py and integrations_fsdp.py in turn; each property below is its own test case.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="install the [hf] extra")
pytest.importorskip("accelerate", reason="install the [hf] extra")
pytest.importorskip("lightning", reason="install the [lightning] extra")


@pytest.fixture(scope="module")
def two_ranks_run(tmp_path_factory):
    from conftest import run_torchrun

    try:
        return run_torchrun(Path(__file__).parents[1] / "dist" / "integrations_all.py",
                            str(tmp_path_factory.mktemp("integrations_2ranks")))
    except pytest.fail.Exception as exc:  # a failed check: its PASS line and the later ones are missing
        return subprocess.CompletedProcess([], 1, stdout=str(exc), stderr="")


@pytest.mark.dist
def test_trainer_two_gloo_ranks(two_ranks_run):
    """HF Trainer and Lightning under DDP: exactness vs one big batch, default error, B_simple vs the monitor."""
    for check in ("hf-ddp-exact", "hf-ddp-pinned", "hf-ddp-noise", "lightning-ddp-exact", "lightning-ddp-bf16",
                  "lightning-ddp-noise"):
        assert f"PASS {check}" in two_ranks_run.stdout, two_ranks_run.stdout[-3000:]


@pytest.mark.dist
def test_count_zero_micro_batches_and_rank_windows_on_two_ranks(two_ranks_run):
    """Micro-batches and whole rank windows without a target (count 0), every integration (prompt-masked instruction
    rows on a tiny GPT-NeoX, float64): the plain StepDriver with NoiseScaleMonitor (micro and rank sources),
    GlobalBatchTrainer, ExactAccumulation under Accelerate and the Lightning mixin under Lightning's DDP. Each is exact
    against one full batch (≤ 1e-10) and logs B_simple from the windows it could use, with the window that had one
    small batch over all ranks and the window with no target anywhere counted as skipped, the same on every rank."""
    for check in ("driver-empty", "hf-empty", "accelerate-empty", "lightning-empty"):
        assert f"PASS {check}" in two_ranks_run.stdout, two_ranks_run.stdout[-3000:]
    assert "2 windows, 2 skipped" in two_ranks_run.stdout and "ZeroDivisionError" not in two_ranks_run.stderr


@pytest.mark.dist
def test_trainer_under_fsdp2_is_exact_and_logs_the_ddp_noise_scale(two_ranks_run):
    """GlobalBatchTrainer under FSDP2 (Accelerate's FSDP plugin through TrainingArguments; the CPU gate lifted, see
    tests/dist/integrations_fsdp.py) and the Lightning mixin under ModelParallelStrategy."""
    for check in ("hf-fsdp-exact", "hf-fsdp-noise", "lightning-fsdp-exact", "lightning-fsdp-noise"):
        assert f"PASS {check}" in two_ranks_run.stdout, two_ranks_run.stdout[-3000:]
