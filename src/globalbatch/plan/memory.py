"""The memory model: bytes per device for one training step, and the largest micro-batch that fits.

Pure arithmetic, no torch import (``globalbatch plan --memory`` runs without torch)::

    bytes per device = weights + gradients + master weights + optimizer states   (static, ÷ sharding)
                     + workspace + activation_bytes_per_sample × micro_batch ÷ checkpoint divisor

Static bytes follow Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", §3.1 and Figure 1: mixed precision with Adam holds 2Ψ (fp16/bf16
weights) + 2Ψ (gradients) + KΨ (fp32 master weights, momentum, variance; K = 12) bytes for Ψ
parameters; ZeRO stage 1 divides the K term by the DP degree N_d, stage 2 also the gradients,
stage 3 also the weights. FSDP full sharding (``fsdp``) is stage 3.

Optimizer states, in fp32 elements per parameter, named as in the optimizer registry
(:mod:`globalbatch.optim`): ``sgd`` 1 (the registry's SGD has momentum 0.9: one buffer),
``lars`` 1 (momentum), ``adamw`` and ``lamb`` 2 (exp_avg, exp_avg_sq); and for the memory model
only: ``sgd-plain`` 0 (no momentum), ``sgd-momentum`` 1, ``adafactor`` factored second moment:
rows + cols per matrix, one per element of a vector (Shazeer & Stern 2018, "Adafactor", §3,
Algorithm 4; no first moment, β1 = 0). With only a parameter count (no shapes) adafactor's
state is counted as 0 and the breakdown says so.

Not modelled (measure them, or leave headroom): ZeRO-3/FSDP's gathered layer weights and
reduce buckets, DDP's gradient buckets (≈ gradient size), the optimizer step's temporaries
(foreach AdamW), allocator fragmentation. ``workspace_bytes`` carries whatever a measurement
says is constant beyond the formula.

Activations are not predicted from the architecture: they are **measured** (two points of
forward + backward peak, :func:`activations_from_points`) or given. Activation checkpointing
divides them by ``checkpoint_divisor`` (≈ layers for per-block recomputation that keeps only the
block inputs; √layers for Chen et al. 2016's √n schedule): a given factor, not a prediction.

The probe's :class:`globalbatch.probe.MemoryModel` is the same line fitted on the whole step's
peaks (intercept = everything static); this module splits that intercept into its parts so a
change of optimizer, precision, sharding or device can be predicted before running.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional, Sequence

from globalbatch._util import SettingError

__all__ = ["OPTIMIZER_STATES", "PRECISIONS", "SHARDINGS", "MemoryConfig", "MemoryBreakdown", "Activations",
           "activations_from_points", "optimizer_state_elements", "static_bytes", "breakdown",
           "largest_micro_batch", "memory_report", "check_memory_config", "stage_shapes", "one_pipeline_stage"]

OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "lars": 1, "lamb": 2, "sgd-plain": 0, "sgd-momentum": 1, "adafactor": None}
"""fp32 state elements per parameter; None: factored (depends on the shapes)."""

PRECISIONS = {
    # name: (weight bytes, gradient bytes, fp32 master bytes) per parameter
    "fp32": (4, 4, 0),
    "bf16-mixed": (2, 2, 4),
}
"""Bytes per parameter for weights, gradients and master weights. ``bf16-mixed``: bf16 weights and
gradients for forward/backward, an fp32 master copy for the update (ZeRO's 2Ψ + 2Ψ + 4Ψ)."""

SHARDINGS = {
    # name: (weights sharded, gradients sharded, optimizer states + master sharded)
    "none": (False, False, False),
    "zero1": (False, False, True),
    "zero2": (False, True, True),
    "zero3": (True, True, True),
    "fsdp": (True, True, True),
}
"""What each sharding divides by the DP degree (ZeRO Figure 1; ``fsdp`` = full sharding = stage 3)."""

_OPT_STATE_BYTES = 4  # optimizer states are kept in fp32 in both precisions


def _number(name: str, value: Any, *, low: float, allowed: str, whole: bool = False,
            strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = value > low if strict else value >= low
    if ok and whole:
        ok = float(value).is_integer()
    if not ok:
        raise SettingError(name, value, allowed)


@dataclass(frozen=True, kw_only=True, slots=True)
class Activations:
    """Activation memory of one micro-batch: ``workspace_bytes + bytes_per_sample × micro_batch``."""

    bytes_per_sample: float
    """Bytes kept for backward per sample (before checkpointing)."""
    workspace_bytes: float = 0.0
    """Measured bytes that do not grow with the batch and that the formula does not name (may be < 0
    when fewer gradients are alive at the peak than the formula counts)."""
    source: str = "given"
    """How the numbers were obtained (``given``, or the two measured points)."""


def activations_from_points(points: Sequence[tuple[int, float]], *, formula_static_bytes: float = 0.0,
                            source: Optional[str] = None) -> Activations:
    """Activations from two (or more) measured (micro_batch, peak bytes) points of forward + backward.

    The slope of the line through the points is the per-sample activation; what the line's
    intercept holds beyond ``formula_static_bytes`` (the weights and gradients the formula
    counts for that measurement) is the workspace. Two points give the line exactly; more are
    least-squares (numpy-free: closed form).
    """
    pts = sorted((int(s), float(p)) for s, p in points)
    sizes = {s for s, _ in pts}
    if len(sizes) < 2:
        raise SettingError("activation points", [s for s, _ in pts], "at least two different micro-batch sizes")
    n = len(pts)
    mx = sum(s for s, _ in pts) / n
    my = sum(p for _, p in pts) / n
    slope = sum((s - mx) * (p - my) for s, p in pts) / sum((s - mx) ** 2 for s, _ in pts)
    intercept = my - slope * mx
    text = source or "measured at micro-batch " + ", ".join(str(s) for s, _ in pts)
    return Activations(bytes_per_sample=slope, workspace_bytes=intercept - formula_static_bytes, source=text)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryConfig:
    """What the static bytes depend on."""

    params: int
    """Trainable parameters N (all of them; sharding divides the per-device share)."""
    optimizer: str = "adamw"
    """One of :data:`OPTIMIZER_STATES`: adamw, sgd (momentum 0.9), lars, lamb, sgd-plain, sgd-momentum, adafactor."""
    precision: str = "fp32"
    """One of :data:`PRECISIONS`: fp32, bf16-mixed (bf16 weights/grads + fp32 master)."""
    sharding: str = "none"
    """One of :data:`SHARDINGS`: none (DDP), zero1, zero2, zero3, fsdp."""
    dp_world_size: int = 1
    """Data-parallel degree the sharding divides by."""
    checkpoint_divisor: float = 1.0
    """Activations are divided by this (1: no activation checkpointing)."""
    param_shapes: Optional[tuple[tuple[int, ...], ...]] = None
    """Shapes of the trainable parameters (only adafactor's factored state needs them)."""

    def __post_init__(self) -> None:
        check_memory_config(self)


def check_memory_config(cfg: MemoryConfig) -> None:
    """Raise :class:`SettingError` naming the first bad field."""
    _number("params", cfg.params, low=1, whole=True, allowed="a whole number of parameters ≥ 1, e.g. 7B")
    if cfg.optimizer not in OPTIMIZER_STATES:
        raise SettingError("optimizer", cfg.optimizer, ", ".join(OPTIMIZER_STATES))
    if cfg.precision not in PRECISIONS:
        raise SettingError("precision", cfg.precision, ", ".join(PRECISIONS))
    if cfg.sharding not in SHARDINGS:
        raise SettingError("sharding", cfg.sharding, ", ".join(SHARDINGS))
    _number("dp_world_size", cfg.dp_world_size, low=1, whole=True, allowed="a whole number ≥ 1")
    _number("checkpoint_divisor", cfg.checkpoint_divisor, low=1,
            allowed="a number ≥ 1 (1: no activation checkpointing; ≈ layers for per-block recomputation)")


def optimizer_state_elements(cfg: MemoryConfig) -> tuple[float, str]:
    """fp32 optimizer-state elements for all parameters, and a note (empty unless estimated)."""
    per_param = OPTIMIZER_STATES[cfg.optimizer]
    if per_param is not None:
        return float(per_param * cfg.params), ""
    if cfg.param_shapes is None:
        return 0.0, "adafactor's factored state (rows + cols per matrix) needs the shapes; counted as 0"
    total = 0
    for shape in cfg.param_shapes:
        if len(shape) >= 2:  # factored over the last two dims (the others are batch dims of the factor)
            lead = math.prod(shape[:-2])
            total += lead * (shape[-2] + shape[-1])
        else:
            total += math.prod(shape)
    return float(total), ""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Bytes per device at one micro-batch, by part."""

    micro_batch: int
    weights_bytes: float
    gradients_bytes: float
    master_weights_bytes: float
    optimizer_states_bytes: float
    workspace_bytes: float
    activations_bytes: float
    note: str = ""

    @property
    def static_bytes(self) -> float:
        """Everything that does not grow with the micro-batch."""
        return (self.weights_bytes + self.gradients_bytes + self.master_weights_bytes
                + self.optimizer_states_bytes + self.workspace_bytes)

    @property
    def total_bytes(self) -> float:
        return self.static_bytes + self.activations_bytes

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["static_bytes"] = self.static_bytes
        out["total_bytes"] = self.total_bytes
        return out


def static_bytes(cfg: MemoryConfig) -> dict[str, float]:
    """Weights, gradients, master weights and optimizer states per device (ZeRO §3.1, Figure 1)."""
    w, g, m = PRECISIONS[cfg.precision]
    shard_w, shard_g, shard_os = SHARDINGS[cfg.sharding]
    d = cfg.dp_world_size
    states, _ = optimizer_state_elements(cfg)
    return {
        "weights_bytes": w * cfg.params / (d if shard_w else 1),
        "gradients_bytes": g * cfg.params / (d if shard_g else 1),
        "master_weights_bytes": m * cfg.params / (d if shard_os else 1),
        "optimizer_states_bytes": _OPT_STATE_BYTES * states / (d if shard_os else 1),
    }


def breakdown(cfg: MemoryConfig, activations: Activations, micro_batch: int) -> MemoryBreakdown:
    """Bytes per device at ``micro_batch`` samples per forward/backward."""
    _number("micro_batch", micro_batch, low=0, whole=True, allowed="a whole number ≥ 0")
    parts = static_bytes(cfg)
    _, note = optimizer_state_elements(cfg)
    act = activations.bytes_per_sample * micro_batch / cfg.checkpoint_divisor
    return MemoryBreakdown(micro_batch=int(micro_batch), workspace_bytes=activations.workspace_bytes,
                           activations_bytes=act, note=note, **parts)


def largest_micro_batch(cfg: MemoryConfig, activations: Activations, device_bytes: float) -> int:
    """The largest micro-batch whose predicted bytes are at most ``device_bytes`` (0: not even one)."""
    _number("device_bytes", device_bytes, low=0, strict=True, allowed="bytes > 0, e.g. 80GiB")
    per_sample = activations.bytes_per_sample / cfg.checkpoint_divisor
    free = device_bytes - breakdown(cfg, activations, 0).static_bytes
    if free < per_sample:
        return 0
    if per_sample <= 0:
        raise SettingError("activation_bytes_per_sample", activations.bytes_per_sample,
                           "a number > 0 (activations grow with the batch)")
    # Half a byte of slack (as the probe's line): a budget exactly at a boundary fits, one byte below does not.
    return int(math.floor((free + min(0.5, 0.5 * per_sample)) / per_sample))


def stage_shapes(shapes: Sequence[tuple[int, ...]], pp_stages: int) -> list[tuple[tuple[int, ...], ...]]:
    """The parameter shapes cut into ``pp_stages`` contiguous stages of about equal parameter counts, in the model's
    parameter order (which follows its layers): a shape goes to stage ⌊p · m / N⌋, m the midpoint of its elements
    in the running count, N all elements. A tensor larger than a stage's share leaves a neighbouring stage empty."""
    _number("pp_stages", pp_stages, low=1, whole=True, allowed="a whole number ≥ 1")
    pp_stages = int(pp_stages)
    sizes = [math.prod(sh) for sh in shapes]
    total = sum(sizes) or 1
    stages: list[list[tuple[int, ...]]] = [[] for _ in range(pp_stages)]
    seen = 0
    for sh, n in zip(shapes, sizes):
        stages[min(pp_stages - 1, int(pp_stages * (seen + n / 2) / total))].append(tuple(sh))
        seen += n
    return [tuple(st) for st in stages]


def one_pipeline_stage(cfg: MemoryConfig, pp_stages: int) -> MemoryConfig:
    """What one device of a ``pp_stages``-stage pipeline holds: ⌈N / p⌉ parameters and, with shapes, those of the
    stage (:func:`stage_shapes`) whose optimizer state is the largest (adafactor's factored state depends on which
    matrices a stage has; the other optimizers' on the count alone)."""
    _number("pp_stages", pp_stages, low=1, whole=True, allowed="a whole number ≥ 1")
    pp_stages = int(pp_stages)
    if pp_stages == 1:
        return cfg
    shapes = cfg.param_shapes
    if shapes is not None:
        shapes = max(stage_shapes(shapes, pp_stages),
                     key=lambda st: optimizer_state_elements(replace(cfg, param_shapes=st))[0])
    return replace(cfg, params=-(-cfg.params // pp_stages), param_shapes=shapes)


def memory_report(cfg: MemoryConfig, activations: Activations, device_bytes: float,
                  micro_batch: Optional[int] = None, *, pp_stages: int = 1) -> dict[str, Any]:
    """The ``plan --memory`` section: the largest micro-batch and the breakdown at it (or at ``micro_batch``).

    ``pp_stages`` only labels the section: ``cfg.params`` is then one pipeline stage's share."""
    largest = largest_micro_batch(cfg, activations, device_bytes)
    shown = largest if micro_batch is None else micro_batch
    parts = breakdown(cfg, activations, shown)
    return {
        "device_bytes": device_bytes,
        "params": cfg.params,
        "pp_stages": pp_stages,
        "optimizer": cfg.optimizer,
        "precision": cfg.precision,
        "sharding": cfg.sharding,
        "dp_world_size": cfg.dp_world_size,
        "checkpoint_divisor": cfg.checkpoint_divisor,
        "activation_bytes_per_sample": activations.bytes_per_sample,
        "activations_source": activations.source,
        "largest_micro_batch": largest,
        "breakdown": parts.to_dict(),
        "fits": parts.total_bytes <= device_bytes,
    }


def _fmt_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:,.0f} {unit}" if unit == "B" else f"{sign}{n:,.2f} {unit}"
        n /= 1024
    return f"{sign}{n:,.2f} TiB"  # pragma: no cover


def memory_table(report: dict[str, Any]) -> Any:
    """A rich Table of the breakdown (rich is a core dependency)."""
    from rich.table import Table

    b = report["breakdown"]
    title = (f"memory per device: {report['optimizer']}, {report['precision']}, sharding {report['sharding']}"
             f" over dp {report['dp_world_size']}, device {_fmt_bytes(report['device_bytes'])}")
    table = Table(title=title)
    table.add_column("part")
    table.add_column("bytes", justify="right")
    table.add_column("how", justify="left")
    divisor = report["checkpoint_divisor"]
    pp = report.get("pp_stages", 1)
    params = f"params ({report['params']:,} per stage of {pp})" if pp > 1 else "params"
    rows = [
        ("weights", b["weights_bytes"], f"{params} × bytes per weight"),
        ("gradients", b["gradients_bytes"], f"{params} × bytes per gradient"),
        ("master weights", b["master_weights_bytes"], "fp32 copy (bf16-mixed only)"),
        ("optimizer states", b["optimizer_states_bytes"], b["note"] or "fp32 states per param"),
        ("workspace", b["workspace_bytes"], "measured constant beyond the formula"),
        (f"activations × {b['micro_batch']}", b["activations_bytes"],
         f"{_fmt_bytes(report['activation_bytes_per_sample'])}/sample"
         + (f" ÷ {divisor:g} (checkpointing)" if divisor != 1 else "") + f" ({report['activations_source']})"),
        ("total", b["total_bytes"], f"largest micro-batch that fits: {report['largest_micro_batch']}"),
    ]
    for name, value, how in rows:
        table.add_row(name, _fmt_bytes(value), how)
    return table
