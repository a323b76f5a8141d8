"""ExactAccumulation under ``accelerate launch`` with 2 processes, as users run it (CPU, gloo).

``accelerate launch --config_file examples/configs/accelerate_2proc.yaml --num_processes 2
examples/accelerate_exact.py``: the documented ``accelerator.accumulate`` loop with a prepared model,
optimizer and data loader (Accelerate deals the micro-batches to the processes). On this CPU-only machine
``ACCELERATE_USE_CPU=true`` makes each process MULTI_CPU on gloo (Accelerate 1.15 launches a
``distributed_type: MULTI_CPU`` config through mpirun only; without an mpirun hostfile it starts one
process). Float64, micro 2 × accumulation 2 × 2 processes, 12 ragged documents: a full window of 8 and a
short one of 4; two SGD steps against one step per whole window in one forward.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="install the [hf] extra")
pytest.importorskip("transformers", reason="install the [hf] extra")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.dist
@pytest.mark.slow  # ~12 s: two processes importing transformers, then two runs each
def test_exact_accumulation_under_accelerate_launch_with_two_processes():
    launcher = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")
    assert launcher is not None, "the accelerate CLI is installed with the [hf] extra"
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true", PYTHONPATH=str(REPO / "src"),
               HF_HUB_OFFLINE="1")
    cmd = [launcher, "launch", "--config_file", str(REPO / "examples" / "configs" / "accelerate_2proc.yaml"),
           "--num_processes", "2", "--main_process_port", "29517", str(REPO / "examples" / "accelerate_exact.py"),
           "--steps", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    err = {m.group(1): float(m.group(2)) for m in re.finditer(r"max-element relative\): (.+?): (\S+)", proc.stdout)}
    print(proc.stdout)
    assert "2 steps on 2 process(es), windows of 8 and 4 documents" in proc.stdout, proc.stdout
    assert err["ExactAccumulation"] < 1e-10 and err["accumulate + mean loss (default)"] > 1e-3, err
    logs = [line for line in proc.stdout.splitlines() if line.startswith("log: ")]
    assert len(logs) == 2 and all("noise/b_simple_tokens=" in line for line in logs), proc.stdout
