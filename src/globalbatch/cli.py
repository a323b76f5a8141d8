"""The ``globalbatch`` (alias ``gbs``) command line: a thin layer over the library.

Each command parses flags, calls one library function and prints. Heavy imports
(torch, matplotlib, ray) happen inside the command that needs them, so
``globalbatch plan`` starts fast and works without torch.

Errors: any ``ValueError`` (or click usage error) becomes one line on stderr,
``error: <flag> <value> is not allowed; allowed: <what is allowed>``, and exit code 2 —
never a traceback. A :class:`~globalbatch._util.SettingError` names a library field; the
line names the flag instead, found in the command's own typer parameters
(:func:`flag_names_of`), not in any message. Inputs are checked with
:mod:`globalbatch.validate` before anything is printed or written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal, Optional, get_args, get_origin

import typer

from globalbatch.optim.registry import optimizer_names  # noqa: E402 (torch-free table)

_OPTIMIZERS = ", ".join(optimizer_names())
"""The registry's names as --help shows them."""

# Fixed choices as Literal types: typer shows them in --help (``--objective <time|cost>``) and refuses
# any other value before the command runs (one line, see _usage_error_line).
OptimizerName = Literal.__getitem__(tuple(optimizer_names()))  # the registry's names, whatever they are
PrecisionName = Literal["fp32", "bf16", "fp16"]
Backend = Literal["local", "ray"]
Objective = Literal["time", "cost"]
Metric = Literal["val", "train"]
Test = Literal["paired", "welch"]
LrRule = Literal["linear", "sqrt", "none"]
AdaptiveLrRule = Literal["sqrt", "linear", "adascale", "none"]

app = typer.Typer(
    name="globalbatch",
    help="Plan, check and measure the global batch size of PyTorch training.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


class CliError(ValueError):
    """A user error reported as one line with exit code 2."""


def _echo_json(obj: Any) -> None:
    """``--json``: one JSON document on stdout, stable snake_case keys."""
    from ._util import json_default

    typer.echo(json.dumps(obj, indent=2, sort_keys=True, default=json_default))


def _fail(message: str) -> "typer.Exit":
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


# ---------------------------------------------------------------------------
# The one field → flag mapping, taken from the commands' own typer definitions
# ---------------------------------------------------------------------------

_FIELD_PARAMS: dict[str, dict[str, str]] = {
    "plan": {"grad_accum_steps": "grad_accum", "dp_world_size": "dp", "new_dp_world_size": "dp",
             "compute_flops": "compute", "loss_nats": "loss", "config": "config"},
    "probe": {"dp_world_size": "dp", "tolerance": "throughput_tolerance", "task_overrides": "task_arg",
              "memory_limit_bytes": "memory_limit"},
    "sweep": {"budget": "tokens", "task_overrides": "task_arg", "max_val_samples": "val_samples"},
    "report": {"halflife_steps": "half_life_steps", "tolerance": "time_tolerance"},
    "noise": {"grad_accum_steps": "grad_accum", "task_overrides": "task_arg"},
    "branch": {"branch_at": "warmup_tokens", "window": "window_tokens", "task_overrides": "task_arg",
               "tolerance": "loss_tolerance"},
    "adaptive": {"budget": "tokens", "task_overrides": "task_arg", "base_batch": "lr_base_batch",
                 "min_interval_steps": "min_interval"},
}
"""Library field → the command's typer parameter, only where the library names a setting differently."""


def _commands() -> dict:
    global _COMMANDS
    if _COMMANDS is None:
        _COMMANDS = dict(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    return _COMMANDS


_COMMANDS: Optional[dict] = None


def flag_names_of(command_name: str) -> dict[str, str]:
    """``{library field: flag}`` for one command: every typer parameter under its own name (``task_arg`` →
    ``--task-arg``, the ``RUN_DIR`` argument) and the library's names of :data:`_FIELD_PARAMS`."""
    cmd = _commands()[command_name]
    by_param = {}
    for p in cmd.params:  # typer's click objects: options have --flags, arguments a METAVAR name
        if getattr(p, "param_type_name", "") == "option":
            by_param[p.name] = next((o for o in p.opts if o.startswith("--")), p.opts[0])
        else:
            by_param[p.name] = str(p.name).upper()
    out = dict(by_param)
    for field, param in _FIELD_PARAMS.get(command_name, {}).items():
        if param in by_param:
            out[field] = by_param[param]
    return out


def _setting_line(exc: Exception, command_name: Optional[str]) -> str:
    """A SettingError's line naming the flag the user typed (the field as is when no flag spells it)."""
    field = getattr(exc, "field", "")
    if command_name and not field.startswith("-"):
        try:
            flag = flag_names_of(command_name).get(field)
        except KeyError:
            flag = None
        if flag is not None:
            return exc.text(flag)  # type: ignore[attr-defined]
    return str(exc)


# ---------------------------------------------------------------------------
# Commands. Keep each one thin: parse, call the library, print.
# ---------------------------------------------------------------------------

def _version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"globalbatch {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Plan, check and measure the global batch size of PyTorch training."""


# (commands are registered below this line)


@app.command("plan", short_help="State, check and derive the batch geometry of a run (no torch needed).")
def plan_cmd(
    config: Optional[str] = typer.Option(None, "--config", help="YAML/TOML (our schema), DeepSpeed JSON or HF TrainingArguments JSON."),
    global_batch: Optional[int] = typer.Option(None, "--global-batch", help="Sequences per optimizer step, all ranks."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Sequences per forward/backward per rank."),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum", help="Micro-batches accumulated per optimizer step."),
    dp: Optional[int] = typer.Option(None, "--dp", help="Data-parallel world size. With --config: a new world size; the global batch stays fixed and accum is re-derived."),
    round_down: bool = typer.Option(False, "--round-down", help="When the new --dp does not divide, round the global batch down and say how much is dropped."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sequence (padded)."),
    valid_tokens_per_seq: Optional[float] = typer.Option(None, "--valid-tokens-per-seq", help="Mean non-padding tokens per sequence."),
    padding_fraction: Optional[float] = typer.Option(None, "--padding-fraction", help="Share of token slots that are padding, 0 ≤ x < 1."),
    total_tokens: Optional[str] = typer.Option(None, "--total-tokens", help="Training budget in tokens, e.g. 100B."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Learning rate (tuned at --lr-base-batch if given)."),
    lr_base_batch: Optional[int] = typer.Option(None, "--lr-base-batch", help="Global batch (sequences) at which --lr was tuned."),
    lr_rule: Optional[LrRule] = typer.Option(None, "--lr-rule", help="linear | sqrt | none (default sqrt, or --optimizer's rule)."),
    optimizer: Optional[str] = typer.Option(None, "--optimizer", help="A registry name (adamw, sgd, lars, lamb): its LR rule is the default --lr-rule; with --memory also its state bytes (plus sgd-plain, sgd-momentum, adafactor; default adamw)."),
    warmup_tokens: Optional[str] = typer.Option(None, "--warmup-tokens", help="Warmup in tokens, e.g. 375M (converted to steps)."),
    warmup_steps: Optional[int] = typer.Option(None, "--warmup-steps", help="Warmup in steps (converted to tokens)."),
    pp_stages: Optional[int] = typer.Option(None, "--pp-stages", help="Pipeline stages p (micro-batches per step m = grad accum)."),
    virtual_stages: Optional[int] = typer.Option(None, "--virtual-stages", help="Interleaved virtual stages v (default 1)."),
    max_bubble: Optional[float] = typer.Option(None, "--max-bubble", help="Bubble target (fraction of compute) for the smallest-global-batch hint."),
    params: Optional[str] = typer.Option(None, "--params", help="Model parameters N, e.g. 7B (all-reduce volume, priors)."),
    grad_bytes_per_param: Optional[int] = typer.Option(None, "--grad-bytes-per-param", help="Bytes per gradient element (4 fp32, 2 bf16; default 4)."),
    sync_every_micro_step: bool = typer.Option(False, "--sync-every-micro-step", help="All-reduce on every micro-step (no no_sync)."),
    compute: Optional[str] = typer.Option(None, "--compute", help="Training FLOPs C for the DeepSeek prior (default 6·N·D)."),
    loss: Optional[float] = typer.Option(None, "--loss", help="Loss in nats/token for the Kaplan B_crit prior."),
    memory: Optional[str] = typer.Option(None, "--memory", help="Device memory, e.g. 80GiB: predict the largest micro-batch and show the memory breakdown (needs --params and --activation-bytes-per-sample, or --task)."),
    precision: Optional[str] = typer.Option(None, "--precision", help="With --memory: fp32 or bf16-mixed (bf16 weights/grads, fp32 master; default fp32)."),
    sharding: Optional[str] = typer.Option(None, "--sharding", help="With --memory: none, zero1, zero2, zero3 or fsdp, over --dp ranks (default none)."),
    activation_bytes: Optional[str] = typer.Option(None, "--activation-bytes-per-sample", help="With --memory: activation bytes per sample, e.g. 1.5GiB (else measured with --task)."),
    checkpoint_divisor: Optional[float] = typer.Option(None, "--checkpoint-divisor", help="With --memory: activation checkpointing divides activations by this (default 1: none)."),
    task: Optional[str] = typer.Option(None, "--task", help="With --memory: measure params and activations of this task (tinygpt, mnist or package.module:function; needs torch)."),
    task_arg: list[str] = typer.Option([], "--task-arg", help="With --task: override KEY=VALUE (repeatable), e.g. d_model=64."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON with stable snake_case keys."),
) -> None:
    """State the whole batch geometry of a run, check it, and say what follows from it."""
    import json

    from . import plan as P
    from .config import make_plan, plan_table

    def count(text: Optional[str], flag: str) -> Optional[float]:
        return None if text is None else float(P.parse_count(text, flag))

    if optimizer is not None:  # the registry's table imports no torch
        from ._util import SettingError
        from .optim.registry import lr_scaling_rule, optimizer_names

        from .memory import OPTIMIZER_STATES

        if optimizer not in optimizer_names():
            if memory is None and optimizer in OPTIMIZER_STATES:
                raise SettingError("--optimizer", optimizer, f"{', '.join(optimizer_names())} (the registry; "
                                   f"{optimizer} names optimizer state for --memory only)", flag=True)
            if memory is None:
                raise SettingError("--optimizer", optimizer, ", ".join(optimizer_names()), flag=True)
            if optimizer not in OPTIMIZER_STATES:
                raise SettingError("--optimizer", optimizer, ", ".join(dict.fromkeys(
                    [*optimizer_names(), *OPTIMIZER_STATES])), flag=True)
        if lr_rule is None and optimizer in optimizer_names():
            lr_rule = lr_scaling_rule(optimizer)

    memory_flags = {"--precision": precision, "--sharding": sharding,
                    "--activation-bytes-per-sample": activation_bytes, "--checkpoint-divisor": checkpoint_divisor,
                    "--task": task, "--task-arg": task_arg or None}
    memory_inputs = None
    if memory is None:
        for flag, value in memory_flags.items():
            if value is not None:
                raise ValueError(f"{flag} {value if not isinstance(value, list) else ','.join(value)} is not allowed "
                                 "without --memory; allowed: add --memory DEVICE_BYTES, e.g. --memory 80GiB")
    else:
        memory_inputs = _memory_inputs(memory, params=params, dp=dp, optimizer=optimizer, precision=precision,
                                       sharding=sharding, activation_bytes=activation_bytes,
                                       checkpoint_divisor=checkpoint_divisor, task=task, task_arg=task_arg)
    geometry_given = config is not None or any(v is not None for v in (global_batch, micro_batch, grad_accum))
    if memory_inputs is not None and not geometry_given:
        _print_memory(memory_inputs, None, as_json)
        return

    flags = {
        "global_batch": global_batch, "micro_batch": micro_batch, "grad_accum_steps": grad_accum,
        "seq_len": seq_len, "valid_tokens_per_seq": valid_tokens_per_seq, "padding_fraction": padding_fraction,
        "total_tokens": count(total_tokens, "--total-tokens"),
        "lr": lr, "lr_base_batch": lr_base_batch, "lr_rule": lr_rule,
        "warmup_tokens": count(warmup_tokens, "--warmup-tokens"),
        "warmup_steps": warmup_steps, "pp_stages": pp_stages, "virtual_stages": virtual_stages,
        "max_bubble": max_bubble, "params": count(params, "--params"),
        "grad_bytes_per_param": grad_bytes_per_param,
        "compute_flops": count(compute, "--compute"), "loss_nats": loss,
        "no_sync": False if sync_every_micro_step else None,
    }
    report = make_plan(config, flags, dp_world_size=dp, round_down=round_down)
    warnings = list(report.warnings)
    memory_section = None
    if memory_inputs is not None:
        memory_section = _memory_section(memory_inputs, report.micro_batch)
        if not memory_section["fits"]:
            warnings.append(
                f"micro_batch {memory_section['breakdown']['micro_batch']} needs "
                f"{memory_section['breakdown']['total_bytes'] / 2**30:,.2f} GiB, more than --memory {memory}; "
                f"the largest that fits is {memory_section['largest_micro_batch']}")
    if as_json:
        out = report.to_dict()
        if optimizer is not None:
            out["optimizer"] = optimizer
        if memory_section is not None:
            out["memory"] = memory_section
            out["warnings"] = warnings
        typer.echo(json.dumps(out, indent=2, sort_keys=True))
    else:
        from rich.console import Console

        console = Console(width=max(Console().width, 120))  # the arithmetic column reads best unwrapped
        console.print(plan_table(report))
        if memory_section is not None:
            from .memory import memory_table

            console.print(memory_table(memory_section))
        if report.priors:
            console.print("priors are scaling-law predictions, not measurements: measure with `globalbatch sweep`/`noise`.")
    for w in warnings:
        typer.echo(f"warning: {w}", err=True)


def _memory_inputs(memory: str, *, params: Optional[str], dp: Optional[int], optimizer: Optional[str],
                   precision: Optional[str], sharding: Optional[str], activation_bytes: Optional[str],
                   checkpoint_divisor: Optional[float], task: Optional[str], task_arg: list[str]) -> tuple:
    """Check every ``plan --memory`` flag (before anything is printed), then measure the task if one is given."""
    from ._util import SettingError, flag_names, parse_task_args
    from .memory import Activations, MemoryConfig
    from .plan import parse_bytes, parse_count

    device_bytes = parse_bytes(memory, "--memory")
    if device_bytes < 1:
        raise ValueError(f"--memory {memory} is not allowed; allowed: a device memory of at least 1 byte")
    if task is not None and (params is not None or activation_bytes is not None):
        given = "--params" if params is not None else "--activation-bytes-per-sample"
        raise ValueError(f"{given} is not allowed with --task {task}: the task's model gives it; "
                         "allowed: --task, or --params with --activation-bytes-per-sample")
    if task is None:
        if params is None:
            raise ValueError("--memory needs --params (e.g. 7B) or --task; allowed: add one of them")
        if activation_bytes is None:
            raise ValueError("--memory needs --activation-bytes-per-sample (e.g. 1.5GiB) or --task to measure it; "
                             "allowed: add one of them")
    if task_arg and task is None:
        raise ValueError("--task-arg is not allowed without --task; allowed: add --task, e.g. --task tinygpt")
    per_sample = None
    if activation_bytes is not None:
        per_sample = parse_bytes(activation_bytes, "--activation-bytes-per-sample")
        if per_sample < 1:
            raise ValueError(f"--activation-bytes-per-sample {activation_bytes} is not allowed; allowed: at least 1 byte")
    names = {"params": "--params", "optimizer": "--optimizer", "precision": "--precision", "sharding": "--sharding",
             "dp_world_size": "--dp", "checkpoint_divisor": "--checkpoint-divisor"}
    common = dict(optimizer=optimizer or "adamw", precision=precision or "fp32", sharding=sharding or "none",
                  dp_world_size=1 if dp is None else dp,
                  checkpoint_divisor=1.0 if checkpoint_divisor is None else checkpoint_divisor)
    with flag_names(names):
        MemoryConfig(params=1 if params is None else parse_count(params, "--params"), **common)  # check the flags
    if task is None:
        cfg = MemoryConfig(params=parse_count(params, "--params"), **common)
        return device_bytes, cfg, Activations(bytes_per_sample=float(per_sample), source="given")
    from ._util import load_task_checked
    from .probe.activations import task_memory_inputs

    with flag_names({"task": "--task", "task_overrides": "--task-arg"}):
        try:
            task_obj = load_task_checked(task, parse_task_args(task_arg))
        except SettingError:
            raise
        except ValueError as exc:
            raise SettingError("task", task, "tinygpt, mnist or package.module:function", why=str(exc)) from None
    n, shapes, acts = task_memory_inputs(task_obj, device="cpu")
    return device_bytes, MemoryConfig(params=n, param_shapes=shapes, **common), acts


def _memory_section(inputs: tuple, micro_batch: Optional[int]) -> dict:
    from .memory import memory_report

    device_bytes, cfg, acts = inputs
    return memory_report(cfg, acts, device_bytes, micro_batch=micro_batch)


def _print_memory(inputs: tuple, micro_batch: Optional[int], as_json: bool) -> None:
    import json

    report = _memory_section(inputs, micro_batch)
    if as_json:
        typer.echo(json.dumps({"memory": report}, indent=2, sort_keys=True))
        return
    from rich.console import Console

    from .memory import memory_table

    Console(width=max(Console().width, 120)).print(memory_table(report))
    if report["largest_micro_batch"] == 0:
        typer.echo("warning: not even micro-batch 1 fits: the static bytes alone exceed --memory", err=True)


@app.command("probe", short_help="Find the largest micro-batch that fits and the fastest one.")
def probe_cmd(
    task: str = typer.Option("tinygpt", "--task", help="Task: tinygpt, mnist or package.module:function."),
    global_batch: Optional[int] = typer.Option(None, "--global-batch", help="Samples (sequences) per optimizer step, all ranks; reports the accum that keeps it."),
    dp: int = typer.Option(1, "--dp", help="Data-parallel world size for the global-batch arithmetic."),
    memory_limit: Optional[str] = typer.Option(None, "--memory-limit", help="Memory budget, e.g. 8GiB: a larger measured peak counts as out of memory."),
    max_micro_batch: Optional[int] = typer.Option(None, "--max-micro-batch", help="Largest size tried (default global ÷ dp, else 8192)."),
    steps_per_trial: int = typer.Option(3, "--steps-per-trial", help="Timed training steps per trial (after 2 untimed warm-up steps)."),
    tolerance: float = typer.Option(0.05, "--throughput-tolerance", help="Fastest = smallest micro-batch within this fraction of the best tokens/s."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:N or mps (default cuda when available)."),
    precision: PrecisionName = typer.Option("fp32", "--precision", help="fp32, bf16 (autocast) or fp16 (autocast)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON with stable snake_case keys."),
    task_arg: list[str] = typer.Option([], "--task-arg", help="Task override KEY=VALUE (repeatable), e.g. d_model=64."),
) -> None:
    """Find the largest micro-batch that fits and the fastest one; keep the global batch with accumulation."""
    import json
    import logging

    from . import validate as V
    from ._util import load_task_checked, parse_task_args
    from .plan import parse_bytes
    from .lab.probe_run import probe_task
    from .probe import NothingFits, check_probe_settings, format_bytes, geometry_text, limit_text, probe_table

    overrides = parse_task_args(task_arg)
    limit = None if memory_limit is None else parse_bytes(memory_limit, "--memory-limit")
    if limit is not None and limit < 1:
        raise ValueError(f"--memory-limit {memory_limit} is not allowed; allowed: a budget of at least 1 byte")
    check_probe_settings(global_batch=global_batch, dp_world_size=dp, max_micro_batch=max_micro_batch,
                         steps_per_trial=steps_per_trial, tolerance=tolerance, names=flag_names_of("probe"))
    V.device(device, "device", precision=precision, default_cuda=True)
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
            raise ValueError(f"--memory-limit {memory_limit} is too small: micro_batch 1 needs {format_bytes(peak)} "
                             "(peak measured); allowed: a limit above that") from None
        raise ValueError(f"--task {task} does not fit: micro_batch 1 ran out of memory ({exc.trial.note}); "
                         "allowed: a smaller model (--task-arg) or a device with more memory") from None
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


def _parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` → ``[0, 1, 2]``; one error line naming --seeds otherwise."""
    from ._util import SettingError

    items = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        vals = [int(t) for t in items]
    except ValueError:
        vals = []
    if not vals or any(v < 0 for v in vals) or len(set(vals)) != len(vals):
        raise SettingError("seeds", text, "distinct whole numbers ≥ 0, comma-separated, e.g. 0,1,2")
    return vals


def _parse_units(text: str, flag: str) -> int:
    """``"10K"`` → 10000, ``"0"`` → 0 (a count of units that may be zero)."""
    from .plan import parse_count

    return 0 if str(text).strip() in ("0", "0.0") else parse_count(text, flag)


def _print_seed_analysis(data, sa) -> None:
    """The tables over seeds, the recommendation and the warnings, on the terminal."""
    from rich.console import Console

    from .lab.report import seed_tables

    Console(width=max(Console().width, 160)).print(seed_tables(data, sa))
    if sa.joint is not None:
        j = sa.joint
        typer.echo(f"joint fit over targets and seeds: B_crit(L) = {j.b_ref:,.0f}·(L/{j.loss_ref:.3f})^{j.k:.2f} "
                   f"(SE of the exponent {j.se_k:.2f}; Kaplan α_B = {j.alpha_b:.2f}); "
                   f"{sa.monotone_share():.0%} of seed × target cells monotone")
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

    from .lab.report import analysis_table

    Console(width=max(Console().width, 140)).print(analysis_table(res.data, res.analysis))
    if res.analysis.recommendation is not None:
        typer.echo(res.analysis.recommendation.text())
    for w in res.analysis.warnings:
        typer.echo(f"warning: {w}", err=True)


@app.command("sweep", short_help="Batch × LR sweep at equal tokens; fit the critical batch.")
def sweep_cmd(
    task: str = typer.Option("tinygpt", "--task", help="Task: tinygpt, mnist or package.module:function."),
    batches: str = typer.Option("16,32,64,128,256", "--batches", help="Global batch sizes in samples (sequences) per step, comma-separated."),
    lrs: str = typer.Option("3e-4,1e-3,3e-3", "--lrs", help="Peak learning rates, comma-separated; every batch runs every LR."),
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
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Samples per forward/backward (default min(batch, 16))."),
    eval_every: Optional[str] = typer.Option(None, "--eval-every", help="Units between held-out evaluations (default: --eval-points log-spaced ones)."),
    eval_points: int = typer.Option(32, "--eval-points", help="Log-spaced held-out evaluations per trial (≥ 30 for a sound read-out)."),
    val_samples: int = typer.Option(512, "--val-samples", help="Held-out samples per evaluation (a fixed random draw, the same for every trial)."),
    optimizer: OptimizerName = typer.Option("adamw", "--optimizer", help="A registry optimizer: " + _OPTIMIZERS + "."),
    task_arg: list[str] = typer.Option([], "--task-arg", help="Task override KEY=VALUE (repeatable), e.g. d_model=64."),
    noise: bool = typer.Option(False, "--noise", help="Also log the gradient noise scale B_simple at every evaluation (the report plots it)."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:N or mps (checked before anything is written)."),
    precision: PrecisionName = typer.Option("fp32", "--precision", help="fp32, bf16 (autocast) or fp16 (autocast + GradScaler)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON with stable snake_case keys instead of tables (progress stays on stderr)."),
) -> None:
    """Train every batch × LR on the same data order and token budget, then fit the critical batch."""
    from rich.console import Console

    from types import SimpleNamespace

    from . import validate as V
    from ._util import flag_names, parse_task_args
    from .lab.report import seed_analysis_or_note, seed_json
    from .lab.sweep import SweepConfig, analyze_sweep, run_sweep

    with flag_names(flag_names_of("sweep")):
        V.out_dir(out, "out")
        cfg = SweepConfig(task=task, task_overrides=parse_task_args(task_arg),
                          batches=V.count_list(batches, "batches"), lrs=V.number_list(lrs, "lrs"),
                          budget=V.count(tokens, "budget", what="a whole number of units"), seed=seed,
                          seeds=None if seeds is None else _parse_seeds(seeds),
                          warmup=None if warmup is None else _parse_units(warmup, "--warmup"),
                          warmup_min_steps=warmup_min_steps, lr_rule=lr_rule, base_batch=base_batch, lr_edge_extend=lr_edge_extend,
                          eval_points=eval_points, max_val_samples=val_samples,
                          micro_batch=micro_batch,
                          eval_every=None if eval_every is None else V.count(eval_every, "eval_every"),
                          optimizer=optimizer, noise=noise, device=device, precision=precision)
        console = Console(stderr=True)
        result = run_sweep(cfg, out, workers=workers, threads=threads, backend=backend, address=address,
                           progress=not as_json)
    data, analysis = analyze_sweep(out)
    sa, note = seed_analysis_or_note(out)
    if note is not None:
        analysis.warnings.append(note)
    if as_json:
        _echo_json({"out_dir": result.out_dir, "ran": result.ran, "skipped": result.skipped,
                    "wall_time_s": result.wall_time_s, "workers": result.workers,
                    "threads_per_worker": result.threads_per_worker, "analysis": analysis.to_dict(),
                    "seeds": None if sa is None else seed_json(data, sa),
                    "recommendation": None if analysis.recommendation is None else analysis.recommendation.text(),
                    "warnings": list(analysis.warnings)})
        return
    console.print(f"sweep {out}: {len(result.ran)} trial(s) run, {len(result.skipped)} already finished, "
                  f"{result.wall_time_s:,.1f} s ({result.workers} worker(s) × {result.threads_per_worker} thread(s))")
    _print_report(SimpleNamespace(data=data, analysis=analysis, seed_analysis=sa))
    typer.echo(f"report: globalbatch report {out}")


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
    as_json: bool = typer.Option(False, "--json", help="Print the analysis over seeds as JSON (stable snake_case keys: targets with b_crit, b_crit_per_seed, steps_to_target, monotone; recommendation with batch, lr, per_seed, probability_fastest) instead of the tables."),
) -> None:
    """Write PNG plots and a self-contained HTML report of a sweep, with the recommended batch."""

    from . import validate as V
    from ._util import flag_names
    from .lab.report import seed_json, write_report

    with flag_names(flag_names_of("report")):
        V.existing_dir(run_dir, "run_dir", allowed="a sweep directory (written by globalbatch sweep)")
        target_list = None if targets is None else V.number_list(targets, "targets", positive_only=False)
        with V.created_out_dir(out if out is not None else str(Path(run_dir) / "report"), "out"):
            res = write_report(run_dir, out, targets=target_list, objective=objective, tolerance=tolerance,
                               ema_fraction=ema_fraction, halflife_steps=half_life_steps, readout=readout,
                               seed_targets=target_list)
    if as_json:
        doc = seed_json(res.data, res.seed_analysis) if res.seed_analysis is not None else {
            "recommendation": None, "warnings": []}
        doc.update({"html": str(res.html), "plots": [str(p) for p in res.plots],
                    "first_seed_recommendation": None if res.analysis.recommendation is None
                    else res.analysis.recommendation.text()})
        doc["warnings"] = list(doc["warnings"]) + [w for w in res.analysis.warnings if w not in doc["warnings"]]
        _echo_json(doc)
        return
    _print_report(res)
    typer.echo(f"wrote {res.html} and {len(res.plots)} plot(s)")


@app.command("noise", short_help="Measure the gradient noise scale B_simple with its interval.")
def noise_cmd(
    task: str = typer.Option("tinygpt", "--task", help="Task: tinygpt, mnist or package.module:function."),
    micro_batch: int = typer.Option(8, "--micro-batch", help="Samples (sequences) per forward/backward per rank."),
    grad_accum: int = typer.Option(4, "--grad-accum", help="Micro-batches per step; on one process ≥ 2 (they are the small batches)."),
    steps: int = typer.Option(50, "--steps", help="Optimizer steps (windows) to train and measure."),
    lr: float = typer.Option(1e-3, "--lr", help="Constant learning rate (B_simple depends on it; it is logged)."),
    optimizer: OptimizerName = typer.Option("adamw", "--optimizer", help="A registry optimizer: " + _OPTIMIZERS + " (the same recipe as sweep)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the model init and the data order."),
    log_every: int = typer.Option(5, "--log-every", help="Steps between estimates (rows of the curve)."),
    half_life_windows: float = typer.Option(10.0, "--half-life-windows", help="EMA half-life in windows of the global batch (forgetting is per unit)."),
    adam_variant: bool = typer.Option(False, "--adam-variant", help="Also report the Adam-preconditioned variant g/(√v̂+eps)."),
    out: str = typer.Option("runs/noise", "--out", help="Directory for noise.csv (and tb/ with --tensorboard)."),
    tensorboard: bool = typer.Option(False, "--tensorboard", help="Also write TensorBoard scalars (pip install 'globalbatch[tensorboard]')."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:N or mps (default cuda when available)."),
    precision: PrecisionName = typer.Option("fp32", "--precision", help="fp32, bf16 (autocast) or fp16 (autocast + GradScaler)."),
    task_arg: list[str] = typer.Option([], "--task-arg", help="Task override KEY=VALUE (repeatable), e.g. d_model=64."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Torch threads (default: all cores)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON with stable snake_case keys instead of tables (progress stays on stderr)."),
) -> None:
    """Measure the gradient noise scale B_simple (McCandlish et al. 2018) over a short training run."""
    import dataclasses
    import os

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from . import validate as V
    from ._util import flag_names, parse_task_args
    from .lab.noise_run import NoiseRunConfig, check_noise_settings, format_estimate, format_interval, measure_noise

    names = flag_names_of("noise")
    check_noise_settings(micro_batch=micro_batch, grad_accum_steps=grad_accum, steps=steps, lr=lr, optimizer=optimizer,
                         log_every=log_every, half_life_windows=half_life_windows, adam_variant=adam_variant,
                         threads=threads, world_size=int(os.environ.get("WORLD_SIZE", "1")), names=names)
    V.positive(lr, "lr")
    V.positive(half_life_windows, "half_life_windows")
    V.out_dir(out, "out")
    V.device(device, "device", precision=precision, default_cuda=True)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    cfg = NoiseRunConfig(task=task, task_overrides=parse_task_args(task_arg), micro_batch=micro_batch,
                         grad_accum_steps=grad_accum, steps=steps, lr=lr, optimizer=optimizer, seed=seed,
                         log_every=log_every, half_life_windows=half_life_windows, adam_variant=adam_variant,
                         device=device, precision=precision)
    console = Console(width=max(Console().width, 140))
    header = [f"noise: {task}, {micro_batch} samples × {grad_accum} accum per rank, {steps} steps, lr {lr:g} "
              f"({optimizer}); EMA half-life {half_life_windows:g} windows"]

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
    except ImportError as exc:
        raise ValueError(f"--tensorboard: {exc}") from exc
    if not result.rows:
        return  # not rank 0
    if as_json:
        _echo_json({"unit": result.unit, "dp_world_size": result.dp_world_size, "csv": result.csv_path,
                    "rows": result.rows, "final": {k: dataclasses.asdict(e) for k, e in result.final.items()}})
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
    if result.csv_path:
        console.print(f"wrote {result.csv_path}" + (f" and {out}/tb" if tensorboard else ""))


def _rate_text(row: dict) -> str:
    """``  1,234 valid tok/s  MFU 12.3%`` for a noise row (nothing for what is not known)."""
    parts = []
    if row.get("valid_tokens_per_s") == row.get("valid_tokens_per_s") and row.get("valid_tokens_per_s") is not None:
        parts.append(f"{row['valid_tokens_per_s']:,.0f} valid tok/s")
    if row.get("mfu") == row.get("mfu") and row.get("mfu") is not None:
        parts.append(f"MFU {row['mfu']:.1%}")
    return ("  " + "  ".join(parts)) if parts else ""


@app.command("branch", short_help="Branch test (Merrill et al. 2025): the largest safe batch multiple k.")
def branch_cmd(
    task: str = typer.Option("tinygpt", "--task", help="Task: tinygpt, mnist or package.module:function."),
    base_batch: int = typer.Option(16, "--base-batch", help="Batch of the base run, in samples (sequences) per step."),
    ks: str = typer.Option("1,2,4,8", "--ks", help="Batch multipliers to branch at, comma-separated; must include 1."),
    lr: float = typer.Option(1e-3, "--lr", help="LR of the base run; a k-branch uses lr·√k (adamw) or lr·k (sgd)."),
    warmup_tokens: str = typer.Option("200K", "--warmup-tokens", help="Units the base run trains before branching; a comma list branches at several points."),
    window_tokens: str = typer.Option("100K", "--window-tokens", help="Units every branch trains."),
    seeds: int = typer.Option(3, "--seeds", help="Branches per k, each with its own data order (>= 2)."),
    tolerance: float = typer.Option(0.01, "--loss-tolerance", help="Loss increase over k=1 that still counts as equal (Merrill et al.: 0.01)."),
    alpha: float = typer.Option(0.05, "--alpha", help="Level of the one-sided t-test per k."),
    metric: Metric = typer.Option("val", "--metric", help="val (validation loss at the end of the window) or train (last quarter's training loss)."),
    test: Test = typer.Option("paired", "--test", help="paired (per-seed differences) or welch."),
    optimizer: OptimizerName = typer.Option("adamw", "--optimizer", help="A registry optimizer (" + _OPTIMIZERS + "); LR × √k for Adam-type, × k for SGD-type."),
    out: str = typer.Option("runs/branch", "--out", help="Output directory; rerunning reuses finished branches (a larger --seeds adds only the new seeds' branches)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the model init and the base run's data order."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Samples per forward/backward (default min(batch, 16))."),
    task_arg: list[str] = typer.Option([], "--task-arg", help="Task override KEY=VALUE (repeatable)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Torch threads (default: all cores)."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:N or mps (checked before anything is written)."),
    precision: PrecisionName = typer.Option("fp32", "--precision", help="fp32, bf16 (autocast) or fp16 (autocast + GradScaler)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON with stable snake_case keys instead of tables (progress stays on stderr)."),
) -> None:
    """Merrill et al. 2025 branch test: the largest k whose k× batch branches are not worse than k = 1."""
    from . import validate as V
    from ._util import flag_names, parse_task_args
    from .lab.branch import BranchConfig, run_branch_test

    with flag_names(flag_names_of("branch")):
        V.out_dir(out, "out")
        V.whole(base_batch, "base_batch", maximum=V.MAX_BATCH)
        k_list = V.count_list(ks, "ks", allowed="whole numbers ≥ 1 including 1, e.g. 1,2,4,8")
        V.whole(base_batch * max(k_list), "base_batch", maximum=V.MAX_BATCH)
        cfg = BranchConfig(task=task, task_overrides=parse_task_args(task_arg), base_batch=base_batch,
                           ks=k_list, lr=V.positive(lr, "lr"), optimizer=optimizer,
                           branch_at=V.count_list(warmup_tokens, "branch_at", maximum=V.MAX_COUNT,
                                                  allowed="unit counts ≥ 1, e.g. 200K or 100K,200K"),
                           window=V.count(window_tokens, "window", what="a whole number of units"), seeds=seeds, seed=seed,
                           micro_batch=micro_batch, tolerance=tolerance, alpha=alpha, metric=metric, test=test,
                           device=device, precision=precision)
        result = run_branch_test(cfg, out, threads=threads, progress=not as_json)
    if as_json:
        _echo_json(result.to_dict())
        return
    typer.echo(result.text())
    typer.echo(f"wrote {out}/result.json")


@app.command("adaptive", short_help="An adaptive global batch (noise-tracking or goodput) vs fixed batches, over seeds.")
def adaptive_cmd(
    task: str = typer.Option("tinygpt", "--task", help="Task: tinygpt (default: the demo's settings), mnist or package.module:function."),
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
    optimizer: OptimizerName = typer.Option("adamw", "--optimizer", help="A registry optimizer: " + _OPTIMIZERS + " (pick --lr-rule to match: sqrt for Adam-type, linear for SGD)."),
    target: list[float] = typer.Option([], "--target", help="Held-out loss target (repeatable); default two: every fixed batch's final loss reaches it (worst + 0.01), and half of them do (median + 0.01)."),
    task_arg: list[str] = typer.Option([], "--task-arg", help="Task override KEY=VALUE (repeatable)."),
    out: str = typer.Option("runs/adaptive", "--out", help="Output directory; rerunning resumes it (finished runs are kept; --seeds may grow)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Torch threads (default: all cores)."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:N or mps (checked before anything is written)."),
    precision: PrecisionName = typer.Option("fp32", "--precision", help="fp32, bf16 (autocast) or fp16 (autocast + GradScaler)."),
    as_json: bool = typer.Option(False, "--json", help="Print the analyses as JSON (stable snake_case keys) instead of tables (progress stays on stderr)."),
) -> None:
    """Train the adaptive policy and each fixed batch at equal tokens on every seed; report loss vs tokens/steps,
    the batch over time and tokens-/steps-to-target with intervals."""
    import math

    from . import validate as V
    from ._util import SettingError, flag_names, parse_list, parse_task_args
    from .lab.adaptive_report import format_analysis, write_adaptive_report
    from .lab.adaptive_run import AdaptiveConfig, run_adaptive
    from .lab.sweep import demo_config
    from .plan import parse_count

    with flag_names(flag_names_of("adaptive")):
        V.out_dir(out, "out")
        overrides = parse_task_args(task_arg)
        if task == "tinygpt":
            overrides = {**demo_config().task_overrides, **overrides}
        cfg = AdaptiveConfig(task=task, task_overrides=overrides, policy=policy,
                             batches=parse_list(batches, "--batches", int), lr=lr, base_batch=lr_base_batch,
                             initial_batch=initial_batch,
                             lr_rule=lr_rule, c=c, throughput_from=throughput_from, max_batch=max_batch, powers_of_two=not any_batch,
                             decide_every=decide_every, min_interval_steps=min_interval, patience=patience,
                             budget=parse_count(tokens, "--tokens"),
                             seeds=parse_list(seeds, "--seeds", int, allowed="whole numbers ≥ 0, e.g. 1,2,3"),
                             micro_batch=micro_batch, optimizer=optimizer, device=device, precision=precision)
        for t in target:
            if not (t > 0 and math.isfinite(t)):
                raise SettingError("target", t, "a finite held-out loss > 0")
        result = run_adaptive(cfg, out, threads=threads, log=lambda m: typer.echo(m, err=True))
    typer.echo(f"{len(result.ran)} run(s) trained, {len(result.skipped)} already finished, {result.wall_time_s:,.0f} s",
               err=True)
    analyses, files = write_adaptive_report(out, targets=target or None)
    if as_json:
        _echo_json({"analyses": [a.as_dict() for a in analyses], "files": files})
        return
    for analysis in analyses:
        typer.echo(format_analysis(analysis))
    typer.echo(f"report: {files[-1]}")


@app.command("demo", short_help="Quick sweep of a small tinygpt and its report (the main job).")
def demo_cmd(
    out: str = typer.Option("demo_out", "--out", help="Output directory of the demo sweep and its report."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Trials at once (default: min(trials, cores))."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:N or mps (checked before anything is written)."),
    precision: PrecisionName = typer.Option("fp32", "--precision", help="fp32, bf16 (autocast) or fp16 (autocast + GradScaler)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON with stable snake_case keys instead of tables (progress stays on stderr)."),
) -> None:
    """A quick sweep of a small tinygpt (a few minutes on 2 CPU cores), then the HTML report."""
    import time

    from rich.console import Console

    import dataclasses

    from . import validate as V
    from ._util import SettingError, flag_names
    from .lab.report import seed_json, write_report
    from .lab.sweep import demo_config, run_sweep

    t0 = time.time()
    with flag_names(flag_names_of("demo")):
        cfg = dataclasses.replace(demo_config(), device=device, precision=precision)
        V.device(device, "device", precision=precision)  # before the banner: a bad flag is one line
        if workers is not None:
            V.whole(workers, "workers")
        V.out_dir(out, "out")
        from .lab.rundir import lock_holder

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
        _echo_json({"out_dir": result.out_dir, "wall_time_s": result.wall_time_s, "report": str(res.html),
                    "analysis": res.analysis.to_dict(), "warnings": list(res.analysis.warnings),
                    "seeds": None if res.seed_analysis is None else seed_json(res.data, res.seed_analysis),
                    "recommendation": None if res.analysis.recommendation is None else res.analysis.recommendation.text()})
        return
    _print_report(res)
    typer.echo(f"sweep {result.wall_time_s:,.0f} s, total {time.time() - t0:,.0f} s; report: {res.html}")


def _choices_of(param: Any) -> tuple:
    """The values of a ``Literal[...]`` (or ``Optional[Literal[...]]``) option; () for any other."""
    t = getattr(getattr(param, "type_descriptor", None), "annotation", None)  # typer 0.29's record of the hint
    for cand in (t, *get_args(t)):
        if get_origin(cand) is Literal:
            return get_args(cand)
    return ()


def _usage_error_line(exc: Exception, argv: list[str]) -> str:
    """click's BadParameter as ``--dp 'abc' is not allowed; allowed: a whole number``."""
    param = getattr(exc, "param", None)
    opts = list(getattr(param, "opts", []) or [])
    if type(exc).__name__ == "MissingParameter" and param is not None:
        name = opts[0] if getattr(param, "param_type_name", "") == "option" and opts else str(param.name).upper()
        return f"{name} is missing; allowed: see --help"
    text = exc.format_message().lower()
    kind = getattr(getattr(param, "type", None), "name", "") or text  # click has .type; typer >= 0.2x does not
    choices = _choices_of(param)
    allowed = ", ".join(choices) if choices else next(
        (a for key, a in (("integer", "a whole number"), ("float", "a number"), ("number", "a number"),
                          ("bool", "true or false")) if key in kind), None)
    if opts and allowed:
        for i, tok in enumerate(argv):
            for opt in opts:
                if tok == opt and i + 1 < len(argv):
                    return f"{opt} {argv[i + 1]!r} is not allowed; allowed: {allowed}"
                if tok.startswith(opt + "="):
                    return f"{opt} {tok[len(opt) + 1:]!r} is not allowed; allowed: {allowed}"
    return " ".join(exc.format_message().split())


def main(argv: Optional[list[str]] = None) -> None:
    """Console-script entry point with one-line errors and exit code 2."""
    import os

    args = list(sys.argv[1:] if argv is None else argv)
    prog = os.path.basename(sys.argv[0]) if argv is None and sys.argv and sys.argv[0] else "globalbatch"
    if prog not in ("globalbatch", "gbs"):
        prog = "globalbatch"
    command = typer.main.get_command(app)
    command.context_settings = {**(command.context_settings or {}), "help_option_names": ["-h", "--help"]}
    try:
        rv = command.main(args=args, prog_name=prog, standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        sys.exit(130)
    except (ValueError, FileNotFoundError, IsADirectoryError) as exc:
        from ._util import SettingError

        sub = args[0] if args and not args[0].startswith("-") else None
        text = _setting_line(exc, sub) if isinstance(exc, SettingError) else str(exc)
        typer.echo("error: " + " ".join(text.split()), err=True)  # one line, whatever the message holds
        sys.exit(2)
    except Exception as exc:
        # click's (or typer's vendored click's) usage errors: bad flag, bad value, missing argument.
        if not hasattr(exc, "format_message"):
            raise
        if type(exc).__name__ == "NoArgsIsHelpError" and getattr(exc, "ctx", None) is not None:
            typer.echo(exc.ctx.get_help())
            sys.exit(0)
        typer.echo(f"error: {_usage_error_line(exc, args)}", err=True)
        sys.exit(getattr(exc, "exit_code", 2) or 2)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
