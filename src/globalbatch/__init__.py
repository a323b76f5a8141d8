"""globalbatch: the global batch size of PyTorch training, planned, exact and measured.

The front door: ``import globalbatch as gb`` gives the core API a user imports into a loop,
resolved lazily, so ``import globalbatch`` alone imports no torch (``gb.plan`` functions need
none either)::

    import globalbatch as gb

    driver = gb.StepDriver(model, opt, gb.StepConfig(micro_batch=2, global_batch=16,
                                                     lr_schedule=gb.LRSchedule(peak_lr=3e-4, total="2B")))

Layers: the core (``plan``, ``schedule``, ``step``, ``checkpoint``, ``optim``, ``nn``), the
measurements (``noise``, ``probe``, ``critical``), the lab that runs experiments
(``globalbatch.lab``: tasks, the one training loop, sweep, branch, report) and the CLI.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # plan (pure arithmetic, no torch)
    "BatchGeometry": "globalbatch.plan",
    "solve_geometry": "globalbatch.plan",
    "scale_lr": "globalbatch.plan",
    "parse_count": "globalbatch.plan",
    # schedules
    "LRSchedule": "globalbatch.schedule",
    "TokenLRSchedule": "globalbatch.schedule",
    "StepBatchSchedule": "globalbatch.schedule",
    "RampupBatchSchedule": "globalbatch.schedule",
    "parse_step_schedule": "globalbatch.schedule",
    "constant_batch": "globalbatch.schedule",
    # the exact step
    "StepConfig": "globalbatch.step",
    "StepDriver": "globalbatch.step",
    "StepResult": "globalbatch.step",
    "NonFiniteError": "globalbatch.step",
    "plan_for_world": "globalbatch.step",
    "StepCallback": "globalbatch.step",
    "rank_windows": "globalbatch.windows",
    "MicroBatches": "globalbatch.windows",
    "causal_lm_loss": "globalbatch.losses",
    "causal_lm_loss_sum": "globalbatch.losses",
    "save_checkpoint": "globalbatch.checkpoint",
    "load_checkpoint": "globalbatch.checkpoint",
    # the adaptive batch
    "AdaptiveBatchSchedule": "globalbatch.adaptive",
    "FeasibleBatches": "globalbatch.adaptive",
    "NoiseTrackingPolicy": "globalbatch.adaptive",
    "GoodputPolicy": "globalbatch.adaptive",
    # optimizers
    "build_optimizer": "globalbatch.optim",
    "optimizer_names": "globalbatch.optim",
    "lr_for_batch": "globalbatch.optim",
    "LARS": "globalbatch.optim.large_batch",
    "LAMB": "globalbatch.optim.large_batch",
    # layers
    "GhostBatchNorm1d": "globalbatch.nn",
    "GhostBatchNorm2d": "globalbatch.nn",
    "convert_to_ghost_bn": "globalbatch.nn",
    # measurements
    "NoiseScaleMonitor": "globalbatch.noise",
    "NoiseConfig": "globalbatch.noise",
    "probe_micro_batch": "globalbatch.probe",
    "probe_model": "globalbatch.probe",
}

__all__ = ["__version__", *_EXPORTS]  # ``gb.probe`` (the package, callable: deprecated) is not listed


def __getattr__(name: str) -> Any:
    if name == "probe":  # the package (callable, deprecated) whatever was imported first: never a changing name
        return importlib.import_module("globalbatch.probe")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'globalbatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | {"probe"})
