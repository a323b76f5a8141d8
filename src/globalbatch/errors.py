"""The one error type of the library: :class:`SettingError` (field, value, allowed).

Every error a user can cause — a bad argument, a bad config key, a damaged run directory — is a
``SettingError`` naming the library's field, the value and what is allowed. The CLI renames the
field to the flag the user typed (:func:`flag_names`, from its own typer definitions); nothing
parses a message to find the field.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping

__all__ = ["SettingError", "flag_names", "Raw"]


class Raw(str):
    """A string shown unquoted in an error line (a value as the user typed it)."""


# ---------------------------------------------------------------------------
# Setting errors in the house style
# ---------------------------------------------------------------------------


def _show(value: Any, flag: bool) -> str:
    """A value as the error line shows it: strings quoted, numbers plain, lists comma-joined for a flag."""
    if isinstance(value, (list, tuple)):
        return ",".join(_show(v, True) for v in value) if flag else repr(list(value))
    if isinstance(value, bool) or value is None or isinstance(value, Raw):
        return str(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int):
        return str(value)
    return repr(value)


class SettingError(ValueError):
    """A bad setting: ``<name> <value> is not allowed; allowed: <allowed>``.

    ``field`` is the library's name of the setting; :func:`flag_names` renames it to the
    command-line flag the user typed (``budget`` → ``--tokens``).
    """

    def __init__(self, field: str, value: Any, allowed: str, *, why: str = "", flag: bool = False) -> None:
        self.field, self.value, self.allowed, self.why = field, value, allowed, why
        super().__init__(self.text(field, flag=flag))

    def text(self, name: str, *, flag: bool = True) -> str:
        why = f" ({self.why})" if self.why else ""
        return f"{name} {_show(self.value, flag)} is not allowed{why}; allowed: {self.allowed}"


@contextmanager
def flag_names(names: Mapping[str, str]) -> Iterator[None]:
    """Inside, a :class:`SettingError` of a field in ``names`` is re-raised naming the flag instead."""
    try:
        yield
    except SettingError as exc:
        if exc.field not in names:
            raise
        raise SettingError(names[exc.field], exc.value, exc.allowed, why=exc.why, flag=True) from None
