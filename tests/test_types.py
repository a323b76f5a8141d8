"""The type check: mypy over src/globalbatch with pyproject.toml's [tool.mypy] settings is clean."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_mypy_is_clean_on_src():
    env = {**os.environ, "MYPY_CACHE_DIR": os.environ.get("MYPY_CACHE_DIR", str(REPO / ".mypy_cache"))}
    res = subprocess.run([sys.executable, "-m", "mypy", "src/globalbatch"], cwd=REPO, capture_output=True, text=True,
                         env=env, timeout=900)
    assert "No module named mypy" not in res.stderr, "mypy is a dev dependency: pip install -e '.[dev]' -c constraints.txt"
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert "Success: no issues found" in res.stdout
