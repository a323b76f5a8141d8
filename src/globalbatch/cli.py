"""The ``globalbatch`` (alias ``gbs``) command line: a thin layer over the library.

Each command parses flags, calls one library function and prints. Heavy imports
(torch, matplotlib, ray) happen inside the command that needs them, so
``globalbatch plan`` starts fast and works without torch.

Errors: any ``ValueError`` (or click usage error) becomes one line on stderr,
``error: <field>: <value>: <what is allowed>``, and exit code 2 — never a traceback.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

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


def _fail(message: str) -> "typer.Exit":
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


# ---------------------------------------------------------------------------
# Commands. Keep each one thin: parse, call the library, print.
# ---------------------------------------------------------------------------

# (commands are registered below this line)


def main(argv: Optional[list[str]] = None) -> None:
    """Console-script entry point with one-line errors and exit code 2."""
    import click

    command = typer.main.get_command(app)
    try:
        rv = command.main(args=argv, prog_name="globalbatch", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:  # click >= 8.2 raises this for bare `globalbatch`
        typer.echo(exc.ctx.get_help() if exc.ctx else str(exc))
        sys.exit(0)
    except click.UsageError as exc:
        typer.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(2)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        typer.echo("error: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        typer.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(2)
    except (ValueError, FileNotFoundError, IsADirectoryError) as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
