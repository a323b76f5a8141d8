"""globalbatch.noise: the unbiased two-batch estimators against ground truth.

Truths used here: (1) synthetic per-unit gradients g = G + noise with known G and Σ;
(2) linear regression with Gaussian inputs, where G and Σ are closed-form; (3) an MLP
whose tr(Σ) and |G|² come from brute-force per-example gradients (torch.func) of the
whole dataset at fixed parameters; (4) under torchrun, an exact re-computation of every
micro-batch gradient and the per-example truth (tests/dist/noise_ddp.py).
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import pytest

from globalbatch.errors import SettingError
import torch

from globalbatch.noise import (
    NEEDS_TWO_BATCH_SIZES,
    NoiseConfig,
    NoiseScaleEstimator,
    NoiseScaleMonitor,
    fieller_interval,
    window_estimates,
)

sys.path.insert(0, str(Path(__file__).parent / "dist"))
import noise_common as nc  # noqa: E402

from conftest import run_torchrun  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is ~10× faster than two on the shared 2-core machines."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------
# The pure estimator
# ---------------------------------------------------------------------------


def test_equal_counts_reduce_to_mccandlish_formulas():
    # k = 4 small batches of b = 8; B_big = 32. Hand-made norms.
    small = torch.tensor([5.0, 7.0, 6.0, 4.0])
    big = 2.0
    s = window_estimates(small, [8, 8, 8, 8], big)
    g_small = small.mean().item()  # 5.5
    # McCandlish A.1: |G|² = (B_big|G_big|² − B_small|G_small|²)/(B_big − B_small) = (64 − 44)/24
    assert s.g_sq.item() == pytest.approx((32 * big - 8 * g_small) / (32 - 8))
    # tr(Σ) = (|G_small|² − |G_big|²)/(1/B_small − 1/B_big) = 3.5 / (1/8 − 1/32) = 37.333…
    assert s.tr_sigma.item() == pytest.approx((g_small - big) / (1 / 8 - 1 / 32))
    assert s.big_count.item() == 32


def _synthetic_window(gen, G, sd, counts):
    """Per-unit gradients G + sd·ε (non-Gaussian: centred exponential) for each small batch."""
    per = [G + sd * (torch.empty(c, len(G)).exponential_(generator=gen) - 1.0) for c in counts]
    means = torch.stack([p.mean(0) for p in per])
    big = torch.cat(per).mean(0)
    return means.square().sum(1), big.square().sum()


def test_ragged_counts_unbiased_within_5_percent_of_synthetic_truth():
    gen = torch.Generator().manual_seed(0)
    d = 24
    G = torch.randn(d, generator=gen) * 0.4
    sd = torch.rand(d, generator=gen) + 0.5
    tr_true, g_true = float(sd.square().sum()), float(G.square().sum())  # exp(1) − 1 has unit variance
    est = NoiseScaleEstimator(half_life=math.inf)
    counts = torch.tensor([3, 11, 6, 1, 9])  # very unequal, including a single unit
    for _ in range(1500):
        small_sq, big_sq = _synthetic_window(gen, G, sd, counts.tolist())
        est.update(small_sq, counts, big_sq)
    e = est.estimate()
    assert e.ok, e.flags
    assert e.tr_sigma == pytest.approx(tr_true, rel=0.05)
    assert e.g_sq == pytest.approx(g_true, rel=0.05)
    assert e.b_simple == pytest.approx(tr_true / g_true, rel=0.05)
    assert e.low < tr_true / g_true < e.high


def test_equal_size_formula_with_mean_counts_is_biased_for_ragged_counts():
    """Negative control: McCandlish's equal-size formula fed the *mean* count is off here."""
    gen = torch.Generator().manual_seed(1)
    d = 24
    G = torch.randn(d, generator=gen) * 0.4
    sd = torch.ones(d)
    counts = [1, 1, 1, 29]
    ours, naive = NoiseScaleEstimator(half_life=math.inf), []
    for _ in range(800):
        small_sq, big_sq = _synthetic_window(gen, G, sd, counts)
        ours.update(small_sq, counts, big_sq)
        b, B = sum(counts) / len(counts), sum(counts)
        naive.append(((small_sq.mean() - big_sq) / (1 / b - 1 / B)).item())
    tr_true = float(sd.square().sum())
    assert ours.estimate().tr_sigma == pytest.approx(tr_true, rel=0.05)
    assert abs(sum(naive) / len(naive) / tr_true - 1) > 0.5


def test_one_small_batch_raises_naming_the_fix():
    with pytest.raises(SettingError, match="grad_accum_steps ≥ 2 or dp_world_size ≥ 2"):
        window_estimates([1.0], [8], 1.0)
    model = torch.nn.Linear(3, 1)
    mon = NoiseScaleMonitor(model)
    model(torch.randn(4, 3)).sum().backward()
    mon.micro_backward(4)
    with pytest.raises(SettingError, match="needs at least two batch sizes: use grad_accum_steps ≥ 2 or "
                                         "dp_world_size ≥ 2"):
        mon.window_end()
    with pytest.raises(SettingError, match=NEEDS_TWO_BATCH_SIZES):
        NoiseScaleMonitor(model, config=NoiseConfig(sources=("rank",)))


def test_inputs_are_validated_with_numbers():
    with pytest.raises(SettingError, match="big_count 10 is not allowed; allowed: sum"):
        window_estimates([1.0, 2.0], [4, 4], 1.0, big_count=10)
    with pytest.raises(SettingError, match="small_counts with 3 values for 2"):
        window_estimates([1.0, 2.0], [4, 4, 4], 1.0)
    with pytest.raises(SettingError, match="small_counts .* is not allowed; allowed: every count > 0"):
        window_estimates([1.0, 2.0], [4, 0], 1.0)
    with pytest.raises(SettingError, match="sources"):
        NoiseConfig(sources=("bogus",))
    with pytest.raises(SettingError, match="half_life -1 is not allowed"):
        NoiseConfig(half_life=-1)
    with pytest.raises(SettingError, match="confidence 1.5 is not allowed"):
        NoiseScaleEstimator(confidence=1.5)
    with pytest.raises(SettingError, match=r"not allowed \(with adam=True\)"):
        NoiseScaleMonitor(torch.nn.Linear(2, 2), config=NoiseConfig(adam=True))


def test_fieller_interval_known_cases():
    # No noise: the interval collapses to the ratio.
    lo, hi = fieller_interval(6.0, 2.0, 0.0, 0.0, 0.0, 1.96)
    assert lo == pytest.approx(3.0) and hi == pytest.approx(3.0)
    # Independent noise on the numerator only: ratio ± z·se/den.
    lo, hi = fieller_interval(6.0, 2.0, 0.25, 0.0, 0.0, 2.0)
    assert (lo, hi) == (pytest.approx(2.5), pytest.approx(3.5))
    # Denominator not significantly positive: unbounded.
    assert fieller_interval(6.0, 0.1, 0.0, 0.01, 0.0, 1.96) is None


def test_interval_covers_the_truth_about_95_percent():
    gen = torch.Generator().manual_seed(3)
    d = 16
    G = torch.randn(d, generator=gen) * 0.5
    sd = torch.ones(d) * 0.8
    truth = float(sd.square().sum() / G.square().sum())
    hits, runs = 0, 150
    for _ in range(runs):
        est = NoiseScaleEstimator(half_life_windows=10.0)
        for _ in range(40):
            small_sq, big_sq = _synthetic_window(gen, G, sd, [4, 4, 4, 4])
            est.update(small_sq, [4, 4, 4, 4], big_sq)
        e = est.estimate()
        hits += e.low <= truth <= e.high
    coverage = hits / runs
    assert 0.87 <= coverage <= 0.995, coverage


def test_flags_zero_gradient_and_few_windows():
    gen = torch.Generator().manual_seed(4)
    est = NoiseScaleEstimator(half_life=math.inf)
    assert est.estimate().flags == ("no_windows",)
    G = torch.zeros(16)  # pure noise: |G|² = 0, B_simple is infinite
    for w in range(60):
        small_sq, big_sq = _synthetic_window(gen, G, torch.ones(16), [4, 4])
        est.update(small_sq, [4, 4], big_sq)
        if w == 1:
            assert "few_windows" in est.estimate().flags
    e = est.estimate()
    assert not e.ok
    assert set(e.flags) & {"too_noisy", "g_sq_nonpositive"}
    assert math.isnan(e.low) and math.isnan(e.high)


def test_nonfinite_window_is_skipped_on_device():
    est = NoiseScaleEstimator(half_life=math.inf)
    est.update([5.0, 7.0], [8, 8], 2.0)
    before = est.estimate()
    est.update([float("inf"), 7.0], [8, 8], float("nan"))
    after = est.estimate()
    assert after.skipped_windows == 1 and after.windows == 1
    assert after.tr_sigma == before.tr_sigma and after.g_sq == before.g_sq


def test_ema_forgets_per_unit_not_per_step():
    """Same units consumed → same memory, whatever the batch: half the weight after half_life units."""
    a = NoiseScaleEstimator(half_life=1000.0)
    b = NoiseScaleEstimator(half_life=1000.0)
    for est, batch in ((a, 50), (b, 200)):
        assert est.decay_for(torch.tensor(float(batch))).item() == pytest.approx(0.5 ** (batch / 1000))
        for _ in range(4000 // batch):  # 4000 units at tr(Σ)^ = 10
            est.update([10.0 / batch * 4 + 1, 1.0], [batch / 2, batch / 2], 1.0)  # any fixed window
        first = est.estimate().tr_sigma
        for _ in range(1000 // batch):  # one half-life at a new value
            est.update([30.0 / batch * 4 + 1, 1.0], [batch / 2, batch / 2], 1.0)
        est._moved = (first, est.estimate().tr_sigma)
    (a0, a1), (b0, b1) = a._moved, b._moved
    assert a0 == pytest.approx(b0)
    # Half-way (in the EMA's weight) between old and new value, for both batch sizes.
    assert (a1 - a0) / (3 * a0 - a0) == pytest.approx(0.5, abs=0.03)
    assert (b1 - b0) / (3 * b0 - b0) == pytest.approx(0.5, abs=0.03)


def test_state_dict_roundtrip():
    est = NoiseScaleEstimator()
    for v in (5.0, 6.0, 9.0):
        est.update([v, 7.0], [8, 8], 2.0, lr=0.1)
    clone = NoiseScaleEstimator()
    clone.load_state_dict(est.state_dict())
    assert clone.estimate() == est.estimate()
    assert clone.estimate().lr == pytest.approx(0.1)


# ---------------------------------------------------------------------------
# The monitor on real gradients
# ---------------------------------------------------------------------------


def test_linear_regression_closed_form_within_5_percent():
    """x ~ N(0, I_d), y = w*·x + σε, loss ½(w·x − y)²: G = Δ, Σ = (|Δ|² + σ²)I + ΔΔᵀ."""
    torch.manual_seed(0)
    d, sigma = 12, 0.5
    model = torch.nn.Linear(d, 1, bias=False)
    w_star = torch.randn(d)
    with torch.no_grad():
        model.weight.copy_((w_star + 0.3 * torch.randn(d))[None])
    delta = model.weight[0].detach() - w_star
    g_true = float(delta.square().sum())
    tr_true = d * (g_true + sigma**2) + g_true
    mon = NoiseScaleMonitor(model, unit="sample", config=NoiseConfig(half_life=math.inf))
    for _ in range(300):
        counts = [16, 36, 24, 52]
        for c in counts:
            x = torch.randn(c, d)
            y = x @ w_star + sigma * torch.randn(c)
            (0.5 * (model(x)[:, 0] - y).square().sum()).backward()
            mon.micro_backward(c)
        for p in model.parameters():
            p.grad /= sum(counts)
        mon.window_end(lr=0.0)
        model.zero_grad(set_to_none=True)
    e = mon.estimate()
    assert e.ok, e.flags
    assert e.tr_sigma == pytest.approx(tr_true, rel=0.05)
    assert e.g_sq == pytest.approx(g_true, rel=0.05)
    assert e.b_simple == pytest.approx(tr_true / g_true, rel=0.05)


@pytest.fixture(scope="module")
def mlp_problem():
    x, y = nc.make_data()
    model = nc.make_model(0)
    tr, g = nc.truth(model, x, y)
    return x, y, model, tr, g


def _run_plain_loop(model, x, y, windows, sizes, seed, *, mean_loss=False, optimizer=None, adam=False,
                    host_path=True, half_life=math.inf):
    mon = NoiseScaleMonitor(model, unit="sample", optimizer=optimizer,
                            config=NoiseConfig(half_life=half_life, adam=adam))
    mon._host_path = host_path
    gen = torch.Generator().manual_seed(seed)
    k = len(sizes)
    for _ in range(windows):
        for i, b in enumerate(sizes):
            idx = torch.randint(0, len(x), (b,), generator=gen)
            loss, count = nc.loss_sum(model, x[idx], y[idx])
            if mean_loss:  # the common `loss.mean() / k` loop: Δ.grad = g_i / k
                (loss / count / k).backward()
                mon.micro_backward(count, grad_multiplier=1.0 / k)
            else:
                loss.backward()
                mon.micro_backward(count)
        if not mean_loss:
            for p in model.parameters():
                p.grad /= sum(sizes)
        mon.window_end()
        model.zero_grad(set_to_none=True)
    return mon


def test_mlp_accumulation_within_10_percent_of_per_example_truth(mlp_problem):
    x, y, model, tr, g = mlp_problem
    mon = _run_plain_loop(copy.deepcopy(model), x, y, windows=250, sizes=[16, 40, 8, 24], seed=0)
    e = mon.estimate()
    assert e.ok, e.flags
    assert e.b_simple == pytest.approx(tr / g, rel=0.10)
    assert e.tr_sigma == pytest.approx(tr, rel=0.10)


def test_mean_loss_loop_gives_the_same_numbers_as_sum_loss(mlp_problem):
    x, y, model, _, _ = mlp_problem
    a = _run_plain_loop(copy.deepcopy(model), x, y, windows=5, sizes=[8, 8, 8], seed=1).estimate()
    b = _run_plain_loop(copy.deepcopy(model), x, y, windows=5, sizes=[8, 8, 8], seed=1, mean_loss=True).estimate()
    assert b.tr_sigma == pytest.approx(a.tr_sigma, rel=1e-4)
    assert b.g_sq == pytest.approx(a.g_sq, rel=1e-4)


def test_is_last_no_longer_matters(mlp_problem):
    """The micro source reads each micro-batch's incoming gradient in a parameter hook, so there is no
    snapshot for ``is_last`` to save: a wrong ``is_last`` (even "last" on the first micro-batch) gives
    the same numbers. The argument is deprecated: passing it warns."""
    x, y, model, _, _ = mlp_problem
    got = []
    for flags in ([None, None, None], [True, False, True]):
        m = copy.deepcopy(model)
        mon = NoiseScaleMonitor(m, unit="sample", config=NoiseConfig(half_life=math.inf))
        gen = torch.Generator().manual_seed(11)
        for _ in range(4):
            for is_last in flags:
                idx = torch.randint(0, len(x), (8,), generator=gen)
                nc.loss_sum(m, x[idx], y[idx])[0].backward()
                if is_last is None:
                    mon.micro_backward(8)
                else:
                    with pytest.warns(FutureWarning, match=r"micro_backward\(is_last=...\) is deprecated"):
                        mon.micro_backward(8, is_last=is_last)
            for p in m.parameters():
                p.grad /= 24
            mon.window_end()
            m.zero_grad(set_to_none=True)
        got.append(mon.estimate())
    assert got[0].windows == got[1].windows == 4
    assert got[1].tr_sigma == pytest.approx(got[0].tr_sigma, rel=1e-12)
    assert got[1].g_sq == pytest.approx(got[0].g_sq, rel=1e-12)


def _adam_ready(model, x, y, steps=3):
    """An Adam whose exp_avg_sq exists (a few steps on the problem); grads cleared."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        opt.zero_grad()
        idx = torch.randint(0, len(x), (64,), generator=gen)
        (nc.loss_sum(model, x[idx], y[idx])[0] / 64).backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    return opt


@pytest.fixture
def host_calls(monkeypatch):
    """Counts calls of the host path, so the equivalence tests know which path ran."""
    calls = []
    for name in ("_host_vector", "_raw_vectors"):  # at the window's end, or deferred to the fold
        orig = getattr(NoiseScaleMonitor, name)

        def counted(self, *a, _orig=orig, _name=name, **k):
            calls.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(NoiseScaleMonitor, name, counted)
    return calls


@pytest.mark.parametrize("case", ["ragged", "mean_loss", "adam", "ema"])
def test_host_path_equals_tensor_path(mlp_problem, case, host_calls):
    """On CPU with one replica the window statistics are computed with host arithmetic; the device
    tensor chain (every other device, and DP) must give the same estimates to rounding."""
    x, y, model, _, _ = mlp_problem
    got = []
    for host in (True, False):
        host_calls.clear()
        m = copy.deepcopy(model)
        opt = _adam_ready(m, x, y) if case == "adam" else None
        mon = _run_plain_loop(m, x, y, windows=7, sizes=[16, 40, 8, 24], seed=4, host_path=host,
                              mean_loss=case == "mean_loss", optimizer=opt, adam=case == "adam",
                              half_life=None if case == "ema" else math.inf)
        assert len(host_calls) == (7 if host else 0)
        got.append(mon.estimates())
    assert got[0].keys() == got[1].keys() and got[0]
    for key, a in got[0].items():
        b = got[1][key]
        assert a.windows == b.windows == 7
        assert a.tr_sigma == pytest.approx(b.tr_sigma, rel=1e-12), key
        assert a.g_sq == pytest.approx(b.g_sq, rel=1e-12), key


@pytest.mark.parametrize("every, adam", [(1, False), (2, False), (1, True)])
def test_host_path_equals_tensor_path_under_the_step_driver(mlp_problem, host_calls, every, adam):
    """Through the StepDriver (|G_big|² from its on_step_end, a NaN window it skips, every=n) both paths
    give the same estimates and counts."""
    x, y, model, _, _ = mlp_problem
    got = []
    for host in (True, False):
        host_calls.clear()
        m = copy.deepcopy(model)
        opt = _adam_ready(m, x, y) if adam else None
        mon = NoiseScaleMonitor(m, optimizer=opt, config=NoiseConfig(half_life=math.inf, every=every, adam=adam))
        mon._host_path = host
        _driver_run(m, x, y, 9, callbacks=[mon], sizes=(8, 3, 8, 5), nan_window=4)
        got.append(mon.estimates())  # folds the queued windows in
        assert (len(host_calls) > 0) == host
    a, b = got
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].windows == b[key].windows > 0, key
        assert a[key].skipped_windows == b[key].skipped_windows == 1, key  # the NaN window 4 (measured at every=1, 2)
        assert a[key].tr_sigma == pytest.approx(b[key].tr_sigma, rel=1e-9), key
        assert a[key].g_sq == pytest.approx(b[key].g_sq, rel=1e-9), key


@pytest.mark.parametrize("ring_elements", [None, 64])  # 64: the smallest ring (8 rows), a fold every 5 windows
def test_deferred_host_windows_equal_tensor_path_over_ragged_windows_and_ring_wraps(host_calls, monkeypatch,
                                                                                     ring_elements):
    """Under the StepDriver on CPU the window vectors are computed at the fold, from norms left in a ring
    of rows. Over 700 windows (the ring wraps twice, folds keep the window awaiting its step) of 2–4
    micro-batches, some of which never reach the second layer (norms per micro-batch differ), with the
    EMA on: the same estimates as the tensor path. Then, with windows still queued, 20 micro-batches
    per window (80 norms: the norm buffer grows past 64) and float64 gradients (the buffer and the
    ring turn float64): the queued windows keep their norms."""
    from globalbatch.noise.sources import _NormSlots
    from globalbatch.step import StepConfig, StepDriver

    if ring_elements is not None:
        monkeypatch.setattr(_NormSlots, "RING_ELEMENTS", ring_elements)
    torch.manual_seed(0)
    base = torch.nn.ModuleList([torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)])
    gen = torch.Generator().manual_seed(2)
    data = []
    for w in range(760):
        k = 20 if 700 <= w < 730 else 2 + w % 3
        data.append([(torch.randn(3 + i % 4, 5, generator=gen), torch.randint(0, 3, (3 + i % 4,), generator=gen))
                     for i in range(k)])
    got, calls, ring = [], [], None
    for host in (True, False):
        host_calls.clear()
        m = copy.deepcopy(base)
        mon = NoiseScaleMonitor(m, unit="token", config=NoiseConfig(half_life_windows=50))
        mon._host_path = host
        driver = StepDriver(m, torch.optim.SGD(m.parameters(), lr=1e-3), StepConfig(micro_batch=6, global_batch=120),
                            callbacks=[mon])
        for w, window in enumerate(data):
            if w == 740:
                m.double()
            for i, (xb, yb) in enumerate(window):
                xb = xb.double() if w >= 740 else xb
                with driver.micro_step(last=i == len(window) - 1):
                    h = m[0](xb)
                    out = h[:, :3] if (i + w) % 4 == 1 else m[1](torch.relu(h))
                    # 2 "tokens" per sample: the token and the sample columns both carry weight
                    loss = torch.nn.functional.cross_entropy(out, yb, reduction="sum") * 2
                    driver.backward(loss, 2 * len(yb), samples=len(yb))
            driver.step()
            if w == 350:
                mid = mon.estimates()  # a read-out in the middle folds early; the ring goes on
        got.append((mid, mon.estimates()))
        calls.append(list(host_calls))
        ring = mon._slots.ring if host else ring
    assert calls[0].count("_raw_vectors") >= 2 and "_host_vector" not in calls[0] and calls[1] == []
    assert ring.dtype == torch.float64 and ring.shape[1] >= 80  # grew and turned float64 with windows queued
    assert len(ring) == (8 if ring_elements else _NormSlots.ROWS)
    for a, b in zip(*got):
        assert set(a) == set(b) == {"micro/token", "micro/sample"}
        for key in a:
            assert a[key].windows == b[key].windows > 300
            assert a[key].tr_sigma == pytest.approx(b[key].tr_sigma, rel=1e-9), key
            assert a[key].g_sq == pytest.approx(b[key].g_sq, rel=1e-9), key
            assert a[key].b_simple == pytest.approx(b[key].b_simple, rel=1e-9), key
    assert got[0][1]["micro/token"].b_simple != pytest.approx(got[0][1]["micro/sample"].b_simple, rel=0.01)


@pytest.mark.parametrize("host", [True, False])
def test_empty_micro_batches_are_no_small_batches(mlp_problem, host):
    """A micro-batch without loss-bearing units (all padding: count 0) adds nothing to .grad; it used to
    divide by zero (host path) or turn the window NaN. It is left out of the window's small batches, and
    a window left with one small batch is not measured (no error): the estimates equal a run without
    them, on the deferred host path and on the tensor path."""
    from globalbatch.step import StepConfig, StepDriver

    x, y, model, _, _ = mlp_problem
    gen = torch.Generator().manual_seed(8)
    plan = [[8, 8, 8], [8, 0, 8, 8], [8, 8, 0], [8, 0], [0, 8, 8, 8], [8, 8, 8]]  # 0: an empty micro-batch
    draws = [[torch.randint(0, len(x), (max(b, 1),), generator=gen) for b in window] for window in plan]
    got = []
    for with_empty in (True, False):
        m = copy.deepcopy(model)
        mon = NoiseScaleMonitor(m, unit="sample", config=NoiseConfig(half_life=math.inf))
        mon._host_path = host
        driver = StepDriver(m, torch.optim.SGD(m.parameters(), lr=0.0), StepConfig(micro_batch=8, global_batch=32),
                            callbacks=[mon])
        for window, idxs in zip(plan, draws):
            micros = [(b, idx) for b, idx in zip(window, idxs) if b or with_empty]
            if not with_empty and len(micros) < 2:
                continue  # the reference leaves that window out altogether
            for i, (b, idx) in enumerate(micros):
                with driver.micro_step(last=i == len(micros) - 1):
                    loss, count = nc.loss_sum(m, x[idx], y[idx])
                    if b == 0:
                        loss, count = loss * 0.0, 0  # every target masked: nothing to learn from
                    driver.backward(loss, count, samples=b)
            driver.step()
        got.append(mon.estimate())
    a, b = got
    assert a.windows == b.windows == 5 and a.skipped_windows == b.skipped_windows == 0
    assert math.isfinite(a.b_simple)
    assert a.tr_sigma == pytest.approx(b.tr_sigma, rel=1e-9)
    assert a.g_sq == pytest.approx(b.g_sq, rel=1e-9)


def test_host_path_equals_tensor_path_with_uneven_micro_batches_and_loss_scale():
    """A parameter that gets no gradient in some micro-batch (uneven norms per micro-batch) and a loss
    scale passed by hand: host and tensor paths agree, and the scale is divided out."""
    torch.manual_seed(0)
    base = torch.nn.ModuleList([torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)])
    gen = torch.Generator().manual_seed(1)
    data = [[(torch.randn(6, 5, generator=gen), torch.randint(0, 3, (6,), generator=gen)) for _ in range(3)]
            for _ in range(5)]
    got = []
    for host, scale in ((True, 8.0), (False, 8.0), (True, 1.0)):
        m = copy.deepcopy(base)
        mon = NoiseScaleMonitor(m, unit="token", config=NoiseConfig(half_life=math.inf))
        mon._host_path = host
        for window in data:
            for i, (xb, yb) in enumerate(window):
                h = m[0](xb)
                out = h[:, :3] if i == 1 else m[1](torch.relu(h))  # micro 1 never reaches the second layer
                # each sample's loss counted twice: 2 "tokens" per sample, so both unit columns are used
                (torch.nn.functional.cross_entropy(out, yb, reduction="sum") * 2 * scale).backward()
                mon.micro_backward(2 * len(yb), samples=len(yb))
            for p in m.parameters():
                p.grad /= scale * 36
            mon.window_end(loss_scale=scale)
            m.zero_grad(set_to_none=True)
        got.append(mon.estimates())
    assert set(got[0]) == {"micro/token", "micro/sample"}
    for key, e in got[0].items():
        assert e.windows == got[1][key].windows == 5
        for other in (got[1], got[2]):
            assert e.tr_sigma == pytest.approx(other[key].tr_sigma, rel=1e-6), key
            assert e.g_sq == pytest.approx(other[key].g_sq, rel=1e-6), key


def test_adam_variant_within_10_percent_of_preconditioned_truth(mlp_problem):
    x, y, model, _, _ = mlp_problem
    model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):  # build exp_avg_sq, then freeze everything: no more optimizer steps
        opt.zero_grad()
        idx = torch.randint(0, len(x), (64,))
        (nc.loss_sum(model, x[idx], y[idx])[0] / 64).backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    beta2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
    precond = [1.0 / ((opt.state[p]["exp_avg_sq"] / (1 - beta2 ** 3)).sqrt() + eps) for p in model.parameters()]
    tr, g = nc.truth(model, x, y, precond)
    mon = _run_plain_loop(model, x, y, windows=250, sizes=[16, 40, 8, 24], seed=2, optimizer=opt, adam=True)
    e = mon.estimate(adam=True)
    assert e.ok, e.flags
    assert e.b_simple == pytest.approx(tr / g, rel=0.10)
    plain = mon.estimate()
    assert abs(plain.b_simple / e.b_simple - 1) > 0.2  # the variant is a different quantity here


def test_step_driver_callback_matches_plain_loop_and_unscales(mlp_problem):
    """Through StepDriver (with and without a GradScaler) the numbers equal the plain loop's."""
    from globalbatch.step import StepConfig, StepDriver

    x, y, model, _, _ = mlp_problem
    sizes, windows = [8, 8, 8, 8], 6
    want = _run_plain_loop(copy.deepcopy(model), x, y, windows, sizes, seed=5).estimate()
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**12)):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        mon = NoiseScaleMonitor(m, optimizer=opt, unit="sample", config=NoiseConfig(half_life=math.inf))
        driver = StepDriver(m, opt, StepConfig(micro_batch=8, global_batch=32), scaler=scaler, callbacks=[mon])
        gen = torch.Generator().manual_seed(5)
        for _ in range(windows):
            for i, b in enumerate(sizes):
                idx = torch.randint(0, len(x), (b,), generator=gen)
                with driver.micro_step(last=i == len(sizes) - 1):
                    driver.backward(*nc.loss_sum(m, x[idx], y[idx]), samples=b)
            driver.step()
        got = mon.estimate()
        if scaler is not None:  # really scaled: grads were 4096× until unscaled; norms 4096²× before ÷S²
            assert driver.scaler is scaler and scaler.get_scale() == 2.0**12
        assert got.tr_sigma == pytest.approx(want.tr_sigma, rel=1e-4)
        assert got.g_sq == pytest.approx(want.g_sq, rel=1e-4)
        assert got.lr == 0.0 and got.big_count == 32


def test_token_and_sample_units_differ_by_tokens_per_sample():
    """Token-mean loss with T loss-bearing tokens in every sample: B_tokens = T × B_samples."""
    torch.manual_seed(0)
    T, vocab = 6, 11
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab))
    mon = NoiseScaleMonitor(model, unit="token", config=NoiseConfig(half_life=math.inf))
    for _ in range(4):
        for n in (3, 5):
            ids = torch.randint(0, vocab, (n, T + 1))
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1),
                                                     reduction="sum")
            loss.backward()
            mon.micro_backward(torch.tensor(n * T), samples=n)
        for p in model.parameters():
            p.grad /= 8 * T
        mon.window_end()
        model.zero_grad(set_to_none=True)
    tok, smp = mon.estimate(unit="token"), mon.estimate(unit="sample")
    assert tok.b_simple == pytest.approx(T * smp.b_simple, rel=1e-6)
    assert tok.big_count == 8 * T and smp.big_count == 8


def _token_lm_windows(seed, windows, sizes, T=6, vocab=11):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, vocab, (n, T + 1), generator=gen) for n in sizes] for _ in range(windows)]


def _token_lm_loss(model, ids, vocab=11):
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1), reduction="sum")
    return loss, torch.tensor(ids[:, 1:].numel())


def test_step_driver_callback_counts_ragged_micro_batch_samples():
    """Through StepDriver, ragged micro-batches (3 then 5 samples, planned 5) weigh their real
    sample counts (driver.last_micro_samples), exactly as a plain loop passing samples=n does."""
    from globalbatch.step import StepConfig, StepDriver

    T, sizes = 6, (3, 5)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)).double()
    data = _token_lm_windows(1, 4, sizes, T)

    plain = copy.deepcopy(base)
    want = NoiseScaleMonitor(plain, unit="token", config=NoiseConfig(half_life=math.inf))
    for window in data:
        for ids in window:
            loss, count = _token_lm_loss(plain, ids)
            loss.backward()
            want.micro_backward(count, samples=len(ids))
        for p in plain.parameters():
            p.grad /= sum(sizes) * T
        want.window_end()
        plain.zero_grad(set_to_none=True)

    m = copy.deepcopy(base)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    mon = NoiseScaleMonitor(m, optimizer=opt, unit="token", config=NoiseConfig(half_life=math.inf))
    driver = StepDriver(m, opt, StepConfig(micro_batch=5, global_batch=10), callbacks=[mon])
    for window in data:
        for i, ids in enumerate(window):
            with driver.micro_step(last=i == len(window) - 1):
                driver.backward(*_token_lm_loss(m, ids), samples=len(ids))
        assert driver.step().global_samples == sum(sizes)

    got_smp, want_smp = mon.estimate(unit="sample"), want.estimate(unit="sample")
    assert got_smp.big_count == want_smp.big_count == sum(sizes)  # not 2 × micro_batch = 10
    assert got_smp.tr_sigma == pytest.approx(want_smp.tr_sigma, rel=1e-9)
    assert got_smp.g_sq == pytest.approx(want_smp.g_sq, rel=1e-9)
    # T tokens in every sample: the sample estimate is exactly the token one ÷ T
    assert mon.estimate(unit="token").b_simple == pytest.approx(T * got_smp.b_simple, rel=1e-9)


def test_state_is_one_float64_tensor_on_the_gradients_device(mlp_problem):
    """The estimators' state lives on the gradients' device and is a single float64 tensor."""
    x, y, model, _, _ = mlp_problem
    mon = _run_plain_loop(copy.deepcopy(model), x, y, windows=2, sizes=[4, 4], seed=0)
    mon.estimate()  # folds the queued windows in
    (est,) = mon.estimators.values()
    assert est.state.dtype == torch.float64 and est.state.device == next(model.parameters()).device


# ---------------------------------------------------------------------------
# every=n, attaching at any time, skipped steps, read-outs
# ---------------------------------------------------------------------------


def _driver_run(model, x, y, windows, *, callbacks=(), sizes=(8, 8, 8, 8), seed=5, nan_window=None,
                during=None):
    """StepDriver at lr 0 over the MLP problem; ``during(driver, window, micro)`` runs after each micro."""
    from globalbatch.step import StepConfig, StepDriver

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    driver = StepDriver(model, opt, StepConfig(micro_batch=max(sizes), global_batch=max(sizes) * len(sizes)),
                        callbacks=list(callbacks))
    gen = torch.Generator().manual_seed(seed)
    for w in range(windows):
        for i, b in enumerate(sizes):
            idx = torch.randint(0, len(x), (b,), generator=gen)
            with driver.micro_step(last=i == len(sizes) - 1):
                loss, count = nc.loss_sum(model, x[idx], y[idx])
                if w == nan_window and i == 1:
                    loss = loss + torch.tensor(float("nan"))  # a NaN loss with finite gradients
                driver.backward(loss, count, samples=b)
            if during is not None:
                during(driver, w, i)
        driver.step()
    return driver


def _per_window(mon_factory, run):
    """Per-window (tr Σ^, |G|²^) of a plain-mean monitor, by differencing its running sums."""
    rows, total = [], [0.0, 0.0]
    mon = mon_factory()

    class _Tap:
        @staticmethod
        def on_step_end(driver, result):
            e = mon.estimate()
            now = (e.tr_sigma * e.windows, e.g_sq * e.windows)
            rows.append((now[0] - total[0], now[1] - total[1]))
            total[:] = now

    run([mon, _Tap()])
    return rows


def test_every_n_measures_one_window_in_n_and_equals_those_windows(mlp_problem):
    x, y, model, _, _ = mlp_problem
    plain = NoiseConfig(half_life=math.inf)
    m1, m3 = copy.deepcopy(model), copy.deepcopy(model)
    per = _per_window(lambda: NoiseScaleMonitor(m1, unit="sample", config=plain),
                      lambda cbs: _driver_run(m1, x, y, 12, callbacks=cbs))
    mon = NoiseScaleMonitor(m3, unit="sample", config=NoiseConfig(half_life=math.inf, every=3))
    hooked = []
    _driver_run(m3, x, y, 12, callbacks=[mon], during=lambda d, w, i: hooked.append(mon._installed) if i else None)
    # skipped windows cost nothing: no parameter hooks in place during them
    assert hooked == [w % 3 == 0 for w in range(12) for _ in range(3)]
    e = mon.estimate()
    kept = per[0::3]  # windows 0, 3, 6, 9
    assert e.windows == len(kept) == 4
    assert e.tr_sigma == pytest.approx(sum(t for t, _ in kept) / 4, rel=1e-9)
    assert e.g_sq == pytest.approx(sum(g for _, g in kept) / 4, rel=1e-9)
    assert mon.every == 3
    mon.every = 1  # changed at any time: from the next window
    _driver_run(m3, x, y, 2, callbacks=[mon])
    assert mon.estimate().windows == 6
    with pytest.raises(SettingError, match="every 0 is not allowed"):
        mon.every = 0


def test_every_n_ema_forgets_per_trained_unit():
    """With every=n a measured window stands for n windows of training: the decay is 0.5^(n·B/half_life)."""
    model = torch.nn.Linear(4, 1)
    mon = NoiseScaleMonitor(model, unit="sample", config=NoiseConfig(half_life=64.0, every=2))
    decays = []
    orig = mon._decay

    def spy(state, units, present, windows):
        d = orig(state, units, present, windows)
        decays.append(d[:, 0].tolist())
        return d

    mon._decay = spy
    for _ in range(6):
        for _ in range(2):
            model(torch.randn(8, 4)).square().sum().backward()
            mon.micro_backward(8, samples=8)
        for p in model.parameters():
            p.grad /= 16
        mon.window_end()
        model.zero_grad(set_to_none=True)
    mon.estimate()
    flat = [d for fold in decays for d in fold]
    assert flat[0] == pytest.approx(0.5 ** (16 / 64))        # the first measured window: 1 window elapsed
    assert flat[1:] == pytest.approx([0.5 ** (2 * 16 / 64)] * 2)  # then 2 windows of 16 samples each


def test_callback_appended_late_works_from_the_next_window_and_remove_stops_it(mlp_problem):
    """Issue 12: ``driver.callbacks.append(monitor)`` after construction used to be ignored."""
    x, y, model, _, _ = mlp_problem
    m = copy.deepcopy(model)
    mon = NoiseScaleMonitor(m, unit="sample", config=NoiseConfig(half_life=math.inf))
    seen = {}

    def during(driver, w, i):
        if (w, i) == (2, 1):  # in the middle of window 2
            driver.callbacks.append(mon)
        if (w, i) == (6, 3):  # after the last micro-batch of window 6, before its step
            seen["windows_at_6"] = mon.estimate().windows
        if (w, i) == (7, 0):
            driver.callbacks.remove(mon)
            mon.detach()

    _driver_run(m, x, y, 10, during=during)
    e = mon.estimate()
    assert seen["windows_at_6"] == 3  # windows 3, 4, 5 (window 2 joined half-way: left out)
    assert e.windows == 4  # windows 3..6; none after remove() and detach()
    assert not mon._hooks and not mon._installed


def test_window_skipped_by_the_driver_is_left_out(mlp_problem):
    """Issue 11: a window skipped for a NaN loss (finite gradients) was still counted."""
    x, y, model, _, _ = mlp_problem
    cfg = NoiseConfig(half_life=math.inf)
    m_ref, m_nan = copy.deepcopy(model), copy.deepcopy(model)
    ref = _per_window(lambda: NoiseScaleMonitor(m_ref, unit="sample", config=cfg),
                      lambda cbs: _driver_run(m_ref, x, y, 8, callbacks=cbs))
    mon = NoiseScaleMonitor(m_nan, unit="sample", config=cfg)
    driver = _driver_run(m_nan, x, y, 8, callbacks=[mon], nan_window=5)
    assert driver.skipped_windows == 1
    e = mon.estimate()
    kept = ref[:5] + ref[6:]
    assert (e.windows, e.skipped_windows) == (7, 1)
    assert e.tr_sigma == pytest.approx(sum(t for t, _ in kept) / 7, rel=1e-9)
    assert e.g_sq == pytest.approx(sum(g for _, g in kept) / 7, rel=1e-9)
    with_nan = sum(t for t, _ in ref) / 8
    assert abs(e.tr_sigma / with_nan - 1) > 1e-6  # the skipped window would have moved it


def test_window_the_driver_refused_is_left_out(mlp_problem):
    """A window of more samples than planned raises in step() after on_window_end: never applied, never counted."""
    from globalbatch.step import StepConfig, StepDriver

    x, y, model, _, _ = mlp_problem
    gen = torch.Generator().manual_seed(21)
    data = [[torch.randint(0, len(x), (8,), generator=gen) for _ in range(4)] for _ in range(5)]
    cfg = NoiseConfig(half_life=math.inf)
    got = []
    for windows, refuse in (([0, 1, 3, 4], None), ([0, 1, 2, 3, 4], 2)):
        m = copy.deepcopy(model)
        mon = NoiseScaleMonitor(m, unit="sample", config=cfg)
        driver = StepDriver(m, torch.optim.SGD(m.parameters(), lr=0.0), StepConfig(micro_batch=8, global_batch=32),
                            callbacks=[mon])
        for w in windows:
            micros = data[w] + (data[w][:1] if w == refuse else [])  # the refused window: 5 micro-batches of 8
            for i, idx in enumerate(micros):
                with driver.micro_step(last=i == len(micros) - 1):
                    driver.backward(*nc.loss_sum(m, x[idx], y[idx]), samples=8)
            if w == refuse:
                with pytest.raises(SettingError, match="more than the planned global batch"):
                    driver.step()
            else:
                driver.step()
        got.append(mon.estimate())
    assert (got[1].windows, got[1].skipped_windows) == (4, 1)
    assert got[1].tr_sigma == pytest.approx(got[0].tr_sigma, rel=1e-12)
    assert got[1].g_sq == pytest.approx(got[0].g_sq, rel=1e-12)


def test_estimate_before_any_window_is_flagged_not_raised():
    mon = NoiseScaleMonitor(torch.nn.Linear(3, 1))
    e = mon.estimate()
    assert e.flags == ("no_windows",) and e.windows == 0 and math.isnan(e.b_simple)
    assert mon.estimates() == {}
    with pytest.raises(SettingError, match=r"estimate 'rank/token' is not allowed \(not measured\)"):
        mon.estimate("rank")  # one process: the rank source does not exist


def test_wide_interval_is_flagged():
    """Issue 12 measured single runs reading +111 % with an interval [72.4, 242.1] and no flag."""
    gen = torch.Generator().manual_seed(6)
    G, sd = torch.randn(16, generator=gen) * 0.3, torch.ones(16)
    wide = NoiseScaleEstimator(half_life=math.inf)
    tunable = NoiseScaleEstimator(half_life=math.inf, max_interval_ratio=math.inf, max_relative_stderr=10.0)
    narrow = NoiseScaleEstimator(half_life=math.inf)
    for w in range(600):
        small_sq, big_sq = _synthetic_window(gen, G, sd, [4, 4])
        if w < 12:
            wide.update(small_sq, [4, 4], big_sq)
            tunable.update(small_sq, [4, 4], big_sq)
        narrow.update(small_sq, [4, 4], big_sq)
    e = wide.estimate()
    assert math.isfinite(e.high) and e.high > 2 * e.low and "wide_interval" in e.flags and not e.ok
    assert "wide_interval" not in tunable.estimate().flags
    n = narrow.estimate()
    assert n.high < 2 * n.low and n.ok, n
    from globalbatch.lab.noise_run import format_estimate

    assert "interval wider than 2×" in format_estimate(e)
    with pytest.raises(SettingError, match="max_interval_ratio 1 is not allowed"):
        NoiseConfig(max_interval_ratio=1)


def test_unit_follows_the_loss(mlp_problem):
    """unit=None: a per-sample loss (units = samples) reads in samples, a token loss in tokens."""
    x, y, model, _, _ = mlp_problem
    m = copy.deepcopy(model)
    mon = NoiseScaleMonitor(m)  # unit=None
    _driver_run(m, x, y, 3, callbacks=[mon])
    assert mon.unit == "sample" and mon.estimate().unit == "sample"
    assert set(mon.estimates()) == {"micro/sample"}
    from globalbatch.step import StepConfig, StepDriver

    torch.manual_seed(0)
    lm = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    tok = NoiseScaleMonitor(lm)
    driver = StepDriver(lm, torch.optim.SGD(lm.parameters(), lr=0.0), StepConfig(micro_batch=5, global_batch=10),
                        callbacks=[tok])
    for window in _token_lm_windows(2, 3, (5, 5)):
        for i, ids in enumerate(window):
            with driver.micro_step(last=i == 1):
                driver.backward(*_token_lm_loss(lm, ids), samples=len(ids))
        driver.step()
    assert tok.unit == "token" and set(tok.estimates()) == {"micro/token", "micro/sample"}


def test_compiled_module_gives_the_same_numbers(mlp_problem):
    x, y, model, _, _ = mlp_problem
    out = []
    for wrap in (lambda m: m, lambda m: torch.compile(m, backend="eager")):
        m = copy.deepcopy(model)
        w = wrap(m)
        mon = NoiseScaleMonitor(w, unit="sample", config=NoiseConfig(half_life=math.inf))
        _driver_run(w, x, y, 3, callbacks=[mon])
        out.append(mon.estimate())
    assert out[1].tr_sigma == pytest.approx(out[0].tr_sigma, rel=1e-6)
    assert out[1].g_sq == pytest.approx(out[0].g_sq, rel=1e-6)


def test_fsdp2_with_adam_variant_is_refused_naming_the_field():
    from globalbatch.parallel import fsdp_module_class

    model = torch.nn.Linear(2, 2)
    model.__class__ = type("FSDPLinear", (fsdp_module_class(), torch.nn.Linear), {})  # what fully_shard does
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(SettingError, match=r"^adam True is not allowed \(with an FSDP2 model\)"):
        NoiseScaleMonitor(model, optimizer=opt, config=NoiseConfig(adam=True))


# ---------------------------------------------------------------------------
# DDP + accumulation (torchrun, 2 gloo ranks)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def noise_two_ranks():
    """One torchrun launch of noise_ddp.py, noise_fsdp2.py and noise_wrappers.py (tests/dist/noise_all.py)."""
    import subprocess

    try:
        return run_torchrun(Path(__file__).parent / "dist" / "noise_all.py")
    except pytest.fail.Exception as exc:  # a failed script: its line and the later ones are missing
        return subprocess.CompletedProcess([], 1, stdout=str(exc), stderr="")


@pytest.mark.dist
def test_ddp_and_accumulation_exact_plumbing_and_agreement(noise_two_ranks):
    proc = noise_two_ranks
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("NOISE_DDP "))
    out = json.loads(line[len("NOISE_DDP "):])
    assert out["world"] == 2
    # Every source's per-window estimates equal the reference from per-micro gradients.
    assert out["phase1_worst_rel_err"] < 1e-4
    truth, micro, rank = out["truth"], out["micro"], out["rank"]
    for e in (micro, rank):
        assert not e["flags"], e
        assert e["b_simple"] == pytest.approx(truth, rel=0.10)
        assert e["tr_sigma"] == pytest.approx(out["truth_tr_sigma"], rel=0.10)
    # The accumulation (micro) and DDP (rank) estimates agree within their intervals.
    assert micro["low"] <= rank["high"] and rank["low"] <= micro["high"]
    assert micro["low"] <= truth <= micro["high"]


@pytest.mark.dist
def test_compiled_ddp_and_comm_hooks_give_the_monitor_the_same_estimates(noise_two_ranks):
    proc = noise_two_ranks
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("NOISE_WRAPPERS "))
    out = json.loads(line[len("NOISE_WRAPPERS "):])
    ddp = out["ddp"]
    assert out["compiled_type"] == "OptimizedModule"
    for source in ("micro", "rank"):
        assert ddp[source]["windows"] == 60
        # torch.compile(DDP(m)): the same micro and rank estimates as DDP(m) (issue 9: 82 instead of 12)
        assert out["compiled_ddp"][source]["b_simple"] == pytest.approx(ddp[source]["b_simple"], rel=1e-6)
        assert out["compiled_ddp"][source]["tr_sigma"] == pytest.approx(ddp[source]["tr_sigma"], rel=1e-6)
        # two monitors share one DDP model's comm hook: both measure, identically
        for row in out["two_monitors"]:
            assert row[source]["b_simple"] == pytest.approx(ddp[source]["b_simple"], rel=1e-9)
        # fp16 compression (wrapped, not replaced): only the big gradient's rounding changes the estimate
        fp16 = out["fp16"][source]
        assert fp16["b_simple"] == pytest.approx(ddp[source]["b_simple"], rel=1e-3)
        assert fp16["b_simple"] != ddp[source]["b_simple"]  # the compressed all-reduce really ran
        assert fp16["low"] <= out["truth"] <= fp16["high"]
    assert out["refused"].startswith("model a DDP model with a comm hook is not allowed (DDP allows one comm hook)")


@pytest.mark.dist
def test_fsdp2_micro_source_equals_ddp_and_the_truth(noise_two_ranks):
    proc = noise_two_ranks
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("NOISE_FSDP2 "))
    out = json.loads(line[len("NOISE_FSDP2 "):])
    assert out["world"] == 2
    for fsdp, ddp in (("fsdp2", "ddp"), ("fsdp2_plain_loop", "ddp_plain_loop")):
        f, d = out[fsdp], out[ddp]
        assert f["windows"] == d["windows"] > 0  # FSDP2 starts at its second window; DDP joined there too
        # the same windows on the same ranks: sharded gradients give the same estimate as DDP
        assert f["tr_sigma"] == pytest.approx(d["tr_sigma"], rel=1e-6)
        assert f["g_sq"] == pytest.approx(d["g_sq"], rel=1e-6)
    e = out["fsdp2"]
    assert not e["flags"], e
    assert e["b_simple"] == pytest.approx(out["truth"], rel=0.10)
    assert e["low"] <= out["truth"] <= e["high"]


# ---------------------------------------------------------------------------
# globalbatch noise
# ---------------------------------------------------------------------------

TINY = ["--task-arg", "d_model=16", "--task-arg", "n_layer=1", "--task-arg", "n_head=2",
        "--task-arg", "seq_len=16", "--task-arg", "max_corpus_bytes=200000"]


def _cli(args, capsys):
    from globalbatch.cli import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_cli_help_names_the_flags(capsys):
    code, out, _ = _cli(["noise", "--help"], capsys)
    assert code == 0
    for flag in ("--task", "--micro-batch", "--grad-accum", "--steps", "--lr", "--out", "--tensorboard",
                 "--adam-variant", "--half-life-windows", "--log-every"):
        assert flag in out


def test_cli_runs_tinygpt_and_writes_csv(tmp_path, capsys):
    out_dir = tmp_path / "noise"
    threads = torch.get_num_threads()
    try:
        code, out, err = _cli(["noise", *TINY, "--micro-batch", "4", "--grad-accum", "3", "--steps", "6",
                               "--log-every", "3", "--out", str(out_dir), "--threads", "1"], capsys)
        assert torch.get_num_threads() == 1  # --threads
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err
    assert "nan" not in out and "e+" not in out
    # the summary follows the curve's columns: the loss's unit (tokens) first, then samples
    assert out.index("B_simple (micro-batches, per token):") < out.index("B_simple (micro-batches, per sample):")
    import csv

    rows = list(csv.DictReader(open(out_dir / "noise.csv")))
    assert [int(r["step"]) for r in rows] == [3, 6]
    for r in rows:
        assert float(r["b_simple_micro_token"]) > 0 and float(r["lr"]) == pytest.approx(1e-3)
        assert int(r["batch_samples"]) == 12
        # the sample-unit estimate of a token-mean loss: about tokens-per-sample times smaller
        assert float(r["b_simple_micro_sample"]) < float(r["b_simple_micro_token"])
        assert float(r["valid_tokens_per_s"]) > 0 and 0 < float(r["mfu"]) < 1  # throughput of the window
    assert "valid tok/s" in out and "MFU" in out
    assert "B_simple (micro-batches, per token):" in out and "B_simple (micro-batches, per sample):" in out
    assert not list(out_dir.glob(".*tmp*"))  # atomic writes leave no temporary files


@pytest.mark.parametrize("argv, expected", [
    (("--micro-batch", "0"), "--micro-batch 0 is not allowed; allowed: a whole number ≥ 1"),
    (("--steps", "0"), "--steps 0 is not allowed; allowed: a whole number ≥ 1"),
    (("--log-every", "-1"), "--log-every -1 is not allowed; allowed: a whole number ≥ 1"),
    (("--threads", "0"), "--threads 0 is not allowed; allowed: a whole number ≥ 1"),
    (("--lr", "-1"), "--lr -1 is not allowed; allowed: a finite number ≥ 0"),
    (("--optimizer", "adam"), "--optimizer 'adam' is not allowed; allowed: adamw, sgd, lars, lamb"),
    (("--optimizer", "sgd", "--adam-variant"),
     "--adam-variant True is not allowed (with --optimizer sgd); allowed: --optimizer adamw"),
    (("--half-life-windows", "0"), "--half-life-windows 0 is not allowed; allowed: a number > 0"),
])
def test_cli_bad_flags_are_one_line_naming_the_flag(tmp_path, capsys, argv, expected):
    code, out, err = _cli(["noise", *TINY, *argv, "--out", str(tmp_path)], capsys)
    assert code == 2 and out == ""
    assert err.startswith("error: " + expected) and err.count("\n") == 1, err


def test_run_config_errors_name_the_field():
    from globalbatch.lab.noise_run import NoiseRunConfig

    with pytest.raises(SettingError, match="^micro_batch 0 is not allowed; allowed: a whole number ≥ 1$"):
        NoiseRunConfig(micro_batch=0)
    with pytest.raises(SettingError, match="^optimizer 'adam' is not allowed; allowed: adamw, sgd, lars, lamb$"):
        NoiseRunConfig(optimizer="adam")


def test_numbers_and_intervals_read_well():
    from globalbatch.lab.noise_run import format_interval, format_number

    assert [format_number(x) for x in (10689.3, 1600.2, 262.4, 31.09, 0.4697, 0.0001234, math.nan)] == \
        ["10,700", "1,600", "262", "31.1", "0.47", "0.000123", "n/a"]
    assert format_interval(262.0, 1600.2, 10689.3, "") == "262 [1,600, 10,700]"
    assert format_interval(262.0, math.nan, math.nan, "too_noisy") == "262 (too noisy: interval unbounded)"
    assert format_interval(212.0, 0.0, 3152.0, "too_noisy") == "212 [0, 3,150] (too noisy)"
    assert format_interval(math.nan, math.nan, math.nan, "no_windows") == "n/a (no windows yet)"
    for text in (format_interval(262.0, math.nan, math.nan, ("g_sq_nonpositive",)),):
        assert "nan" not in text and "unbounded" in text


def test_format_estimate_flags_instead_of_nan():
    from globalbatch.lab.noise_run import format_estimate
    from globalbatch.noise import NoiseScaleEstimate

    base = dict(unit="token", confidence=0.95, tr_sigma=1.0, g_sq=1.0, windows=60, skipped_windows=0,
                effective_windows=20.0, big_count=1024.0, lr=3e-3)
    ok = NoiseScaleEstimate(b_simple=10689.3, stderr=1234.0, low=1600.2, high=20480.0, flags=(), **base)
    assert format_estimate(ok) == "10,700 tokens [95% 1,600, 20,500], SE 1,230"
    bad = NoiseScaleEstimate(b_simple=375.2, stderr=math.nan, low=math.nan, high=math.nan, flags=("too_noisy",),
                             **base)
    assert format_estimate(bad) == "375 tokens (too noisy: interval unbounded; not reportable)"


def test_cli_one_micro_batch_is_a_clear_error(tmp_path, capsys):
    code, out, err = _cli(["noise", *TINY, "--grad-accum", "1", "--steps", "2", "--out", str(tmp_path)], capsys)
    assert code == 2 and out == ""  # checked before the header is printed
    assert err == ("error: --grad-accum 1 is not allowed (one process gives no second batch size); "
                   "allowed: ≥ 2, or ≥ 2 processes (torchrun)\n")


def test_cli_tensorboard_missing_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now fails
    code, _, err = _cli(["noise", *TINY, "--grad-accum", "2", "--steps", "1", "--out", str(tmp_path),
                         "--tensorboard"], capsys)
    assert code == 2
    assert "globalbatch[tensorboard]" in err


def test_cli_tensorboard_writes_scalars(tmp_path, capsys):
    code, _, err = _cli(["noise", *TINY, "--grad-accum", "2", "--steps", "3", "--log-every", "3",
                         "--out", str(tmp_path), "--tensorboard"], capsys)
    assert code == 0, err
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "noise/micro/b_simple_tokens" in tags and "train/lr" in tags


def test_host_weights_leave_count_zero_micro_batches_out():
    """The host arithmetic never divides by a zero multiplier: a count-0 micro-batch weighs 0 (it is no
    small batch); a multiplier 0 with targets cannot be rescaled and makes the window NaN (skipped)."""
    import math as _math

    from globalbatch.noise.window import _host_weights

    units, (w_units, w_samples), mult_sum = _host_weights([8, 0, 4], [8.0, 0.0, 4.0], [2.0, 1.0, 1.0])
    assert units == 12 and mult_sum == 12.0
    assert w_units == [8 / 64, 0.0, 4 / 16] and w_samples == [2 / 64, 0.0, 1 / 16]
    _, (w_units, _), _ = _host_weights([8, 3], [8.0, 0.0], None)
    assert _math.isnan(w_units[1])


def test_monitor_built_before_it_is_fed_leaves_out_the_stale_window():
    """A monitor built windows before it is appended to the driver's callbacks: its hooks saw backward passes
    nobody fed it, and their norms used to land in the first fed window (tr(Σ) 6.20 instead of 3.12 here).
    That window is now left out: the estimate equals a monitor built at the next window."""
    from globalbatch.step import StepConfig, StepDriver

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x, y = torch.randn(256, 6), torch.randint(0, 3, (256,))
    gen = torch.Generator().manual_seed(1)
    wins = [[torch.randint(0, 256, (8,), generator=gen) for _ in range(3)] for _ in range(6)]
    got = []
    for built_at, appended_at in ((0, 2), (3, 3)):
        m = copy.deepcopy(base)
        driver = StepDriver(m, torch.optim.SGD(m.parameters(), lr=0.0), StepConfig(micro_batch=8, global_batch=24))
        mon = None
        for w, idxs in enumerate(wins):
            if w == built_at:
                mon = NoiseScaleMonitor(m, unit="sample", config=NoiseConfig(half_life=math.inf))
            if w == appended_at:
                driver.callbacks.append(mon)
            for i, idx in enumerate(idxs):
                with driver.micro_step(last=i == 2):
                    driver.backward(torch.nn.functional.cross_entropy(m(x[idx]), y[idx], reduction="sum"), 8,
                                    samples=8)
            driver.step()
        got.append(mon.estimate())
    a, b = got
    assert a.windows == b.windows == 3
    assert a.tr_sigma == pytest.approx(b.tr_sigma, rel=1e-9) and a.g_sq == pytest.approx(b.g_sq, rel=1e-9)
