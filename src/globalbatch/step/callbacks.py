"""The driver's callback list: the hook names, the check of a callback, and a list that refreshes the driver."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from globalbatch.errors import Raw, SettingError

CALLBACK_HOOKS = ("on_micro_backward", "on_window_end", "on_step_end")
"""The hooks a :class:`StepCallback` may implement; the driver calls those a callback has."""


def _check_callback(cb: Any) -> None:
    hooks = [h for h in CALLBACK_HOOKS if callable(getattr(cb, h, None))]
    odd = sorted(n for n in dir(type(cb)) if n.startswith("on_") and n not in CALLBACK_HOOKS
                 and callable(getattr(cb, n, None)))
    if odd:
        raise SettingError("callbacks", Raw(f"{type(cb).__name__} with {', '.join(odd)}"),
                           f"hooks named {', '.join(CALLBACK_HOOKS)} (StepCallback)")
    if not hooks:
        raise SettingError("callbacks", Raw(type(cb).__name__), f"an object with any of {', '.join(CALLBACK_HOOKS)} "
                           "(StepCallback)")


class _CallbackList(list):
    """``driver.callbacks``: a list whose every change refreshes the driver's cached hook lists, so a
    callback appended, inserted or removed after construction takes effect at the next hook call."""

    def __init__(self, driver: Any, items: Sequence[Any] = ()) -> None:
        super().__init__(items)
        self._driver = driver

    def _changed(self) -> None:
        self._driver._refresh_callbacks()


def _refreshing(name: str) -> Callable[..., Any]:
    base = getattr(list, name)

    def method(self: _CallbackList, *args: Any, **kwargs: Any) -> Any:
        out = base(self, *args, **kwargs)
        self._changed()
        return out if name != "__iadd__" else self

    method.__name__ = name
    return method


for _name in ("append", "extend", "insert", "remove", "pop", "clear", "__setitem__", "__delitem__", "__iadd__",
              "sort", "reverse"):
    setattr(_CallbackList, _name, _refreshing(_name))
