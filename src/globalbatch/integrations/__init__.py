"""Exact global batches, the plan check and the noise scale inside the frameworks users already train with.

* :mod:`globalbatch.integrations.hf` — Hugging Face ``Trainer``: :class:`~globalbatch.integrations.hf.GlobalBatchTrainer`
  (or the mixin) for exact token-normalized accumulation across micro-batches and ranks, and
  :class:`~globalbatch.integrations.hf.GlobalBatchCallback` for the plan check and the logged metrics.
* :mod:`globalbatch.integrations.accelerate` — :class:`~globalbatch.integrations.accelerate.ExactAccumulation`
  makes an ``accelerator.accumulate`` loop exact.
* :mod:`globalbatch.integrations.lightning` — :class:`~globalbatch.integrations.lightning.ExactAccumulationMixin`
  (manual optimization through :class:`~globalbatch.step.StepDriver`) and a plan/logging ``Callback``.

Each submodule imports its framework; install it with ``pip install 'globalbatch[hf]'`` or
``'globalbatch[lightning]'``. This package itself imports nothing heavy. See ``docs/integrations.md``.
"""

from __future__ import annotations

import importlib
from typing import Any


def require(module: str, extra: str) -> Any:
    """Import ``module`` or raise ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"{module} is not installed; allowed: install it with pip install 'globalbatch[{extra}]'") from e
