"""Run directories of the lab (sweeps, branch tests): the manifest, the event log, stale temporary files.

A run directory is resumable: ``manifest.json`` records every setting that changes a
result; a rerun into the same directory must match it (a few named settings may change,
e.g. the branch test's seed count), and a mismatch is an error naming each difference —
never a silent mix of two runs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

from globalbatch._util import SettingError, atomic_write_json, json_default

__all__ = ["append_event", "pid_alive", "remove_stale_tmp", "check_manifest"]

_KINDS = {"grid": "a sweep", "branch": "a branch test", "adaptive": "an adaptive-batch comparison"}


def append_event(out_dir: Path, **event: Any) -> None:
    """One line in ``events.jsonl`` (O_APPEND: concurrent writers never interleave a short line)."""
    event = {"time": time.time(), "pid": os.getpid(), **event}
    fd = os.open(Path(out_dir) / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(event, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie — killed, not yet reaped — counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            return "\nState:\tZ" not in f.read()
    except OSError:  # no procfs (macOS): trust kill(0)
        return True


def remove_stale_tmp(trial_dir: Path, *, also_own: bool = False) -> None:
    """Delete ``metrics.jsonl.tmp-<pid>`` files of killed attempts (writer gone; never a live writer's)."""
    for stale in Path(trial_dir).glob("metrics.jsonl.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or not pid_alive(int(pid)) or (also_own and int(pid) == os.getpid()):
            stale.unlink(missing_ok=True)


def check_manifest(out: Path, want: dict[str, Any], *, section: str, mutable: Sequence[str] = ()) -> None:
    """Refuse a directory that holds another kind of run, or this kind with other settings; record ``want``.

    ``want`` is ``{"version": …, section: {...settings}}``; settings named in ``mutable`` may
    differ from the recorded ones (the manifest is then rewritten with the new values).
    """
    what = _KINDS.get(section, section)
    path = Path(out) / "manifest.json"
    want = json.loads(json.dumps(want, default=json_default))
    if path.is_file():
        try:
            have = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SettingError("out", str(out), f"a new directory, or {what} directory",
                               why=f"manifest.json is unreadable: {exc}") from None
        if not isinstance(have, dict) or not isinstance(have.get(section), dict):
            other = next((name for key, name in _KINDS.items() if isinstance(have, dict) and key in have), None)
            raise SettingError("out", str(out), f"a new directory, or {what} directory",
                               why=f"it holds {other or 'no ' + what.split(' ', 1)[1]}")
        g_have = {k: v for k, v in have[section].items() if k not in mutable}
        g_want = {k: v for k, v in want[section].items() if k not in mutable}
        if g_have != g_want or have.get("version") != want.get("version"):
            diffs = [f"{k}: {g_have.get(k)!r} -> {g_want.get(k)!r}" for k in sorted(set(g_have) | set(g_want))
                     if g_have.get(k) != g_want.get(k)]
            if have.get("version") != want.get("version"):
                diffs.append(f"version: {have.get('version')!r} -> {want.get('version')!r} (trained differently)")
            may = f" (only {', '.join(mutable)} may change)" if mutable else ""
            raise SettingError("out", str(out), f"a new directory, or the original settings to resume{may}",
                               why=f"holds {what} with a different grid: {'; '.join(diffs)}")
        if have == want:
            return
    atomic_write_json(path, want)
