"""``globalbatch plan``: the batch geometry, its checks and the memory model (no torch needed)."""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any, Callable, Optional, cast

import typer

from globalbatch.cli.app import app, flag_names_of, LrRule
from globalbatch.plan.settings import COUNT_FIELDS, PlanConfig
from globalbatch.validate import field_types

HELP = {
    "config": "YAML/TOML (our schema), DeepSpeed JSON or HF TrainingArguments JSON.",
    "global_batch": "Sequences per optimizer step, all ranks.",
    "micro_batch": "Sequences per forward/backward per rank.",
    "grad_accum_steps": "Micro-batches accumulated per optimizer step.",
    "dp": "Data-parallel world size. With --config: a new world size; the global batch stays fixed and accum is re-derived.",
    "round_down": "When the new --dp does not divide, round the global batch down and say how much is dropped.",
    "seq_len": "Tokens per sequence (padded).",
    "valid_tokens_per_seq": "Mean non-padding tokens per sequence.",
    "padding_fraction": "Share of token slots that are padding, 0 ≤ x < 1.",
    "total_tokens": "Training budget in tokens, e.g. 100B.",
    "lr": "Learning rate (tuned at --lr-base-batch if given).",
    "lr_base_batch": "Global batch (sequences) at which --lr was tuned.",
    "lr_rule": "linear | sqrt | none (default sqrt, or --optimizer's rule).",
    "optimizer": "A registry name (adamw, sgd, lars, lamb): its LR rule is the default --lr-rule; with --memory also its state bytes (plus sgd-plain, sgd-momentum, adafactor; default adamw).",
    "warmup_tokens": "Warmup in tokens, e.g. 375M (converted to steps).",
    "warmup_steps": "Warmup in steps (converted to tokens).",
    "pp_stages": "Pipeline stages p (micro-batches per step m = grad accum).",
    "virtual_stages": "Interleaved virtual stages v (default 1).",
    "max_bubble": "Bubble target (fraction of compute) for the smallest-global-batch hint.",
    "params": "Model parameters N, e.g. 7B (all-reduce volume, priors).",
    "grad_bytes_per_param": "Bytes per gradient element (4 fp32, 2 bf16; default 4).",
    "sync_every_micro_step": "All-reduce on every micro-step (no no_sync).",
    "compute_flops": "Training FLOPs C for the DeepSeek prior (default 6·N·D).",
    "loss_nats": "Loss in nats/token for the Kaplan B_crit prior.",
    "memory": "Device memory, e.g. 80GiB: predict the largest micro-batch and show the memory breakdown (needs --params and --activation-bytes-per-sample, or --task).",
    "precision": "With --memory: fp32 or bf16-mixed (bf16 weights/grads, fp32 master; default fp32).",
    "sharding": "With --memory: none, zero1, zero2, zero3 or fsdp, over --dp ranks (default none).",
    "activation_bytes": "With --memory: activation bytes per sample, e.g. 1.5GiB (else measured with --task).",
    "checkpoint_divisor": "With --memory: activation checkpointing divides activations by this (default 1: none).",
    "task": "With --memory: measure params and activations of this task (tinygpt, mnist, package.module:function or path/to/file.py:function; needs torch).",
    "task_arg": "With --task: override KEY=VALUE (repeatable), e.g. d_model=64.",
    "batch_schedule": "A batch schedule in tokens, e.g. '0:256 2B:512' (what `globalbatch scale` proposes and StepDriver takes): each stage's accum and steps; the first stage is the plan's global batch.",
    "as_json": "Print JSON with stable snake_case keys.",
}
"""Every option of ``globalbatch plan``, in ``--help`` order: parameter → help. The flag is the parameter's name
with dashes (:data:`FLAGS` where not); the type is declared by :func:`plan_cmd`, or else by :class:`PlanConfig`'s
field of the same name (which the option sets; counts as strings, ``'100B'``) or by :data:`MEMORY_FLAGS`."""

FLAGS = {"grad_accum_steps": "--grad-accum", "compute_flops": "--compute", "loss_nats": "--loss",
         "activation_bytes": "--activation-bytes-per-sample", "as_json": "--json"}
"""Parameter → flag, where the flag is not the parameter's name with dashes."""

MEMORY_FLAGS: dict[str, Any] = {"precision": str, "sharding": str, "activation_bytes": str,
                                "checkpoint_divisor": float, "task": str, "task_arg": list[str]}
"""The options that need ``--memory``, with their types."""


def _flag(name: str) -> str:
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def _option_type(name: str) -> Any:
    """The type of an option :func:`plan_cmd` does not declare (see :data:`HELP`)."""
    if name in MEMORY_FLAGS:
        kind = MEMORY_FLAGS[name]
        return kind if kind == list[str] else Optional[kind]
    if name == "lr_rule":
        return Optional[LrRule]
    kind = str if name in COUNT_FIELDS else {"int": int, "float": float}[field_types(PlanConfig)[name][0]]
    return Optional[kind]


def _with_options(command: Callable[..., None]) -> Callable[..., None]:
    """Give ``command`` one typer option per :data:`HELP` entry: its own parameters as declared, the others
    (passed in ``**given``) typed by :func:`_option_type`, unset by default."""
    own = inspect.signature(command, eval_str=True).parameters
    params = []
    for name, text in HELP.items():
        kind = own[name].annotation if name in own else _option_type(name)
        default = own[name].default if name in own else [] if kind == list[str] else None
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=kind,
                                        default=typer.Option(default, _flag(name), help=text)))
    command.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    return command


@app.command("plan", short_help="State, check and derive the batch geometry of a run (no torch needed).")
@_with_options
def plan_cmd(
    *,
    config: Optional[str] = None,
    dp: Optional[int] = None,
    round_down: bool = False,
    optimizer: Optional[str] = None,
    sync_every_micro_step: bool = False,
    memory: Optional[str] = None,
    batch_schedule: Optional[str] = None,
    as_json: bool = False,
    **given: Any,
) -> None:
    """State the whole batch geometry of a run, check it, and say what follows from it."""

    from .. import plan as P
    from ..errors import Raw, SettingError
    from ..plan.report import make_plan, plan_table

    memory_given = {name: given.pop(name) for name in MEMORY_FLAGS}
    settings = given  # the PlanConfig fields, as typed (counts still strings)
    global_batch, micro_batch, grad_accum = settings["global_batch"], settings["micro_batch"], settings["grad_accum_steps"]
    seq_len, total_tokens = settings["seq_len"], settings["total_tokens"]

    if optimizer is not None:  # the registry's table imports no torch
        from ..optim.registry import lr_scaling_rule, optimizer_names

        from ..plan.memory import OPTIMIZER_STATES

        if optimizer not in optimizer_names():
            if memory is None and optimizer in OPTIMIZER_STATES:
                raise SettingError("--optimizer", optimizer, f"{', '.join(optimizer_names())} (the registry; "
                                   f"{optimizer} names optimizer state for --memory only)", flag=True)
            if memory is None:
                raise SettingError("--optimizer", optimizer, ", ".join(optimizer_names()), flag=True)
            if optimizer not in OPTIMIZER_STATES:
                raise SettingError("--optimizer", optimizer, ", ".join(dict.fromkeys(
                    [*optimizer_names(), *OPTIMIZER_STATES])), flag=True)
        if settings["lr_rule"] is None and optimizer in optimizer_names():
            settings["lr_rule"] = cast(LrRule, lr_scaling_rule(optimizer))

    memory_inputs = None
    if memory is None:
        for name, value in memory_given.items():
            if value not in (None, []):  # (an unset --task-arg is an empty list)
                raise SettingError(_flag(name), Raw(value if not isinstance(value, list) else ",".join(value)),
                                   "add --memory DEVICE_BYTES, e.g. --memory 80GiB", why="without --memory", flag=True)
    else:
        params = settings["params"]
        if params is None and config is not None and memory_given["task"] is None:
            params = _config_params(config)  # a --config file's params, checked (and named) as the file's
        memory_inputs = _memory_inputs(memory, params=params, dp=dp, optimizer=optimizer, **memory_given)
    geometry_given = config is not None or any(v is not None for v in (global_batch, micro_batch, grad_accum))
    if memory_inputs is not None and not geometry_given:
        pp_stages = settings["pp_stages"]
        if pp_stages is not None:
            from ..validate import whole

            whole(pp_stages, "--pp-stages")
        _print_memory(memory_inputs, pp_stages, as_json)
        return
    if config is None and batch_schedule is None:  # (a schedule's first stage is the global batch; it needs --micro-batch)
        _check_geometry_given(global_batch, micro_batch, grad_accum)

    flags = {name: float(P.parse_count(v, _flag(name))) if name in COUNT_FIELDS and v is not None else v
             for name, v in settings.items()}
    flags["no_sync"] = False if sync_every_micro_step else None
    schedule = None
    if batch_schedule is not None:
        from ..errors import flag_names
        from ..schedule import parse_step_schedule

        with flag_names({"batch schedule": "--batch-schedule", "batch schedule entry": "--batch-schedule",
                         "batch schedule threshold": "--batch-schedule", "batch schedule batch": "--batch-schedule",
                         "batch schedule first threshold": "--batch-schedule",
                         "batch schedule thresholds": "--batch-schedule"}):
            schedule = parse_step_schedule(batch_schedule)
        first = schedule.first_batch
        if global_batch is not None and global_batch != first:
            raise SettingError("--batch-schedule", batch_schedule, f"a first stage of --global-batch {global_batch}",
                               why=f"its first batch is {first}", flag=True)
        for flag, value in (("--seq-len", seq_len), ("--total-tokens", total_tokens), ("--micro-batch", micro_batch)):
            if value is None:
                raise SettingError("--batch-schedule", batch_schedule, f"with {flag} given (stages count tokens)",
                                   why=f"{flag} is missing", flag=True)
        if grad_accum is None:
            flags["global_batch"] = first
    from ..errors import flag_names as _renamed

    # the first stage of --batch-schedule is the plan's global batch: its errors name that flag
    with _renamed({"global_batch": "--batch-schedule"} if schedule is not None and global_batch is None else {}):
        report = make_plan(config, flags, dp_world_size=dp, round_down=round_down, names=flag_names_of("plan"))
    stages = None
    if schedule is not None and total_tokens is not None and seq_len is not None:  # both checked above
        with flag_names({"global batch": "--batch-schedule", "global_batch": "--batch-schedule"}):
            stages = schedule.stages(total=P.parse_count(total_tokens, "--total-tokens"), micro_batch=report.micro_batch,
                                     dp_world_size=report.dp_world_size, units_per_sample=seq_len)
    warnings = list(report.warnings)
    memory_section = None
    if memory_inputs is not None:
        from ..plan.memory import _fmt_bytes

        memory_section = _memory_section(memory_inputs, report.micro_batch, dp_world_size=report.dp_world_size,
                                         pp_stages=report.pp_stages)
        if not memory_section["fits"]:
            warnings.append(
                f"micro_batch {memory_section['breakdown']['micro_batch']} needs "
                f"{_fmt_bytes(memory_section['breakdown']['total_bytes'])}, more than --memory {memory}; "
                f"the largest that fits is {memory_section['largest_micro_batch']}")
    if as_json:
        out = report.to_dict()
        if optimizer is not None:
            out["optimizer"] = optimizer
        if memory_section is not None:
            out["memory"] = memory_section
            out["warnings"] = warnings
        if stages is not None:
            out["batch_schedule"] = [dataclasses.asdict(st) for st in stages]
        typer.echo(json.dumps(out, indent=2, sort_keys=True))
    else:
        from rich.console import Console

        console = Console(width=max(Console().width, 120))  # the arithmetic column reads best unwrapped
        console.print(plan_table(report))
        if memory_section is not None:
            from ..plan.memory import memory_table

            console.print(memory_table(memory_section))
        if stages is not None:
            console.print(_stages_table(stages, report.micro_batch, report.dp_world_size))
        if report.priors:
            console.print("priors are scaling-law predictions, not measurements: measure with `globalbatch sweep`/`noise`.")
    for w in warnings:
        typer.echo(f"warning: {w}", err=True)


GEOMETRY_FLAGS = ("--global-batch", "--micro-batch", "--grad-accum")
"""Two of these (with ``--dp``, default one rank) give the batch geometry."""


def _check_geometry_given(global_batch: Optional[int], micro_batch: Optional[int], grad_accum: Optional[int]) -> None:
    """Without ``--config``, two of :data:`GEOMETRY_FLAGS`: checked here, so that the error names the flags and
    what is needed instead of a field set to None."""
    given = [(flag, v) for flag, v in zip(GEOMETRY_FLAGS, (global_batch, micro_batch, grad_accum)) if v is not None]
    if len(given) >= 2:
        return
    from ..errors import Raw, SettingError

    allowed = ("two of --global-batch, --micro-batch, --grad-accum (with --dp, default 1 rank), "
               "e.g. --global-batch 256 --micro-batch 8; or --config FILE")
    if not given:
        raise SettingError("plan", Raw("without a batch geometry"), allowed)
    flag, value = given[0]
    others = " or ".join(f for f in GEOMETRY_FLAGS if f != flag)
    raise SettingError(flag, value, f"add {others} (with --dp, default 1 rank); or --config FILE",
                       why="alone: the batch geometry needs two of --global-batch, --micro-batch, --grad-accum",
                       flag=True)


def _config_params(config: str) -> Optional[str]:
    """The parameter count a ``--config`` file of our schema gives (None for DeepSpeed, Transformers or none)."""
    from ..plan.config import _from_mapping, read_config_file

    kind, data = read_config_file(config)
    if kind in ("deepspeed", "hf"):
        return None
    value = _from_mapping(data, kind, str(config)).get("params")
    return None if value is None else str(int(value))


def _memory_inputs(memory: str, *, params: Optional[str], dp: Optional[int], optimizer: Optional[str],
                   precision: Optional[str], sharding: Optional[str], activation_bytes: Optional[str],
                   checkpoint_divisor: Optional[float], task: Optional[str], task_arg: list[str]) -> tuple:
    """Check every ``plan --memory`` flag (before anything is printed), then measure the task if one is given."""
    from .._util import SettingError, flag_names
    from ..errors import Raw
    from ..plan.memory import Activations, MemoryConfig
    from ..plan import parse_bytes, parse_count

    device_bytes = parse_bytes(memory, "--memory")
    if device_bytes < 1:
        raise SettingError("--memory", Raw(memory), "a device memory of at least 1 byte", flag=True)
    if task is not None and (params is not None or activation_bytes is not None):
        given, value = ("--params", params) if params is not None else ("--activation-bytes-per-sample", activation_bytes)
        raise SettingError(given, Raw(value), "--task alone, or --params with --activation-bytes-per-sample",
                           why=f"with --task {task}: the task's model gives it", flag=True)
    if task is None:
        for flag, value, example in (("--params", params, "7B"), ("--activation-bytes-per-sample", activation_bytes,
                                                                   "1.5GiB")):
            if value is None:
                raise SettingError("--memory", Raw(memory), f"with {flag} (e.g. {example}) or --task to measure it",
                                   why=f"{flag} is missing", flag=True)
    if task_arg and task is None:
        raise SettingError("--task-arg", Raw(",".join(task_arg)), "add --task, e.g. --task tinygpt",
                           why="without --task", flag=True)
    per_sample = None
    if activation_bytes is not None:
        per_sample = parse_bytes(activation_bytes, "--activation-bytes-per-sample")
        if per_sample < 1:
            raise SettingError("--activation-bytes-per-sample", Raw(activation_bytes), "at least 1 byte", flag=True)
    names = {"params": "--params", "optimizer": "--optimizer", "precision": "--precision", "sharding": "--sharding",
             "dp_world_size": "--dp", "checkpoint_divisor": "--checkpoint-divisor"}
    common: dict[str, Any] = dict(optimizer=optimizer or "adamw", precision=precision or "fp32", sharding=sharding or "none",
                  dp_world_size=1 if dp is None else dp,
                  checkpoint_divisor=1.0 if checkpoint_divisor is None else checkpoint_divisor)
    with flag_names(names):
        MemoryConfig(params=1 if params is None else parse_count(params, "--params"), **common)  # check the flags
    if task is None:
        cfg = MemoryConfig(params=parse_count(params, "--params"), **common)
        assert per_sample is not None  # without --task, --activation-bytes-per-sample was required above
        return device_bytes, cfg, Activations(bytes_per_sample=float(per_sample), source="given")
    from .. import validate as V
    from ..lab.tasks import load_task_checked
    from ..probe.activations import task_memory_inputs

    with flag_names({"task": "--task", "task_overrides": "--task-arg"}):
        try:
            task_obj = load_task_checked(task, V.key_values(task_arg, "task_arg"))
        except SettingError:
            raise
        except ValueError as exc:
            raise SettingError("task", task, "tinygpt, mnist, package.module:function or path/to/file.py:function",
                               why=str(exc)) from None
    n, shapes, acts = task_memory_inputs(task_obj, device="cpu")
    return device_bytes, MemoryConfig(params=n, param_shapes=shapes, **common), acts


def _memory_section(inputs: tuple, micro_batch: Optional[int], *, dp_world_size: Optional[int] = None,
                    pp_stages: Optional[int] = None) -> dict:
    """The memory section on ``dp_world_size`` ranks (the plan's: a ``--config`` file's included) and per pipeline
    stage (``ceil(params / pp_stages)``; the activations stay the whole model's per sample: under 1F1B the first
    stage holds p micro-batches of 1/p of the layers)."""
    from ..plan.memory import memory_report, one_pipeline_stage

    device_bytes, cfg, acts = inputs
    pp = pp_stages or 1
    cfg = one_pipeline_stage(dataclasses.replace(cfg, dp_world_size=dp_world_size or cfg.dp_world_size), pp)
    return memory_report(cfg, acts, device_bytes, micro_batch=micro_batch, pp_stages=pp)


def _print_memory(inputs: tuple, pp_stages: Optional[int], as_json: bool) -> None:

    report = _memory_section(inputs, None, pp_stages=pp_stages)
    if as_json:
        typer.echo(json.dumps({"memory": report}, indent=2, sort_keys=True))
        return
    from rich.console import Console

    from ..plan.memory import memory_table

    Console(width=max(Console().width, 120)).print(memory_table(report))
    if report["largest_micro_batch"] == 0:
        typer.echo("warning: not even micro-batch 1 fits: the static bytes alone exceed --memory", err=True)


def _stages_table(stages: list, micro_batch: int, dp_world_size: int):
    """The batch schedule's stages: tokens, global batch, accum at micro × dp, optimizer steps."""
    from rich.table import Table

    fmt = "{:,}".format
    table = Table(title="batch schedule (tokens)", title_justify="left")
    for name in ("from", "to", "global batch", "grad accum", "tokens per step", "steps"):
        table.add_column(name, justify="right")
    for st in stages:
        table.add_row(fmt(st.start), fmt(st.end), f"{fmt(st.global_batch)} seq",
                      f"{st.grad_accum_steps} (× {micro_batch} × {dp_world_size})", fmt(st.units_per_step),
                      fmt(st.optimizer_steps))
    table.add_row("", "", "", "", "total", fmt(sum(st.optimizer_steps for st in stages)))
    return table
