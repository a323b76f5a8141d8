"""Peak memory: the linear model, recognising and releasing out of memory, measuring CPU peaks.

* :class:`MemoryModel` / :func:`fit_memory_model`: ``peak = a + b·size``, fitted on the
  largest measured sizes, predicts the largest size under a budget.
* :func:`is_oom_error` tells out of memory from every other error; :func:`release_memory`
  returns the memory after one; :func:`run_or_oom` runs a trial and turns its OOM into a failed result.
* ``_CpuTensorPeak`` (profiler memory events), ``_reset_peak_rss`` / ``_read_status_kib``
  (``VmHWM``) and ``_static_bytes`` measure a CPU trial's peak for ``TrainStepRunner``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from globalbatch.errors import SettingError
from globalbatch.probe.trial import TrialResult, _one_line

_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "MPS backend out of memory",
    "XPU out of memory",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryModel:
    """Peak memory as a line in the micro-batch: ``peak = intercept_bytes + bytes_per_sample · size``."""

    intercept_bytes: float
    """Memory that does not grow with the batch: weights, gradients, optimizer state, workspaces."""
    bytes_per_sample: float
    """Activation (and batch) bytes added per sample."""
    sizes: tuple[int, ...]
    """The micro-batch sizes the line was fitted on."""
    max_residual_bytes: float = 0.0
    """Largest distance of a fitted peak from the line (0 for two points, or for exactly linear peaks)."""

    def peak_bytes(self, micro_batch: int) -> float:
        return self.intercept_bytes + self.bytes_per_sample * micro_batch

    def largest_fitting(self, budget_bytes: float) -> Optional[int]:
        """The largest size the line puts at or under ``budget_bytes`` (None if the slope is not positive)."""
        if not self.bytes_per_sample > 0 or not math.isfinite(self.bytes_per_sample):
            return None
        # Peaks are whole bytes: a boundary at exactly the budget must not round down through the fit's
        # rounding error, and a budget one byte below a boundary must not round up. Half a byte of slack
        # (less for a slope under one byte per sample) does both; a slack in samples (such as + 1e-6)
        # swallowed budgets up to b·1e-6 bytes below a boundary (30 bytes at 30 MiB/sample).
        slack_bytes = min(0.5, 0.5 * self.bytes_per_sample)
        return math.floor((budget_bytes - self.intercept_bytes + slack_bytes) / self.bytes_per_sample)


def fit_memory_model(trials: Iterable[TrialResult], *, max_points: int = 3) -> Optional[MemoryModel]:
    """Least-squares line through the measured peaks of the ``max_points`` largest sizes.

    Fitting only the sizes nearest the boundary keeps the line local: small sizes carry
    allocator rounding and (for ragged batches) shorter rows. Trials that failed on the
    budget have a measured peak and are used; exception OOMs have none and are not.
    Returns None with fewer than two distinct measured sizes.
    """
    points: dict[int, int] = {}
    for t in trials:
        if t.peak_memory_bytes is not None:
            points[t.micro_batch] = t.peak_memory_bytes
    if len(points) < 2:
        return None
    sizes = sorted(points)[-max_points:]
    x = np.asarray(sizes, dtype=np.float64)
    y = np.asarray([points[s] for s in sizes], dtype=np.float64)
    # Centred on the mean size and peak: a well-conditioned fit, so exact peaks give the line to well
    # under a byte (the half-byte slack of ``largest_fitting`` needs that).
    x0, y0 = float(x.mean()), float(y.mean())
    design = np.stack([np.ones_like(x), x - x0], axis=1)
    (offset, slope), *_ = np.linalg.lstsq(design, y - y0, rcond=None)
    intercept = y0 + offset - slope * x0
    residual = float(np.max(np.abs(y - (intercept + slope * x))))
    return MemoryModel(intercept_bytes=float(intercept), bytes_per_sample=float(slope), sizes=tuple(sizes),
                       max_residual_bytes=residual)



# ---------------------------------------------------------------------------
# Out of memory: recognise, release
# ---------------------------------------------------------------------------


def is_oom_error(exc: BaseException) -> bool:
    """True for out-of-memory errors only; anything else must be re-raised, not retried.

    Recognised: ``torch.cuda.OutOfMemoryError``, ``MemoryError``, and RuntimeErrors whose
    message contains one of: "CUDA out of memory", "CUDA error: out of memory",
    "DefaultCPUAllocator: can't allocate memory", "MPS backend out of memory",
    "XPU out of memory". Not recognised (re-raised): "an illegal memory access", cuDNN
    and NCCL errors, shape errors.
    """
    cuda_oom = getattr(torch.cuda, "OutOfMemoryError", None)
    if cuda_oom is not None and isinstance(exc, cuda_oom):
        return True
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc)
        return any(m in message for m in _OOM_MESSAGES)
    return False


def release_memory() -> None:
    """Collect garbage and return cached CUDA blocks (call after an OOM, outside its ``except``)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def run_or_oom(run: Callable[[int], TrialResult], size: int, *, on_error: Optional[Callable[[], object]] = None,
               cleanup: Optional[Callable[[], None]] = None) -> TrialResult:
    """``run(size)``; when it runs out of memory (:func:`is_oom_error`), a failed ``TrialResult(oom=True)``
    with the error's line, returned after :func:`release_memory` — outside the ``except``, where the
    traceback no longer pins the activations. Any other error is re-raised, after ``on_error``.
    ``cleanup`` runs either way, before the memory is released."""
    note: Optional[str] = None
    try:
        return run(size)
    except Exception as exc:
        if not is_oom_error(exc):
            if on_error is not None:
                on_error()
            raise
        note = _one_line(exc)
    finally:
        if cleanup is not None:
            cleanup()
    release_memory()
    return TrialResult(micro_batch=size, oom=True, note=note or "out of memory")



# ---------------------------------------------------------------------------
# Measuring a CPU trial's peak
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_stderr_fd() -> Iterator[None]:
    """Silence fd 2 briefly: kineto prints 'profiler_start/stop' lines there on enter and exit."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (e.g. captured in some notebooks)
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class _CpuTensorPeak:
    """Peak of live tensor bytes allocated inside the window, from the profiler's memory events."""

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self) -> "_CpuTensorPeak":
        with _quiet_stderr_fd():
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        with _quiet_stderr_fd():
            self._prof.__exit__(*exc)

    def peak_bytes(self) -> int:
        profiler: Any = self._prof.profiler  # torch's private kineto results: not in its stubs
        events = [e for e in profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        running = peak = 0
        for e in events:
            running += e.nbytes()  # > 0 allocation, < 0 free
            peak = max(peak, running)
        return peak


def _read_status_kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise SettingError("cpu_memory", "rss", "'rss' on Linux only", why=f"no {key} in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as fh:  # "5" resets VmHWM to the current RSS (Linux ≥ 4.0)
        fh.write("5")


def trainable_params(model: nn.Module) -> int:
    """Elements of the parameters that require a gradient: what an optimizer step updates."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _static_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total

