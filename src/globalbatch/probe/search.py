"""The search: the exact largest micro-batch that fits, and the fastest one.

:func:`probe_micro_batch` drives any ``run_trial(size) -> TrialResult`` (a fake one in the
tests, :class:`~globalbatch.probe.runner.TrainStepRunner` for real steps)::

    lo = largest size known to fit (0: none yet)     hi = smallest size known not to fit
    grow:    2, 4, 8, …  (doubling from ``start_micro_batch``, capped at max_micro_batch) until
             a size fails (if 2 fails, 1 is tried next)
    bracket: the answer lies in [lo, hi); every trial halves it (bisection) …
    predict: … unless the fitted memory line and a known budget predict the boundary p:
             then run p (expected to fit) and p + 1 (expected to fail).

Trials for an answer T ≥ 2 (OOM signal only): ⌊log2 T⌋ + 1 to bracket, ⌊log2 T⌋ to bisect,
2⌊log2 T⌋ + 1 ≤ 2⌈log2 T⌉ + 1 in all (T = 1: 2 trials, 2 and 1). With a linear memory and a
known budget: ⌈log2 T⌉ + 1. :mod:`globalbatch.probe` describes the whole method.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional, cast

from globalbatch.errors import Raw, SettingError
from globalbatch.plan import BatchGeometry, solve_geometry
from globalbatch.probe import memory  # memory.release_memory() looked up per call: tests patch it
from globalbatch.probe.memory import MemoryModel, fit_memory_model
from globalbatch.probe.trial import _FAILED, _FITS, _OOM, TrialResult, _agree, _log_trial, _over_budget
from globalbatch.validate import whole

log = logging.getLogger(__name__)

DEFAULT_MAX_MICRO_BATCH = 8192
"""Upper end of the search when neither ``max_micro_batch`` nor a global batch bounds it."""

DEFAULT_START_MICRO_BATCH = 2
"""First size tried. Starting at 2 rather than 1 saves a trial: 2⌊log2 T⌋ + 1 trials instead of
2⌊log2 T⌋ + 2, within 2⌈log2 T⌉ + 1 also when T is a power of two; when 2 fails, 1 runs next."""


class NothingFits(RuntimeError):
    """Even micro-batch 1 ran out of memory (or over the budget); ``trial`` is its record."""

    def __init__(self, message: str, trial: TrialResult) -> None:
        super().__init__(message)
        self.trial = trial


def check_probe_settings(*, global_batch: Optional[int] = None, dp_world_size: int = 1,
                         max_micro_batch: Optional[int] = None, steps_per_trial: int = 3,
                         tolerance: float = 0.05, memory_limit_bytes: Optional[int] = None,
                         names: Optional[dict[str, str]] = None) -> None:
    """Raise :class:`SettingError` for the first bad setting, before any model is built.

    ``names`` maps a setting to how the user wrote it (the CLI passes its flags, e.g.
    ``{"dp_world_size": "--dp"}``); a setting not in it is named by its field name.
    """
    from globalbatch import validate as V
    from globalbatch.errors import flag_names

    with flag_names(names or {}):
        V.whole(dp_world_size, "dp_world_size")
        if global_batch is not None:
            _check_global_batch(global_batch, dp_world_size)
        if max_micro_batch is not None:
            V.whole(max_micro_batch, "max_micro_batch")
        V.whole(steps_per_trial, "steps_per_trial")
        V.number(tolerance, "tolerance", low=0.0, high=1.0, high_open=True,
                 allowed="a fraction, 0 ≤ tolerance < 1 (0.05 = within 5%)")
        if memory_limit_bytes is not None:
            V.whole(memory_limit_bytes, "memory_limit_bytes", allowed="at least 1 byte")


def _check_global_batch(global_batch: Any, dp_world_size: int) -> None:
    """``global_batch``: a positive multiple of ``dp_world_size`` (the error names both settings)."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1 \
            or global_batch % dp_world_size:
        raise SettingError("global_batch", global_batch, f"a positive multiple of dp_world_size {dp_world_size}",
                           why=f"with dp_world_size {dp_world_size}" if dp_world_size > 1 else "",
                           see={"dp_world_size": "dp_world_size"})


@dataclass(kw_only=True, slots=True)
class ProbeConfig:
    """Settings of :func:`probe_micro_batch`."""

    max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH
    """Never try a larger micro-batch (e.g. global batch ÷ dp: a larger one cannot be used)."""
    start_micro_batch: int = DEFAULT_START_MICRO_BATCH
    """First size tried; growth doubles from here. Capped at ``max_micro_batch`` (so the default 2
    with a cap of 1 starts at 1). When it fails, the search bisects below it, down to 1."""
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
            whole(value, name)
        # A start above the cap only moves the first trial: capping it keeps the search exact.
        self.start_micro_batch = min(self.start_micro_batch, self.max_micro_batch)
        if self.memory_limit_bytes is not None:
            whole(self.memory_limit_bytes, "memory_limit_bytes", allowed="None or a whole number ≥ 1")
        if not (isinstance(self.tolerance, (int, float)) and 0 <= self.tolerance < 1):
            raise SettingError("tolerance", self.tolerance, "0 ≤ tolerance < 1")
        if self.max_prediction_misses < 0:
            raise SettingError("max_prediction_misses", self.max_prediction_misses, "≥ 0")


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
    unit: Optional[str] = None
    """The task's loss unit, ``"token"`` or ``"sample"`` (None when unknown: plain :func:`probe`)."""
    conflicts: tuple[str, ...] = ()
    """Trials that contradict monotone memory (a size failed although a larger one fit: an intermittent
    out of memory, e.g. fragmentation), each with the decision taken; empty when memory was monotone."""
    predicted_micro_batch: Optional[int] = None
    """The memory model's prediction of ``largest_fit`` (``globalbatch.plan.memory``), when one was made."""
    predicted_note: str = ""
    """How ``predicted_micro_batch`` was made (which trials, which model)."""
    peak_flops_per_s: Optional[float] = None
    """Peak FLOP/s of one device for the trials' MFU (``globalbatch.flops.peak_flops_per_s``); None: unknown."""
    peak_flops_source: str = ""
    params: Optional[int] = None
    """Trainable parameters of the probed model (what its optimizer step updates); None: not known (plain
    :func:`probe_micro_batch`)."""

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
            "unit": self.unit,
            "conflicts": list(self.conflicts),
            "predicted_micro_batch": self.predicted_micro_batch,
            "predicted_note": self.predicted_note,
            "peak_flops_per_s": self.peak_flops_per_s,
            "peak_flops_source": self.peak_flops_source,
            "params": self.params,
            "memory_model": None if self.memory_model is None else dataclasses.asdict(self.memory_model),
            "trials": [dict(t.to_dict(), mfu=t.mfu(self.peak_flops_per_s)) for t in self.trials],
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
    rate = {id(t): cast(float, _throughput(t, use_tokens)) for t in timed}  # timed: each has a step time
    best = max(rate.values())
    good = [t.micro_batch for t in timed if rate[id(t)] >= (1.0 - tolerance) * best]
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
        self.missed: set[int] = set()  # sizes already counted as a wrong prediction: one miss each
        self.conflicts: list[str] = []
        self.model: Optional[MemoryModel] = None
        self.confirm: Optional[int] = None  # after a predicted p fit: p + 1 must run next (expected to fail)
        self.next_growth = config.start_micro_batch  # the next doubling; predicted trials never move it

    # -- one trial ------------------------------------------------------------------

    def run(self, size: int) -> TrialResult:
        # another error: the other ranks are told before it is raised (no-op single-process)
        result = memory.run_or_oom(self.run_trial, size, on_error=lambda: _agree(None, size, _FAILED))
        if result.micro_batch != size:
            raise SettingError("run_trial", Raw(f"returning a TrialResult for micro_batch {result.micro_batch}"),
                               f"a TrialResult for the size it was asked to run ({size})")
        limit = self.config.memory_limit_bytes
        if not result.oom and limit is not None:
            if result.peak_memory_bytes is None:
                raise SettingError("memory_limit_bytes", limit, "None, or trials that measure peak_memory_bytes",
                                   why=f"run_trial({size}) returned peak_memory_bytes None")
            if result.peak_memory_bytes > limit:
                result = dataclasses.replace(
                    result, oom=True, step_time_s=None,
                    note=_over_budget(result.peak_memory_bytes, limit))
        result = _agree(result, size, _OOM if result.oom else _FITS)
        self.trials.append(result)
        self.by_size[size] = result
        if result.fits and size >= self.hi and self.hi_observed:
            # A size fit above one that failed: the failure stands (it will fail in training too).
            self._conflict(f"micro_batch {size} fit although {self.hi} ran out of memory earlier; "
                           f"kept {self.hi} as the smallest failure")
        elif result.fits:
            self.lo = max(self.lo, size)
        elif size <= self.lo:
            # A size failed although an equal or larger one fit: an intermittent out of memory.
            # Decision: trust the failure (training would hit it too): the largest fit becomes the
            # largest measured fit below this size, and the search resumes above that.
            below = [s for s, t in self.by_size.items() if t.fits and s < size]
            new_lo = max(below, default=0)
            self._conflict(f"micro_batch {size} ran out of memory ({result.note}) although micro_batch "
                           f"{self.lo} fit earlier (intermittent: fragmentation?); decided: largest fit "
                           f"lowered to {new_lo}, the largest measured fit below {size}")
            self.lo, self.hi, self.hi_observed = new_lo, size, True
        else:
            self.hi = min(self.hi, size)
            self.hi_observed = True
        self.model = fit_memory_model(self.trials) if self.config.use_memory_model else None
        _log_trial(result)
        return result

    def _conflict(self, text: str) -> None:
        self.conflicts.append(text)
        log.warning("probe: %s", text)

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
        if len(self.model.sizes) < 3 or not self.model.max_residual_bytes <= 0.5 * self.model.bytes_per_sample:
            # Two points always lie on a line; three that do not lie on one to within half a sample (a
            # staircase of allocator blocks, noise) make a prediction that misses as often as it hits:
            # bisect instead.
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
            while self.next_growth <= self.lo:  # a predicted size fit at or past the pending doubling
                self.next_growth *= 2
            grow = min(self.next_growth, self.hi - 1)
            predicted = self.prediction(grow)
            return predicted if predicted else (grow, None)
        predicted = self.prediction(self.hi)
        if predicted:
            return predicted
        if self.model is not None and self.budget_bytes() is not None and self.lo >= 1 \
                and self.misses < self.config.max_prediction_misses:
            p = self.model.largest_fitting(cast(float, self.budget_bytes()))
            if p is not None and p >= self.hi and self.hi not in self.missed:
                self.misses += 1  # the line says hi fits, but hi failed: the line is wrong here (once per size)
                self.missed.add(self.hi)
        return (self.lo + self.hi) // 2, None

    def search(self) -> None:
        while self.hi - self.lo > 1:
            size, expect_fit = self.next_size()
            if size in self.by_size:  # never re-run a measured size: a repeat can only add an intermittent OOM
                raise RuntimeError(f"probe: internal error: micro_batch {size} was chosen twice "
                                   f"(lo {self.lo}, hi {self.hi})")
            result = self.run(size)
            if expect_fit and result.fits:
                self.confirm = size + 1
            if result.fits and expect_fit is None and not self.hi_observed:
                self.next_growth = 2 * size  # a growth step fit: keep doubling
            if expect_fit is not None and result.fits != expect_fit:
                self.misses += 1
                self.missed.add(size)
                log.info("probe: memory line predicted micro_batch %d would %s; it did not (miss %d)",
                         size, "fit" if expect_fit else "fail", self.misses)

    # -- keeping the global batch ---------------------------------------------------

    def choices(self, global_batch: int, dp_world_size: int) -> tuple[GlobalBatchChoice, ...]:
        """One choice per role; may run one more trial to verify a suggested divisor."""
        per_rank = global_batch // dp_world_size
        # Largest: the largest divisor of global ÷ dp at or below the largest fit, verified by a run.
        divisor = self._largest_divisor(per_rank)  # first: a verification that fails may lower lo
        largest = self._choice("largest", self.lo, global_batch, dp_world_size, divisor)
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



def probe_micro_batch(
    run_trial: Callable[[int], TrialResult],
    *,
    max_micro_batch: Optional[int] = None,
    start_micro_batch: int = DEFAULT_START_MICRO_BATCH,
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
        start_micro_batch: the first size tried (doubling starts here; capped at
            ``max_micro_batch``). The default 2 saves a trial over 1; if 2 fails, 1 runs next.
        memory_limit_bytes: a measured peak above this counts as out of memory.
        tolerance: "fastest" is the smallest size within this fraction of the best throughput.
        use_memory_model: use the fitted ``a + b·size`` line to cut the search.
        max_prediction_misses: wrong predictions allowed before plain bisection.
        global_batch: samples per optimizer step over all ranks; when given, each pick
            gets the accumulation that keeps it (and a verified replacement when it does not divide).
        dp_world_size: data-parallel ranks for the global-batch arithmetic.

    Raises:
        ValueError: bad settings (the message names the field), or global_batch not divisible by dp.
        NothingFits: (a RuntimeError) even ``start_micro_batch`` (and every size below it) runs out
            of memory; its ``trial`` is the record of micro-batch 1.
    """
    if global_batch is not None:
        whole(dp_world_size, "dp_world_size")
        _check_global_batch(global_batch, dp_world_size)
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
        raise NothingFits(f"probe: micro_batch 1 does not fit ({first.note}); nothing to train with", first)
    choices: tuple[GlobalBatchChoice, ...] = ()
    if global_batch is not None:
        choices = search.choices(global_batch, dp_world_size)  # may run a verification trial
    largest_fit = search.lo  # after the choices: a verification trial that failed may have lowered it
    if largest_fit == 0:
        raise NothingFits("probe: every size that fit later ran out of memory; nothing to train with",
                          search.trials[-1])
    limited_by = "max_micro_batch" if largest_fit == config.max_micro_batch else "memory"
    fastest = choose_fastest(search.trials, config.tolerance)
    return ProbeResult(
        trials=tuple(search.trials), largest_fit=largest_fit, limited_by=limited_by, fastest=fastest,
        tolerance=config.tolerance, memory_limit_bytes=memory_limit_bytes, memory_model=search.model,
        prediction_misses=search.misses, choices=choices, conflicts=tuple(search.conflicts))

