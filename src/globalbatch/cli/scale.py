"""``globalbatch scale``: the batch (or ramp), geometry and GPU count that reach a target loss fastest or cheapest."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Literal, Optional, cast

import typer

from globalbatch.cli.app import app, echo_json, flag_names_of

ScaleObjective = Literal["time", "cost", "pareto"]
ScaleLrRule = Literal["sqrt", "linear", "none"]
ScaleSharding = Literal["none", "zero1", "zero2", "zero3", "fsdp"]
Prior = Literal["kaplan"]

_EXTRA_FIELDS = {"deadline_s": "--deadline", "budget_gpu_hours": "--budget-gpu-hours", "target_loss": "--target-loss",
                 "tp_options": "--tp", "pp_options": "--pp", "max_stages": "--max-stages", "seq_len": "--seq-len",
                 "tokens_per_sequence": "--tokens-per-seq", "flops_per_token": "--flops-per-token",
                 "activation_bytes_per_token": "--activation-bytes-per-token", "virtual_stages": "--virtual-stages",
                 "run_dir": "RUN_DIR", "min_global_batch": "--min-batch"}

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([smhd]?)\s*$")


def _duration_s(text: str, field: str) -> float:
    from .._util import SettingError

    m = _DURATION.match(text or "")
    value = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)] if m else math.nan
    if not (math.isfinite(value) and value > 0):
        raise SettingError(field, text, "a duration > 0 in s, m, h or d, e.g. 36h or 3d")
    return value


def _int_list(text: str, field: str) -> tuple[int, ...]:
    from .. import validate as V

    return tuple(V.count_list(text, field, maximum=4096))


def _fmt_s(s: float) -> str:
    if s < 1:
        return f"{s * 1e3:,.1f} ms"
    if s < 120:
        return f"{s:,.2f} s"
    if s < 7200:
        return f"{s / 60:,.1f} min"
    if s < 3 * 86400:
        return f"{s / 3600:,.1f} h"
    return f"{s / 86400:,.1f} d"


def _fmt_h(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _fmt_n(x: float) -> str:
    for div, suf in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:,.3g}{suf}"
    return f"{x:,.3g}"


def convergence_from_sweep(run_dir: str):
    """A fitted :class:`~globalbatch.scale.ConvergenceModel` from a sweep directory with seeds (the joint B_crit(L)
    fit of ``globalbatch.critical``), and facts of the sweep (``seq_len``, tokens per sequence, primary target)."""
    from .._util import SettingError
    from ..lab.sweep.store import analyze_sweep_seeds
    from ..scale import BCritLaw
    from ..scale.convergence import from_points

    data, a = analyze_sweep_seeds(run_dir)
    j = a.joint
    if j is None:
        raise SettingError("run_dir", run_dir, "a sweep whose joint B_crit(L) fit succeeded",
                           why=getattr(a, "joint_error", "") or "no joint fit")
    law = BCritLaw(b_ref_tokens=float(j.b_ref), loss_ref=float(j.loss_ref), k=float(j.k),
                   cov=cast(Any, tuple(tuple(float(v) for v in row) for row in j.cov)), dof=int(j.dof),
                   boot=tuple(zip(j.boot_log_b_ref, j.boot_k)))
    pts = [(st.target, s, b, st.steps[b][s]) for st in a.targets for s in a.seeds if st.monotone[s]
           for b in st.steps if st.steps[b][s] is not None]
    try:
        conv = from_points(pts, law, source=f"sweep {run_dir} (joint fit over {len(a.seeds)} seeds, "
                                            f"{len(a.targets)} targets)",
                           conditions=f"task {data.config.task} {data.config.task_overrides}, "
                                      f"{data.config.optimizer}, held-out loss")
    except SettingError as exc:  # a law that does not rise as the loss falls; fit_s_min: fewer than 2 usable targets
        if exc.field == "b_crit_law":
            raise SettingError("run_dir", run_dir, "a sweep whose B_crit rises as the loss falls, or --prior",
                               why=f"its joint fit B_crit(L) ∝ L^k has {exc.value}: B_crit does not rise as the loss "
                                   "falls, so the model has no noise scale to integrate") from None
        raise SettingError("run_dir", run_dir, "a sweep with S_min at ≥ 2 targets", why=str(exc)) from None
    units = data.batch_units()
    per_seq = [u / b for b, u in units.items() if b > 0]
    seq_len = int(data.config.task_overrides.get("seq_len", 0)) or None
    # a joint fit the sweep's own medians reject (its report shows it only as a comparison); a flat or falling
    # exponent is not one: the law's SE widens every interval here, and a falling one is refused by the search
    lack_of_fit = [f for f in a.joint_flags if f.startswith("lack of fit")]
    return conv, {"joint_lack_of_fit": lack_of_fit, "seq_len": seq_len, "tokens_per_sequence": float(sum(per_seq) / len(per_seq)) if per_seq else None,
                  "primary_target": float(min(st.target for st in a.targets)), "task": data.config.task,
                  "layers": data.config.task_overrides.get("n_layer"), "min_batch": int(min(units)),
                  "task_overrides": dict(data.config.task_overrides)}


def _task_params(task: str, overrides: dict) -> float:
    from ..lab.tasks import load_task

    model = load_task(task, **overrides).build_model(0)
    return float(sum(p.numel() for p in model.parameters()))


@app.command("scale", short_help="The batch or ramp, geometry and GPU count that reach a target loss fastest or cheapest.")
def scale_cmd(
    run_dir: Optional[str] = typer.Argument(None, help="A sweep directory with seeds (its B_crit(L) and S_min(L) fit); or give --prior."),
    prior: Optional[Prior] = typer.Option(None, "--prior", help="A published law instead of a sweep: kaplan (Kaplan et al. 2020; needs --params)."),
    target_loss: Optional[float] = typer.Option(None, "--target-loss", help="Loss (nats) to reach; default the sweep's lowest common target."),
    cluster: str = typer.Option("h100-ib", "--cluster", help="A preset (h100-ib, a100-ib, h200-ib) or FILE.yaml."),
    max_gpus: int = typer.Option(1024, "--max-gpus", help="Largest GPU count tried (1, 2, 4 … then node multiples)."),
    objective: ScaleObjective = typer.Option("time", "--objective", help="time (fastest), cost (fewest GPU-hours) or pareto."),
    deadline: Optional[str] = typer.Option(None, "--deadline", help="Only answers within this wall-clock time, e.g. 36h, 3d."),
    budget_gpu_hours: Optional[float] = typer.Option(None, "--budget-gpu-hours", help="Only answers within this many GPU-hours."),
    throughput: Optional[str] = typer.Option(None, "--throughput", help="A `globalbatch probe --json` output: its MFU per micro-batch (default: a labelled curve)."),
    params: Optional[str] = typer.Option(None, "--params", help="Parameters of the model to train, e.g. 7B (default: the sweep's model)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sequence (default: the sweep's, else 4096)."),
    tokens_per_seq: Optional[float] = typer.Option(None, "--tokens-per-seq", help="Loss-bearing tokens per sequence (default: the sweep's mean, else --seq-len)."),
    flops_per_token: Optional[float] = typer.Option(None, "--flops-per-token", help="Training FLOPs per token (default 6N)."),
    sharding: ScaleSharding = typer.Option("none", "--sharding", help="none (DDP all-reduce), zero1, zero2, zero3 or fsdp."),
    activation_bytes_per_token: Optional[float] = typer.Option(None, "--activation-bytes-per-token", help="Activation bytes per token of the whole model at TP 1 (bounds the micro-batch; default: static memory only)."),
    tp: str = typer.Option("1", "--tp", help="Tensor-parallel degrees tried, e.g. 8 or 1,2,4,8 (each ≤ GPUs per node; TP's communication is inside the MFU curve)."),
    pp: str = typer.Option("1", "--pp", help="Pipeline-parallel degrees tried, e.g. 1,2,4,8,16 (each ≤ --layers)."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Transformer layers (bounds PP; default: the sweep's n_layer)."),
    min_batch: Optional[int] = typer.Option(None, "--min-batch", help="Smallest global batch tried, in sequences (default: the sweep's smallest batch, else 1)."),
    virtual_stages: int = typer.Option(1, "--virtual-stages", help="Interleaved chunks per pipeline stage."),
    overlap: float = typer.Option(1.0, "--overlap", help="Share of the last backward the gradient communication hides behind (0–1)."),
    max_stages: int = typer.Option(3, "--max-stages", help="Most stages of the proposed ramp."),
    lr_rule: ScaleLrRule = typer.Option("sqrt", "--lr-rule", help="LR at each ramp change: sqrt (Adam-type), linear (SGD), none."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Write the time-vs-GPU-hours Pareto plot to this PNG."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON with stable snake_case keys."),
) -> None:
    """From a sweep (or a prior) and a cluster model: per GPU count the best batch and geometry, steps, time and
    GPU-hours to the target loss; the best ramp as a batch schedule; the time-vs-GPU-hours Pareto front."""
    from pathlib import Path

    from .. import validate as V
    from .._util import SettingError, flag_names
    from ..scale import (ModelSpec, ScaleConfig, default_mfu_curve, kaplan_prior, load_cluster, mfu_curve_from_probe,
                         scale)

    names = {**flag_names_of("scale"), **_EXTRA_FIELDS}
    with flag_names(names):
        # Everything is checked before anything is printed or written.
        if (run_dir is None) == (prior is None):
            raise SettingError("run_dir", run_dir, "a sweep directory or --prior kaplan (exactly one)")
        V.whole(max_gpus, "max_gpus", maximum=10**7)
        tp_opts, pp_opts = _int_list(tp, "tp_options"), _int_list(pp, "pp_options")
        deadline_s = _duration_s(deadline, "deadline_s") if deadline is not None else None
        if budget_gpu_hours is not None:
            V.positive(budget_gpu_hours, "budget_gpu_hours")
        V.fraction(overlap, "overlap", high_open=False)
        if plot is not None:
            V.out_dir(str(Path(plot).parent) if Path(plot).parent != Path("") else ".", "plot")
            if not plot.endswith(".png"):
                raise SettingError("plot", plot, "a FILE.png path")
        try:
            clus = load_cluster(cluster)
        except SettingError as exc:
            if exc.field == "cluster":
                raise
            raise SettingError(f"--cluster {cluster}: {exc.field}", exc.value, exc.allowed, why=exc.why) from None
        curve = mfu_curve_from_probe(throughput) if throughput is not None else default_mfu_curve()
        n_params = float(V.count(params, "params")) if params is not None else None
        facts: dict = {}
        if run_dir is not None:
            V.existing_dir(run_dir, "run_dir")
            conv, facts = convergence_from_sweep(run_dir)
            swept = _task_params(facts["task"], facts["task_overrides"])
            if n_params is None:
                n_params = swept
            conv = conv.for_params(n_params, swept)
        else:
            if n_params is None:
                raise SettingError("params", None, "a parameter count with --prior kaplan, e.g. 7B")
            conv = kaplan_prior(params=n_params)
        target = target_loss if target_loss is not None else facts.get("primary_target")
        if target is None:
            raise SettingError("target_loss", None, "a loss in nats with --prior")
        sl = seq_len if seq_len is not None else (facts.get("seq_len") or 4096)
        if tokens_per_seq is not None and tokens_per_seq > sl:  # never clamped silently
            raise SettingError("tokens_per_sequence", tokens_per_seq, f"at most --seq-len {sl} (loss-bearing tokens of a "
                               "sequence)")
        tps = tokens_per_seq if tokens_per_seq is not None else (facts.get("tokens_per_sequence") if seq_len is None else None)
        model = ModelSpec(params=n_params, seq_len=sl, tokens_per_sequence=min(tps, sl) if tps else None,
                          flops_per_token=flops_per_token, sharding=sharding,
                          activation_bytes_per_token=activation_bytes_per_token, virtual_stages=virtual_stages,
                          layers=layers if layers is not None else facts.get("layers"))
        # degrees the search would skip, every one of them: said here, not as "the model fits no geometry"
        for flag, opts, top, why in (("tp_options", tp_opts, clus.gpus_per_node,
                                      f"{clus.name} has {clus.gpus_per_node} GPUs per node: TP stays inside a node"),
                                     ("pp_options", pp_opts, model.layers, f"the model has {model.layers} layers")):
            over = [o for o in opts if top is not None and o > top]
            if over:
                raise SettingError(flag, over, f"degrees ≤ {top}", why=why)
        cfg = ScaleConfig(target_loss=float(target), max_gpus=max_gpus, objective=objective, deadline_s=deadline_s,
                          budget_gpu_hours=budget_gpu_hours, tp_options=tp_opts, pp_options=pp_opts, overlap=overlap,
                          max_stages=max_stages, lr_rule=lr_rule,
                          min_global_batch=min_batch if min_batch is not None else facts.get("min_batch", 1))
        try:
            result = scale(conv, model, clus, curve, cfg)
        except SettingError as exc:  # the sweep's fitted law, not a flag: the line names the sweep
            if exc.field != "b_crit_law" or run_dir is None:
                raise
            raise SettingError("run_dir", run_dir, f"{exc.allowed} (a sweep whose B_crit rises as the loss falls, "
                               "or --prior)", why=f"its joint fit B_crit(L) ∝ L^k has {exc.value}: {exc.why}") from None
    if facts.get("joint_lack_of_fit"):  # the sweep's own medians reject the law every number below extrapolates
        result = dataclasses.replace(result, notes=(
            f"the sweep's joint fit B_crit(L) is flagged ({'; '.join(facts['joint_lack_of_fit'])}): its report shows "
            "it only as a comparison, and every number here extrapolates it",) + result.notes)
    if plot is not None:
        pareto_plot(result, plot)
    if as_json:
        out = result.to_dict()
        out["plot"] = plot
        echo_json(out)
        return
    _print(result, plot)


def pareto_plot(result, path: str) -> None:
    """Time to target against GPU-hours, one point per GPU count, the Pareto front joined (matplotlib, lazily)."""
    from ..lab.scale_section import pareto_figure

    pareto_figure(result.to_dict(), path)


def _print(result, plot: Optional[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(Console().width, 180))
    conv = result.convergence
    lo, hi = result.b_crit_interval
    con.print(f"convergence: {conv.kind} — {conv.source}")
    con.print(f"target loss {result.target_loss:g}: B_crit {result.b_crit_tokens:,.0f} tokens [{lo:,.0f}–{hi:,.0f}], "
              f"S_min {result.s_min:,.0f} steps"
              + (" — EXTRAPOLATED outside the fitted losses" if result.extrapolated else ""))
    con.print(f"cluster: {result.cluster.name} ({result.cluster.gpus_per_node} GPUs/node); MFU curve: {result.throughput_source}")
    t = Table(title=f"best constant batch per GPU count (objective: {result.objective})")
    for col in ("GPUs", "batch (tokens)", "geometry", "steps", "tokens", "step: compute / comm / bubble / overhead", "MFU",
                "time", "GPU-h", "stat. eff.", ""):
        t.add_column(col, justify="left" if col in ("geometry", "") else "right")
    for r in result.rows:
        st = r.step
        marks = [m for m, on in (("best", result.best is r), ("pareto", r.pareto), ("over limits", not r.meets_limits)) if on]
        t.add_row(f"{r.gpus:,}", _fmt_n(r.batch_tokens), f"{st.micro_batch}×{st.grad_accum_steps}×DP{st.dp} TP{st.tp} PP{st.pp}",
                  f"{r.steps:,.0f}", _fmt_n(r.tokens),
                  f"{_fmt_s(st.compute_s)} / {_fmt_s(st.comm_exposed_s)} / {_fmt_s(st.bubble_s)} / {_fmt_s(st.overhead_s)}",
                  f"{st.mfu():.0%}",
                  _fmt_s(r.time_s), _fmt_h(r.gpu_hours), f"{r.efficiency:.0%}", ", ".join(marks))
    con.print(t)
    if result.best is not None:
        b = result.best
        con.print(f"best: {b.gpus:,} GPUs, batch {b.step.global_batch:,} seq ({_fmt_n(b.batch_tokens)} tokens) = "
                  f"{b.step.geometry()}; {b.steps:,.0f} steps [{b.steps_interval[0]:,.0f}–{b.steps_interval[1]:,.0f}], "
                  f"{_fmt_s(b.time_s)}, {_fmt_h(b.gpu_hours)} GPU-hours")
    ramp = result.best_ramp
    if ramp is not None:
        ratio = ramp.time_s / ramp.constant_time_s
        con.print(f"best ramp at {ramp.gpus:,} GPUs: batch schedule \"{ramp.schedule}\" (StepDriver, parse_step_schedule: thresholds in tokens, batches in "
                  f"sequences; {ramp.lr_text}): {ramp.steps:,.0f} steps, {_fmt_n(ramp.tokens)} tokens, {_fmt_s(ramp.time_s)} "
                  f"= {ratio:.3f}× the best constant batch's time")
    for n in result.notes:
        con.print(f"note: {n}")
    if plot:
        con.print(f"plot: {plot}")
    con.print(f"searched {result.evaluated_geometries:,} geometries in {result.search_seconds:.2f} s CPU")

