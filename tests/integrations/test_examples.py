"""examples/hf_trainer.py and examples/lightning_module.py run end to end (CPU, nothing downloaded)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="install the [hf] extra")

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="2",
               PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run([sys.executable, str(REPO / "examples" / script), *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _errors(out: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"max-element relative\): (.+?): (\S+)", out)}


@pytest.mark.slow  # ~10 s alone; 20-30 s on the loaded 2-core machine
def test_hf_trainer_example():
    out = _run("hf_trainer.py", "--steps", "3")
    err = _errors(out)
    assert err["GlobalBatchTrainer"] < 1e-10 and err["Trainer (default)"] > 1e-3, out
    assert "global batch 16 sequences = micro_batch 4 × grad_accum_steps 4 × dp_world_size 1 (pinned)" in out
    logs = [line for line in out.splitlines() if line.startswith("log: ")]
    assert len(logs) == 3 and all("noise/b_simple_tokens=" in line for line in logs), out


@pytest.mark.slow  # ~12 s alone; 25-45 s on the loaded 2-core machine
def test_lightning_example():
    pytest.importorskip("lightning", reason="install the [lightning] extra")
    out = _run("lightning_module.py", "--steps", "3")
    err = _errors(out)
    assert err["ExactAccumulationMixin"] < 1e-10 and err["accumulate_grad_batches (default)"] > 1e-3, out
    assert "trained 3 optimizer steps of 16 sequences" in out
    logs = [line for line in out.splitlines() if line.startswith("log: ")]
    assert len(logs) == 3 and all("noise/b_simple_tokens=" in line for line in logs), out


def test_examples_refuse_bad_flags_with_exit_code_2():
    for script in ("hf_trainer.py",):
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO / "src"))
        proc = subprocess.run([sys.executable, str(REPO / "examples" / script), "--global-batch", "10"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        assert "--global-batch 10 is not allowed; allowed: a multiple of --micro-batch 4" in proc.stderr
        assert "Traceback" not in proc.stderr
