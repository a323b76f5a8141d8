"""Model FLOPs and peak FLOP/s of a lab task: MFU and valid tokens/s for the experiment loop.

:func:`task_flops` counts the task's model with FlopCounterMode at set-up (never inside a
timed window) and returns ``flops(batch, samples)`` for every later micro-batch without
another count:

* token task: :class:`globalbatch.flops.SequenceFlops` — one row of a real collated batch,
  cut to two widths (padding costs FLOPs like any token, so the content does not matter),
  gives ``α·w + β·w²`` per sequence, exact for matmuls and attention at every padded width;
* sample task: one sample counted once, times the samples (a per-sample model's FLOPs are
  linear in the batch).

:func:`task_peak` is the device's peak for the run's precision (a measured matmul on CPU,
the A100/H100/H200 table on CUDA — untested here, no GPU), or None when unknown.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional

import torch

from globalbatch.flops import PeakFlops, SequenceFlops, count_flops, peak_flops_per_s

__all__ = ["task_flops", "task_peak", "batch_width"]

_PROBE_SAMPLES = 16


def _rows(batch: Any, rows: int, width: Optional[int] = None) -> Any:
    """The first ``rows`` samples of a dict batch, every (batch, width, …) tensor cut to ``width``."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 1:
            value = value[:rows]
            if width is not None and value.ndim >= 2:
                value = value[:, :width]
        out[key] = value
    return out


def batch_width(batch: Any) -> Optional[int]:
    """The padded width of a token batch: dim 1 of its first tensor with two or more dims."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.ndim >= 2:
            return int(value.shape[1])
    return None


def task_flops(task: Any, model: torch.nn.Module, device: Any) -> Optional[Callable[[Any, int], float]]:
    """``flops(batch, samples)`` (forward + backward) for ``task``'s micro-batches, or None when the batch
    is not a dict of tensors (a user task with another batch type: no MFU)."""
    ref = task.collate(list(itertools.islice(task.sample_order(0), _PROBE_SAMPLES)), device)
    if not isinstance(ref, dict):
        return None

    def loss(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return task.loss_sum(m, b)[0]

    if getattr(task, "unit", None) == "token":
        width = batch_width(ref)
        if width is None or width < 2:
            return None
        seq = SequenceFlops(model, lambda w: _rows(ref, 1, w), loss, widths=(width // 2, width))
        return lambda batch, samples: seq(samples, batch_width(batch) or width)
    per_sample = float(count_flops(model, _rows(ref, 1), loss))
    return lambda batch, samples: per_sample * samples


def task_peak(device: Any, precision: str) -> Optional[PeakFlops]:
    """Peak FLOP/s of one device for ``precision`` (``fp32``, ``bf16``, ``fp16``); None when unknown."""
    try:
        return peak_flops_per_s(device=str(device), dtype=precision)
    except ValueError:
        return None
