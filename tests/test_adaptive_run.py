"""lab/adaptive_run + adaptive_report + the `globalbatch adaptive` command, on a tiny tinygpt."""

from __future__ import annotations

import json
import math

import pytest
import torch

from globalbatch._util import SettingError, read_jsonl
from globalbatch.lab.adaptive_run import (
    AdaptiveConfig,
    _crossing,
    _front_units,
    _t_interval,
    analyze_adaptive,
    eval_points,
    pareto_front,
    run_adaptive,
)

TINY = dict(n_layer=1, d_model=16, n_head=2, seq_len=16, max_corpus_bytes=100_000)
TINY_ARGS = [f"--task-arg={k}={v}" for k, v in TINY.items()]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(**kw) -> AdaptiveConfig:
    base = dict(task_overrides=TINY, batches=[4, 8, 16], budget=3000, seeds=[1, 2], micro_batch=4, base_batch=8,
                decide_every=2, min_interval_steps=2, patience=1, eval_points=6, max_val_samples=16)
    base.update(kw)
    return AdaptiveConfig(**base)


def test_crossing_interpolates_units_and_steps():
    ev = [{"consumed": 0, "step": 0, "val_loss": 5.0}, {"consumed": 100, "step": 10, "val_loss": 4.0},
          {"consumed": 300, "step": 20, "val_loss": 3.0}]
    assert _crossing(ev, 3.5) == (200.0, 15.0)
    assert _crossing(ev, 5.5) == (0.0, 0.0)
    assert all(math.isnan(v) for v in _crossing(ev, 2.0))


def test_t_interval_matches_the_closed_form():
    from scipy import stats

    v = [1.0, 2.0, 4.0]
    d = _t_interval(v)
    import statistics

    half = stats.t.ppf(0.975, 2) * statistics.stdev(v) / math.sqrt(3)
    assert d["mean"] == pytest.approx(7 / 3, rel=1e-12) and d["high"] - d["mean"] == pytest.approx(half, rel=1e-9)
    g = _t_interval(v, log=True)
    assert g["mean"] == pytest.approx(2.0, rel=1e-12)  # geometric mean of 1, 2, 4
    assert math.isnan(_t_interval([1.0, math.nan])["mean"])


def test_front_units_is_log_log_interpolation_on_the_pareto_front():
    pts = [(100.0, 1000.0), (25.0, 4000.0), (60.0, 5000.0), (math.nan, 1.0)]  # (60, 5000) is dominated
    assert pareto_front(pts) == [(25.0, 4000.0), (100.0, 1000.0)]
    assert _front_units(pts, 50.0) == pytest.approx(2000.0, rel=1e-12)  # E ∝ 1/S between the points
    assert _front_units(pts, 100.0 * (1 + 1e-8)) == 1000.0  # beyond the end point: flat
    assert _front_units(pts, 10.0) == 4000.0 and math.isnan(_front_units(pts, math.nan))


def test_eval_points_are_log_spaced_and_end_at_the_budget():
    p = eval_points(300_000, 24)
    assert p[-1] == 300_000 and p == sorted(set(p)) and len(p) == 24
    assert p[0] == round(300_000 / 64)


def test_throughput_from_a_sweep_timing_pass(tmp_path):
    from globalbatch._util import atomic_write_json
    from globalbatch.lab.adaptive_run import throughput_from_timing
    from globalbatch.lab.sweep.timing import timing_path

    for b, secs in ((4, 2.0), (8, 2.5)):
        atomic_write_json(timing_path(tmp_path, b), {"batch": b, "units": 8 * b * 64, "steps": 8, "seconds": secs})
    assert throughput_from_timing(tmp_path) == {4: 16.0, 8: 25.6}  # samples/s = steps × batch / seconds
    with pytest.raises(SettingError, match="throughput_from"):
        throughput_from_timing(tmp_path / "none")


def test_config_errors_name_the_field():
    with pytest.raises(SettingError, match="initial_batch 6 is not allowed"):
        tiny(initial_batch=6)  # not a power of two
    with pytest.raises(SettingError, match="initial_batch 1 is not allowed"):
        tiny(initial_batch=1, batches=[1, 2])
    assert tiny().start_batch == 4 and tiny().adaptive_micro_batch == 2 and tiny(initial_batch=8).adaptive_micro_batch == 4
    with pytest.raises(SettingError, match="policy 'magic' is not allowed"):
        tiny(policy="magic")
    with pytest.raises(SettingError, match="seeds"):
        tiny(seeds=[1, 1])


def test_run_resume_policy_dirs_and_report(tmp_path):
    out = tmp_path / "a"
    cfg = tiny()
    r = run_adaptive(cfg, out, threads=1)
    assert len(r.ran) == 8 and not r.skipped
    # rerun: nothing trained again; another c reuses the fixed runs and trains only its adaptive arm
    assert run_adaptive(cfg, out, threads=1).ran == []
    r2 = run_adaptive(tiny(c=50.0), out, threads=1)
    assert sorted(r2.ran) == ["adaptive/s1", "adaptive/s2"] and len(r2.skipped) == 6
    dirs = sorted(p.name for p in (out / "runs").iterdir())
    assert dirs == sorted(["b4", "b8", "b16", tiny().adaptive_dir(), tiny(c=50.0).adaptive_dir()])
    # a second comparison into a directory in use is refused (the run-directory lock)
    from globalbatch.lab.rundir import lock_run_dir

    with lock_run_dir(out):
        with pytest.raises(SettingError, match="out"):
            run_adaptive(cfg, out, threads=1)
    # a setting that changes the fixed runs is refused, naming the difference
    with pytest.raises(SettingError, match="budget: 3000 -> 4000"):
        run_adaptive(tiny(budget=4000), out, threads=1)
    # c=50 grows the batch; every change is feasible and logged with its reason, batch never shrinks
    a = analyze_adaptive(out, policy={"c": 50.0})
    for seed, chs in a.changes.items():
        assert chs, seed
        assert all(ch["new_batch"] in (8, 16) and ch["new_batch"] > ch["old_batch"] for ch in chs)
        assert all("grow" in ch["reason"] for ch in chs)
    for seed in a.seeds:
        evals = a.curves["adaptive"][seed]
        assert evals[-1]["consumed"] >= 3000 and evals[-1]["batch"] in (8, 16)
    # an adaptive arm that never changes is the fixed run of its first batch (same init, data, LR), up to the
    # micro-batch split (2 vs 4 samples): equal within float32 summation-order noise
    with pytest.raises(SettingError, match="no seed has all arms"):
        analyze_adaptive(out, policy={"c": 1e-3})  # not run yet
    run_adaptive(tiny(c=1e-3), out, threads=1)
    a0 = analyze_adaptive(out, policy={"c": 1e-3})
    for seed in a0.seeds:
        assert a0.changes[seed] == []
        got = [e["val_loss"] for e in a0.curves["adaptive"][seed]]
        want = [e["val_loss"] for e in a0.curves["b4"][seed]]
        assert got == pytest.approx(want, rel=1e-5, abs=0)
    assert a0.best_fixed in ("b4", "b8", "b16") and "over 2 seeds" in a0.verdict


def _cli(argv, capsys):
    from globalbatch.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_cli_adaptive_writes_the_report(tmp_path, capsys):
    out = tmp_path / "cli"
    code, so, se = _cli(["adaptive", *TINY_ARGS, "--batches", "4,8,16", "--tokens", "2K", "--seeds", "1,2",
                         "--c", "50", "--decide-every", "2", "--min-interval", "2", "--patience", "1",
                         "--threads", "1", "--out", str(out)], capsys)
    assert code == 0, se
    assert "best fixed batch by tokens" in so and "adaptive / best fixed" in so
    rep = out / "report"
    for f in ("loss_vs_tokens.png", "loss_vs_steps.png", "batch_over_time.png", "steps_vs_tokens.png", "report.md"):
        assert (rep / f).is_file() and (rep / f).stat().st_size > 0, f
    res = json.loads((rep / "result.json").read_text())["targets"]
    assert len(res) == 2 and res[0]["target"] <= res[1]["target"]  # "half" is no looser than "all"
    assert set(res[0]["arms"]) == {"b4", "b8", "b16", "adaptive"} and res[0]["seeds"] == [1, 2]
    md = (rep / "report.md").read_text()
    assert "Verdict" in md and "| adaptive |" in md and "→ 16" in md
    recs = read_jsonl(next((out / "runs").glob("adaptive-*")) / "s1" / "metrics.jsonl")
    assert any(r["kind"] == "change" for r in recs)


def test_cli_adaptive_bad_input_is_one_line_exit_2(tmp_path, capsys):
    cases = {("--c", "-1"): "error: --c -1 is not allowed; allowed: a finite number > 0",
             ("--lr-rule", "cube"): "error: --lr-rule 'cube' is not allowed; allowed: sqrt, linear, adascale, none",
             ("--policy", "magic"): "error: --policy 'magic' is not allowed; allowed: noise, goodput or package.module:function",
             ("--initial-batch", "6"): "error: --initial-batch 6 is not allowed",
             ("--target", "-2"): "error: --target -2 is not allowed; allowed: a finite held-out loss > 0",
             ("--optimizer", "rmsprop"): "error: --optimizer 'rmsprop' is not allowed; allowed: ",
             ("--tokens", "0"): "error: --tokens 0 is not allowed",
             ("--min-interval", "-1"): "error: --min-interval -1 is not allowed",
             ("--lr-base-batch", "0"): "error: --lr-base-batch 0 is not allowed",
             ("--throughput-from", str(tmp_path / "nosweep")): "error: --throughput-from"}
    for (flag, value), want in cases.items():
        code, _, err = _cli(["adaptive", *TINY_ARGS, flag, value, "--out", str(tmp_path / "x")], capsys)
        assert code == 2 and err.strip().startswith(want) and len(err.strip().splitlines()) == 1, (flag, err)
    assert not (tmp_path / "x").exists()
