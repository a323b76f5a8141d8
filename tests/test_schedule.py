"""Tests of globalbatch.schedule: step and ramp-up batch schedules, LR schedules over tokens."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from globalbatch.errors import SettingError
from globalbatch.schedule import (
    RampupBatchSchedule,
    StepBatchSchedule,
    LRSchedule,
    TokenLRSchedule,
    constant_batch,
    format_batch_change,
    format_lr,
    format_lrs,
    list_lr_shapes,
    parse_step_schedule,
)

B = 1_000_000_000


def test_parse_megatron_step_schedule():
    s = parse_step_schedule("0:256 2B:512 8B:1024")
    assert s.steps == ((0, 256), (2 * B, 512), (8 * B, 1024))
    assert s.unit is None and s.lr_rule == "sqrt"  # positions count the run's unit (StepConfig.unit)
    assert [s.batch_at(p) for p in (0, 2 * B - 1, 2 * B, 8 * B - 1, 8 * B, 10**15)] == [256, 256, 512, 512, 1024, 1024]
    assert parse_step_schedule("0:8, 1.5K:16,3M:32").steps == ((0, 8), (1500, 16), (3_000_000, 32))
    assert s.all_batches() == [256, 512, 1024] and str(parse_step_schedule("0:4 10:8")) == "0:4 10:8"


@pytest.mark.parametrize("text, match", [
    ("", "is empty"),
    ("   ", "is empty"),
    ("0:256 2B", r"entry '2B' is not allowed \(it is not THRESHOLD:BATCH\)"),
    ("0:256 2B:512:3", "entry '2B:512:3'"),
    ("1K:256 2B:512", "first threshold 1,000 is not allowed; allowed: 0"),
    ("0:256 2B:512 2B:1024", r"thresholds 2,000,000,000 then 2,000,000,000 is not allowed \(they are not strictly increasing\)"),
    ("0:256 2B:512 1B:1024", "not strictly increasing"),
    ("0:512 2B:256", r"batch 512 then 256 at 2,000,000,000 is not allowed \(it does not grow\)"),
    ("0:256 2B:256", "does not grow"),
    ("0:256 2X:512", "threshold '2X'"),
    ("0:0", "batch 0 is not allowed"),
    ("0:2.5", "2.5"),
])
def test_parse_errors_are_one_line_value_errors(text, match):
    with pytest.raises(SettingError, match=match) as info:
        parse_step_schedule(text)
    assert "\n" not in str(info.value)


def test_schedule_unit_and_rule_are_checked():
    with pytest.raises(SettingError, match="unit 'epoch' is not allowed; allowed: token, sample"):
        parse_step_schedule("0:4", unit="epoch")  # the deprecated argument is still checked
    with pytest.raises(SettingError, match="lr_rule 'cubic' is not allowed; allowed: linear, sqrt, none"):
        parse_step_schedule("0:4", lr_rule="cubic")


@pytest.mark.parametrize("rule, mult", [("sqrt", math.sqrt(4)), ("linear", 4.0), ("none", 1.0)])
def test_lr_multiplier_follows_the_rule_relative_to_first_batch(rule, mult):
    s = parse_step_schedule("0:256 1M:1024", lr_rule=rule)
    assert s.lr_multiplier(256) == 1.0
    assert s.lr_multiplier(1024) == pytest.approx(mult, rel=1e-15)


def test_constant_batch_never_changes():
    s = constant_batch(64)
    assert s.batch_at(0) == s.batch_at(10**18) == 64 and s.all_batches() == [64]


def test_rampup_matches_megatron_example():
    # Megatron-LM --rampup-batch-size 16 8 300000 with --global-batch-size 1024:
    # 126 increments of 300000/126 ≈ 2380.95 samples each
    r = RampupBatchSchedule(start=16, increment=8, ramp=300_000, final=1024)  # in samples with StepConfig(unit="sample")
    assert r.unit is None  # no unit of its own: the run's
    assert r.num_increments == 126
    for k in range(1, 127):
        boundary = math.ceil(k * 300_000 / 126)  # first position of increment k
        assert r.batch_at(boundary) == 16 + 8 * k
        assert r.batch_at(boundary - 1) == 16 + 8 * (k - 1)
    assert r.batch_at(0) == 16 and r.batch_at(300_000) == 1024 and r.batch_at(10**12) == 1024
    assert r.all_batches() == list(range(16, 1025, 8))


@pytest.mark.parametrize("kw, match", [
    (dict(start=16, increment=10, ramp=100, final=1024), "1008 is not divisible by increment 10"),
    (dict(start=64, increment=8, ramp=100, final=64), "final 64 is not allowed; allowed: > start 64"),
    (dict(start=16, increment=8, ramp=0, final=1024), "rampup ramp 0"),
])
def test_rampup_errors(kw, match):
    with pytest.raises(SettingError, match=match):
        RampupBatchSchedule(**kw)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=20), st.integers(1, 50), st.integers(1, 8),
       st.integers(1, 10**5))
def test_batch_schedules_only_grow(positions, start, steps, ramp):
    r = RampupBatchSchedule(start=start, increment=3, ramp=ramp, final=start + 3 * steps)
    s = parse_step_schedule("0:2 1K:4 100K:8")
    for sched in (r, s):
        values = [sched.batch_at(p) for p in sorted(positions)]
        assert values == sorted(values)
        assert set(values) <= set(sched.all_batches())


def test_batch_change_log_line():
    line = format_batch_change(256, 512, 2 * B, "token", 3e-4, 3e-4 * math.sqrt(2), "sqrt")
    assert line == "global batch 256 -> 512 at 2,000,000,000 tokens; lr 3e-4 -> 4.24e-4 (sqrt)"
    assert format_batch_change(8, 16, 1500, "sample", 0.1, 0.2, "linear") == (
        "global batch 8 -> 16 at 1,500 samples; lr 0.1 -> 0.2 (linear)")


@pytest.mark.parametrize("lr, text", [(3e-4, "3e-4"), (6e-5, "6e-5"), (1.2345e-4, "1.23e-4"), (0.01, "0.01"),
                                      (0.00141421, "0.00141"), (0.0, "0"), (2.0, "2"), (999.9, "1e3"),
                                      (9.996e-4, "0.001"), (1e-3, "0.001")])
def test_format_lr(lr, text):
    assert format_lr(lr) == text


def test_batch_change_log_line_uses_one_notation_for_both_lrs():
    # 9.93e-4 alone prints scientific, 1.4e-3 alone plain: together both scientific
    assert format_lrs(9.93e-4, 1.4e-3) == ["9.93e-4", "1.4e-3"]
    assert format_lrs(0.01, 0.0141421) == ["0.01", "0.0141"]
    line = format_batch_change(64, 128, 20_000, "token", 9.93e-4, 9.93e-4 * math.sqrt(2), "sqrt")
    assert line.endswith("lr 9.93e-4 -> 1.4e-3 (sqrt)")
    for lo in (1e-5, 3e-4, 9.93e-4, 1e-3, 0.05, 0.9, 900.0):
        pair = format_lrs(lo, lo * 2)
        assert len({"e" in t for t in pair}) == 1, pair  # never one plain and one scientific


# --------------------------------------------------------------------------- LR schedules


@pytest.mark.parametrize("shape", list_lr_shapes())
def test_lr_shapes_warm_up_then_end_at_min(shape):
    s = LRSchedule(peak_lr=1e-3, warmup=1000, total=11_000, shape=shape, min_lr_ratio=0.1)
    assert s.lr_at(0) == 0.0
    assert s.lr_at(500) == pytest.approx(5e-4, rel=1e-15)  # linear warmup: half-way, half the peak
    assert s.lr_at(1000) == pytest.approx(1e-3, rel=1e-15)
    end = 1e-3 if shape == "constant" else 1e-4
    assert s.lr_at(11_000) == pytest.approx(end, rel=1e-12)
    assert s.lr_at(10**9) == pytest.approx(end, rel=1e-12)
    after = [s.lr_at(p) for p in range(1000, 12_000, 250)]
    assert all(a >= b for a, b in zip(after, after[1:]))  # never increases after warmup


def test_lr_shape_values_by_hand():
    # cosine half-way: r + (1 - r)·½(1 + cos(π/2)) = 0.1 + 0.9·0.5 = 0.55 of peak
    cos = LRSchedule(peak_lr=1.0, warmup=0, total=1000, shape="cosine", min_lr_ratio=0.1)
    assert cos.lr_at(500) == pytest.approx(0.55, rel=1e-15)
    # linear a quarter in: 1 − 0.25 = 0.75
    lin = LRSchedule(peak_lr=1.0, warmup=0, total=1000, shape="linear")
    assert lin.lr_at(250) == pytest.approx(0.75, rel=1e-15)
    # WSD with the last 20 % decaying: stable until 800, half-way down at 900
    wsd = LRSchedule(peak_lr=1.0, warmup=0, total=1000, shape="wsd", decay_fraction=0.2)
    assert wsd.lr_at(799) == 1.0 and wsd.lr_at(800) == 1.0
    assert wsd.lr_at(900) == pytest.approx(0.5, rel=1e-12)
    assert wsd.factor_at(1000) == 0.0


def test_token_warmup_is_identical_across_batch_sizes():
    """LR as a function of tokens is the same whatever batch walks along it; a step-based warmup is not."""
    sched = LRSchedule(peak_lr=3e-4, warmup=8192, total=100_000, shape="cosine")
    small, large = 256, 1024  # tokens per optimizer step
    lr_small = {small * k: sched.lr_at(small * k) for k in range(1, 200)}
    lr_large = {large * k: sched.lr_at(large * k) for k in range(1, 50)}
    common = sorted(set(lr_small) & set(lr_large))
    assert len(common) == 49
    assert all(lr_small[t] == lr_large[t] for t in common)
    # the step-based equivalent (warmup = 32 steps, tuned at the small batch) reaches the peak
    # after 32 × 1024 = 32,768 tokens at the large batch: 4× later, so it differs at 4,096 tokens
    step_warmup = 32
    step_lr_large_at_4096 = 3e-4 * (4096 // large) / step_warmup
    assert lr_large[4096] == pytest.approx(3e-4 * 4096 / 8192, rel=1e-15)
    assert abs(lr_large[4096] - step_lr_large_at_4096) > 1e-5


@pytest.mark.parametrize("kw, match", [
    (dict(peak_lr=0.0, total=10), "peak_lr 0 is not allowed"),
    (dict(peak_lr=1e-3, total=10, warmup=11), "warmup 11 is not allowed; allowed: <= total 10"),
    (dict(peak_lr=1e-3, total=0), "total 0"),
    (dict(peak_lr=1e-3, total=10, shape="step"), "lr shape 'step' is not allowed; allowed: constant, cosine, linear, wsd"),
    (dict(peak_lr=1e-3, total=10, min_lr_ratio=1.5), "min_lr_ratio 1.5"),
    (dict(peak_lr=1e-3, total=10, decay_fraction=0.0), "decay_fraction 0 is not allowed"),
    (dict(peak_lr=1e-3, total=10, unit="step"), "unit 'step'"),
])
def test_lr_schedule_errors(kw, match):
    with pytest.raises(SettingError, match=match):
        LRSchedule(**kw)


def test_lr_schedule_takes_count_strings_and_integral_floats():
    s = LRSchedule(peak_lr=1e-3, total="2B", warmup="375M")
    assert (s.total, s.warmup) == (2 * B, 375_000_000) and type(s.total) is int and type(s.warmup) is int
    f = LRSchedule(peak_lr=1e-3, total=1e9, warmup=1e6)
    assert (f.total, f.warmup) == (B, 1_000_000) and type(f.total) is int
    assert f == LRSchedule(peak_lr=1e-3, total=B, warmup="1M")
    assert f.lr_at(500_000) == pytest.approx(5e-4, rel=1e-15)
    r = RampupBatchSchedule(start=16, increment=8, ramp="300K", final=1024.0)
    assert (r.ramp, r.final) == (300_000, 1024) and type(r.final) is int


@pytest.mark.parametrize("kw, match", [
    (dict(total=1.5), r"total 1.5 is not allowed \(not a whole number\)"),
    (dict(total="2X"), r"total '2X' is not allowed \(not a quantity\)"),
    (dict(total=True), r"total True is not allowed; allowed: a whole number of units >= 0"),
    (dict(total=None), r"total None is not allowed"),
    (dict(total=-5), r"total -5 is not allowed"),
    (dict(total="1K", warmup="2K"), r"warmup 2,000 is not allowed; allowed: <= total 1,000"),
])
def test_lr_schedule_count_errors_are_one_line(kw, match):
    with pytest.raises(SettingError, match=match) as info:
        LRSchedule(peak_lr=1e-3, **kw)
    assert "\n" not in str(info.value)


def test_step_schedule_direct_construction_is_validated():
    with pytest.raises(SettingError, match="threshold -1"):
        StepBatchSchedule(steps=((-1, 4),))
    with pytest.raises(SettingError, match="is empty"):
        StepBatchSchedule(steps=())


def test_the_unit_is_said_once_and_the_old_per_schedule_units_are_deprecated():
    from globalbatch.step import StepConfig

    lr = LRSchedule(peak_lr=1e-3, total=10_000)
    ramp = RampupBatchSchedule(start=4, increment=4, ramp=1_000, final=16)
    cfg = StepConfig(micro_batch=4, batch_schedule=ramp, lr_schedule=lr, unit="sample")
    assert cfg.position_unit == "sample" and lr.unit is None and ramp.unit is None
    assert StepConfig(micro_batch=4, batch_schedule=ramp, lr_schedule=lr).position_unit == "token"
    # the old way: a unit on each schedule (and a name that said "token") still works for one release, warned
    with pytest.warns(FutureWarning, match="unit= on RampupBatchSchedule is deprecated"):
        old_ramp = RampupBatchSchedule(start=4, increment=4, ramp=1_000, final=16, unit="sample")
    with pytest.warns(FutureWarning, match="TokenLRSchedule is deprecated: use LRSchedule"):
        renamed = TokenLRSchedule(peak_lr=1e-3, total=10_000)
    assert isinstance(renamed, LRSchedule) and renamed.lr_at(5_000) == lr.lr_at(5_000)
    with pytest.warns(FutureWarning, match="unit= on the LR schedule is deprecated"):
        old_lr = LRSchedule(peak_lr=1e-3, total=10_000, unit="token")
    with pytest.raises(SettingError, match="lr_schedule unit 'token' is not allowed; allowed: batch_schedule unit 'sample'"):
        StepConfig(micro_batch=4, batch_schedule=old_ramp, lr_schedule=old_lr)
    assert StepConfig(micro_batch=4, batch_schedule=old_ramp).position_unit == "sample"  # honoured as before
    with pytest.warns(FutureWarning, match="loss_unit"):
        assert StepConfig(micro_batch=4, global_batch=8, loss_unit="sample").unit == "sample"
    with pytest.raises(SettingError, match="unit 'epoch' is not allowed; allowed: token, sample"):
        StepConfig(micro_batch=4, global_batch=8, unit="epoch")


def test_driver_lr_schedule_argument_is_a_deprecated_alias():
    import torch

    from globalbatch.step import StepConfig, StepDriver

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lr = LRSchedule(peak_lr=1e-3, total=10_000)
    with pytest.warns(FutureWarning, match="StepConfig"):
        drv = StepDriver(model, opt, StepConfig(micro_batch=1, global_batch=2), lr_schedule=lr)
    assert drv.config.lr_schedule is lr and drv.lr_schedule is lr
    with pytest.raises(SettingError, match="StepConfig.lr_schedule only"):
        StepDriver(model, opt, StepConfig(micro_batch=1, global_batch=2, lr_schedule=lr), lr_schedule=lr)


def test_step_schedule_stages_are_the_geometry_and_steps_of_each_stage():
    from globalbatch.errors import SettingError
    from globalbatch.schedule import parse_step_schedule

    sched = parse_step_schedule("0:1024 2B:2048 10B:4096")
    stages = sched.stages(total=100 * 10**9, micro_batch=2, dp_world_size=64, units_per_sample=2048)
    # by hand: 2e9 / (1024·2048) = 953.67 → 954; 8e9 / (2048·2048) = 1907.3 → 1908; 9e10 / (4096·2048) = 10728.8 → 10729
    assert [(s.start, s.end, s.global_batch, s.grad_accum_steps, s.optimizer_steps) for s in stages] == [
        (0, 2 * 10**9, 1024, 8, 954), (2 * 10**9, 10 * 10**9, 2048, 16, 1908), (10 * 10**9, 100 * 10**9, 4096, 32, 10729)]
    # a total inside the second stage cuts it there and drops the third
    short = sched.stages(total=3 * 10**9, micro_batch=2, dp_world_size=64, units_per_sample=2048)
    assert [(s.end, s.optimizer_steps) for s in short] == [(2 * 10**9, 954), (3 * 10**9, 239)]
    with pytest.raises(SettingError, match="not divisible by micro_batch 2 × dp 64 = 128"):
        parse_step_schedule("0:1024 2B:2000").stages(total=10**10, micro_batch=2, dp_world_size=64)


def test_stage_steps_are_the_drivers_a_step_that_overshoots_a_threshold_counts_before_it():
    """Per-stage ⌈span ÷ units per step⌉ said 31 + 2 + 8 = 41 steps for '0:64 1M:128 1070K:256' at 512 tokens per
    sequence; the driver switches at the first step starting past a threshold: 31 steps end at 1,015,808, one step
    of 128 ends past 1,070,000, then 8 of 256: 40. The stages now count what a StepDriver runs."""
    import torch

    from globalbatch.schedule import parse_step_schedule
    from globalbatch.step import StepConfig, StepDriver

    text, seq = "0:64 1M:128 1070K:256 1080K:512", 512
    stages = parse_step_schedule(text).stages(total=2_000_000, micro_batch=64, dp_world_size=1, units_per_sample=seq)
    model = torch.nn.Linear(1, 1)
    driver = StepDriver(model, torch.optim.SGD(model.parameters(), lr=0.0),
                        StepConfig(micro_batch=64, batch_schedule=parse_step_schedule(text), print_geometry=False))
    ran: dict[int, int] = {}
    while driver.trained_units < 2_000_000:  # every sample carries seq tokens, as the plan counts them
        b = driver.global_batch
        for i in range(b // 64):
            with driver.micro_step(last=i == b // 64 - 1):
                driver.backward(model.weight.sum() * 0.0, 64 * seq, samples=64)
        driver.step()
        ran[b] = ran.get(b, 0) + 1
    assert [(s.global_batch, s.optimizer_steps) for s in stages] == [(64, 31), (128, 1), (256, 0), (512, 4)]
    assert {s.global_batch: s.optimizer_steps for s in stages if s.optimizer_steps} == ran


def test_plan_takes_the_batch_schedule_string_as_scale_writes_it():
    import contextlib
    import io
    import json

    from globalbatch.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        main(["plan", "--micro-batch", "2", "--dp", "64", "--seq-len", "2048", "--total-tokens", "100B",
              "--batch-schedule", "0:1024 2B:2048", "--json"])
    assert exc.value.code == 0
    data = json.loads(out.getvalue())
    assert data["global_batch_sequences"] == 1024  # the first stage is the plan's global batch
    assert [(s["global_batch"], s["grad_accum_steps"], s["optimizer_steps"]) for s in data["batch_schedule"]] == [
        (1024, 8, 954), (2048, 16, 23365)]  # 954 steps end at 2,000,683,008: (1e11 − that) / (2048·2048) = 23364.9
