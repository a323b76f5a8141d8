"""Run directories: one run at a time (the lock), exclusive manifests, no orphan writes after a SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from conftest import children_of

from globalbatch._util import SettingError, read_jsonl
from globalbatch.lab.rundir import check_manifest, lock_holder, lock_run_dir, pid_alive

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1", COLUMNS="120")
TINY = ["--task-arg", "n_layer=1", "--task-arg", "d_model=16", "--task-arg", "n_head=1", "--task-arg", "seq_len=16",
        "--task-arg", "max_corpus_bytes=20000"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_lock_is_exclusive_names_the_holder_and_is_removed_on_release(tmp_path):
    with lock_run_dir(tmp_path):
        assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())
        assert lock_holder(tmp_path) == os.getpid()
        with pytest.raises(SettingError) as exc:
            lock_run_dir(tmp_path).acquire()  # another open file description: refused like another process
        assert exc.value.field == "out" and f"pid {os.getpid()}" in str(exc.value)
    assert not (tmp_path / ".lock").exists() and lock_holder(tmp_path) is None
    with lock_run_dir(tmp_path):  # free again
        pass


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_note(tmp_path, capsys):
    dead = _dead_pid()
    (tmp_path / ".lock").write_text(f"{dead}\n")
    assert lock_holder(tmp_path) is None  # nobody holds the flock: the file is stale
    with lock_run_dir(tmp_path):
        assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())
    err = capsys.readouterr().err
    assert f"locked by pid {dead}, which is gone; taking it over" in err


def test_loser_of_a_close_race_still_names_the_winner(tmp_path, monkeypatch):
    # The winner flocks first and writes its pid a moment later; a loser in between must not
    # report the empty file (or a dead earlier owner's pid) as "another process".
    import fcntl
    import threading

    from globalbatch.lab import rundir

    monkeypatch.setattr(rundir, "_HOLDER_WAIT_S", 10.0)  # a loaded machine may run the timer late

    (tmp_path / ".lock").write_text(f"{_dead_pid()}\n")  # a killed earlier owner's pid is still in the file
    fd = os.open(tmp_path / ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the winner, before it writes its pid
    late = threading.Timer(0.1, lambda: (os.ftruncate(fd, 0), os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)))
    late.start()
    try:
        with pytest.raises(SettingError) as exc:
            lock_run_dir(tmp_path).acquire()
        assert f"a run (pid {os.getpid()}) holds" in str(exc.value)
    finally:
        late.join()
        os.close(fd)


def test_a_lock_whose_holder_never_writes_says_another_process(tmp_path):
    import fcntl

    fd = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(SettingError, match=r"a run \(another process\) holds"):  # after the 0.5 s wait
            lock_run_dir(tmp_path).acquire()
    finally:
        os.close(fd)


def test_lock_of_a_live_process_blocks_until_it_exits(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from globalbatch.lab.rundir import lock_run_dir\n"
        f"l = lock_run_dir({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)")],
        env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SettingError, match=f"pid {holder.pid}"):
            lock_run_dir(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    with lock_run_dir(tmp_path):  # the kernel dropped the dead holder's flock; its file is taken over
        pass


def test_manifest_is_created_exclusively(tmp_path, monkeypatch):
    want = {"version": 1, "grid": {"batches": [2]}}
    real_link = os.link

    def racing_link(src, dst):  # another run creates the manifest between our check and our write
        Path(dst).write_text(json.dumps({"version": 1, "grid": {"batches": [99]}}))
        return real_link(src, dst)

    monkeypatch.setattr(os, "link", racing_link)
    with pytest.raises(SettingError, match="created by another run meanwhile"):
        check_manifest(tmp_path, want, section="grid")
    assert json.loads((tmp_path / "manifest.json").read_text())["grid"]["batches"] == [99]  # not overwritten
    assert not list(tmp_path.glob(".manifest.json.tmp-*"))


@pytest.mark.slow
def test_two_sweeps_into_one_directory_exactly_one_runs(tmp_path):
    out = tmp_path / "sweep"
    common = [sys.executable, "-m", "globalbatch.cli", "sweep", "--out", str(out), "--lrs", "1e-3", "--tokens", "3K",
              "--workers", "1", "--threads", "1", *TINY]
    procs = [subprocess.Popen(common + ["--batches", b], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for b in ("2", "4")]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(r[0] for r in results)
    assert codes == [0, 2], [(r[0], r[2][-500:]) for r in results]
    (win_code, _, _), (lose_code, lose_out, lose_err) = sorted(results, key=lambda r: r[0])
    lines = lose_err.strip().splitlines()
    assert lose_out == "" and len(lines) == 1 and lines[0].startswith(f"error: --out '{out}'"), lose_err
    assert "holds" in lines[0] and "pid" in lines[0]
    winner = 0 if results[0][0] == 0 else 1
    grid = json.loads((out / "manifest.json").read_text())["grid"]
    assert grid["batches"] == [(2, 4)[winner]]  # one grid, the winner's
    assert [d.name for d in (out / "trials").iterdir()] == [f"b{(2, 4)[winner]}_lr0.001_s0"]
    assert not (out / ".lock").exists()


_KILL_SCRIPT = """
import sys, json
from globalbatch.lab.sweep import SweepConfig, run_sweep
cfg = SweepConfig(**json.loads(sys.argv[2]))
run_sweep(cfg, sys.argv[1], workers=2, threads=1, progress=False, timing_steps=0)
"""


@pytest.mark.slow
def test_sigkill_of_the_sweep_no_trial_starts_or_finishes_afterwards(tmp_path):
    """Kill -9 the sweep right after its first trial finishes (its worker is about to take the next one)."""
    from globalbatch.lab.sweep import SweepConfig

    cfg = SweepConfig(task="tinygpt", task_overrides=dict(n_layer=1, d_model=16, n_head=2, seq_len=16,
                                                          max_corpus_bytes=100_000),
                      batches=[4, 8, 16], lrs=[1e-3, 3e-3], budget=4000, max_val_samples=16, eval_every=2000)
    out = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(out), json.dumps(asdict(cfg))], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 240
    workers: list[int] = []
    while time.time() < deadline and proc.poll() is None:
        events = read_jsonl(out / "events.jsonl") if (out / "events.jsonl").exists() else []
        if any(e["event"] == "done" for e in events):
            workers = children_of(proc.pid)
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    proc.wait(timeout=30)
    t_dead = time.time()  # the sweep process is dead and reaped: from here on nothing may start or finish
    assert workers, f"no trial finished in time: {proc.stdout.read().decode()[-2000:]}"
    deadline = time.time() + 30
    while any(pid_alive(p) for p in workers) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(p) for p in workers), "a worker outlived the killed sweep"
    events = read_jsonl(out / "events.jsonl")
    late = [e for e in events if e["time"] > t_dead]
    assert not late, f"orphans wrote after the kill: {late}"
    for summary in out.glob("trials/*/summary.json"):
        assert summary.stat().st_mtime <= t_dead, f"{summary} written after the kill"
    started = [e for e in events if e["event"] == "start"]
    assert len(started) < len(cfg.trials())  # the kill did cut the sweep short
