"""Built-in training tasks (tinygpt, mnist) and user tasks: ``load_task(spec, **overrides)``.

User tasks: ``load_task("package.module:function", **overrides)`` or
``load_task("path/to/file.py:function")`` imports the module, calls the function
with the overrides and checks the result against :data:`REQUIRED_ATTRIBUTES`.
See ``docs/tasks.md``.
"""

from __future__ import annotations

import dataclasses
import json
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Mapping

from globalbatch.errors import Raw as _Raw, SettingError
from globalbatch.lab.tasks.base import (  # noqa: F401
    DEFAULT_TASK, IGNORE_INDEX, REQUIRED_ATTRIBUTES, UNITS, Task, check_task, to_device,
)
from globalbatch.lab.tasks.mnist import MnistConfig, MnistTask  # noqa: F401
from globalbatch.lab.tasks.tinygpt import PAD_ID, TinyGPT, TinyGPTConfig, TinyGPTTask  # noqa: F401

__all__ = [
    "load_task_checked",
    "DEFAULT_TASK",
    "REQUIRED_ATTRIBUTES",
    "IGNORE_INDEX",
    "Task",
    "TinyGPTConfig",
    "TinyGPTTask",
    "TinyGPT",
    "MnistConfig",
    "MnistTask",
    "load_task",
    "list_tasks",
    "check_task",
    "to_device",
]

_BUILTIN: dict[str, tuple[type, Any]] = {
    "tinygpt": (TinyGPTConfig, TinyGPTTask.from_config),
    "mnist": (MnistConfig, MnistTask.from_config),
}


_TASK_ALLOWED = "tinygpt, mnist, package.module:function or path/to/file.py:function"


def list_tasks() -> list[str]:
    """Names of the built-in tasks, the default first."""
    return [DEFAULT_TASK] + sorted(n for n in _BUILTIN if n != DEFAULT_TASK)


def _config_from_overrides(name: str, config_cls: type, overrides: dict[str, Any]):
    allowed = [f.name for f in dataclasses.fields(config_cls)]
    for key, value in overrides.items():
        if key not in allowed:
            raise SettingError(key, value, f"an override of {name}: {', '.join(allowed)}", why="unknown override")
    return config_cls(**overrides)


def _import_user_function(spec: str):
    module_part, _, func_name = spec.rpartition(":")
    if not module_part or not func_name.isidentifier():
        raise SettingError("task", spec, _TASK_ALLOWED, why="no function after the ':'")
    if module_part.endswith(".py"):
        path = Path(module_part).resolve()
        if not path.is_file():
            raise SettingError("task", spec, _TASK_ALLOWED,
                           why=f"file {str(path)!r} does not exist")
        module_name = f"_globalbatch_user_task_{path.stem}"
        file_spec = importlib.util.spec_from_file_location(module_name, path)
        if file_spec is None or file_spec.loader is None:
            raise SettingError("task", spec, _TASK_ALLOWED,
                           why=f"cannot import {str(path)!r}")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[module_name] = module  # dataclasses look their module up here
        dont_write = sys.dont_write_bytecode
        sys.dont_write_bytecode = True  # no __pycache__ beside the user's file (nothing written on a refusal)
        try:
            file_spec.loader.exec_module(module)  # runs the file: --task is code the user chose to run
        except Exception as exc:  # SyntaxError, ImportError, anything the file raises: one line
            sys.modules.pop(module_name, None)
            raise SettingError("task", spec, _TASK_ALLOWED,
                           why=f"{str(path)!r} cannot be imported: {_one_line(exc)}") from None
        finally:
            sys.dont_write_bytecode = dont_write
    else:
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            raise SettingError("task", spec, _TASK_ALLOWED,
                           why=f"cannot import module {module_part!r} ({exc})") from None
        except Exception as exc:
            raise SettingError("task", spec, _TASK_ALLOWED,
                           why=f"module {module_part!r} cannot be imported: {_one_line(exc)}") from None
    fn = getattr(module, func_name, None)
    if fn is None or not callable(fn):
        raise SettingError("task", spec, _TASK_ALLOWED,
                           why=f"module {module_part!r} has no callable {func_name!r}")
    return fn


def load_task(spec: str = DEFAULT_TASK, **overrides: Any) -> Task:
    """Build a task by name (see :func:`list_tasks`) or from ``"package.module:function"``.

    Args:
        spec: ``"tinygpt"``, ``"mnist"``, ``"package.module:function"`` or
            ``"path/to/file.py:function"``; the function is called with ``overrides``
            and must return an object with :data:`REQUIRED_ATTRIBUTES`.
        **overrides: fields of :class:`TinyGPTConfig` / :class:`MnistConfig`, or the user
            function's keyword arguments.

    Raises:
        ValueError: unknown task, unknown or invalid override, or a user task that
            lacks required attributes; the message names the field, value and what is allowed.
    """
    if not isinstance(spec, str):
        raise SettingError("task", spec, _TASK_ALLOWED, why="not a string")
    if spec in _BUILTIN:
        config_cls, factory = _BUILTIN[spec]
        return factory(_config_from_overrides(spec, config_cls, overrides))
    if ":" not in spec:
        raise SettingError("task", spec, _TASK_ALLOWED, why="no built-in task of that name")
    fn = _import_user_function(spec)
    try:
        inspect.signature(fn).bind(**overrides)
    except TypeError as exc:
        raise SettingError("task", spec, _TASK_ALLOWED,
                           why=f"overrides {sorted(overrides)} do not fit "
                         f"{fn.__name__}{inspect.signature(fn)} ({exc})") from exc
    except ValueError:  # no signature available (builtins); let the call decide
        pass
    try:
        made = fn(**overrides)
    except ValueError:
        raise
    except Exception as exc:  # the user's function failed: one line naming it, not a traceback
        raise SettingError("task", spec, _TASK_ALLOWED,
                           why=f"{fn.__name__}(**{overrides!r}) failed: {_one_line(exc)}") from None
    return _build_failures_named(check_task(made, origin=spec), spec)


def _build_failures_named(task: Any, spec: str) -> Any:
    """A user task whose ``build_model`` raises (a bad ``--task-arg`` that only the model's layers refuse) fails
    with one line naming ``task``, as its factory's errors do. A task object that takes no new attribute
    (``__slots__``, a frozen dataclass) is returned as it is."""
    build = task.build_model

    def build_model(seed: int) -> Any:
        try:
            return build(seed)
        except SettingError:
            raise
        except Exception as exc:  # the user's model code: one line naming the task, not a traceback
            raise SettingError("task", spec, _TASK_ALLOWED,
                               why=f"its build_model({seed}) failed: {_one_line(exc)}") from None

    try:
        task.build_model = build_model
    except (AttributeError, TypeError):  # FrozenInstanceError is an AttributeError
        pass
    return task


def _one_line(exc: BaseException) -> str:
    """``SyntaxError: invalid syntax (syn.py, line 1)`` — an exception as one line."""
    return f"{type(exc).__name__}: " + " ".join(str(exc).split())


def load_task_checked(task: str, overrides: Mapping[str, Any]):
    """``load_task(task, **overrides)`` with a :class:`SettingError` naming ``task`` or ``task_overrides``."""
    try:
        return load_task(task, **dict(overrides))
    except ValueError as exc:
        field = exc.field if isinstance(exc, SettingError) else None
        if field == "task":
            raise
        if not overrides:  # a user task's own ValueError
            raise SettingError("task", task, _TASK_ALLOWED, why=str(exc)) from None
        named = [k for k in overrides if k == field]  # the override the error is about (a user task: all of them)
        shown = " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in overrides.items()
                         if not named or k in named)
        raise SettingError("task_overrides", _Raw(shown), f"overrides task {task!r} accepts ({exc})") from None
