"""sweep.py: a tiny real sweep, kill -9 mid-trial and resume, manifest checks, file safety."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from conftest import children_of

from globalbatch.lab.rundir import pid_alive

from globalbatch import validate as V
from globalbatch._util import atomic_write_json, read_jsonl
from globalbatch.critical import AnalysisSettings
from globalbatch.errors import SettingError
from globalbatch.lab.sweep import SweepConfig, analyze_sweep, load_sweep, run_sweep, run_trial

REPO = Path(__file__).resolve().parents[1]

# A model of a few thousand parameters on 100 KB of source: a trial takes well under a second.
TINY = dict(n_layer=1, d_model=16, n_head=2, seq_len=16, max_corpus_bytes=100_000)


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def tiny_config(**kw) -> SweepConfig:
    base = dict(task="tinygpt", task_overrides=TINY, batches=[4, 8], lrs=[1e-3, 3e-3], budget=6000,
                max_val_samples=16, eval_every=2000, lr_rule="none", lr_edge_extend=0)
    base.update(kw)
    return SweepConfig(**base)


TIMING_KEYS = {"units_per_s", "train_time_s"}


def numeric_records(trial_dir: Path) -> list[dict]:
    """The step/eval records without timing fields (the reproducible part of a trial)."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_jsonl(trial_dir / "metrics.jsonl")
            if r["kind"] != "header"]


# --- config and parsing ------------------------------------------------------------


def test_config_errors_name_field_and_value():
    with pytest.raises(ValueError, match=r"batches \[4, 4\] is not allowed; allowed: distinct whole numbers ≥ 1"):
        tiny_config(batches=[4, 4])
    with pytest.raises(ValueError, match="lrs"):
        tiny_config(lrs=[-1.0])
    with pytest.raises(ValueError, match="budget 0 is not allowed"):
        tiny_config(budget=0)
    with pytest.raises(ValueError, match="micro_batch 3 is not allowed"):
        tiny_config(micro_batch=3)
    with pytest.raises(ValueError, match="optimizer 'lion' is not allowed; allowed: adamw, sgd, lars, lamb"):
        tiny_config(optimizer="lion")
    assert tiny_config(batches=[4, 48], micro_batch=16).micro_batch_for(48) == 16
    assert tiny_config(batches=[4, 24]).micro_batch_for(24) == 8  # gcd(24, 16)
    assert tiny_config().micro_batch_for(4) == 4


def test_parse_helpers():
    assert V.count_list("16,32, 1K", "batches") == [16, 32, 1000]
    assert V.number_list("3e-4,1e-3", "lrs") == [3e-4, 1e-3]
    with pytest.raises(SettingError, match="^lrs 'fast' is not allowed"):
        V.number_list("1e-3,fast", "lrs")
    with pytest.raises(SettingError, match="^batches -16 is not allowed; allowed: whole numbers ≥ 1"):
        V.count_list("8,-16", "batches")
    with pytest.raises(SettingError, match="^batches 0 is not allowed"):
        V.count_list("0", "batches")
    assert V.seed_list("0,1, 2") == [0, 1, 2]
    for bad in ("0,0", "-1", "x", ""):
        with pytest.raises(SettingError, match="^seeds .* is not allowed; allowed: distinct whole numbers ≥ 0"):
            V.seed_list(bad)
    assert V.key_values(["d_model=64", "corpus_dir=/x"]) == {"d_model": 64, "corpus_dir": "/x"}
    with pytest.raises(SettingError, match="KEY=VALUE"):
        V.key_values(["d_model"])


def test_read_jsonl_drops_a_torn_last_line_and_atomic_write_leaves_no_tmp(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"a": 1}\n{"a": 2}\n{"a": 3')  # the third write was cut by a kill
    assert read_jsonl(p) == [{"a": 1}, {"a": 2}]
    atomic_write_json(tmp_path / "s.json", {"x": 1})
    assert json.loads((tmp_path / "s.json").read_text()) == {"x": 1}
    assert sorted(f.name for f in tmp_path.iterdir()) == ["m.jsonl", "s.json"]


# --- a real sweep -------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_sweep(tmp_path_factory):
    """An uninterrupted tiny sweep, in-process, 1 thread (the kill test compares against it)."""
    out = tmp_path_factory.mktemp("ref")
    t0 = time.time()
    res = run_sweep(tiny_config(), out, workers=1, threads=1, progress=False)
    return out, res, time.time() - t0


def test_progress_prints_a_line_per_finished_trial_and_keeps_bars_only_for_running_ones(tmp_path, capsys):
    """The display holds the overall bar and the running trials' bars (not one per cell: rendering 45 bars on a
    terminal took a fifth of a core from the trials); each finished trial gets one printed line."""
    res = run_sweep(tiny_config(), tmp_path / "p", workers=1, threads=1, progress=True, timing_steps=0)
    err = capsys.readouterr().err
    names = sorted(res.ran)
    assert len(names) == 4 and all(f"{n} done (" in err for n in names)
    assert sorted(int(x) for x in re.findall(r"done \((\d+)/4,", err)) == [1, 2, 3, 4]
    assert re.search(r"trials\s.*4/4 trials", err)


def test_sweep_records_every_step_and_eval(reference_sweep):
    out, res, _ = reference_sweep
    assert sorted(res.ran) == sorted(["b4_lr0.001_s0", "b4_lr0.003_s0", "b8_lr0.001_s0", "b8_lr0.003_s0"])
    data = load_sweep(out)
    assert not data.missing and data.unit == "token"
    for name, recs in data.trials.items():
        header, steps = recs[0], [r for r in recs if r["kind"] == "step"]
        assert header["kind"] == "header" and header["grid"]["budget"] == 6000
        s = data.summaries[name]
        assert s.completed and s.steps == len(steps) == steps[-1]["step"]
        # Stops at the first step at or past the budget; consumed increases by each step's tokens.
        assert steps[-1]["consumed"] >= 6000 > steps[-2]["consumed"]
        assert all(b["consumed"] - a["consumed"] == b["batch_units"] for a, b in zip(steps, steps[1:]))
        for key in ("loss", "grad_norm", "lr", "units_per_s", "skipped_total"):
            assert all(key in r for r in steps)
        # Validation at 0, at every 2,000 tokens, and at the end.
        evals = [r["consumed"] for r in recs if "val_loss" in r]
        assert evals[0] == 0 and len(evals) == 1 + 3 and all(math.isfinite(r["val_loss"]) for r in recs if "val_loss" in r)
        # Token-indexed warmup: the LR after 5% of the budget is the peak LR.
        assert steps[-1]["lr"] == pytest.approx(s.lr)
        assert s.units_per_s > 0 and s.core_s_per_unit is not None and s.core_s_per_unit > 0


def test_same_data_order_for_every_trial(reference_sweep):
    """At equal batch, trials with different LRs see identical tokens per step (same order)."""
    out, _, _ = reference_sweep
    data = load_sweep(out)
    units = {n: [r["batch_units"] for r in recs if r["kind"] == "step"] for n, recs in data.trials.items()}
    assert units["b4_lr0.001_s0"] == units["b4_lr0.003_s0"]
    # Batch 8's first step holds exactly batch 4's first two steps' samples.
    assert units["b8_lr0.001_s0"][0] == units["b4_lr0.001_s0"][0] + units["b4_lr0.001_s0"][1]


def test_rerun_skips_finished_trials_and_changed_grid_is_an_error(reference_sweep):
    out, _, _ = reference_sweep
    again = run_sweep(tiny_config(), out, workers=1, threads=1, progress=False)
    assert again.ran == [] and len(again.skipped) == 4
    with pytest.raises(ValueError, match=r"different grid: lrs: \[0.001, 0.003\] -> \[0.001, 0.01\]"):
        run_sweep(tiny_config(lrs=[1e-3, 1e-2]), out, workers=1, progress=False)


def test_later_rounds_run_in_the_same_worker_processes_and_match_one_process(tmp_path):
    """LR-edge cells (a round after the base cells) run in the workers the base round started — one pool for the
    whole sweep — and every trial's records equal an in-process run of the same grid, bit for bit."""
    cfg = tiny_config(batches=[4], lrs=[3e-4, 1e-3], lr_edge_extend=2)  # the best LR sits at the top edge
    pooled = run_sweep(cfg, tmp_path / "pool", workers=2, threads=1, progress=False, timing_steps=0)
    alone = run_sweep(cfg, tmp_path / "alone", workers=1, threads=1, progress=False, timing_steps=0)
    assert sorted(pooled.ran) == sorted(alone.ran) and len(pooled.ran) > 2  # edge cells ran after the base round
    base = {t.name for t in cfg.trials()}
    events = read_jsonl(tmp_path / "pool" / "events.jsonl")
    pids = {e["trial"]: e["pid"] for e in events if e["event"] == "start"}
    assert {pids[n] for n in pooled.ran if n not in base} <= {pids[n] for n in base}  # no new worker started
    for name in pooled.ran:
        assert numeric_records(tmp_path / "pool" / "trials" / name) == numeric_records(
            tmp_path / "alone" / "trials" / name)


def test_a_closing_pool_starts_no_trial_a_worker_already_holds(tmp_path):
    """Ctrl-C: the sweep closes its pool, which cancels the cells no worker took — but the executor hands each
    worker one more cell ahead, which cancelling cannot reach; the pool's stop event keeps that one from starting.
    Here the event is set before a cell is handed over: the worker returns it untouched (no trial directory)."""
    from globalbatch.lab.sweep.runner import _WorkerPool

    cfg = tiny_config(batches=[4], lrs=[1e-3])
    pool = _WorkerPool(asdict(cfg), 1, 1)
    try:
        pool.run([], tmp_path)  # the workers' executor and its stop event
        pool._stop.set()
        t0 = time.time()
        pool.run(cfg.trials(), tmp_path)
        assert not (tmp_path / "trials").exists(), "a trial started after the stop"
        assert time.time() - t0 < 60
    finally:
        pool.close()


def test_progress_ignores_a_killed_attempts_temp_file(tmp_path):
    """A killed earlier run leaves ``metrics.jsonl.tmp-<its pid>``; until the trial restarts, its bar shows no
    progress rather than the dead attempt's."""
    from globalbatch.lab.sweep.runner import _Progress

    cfg = tiny_config(batches=[4], lrs=[1e-3])
    (t,) = cfg.trials()
    d = tmp_path / "trials" / t.name
    d.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (d / f"metrics.jsonl.tmp-{int(dead.stdout)}").write_text(json.dumps({"kind": "step", "consumed": 4000}) + "\n")
    progress = _Progress(tmp_path, [t], cfg.budget, "token", enabled=False)
    assert progress._consumed(t.name) is None
    (d / f"metrics.jsonl.tmp-{os.getpid()}").write_text(json.dumps({"kind": "step", "consumed": 800}) + "\n")
    assert progress._consumed(t.name) == 800  # a live writer's


def test_analyze_sweep_gives_points_and_recommendation(reference_sweep):
    out, _, _ = reference_sweep
    data, analysis = analyze_sweep(out, settings=AnalysisSettings(first_seed_n_targets=2))
    primary = analysis.targets[0]
    assert {p.batch_size for p in primary.points} == set(data.batch_units().values())
    assert analysis.recommendation is not None and "recommend batch" in analysis.recommendation.text()


_KILL_SCRIPT = """
import sys, json
from globalbatch.lab.sweep import SweepConfig, run_sweep
cfg = SweepConfig(**json.loads(sys.argv[2]))
run_sweep(cfg, sys.argv[1], workers=2, threads=1, progress=False)
"""


def test_sigkill_mid_trial_then_resume_equals_uninterrupted(tmp_path, reference_sweep):
    ref_out, _, _ = reference_sweep
    out = tmp_path / "sweep"
    cfg = json.dumps(asdict(tiny_config()))
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(out), cfg], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    # Kill -9 the sweep process once one trial is finished and another is mid-way.
    deadline = time.time() + 60
    killed_during = None
    while time.time() < deadline and proc.poll() is None:
        trials = out / "trials"
        done = list(trials.glob("*/summary.json")) if trials.exists() else []
        running = []
        for tmp in trials.glob("*/metrics.jsonl.tmp-*") if trials.exists() else []:
            try:
                n_steps = sum(1 for r in read_jsonl(tmp) if r.get("kind") == "step")
            except (OSError, ValueError):
                continue
            if 3 <= n_steps <= 20 and not (tmp.parent / "summary.json").exists():  # a trial has 50-100 steps
                running.append(tmp.parent.name)
        if done and running:
            workers = children_of(proc.pid)
            proc.send_signal(signal.SIGKILL)
            killed_during = running
            break
        time.sleep(0.01)
    proc.wait(timeout=30)
    assert killed_during, f"never caught a trial mid-way: {proc.stdout.read().decode()[-2000:]}"

    # Orphaned workers (busy or idle) notice their parent is gone and exit.
    starts = {e["pid"] for e in read_jsonl(out / "events.jsonl") if e["event"] == "start"}
    assert starts <= set(workers)
    deadline = time.time() + 20
    while any(pid_alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(pid) for pid in workers), "a worker outlived the killed sweep"

    # Nothing corrupt: every finished file parses, every done marker has its full metrics.
    finished_before = {}
    for summary in out.glob("trials/*/summary.json"):
        s = json.loads(summary.read_text())
        recs = read_jsonl(summary.parent / "metrics.jsonl")
        assert recs[-1]["consumed"] >= 6000 and s["steps"] == recs[-1]["step"]
        finished_before[summary.parent.name] = s["finished_at"]
    # Whatever raced past the kill, at least one trial was cut mid-way and has no result.
    interrupted = {d.name for d in (out / "trials").iterdir() if not (d / "summary.json").exists()}
    assert finished_before and interrupted & set(killed_during)

    # Resume (in-process: no second start-up of torch in spawned workers; same 1 thread per trial).
    resumed = run_sweep(tiny_config(), out, workers=1, threads=1, progress=False)
    assert set(resumed.skipped) == set(finished_before) and interrupted <= set(resumed.ran)

    events = read_jsonl(out / "events.jsonl")
    done_counts = {}
    for e in events:
        if e["event"] == "done":
            done_counts[e["trial"]] = done_counts.get(e["trial"], 0) + 1
    assert done_counts == {n: 1 for n in ("b4_lr0.001_s0", "b4_lr0.003_s0", "b8_lr0.001_s0", "b8_lr0.003_s0")}
    for name, finished_at in finished_before.items():  # finished results were not redone
        assert json.loads((out / "trials" / name / "summary.json").read_text())["finished_at"] == finished_at
    assert not list(out.glob("trials/*/metrics.jsonl.tmp-*"))
    # Identical to the uninterrupted sweep, step by step.
    for name in done_counts:
        assert numeric_records(out / "trials" / name) == numeric_records(ref_out / "trials" / name), name


def test_ray_backend_without_ray_names_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ValueError, match=r"pip install 'globalbatch\[ray\]'"):
        run_sweep(tiny_config(batches=[4], lrs=[1e-3]), tmp_path, backend="ray", progress=False)


def test_run_trial_removes_stale_tmp_of_dead_writers(tmp_path):
    cfg = tiny_config(batches=[4], lrs=[1e-3], budget=200)
    d = tmp_path / "trials" / "b4_lr0.001_s0"
    d.mkdir(parents=True)
    stale = d / "metrics.jsonl.tmp-999999999"
    stale.write_text('{"kind": "header"}\n{"kind": "st')
    summary = run_trial(asdict(cfg), {"batch": 4, "lr": 1e-3}, str(tmp_path), threads=1)
    assert summary["completed"] and not stale.exists()


# --- the CLI ------------------------------------------------------------------------------


def _cli(argv, capsys):
    from globalbatch.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


TINY_ARGS = [f"--task-arg={k}={v}" for k, v in TINY.items()]


def test_cli_sweep_then_report(tmp_path, capsys):
    code, out, err = _cli(["sweep", *TINY_ARGS, "--batches", "4,8,16", "--lrs", "1e-3,3e-3", "--tokens", "2K",
                           "--workers", "1", "--threads", "1", "--eval-every", "1K", "--lr-rule", "none",
                           "--lr-edge-extend", "0", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert ("recommend batch" in out or "tie:" in out) and "critical batch per target" in out
    assert "6 trial(s) run" in " ".join(err.split())
    code, out, err = _cli(["report", str(tmp_path), "--objective", "cost"], capsys)
    assert code == 0, err
    page = (tmp_path / "report" / "report.html").read_text()
    assert "objective: cost to target" in page and "tokens to target" in out
    # The first seed's line names its LR without doubled brackets and says where its throughput comes from.
    assert re.search(r"batch 4 \(≈[\d,]+ tokens\), lr [\d.e-]+: .* token/s \(timed pass\)", page), page
    code, out, err = _cli(["report", str(tmp_path), "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["readout"] in ("heldout", "train") and doc["seeds"] == [0]
    for key in ("target_loss", "b_crit", "b_crit_per_seed", "steps_to_target", "monotone"):
        assert key in doc["targets"][0]
    assert "No artists with labels" not in err
    # Analysis settings: one error line, exit 2 (the ValueError used to be swallowed: exit 0, no recommendation).
    for args, want in [(["--objective", "speed"], "error: --objective 'speed' is not allowed; allowed: time, cost"),
                       (["--time-tolerance", "-1"], "error: --time-tolerance -1 is not allowed; allowed: a fraction, 0 ≤ tolerance < 1"),
                       (["--time-tolerance", "5"], "error: --time-tolerance 5 is not allowed; allowed: a fraction, 0 ≤ tolerance < 1"),
                       (["--half-life-steps", "0"], "error: --half-life-steps 0 is not allowed; allowed: a number of steps > 0"),
                       (["--half-life-steps", "-2"], "error: --half-life-steps -2 is not allowed; allowed: a number of steps > 0")]:
        code, out, err = _cli(["report", str(tmp_path), *args], capsys)
        assert code == 2 and err.strip().startswith(want), (args, err)
    for flag in ("--half-life-steps",):  # the legacy --halflife-steps is gone (tests/test_bad_inputs.py)
        code, out, err = _cli(["report", str(tmp_path), flag, "2"], capsys)
        assert code == 0 and "EMA half-life 2 steps" in (tmp_path / "report" / "report.html").read_text(), err


def test_cli_errors_are_one_line_with_exit_2(tmp_path, capsys):
    code, _, err = _cli(["sweep", "--batches", "4,x", "--out", str(tmp_path)], capsys)
    assert code == 2 and err.strip() == "error: --batches 'x' is not allowed; allowed: whole numbers ≥ 1 (at most 1e9), e.g. 16,32,64"
    cases = {
        ("--batches", "8,-16"): "error: --batches -16 is not allowed; allowed: whole numbers ≥ 1 (at most 1e9), e.g. 16,32,64",
        ("--batches", "4,4"): "error: --batches 4,4 is not allowed; allowed: distinct whole numbers ≥ 1, e.g. 16,32,64",
        ("--backend", "slurm"): "error: --backend 'slurm' is not allowed; allowed: local, ray",
        ("--micro-batch", "0"): "error: --micro-batch 0 is not allowed; allowed: a whole number ≥ 1",
        ("--tokens", "0"): "error: --tokens 0 is not allowed; allowed: a whole number of units ≥ 1 (at most 1e18), e.g. 2M",
        ("--lrs", "-1"): "error: --lrs -1 is not allowed; allowed: distinct finite numbers > 0, e.g. 3e-4,1e-3",
        ("--threads", "0"): f"error: --threads 0 is not allowed; allowed: a whole number from 1 to {8 * _cores()} (8 × "
                            f"the {_cores()} cores here)",
        ("--batch-edge-extend", "-1"): "error: --batch-edge-extend -1 is not allowed; allowed: a whole number ≥ 0",
        ("--optimizer", "lion"): "error: --optimizer 'lion' is not allowed; allowed: adamw, sgd, lars, lamb",
    }
    for (flag, value), want in cases.items():
        code, _, err = _cli(["sweep", *TINY_ARGS, "--batches", "4", flag, value, "--out", str(tmp_path / "x")], capsys)
        assert code == 2 and err.strip() == want, (flag, err)
    assert not (tmp_path / "x" / "manifest.json").exists()
    code, _, err = _cli(["report", str(tmp_path / "nope")], capsys)
    assert code == 2 and "it does not exist" in err and err.startswith("error: RUN_DIR ")
    (tmp_path / "run").mkdir()
    code, _, err = _cli(["report", str(tmp_path / "run"), "--targets", "2.4,abc"], capsys)  # losses, not LRs
    assert code == 2 and err.strip() == "error: --targets 'abc' is not allowed; allowed: distinct finite numbers, e.g. 2.4,2.3 (losses)"


def test_batch_edge_extend_is_a_flag_and_an_added_batch_is_said(tmp_path, capsys, monkeypatch):
    """The sweep adds the largest batch × 2 when B_crit lies beyond it (SweepConfig.batch_edge_extend): the command
    takes the count as --batch-edge-extend and says which batches it added beyond --batches."""
    import globalbatch.lab.sweep as sweep_pkg
    from types import SimpleNamespace

    seen = {}

    def fake_run(cfg, out, **kw):
        seen["cfg"] = cfg
        return SimpleNamespace(ran=["b8_lr0.001_s0"], skipped=[], wall_time_s=1.0, workers=1, threads_per_worker=1,
                               out_dir=str(out))

    def fake_analyze(out):
        summaries = {f"b{b}": SimpleNamespace(batch=b) for b in (2, 4, 8)}
        return (SimpleNamespace(summaries=summaries),
                SimpleNamespace(warnings=[], recommendation=None, targets=[], to_dict=lambda: {}))

    monkeypatch.setattr(sweep_pkg, "run_sweep", fake_run)
    monkeypatch.setattr(sweep_pkg, "analyze_sweep", fake_analyze)
    monkeypatch.setattr("globalbatch.lab.report.seed_analysis_or_note", lambda out: (None, None))
    monkeypatch.setattr("globalbatch.cli.critical._print_report", lambda res: None)
    code, out, err = _cli(["sweep", *TINY_ARGS, "--batches", "2,4", "--lrs", "1e-3", "--tokens", "2K",
                           "--batch-edge-extend", "0", "--out", str(tmp_path / "s")], capsys)
    assert code in (0, None), err
    assert seen["cfg"].batch_edge_extend == 0
    assert "batch 8 added beyond --batches: B_crit at the primary target lay beyond the largest batch" \
        in " ".join(err.split())  # (rich wraps the line)


def test_a_rejected_sweep_writes_no_manifest_so_the_corrected_rerun_runs(tmp_path, capsys):
    """The tester's case: a bad --task-arg exited 2 but left a manifest, refusing the corrected rerun."""
    out = tmp_path / "s"
    code, _, err = _cli(["sweep", *TINY_ARGS, "--task-arg", "hiden=3", "--batches", "4", "--lrs", "1e-3",
                         "--tokens", "200", "--out", str(out)], capsys)
    assert code == 2 and err.startswith("error: --task-arg hiden=3 is not allowed") and "hiden" in err
    assert len(err.strip().splitlines()) == 1 and not (out / "manifest.json").exists()
    code, _, err = _cli(["sweep", *TINY_ARGS, "--batches", "4", "--lrs", "1e-3", "--tokens", "200", "--workers", "1",
                         "--threads", "1", "--out", str(out)], capsys)
    assert code == 0, err
    with pytest.raises(ValueError, match="threads 0 is not allowed"):
        run_sweep(tiny_config(), tmp_path / "t", threads=0, progress=False)
    with pytest.raises(ValueError, match="task"):
        run_sweep(tiny_config(task="nope"), tmp_path / "t", progress=False)
    assert not (tmp_path / "t").exists()


def test_load_sweep_rejects_a_branch_dir_and_a_malformed_manifest(tmp_path, capsys):
    (tmp_path / "b").mkdir()
    atomic_write_json(tmp_path / "b" / "manifest.json", {"version": 2, "branch": {"task": "tinygpt"}})
    with pytest.raises(ValueError, match="is a branch test, not a sweep"):
        load_sweep(tmp_path / "b")
    code, _, err = _cli(["report", str(tmp_path / "b")], capsys)
    assert code == 2 and err.startswith("error: RUN_DIR ") and "branch test, not a sweep" in err
    assert "allowed: a sweep directory" in err
    for text in ("{not json", "[1, 2]", '{"grid": {"batches": "x"}}'):
        (tmp_path / "m").mkdir(exist_ok=True)
        (tmp_path / "m" / "manifest.json").write_text(text)
        code, _, err = _cli(["report", str(tmp_path / "m")], capsys)
        assert code == 2 and err.startswith("error: RUN_DIR ") and "Traceback" not in err, (text, err)


def test_noise_scale_is_logged_at_evaluations(tmp_path):
    cfg = tiny_config(batches=[4], lrs=[3e-3], budget=3000, eval_every=1000, noise=True)
    assert cfg.micro_batch_for(4) == 2  # two micro-batches per step for the two-batch estimator
    run_sweep(cfg, tmp_path, workers=1, threads=1, progress=False)
    recs = load_sweep(tmp_path).trials["b4_lr0.003_s0"]
    logged = [r for r in recs if "b_simple" in r]
    assert len(logged) == 3 and all(r["kind"] == "step" for r in logged)
    assert all(isinstance(r["b_simple_flags"], list) for r in logged)
    assert any(math.isfinite(r["b_simple"]) for r in logged)


def test_demo_config_stays_within_its_measured_budget():
    """`make demo` must finish in 5 minutes on 2 cores: 4.5M tokens took 80 s of sweep on a quiet
    machine (docs/sweep.md). The 3-seed demo trains 6.75M tokens in its base cells, plus ≈18 % for the
    held-out evaluations and up to 15 edge cells (docs/sweep.md, "Stability over seeds", for the estimate).
    Growing the grid needs a new measurement."""
    from globalbatch.lab.sweep import demo_config

    cfg = demo_config()
    assert len(cfg.trials()) * cfg.budget <= 6_750_000 and len(cfg.seed_list()) == 3
    assert len(cfg.eval_positions()) >= 30 and cfg.max_val_samples >= 512 and cfg.warmup is not None
    assert cfg.task == "tinygpt" and len(cfg.batches) >= 4 and len(cfg.lrs) >= 2


def test_timing_pass_is_sequential_recorded_and_used_by_the_analysis(reference_sweep):
    """Throughput comes from a separate pass per batch, alone on the sweep's threads, not from trials that shared the cores."""
    out, res, _ = reference_sweep
    assert sorted(res.timing) == [4, 8]
    for b in (4, 8):
        rec = json.loads((out / "timing" / f"b{b}.json").read_text())
        assert rec["steps"] == 8 and rec["warmup_steps"] == 2 and rec["units_per_s"] > 0 and len(rec["step_units_per_s"]) == 8
        # valid (loss-bearing) tokens/s and MFU: timed model FLOP/s over the measured peak of the same threads
        assert rec["valid_tokens_per_s"] == rec["units_per_s"] and 0 < rec["mfu"] < 1
        assert rec["mfu"] == pytest.approx(rec["model_flops_per_s"] / rec["peak_flops_per_s"])
        assert rec["peak_flops_source"].startswith("measured: cpu")
        # the best-LR config of the batch (lowest final validation loss)
        best = min((s for s in res.summaries if s["batch"] == b), key=lambda s: s["final_val_loss"])
        assert rec["lr"] == best["lr"]
    data, analysis = analyze_sweep(out, settings=AnalysisSettings(first_seed_n_targets=2))
    units = data.batch_units()
    for p in analysis.targets[0].points:
        b = next(k for k, v in units.items() if v == p.batch_size)
        assert p.examples_per_s == pytest.approx(data.timing[b]["units_per_s"])
        assert data.in_trial_units_per_s(b) is not None  # kept as the secondary number
    # Resumable: a rerun does not time again.
    mtime = (out / "timing" / "b4.json").stat().st_mtime_ns
    again = run_sweep(tiny_config(), out, workers=1, threads=1, progress=False)
    assert (out / "timing" / "b4.json").stat().st_mtime_ns == mtime and again.timing[4] == res.timing[4]


def _crossing_trial(cfg, spec, out, threads=1, pause_at=None):
    """A stand-in for run_trial (the runner's loop is under test, not training): loss = L∞ + 3/(1 + s/τ) with,
    at an LR ``rel`` × the rule's (√batch), τ = 10·(1 + 1600/B)/rel steps and L∞ = 2 + 0.12·rel — a higher LR
    learns faster and plateaus higher, so the lowest final loss and the fewest steps to a looser target pick
    different LRs. 20 tokens per sample; held-out losses at log-spaced steps."""
    import numpy as np

    b, lr, seed = int(spec["batch"]), float(spec["lr"]), int(spec.get("seed", 0))
    b_tok, rel = b * 20, lr / (1e-3 * math.sqrt(b / 8))
    n = cfg["budget"] // b_tok
    tau, floor = 10.0 * (1 + 1600.0 / b_tok) / rel, 2.0 + 0.12 * rel
    loss = floor + 3.0 / (1.0 + np.arange(1, n + 1) / tau)
    evals = set(np.unique(np.geomspace(1, n, 12).astype(int)).tolist())
    name = f"b{b}_lr{lr:g}_s{seed}"
    recs = [{"kind": "header", "trial": name, "batch": b, "lr": lr, "unit": "token"},
            {"kind": "eval", "step": 0, "consumed": 0, "val_loss": 5.0}]
    for i in range(n):
        r = {"kind": "step", "step": i + 1, "consumed": (i + 1) * b_tok, "batch": b, "batch_units": b_tok,
             "loss": float(loss[i]), "grad_norm": 1.0, "lr": lr, "skipped": False, "skipped_total": 0,
             "units_per_s": 1e4, "train_time_s": (i + 1) * b_tok / 1e4}
        if i + 1 in evals:
            r["val_loss"] = float(loss[i])
        recs.append(r)
    d = Path(out) / "trials" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    atomic_write_json(d / "summary.json", {
        "completed": True, "trial": name, "batch": b, "lr": lr, "seed": seed, "unit": "token", "steps": n,
        "consumed": n * b_tok, "mean_batch_units": float(b_tok), "units_per_s": 1e4, "core_s_per_unit": 1e-4,
        "skipped_windows": 0, "final_val_loss": float(loss[-1]), "train_time_s": n * b_tok / 1e4, "micro_batch": b})


def test_narrow_design_extends_the_batch_edge_where_b_crit_lies_beyond(tmp_path, monkeypatch):
    """The stand-in's B_crit is 1,600 tokens, beyond the largest batch (32 × 20): after its transfers a narrow design
    runs the next batch, 64, at the base batch's chosen LR moved by the rule only, and reads a point there."""
    import globalbatch.lab.sweep.runner as runner
    from globalbatch.critical.lr_choice import chosen_lr_per_batch
    from globalbatch.lab.sweep import analyze_sweep_seeds

    monkeypatch.setattr(runner, "run_trial", _crossing_trial)
    cfg = SweepConfig(task="tinygpt", task_overrides=TINY, batches=[8, 16, 32], lrs=[1e-3, 3e-3], budget=200_000,
                      seeds=[0], design="narrow1", lr_edge_extend=1, warmup=0)
    res = run_sweep(cfg, tmp_path / "s", workers=1, threads=1, progress=False, timing_steps=0)
    data, sa = analyze_sweep_seeds(tmp_path / "s")
    chosen = chosen_lr_per_batch(sa.primary)[data.batch_units()[16]]
    at_64 = {float(n.split("_lr")[1].split("_")[0]) for n in res.ran if n.startswith("b64_")}
    assert len(at_64) == 1 and at_64.pop() == pytest.approx(cfg.transfer_lr(chosen, 16, 64), rel=1e-3), sorted(res.ran)
    assert not any(n.startswith("b128_") for n in res.ran)  # the cap: one doubling
    again = run_sweep(cfg, tmp_path / "s", workers=1, threads=1, progress=False, timing_steps=0)
    assert again.ran == [] and sorted(again.skipped) == sorted(res.ran)  # a resume counts the edge cells as finished


def test_narrow_design_transfers_the_lr_the_analysis_chooses_and_follows_it(tmp_path, monkeypatch):
    """Base batch 16 at rel 1 and 3 (× the rule's LR): lowest final loss at rel 1, but once batches 8 and 32 ran the
    primary target loosens and the analysis reads batch 16 at rel 3 (fewer steps). The transfer follows the
    analysis' choice (critical.lr_choice.chosen_lr_per_batch): every other batch runs rel 3 moved by the rule —
    not only rel 1, the lowest final loss, which the analysis then does not choose."""
    import globalbatch.lab.sweep.runner as runner
    from globalbatch.critical.lr_choice import chosen_lr_per_batch
    from globalbatch.lab.sweep import analyze_sweep_seeds

    monkeypatch.setattr(runner, "run_trial", _crossing_trial)
    cfg = SweepConfig(task="tinygpt", task_overrides=TINY, batches=[8, 16, 32], lrs=[1e-3, 3e-3], budget=200_000,
                      seeds=[0], design="narrow1", lr_edge_extend=1, warmup=0)
    res = run_sweep(cfg, tmp_path / "s", workers=1, threads=1, progress=False, timing_steps=0)
    data, sa = analyze_sweep_seeds(tmp_path / "s")
    units = data.batch_units()
    chosen = chosen_lr_per_batch(sa.primary)[units[16]]
    assert chosen == pytest.approx(3e-3 * math.sqrt(2), rel=1e-3)  # rel 3 at batch 16
    ran = {(int(n.split("_")[0][1:]), float(n.split("_lr")[1].split("_")[0])) for n in res.ran}
    for b in (8, 32):
        assert (b, cfg.transfer_lr(chosen, 16, b)) in ran, sorted(ran)
        assert chosen_lr_per_batch(sa.primary)[units[b]] == pytest.approx(cfg.transfer_lr(chosen, 16, b))
    assert not sa.lr_falls
