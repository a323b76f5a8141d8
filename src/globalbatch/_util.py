"""Small shared helpers: crash-safe file writes and the CLI's list/``KEY=VALUE`` parsing.

Used by the lab (sweep, branch, report, noise) and the CLI.
"""

from __future__ import annotations

import json
import math
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Mapping, Optional, Sequence

__all__ = ["atomic_write_text", "atomic_write_json", "json_default", "read_jsonl", "parse_list", "parse_task_args",
           "SettingError", "flag_names", "read_json_checked"]


# ---------------------------------------------------------------------------
# Setting errors in the house style
# ---------------------------------------------------------------------------


def _show(value: Any, flag: bool) -> str:
    """A value as the error line shows it: strings quoted, numbers plain, lists comma-joined for a flag."""
    if isinstance(value, (list, tuple)):
        return ",".join(_show(v, True) for v in value) if flag else repr(list(value))
    if isinstance(value, bool) or value is None or type(value).__name__ == "_Raw":
        return str(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int):
        return str(value)
    return repr(value)


class SettingError(ValueError):
    """A bad setting: ``<name> <value> is not allowed; allowed: <allowed>``.

    ``field`` is the library's name of the setting; :func:`flag_names` renames it to the
    command-line flag the user typed (``budget`` → ``--tokens``).
    """

    def __init__(self, field: str, value: Any, allowed: str, *, why: str = "", flag: bool = False) -> None:
        self.field, self.value, self.allowed, self.why = field, value, allowed, why
        super().__init__(self.text(field, flag=flag))

    def text(self, name: str, *, flag: bool = True) -> str:
        why = f" ({self.why})" if self.why else ""
        return f"{name} {_show(self.value, flag)} is not allowed{why}; allowed: {self.allowed}"


@contextmanager
def flag_names(names: Mapping[str, str]) -> Iterator[None]:
    """Inside, a :class:`SettingError` of a field in ``names`` is re-raised naming the flag instead."""
    try:
        yield
    except SettingError as exc:
        if exc.field not in names:
            raise
        raise SettingError(names[exc.field], exc.value, exc.allowed, why=exc.why, flag=True) from None


# ---------------------------------------------------------------------------
# Atomic files
# ---------------------------------------------------------------------------


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """Call ``write(f)`` on a same-directory temporary file, fsync it and ``os.replace`` it onto ``path``.

    A crash at any moment leaves either the old file or the new one, never a partial one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_write`)."""
    data = text.encode("utf-8")
    atomic_write(path, lambda f: f.write(data))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=json_default) + "\n")


def json_default(o: Any) -> Any:
    """``json.dumps(default=)`` for numpy scalars/arrays and tuples."""
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def read_json_checked(path: str | os.PathLike, *, field: str = "run_dir") -> Any:
    """A JSON file of a run directory; unreadable or malformed is a :class:`SettingError` naming the file."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SettingError(field, str(Path(path).parent), "a run directory written by globalbatch",
                           why=f"{path} is unreadable: {exc}") from None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Records of a JSONL file; a torn last line (a write cut by a kill) is dropped; a garbage line names the file."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.endswith("\n"):
                break
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise SettingError("run_dir", str(Path(path).parent), "a run directory written by globalbatch",
                                       why=f"{path} line {lineno} is not JSON: {exc}") from None
    return out


# ---------------------------------------------------------------------------
# Command-line parsing helpers (``globalbatch sweep``/``branch``/``noise``)
# ---------------------------------------------------------------------------


def parse_list(text: str, field_name: str, kind: type = float, allowed: Optional[str] = None) -> list:
    """``"16,32,64"`` → ``[16, 32, 64]``; K/M suffixes allowed for integers (``"1K,2K"``).

    Integers must be ≥ 1 and numbers finite; a bad item is one error line naming it:
    ``--batches -16 is not allowed; allowed: whole numbers ≥ 1, e.g. 16,32,64``.
    """
    from globalbatch.plan import parse_count

    if allowed is None:
        allowed = "whole numbers ≥ 1, e.g. 16,32,64" if kind is int else "numbers, e.g. 3e-4,1e-3"
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"{field_name} {str(text)!r} is not allowed; allowed: a comma-separated list of {allowed}")
    out = []
    for item in items:
        try:
            value = parse_count(item, field_name) if kind is int else float(item)
            ok = value >= 1 if kind is int else math.isfinite(value)
        except ValueError:
            value, ok = None, False
        if not ok:
            try:
                float(item)
                shown = item  # a number: shown as typed
            except ValueError:
                shown = repr(item)
            raise ValueError(f"{field_name} {shown} is not allowed; allowed: {allowed}")
        out.append(value)
    return out


def parse_task_args(pairs: Sequence[str]) -> dict[str, Any]:
    """``["d_model=64", "corpus_dir=/x"]`` → ``{"d_model": 64, "corpus_dir": "/x"}`` (JSON values where they parse)."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--task-arg {pair!r} is not allowed; allowed: KEY=VALUE, e.g. d_model=64")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def load_task_checked(task: str, overrides: Mapping[str, Any]):
    """``load_task(task, **overrides)`` with a :class:`SettingError` naming ``task`` or ``task_overrides``."""
    from globalbatch.lab.tasks import load_task

    try:
        return load_task(task, **dict(overrides))
    except ValueError as exc:
        if not overrides or str(exc).startswith(("task:", "task ")):
            raise SettingError("task", task, "tinygpt, mnist or package.module:function", why=str(exc)) from None
        import re

        named = [k for k in overrides if re.search(rf"(^|\.){re.escape(str(k))}:", str(exc))]  # the bad one(s)
        shown = " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in overrides.items()
                         if not named or k in named)
        raise SettingError("task_overrides", _Raw(shown), f"overrides task {task!r} accepts ({exc})") from None


class _Raw(str):
    """A string shown unquoted in an error line."""
