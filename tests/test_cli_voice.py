"""One voice on the command line: --json everywhere, choices in --help, one meaning per flag."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

from globalbatch.cli import main
from globalbatch.cli.app import _commands, flag_names_of

TINY = ["--task-arg", "n_layer=1", "--task-arg", "d_model=16", "--task-arg", "n_head=1", "--task-arg", "seq_len=16",
        "--task-arg", "max_corpus_bytes=20000"]


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            return exc.code, out.getvalue(), err.getvalue()
    return 0, out.getvalue(), err.getvalue()


def test_every_command_has_json():
    assert set(_commands()) == {"plan", "probe", "sweep", "report", "noise", "branch", "demo", "adaptive", "scale"}
    for name in _commands():
        assert flag_names_of(name)["as_json"] == "--json", name


@pytest.mark.parametrize("command", ["probe", "noise", "sweep", "branch", "adaptive", "plan"])
def test_task_help_names_the_file_form(command, monkeypatch):
    """`--task path/to/file.py:function` works (docs/tasks.md): every --task help says so."""
    code, out, _ = run([command, "--help"])
    task_help = re.split(r" --[a-z-]+ <", " ".join(out.split()).split("--task <str>")[1])[0]  # however it wraps
    assert code == 0 and "package.module:function or path/to/file.py:function" in task_help


@pytest.mark.parametrize("command, flag, choices", [
    ("report", "--objective", "<time|cost>"), ("branch", "--metric", "<val|train>"), ("branch", "--test", "<paired|welch>"),
    ("sweep", "--backend", "<local|ray>"), ("sweep", "--optimizer", "<adamw|sgd|lars|lamb>"), ("noise", "--precision", "<fp32|bf16|fp16>"),
    ("plan", "--lr-rule", "<linear|sqrt|none>"), ("demo", "--precision", "<fp32|bf16|fp16>"),
])
def test_choices_are_shown_in_help_and_enforced(command, flag, choices, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run([command, "--help"])
    assert code == 0 and f"{flag} {choices}" in out
    code, out, err = run([command, flag, "nope"] + (["RUN"] if command == "report" else []))
    allowed = choices.strip("<>").replace("|", ", ")
    assert code == 2 and out == "" and err == f"error: {flag} 'nope' is not allowed; allowed: {allowed}\n"


def test_tolerance_means_one_thing_per_name_and_old_spellings_are_gone():
    names = {c: flag_names_of(c) for c in ("probe", "report", "branch")}
    assert names["probe"]["tolerance"] == "--throughput-tolerance"
    assert names["report"]["tolerance"] == "--time-tolerance"
    assert names["branch"]["tolerance"] == "--loss-tolerance"
    for command in names:
        code, _, err = run([command, "--tolerance", "0.1"])
        assert code == 2 and "--tolerance" in err and err.count("\n") == 1
    code, _, err = run(["report", "RUN", "--halflife-steps", "2"])
    assert code == 2 and "--halflife-steps" in err


def test_field_names_map_to_the_flags_typer_defines():
    sweep = flag_names_of("sweep")
    assert sweep["budget"] == "--tokens" and sweep["task_overrides"] == "--task-arg" and sweep["out"] == "--out"
    assert flag_names_of("report")["run_dir"] == "RUN_DIR"
    assert flag_names_of("plan")["grad_accum_steps"] == "--grad-accum"


def test_plan_and_report_json(tmp_path):
    code, out, err = run(["plan", "--micro-batch", "2", "--grad-accum", "4", "--dp", "2", "--seq-len", "8", "--json"])
    assert code == 0 and json.loads(out)["global_batch_sequences"] == 16
    from test_report import write_synthetic_sweep

    write_synthetic_sweep(tmp_path)
    code, out, err = run(["report", str(tmp_path), "--json"])
    doc = json.loads(out)
    assert code == 0 and doc["html"].endswith("report.html") and "recommend" in doc["first_seed_recommendation"]
    # the analysis over seeds (issue 10): targets and a recommendation with its spread, when the sweep has one
    rec = doc["recommendation"]
    assert rec is None or {"batch", "lr", "per_seed", "probability_fastest"} <= set(rec)


def test_noise_json(tmp_path):
    code, out, err = run(["noise", "--out", str(tmp_path), "--steps", "2", "--log-every", "1", "--micro-batch", "2",
                          "--grad-accum", "2", "--device", "cpu", "--json", *TINY])
    doc = json.loads(out)
    assert code == 0 and len(doc["rows"]) == 2 and doc["final"]["micro/sample"]["windows"] == 2


@pytest.mark.parametrize("kw, field", [(dict(lr=-1.0), "lr"), (dict(padding_fraction=1.0), "padding_fraction"),
                                       (dict(warmup_steps=-1), "warmup_steps"), (dict(pp_stages=0), "pp_stages"),
                                       (dict(lr_rule="cubic"), "lr_rule")])
def test_plan_config_errors_carry_their_field(kw, field):
    """The library raises SettingError(field); the CLI finds the flag in its typer parameters, not in the text."""
    from globalbatch._util import SettingError
    from globalbatch.plan.config import PlanConfig

    with pytest.raises(SettingError) as exc:
        PlanConfig(micro_batch=2, grad_accum_steps=1, dp_world_size=1, **kw)
    assert exc.value.field == field
    flag = flag_names_of("plan")[field]
    code, out, err = run(["plan", "--micro-batch", "2", "--grad-accum", "1", "--dp", "1",
                          flag, str(next(iter(kw.values())))])
    assert code == 2 and out == "" and err.startswith(f"error: {flag} ") and err.count("\n") == 1


def test_a_bad_value_from_a_file_keeps_the_files_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("micro_batch: 2\ngrad_accum_steps: 1\nseq_len: 8\nvalid_tokens_per_seq: 20\n")
    code, out, err = run(["plan", "--config", str(cfg)])
    assert code == 2 and err.startswith(f"error: {cfg}: valid_tokens_per_seq 20 is not allowed") \
        and "--" not in err.split(";")[0]
