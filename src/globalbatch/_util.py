"""Small private helpers: crash-safe file writes and JSON files of run directories.

``SettingError`` lives in :mod:`globalbatch.errors` (re-exported here for old imports).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, BinaryIO, Callable

from globalbatch.errors import Raw as _Raw, SettingError, flag_names  # noqa: F401 (re-exported)

__all__ = ["atomic_write", "atomic_write_text", "atomic_write_json", "json_default", "read_jsonl", "read_json_checked"]


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
