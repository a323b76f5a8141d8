"""Shared fixtures: every test leaves no process group behind and the default dtype as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _clean_torch_state():
    try:
        import torch
    except ImportError:  # plan tests run without torch
        yield
        return
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run_torchrun(script: Path, *args: str, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """Launch ``script`` under ``torchrun --standalone`` with gloo-friendly settings.

    Fails the calling test with the script's output when it exits non-zero.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", str(script), *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"torchrun {script.name} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc
