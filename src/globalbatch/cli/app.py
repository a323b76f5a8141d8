"""The command line's app, option types and the error line every command shares (no commands here).

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
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional

import typer

from globalbatch.optim.registry import optimizer_names  # noqa: E402 (torch-free table)

OPTIMIZERS_HELP = ", ".join(optimizer_names())
"""The registry's names as --help shows them."""

# Fixed choices as Literal types: typer shows them in --help (``--objective <time|cost>``) and refuses
# any other value before the command runs (one line, see _usage_error_line).
if TYPE_CHECKING:  # a Literal built at run time is no static type: the checker sees a str
    OptimizerName = str
else:
    OptimizerName = Literal.__getitem__(tuple(optimizer_names()))  # the registry's names, whatever they are
PrecisionName = Literal["fp32", "bf16", "fp16"]
Backend = Literal["local", "ray"]
Objective = Literal["time", "cost"]
Metric = Literal["val", "train"]
Test = Literal["paired", "welch"]
LrRule = Literal["linear", "sqrt", "none"]
AdaptiveLrRule = Literal["sqrt", "linear", "adascale", "none"]

# Options several commands share, defined once (``task: TaskOption = "tinygpt"``): the same flag, type and help.
TaskOption = Annotated[str, typer.Option("--task", help="Task: tinygpt, mnist, package.module:function or path/to/file.py:function.")]
TaskArgOption = Annotated[Optional[list[str]], typer.Option("--task-arg", help="Task override KEY=VALUE (repeatable), e.g. d_model=64.")]
DeviceOption = Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:N or mps (checked before anything is written).")]
AutoDeviceOption = Annotated[Optional[str], typer.Option("--device", help="cpu, cuda, cuda:N or mps (default cuda when available).")]
PrecisionOption = Annotated[PrecisionName, typer.Option("--precision", help="fp32, bf16 (autocast) or fp16 (autocast + GradScaler).")]
ThreadsOption = Annotated[Optional[int], typer.Option("--threads", help="Torch threads (default: all cores).")]
MicroBatchOption = Annotated[Optional[int], typer.Option("--micro-batch", help="Samples per forward/backward (default min(batch, 16)).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON with stable snake_case keys instead of tables (progress stays on stderr).")]

app = typer.Typer(
    name="globalbatch",
    help="Plan, check and measure the global batch size of PyTorch training.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def echo_json(obj: Any) -> None:
    """``--json``: one JSON document on stdout, stable snake_case keys."""
    from .._util import json_default

    typer.echo(json.dumps(obj, indent=2, sort_keys=True, default=json_default))


# ---------------------------------------------------------------------------
# The one field → flag mapping, taken from the commands' own typer definitions
# ---------------------------------------------------------------------------

_FIELD_PARAMS: dict[str, dict[str, str]] = {
    "plan": {"dp_world_size": "dp", "new_dp_world_size": "dp", "config": "config"},
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


def setting_line(exc: Exception, command_name: Optional[str]) -> str:
    """A SettingError's line naming the flag the user typed (the field as is when no flag spells it)."""
    field = getattr(exc, "field", "")
    if command_name and not field.startswith("-"):
        try:
            names = flag_names_of(command_name)
        except KeyError:
            names = {}
        if field in names:
            return exc.text(names[field], names=names)  # type: ignore[attr-defined]
        return exc.text(field, flag=False, names=names)  # type: ignore[attr-defined]  # other settings it names: flags
    return str(exc)


# ---------------------------------------------------------------------------
# Commands. Keep each one thin: parse, call the library, print.
# ---------------------------------------------------------------------------

def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"globalbatch {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Plan, check and measure the global batch size of PyTorch training."""
