"""`globalbatch plan` end to end: golden outputs for the seeds' examples, errors, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "configs"
SEED = ["--micro-batch", "2", "--grad-accum", "8", "--dp", "64", "--seq-len", "2048"]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="120", NO_COLOR="1", TERM="dumb")
    return subprocess.run([sys.executable, "-m", "globalbatch.cli", *args], capture_output=True, text=True, env=env, timeout=60)


def test_seed_example_json():
    out = json.loads(cli("plan", *SEED, "--json").stdout)
    assert out["global_batch_sequences"] == 1024
    assert out["global_batch_tokens"] == 2_097_152
    out = json.loads(cli("plan", *SEED, "--valid-tokens-per-seq", "1500", "--json").stdout)
    assert out["global_batch_valid_tokens"] == 1_536_000


def test_stable_json_keys():
    out = json.loads(cli("plan", *SEED, "--json").stdout)
    required = {
        "global_batch_sequences", "global_batch_tokens", "global_batch_valid_tokens", "micro_batch",
        "grad_accum_steps", "dp_world_size", "optimizer_steps", "lr", "warmup_steps",
        "pipeline_bubble_fraction", "allreduce_bytes_per_step", "priors",
    }
    assert required <= set(out)
    assert all(k == k.lower() and " " not in k for k in out)


@pytest.mark.parametrize("name, args", [
    ("seed_example", ["plan", "--config", str(EXAMPLES / "seed_example.yaml"), "--pp-stages", "4", "--params", "7B"]),
])
def test_golden_table_and_json(name, args):
    table = cli(*args)
    assert table.returncode == 0, table.stderr
    js = cli(*args, "--json")
    got_json = json.loads(js.stdout)
    got_json["source"] = "yaml"
    expected_json = json.loads((GOLDEN / f"{name}.json").read_text())
    assert got_json == expected_json
    assert table.stdout == (GOLDEN / f"{name}.txt").read_text()
    assert "64 ranks × 8 accum × 2 seq × 2,048" in table.stdout


def test_world_size_change_from_config_keeps_the_global_batch():
    cfg = str(EXAMPLES / "seed_example.yaml")
    out = json.loads(cli("plan", "--config", cfg, "--dp", "128", "--json").stdout)
    assert (out["global_batch_sequences"], out["grad_accum_steps"], out["dp_world_size"]) == (1024, 4, 128)
    bad = cli("plan", "--config", cfg, "--dp", "96")
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "error: --dp 96 is not allowed (global batch 1024 is not divisible by micro_batch 2 × dp 96 = 192; "
        "nearest valid global batches: 960 or 1152); allowed: a world size where micro_batch 2 × dp divides 1024, "
        "or --round-down to drop the remainder explicitly"
    )
    ok = json.loads(cli("plan", "--config", cfg, "--dp", "96", "--round-down", "--json").stdout)
    assert ok["global_batch_sequences"] == 960 and ok["dp_change"]["dropped_samples_per_step"] == 64


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", "--dp", "x"], "--dp 'x' is not allowed; allowed: a whole number"),
        (["plan", "--lr", "fast", "--micro-batch", "2", "--grad-accum", "2"], "--lr 'fast' is not allowed; allowed: a number"),
        (["plan", "--dp", "0", "--micro-batch", "2", "--grad-accum", "2"], "--dp 0 is not allowed; allowed: a whole number ≥ 1"),
        (["plan", "--global-batch", "1000", "--micro-batch", "4", "--dp", "64"], "global batch 1000 is not divisible by micro_batch 4 × dp 64 = 256"),
        (["plan", "--micro-batch", "2", "--grad-accum", "2", "--total-tokens", "lots"], "--total-tokens 'lots' is not allowed (not a quantity)"),
        (["plan", "--micro-batch", "2", "--grad-accum", "2", "--lr-rule", "cubic"], "--lr-rule 'cubic' is not allowed"),
        (["plan", "--config", "/nonexistent.yaml"], "does not exist"),
        (["plan", "--micro-batch", "2", "--grad-accum", "2", "--padding-fraction", "1.5", "--seq-len", "8"],
         "--padding-fraction 1.5 is not allowed; allowed: 0 ≤ x < 1"),
        (["plan", "--bogus"], "No such option: --bogus"),
        (["nosuchcommand"], "No such command"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, message):
    r = cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and message in lines[0]
    assert "Traceback" not in r.stderr


def test_bad_config_key_via_cli(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("micro_batch: 2\nmicro_bach: 3\n")
    r = cli("plan", "--config", str(p))
    assert r.returncode == 2 and "key 'micro_bach' is not allowed (unknown" in r.stderr


def test_help_lists_plan_flags():
    r = cli("plan", "--help")
    assert r.returncode == 0
    for flag in ("--global-batch", "--micro-batch", "--grad-accum", "--dp", "--seq-len", "--valid-tokens-per-seq",
                 "--padding-fraction", "--total-tokens", "--lr-rule", "--warmup-tokens", "--pp-stages",
                 "--virtual-stages", "--params", "--config", "--round-down", "--json"):
        assert flag in r.stdout


def test_warnings_go_to_stderr_on_one_line():
    r = cli("plan", "--micro-batch", "2", "--grad-accum", "8", "--dp", "4", "--pp-stages", "16")
    assert r.returncode == 0
    assert "warning" not in r.stdout
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("warning: 8 micro-batches per step < 16 pipeline stages")


def test_version_and_short_help():
    from globalbatch import __version__

    assert cli("--version").stdout.strip() == f"globalbatch {__version__}"
    assert "--global-batch" in cli("plan", "-h").stdout


def test_decimal_budget_on_the_command_line():
    out = json.loads(cli("plan", *SEED, "--total-tokens", "4.1B", "--json").stdout)
    assert out["optimizer_steps"] == 1956  # ceil(4.1e9 / 2,097,152)
    bad = cli("plan", *SEED, "--total-tokens", "1,5B")
    assert bad.returncode == 2 and "--total-tokens '1,5B' is not allowed (not a quantity)" in bad.stderr


def test_plan_model_flops_per_step_is_the_labelled_6n_formula():
    out = json.loads(cli("plan", *SEED, "--params", "7B", "--json").stdout)
    assert out["model_flops_per_step"] == 6 * 7e9 * 1024 * 2048  # 6·N × padded token slots per step
    assert "formula" in out["model_flops_formula"]
    bare = json.loads(cli("plan", *SEED, "--json").stdout)
    assert bare["model_flops_per_step"] is None  # no params: no FLOPs
