"""Tests for globalbatch.probe: exact search, trial counts, OOM handling, picks, memory hygiene, CLI."""

from __future__ import annotations

import gc
import json
import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import globalbatch.probe.memory as probe_memory
from globalbatch.errors import SettingError
from globalbatch.probe import (
    MemoryModel,
    ProbeConfig,
    TrialConfig,
    TrialResult,
    TrainStepRunner,
    choose_fastest,
    fit_memory_model,
    is_oom_error,
    probe,
    probe_micro_batch,
)

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)"


class FakeOOM:
    """run_trial that raises a CUDA-style OOM above ``threshold`` and records what it ran."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self.ran: list[int] = []

    def __call__(self, size: int) -> TrialResult:
        self.ran.append(size)
        if size > self.threshold:
            raise RuntimeError(CUDA_OOM)
        return TrialResult(micro_batch=size, step_time_s=0.01 + 0.001 * size)


class FakeAllocator:
    """Peak memory ``a + b·size``; the probe (``memory_limit_bytes``) or the fake itself enforces the budget."""

    def __init__(self, a: int, b: int, budget: int, *, raise_oom: bool = False) -> None:
        self.a, self.b, self.budget, self.raise_oom = a, b, budget, raise_oom
        self.ran: list[int] = []

    def __call__(self, size: int) -> TrialResult:
        self.ran.append(size)
        peak = self.a + self.b * size
        if self.raise_oom:
            if peak > self.budget:
                raise torch.cuda.OutOfMemoryError(CUDA_OOM)
            return TrialResult(micro_batch=size, peak_memory_bytes=peak, step_time_s=0.01,
                               capacity_bytes=self.budget)
        return TrialResult(micro_batch=size, peak_memory_bytes=peak, step_time_s=0.01)


def linear_case(threshold: int) -> tuple[int, int, int]:
    """(a, b, budget) with ⌊(budget − a)/b⌋ = threshold: 1.5 GiB fixed, 3 MiB per sample."""
    a, b = 1_610_612_736, 3 * 2**20
    return a, b, a + b * threshold + b // 2


@pytest.fixture
def one_thread():
    """Real training steps on one thread: two cores shared with other jobs make 2 threads spin-wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def releases(monkeypatch):
    """Count release_memory() calls (and skip its full gc.collect, which dominates fake-trial tests)."""
    calls = []
    monkeypatch.setattr(probe_memory, "release_memory", lambda: calls.append(1))
    return calls


def check_ran_and_exact(result, ran: list[int], threshold: int, cap: int) -> None:
    assert result.largest_fit == min(threshold, cap)
    assert [t.micro_batch for t in result.trials] == ran  # every reported trial is one that ran, in order
    assert len(set(ran)) == len(ran)  # no size is run twice
    for t in result.trials:
        assert t.fits == (t.micro_batch <= threshold)
    assert result.largest_fit in ran


# ---------------------------------------------------------------------------
# Search: exactness and trial counts
# ---------------------------------------------------------------------------


THRESHOLDS = [1, 2, 37, 64, 100, 1000, 1024, 5000, 6000]  # 64 and 1024: powers of two, the tight case


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_oom_threshold_exact_within_bisection_bound(threshold, releases):
    runner = FakeOOM(threshold)
    result = probe_micro_batch(runner, max_micro_batch=8192)
    check_ran_and_exact(result, runner.ran, threshold, 8192)
    assert len(releases) == sum(t.oom for t in result.trials)  # memory released after every OOM
    assert result.limited_by == "memory"
    if threshold == 1:
        # 2 fails, 1 fits. The bound 2⌈log2 1⌉ + 1 = 1 cannot be met: exactness needs 1 to fit and 2 to fail.
        assert runner.ran == [2, 1]
        return
    assert len(runner.ran) <= 2 * math.ceil(math.log2(threshold)) + 1
    # Exact count from 2: ⌊log2 T⌋ + 1 trials to bracket (2 … 2^⌊log2 T⌋ fit, the next doubling fails),
    # ⌊log2 T⌋ to bisect: 37 → 11, 64 → 13 (bound 13), 1000 → 19, 1024 → 21 (bound 21), 6000 → 25.
    assert len(runner.ran) == 2 * math.floor(math.log2(threshold)) + 1
    assert runner.ran[0] == 2


def test_oom_power_of_two_run_sequence(releases):
    runner = FakeOOM(64)
    probe_micro_batch(runner, max_micro_batch=8192)
    assert runner.ran == [2, 4, 8, 16, 32, 64, 128, 96, 80, 72, 68, 66, 65]


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_linear_memory_with_budget_needs_log_plus_three(threshold):
    a, b, budget = linear_case(threshold)
    runner = FakeAllocator(a, b, budget)
    result = probe_micro_batch(runner, max_micro_batch=8192, memory_limit_bytes=budget)
    check_ran_and_exact(result, runner.ran, threshold, 8192)
    assert len(runner.ran) <= math.ceil(math.log2(threshold)) + 3
    assert result.memory_model is not None  # two measured peaks: 2 and 4 (over-budget peaks count too)
    assert result.memory_model.bytes_per_sample == pytest.approx(b)
    assert result.prediction_misses == 0
    if threshold <= 2:  # 1: 2 is over budget, 1 fits.  2: 2 fits, 4 is over, the line says 3 is over.
        assert runner.ran == {1: [2, 1], 2: [2, 4, 3]}[threshold]
        return
    # Doubling 2 … 2^⌊log2 T⌋, then the predicted T and T + 1 (for T = 2^k: T ran as a doubling, then
    # T + 1); the overshooting doubling is skipped: 37 → 7, 64 → 7, 1024 → 11, 6000 → 14.
    assert len(runner.ran) == math.ceil(math.log2(threshold)) + 1
    assert runner.ran[-2:] == [threshold, threshold + 1]


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_linear_memory_raising_oom_uses_reported_capacity(threshold, releases):
    a, b, budget = linear_case(threshold)
    runner = FakeAllocator(a, b, budget, raise_oom=True)
    result = probe_micro_batch(runner, max_micro_batch=8192)
    check_ran_and_exact(result, runner.ran, threshold, 8192)
    assert len(runner.ran) <= math.ceil(math.log2(threshold)) + 3
    assert "CUDA out of memory" in [t for t in result.trials if t.oom][-1].note


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(threshold=st.integers(1, 20_000), cap=st.integers(1, 9000))
def test_search_is_exact_for_any_threshold_and_cap(threshold, cap, releases):
    runner = FakeOOM(threshold)
    result = probe_micro_batch(runner, max_micro_batch=cap)
    check_ran_and_exact(result, runner.ran, threshold, cap)
    answer = min(threshold, cap)
    if threshold < cap:
        assert len(runner.ran) <= (2 * math.floor(math.log2(answer)) + 1 if answer >= 2 else 2)
    else:
        assert result.limited_by == "max_micro_batch"


@settings(max_examples=100, deadline=None)
@given(threshold=st.integers(2, 20_000), curvature=st.floats(0.0, 2e-3))
def test_nonlinear_memory_still_exact_and_bounded(threshold, curvature):
    """Peak a + b·s + c·s² (convex): the line mispredicts; verification and the miss limit keep it exact."""
    a, b = 1000.0, 100.0

    def peak(s: int) -> float:
        return a + b * s + curvature * b * s * s

    budget = peak(threshold) + 1e-6 * b
    ran: list[int] = []

    def run(s: int) -> TrialResult:
        ran.append(s)
        return TrialResult(micro_batch=s, peak_memory_bytes=int(round(peak(s))), step_time_s=0.01)

    result = probe_micro_batch(run, max_micro_batch=40_000, memory_limit_bytes=int(budget))
    fits = [s for s in ran if peak(s) <= int(budget) + 0.5]
    assert result.largest_fit == max(fits)
    assert result.largest_fit + 1 in ran or result.largest_fit == 40_000
    # Never worse than bisection (2k + 1 from 2) plus at most 2 wasted trials per allowed miss.
    k = math.floor(math.log2(result.largest_fit))
    assert len(ran) <= 2 * k + 1 + 2 * 2


def test_plain_bisection_when_model_disabled():
    a, b, budget = linear_case(100)
    runner = FakeAllocator(a, b, budget)
    result = probe_micro_batch(runner, memory_limit_bytes=budget, use_memory_model=False, max_micro_batch=8192)
    check_ran_and_exact(result, runner.ran, 100, 8192)
    assert len(runner.ran) == 2 * 6 + 1  # 2..64, 128 fails, 6 bisection steps
    assert runner.ran[:7] == [2, 4, 8, 16, 32, 64, 128]


def test_start_micro_batch_and_first_size_failing(releases):
    runner = FakeOOM(5)
    result = probe_micro_batch(runner, start_micro_batch=16, max_micro_batch=64)
    assert runner.ran[0] == 16 and result.largest_fit == 5
    runner = FakeOOM(0)
    with pytest.raises(RuntimeError, match="micro_batch 1 does not fit"):
        probe_micro_batch(runner, max_micro_batch=64)
    assert runner.ran == [2, 1]  # the default start 2 fails, then 1


def test_start_micro_batch_default_and_cap(releases):
    runner = FakeOOM(1)
    result = probe_micro_batch(runner, max_micro_batch=64)
    assert runner.ran == [2, 1] and result.largest_fit == 1 and result.limited_by == "memory"
    runner = FakeOOM(100)
    result = probe_micro_batch(runner, max_micro_batch=1)  # the default start 2 is capped at 1
    assert runner.ran == [1] and result.largest_fit == 1 and result.limited_by == "max_micro_batch"
    runner = FakeOOM(100)
    result = probe_micro_batch(runner, global_batch=1)
    assert runner.ran == [1] and result.choices[0].geometry.grad_accum_steps == 1
    runner = FakeOOM(100)
    assert probe_micro_batch(runner, start_micro_batch=1, max_micro_batch=4).largest_fit == 4
    assert runner.ran == [1, 2, 4]  # start 1 is still allowed


def test_max_micro_batch_limits_the_search(releases):
    runner = FakeOOM(10_000)
    result = probe_micro_batch(runner, max_micro_batch=96)
    assert result.largest_fit == 96 and result.limited_by == "max_micro_batch"
    assert runner.ran == [2, 4, 8, 16, 32, 64, 96]


def test_non_oom_error_is_raised_not_retried():
    ran = []

    def run(size):
        ran.append(size)
        if size == 8:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return TrialResult(micro_batch=size)

    with pytest.raises(RuntimeError, match="illegal memory access"):
        probe_micro_batch(run, max_micro_batch=64)
    assert ran == [2, 4, 8]


def test_memory_limit_needs_measured_peaks():
    with pytest.raises(SettingError, match=r"memory_limit_bytes 100 is not allowed \(run_trial\(\d+\) returned peak_memory_bytes None\)"):
        probe_micro_batch(FakeOOM(10), memory_limit_bytes=100)


@pytest.mark.parametrize(
    "exc, expected",
    [
        (torch.cuda.OutOfMemoryError(CUDA_OOM), True),
        (RuntimeError(CUDA_OOM), True),
        (RuntimeError("CUDA error: out of memory"), True),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                      "you tried to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)"), True),
        (RuntimeError("MPS backend out of memory (MPS allocated: 1.00 GB)"), True),
        (MemoryError(), True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"), False),
        (RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"), False),
        (ValueError("out of memory"), False),
    ],
)
def test_is_oom_error(exc, expected):
    assert is_oom_error(exc) is expected


def test_config_errors_name_field_and_value():
    with pytest.raises(SettingError, match="max_micro_batch 0 is not allowed"):
        ProbeConfig(max_micro_batch=0)
    with pytest.raises(SettingError, match="tolerance 1.5 is not allowed"):
        ProbeConfig(tolerance=1.5)
    with pytest.raises(SettingError, match="start_micro_batch 0 is not allowed"):
        ProbeConfig(start_micro_batch=0)
    assert ProbeConfig().start_micro_batch == 2
    assert ProbeConfig(start_micro_batch=128, max_micro_batch=64).start_micro_batch == 64  # capped
    assert ProbeConfig(max_micro_batch=1).start_micro_batch == 1
    with pytest.raises(SettingError, match="steps_per_trial 0 is not allowed"):
        TrialConfig(steps_per_trial=0)
    with pytest.raises(SettingError, match="cpu_memory 'vms' is not allowed"):
        TrialConfig(cpu_memory="vms")
    with pytest.raises(SettingError, match=r"global_batch 10 is not allowed \(with dp_world_size 4\); allowed: a positive multiple of dp_world_size 4"):
        probe_micro_batch(FakeOOM(10), global_batch=10, dp_world_size=4)


def test_fit_memory_model_uses_the_largest_sizes():
    trials = [TrialResult(micro_batch=s, peak_memory_bytes=p) for s, p in
              [(1, 5_000), (2, 5_000), (32, 1000 + 32 * 100), (64, 1000 + 64 * 100), (90, 1000 + 90 * 100)]]
    model = fit_memory_model(trials)
    assert model.sizes == (32, 64, 90)
    assert model.intercept_bytes == pytest.approx(1000) and model.bytes_per_sample == pytest.approx(100)
    assert model.largest_fitting(1000 + 100 * 77 + 50) == 77
    assert fit_memory_model(trials[:1]) is None
    assert MemoryModel(intercept_bytes=0, bytes_per_sample=0, sizes=(1, 2)).largest_fitting(10) is None


# ---------------------------------------------------------------------------
# Throughput-optimal choice on synthetic timing curves
# ---------------------------------------------------------------------------


def timed(curve, sizes, tokens_per_sample=None):
    return [TrialResult(micro_batch=s, step_time_s=curve(s),
                        tokens_per_step=None if tokens_per_sample is None else s * tokens_per_sample)
            for s in sizes]


POW2 = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_fastest_saturating_curve():
    # step = 10 ms + 1 ms·s → samples/s = 1000·s/(10 + s): 90.9 @1 … 909 @100 … 962 @256 (best).
    # 95 % of 962.4 = 914.3; s = 128 gives 927.5 (in), s = 64 gives 864.9 (out) → 128.
    trials = timed(lambda s: 0.010 + 0.001 * s, POW2)
    assert choose_fastest(trials, 0.05) == 128
    # 10 %: 866.2 → 64 is still out (864.9), 128 in.  20 %: 769.9 → 64 in, 32 (761.9) out.
    assert choose_fastest(trials, 0.10) == 128
    assert choose_fastest(trials, 0.20) == 64
    assert choose_fastest(trials, 0.0) == 256


def test_fastest_peaked_curve_is_not_the_largest():
    # Throughput peaks at 32 (cache-resident), then drops: per-sample cost 1 ms up to 32, 1.5 ms beyond.
    trials = timed(lambda s: 0.002 + (0.001 if s <= 32 else 0.0015) * s, POW2, tokens_per_sample=128)
    # tok/s: 16 → 113,778; 32 → 120,471 (best); 64 → 84,211; 95 % of best = 114,447 → 32.
    assert choose_fastest(trials, 0.05) == 32
    assert choose_fastest(trials, 0.06) == 16  # 113,778 ≥ 0.94·120,471 = 113,243


def test_fastest_flat_curve_picks_the_smallest_and_ignores_failures():
    trials = timed(lambda s: 0.001 * s, POW2)
    trials.append(TrialResult(micro_batch=512, oom=True, note="out of memory"))
    assert choose_fastest(trials, 0.05) == 1
    assert choose_fastest([TrialResult(micro_batch=4, oom=True)], 0.05) is None


def test_fastest_through_the_probe_uses_measured_sizes_only(releases):
    def run(s):
        if s > 300:
            raise RuntimeError(CUDA_OOM)
        return TrialResult(micro_batch=s, step_time_s=0.002 + (0.001 if s <= 32 else 0.0015) * s,
                           tokens_per_step=128 * s)

    result = probe_micro_batch(run, max_micro_batch=1024)
    assert result.largest_fit == 300 and result.fastest == 32
    assert result.fastest in [t.micro_batch for t in result.trials]


# ---------------------------------------------------------------------------
# Keeping the global batch
# ---------------------------------------------------------------------------


def test_global_batch_divides(releases):
    result = probe_micro_batch(FakeOOM(10_000), global_batch=256, dp_world_size=2)
    assert result.largest_fit == 128 and result.limited_by == "max_micro_batch"
    largest = result.choices[0]
    assert largest.role == "largest" and largest.geometry.grad_accum_steps == 1
    assert largest.usable.micro_batch == 128


def test_global_batch_not_divisible_suggests_a_verified_divisor(releases):
    runner = FakeOOM(100)
    result = probe_micro_batch(runner, global_batch=240, dp_world_size=1)
    assert result.largest_fit == 100
    largest, fastest = result.choices
    assert largest.geometry is None
    assert largest.suggested_micro_batch == 80 and largest.suggested_geometry.grad_accum_steps == 3
    assert "global batch 240 is not divisible by micro_batch 100 × dp 1 = 100" in largest.error
    assert "largest fitting micro-batch that divides 240 / dp 1 = 240 is 80 (accum 3)" in largest.error
    assert 80 in runner.ran  # the suggestion was run to verify it fits
    assert fastest.usable is not None and 240 % fastest.usable.micro_batch == 0


def test_table_and_json_report(releases):
    from rich.console import Console

    from globalbatch.probe import probe_table

    def run(s):
        if s > 40:
            raise RuntimeError(CUDA_OOM)
        return TrialResult(micro_batch=s, peak_memory_bytes=1000 + 100 * s, step_time_s=0.001 * s + 0.004,
                           tokens_per_step=64 * s)

    result = probe_micro_batch(run, global_batch=96, max_micro_batch=64)
    console = Console(record=True, width=200)
    console.print(probe_table(result, title="t"))
    text = console.export_text()
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if line.startswith("│")}
    assert set(rows) == {str(t.micro_batch) for t in result.trials}
    assert "largest" in rows["40"] and "CUDA out of memory" in rows["41"]
    report = json.loads(json.dumps(result.to_dict()))
    assert report["largest_fit"] == 40 and report["choices"][0]["suggested_micro_batch"] == 32
    assert report["trials"][0]["micro_batch"] == 2
    assert report["trials"][0]["tokens_per_s"] == pytest.approx(128 / 0.006)


# ---------------------------------------------------------------------------
# Real training steps on CPU
# ---------------------------------------------------------------------------


class TinyMLP(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, 32))

    def forward(self, x):
        return self.net(x)


def live_tensors() -> tuple[int, int]:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on torch's lazy deprecated modules warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    return len(tensors), sum(t.untyped_storage().nbytes() for t in tensors)


def test_real_probe_on_cpu_restores_model_and_memory(one_thread):
    torch.manual_seed(0)
    model = TinyMLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng_before = torch.get_rng_state()
    oom_above = 12

    def make_batch(s):
        return torch.randn(s, 32)

    def loss_fn(m, x):
        out = m(x)
        if x.shape[0] > oom_above:  # a real allocation is pinned by the traceback, then "the allocator fails"
            _pinned = torch.empty(x.shape[0], 4096)  # noqa: F841
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        return out.square().mean()

    baseline = live_tensors()
    result = probe(model, make_batch, loss_fn, max_micro_batch=64, steps_per_trial=1, warmup_steps=2)
    assert sum(t.oom for t in result.trials) >= 2  # the OOM path ran (and released) more than once
    assert result.largest_fit == oom_above
    assert all(t.peak_memory_bytes > 0 for t in result.trials if t.fits)
    assert all(p.grad is None for p in model.parameters())
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed == []  # the trial steps' updates were undone
    assert torch.equal(torch.get_rng_state(), rng_before)
    del result
    assert live_tensors() == baseline  # no leaked tensors, grads or optimizer state


def test_real_probe_tensor_peak_counts_weights_grads_and_adam_state(one_thread):
    model = TinyMLP(width=256)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    runner = TrainStepRunner(model, lambda s: torch.randn(s, 32), lambda m, x: m(x).square().mean(),
                             config=TrialConfig(steps_per_trial=1, warmup_steps=2))
    small, large = runner(4), runner(512)
    # params + grads + two AdamW moments are live together in the second warm-up step.
    assert small.peak_memory_bytes >= 4 * param_bytes
    # The hidden activations alone are 512·256·4 bytes (GELU input and output: twice that).
    assert large.peak_memory_bytes - small.peak_memory_bytes >= 508 * 256 * 4
    assert small.step_time_s > 0 and small.tokens_per_step is None


def test_real_probe_splits_each_step_after_its_backward(one_thread):
    """``forward_backward_s`` is the part of each timed step before the optimizer: an optimizer that sleeps 30 ms
    per step lands entirely in the rest (bounds, not a timing: the sleep is a floor on one side only)."""
    import time as _time

    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            _time.sleep(0.03)
            return super().step(closure)

    runner = TrainStepRunner(TinyMLP(width=16), lambda s: torch.randn(s, 32), lambda m, x: m(x).square().mean(),
                             optimizer_factory=lambda ps: SlowSGD(ps, lr=1e-3),
                             config=TrialConfig(steps_per_trial=3, warmup_steps=1))
    r = runner(4)
    assert 0 < r.forward_backward_s < r.step_time_s
    assert r.step_time_s - r.forward_backward_s >= 0.03
    assert r.to_dict()["forward_backward_s"] == r.forward_backward_s


def test_probe_model_reports_the_parameters_its_optimizer_updates(one_thread):
    from globalbatch.probe import probe_model

    model = TinyMLP(width=16)
    model.net[0].weight.requires_grad_(False)  # a frozen layer is not updated
    result = probe_model(model, lambda s: torch.randn(s, 32), lambda m, x: m(x).square().mean(), max_micro_batch=4,
                         steps_per_trial=1, warmup_steps=1)
    want = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert result.params == want < sum(p.numel() for p in model.parameters())
    assert result.to_dict()["params"] == want


def test_real_probe_with_memory_limit_brackets_and_keeps_global_batch(one_thread):
    model = TinyMLP(width=128)
    runner_probe = TrainStepRunner(model, lambda s: torch.randn(s, 32), lambda m, x: m(x).square().mean(),
                                   config=TrialConfig(steps_per_trial=1, warmup_steps=2))
    p64 = runner_probe(64).peak_memory_bytes
    limit = p64 + (p64 - runner_probe(32).peak_memory_bytes) // 2  # between 64 and 96 samples
    result = probe(model, lambda s: torch.randn(s, 32), lambda m, x: m(x).square().mean(),
                   memory_limit_bytes=limit, global_batch=1024, steps_per_trial=1)
    fits = [t for t in result.trials if t.fits]
    assert all(t.peak_memory_bytes <= limit for t in fits)
    assert all(t.peak_memory_bytes > limit for t in result.trials if t.oom)
    assert result.largest_fit + 1 in [t.micro_batch for t in result.trials if t.oom]
    assert 64 <= result.largest_fit < 128
    largest = result.choices[0]
    assert largest.usable is not None and 1024 % largest.usable.micro_batch == 0
    assert largest.usable.micro_batch in [t.micro_batch for t in fits]


def test_rss_mode_reports_a_process_peak(one_thread):
    runner = TrainStepRunner(TinyMLP(), lambda s: torch.randn(s, 32), lambda m, x: m(x).square().mean(),
                             config=TrialConfig(steps_per_trial=1, cpu_memory="rss"))
    t = runner(8)
    assert t.fits and t.peak_memory_bytes > 10 * 2**20  # a Python process with torch is tens of MiB


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def run_cli(capsys, *argv):
    from globalbatch.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_cli_help_lists_the_flags(capsys):
    code, out, _ = run_cli(capsys, "probe", "--help")
    assert code == 0
    for flag in ("--task", "--global-batch", "--dp", "--memory-limit", "--max-micro-batch",
                 "--steps-per-trial", "--throughput-tolerance", "--json"):
        assert flag in out


def test_cli_bad_memory_limit_is_one_line_exit_2(capsys):
    code, out, err = run_cli(capsys, "probe", "--memory-limit", "lots")
    assert code == 2
    assert err.strip().startswith("error: --memory-limit 'lots' is not allowed (not a quantity)")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_missing_cuda_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    code, _, err = run_cli(capsys, "probe", "--task", "tinygpt", "--device", "cuda")
    assert code == 2 and err.strip() == ("error: --device 'cuda' is not allowed (CUDA is not available on this "
                                         "machine); allowed: cpu (or a CUDA device on a machine with one)")


def test_cli_tinygpt_json(capsys, one_thread):
    code, out, _ = run_cli(capsys, "probe", "--task", "tinygpt", "--global-batch", "12", "--memory-limit", "40MiB",
                           "--steps-per-trial", "1", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["task"] == "tinygpt"
    sizes = {t["micro_batch"]: t for t in report["trials"]}
    assert sizes[report["largest_fit"]]["oom"] is False
    assert report["limited_by"] == "max_micro_batch" or sizes[report["largest_fit"] + 1]["oom"] is True
    assert all(t["peak_memory_bytes"] <= 40 * 2**20 for t in report["trials"] if not t["oom"])
    assert all(t["tokens_per_s"] > 0 for t in report["trials"] if not t["oom"])
    largest = report["choices"][0]
    usable = largest["geometry"] or largest["suggested_geometry"]
    assert usable["global_batch"] == 12 and usable["micro_batch"] * usable["grad_accum_steps"] == 12


TINY_GPT = ("--task-arg", "d_model=16", "--task-arg", "n_layer=1", "--task-arg", "n_head=2",
            "--task-arg", "seq_len=16", "--task-arg", "max_corpus_bytes=200000")


@pytest.mark.parametrize("argv, expected", [
    (("--global-batch", "64", "--dp", "0"), "--dp 0 is not allowed; allowed: a whole number ≥ 1"),
    (("--global-batch", "64", "--dp", "-2"), "--dp -2 is not allowed; allowed: a whole number ≥ 1"),
    (("--global-batch", "-4", "--memory-limit", "64MiB"),
     "--global-batch -4 is not allowed; allowed: a positive multiple of --dp 1"),
    (("--global-batch", "10", "--dp", "4"),
     "--global-batch 10 is not allowed (with --dp 4); allowed: a positive multiple of --dp 4"),
    (("--max-micro-batch", "0",), "--max-micro-batch 0 is not allowed; allowed: a whole number ≥ 1"),
    (("--steps-per-trial", "0",), "--steps-per-trial 0 is not allowed; allowed: a whole number ≥ 1"),
    (("--throughput-tolerance", "1.5",), "--throughput-tolerance 1.5 is not allowed; allowed: a fraction"),
    (("--memory-limit", "0",), "--memory-limit 0 is not allowed; allowed: a budget of at least 1 byte"),
])
def test_cli_bad_flags_are_one_line_before_any_trial(capsys, monkeypatch, argv, expected):
    import globalbatch.lab.tasks

    def no_task(*a, **k):
        raise AssertionError("a bad flag must be caught before the task is built")

    monkeypatch.setattr(globalbatch.lab.tasks, "load_task", no_task)
    code, out, err = run_cli(capsys, "probe", *argv)
    assert code == 2 and out == ""
    assert err.startswith("error: " + expected) and err.count("\n") == 1, err


def test_probe_task_checks_settings_before_building(monkeypatch):
    import globalbatch.lab.tasks
    from globalbatch.lab.probe_run import probe_task

    monkeypatch.setattr(globalbatch.lab.tasks, "load_task", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(SettingError, match="dp_world_size 0 is not allowed"):
        probe_task("tinygpt", global_batch=64, dp_world_size=0)
    with pytest.raises(SettingError, match="global_batch -4 is not allowed; allowed: a positive multiple"):
        probe_task("tinygpt", global_batch=-4)


def test_cli_memory_limit_below_micro_batch_1_is_one_error_line(capsys, one_thread):
    code, out, err = run_cli(capsys, "probe", *TINY_GPT, "--global-batch", "64", "--memory-limit", "1KiB",
                             "--steps-per-trial", "1")
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: --memory-limit 1KiB is not allowed (too small: micro_batch 1 needs ")
    assert ", peak measured); allowed: a limit above " in last
    assert all(line.startswith("probe: ") for line in err.strip().splitlines()[:-1])  # only progress lines


def test_nothing_fits_carries_the_trial(releases):
    from globalbatch.probe import NothingFits

    with pytest.raises(NothingFits, match="micro_batch 1 does not fit") as info:
        probe_micro_batch(lambda s: TrialResult(micro_batch=s, peak_memory_bytes=5000 + s), memory_limit_bytes=10)
    assert info.value.trial.micro_batch == 1 and info.value.trial.peak_memory_bytes == 5001


def test_byte_units_follow_the_size():
    from globalbatch.probe import format_bytes
    from globalbatch.probe.trial import _over_budget

    assert format_bytes(512) == "512 B" and format_bytes(1024) == "1.00 KiB"
    assert format_bytes(3.1 * 2**20) == "3.10 MiB" and format_bytes(1.5 * 2**30) == "1.50 GiB"
    assert format_bytes(1500 * 2**30) == "1.46 TiB" and format_bytes(None) == "-"
    assert _over_budget(int(3.1 * 2**20), 1024) == "peak 3.10 MiB > limit 1.00 KiB"
    # close values keep the unit that shows the difference
    assert _over_budget(int(1026.26 * 2**20), 2**30) == "peak 1,026.26 MiB > limit 1,024.00 MiB"


def test_cli_task_arg_reaches_the_task(capsys, monkeypatch):
    import globalbatch.lab.tasks

    seen = {}

    def fake_load(spec, **overrides):
        seen.update(overrides, spec=spec)
        raise ValueError("stop here")

    monkeypatch.setattr(globalbatch.lab.tasks, "load_task", fake_load)
    code, _, err = run_cli(capsys, "probe", "--task-arg", "d_model=64", "--task-arg", "corpus_dir=/x")
    assert code == 2 and err.startswith("error: --task-arg ") and "stop here" in err and err.count("\n") == 1
    assert seen == {"spec": "tinygpt", "d_model": 64, "corpus_dir": "/x"}
    code, _, err = run_cli(capsys, "probe", "--task-arg", "oops")
    assert code == 2 and "--task-arg" in err and "KEY=VALUE" in err


def test_cli_sample_task_speaks_in_samples(capsys, one_thread):
    code, out, err = run_cli(capsys, "probe", "--task", "mnist", "--global-batch", "60", "--dp", "2",
                             "--memory-limit", "100MiB", "--steps-per-trial", "1")
    assert code == 0, err
    assert "samples/s" in out and "tokens/s" not in out
    assert "largest that fits: 30 (limited by global batch ÷ dp (= 30))" in out
    assert "largest: 60 samples = 2 ranks × 1 accum × 30 samples" in out
    assert " seq" not in out and "1 ranks" not in out


def test_summary_texts():
    from globalbatch.plan import solve_geometry
    from globalbatch.probe import geometry_text, limit_text

    g = solve_geometry(global_batch=256, micro_batch=16, dp_world_size=1)
    assert geometry_text(g, "token") == "256 seq = 1 rank × 16 accum × 16 seq"
    assert geometry_text(solve_geometry(global_batch=60, micro_batch=30, dp_world_size=2), "sample") == \
        "60 samples = 2 ranks × 1 accum × 30 samples"
    result = probe_micro_batch(lambda s: TrialResult(micro_batch=s, peak_memory_bytes=s), max_micro_batch=8)
    assert limit_text(result, max_micro_batch=8, flag_names=True) == "--max-micro-batch (= 8)"
    assert limit_text(result, global_batch=16, dp_world_size=2) == "global batch ÷ dp (= 8)"


# Distributed (2 gloo ranks agree on every trial): tests/test_core_two_ranks.py, one launch with the step and
# adaptive checks.


# ---------------------------------------------------------------------------
# Issue 16: budgets at, just below and just above every boundary; no re-runs; intermittent OOM
# ---------------------------------------------------------------------------


def test_issue_16_budget_one_byte_below_the_next_boundary():
    """a = 2 GiB, b = 30 MiB, T = 1000, budget a + b(T+1) − 1: was 19 trials (a +1e-6-sample slack)."""
    a, b, t = 2 * 2**30, 30 * 2**20, 1000
    runner = FakeAllocator(a, b, a + b * (t + 1) - 1)
    result = probe_micro_batch(runner, max_micro_batch=8192, memory_limit_bytes=a + b * (t + 1) - 1)
    assert runner.ran == [2, 4, 8, 16, 32, 64, 128, 256, 512, 1000, 1001]
    assert result.largest_fit == t and result.prediction_misses == 0
    assert len(runner.ran) <= math.ceil(math.log2(t)) + 3


BOUNDARY_SLOPES = [(2 * 2**30, 30 * 2**20), (1_610_612_736, 3 * 2**20), (10 * 2**20, 4_736_000), (1000, 100),
                   (5 * 2**30, 2**20 + 7)]


@pytest.mark.parametrize("a, b", BOUNDARY_SLOPES)
def test_linear_memory_exact_within_log_plus_three_at_every_boundary(a, b, releases):
    thresholds = sorted(set(THRESHOLDS + [3, 5, 7, 31, 33, 63, 65, 127, 129, 255, 257, 511, 513, 999, 1001, 2047,
                                          2049, 4095, 4097, 6143, 8191]))
    checked = 0
    for t in thresholds:
        for budget in (a + b * t, a + b * t - 1, a + b * t + 1, a + b * (t + 1) - 1):
            answer = min((budget - a) // b, 8192)
            if answer < 1:
                continue
            runner = FakeAllocator(a, b, budget)
            result = probe_micro_batch(runner, max_micro_batch=8192, memory_limit_bytes=budget)
            check_ran_and_exact(result, runner.ran, answer, 8192)
            assert len(runner.ran) <= math.ceil(math.log2(answer)) + 3, (t, budget - a - b * t, runner.ran)
            assert result.prediction_misses == 0
            checked += 1
    assert checked >= 4 * len(thresholds) - 2


def test_a_wrong_prediction_counts_as_one_miss(releases):
    """Peaks on a line, but the device fails above 1000 while its reported capacity says 1001 fits."""
    a, b = 2 * 2**30, 30 * 2**20
    ran = []

    def run(s):
        ran.append(s)
        if s > 1000:
            raise torch.cuda.OutOfMemoryError(CUDA_OOM)
        return TrialResult(micro_batch=s, peak_memory_bytes=a + b * s, capacity_bytes=a + b * 1001 + b // 2)

    result = probe_micro_batch(run, max_micro_batch=8192)
    assert result.largest_fit == 1000 and len(set(ran)) == len(ran)
    assert result.prediction_misses == 1  # 1001 predicted to fit and failed: one miss, not two


def test_a_measured_size_is_never_run_again_and_the_boundary_is_found(releases):
    """The line predicts 4095 from 512…2048; 4095 and the pending doubling 4096 both fit (memory grows
    slower above 2048). The old search ran 4096 again; an intermittent OOM on that repeat made it stop
    at 4096 with the true ceiling 6143 and 4097 never run."""
    a, b = 10**6, 1000
    budget = int(a + b * 4095.5)
    ran: list[int] = []

    def run(s):
        if s in ran:  # a repeat hits an intermittent OOM (fragmentation)
            raise RuntimeError(CUDA_OOM)
        ran.append(s)
        peak = a + b * s if s <= 2048 else a + b * 2048 + (b // 2) * (s - 2048)
        return TrialResult(micro_batch=s, peak_memory_bytes=peak)

    result = probe_micro_batch(run, max_micro_batch=8192, memory_limit_bytes=budget)
    assert result.largest_fit == 6143 and 6144 in ran
    assert len(result.trials) == len(ran) == len(set(ran))  # nothing ran twice
    assert result.conflicts == ()


def test_intermittent_oom_on_a_smaller_size_is_reported_and_decided(releases, caplog):
    """Sizes up to 100 fit, but 90 (first run by the global-batch verification) fails: the probe says so
    and decides: the largest fit becomes the largest measured fit below 90, and the pick divides 90."""
    ran = []

    def run(s):
        ran.append(s)
        if s > 100 or s == 90:
            raise RuntimeError(CUDA_OOM)
        return TrialResult(micro_batch=s, step_time_s=0.01)

    with caplog.at_level("WARNING"):
        result = probe_micro_batch(run, global_batch=90, max_micro_batch=8192, use_memory_model=False)
    assert len(ran) == len(set(ran))
    assert len(result.conflicts) == 1 and "micro_batch 90 ran out of memory" in result.conflicts[0]
    assert "lowered to 64" in result.conflicts[0] and "lowered to 64" in caplog.text
    assert result.largest_fit == 64
    largest = result.choices[0]
    assert largest.micro_batch == 64 and largest.suggested_micro_batch == 45
    assert result.to_dict()["conflicts"] == list(result.conflicts)


def test_probe_task_reports_valid_tokens_and_mfu(one_thread):
    """Each fitting trial carries its counted FLOPs and its non-padding tokens; MFU is against the peak."""
    from globalbatch.flops import count_flops
    from globalbatch.lab.probe_run import probe_task
    from globalbatch.lab.tasks import load_task

    overrides = {"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32}
    result = probe_task("tinygpt", max_micro_batch=8, steps_per_trial=1, device="cpu", task_overrides=overrides)
    assert result.peak_flops_per_s is not None and result.peak_flops_source.startswith("measured: cpu")
    task = load_task("tinygpt", **overrides)
    model = task.build_model(0)
    for t in result.trials:
        assert t.fits and t.model_flops_per_step > 0
        assert t.valid_tokens_per_step <= t.tokens_per_step
        assert 0 < t.mfu(result.peak_flops_per_s) < 1
        assert t.model_flops_per_s() == pytest.approx(t.model_flops_per_step / t.step_time_s)
    # the counted FLOPs are FlopCounterMode's for the same batch (probe_task: the first samples of the order)
    from itertools import islice

    pool = list(islice(task.sample_order(0), 8))
    batch = task.collate(pool[:8], "cpu")
    expected = count_flops(model, batch, lambda m, b: task.loss_sum(m, b)[0])
    assert result.by_size()[-1].model_flops_per_step == expected
    assert result.by_size()[-1].valid_tokens_per_step == int(task.loss_sum(model, batch)[1])  # the loss count
    row = result.to_dict()["trials"][0]
    assert row["mfu"] == pytest.approx(result.trials[0].mfu(result.peak_flops_per_s))
    assert row["valid_tokens_per_s"] == result.trials[0].valid_tokens_per_s()


@pytest.mark.parametrize("block, b", [(2 * 2**20, 700_000), (20 * 2**20, 3 * 2**20), (20 * 2**20, 700_000)])
def test_staircase_memory_is_exact_and_close_to_the_bisection_bound(block, b, releases):
    """Peaks rounded up to allocator blocks larger than a sample (a staircase, as CUDA's caching allocator makes):
    the line fits the points only loosely, so it is not used (residual > half a sample) except where the points
    happen to be collinear. Exact every time; measured worst: one trial over 2⌈log2 T⌉ + 1."""
    a = 2 * 2**30

    def peak(s):
        return a + math.ceil(b * s / block) * block

    over = 0
    for t in list(range(2, 200)) + [257, 511, 1000, 1024, 3000, 4096, 6000]:
        budget = peak(t)
        ran = []

        def run(s):
            ran.append(s)
            return TrialResult(micro_batch=s, peak_memory_bytes=peak(s))

        result = probe_micro_batch(run, max_micro_batch=8192, memory_limit_bytes=budget)
        answer = max(s for s in range(t, t + block // b + 2) if peak(s) <= budget)
        assert result.largest_fit == answer and len(set(ran)) == len(ran)
        bound = 2 * math.ceil(math.log2(answer)) + 1
        assert len(ran) <= bound + 1, (t, ran)
        over += len(ran) > bound
    assert over <= 40  # most thresholds within the bound itself


def test_gb_probe_is_a_deprecated_alias_of_probe_model():
    import globalbatch as gb

    model = nn.Linear(4, 1)
    with pytest.warns(FutureWarning, match=r"globalbatch.probe\(\.\.\.\) is deprecated; call globalbatch.probe_model"):
        old = gb.probe(model, lambda s: torch.randn(s, 4), lambda m, x: m(x).square().mean(), max_micro_batch=4,
                       steps_per_trial=1, warmup_steps=1)
    assert old.largest_fit == 4
