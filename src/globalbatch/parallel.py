"""One inspection of a model's data-parallel wrappers, shared by the step driver and the noise monitor.

A training model may be wrapped in ``torch.compile`` (``OptimizedModule``, the user's module in
``_orig_mod``), ``DistributedDataParallel`` (in ``.module``) and FSDP2 (``fully_shard`` swaps the
module's class in place, so the module *is* the ``FSDPModule``), in any order and at any depth:
``torch.compile(DDP(torch.compile(m)))`` is legal. Code that only checks ``isinstance(model, DDP)``
silently treats a compiled DDP model as one replica; :func:`inspect_parallel` looks through every
layer once, and every consumer asks it.

Core module: imports torch only (no lab, no CLI).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from globalbatch.errors import Raw, SettingError

__all__ = ["ParallelInfo", "inspect_parallel", "unwrap_model", "uncompiled", "fsdp_module_class"]

_MAX_DEPTH = 64  # wrappers nest a few levels deep; a cycle would be a bug in a wrapper


def fsdp_module_class() -> Optional[type]:
    """``FSDPModule`` (the class ``fully_shard`` mixes in), or None on a torch without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6

        return FSDPModule
    except ImportError:  # pragma: no cover - older torch
        try:
            from torch.distributed._composable.fsdp import FSDPModule

            return FSDPModule
        except ImportError:
            return None


def uncompiled(model: nn.Module) -> nn.Module:
    """The module inside any number of ``torch.compile`` wrappers (``_orig_mod``), else the module."""
    for _ in range(_MAX_DEPTH):
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner
    raise SettingError("model", Raw(f"in more than {_MAX_DEPTH} nested torch.compile wrappers"), "a finite nesting")


@dataclass(frozen=True)
class ParallelInfo:
    """What :func:`inspect_parallel` found."""

    kind: str
    """``"ddp"``, ``"fsdp2"`` or ``"none"`` (one replica as far as the wrappers tell)."""
    sync_module: nn.Module
    """The module that controls gradient sync: the ``DistributedDataParallel`` (``no_sync``,
    ``register_comm_hook``), the root ``FSDPModule`` (``set_requires_gradient_sync``), or the
    user's module when ``kind == "none"``."""
    module: nn.Module
    """The user's module inside every wrapper (what checkpoints save)."""
    process_group: Any
    """DDP's process group; None for FSDP2 (its mesh decides) and for ``"none"``."""
    compiled: bool
    """True when a ``torch.compile`` wrapper was found at any depth."""


def inspect_parallel(model: nn.Module) -> ParallelInfo:
    """Look through ``torch.compile``, DDP and FSDP2 layers at any depth.

    The outermost data-parallel layer decides ``kind``: DDP around an FSDP2 module is reported as
    DDP (its ``no_sync`` and comm hook are the ones that act on the gradients the loop sees).
    """
    fsdp_cls = fsdp_module_class()
    found: Optional[tuple[str, nn.Module, Any]] = None
    compiled = False
    m = model
    for _ in range(_MAX_DEPTH):
        inner = getattr(m, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            compiled = True
            m = inner
            continue
        if isinstance(m, nn.parallel.DistributedDataParallel):
            if found is None:
                found = ("ddp", m, m.process_group)
            m = m.module
            continue
        if fsdp_cls is not None and isinstance(m, fsdp_cls) and found is None:
            found = ("fsdp2", m, None)
        break
    else:
        raise SettingError("model", Raw(f"in more than {_MAX_DEPTH} nested wrappers"), "a finite nesting")
    if found is None:
        return ParallelInfo(kind="none", sync_module=m, module=m, process_group=None, compiled=compiled)
    kind, sync_module, group = found
    return ParallelInfo(kind=kind, sync_module=sync_module, module=m, process_group=group, compiled=compiled)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside ``torch.compile`` and ``DistributedDataParallel`` wrappers (any depth)."""
    return inspect_parallel(model).module
