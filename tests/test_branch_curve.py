"""B_crit(L) from the branch test at several points (lab/branch_stats.py: branch_curve) on synthetic losses with a known
B_crit(L), and the plumbing through a tiny real multi-point run and the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from globalbatch.lab.branch_stats import branch_curve

TOL = 0.01
BASE = 4  # samples per step of the base run; B_crit in samples here (base_batch_units = 4)


def true_b_crit(loss: float) -> float:
    return 24.0 * (loss / 3.0) ** -3.0


def synthetic(rng, losses, ks, *, seeds=6, seed_sd=0.03, noise_sd=0.002):
    """Per point: the k = 1 branches reach ``loss``; a k·B branch is worse by tol·(k·B / B_true(loss))², so
    exactly the tolerance at k·B = B_true (the branch test's definition), plus a per-seed effect shared by
    every k (same data) and independent noise."""
    out = {}
    for i, loss in enumerate(losses):
        shared = rng.normal(0.0, seed_sd, seeds)
        out[1000 * (i + 1)] = {k: loss + TOL * (k * BASE / true_b_crit(loss)) ** 2 - (TOL * (BASE / true_b_crit(loss)) ** 2)
                               + shared + rng.normal(0.0, noise_sd, seeds) for k in ks}
    return out


def test_curve_recovers_a_known_b_crit_of_the_loss():
    ks = list(range(1, 17))  # B = 4 … 64 in steps of 4: the grid's resolution is 4 samples
    losses = [3.3, 3.0, 2.7, 2.45]
    errors_k, covered = [], 0
    for rep in range(6):
        curve = branch_curve(synthetic(np.random.default_rng(rep), losses, ks), base_batch_units=BASE, tolerance=TOL,
                             n_boot=25, rng_seed=rep)
        assert [p.censored for p in curve.points] == [False] * 4
        for p, loss in zip(curve.points, losses):  # interpolated between the grid's batches: within a grid step
            on_grid = BASE * math.floor(true_b_crit(loss) / BASE)  # the largest grid batch within the tolerance
            assert abs(p.critical_k * BASE - on_grid) <= BASE and abs(p.b_crit_units - true_b_crit(loss)) < BASE, p
            assert p.loss == pytest.approx(loss, abs=0.05)  # the k = 1 branches' mean (the seed effect included)
        f = curve.fit
        assert f is not None and f.n_points == 4 and f.dof == 2 and len(f.boot_k) > 20
        errors_k.append(f.k + 3.0)
        lo, hi = f.interval(2.85)
        covered += lo <= true_b_crit(2.85) <= hi
        assert f.b_crit(2.85) == pytest.approx(true_b_crit(2.85), rel=0.2)
    assert abs(float(np.median(errors_k))) < 0.5 and max(abs(e) for e in errors_k) < 1.0
    assert covered >= 5  # the 95 % interval (covariance ∪ seed bootstrap) covers the truth


def test_a_point_at_the_largest_k_is_a_bound_left_out_of_the_fit():
    rng = np.random.default_rng(0)
    data = synthetic(rng, [3.3, 3.0, 2.45], [1, 2, 4, 8])  # B_crit(2.45) ≈ 44 > 8·4: every k passes there
    curve = branch_curve(data, base_batch_units=BASE, tolerance=TOL, n_boot=20)
    assert [p.censored for p in curve.points] == [False, False, True]
    assert curve.fit is not None and curve.fit.n_points == 2 and "left out" in curve.note
    assert "≥ 32" in curve.text()
    only_one = {p: v for p, v in data.items() if p != 1000}
    c1 = branch_curve(only_one, base_batch_units=BASE, tolerance=TOL, n_boot=20)
    assert c1.fit is None and "fewer than 2 points" in c1.note and "no fit" in c1.text()


def test_the_curve_is_in_the_result_json_and_the_text(tmp_path, capsys):
    """A tiny real run at 3 points (--points 3): the curve's plumbing, text and JSON (no claim about its values)."""
    from globalbatch.cli import main

    tiny = dict(n_layer=1, d_model=16, n_head=2, seq_len=16, max_corpus_bytes=100_000)
    args = ["branch", *[f"--task-arg={k}={v}" for k, v in tiny.items()], "--base-batch", "2", "--ks", "1,2",
            "--lr", "3e-3", "--warmup-tokens", "900", "--points", "3", "--window-tokens", "200", "--seeds", "2",
            "--threads", "1", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--json"])
    out = capsys.readouterr()
    assert exc.value.code == 0, out.err
    doc = json.loads(out.out)
    assert doc["config"]["branch_at"] == [300, 600, 900]
    curve = doc["curve"]
    assert [p["branch_at"] for p in curve["points"]] == [300, 600, 900]
    for p in curve["points"]:
        assert math.isfinite(p["loss"]) and p["critical_k"] in (1, 2) and p["b_crit_units"] > 0
    assert json.loads((tmp_path / "result.json").read_text())["curve"] == curve
    # every k = 1 branch evaluated half-way: the half-window rule re-decides without training
    assert all(math.isfinite(b["val_loss_mid"]) for b in doc["branches"] if b["k"] == 1)
    assert not any("val_loss_mid" in b for b in doc["branches"] if b["k"] > 1)
    from globalbatch.lab.branch import load_branch_results

    half = load_branch_results(tmp_path, tolerance_rule="half_window")
    for p in half.points:
        mids = [b["val_loss_mid"] - b["val_loss"] for b in half.branches if b["k"] == 1 and b["branch_at"] == p.branch_at]
        assert p.tolerance == pytest.approx(max(sum(mids) / len(mids), 0.0))
    assert "half-window rule" in half.text() and half.curve is not None
    with pytest.raises(SystemExit) as exc:
        main(args)
    text = capsys.readouterr().out
    assert exc.value.code == 0 and "B_crit(L) over 3 branch points" in text
    with pytest.raises(SystemExit) as exc:  # --points with a list of branch points: one line naming --points
        main([*args[:-2], "--warmup-tokens", "600,900", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("error: --points") and err.count("\n") == 1


def test_the_half_window_rule_reads_mccandlish_b_crit():
    """Losses from McCandlish et al.'s model: over a window of W examples a branch at batch b makes the progress of
    W·(1 + B/B_crit)/(1 + b/B_crit) small-batch examples on a convex loss curve L(e). With the k = 1 branches'
    drop over the window's second half as the tolerance, the curve's B_crit is the model's (the grid 4 … 128)."""
    def loss_at(e):
        return 1.0 + 2.0 / (1.0 + e / 2000.0)

    rng = np.random.default_rng(1)
    ks = list(range(1, 33))
    for b_crit in (24.0, 48.0, 96.0):
        for start, window in ((500, 400), (2000, 800), (6000, 2000)):
            def eff(b):
                return window * (1 + BASE / b_crit) / (1 + b / b_crit)

            shared = rng.normal(0.0, 0.01, 4)
            losses = {k: (loss_at(start + eff(k * BASE)) + shared + rng.normal(0.0, 5e-4, 4)).tolist() for k in ks}
            mid = loss_at(start + eff(BASE) / 2) + shared + rng.normal(0.0, 5e-4, 4)
            curve = branch_curve({start: losses}, base_batch_units=BASE, n_boot=0,
                                 drops_by_point={start: (mid - np.asarray(losses[1])).tolist()})
            (p,) = curve.points
            assert not p.censored and 0.9 * b_crit <= p.b_crit_units <= 1.25 * b_crit, (b_crit, start, p)
            # the fixed tolerance of Merrill et al. reads another batch, one that moves with the window and the slope
    fixed = branch_curve({start: losses}, base_batch_units=BASE, tolerance=TOL, n_boot=0).points[0]
    assert fixed.b_crit_units < 0.5 * b_crit


def test_window_fraction_gives_each_point_its_own_window(tmp_path):
    from globalbatch.lab.branch import BranchConfig, run_branch_test

    tiny = dict(n_layer=1, d_model=16, n_head=2, seq_len=16, max_corpus_bytes=100_000)
    cfg = BranchConfig(task="tinygpt", task_overrides=tiny, base_batch=2, ks=[1, 2], lr=3e-3, branch_at=[300, 1200],
                       window=1, window_fraction=0.5, seeds=2, max_val_samples=16)
    res = run_branch_test(cfg, tmp_path, threads=1, progress=False)
    ups = res.window_units / res.window_samples
    assert res.window_samples_by_point == {p: cfg.window_samples(ups, p) for p in (300, 1200)}
    w300, w1200 = res.window_samples_by_point[300], res.window_samples_by_point[1200]
    assert w300 % 4 == 0 and w1200 % 4 == 0 and w1200 > 2 * w300  # a quarter of the units → a quarter of the window
    assert 0.5 * 300 <= w300 * ups < 0.5 * 300 + 4 * ups  # rounded up to a multiple of max k × base batch
    for b in res.branches:
        assert b["window_samples"] == res.window_samples_by_point[b["branch_at"]] == b["samples"]
    assert "window 0.5 × each point's tokens" in res.text()
    with pytest.raises(ValueError, match="window_fraction"):
        BranchConfig(branch_at=[300], window=1, window_fraction=0.0)


def test_split_second_moment_divides_only_the_noise_share():
    """AdamW's own state after 400 steps on gradients g + σ·ε, three tensors of 2,000 coordinates: pure signal keeps
    its second moment (= keep), pure noise is divided by k (= scaled), a mix with g² = σ²/4 keeps g² and divides σ²."""
    import torch

    from globalbatch.lab.branch import split_second_moment

    torch.manual_seed(0)
    n, k = 2000, 8
    ws = [torch.nn.Parameter(torch.zeros(n)) for _ in range(3)]
    opt = torch.optim.AdamW(ws, lr=1e-3, betas=(0.9, 0.95))
    for _ in range(400):
        for w, g, sigma in zip(ws, (1.0, 0.0, 0.5), (0.0, 1.0, 1.0)):
            w.grad = g + sigma * torch.randn(n)
        opt.step()
    ratio = []
    for w in ws:
        before = float(opt.state[w]["exp_avg_sq"].sum())
        split_second_moment(opt.state[w], k, opt.param_groups[0]["betas"])
        ratio.append(float(opt.state[w]["exp_avg_sq"].sum()) / before)
    assert ratio[0] == pytest.approx(1.0, abs=1e-3)  # signal only: kept
    assert ratio[1] == pytest.approx(1 / k, rel=0.05)  # noise only: ÷ k
    assert ratio[2] == pytest.approx((0.25 + 1 / k) / 1.25, rel=0.05)  # mixed: g² kept, σ² ÷ k
    with pytest.raises(ValueError, match="split"):
        split_second_moment({"exp_avg_sq": torch.ones(2)}, k, (0.9, 0.95))


def test_second_moment_scaled_changes_only_the_k_above_1_branches(tmp_path):
    from globalbatch.lab.branch import BranchConfig, run_branch_test

    tiny = dict(n_layer=1, d_model=16, n_head=2, seq_len=16, max_corpus_bytes=100_000)
    kw = dict(task="tinygpt", task_overrides=tiny, base_batch=2, ks=[1, 2], lr=3e-3, branch_at=[300], window=200,
              seeds=2, max_val_samples=16)
    keep = run_branch_test(BranchConfig(**kw), tmp_path / "keep", threads=1, progress=False)
    scaled = run_branch_test(BranchConfig(**kw, second_moment="scaled"), tmp_path / "scaled", threads=1,
                             progress=False)
    a = {(b["k"], b["seed"]): b["val_loss"] for b in keep.branches}
    b = {(r["k"], r["seed"]): r["val_loss"] for r in scaled.branches}
    assert all(a[(1, s)] == b[(1, s)] for s in (0, 1))  # k = 1 untouched, bit for bit
    assert all(a[(2, s)] != b[(2, s)] for s in (0, 1))  # k = 2 starts from exp_avg_sq / 2
    split = run_branch_test(BranchConfig(**kw, second_moment="split"), tmp_path / "split", threads=1, progress=False)
    c = {(r["k"], r["seed"]): r["val_loss"] for r in split.branches}
    assert all(a[(1, s)] == c[(1, s)] for s in (0, 1)) and all(c[(2, s)] not in (a[(2, s)], b[(2, s)]) for s in (0, 1))
    assert "second_moment" not in json.loads((tmp_path / "keep" / "manifest.json").read_text())["branch"]
    with pytest.raises(ValueError, match="second_moment"):
        BranchConfig(**kw, second_moment="reset")


def test_half_window_below_the_base_batch_is_an_upper_bound():
    """Every k > 1 fails by far: the crossing lies between k = 1 and 2, so B_crit = (k* − 2)·B ≤ 0 — read as '<'."""
    losses = {1: [3.00, 3.01, 2.99], 2: [3.30, 3.31, 3.29], 4: [3.60, 3.61, 3.59]}
    curve = branch_curve({100: losses, 200: losses}, base_batch_units=BASE, n_boot=0,
                         drops_by_point={100: [0.05, 0.05, 0.05], 200: [0.05, 0.05, 0.05]})
    assert [(p.bound, p.censored, p.b_crit_units) for p in curve.points] == [("<", True, BASE)] * 2
    assert curve.fit is None and "< 4" in curve.text()
