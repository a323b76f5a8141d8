"""The one error type of the library: :class:`SettingError` (field, value, allowed).

A ``SettingError`` names the library's field, the value and what is allowed; the shared validators
(:mod:`globalbatch.validate`) and the core raise it for the errors a user can cause. The CLI renames
the field to the flag the user typed (:func:`flag_names`, from its own typer definitions), without
reading the message. Some library errors are still plain ``ValueError``s; no field is ever found by
reading a message.
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
    command-line flag the user typed (``budget`` → ``--tokens``). ``see`` names other settings the
    message mentions: ``{"round_down=True": "round_down"}`` — that spelling in ``allowed`` or ``why``
    is the library's; :meth:`text` with ``names`` writes the flag there instead (``--round-down``).
    """

    def __init__(self, field: str, value: Any, allowed: str, *, why: str = "", flag: bool = False,
                 see: Mapping[str, str] | None = None) -> None:
        self.field, self.value, self.allowed, self.why = field, value, allowed, why
        self.see = dict(see or {})
        super().__init__(self.text(field, flag=flag))

    def text(self, name: str, *, flag: bool = True, names: Mapping[str, str] | None = None) -> str:
        """The line naming the setting ``name``; ``names`` (field → flag) renames the settings of ``see``."""
        allowed, why = self._renamed(names)
        why = f" ({why})" if why else ""
        return f"{name} {_show(self.value, flag)} is not allowed{why}; allowed: {allowed}"

    def _renamed(self, names: Mapping[str, str] | None) -> tuple[str, str]:
        allowed, why = self.allowed, self.why
        for spelled, field in self.see.items():
            if names and field in names:
                allowed, why = allowed.replace(spelled, names[field]), why.replace(spelled, names[field])
        return allowed, why


@contextmanager
def flag_names(names: Mapping[str, str]) -> Iterator[None]:
    """Inside, a :class:`SettingError` of a field in ``names`` is re-raised naming the flag instead."""
    try:
        yield
    except SettingError as exc:
        if exc.field not in names:
            raise
        allowed, why = exc._renamed(names)
        raise SettingError(names[exc.field], exc.value, allowed, why=why, flag=True) from None
