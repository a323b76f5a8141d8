"""Files read back from a run directory, validated field by field: a damaged one is refused, never reported.

Every JSON file and JSONL line the lab reads back — a sweep trial's ``summary.json`` and its
``metrics.jsonl`` lines, an adaptive arm's ``summary.json``, a timing record — passes through
here. A missing key, a value of the wrong type, a line that is no JSON object is a
:class:`~globalbatch.errors.SettingError` naming the run directory (``run_dir``), the file, its
line and the field. The summaries are typed: :class:`TrialSummary` and :class:`ArmSummary`,
frozen, with ``from_json`` (validating; older key names still read) and ``to_json``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, TypeVar

from globalbatch._util import read_json_checked, read_jsonl
from globalbatch.errors import SettingError
from globalbatch.validate import field_types

__all__ = ["RUN_DIR_ALLOWED", "damaged", "check_record", "read_record", "read_records", "TrialSummary", "ArmSummary",
           "read_summary", "STEP", "EVAL", "HEADER", "TIMING"]

RUN_DIR_ALLOWED = "a run directory written by globalbatch"

NUMBER = "number"
"""A JSON number (int or float; NaN and ±inf allowed: a diverged run writes them)."""
OPT_NUMBER = "number or null"
WHOLE = "whole number"
OPT_WHOLE = "whole number or null"
TEXT = "string"
OPT_TEXT = "string or null"
FLAG = "true or false"
LIST = "list"


_KIND_OF = {("int", False): WHOLE, ("int", True): OPT_WHOLE, ("float", False): NUMBER, ("float", True): OPT_NUMBER,
            ("str", False): TEXT, ("str", True): OPT_TEXT, ("bool", False): FLAG, ("list", False): LIST}
"""A summary field's kind from its annotation (:func:`globalbatch.validate.field_types`)."""


def _is(kind: str, value: Any) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    whole = isinstance(value, int) and not isinstance(value, bool)
    return {NUMBER: number, OPT_NUMBER: value is None or number, WHOLE: whole, OPT_WHOLE: value is None or whole,
            TEXT: isinstance(value, str), OPT_TEXT: value is None or isinstance(value, str),
            FLAG: isinstance(value, bool), LIST: isinstance(value, list)}[kind]


def damaged(run_dir: str | os.PathLike, where: str, what: str, *, field: str = "run_dir") -> SettingError:
    """The error of a damaged run directory: ``run_dir`` named (as ``field``), with the file (and line) and what is wrong."""
    return SettingError(field, str(run_dir), RUN_DIR_ALLOWED, why=f"{where}: {what}")


def _where(path: Path, line: Optional[int]) -> str:
    return f"{path}" + (f" line {line}" if line is not None else "")


def check_record(rec: Any, fields: Mapping[str, str], *, run_dir: str | os.PathLike, path: Path,
                 line: Optional[int] = None, optional: Mapping[str, str] | None = None,
                 field: str = "run_dir") -> dict[str, Any]:
    """``rec`` when it is a JSON object whose ``fields`` are present with their kinds and whose ``optional``
    fields, where present, are of theirs; else :func:`damaged` (naming the directory as ``field``)."""
    where = _where(path, line)
    if not isinstance(rec, dict):
        raise damaged(run_dir, where, "not a JSON object", field=field)
    for key, kind in fields.items():
        if key not in rec:
            raise damaged(run_dir, where, f"no {key}", field=field)
    for key, kind in {**(optional or {}), **fields}.items():
        if key in rec and not _is(kind, rec[key]):
            raise damaged(run_dir, where, f"{key} is {rec[key]!r}, not a {kind}", field=field)
    return rec


def _read_json(path: Path, run_dir: str | os.PathLike, field: str) -> Any:
    try:
        return read_json_checked(path)
    except SettingError as exc:
        raise SettingError(field, str(run_dir), RUN_DIR_ALLOWED, why=exc.why) from None


def read_record(path: Path, fields: Mapping[str, str], optional: Mapping[str, str] | None = None, *,
                run_dir: str | os.PathLike, field: str = "run_dir") -> dict[str, Any]:
    """A JSON file of a run directory, checked by :func:`check_record`."""
    return check_record(_read_json(path, run_dir, field), fields, run_dir=run_dir, path=path, optional=optional,
                        field=field)


STEP = ({"step": WHOLE, "consumed": NUMBER, "loss": NUMBER},
        {"skipped": FLAG, "val_loss": OPT_NUMBER, "b_simple": OPT_NUMBER, "batch": WHOLE, "lr": NUMBER})
"""A ``metrics.jsonl`` step record: the keys the analysis reads, then those it reads where present."""
EVAL = ({"step": WHOLE, "consumed": NUMBER, "val_loss": OPT_NUMBER}, {"batch": WHOLE})
HEADER: tuple[dict[str, str], dict[str, str]] = ({}, {"warmup_units": NUMBER, "unit": TEXT})
CHANGE: tuple[dict[str, str], dict[str, str]] = ({}, {})
TIMING = ({"units_per_s": NUMBER}, {"mfu": OPT_NUMBER, "batch": WHOLE, "steps": WHOLE, "seconds": NUMBER})
"""A sweep's ``timing/b<batch>.json``."""
_KINDS = {"step": STEP, "eval": EVAL, "header": HEADER, "change": CHANGE}
BRANCH = ({"branch_at": NUMBER, "k": WHOLE, "seed": WHOLE, "train_time_s": NUMBER},
          {"val_loss": OPT_NUMBER, "train_tail_loss": OPT_NUMBER, "batch": WHOLE})
"""A branch test's ``branches/<name>.json`` (``train_s`` in files written before the rename)."""
BRANCH_BASE = ({"train_time_s": NUMBER}, {"units_per_sample": OPT_NUMBER, "unit": TEXT})
"""A branch test's ``base/base.json``."""


def read_renamed(path: Path, schema: tuple[dict[str, str], dict[str, str]], *, run_dir: str | os.PathLike,
                 field: str = "run_dir", old_names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """:func:`read_record` of a file whose keys may carry an old name (``old_names``: old → today's)."""
    doc = _read_json(path, run_dir, field)
    if isinstance(doc, dict) and old_names:
        doc = {old_names.get(k, k): v for k, v in doc.items()}
    return check_record(doc, schema[0], run_dir=run_dir, path=path, optional=schema[1], field=field)


def read_records(path: Path, *, run_dir: str | os.PathLike, field: str = "run_dir") -> list[dict[str, Any]]:
    """The lines of a ``metrics.jsonl``: each a JSON object with a known ``kind`` and that kind's fields."""
    try:
        recs = read_jsonl(path)
    except OSError as exc:
        raise damaged(run_dir, str(path), f"unreadable: {exc.strerror or exc}", field=field) from None
    except SettingError as exc:  # a line that is no JSON: the error names the file and the line
        raise SettingError(field, str(run_dir), RUN_DIR_ALLOWED, why=exc.why) from None
    for i, rec in enumerate(recs, 1):
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if kind not in _KINDS:
            check_record(rec, {}, run_dir=run_dir, path=path, line=i, field=field)
            raise damaged(run_dir, _where(path, i), f"kind is {kind!r}, not one of {', '.join(_KINDS)}", field=field)
        required, optional = _KINDS[kind]
        check_record(rec, required, run_dir=run_dir, path=path, line=i, optional=optional, field=field)
    return recs


# ---------------------------------------------------------------------------
# Typed summaries
# ---------------------------------------------------------------------------

_S = TypeVar("_S", bound="_Summary")


class _Summary:
    """``from_json``/``to_json`` for a frozen dataclass: each field is checked by the kind its annotation says
    (``Optional[int]``: a whole number or null, ...)."""

    _OLD_NAMES: dict[str, str] = {}
    """Old key → today's name (files written before the rename still read)."""

    @classmethod
    def from_json(cls: type[_S], doc: Any, *, path: Path, run_dir: str | os.PathLike, field: str = "run_dir") -> _S:
        """A summary from its JSON object; a missing or mistyped field is :func:`damaged`."""
        if isinstance(doc, dict):
            doc = {cls._OLD_NAMES.get(k, k): v for k, v in doc.items()}
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        kinds = {name: _KIND_OF[t] for name, t in field_types(cls).items()}
        required = {f.name: kinds[f.name] for f in fields
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        optional = {f.name: kinds[f.name] for f in fields if f.name not in required}
        rec = check_record(doc, required, run_dir=run_dir, path=path, optional=optional, field=field)
        return cls(**{f.name: rec[f.name] for f in fields if f.name in rec})

    def to_json(self) -> dict[str, Any]:
        """The JSON object ``summary.json`` holds (every field; ``from_json`` reads it back equal)."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]


@dataclass(kw_only=True, frozen=True, slots=True)
class TrialSummary(_Summary):
    """A finished sweep trial (``trials/<name>/summary.json``, the done marker)."""

    trial: str
    """The trial's name, ``b<batch>_lr<lr>_s<seed>`` (its directory's)."""
    batch: int
    """Global batch in samples."""
    lr: float
    seed: int = 0
    unit: str
    """``token`` or ``sample``: what ``consumed`` and ``mean_batch_units`` count."""
    steps: int
    """Optimizer steps taken."""
    consumed: float
    """Loss-bearing units trained on."""
    mean_batch_units: float
    """Loss-bearing units per optimizer step, averaged over the trial."""
    units_per_s: float
    """Median in-trial throughput over the steady steps (NaN when none was timed)."""
    completed: bool = True
    micro_batch: Optional[int] = None
    consumed_samples: Optional[int] = None
    windows: Optional[int] = None
    skipped_windows: int = 0
    final_val_loss: Optional[float] = None
    core_s_per_unit: Optional[float] = None
    threads: Optional[int] = None
    train_time_s: Optional[float] = None
    eval_time_s: Optional[float] = None
    wall_time_s: Optional[float] = None
    started_at: Optional[float] = None
    finished_at: Optional[float] = None
    device: Optional[str] = None
    precision: Optional[str] = None
    pid: Optional[int] = None

    def rate(self) -> Optional[float]:
        """``units_per_s`` when it is a finite number > 0, else None."""
        x = self.units_per_s
        return float(x) if math.isfinite(x) and x > 0 else None


@dataclass(kw_only=True, frozen=True, slots=True)
class ArmSummary(_Summary):
    """A finished arm of the adaptive comparison at one seed (``runs/<arm>/s<seed>/summary.json``)."""

    arm: str
    """``b<batch>`` for a fixed batch, ``adaptive`` for the policy's arm."""
    seed: int
    batch: int
    """The global batch (samples) it started at."""
    lr: float
    steps: int
    consumed: float
    units_per_s: float
    completed: bool = True
    skipped_windows: int = 0
    train_time_s: Optional[float] = None
    wall_time_s: Optional[float] = None
    final_batch: Optional[int] = None
    changes: list = dataclasses.field(default_factory=list)
    """The adaptive schedule's batch changes (empty for a fixed batch)."""
    decisions: int = 0

    _OLD_NAMES = {"train_s": "train_time_s", "wall_s": "wall_time_s"}


def read_summary(cls: type[_S], path: Path, *, run_dir: str | os.PathLike, field: str = "run_dir") -> _S:
    """A summary file read and validated (:meth:`_Summary.from_json`)."""
    return cls.from_json(_read_json(path, run_dir, field), path=path, run_dir=run_dir, field=field)
