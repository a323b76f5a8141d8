"""Trials taken and size returned by micro-batch finders, with a simulated OOM above a threshold T.

    .venv/bin/python benchmarks/probe_trials.py [T ...]
    .venv/bin/python benchmarks/probe_trials.py --curves     # the memory line on curved / noisy peaks

Every finder runs against the same oracle: a trial at size s fails (out of memory) iff s > T.
A finder's result is marked
    ✓  = min(T, 8192) exactly
    ~  = below T (wastes memory), but it ran or fits
    ✗  = above T: it would run out of memory (returned without running it)
and "untested" when the returned size was never run.

The peer finders are EMULATIONS, written from the rules described in docs/probe.md and
/work/shared/reference/peer-frameworks.md, not the libraries themselves (none is installed):

* Lightning ``Tuner.scale_batch_size`` (init_val=2, max_trials=25, max_val=8192, margin=0.05):
  power: double until OOM, return the last success (halving); a doubling that reaches
  max_val returns max_val without running it. binsearch: double, then bisect between the last
  success and the failure, then return ⌊(1 − margin)·size⌋; a doubling that reaches max_val
  returns ⌊0.95·max_val⌋ = 7782 without running it.
* accelerate ``find_executable_batch_size(starting_batch_size=8192)`` (≥ 1.9.0): on OOM,
  ``bs = int(bs * 0.9)``; the first size that runs is returned.
* Composer ``device_train_microbatch_size="auto"`` from a batch of 8192: halve on OOM
  (``max(int(mbs / 2), 1)``) until it runs.

Ours: ``globalbatch.probe.probe_micro_batch`` (doubling from its default start, 2) with (a) only
the OOM signal and (b) a peak memory linear in the size (1.5 GiB + 3 MiB·s) and the budget known
(``memory_limit_bytes``).
"""

from __future__ import annotations

import math
import random
import statistics
import sys
from dataclasses import dataclass

import globalbatch.probe.memory as probe_memory
from globalbatch.probe import TrialResult, probe_micro_batch

MAX_VAL = 8192
DEFAULT_THRESHOLDS = (1, 37, 64, 100, 1000, 1024, 3000, 5000, 6000, 10_000)  # 64, 1024: powers of two


class Oracle:
    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self.ran: list[int] = []

    def fits(self, size: int) -> bool:
        self.ran.append(size)
        return size <= self.threshold


@dataclass
class Outcome:
    trials: int
    result: int
    tested: bool

    def cell(self, threshold: int) -> str:
        target = min(threshold, MAX_VAL)  # the right answer: T, or the cap when T is above it
        mark = "✓" if self.result == target else ("✗" if self.result > threshold else "~")
        untested = " untested" if not self.tested else ""
        return f"{self.trials:>3} → {self.result:>5} {mark}{untested}"


def lightning_power(oracle: Oracle, init_val: int = 2, max_trials: int = 25) -> int:
    size, any_success = init_val, False
    for _ in range(max_trials):
        if oracle.fits(size):
            any_success = True
            if size * 2 >= MAX_VAL:
                return MAX_VAL  # clamped to max_val and returned without a trial
            size *= 2
        else:
            size = max(int(size * 0.5), 1)
            if any_success:
                break
    return size


def lightning_binsearch(oracle: Oracle, init_val: int = 2, max_trials: int = 25, margin: float = 0.05) -> int:
    low, high, size, count = 1, None, init_val, 0
    while True:
        if oracle.fits(size):
            count += 1
            if count > max_trials:
                break
            low = size
            if high:
                if high - low <= 1:
                    break
                size = (high + low) // 2
            else:
                if size * 2 >= MAX_VAL:
                    size = MAX_VAL  # clamped to max_val; the loop ends without running it
                    break
                size *= 2
        else:
            high = size
            size = (high + low) // 2
            if high - low <= 1:
                break
    return int(size * (1 - margin))


def accelerate_find_executable(oracle: Oracle, starting: int = MAX_VAL) -> int:
    bs = starting
    while bs > 0:
        if oracle.fits(bs):
            return bs
        bs = int(bs * 0.9)
    raise RuntimeError("No executable batch size found, reached zero.")


def composer_halving(oracle: Oracle, starting: int = MAX_VAL) -> int:
    mbs = starting
    while not oracle.fits(mbs):
        if mbs == 1:
            raise RuntimeError("out of memory at micro-batch 1")
        mbs = max(int(mbs / 2), 1)
    return mbs


def ours_oom_only(threshold: int) -> Outcome:
    ran: list[int] = []

    def run(size: int) -> TrialResult:
        ran.append(size)
        if size > threshold:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return TrialResult(micro_batch=size)

    result = probe_micro_batch(run, max_micro_batch=MAX_VAL)
    return Outcome(len(ran), result.largest_fit, result.largest_fit in ran)


def ours_linear_memory(threshold: int) -> Outcome:
    a, b = 1_610_612_736, 3 * 2**20
    budget = a + b * threshold + b // 2
    ran: list[int] = []

    def run(size: int) -> TrialResult:
        ran.append(size)
        return TrialResult(micro_batch=size, peak_memory_bytes=a + b * size)

    result = probe_micro_batch(run, max_micro_batch=MAX_VAL, memory_limit_bytes=budget)
    return Outcome(len(ran), result.largest_fit, result.largest_fit in ran)


def emulated(finder, threshold: int) -> Outcome:
    oracle = Oracle(threshold)
    result = finder(oracle)
    return Outcome(len(oracle.ran), result, result in oracle.ran)


def main(thresholds: tuple[int, ...]) -> None:
    probe_memory.release_memory = lambda: None  # nothing to release in a simulation; skips a full gc per OOM
    columns = [
        ("ours: OOM only", ours_oom_only),
        ("ours: linear memory", ours_linear_memory),
        ("Lightning power (emul.)", lambda t: emulated(lightning_power, t)),
        ("Lightning binsearch (emul.)", lambda t: emulated(lightning_binsearch, t)),
        ("accelerate ×0.9 (emul.)", lambda t: emulated(accelerate_find_executable, t)),
        ("Composer halving (emul.)", lambda t: emulated(composer_halving, t)),
    ]
    print(f"Simulated OOM above T; max size {MAX_VAL}. Cells: trials → returned size "
          "(✓ = min(T, 8192), ~ = below it, ✗ = above T: would run out of memory).")
    print()
    print("| T | bound 2⌈log2 T⌉+1 | " + " | ".join(name for name, _ in columns) + " |")
    print("|---:|---:|" + "---|" * len(columns))
    for t in thresholds:
        cells = [fn(t).cell(t) for _, fn in columns]
        print(f"| {t} | {2 * math.ceil(math.log2(t)) + 1} | " + " | ".join(cells) + " |")


def curves(samples: int = 300, seed: int = 1) -> None:
    """Mean trials (and worst excess over bisection's 2⌊log2 T⌋ + 1) when peak memory is not a line.

    Peak(s) = a + b·s·(1 + c·s) (convex) or a + b·s / √(1 + c·s) (concave), each trial's peak
    multiplied by (1 + noise·U(−1, 1)); the budget is peak(T) for T uniform in [2, 30000]; cap 40000.
    """
    probe_memory.release_memory = lambda: None
    a, b = 1000.0, 100.0
    shapes = {
        "linear": lambda c: (lambda s: a + b * s),
        "convex": lambda c: (lambda s: a + b * s * (1 + c * s)),
        "concave": lambda c: (lambda s: a + b * s / math.sqrt(1 + c * s)),
    }
    variants = [("bisection only", False, 0), ("line, 1 miss", True, 1), ("line, 2 misses (default)", True, 2)]
    print(f"Mean trials / worst excess over 2⌊log2 T⌋ + 1, {samples} thresholds T ∈ [2, 30000] each.")
    print()
    print("| peak memory | c | noise | " + " | ".join(v[0] for v in variants) + " |")
    print("|---|---:|---:|" + "---:|" * len(variants))
    for shape, c in [("linear", 0.0), ("convex", 1e-5), ("convex", 1e-3), ("concave", 1e-5), ("concave", 1e-3)]:
        for noise in (0.0, 0.002):
            cells = []
            for _, use_model, misses in variants:
                rng = random.Random(seed)
                counts, worst = [], -99
                for _ in range(samples):
                    threshold = rng.randint(2, 30_000)
                    peak = shapes[shape](c)
                    ran: list[int] = []

                    def run(size: int) -> TrialResult:
                        ran.append(size)
                        return TrialResult(micro_batch=size,
                                           peak_memory_bytes=int(peak(size) * (1 + noise * rng.uniform(-1, 1))))

                    result = probe_micro_batch(run, max_micro_batch=40_000, memory_limit_bytes=int(peak(threshold)),
                                               use_memory_model=use_model, max_prediction_misses=misses)
                    counts.append(len(ran))
                    worst = max(worst, len(ran) - (2 * math.floor(math.log2(result.largest_fit)) + 1))
                cells.append(f"{statistics.mean(counts):.1f} / {worst:+d}")
            print(f"| {shape} | {c:g} | {noise:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if sys.argv[1:] == ["--curves"]:
        curves()
    else:
        main(tuple(int(a) for a in sys.argv[1:]) or DEFAULT_THRESHOLDS)
