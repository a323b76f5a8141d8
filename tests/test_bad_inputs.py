"""Every command and file reader answers bad input the same way (issue 11).

Each case runs ``globalbatch.cli.main`` in-process in an empty working directory and asserts:
exit code 2, nothing on stdout, exactly one line on stderr that names the field (the flag on
the command line, the key or the file of a file), no traceback, and no file written or changed.
No case trains: every one is refused before a model is built.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

import pytest

TINY = ["--task-arg", "n_layer=1", "--task-arg", "d_model=16", "--task-arg", "n_head=1", "--task-arg", "seq_len=16",
        "--task-arg", "max_corpus_bytes=20000"]
PLAN = ["plan", "--micro-batch", "2", "--grad-accum", "1", "--dp", "1", "--seq-len", "10"]
SWEEP = ["sweep", "--out", "o", "--batches", "2", "--lrs", "1e-3", "--tokens", "200", "--workers", "1", *TINY]
NOISE = ["noise", "--out", "o", "--steps", "2", "--micro-batch", "2", "--grad-accum", "2", "--device", "cpu", *TINY]
BRANCH = ["branch", "--out", "o", "--base-batch", "2", "--ks", "1,2", "--warmup-tokens", "100", "--window-tokens", "100",
          "--seeds", "2", *TINY]
PROBE = ["probe", "--device", "cpu", "--max-micro-batch", "2", *TINY]
LONG = "x" * 300
ALIAS_BOMB = ("micro_batch: [&a [x,x,x,x,x,x,x,x,x,x], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], "
              "&c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c], "
              "&e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d], &f [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e], "
              "&g [*f,*f,*f,*f,*f,*f,*f,*f,*f,*f], &h [*g,*g,*g,*g,*g,*g,*g,*g,*g,*g], "
              "&i [*h,*h,*h,*h,*h,*h,*h,*h,*h,*h]]\n")


# ---------------------------------------------------------------------------
# Files the cases read (made in the case's working directory before it runs)
# ---------------------------------------------------------------------------

def _sweep_dir(root: Path, edit: dict[str, str] | None = None) -> Path:
    """A small valid sweep directory (tests/test_report.py's synthetic one), then files replaced by ``edit``."""
    from test_report import write_synthetic_sweep

    d = root / "run"
    d.mkdir()
    write_synthetic_sweep(d)
    for rel, text in (edit or {}).items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


def _first_trial(d: Path) -> Path:
    return sorted((d / "trials").iterdir())[0]


def _setup_summary(root: Path, change) -> None:
    d = _sweep_dir(root)
    p = _first_trial(d) / "summary.json"
    s = json.loads(p.read_text())
    change(s)
    p.write_text(json.dumps(s))


FILES = {
    "afile": lambda r: (r / "afile").write_text("x"),
    "bomb": lambda r: (r / "bomb.yaml").write_text(ALIAS_BOMB),
    "syn": lambda r: (r / "syn.py").write_text("def make_task(:\n"),
    "missing_import": lambda r: (r / "imp.py").write_text("import no_such_module_xyz\ndef make_task(): pass\n"),
    "raises": lambda r: (r / "raises.py").write_text("raise RuntimeError('boom at import')\ndef make_task(): pass\n"),
    "notask": lambda r: (r / "notask.py").write_text("def make_task():\n    return 3\n"),
    "run": lambda r: _sweep_dir(r),
    "no_unit": lambda r: _setup_summary(r, lambda s: s.pop("unit")),
    "nan_summary": lambda r: _setup_summary(r, lambda s: s.update(units_per_s="fast")),
    "text_mean_batch": lambda r: _setup_summary(r, lambda s: s.update(mean_batch_units="lots")),
    "text_batch": lambda r: _setup_summary(r, lambda s: s.update(batch=str(s["batch"]))),
    "text_lr": lambda r: _setup_summary(r, lambda s: s.update(lr="fast")),
    "float_seed": lambda r: _setup_summary(r, lambda s: s.update(seed=0.5)),
    "other_trial": lambda r: _setup_summary(r, lambda s: s.update(batch=s["batch"] * 2)),
    "not_completed": lambda r: _setup_summary(r, lambda s: s.update(completed=False)),
    "no_metrics": lambda r: (_first_trial(_sweep_dir(r)) / "metrics.jsonl").unlink(),
    "metrics_text_step": lambda r: (_first_trial(_sweep_dir(r)) / "metrics.jsonl").open("a").write(
        '{"kind": "step", "step": 99, "consumed": "many", "loss": 1.0}\n'),
    "metrics_text_val_loss": lambda r: (_first_trial(_sweep_dir(r)) / "metrics.jsonl").open("a").write(
        '{"kind": "eval", "step": 99, "consumed": 10, "val_loss": "low"}\n'),
    "metrics_no_kind": lambda r: (_first_trial(_sweep_dir(r)) / "metrics.jsonl").open("a").write('{"step": 3}\n'),
    "text_timing": lambda r: _sweep_dir(r, {"timing/b16.json": '{"units_per_s": "fast"}'}),
    "summary_list": lambda r: (_first_trial(_sweep_dir(r)) / "summary.json").write_text("[1, 2]"),
    "broken_summary": lambda r: (_first_trial(_sweep_dir(r)) / "summary.json").write_text("{not json"),
    "garbage_metrics": lambda r: (_first_trial(_sweep_dir(r)) / "metrics.jsonl").open("a").write("garbage\n{}\n"),
    "metrics_non_record": lambda r: (_first_trial(_sweep_dir(r)) / "metrics.jsonl").open("a").write("[1]\n"),
    "broken_timing": lambda r: _sweep_dir(r, {"timing/b16.json": "{broken"}),
    "broken_manifest": lambda r: _sweep_dir(r, {"manifest.json": "{broken"}),
    "manifest_list": lambda r: _sweep_dir(r, {"manifest.json": "[1, 2]"}),
    "empty_dir": lambda r: (r / "run").mkdir(),
    "branch_dir": lambda r: ((r / "run").mkdir(), (r / "run" / "manifest.json").write_text(
        json.dumps({"version": 2, "branch": {"task": "tinygpt"}}))),
    "out_broken_manifest": lambda r: ((r / "o").mkdir(), (r / "o" / "manifest.json").write_text("{broken")),
    "out_other_grid": lambda r: ((r / "o").mkdir(), (r / "o" / "manifest.json").write_text(
        json.dumps({"version": 1, "grid": {"batches": [99]}}))),
    "out_branch": lambda r: ((r / "o").mkdir(), (r / "o" / "manifest.json").write_text(
        json.dumps({"version": 2, "branch": {"task": "tinygpt"}}))),
    "out_grid_for_branch": lambda r: ((r / "o").mkdir(), (r / "o" / "manifest.json").write_text(
        json.dumps({"version": 1, "grid": {"batches": [2]}}))),
    "out_file": lambda r: (r / "o").write_text("x"),
    "cluster_neg_bw": lambda r: (r / "c.yaml").write_text(
        "gpus_per_node: 8\npeak_flops_per_s: 9.89e14\nmemory_bytes: 8e10\nintra_busbw_bytes_per_s: -3.7e11\n"
        "inter_busbw_bytes_per_s: 4.6e10\n"),
    "locked": lambda r: _held_lock(r / "o"),
}


_HELD: list = []


def _held_lock(d: Path) -> None:
    """``d`` locked by a run that is still going (this process, through another open file)."""
    from globalbatch.lab.rundir import lock_run_dir

    d.mkdir()
    _HELD.append(lock_run_dir(d).acquire())


@pytest.fixture(autouse=True)
def _release_held_locks():
    yield
    while _HELD:
        _HELD.pop().release()


def _cfg(name: str, text: str):
    return lambda r: (r / name).write_bytes(text.encode() if isinstance(text, str) else text)


CONFIGS = {
    "yaml_syntax": ("c.yaml", "micro_batch: [1,\n"),
    "yaml_list": ("c.yaml", "- 1\n- 2\n"),
    "yaml_empty": ("c.yaml", "\n"),
    "yaml_unknown": ("c.yaml", "micro_bach: 2\n"),
    "yaml_dup": ("c.yaml", "micro_batch: 2\nmicro_batch: 4\n"),
    "yaml_tokens_1e400": ("c.yaml", "micro_batch: 2\ngrad_accum_steps: 1\nseq_len: 8\ntotal_tokens: 1e400\n"),
    "yaml_params_huge": ("c.yaml", "micro_batch: 2\ngrad_accum_steps: 1\nseq_len: 8\nparams: 1e999999999\n"),
    "yaml_micro_neg": ("c.yaml", "micro_batch: -1\n"),
    "yaml_micro_str": ("c.yaml", "micro_batch: two\n"),
    "yaml_warmup_neg": ("c.yaml", "micro_batch: 2\ngrad_accum_steps: 1\nwarmup_steps: -1\n"),
    "yaml_lr_nan": ("c.yaml", "micro_batch: 2\ngrad_accum_steps: 1\nlr: .nan\n"),
    "yaml_lr_rule": ("c.yaml", "micro_batch: 2\ngrad_accum_steps: 1\nlr_rule: cubic\n"),
    "yaml_padding": ("c.yaml", "micro_batch: 2\ngrad_accum_steps: 1\npadding_fraction: 1.5\n"),
    "yaml_bool": ("c.yaml", "micro_batch: 2\ngrad_accum_steps: 1\nno_sync: maybe\n"),
    "yaml_python_tag": ("c.yaml", "micro_batch: !!python/object/apply:os.system ['echo PWNED']\n"),
    "yaml_list_key": ("c.yaml", "? [micro_batch, dp]\n: 2\n"),  # an unhashable key: one line, not a TypeError
    "toml_syntax": ("c.toml", "micro_batch = \n"),
    "toml_bad": ("c.toml", "micro_batch = 0\n"),
    "json_syntax": ("c.json", "{\"micro_batch\": }"),
    "json_list": ("c.json", "[1]"),
    "not_utf8": ("c.yaml", b"micro_batch: \xff\xfe\n"),
    "hf_lr_nan": ("hf.json", json.dumps({"output_dir": "x", "per_device_train_batch_size": 2, "learning_rate": "NaN"})),
    "hf_lr_neg": ("hf.json", json.dumps({"output_dir": "x", "per_device_train_batch_size": 2, "learning_rate": -1})),
    "hf_warmup_neg": ("hf.json", json.dumps({"output_dir": "x", "per_device_train_batch_size": 2, "warmup_steps": -5})),
    "hf_micro_zero": ("hf.json", json.dumps({"output_dir": "x", "per_device_train_batch_size": 0})),
    "hf_accum_str": ("hf.json", json.dumps({"output_dir": "x", "per_device_train_batch_size": 2,
                                            "gradient_accumulation_steps": "two"})),
    "ds_lr_neg": ("ds.json", json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"params": {"lr": -1}}})),
    "ds_lr_str": ("ds.json", json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"params": {"lr": "fast"}}})),
    "ds_train_zero": ("ds.json", json.dumps({"train_batch_size": 0})),
    "ds_indivisible": ("ds.json", json.dumps({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3,
                                              "gradient_accumulation_steps": 1})),
    "ds_huge": ("ds.json", '{"train_batch_size": 1e400}'),
}
for _key, (_name, _text) in CONFIGS.items():
    FILES[_key] = _cfg(_name, _text)


# ---------------------------------------------------------------------------
# The cases: (id, argv, field named on the line, files to make first)
# ---------------------------------------------------------------------------

def _c(id_, argv, field, *files):
    return pytest.param(list(argv), field, files, id=id_)


ADAPTIVE = ["adaptive", "--out", "o", "--seeds", "0,1"]

PLAN_SCHED = ["plan", "--micro-batch", "2", "--dp", "64", "--seq-len", "2048", "--total-tokens", "100B"]

CASES = [
    _c("plan-batch-schedule-indivisible", PLAN_SCHED + ["--batch-schedule", "0:1024 2B:2000"], "--batch-schedule"),
    _c("plan-batch-schedule-first-indivisible", PLAN_SCHED + ["--batch-schedule", "0:1000"], "--batch-schedule"),
    _c("plan-batch-schedule-word", PLAN_SCHED + ["--batch-schedule", "soon"], "--batch-schedule"),
    _c("plan-batch-schedule-shrinks", PLAN_SCHED + ["--batch-schedule", "0:1024 2B:512"], "--batch-schedule"),
    _c("plan-batch-schedule-not-first-global", PLAN_SCHED + ["--global-batch", "512", "--batch-schedule", "0:1024"],
       "--batch-schedule"),
    _c("plan-batch-schedule-no-seq-len", ["plan", "--micro-batch", "2", "--dp", "64", "--total-tokens", "100B",
                                          "--batch-schedule", "0:1024"], "--batch-schedule"),
    # plan: numbers
    _c("plan-total-1e400", PLAN + ["--total-tokens", "1e400"], "--total-tokens"),
    _c("plan-total-1e999999999", PLAN + ["--total-tokens", "1e999999999"], "--total-tokens"),
    _c("plan-total-word", PLAN + ["--total-tokens", "lots"], "--total-tokens"),
    _c("plan-total-negative", PLAN + ["--total-tokens", "-5"], "--total-tokens"),
    _c("plan-total-zero", PLAN + ["--total-tokens", "0"], "--total-tokens"),
    _c("plan-total-suffix", PLAN + ["--total-tokens", "5X"], "--total-tokens"),
    _c("plan-params-1e400", PLAN + ["--params", "1e400"], "--params"),
    _c("plan-params-1e999999999", PLAN + ["--params", "1e999999999"], "--params"),
    _c("plan-params-zero", PLAN + ["--params", "0"], "--params"),
    _c("plan-compute-1e400", PLAN + ["--compute", "1e400"], "--compute"),
    _c("plan-compute-word", PLAN + ["--compute", "big"], "--compute"),
    _c("plan-warmup-tokens-1e400", PLAN + ["--warmup-tokens", "1e400"], "--warmup-tokens"),
    _c("plan-warmup-tokens-1e999999999", PLAN + ["--warmup-tokens", "1e999999999"], "--warmup-tokens"),
    _c("plan-warmup-steps-neg-no-seq", ["plan", "--micro-batch", "2", "--grad-accum", "1", "--dp", "1",
                                        "--warmup-steps", "-1"], "--warmup-steps"),
    _c("plan-warmup-steps-neg", PLAN + ["--warmup-steps", "-1"], "--warmup-steps"),
    _c("plan-warmup-both", PLAN + ["--warmup-steps", "2", "--warmup-tokens", "20"], "--warmup"),
    _c("plan-micro-zero", ["plan", "--micro-batch", "0", "--grad-accum", "1", "--dp", "1"], "--micro-batch"),
    _c("plan-micro-neg", ["plan", "--micro-batch", "-2", "--grad-accum", "1", "--dp", "1"], "--micro-batch"),
    _c("plan-micro-word", ["plan", "--micro-batch", "two"], "--micro-batch"),
    _c("plan-micro-float", ["plan", "--micro-batch", "2.5"], "--micro-batch"),
    _c("plan-micro-huge", ["plan", "--micro-batch", "1e400"], "--micro-batch"),
    _c("plan-no-geometry", ["plan"], "--global-batch"),  # not "global_batch None is not allowed"
    _c("plan-memory-flag-without-memory", ["plan", "--sharding", "zero1", "--global-batch", "8", "--micro-batch", "2"],
       "--sharding"),
    _c("plan-memory-without-params", ["plan", "--memory", "8GiB", "--activation-bytes-per-sample", "1MiB"],
       "--params is missing"),
    _c("plan-task-arg-without-task", ["plan", "--memory", "8GiB", "--params", "1B", "--activation-bytes-per-sample", "1MiB",
                                      "--task-arg", "d_model=8"], "--task-arg"),
    _c("plan-one-geometry-flag", ["plan", "--micro-batch", "4", "--dp", "2"], "--micro-batch 4"),
    _c("plan-accum-zero", ["plan", "--micro-batch", "2", "--grad-accum", "0", "--dp", "1"], "--grad-accum"),
    _c("plan-dp-zero", ["plan", "--micro-batch", "2", "--grad-accum", "1", "--dp", "0"], "--dp"),
    _c("plan-dp-neg", ["plan", "--micro-batch", "2", "--grad-accum", "1", "--dp", "-4"], "--dp"),
    _c("plan-global-zero", ["plan", "--global-batch", "0", "--micro-batch", "2", "--dp", "1"], "--global-batch"),
    _c("plan-global-indivisible", ["plan", "--global-batch", "7", "--micro-batch", "2", "--dp", "1"], "global batch 7"),
    _c("plan-seq-zero", PLAN[:-2] + ["--seq-len", "0"], "--seq-len"),
    _c("plan-lr-zero", PLAN + ["--lr", "0"], "--lr"),
    _c("plan-lr-neg", PLAN + ["--lr", "-1e-3"], "--lr"),
    _c("plan-lr-nan", PLAN + ["--lr", "nan"], "--lr"),
    _c("plan-lr-inf", PLAN + ["--lr", "inf"], "--lr"),
    _c("plan-lr-1e400", PLAN + ["--lr", "1e400"], "--lr"),
    _c("plan-lr-word", PLAN + ["--lr", "fast"], "--lr"),
    _c("plan-lr-rule", PLAN + ["--lr", "1e-3", "--lr-rule", "cubic"], "--lr-rule"),
    _c("plan-lr-base-zero", PLAN + ["--lr", "1e-3", "--lr-base-batch", "0"], "--lr-base-batch"),
    _c("plan-lr-base-without-lr", PLAN + ["--lr-base-batch", "8"], "--lr-base-batch"),
    _c("plan-padding-one", PLAN + ["--padding-fraction", "1"], "--padding-fraction"),
    _c("plan-padding-neg", PLAN + ["--padding-fraction", "-0.1"], "--padding-fraction"),
    _c("plan-padding-nan", PLAN + ["--padding-fraction", "nan"], "--padding-fraction"),
    _c("plan-valid-zero", PLAN + ["--valid-tokens-per-seq", "0"], "--valid-tokens-per-seq"),
    _c("plan-valid-over-seq", PLAN + ["--valid-tokens-per-seq", "11"], "--valid-tokens-per-seq"),
    _c("plan-pp-zero", PLAN + ["--pp-stages", "0"], "--pp-stages"),
    _c("plan-virtual-zero", PLAN + ["--pp-stages", "2", "--virtual-stages", "0"], "--virtual-stages"),
    _c("plan-virtual-without-pp", PLAN + ["--virtual-stages", "2"], "--virtual-stages"),
    _c("plan-bubble-zero", PLAN + ["--max-bubble", "0"], "--max-bubble"),
    _c("plan-bubble-nan", PLAN + ["--max-bubble", "nan"], "--max-bubble"),
    _c("plan-grad-bytes-zero", PLAN + ["--grad-bytes-per-param", "0"], "--grad-bytes-per-param"),
    _c("plan-loss-zero", PLAN + ["--loss", "0"], "--loss"),
    _c("plan-loss-inf", PLAN + ["--loss", "inf"], "--loss"),
    _c("plan-unknown-flag", PLAN + ["--micro-batches", "2"], "--micro-batches"),
    # plan: config files
    _c("plan-config-long-name", ["plan", "--config", LONG + ".yaml"], "--config"),
    _c("plan-config-missing", ["plan", "--config", "nope.yaml"], "--config"),
    _c("plan-config-dir", ["plan", "--config", "."], "--config"),
    _c("plan-config-suffix", ["plan", "--config", "afile"], "--config", "afile"),
    _c("plan-config-empty-name", ["plan", "--config", ""], "--config"),
    _c("plan-config-alias-bomb", ["plan", "--config", "bomb.yaml"], "bomb.yaml", "bomb"),
    *[_c(f"plan-config-{key}", ["plan", "--config", name], name, key)  # the file's own errors name the file
      for key, (name, _) in CONFIGS.items()],
    # probe
    _c("probe-dp-zero", PROBE + ["--dp", "0"], "--dp"),
    _c("probe-steps-zero", PROBE + ["--steps-per-trial", "0"], "--steps-per-trial"),
    _c("probe-max-micro-zero", PROBE + ["--max-micro-batch", "0"], "--max-micro-batch"),
    _c("probe-global-zero", PROBE + ["--global-batch", "0"], "--global-batch"),
    _c("probe-memory-word", PROBE + ["--memory-limit", "lots"], "--memory-limit"),
    _c("probe-memory-zero", PROBE + ["--memory-limit", "0"], "--memory-limit"),
    _c("probe-memory-1e400", PROBE + ["--memory-limit", "1e400"], "--memory-limit"),
    _c("probe-device-foo", ["probe", "--device", "foo", *TINY], "--device"),
    _c("probe-device-cuda99", ["probe", "--device", "cuda:99", *TINY], "--device"),
    _c("probe-precision", PROBE + ["--precision", "fp8"], "--precision"),
    _c("probe-task-unknown", ["probe", "--device", "cpu", "--task", "nosuch"], "--task"),
    _c("probe-task-arg-zero", PROBE + ["--task-arg", "n_layer=0"], "--task-arg"),
    _c("probe-task-arg-unknown", PROBE + ["--task-arg", "layers=2"], "--task-arg"),
    _c("probe-task-arg-no-eq", PROBE + ["--task-arg", "n_layer"], "--task-arg"),
    # sweep: numbers and lists
    _c("sweep-tokens-1e400", SWEEP + ["--tokens", "1e400"], "--tokens"),
    _c("sweep-tokens-1e999999999", SWEEP + ["--tokens", "1e999999999"], "--tokens"),
    _c("sweep-tokens-zero", SWEEP + ["--tokens", "0"], "--tokens"),
    # the seed and a task override, checked before the run directory (or its default parent, runs/) is made
    _c("branch-seed-negative", BRANCH + ["--seed", "-3"], "--seed"),
    _c("noise-seed-negative-default-out", NOISE[:1] + NOISE[3:] + ["--seed", "-1"], "--seed"),
    _c("noise-task-arg-bad-default-out", ["noise", "--task", "mnist", "--steps", "2", "--micro-batch", "2",
                                          "--grad-accum", "2", "--device", "cpu", "--task-arg", "hidden=0"], "--task-arg"),
    _c("sweep-tokens-below-two-steps", SWEEP + ["--tokens", "50"], "--tokens"),  # batch 2 × 16 tokens × 2 = 64
    _c("sweep-threads-huge", SWEEP + ["--threads", "100000"], "--threads"),  # killed the workers' OpenMP pools
    _c("sweep-seed-and-seeds", SWEEP + ["--seed", "1", "--seeds", "0,1"], "--seed"),  # --seed would be ignored
    _c("sweep-eval-points-and-every", SWEEP + ["--eval-points", "5", "--eval-every", "100"], "--eval-points"),
    _c("sweep-warmup-min-steps-negative", SWEEP + ["--warmup-min-steps", "-3"], "--warmup-min-steps"),
    _c("sweep-tokens-word", SWEEP + ["--tokens", "many"], "--tokens"),
    _c("sweep-batches-1e400", SWEEP + ["--batches", "1e400"], "--batches"),
    _c("sweep-batches-1e999999999", SWEEP + ["--batches", "1e999999999"], "--batches"),
    _c("sweep-batches-zero", SWEEP + ["--batches", "0"], "--batches"),
    _c("sweep-batches-word", SWEEP + ["--batches", "2,x"], "--batches"),
    _c("sweep-batches-empty", SWEEP + ["--batches", ""], "--batches"),
    _c("sweep-batches-dup", SWEEP + ["--batches", "2,2"], "--batches"),
    _c("sweep-batches-float", SWEEP + ["--batches", "2.5"], "--batches"),
    _c("sweep-lrs-zero", SWEEP + ["--lrs", "0"], "--lrs"),
    _c("sweep-lrs-neg", SWEEP + ["--lrs", "-1e-3"], "--lrs"),
    _c("sweep-lrs-nan", SWEEP + ["--lrs", "nan"], "--lrs"),
    _c("sweep-lrs-inf", SWEEP + ["--lrs", "inf"], "--lrs"),
    _c("sweep-lrs-1e400", SWEEP + ["--lrs", "1e400"], "--lrs"),
    _c("sweep-lrs-word", SWEEP + ["--lrs", "fast"], "--lrs"),
    _c("sweep-workers-zero", SWEEP + ["--workers", "0"], "--workers"),
    _c("sweep-workers-neg", SWEEP + ["--workers", "-1"], "--workers"),
    _c("sweep-threads-zero", SWEEP + ["--threads", "0"], "--threads"),
    _c("sweep-micro-zero", SWEEP + ["--micro-batch", "0"], "--micro-batch"),
    _c("sweep-eval-every-zero", SWEEP + ["--eval-every", "0"], "--eval-every"),
    _c("sweep-eval-every-1e400", SWEEP + ["--eval-every", "1e400"], "--eval-every"),
    _c("sweep-backend", SWEEP + ["--backend", "slurm"], "--backend"),
    _c("sweep-address-local", SWEEP + ["--address", "ray://x:1"], "--address"),
    _c("sweep-optimizer", SWEEP + ["--optimizer", "lion"], "--optimizer"),
    _c("sweep-device-foo", SWEEP + ["--device", "foo"], "--device"),
    _c("sweep-device-cuda99", SWEEP + ["--device", "cuda:99"], "--device"),
    _c("sweep-precision", SWEEP + ["--precision", "fp8"], "--precision"),
    _c("sweep-seed-word", SWEEP + ["--seed", "x"], "--seed"),
    _c("sweep-budget-zero", SWEEP + ["--budget", "0"], "--budget"),
    _c("sweep-budget-word", SWEEP + ["--budget", "cheap"], "--budget"),
    _c("sweep-budget-nan", SWEEP + ["--budget", "nan"], "--budget"),
    _c("sweep-budget-fraction-above-1", SWEEP + ["--budget", "1.5"], "--budget"),
    _c("sweep-budget-too-small", SWEEP + ["--seeds", "0,1", "--lrs", "1e-3,2e-3", "--budget", "1%"], "--budget"),
    # sweep: tasks
    _c("sweep-task-unknown", SWEEP + ["--task", "nosuch"], "--task"),
    _c("sweep-task-syntax-error", SWEEP[:-len(TINY)] + ["--task", "syn.py:make_task"], "--task", "syn"),
    _c("sweep-task-missing-import", SWEEP[:-len(TINY)] + ["--task", "imp.py:make_task"], "--task", "missing_import"),
    _c("sweep-task-raises", SWEEP[:-len(TINY)] + ["--task", "raises.py:make_task"], "--task", "raises"),
    _c("sweep-task-not-a-task", SWEEP[:-len(TINY)] + ["--task", "notask.py:make_task"], "--task", "notask"),
    _c("sweep-task-missing-file", SWEEP[:-len(TINY)] + ["--task", "nofile.py:make_task"], "--task"),
    _c("sweep-task-missing-module", SWEEP[:-len(TINY)] + ["--task", "no_such_pkg_xyz.mod:make"], "--task"),
    _c("sweep-task-missing-function", SWEEP[:-len(TINY)] + ["--task", "json:no_such_function"], "--task"),
    _c("sweep-task-bad-function", SWEEP[:-len(TINY)] + ["--task", "json:"], "--task"),
    _c("sweep-task-arg-zero", SWEEP + ["--task-arg", "n_layer=0"], "--task-arg"),
    _c("sweep-task-arg-unknown", SWEEP + ["--task-arg", "hiden=3"], "--task-arg"),
    _c("sweep-task-arg-no-eq", SWEEP + ["--task-arg", "=3"], "--task-arg"),
    # sweep: output directories
    _c("sweep-out-empty", SWEEP + ["--out", ""], "--out"),
    _c("sweep-out-under-file", SWEEP + ["--out", "afile/sub"], "--out", "afile"),
    _c("sweep-out-is-file", SWEEP + ["--out", "o"], "--out", "out_file"),
    _c("sweep-out-long", SWEEP + ["--out", LONG], "--out"),
    _c("sweep-out-unwritable", SWEEP + ["--out", "/sys/globalbatch-test"], "--out"),
    _c("sweep-out-broken-manifest", SWEEP, "--out", "out_broken_manifest"),
    _c("sweep-out-other-grid", SWEEP, "--out", "out_other_grid"),
    _c("sweep-out-branch-dir", SWEEP, "--out", "out_branch"),
    _c("sweep-out-locked", SWEEP, "--out", "locked"),
    # report: settings
    _c("report-objective", ["report", "run", "--objective", "speed"], "--objective", "run"),
    _c("report-target-above-the-start", ["report", "run", "--targets", "100"], "--targets", "run"),
    _c("report-tolerance-neg", ["report", "run", "--time-tolerance", "-1"], "--time-tolerance", "run"),
    _c("report-tolerance-big", ["report", "run", "--time-tolerance", "5"], "--time-tolerance", "run"),
    _c("report-tolerance-nan", ["report", "run", "--time-tolerance", "nan"], "--time-tolerance", "run"),
    _c("report-old-tolerance-flag", ["report", "run", "--tolerance", "0.1"], "--tolerance", "run"),
    _c("report-ema-zero", ["report", "run", "--ema-fraction", "0"], "--ema-fraction", "run"),
    _c("report-ema-big", ["report", "run", "--ema-fraction", "2"], "--ema-fraction", "run"),
    _c("report-half-life-zero", ["report", "run", "--half-life-steps", "0"], "--half-life-steps", "run"),
    _c("report-half-life-nan", ["report", "run", "--half-life-steps", "nan"], "--half-life-steps", "run"),
    _c("report-legacy-halflife-flag", ["report", "run", "--halflife-steps", "2"], "--halflife-steps", "run"),
    _c("report-targets-word", ["report", "run", "--targets", "low"], "--targets", "run"),
    _c("report-targets-empty", ["report", "run", "--targets", ","], "--targets", "run"),
    _c("report-targets-nan", ["report", "run", "--targets", "nan"], "--targets", "run"),
    _c("report-lr-selection", ["report", "run", "--lr-selection", "best"], "--lr-selection", "run"),
    # report: output and run directories
    _c("report-out-file", ["report", "run", "--out", "afile"], "--out", "run", "afile"),
    _c("report-out-under-file", ["report", "run", "--out", "afile/sub"], "--out", "run", "afile"),
    _c("report-out-long", ["report", "run", "--out", LONG], "--out", "run"),
    _c("report-out-unwritable", ["report", "run", "--out", "/sys/globalbatch-test"], "--out", "run"),
    _c("report-missing-dir", ["report", "nope"], "RUN_DIR"),
    _c("report-dir-is-file", ["report", "afile"], "RUN_DIR", "afile"),
    _c("report-empty-dir", ["report", "run"], "RUN_DIR", "empty_dir"),
    _c("report-branch-dir", ["report", "run"], "RUN_DIR", "branch_dir"),
    _c("report-broken-manifest", ["report", "run"], "manifest.json", "broken_manifest"),
    _c("report-manifest-list", ["report", "run"], "manifest.json", "manifest_list"),
    _c("report-summary-no-unit", ["report", "run"], "summary.json", "no_unit"),
    _c("report-summary-not-number", ["report", "run"], "summary.json", "nan_summary"),
    _c("report-summary-list", ["report", "run"], "summary.json", "summary_list"),
    _c("report-summary-broken", ["report", "run"], "summary.json", "broken_summary"),
    _c("report-metrics-garbage", ["report", "run"], "metrics.jsonl", "garbage_metrics"),
    _c("report-metrics-non-record", ["report", "run"], "metrics.jsonl", "metrics_non_record"),
    _c("report-timing-broken", ["report", "run"], "b16.json", "broken_timing"),
    _c("report-summary-text-mean-batch", ["report", "run"], "summary.json: mean_batch_units is 'lots'", "text_mean_batch"),
    _c("report-summary-text-batch", ["report", "run"], "summary.json: batch is '128'", "text_batch"),
    _c("report-summary-text-lr", ["report", "run"], "summary.json: lr is 'fast'", "text_lr"),
    _c("report-summary-float-seed", ["report", "run"], "summary.json: seed is 0.5", "float_seed"),
    _c("report-summary-other-trial", ["report", "run"], "summary.json: it names trial", "other_trial"),
    _c("report-summary-not-completed", ["report", "run"], "completed false", "not_completed"),
    _c("report-metrics-missing", ["report", "run"], "without its metrics.jsonl", "no_metrics"),
    _c("report-metrics-text-consumed", ["report", "run"], "consumed is 'many'", "metrics_text_step"),
    _c("report-metrics-text-val-loss", ["report", "run"], "val_loss is 'low'", "metrics_text_val_loss"),
    _c("report-metrics-no-kind", ["report", "run"], "kind is None", "metrics_no_kind"),
    _c("report-timing-text", ["report", "run"], "b16.json: units_per_s is 'fast'", "text_timing"),
    _c("report-missing-arg", ["report"], "RUN_DIR"),
    # noise
    _c("noise-adam-variant-sgd", NOISE + ["--optimizer", "sgd", "--adam-variant"], "--adam-variant"),
    _c("noise-grad-accum-one-process", NOISE + ["--grad-accum", "1"], "--grad-accum 1"),
    _c("noise-corpus-without-py", NOISE + ["--task-arg", "corpus_dir=run"], "--task-arg", "empty_dir"),
    _c("sweep-corpus-without-py", SWEEP + ["--task-arg", "corpus_dir=run"], "--task-arg", "empty_dir"),
    _c("noise-device-foo", NOISE + ["--device", "foo"], "--device"),
    _c("noise-device-cuda99", NOISE + ["--device", "cuda:99"], "--device"),
    _c("noise-precision", NOISE + ["--precision", "fp8"], "--precision"),
    _c("noise-task-unknown", NOISE + ["--task", "nosuch"], "--task"),
    _c("noise-task-arg-zero", NOISE + ["--task-arg", "n_layer=0"], "--task-arg"),
    _c("noise-task-syntax-error", NOISE[:-len(TINY)] + ["--task", "syn.py:make_task"], "--task", "syn"),
    _c("noise-tensorboard-task-unknown", NOISE + ["--tensorboard", "--task", "nosuch"], "--task"),
    _c("noise-out-file", NOISE + ["--out", "afile"], "--out", "afile"),
    _c("noise-out-under-file", NOISE + ["--out", "afile/sub"], "--out", "afile"),
    _c("noise-out-long", NOISE + ["--out", LONG], "--out"),
    _c("noise-out-empty", NOISE + ["--out", ""], "--out"),
    _c("noise-out-unwritable", NOISE + ["--out", "/sys/globalbatch-test"], "--out"),
    _c("noise-micro-zero", NOISE + ["--micro-batch", "0"], "--micro-batch"),
    _c("noise-accum-one", NOISE + ["--grad-accum", "1"], "--grad-accum"),
    _c("noise-steps-zero", NOISE + ["--steps", "0"], "--steps"),
    _c("noise-lr-zero", NOISE + ["--lr", "0"], "--lr"),
    _c("noise-lr-nan", NOISE + ["--lr", "nan"], "--lr"),
    _c("noise-log-every-zero", NOISE + ["--log-every", "0"], "--log-every"),
    _c("noise-half-life-zero", NOISE + ["--half-life-windows", "0"], "--half-life-windows"),
    _c("noise-half-life-inf", NOISE + ["--half-life-windows", "inf"], "--half-life-windows"),
    _c("noise-threads-zero", NOISE + ["--threads", "0"], "--threads"),
    _c("noise-optimizer", NOISE + ["--optimizer", "lion"], "--optimizer"),
    _c("noise-budget-zero", NOISE + ["--budget", "0"], "--budget"),
    _c("noise-budget-percent-over", NOISE + ["--budget", "150%"], "--budget"),
    _c("noise-budget-word", NOISE + ["--budget", "two"], "--budget"),
    _c("noise-steps-word", NOISE + ["--steps", "many"], "--steps"),
    # branch
    _c("branch-base-zero", BRANCH + ["--base-batch", "0"], "--base-batch"),
    _c("branch-points-one", BRANCH + ["--points", "1"], "--points"),
    _c("branch-window-fraction-zero", BRANCH + ["--window-fraction", "0"], "--window-fraction"),
    _c("branch-second-moment", BRANCH + ["--second-moment", "reset"], "--second-moment"),
    _c("branch-tolerance-rule", BRANCH + ["--tolerance-rule", "relative"], "--tolerance-rule"),
    _c("branch-tolerance-rule-train", BRANCH + ["--tolerance-rule", "half_window", "--metric", "train"],
       "--tolerance-rule"),
    _c("branch-points-with-a-list", BRANCH + ["--points", "2", "--warmup-tokens", "100,200"], "--points"),
    _c("branch-points-more-than-units", BRANCH + ["--points", "60", "--warmup-tokens", "50"], "--points"),
    _c("branch-ks-no-one", BRANCH + ["--ks", "2,4"], "--ks"),
    _c("branch-ks-zero", BRANCH + ["--ks", "0,1"], "--ks"),
    _c("branch-ks-word", BRANCH + ["--ks", "1,x"], "--ks"),
    _c("branch-lr-zero", BRANCH + ["--lr", "0"], "--lr"),
    _c("branch-lr-nan", BRANCH + ["--lr", "nan"], "--lr"),
    _c("branch-warmup-1e400", BRANCH + ["--warmup-tokens", "1e400"], "--warmup-tokens"),
    _c("branch-warmup-1e999999999", BRANCH + ["--warmup-tokens", "1e999999999"], "--warmup-tokens"),
    _c("branch-window-1e400", BRANCH + ["--window-tokens", "1e400"], "--window-tokens"),
    _c("branch-window-zero", BRANCH + ["--window-tokens", "0"], "--window-tokens"),
    _c("branch-seeds-one", BRANCH + ["--seeds", "1"], "--seeds"),
    _c("branch-loss-tolerance-neg", BRANCH + ["--loss-tolerance", "-1"], "--loss-tolerance"),
    _c("branch-old-tolerance-flag", BRANCH + ["--tolerance", "0.01"], "--tolerance"),
    _c("branch-alpha-zero", BRANCH + ["--alpha", "0"], "--alpha"),
    _c("branch-alpha-one", BRANCH + ["--alpha", "1"], "--alpha"),
    _c("branch-metric", BRANCH + ["--metric", "accuracy"], "--metric"),
    _c("branch-test", BRANCH + ["--test", "anova"], "--test"),
    _c("branch-optimizer", BRANCH + ["--optimizer", "lion"], "--optimizer"),
    _c("branch-threads-zero", BRANCH + ["--threads", "0"], "--threads"),
    _c("branch-micro-zero", BRANCH + ["--micro-batch", "0"], "--micro-batch"),
    _c("branch-device-foo", BRANCH + ["--device", "foo"], "--device"),
    _c("branch-precision", BRANCH + ["--precision", "fp8"], "--precision"),
    _c("branch-task-unknown", BRANCH + ["--task", "nosuch"], "--task"),
    _c("branch-task-arg-zero", BRANCH + ["--task-arg", "n_layer=0"], "--task-arg"),
    _c("branch-out-file", BRANCH, "--out", "out_file"),
    _c("branch-out-empty", BRANCH + ["--out", ""], "--out"),
    _c("branch-out-under-file", BRANCH + ["--out", "afile/sub"], "--out", "afile"),
    _c("branch-out-long", BRANCH + ["--out", LONG], "--out"),
    _c("branch-out-unwritable", BRANCH + ["--out", "/sys/globalbatch-test"], "--out"),
    _c("branch-out-broken-manifest", BRANCH, "--out", "out_broken_manifest"),
    _c("branch-out-sweep-dir", BRANCH, "--out", "out_grid_for_branch"),
    _c("branch-out-locked", BRANCH, "--out", "locked"),
    # adaptive (--seeds 0,1 is valid: each case below fails on another flag, after --seeds parsed)
    _c("adaptive-seeds-ok-tokens-zero", ADAPTIVE + ["--tokens", "0"], "--tokens"),
    _c("adaptive-seeds-ok-batches-zero", ADAPTIVE + ["--batches", "0,4"], "--batches"),
    _c("adaptive-seeds-ok-lr-zero", ADAPTIVE + ["--lr", "0"], "--lr"),
    _c("adaptive-seeds-ok-device-foo", ADAPTIVE + ["--device", "foo"], "--device"),
    _c("adaptive-seeds-ok-task-arg", ADAPTIVE + ["--task-arg", "n_layer"], "--task-arg"),
    _c("adaptive-seeds-dup", ["adaptive", "--out", "o", "--seeds", "0,0"], "--seeds"),
    _c("adaptive-seeds-word", ["adaptive", "--out", "o", "--seeds", "0,x"], "--seeds"),
    _c("adaptive-seeds-negative", ["adaptive", "--out", "o", "--seeds", "-1"], "--seeds"),
    _c("adaptive-out-file", ["adaptive", "--seeds", "0,1", "--out", "afile"], "--out", "afile"),
    # demo
    _c("demo-workers-zero", ["demo", "--workers", "0"], "--workers"),
    _c("demo-device-foo", ["demo", "--device", "foo"], "--device"),
    _c("demo-precision", ["demo", "--precision", "fp8"], "--precision"),
    _c("demo-out-file", ["demo", "--out", "afile"], "--out", "afile"),
    _c("demo-out-empty", ["demo", "--out", ""], "--out"),
    _c("demo-out-long", ["demo", "--out", LONG], "--out"),
    _c("demo-out-locked", ["demo", "--out", "o"], "--out", "locked"),
    # scale (more in tests/test_scale_cli.py)
    _c("scale-unknown-preset", ["scale", "--prior", "kaplan", "--params", "1B", "--target-loss", "2.6", "--cluster", "h900"],
       "--cluster"),
    _c("scale-negative-bandwidth", ["scale", "--prior", "kaplan", "--params", "1B", "--target-loss", "2.6",
                                    "--cluster", "c.yaml"], "intra_busbw_bytes_per_s", "cluster_neg_bw"),
    _c("scale-unreachable-target", ["scale", "--prior", "kaplan", "--params", "1B", "--target-loss", "1.0"], "--target-loss"),
    _c("scale-fits-no-geometry", ["scale", "--prior", "kaplan", "--params", "10T", "--target-loss", "2.5", "--max-gpus", "8"],
       "--params"),
    # the command line itself
    _c("unknown-command", ["plant"], "plant"),
]


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under ``root``: a file's size and mtime (a directory's entries are its files)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else (0, 0)
            for p in root.rglob("*")}


def run_main(argv: list[str]) -> tuple[int, str, str]:
    from globalbatch.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code
        else:  # pragma: no cover - main always exits
            code = 0
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("argv, field, files", CASES)
def test_bad_input_is_one_line_exit_2_nothing_written(argv, field, files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "120")
    for name in files:
        FILES[name](tmp_path)
    before = _tree(tmp_path)
    t0 = time.perf_counter()
    code, out, err = run_main(argv)
    seconds = time.perf_counter() - t0
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert out == "", out
    assert len(lines) == 1, err
    assert "Traceback" not in err and lines[0].startswith("error: "), err
    assert field in lines[0], (field, lines[0])
    assert _tree(tmp_path) == before, "a rejected command wrote or changed a file"
    assert not Path("/sys/globalbatch-test").exists()
    if "bomb" in files:
        assert seconds < 1.0, f"the alias bomb took {seconds:.2f} s"


def test_there_are_at_least_150_cases_and_every_command_is_covered():
    assert len(CASES) >= 150
    commands = {c.values[0][0] for c in CASES}
    assert {"plan", "probe", "sweep", "report", "noise", "branch", "demo", "adaptive"} <= commands
