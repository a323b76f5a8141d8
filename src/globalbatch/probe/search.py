"""Probe the largest micro-batch that fits on this device, and the fastest one.

The seeds' practice: find the largest micro-batch that runs efficiently on one
device, reach the global batch with gradient accumulation, then scale DP. This
module finds that micro-batch *exactly* and measures what each size costs.

Search (``probe_micro_batch``)::

    lo = largest size known to fit (0: none yet)     hi = smallest size known not to fit
    grow:    1, 2, 4, …  (doubling, capped at max_micro_batch) until a size fails
    bracket: the answer lies in [lo, hi); every trial halves it (bisection) …
    predict: … unless the fitted memory line  peak = a + b·size  and a known budget
             (``memory_limit_bytes``, or the device's capacity) predict the boundary
             p = ⌊(budget − a) / b⌋: then run p (expected to fit) and p + 1 (expected
             to fail); two trials close the bracket. A prediction is only ever used
             inside the current bracket (never a jump past the next doubling), and after
             ``max_prediction_misses`` wrong predictions the search is plain bisection.

Every size reported as fitting has run (``TrialResult`` in ``ProbeResult.trials``).
Trials (pure OOM signal, no memory model): ⌊log2 T⌋ + 2 to bracket, ⌊log2 T⌋ to bisect,
so 2⌊log2 T⌋ + 2 ≤ 2⌈log2 T⌉ + 1 for T not a power of two (T = 2^k: 2k + 2). With a linear
memory and a known budget: ⌈log2 T⌉ + 2 (docs/probe.md has the table). Wrong predictions
cost at most 2 trials each, and at most ``max_prediction_misses`` (2) of them happen.

A trial (``TrainStepRunner``) runs ``warmup_steps`` + ``steps_per_trial`` full training
steps (forward, backward, optimizer step, zero_grad(set_to_none)) on one fixed batch;
the warm-up steps are untimed (the first one allocates the optimizer state).

Peak memory:

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
ranks take the same next size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from globalbatch.plan import BatchGeometry, solve_geometry

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
    "probe_task",
    "probe_table",
    "format_bytes",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_MICRO_BATCH = 8192
"""Upper end of the search when neither ``max_micro_batch`` nor a global batch bounds it."""

_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "MPS backend out of memory",
    "XPU out of memory",
)

# The all-reduced per-trial record: flag, peak bytes, step seconds, tokens per step, −capacity.
_FITS, _OOM, _FAILED = 0.0, 1.0, 2.0


def _over_budget(peak: int, limit: int) -> str:
    """``peak 1,026.26 MiB > limit 1,024.00 MiB``: one unit, enough digits to see the difference."""
    return f"peak {peak / 2**20:,.2f} MiB > limit {limit / 2**20:,.2f} MiB"


def format_bytes(num_bytes: Optional[float]) -> str:
    """``1610612736`` → ``'1.50 GiB'``; None → ``'-'``."""
    if num_bytes is None:
        return "-"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"  # pragma: no cover - loop always returns


# ---------------------------------------------------------------------------
# Trials and the memory model
# ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class TrialResult:
    """What one trial at one micro-batch size measured."""

    micro_batch: int
    """Samples per forward/backward on this rank."""
    oom: bool = False
    """True when the trial ran out of memory or its peak exceeded the memory budget."""
    peak_memory_bytes: Optional[int] = None
    """Peak bytes during the trial (see the module docstring for what is counted); None if not measured."""
    step_time_s: Optional[float] = None
    """Median seconds per timed training step (warm-up excluded); None for a failed trial."""
    tokens_per_step: Optional[int] = None
    """Tokens (padding included) per micro-batch on this rank; None when the batch has no token count."""
    capacity_bytes: Optional[int] = None
    """Bytes the device could hold for this process (CUDA: free + reserved by torch); None if unknown."""
    note: str = ""
    """Why a trial failed (one line), or extra detail."""

    def __post_init__(self) -> None:
        if isinstance(self.micro_batch, bool) or not isinstance(self.micro_batch, int) or self.micro_batch < 1:
            raise ValueError(f"micro_batch {self.micro_batch!r} is not allowed; allowed: an int ≥ 1")

    @property
    def fits(self) -> bool:
        """The trial ran to the end within memory."""
        return not self.oom

    def samples_per_s(self) -> Optional[float]:
        """Samples per second on this rank (None without a timing)."""
        if self.oom or not self.step_time_s:
            return None
        return self.micro_batch / self.step_time_s

    def tokens_per_s(self) -> Optional[float]:
        """Tokens per second on this rank (None without a timing or a token count)."""
        if self.oom or not self.step_time_s or self.tokens_per_step is None:
            return None
        return self.tokens_per_step / self.step_time_s

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["samples_per_s"] = self.samples_per_s()
        out["tokens_per_s"] = self.tokens_per_s()
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryModel:
    """Peak memory as a line in the micro-batch: ``peak = intercept_bytes + bytes_per_sample · size``."""

    intercept_bytes: float
    """Memory that does not grow with the batch: weights, gradients, optimizer state, workspaces."""
    bytes_per_sample: float
    """Activation (and batch) bytes added per sample."""
    sizes: tuple[int, ...]
    """The micro-batch sizes the line was fitted on."""

    def peak_bytes(self, micro_batch: int) -> float:
        return self.intercept_bytes + self.bytes_per_sample * micro_batch

    def largest_fitting(self, budget_bytes: float) -> Optional[int]:
        """The largest size the line puts at or under ``budget_bytes`` (None if the slope is not positive)."""
        if not self.bytes_per_sample > 0 or not math.isfinite(self.bytes_per_sample):
            return None
        # + 1e-6: a boundary that lands exactly on an integer must not round down through lstsq's rounding error.
        return math.floor((budget_bytes - self.intercept_bytes) / self.bytes_per_sample + 1e-6)


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
    design = np.stack([np.ones_like(x), x], axis=1)
    (intercept, slope), *_ = np.linalg.lstsq(design, y, rcond=None)
    return MemoryModel(intercept_bytes=float(intercept), bytes_per_sample=float(slope), sizes=tuple(sizes))


# ---------------------------------------------------------------------------
# Out of memory: recognise, release, agree
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


def _one_line(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _all_reduce_max(values: list[float]) -> list[float]:
    """Element-wise MAX over ranks (identity without an initialised process group)."""
    if not _dist_ready():
        return values
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    buf = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return buf.tolist()  # host sync: once per trial, the search needs the agreed values


def _encode(x: Optional[float]) -> float:
    return -math.inf if x is None else float(x)


def _decode(x: float) -> Optional[float]:
    return None if x == -math.inf else x


def _agree(result: Optional[TrialResult], micro_batch: int, flag: float) -> TrialResult:
    """All ranks agree on the trial: MAX of the flag, peak, step time, tokens; MIN of capacity."""
    r = result or TrialResult(micro_batch=micro_batch, oom=flag != _FITS)
    local = [flag, _encode(r.peak_memory_bytes), _encode(r.step_time_s), _encode(r.tokens_per_step),
             _encode(None if r.capacity_bytes is None else -r.capacity_bytes)]
    if not _dist_ready():
        return r
    agreed_flag, peak, step, tokens, neg_cap = _all_reduce_max(local)
    if agreed_flag == _FAILED and flag != _FAILED:
        raise RuntimeError(f"probe: another rank failed at micro_batch {micro_batch} (see its log)")
    note = r.note if flag == agreed_flag else "another rank ran out of memory"
    cap = _decode(neg_cap)
    return TrialResult(
        micro_batch=micro_batch,
        oom=agreed_flag != _FITS,
        peak_memory_bytes=None if _decode(peak) is None else int(peak),
        step_time_s=None if agreed_flag != _FITS else _decode(step),
        tokens_per_step=None if _decode(tokens) is None else int(tokens),
        capacity_bytes=None if cap is None else int(-cap),
        note=note,
    )


# ---------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class ProbeConfig:
    """Settings of :func:`probe_micro_batch`."""

    max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH
    """Never try a larger micro-batch (e.g. global batch ÷ dp: a larger one cannot be used)."""
    start_micro_batch: int = 1
    """First size tried; growth doubles from here."""
    memory_limit_bytes: Optional[int] = None
    """Budget in bytes: a measured peak above it counts as out of memory (plan for a smaller device, or CPU)."""
    tolerance: float = 0.05
    """The fastest micro-batch is the smallest within this fraction of the best throughput."""
    use_memory_model: bool = True
    """Predict the boundary from a fitted ``a + b·size`` line; False means plain bisection."""
    max_prediction_misses: int = 2
    """After this many wrong predictions the search bisects."""

    def __post_init__(self) -> None:
        for name in ("max_micro_batch", "start_micro_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r} is not allowed; allowed: an int ≥ 1")
        if self.start_micro_batch > self.max_micro_batch:
            raise ValueError(f"start_micro_batch {self.start_micro_batch} is above max_micro_batch "
                             f"{self.max_micro_batch}; allowed: start ≤ max")
        if self.memory_limit_bytes is not None and (
                isinstance(self.memory_limit_bytes, bool) or not isinstance(self.memory_limit_bytes, int)
                or self.memory_limit_bytes < 1):
            raise ValueError(f"memory_limit_bytes {self.memory_limit_bytes!r} is not allowed; "
                             "allowed: None or an int ≥ 1")
        if not (isinstance(self.tolerance, (int, float)) and 0 <= self.tolerance < 1):
            raise ValueError(f"tolerance {self.tolerance!r} is not allowed; allowed: 0 ≤ tolerance < 1")
        if self.max_prediction_misses < 0:
            raise ValueError(f"max_prediction_misses {self.max_prediction_misses} is not allowed; allowed: ≥ 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class GlobalBatchChoice:
    """A probed micro-batch and the accumulation that keeps the global batch."""

    role: str
    """``"largest"`` (largest that fits) or ``"fastest"`` (throughput-optimal)."""
    micro_batch: int
    """The probe's pick for this role."""
    geometry: Optional[BatchGeometry]
    """global = micro × accum × dp for ``micro_batch``; None when it does not divide."""
    error: Optional[str] = None
    """Why ``micro_batch`` cannot keep the global batch, with the suggested replacement."""
    suggested_micro_batch: Optional[int] = None
    """A size that has run, fits and divides global ÷ dp (only when ``geometry`` is None)."""
    suggested_geometry: Optional[BatchGeometry] = None
    """The geometry of ``suggested_micro_batch``."""

    @property
    def usable(self) -> Optional[BatchGeometry]:
        """The geometry to train with: ``geometry``, else ``suggested_geometry``."""
        return self.geometry or self.suggested_geometry


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeResult:
    """Everything the probe ran and what it concluded."""

    trials: tuple[TrialResult, ...]
    """Every trial in the order it ran (agreed across ranks)."""
    largest_fit: int
    """The largest micro-batch that fits; it has run."""
    limited_by: str
    """``"memory"`` (largest_fit + 1 failed) or ``"max_micro_batch"`` (the cap fits)."""
    fastest: Optional[int]
    """Smallest size within ``tolerance`` of the best throughput (None without timings)."""
    tolerance: float
    memory_limit_bytes: Optional[int] = None
    memory_model: Optional[MemoryModel] = None
    """The last fitted line (None when fewer than two peaks were measured)."""
    prediction_misses: int = 0
    choices: tuple[GlobalBatchChoice, ...] = ()
    """For a given global batch: one choice per role (empty when no global batch was given)."""

    @property
    def num_trials(self) -> int:
        return len(self.trials)

    def by_size(self) -> list[TrialResult]:
        """Trials sorted by micro-batch."""
        return sorted(self.trials, key=lambda t: t.micro_batch)

    def to_dict(self) -> dict[str, Any]:
        def geo(g: Optional[BatchGeometry]) -> Optional[dict[str, int]]:
            return None if g is None else dataclasses.asdict(g)

        return {
            "largest_fit": self.largest_fit,
            "limited_by": self.limited_by,
            "fastest": self.fastest,
            "tolerance": self.tolerance,
            "memory_limit_bytes": self.memory_limit_bytes,
            "num_trials": self.num_trials,
            "prediction_misses": self.prediction_misses,
            "memory_model": None if self.memory_model is None else dataclasses.asdict(self.memory_model),
            "trials": [t.to_dict() for t in self.trials],
            "choices": [
                {"role": c.role, "micro_batch": c.micro_batch, "geometry": geo(c.geometry), "error": c.error,
                 "suggested_micro_batch": c.suggested_micro_batch,
                 "suggested_geometry": geo(c.suggested_geometry)}
                for c in self.choices
            ],
        }


def _throughput(t: TrialResult, use_tokens: bool) -> Optional[float]:
    return t.tokens_per_s() if use_tokens else t.samples_per_s()


def choose_fastest(trials: Iterable[TrialResult], tolerance: float = 0.05) -> Optional[int]:
    """The smallest fitting micro-batch whose throughput is within ``tolerance`` of the best.

    Throughput is tokens/s when every timed trial has a token count, else samples/s.
    Smaller wins ties because it leaves memory free and needs fewer samples per step.
    Returns None when no fitting trial was timed.
    """
    timed = [t for t in trials if t.fits and t.step_time_s]
    if not timed:
        return None
    use_tokens = all(t.tokens_per_step is not None for t in timed)
    best = max(_throughput(t, use_tokens) for t in timed)
    good = [t.micro_batch for t in timed if _throughput(t, use_tokens) >= (1.0 - tolerance) * best]
    return min(good)


class _Search:
    """State of one probe: the bracket [lo, hi), the trials, the memory model."""

    def __init__(self, run_trial: Callable[[int], TrialResult], config: ProbeConfig) -> None:
        self.run_trial = run_trial
        self.config = config
        self.trials: list[TrialResult] = []
        self.by_size: dict[int, TrialResult] = {}
        self.lo = 0  # largest size known to fit
        self.hi = config.max_micro_batch + 1  # smallest size known not to fit (virtual until observed)
        self.hi_observed = False
        self.misses = 0
        self.model: Optional[MemoryModel] = None
        self.confirm: Optional[int] = None  # after a predicted p fit: p + 1 must run next (expected to fail)
        self.next_growth = config.start_micro_batch  # the next doubling; predicted trials never move it

    # -- one trial ------------------------------------------------------------------

    def run(self, size: int) -> TrialResult:
        result: Optional[TrialResult] = None
        oom_note: Optional[str] = None
        try:
            result = self.run_trial(size)
        except Exception as exc:
            if not is_oom_error(exc):
                _agree(None, size, _FAILED)  # tell the other ranks before raising; no-op single-process
                raise
            oom_note = _one_line(exc)
        # Outside the ``except``: the exception, its traceback and the frames holding
        # activations are gone, so the memory can really be released.
        if result is None:
            release_memory()
            result = TrialResult(micro_batch=size, oom=True, note=oom_note or "out of memory")
        if result.micro_batch != size:
            raise ValueError(f"run_trial({size}) returned a TrialResult for micro_batch {result.micro_batch}; "
                             "allowed: the size it was asked to run")
        limit = self.config.memory_limit_bytes
        if not result.oom and limit is not None:
            if result.peak_memory_bytes is None:
                raise ValueError(f"memory_limit_bytes {limit} needs trials that measure peak_memory_bytes; "
                                 f"run_trial({size}) returned None")
            if result.peak_memory_bytes > limit:
                result = dataclasses.replace(
                    result, oom=True, step_time_s=None,
                    note=_over_budget(result.peak_memory_bytes, limit))
        result = _agree(result, size, _OOM if result.oom else _FITS)
        self.trials.append(result)
        self.by_size[size] = result
        if result.fits:
            self.lo = max(self.lo, size)
        else:
            self.hi = min(self.hi, size)
            self.hi_observed = True
        self.model = fit_memory_model(self.trials) if self.config.use_memory_model else None
        _log_trial(result)
        return result

    # -- choosing the next size -----------------------------------------------------

    def budget_bytes(self) -> Optional[float]:
        if self.config.memory_limit_bytes is not None:
            return float(self.config.memory_limit_bytes)
        caps = [t.capacity_bytes for t in self.trials if t.capacity_bytes is not None]
        return float(min(caps)) if caps else None

    def prediction(self, upper: int) -> Optional[tuple[int, bool]]:
        """(candidate, expected to fit) from the memory line, if it lands in [lo, upper)."""
        if self.model is None or self.misses >= self.config.max_prediction_misses or self.lo < 1:
            return None
        budget = self.budget_bytes()
        if budget is None:
            return None
        p = self.model.largest_fitting(budget)
        if p is None or p < self.lo or p >= upper:
            return None
        if p == self.lo:
            return self.lo + 1, False  # the line says lo is the boundary: confirm lo + 1 fails
        return p, True

    def next_size(self) -> tuple[int, Optional[bool]]:
        if self.lo == 0 and not self.trials:
            return self.config.start_micro_batch, None
        confirm, self.confirm = self.confirm, None
        if confirm is not None and self.lo < confirm < self.hi:
            return confirm, False  # a prediction is a pair (p, p + 1); no re-predicting in between
        if not self.hi_observed:  # growing
            grow = min(self.next_growth, self.hi - 1)
            predicted = self.prediction(grow)
            return predicted if predicted else (grow, None)
        predicted = self.prediction(self.hi)
        if predicted:
            return predicted
        if self.model is not None and self.budget_bytes() is not None and self.lo >= 1 \
                and self.misses < self.config.max_prediction_misses:
            p = self.model.largest_fitting(self.budget_bytes())
            if p is not None and p >= self.hi:
                self.misses += 1  # the line says hi fits, but hi failed: the line is wrong here
        return (self.lo + self.hi) // 2, None

    def search(self) -> None:
        while self.hi - self.lo > 1:
            size, expect_fit = self.next_size()
            result = self.run(size)
            if expect_fit and result.fits:
                self.confirm = size + 1
            if result.fits and expect_fit is None and not self.hi_observed:
                self.next_growth = 2 * size  # a growth step fit: keep doubling
            if expect_fit is not None and result.fits != expect_fit:
                self.misses += 1
                log.info("probe: memory line predicted micro_batch %d would %s; it did not (miss %d)",
                         size, "fit" if expect_fit else "fail", self.misses)

    # -- keeping the global batch ---------------------------------------------------

    def choices(self, global_batch: int, dp_world_size: int) -> tuple[GlobalBatchChoice, ...]:
        """One choice per role; may run one more trial to verify a suggested divisor."""
        per_rank = global_batch // dp_world_size
        # Largest: the largest divisor of global ÷ dp at or below the largest fit, verified by a run.
        largest = self._choice("largest", self.lo, global_batch, dp_world_size, self._largest_divisor(per_rank))
        fastest = choose_fastest(self.trials, self.config.tolerance)
        if fastest is None:
            return (largest,)
        dividing = [t for t in self.trials if t.fits and per_rank % t.micro_batch == 0]
        alternative = choose_fastest(dividing, self.config.tolerance)
        return largest, self._choice("fastest", fastest, global_batch, dp_world_size, alternative)

    def _largest_divisor(self, per_rank: int) -> Optional[int]:
        for d in sorted((d for d in _divisors(per_rank) if d <= self.lo), reverse=True):
            known = self.by_size.get(d)
            if known is None:
                known = self.run(d)  # never report a size that has not run
            if known.fits:
                return d
        return None

    @staticmethod
    def _choice(role: str, micro_batch: int, global_batch: int, dp: int, alternative: Optional[int]) -> GlobalBatchChoice:
        try:
            geometry = solve_geometry(global_batch=global_batch, micro_batch=micro_batch, dp_world_size=dp)
            return GlobalBatchChoice(role=role, micro_batch=micro_batch, geometry=geometry)
        except ValueError as exc:
            message = str(exc).split("; nearest")[0]
        if alternative is None:
            return GlobalBatchChoice(role=role, micro_batch=micro_batch, geometry=None,
                                     error=f"{message}; no fitting micro-batch divides {global_batch} / {dp}")
        geometry = solve_geometry(global_batch=global_batch, micro_batch=alternative, dp_world_size=dp)
        adjective = "largest" if role == "largest" else "fastest"
        return GlobalBatchChoice(
            role=role, micro_batch=micro_batch, geometry=None,
            error=(f"{message}; the {adjective} fitting micro-batch that divides {global_batch} / dp {dp} = "
                   f"{global_batch // dp} is {alternative} (accum {geometry.grad_accum_steps})"),
            suggested_micro_batch=alternative, suggested_geometry=geometry)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _log_trial(t: TrialResult) -> None:
    if _dist_ready():
        import torch.distributed as dist

        if dist.get_rank() != 0:
            return
    if t.fits:
        tps = t.tokens_per_s()
        rate = f"{tps:,.0f} tok/s" if tps is not None else (
            f"{t.samples_per_s():,.1f} samples/s" if t.samples_per_s() is not None else "untimed")
        log.info("probe: micro_batch %d fits: peak %s, %s", t.micro_batch, format_bytes(t.peak_memory_bytes), rate)
    else:
        log.info("probe: micro_batch %d -> out of memory (%s)", t.micro_batch, t.note)


def probe_micro_batch(
    run_trial: Callable[[int], TrialResult],
    *,
    max_micro_batch: Optional[int] = None,
    start_micro_batch: int = 1,
    memory_limit_bytes: Optional[int] = None,
    tolerance: float = 0.05,
    use_memory_model: bool = True,
    max_prediction_misses: int = 2,
    global_batch: Optional[int] = None,
    dp_world_size: int = 1,
) -> ProbeResult:
    """Find the exact largest micro-batch that fits, and the throughput-optimal one.

    Args:
        run_trial: runs a few training steps at a micro-batch size and returns a
            :class:`TrialResult`; it may instead raise an out-of-memory error
            (:func:`is_oom_error`). Any other exception propagates. Inject a fake one to
            test the search; :class:`TrainStepRunner` is the real one.
        max_micro_batch: the largest size ever tried; default global ÷ dp when a global
            batch is given, else 8192.
        start_micro_batch: the first size tried (doubling starts here).
        memory_limit_bytes: a measured peak above this counts as out of memory.
        tolerance: "fastest" is the smallest size within this fraction of the best throughput.
        use_memory_model: use the fitted ``a + b·size`` line to cut the search.
        max_prediction_misses: wrong predictions allowed before plain bisection.
        global_batch: samples per optimizer step over all ranks; when given, each pick
            gets the accumulation that keeps it (and a verified replacement when it does not divide).
        dp_world_size: data-parallel ranks for the global-batch arithmetic.

    Raises:
        ValueError: bad settings (the message names the field), or global_batch not divisible by dp.
        RuntimeError: even ``start_micro_batch`` (and every size below it) runs out of memory.
    """
    if global_batch is not None:
        if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
            raise ValueError(f"dp_world_size {dp_world_size!r} is not allowed; allowed: an int ≥ 1")
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch % dp_world_size \
                or global_batch < 1:
            raise ValueError(f"global_batch {global_batch!r} is not allowed with dp {dp_world_size}; "
                             f"allowed: a positive multiple of {dp_world_size}")
        if max_micro_batch is None:
            max_micro_batch = global_batch // dp_world_size
    config = ProbeConfig(
        max_micro_batch=DEFAULT_MAX_MICRO_BATCH if max_micro_batch is None else max_micro_batch,
        start_micro_batch=start_micro_batch, memory_limit_bytes=memory_limit_bytes, tolerance=tolerance,
        use_memory_model=use_memory_model, max_prediction_misses=max_prediction_misses)
    search = _Search(run_trial, config)
    search.search()
    if search.lo == 0:
        first = search.by_size.get(1) or search.trials[-1]
        raise RuntimeError(f"probe: micro_batch 1 does not fit ({first.note}); nothing to train with")
    largest_fit = search.lo
    limited_by = "max_micro_batch" if largest_fit == config.max_micro_batch else "memory"
    choices: tuple[GlobalBatchChoice, ...] = ()
    if global_batch is not None:
        choices = search.choices(global_batch, dp_world_size)  # may run a verification trial
    fastest = choose_fastest(search.trials, config.tolerance)
    return ProbeResult(
        trials=tuple(search.trials), largest_fit=largest_fit, limited_by=limited_by, fastest=fastest,
        tolerance=config.tolerance, memory_limit_bytes=memory_limit_bytes, memory_model=search.model,
        prediction_misses=search.misses, choices=choices)


# ---------------------------------------------------------------------------
# The real trial: a few training steps of the user's model
# ---------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class TrialConfig:
    """How :class:`TrainStepRunner` runs and measures one trial."""

    steps_per_trial: int = 3
    """Timed training steps per trial (after the warm-up)."""
    warmup_steps: int = 2
    """Untimed steps first: the first allocates optimizer state, the second is the first steady step.
    On CPU memory is measured over them."""
    memory_limit_bytes: Optional[int] = None
    """Stop a trial after the warm-up when its peak is above this (saves the timed steps)."""
    cpu_memory: str = "tensors"
    """CPU peak memory: ``"tensors"`` (profiler allocation events) or ``"rss"`` (process peak RSS)."""

    def __post_init__(self) -> None:
        if isinstance(self.steps_per_trial, bool) or not isinstance(self.steps_per_trial, int) \
                or self.steps_per_trial < 1:
            raise ValueError(f"steps_per_trial {self.steps_per_trial!r} is not allowed; allowed: an int ≥ 1")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 1:
            raise ValueError(f"warmup_steps {self.warmup_steps!r} is not allowed; allowed: an int ≥ 1 "
                             "(the first step allocates optimizer state)")
        if self.cpu_memory not in ("tensors", "rss"):
            raise ValueError(f"cpu_memory {self.cpu_memory!r} is not allowed; allowed: 'tensors' or 'rss'")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes < 1:
            raise ValueError(f"memory_limit_bytes {self.memory_limit_bytes} is not allowed; allowed: None or ≥ 1")


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
        events = [e for e in self._prof.profiler.kineto_results.events() if e.name() == "[memory]"]
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
    raise ValueError(f"cpu_memory 'rss' needs {key} in /proc/self/status; allowed on Linux only")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as fh:  # "5" resets VmHWM to the current RSS (Linux ≥ 4.0)
        fh.write("5")


def _static_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def _default_count_tokens(batch: Any) -> Optional[int]:
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        return int(batch["input_ids"].numel())
    return None


class TrainStepRunner:
    """``run_trial`` for :func:`probe_micro_batch`: real training steps on the user's model.

    Each call builds one batch with ``make_batch(micro_batch)``, a fresh optimizer with
    ``optimizer_factory(model.parameters())``, runs ``warmup_steps`` untimed and
    ``steps_per_trial`` timed steps of ``loss_fn(model, batch).backward(); opt.step();
    opt.zero_grad(set_to_none=True)``, and frees everything it made (gradients set to
    None, optimizer state dropped). The steps change the weights: :func:`probe` restores
    them afterwards. Out of memory inside the trial is returned as ``oom=True``.
    """

    def __init__(self, model: nn.Module, make_batch: Callable[[int], Any],
                 loss_fn: Callable[[nn.Module, Any], torch.Tensor], *,
                 optimizer_factory: Optional[Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = None,
                 count_tokens: Optional[Callable[[Any], Optional[int]]] = None,
                 config: Optional[TrialConfig] = None) -> None:
        self.model = model
        self.make_batch = make_batch
        self.loss_fn = loss_fn
        self.optimizer_factory = optimizer_factory or _default_optimizer
        self.count_tokens = count_tokens or _default_count_tokens
        self.config = config or TrialConfig()
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")

    def __call__(self, micro_batch: int) -> TrialResult:
        oom_note: Optional[str] = None
        result: Optional[TrialResult] = None
        try:
            result = self._trial(micro_batch)
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            oom_note = _one_line(exc)
        finally:
            self.model.zero_grad(set_to_none=True)
        if result is None:  # outside the except: the traceback no longer pins activations
            release_memory()
            return TrialResult(micro_batch=micro_batch, oom=True, note=oom_note or "out of memory")
        return result

    def _step(self, batch: Any, optimizer: torch.optim.Optimizer) -> None:
        loss = self.loss_fn(self.model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def _trial(self, micro_batch: int) -> TrialResult:
        cfg = self.config
        cuda = self.device.type == "cuda"
        self.model.zero_grad(set_to_none=True)
        self.model.train()
        capacity = None
        if cuda:
            torch.cuda.synchronize(self.device)  # host sync: trial boundary, outside the timed steps
            gc.collect()
            torch.cuda.empty_cache()
            free_bytes, _total = torch.cuda.mem_get_info(self.device)
            capacity = int(free_bytes + torch.cuda.memory_reserved(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        optimizer = self.optimizer_factory(self.model.parameters())
        try:
            # -- warm-up (untimed): memory is measured here on CPU ---------------------
            if cuda:
                batch = self.make_batch(micro_batch)
                for _ in range(cfg.warmup_steps):
                    self._step(batch, optimizer)
                torch.cuda.synchronize(self.device)  # host sync: read the peak after the warm-up
                peak = int(torch.cuda.max_memory_allocated(self.device))
            elif cfg.cpu_memory == "rss":
                _reset_peak_rss()
                batch = self.make_batch(micro_batch)
                for _ in range(cfg.warmup_steps):
                    self._step(batch, optimizer)
                peak = _read_status_kib("VmHWM") * 1024
            else:
                static = _static_bytes(self.model)
                with _CpuTensorPeak() as window:
                    batch = self.make_batch(micro_batch)
                    for _ in range(cfg.warmup_steps):
                        self._step(batch, optimizer)
                peak = static + window.peak_bytes()
            tokens = self.count_tokens(batch)
            if cfg.memory_limit_bytes is not None and peak > cfg.memory_limit_bytes:
                return TrialResult(micro_batch=micro_batch, oom=True, peak_memory_bytes=peak,
                                   tokens_per_step=tokens, capacity_bytes=capacity,
                                   note=_over_budget(peak, cfg.memory_limit_bytes))
            # -- timed steps: the median step, robust to a stall of a shared CPU ----------
            step_times_s = []
            if cuda:
                events = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.steps_per_trial + 1)]
                events[0].record()
                for i in range(cfg.steps_per_trial):
                    self._step(batch, optimizer)
                    events[i + 1].record()
                torch.cuda.synchronize(self.device)  # host sync: once, after the timed steps
                step_times_s = [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(cfg.steps_per_trial)]
                peak = max(peak, int(torch.cuda.max_memory_allocated(self.device)))
            else:
                for _ in range(cfg.steps_per_trial):
                    start = time.perf_counter()
                    self._step(batch, optimizer)
                    step_times_s.append(time.perf_counter() - start)
            return TrialResult(micro_batch=micro_batch, peak_memory_bytes=peak,
                               step_time_s=float(np.median(step_times_s)), tokens_per_step=tokens,
                               capacity_bytes=capacity)
        finally:
            optimizer.state.clear()
            del optimizer


@contextlib.contextmanager
def _restored(model: nn.Module) -> Iterator[None]:
    """Put back the weights, buffers and RNG state that the trial steps change."""
    snapshot = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    was_training = model.training
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            model.load_state_dict(snapshot)
            model.train(was_training)
            model.zero_grad(set_to_none=True)
            del snapshot
            release_memory()


def probe(
    model: nn.Module,
    make_batch: Callable[[int], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    global_batch: Optional[int] = None,
    dp_world_size: int = 1,
    memory_limit_bytes: Optional[int] = None,
    max_micro_batch: Optional[int] = None,
    steps_per_trial: int = 3,
    warmup_steps: int = 2,
    tolerance: float = 0.05,
    optimizer_factory: Optional[Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = None,
    count_tokens: Optional[Callable[[Any], Optional[int]]] = None,
    cpu_memory: str = "tensors",
    use_memory_model: bool = True,
) -> ProbeResult:
    """Probe ``model`` on its current device; leave its weights, RNG and memory as they were.

    Args:
        model: the model to train (on the device to probe). Under torchrun pass the plain
            module, not the DDP wrapper: a rank that runs out of memory mid-backward would
            leave the others waiting in DDP's gradient all-reduce.
        make_batch: ``make_batch(micro_batch) -> batch`` on the model's device.
        loss_fn: ``loss_fn(model, batch) -> scalar loss`` to call ``backward()`` on.
        global_batch: samples per optimizer step over all ranks, to report the accumulation.
        dp_world_size: data-parallel ranks.
        memory_limit_bytes: budget; a larger measured peak counts as out of memory.
        max_micro_batch: the largest size tried (default global ÷ dp, else 8192).
        steps_per_trial: timed steps per trial; warmup_steps: untimed steps before them.
        tolerance: "fastest" = smallest size within this fraction of the best throughput.
        optimizer_factory: ``params -> optimizer``; default AdamW (its state is part of the peak).
        count_tokens: ``batch -> tokens``; default ``batch["input_ids"].numel()`` when present.
        cpu_memory: ``"tensors"`` or ``"rss"`` (see the module docstring).
        use_memory_model: cut the search with the fitted memory line.
    """
    runner = TrainStepRunner(
        model, make_batch, loss_fn, optimizer_factory=optimizer_factory, count_tokens=count_tokens,
        config=TrialConfig(steps_per_trial=steps_per_trial, warmup_steps=warmup_steps,
                           memory_limit_bytes=memory_limit_bytes, cpu_memory=cpu_memory))
    with _restored(model):
        return probe_micro_batch(
            runner, max_micro_batch=max_micro_batch, memory_limit_bytes=memory_limit_bytes, tolerance=tolerance,
            use_memory_model=use_memory_model, global_batch=global_batch, dp_world_size=dp_world_size)


# ---------------------------------------------------------------------------
# Built-in tasks and the report table (used by ``globalbatch probe``)
# ---------------------------------------------------------------------------


def probe_task(
    task: Any,
    *,
    global_batch: Optional[int] = None,
    dp_world_size: int = 1,
    memory_limit_bytes: Optional[int] = None,
    max_micro_batch: Optional[int] = None,
    steps_per_trial: int = 3,
    tolerance: float = 0.05,
    device: Optional[str] = None,
    seed: int = 0,
) -> ProbeResult:
    """:func:`probe` on a :mod:`globalbatch.tasks` task (a name such as ``"tinygpt"`` or a Task).

    Batches are the first samples of ``task.sample_order(seed)`` (cycled when the
    micro-batch is larger than the data set); the loss is ``loss_sum / count``; tokens per
    step are ``task.tokens_in(batch)`` (padding included).
    """
    from itertools import islice

    from globalbatch.tasks import load_task

    if isinstance(task, str):
        task = load_task(task)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch_device = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device {device!r} is not a device; allowed: cpu, cuda, cuda:N ({exc})") from None
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} is not available here; allowed: cpu")
    model = task.build_model(seed).to(torch_device)
    cap = max_micro_batch or (global_batch // dp_world_size if global_batch else DEFAULT_MAX_MICRO_BATCH)
    pool = list(islice(task.sample_order(seed), min(int(cap), task.num_train_samples)))

    def make_batch(micro_batch: int) -> Any:
        indices = [pool[i % len(pool)] for i in range(micro_batch)]
        return task.collate(indices, torch_device)

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        loss_sum, count = task.loss_sum(m, batch)
        return loss_sum / count.clamp(min=1)

    return probe(model, make_batch, loss_fn, global_batch=global_batch, dp_world_size=dp_world_size,
                 memory_limit_bytes=memory_limit_bytes, max_micro_batch=max_micro_batch,
                 steps_per_trial=steps_per_trial, tolerance=tolerance, count_tokens=task.tokens_in)


def probe_table(result: ProbeResult, title: str = "probe") -> Any:
    """A rich Table: one row per size tried, in size order, with the picks marked."""
    from rich.table import Table

    use_tokens = all(t.tokens_per_step is not None for t in result.trials if t.fits and t.step_time_s)
    table = Table(title=title)
    for name in ("micro_batch", "fits", "peak memory", "step time", "tokens/s" if use_tokens else "samples/s",
                 "trial #", "note"):
        table.add_column(name, justify="right" if name not in ("fits", "note") else "left")
    order = {id(t): i + 1 for i, t in enumerate(result.trials)}
    for t in result.by_size():
        rate = t.tokens_per_s() if use_tokens else t.samples_per_s()
        marks = [m for m, size in (("largest", result.largest_fit), ("fastest", result.fastest))
                 if size == t.micro_batch]
        table.add_row(
            str(t.micro_batch), "yes" if t.fits else "no", format_bytes(t.peak_memory_bytes),
            "-" if t.step_time_s is None else f"{t.step_time_s * 1e3:,.1f} ms",
            "-" if rate is None else f"{rate:,.0f}", str(order[id(t)]),
            ", ".join(marks) if marks else t.note)
    return table
