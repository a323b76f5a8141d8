"""Probe the largest micro-batch that fits on this device, and the fastest one.

The seeds' practice: find the largest micro-batch that runs efficiently on one
device, reach the global batch with gradient accumulation, then scale DP. This
package finds that micro-batch *exactly* and measures what each size costs.

Search (``probe_micro_batch``, :mod:`globalbatch.probe.search`)::

    lo = largest size known to fit (0: none yet)     hi = smallest size known not to fit
    grow:    2, 4, 8, …  (doubling, capped at max_micro_batch) until a size fails; if 2 fails, 1
    bracket: the answer lies in [lo, hi); every trial halves it (bisection) …
    predict: … unless the fitted memory line  peak = a + b·size  and a known budget
             (``memory_limit_bytes``, or the device's capacity) predict the boundary
             p = ⌊(budget − a) / b⌋: then run p (expected to fit) and p + 1 (expected
             to fail); two trials close the bracket. A prediction is only ever used
             inside the current bracket (never a jump past the next doubling), and after
             ``max_prediction_misses`` wrong predictions the search is plain bisection.

Every size reported as fitting has run (``TrialResult`` in ``ProbeResult.trials``).
Trials for an answer T ≥ 2 (pure OOM signal, no memory model): ⌊log2 T⌋ + 1 to bracket
(2, 4, …, 2^⌊log2 T⌋ fit, the next doubling fails), ⌊log2 T⌋ to bisect, so 2⌊log2 T⌋ + 1 ≤
2⌈log2 T⌉ + 1 for every T ≥ 2, powers of two included; T = 1 takes 2 (2 fails, 1 fits).
Starting at 1 would cost one more trial (2⌊log2 T⌋ + 2, over the bound for T = 2^k). With a
linear memory and a known budget: ⌈log2 T⌉ + 1 (docs/probe.md has the table). Wrong
predictions cost at most 2 trials each, and at most ``max_prediction_misses`` (2) of them happen.

A trial (``TrainStepRunner``, :mod:`globalbatch.probe.runner`) runs ``warmup_steps`` +
``steps_per_trial`` full training steps (forward, backward, optimizer step,
zero_grad(set_to_none)) on one fixed batch; the warm-up steps are untimed (the first one
allocates the optimizer state).

Peak memory (:mod:`globalbatch.probe.memory`):

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``
  (all live tensors on the device, as the caching allocator counts them).
* CPU, ``cpu_memory="tensors"`` (default): the bytes of the model's parameters and
  buffers plus the peak of the running sum of tensor allocations minus frees during the
  warm-up steps, read from the PyTorch profiler's memory events (``profile_memory=True``).
  Exact for tensors, comparable with CUDA's number, so a CPU run can plan for another
  device; the profiler slows the warm-up steps, which are untimed anyway.
* CPU, ``cpu_memory="rss"``: the process's peak resident set (``VmHWM`` in
  ``/proc/self/status``, reset per trial by writing 5 to ``/proc/self/clear_refs``).
  Includes Python, the allocator's cache and everything else; history dependent (freed
  memory may stay resident), so it is not the default.

Out of memory is recognised precisely (:func:`is_oom_error`): ``torch.cuda.OutOfMemoryError``,
``MemoryError`` and RuntimeErrors whose message says CUDA/MPS/XPU out of memory or
"DefaultCPUAllocator: can't allocate memory". Other errors (an illegal address, a shape
bug) are re-raised, never retried. With ``memory_limit_bytes`` a measured peak above the
budget counts as out of memory. Under ``torch.distributed`` the flag (0 fits, 1 OOM,
2 failed), peak memory and step time are all-reduced with MAX after every trial, so all
ranks take the same next size (:mod:`globalbatch.probe.trial`).
"""

from __future__ import annotations

import sys
import types
import warnings

from globalbatch.probe.memory import MemoryModel, fit_memory_model, is_oom_error, release_memory
from globalbatch.probe.report import geometry_text, limit_text, probe_table
from globalbatch.probe.runner import TrainStepRunner, TrialConfig, probe, probe_model
from globalbatch.probe.search import (
    DEFAULT_MAX_MICRO_BATCH,
    DEFAULT_START_MICRO_BATCH,
    GlobalBatchChoice,
    NothingFits,
    ProbeConfig,
    ProbeResult,
    check_probe_settings,
    choose_fastest,
    probe_micro_batch,
)
from globalbatch.probe.trial import TrialResult, format_bytes

__all__ = [
    "TrialResult",
    "MemoryModel",
    "fit_memory_model",
    "ProbeConfig",
    "GlobalBatchChoice",
    "ProbeResult",
    "probe_micro_batch",
    "choose_fastest",
    "is_oom_error",
    "release_memory",
    "TrialConfig",
    "TrainStepRunner",
    "probe",
    "probe_model",
    "probe_table",
    "geometry_text",
    "limit_text",
    "NothingFits",
    "check_probe_settings",
    "format_bytes",
    "DEFAULT_MAX_MICRO_BATCH",
    "DEFAULT_START_MICRO_BATCH",
]


class _CallablePackage(types.ModuleType):
    """``gb.probe`` names this package once ``import globalbatch.probe`` has run, so the package answers
    ``gb.probe(model, …)`` itself, whatever was imported first (deprecated: call :func:`probe_model`)."""

    def __call__(self, *args, **kwargs):
        warnings.warn("globalbatch.probe(...) is deprecated; call globalbatch.probe_model(...)", FutureWarning,
                      stacklevel=2)
        return probe_model(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
