"""Shared validators that raise :class:`~globalbatch.errors.SettingError`.

Commands and file readers check their inputs with these before anything is printed or
written. Each raises ``SettingError(field, value, allowed)`` naming the library's field; the
CLI renames the field to the flag the user typed from its own typer definitions
(:func:`globalbatch.cli.app.flag_names_of`), so a validator's error needs no message parsing.

No torch at import time (``plan`` uses these too); :func:`device` imports it when called.
"""

from __future__ import annotations

import errno
import math
import numbers
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from globalbatch.errors import Raw as _Raw, SettingError
from globalbatch.units import parse_count

__all__ = ["MAX_COUNT", "MAX_BATCH", "count", "whole", "positive", "number", "fraction", "choice", "out_dir",
           "existing_dir", "number_list", "count_list", "whole_list", "key_values", "seed_list", "make_out_dir",
           "created_out_dir", "field_types"]

MAX_COUNT = 10**18
"""Upper bound of any token, sample or step count (a quintillion: far above any training run)."""
MAX_BATCH = 10**9
"""Upper bound of a batch size in samples (it names a trial directory and sizes a tensor)."""


def _is_int(value: Any) -> bool:
    """An integer: Python's, numpy's or any ``numbers.Integral`` (a 0-d integer tensor is not one); never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # numpy's bool is no Integral


def count(value: Any, field: str, *, minimum: int = 1, maximum: int = MAX_COUNT, what: str = "a whole number") -> int:
    """A count typed as ``2M``, ``4.1B``, ``2,048``, ``1e6`` or an int; whole, ``minimum ≤ n ≤ maximum``.

    ``1e400`` and ``1e999999999`` are errors naming ``field`` (never an OverflowError).
    """
    allowed = f"{what} ≥ {minimum:,} (at most {_sci(maximum)}), e.g. 2M"
    if _is_int(value):
        n = int(value)
    else:
        try:
            n = parse_count(value, field)
        except ValueError:
            raise SettingError(field, value if not isinstance(value, str) else _Typed(value), allowed) from None
    if not minimum <= n <= maximum:
        raise SettingError(field, value if _is_int(value) else _Typed(str(value)), allowed)
    return n


def _sci(n: int) -> str:
    """``10**18`` → ``1e18``; other numbers with thousands separators."""
    text = str(n)
    return f"1e{len(text) - 1}" if text.strip("0") == "1" else f"{n:,}"


def whole(value: Any, field: str, *, minimum: int = 1, maximum: int = MAX_COUNT, allowed: Optional[str] = None) -> int:
    """A plain whole number (no suffixes), ``minimum ≤ n ≤ maximum`` (``allowed``: the error's own wording)."""
    if not _is_int(value) or not minimum <= value <= maximum:
        top = f" ≤ {maximum:,}" if maximum < MAX_COUNT else ""
        # a float shows as given ("global_batch 4.0 is not allowed"; "4" would read as allowed)
        raise SettingError(field, _Typed(repr(value)) if isinstance(value, float) else value,
                           allowed or f"a whole number ≥ {minimum}{top}")
    return int(value)  # numpy's integers as Python's


def number(value: Any, field: str, *, low: Optional[float] = None, high: Optional[float] = None,
           low_open: bool = False, high_open: bool = False, allowed: Optional[str] = None) -> float:
    """A finite real number in ``[low, high]`` (either end open with ``*_open``; None: unbounded)."""
    if allowed is None:
        parts = []
        if low is not None:
            parts.append(f"{'>' if low_open else '≥'} {low:g}")
        if high is not None:
            parts.append(f"{'<' if high_open else '≤'} {high:g}")
        allowed = "a finite number" + (" " + " and ".join(parts) if parts else "")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    x = float(value) if ok else math.nan
    ok = ok and math.isfinite(x)
    if ok and low is not None:
        ok = x > low if low_open else x >= low
    if ok and high is not None:
        ok = x < high if high_open else x <= high
    if not ok:
        raise SettingError(field, value, allowed)
    return x


def positive(value: Any, field: str, *, allowed: Optional[str] = None) -> float:
    """A finite number > 0."""
    return number(value, field, low=0.0, low_open=True, allowed=allowed or "a finite number > 0")


def fraction(value: Any, field: str, *, low_open: bool = False, high_open: bool = True) -> float:
    """A number in [0, 1) by default (ends chosen by ``low_open``/``high_open``)."""
    lo, hi = ("0 <" if low_open else "0 ≤"), ("< 1" if high_open else "≤ 1")
    return number(value, field, low=0.0, high=1.0, low_open=low_open, high_open=high_open,
                  allowed=f"a fraction, {lo} x {hi}")


def choice(value: Any, field: str, choices: Iterable[str]) -> str:
    """One of ``choices`` (exact spelling)."""
    choices = list(choices)
    if value not in choices:
        raise SettingError(field, value, ", ".join(choices))
    return value


def number_list(text: Any, field: str, *, positive_only: bool = True, example: str = "3e-4,1e-3") -> list[float]:
    """``"3e-4,1e-3"`` → ``[3e-4, 1e-3]``: distinct finite numbers (> 0 with ``positive_only``); ``example`` is the
    error's example of what is allowed."""
    allowed = f"distinct finite numbers{' > 0' if positive_only else ''}, e.g. {example}"
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise SettingError(field, _Typed(str(text)), allowed)
    out = []
    for item in items:
        try:
            x = float(item)
        except ValueError:
            raise SettingError(field, item, allowed) from None
        if not math.isfinite(x) or (positive_only and x <= 0):
            raise SettingError(field, _Typed(item), allowed)
        out.append(x)
    if len(set(out)) != len(out):
        raise SettingError(field, _Typed(str(text)), allowed)
    return out


def count_list(text: Any, field: str, *, maximum: int = MAX_BATCH, allowed: Optional[str] = None) -> list[int]:
    """``"16,32,1K"`` → ``[16, 32, 1000]``: whole numbers from 1 to ``maximum``."""
    allowed = allowed or f"whole numbers ≥ 1 (at most {_sci(maximum)}), e.g. 16,32,64"
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise SettingError(field, _Typed(repr(str(text))), allowed)
    out = []
    for item in items:
        try:
            out.append(count(item, field, maximum=maximum))
        except SettingError:
            try:
                float(item)
                shown: Any = _Typed(item)
            except ValueError:
                shown = item
            raise SettingError(field, shown, allowed) from None
    return out


def whole_list(values: Any, field: str, *, minimum: int = 1, allowed: Optional[str] = None) -> list[int]:
    """A non-empty list (or tuple) of distinct whole numbers ≥ ``minimum``, as ints (``4.0`` is 4)."""
    def ok(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v == int(v) \
            and v >= minimum

    seq = isinstance(values, (list, tuple))
    out = [int(v) for v in values] if seq and values and all(ok(v) for v in values) else []
    if not out or len(set(out)) != len(out):
        raise SettingError(field, list(values) if seq else values, allowed or f"distinct whole numbers ≥ {minimum}")
    return out


def key_values(pairs: Iterable[str] | None, field: str = "task_overrides") -> dict[str, Any]:
    """``["d_model=64", "corpus_dir=/x"]`` → ``{"d_model": 64, "corpus_dir": "/x"}`` (JSON values where they parse)."""
    import json

    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SettingError(field, pair, "KEY=VALUE, e.g. d_model=64")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def seed_list(text: Any, field: str = "seeds") -> list[int]:
    """``"0,1,2"`` → ``[0, 1, 2]``: distinct whole numbers ≥ 0."""
    allowed = "distinct whole numbers ≥ 0, comma-separated, e.g. 0,1,2"
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    out = []
    for item in items:
        try:
            out.append(count(item, field, minimum=0, maximum=2**32 - 1))
        except SettingError:
            raise SettingError(field, str(text), allowed) from None
    if not out or len(set(out)) != len(out):
        raise SettingError(field, str(text), allowed)
    return out


def field_types(cls: type) -> dict[str, tuple[str, bool]]:
    """Each field of dataclass ``cls``: its base type's name and whether it may be None, read from its
    annotation (``Optional[int]`` → ``("int", True)``, ``list[int]`` → ``("list", False)``), so that a
    record's checks follow its declaration instead of a second list of the same types."""
    import dataclasses

    out: dict[str, tuple[str, bool]] = {}
    for f in dataclasses.fields(cls):
        text = (f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))).replace(" ", "")
        optional = text.startswith("Optional[") or "|None" in text or text.startswith("None|")
        if text.startswith("Optional["):
            text = text[len("Optional["):-1]
        text = text.replace("|None", "").replace("None|", "")
        out[f.name] = (text.split("[")[0], optional)
    return out


# ---------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------

def _too_long(path: Path) -> Optional[str]:
    try:
        name_max = os.pathconf(_existing_ancestor(path), "PC_NAME_MAX")
        path_max = os.pathconf(_existing_ancestor(path), "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    longest = max((len(os.fsencode(p)) for p in path.parts), default=0)
    if longest > name_max:
        return f"a name is {longest} bytes; this file system allows {name_max}"
    if len(os.fsencode(str(path.absolute()))) >= path_max:
        return f"the path is longer than {path_max} bytes"
    return None


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def out_dir(path: Any, field: str = "out") -> Path:
    """An output directory that exists or can be created: checked, nothing created.

    Refused: ``''``, a name too long for the file system, an existing non-directory, a path
    under a file, a first existing ancestor that this process cannot write.
    """
    allowed = "a directory that exists or can be created"
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise SettingError(field, "" if path is None else path, allowed, why="empty")
    p = Path(path)
    why = _too_long(p)
    if why:
        raise SettingError(field, _Typed(_short(str(p))), allowed, why=why)
    if p.exists() and not p.is_dir():
        raise SettingError(field, str(p), allowed, why="it is a file")
    anc = _existing_ancestor(p)
    if not anc.is_dir():
        raise SettingError(field, str(p), allowed, why=f"{anc} is a file")
    if not p.exists() and not os.access(anc, os.W_OK | os.X_OK):
        raise SettingError(field, str(p), allowed, why=f"{anc} is not writable")
    if p.exists() and not os.access(p, os.W_OK | os.X_OK):
        raise SettingError(field, str(p), allowed, why="it is not writable")
    return p


def make_out_dir(path: Path, field: str = "out") -> None:
    """``mkdir -p`` of a checked :func:`out_dir`; an OS refusal (read-only file system) is a SettingError."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SettingError(field, str(path), "a directory that exists or can be created",
                           why=exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))) from None


@contextmanager
def created_out_dir(path: Any, field: str = "out") -> Iterator[Path]:
    """Check and create ``path`` for a command's output; if the command then fails, a directory it
    created (still empty) is removed again, so a rejected run leaves nothing behind."""
    p = out_dir(path, field)
    created = [d for d in (p, *p.parents) if not d.exists()]  # this directory and the parents it creates, deepest first
    make_out_dir(p, field)
    try:
        yield p
    except BaseException:
        for d in created:
            try:
                d.rmdir()  # only while still empty
            except OSError:
                break
        raise


def existing_dir(path: Any, field: str, *, allowed: str = "an existing directory") -> Path:
    """A directory that exists."""
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise SettingError(field, "" if path is None else path, allowed, why="empty")
    p = Path(path)
    if _too_long(p):
        raise SettingError(field, _Typed(_short(str(p))), allowed, why=_too_long(p) or "")
    if not p.exists():
        raise SettingError(field, str(p), allowed, why="it does not exist")
    if not p.is_dir():
        raise SettingError(field, str(p), allowed, why="it is a file")
    return p


def _short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[:n] + f"… ({len(text)} characters)"


_Typed = _Raw
"""A value shown as the user typed it (unquoted)."""
