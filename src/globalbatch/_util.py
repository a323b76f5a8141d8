"""Small shared helpers: crash-safe file writes and the CLI's list/``KEY=VALUE`` parsing.

Used by sweep, branch, report and noise; ``globalbatch.sweep`` re-exports the public ones.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Sequence

__all__ = ["atomic_write_text", "atomic_write_json", "json_default", "read_jsonl", "parse_list", "parse_task_args"]


# ---------------------------------------------------------------------------
# Atomic files
# ---------------------------------------------------------------------------


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a same-directory temporary file, fsync and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


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


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Records of a JSONL file; a torn last line (a write cut by a kill) is dropped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


# ---------------------------------------------------------------------------
# Command-line parsing helpers (``globalbatch sweep``/``branch``/``noise``)
# ---------------------------------------------------------------------------


def parse_list(text: str, field_name: str, kind: type = float) -> list:
    """``"16,32,64"`` → ``[16, 32, 64]``; K/M suffixes allowed for integers (``"1K,2K"``)."""
    from globalbatch.plan import parse_count

    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"{field_name}: {text!r}: expected a comma-separated list, e.g. 16,32,64")
    out = []
    for item in items:
        try:
            out.append(parse_count(item, field_name) if kind is int else float(item))
        except ValueError:
            raise ValueError(f"{field_name}: {item!r}: not a {'whole number' if kind is int else 'number'} "
                             f"(list like {'16,32,64' if kind is int else '3e-4,1e-3'})") from None
    return out


def parse_task_args(pairs: Sequence[str]) -> dict[str, Any]:
    """``["d_model=64", "corpus_dir=/x"]`` → ``{"d_model": 64, "corpus_dir": "/x"}`` (JSON values where they parse)."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--task-arg: {pair!r}: expected KEY=VALUE, e.g. d_model=64")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out
