"""Checkpoints of a run driven by :class:`globalbatch.step.StepDriver`: bit-exact resume.

``save_checkpoint(path, driver)`` / ``load_checkpoint(path, driver)``: everything comes from the driver.
One file holds the model, the optimizer, the driver's counters and schedule position (an adaptive
schedule's decisions), the GradScaler, a step-based LR scheduler, the state of every stateful callback
(the noise monitor) and every rank's RNG state; it is written atomically by rank 0 and read with
``torch.load(weights_only=True)``.

It also holds what defines the run (:func:`run_definition`: the batch schedule and the LR
schedule with its horizons — total and warmup units, peak LR, shape). Resuming with other
values would silently train a different run (an LR decayed over another horizon), so
:func:`load_checkpoint` refuses it with a :class:`RunMismatch` naming each value, checkpoint
and now, unless ``override=True`` (a deliberate change, logged).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from globalbatch._util import atomic_write
from globalbatch.errors import Raw, SettingError
from globalbatch.parallel import inspect_parallel, unwrap_model
from globalbatch.step import StepDriver

__all__ = ["save_checkpoint", "load_checkpoint", "run_definition", "RunMismatch"]

logger = logging.getLogger(__name__)


class RunMismatch(ValueError):
    """A resume whose run-defining settings differ from the checkpoint's; ``diffs`` maps each to (then, now)."""

    def __init__(self, path: Any, diffs: dict[str, tuple[Any, Any]]) -> None:
        self.path, self.diffs = path, diffs
        shown = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diffs.items())
        super().__init__(f"checkpoint {str(path)!r} was written by another run ({shown}); allowed: the checkpoint's "
                         "values, or override=True (--override) to change them on purpose")


def _plain(obj: Any) -> Any:
    """A schedule as primitives (``weights_only``-loadable): dataclass fields, tuples as lists, the class name."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {"type": type(obj).__name__, **{f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return repr(obj)


def run_definition(driver: StepDriver) -> dict[str, Any]:
    """What defines the run, flattened: ``{"batch_schedule.steps": …, "lr_schedule.total": …, "unit": …}``."""
    cfg = driver.config
    out: dict[str, Any] = {}
    for name, obj in (("batch_schedule", driver.schedule), ("lr_schedule", cfg.lr_schedule)):
        plain = _plain(obj)
        if isinstance(plain, dict):
            plain.pop("unit", None)  # the run's unit is said once (below)
            if plain.get("type") == "TokenLRSchedule":  # the deprecated name of LRSchedule
                plain["type"] = "LRSchedule"
            out.update({f"{name}.{k}": v for k, v in plain.items()})
        else:
            out[name] = plain
    out["unit"] = driver.position_unit
    return out


def _normalized(stored: dict[str, Any], driver: StepDriver) -> dict[str, Any]:
    """A run definition written by an older version, in today's keys: one ``unit``, ``LRSchedule``."""
    stored = dict(stored)
    units = {stored.pop(k) for k in ("batch_schedule.unit", "lr_schedule.unit") if k in stored}
    units.discard(None)
    if "unit" not in stored:
        stored["unit"] = units.pop() if len(units) == 1 else driver.position_unit
    if stored.get("lr_schedule.type") == "TokenLRSchedule":
        stored["lr_schedule.type"] = "LRSchedule"
    if isinstance(stored.get("batch_schedule"), str):  # an adaptive schedule's repr: drop the old ", unit=…"
        stored["batch_schedule"] = re.sub(r", unit=\w+", "", stored["batch_schedule"])
    return stored



def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _driver_and_parts(fn: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[StepDriver, nn.Module,
                                                                                       torch.optim.Optimizer, Any, Any]:
    """``(path, driver)`` or the deprecated ``(path, model, optimizer, driver, scaler=, lr_scheduler=)``."""
    if len(args) == 1 and isinstance(args[0], StepDriver):
        d = args[0]
        return d, d.model, d.optimizer, d.scaler, d.lr_scheduler
    if len(args) == 3 and isinstance(args[2], StepDriver):
        warnings.warn(f"{fn}(path, model, optimizer, driver) is deprecated: use {fn}(path, driver) (the driver holds "
                      "the model, the optimizer, the scaler, the LR scheduler and the callbacks)", FutureWarning,
                      stacklevel=3)
        model, optimizer, d = args
        scaler = kwargs.pop("scaler", None)
        lr_scheduler = kwargs.pop("lr_scheduler", None)
        return (d, model, optimizer, scaler if scaler is not None else d.scaler,
                lr_scheduler if lr_scheduler is not None else d.lr_scheduler)
    raise SettingError("arguments", Raw(", ".join(type(a).__name__ for a in args)),
                       f"{fn}(path, driver) (a StepDriver)")


def _stateful_callbacks(driver: StepDriver) -> dict[str, Any]:
    """The driver's callbacks with ``state_dict``/``load_state_dict`` (the noise monitor), keyed by position and
    class. The batch schedule's state travels in the driver's own state."""
    return {f"{i}:{type(cb).__name__}": cb for i, cb in enumerate(driver.callbacks)
            if callable(getattr(cb, "state_dict", None)) and callable(getattr(cb, "load_state_dict", None))}


def save_checkpoint(path: str | os.PathLike, *args: Any, extra: Optional[dict[str, Any]] = None, **kwargs: Any) -> None:
    """``save_checkpoint(path, driver)``: everything of the run, from the driver, atomically.

    Writes the model (unwrapped from DDP), the optimizer, the driver's counters and schedule position
    (an adaptive schedule's decisions included), its GradScaler and LR scheduler, the state of every
    callback with ``state_dict()`` (the noise monitor), every rank's RNG state and the run's definition.
    Every rank's CPU (and CUDA) RNG state is gathered to rank 0, which writes ``path`` via a temporary file
    and ``os.replace``; the other ranks wait at a barrier: call it on every rank. ``extra`` must hold only
    tensors, primitives and containers so the file loads with ``torch.load(weights_only=True)``.

    The old form ``save_checkpoint(path, model, optimizer, driver, scaler=, lr_scheduler=)`` still works, with
    a FutureWarning.
    """
    driver, model, optimizer, scaler, lr_scheduler = _driver_and_parts("save_checkpoint", args, kwargs)
    if kwargs:
        raise TypeError(f"save_checkpoint() got unexpected keyword arguments {sorted(kwargs)}")
    if inspect_parallel(model).kind == "fsdp2":
        raise NotImplementedError("FSDP2 checkpoints are sharded; use torch.distributed.checkpoint for the model")
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    rng = _rng_state()
    if distributed:
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, rng)  # once per checkpoint, not in the hot path
    else:
        per_rank = [rng]
    callbacks = {k: cb.state_dict() for k, cb in _stateful_callbacks(driver).items()}  # every rank (they may sync)
    if rank == 0:
        state = {
            "model": unwrap_model(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "driver": driver.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "callbacks": callbacks,
            "rng": {"per_rank": per_rank},
            "run": run_definition(driver),
            "extra": extra,
        }
        atomic_write(path, lambda f: torch.save(state, f))
    if distributed:
        dist.barrier()


def load_checkpoint(path: str | os.PathLike, *args: Any, map_location: Any = "cpu", restore_rng: bool = True,
                    override: bool = False, **kwargs: Any) -> Optional[dict[str, Any]]:
    """``load_checkpoint(path, driver)``: restore what :func:`save_checkpoint` wrote (``weights_only=True``);
    returns ``extra``.

    Restores the model, the optimizer, the driver (counters, schedule position), its scaler and LR scheduler,
    and each stateful callback saved at the same place in ``driver.callbacks`` with the same class (a saved
    one the driver no longer has is named in a warning). Each rank restores its own RNG state (rank 0's when
    the world size changed). The old form ``load_checkpoint(path, model, optimizer, driver, ...)`` still
    works, with a FutureWarning.

    Raises:
        RunMismatch: the driver's batch or LR schedule (horizons, total units, peak LR, …)
            differs from the checkpoint's, and ``override`` is False. Checked before anything
            is restored.
    """
    driver, model, optimizer, scaler, lr_scheduler = _driver_and_parts("load_checkpoint", args, kwargs)
    if kwargs:
        raise TypeError(f"load_checkpoint() got unexpected keyword arguments {sorted(kwargs)}")
    state = _read(path, map_location)
    stored = state.get("run")
    if stored is not None:  # checkpoints from before run definitions were recorded carry none
        now = run_definition(driver)
        stored = _normalized(stored, driver)
        diffs = {k: (stored.get(k), now.get(k)) for k in sorted(set(stored) | set(now)) if stored.get(k) != now.get(k)}
        if diffs and not override:
            raise RunMismatch(path, diffs)
        for key, (then, current) in diffs.items():
            logger.warning("resume with override: %s %r in the checkpoint, %r now", key, then, current)
    unwrap_model(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    driver.load_state_dict(state["driver"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    if lr_scheduler is not None and state.get("lr_scheduler") is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    saved_cbs = state.get("callbacks") or {}
    live = _stateful_callbacks(driver)
    for key, cb_state in saved_cbs.items():
        if key in live:
            live[key].load_state_dict(cb_state)
        else:
            logger.warning("checkpoint %s: callback %s has state but the driver has no such callback there; "
                           "its state was not restored", str(path), key)
    rng = state.get("rng")
    if restore_rng and rng is not None:
        if "per_rank" in rng:
            per_rank = rng["per_rank"]
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            _set_rng_state(per_rank[rank] if rank < len(per_rank) and len(per_rank) == _world() else per_rank[0])
        else:  # files written before per-rank RNG
            torch.set_rng_state(rng["torch"])
    return state.get("extra")


_SAVED = ("model", "optimizer", "driver")
"""What every :func:`save_checkpoint` file holds."""


_MAP_LOCATION_ALLOWED = "'cpu' or a device this machine has (cuda:0 … cuda:N−1, mps), a dict or a function"


def _check_map_location(map_location: Any) -> None:
    """A device named by ``map_location`` (a string or ``torch.device``) must exist here: otherwise a one-line
    :class:`SettingError` naming ``map_location``, not the file (dicts and functions are torch's to check)."""
    if not isinstance(map_location, (str, torch.device)):
        return
    allowed = _MAP_LOCATION_ALLOWED
    try:
        device = torch.device(map_location)
    except (RuntimeError, ValueError):
        raise SettingError("map_location", Raw(repr(map_location)), allowed, why="not a torch device") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index is not None and device.index >= count):
            raise SettingError("map_location", Raw(repr(map_location)), allowed,
                               why=f"this machine has {count} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise SettingError("map_location", Raw(repr(map_location)), allowed, why="MPS is not available here")


def _read(path: str | os.PathLike, map_location: Any) -> dict[str, Any]:
    """The checkpoint's dict (``weights_only=True``); a file that is not one is a one-line :class:`SettingError`
    before anything is restored (never torch's advice to load it with ``weights_only=False``); so is a
    ``map_location`` device this machine does not have."""
    allowed = "a file written by globalbatch.save_checkpoint"
    _check_map_location(map_location)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except OSError:  # missing, a directory, no permission: the OS's own error
        raise
    except Exception as exc:  # noqa: BLE001 - corrupt, truncated, not a torch file, or unsafe to unpickle
        text = str(exc)
        text = text.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in text else text
        detail = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")[:200]
        if "Attempting to deserialize object on" in text:  # the file is fine; where its tensors would go is not
            where = text[text.index("Attempting"):].split(". ", 1)[0]
            raise SettingError("map_location", Raw(repr(map_location)), _MAP_LOCATION_ALLOWED,
                               why=where) from None
        raise SettingError("checkpoint", Raw(repr(str(path))), allowed,
                           why=f"torch.load(weights_only=True) cannot read it: {type(exc).__name__}: {detail}") from None
    missing = [k for k in _SAVED if not isinstance(state, dict) or k not in state]
    if missing:
        raise SettingError("checkpoint", Raw(repr(str(path))), allowed, why=f"it has no {', '.join(missing)}")
    return state


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
