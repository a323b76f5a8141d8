"""The core on 2 gloo ranks: the step driver against one full batch, the adaptive schedule's decisions, the probe.

One torchrun launch (tests/dist/core_all.py) runs step_equivalence_script.py (with step_skip_agree.py's check),
adaptive_agree.py and probe_agree.py in turn; each property below is its own test case.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import REPO, run_torchrun


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("core_2ranks")
    try:
        proc = run_torchrun(REPO / "tests" / "dist" / "core_all.py", str(out))
    except pytest.fail.Exception as exc:  # a failed check: the cases before it still pass, it and the rest fail
        proc = subprocess.CompletedProcess([], 1, stdout=str(exc), stderr="")
    return proc, out


@pytest.mark.dist
@pytest.mark.parametrize("check", ["ddp-float64", "ddp-float32", "ddp-short-window", "ddp-uneven-ranks",
                                   "ddp-no-sync-deferred", "ddp-flops", "ddp-nan-skip", "ddp-k-skips-raise",
                                   "ddp-resume", "fsdp2-float64", "ddp-inf-after-sync-skips-on-every-rank"])
def test_distributed_equivalence_skip_resume_fsdp2(two_ranks, check):
    proc, _ = two_ranks
    assert f"PASS {check}" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.dist
def test_all_ranks_make_the_same_decisions(two_ranks):
    """The adaptive batch schedule: every rank takes the same decisions (tests/dist/adaptive_agree.py)."""
    proc, out = two_ranks
    ranks = [json.loads((out / "adaptive" / f"rank{r}.json").read_text()) for r in range(2)]
    a, b = ranks
    assert a["history"] == b["history"] and len(a["history"]) >= 1, proc.stdout[-2000:]
    assert a["decisions"] == b["decisions"] and len(a["decisions"]) >= 5
    assert a["batches"] == b["batches"] and a["params"] == b["params"]
    # each rank saw different data and measured a different local rate: the shared value is what agrees
    assert a["first_micro_sum"] != b["first_micro_sum"]
    assert a["local_rates"] != b["local_rates"]


@pytest.mark.dist
def test_dist_probe_ranks_agree(two_ranks):
    """The micro-batch probe: 2 gloo ranks agree on every trial (tests/dist/probe_agree.py)."""
    proc, _ = two_ranks
    for name in ("oom_min", "oom_min_timing", "budget_min", "fatal", "real", "real_min_rank", "real_geometry"):
        assert f"CHECK {name} ok" in proc.stdout, proc.stdout + proc.stderr
