"""globalbatch.plan: the arithmetic, its identities (hypothesis) and every error path."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from globalbatch import plan as P
from globalbatch.errors import SettingError

ints = st.integers(min_value=1, max_value=4096)


# --- the seeds' worked examples ---------------------------------------------------------


def test_seed_example_geometry_and_tokens():
    geo = P.solve_geometry(micro_batch=2, grad_accum_steps=8, dp_world_size=64)
    assert geo.global_batch == 1024
    assert geo.tokens(2048) == 2_097_152
    assert geo.global_batch * 1500 == 1_536_000
    assert geo.arithmetic() == "1,024 seq = 64 ranks × 8 accum × 2 seq"


@pytest.mark.parametrize("tokens_per_update, steps", [("1M", 100_000), ("4M", 25_000)])
def test_seed_example_budget(tokens_per_update, steps):
    # "100B tokens at 1M tokens per update -> 100,000 steps, at 4M -> 25,000" (decimal M, B)
    assert P.optimizer_steps(P.parse_count("100B"), P.parse_count(tokens_per_update)) == steps


def test_optimizer_steps_rounds_up_a_partial_step():
    assert P.optimizer_steps(10, 3) == 4
    assert P.optimizer_steps(9, 3) == 3


# --- solve / check round trips --------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(m=ints, a=ints, d=ints)
def test_solve_each_missing_value_round_trips(m, a, d):
    g = m * a * d
    full = P.solve_geometry(global_batch=g, micro_batch=m, grad_accum_steps=a, dp_world_size=d)
    assert P.solve_geometry(micro_batch=m, grad_accum_steps=a, dp_world_size=d) == full
    assert P.solve_geometry(global_batch=g, grad_accum_steps=a, dp_world_size=d) == full
    assert P.solve_geometry(global_batch=g, micro_batch=m, dp_world_size=d) == full
    assert P.solve_geometry(global_batch=g, micro_batch=m, grad_accum_steps=a) == full
    assert full.samples_per_rank_per_step * d == g


@settings(max_examples=300, deadline=None)
@given(g=st.integers(1, 10**7), m=ints, d=ints)
def test_solve_accum_errors_exactly_when_not_divisible(g, m, d):
    if g % (m * d):
        with pytest.raises(SettingError, match=rf"global batch {g} is not divisible by micro_batch {m} × dp {d} = {m * d}"):
            P.solve_geometry(global_batch=g, micro_batch=m, dp_world_size=d)
    else:
        geo = P.solve_geometry(global_batch=g, micro_batch=m, dp_world_size=d)
        assert geo.grad_accum_steps * m * d == g


def test_error_messages_quote_the_numbers():
    with pytest.raises(SettingError, match=r"^global_batch 1000 is not allowed \(global batch 1000 is not divisible by micro_batch 4 × dp 64 = 256; "
                       r"nearest valid global batches: 768 or 1024\); allowed: a multiple of 256$"):
        P.solve_geometry(global_batch=1000, micro_batch=4, dp_world_size=64)
    with pytest.raises(SettingError, match=r"global batch 1000 != micro_batch 4 × grad_accum 4 × dp 64 = 1024"):
        P.solve_geometry(global_batch=1000, micro_batch=4, grad_accum_steps=4, dp_world_size=64)
    with pytest.raises(SettingError, match="not divisible by grad_accum 3 × dp 2 = 6"):
        P.solve_geometry(global_batch=16, grad_accum_steps=3, dp_world_size=2)
    with pytest.raises(SettingError, match="not divisible by micro_batch 3 × grad_accum 2 = 6"):
        P.solve_geometry(global_batch=16, micro_batch=3, grad_accum_steps=2)
    with pytest.raises(SettingError, match="global_batch, micro_batch are missing"):
        P.solve_geometry(grad_accum_steps=2, dp_world_size=2)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True])
def test_non_positive_or_non_integer_values_are_rejected(bad):
    with pytest.raises(SettingError, match="micro_batch"):
        P.solve_geometry(global_batch=16, micro_batch=bad, dp_world_size=1)


# --- world-size change ---------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(m=ints, a=ints, d=ints, d2=ints)
def test_rescale_dp_keeps_the_global_batch_or_errors(m, a, d, d2):
    geo = P.solve_geometry(micro_batch=m, grad_accum_steps=a, dp_world_size=d)
    if geo.global_batch % (m * d2) == 0:
        res = P.rescale_dp(geo, d2)
        assert res.geometry.global_batch == geo.global_batch
        assert res.geometry.micro_batch == m and res.geometry.dp_world_size == d2
        assert res.dropped_samples_per_step == 0
    else:
        with pytest.raises(SettingError, match="round_down=True"):  # the library names its parameter
            P.rescale_dp(geo, d2)
        if geo.global_batch >= m * d2:
            res = P.rescale_dp(geo, d2, round_down=True)
            assert res.geometry.global_batch + res.dropped_samples_per_step == geo.global_batch
            assert 0 < res.dropped_samples_per_step < m * d2
        else:
            with pytest.raises(SettingError, match="smaller than"):
                P.rescale_dp(geo, d2, round_down=True)


def test_rescale_dp_example():
    geo = P.solve_geometry(global_batch=1024, micro_batch=2, dp_world_size=64)
    assert P.rescale_dp(geo, 128).geometry.grad_accum_steps == 4
    res = P.rescale_dp(geo, 96, round_down=True)
    assert (res.geometry.global_batch, res.dropped_samples_per_step) == (960, 64)


# --- LR and warmup -------------------------------------------------------------------------


def test_lr_rules():
    assert P.scale_lr(1e-3, 256, 1024, "linear") == pytest.approx(4e-3, rel=1e-15)
    assert P.scale_lr(1e-3, 256, 1024, "sqrt") == pytest.approx(2e-3, rel=1e-15)
    assert P.scale_lr(1e-3, 256, 1024, "none") == 1e-3
    with pytest.raises(SettingError, match="lr_rule 'cubic' is not allowed; allowed: linear, sqrt, none"):
        P.scale_lr(1e-3, 1, 2, "cubic")
    with pytest.raises(SettingError, match="from_batch 0"):
        P.scale_lr(1e-3, 0, 2, "sqrt")


@settings(max_examples=200, deadline=None)
@given(lr=st.floats(1e-6, 1.0), b1=ints, b2=ints, rule=st.sampled_from(P.LR_RULES))
def test_lr_scaling_round_trips(lr, b1, b2, rule):
    assert P.scale_lr(P.scale_lr(lr, b1, b2, rule), b2, b1, rule) == pytest.approx(lr, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(steps=st.integers(0, 10**6), tps=st.integers(1, 10**7))
def test_warmup_steps_tokens_round_trip(steps, tps):
    tokens = P.warmup_steps_to_tokens(steps, tps)
    assert P.warmup_tokens_to_steps(tokens, tps) == steps


def test_warmup_tokens_to_steps_per_batch():
    # 375M tokens of warmup: 358 steps at 2^20 tok/step (ceil of 357.6), 90 at 2^22.
    assert P.warmup_tokens_to_steps(375e6, 2**20) == 358
    assert P.warmup_tokens_to_steps(375e6, 2**22) == 90


# --- pipeline and communication ------------------------------------------------------------


def test_pipeline_bubble_formulas():
    b = P.pipeline_bubble(4, 8)
    assert b.fraction_of_ideal == pytest.approx(3 / 8)
    assert b.idle_share == pytest.approx(3 / 11)
    assert b.warning is None
    b2 = P.pipeline_bubble(4, 8, virtual_stages=2)
    assert b2.fraction_of_ideal == pytest.approx(3 / 16)
    assert P.pipeline_bubble(8, 4).warning.startswith("4 micro-batches per step < 8 pipeline stages")


@settings(max_examples=200, deadline=None)
@given(p=st.integers(1, 64), m=st.integers(1, 512), v=st.integers(1, 8))
def test_bubble_identity(p, m, v):
    b = P.pipeline_bubble(p, m, v)
    # idle share = f / (1 + f) where f is the fraction of ideal compute
    assert b.idle_share == pytest.approx(b.fraction_of_ideal / (1 + b.fraction_of_ideal))


@settings(max_examples=200, deadline=None)
@given(p=st.integers(2, 64), v=st.integers(1, 4), target=st.floats(0.01, 2.0), micro=st.integers(1, 8), dp=st.integers(1, 64))
def test_min_global_batch_for_bubble_is_smallest(p, v, target, micro, dp):
    g = P.min_global_batch_for_bubble(target, pp_stages=p, micro_batch=micro, dp_world_size=dp, virtual_stages=v)
    m = g // (micro * dp)
    assert g == m * micro * dp
    assert P.pipeline_bubble(p, m, v).fraction_of_ideal <= target + 1e-12
    if m > 1:
        assert P.pipeline_bubble(p, m - 1, v).fraction_of_ideal > target


def test_allreduce_volume():
    # 7B params in bf16 = 14 GB; ring: 2(N-1)/N per rank.
    assert P.allreduce_bytes_per_rank(14e9, 64) == pytest.approx(2 * 63 / 64 * 14e9)
    assert P.allreduce_bytes_per_rank(1.0, 1) == 0.0
    assert P.allreduce_bytes_per_rank(10.0, 2, grad_accum_steps=8, no_sync=False) == pytest.approx(80.0)
    assert P.allreduce_bytes_per_rank(10.0, 2, grad_accum_steps=8, no_sync=True) == pytest.approx(10.0)


# --- priors --------------------------------------------------------------------------------


def test_priors_match_the_published_formulas():
    n, d = 1e9, 20e9
    priors = {p.source.split(" (")[0]: p for p in P.scaling_law_priors(params=n, tokens=d, loss_nats=2.0)}
    c = 6 * n * d
    assert priors["DeepSeek LLM"].batch_tokens == pytest.approx(0.2920 * c**0.3271)
    assert priors["DeepSeek LLM"].lr == pytest.approx(0.3118 * c**-0.125)
    assert priors["Step Law"].batch_tokens == pytest.approx(0.58 * d**0.571)
    assert priors["Step Law"].lr == pytest.approx(1.79 * n**-0.713 * d**0.307)
    assert priors["Kaplan et al."].batch_tokens == pytest.approx(2e8 / 2.0 ** (1 / 0.21))
    assert priors["Kaplan et al."].quantity == "B_crit"
    assert all(p.kind == "prior" for p in priors.values())
    # explicit compute overrides 6·N·D
    (ds,) = P.scaling_law_priors(compute_flops=1e21)
    assert ds.batch_tokens == pytest.approx(0.2920 * 1e21**0.3271)
    assert P.scaling_law_priors() == []
    with pytest.raises(SettingError, match="params -1"):
        P.scaling_law_priors(params=-1, tokens=1)


# --- parsing -------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [("2M", 2_000_000), ("100B", 10**11), ("1.5K", 1500), ("2,048", 2048), (4096, 4096),
                                         ("1e6", 10**6), ("3T", 3 * 10**12)])
def test_parse_count(text, value):
    assert P.parse_count(text) == value


@pytest.mark.parametrize("text", ["2X", "", "abc", "-5", "1.5", True, "nan"])
def test_parse_count_rejects(text):
    with pytest.raises(SettingError, match="tokens"):
        P.parse_count(text, "tokens")


@pytest.mark.parametrize("text, value", [("8GiB", 8 * 2**30), ("8GB", 8 * 10**9), ("512MiB", 512 * 2**20), ("1024", 1024), ("2G", 2 * 2**30)])
def test_parse_bytes(text, value):
    assert P.parse_bytes(text) == value


def test_plan_imports_no_torch():
    code = "import sys, globalbatch.plan, globalbatch.plan.config; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_fmt_int():
    assert P.fmt_int(2097152) == "2,097,152"
    assert P.fmt_int(1536000.0) == "1,536,000"
    assert math.isclose(float(P.fmt_int(0.5)), 0.5)
