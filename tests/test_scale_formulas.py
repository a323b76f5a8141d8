"""globalbatch.scale against closed forms: eq. 2.11, the ramp integral (McCandlish et al. 2018 App. D), the α–β
collectives (NCCL's ring and tree model), the pipeline bubble, the memory bound, and the search against brute force.
Tolerances: float64 closed forms to 1e-9 relative; numerical quadrature to 1e-4."""

from __future__ import annotations

import math

import numpy as np
import pytest

from globalbatch._util import SettingError
from globalbatch.scale import (
    PRESETS,
    BCritLaw,
    Cluster,
    ConvergenceModel,
    ModelSpec,
    ScaleConfig,
    SMinLaw,
    ThroughputCurve,
    allreduce_time,
    default_mfu_curve,
    dp_comm_time,
    format_count,
    gpu_counts,
    kaplan_prior,
    ring_collective_time,
    scale,
    schedule_string,
    step_time,
    tree_allreduce_time,
)
from globalbatch.scale.convergence import fit_s_min, from_points, s_min_at_targets


def _conv(k: float = -4.0, floor: float = 1.0) -> ConvergenceModel:
    return ConvergenceModel(b_crit_law=BCritLaw(b_ref_tokens=500.0, loss_ref=2.7, k=k),
                            s_min_law=SMinLaw(s_c=150.0, exponent=2.5, loss_floor=floor), loss_range=(2.6, 2.9))


# ---------------------------------------------------------------------------
# Convergence
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("b", [50.0, 500.0, 5000.0])
def test_constant_batch_path_integral_is_eq_2_11(b):
    m = _conv()
    L = 2.55
    c = m.schedule_cost([(0, b)], L)
    assert c.steps == pytest.approx(m.s_min(L) * (1 + m.b_crit(L) / b), rel=1e-12)
    assert c.tokens == pytest.approx(m.e_min(L) * (1 + b / m.b_crit(L)), rel=1e-12)


def test_two_stage_ramp_with_constant_noise_scale_matches_closed_form():
    m = _conv(k=0.0)  # B_crit = B_noise = 500 everywhere
    bc, L = 500.0, 2.5
    b1, b2, T = 100.0, 1000.0, 4_000.0
    u_t = m.s_min(L)
    u1 = T / (b1 + bc)  # stage 1 ends when (B1 + Bc)·u = T
    steps = u1 * (1 + bc / b1) + (u_t - u1) * (1 + bc / b2)
    tokens = T + (u_t - u1) * (b2 + bc)
    c = m.schedule_cost([(0, b1), (int(T), b2)], L)
    assert c.steps == pytest.approx(steps, rel=1e-9)
    assert c.tokens == pytest.approx(tokens, rel=1e-9)
    assert c.stage_tokens[0] == pytest.approx(T, rel=1e-9)


def test_ramp_integral_matches_quadrature_when_b_crit_moves():
    m = _conv(k=-6.0)
    L = 2.55
    stages = [(0, 120.0), (3_000, 480.0), (20_000, 960.0)]
    c = m.schedule_cost(stages, L)
    # Euler–trapezoid along u with the local noise scale; the batch switches on consumed tokens.
    u = np.linspace(1e-9, m.s_min(L), 400_001)
    bn = np.array([m.b_noise(x) for x in u[::100]])
    bn = np.interp(u, u[::100], bn)
    du = np.diff(u)
    bmid = 0.5 * (bn[1:] + bn[:-1])
    steps = tokens = 0.0
    for d, n in zip(du, bmid):
        b = [bb for t, bb in stages if tokens >= t][-1]
        steps += d * (1 + n / b)
        tokens += d * (b + n)
    assert c.steps == pytest.approx(steps, rel=2e-4)
    assert c.tokens == pytest.approx(tokens, rel=2e-4)


def test_local_noise_scale_is_the_derivative_of_e_min():
    m = _conv(k=-5.0)
    for u in (1.0, 10.0, 40.0):
        h = u * 1e-6
        fd = (m.e_min_path(u + h) - m.e_min_path(u - h)) / (2 * h)
        assert m.b_noise(u) == pytest.approx(fd, rel=1e-6)
        assert m.b_noise(u) > m.b_crit(m.s_min_law.loss_at(u))  # B_crit rising as the loss falls: local > average


def test_ramp_stages_grow_and_beat_the_constant_batch_of_equal_tokens():
    m = _conv(k=-8.0)
    L = 2.55
    feasible = [62.0 * 2 ** i for i in range(8)]
    stages = m.ramp_stages(feasible[5], feasible, L, max_stages=3)
    assert 2 <= len(stages) <= 3 and stages[0][0] == 0
    assert all(a[0] < b[0] and a[1] < b[1] for a, b in zip(stages, stages[1:]))
    ramp = m.schedule_cost(stages, L)
    # the constant batch with the same tokens to target needs more steps (McCandlish App. D: a ramp helps)
    from scipy.optimize import brentq

    b_same = brentq(lambda b: m.tokens(b, L) - ramp.tokens, 1.0, 1e7)
    assert ramp.steps < m.steps(b_same, L)


def test_unreachable_target_and_extrapolation():
    m = _conv(floor=2.0)
    with pytest.raises(SettingError) as e:
        m.check_target(1.9)
    assert e.value.field == "target_loss"
    with pytest.raises(SettingError):
        m.check_target(-1.0)
    assert m.extrapolated(2.5) and not m.extrapolated(2.7)


def test_fit_recovers_s_min_law_and_interval_widens_outside():
    true = SMinLaw(s_c=150.0, exponent=2.5, loss_floor=1.0)
    law = BCritLaw(b_ref_tokens=500.0, loss_ref=2.7, k=-5.0, cov=((0.01, 0.0), (0.0, 1.0)), dof=40)
    rng = np.random.default_rng(0)
    targets = [2.6, 2.65, 2.7, 2.8, 2.9]
    pts = []
    for t in targets:
        for seed in range(3):
            for b in (100.0, 300.0, 900.0, 2700.0):
                s = true.s_min(t) * (1 + law.b_crit(t) / b) * math.exp(rng.normal(0, 0.01))
                pts.append((t, seed, b, s))
    sm = s_min_at_targets(pts, law)
    for t in targets:
        assert sm[t] == pytest.approx(true.s_min(t), rel=0.02)
    m = from_points(pts, law)
    assert m.s_min(2.75) == pytest.approx(true.s_min(2.75), rel=0.02)
    inside = m.steps_interval(500.0, 2.7)
    outside = m.steps_interval(500.0, 2.2)
    assert inside[0] < m.steps(500.0, 2.7) < inside[1]
    assert outside[1] / outside[0] > inside[1] / inside[0]
    with pytest.raises(ValueError):
        fit_s_min([2.6], [10.0])


def test_kaplan_prior_is_the_published_law():
    m = kaplan_prior(params=1e9)
    assert m.b_crit(3.0) == pytest.approx(2e8 / 3.0 ** (1 / 0.21), rel=1e-12)
    assert m.s_min_law.loss_floor == pytest.approx((6.5e13 / 1e9) ** 0.077, rel=1e-12)
    L = m.s_min_law.loss_floor + 0.5
    assert m.s_min(L) == pytest.approx(2.1e3 / 0.5 ** (1 / 0.76), rel=1e-12)
    assert m.kind == "prior" and m.extrapolated(3.0)


# ---------------------------------------------------------------------------
# Collectives and the step
# ---------------------------------------------------------------------------

C = PRESETS["h100-ib"]


def test_ring_allreduce_alpha_beta_closed_form():
    S = 1e9
    n, N = 64, 8
    lat = C.base_latency_s + (2 * (n - 1) - 2 * (N - 1)) * C.intra_hop_latency_s + 2 * (N - 1) * C.inter_hop_latency_s
    bw = min(C.intra_busbw_bytes_per_s, C.inter_busbw_bytes_per_s)
    assert ring_collective_time(S, n, N, C) == pytest.approx(lat + 2 * (n - 1) / n * S / bw, rel=1e-12)
    one = ring_collective_time(S, 8, 1, C)
    assert one == pytest.approx(C.base_latency_s + 14 * C.intra_hop_latency_s + 2 * 7 / 8 * S / C.intra_busbw_bytes_per_s)
    rs = ring_collective_time(S, n, N, C, kind="reducescatter")
    assert rs == pytest.approx(C.base_latency_s + ((n - 1) - (N - 1)) * C.intra_hop_latency_s
                               + (N - 1) * C.inter_hop_latency_s + (n - 1) / n * S / bw, rel=1e-12)
    assert ring_collective_time(S, 1, 1, C) == 0.0


def test_tree_wins_small_messages_at_many_nodes_ring_wins_large():
    n, N = 8192, 1024
    tree = tree_allreduce_time(1e4, n, N, C)
    assert tree == pytest.approx(2 * (7 * C.tree_intra_latency_s + 10 * C.tree_inter_latency_s)
                                 + 2 * 1e4 / (0.9 * min(C.intra_busbw_bytes_per_s, C.inter_busbw_bytes_per_s)))
    assert allreduce_time(1e4, n, N, C)[1] == "tree"
    assert allreduce_time(1e10, 16, 2, C)[1] == "ring"


def test_pipeline_bubble_share_is_p_minus_1_over_m_plus_p_minus_1():
    from globalbatch.plan import pipeline_bubble

    model = ModelSpec(params=1e9, seq_len=2048)
    curve = default_mfu_curve()
    for p, m in ((4, 8), (16, 32), (2, 1)):
        st = step_time(model, C, curve, micro_batch=1, grad_accum_steps=m, dp=1, tp=1, pp=p)
        assert st.bubble_s / st.compute_s == pytest.approx((p - 1) / m, rel=1e-12)
        # the bubble's share of the pipelined part (the per-step overhead is outside the pipeline)
        assert st.bubble_s / (st.total_s - st.overhead_s) == pytest.approx(pipeline_bubble(p, m).idle_share, rel=1e-12)
    st = step_time(ModelSpec(params=1e9, seq_len=2048, virtual_stages=4), C, curve, micro_batch=1, grad_accum_steps=8,
                   dp=1, pp=4)
    assert st.bubble_s / st.compute_s == pytest.approx(3 / 32)


def test_compute_time_and_exposed_comm():
    model = ModelSpec(params=1e9, seq_len=1000)
    flat = ThroughputCurve(tokens=(1.0,), mfu=(0.5,), source="flat")
    st = step_time(model, C, flat, micro_batch=4, grad_accum_steps=2, dp=16, overlap=0.0)
    assert st.compute_s == pytest.approx(6e9 * 4 * 2 * 16 * 1000 / (16 * C.peak_flops_per_s * 0.5), rel=1e-12)
    comm, _ = dp_comm_time(model, C, dp=16, tp=1, pp=1)
    assert st.comm_exposed_s == pytest.approx(comm)  # no overlap: all of it
    hidden = step_time(model, C, flat, micro_batch=4, grad_accum_steps=2, dp=16, overlap=1.0)
    window = st.compute_s / 2 * 2 / 3
    assert hidden.comm_exposed_s == pytest.approx(max(comm - window, comm * 25 * 2 ** 20 / 2e9))
    tp2 = step_time(model, C, flat, micro_batch=4, grad_accum_steps=2, dp=8, tp=2, overlap=1.0)
    comm2, how2 = dp_comm_time(model, C, dp=8, tp=2, pp=1)  # each TP rank reduces its half of the gradients
    buckets = math.ceil(1e9 / (25 * 2 ** 20))  # DDP: one all-reduce per 25 MB bucket, each with its latency
    assert comm2 == pytest.approx(buckets * allreduce_time(1e9 / buckets, 8, 2, C)[0]) and f"{buckets} buckets" in how2
    assert comm2 > allreduce_time(1e9, 8, 2, C)[0]
    assert tp2.comm_exposed_s == pytest.approx(max(comm2 - tp2.compute_s / 2 * 2 / 3, comm2 * 25 * 2 ** 20 / 1e9))
    z3 = ModelSpec(params=1e9, seq_len=1000, sharding="zero3")
    t3, how = dp_comm_time(z3, C, dp=16, tp=1, pp=1)
    rs = ring_collective_time(2e9, 16, 2, C, kind="reducescatter")
    assert t3 == pytest.approx(3 * rs) and "2 all-gather" in how


def test_step_overhead_measured_default_and_dp_latency():
    from globalbatch.scale.cluster import DRIVER_STEP_COLLECTIVES, OPTIMIZER_BYTES_PER_PARAM, step_overhead_time

    flat = ThroughputCurve(tokens=(1.0,), mfu=(0.5,), source="flat")
    model = ModelSpec(params=1e9, seq_len=1000)
    # the labelled default: 32 bytes per updated parameter over the memory bandwidth
    one = step_time(model, C, flat, micro_batch=4, grad_accum_steps=2, dp=1)
    assert one.overhead_s == pytest.approx(OPTIMIZER_BYTES_PER_PARAM * 1e9 / 3.35e12, rel=1e-12)
    assert one.total_s == pytest.approx(one.compute_s + one.overhead_s, rel=1e-12)
    # DP > 1: each DDP rank updates all parameters, plus StepDriver's small all-reduces (their latency)
    dp16 = step_time(model, C, flat, micro_batch=4, grad_accum_steps=2, dp=16)
    small = allreduce_time(40.0, 16, 2, C)[0]
    assert dp16.overhead_s == pytest.approx(one.overhead_s + DRIVER_STEP_COLLECTIVES * small, rel=1e-12)
    # ZeRO: a rank updates its shard; TP × PP divide it too
    z1 = ModelSpec(params=1e9, seq_len=1000, sharding="zero1")
    assert step_overhead_time(z1, C, flat, dp=16, tp=2, pp=2) == pytest.approx(
        OPTIMIZER_BYTES_PER_PARAM * 1e9 / 64 / 3.35e12 + DRIVER_STEP_COLLECTIVES * allreduce_time(40.0, 16, 4, C)[0])
    # measured: scaled from the parameter count it was measured at; it replaces the default
    measured = ThroughputCurve(tokens=(1.0,), mfu=(0.5,), source="m", step_overhead_s=2e-3, overhead_params=1e5)
    assert step_overhead_time(model, C, measured, dp=1, tp=1, pp=1) == pytest.approx(2e-3 * 1e9 / 1e5, rel=1e-12)
    # no bandwidth stated, nothing measured: no overhead
    bare = Cluster(name="b", gpus_per_node=8, peak_flops_per_s=1e15, memory_bytes=8e10, intra_busbw_bytes_per_s=1e11,
                   inter_busbw_bytes_per_s=1e10)
    assert step_overhead_time(model, bare, flat, dp=1, tp=1, pp=1) == 0.0
    with pytest.raises(SettingError):
        ThroughputCurve(tokens=(1.0,), mfu=(0.5,), source="x", step_overhead_s=1e-3)


def test_dp_bookkeeping_is_once_per_step_plus_per_micro_batch_with_dp():
    from dataclasses import replace

    from globalbatch.scale import dp_bookkeeping_time

    flat = ThroughputCurve(tokens=(1.0,), mfu=(0.5,), source="flat")
    model = ModelSpec(params=1e9, seq_len=1000)
    c = replace(C, dp_step_overhead_s=2e-3, dp_micro_overhead_s=3e-4)
    for accum in (1, 4):
        base = step_time(model, C, flat, micro_batch=4, grad_accum_steps=accum, dp=16)
        st = step_time(model, c, flat, micro_batch=4, grad_accum_steps=accum, dp=16)
        assert st.overhead_s == pytest.approx(base.overhead_s + 2e-3 + accum * 3e-4, rel=1e-12)
        assert st.total_s == pytest.approx(base.total_s + 2e-3 + accum * 3e-4, rel=1e-12)
        assert (st.compute_s, st.comm_exposed_s) == (base.compute_s, base.comm_exposed_s)
        # one replica has no data-parallel bookkeeping
        assert step_time(model, c, flat, micro_batch=4, grad_accum_steps=accum, dp=1).overhead_s == \
            step_time(model, C, flat, micro_batch=4, grad_accum_steps=accum, dp=1).overhead_s
    assert dp_bookkeeping_time(c, dp=2, grad_accum_steps=np.array([1.0, 8.0])) == pytest.approx([2.3e-3, 4.4e-3])
    assert dp_bookkeeping_time(c, dp=1, grad_accum_steps=8) == 0.0
    # per parameter tensor of a rank's model (DDP's per-parameter hook), per pipeline stage
    from globalbatch.scale.cluster import rank_param_tensors

    ct = replace(c, dp_tensor_overhead_s=2e-5)
    assert dp_bookkeeping_time(ct, dp=2, grad_accum_steps=1, param_tensors=30) == pytest.approx(2.3e-3 + 30 * 2e-5)
    assert dp_bookkeeping_time(ct, dp=1, param_tensors=30) == 0.0
    spec = ModelSpec(params=1e6, seq_len=8, param_tensors=30)
    st = step_time(spec, ct, flat, micro_batch=4, grad_accum_steps=1, dp=16)
    assert st.overhead_s == pytest.approx(step_time(ModelSpec(params=1e6, seq_len=8), ct, flat, micro_batch=4,
                                                    grad_accum_steps=1, dp=16).overhead_s + 30 * 2e-5, rel=1e-12)
    assert rank_param_tensors(spec, 4) == 8 and rank_param_tensors(ModelSpec(params=1e6, seq_len=8), 4) == 0
    with pytest.raises(SettingError, match="param_tensors"):
        ModelSpec(params=1e6, seq_len=8, param_tensors=0)
    assert all(p.dp_step_overhead_s == p.dp_micro_overhead_s == p.dp_call_overhead_s == 0.0 for p in PRESETS.values())


def test_dp_call_overhead_is_charged_to_every_collective_of_a_dp_step():
    from dataclasses import replace

    from globalbatch.scale.cluster import DRIVER_STEP_COLLECTIVES, step_overhead_time

    x = 4e-4
    c = replace(C, dp_call_overhead_s=x)
    flat = ThroughputCurve(tokens=(1.0,), mfu=(0.5,), source="flat")
    ddp = ModelSpec(params=1e9, seq_len=1000)  # 2 GB of bf16 gradients: 77 buckets of 25 MB
    buckets = math.ceil(2e9 / (25 * 2 ** 20))
    assert dp_comm_time(ddp, c, dp=16, tp=1, pp=1)[0] == pytest.approx(
        dp_comm_time(ddp, C, dp=16, tp=1, pp=1)[0] + buckets * x, rel=1e-12)
    for sharding, calls in (("zero1", 2), ("zero3", 3)):  # reduce-scatter + 1 or 2 all-gathers
        z = ModelSpec(params=1e9, seq_len=1000, sharding=sharding)
        assert dp_comm_time(z, c, dp=16, tp=1, pp=1)[0] == pytest.approx(
            dp_comm_time(z, C, dp=16, tp=1, pp=1)[0] + calls * x, rel=1e-12)
    assert step_overhead_time(ddp, c, flat, dp=16, tp=1, pp=1) == pytest.approx(
        step_overhead_time(ddp, C, flat, dp=16, tp=1, pp=1) + DRIVER_STEP_COLLECTIVES * x, rel=1e-12)
    # one replica issues no collective
    assert dp_comm_time(ddp, c, dp=1, tp=1, pp=1)[0] == 0.0
    assert step_overhead_time(ddp, c, flat, dp=1, tp=1, pp=1) == step_overhead_time(ddp, C, flat, dp=1, tp=1, pp=1)


def test_probe_file_curve_is_forward_and_backward_alone(tmp_path):
    import json

    from globalbatch.scale import mfu_curve_from_probe

    trials = [{"micro_batch": 2, "tokens_per_step": 128, "step_time_s": 4e-3, "mfu": 0.2},
              {"micro_batch": 4, "tokens_per_step": 256, "step_time_s": 6e-3, "mfu": 0.3}]
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"trials": trials, "peak_flops_per_s": 1e11}))
    plain = mfu_curve_from_probe(str(path))
    assert plain.mfu == (0.2, 0.3) and plain.step_overhead_s is None
    path.write_text(json.dumps({"trials": trials, "peak_flops_per_s": 1e11, "optimizer_step_s": 1e-3,
                                "step_overhead_s": 1.5e-3, "overhead_params": 137024}))
    c = mfu_curve_from_probe(str(path))  # forward + backward alone: t − optimizer step
    assert c.mfu == pytest.approx((0.2 * 4 / 3, 0.3 * 6 / 5), rel=1e-12)
    assert (c.step_overhead_s, c.overhead_params) == (1.5e-3, 137024)
    path.write_text(json.dumps({"trials": trials, "optimizer_step_s": 5e-3}))
    with pytest.raises(SettingError):
        mfu_curve_from_probe(str(path))
    # the probe's own in-place split wins over a separately measured optimizer step
    split = [dict(t, forward_backward_s=f) for t, f in zip(trials, (2.5e-3, 5e-3))]
    path.write_text(json.dumps({"trials": split, "peak_flops_per_s": 1e11, "optimizer_step_s": 1e-3}))
    assert mfu_curve_from_probe(str(path)).mfu == pytest.approx((0.2 * 4 / 2.5, 0.3 * 6 / 5), rel=1e-12)
    for bad in (0.0, 7e-3, "x"):
        path.write_text(json.dumps({"trials": [dict(trials[1], forward_backward_s=bad)]}))
        with pytest.raises(SettingError, match="forward_backward_s"):
            mfu_curve_from_probe(str(path))
    # the probe's model size with the split: the per-step overhead is its optimizer step timed in place
    path.write_text(json.dumps({"trials": split, "peak_flops_per_s": 1e11, "params": 5000}))
    c = mfu_curve_from_probe(str(path))
    assert (c.step_overhead_s, c.overhead_params) == (pytest.approx(np.median([4e-3 - 2.5e-3, 6e-3 - 5e-3])), 5000)
    assert "timed in place" in c.source
    path.write_text(json.dumps({"trials": split, "params": 5000, "step_overhead_s": 7e-3, "overhead_params": 9}))
    assert (mfu_curve_from_probe(str(path)).step_overhead_s, mfu_curve_from_probe(str(path)).overhead_params) == (7e-3, 9)
    path.write_text(json.dumps({"trials": trials, "params": 5000}))  # no split: no overhead from the probe
    assert mfu_curve_from_probe(str(path)).step_overhead_s is None
    for bad in (0, -3, "many", True):
        path.write_text(json.dumps({"trials": split, "params": bad}))
        with pytest.raises(SettingError, match="params"):
            mfu_curve_from_probe(str(path))


def test_memory_bounds_the_micro_batch_and_a_huge_model_fits_nowhere():
    from globalbatch.scale import largest_micro
    from globalbatch.scale.cluster import Activations, MemoryConfig, largest_micro_batch

    model = ModelSpec(params=7e9, seq_len=4096, activation_bytes_per_token=2e5, sharding="zero1")
    got = largest_micro(model, C, dp=8, tp=2, pp=1)
    want = largest_micro_batch(MemoryConfig(params=int(3.5e9), precision="bf16-mixed", sharding="zero1", dp_world_size=8),
                               Activations(bytes_per_sample=2e5 * 4096 / 2), C.memory_bytes)
    assert got == want > 0
    huge = ModelSpec(params=1e13, seq_len=2048)
    with pytest.raises(SettingError) as e:
        scale(kaplan_prior(params=1e13), huge, C, default_mfu_curve(), ScaleConfig(target_loss=2.0, max_gpus=64))
    assert e.value.field == "params"


@pytest.mark.parametrize("dp_overheads", [(0.0, 0.0), (0.05, 0.002)])
def test_search_best_equals_brute_force_over_geometries(dp_overheads):
    conv = _conv(k=-6.0)
    model = ModelSpec(params=2e8, seq_len=1024, tokens_per_sequence=1000.0)
    cluster = Cluster(name="t", gpus_per_node=4, peak_flops_per_s=1e14, memory_bytes=80e9,
                      intra_busbw_bytes_per_s=1e11, inter_busbw_bytes_per_s=1e10,
                      dp_step_overhead_s=dp_overheads[0], dp_micro_overhead_s=dp_overheads[1])
    # with the DP bookkeeping, an MFU that falls with the micro-batch: the best geometries accumulate
    curve = default_mfu_curve() if not dp_overheads[1] else ThroughputCurve(tokens=(1024.0, 262144.0), mfu=(0.5, 0.1),
                                                                             source="falling")
    cfg = ScaleConfig(target_loss=2.6, max_gpus=16, tp_options=(1, 2), pp_options=(1, 2), max_global_batch=256)
    assert ScaleConfig(target_loss=2.6).tp_options == (1,)
    res = scale(conv, model, cluster, curve, cfg)
    for row in res.rows:
        g = row.gpus
        best = math.inf
        for tp in (1, 2):
            for pp in (1, 2):
                if g % (tp * pp) or tp > 4:
                    continue
                dp = g // (tp * pp)
                for r in (2 ** j for j in range(9)):
                    if r * dp > 256:
                        continue
                    for m in (2 ** i for i in range(9)):
                        if m > r:
                            continue
                        st = step_time(model, cluster, curve, micro_batch=m, grad_accum_steps=r // m, dp=dp, tp=tp,
                                       pp=pp)
                        best = min(best, conv.steps(st.global_batch * 1000.0, 2.6) * st.total_s)
        assert row.time_s == pytest.approx(best, rel=1e-9)
    assert res.best is min(res.rows, key=lambda r: r.time_s)
    if dp_overheads[1]:
        assert any(r.step.grad_accum_steps > 1 and r.step.dp > 1 for r in res.rows)
    assert any(r.pareto for r in res.rows)


def test_gpu_counts_and_schedule_strings():
    counts = gpu_counts(10_000, 8)
    assert counts[:4] == [1, 2, 4, 8] and counts[-1] == 10_000 and all(c % 8 == 0 for c in counts[3:])
    assert gpu_counts(3, 8) == [1, 2, 3]
    from globalbatch.schedule import parse_step_schedule

    for n in (0, 7, 1200, 150_000, 1_200_000, 12_345_678, 3_000_000_000):
        assert int(parse_step_schedule(f"0:1 {format_count(n) if n else 1}:2").steps[1][0]) == max(n, 1)
    text = schedule_string([(0, 8), (150_000, 16), (2_600_000, 32)])
    assert text == "0:8 150K:16 2.6M:32"
    assert parse_step_schedule(text).steps == ((0, 8), (150_000, 16), (2_600_000, 32))


def test_moving_a_fit_to_another_model_size_keeps_b_crit_and_moves_the_floor():
    m = _conv(k=-4.0, floor=1.0)
    big = m.for_params(8e6, 1e6)
    assert big.b_crit(2.7) == m.b_crit(2.7)
    assert big.s_min_law.loss_floor == pytest.approx(1.0 * (1e6 / 8e6) ** 0.077, rel=1e-12)
    assert big.s_min(2.7) < m.s_min(2.7)  # a larger model reaches the same loss in fewer steps
    assert big.loss_range is None and big.extrapolated(2.7)
    assert m.for_params(1e6, 1e6) is m


def test_deepseek_reference_and_presets():
    from globalbatch.scale import deepseek_batch_prior, load_cluster

    d = deepseek_batch_prior(1e21)
    assert d["b_opt_tokens"] == pytest.approx(0.2920 * 1e21 ** 0.3271, rel=1e-12)
    assert d["lr_opt"] == pytest.approx(0.3118 * 1e21 ** -0.1250, rel=1e-12)
    for name, peak in (("h100-ib", 989e12), ("a100-ib", 312e12), ("h200-ib", 989e12)):
        c = load_cluster(name)
        assert c.peak_flops_per_s == peak and c.gpus_per_node == 8 and c.source
    assert load_cluster("h200-ib").memory_bytes == 141e9
    with pytest.raises(SettingError) as e:
        load_cluster("h900")
    assert e.value.field == "cluster"


def test_yaml_cluster_keys_are_checked_one_by_one(tmp_path):
    from globalbatch.scale import load_cluster

    base = ("gpus_per_node: 4\npeak_flops_per_s: 3.12e14\nmemory_bytes: 40e9\nintra_busbw_bytes_per_s: 2e11\n"
            "inter_busbw_bytes_per_s: 2.5e10\n")
    p = tmp_path / "c.yaml"
    p.write_text(base + "gpu_hour_price: 2.5\ndp_step_overhead_s: 1.5e-3\ndp_micro_overhead_s: 0.0002\n")
    c = load_cluster(str(p))
    assert c.name == "c" and c.peak_flops_per_s == 3.12e14 and c.gpu_hour_price == 2.5  # "3.12e14": YAML 1.1 string
    assert (c.dp_step_overhead_s, c.dp_micro_overhead_s) == (1.5e-3, 2e-4)
    for extra, key in (("gpus_per_node: 0\n", "gpus_per_node"), ("memory_bytes: -1\n", "memory_bytes"),
                       ("base_latency_s: -1e-6\n", "base_latency_s"), ("bogus: 1\n", "bogus"),
                       ("dp_step_overhead_s: -1e-3\n", "dp_step_overhead_s"),
                       ("dp_micro_overhead_s: .inf\n", "dp_micro_overhead_s"),
                       ("dp_call_overhead_s: -0.1\n", "dp_call_overhead_s"),
                       ("peak_flops_per_s: fast\n", "peak_flops_per_s"), ("gpu_hour_price: .nan\n", "gpu_hour_price")):
        lines = [ln for ln in base.splitlines() if not ln.startswith(extra.split(":")[0] + ":")]
        p.write_text("\n".join(lines) + "\n" + extra)
        with pytest.raises(SettingError) as e:
            load_cluster(str(p))
        assert e.value.field == key, (extra, e.value)


def test_deadline_and_budget_filter_the_answer():
    conv = kaplan_prior(params=1e9)
    model = ModelSpec(params=1e9, seq_len=2048)
    curve = default_mfu_curve()
    free = scale(conv, model, C, curve, ScaleConfig(target_loss=2.6, max_gpus=64))
    fastest = min(free.rows, key=lambda r: r.time_s)
    cheapest = min(free.rows, key=lambda r: r.gpu_hours)
    assert free.best is fastest
    assert scale(conv, model, C, curve, ScaleConfig(target_loss=2.6, max_gpus=64, objective="cost")).best.gpus == cheapest.gpus
    budget = sorted(r.gpu_hours for r in free.rows)[len(free.rows) // 2]
    capped = scale(conv, model, C, curve, ScaleConfig(target_loss=2.6, max_gpus=64, budget_gpu_hours=budget))
    assert capped.best.gpu_hours <= budget and capped.best is min((r for r in capped.rows if r.meets_limits),
                                                                   key=lambda r: r.time_s)
    none = scale(conv, model, C, curve, ScaleConfig(target_loss=2.6, max_gpus=64, deadline_s=1.0))
    assert none.best is None and none.best_ramp is None and any("deadline" in n for n in none.notes)
    assert all(not r.meets_limits for r in none.rows)
    priced = scale(conv, model, Cluster(**{**{f: getattr(C, f) for f in C.__slots__}, "gpu_hour_price": 2.0}), curve,
                   ScaleConfig(target_loss=2.6, max_gpus=8)).to_dict()
    assert priced["best"]["cost"] == pytest.approx(2.0 * priced["best"]["gpu_hours"])


def test_a_law_whose_b_crit_does_not_rise_as_the_loss_falls_is_refused():
    """The model integrates a noise scale that grows as the loss falls: a sweep's joint fit with k ≥ 0 (B_crit flat or
    falling along the path) is refused, naming k and its SE, instead of planning from it."""
    from globalbatch.errors import SettingError
    from globalbatch.scale import BCritLaw
    from globalbatch.scale.convergence import from_points

    pts = [(t, s, b, 10.0 * (1 + 500.0 / b) * t) for t in (3.0, 2.8, 2.6) for s in (0, 1) for b in (128.0, 512.0, 2048.0)]
    for k in (0.66, 0.0):
        law = BCritLaw(b_ref_tokens=500.0, loss_ref=2.8, k=k, cov=((0.01, 0.0), (0.0, 0.0576)))
        with pytest.raises(SettingError, match=r"b_crit_law 'k = .* \(SE 0.24\)'.*does not rise as the loss falls"):
            from_points(pts, law)
    from_points(pts, BCritLaw(b_ref_tokens=500.0, loss_ref=2.8, k=-2.0))  # rises: accepted
