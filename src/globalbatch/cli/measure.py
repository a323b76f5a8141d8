"""``globalbatch probe`` and ``globalbatch noise``: the measurements of one configuration."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from globalbatch.lab.device import checked_device
from globalbatch.cli.app import (app, AutoDeviceOption, flag_names_of, JsonOption, OptimizerName, PrecisionName,
                                PrecisionOption, TaskArgOption, TaskOption, ThreadsOption, echo_json, OPTIMIZERS_HELP)


@app.command("probe", short_help="Find the largest micro-batch that fits and the fastest one.")
def probe_cmd(
    task: TaskOption = "tinygpt",
    global_batch: Optional[int] = typer.Option(None, "--global-batch", help="Samples (sequences) per optimizer step, all ranks; reports the accum that keeps it."),
    dp: int = typer.Option(1, "--dp", help="Data-parallel world size for the global-batch arithmetic."),
    memory_limit: Optional[str] = typer.Option(None, "--memory-limit", help="Memory budget, e.g. 8GiB: a larger measured peak counts as out of memory."),
    max_micro_batch: Optional[int] = typer.Option(None, "--max-micro-batch", help="Largest size tried (default global ÷ dp, else 8192)."),
    steps_per_trial: int = typer.Option(3, "--steps-per-trial", help="Timed training steps per trial (after 2 untimed warm-up steps)."),
    tolerance: float = typer.Option(0.05, "--throughput-tolerance", help="Fastest = smallest micro-batch within this fraction of the best tokens/s."),
    device: AutoDeviceOption = None,
    precision: PrecisionName = typer.Option("fp32", "--precision", help="fp32, bf16 (autocast) or fp16 (autocast)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON with stable snake_case keys."),
    task_arg: TaskArgOption = None,
) -> None:
    """Find the largest micro-batch that fits and the fastest one; keep the global batch with accumulation."""
    import logging

    from .. import validate as V
    from ..errors import Raw, SettingError
    from ..lab.tasks import load_task_checked
    from ..plan import parse_bytes
    from ..lab.probe_run import probe_task
    from ..probe import NothingFits, check_probe_settings, format_bytes, geometry_text, limit_text, probe_table

    overrides = V.key_values(task_arg, "task_arg")
    limit = None if memory_limit is None else parse_bytes(memory_limit, "--memory-limit")
    if limit is not None and limit < 1:
        raise SettingError("--memory-limit", Raw(memory_limit), "a budget of at least 1 byte", flag=True)
    check_probe_settings(global_batch=global_batch, dp_world_size=dp, max_micro_batch=max_micro_batch,
                         steps_per_trial=steps_per_trial, tolerance=tolerance, names=flag_names_of("probe"))
    checked_device(device, "device", precision=precision, default_cuda=True)
    load_task_checked(task, overrides)  # a bad --task/--task-arg: one line before any trial
    if not as_json:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        result = probe_task(task, global_batch=global_batch, dp_world_size=dp, memory_limit_bytes=limit,
                            max_micro_batch=max_micro_batch, steps_per_trial=steps_per_trial, tolerance=tolerance,
                            device=device, precision=precision, task_overrides=overrides)
    except NothingFits as exc:
        peak = exc.trial.peak_memory_bytes
        if limit is not None and peak is not None and peak > limit:
            raise SettingError("--memory-limit", Raw(memory_limit), f"a limit above {format_bytes(peak)}",
                               why=f"too small: micro_batch 1 needs {format_bytes(peak)}, peak measured",
                               flag=True) from None
        raise SettingError("--task", task, "a smaller model (--task-arg) or a device with more memory",
                           why=f"it does not fit: micro_batch 1 ran out of memory ({exc.trial.note})",
                           flag=True) from None
    if as_json:
        typer.echo(json.dumps(dict(result.to_dict(), task=task), indent=2, sort_keys=True))
        return
    from rich.console import Console

    console = Console(width=max(Console().width, 130))
    budget = f", memory limit {format_bytes(limit)}" if limit is not None else ""
    console.print(probe_table(result, title=f"globalbatch probe: {task}{budget}, {result.num_trials} trials"))
    if result.peak_flops_per_s is not None:
        console.print(f"MFU: model FLOPs (forward + backward, FlopCounterMode) per median step over the peak "
                      f"{result.peak_flops_per_s / 1e9:,.1f} GFLOP/s ({result.peak_flops_source})")
    limited = limit_text(result, max_micro_batch=max_micro_batch, global_batch=global_batch, dp_world_size=dp,
                         flag_names=True)
    console.print(f"largest that fits: {result.largest_fit} (limited by {limited})")
    if result.predicted_micro_batch is not None:
        error = (result.predicted_micro_batch - result.largest_fit) / result.largest_fit
        console.print(f"predicted before running: {result.predicted_micro_batch} (measured {result.largest_fit}, "
                      f"error {error:+.1%}; {result.predicted_note})")
    for conflict in result.conflicts:
        console.print(f"[yellow]intermittent out of memory:[/yellow] {conflict}")
    console.print(f"fastest: {result.fastest} (smallest within {result.tolerance:.0%} of the best throughput)")
    for choice in result.choices:
        if choice.geometry is not None:
            console.print(f"{choice.role}: {geometry_text(choice.geometry, result.unit)}")
        else:
            console.print(f"[yellow]{choice.role}:[/yellow] {choice.error}")


@app.command("noise", short_help="Measure the gradient noise scale B_simple with its interval.")
def noise_cmd(
    task: TaskOption = "tinygpt",
    micro_batch: int = typer.Option(8, "--micro-batch", help="Samples (sequences) per forward/backward per rank."),
    grad_accum: int = typer.Option(4, "--grad-accum", help="Micro-batches per step; on one process ≥ 2 (they are the small batches)."),
    steps: int = typer.Option(50, "--steps", help="Optimizer steps (windows) to train and measure."),
    lr: float = typer.Option(1e-3, "--lr", help="Constant learning rate (B_simple depends on it; it is logged)."),
    optimizer: OptimizerName = typer.Option("adamw", "--optimizer", help="A registry optimizer: " + OPTIMIZERS_HELP + " (the same recipe as sweep)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the model init and the data order."),
    log_every: int = typer.Option(5, "--log-every", help="Steps between estimates (rows of the curve)."),
    half_life_windows: float = typer.Option(10.0, "--half-life-windows", help="EMA half-life in windows of the global batch (forgetting is per unit)."),
    adam_variant: bool = typer.Option(False, "--adam-variant", help="Also report the Adam-preconditioned variant g/(√v̂+eps)."),
    budget: Optional[str] = typer.Option(None, "--budget", help="The monitor's cost allowed, a fraction of the step time (0.02 or 2%): it times itself and measures one window in n to stay within it (default: every window)."),
    calibrate_from: Optional[str] = typer.Option(None, "--calibrate-from", help="A sweep directory run with --noise: also report B_crit ≈ F × B_simple along the run, F = B_crit / B_simple measured on that sweep (labelled with it)."),
    out: str = typer.Option("runs/noise", "--out", help="Directory for noise.csv (and tb/ with --tensorboard)."),
    tensorboard: bool = typer.Option(False, "--tensorboard", help="Also write TensorBoard scalars (pip install 'globalbatch[tensorboard]')."),
    device: AutoDeviceOption = None,
    precision: PrecisionOption = "fp32",
    task_arg: TaskArgOption = None,
    threads: ThreadsOption = None,
    as_json: JsonOption = False,
) -> None:
    """Measure the gradient noise scale B_simple (McCandlish et al. 2018) over a short training run."""
    import dataclasses
    import os

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from .. import validate as V
    from .._util import flag_names
    from ..errors import SettingError
    from ..lab.noise_run import (NoiseRunConfig, check_noise_settings, format_estimate, format_interval, format_number,
                                 measure_noise)
    from ..noise.budget import parse_budget

    names = flag_names_of("noise")
    with flag_names(names):
        budget_fraction = None if budget is None else parse_budget(budget, "budget")
    calibration = None if calibrate_from is None else _calibration(calibrate_from)
    check_noise_settings(micro_batch=micro_batch, grad_accum_steps=grad_accum, steps=steps, lr=lr, optimizer=optimizer,
                         log_every=log_every, half_life_windows=half_life_windows, adam_variant=adam_variant,
                         threads=threads, world_size=int(os.environ.get("WORLD_SIZE", "1")), names=names)
    V.positive(lr, "lr")
    V.positive(half_life_windows, "half_life_windows")
    V.out_dir(out, "out")
    checked_device(device, "device", precision=precision, default_cuda=True)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    cfg = NoiseRunConfig(task=task, task_overrides=V.key_values(task_arg, "task_arg"), micro_batch=micro_batch,
                         grad_accum_steps=grad_accum, steps=steps, lr=lr, optimizer=optimizer, seed=seed,
                         log_every=log_every, half_life_windows=half_life_windows, adam_variant=adam_variant,
                         device=device, precision=precision, budget=budget_fraction)
    console = Console(width=max(Console().width, 140))
    header = [f"noise: {task}, {micro_batch} samples × {grad_accum} accum per rank, {steps} steps, lr {lr:g} "
              f"({optimizer}); EMA half-life {half_life_windows:g} windows"
              + ("" if budget_fraction is None else f"; monitor budget {budget_fraction:.2%} of the step")]

    def show(row: dict) -> None:
        if as_json:
            return
        if header:  # printed with the first row: every input (the task too) is checked by then
            console.print(header.pop())
        keys = [k[len("b_simple_"):] for k in row if k.startswith("b_simple_")]
        parts = [f"{k}={format_interval(row['b_simple_' + k], row['low_' + k], row['high_' + k], row['flags_' + k])}"
                 for k in keys]
        rate = _rate_text(row)
        console.print(f"step {row['step']:>5}  loss {row['loss']:.4f}  " + "  ".join(parts) + rate, markup=False,
                      highlight=False, soft_wrap=True)

    try:
        with flag_names(names), V.created_out_dir(out, "out"):
            result = measure_noise(cfg, out_dir=out, tensorboard=tensorboard, on_row=show)
    except ImportError as exc:  # the optional extra
        raise SettingError("--tensorboard", True, "without --tensorboard, or pip install 'globalbatch[tensorboard]'",
                           why=str(exc), flag=True) from exc
    if not result.rows:
        return  # not rank 0
    if as_json:
        echo_json({"unit": result.unit, "dp_world_size": result.dp_world_size, "csv": result.csv_path,
                    "rows": result.rows, "final": {k: dataclasses.asdict(e) for k, e in result.final.items()},
                    "cost": None if result.cost is None else result.cost.to_dict(),
                    "calibrated": None if calibration is None else {
                        "calibration": calibration.to_dict(), "rows": _calibrated_rows(result, calibration)}})
        return
    table = Table(title=f"B_simple curve ({result.unit}-mean loss; interval {next(iter(result.final.values())).confidence:.0%} Fieller)")
    keys = [k[len("b_simple_"):] for k in result.rows[0] if k.startswith("b_simple_")]
    for col in ["step", "loss", "lr", "batch", "valid tok/s", "MFU"] + keys:
        table.add_column(col, justify="right")
    for row in result.rows:
        cells = [str(row["step"]), f"{row['loss']:.4f}", f"{row['lr']:.3g}",
                 f"{row['batch_units']:,} {result.unit}s",
                 "–" if row["valid_tokens_per_s"] != row["valid_tokens_per_s"] else f"{row['valid_tokens_per_s']:,.0f}",
                 "–" if row["mfu"] != row["mfu"] else f"{row['mfu']:.1%}"]
        cells += [format_interval(row["b_simple_" + k], row["low_" + k], row["high_" + k], row["flags_" + k])
                  for k in keys]
        table.add_row(*[Text(c) for c in cells])  # Text: "[...]" is not rich markup
    console.print(table)
    for key, est in result.final.items():
        source, unit = key.split("/")
        label = {"micro": "micro-batches", "rank": "DP ranks", "micro_adam": "micro-batches, Adam-preconditioned VARIANT",
                 "rank_adam": "DP ranks, Adam-preconditioned VARIANT"}[source]
        console.print(f"B_simple ({label}, per {unit}): {format_estimate(est)}; lr {est.lr:g}, "
                      f"batch {est.big_count:,.0f} {unit}s, {est.windows} windows", markup=False, highlight=False,
                      soft_wrap=True)
    if result.cost is not None:
        console.print(result.cost.text(), markup=False, highlight=False, soft_wrap=True)
    if calibration is not None:
        console.print(calibration.label, markup=False, highlight=False, soft_wrap=True)
        for r in _calibrated_rows(result, calibration):
            console.print(f"step {r['step']:>5}  loss {r['loss']:.4f}  B_simple {format_number(r['b_simple'])}  → B_crit ≈ "
                          f"{format_number(r['b_crit_calibrated'])} [{format_number(r['b_crit_calibrated_low'])}–"
                          f"{format_number(r['b_crit_calibrated_high'])}] {result.unit}s"
                          + ("" if r["in_calibrated_range"] else "  (loss outside the calibrated losses)"),
                          markup=False, highlight=False, soft_wrap=True)
    if result.csv_path:
        console.print(f"wrote {result.csv_path}" + (f" and {out}/tb" if tensorboard else ""))


def _calibration(run_dir: str):
    """``--calibrate-from``: the factor B_crit / B_simple of a sweep run with ``--noise``, before anything runs."""
    from ..errors import Raw, SettingError
    from ..lab.noise_calibration import calibrate_from_sweep

    try:
        return calibrate_from_sweep(run_dir)
    except ValueError as exc:  # not a sweep directory, or one without B_simple / B_crit at its targets
        raise SettingError("--calibrate-from", Raw(run_dir), "a sweep directory run with --noise", why=str(exc),
                           flag=True) from None


def _calibrated_rows(result, calibration) -> list[dict]:
    """The run's B_simple curve (micro-batches, in the loss's unit) times the calibration's factor."""
    from ..lab.noise_calibration import calibrated_curve

    key = next((k for k in (f"b_simple_micro_{result.unit}", f"b_simple_rank_{result.unit}") if k in result.rows[0]),
               f"b_simple_micro_{result.unit}")
    return calibrated_curve(result.rows, calibration, key=key)


def _rate_text(row: dict) -> str:
    """``  1,234 valid tok/s  MFU 12.3%`` for a noise row (nothing for what is not known)."""
    parts = []
    if row.get("valid_tokens_per_s") == row.get("valid_tokens_per_s") and row.get("valid_tokens_per_s") is not None:
        parts.append(f"{row['valid_tokens_per_s']:,.0f} valid tok/s")
    if row.get("mfu") == row.get("mfu") and row.get("mfu") is not None:
        parts.append(f"MFU {row['mfu']:.1%}")
    return ("  " + "  ".join(parts)) if parts else ""
