"""branch.py: the test's error rates on synthetic losses with known truth, and a tiny real branch run."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from globalbatch.lab.branch import BranchConfig, branch_verdicts, load_branch_results, run_branch_test

TOL = 0.01


def simulate(rng, true_diffs: dict[int, float], *, n=5, seed_sd=0.05, noise_sd=0.01):
    """Losses per k and seed: a shared per-seed effect (same data for every k) plus independent noise."""
    seed_effect = rng.normal(0.0, seed_sd, n)
    return {k: 3.0 + d + seed_effect + rng.normal(0.0, noise_sd, n) for k, d in true_diffs.items()}


@pytest.mark.parametrize("test", ["paired", "welch"])
def test_false_alarm_rate_at_the_tolerance_boundary_is_alpha(test):
    """True difference = tolerance exactly (the edge of H0): 'worse' in ~5% of 1,000 replicates."""
    rng = np.random.default_rng(0)
    worse = 0
    for _ in range(1000):
        v = branch_verdicts(simulate(rng, {1: 0.0, 2: TOL}, seed_sd=0.0), tolerance=TOL, alpha=0.05, test=test)
        worse += v.per_k[1].worse
    assert 0.03 <= worse / 1000 <= 0.07


def test_upper_bound_covers_the_true_difference_at_its_level():
    rng = np.random.default_rng(1)
    covered = sum(
        branch_verdicts(simulate(rng, {1: 0.0, 4: 0.03}), tolerance=TOL, alpha=0.05).per_k[1].upper >= 0.03
        for _ in range(1000)
    )
    assert 0.92 <= covered / 1000 <= 0.98


def test_critical_k_recovers_known_truth():
    rng = np.random.default_rng(2)
    # k ≤ 4 as good as k = 1, k = 8 worse by 0.08: critical k = 4. A k passes only when its
    # mean difference is also within the tolerance, so the noise must resolve 0.002 vs 0.01.
    truth = {1: 0.0, 2: 0.0, 4: 0.002, 8: 0.08}
    hits = [branch_verdicts(simulate(rng, truth, noise_sd=0.005), tolerance=TOL).critical_k for _ in range(100)]
    assert np.mean(np.array(hits) == 4) >= 0.9
    v = branch_verdicts(simulate(rng, truth), tolerance=TOL)
    assert [x.k for x in v.per_k] == [1, 2, 4, 8] and v.per_k[0].status == "reference"


def test_a_worse_small_k_stops_the_scan():
    losses = {1: [3.0, 3.01, 2.99], 2: [3.2, 3.21, 3.19], 4: [3.0, 3.01, 2.99]}
    v = branch_verdicts(losses, tolerance=TOL)
    assert v.critical_k == 1 and v.per_k[1].worse and not v.per_k[2].worse


def test_paired_test_uses_the_shared_data_order():
    """A seed effect 5× the k effect hides a real 0.05 loss increase from Welch but not from the paired test."""
    rng = np.random.default_rng(3)
    paired = welch = 0
    for _ in range(200):
        losses = simulate(rng, {1: 0.0, 2: 0.05}, n=4, seed_sd=0.25, noise_sd=0.01)
        paired += branch_verdicts(losses, tolerance=TOL, test="paired").per_k[1].worse
        welch += branch_verdicts(losses, tolerance=TOL, test="welch").per_k[1].worse
    assert paired / 200 > 0.9 and welch / 200 < 0.2


def test_three_states_and_conservative_critical_k():
    # Same mean, tiny noise: shown within tolerance. Large noise, same mean: inconclusive, not worse.
    tight = {1: [3.0, 3.001, 2.999, 3.0], 2: [3.0, 3.001, 2.999, 3.0005]}
    loose = {1: [3.0, 3.1, 2.9, 3.0], 2: [3.05, 2.9, 3.1, 2.95]}
    assert branch_verdicts(tight, tolerance=TOL).per_k[1].status == "within tolerance"
    v = branch_verdicts(loose, tolerance=TOL)
    assert v.per_k[1].status == "inconclusive" and v.critical_k == 2 and v.critical_k_shown == 1


def test_identical_losses_do_not_divide_by_zero():
    v = branch_verdicts({1: [3.0, 3.0], 2: [3.0, 3.0]}, tolerance=TOL)
    assert v.critical_k == 2 and v.per_k[1].status == "within tolerance" and math.isinf(v.per_k[1].t)


def test_config_errors_name_fields():
    base = dict(branch_at=[1000], window=1000)
    with pytest.raises(ValueError, match="ks \\[2, 4\\] is not allowed"):
        BranchConfig(ks=[2, 4], **base)
    with pytest.raises(ValueError, match="seeds 1 is not allowed"):
        BranchConfig(seeds=1, **base)
    with pytest.raises(ValueError, match="metric 'ema' is not allowed; allowed: val, train"):
        BranchConfig(metric="ema", **base)
    assert BranchConfig(lr=1e-3, **base).lr_for(4) == pytest.approx(2e-3)  # Adam: √k
    assert BranchConfig(lr=1e-3, optimizer="sgd", **base).lr_for(4) == pytest.approx(4e-3)  # SGD: k


TINY = dict(n_layer=1, d_model=16, n_head=2, seq_len=16, max_corpus_bytes=100_000)


def test_tiny_branch_run_resume_and_redecide(tmp_path):
    cfg = BranchConfig(task="tinygpt", task_overrides=TINY, base_batch=4, ks=[1, 2], lr=3e-3, branch_at=[600, 1200],
                       window=600, seeds=2, max_val_samples=16)
    res = run_branch_test(cfg, tmp_path, threads=1, progress=False)
    assert [p.branch_at for p in res.points] == [600, 1200] and len(res.branches) == 2 * 2 * 2
    assert (tmp_path / "base" / "ckpt_600.pt").is_file() and (tmp_path / "base" / "ckpt_1200.pt").is_file()
    by = {(b["branch_at"], b["k"], b["seed"]): b for b in res.branches}
    for (p, k, s), b in by.items():
        assert b["lr"] == pytest.approx(3e-3 * math.sqrt(k))
        assert b["units"] >= 600 and b["batch"] == 4 * k and math.isfinite(b["val_loss"])
        # Same seed → same data: the k=2 branch consumed exactly the k=1 branch's samples.
        assert b["samples"] == by[(p, 1, s)]["samples"] and b["samples_sha1"] == by[(p, 1, s)]["samples_sha1"]
    assert all(p.critical_k in (1, 2) for p in res.points) and res.compute_s > 0
    # Resume: nothing is retrained; changed run settings are an error; decisions can be redone.
    again = run_branch_test(cfg, tmp_path, threads=1, progress=False)
    assert again.compute_s == pytest.approx(res.compute_s)
    assert [b["val_loss"] for b in again.branches] == [b["val_loss"] for b in res.branches]
    with pytest.raises(ValueError, match="window: 600 -> 900"):
        run_branch_test(BranchConfig(**{**cfg.__dict__, "window": 900}), tmp_path, progress=False)
    redecided = load_branch_results(tmp_path, tolerance=0.0, alpha=0.5)
    assert redecided.config.alpha == 0.5 and json.loads((tmp_path / "result.json").read_text())["config"]["alpha"] == 0.5
    # Losing the later checkpoint and its branches: the base run resumes from ckpt_600 and
    # reproduces them exactly (model, Adam state, driver counters, data position restored).
    (tmp_path / "base" / "ckpt_1200.pt").unlink()
    for f in (tmp_path / "branches").glob("p1200_*.json"):
        f.unlink()
    redone = run_branch_test(cfg, tmp_path, threads=1, progress=False)
    assert {b["name"]: b["val_loss"] for b in redone.branches} == {b["name"]: b["val_loss"] for b in res.branches}


def test_cli_branch(tmp_path, capsys):
    from globalbatch.cli import main

    args = ["branch", *[f"--task-arg={k}={v}" for k, v in TINY.items()], "--base-batch", "4", "--ks", "1,2", "--lr", "3e-3",
            "--warmup-tokens", "600", "--window-tokens", "400", "--seeds", "2", "--threads", "1", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exc:
        main(args)
    out = capsys.readouterr()
    assert exc.value.code == 0, out.err
    assert "critical k = " in out.out and (tmp_path / "result.json").is_file()
    with pytest.raises(SystemExit) as exc:
        main(["branch", "--ks", "2,4", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2 and capsys.readouterr().err.startswith("error: --ks 2,4 is not allowed; allowed: ")
    # More seeds on a rerun: only the new seed's branches train, the finished ones are reused.
    before = {f.name: f.stat().st_mtime_ns for f in (tmp_path / "branches").glob("*.json")}
    more = list(args)
    more[more.index("--seeds") + 1] = "3"
    with pytest.raises(SystemExit) as exc:
        main(more)
    out = capsys.readouterr()
    assert exc.value.code == 0, out.err
    after = {f.name: f.stat().st_mtime_ns for f in (tmp_path / "branches").glob("*.json")}
    assert {n: t for n, t in after.items() if n in before} == before and sorted(set(after) - set(before)) == \
        ["p600_k1_s2.json", "p600_k2_s2.json"]
    assert "3 seeds" in out.out
    assert load_branch_results(tmp_path).points[0].verdicts[0].n == 3
    assert load_branch_results(tmp_path, seeds=2).points[0].verdicts[0].n == 2  # a subset of the seeds


def test_cli_branch_checks_everything_before_writing(tmp_path, capsys):
    """--threads 0 and a bad --task-arg: one error line, exit 2, no manifest (the corrected rerun is not refused)."""
    from globalbatch.cli import main

    base = ["branch", "--task", "mnist", "--out", str(tmp_path / "b")]
    for extra, want in [(["--threads", "0"], "error: --threads 0 is not allowed; allowed: a whole number ≥ 1"),
                        (["--task-arg", "hiden=3"], "error: --task-arg hiden=3 is not allowed"),
                        (["--warmup-tokens", "0"], "error: --warmup-tokens 0 is not allowed"),
                        (["--seeds", "1"], "error: --seeds 1 is not allowed"),
                        (["--micro-batch", "0"], "error: --micro-batch 0 is not allowed; allowed: a whole number ≥ 1")]:
        with pytest.raises(SystemExit) as exc:
            main(base + extra)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.startswith(want) and len(err.strip().splitlines()) == 1, (extra, err)
        assert not (tmp_path / "b" / "manifest.json").exists()
    with pytest.raises(ValueError, match="threads 0 is not allowed"):
        run_branch_test(BranchConfig(branch_at=[1000], window=1000), tmp_path / "c", threads=0, progress=False)
    assert not (tmp_path / "c").exists()


def test_a_mean_beyond_tolerance_fails_even_when_not_significant():
    """The reviewer's example: k = 2 is 0.05 (5× the tolerance) worse on average, p ≥ alpha with 3 seeds."""
    v = branch_verdicts({1: [3, 3, 3], 2: [3.15, 2.96, 3.04], 4: [3, 3, 3.01]}, tolerance=0.01)
    k2 = v.per_k[1]
    assert k2.diff == pytest.approx(0.05) and k2.p_value >= 0.05 and not k2.worse
    assert k2.status == "beyond tolerance (not significant)" and not k2.passes
    assert v.critical_k == 1  # stops at the first failing k, not 4
    assert v.per_k[2].passes  # k = 4 itself is within tolerance, but the scan has stopped
    # A better large batch (negative difference) passes.
    better = branch_verdicts({1: [3.0, 3.01, 2.99], 2: [2.9, 2.91, 2.89]}, tolerance=TOL)
    assert better.critical_k == 2 and better.per_k[1].passes


def test_branch_points_inside_the_base_warmup_are_an_error():
    with pytest.raises(ValueError, match=r"branch_at \[100\] is not allowed \(inside the warmup"):
        BranchConfig(branch_at=[100, 10_000], window=1000, base_warmup_fraction=0.05)
    assert BranchConfig(branch_at=[500, 10_000], window=1000).base_warmup_units() == 500


def test_window_is_counted_in_samples_rounded_to_the_largest_step():
    cfg = BranchConfig(base_batch=4, ks=[1, 2, 8], branch_at=[600], window=700)
    assert cfg.window_samples(1.0) == 704  # 700 → a multiple of 8 × 4 = 32
    assert cfg.window_samples(16.0) == 64  # 700 tokens / 16 = 44 samples → 64


def test_every_branch_trains_on_the_same_samples(tmp_path):
    """Repro: base 4, ks 1/2/8, window 700 gave 704 / 768 / 1,024 units; now all branches of a seed are identical."""
    cfg = BranchConfig(task="tinygpt", task_overrides=TINY, base_batch=4, ks=[1, 2, 8], lr=3e-3, branch_at=[600],
                       window=700, seeds=2, max_val_samples=16)
    res = run_branch_test(cfg, tmp_path, threads=1, progress=False)
    ups = json.loads((tmp_path / "base" / "base.json").read_text())["units_per_sample"]
    assert res.window_samples == cfg.window_samples(ups) and res.window_samples % 32 == 0
    assert res.window_samples * ups >= 700
    for s in range(2):
        rows = [b for b in res.branches if b["seed"] == s]
        assert len({b["samples"] for b in rows}) == 1 and rows[0]["samples"] == res.window_samples
        assert len({b["units"] for b in rows}) == 1
        assert len({b["samples_sha1"] for b in rows}) == 1
        assert {b["k"]: b["steps"] for b in rows} == {k: res.window_samples // (4 * k) for k in (1, 2, 8)}
    assert "rounded up to a multiple of max k × base batch = 32" in res.text()


def test_verdicts_refuse_bad_losses_naming_the_field():
    from globalbatch.errors import SettingError

    for losses, test, field, text in (
            ({2: [3.0, 3.1]}, "paired", "losses", "with k = 1 among the keys"),
            ({1: [3.0, 3.1], 2: [3.0, 3.1]}, "anova", "test", "paired, welch"),
            ({1: [3.0, 3.1], 2: [3.0]}, "welch", "losses", "1 value(s) at k = 2"),
            ({1: [3.0, 3.1], 2: [3.0, 3.1, 3.2]}, "paired", "losses", "3 values at k = 2, 2 at k = 1")):
        with pytest.raises(SettingError, match=re.escape(text)) as err:
            branch_verdicts(losses, test=test)
        assert err.value.field == field
