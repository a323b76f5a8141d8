"""The search: GPU counts × geometries × constant batches and ramps, for time, cost or the Pareto front.

For every GPU count (1, 2, 4 … inside a node, then node multiples up to ``max_gpus``), every TP and PP
that divides it, every micro-batch the memory model allows and every per-replica batch (powers of two
sequences), the cluster model (:mod:`globalbatch.scale.cluster`) gives the step time; the convergence
model (:mod:`globalbatch.scale.convergence`, McCandlish et al. 2018 eq. 2.11) the steps to the target.
Time to target = steps × step time; GPU-hours = GPUs × time. At one GPU count the fastest batch is also
the cheapest; across counts ``objective`` picks the fastest (``time``), the cheapest (``cost``) or
reports the Pareto front of (time, GPU-hours) (``pareto``; its fastest point is the "best").

Ramps (McCandlish et al. 2018 App. D, ``B(s) = √(r·B_noise(s))``) are tried at the best GPU count: one
candidate per final batch, snapped to the count's feasible batches, at most ``max_stages`` stages; each
is costed exactly (steps of each stage × that stage's best step time).

Pure arithmetic; no torch.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from globalbatch._util import SettingError
from globalbatch.scale.cluster import (
    Cluster,
    ModelSpec,
    StepTime,
    ThroughputCurve,
    dp_bookkeeping_time,
    dp_comm_time,
    largest_micro,
    rank_param_tensors,
    step_overhead_time,
    step_times_grid,
)
from globalbatch.scale.convergence import ConvergenceModel
from globalbatch.validate import choice, number, positive, whole

__all__ = ["OBJECTIVES", "ScaleConfig", "Choice", "RampChoice", "ScaleResult", "scale", "gpu_counts",
           "format_count", "schedule_string"]

OBJECTIVES = ("time", "cost", "pareto")
LR_RULE_TEXT = {"sqrt": "LR × √(B/B₀) at each change (Adam-type)", "linear": "LR × B/B₀ at each change (SGD)",
                "none": "LR unchanged at each change"}


@dataclass(frozen=True, kw_only=True, slots=True)
class ScaleConfig:
    """What to search."""

    target_loss: float
    """Loss (nats) to reach."""
    max_gpus: int = 1024
    """Largest GPU count tried."""
    objective: str = "time"
    """time, cost or pareto."""
    deadline_s: Optional[float] = None
    """Only answers reaching the target within this many seconds."""
    budget_gpu_hours: Optional[float] = None
    """Only answers within this many GPU-hours."""
    tp_options: tuple[int, ...] = (1,)
    """Tensor-parallel degrees tried (each ≤ GPUs per node). TP's own communication is not modelled (it is inside
    the MFU curve), so give the degrees the MFU curve was measured at."""
    pp_options: tuple[int, ...] = (1,)
    """Pipeline-parallel degrees tried (each ≤ the model's layers when known); p2p sends are not modelled."""
    overlap: float = 1.0
    """Share of the last backward the gradient communication can hide behind (0…1)."""
    max_stages: int = 3
    """Most stages of a ramp."""
    lr_rule: str = "sqrt"
    """How the LR follows the batch at a ramp's changes: sqrt (Adam-type), linear (SGD), none."""
    max_global_batch: int = 1 << 24
    """Largest global batch tried, in sequences."""
    min_global_batch: int = 1
    """Smallest global batch tried, in sequences."""

    def __post_init__(self) -> None:
        whole(self.max_gpus, "max_gpus", maximum=10**7, allowed="a whole number from 1 to 10,000,000")
        choice(self.objective, "objective", OBJECTIVES)
        for name in ("deadline_s", "budget_gpu_hours"):
            if getattr(self, name) is not None:
                positive(getattr(self, name), name, allowed="a number > 0")
        number(self.overlap, "overlap", low=0.0, high=1.0, allowed="a share from 0 to 1")
        whole(self.max_stages, "max_stages", maximum=8, allowed="a whole number from 1 to 8")
        choice(self.lr_rule, "lr_rule", LR_RULE_TEXT)
        for name in ("tp_options", "pp_options"):
            if not getattr(self, name):
                raise SettingError(name, getattr(self, name), "whole numbers ≥ 1, at least one")
            for x in getattr(self, name):
                whole(x, name, allowed="whole numbers ≥ 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """The best constant batch at one GPU count."""

    gpus: int
    step: StepTime
    batch_tokens: float
    steps: float
    steps_interval: tuple[float, float]
    tokens: float
    time_s: float
    gpu_hours: float
    efficiency: float
    """Statistical efficiency E_min/E = 1/(1 + B/B_crit)."""
    meets_limits: bool = True
    pareto: bool = False

    def to_dict(self) -> dict:
        return {"gpus": self.gpus, "global_batch": self.step.global_batch, "global_batch_tokens": self.batch_tokens,
                "geometry": self.step.to_dict(), "steps": self.steps, "steps_interval": list(self.steps_interval),
                "tokens": self.tokens, "step_s": self.step.total_s, "compute_s": self.step.compute_s,
                "comm_exposed_s": self.step.comm_exposed_s, "bubble_s": self.step.bubble_s, "mfu": self.step.mfu(),
                "time_s": self.time_s, "gpu_hours": self.gpu_hours, "statistical_efficiency": self.efficiency,
                "meets_limits": self.meets_limits, "pareto": self.pareto}


@dataclass(frozen=True, kw_only=True, slots=True)
class RampChoice:
    """The best ramp at one GPU count, as a batch schedule StepDriver and ``plan`` accept."""

    gpus: int
    schedule: str
    """``"0:B0 T1:B1 …"``: thresholds in consumed loss-bearing tokens, batches in sequences."""
    stages: tuple[tuple[int, int, float], ...]
    """(threshold tokens, batch sequences, batch tokens) per stage."""
    stage_steps: tuple[float, ...]
    stage_step_s: tuple[float, ...]
    steps: float
    tokens: float
    time_s: float
    gpu_hours: float
    lr_rule: str
    lr_text: str
    constant_time_s: float
    """The best constant batch's time at the same GPU count."""
    constant_gpu_hours: float

    def to_dict(self) -> dict:
        return {"gpus": self.gpus, "schedule": self.schedule,
                "stages": [{"threshold_tokens": t, "global_batch": b, "global_batch_tokens": bt}
                           for t, b, bt in self.stages],
                "stage_steps": list(self.stage_steps), "stage_step_s": list(self.stage_step_s), "steps": self.steps,
                "tokens": self.tokens, "time_s": self.time_s, "gpu_hours": self.gpu_hours, "lr_rule": self.lr_rule,
                "lr_text": self.lr_text, "constant_time_s": self.constant_time_s,
                "constant_gpu_hours": self.constant_gpu_hours,
                "time_ratio_vs_constant": self.time_s / self.constant_time_s if self.constant_time_s else None}


@dataclass(frozen=True, kw_only=True, slots=True)
class ScaleResult:
    """Everything ``scale`` found."""

    target_loss: float
    extrapolated: bool
    b_crit_tokens: float
    b_crit_interval: tuple[float, float]
    s_min: float
    rows: tuple[Choice, ...]
    """One per GPU count at which some geometry fits, ascending."""
    best: Optional[Choice]
    """The objective's answer among rows within the limits (None: none is)."""
    best_ramp: Optional[RampChoice]
    objective: str
    convergence: ConvergenceModel
    cluster: Cluster
    model: ModelSpec
    throughput_source: str
    notes: tuple[str, ...]
    search_seconds: float
    evaluated_geometries: int

    def _priced(self, row: dict) -> dict:
        """``cost``: GPU-hours × the cluster's ``gpu_hour_price`` (None without a price)."""
        price = self.cluster.gpu_hour_price
        row["cost"] = None if price is None else row["gpu_hours"] * price
        return row

    def to_dict(self) -> dict:
        c = self.cluster
        return {
            "target_loss": self.target_loss, "extrapolated": self.extrapolated, "b_crit_tokens": self.b_crit_tokens,
            "b_crit_interval": list(self.b_crit_interval), "s_min": self.s_min, "objective": self.objective,
            "rows": [self._priced(r.to_dict()) for r in self.rows],
            "best": None if self.best is None else self._priced(self.best.to_dict()),
            "best_ramp": None if self.best_ramp is None else self.best_ramp.to_dict(),
            "pareto_gpus": [r.gpus for r in self.rows if r.pareto],
            "convergence": self.convergence.to_dict(),
            "cluster": {"name": c.name, "gpus_per_node": c.gpus_per_node, "peak_flops_per_s": c.peak_flops_per_s,
                        "memory_bytes": c.memory_bytes, "intra_busbw_bytes_per_s": c.intra_busbw_bytes_per_s,
                        "inter_busbw_bytes_per_s": c.inter_busbw_bytes_per_s, "base_latency_s": c.base_latency_s,
                        "dp_step_overhead_s": c.dp_step_overhead_s, "dp_micro_overhead_s": c.dp_micro_overhead_s,
                        "dp_tensor_overhead_s": c.dp_tensor_overhead_s,
                        "dp_call_overhead_s": c.dp_call_overhead_s,
                        "gpu_hour_price": c.gpu_hour_price, "source": c.source},
            "model": {"params": self.model.params, "seq_len": self.model.seq_len,
                      "tokens_per_sequence": self.model.tokens_per_seq,
                      "flops_per_token": self.model.train_flops_per_token, "sharding": self.model.sharding},
            "throughput_source": self.throughput_source, "notes": list(self.notes),
            "search_seconds": self.search_seconds, "evaluated_geometries": self.evaluated_geometries,
        }


def gpu_counts(max_gpus: int, gpus_per_node: int) -> list[int]:
    """1, 2, 4 … below a node, then every node count up to 16 nodes and ≈ 2^(1/4) steps beyond, and max_gpus's
    whole nodes."""
    out = set()
    g = 1
    while g < gpus_per_node and g <= max_gpus:
        out.add(g)
        g *= 2
    max_nodes = max_gpus // gpus_per_node
    n = 1
    while n <= max_nodes:
        out.add(n * gpus_per_node)
        n = n + 1 if n < 16 else max(n + 1, int(round(n * 2 ** 0.25)))
    if max_nodes >= 1:
        out.add(max_nodes * gpus_per_node)
    if max_gpus < gpus_per_node:
        out.add(max_gpus)
    return sorted(x for x in out if x <= max_gpus)


def format_count(n: int) -> str:
    """A whole number as the shortest exact ``K/M/B/T`` form ``parse_count`` reads back (``1200000`` → ``1.2M``)."""
    n = int(n)
    for exp, suf in ((12, "T"), (9, "B"), (6, "M"), (3, "K")):
        if n >= 10 ** exp:
            text = f"{n / 10 ** exp:.6f}".rstrip("0").rstrip(".")
            if round(float(text) * 10 ** exp) == n:
                return text + suf
    return str(n)


def schedule_string(stages: list[tuple[int, int]]) -> str:
    """``[(threshold_tokens, batch_sequences)]`` → ``"0:8 150K:16"``."""
    return " ".join(f"{format_count(t)}:{b}" for t, b in stages)


def _nothing_fits(model: ModelSpec, cluster: Cluster, cfg: ScaleConfig, counts: Sequence[int]) -> SettingError:
    """Why no GPU count has a row, naming what to change: the parameters (the static bytes fit no geometry), the
    activations (the static bytes fit, micro-batch 1's activations do not) or the batch bounds."""
    geometries = [(g // (tp * pp), tp, pp) for g in counts for tp, pp in _degrees(model, cluster, cfg, g)]
    if not geometries:
        least = min(tp * pp for tp in cfg.tp_options for pp in cfg.pp_options)
        return SettingError("max_gpus", cfg.max_gpus, f"at least {least:,} GPUs (the smallest TP × PP), in counts "
                                                      "they divide", why="no GPU count takes any TP × PP given")
    static = dataclasses.replace(model, activation_bytes_per_token=None)
    if not any(largest_micro(static, cluster, dp=dp, tp=tp, pp=pp) for dp, tp, pp in geometries):
        return SettingError("params", model.params, f"a model that fits in memory on some geometry of up to "
                                                    f"{cfg.max_gpus:,} GPUs",
                            why=f"static bytes exceed {cluster.memory_bytes:.3g} per GPU for every TP × PP × sharding tried")
    act = model.activation_bytes_per_token
    if act is not None and not any(largest_micro(model, cluster, dp=dp, tp=tp, pp=pp) for dp, tp, pp in geometries):
        tp_max = max(tp for _, tp, _ in geometries)
        return SettingError("activation_bytes_per_token", act,
                            f"activations that let one sequence of {model.seq_len:,} tokens fit beside the static bytes "
                            f"on some geometry of up to {cfg.max_gpus:,} GPUs",
                            why=f"micro-batch 1 needs {act * model.seq_len / tp_max:.3g} "
                                f"bytes at TP {tp_max} against {cluster.memory_bytes:.3g} per GPU")
    return SettingError("min_global_batch", cfg.min_global_batch,
                        f"a global batch between the smallest a geometry can take and {cfg.max_global_batch:,} "
                        "sequences", why="no geometry that fits memory has a global batch in those bounds")


def _degrees(model: ModelSpec, cluster: Cluster, cfg: ScaleConfig, gpus: int) -> list[tuple[int, int]]:
    """The (TP, PP) degrees that ``gpus`` GPUs can take: TP within a node, TP × PP dividing the count, PP at most
    the model's layers."""
    return [(tp, pp) for tp in cfg.tp_options if tp <= cluster.gpus_per_node and gpus % tp == 0
            for pp in cfg.pp_options if gpus % (tp * pp) == 0 and (model.layers is None or pp <= model.layers)]


def _best_by_batch(model: ModelSpec, cluster: Cluster, curve: ThroughputCurve, cfg: ScaleConfig, gpus: int,
                   peak: Optional[float]) -> tuple[dict[int, StepTime], int]:
    """Global batch (sequences) → the fastest geometry's step at ``gpus`` GPUs."""
    best: dict[int, StepTime] = {}
    evaluated = 0
    for tp, pp in _degrees(model, cluster, cfg, gpus):
        dp = gpus // (tp * pp)
        m_max = largest_micro(model, cluster, dp=dp, tp=tp, pp=pp)
        if m_max < 1:
            continue
        comm = dp_comm_time(model, cluster, dp=dp, tp=tp, pp=pp)
        r_max = cfg.max_global_batch // dp
        if r_max < 1:
            continue
        j = np.arange(0, int(math.log2(r_max)) + 1)
        i = np.arange(0, int(math.log2(min(m_max, r_max))) + 1)
        jj, ii = np.meshgrid(j, i, indexing="ij")
        ok = ii <= jj
        per_rep = (2.0 ** jj[ok])
        micro = (2.0 ** ii[ok])
        accum = per_rep / micro
        compute, bubble, exposed, mfu_k = step_times_grid(model, cluster, curve, dp=dp, tp=tp, pp=pp, micro=micro,
                                                          accum=accum, overlap=cfg.overlap, comm=comm,
                                                          peak_flops_per_s=peak)
        overhead = (step_overhead_time(model, cluster, curve, dp=dp, tp=tp, pp=pp)
                    + dp_bookkeeping_time(cluster, dp=dp, grad_accum_steps=accum,
                                          param_tensors=rank_param_tensors(model, pp)))
        total = compute + bubble + exposed + overhead
        evaluated += total.size
        for r in np.unique(per_rep):
            sel = np.flatnonzero(per_rep == r)
            k = sel[np.argmin(total[sel])]
            gb = int(r) * dp
            if gb < cfg.min_global_batch:
                continue
            if gb not in best or total[k] < best[gb].total_s:
                best[gb] = StepTime(gpus=gpus, global_batch=gb, micro_batch=int(micro[k]),
                                    grad_accum_steps=int(accum[k]), dp=dp, tp=tp, pp=pp,
                                    compute_s=float(compute[k]), comm_exposed_s=float(exposed[k]),
                                    bubble_s=float(bubble[k]), comm_total_s=comm[0], comm_how=comm[1],
                                    mfu_kernel=float(mfu_k[k]), overhead_s=float(overhead[k]))
    return best, evaluated


def scale(conv: ConvergenceModel, model: ModelSpec, cluster: Cluster, curve: ThroughputCurve, cfg: ScaleConfig, *,
          peak_flops_per_s: Optional[float] = None, gpu_count_list: Optional[list[int]] = None) -> ScaleResult:
    """The search. ``peak_flops_per_s`` overrides the cluster's peak (a probe's measured peak, say)."""
    t0 = time.process_time()
    loss = conv.check_target(cfg.target_loss)
    conv.check_path(loss)
    tps = model.tokens_per_seq
    bc = conv.b_crit(loss)
    counts = gpu_count_list if gpu_count_list is not None else gpu_counts(cfg.max_gpus, cluster.gpus_per_node)
    rows: list[Choice] = []
    tables: dict[int, dict[int, StepTime]] = {}
    evaluated = 0
    for g in counts:
        table, n = _best_by_batch(model, cluster, curve, cfg, g, peak_flops_per_s)
        evaluated += n
        if not table:
            continue
        tables[g] = table
        gbs = np.array(sorted(table), dtype=float)
        bt = gbs * tps
        steps = conv.s_min(loss) * (1 + bc / bt)
        t_step = np.array([table[int(b)].total_s for b in gbs])
        times = steps * t_step
        k = int(np.argmin(times))
        st = table[int(gbs[k])]
        t = float(times[k])
        rows.append(Choice(gpus=g, step=st, batch_tokens=float(bt[k]), steps=float(steps[k]),
                           steps_interval=conv.steps_interval(float(bt[k]), loss), tokens=float(steps[k] * bt[k]),
                           time_s=t, gpu_hours=g * t / 3600.0, efficiency=conv.efficiency(float(bt[k]), loss)))
    if not rows:
        raise _nothing_fits(model, cluster, cfg, counts)
    rows = _mark(rows, cfg)
    best = _pick(rows, cfg.objective)
    notes = []
    if conv.extrapolated(loss):
        if conv.loss_range is not None:
            notes.append(f"target {loss:g} is outside the fitted losses {conv.loss_range[0]:.4g}–{conv.loss_range[1]:.4g}:"
                         " extrapolated; the intervals widen with the fit's standard errors")
        elif conv.kind == "prior":
            notes.append(f"target {loss:g} comes from a prior ({conv.source}) with no stated uncertainty: "
                         f"every number is an extrapolation ({conv.conditions})")
        else:
            notes.append(f"the fit was moved to another model size ({conv.source}): every number is an "
                         "extrapolation under Kaplan's transfer assumptions")
    if best is None:
        notes.append("no GPU count meets the deadline / GPU-hour budget")
    ramp = None
    if best is not None:
        ramp = _best_ramp(conv, model, tables[best.gpus], best, cfg, loss)
    return ScaleResult(target_loss=loss, extrapolated=conv.extrapolated(loss), b_crit_tokens=bc,
                       b_crit_interval=conv.b_crit_law.interval(loss), s_min=conv.s_min(loss), rows=tuple(rows),
                       best=best, best_ramp=ramp, objective=cfg.objective, convergence=conv, cluster=cluster,
                       model=model, throughput_source=curve.source, notes=tuple(notes),
                       search_seconds=time.process_time() - t0, evaluated_geometries=evaluated)


def _mark(rows: list[Choice], cfg: ScaleConfig) -> list[Choice]:
    from dataclasses import replace

    out = []
    front = _pareto([(r.time_s, r.gpu_hours) for r in rows])
    for r, on in zip(rows, front):
        ok = (cfg.deadline_s is None or r.time_s <= cfg.deadline_s) and \
             (cfg.budget_gpu_hours is None or r.gpu_hours <= cfg.budget_gpu_hours)
        out.append(replace(r, meets_limits=ok, pareto=on))
    return out


def _pareto(points: list[tuple[float, float]]) -> list[bool]:
    """True for points no other point beats in both coordinates (ties kept)."""
    out = []
    for i, (t, c) in enumerate(points):
        dominated = any((t2 <= t and c2 <= c) and (t2 < t or c2 < c) for j, (t2, c2) in enumerate(points) if j != i)
        out.append(not dominated)
    return out


def _pick(rows: list[Choice], objective: str) -> Optional[Choice]:
    ok = [r for r in rows if r.meets_limits]
    if not ok:
        return None
    if objective == "cost":
        return min(ok, key=lambda r: (r.gpu_hours, r.time_s))
    if objective == "pareto":
        front = [r for r in ok if r.pareto] or ok
        return min(front, key=lambda r: (r.time_s, r.gpu_hours))
    return min(ok, key=lambda r: (r.time_s, r.gpu_hours))


def _best_ramp(conv: ConvergenceModel, model: ModelSpec, table: dict[int, StepTime], const: Choice, cfg: ScaleConfig,
               loss: float) -> Optional[RampChoice]:
    tps = model.tokens_per_seq
    gbs = sorted(table)
    feas_tok = [b * tps for b in gbs]
    by_tok = {b * tps: b for b in gbs}
    best: Optional[RampChoice] = None
    for b_f in gbs:
        if b_f * tps < const.batch_tokens / 4:  # ramps ending far below the best constant batch never win
            continue
        stages = conv.ramp_stages(b_f * tps, feas_tok, loss, max_stages=cfg.max_stages)
        if len(stages) < 2:
            continue
        stage_seq = [(int(t), by_tok.get(b) or int(round(b / tps))) for t, b in stages]
        cost = conv.schedule_cost([(t, b) for t, b in stages], loss)
        step_s = [table[b].total_s for _, b in stage_seq]
        t = sum(s * ts for s, ts in zip(cost.stage_steps, step_s))
        cand = RampChoice(gpus=const.gpus, schedule=schedule_string(stage_seq),
                          stages=tuple((t_, b, b * tps) for t_, b in stage_seq), stage_steps=cost.stage_steps,
                          stage_step_s=tuple(step_s), steps=cost.steps, tokens=cost.tokens, time_s=t,
                          gpu_hours=const.gpus * t / 3600.0, lr_rule=cfg.lr_rule, lr_text=LR_RULE_TEXT[cfg.lr_rule],
                          constant_time_s=const.time_s, constant_gpu_hours=const.gpu_hours)
        if best is None or cand.time_s < best.time_s:
            best = cand
    return best
