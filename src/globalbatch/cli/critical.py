"""``globalbatch sweep``, ``report``, ``branch``, ``adaptive`` and ``demo``: the critical-batch experiments."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from globalbatch.lab.device import checked_device
from globalbatch.cli.app import (AdaptiveLrRule, app, Backend, DeviceOption, flag_names_of, JsonOption, Metric,
                                MicroBatchOption, Objective, OptimizerName, PrecisionOption, TaskArgOption, TaskOption,
                                Test, ThreadsOption, echo_json, OPTIMIZERS_HELP)


def _parse_units(text: str, flag: str) -> int:
    """``"10K"`` → 10000, ``"0"`` → 0 (a count of units that may be zero)."""
    from ..plan import parse_count

    return 0 if str(text).strip() in ("0", "0.0") else parse_count(text, flag)


def _print_seed_analysis(data, sa) -> None:
    """The tables over seeds, the recommendation and the warnings, on the terminal."""
    from rich.console import Console

    from ..lab.report import seed_tables

    Console(width=max(Console().width, 160)).print(seed_tables(data, sa))
    from ..critical.seeds import lr_selection_text
    from ..lab.report import _design_text, joint_text

    if sa.joint is not None:
        typer.echo(f"{joint_text(sa)}; {sa.monotone_share():.0%} of seed × target cells monotone")

    typer.echo(lr_selection_text(sa))
    if _design_text(data):
        typer.echo(_design_text(data))
    if sa.recommendation is not None:
        typer.echo(sa.recommendation.text())
    for w in sa.warnings:
        typer.echo(f"warning: {w}", err=True)


def _print_report(res) -> None:
    """The analysis over seeds when there is one, else the first seed's training-loss analysis."""
    if res.seed_analysis is not None:
        _print_seed_analysis(res.data, res.seed_analysis)
        for w in res.analysis.warnings:
            if w not in res.seed_analysis.warnings:
                typer.echo(f"warning: {w}", err=True)
        return
    from rich.console import Console

    from ..lab.report import analysis_table

    Console(width=max(Console().width, 140)).print(analysis_table(res.data, res.analysis))
    if res.analysis.recommendation is not None:
        typer.echo(res.analysis.recommendation.text())
    for w in res.analysis.warnings:
        typer.echo(f"warning: {w}", err=True)


def _on_command_line(ctx: typer.Context, name: str) -> bool:
    """True when the user typed the option ``name`` (not its default). By the source's name: typer may carry its own
    copy of click's ParameterSource."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


@app.command("sweep", short_help="Batch × LR sweep at equal tokens; fit the critical batch.")
def sweep_cmd(
    ctx: typer.Context,
    task: TaskOption = "tinygpt",
    batches: str = typer.Option("16,32,64,128,256", "--batches", help="Global batch sizes in samples (sequences) per step, comma-separated."),
    lrs: str = typer.Option("3e-4,1e-3,3e-3", "--lrs", help="Peak learning rates at --base-batch, comma-separated; every batch runs them moved by --lr-rule."),
    tokens: str = typer.Option("2M", "--tokens", help="Budget per trial in the task's unit (tokens; samples for a sample task), e.g. 2M."),
    out: str = typer.Option("runs/sweep", "--out", help="Output directory; rerunning resumes it (the grid must match)."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Trials at once (default: min(trials, cores)); threads = cores ÷ workers."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Torch threads per trial (default cores ÷ workers); keep it when resuming."),
    backend: Backend = typer.Option("local", "--backend", help="local (spawned processes) or ray (Ray Tune; pip install 'globalbatch[ray]')."),
    address: Optional[str] = typer.Option(None, "--address", help="Ray cluster address (with --backend ray)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the model init and of the shared data order (one seed; see --seeds)."),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="Seeds, comma-separated, e.g. 0,1,2: every cell runs per seed (resumable); the report states the spread."),
    warmup: Optional[str] = typer.Option(None, "--warmup", help="LR warmup in the task's units (tokens), e.g. 10K; default 5% of the budget."),
    warmup_min_steps: int = typer.Option(0, "--warmup-min-steps", help="Warm up over at least this many steps of each batch (Adam needs ≈ 1/(1−β2)); 0: --warmup alone."),
    lr_rule: str = typer.Option("auto", "--lr-rule", help="LR grid per batch: auto (the optimizer's rule), sqrt, linear or none (one grid for all)."),
    base_batch: Optional[int] = typer.Option(None, "--base-batch", help="The batch at which --lrs hold (default the smallest)."),
    lr_edge_extend: int = typer.Option(2, "--lr-edge-extend", help="Extra LRs per side run when a batch's best LR sits at an edge of its grid."),
    batch_edge_extend: int = typer.Option(1, "--batch-edge-extend", help="Doublings of the largest batch run when B_crit at the primary target lies beyond it (0: only state the bound)."),
    micro_batch: MicroBatchOption = None,
    eval_every: Optional[str] = typer.Option(None, "--eval-every", help="Units between held-out evaluations (default: --eval-points log-spaced ones)."),
    eval_points: int = typer.Option(32, "--eval-points", help="Log-spaced held-out evaluations per trial (≥ 30 for a sound read-out)."),
    val_samples: int = typer.Option(512, "--val-samples", help="Held-out samples per evaluation (a fixed random draw, the same for every trial)."),
    optimizer: OptimizerName = typer.Option("adamw", "--optimizer", help="A registry optimizer: " + OPTIMIZERS_HELP + "."),
    task_arg: TaskArgOption = None,
    noise: bool = typer.Option(False, "--noise", help="Also log the gradient noise scale B_simple at every evaluation (the report plots it)."),
    device: DeviceOption = "cpu",
    precision: PrecisionOption = "fp32",
    sweep_budget: Optional[str] = typer.Option(None, "--budget", help="Spend at most this share of the full design's tokens (0.1, 10%) or this many tokens in all (1.2M): runs the cheapest design that fits, one measured to hold where one fits (benchmarks/critical_cost.py), and says which and what it measured."),
    as_json: JsonOption = False,
) -> None:
    """Train every batch × LR on the same data order and token budget, then fit the critical batch."""
    from rich.console import Console

    from types import SimpleNamespace

    from .. import validate as V
    from .._util import SettingError, flag_names
    from ..lab.report import design_json, seed_analysis_or_note, seed_json
    from ..lab.sweep.halving import spent_text
    from ..lab.sweep import SweepConfig, analyze_sweep, run_sweep

    with flag_names(flag_names_of("sweep")):
        V.out_dir(out, "out")
        for one, other, value, given in (("seed", "--seeds", seed, seeds), ("eval_points", "--eval-every", eval_points,
                                                                           eval_every)):
            if given is not None and _on_command_line(ctx, one):  # the other one would be ignored
                raise SettingError(one, value, f"either it or {other}", why=f"{other} is given too")
        cfg = SweepConfig(task=task, task_overrides=V.key_values(task_arg, "task_arg"),
                          batches=V.count_list(batches, "batches"), lrs=V.number_list(lrs, "lrs"),
                          budget=V.count(tokens, "budget", what="a whole number of units"), seed=seed,
                          seeds=None if seeds is None else V.seed_list(seeds),
                          warmup=None if warmup is None else _parse_units(warmup, "--warmup"),
                          warmup_min_steps=warmup_min_steps, lr_rule=lr_rule, base_batch=base_batch, lr_edge_extend=lr_edge_extend,
                          batch_edge_extend=batch_edge_extend,
                          eval_points=eval_points, max_val_samples=val_samples,
                          micro_batch=micro_batch,
                          eval_every=None if eval_every is None else V.count(eval_every, "eval_every"),
                          optimizer=optimizer, noise=noise, device=device, precision=precision)
        plan = None if sweep_budget is None else _plan_budget(cfg, sweep_budget)
        console = Console(stderr=True)
        if plan is not None:
            import dataclasses

            cfg = dataclasses.replace(cfg, design=plan.design.name)
            typer.echo(plan.statement, err=True)
        result = run_sweep(cfg, out, workers=workers, threads=threads, backend=backend, address=address,
                           progress=not as_json)
    data, analysis = analyze_sweep(out)
    sa, note = seed_analysis_or_note(out)
    if note is not None:
        analysis.warnings.append(note)
    if as_json:
        over_seeds = None if sa is None else seed_json(data, sa)
        echo_json({"out_dir": result.out_dir, "ran": result.ran, "skipped": result.skipped,
                    "design": None if plan is None else {**design_json(plan.design.name, plan.statement),
                                                         "budget_fraction": plan.fraction,
                                                         "planned_fraction": plan.planned_fraction,
                                                         "spent": spent_text(out, cfg, data.unit)},
                    "wall_time_s": result.wall_time_s, "workers": result.workers,
                    "threads_per_worker": result.threads_per_worker, "analysis": analysis.to_dict(),
                    "seeds": over_seeds,
                    # the one answer, as the tables and `report --json` give it: the seeds' held-out analysis
                    "recommendation": None if over_seeds is None else over_seeds["recommendation"],
                    "first_seed_recommendation": None if analysis.recommendation is None
                    else analysis.recommendation.text(),
                    "warnings": list(analysis.warnings)})
        return
    console.print(f"sweep {out}: {len(result.ran)} trial(s) run, {len(result.skipped)} already finished, "
                  f"{result.wall_time_s:,.1f} s ({result.workers} worker(s) × {result.threads_per_worker} thread(s))"
                  + (f"; design {plan.design.name}: {spent_text(out, cfg, data.unit)}" if plan is not None else ""))
    added = sorted({s.batch for s in data.summaries.values()} - set(cfg.batches))
    if added:
        console.print(f"batch {', '.join(map(str, added))} added beyond --batches: B_crit at the primary target lay "
                      f"beyond the largest batch (--batch-edge-extend {cfg.batch_edge_extend}; 0 only states the bound)")
    _print_report(SimpleNamespace(data=data, analysis=analysis, seed_analysis=sa))
    typer.echo(f"report: globalbatch report {out}")


def _plan_budget(cfg, text: str):
    """``--budget``: the design to run, or one line (exit 2) when not even the cheapest design fits."""
    from ..errors import SettingError
    from ..lab.sweep.designs import DESIGNS, budget_fraction, plan_for_budget

    n_seeds = len(cfg.seeds) if cfg.seeds is not None else 1
    full_units = len(cfg.batches) * len(cfg.lrs) * n_seeds * cfg.budget
    fraction = budget_fraction(text, full_units)
    plan = plan_for_budget(fraction, len(cfg.batches), len(cfg.lrs), n_seeds)
    if plan is None:
        cheapest = min(DESIGNS.values(), key=lambda d: d.planned_fraction(len(cfg.batches), len(cfg.lrs), n_seeds))
        need = cheapest.planned_fraction(len(cfg.batches), len(cfg.lrs), n_seeds)
        raise SettingError("sweep_budget", text,
                           f"at least {need:.1%} of the full design's {full_units:,} tokens "
                           f"({need * full_units:,.0f}: design {cheapest.name}, {cheapest.summary})")
    return plan


@app.command("report", short_help="Plots and an HTML report of a sweep, with the recommendation.")
def report_cmd(
    run_dir: str = typer.Argument(..., help="A sweep output directory (with manifest.json)."),
    out: Optional[str] = typer.Option(None, "--out", help="Where to write plots and report.html (default RUN_DIR/report)."),
    targets: Optional[str] = typer.Option(None, "--targets", help="Loss targets, comma-separated (default: automatic); over seeds the lowest is the primary, for the first seed alone the first."),
    objective: Objective = typer.Option("time", "--objective", help="time (wall-clock to target) or cost (units to target)."),
    tolerance: float = typer.Option(0.05, "--time-tolerance", help="Batches within this fraction of the best time (or cost) to target count as ties; the most data-efficient wins."),
    ema_fraction: float = typer.Option(0.05, "--ema-fraction", help="EMA half-life of the training loss as a fraction of each trial's steps to the target (lag-corrected)."),
    half_life_steps: Optional[float] = typer.Option(None, "--half-life-steps", help="A fixed EMA half-life in steps instead (biases B_crit low; see docs/critical.md)."),
    readout: str = typer.Option("heldout", "--readout", help="heldout (monotone fit of the held-out evaluations) or train (EMA of the training loss, window ≥ 2% of the budget)."),
    lr_selection: str = typer.Option("auto", "--lr-selection", help="The LR each batch is read at over seeds: auto (one LR per batch, re-chosen at a target where it leaves seeds non-monotone), per_batch or per_target."),
    as_json: bool = typer.Option(False, "--json", help="Print the analysis over seeds as JSON (stable snake_case keys: targets with b_crit, b_crit_per_seed, steps_to_target, monotone; recommendation with batch, lr, per_seed, probability_fastest) instead of the tables."),
    scale: Optional[str] = typer.Option(None, "--scale", help="A `globalbatch scale RUN_DIR --json` output: adds its time-vs-GPU-hours Pareto plot, table per GPU count and assumptions as a section."),
) -> None:
    """Write PNG plots and a self-contained HTML report of a sweep, with the recommended batch."""

    from .. import validate as V
    from .._util import flag_names
    from ..lab.report import seed_json, write_report

    with flag_names(flag_names_of("report")):
        V.existing_dir(run_dir, "run_dir", allowed="a sweep directory (written by globalbatch sweep)")
        target_list = None if targets is None else tuple(V.number_list(targets, "targets", positive_only=False,
                                                                            example="2.4,2.3 (losses)"))
        from ..lab.scale_section import load_scale_json

        scale_doc = None if scale is None else load_scale_json(scale)
        with V.created_out_dir(out if out is not None else str(Path(run_dir) / "report"), "out"):
            from ..critical import AnalysisSettings

            settings = AnalysisSettings(objective=objective, tolerance=tolerance, ema_fraction=ema_fraction,
                                        halflife_steps=half_life_steps, readout=readout, lr_selection=lr_selection,
                                        targets=target_list, first_seed_targets=target_list)
            res = write_report(run_dir, out, settings=settings, scale=scale_doc)
    if as_json:
        doc = seed_json(res.data, res.seed_analysis) if res.seed_analysis is not None else {
            "recommendation": None, "warnings": []}
        doc.update({"html": str(res.html), "plots": [str(p) for p in res.plots],
                    "first_seed_recommendation": None if res.analysis.recommendation is None
                    else res.analysis.recommendation.text()})
        doc["warnings"] = list(doc["warnings"]) + [w for w in res.analysis.warnings if w not in doc["warnings"]]
        echo_json(doc)
        return
    _print_report(res)
    typer.echo(f"wrote {res.html} and {len(res.plots)} plot(s)")


@app.command("branch", short_help="Branch test (Merrill et al. 2025): the largest safe batch multiple k.")
def branch_cmd(
    task: TaskOption = "tinygpt",
    base_batch: int = typer.Option(16, "--base-batch", help="Batch of the base run, in samples (sequences) per step."),
    ks: str = typer.Option("1,2,4,8", "--ks", help="Batch multipliers to branch at, comma-separated; must include 1."),
    lr: float = typer.Option(1e-3, "--lr", help="LR of the base run; a k-branch uses lr·√k (adamw) or lr·k (sgd)."),
    warmup_tokens: str = typer.Option("200K", "--warmup-tokens", help="Units the base run trains before branching; a comma list branches at several points."),
    points: Optional[int] = typer.Option(None, "--points", help="Branch at this many evenly spaced points up to --warmup-tokens (one value) and fit B_crit(L) over them."),
    window_tokens: str = typer.Option("100K", "--window-tokens", help="Units every branch trains."),
    second_moment: str = typer.Option("keep", "--second-moment", help="keep the checkpoint's Adam second moments at a k-branch, scaled: divided by k (a large-k branch otherwise starts with the small batch's larger exp_avg_sq), or split: only their noise part (from the first moment) divided by k."),
    window_fraction: Optional[float] = typer.Option(None, "--window-fraction", help="Instead of --window-tokens: each point's window is this fraction of its own units (short windows early, long late)."),
    seeds: int = typer.Option(3, "--seeds", help="Branches per k, each with its own data order (>= 2)."),
    tolerance: float = typer.Option(0.01, "--loss-tolerance", help="Loss increase over k=1 that still counts as equal (Merrill et al.: 0.01)."),
    tolerance_rule: str = typer.Option("absolute", "--tolerance-rule", help="absolute (--loss-tolerance at every point) or half_window (at each point the k=1 branches' loss drop over the window's second half: the critical batch then reads McCandlish's B_crit)."),
    alpha: float = typer.Option(0.05, "--alpha", help="Level of the one-sided t-test per k."),
    metric: Metric = typer.Option("val", "--metric", help="val (validation loss at the end of the window) or train (last quarter's training loss)."),
    test: Test = typer.Option("paired", "--test", help="paired (per-seed differences) or welch."),
    optimizer: OptimizerName = typer.Option("adamw", "--optimizer", help="A registry optimizer (" + OPTIMIZERS_HELP + "); LR × √k for Adam-type, × k for SGD-type."),
    out: str = typer.Option("runs/branch", "--out", help="Output directory; rerunning reuses finished branches (a larger --seeds adds only the new seeds' branches)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the model init and the base run's data order."),
    micro_batch: MicroBatchOption = None,
    task_arg: TaskArgOption = None,
    threads: ThreadsOption = None,
    device: DeviceOption = "cpu",
    precision: PrecisionOption = "fp32",
    as_json: JsonOption = False,
) -> None:
    """Merrill et al. 2025 branch test: the largest k whose k× batch branches are not worse than k = 1."""
    from .. import validate as V
    from .._util import flag_names
    from ..lab.branch import BranchConfig, evenly_spaced_points, run_branch_test

    with flag_names(flag_names_of("branch")):
        V.out_dir(out, "out")
        V.whole(base_batch, "base_batch", maximum=V.MAX_BATCH)
        k_list = V.count_list(ks, "ks", allowed="whole numbers ≥ 1 including 1, e.g. 1,2,4,8")
        V.whole(base_batch * max(k_list), "base_batch", maximum=V.MAX_BATCH)
        branch_at = V.count_list(warmup_tokens, "branch_at", maximum=V.MAX_COUNT,
                                 allowed="unit counts ≥ 1, e.g. 200K or 100K,200K")
        if points is not None:
            branch_at = evenly_spaced_points(branch_at, points)
        cfg = BranchConfig(task=task, task_overrides=V.key_values(task_arg, "task_arg"), base_batch=base_batch,
                           ks=k_list, lr=V.positive(lr, "lr"), optimizer=optimizer, branch_at=branch_at,
                           window=V.count(window_tokens, "window", what="a whole number of units"),
                           window_fraction=window_fraction, second_moment=second_moment, seeds=seeds, seed=seed,
                           micro_batch=micro_batch, tolerance=tolerance, tolerance_rule=tolerance_rule, alpha=alpha,
                           metric=metric, test=test,
                           device=device, precision=precision)
        result = run_branch_test(cfg, out, threads=threads, progress=not as_json)
    if as_json:
        echo_json(result.to_dict())
        return
    typer.echo(result.text())
    typer.echo(f"wrote {out}/result.json")


@app.command("adaptive", short_help="An adaptive global batch (noise-tracking or goodput) vs fixed batches, over seeds.")
def adaptive_cmd(
    task: str = typer.Option("tinygpt", "--task", help="Task: tinygpt (default: the demo's settings), mnist, package.module:function or path/to/file.py:function."),
    policy: str = typer.Option("noise", "--policy", help="noise (B = c·B_simple, on its lower bound), goodput (Pollux) or package.module:function (a factory f(config) -> policy)."),
    batches: str = typer.Option("4,8,16,32,64", "--batches", help="Fixed global batches to compare against, in samples, comma-separated."),
    lr: float = typer.Option(3e-3, "--lr", help="Peak LR at --lr-base-batch; other batches scale it by --lr-rule."),
    lr_base_batch: int = typer.Option(8, "--lr-base-batch", help="The batch --lr belongs to: batch B trains at lr × rule(B / this)."),
    initial_batch: Optional[int] = typer.Option(None, "--initial-batch", help="The adaptive run's first batch (default: the smallest fixed batch)."),
    lr_rule: AdaptiveLrRule = typer.Option("sqrt", "--lr-rule", help="LR at a batch change: sqrt, linear, adascale (gain from B_simple) or none."),
    throughput_from: Optional[str] = typer.Option(None, "--throughput-from", help="Goodput: a sweep directory whose timing pass gives throughput per batch (default: the fixed runs')."),
    c: float = typer.Option(2.0, "--c", help="Noise tracking: target batch = c × B_simple (2: tuned on the demo tinygpt, seeds 101-102)."),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", help="Largest adaptive batch (default: the largest fixed batch)."),
    any_batch: bool = typer.Option(False, "--any-batch", help="Allow any multiple of the micro-batch, not only powers of two."),
    decide_every: int = typer.Option(10, "--decide-every", help="Optimizer steps between decisions."),
    min_interval: int = typer.Option(50, "--min-interval", help="Optimizer steps between two batch changes."),
    patience: int = typer.Option(2, "--patience", help="Decisions in a row that must agree before a change (hysteresis)."),
    tokens: str = typer.Option("300K", "--tokens", help="Budget per run in the task's unit (tokens), e.g. 300K."),
    seeds: str = typer.Option("1,2,3", "--seeds", help="Seeds (model init and data order), comma-separated; >= 3 for intervals."),
    micro_batch: int = typer.Option(4, "--micro-batch", help="Samples per forward/backward, every arm."),
    optimizer: OptimizerName = typer.Option("adamw", "--optimizer", help="A registry optimizer: " + OPTIMIZERS_HELP + " (pick --lr-rule to match: sqrt for Adam-type, linear for SGD)."),
    target: list[float] = typer.Option([], "--target", help="Held-out loss target (repeatable); default two: every fixed batch's final loss reaches it (worst + 0.01), and half of them do (median + 0.01)."),
    task_arg: TaskArgOption = None,
    out: str = typer.Option("runs/adaptive", "--out", help="Output directory; rerunning resumes it (finished runs are kept; --seeds may grow)."),
    threads: ThreadsOption = None,
    device: DeviceOption = "cpu",
    precision: PrecisionOption = "fp32",
    as_json: bool = typer.Option(False, "--json", help="Print the analyses as JSON (stable snake_case keys) instead of tables (progress stays on stderr)."),
) -> None:
    """Train the adaptive policy and each fixed batch at equal tokens on every seed; report loss vs tokens/steps,
    the batch over time and tokens-/steps-to-target with intervals."""
    import math

    from .. import validate as V
    from .._util import SettingError, flag_names
    from ..lab.adaptive_report import format_analysis, write_adaptive_report
    from ..lab.adaptive_run import AdaptiveConfig, run_adaptive
    from ..lab.sweep import demo_config
    from ..plan import parse_count

    with flag_names(flag_names_of("adaptive")):
        V.out_dir(out, "out")
        overrides = V.key_values(task_arg, "task_arg")
        if task == "tinygpt":
            overrides = {**demo_config().task_overrides, **overrides}
        cfg = AdaptiveConfig(task=task, task_overrides=overrides, policy=policy,
                             batches=V.count_list(batches, "batches"), lr=lr, base_batch=lr_base_batch,
                             initial_batch=initial_batch,
                             lr_rule=lr_rule, c=c, throughput_from=throughput_from, max_batch=max_batch, powers_of_two=not any_batch,
                             decide_every=decide_every, min_interval_steps=min_interval, patience=patience,
                             budget=parse_count(tokens, "--tokens"),
                             seeds=V.seed_list(seeds),
                             micro_batch=micro_batch, optimizer=optimizer, device=device, precision=precision)
        for t in target:
            if not (t > 0 and math.isfinite(t)):
                raise SettingError("target", t, "a finite held-out loss > 0")
        result = run_adaptive(cfg, out, threads=threads, log=lambda m: typer.echo(m, err=True))
    typer.echo(f"{len(result.ran)} run(s) trained, {len(result.skipped)} already finished, {result.wall_time_s:,.0f} s",
               err=True)
    analyses, files = write_adaptive_report(out, targets=target or None)
    if as_json:
        echo_json({"analyses": [a.as_dict() for a in analyses], "files": files})
        return
    for analysis in analyses:
        typer.echo(format_analysis(analysis))
    typer.echo(f"report: {files[-1]}")


@app.command("demo", short_help="Quick sweep of a small tinygpt and its report (the main job).")
def demo_cmd(
    out: str = typer.Option("demo_out", "--out", help="Output directory of the demo sweep and its report."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Trials at once (default: min(trials, cores))."),
    device: DeviceOption = "cpu",
    precision: PrecisionOption = "fp32",
    as_json: JsonOption = False,
) -> None:
    """A quick sweep of a small tinygpt (a few minutes on 2 CPU cores), then the HTML report."""
    import time

    from rich.console import Console

    import dataclasses

    from .. import validate as V
    from .._util import SettingError, flag_names
    from ..lab.report import seed_json, write_report
    from ..lab.sweep import demo_config, run_sweep

    t0 = time.time()
    with flag_names(flag_names_of("demo")):
        cfg = dataclasses.replace(demo_config(), device=device, precision=precision)
        checked_device(device, "device", precision=precision)  # before the banner: a bad flag is one line
        if workers is not None:
            V.whole(workers, "workers")
        V.out_dir(out, "out")
        from ..lab.rundir import lock_holder

        holder = lock_holder(out)
        if holder is not None:  # in use by another run: one line now, not after the banner
            raise SettingError("out", out, "a directory no other run is using", why=f"a run (pid {holder}) holds it")
        console = Console(stderr=True)
        console.print(f"demo: tinygpt {cfg.task_overrides}, batches {cfg.batches}, lrs {cfg.lrs} at batch "
                      f"{min(cfg.batches)} ({cfg.lr_rule_resolved()} rule), seeds {cfg.seed_list()}, "
                      f"{cfg.budget:,} tokens per trial, {cfg.device} {cfg.precision}")
        result = run_sweep(cfg, out, workers=workers, progress=not as_json)
    res = write_report(out)
    if as_json:
        over_seeds = None if res.seed_analysis is None else seed_json(res.data, res.seed_analysis)
        echo_json({"out_dir": result.out_dir, "wall_time_s": result.wall_time_s, "report": str(res.html),
                    "analysis": res.analysis.to_dict(), "warnings": list(res.analysis.warnings),
                    "seeds": over_seeds,
                    # the one answer, as `sweep --json` and `report --json` give it: the seeds' held-out analysis
                    "recommendation": None if over_seeds is None else over_seeds["recommendation"],
                    "first_seed_recommendation": None if res.analysis.recommendation is None
                    else res.analysis.recommendation.text()})
        return
    _print_report(res)
    typer.echo(f"sweep {result.wall_time_s:,.0f} s, total {time.time() - t0:,.0f} s; report: {res.html}")
