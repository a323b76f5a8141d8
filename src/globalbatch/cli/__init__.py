"""The ``globalbatch`` (alias ``gbs``) command line: a thin layer over the library.

:func:`main` runs the typer ``app`` (:mod:`globalbatch.cli.app`: option types, the flag names and the
error line every command shares) with one-line errors and exit code 2, never a traceback; the
commands live in one module per family and register themselves on import.
"""

from __future__ import annotations

import sys
from typing import Any, Literal, Optional, get_args, get_origin

import typer

from globalbatch.cli.app import app, setting_line

__all__ = ["app", "main"]

# The commands live in one module per family and register themselves on ``app`` when imported, in
# the order --help lists them: plan, probe, noise, then the critical-batch experiments.
from globalbatch.cli import plan as _plan  # noqa: F401
from globalbatch.cli import measure as _measure  # noqa: F401
from globalbatch.cli import critical as _critical  # noqa: F401
from globalbatch.cli import scale as _scale  # noqa: F401


def _choices_of(param: Any) -> tuple:
    """The values of a ``Literal[...]`` (or ``Optional[Literal[...]]``) option; () for any other."""
    t = getattr(getattr(param, "type_descriptor", None), "annotation", None)  # typer 0.29's record of the hint
    for cand in (t, *get_args(t)):
        if get_origin(cand) is Literal:
            return get_args(cand)
    return ()


def _usage_error_line(exc: Any, argv: list[str]) -> str:
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
        text = setting_line(exc, sub) if isinstance(exc, SettingError) else str(exc)
        typer.echo("error: " + " ".join(text.split()), err=True)  # one line, whatever the message holds
        sys.exit(2)
    except Exception as exc:
        # click's (or typer's vendored click's) usage errors: bad flag, bad value, missing argument.
        if not hasattr(exc, "format_message"):
            raise
        if type(exc).__name__ == "NoArgsIsHelpError" and getattr(exc, "ctx", None) is not None:
            typer.echo(exc.ctx.get_help())  # type: ignore[attr-defined]  # click's NoArgsIsHelpError
            sys.exit(0)
        typer.echo(f"error: {_usage_error_line(exc, args)}", err=True)
        sys.exit(getattr(exc, "exit_code", 2) or 2)
    sys.exit(rv if isinstance(rv, int) else 0)
