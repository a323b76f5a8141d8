"""What ``globalbatch plan`` can be told (:class:`PlanConfig`) and the check of one value of it.

A config file's values (:mod:`globalbatch.plan.config` reads them) and the CLI's flags are checked by the
same rules: the kind of each field follows its annotation (:func:`globalbatch.validate.field_types`);
token and parameter counts also take ``'100B'``-style strings. No torch import here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from globalbatch._util import SettingError, _Raw
from globalbatch.plan import arithmetic as P
from globalbatch.validate import field_types, whole

__all__ = ["PlanConfig", "COUNT_FIELDS"]


def _count() -> Any:
    """A field holding a token, parameter or FLOP count: a config file and the CLI may also give it as a
    ``'100B'``-style string (:data:`COUNT_FIELDS`)."""
    return field(default=None, metadata={"count": True})


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
    total_tokens: Optional[float] = _count()
    """Training budget in tokens (valid tokens when valid_tokens_per_seq/padding_fraction is set)."""
    lr: Optional[float] = None
    """Learning rate, tuned at ``lr_base_batch`` if that is given, else at this global batch."""
    lr_base_batch: Optional[int] = None
    """Global batch (sequences) at which ``lr`` was tuned."""
    lr_rule: str = "sqrt"
    """How the LR moves with the batch: linear, sqrt or none."""
    warmup_tokens: Optional[float] = _count()
    """Warmup length in tokens (converted to steps)."""
    warmup_steps: Optional[int] = None
    """Warmup length in optimizer steps (converted to tokens)."""
    pp_stages: Optional[int] = None
    """Pipeline-parallel stages p."""
    virtual_stages: int = 1
    """Interleaved virtual stages per pipeline stage v."""
    max_bubble: Optional[float] = None
    """Target pipeline bubble (fraction of ideal compute) for the smallest-global-batch hint."""
    params: Optional[float] = _count()
    """Model parameters N (for all-reduce volume and priors)."""
    grad_bytes_per_param: int = 4
    """Bytes per gradient element in the all-reduce (4 = fp32, 2 = bf16)."""
    no_sync: bool = True
    """Gradient sync only on the last micro-step (DDP no_sync)."""
    compute_flops: Optional[float] = _count()
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
COUNT_FIELDS = frozenset(f.name for f in fields(PlanConfig) if f.metadata.get("count"))
"""The fields that take ``'100B'``-style counts (``total_tokens``, ``warmup_tokens``, ``params``, ``compute_flops``)."""
_TYPES = field_types(PlanConfig)  # the checks of a file's values follow the fields' annotations
_INT_FIELDS = {n for n, (t, _) in _TYPES.items() if t == "int"}
_FLOAT_FIELDS = {n for n, (t, _) in _TYPES.items() if t == "float"} - COUNT_FIELDS
_BOOL_FIELDS = {n for n, (t, _) in _TYPES.items() if t == "bool"}


def _coerce(name: str, value: Any) -> Any:
    """Type-check one value of our schema; token/param counts accept ``'100B'``-style strings."""
    if name in COUNT_FIELDS:
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
