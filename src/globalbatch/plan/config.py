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

No torch import here.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Optional

from globalbatch._util import SettingError, _Raw
from globalbatch.plan import arithmetic as P
from globalbatch.validate import field_types, whole

__all__ = ["PlanConfig", "read_config_file", "resolve_plan_config", "config_error"]

_MAX_CONFIG_BYTES = 4 * 1024 * 1024
_GEOMETRY = ("global_batch", "micro_batch", "grad_accum_steps", "dp_world_size")


@dataclass(kw_only=True)
class PlanConfig:
    """Everything ``globalbatch plan`` can be told. Batch sizes are in sequences (samples)."""

    global_batch: Optional[int] = None
    """Sequences per optimizer step over all ranks and micro-steps."""
    micro_batch: Optional[int] = None
    """Sequences per forward/backward on one rank."""
    grad_accum_steps: Optional[int] = None
    """Micro-batches accumulated per optimizer step on each rank."""
    dp_world_size: Optional[int] = None
    """Data-parallel ranks."""
    new_dp_world_size: Optional[int] = None
    """Move the fixed global batch to this DP world size (re-derives grad_accum_steps)."""
    round_down: bool = False
    """When the batch does not divide: round the global batch down instead of failing, and say how much is dropped."""
    seq_len: Optional[int] = None
    """Tokens per sequence (padded length)."""
    valid_tokens_per_seq: Optional[float] = None
    """Mean non-padding (loss-bearing) tokens per sequence."""
    padding_fraction: Optional[float] = None
    """Share of token slots that are padding, in [0, 1)."""
    total_tokens: Optional[float] = None
    """Training budget in tokens (valid tokens when valid_tokens_per_seq/padding_fraction is set)."""
    lr: Optional[float] = None
    """Learning rate, tuned at ``lr_base_batch`` if that is given, else at this global batch."""
    lr_base_batch: Optional[int] = None
    """Global batch (sequences) at which ``lr`` was tuned."""
    lr_rule: str = "sqrt"
    """How the LR moves with the batch: linear, sqrt or none."""
    warmup_tokens: Optional[float] = None
    """Warmup length in tokens (converted to steps)."""
    warmup_steps: Optional[int] = None
    """Warmup length in optimizer steps (converted to tokens)."""
    pp_stages: Optional[int] = None
    """Pipeline-parallel stages p."""
    virtual_stages: int = 1
    """Interleaved virtual stages per pipeline stage v."""
    max_bubble: Optional[float] = None
    """Target pipeline bubble (fraction of ideal compute) for the smallest-global-batch hint."""
    params: Optional[float] = None
    """Model parameters N (for all-reduce volume and priors)."""
    grad_bytes_per_param: int = 4
    """Bytes per gradient element in the all-reduce (4 = fp32, 2 = bf16)."""
    no_sync: bool = True
    """Gradient sync only on the last micro-step (DDP no_sync)."""
    compute_flops: Optional[float] = None
    """Training compute C for the DeepSeek prior (default 6·N·D)."""
    loss_nats: Optional[float] = None
    """Loss (nats/token) for the Kaplan B_crit prior."""
    source: str = "flags"
    """Where the config came from (flags, yaml, toml, json, deepspeed, hf)."""

    def __post_init__(self) -> None:
        # One-field checks raise SettingError(field, ...): the CLI names the flag from its typer definitions.
        E, R = SettingError, _Raw
        if self.lr_rule not in P.LR_RULES:
            raise E("lr_rule", self.lr_rule, ", ".join(P.LR_RULES))
        if self.padding_fraction is not None and not 0 <= self.padding_fraction < 1:
            raise E("padding_fraction", R(str(self.padding_fraction)), "0 ≤ x < 1")
        if self.valid_tokens_per_seq is not None:
            if not self.valid_tokens_per_seq > 0:
                raise E("valid_tokens_per_seq", R(str(self.valid_tokens_per_seq)), "> 0")
            if self.seq_len is not None and self.valid_tokens_per_seq > self.seq_len:
                raise E("valid_tokens_per_seq", R(fmt(self.valid_tokens_per_seq)), f"≤ seq_len {self.seq_len}")
        for name in ("lr", "total_tokens", "max_bubble", "params", "compute_flops", "loss_nats"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
                raise E(name, R(_show(v)), "a number > 0")
        for name in ("seq_len", "lr_base_batch", "pp_stages", "virtual_stages", "grad_bytes_per_param", "new_dp_world_size"):
            if getattr(self, name) is not None:
                whole(getattr(self, name), name)
        if self.warmup_steps is not None:
            whole(self.warmup_steps, "warmup_steps", minimum=0)
        if self.warmup_tokens is not None and (not math.isfinite(self.warmup_tokens) or self.warmup_tokens < 0):
            raise E("warmup_tokens", R(_show(self.warmup_tokens)), "a number ≥ 0")
        if self.warmup_tokens is not None and self.warmup_steps is not None:
            raise SettingError("warmup_steps", self.warmup_steps, "warmup_tokens or warmup_steps, not both",
                               why="warmup_tokens is set too",
                               see={"warmup_tokens": "warmup_tokens", "warmup_steps": "warmup_steps"})
        if self.lr_base_batch is not None and self.lr is None:
            raise SettingError("lr_base_batch", self.lr_base_batch, "lr given as well (the lr tuned at that batch)",
                               see={"lr given": "lr"})
        if self.virtual_stages != 1 and self.pp_stages is None:
            raise SettingError("virtual_stages", self.virtual_stages, "pp_stages given as well (the pipeline stages)",
                               see={"pp_stages given": "pp_stages"})


def fmt(x: Any) -> str:
    """A count with thousands separators (a report's field, known to be set where it is shown)."""
    return P.fmt_int(x)


def _show(v: Any) -> str:
    """A value as the user wrote it: whole floats without ``.0``."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return repr(v) if isinstance(v, str) else str(v)


_FIELDS = {f.name: f for f in fields(PlanConfig)}
_COUNT_FIELDS = {"total_tokens", "params", "compute_flops", "warmup_tokens"}
_TYPES = field_types(PlanConfig)  # the checks of a file's values follow the fields' annotations
_INT_FIELDS = {n for n, (t, _) in _TYPES.items() if t == "int"}
_FLOAT_FIELDS = {n for n, (t, _) in _TYPES.items() if t == "float"} - _COUNT_FIELDS
_BOOL_FIELDS = {n for n, (t, _) in _TYPES.items() if t == "bool"}


def _coerce(name: str, value: Any) -> Any:
    """Type-check one value of our schema; token/param counts accept ``'100B'``-style strings."""
    if name in _COUNT_FIELDS:
        return float(P.parse_count(value, name))
    if name in _INT_FIELDS:
        # Batch sizes and lengths take plain whole numbers: "2K" for a seq_len is ambiguous (2000 or 2048?).
        if isinstance(value, str) and value.strip().replace(",", "").replace("_", "").isdigit():
            value = P.parse_count(value, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingError(name, value, "a whole number")
        return P._positive_int(name, value) if name != "warmup_steps" else _nonneg_int(name, value)
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                value = float(str(value))
            except ValueError:
                raise SettingError(name, value, "a number") from None
        if not math.isfinite(value):
            raise SettingError(name, value, "a finite number")
        if name == "padding_fraction" and not 0 <= value < 1:
            raise SettingError(name, value, "0 ≤ x < 1")
        if name != "padding_fraction" and value <= 0:
            raise SettingError(name, value, "a number > 0")
        return float(value)
    if name in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise SettingError(name, value, "true or false")
        return value
    if name == "lr_rule":
        if value not in P.LR_RULES:
            raise SettingError("lr_rule", value, ", ".join(P.LR_RULES))
        return str(value)
    raise RuntimeError(f"{name} is not a PlanConfig field")  # pragma: no cover


def _nonneg_int(name: str, value: Any) -> int:
    whole(value, name, minimum=0)
    return value


# ---------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------


def _yaml_load_unique(text: str) -> Any:
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
            data = _yaml_load_unique(text)
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
        raise config_error(exc, flags, dp_world_size) from None
    return cfg, [_spelled(w, names) for w in warnings]


def config_error(exc: ValueError, flags: dict, dp_world_size: Optional[int]) -> ValueError:
    """An error about a value read from the file keeps the file's key; one about a given value its field.

    A :class:`SettingError` of a given field (or of a file-qualified one, ``<path>: key``) passes through
    unchanged (the CLI names its flag from its typer definitions); one about a bare field read from a
    file becomes a plain ``ValueError``, so that no flag's name is put on a value the file holds.
    """
    given = set(flags) | ({"dp_world_size", "new_dp_world_size"} if dp_world_size is not None else set())
    if isinstance(exc, SettingError) and not (exc.field in given | {"config"} or ": " in exc.field):
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


# ---------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------


