"""Run directories of the lab (sweeps, branch tests): the manifest, the event log, stale temporary files.

A run directory is resumable: ``manifest.json`` records every setting that changes a
result; a rerun into the same directory must match it (a few named settings may change,
e.g. the branch test's seed count), and a mismatch is an error naming each difference —
never a silent mix of two runs.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from globalbatch._util import SettingError, atomic_write_json, json_default

__all__ = ["append_event", "pid_alive", "remove_stale_tmp", "check_manifest", "known_fields", "RunDirLock", "lock_run_dir",
           "lock_holder"]

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


def tmp_writer(path: Path) -> Optional[int]:
    """The pid of a live process writing ``…tmp-<pid>`` (None: not a pid suffix, or that process is gone: a killed
    attempt's file)."""
    pid = Path(path).name.rsplit("-", 1)[-1]
    return int(pid) if pid.isdigit() and pid_alive(int(pid)) else None


def remove_stale_tmp(trial_dir: Path, *, also_own: bool = False) -> None:
    """Delete ``metrics.jsonl.tmp-<pid>`` files of killed attempts (writer gone; never a live writer's)."""
    for stale in Path(trial_dir).glob("metrics.jsonl.tmp-*"):
        pid = tmp_writer(stale)
        if pid is None or (also_own and pid == os.getpid()):
            stale.unlink(missing_ok=True)


LOCK_NAME = ".lock"


class RunDirLock:
    """An exclusive lock on a run directory: ``.lock`` holding the owner's pid, ``fcntl.flock``-ed.

    The kernel drops a flock when its process dies, so a lock can never outlive its owner;
    a ``.lock`` left by a killed run (its pid gone) is taken over with a note on stderr.
    The file is removed on release (after checking it is still ours, by inode).
    """

    def __init__(self, out: Path, *, field: str = "out") -> None:
        self.out, self.field = Path(out), field
        self.path = self.out / LOCK_NAME
        self._fd: Optional[int] = None

    def acquire(self) -> "RunDirLock":
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise SettingError(self.field, str(self.out), "a writable run directory",
                                   why=f"{self.path} cannot be created: {exc.strerror or exc}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _live_holder(fd)
                os.close(fd)
                who = f"pid {holder}" if holder else "another process"
                raise SettingError(self.field, str(self.out), "a directory no other run is using",
                                   why=f"a run ({who}) holds {self.path}; wait for it or choose another directory") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous owner removed the file between our open and our flock: retry
                os.close(fd)
                continue
            stale = _read_pid(fd)
            if stale and stale != os.getpid():
                print(f"note: {self.out} was locked by pid {stale}, which is gone; taking it over",
                      file=sys.stderr)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._fd = fd
            return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)  # while still locked: a waiter re-checks the inode and retries
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)  # drops the flock
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


_HOLDER_WAIT_S = 0.5  # how long a run that lost the lock waits for the winner's pid (the error path only)


def _live_holder(fd: int, *, wait_s: Optional[float] = None) -> Optional[int]:
    """The live pid written in a lock file someone else holds, or None.

    The holder writes its pid just after taking the flock, so a run that loses the race by
    microseconds may read an empty file or the pid of a killed earlier owner: poll briefly
    (this is the error path only) before saying "another process".
    """
    deadline = time.monotonic() + (_HOLDER_WAIT_S if wait_s is None else wait_s)
    while True:
        pid = _read_pid(fd)
        if pid and pid_alive(pid):
            return pid
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def _read_pid(fd: int) -> Optional[int]:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def lock_holder(out: str | os.PathLike) -> Optional[int]:
    """The pid holding ``out``'s lock (0 when unknown), or None when it is free; writes nothing."""
    try:
        fd = os.open(Path(out) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return _read_pid(fd) or 0
    else:
        return None
    finally:
        os.close(fd)  # drops a shared flock taken here


def lock_run_dir(out: str | os.PathLike, *, field: str = "out") -> RunDirLock:
    """``with lock_run_dir(out):`` — hold ``out``'s exclusive :class:`RunDirLock` (the directory must exist).

    A second run into a directory in use is a :class:`SettingError` naming ``field`` and the holder's pid.
    """
    return RunDirLock(Path(out), field=field)


def known_fields(config_class: Any, d: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a manifest's config ``d`` that are fields of the dataclass ``config_class`` (a manifest of
    another version may hold others): what ``Config.from_dict`` passes to the constructor."""
    names = {f.name for f in fields(config_class)}
    return {k: v for k, v in d.items() if k in names}


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
                               why=f"{path} is unreadable: {' '.join(str(exc).split())}") from None
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
        atomic_write_json(path, want)  # a mutable setting changed: under the run-dir lock
        return
    _create_exclusive(path, want)


def _create_exclusive(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to a new ``path``: complete (temp file + fsync) and exclusive (``os.link``
    fails if another writer created it first)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(obj, indent=2, sort_keys=True, default=json_default) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise SettingError("out", str(path.parent), "a directory no other run is using",
                               why=f"{path} was created by another run meanwhile") from None
    finally:
        tmp.unlink(missing_ok=True)
