"""Activation memory per sample, measured from two forward + backward points (for :mod:`globalbatch.plan.memory`).

The memory model (:mod:`globalbatch.plan.memory`) computes weights, gradients and optimizer states
from the parameter count; activations it takes from a measurement: the peak of one forward +
backward (no optimizer step, so no optimizer state) at two micro-batch sizes. The slope is the
bytes per sample; the intercept minus the formula's weights + gradients is the workspace.

The default points are 8 and 16: a tinygpt micro-batch is padded to its longest document, and
below about 10 samples a batch may be narrower than ``seq_len`` (docs/probe.md), which would
understate the per-sample bytes. Peaks are measured like the probe's trials: CUDA
``max_memory_allocated``; CPU the parameter bytes plus the profiler's peak of live tensor bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import islice
from typing import Any, Optional

import torch
from torch import nn

from globalbatch.plan.memory import Activations, activations_from_points
from globalbatch.probe.memory import _CpuTensorPeak, _static_bytes, trainable_params

DEFAULT_POINTS = (8, 16)


def forward_backward_peak(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> int:
    """Peak bytes of one forward + backward of ``batch`` (model weights included), gradients dropped after."""
    model.zero_grad(set_to_none=True)
    model.train()
    device = next(model.parameters()).device
    try:
        if device.type == "cuda":  # written for CUDA, not yet run on a GPU
            torch.cuda.synchronize(device)  # host sync: measurement boundary, not a training loop
            torch.cuda.reset_peak_memory_stats(device)
            loss_fn(model, batch).backward()
            torch.cuda.synchronize(device)
            return int(torch.cuda.max_memory_allocated(device))
        static = _static_bytes(model)
        with _CpuTensorPeak() as window:
            loss_fn(model, batch).backward()
        return static + window.peak_bytes()
    finally:
        model.zero_grad(set_to_none=True)


def measure_activations(model: nn.Module, make_batch: Callable[[int], Any],
                        loss_fn: Callable[[nn.Module, Any], torch.Tensor], *,
                        points: Sequence[int] = DEFAULT_POINTS) -> Activations:
    """Activations from forward + backward peaks at ``points`` (fp32 weights and gradients assumed).

    The formula part of each peak is the model's parameter bytes (measured, buffers included)
    plus fp32 gradients of the trainable parameters; the rest of the intercept is the workspace.
    """
    trainable = trainable_params(model)
    formula = _static_bytes(model) + 4 * trainable
    peaks = [(int(s), float(forward_backward_peak(model, make_batch(int(s)), loss_fn))) for s in points]
    return activations_from_points(peaks, formula_static_bytes=formula,
                                   source="fwd+bwd measured at micro-batch " + ", ".join(str(s) for s in points))


def task_memory_inputs(task: Any, *, seed: int = 0, device: Optional[str] = None,
                       points: Sequence[int] = DEFAULT_POINTS) -> tuple[int, tuple[tuple[int, ...], ...], Activations]:
    """(trainable params, their shapes, measured activations) of a :mod:`globalbatch.lab.tasks` task object."""
    torch_device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = task.build_model(seed).to(torch_device)
    pool = list(islice(task.sample_order(seed), min(max(points), task.num_train_samples)))

    def make_batch(micro_batch: int) -> Any:
        return task.collate([pool[i % len(pool)] for i in range(micro_batch)], torch_device)

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        loss_sum, count = task.loss_sum(m, batch)
        return loss_sum / count.clamp(min=1)

    acts = measure_activations(model, make_batch, loss_fn, points=points)
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in params), tuple(tuple(p.shape) for p in params), acts

