"""The plan report: what follows from a batch geometry (tokens, steps, LR, warmup, bubble, all-reduce, priors).

:func:`build_plan` solves and checks a :class:`globalbatch.plan.config.PlanConfig` and returns a frozen, typed
:class:`PlanReport`; :func:`plan_table` shows its arithmetic. Pure arithmetic, no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from globalbatch.errors import Raw, SettingError
from globalbatch.plan import arithmetic as P

from globalbatch.plan.config import PlanConfig, _ref, _spelled, config_error, resolve_plan_config

__all__ = ["PlanReport", "DpChange", "build_plan", "make_plan", "plan_table"]


def fmt(x: Any) -> str:
    """:func:`fmt_int` of a report's field (known to be set where it is shown)."""
    return P.fmt_int(x)


@dataclass(frozen=True, kw_only=True)
class DpChange:
    """How the geometry moved from the stated one: a new DP world size, or ``--round-down``."""

    from_dp_world_size: Optional[int]
    """The configured DP world size (None: flags only, rounded down)."""
    from_grad_accum_steps: Optional[int]
    requested_global_batch: int
    """The global batch (sequences) the user asked for."""
    dropped_samples_per_step: int
    """Sequences per step lost to ``--round-down`` (0 when the new world divides)."""


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """Everything ``globalbatch plan`` derives, typed and frozen. :meth:`to_dict` is the stable ``--json``."""

    global_batch_sequences: int
    micro_batch: int
    grad_accum_steps: int
    dp_world_size: int
    seq_len: Optional[int]
    global_batch_tokens: Optional[int]
    """Padded token slots per optimizer step (all ranks)."""
    global_batch_valid_tokens: Optional[float]
    """Non-padding tokens per optimizer step, from ``valid_tokens_per_seq`` or ``padding_fraction``."""
    tokens_per_microbatch_per_dp_rank: Optional[int]
    valid_tokens_per_seq: Optional[float]
    padding_fraction: Optional[float]
    dp_change: Optional[DpChange]
    source: Optional[str]
    """Where the geometry came from (``flags``, ``ours``, ``deepspeed``, ``hf``)."""
    tokens_per_step_counted: Optional[str]
    """``valid`` or ``padded``: which tokens per step the step and warmup counts divide by."""
    total_tokens: Optional[float]
    optimizer_steps: Optional[int]
    lr: Optional[float]
    """The learning rate at this global batch (scaled by ``lr_rule`` from ``lr_base_batch``)."""
    lr_base: Optional[float]
    lr_base_batch: Optional[int]
    lr_rule: Optional[str]
    warmup_tokens: Optional[float]
    warmup_steps: Optional[int]
    warmup_tokens_covered: Optional[float]
    warmup_given_in: Optional[str]
    pp_stages: Optional[int]
    virtual_stages: Optional[int]
    pipeline_bubble_fraction: Optional[float]
    pipeline_idle_share: Optional[float]
    min_global_batch_for_bubble: Optional[int]
    allreduce_bytes_per_step: Optional[float]
    grad_bytes: Optional[float]
    allreduce_syncs_per_step: int
    model_flops_per_step: Optional[float] = None
    """Training FLOPs per optimizer step (all ranks) by the formula ``6·N·tokens`` over the padded token
    slots (PaLM App. B without the attention term); None without ``params`` and ``seq_len``."""
    model_flops_formula: Optional[str] = None
    """How ``model_flops_per_step`` was computed (a formula, not a measurement)."""
    priors: tuple[P.Prior, ...] = ()
    """Scaling-law predictions (labelled priors, not measurements)."""
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the stable snake_case keys of ``globalbatch plan --json``."""
        d = dataclasses.asdict(self)
        d["priors"] = [dataclasses.asdict(p) for p in self.priors]
        d["warnings"] = list(self.warnings)
        return d


def build_plan(cfg: PlanConfig, *, names: Optional[dict[str, str]] = None) -> PlanReport:
    """Solve/check the geometry and derive everything that follows, as a frozen :class:`PlanReport`
    (``names``: how the warnings spell the settings they mention; default the field names)."""
    warnings: list[str] = []
    dp_change: Optional[dict[str, Any]] = None
    g0, m0, d0 = cfg.global_batch, cfg.micro_batch, cfg.dp_world_size
    if (
        cfg.round_down and cfg.grad_accum_steps is None and cfg.new_dp_world_size is None
        and g0 is not None and m0 is not None and d0 is not None and g0 % (m0 * d0)
    ):
        # Flags only: "--global-batch G --micro-batch M --dp D --round-down".
        per_accum = m0 * d0
        if g0 < per_accum:
            raise SettingError("global_batch", g0, "a smaller micro_batch or dp",
                               why=f"global batch {g0} is smaller than micro_batch {m0} × dp {d0} = {per_accum}")
        geo = P.solve_geometry(micro_batch=m0, grad_accum_steps=g0 // per_accum, dp_world_size=d0)
        dp_change = {
            "from_dp_world_size": None, "from_grad_accum_steps": None,
            "requested_global_batch": g0,
            "dropped_samples_per_step": g0 - geo.global_batch,
        }
        warnings.append(
            f"{_ref('round_down')}: global batch {fmt(g0)} -> {fmt(geo.global_batch)}, "
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
                f"{_ref('round_down')}: global batch {fmt(res.requested_global_batch)} -> {fmt(res.geometry.global_batch)}, "
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
            raise SettingError("padding_fraction", cfg.padding_fraction, "seq_len as well", why="it needs seq_len",
                               see={"seq_len": "seq_len"})
        from_pf = cfg.seq_len * (1 - cfg.padding_fraction)
        if valid_per_seq is not None and abs(valid_per_seq - from_pf) > 1e-9 * cfg.seq_len:
            raise SettingError("valid_tokens_per_seq", Raw(fmt(valid_per_seq)), "valid_tokens_per_seq or padding_fraction, "
                               "not both", why=f"it disagrees with (1 − padding_fraction {cfg.padding_fraction}) × seq_len "
                                               f"{cfg.seq_len} = {fmt(from_pf)} valid")
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
    out["total_tokens"] = _int_if_whole(cfg.total_tokens)
    out["optimizer_steps"] = None
    if cfg.total_tokens is not None:
        if not tokens_per_step:
            raise SettingError("total_tokens", Raw(fmt(cfg.total_tokens)), "seq_len (tokens per sequence) as well",
                               why="it needs seq_len", see={"seq_len": "seq_len"})
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
    out["warmup_tokens_covered"] = None
    out["warmup_given_in"] = "tokens" if cfg.warmup_tokens is not None else ("steps" if cfg.warmup_steps is not None else None)
    if cfg.warmup_tokens is not None:
        if not tokens_per_step:
            raise SettingError("warmup_tokens", Raw(fmt(cfg.warmup_tokens)), "seq_len (tokens per sequence) as well",
                               why="it needs seq_len to become steps", see={"seq_len": "seq_len"})
        out["warmup_tokens"] = _int_if_whole(cfg.warmup_tokens)
        out["warmup_steps"] = P.warmup_tokens_to_steps(cfg.warmup_tokens, tokens_per_step)
    elif cfg.warmup_steps is not None and tokens_per_step:
        out["warmup_tokens"] = _int_if_whole(P.warmup_steps_to_tokens(cfg.warmup_steps, tokens_per_step))
    if out["warmup_steps"] is not None and tokens_per_step:
        out["warmup_tokens_covered"] = _int_if_whole(out["warmup_steps"] * tokens_per_step)
    if out["warmup_steps"] is not None and out["optimizer_steps"] is not None and out["warmup_steps"] > out["optimizer_steps"]:
        warnings.append(
            f"warmup {fmt(out['warmup_steps'])} steps is longer than the whole run ({fmt(out['optimizer_steps'])} steps)"
        )

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
        if cfg.virtual_stages > 1 and geo.grad_accum_steps % cfg.pp_stages:
            warnings.append(
                f"interleaved schedule: {geo.grad_accum_steps} micro-batches per step is not a multiple of "
                f"{cfg.pp_stages} pipeline stages (Megatron requires it)"
            )
        if cfg.max_bubble is not None:
            g_min = P.min_global_batch_for_bubble(
                cfg.max_bubble, pp_stages=cfg.pp_stages, micro_batch=geo.micro_batch,
                dp_world_size=geo.dp_world_size, virtual_stages=cfg.virtual_stages,
            )
            if cfg.virtual_stages > 1:  # interleaving needs m to be a multiple of p
                per_m = geo.micro_batch * geo.dp_world_size
                m = g_min // per_m
                m = -(-m // cfg.pp_stages) * cfg.pp_stages
                g_min = m * per_m
            out["min_global_batch_for_bubble"] = g_min
    elif cfg.max_bubble is not None:
        raise SettingError("max_bubble", cfg.max_bubble, "pp_stages as well", why="it needs pp_stages",
                           see={"pp_stages": "pp_stages"})

    # Communication
    out["allreduce_bytes_per_step"] = None
    out["grad_bytes"] = None
    if cfg.params is not None:
        # With pipeline parallelism each rank holds about params / pp_stages of the model.
        grad_bytes = cfg.params * cfg.grad_bytes_per_param / (cfg.pp_stages or 1)
        out["grad_bytes"] = grad_bytes
        out["allreduce_bytes_per_step"] = P.allreduce_bytes_per_rank(
            grad_bytes, geo.dp_world_size, grad_accum_steps=geo.grad_accum_steps, no_sync=cfg.no_sync
        )
    out["allreduce_syncs_per_step"] = 1 if cfg.no_sync else geo.grad_accum_steps
    if cfg.params is not None and out.get("global_batch_tokens") is not None:
        out["model_flops_per_step"] = P.dense_flops_per_token(cfg.params) * out["global_batch_tokens"]
        out["model_flops_formula"] = "6·N·tokens (formula, PaLM App. B; attention term not included)"

    # Priors
    priors = P.scaling_law_priors(
        params=cfg.params, tokens=cfg.total_tokens, compute_flops=cfg.compute_flops, loss_nats=cfg.loss_nats
    )
    out["priors"] = tuple(priors)
    out["warnings"] = tuple(_spelled(w, names) for w in warnings)
    out["dp_change"] = DpChange(**dp_change) if dp_change is not None else None
    return PlanReport(**out)


def _int_if_whole(x: Optional[float]) -> Any:
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _ranks(d: int) -> str:
    return f"{d} rank" if d == 1 else f"{d} ranks"


def _human_bytes(n: Any) -> str:
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
def plan_table(report: PlanReport):
    """A rich Table that shows the arithmetic of the plan."""
    from rich.table import Table

    t = Table(title="globalbatch plan", show_header=True, header_style="bold")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_column("arithmetic")
    g, m, a, d = report.global_batch_sequences, report.micro_batch, report.grad_accum_steps, report.dp_world_size
    t.add_row("global batch", f"{fmt(g)} seq", f"{_ranks(d)} × {a} accum × {m} seq")
    if report.dp_change is not None and report.dp_change.from_dp_world_size is None:
        c = report.dp_change
        t.add_row("rounded down", f"{fmt(c.dropped_samples_per_step)} seq/step dropped", f"global {fmt(c.requested_global_batch)} → {fmt(g)}")
    elif report.dp_change is not None:
        c = report.dp_change
        t.add_row(
            "world-size change", f"dp {c.from_dp_world_size} → {d}",
            f"grad_accum {c.from_grad_accum_steps} → {a}; global {fmt(c.requested_global_batch)} → {fmt(g)}",
        )
    if report.global_batch_tokens is not None:
        s = report.seq_len
        t.add_row("global batch tokens", f"{fmt(report.global_batch_tokens)} tok", f"{_ranks(d)} × {a} accum × {m} seq × {fmt(s)}")
        t.add_row("tokens per micro-batch per rank", f"{fmt(report.tokens_per_microbatch_per_dp_rank)} tok", f"{m} seq × {fmt(s)}")
    if report.global_batch_valid_tokens is not None:
        arith = f"{fmt(g)} seq × {fmt(report.valid_tokens_per_seq)} valid/seq"
        if report.padding_fraction is not None:
            arith += f" (padding {report.padding_fraction:.1%})"
        t.add_row("global batch valid tokens", f"{fmt(report.global_batch_valid_tokens)} tok", arith)
    if report.optimizer_steps is not None:
        per = report.global_batch_valid_tokens or report.global_batch_tokens
        t.add_row("optimizer steps", fmt(report.optimizer_steps), f"{fmt(report.total_tokens)} tok ÷ {fmt(per)} {report.tokens_per_step_counted} tok/step")
    if report.lr is not None:
        if report.lr_base_batch is not None:
            ratio = f"{fmt(g)}/{fmt(report.lr_base_batch)}"
            how = {"linear": f"× ({ratio})", "sqrt": f"× √({ratio})", "none": "unchanged"}[str(report.lr_rule)]
            t.add_row("lr", f"{report.lr:.4g}", f"{report.lr_base:.4g} {how} (rule {report.lr_rule})")
        else:
            t.add_row("lr", f"{report.lr:.4g}", "as given")
    if report.warmup_steps is not None:
        per = report.global_batch_valid_tokens or report.global_batch_tokens
        if report.warmup_given_in == "steps" and per:
            arith = f"given in steps: × {fmt(per)} tok/step = {fmt(report.warmup_tokens)} tok"
        elif report.warmup_tokens is not None and per:
            arith = f"{fmt(report.warmup_tokens)} tok ÷ {fmt(per)} tok/step, rounded up (covers {fmt(report.warmup_tokens_covered)} tok)"
        else:
            arith = "as given (no --seq-len: no token count)"
        t.add_row("warmup", f"{fmt(report.warmup_steps)} steps", arith)
    if report.pipeline_bubble_fraction is not None:
        p, v = report.pp_stages, report.virtual_stages
        t.add_row("pipeline bubble", f"{report.pipeline_bubble_fraction:.2%} of compute", f"({p}−1)/({v}·{a}); idle share {report.pipeline_idle_share:.2%}")
        if report.min_global_batch_for_bubble is not None and p is not None and v is not None:
            m_min = report.min_global_batch_for_bubble // (report.micro_batch * d)
            t.add_row("min global batch for bubble target", f"{fmt(report.min_global_batch_for_bubble)} seq",
                      f"{d} ranks × {m_min} accum × {report.micro_batch} seq: ({p}−1)/({v}·{m_min}) = "
                      f"{(p - 1) / (v * m_min):.2%}" + (f" (accum a multiple of {p}: interleaved)" if v > 1 else ""))
    if report.allreduce_bytes_per_step is not None:
        t.add_row(
            "all-reduce per rank per step", _human_bytes(report.allreduce_bytes_per_step),
            f"2({d}−1)/{d} × {_human_bytes(report.grad_bytes)} gradients"
            + (f" (params / {report.pp_stages} stages)" if report.pp_stages else "")
            + f" × {report.allreduce_syncs_per_step} sync{'s' if report.allreduce_syncs_per_step != 1 else ''}",
        )
    if report.model_flops_per_step is not None:
        t.add_row("model FLOPs per step", f"{report.model_flops_per_step:.3g}",
                  f"6·N × {fmt(report.global_batch_tokens)} token slots (formula, no attention)")
    for prior in report.priors:
        value = f"{_human_count(prior.batch_tokens)} tok"
        extra = f"; lr {prior.lr:.3g}" if prior.lr is not None else ""
        t.add_row(f"prior {prior.quantity} ({prior.source.split(',')[0]})", value, f"{prior.formula}{extra}")
    return t


def make_plan(
    path: Optional[str | Path], flags: dict, *, dp_world_size: Optional[int] = None, round_down: bool = False,
    names: Optional[dict[str, str]] = None,
) -> "PlanReport":
    """:func:`resolve_plan_config` then :func:`build_plan`; the resolution warnings come first (``names``:
    how the caller spells the settings they mention, e.g. the CLI's flags)."""
    cfg, notes = resolve_plan_config(path, flags, dp_world_size=dp_world_size, round_down=round_down, names=names)
    try:
        report = build_plan(cfg, names=names)
    except ValueError as exc:
        raise config_error(exc, {k: v for k, v in flags.items() if v is not None}, dp_world_size, path) from None
    return dataclasses.replace(report, warnings=tuple(notes) + report.warnings)
