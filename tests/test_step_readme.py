"""The README's DDP causal-LM loop (noise monitor, checkpoint) runs as written under torchrun with 2 gloo ranks.

``tests/dist/readme_loop.py`` extracts the block from README.md and runs it; see its docstring for the checks.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import run_torchrun

_SCRIPT = Path(__file__).parent / "dist" / "readme_loop.py"


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    try:
        return run_torchrun(_SCRIPT, str(tmp_path_factory.mktemp("readme_loop")))
    except pytest.fail.Exception as exc:  # a failed check: its PASS line and the later ones are missing
        return subprocess.CompletedProcess([], 1, stdout=str(exc), stderr="")


@pytest.mark.dist
@pytest.mark.parametrize("check", ["glue-lines", "before-loop-exact", "fsdp2-windows-exact", "readme-loop-exact", "readme-loop-naive-gap",
                                   "readme-loop-resume-bitwise"])
def test_readme_loop_under_two_gloo_ranks(readme_run, check):
    assert f"PASS {check}" in readme_run.stdout, readme_run.stdout[-3000:]


@pytest.mark.dist
def test_readme_loop_prints_its_batch_arithmetic_once_on_rank_0(readme_run):
    lines = [x for x in readme_run.stdout.splitlines() if x.startswith("globalbatch: global batch")]
    assert lines and lines[0].startswith("globalbatch: global batch 16 seq = 2 ranks × 4 accum × 2 seq"), lines
    assert len(lines) == 5  # one per driver (three runs of the block, two of the loop before), rank 0 only


@pytest.mark.dist
def test_the_loop_before_named_globalbatch_on_more_lines(readme_run):
    line = next(x for x in readme_run.stdout.splitlines() if x.startswith("GLUE "))
    before, after = (int(x.split("=")[1]) for x in line.split()[1:3])
    assert after <= 8 < before, line
