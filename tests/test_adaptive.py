"""globalbatch.adaptive: feasibility (hypothesis), the LR rules, hysteresis, bitwise resume across a change,
and (torchrun, 2 gloo ranks, in tests/test_core_two_ranks.py) identical decisions on every rank."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from globalbatch.errors import SettingError
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent / "dist"))
sys.path.insert(0, str(Path(__file__).parent))
import adaptive_common as ac  # noqa: E402

from globalbatch.adaptive import (  # noqa: E402
    AdaptiveBatchSchedule,
    FeasibleBatches,
    GoodputPolicy,
    NoiseTrackingPolicy,
    Observation,
    Proposal,
    adascale_gain,
    lr_multiplier,
    statistical_efficiency,
)
from globalbatch.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------- feasibility

def test_feasible_candidates():
    f = FeasibleBatches(micro_batch=4, dp_world_size=2, min_batch=10, max_batch=70)
    assert f.candidates() == [16, 24, 32, 40, 48, 56, 64]
    assert FeasibleBatches(micro_batch=4, dp_world_size=2, min_batch=10, max_batch=70,
                           powers_of_two=True).candidates() == [16, 32, 64]
    assert f.floor(30) == 24 and f.ceil(30) == 32 and f.floor(3) == 16 and f.ceil(1000) == 64
    assert f.next_above(64) is None and f.next_above(16) == 24
    with pytest.raises(SettingError, match="no feasible global batch in \\[9, 15\\]"):
        FeasibleBatches(micro_batch=4, dp_world_size=4, min_batch=9, max_batch=15)
    with pytest.raises(SettingError, match="max_batch 4 is not allowed"):
        FeasibleBatches(micro_batch=1, min_batch=8, max_batch=4)


finite_or_not = st.one_of(st.floats(min_value=0, max_value=1e7, allow_nan=False), st.just(math.nan),
                          st.just(math.inf), st.floats(min_value=-10, max_value=0))


@st.composite
def feasible_and_obs(draw):
    micro = draw(st.integers(1, 16))
    world = draw(st.integers(1, 4))
    q = micro * world
    lo = draw(st.integers(1, 8 * q))
    hi = lo + draw(st.integers(q, 64 * q))
    p2 = draw(st.booleans())
    try:
        f = FeasibleBatches(micro_batch=micro, dp_world_size=world, min_batch=lo, max_batch=hi, powers_of_two=p2)
    except ValueError:
        f = FeasibleBatches(micro_batch=micro, dp_world_size=world, min_batch=lo, max_batch=hi)
    cur = draw(st.sampled_from(f.candidates()))
    b = draw(finite_or_not)
    low = draw(finite_or_not)
    high = draw(finite_or_not)
    obs = Observation(step=10, position=1000, global_batch=cur, base_batch=f.candidates()[0], b_simple=b,
                      b_simple_low=low, b_simple_high=high, units_per_s=draw(finite_or_not),
                      units_per_sample=draw(st.sampled_from([1.0, 64.0, math.nan])))
    return f, obs


@settings(max_examples=300, deadline=None)
@given(feasible_and_obs(), st.floats(min_value=0.01, max_value=100))
def test_policies_never_propose_an_infeasible_batch(fo, c):
    f, obs = fo
    table = {b: float(1 + i) for i, b in enumerate(f.candidates()[:3])}
    for policy in (NoiseTrackingPolicy(c=c), NoiseTrackingPolicy(c=c, use_interval=False), GoodputPolicy(),
                   GoodputPolicy(throughput=table)):
        p = policy.propose(obs, f)
        assert isinstance(p, Proposal) and isinstance(p.batch, int)
        assert f.contains(p.batch), (policy, obs, p)


def test_noise_tracking_grows_on_the_lower_bound_only():
    f = FeasibleBatches(micro_batch=4, min_batch=8, max_batch=256, powers_of_two=True)
    kw = dict(step=1, position=1, global_batch=16, base_batch=8, units_per_s=1.0, units_per_sample=1.0)
    pol = NoiseTrackingPolicy(c=1.0)
    # point estimate 100 would allow 64, but the lower bound 31 does not clear the next batch (32)
    assert pol.propose(Observation(b_simple=100, b_simple_low=31, b_simple_high=300, **kw), f).batch == 16
    assert pol.propose(Observation(b_simple=100, b_simple_low=70, b_simple_high=300, **kw), f).batch == 64
    # shrink proposals only when c × the upper bound is below the current batch
    assert pol.propose(Observation(b_simple=5, b_simple_low=2, b_simple_high=9, **kw), f).batch == 16
    assert pol.propose(Observation(b_simple=5, b_simple_low=2, b_simple_high=12, **kw), f).batch == 16
    assert pol.propose(Observation(b_simple=5, b_simple_low=2, b_simple_high=7.9, **kw), f).batch == 8
    assert NoiseTrackingPolicy(c=0.5).propose(Observation(b_simple=100, b_simple_low=70, b_simple_high=300, **kw),
                                              f).batch == 32


def test_goodput_picks_the_argmax_of_throughput_times_efficiency():
    f = FeasibleBatches(micro_batch=1, min_batch=8, max_batch=64, powers_of_two=True)
    table = {8: 100.0, 16: 180.0, 32: 300.0, 64: 360.0}
    pol = GoodputPolicy(throughput=table, online=False)
    obs = Observation(step=1, position=1, global_batch=8, base_batch=8, b_simple=40.0, b_simple_low=30,
                      b_simple_high=50, units_per_s=math.nan, units_per_sample=1.0)
    want = max(table, key=lambda b: table[b] * (40 + 8) / (40 + b))
    assert want == 32  # 300·48/72 = 200 beats 180·48/56 = 154 and 360·48/104 = 166
    assert pol.propose(obs, f).batch == want
    # within min_gain of the best: hold
    assert GoodputPolicy(throughput=table, online=False, min_gain=1.5).propose(obs, f).batch == 8  # 200 < 100·2.5
    assert statistical_efficiency(8, 40, 8) == 1.0


# --------------------------------------------------------------------------- LR rules

def test_adascale_gain_closed_form():
    # r = (σ² + μ²)/(σ²/S + μ²) with σ² = tr Σ / B0 (variance of the base batch's gradient), μ² = |G|²
    tr_sigma, g2, b0, b = 30.0, 0.5, 8, 32
    s = b / b0
    direct = (tr_sigma / b0 + g2) / (tr_sigma / b0 / s + g2)
    assert adascale_gain(b, tr_sigma / g2, b0) == pytest.approx(direct, rel=1e-12)
    # all noise: linear scaling (gain S); no noise: no gain
    assert adascale_gain(b, 1e9, b0) == pytest.approx(s, rel=1e-6) and adascale_gain(b, 0.0, b0) == 1.0
    assert lr_multiplier("sqrt", 32, 8) == 2.0 and lr_multiplier("linear", 32, 8) == 4.0
    assert lr_multiplier("none", 32, 8) == 1.0 and lr_multiplier("adascale", 32, 8) == 2.0  # no B_noise: sqrt


class _Forced:
    """Proposes ``batch`` from step ``at`` on (a user policy)."""

    name = "forced"

    def __init__(self, batch: int, at: int):
        self.batch, self.at = batch, at

    def propose(self, obs, feasible):
        return Proposal(batch=self.batch if obs.step >= self.at else obs.global_batch, reason=f"forced at {self.at}")


class _FixedEstimate:
    """A monitor stand-in: a fixed B_simple (samples) with its interval."""

    def __init__(self, b):
        self.b = b

    def estimate(self):
        from types import SimpleNamespace
        return SimpleNamespace(b_simple=self.b, low=self.b / 2, high=self.b * 2, unit="sample", ok=True, flags=())


@pytest.mark.parametrize("rule", ["sqrt", "linear", "none", "adascale"])
@pytest.mark.parametrize("with_lr_schedule", [False, True])
def test_lr_rescaling_follows_the_rule(rule, with_lr_schedule):
    from globalbatch.schedule import LRSchedule
    from globalbatch.step import StepConfig, StepDriver

    x, y = ac.make_data(0)
    model = ac.make_model(0)
    base_lr = 0.02
    opt = torch.optim.SGD(model.parameters(), lr=base_lr)
    f = FeasibleBatches(micro_batch=4, min_batch=8, max_batch=64, powers_of_two=True)
    sched = AdaptiveBatchSchedule(_Forced(32, 4), f, 8, monitor=_FixedEstimate(40.0), lr_rule=rule,
                                  decide_every=2, min_interval_steps=0, patience=1)
    lrs = LRSchedule(peak_lr=base_lr, total=10**6, shape="constant") if with_lr_schedule else None
    driver = StepDriver(model, opt, StepConfig(micro_batch=4, batch_schedule=sched, lr_schedule=lrs, unit="sample"))
    seen = []
    for _ in range(8):
        gb = driver.global_batch
        r = ac.run_steps(driver, x, y, 1)
        seen.append((r[0], driver.optimizer_steps, float(opt.param_groups[0]["lr"])))
    want = {"sqrt": 2.0, "linear": 4.0, "none": 1.0, "adascale": 4 * (40 + 8) / (40 + 32)}[rule]
    assert [c.new_batch for c in sched.history] == [32] and sched.history[0].step == 4
    assert sched.history[0].lr_mult == pytest.approx(want, rel=1e-12)
    # the windows after the change run at 32 with LR base × multiplier
    assert [b for b, _, _ in seen] == [8] * 4 + [32] * 4
    assert seen[-1][2] == pytest.approx(base_lr * want, rel=1e-12)
    assert seen[2][2] == pytest.approx(base_lr, rel=1e-12)
    assert driver.batch_lr_mult == pytest.approx(want, rel=1e-12)
    del gb


def test_hysteresis_min_interval_and_non_decreasing():
    from globalbatch.step import StepConfig, StepDriver

    class Up:
        name = "up"

        def propose(self, obs, feasible):
            nxt = feasible.next_above(obs.global_batch)
            return Proposal(batch=nxt or obs.global_batch, reason="up")

    class Down:
        name = "down"

        def propose(self, obs, feasible):
            return Proposal(batch=feasible.candidates()[0], reason="down")

    x, y = ac.make_data(0)
    for policy, allow_decrease, initial in ((Up(), False, 8), (Down(), False, 32), (Down(), True, 32)):
        model = ac.make_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        f = FeasibleBatches(micro_batch=4, min_batch=8, max_batch=64, powers_of_two=True)
        sched = AdaptiveBatchSchedule(policy, f, initial, decide_every=2, min_interval_steps=6,
                                      patience=2, allow_decrease=allow_decrease)
        driver = StepDriver(model, opt, StepConfig(micro_batch=4, batch_schedule=sched, unit="sample"))
        ac.run_steps(driver, x, y, 20)
        steps = [c.step for c in sched.history]
        if isinstance(policy, Up):
            # patience 2 at decide_every 2 is met at step 4, but min_interval_steps 6 counts from step 0 too;
            # after a change the streak restarts: 8, 10 agree, 12 is 6 steps on; capped at 64
            assert steps == [6, 12, 18] and [c.new_batch for c in sched.history] == [16, 32, 64]
        elif not allow_decrease:
            assert sched.history == [] and driver.global_batch == 32
        else:
            assert steps == [6] and driver.global_batch == 8


def test_bad_settings_name_the_field():
    f = FeasibleBatches(micro_batch=4, min_batch=8, max_batch=64)
    with pytest.raises(SettingError, match="initial_batch 10 is not allowed"):
        AdaptiveBatchSchedule(NoiseTrackingPolicy(), f, 10)
    with pytest.raises(SettingError, match="lr_rule 'cube' is not allowed"):
        AdaptiveBatchSchedule(NoiseTrackingPolicy(), f, 8, lr_rule="cube")
    with pytest.raises(SettingError, match="c -1 is not allowed"):
        NoiseTrackingPolicy(c=-1)


# --------------------------------------------------------------------------- resume

def _fresh(c=3.0):
    model = ac.make_model(0)
    driver, sched, mon = ac.build(model, c=c)
    return model, driver, sched, mon


def test_resume_is_bitwise_across_a_change(tmp_path):
    """Real noise monitor + noise-tracking policy: checkpoints before and after a change resume bit for bit."""
    x, y = ac.make_data(1)
    total = 40
    model, driver, sched, mon = _fresh()
    batches = ac.run_steps(driver, x, y, total)
    ref = ac.params_vector(model).clone()
    changes = [c.step for c in sched.history]
    assert len(changes) >= 2, f"the reference run must change the batch at least twice, got {sched.history}"
    first = changes[0]
    for cut in (first - 1, first + 1):  # just before the first change is decided, and just after it
        m1, d1, s1, mon1 = _fresh()
        ac.run_steps(d1, x, y, cut)
        path = tmp_path / f"ck{cut}.pt"
        save_checkpoint(path, d1)  # the monitor's state too: a stateful callback of the driver
        m2, d2, s2, mon2 = _fresh()
        load_checkpoint(path, d2)
        assert d2.global_batch == batches[cut] and d2.optimizer_steps == cut
        assert d2.batch_lr_mult == d1.batch_lr_mult
        rest = ac.run_steps(d2, x, y, total - cut)
        assert rest == batches[cut:]
        assert torch.equal(ac.params_vector(m2), ref)  # bitwise
        assert s2.history == sched.history
        assert float(d2.optimizer.param_groups[0]["lr"]) == float(driver.optimizer.param_groups[0]["lr"])
    # the run definition a checkpoint records is the settings, not the decisions: it does not move with a change
    assert "changes" not in repr(sched) and "c=3.0" in repr(sched) and "patience=2" in repr(sched)


def test_noise_tracking_grows_with_the_measured_noise_scale():
    """On the synthetic task B_simple (samples) rises as the fit converges; the batch follows, non-decreasing."""
    x, y = ac.make_data(2)
    c = 3.0
    model, driver, sched, mon = _fresh(c=c)
    batches = ac.run_steps(driver, x, y, 60)
    assert batches == sorted(batches) and batches[-1] > batches[0]
    for ch in sched.history:  # every change had the lower bound clearing the new batch
        dec = next(d for d in sched.decisions if d["step"] == ch.step)
        assert c * dec["b_simple_low"] >= ch.new_batch > ch.old_batch

