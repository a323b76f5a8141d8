"""All ranks agree on skipping: a non-finite gradient written on one rank after the sync skips everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_torchrun

_DIST = Path(__file__).parent / "dist"


@pytest.mark.dist
def test_one_rank_inf_after_sync_skips_the_step_on_every_rank():
    out = run_torchrun(_DIST / "step_skip_agree.py").stdout
    assert "PASS ddp-inf-after-sync-skips-on-every-rank" in out, out[-3000:]
