"""Run configs for ``globalbatch plan``: our own schema, DeepSpeed and HF files, and the plan report.

Three sources are read:

* our schema, YAML or TOML, flat keys equal to :class:`PlanConfig` field names —
  an unknown key is an error (a typo must not pass silently);
* a DeepSpeed JSON config: ``train_batch_size``, ``train_micro_batch_size_per_gpu``,
  ``gradient_accumulation_steps`` (``"auto"`` means not given), solved with
  DeepSpeed's own rules (``deepspeed/runtime/config.py::_set_batch_related_parameters``)
  but with exact division; other keys are ignored;
* a Hugging Face ``TrainingArguments`` JSON: ``per_device_train_batch_size``,
  ``gradient_accumulation_steps``, ``learning_rate``, ``warmup_steps``; the world
  size comes from ``--dp``; other keys are ignored.

No torch import here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from . import plan as P

__all__ = ["PlanConfig", "load_config", "build_plan", "plan_table"]


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
    """With ``new_dp_world_size``: round the global batch down instead of failing, and say how much is dropped."""
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
    """Where the config came from (flags, yaml, toml, deepspeed, hf)."""

    def __post_init__(self) -> None:
        if self.lr_rule not in P.LR_RULES:
            raise ValueError(f"lr_rule {self.lr_rule!r} is not allowed; allowed: {', '.join(P.LR_RULES)}")
        if self.padding_fraction is not None and not 0 <= self.padding_fraction < 1:
            raise ValueError(f"padding_fraction {self.padding_fraction} is not allowed; allowed: 0 ≤ x < 1")
        if self.valid_tokens_per_seq is not None:
            if not self.valid_tokens_per_seq > 0:
                raise ValueError(f"valid_tokens_per_seq {self.valid_tokens_per_seq} is not allowed; allowed: > 0")
            if self.seq_len is not None and self.valid_tokens_per_seq > self.seq_len:
                raise ValueError(
                    f"valid_tokens_per_seq {fmt(self.valid_tokens_per_seq)} is not allowed; allowed: ≤ seq_len {self.seq_len}"
                )
        for name in ("lr", "total_tokens", "max_bubble", "params", "compute_flops", "loss_nats"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} {v!r} is not allowed; allowed: a number > 0")
        for name in ("seq_len", "lr_base_batch", "pp_stages", "virtual_stages", "grad_bytes_per_param", "new_dp_world_size"):
            v = getattr(self, name)
            if v is not None:
                P._positive_int(name, v)
        if self.warmup_tokens is not None and self.warmup_steps is not None:
            raise ValueError("warmup_tokens and warmup_steps are both set; allowed: one of them")


def fmt(x: float) -> str:
    return P.fmt_int(x)


_FIELDS = {f.name: f for f in fields(PlanConfig)}
_COUNT_FIELDS = {"total_tokens", "params", "compute_flops", "warmup_tokens"}
_INT_FIELDS = {
    "global_batch", "micro_batch", "grad_accum_steps", "dp_world_size", "new_dp_world_size",
    "seq_len", "lr_base_batch", "warmup_steps", "pp_stages", "virtual_stages", "grad_bytes_per_param",
}
_FLOAT_FIELDS = {"valid_tokens_per_seq", "padding_fraction", "lr", "max_bubble", "loss_nats"}
_BOOL_FIELDS = {"round_down", "no_sync"}


def _coerce(name: str, value: Any) -> Any:
    """Type-check one value of our schema; quantities accept ``'100B'``-style strings."""
    if name in _COUNT_FIELDS:
        return float(P.parse_count(value, name))
    if name in _INT_FIELDS:
        if isinstance(value, str):
            value = P.parse_count(value, name)
        return P._positive_int(name, value) if name != "warmup_steps" else _nonneg_int(name, value)
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                return float(str(value))
            except ValueError:
                raise ValueError(f"{name} {value!r} is not a number; allowed: a number") from None
        return float(value)
    if name in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise ValueError(f"{name} {value!r} is not allowed; allowed: true or false")
        return value
    if name == "lr_rule":
        return str(value)
    raise ValueError(f"{name} is not a PlanConfig field")  # pragma: no cover


def _nonneg_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} {value!r} is not allowed; allowed: a whole number ≥ 0")
    return value


def _from_mapping(data: dict, source: str, path: Path) -> dict:
    out = {}
    for key, value in data.items():
        if key not in _FIELDS or key == "source":
            allowed = ", ".join(k for k in _FIELDS if k != "source")
            raise ValueError(f"{path}: unknown key {key!r}; allowed: {allowed}")
        if value is None:
            continue
        out[key] = _coerce(key, value)
    out["source"] = source
    return out


def _auto(value: Any) -> Any:
    return None if value == "auto" or value is None else value


def _deepspeed(data: dict, dp: Optional[int], path: Path) -> dict:
    """DeepSpeed's solving rules (config.py), with exact division instead of floor."""
    ws = dp if dp is not None else 1
    train = _auto(data.get("train_batch_size"))
    micro = _auto(data.get("train_micro_batch_size_per_gpu"))
    gas = _auto(data.get("gradient_accumulation_steps"))
    for name, v in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", gas)):
        if v is not None:
            P._positive_int(f"{path}: {name}", v)
    if train is None and micro is None:
        raise ValueError(
            f"{path}: either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"
        )
    if train is not None and micro is None and gas is None:
        gas = 1  # DeepSpeed: train only -> GAS = 1, micro = train / ws
    if micro is not None and train is None and gas is None:
        gas = 1  # DeepSpeed: micro only -> GAS = 1, train = micro·ws
    out: dict[str, Any] = {"dp_world_size": ws, "source": "deepspeed"}
    if train is not None:
        out["global_batch"] = train
    if micro is not None:
        out["micro_batch"] = micro
    if gas is not None:
        out["grad_accum_steps"] = gas
    lr = (data.get("optimizer") or {}).get("params", {}).get("lr") if isinstance(data.get("optimizer"), dict) else None
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        out["lr"] = float(lr)
    return out


def _hf(data: dict, dp: Optional[int], path: Path) -> dict:
    micro = data.get("per_device_train_batch_size", 8)
    gas = data.get("gradient_accumulation_steps", 1)
    P._positive_int(f"{path}: per_device_train_batch_size", micro)
    P._positive_int(f"{path}: gradient_accumulation_steps", gas)
    out: dict[str, Any] = {
        "micro_batch": micro,
        "grad_accum_steps": gas,
        "dp_world_size": dp if dp is not None else 1,
        "source": "hf",
    }
    if isinstance(data.get("learning_rate"), (int, float)):
        out["lr"] = float(data["learning_rate"])
    if isinstance(data.get("warmup_steps"), int) and data["warmup_steps"] > 0:
        out["warmup_steps"] = data["warmup_steps"]
    return out


def load_config(path: str | Path, *, dp_world_size: Optional[int] = None) -> dict:
    """Read a config file into PlanConfig keyword arguments (not yet validated as a whole)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"config {str(path)!r} does not exist; allowed: a YAML, TOML or JSON file")
    if path.is_dir():
        raise ValueError(f"config {str(path)!r} is a directory; allowed: a YAML, TOML or JSON file")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
            kind = "yaml"
        elif suffix == ".toml":
            data = tomllib.loads(text)
            kind = "toml"
        elif suffix == ".json":
            data = json.loads(text)
            kind = "json"
        else:
            raise ValueError(f"config {str(path)!r} has suffix {suffix!r}; allowed: .yaml, .yml, .toml, .json")
    except ValueError:
        raise
    except Exception as exc:  # yaml.YAMLError, tomllib.TOMLDecodeError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"config {str(path)!r} cannot be parsed: {first}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config {str(path)!r} holds {type(data).__name__}; allowed: a mapping of keys to values")
    if kind == "json":
        if any(k in data for k in ("train_batch_size", "train_micro_batch_size_per_gpu")) or (
            "gradient_accumulation_steps" in data and "per_device_train_batch_size" not in data
        ):
            return _deepspeed(data, dp_world_size, path)
        if "per_device_train_batch_size" in data or "output_dir" in data:
            return _hf(data, dp_world_size, path)
        return _from_mapping(data, "json", path)
    return _from_mapping(data, kind, path)


# ---------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------


def build_plan(cfg: PlanConfig) -> dict:
    """Solve/check the geometry and derive everything that follows. JSON-ready dict."""
    warnings: list[str] = []
    dp_change = None
    if (
        cfg.round_down and cfg.grad_accum_steps is None and cfg.new_dp_world_size is None
        and None not in (cfg.global_batch, cfg.micro_batch, cfg.dp_world_size)
        and cfg.global_batch % (cfg.micro_batch * cfg.dp_world_size)
    ):
        # Flags only: "--global-batch G --micro-batch M --dp D --round-down".
        per_accum = cfg.micro_batch * cfg.dp_world_size
        if cfg.global_batch < per_accum:
            raise ValueError(
                f"global batch {cfg.global_batch} is smaller than micro_batch {cfg.micro_batch} × dp "
                f"{cfg.dp_world_size} = {per_accum}; allowed: a smaller micro_batch or dp"
            )
        geo = P.solve_geometry(
            micro_batch=cfg.micro_batch, grad_accum_steps=cfg.global_batch // per_accum, dp_world_size=cfg.dp_world_size
        )
        dp_change = {
            "from_dp_world_size": None, "from_grad_accum_steps": None,
            "requested_global_batch": cfg.global_batch,
            "dropped_samples_per_step": cfg.global_batch - geo.global_batch,
        }
        warnings.append(
            f"--round-down: global batch {fmt(cfg.global_batch)} -> {fmt(geo.global_batch)}, "
            f"{fmt(dp_change['dropped_samples_per_step'])} samples per step dropped"
        )
    else:
        geo = P.solve_geometry(
            global_batch=cfg.global_batch,
            micro_batch=cfg.micro_batch,
            grad_accum_steps=cfg.grad_accum_steps,
            dp_world_size=cfg.dp_world_size,
        )
    if cfg.new_dp_world_size is not None and cfg.new_dp_world_size != geo.dp_world_size:
        res = P.rescale_dp(geo, cfg.new_dp_world_size, round_down=cfg.round_down)
        dp_change = {
            "from_dp_world_size": geo.dp_world_size,
            "from_grad_accum_steps": geo.grad_accum_steps,
            "requested_global_batch": res.requested_global_batch,
            "dropped_samples_per_step": res.dropped_samples_per_step,
        }
        if res.dropped_samples_per_step:
            warnings.append(
                f"--round-down: global batch {fmt(res.requested_global_batch)} -> {fmt(res.geometry.global_batch)}, "
                f"{fmt(res.dropped_samples_per_step)} samples per step dropped"
            )
        geo = res.geometry

    out: dict[str, Any] = {
        "global_batch_sequences": geo.global_batch,
        "micro_batch": geo.micro_batch,
        "grad_accum_steps": geo.grad_accum_steps,
        "dp_world_size": geo.dp_world_size,
        "seq_len": cfg.seq_len,
        "global_batch_tokens": None,
        "global_batch_valid_tokens": None,
        "tokens_per_microbatch_per_dp_rank": None,
        "valid_tokens_per_seq": None,
        "padding_fraction": None,
        "dp_change": dp_change,
        "source": cfg.source,
    }
    valid_per_seq = cfg.valid_tokens_per_seq
    if cfg.padding_fraction is not None:
        if cfg.seq_len is None:
            raise ValueError("padding_fraction needs seq_len; allowed: give --seq-len too")
        from_pf = cfg.seq_len * (1 - cfg.padding_fraction)
        if valid_per_seq is not None and abs(valid_per_seq - from_pf) > 1e-9 * cfg.seq_len:
            raise ValueError(
                f"valid_tokens_per_seq {fmt(valid_per_seq)} disagrees with padding_fraction {cfg.padding_fraction} "
                f"× seq_len {cfg.seq_len} (= {fmt(from_pf)} valid); allowed: give one of them"
            )
        valid_per_seq = from_pf
    if cfg.seq_len is not None:
        out["global_batch_tokens"] = geo.tokens(cfg.seq_len)
        out["tokens_per_microbatch_per_dp_rank"] = geo.micro_batch * cfg.seq_len
    if valid_per_seq is not None:
        valid = geo.global_batch * valid_per_seq
        out["global_batch_valid_tokens"] = int(valid) if float(valid).is_integer() else valid
        out["valid_tokens_per_seq"] = valid_per_seq
        if cfg.seq_len is not None:
            out["padding_fraction"] = 1 - valid_per_seq / cfg.seq_len

    tokens_per_step = out["global_batch_valid_tokens"] or out["global_batch_tokens"]
    out["tokens_per_step_counted"] = "valid" if out["global_batch_valid_tokens"] else ("padded" if tokens_per_step else None)
    out["total_tokens"] = cfg.total_tokens
    out["optimizer_steps"] = None
    if cfg.total_tokens is not None:
        if not tokens_per_step:
            raise ValueError("total_tokens needs seq_len (tokens per sequence); allowed: give --seq-len too")
        out["optimizer_steps"] = P.optimizer_steps(cfg.total_tokens, tokens_per_step)

    # LR
    out["lr"] = cfg.lr
    out["lr_base"] = cfg.lr
    out["lr_base_batch"] = cfg.lr_base_batch
    out["lr_rule"] = cfg.lr_rule
    if cfg.lr is not None and cfg.lr_base_batch is not None:
        out["lr"] = P.scale_lr(cfg.lr, cfg.lr_base_batch, geo.global_batch, cfg.lr_rule)
    elif cfg.lr is not None and dp_change is not None:
        # The global batch only moves with --round-down; rescale the LR with it.
        out["lr"] = P.scale_lr(cfg.lr, dp_change["requested_global_batch"], geo.global_batch, cfg.lr_rule)
        out["lr_base_batch"] = dp_change["requested_global_batch"]

    # Warmup
    out["warmup_tokens"] = cfg.warmup_tokens
    out["warmup_steps"] = cfg.warmup_steps
    if cfg.warmup_tokens is not None or cfg.warmup_steps is not None:
        if not tokens_per_step:
            raise ValueError("warmup conversion needs seq_len (tokens per sequence); allowed: give --seq-len too")
        if cfg.warmup_tokens is not None:
            out["warmup_steps"] = P.warmup_tokens_to_steps(cfg.warmup_tokens, tokens_per_step)
        else:
            out["warmup_tokens"] = P.warmup_steps_to_tokens(cfg.warmup_steps, tokens_per_step)

    # Pipeline
    out["pp_stages"] = cfg.pp_stages
    out["virtual_stages"] = cfg.virtual_stages
    out["pipeline_bubble_fraction"] = None
    out["pipeline_idle_share"] = None
    out["min_global_batch_for_bubble"] = None
    if cfg.pp_stages is not None:
        bubble = P.pipeline_bubble(cfg.pp_stages, geo.grad_accum_steps, cfg.virtual_stages)
        out["pipeline_bubble_fraction"] = bubble.fraction_of_ideal
        out["pipeline_idle_share"] = bubble.idle_share
        if bubble.warning:
            warnings.append(bubble.warning)
        if cfg.max_bubble is not None:
            out["min_global_batch_for_bubble"] = P.min_global_batch_for_bubble(
                cfg.max_bubble, pp_stages=cfg.pp_stages, micro_batch=geo.micro_batch,
                dp_world_size=geo.dp_world_size, virtual_stages=cfg.virtual_stages,
            )
    elif cfg.max_bubble is not None:
        raise ValueError("max_bubble needs pp_stages; allowed: give --pp-stages too")

    # Communication
    out["allreduce_bytes_per_step"] = None
    out["grad_bytes"] = None
    if cfg.params is not None:
        grad_bytes = cfg.params * cfg.grad_bytes_per_param
        out["grad_bytes"] = grad_bytes
        out["allreduce_bytes_per_step"] = P.allreduce_bytes_per_rank(
            grad_bytes, geo.dp_world_size, grad_accum_steps=geo.grad_accum_steps, no_sync=cfg.no_sync
        )
    out["allreduce_syncs_per_step"] = 1 if cfg.no_sync else geo.grad_accum_steps

    # Priors
    priors = P.scaling_law_priors(
        params=cfg.params, tokens=cfg.total_tokens, compute_flops=cfg.compute_flops, loss_nats=cfg.loss_nats
    )
    out["priors"] = [dataclasses.asdict(p) for p in priors]
    out["warnings"] = warnings
    return out


def plan_table(report: dict):
    """A rich Table that shows the arithmetic of the plan."""
    from rich.table import Table

    t = Table(title="globalbatch plan", show_header=True, header_style="bold")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_column("arithmetic")
    g, m, a, d = (report[k] for k in ("global_batch_sequences", "micro_batch", "grad_accum_steps", "dp_world_size"))
    t.add_row("global batch", f"{fmt(g)} seq", f"{d} ranks × {a} accum × {m} seq")
    if report.get("dp_change") and report["dp_change"]["from_dp_world_size"] is None:
        c = report["dp_change"]
        t.add_row("rounded down", f"{fmt(c['dropped_samples_per_step'])} seq/step dropped", f"global {fmt(c['requested_global_batch'])} → {fmt(g)}")
    elif report.get("dp_change"):
        c = report["dp_change"]
        t.add_row(
            "world-size change", f"dp {c['from_dp_world_size']} → {d}",
            f"grad_accum {c['from_grad_accum_steps']} → {a}; global {fmt(c['requested_global_batch'])} → {fmt(g)}",
        )
    if report["global_batch_tokens"] is not None:
        s = report["seq_len"]
        t.add_row("global batch tokens", f"{fmt(report['global_batch_tokens'])} tok", f"{d} ranks × {a} accum × {m} seq × {fmt(s)}")
        t.add_row("tokens per micro-batch per rank", f"{fmt(report['tokens_per_microbatch_per_dp_rank'])} tok", f"{m} seq × {fmt(s)}")
    if report["global_batch_valid_tokens"] is not None:
        arith = f"{fmt(g)} seq × {fmt(report['valid_tokens_per_seq'])} valid/seq"
        if report["padding_fraction"] is not None:
            arith += f" (padding {report['padding_fraction']:.1%})"
        t.add_row("global batch valid tokens", f"{fmt(report['global_batch_valid_tokens'])} tok", arith)
    if report["optimizer_steps"] is not None:
        per = report["global_batch_valid_tokens"] or report["global_batch_tokens"]
        t.add_row("optimizer steps", fmt(report["optimizer_steps"]), f"{fmt(report['total_tokens'])} tok ÷ {fmt(per)} {report['tokens_per_step_counted']} tok/step")
    if report["lr"] is not None:
        if report["lr_base_batch"] is not None:
            t.add_row("lr", f"{report['lr']:.4g}", f"{report['lr_base']:.4g} × ({fmt(g)}/{fmt(report['lr_base_batch'])}) rule {report['lr_rule']}")
        else:
            t.add_row("lr", f"{report['lr']:.4g}", "as given")
    if report["warmup_steps"] is not None:
        t.add_row("warmup", f"{fmt(report['warmup_steps'])} steps", f"{fmt(report['warmup_tokens'])} tok")
    if report["pipeline_bubble_fraction"] is not None:
        p, v = report["pp_stages"], report["virtual_stages"]
        t.add_row("pipeline bubble", f"{report['pipeline_bubble_fraction']:.2%} of compute", f"({p}−1)/({v}·{a}); idle share {report['pipeline_idle_share']:.2%}")
        if report["min_global_batch_for_bubble"] is not None:
            t.add_row("min global batch for bubble target", f"{fmt(report['min_global_batch_for_bubble'])} seq", "")
    if report["allreduce_bytes_per_step"] is not None:
        t.add_row(
            "all-reduce per rank per step", _human_bytes(report["allreduce_bytes_per_step"]),
            f"2({d}−1)/{d} × {_human_bytes(report['grad_bytes'])} × {report['allreduce_syncs_per_step']} sync",
        )
    for prior in report["priors"]:
        value = f"{_human_count(prior['batch_tokens'])} tok" if prior["batch_tokens"] is not None else ""
        extra = f"; lr {prior['lr']:.3g}" if prior["lr"] is not None else ""
        t.add_row(f"prior {prior['quantity']} ({prior['source'].split(',')[0]})", value, f"{prior['formula']}{extra}")
    return t


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _human_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:,.3g}{unit}"
    return f"{n:,.3g}"
