"""The analysis over seeds against synthetic curves with a known B_crit(L) and realistic noise.

Ground truth: S(B, L) = S_min(L)·(1 + B_crit(L)/B) with B_crit(L) = 500·(L/3)^-4 (B_crit rises
as the loss falls, as McCandlish et al. and Kaplan et al. find). Each trial's loss curve is
that relation inverted at every step; the training loss of a step carries 0.25 nats of noise
at 250 tokens per step (tinygpt's batch 4, measured), scaled by 1/√batch; the held-out
evaluations carry 0.005 nats (a 512-document held-out set); each seed moves every batch's
steps by an independent 5 % (data order and init).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from globalbatch.critical import AnalysisSettings, Curve
from globalbatch.critical.seeds import (analyze_seeds, common_lr, common_targets, fit_joint, is_monotone,
                                        recommend_over_seeds, seed_analysis_json, target_over_seeds)
from globalbatch.critical.readout import heldout_crossing, monotone_fit

BATCHES = [250.0, 500.0, 1000.0, 2000.0, 4000.0]
BUDGET = 400_000.0


def b_crit_true(loss):
    return 500.0 * (np.asarray(loss) / 3.0) ** -4.0


def s_min_true(loss):
    loss = np.asarray(loss, dtype=float)
    return 30.0 * (4.0 - loss) / (loss - 2.0)


def synth_curve(batch: float, seed: int, *, lr: float = 1e-3, seed_sd: float = 0.05, eval_sd: float = 0.005,
                train_sd_at_250: float = 0.25, warmup: float = 0.0, tput: float = 1.0,
                factor: float | None = None) -> Curve:
    rng = np.random.default_rng([int(batch), seed, int(lr * 1e6)])
    draw = math.exp(rng.normal(0, seed_sd))  # this seed's steps at this batch
    factor = draw if factor is None else factor
    grid = np.linspace(3.995, 2.05, 4000)
    steps_grid = factor * s_min_true(grid) * (1 + b_crit_true(grid) / batch)  # increasing along the grid
    n = int(BUDGET // batch)
    steps = np.arange(1, n + 1, dtype=float)
    loss_after = np.interp(np.concatenate([[0.0], steps]), np.concatenate([[0.0], steps_grid]), np.concatenate([[4.0], grid]))
    train = loss_after[:-1] + rng.normal(0, train_sd_at_250 * math.sqrt(250.0 / batch), n)
    pos = np.unique(np.ceil(np.geomspace(BUDGET / 100, BUDGET, 30) / batch))
    ev_steps = np.concatenate([[0.0], pos])
    ev_loss = loss_after[ev_steps.astype(int)] + rng.normal(0, eval_sd, ev_steps.size)
    return Curve(batch_size=batch, lr=lr, examples=batch * steps, loss=train, examples_per_s=tput * batch ** 0.5,
                 seed=seed, eval_examples=batch * ev_steps, eval_steps=ev_steps, eval_loss=ev_loss,
                 warmup_examples=warmup)


def true_steps(batch, loss):
    return s_min_true(loss) * (1 + b_crit_true(loss) / batch)


# --- the read-out -------------------------------------------------------------


def test_heldout_crossing_is_exact_on_a_log_linear_curve():
    """Loss linear in ln(examples): the log-space interpolation is exact (float64, 1e-10)."""
    e = np.concatenate([[0.0], np.geomspace(100, 1e5, 30)])
    loss = np.where(e > 0, 5.0 - 0.3 * np.log(np.maximum(e, 1)), 6.0)
    steps = e / 10.0
    for target in (3.5, 3.0, 2.0):
        c = heldout_crossing(e, steps, loss, target)
        expect = math.exp((5.0 - target) / 0.3)
        assert c.examples == pytest.approx(expect, rel=1e-10) and c.steps == pytest.approx(expect / 10.0, rel=1e-10)
    assert heldout_crossing(e, steps, loss, 1.0) is None  # never reached
    assert heldout_crossing(e, steps, loss, 3.7).before_first_eval


def test_monotone_fit_ignores_a_noise_bump_the_first_crossing_takes():
    e = np.array([0.0, 1, 2, 4, 8, 16, 32])
    loss = np.array([5.0, 4.0, 3.45, 3.7, 3.55, 3.3, 3.0])  # a dip to 3.45 at 2, then back up
    fit = monotone_fit(loss)
    assert np.all(np.diff(fit) <= 0) and fit[2] == fit[3] == pytest.approx((3.45 + 3.7) / 2, rel=1e-12)
    c = heldout_crossing(e, e, loss, 3.5)
    assert 8.0 < c.examples < 16.0  # the raw first crossing (in the dip) would be < 2


# --- the fit over seeds against ground truth -------------------------------------


def _curves(seed_list, **kw):
    return [synth_curve(b, s, **kw) for s in seed_list for b in BATCHES]


@pytest.mark.slow
def test_heldout_readout_is_monotone_and_recovers_b_crit_over_many_seeds():
    """10 independent 3-seed sweeps: ≥ 95 % monotone cells, median B_crit within 25 % of the truth at every
    common target, and the joint exponent within ±1 of −4; the stated interval covers the truth mostly."""
    mono, errors, ks, covered, n_int = [], [], [], 0, 0
    for rep in range(10):
        curves = _curves([3 * rep, 3 * rep + 1, 3 * rep + 2])
        a = analyze_seeds(curves, settings=AnalysisSettings(n_targets=5))
        mono += [m for t in a.targets for m in t.monotone.values()]
        for t in a.targets:
            if t.b_crit is not None:
                errors.append(abs(t.b_crit / b_crit_true(t.target) - 1))
            iv = t.interval()
            if iv is not None:
                n_int += 1
                covered += iv[0] * 0.9 <= b_crit_true(t.target) <= iv[1] * 1.1
        ks.append(a.joint.k)
    assert np.mean(mono) >= 0.95
    assert np.median(errors) < 0.15 and np.max(errors) < 0.5, np.round(errors, 3)
    assert abs(np.median(ks) + 4.0) < 1.0, ks
    assert covered >= 0.6 * n_int


def test_training_readout_with_a_token_window_beats_a_step_window():
    """The issue's failure: a window of 5 % of each trial's steps lets batch-4-sized noise cross early."""
    curves = _curves([0, 1, 2])
    targets = common_targets(curves, 5)
    err = {}
    for name, kw in (("steps", {}), ("tokens", {"min_window_examples": 0.02 * BUDGET})):
        e = []
        for t in targets:
            st = target_over_seeds(curves, t, readout="train", **kw)
            for b in BATCHES:
                for s in (0, 1, 2):
                    if st.steps[b][s] is not None:
                        e.append(abs(math.log(st.steps[b][s] / true_steps(b, t))))
        err[name] = float(np.median(e))
    assert err["tokens"] < 0.25
    assert err["tokens"] <= err["steps"] * 1.05, err


def test_common_targets_are_reached_by_every_cell_and_none_in_warmup():
    curves = _curves([0, 1], warmup=4000.0)
    targets = common_targets(curves, 5)
    assert targets == sorted(targets, reverse=True)
    for t in targets:
        st = target_over_seeds(curves, t)
        assert all(v is not None for d in st.steps.values() for v in d.values())
        assert not st.reached_in_warmup


def test_non_monotone_cells_are_flagged_and_left_out_of_the_fit():
    assert is_monotone([1, 2, 4], [10, 6, 4], [10, 12, 16])
    assert not is_monotone([1, 2, 4], [10, 12, 4], [10, 24, 16])  # batch 2 slower than batch 1
    assert is_monotone([1, 2, 4], [10, 5.2, 2.5], [10, 10.4, 10])  # perfect scaling: E flat, its noise ignored
    curves = _curves([0, 1, 2])
    bad = next(c for c in curves if c.seed == 1 and c.batch_size == 1000.0)
    bad.eval_loss = bad.eval_loss + 0.3  # that batch now needs far more steps than batch 500
    a = analyze_seeds(curves, settings=AnalysisSettings(n_targets=4))
    for t in a.targets:
        assert not t.monotone[1] and t.b_crit_per_seed[1] is None
        assert "non-monotone" in t.b_crit_text_per_seed[1]
    assert any("non-monotone" in w and "seed(s) 1" in w for w in a.warnings)
    assert all(p[1] != 1 for p in [(t.target, s) for t in a.targets for s in a.seeds if t.monotone[s]])


def test_joint_fit_recovers_exact_parameters():
    rows = [(L, s, b, float(true_steps(b, L)) * (1.0 if s == 0 else 1.0)) for L in (2.6, 2.8, 3.0, 3.2)
            for s in (0, 1) for b in BATCHES]
    # true S_min(L) differs per target: the joint model's a_t absorbs it exactly.
    j = fit_joint(rows, n_boot=0)
    assert j.k == pytest.approx(-4.0, abs=1e-6)
    assert j.b_crit(3.0) == pytest.approx(500.0, rel=1e-6)
    assert j.b_crit(2.6) == pytest.approx(float(b_crit_true(2.6)), rel=1e-6)
    with pytest.raises(ValueError, match="at least 2 targets"):
        fit_joint([r for r in rows if r[0] == 2.6])


def test_recommendation_states_probabilities_and_ties():
    curves = _curves([0, 1, 2, 3, 4])
    a = analyze_seeds(curves, settings=AnalysisSettings(n_targets=3))
    rec = a.recommendation
    assert rec is not None and sum(rec.probability_fastest.values()) == pytest.approx(1.0)
    assert set(rec.per_seed) == {0, 1, 2, 3, 4} and rec.batch_size in rec.tie
    for b, (med, lo, hi) in rec.time_to_target.items():
        assert lo <= med <= hi
    # Throughput ∝ √B and examples ≈ E_min(1 + B/B_crit): two batches that tie exactly are stated as a tie.
    st = a.primary
    flat = {b: 1.0 for b in st.steps}
    for b in st.steps:
        for s in st.examples[b]:
            st.examples[b][s] = 1000.0  # every batch the same time to target
    r2 = recommend_over_seeds(st, flat)
    assert len(r2.tie) == len(st.steps) and "tie:" in r2.text()


def test_json_has_the_documented_keys():
    curves = _curves([0, 1, 2])
    a = analyze_seeds(curves, settings=AnalysisSettings(n_targets=3))
    doc = seed_analysis_json(a, lambda u: int(u // 62))
    t = doc["targets"][0]
    for key in ("target_loss", "b_crit", "b_crit_per_seed", "steps_to_target", "monotone", "b_crit_own_per_seed",
                "pooling", "pooling_text"):
        assert key in t
    assert t["pooling"]["p_value"] >= 0 and isinstance(t["pooling"]["shared"], bool)  # 3 monotone seeds: tested
    assert 0.0 <= t["pooling"]["weight"] <= 1.0 and set(t["pooling"]["weight_per_seed"]) == set(t["pooling"]["b_crit_per_seed"])
    assert doc["pooling_text"].startswith("S_min partially pooled at ")
    import json

    json.dumps(doc, allow_nan=False)
    assert set(t["steps_to_target"]) == {str(int(b // 62)) for b in BATCHES}
    assert set(t["steps_to_target"]["4"]) == {"0", "1", "2"}
    for key in ("batch", "lr", "per_seed", "probability_fastest"):
        assert key in doc["recommendation"]


def test_b_simple_is_read_at_the_same_losses_from_the_best_lr_trials():
    """--noise: B_simple of the best-LR trial interpolated (log-log) at each crossing, and averaged up to it."""
    curves = _curves([0, 1])
    for c in curves:
        c.b_simple = [(e, 100.0 + e / 100.0) for e in np.geomspace(BUDGET / 100, BUDGET, 10)]  # rises along the run
    a = analyze_seeds(curves, settings=AnalysisSettings(n_targets=3))
    assert set(a.b_simple) == {t.target for t in a.targets}
    locals_ = [a.b_simple[t.target]["local"] for t in a.targets]
    assert locals_ == sorted(locals_)  # tighter targets are reached later, where B_simple is larger
    st = a.targets[0]
    e = float(np.median([st.examples[b][s] for b in st.steps for s in (0, 1)]))
    assert a.b_simple[st.target]["local"] == pytest.approx(100.0 + e / 100.0, rel=0.05)
    assert all(v["path_averaged"] is None or v["path_averaged"] <= v["local"] for v in a.b_simple.values())


def test_b_simple_is_none_where_the_crossing_lies_outside_the_readings():
    """No B_simple from a distant reading: a crossing after the last (unflagged) reading or before the first has
    none (taking the nearest reading there gave B_crit/B_simple factors of 7–17 on tinygpt). Readings that stop
    before every trial's crossing of the tightest target leave that target without a B_simple; the loosest,
    crossed inside the readings, keeps its log-log interpolation."""
    from globalbatch.critical.seeds import _b_simple_at

    c = synth_curve(500.0, 0)
    c.b_simple = [(100.0, 10.0), (1000.0, 100.0)]
    assert _b_simple_at(c, 50.0) == (None, None) and _b_simple_at(c, 2000.0) == (None, None)
    local, path = _b_simple_at(c, 10 ** 2.5)
    assert local == pytest.approx(10 ** 1.5, rel=1e-12) and path == 10.0
    curves = _curves([0, 1])
    a0 = analyze_seeds(curves, settings=AnalysisSettings(n_targets=3))
    loose, tight = a0.targets[0], a0.targets[-1]
    for c in curves:
        stop = 0.9 * tight.examples[c.batch_size][c.seed]  # every trial crosses the tightest target after it
        assert loose.examples[c.batch_size][c.seed] < stop
        c.b_simple = [(e, 100.0 + e / 100.0) for e in np.geomspace(stop / 100, stop, 10)]
    a = analyze_seeds(curves, settings=AnalysisSettings(n_targets=3))
    assert tight.target not in a.b_simple and loose.target in a.b_simple
    e = float(np.median([loose.examples[b][s] for b in loose.steps for s in (0, 1)]))
    assert a.b_simple[loose.target]["local"] == pytest.approx(100.0 + e / 100.0, rel=0.05)


def test_one_lr_per_batch_for_every_seed_not_each_seeds_lucky_best():
    """At the largest batch a second LR sits at the edge of stability: one seed gets lucky (0.6× the
    steps), the others pay 2×. Each seed's own best LR would give seed 0 the lucky curve and move its
    B_crit; the analysis uses the LR with the least median steps over seeds for every seed."""
    seeds = [0, 1, 2]
    curves = [synth_curve(b, s, factor=1.0, eval_sd=0.0) for b in BATCHES for s in seeds]
    curves += [synth_curve(4000.0, s, lr=2e-3, factor=0.6 if s == 0 else 2.0, eval_sd=0.0) for s in seeds]
    target = 2.6
    assert common_lr(curves, target) == {b: 1e-3 for b in BATCHES}
    st = target_over_seeds(curves, target)
    assert all(st.best_lr[4000.0][s] == 1e-3 for s in seeds)
    vals = [st.b_crit_per_seed[s] for s in seeds]
    assert max(vals) / min(vals) == pytest.approx(1.0, abs=1e-9)   # the same curves: the same B_crit
    assert vals[0] == pytest.approx(float(b_crit_true(target)), rel=0.05)
    # Seed 0 alone, free to pick its own best LR, takes the lucky curve: its B_crit moves by > 20 %.
    alone = target_over_seeds([c for c in curves if c.seed == 0], target)
    assert alone.best_lr[4000.0][0] == 2e-3
    assert abs(alone.b_crit_per_seed[0] / vals[0] - 1) > 0.2


def test_an_lr_that_leaves_seeds_behind_is_not_chosen():
    """An LR 0.8× faster on three seeds that never reaches the target on the other two must not win:
    it would keep only the lucky seeds in the fits."""
    seeds = [0, 1, 2, 3, 4]
    curves = [synth_curve(b, s, factor=1.0, eval_sd=0.0) for b in BATCHES for s in seeds]
    curves += [synth_curve(4000.0, s, lr=2e-3, factor=0.8 if s < 3 else 50.0, eval_sd=0.0) for s in seeds]
    target = 2.6
    st = target_over_seeds(curves, target)
    assert common_lr(curves, target)[4000.0] == 1e-3
    assert all(st.best_lr[4000.0][s] == 1e-3 for s in seeds) and all(st.monotone.values())


def test_the_primary_targets_lr_is_kept_at_every_target_and_targets_follow_it():
    """LR A is faster early, LR B faster at the tight targets: the analysis runs every target at B
    (the batch's one LR), and every batch × seed reaches every target at its LR."""
    seeds = [0, 1, 2]
    curves = [synth_curve(b, s, factor=1.0, eval_sd=0.0) for b in BATCHES for s in seeds]
    # A: 0.7× the steps early, but it stalls at a loss of 2.8 (a high LR's noise floor).
    for b in BATCHES:
        for s in seeds:
            c = synth_curve(b, s, lr=4e-3, factor=0.7, eval_sd=0.0)
            c.eval_loss[:] = np.maximum(c.eval_loss, 2.8)
            c.loss[:] = np.maximum(c.loss, 2.8)
            curves.append(c)
    a = analyze_seeds(curves, settings=AnalysisSettings(n_targets=4))
    assert a.targets[-1].target < 2.8 and a.targets[0].target > 2.8  # the range spans where A stalls
    for st in a.targets:
        assert all(st.best_lr[b][s] == 1e-3 for b in BATCHES for s in seeds), st.target
        assert all(st.steps[b][s] is not None for b in BATCHES for s in seeds)
    # Re-chosen at each target instead, A would win the loose targets:
    assert common_lr(curves, a.targets[0].target)[BATCHES[0]] == 4e-3


def test_one_step_trials_give_a_value_error_not_an_index_error():
    """A sweep so short that a trial made one step (issue found by review: IndexError in the
    training read-out's targets) is refused with a ValueError, which the CLI turns into a note."""
    one = [Curve(batch_size=b, lr=1e-3, examples=np.array([b]), loss=np.array([5.5]), seed=0) for b in (128.0, 256.0)]
    with pytest.raises(ValueError, match="no loss reading after its first step; raise the budget"):
        common_targets(one, readout="train")


def test_the_median_over_seeds_counts_a_seed_that_only_bounds_b_crit():
    """One seed at 60 and two whose B_crit only has a lower bound (> 128): the median is > 128, not 60 (the seeds with
    a point alone); two points and one bound keep a point; bounds on the far side of the middle do not move it."""
    from globalbatch.critical.seed_targets import censored_median

    assert censored_median([60.0], [("lower", 128.0), ("lower", 128.0)]) == (None, ("lower", 128.0))
    assert censored_median([60.0, 100.0], [("lower", 128.0)]) == (100.0, None)
    assert censored_median([60.0, 100.0, 110.0], [("upper", 20.0), ("lower", 500.0)]) == (100.0, None)
    assert censored_median([], [("upper", 20.0), ("upper", 30.0)]) == (None, ("upper", 25.0))
    assert censored_median([60.0], [("lower", 128.0)]) == (None, ("lower", 94.0))  # two seeds: the mean of the middle
    assert censored_median([70.0, 80.0], []) == (75.0, None) and censored_median([], []) == (None, None)


def test_a_target_whose_median_is_a_bound_says_so_in_the_json_and_has_no_interval():
    """Seeds whose steps still halve with the batch at every batch (B_crit far beyond): the per-seed values are lower
    bounds, the median is a bound, and no interval is stated around a point that is not there."""
    import json

    curves = [synth_curve(b, s, factor=(1 + 40 * b_crit_true(3.0) / b) / (1 + b_crit_true(3.0) / b)) for s in (0, 1, 2)
              for b in BATCHES]
    a = analyze_seeds(curves, settings=AnalysisSettings(n_targets=3))
    bounded = [t for t in a.targets if t.b_crit_median_bound is not None]
    assert bounded, [t.b_crit_text_per_seed for t in a.targets]
    t = bounded[0]
    assert t.b_crit is None and t.interval() is None and t.b_crit_median_bound[0] == "lower"
    assert t.median_text.startswith("> ") and "give only a lower bound" in t.median_text
    doc = json.loads(json.dumps(seed_analysis_json(a, lambda u: int(u)), allow_nan=False))
    row = next(r for r in doc["targets"] if r["target_loss"] == t.target)
    assert row["b_crit"] is None and row["b_crit_median_bound"][0] == "lower" and row["b_crit_interval"] is None
