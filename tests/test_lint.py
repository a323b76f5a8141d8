"""``ruff check`` is part of the test run (``make test``): the configuration lives in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "src", "tests",
                           "examples", "benchmarks", "experiments"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "No module named ruff" not in proc.stderr, "ruff is a dev dependency: pip install -e '.[dev]'"
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
