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
    from .._util import json_default

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
        from .. import __version__

        typer.echo(f"globalbatch {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Plan, check and measure the global batch size of PyTorch training."""


# The commands live in one module per family and register themselves on ``app`` when imported, in
# the order --help lists them: plan, probe, noise, then the critical-batch experiments.
from globalbatch.cli import plan as _plan  # noqa: F401
from globalbatch.cli import measure as _measure  # noqa: F401
from globalbatch.cli import critical as _critical  # noqa: F401


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
        from .._util import SettingError

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
