"""Run configs for ``globalbatch plan``: our own schema, DeepSpeed and HF files, and the plan report.

Three sources are read:

* our schema, YAML, TOML or JSON, flat keys equal to :class:`PlanConfig` field names —
  an unknown or duplicate key is an error (a typo must not pass silently);
* a DeepSpeed JSON config: ``train_batch_size``, ``train_micro_batch_size_per_gpu``,
  ``gradient_accumulation_steps`` (``"auto"`` means not given), solved with
  DeepSpeed's own rules (``deepspeed/runtime/config.py::_set_batch_related_parameters``)
  but with exact division; other keys are ignored;
* a Hugging Face ``TrainingArguments`` JSON: ``per_device_train_batch_size``,
  ``gradient_accumulation_steps``, ``learning_rate``, ``warmup_steps``; the world
  size comes from ``dp_world_size``; other keys are ignored.

:func:`resolve_plan_config` merges a file with values given directly (the CLI's flags). Whatever
changes the global batch relative to the file (a given value overriding a file value, a per-device
config under a new ``dp_world_size``) is said in a warning; a new ``dp_world_size`` for a file whose
geometry is complete keeps the global batch and re-derives accumulation.

The config's fields and the check of one value are in :mod:`globalbatch.plan.settings`. No torch import here.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any, Mapping, Optional

from globalbatch._util import SettingError
from globalbatch.plan import arithmetic as P
from globalbatch.plan.settings import _FIELDS, PlanConfig, _coerce, _show, fmt
from globalbatch.validate import whole

__all__ = ["PlanConfig", "read_config_file", "resolve_plan_config", "config_error"]

_MAX_CONFIG_BYTES = 4 * 1024 * 1024
_GEOMETRY = ("global_batch", "micro_batch", "grad_accum_steps", "dp_world_size")


# ---------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------


def yaml_load_unique(text: str) -> Any:
    """``yaml.safe_load`` that refuses duplicate keys (the last one would silently win)."""
    import yaml

    class _UniqueKeySafeLoader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            # No anchors or aliases: a config needs none, and a 300-byte alias bomb expands to 10⁹ items.
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a config",
                                                  event.start_mark)
            return super().compose_node(parent, index)

    def construct_mapping(loader: Any, node: Any, deep: bool = False) -> Any:
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:  # a list or mapping as a key ("? [a, b]"): one line, not a traceback
                raise yaml.constructor.ConstructorError(None, None, f"a key that is a {type(key).__name__}",
                                                        key_node.start_mark) from None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return loader.construct_mapping(node, deep)

    _UniqueKeySafeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return yaml.load(text, Loader=_UniqueKeySafeLoader)  # a SafeLoader subclass: no object construction


def _json_load_unique(text: str) -> tuple[Any, list[str]]:
    """The JSON document and its duplicate keys, in order (the last value of a duplicate would silently win)."""
    duplicates: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict:
        keys = [k for k, _ in items]
        duplicates.extend(k for i, k in enumerate(keys) if k in keys[:i])
        return dict(items)

    return json.loads(text, object_pairs_hook=pairs), duplicates


def _parse_error(exc: Exception) -> str:
    """One line from a YAML/TOML/JSON parser error, with its line number."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


_OURS = set(_FIELDS) - {"source"}
_DS_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu"}
_HF_KEYS = {"per_device_train_batch_size", "output_dir", "per_gpu_train_batch_size"}


def read_config_file(path: str | Path) -> tuple[str, dict]:
    """Read and classify a config file: ``(kind, mapping)`` with kind in yaml, toml, json, deepspeed, hf.

    The suffix is checked before anything is read; only regular files up to 4 MiB are read.
    """
    name = str(path)
    path = Path(path)
    suffix = path.suffix.lower()
    kinds = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml", ".json": "json"}
    a_file = "a YAML, TOML or JSON file"
    if not name:
        raise SettingError("config", name, a_file, why="empty")
    try:
        exists, is_dir, is_file = path.exists(), path.is_dir(), path.is_file()
    except OSError as exc:  # a name too long for the file system, a loop of links
        shown = name if len(name) <= 60 else name[:60] + f"… ({len(name)} characters)"
        raise SettingError("config", shown, a_file, why=exc.strerror or str(exc)) from None
    if not exists:
        raise SettingError("config", name, a_file, why="it does not exist")
    if is_dir:
        raise SettingError("config", name, a_file, why="it is a directory")
    if suffix not in kinds:
        raise SettingError("config", name, "a file ending .yaml, .yml, .toml or .json", why=f"suffix {suffix!r}")
    if not is_file:
        raise SettingError("config", name, a_file, why="it is not a regular file")
    try:
        size = path.stat().st_size
        if size > _MAX_CONFIG_BYTES:
            raise SettingError("config", name, f"a file of at most {_MAX_CONFIG_BYTES:,} bytes", why=f"{size:,} bytes")
        raw = path.read_bytes()
    except OSError as exc:
        raise SettingError("config", name, a_file, why=f"it cannot be read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SettingError("config", name, "a UTF-8 file", why=f"not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        raise SettingError("config", name, "a mapping of keys to values", why="it is empty")
    kind = kinds[suffix]
    duplicates: list[str] = []
    try:
        if kind == "yaml":
            data = yaml_load_unique(text)
        elif kind == "toml":
            data = tomllib.loads(text)
        else:
            data, duplicates = _json_load_unique(text)
    except Exception as exc:  # yaml.YAMLError (a duplicate key too), tomllib.TOMLDecodeError, json.JSONDecodeError
        raise SettingError("config", name, f"a {kind.upper()} file", why=f"it cannot be parsed as {kind.upper()}: "
                                                                        f"{_parse_error(exc)}") from None
    if duplicates:
        raise SettingError("config", name, f"a {kind.upper()} file",
                           why=f"it cannot be parsed as {kind.upper()}: duplicate key {duplicates[0]!r}")
    if not isinstance(data, dict):
        raise SettingError("config", name, "a mapping of keys to values", why=f"it holds a {type(data).__name__}")
    # Keys that only our schema has decide for it (warmup_steps is also an HF key).
    if kind == "json" and not (set(data) & (_OURS - {"warmup_steps"})):
        if set(data) & _DS_KEYS or ("gradient_accumulation_steps" in data and not set(data) & _HF_KEYS):
            kind = "deepspeed"
        elif set(data) & _HF_KEYS:
            kind = "hf"
    return kind, data


def _from_mapping(data: dict, source: str, path: str) -> dict:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in _OURS:
            import difflib

            close = difflib.get_close_matches(str(key), sorted(_OURS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise SettingError(f"{path}: key", key, ", ".join(sorted(_OURS)), why=f"unknown{hint}")
        if value is None:
            continue
        try:
            out[key] = _coerce(key, value)
        except SettingError as exc:  # the file's value: the line names the file and its key
            raise SettingError(f"{path}: {exc.field}", exc.value, exc.allowed, why=exc.why) from None
    out["source"] = source
    return out


def _auto(value: Any) -> Any:
    return None if value == "auto" or value is None else value


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _deepspeed(data: dict, flags: dict, dp: Optional[int], path: str, warnings: list[str]) -> dict:
    """DeepSpeed's solving rules (config.py), with flags merged first and exact division."""
    keys = (("global_batch", "train_batch_size"), ("micro_batch", "train_micro_batch_size_per_gpu"),
            ("grad_accum_steps", "gradient_accumulation_steps"))
    values: dict[str, Optional[int]] = {}
    for ours, theirs in keys:
        v = _auto(data.get(theirs))
        if v is not None:
            P._positive_int(f"{path}: {theirs}", v)
        flag = flags.get(ours)
        if flag is not None and v is not None and flag != v:
            warnings.append(f"{_ref(ours)} {flag} overrides {theirs} {v} from {path}")
        values[ours] = flag if flag is not None else v
    train, micro, gas = values["global_batch"], values["micro_batch"], values["grad_accum_steps"]
    if train is None and micro is None:
        raise SettingError(f"{path}: train_batch_size", None, "train_batch_size or train_micro_batch_size_per_gpu",
                           why="either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
    if dp is None:
        if train is not None and micro is not None and gas is not None:
            per = micro * gas
            if train % per:
                raise SettingError(f"{path}: train_batch_size", train, "a consistent config, or dp_world_size given",
                                   why=f"not divisible by train_micro_batch_size_per_gpu {micro} × "
                                       f"gradient_accumulation_steps {gas} = {per}",
                                   see={"dp_world_size given": "dp_world_size"})
            dp = train // per
            warnings.append(f"dp_world_size {dp} solved from {path} (give {_ref('dp_world_size')} to plan another world size)")
        else:
            dp = 1
            warnings.append(f"dp_world_size not given: assuming 1 rank (give {_ref('dp_world_size')} with a DeepSpeed config)")
    if train is not None and micro is None and gas is None:
        gas = 1  # DeepSpeed: train only -> GAS = 1, micro = train / ws
    if micro is not None and train is None and gas is None:
        gas = 1  # DeepSpeed: micro only -> GAS = 1, train = micro·ws
    if train is None:
        warnings.append(
            f"{path} leaves train_batch_size to DeepSpeed: the global batch is micro × GAS × dp and changes with "
            f"{_ref('dp_world_size')}"
        )
    out: dict[str, Any] = {"dp_world_size": dp, "source": "deepspeed"}
    for k, v in (("global_batch", train), ("micro_batch", micro), ("grad_accum_steps", gas)):
        if v is not None:
            out[k] = v
    opt = data.get("optimizer")
    params = opt.get("params") if isinstance(opt, dict) else None
    if isinstance(params, dict) and _auto(params.get("lr")) is not None:
        out["lr"] = _file_lr(params["lr"], f"{path}: optimizer.params.lr")
    return out


def _file_lr(value: Any, name: str) -> float:
    """A learning rate read from another tool's file: a finite number > 0, never silently dropped."""
    lr = _number(value)
    if lr is None or not math.isfinite(lr) or lr <= 0:
        raise SettingError(name, value, "a finite number > 0 (or leave it out)")
    return lr


def _hf(data: dict, flags: dict, dp: Optional[int], path: str, warnings: list[str]) -> dict:
    micro = data.get("per_device_train_batch_size", data.get("per_gpu_train_batch_size", 8))
    gas = data.get("gradient_accumulation_steps", 1)
    P._positive_int(f"{path}: per_device_train_batch_size", micro)
    P._positive_int(f"{path}: gradient_accumulation_steps", gas)
    for ours, theirs, v in (("micro_batch", "per_device_train_batch_size", micro), ("grad_accum_steps", "gradient_accumulation_steps", gas)):
        if flags.get(ours) is not None and flags[ours] != v:
            warnings.append(f"{_ref(ours)} {flags[ours]} overrides {theirs} {v} from {path}")
    if dp is None:
        dp = 1
        warnings.append(f"dp_world_size not given: assuming 1 rank (give {_ref('dp_world_size')} with a Transformers config)")
    warnings.append(
        f"{path} is per-device: the global batch is per_device_train_batch_size × accum × dp and changes with "
        f"{_ref('dp_world_size')}"
    )
    out: dict[str, Any] = {
        "micro_batch": flags.get("micro_batch") or micro,
        "grad_accum_steps": flags.get("grad_accum_steps") or gas,
        "dp_world_size": dp,
        "source": "hf",
    }
    if flags.get("global_batch") is not None:  # checked against the file's per-device geometry, never dropped
        out["global_batch"] = flags["global_batch"]
    if data.get("learning_rate") is not None:
        out["lr"] = _file_lr(data["learning_rate"], f"{path}: learning_rate")
    ws = data.get("warmup_steps")
    if ws is not None:
        whole(ws, f"{path}: warmup_steps", minimum=0, allowed="a whole number of steps ≥ 0")
    if ws:
        out["warmup_steps"] = ws
    if _number(data.get("warmup_ratio")):
        warnings.append(f"{path}: warmup_ratio {data['warmup_ratio']} needs the run length in steps; not used")
    return out


def _ref(field: str) -> str:
    """A setting named in a warning, as a marker :func:`_spelled` writes the caller's way (``--dp`` on the CLI)."""
    return f"⟨{field}⟩"


def _spelled(text: str, names: Mapping[str, str] | None) -> str:
    """``text`` with each :func:`_ref` marker replaced by ``names[field]`` (the field's own name without one)."""
    return re.sub(r"⟨(\w+)⟩", lambda m: (names or {}).get(m.group(1), m.group(1)), text)


def _try_geometry(kw: dict) -> Optional[P.BatchGeometry]:
    try:
        return P.solve_geometry(**{k: kw.get(k) for k in _GEOMETRY})
    except ValueError:
        return None


def resolve_plan_config(
    path: Optional[str | Path], flags: dict, *, dp_world_size: Optional[int] = None, round_down: bool = False,
    names: Mapping[str, str] | None = None,
) -> tuple[PlanConfig, list[str]]:
    """Merge a config file (optional) with values given directly; returns the config and warnings.

    ``flags`` holds PlanConfig field names (None = not given). ``dp_world_size``: with a file whose
    geometry is complete it is a *new* world size for the same global batch. ``names`` spells the
    settings the warnings mention the caller's way (the CLI passes its flags: ``dp_world_size`` →
    ``--dp``); without it they name the fields.
    """
    flags = {k: v for k, v in flags.items() if v is not None}
    warnings: list[str] = []
    try:
        cfg = _resolve(path, flags, dp_world_size, round_down, warnings)
    except ValueError as exc:
        raise config_error(exc, flags, dp_world_size, path) from None
    return cfg, [_spelled(w, names) for w in warnings]


# Our fields as DeepSpeed and Transformers files spell them
_FILE_KEYS = {
    "deepspeed": {"global_batch": "train_batch_size", "micro_batch": "train_micro_batch_size_per_gpu",
                  "grad_accum_steps": "gradient_accumulation_steps"},
    "hf": {"micro_batch": "per_device_train_batch_size", "grad_accum_steps": "gradient_accumulation_steps"},
}


def _file_key(path: str | Path, field: str) -> Optional[str]:
    """The key of the (already read) config file that holds ``field``, or None when the file does not set it."""
    try:
        kind, data = read_config_file(path)
    except ValueError:
        return None
    key = _FILE_KEYS.get(kind, {}).get(field, field)
    if kind == "hf" and key not in data and field == "micro_batch" and "per_gpu_train_batch_size" in data:
        key = "per_gpu_train_batch_size"
    return key if _auto(data.get(key)) is not None else None


def config_error(exc: ValueError, flags: dict, dp_world_size: Optional[int],
                 path: Optional[str | Path] = None) -> ValueError:
    """An error about a value read from the file names the file and its key; one about a given value its field.

    A :class:`SettingError` of a given field (or of a file-qualified one, ``<path>: key``) passes through
    unchanged (the CLI names its flag from its typer definitions); one about a field the file ``path`` holds is
    re-raised as ``<path>: <the file's key>`` (``ds.json: train_batch_size``); any other bare field becomes a plain
    ``ValueError``, so that no flag's name is put on a value the file holds.
    """
    given = set(flags) | ({"dp_world_size", "new_dp_world_size"} if dp_world_size is not None else set())
    if isinstance(exc, SettingError) and not (exc.field in given | {"config"} or ": " in exc.field):
        key = _file_key(path, exc.field) if path is not None else None
        if key is not None:
            return SettingError(f"{path}: {key}", exc.value, exc.allowed, why=exc.why)
        return ValueError(str(exc))
    return exc


def _resolve(path: Any, flags: dict, dp: Optional[int], round_down: bool, warnings: list[str]) -> PlanConfig:
    if round_down:
        flags["round_down"] = True
    if path is None:
        kw = dict(flags)
        if dp is not None:
            kw["dp_world_size"] = dp
        elif sum(kw.get(k) is not None for k in _GEOMETRY[:3]) < 3:
            kw["dp_world_size"] = 1
            warnings.append(f"dp_world_size not given: assuming 1 rank (give {_ref('dp_world_size')})")
        return PlanConfig(**kw, source="flags")

    name = str(path)
    kind, data = read_config_file(path)
    if kind == "deepspeed":
        kw = _deepspeed(data, flags, dp, name, warnings)
        kw.update({k: v for k, v in flags.items() if k not in _GEOMETRY})
        return PlanConfig(**kw)
    if kind == "hf":
        kw = _hf(data, flags, dp, name, warnings)
        kw.update({k: v for k, v in flags.items() if k not in _GEOMETRY})
        return PlanConfig(**kw)

    file_kw = _from_mapping(data, kind, name)
    file_geo = _try_geometry(file_kw)
    kw = dict(file_kw)
    for key, value in flags.items():
        if key in file_kw and file_kw[key] != value and key in _FIELDS:
            warnings.append(f"{_ref(key)} {_show(value)} overrides {key} {_show(file_kw[key])} from {name}")
        kw[key] = value
    if dp is not None:
        geo_now = _try_geometry(kw)
        base = geo_now or file_geo
        if base is not None and base.dp_world_size != dp:
            if geo_now is None:  # flags made it inconsistent: let the check below report it
                kw["dp_world_size"] = dp
            else:
                kw.update({k: getattr(geo_now, k) for k in _GEOMETRY})
                kw["new_dp_world_size"] = dp  # same global batch on a new world size
        elif base is None:
            kw["dp_world_size"] = dp
    elif _try_geometry(kw) is None and kw.get("dp_world_size") is None and sum(kw.get(k) is not None for k in _GEOMETRY[:3]) < 3:
        kw["dp_world_size"] = 1
        warnings.append(f"dp_world_size not given in {name} or by {_ref('dp_world_size')}: assuming 1 rank")
    cfg = PlanConfig(**kw)
    if file_geo is not None and cfg.new_dp_world_size is None:
        geo = _try_geometry(kw)
        if geo is not None and geo.global_batch != file_geo.global_batch:
            warnings.append(
                f"global batch {fmt(file_geo.global_batch)} in {name} -> {fmt(geo.global_batch)} with the flags given"
            )
    return cfg
