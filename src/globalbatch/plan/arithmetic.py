"""Global-batch arithmetic: pure integer math, no torch import.

The identity everything rests on::

    global_batch (sequences) = micro_batch × grad_accum_steps × dp_world_size
    global_batch_tokens      = global_batch × seq_len
    global_batch_valid_tokens= global_batch × mean valid (non-padding) tokens per sequence

Given any three of (global, micro, accum, dp) the fourth is solved; given all
four they are checked. A configuration that does not divide is an error that
quotes the numbers; the global batch is never changed silently.

Also here: optimizer-step budgets, LR scaling between batch sizes, token/step
warmup conversion, the pipeline bubble (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters", eq. for interleaved 1F1B:
bubble = (p − 1) / (v · m)), ring all-reduce volume (2(N−1)/N × bytes), and
scaling-law priors (each labelled with its source; they are predictions, not
measurements).
"""

from __future__ import annotations

import math
from fractions import Fraction
from dataclasses import dataclass, field
from typing import Any, Optional

from globalbatch.errors import SettingError
from globalbatch.units import fmt_int, parse_bytes, parse_count
from globalbatch.validate import positive, whole

__all__ = [
    "BatchGeometry",
    "solve_geometry",
    "rescale_dp",
    "optimizer_steps",
    "scale_lr",
    "LR_RULES",
    "warmup_tokens_to_steps",
    "warmup_steps_to_tokens",
    "PipelineBubble",
    "pipeline_bubble",
    "min_global_batch_for_bubble",
    "allreduce_bytes_per_rank",
    "Prior",
    "scaling_law_priors",
    "parse_count",
    "parse_bytes",
    "fmt_int",
    "dense_flops_per_token",
]

LR_RULES = ("linear", "sqrt", "none")


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise SettingError(name, value, "a whole number ≥ 1")
    if value < 1:
        raise SettingError(name, value, "a whole number ≥ 1")
    return value


# ---------------------------------------------------------------------------
# Geometry
# ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchGeometry:
    """The batch geometry of one optimizer step, in sequences (samples)."""

    global_batch: int
    """Sequences (samples) per optimizer step, summed over all DP ranks and micro-steps."""
    micro_batch: int
    """Sequences per forward/backward on one DP rank."""
    grad_accum_steps: int
    """Micro-batches accumulated on each rank before one optimizer step."""
    dp_world_size: int
    """Number of data-parallel ranks (replicas)."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch", "grad_accum_steps", "dp_world_size"):
            _positive_int(name, getattr(self, name))
        product = self.micro_batch * self.grad_accum_steps * self.dp_world_size
        if product != self.global_batch:
            raise SettingError("global_batch", self.global_batch, f"micro_batch × grad_accum_steps × dp_world_size = {product}",
                               why=f"global batch {self.global_batch} != micro_batch {self.micro_batch} × "
                                   f"grad_accum {self.grad_accum_steps} × dp {self.dp_world_size} = {product}")

    @property
    def samples_per_rank_per_step(self) -> int:
        """Sequences one DP rank processes per optimizer step (micro × accum)."""
        return self.micro_batch * self.grad_accum_steps

    def tokens(self, seq_len: int) -> int:
        """Token slots (padding included) per optimizer step."""
        return self.global_batch * _positive_int("seq_len", seq_len)

    def arithmetic(self) -> str:
        """``1,024 seq = 64 ranks × 8 accum × 2 seq``."""
        return (
            f"{fmt_int(self.global_batch)} seq = {self.dp_world_size} ranks × "
            f"{self.grad_accum_steps} accum × {self.micro_batch} seq"
        )


def solve_geometry(
    *,
    global_batch: Optional[int] = None,
    micro_batch: Optional[int] = None,
    grad_accum_steps: Optional[int] = None,
    dp_world_size: Optional[int] = None,
) -> BatchGeometry:
    """Solve the one missing value of global = micro × accum × dp, or check all four.

    Exactly three (solve) or four (check) values must be given. Division must be
    exact: ``global batch 1000 is not divisible by micro_batch 4 × dp 64 = 256``.
    """
    given: dict[str, Any] = {  # the values given, each checked to be a whole number ≥ 1 below
        "global_batch": global_batch,
        "micro_batch": micro_batch,
        "grad_accum_steps": grad_accum_steps,
        "dp_world_size": dp_world_size,
    }
    for name, value in given.items():
        if value is not None:
            given[name] = _positive_int(name, value)
    missing = [k for k, v in given.items() if v is None]
    if len(missing) > 1:
        raise SettingError(missing[0], None, "at least three of global_batch, micro_batch, grad_accum_steps, dp_world_size",
                           why=f"cannot solve the batch geometry: {', '.join(missing)} are missing")
    g, m, a, d = (given[k] for k in ("global_batch", "micro_batch", "grad_accum_steps", "dp_world_size"))
    if not missing:
        return BatchGeometry(global_batch=g, micro_batch=m, grad_accum_steps=a, dp_world_size=d)
    target = missing[0]
    if target == "global_batch":
        g = m * a * d
    else:
        # The two given factors, in the order the message names them.
        factors = [(label, value) for key, label, value in (
            ("micro_batch", "micro_batch", m), ("grad_accum_steps", "grad_accum", a), ("dp_world_size", "dp", d),
        ) if key != target]
        (name1, f1), (name2, f2) = factors
        denom = f1 * f2
        if g % denom:
            raise SettingError("global_batch", g, f"a multiple of {denom}",
                               why=f"global batch {g} is not divisible by {name1} {f1} × {name2} {f2} = {denom}"
                                   + _nearest_hint(g, denom))
        solved = g // denom
        m, a, d = (solved if key == target else v for key, v in
                   (("micro_batch", m), ("grad_accum_steps", a), ("dp_world_size", d)))
    return BatchGeometry(global_batch=g, micro_batch=m, grad_accum_steps=a, dp_world_size=d)


def _nearest_hint(value: int, denom: int) -> str:
    lo = (value // denom) * denom
    hi = lo + denom
    options = [str(x) for x in (lo, hi) if x > 0]
    return f"; nearest valid global batches: {' or '.join(options)}"


@dataclass(frozen=True, kw_only=True, slots=True)
class DpRescale:
    """The result of moving a fixed global batch to a new data-parallel world size."""

    geometry: BatchGeometry
    """The new geometry (its global batch is the old one, or the rounded-down one)."""
    requested_global_batch: int
    """The global batch the user asked to keep."""
    dropped_samples_per_step: int
    """Samples per step lost by ``round_down`` (0 when the batch divides)."""


def rescale_dp(
    geometry: BatchGeometry, new_dp_world_size: int, *, round_down: bool = False
) -> DpRescale:
    """Keep the global batch and the micro-batch; re-derive accum for a new DP world size.

    Without ``round_down`` a world size that does not divide is an error. With it the
    global batch is rounded down to a multiple of micro × dp and the loss is reported.
    """
    dp = _positive_int("dp_world_size", new_dp_world_size)
    g, m = geometry.global_batch, geometry.micro_batch
    per_accum = m * dp
    if g % per_accum == 0:
        new = solve_geometry(global_batch=g, micro_batch=m, dp_world_size=dp)
        return DpRescale(geometry=new, requested_global_batch=g, dropped_samples_per_step=0)
    if not round_down:
        raise SettingError("dp_world_size", dp, f"a world size where micro_batch {m} × dp divides {g}, or round_down=True "
                           "to drop the remainder explicitly", see={"round_down=True": "round_down"},
                           why=f"global batch {g} is not divisible by micro_batch {m} × dp {dp} = {per_accum}"
                               + _nearest_hint(g, per_accum))
    accum = g // per_accum
    if accum < 1:
        raise SettingError("dp_world_size", dp, "a smaller micro_batch or dp",
                           why=f"global batch {g} is smaller than micro_batch {m} × dp {dp} = {per_accum}")
    new = solve_geometry(micro_batch=m, grad_accum_steps=accum, dp_world_size=dp)
    return DpRescale(
        geometry=new, requested_global_batch=g, dropped_samples_per_step=g - new.global_batch
    )


# ---------------------------------------------------------------------------
# Budget, LR, warmup
# ---------------------------------------------------------------------------


def optimizer_steps(total_tokens: float, tokens_per_step: float) -> int:
    """Optimizer steps needed to consume ``total_tokens`` at ``tokens_per_step`` (ceil).

    Use valid (non-padding) tokens for both when they are known.
    """
    if not total_tokens > 0:
        raise SettingError("total_tokens", total_tokens, "> 0")
    if not tokens_per_step > 0:
        raise SettingError("tokens_per_step", tokens_per_step, "> 0")
    # Exact rational arithmetic: whole token counts divide exactly, and a budget smaller
    # than one step still needs one step.
    steps = Fraction(total_tokens) / Fraction(tokens_per_step)
    return max(1, math.ceil(steps))


def scale_lr(lr: float, from_batch: float, to_batch: float, rule: str) -> float:
    """Rescale a learning rate tuned at ``from_batch`` to ``to_batch``.

    ``linear``: lr × (to/from) (Goyal et al. 2017, SGD); ``sqrt``: lr × √(to/from)
    (Krizhevsky 2014; Adam-type); ``none``: unchanged.
    """
    if rule not in LR_RULES:
        raise SettingError("lr_rule", rule, ", ".join(LR_RULES))
    if not lr > 0:
        raise SettingError("lr", lr, "> 0")
    for name, b in (("from_batch", from_batch), ("to_batch", to_batch)):
        if not b > 0:
            raise SettingError(name, b, "> 0")
    ratio = to_batch / from_batch
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    return lr


def warmup_tokens_to_steps(warmup_tokens: float, tokens_per_step: float) -> int:
    """Warmup length in optimizer steps for a batch of ``tokens_per_step`` (ceil)."""
    if warmup_tokens < 0:
        raise SettingError("warmup_tokens", warmup_tokens, "≥ 0")
    if warmup_tokens == 0:
        return 0
    return optimizer_steps(warmup_tokens, tokens_per_step)


def warmup_steps_to_tokens(warmup_steps: int, tokens_per_step: float) -> float:
    """Warmup length in tokens for ``warmup_steps`` steps of ``tokens_per_step``."""
    whole(warmup_steps, "warmup_steps", minimum=0)
    if not tokens_per_step > 0:
        raise SettingError("tokens_per_step", tokens_per_step, "> 0")
    return warmup_steps * tokens_per_step


# ---------------------------------------------------------------------------
# Pipeline bubble and communication
# ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineBubble:
    """Pipeline bubble of a (possibly interleaved) 1F1B schedule."""

    pp_stages: int
    """Pipeline stages p."""
    microbatches_per_step: int
    """Micro-batches per optimizer step flowing through the pipeline, m."""
    virtual_stages: int
    """Interleaved model chunks per stage, v (1 = plain 1F1B)."""
    fraction_of_ideal: float
    """Bubble time as a fraction of ideal compute time: (p − 1) / (v·m)."""
    idle_share: float
    """Idle share of the whole step: (p − 1) / (v·m + p − 1)."""
    warning: Optional[str] = None
    """Set when m < p: the pipeline never fills."""


def pipeline_bubble(pp_stages: int, microbatches_per_step: int, virtual_stages: int = 1) -> PipelineBubble:
    """The bubble of p stages, m micro-batches per step and v virtual stages."""
    p = _positive_int("pp_stages", pp_stages)
    m = _positive_int("microbatches_per_step", microbatches_per_step)
    v = _positive_int("virtual_stages", virtual_stages)
    warning = None
    if m < p:
        warning = (
            f"{m} micro-batches per step < {p} pipeline stages: the pipeline never fills; "
            f"use at least {p} (grad_accum_steps ≥ pp_stages)"
        )
    return PipelineBubble(
        pp_stages=p,
        microbatches_per_step=m,
        virtual_stages=v,
        fraction_of_ideal=(p - 1) / (v * m),
        idle_share=(p - 1) / (v * m + p - 1),
        warning=warning,
    )


def min_global_batch_for_bubble(
    max_bubble_fraction: float,
    *,
    pp_stages: int,
    micro_batch: int,
    dp_world_size: int,
    virtual_stages: int = 1,
) -> int:
    """Smallest global batch whose bubble (fraction of ideal compute) is ≤ the target.

    m ≥ (p − 1) / (v · target), global = m × micro × dp.
    """
    if not 0 < max_bubble_fraction:
        raise SettingError("max_bubble_fraction", max_bubble_fraction, "> 0")
    p = _positive_int("pp_stages", pp_stages)
    v = _positive_int("virtual_stages", virtual_stages)
    m = max(1, math.ceil((p - 1) / (v * max_bubble_fraction) - 1e-12))
    return m * _positive_int("micro_batch", micro_batch) * _positive_int("dp_world_size", dp_world_size)


def allreduce_bytes_per_rank(
    grad_bytes: float, dp_world_size: int, *, grad_accum_steps: int = 1, no_sync: bool = True
) -> float:
    """Bytes each rank sends per optimizer step in a ring all-reduce of the gradients.

    A ring all-reduce sends 2(N − 1)/N × the buffer per rank. With ``no_sync``
    during accumulation there is one all-reduce per step, without it one per
    micro-step (``grad_accum_steps``).
    """
    n = _positive_int("dp_world_size", dp_world_size)
    a = _positive_int("grad_accum_steps", grad_accum_steps)
    if grad_bytes < 0:
        raise SettingError("grad_bytes", grad_bytes, "≥ 0")
    syncs = 1 if no_sync else a
    return 2 * (n - 1) / n * grad_bytes * syncs


# ---------------------------------------------------------------------------
# Scaling-law priors
# ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Prior:
    """A prediction from a published scaling law — a prior, not a measurement."""

    source: str
    """Paper the formula comes from."""
    formula: str
    """The formula as published."""
    batch_tokens: float
    """Predicted batch in tokens (B_opt or B_crit, see ``quantity``): every law gives one."""
    lr: Optional[float] = None
    """Predicted peak learning rate, where the law gives one."""
    quantity: str = "B_opt"
    """What the batch means: ``B_opt`` (loss-optimal) or ``B_crit`` (critical)."""
    kind: str = field(default="prior")
    """Always ``"prior"``: these are predictions before any measurement."""


def scaling_law_priors(
    *,
    params: Optional[float] = None,
    tokens: Optional[float] = None,
    compute_flops: Optional[float] = None,
    loss_nats: Optional[float] = None,
) -> list[Prior]:
    """Batch and LR priors from DeepSeek LLM, Step Law and Kaplan et al.

    C = 6·N·D unless ``compute_flops`` is given. Each prior needs its inputs;
    those that cannot be computed are left out.
    """
    for name, v in (("params", params), ("tokens", tokens), ("compute_flops", compute_flops), ("loss_nats", loss_nats)):
        if v is not None and not v > 0:
            raise SettingError(name, v, "> 0")
    out: list[Prior] = []
    c = compute_flops if compute_flops is not None else (6 * params * tokens if params and tokens else None)
    if c is not None:
        out.append(
            Prior(
                source="DeepSeek LLM (2024), arXiv 2401.02954",
                formula="B_opt = 0.2920·C^0.3271 tokens; η_opt = 0.3118·C^-0.1250",
                batch_tokens=0.2920 * c**0.3271,
                lr=0.3118 * c**-0.1250,
            )
        )
    if params is not None and tokens is not None:
        out.append(
            Prior(
                source="Step Law (2025), arXiv 2503.04715",
                formula="B = 0.58·D^0.571 tokens; η = 1.79·N^-0.713·D^0.307",
                batch_tokens=0.58 * tokens**0.571,
                lr=1.79 * params**-0.713 * tokens**0.307,
            )
        )
    if loss_nats is not None:
        out.append(
            Prior(
                source="Kaplan et al. (2020), arXiv 2001.08361",
                formula="B_crit = 2e8 / L^(1/0.21) tokens (L in nats)",
                batch_tokens=2e8 / loss_nats ** (1 / 0.21),
                quantity="B_crit",
            )
        )
    return out


def dense_flops_per_token(params: float) -> float:
    """``6·N``: training FLOPs per token of the weight matmuls alone (PaLM App. B without attention);
    ``plan``'s fallback when the layers and width are not known."""
    positive(params, "params", allowed="a number of parameters > 0")
    return 6.0 * params
