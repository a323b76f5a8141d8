"""Tests of globalbatch.plan.memory (the memory model), its measured activations, and ``plan --memory``."""

from __future__ import annotations

import json
import math

import pytest

from globalbatch.errors import SettingError
import torch

from globalbatch.cli import main
from globalbatch.plan.memory import (
    Activations,
    MemoryConfig,
    activations_from_points,
    breakdown,
    largest_micro_batch,
    static_bytes,
)

GB = 1e9


@pytest.mark.parametrize("sharding, expected_gb", [
    ("none", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9), ("fsdp", 1.9)])
def test_zero_paper_figure_1(sharding, expected_gb):
    """ZeRO Figure 1: Ψ = 7.5B, N_d = 64, mixed precision Adam (K = 12): 120, 31.4, 16.6, 1.9 GB."""
    cfg = MemoryConfig(params=7_500_000_000, optimizer="adamw", precision="bf16-mixed", sharding=sharding,
                       dp_world_size=64)
    total = sum(static_bytes(cfg).values())
    assert total / GB == pytest.approx(expected_gb, abs=0.05)


@pytest.mark.parametrize("optimizer, per_param", [("sgd-plain", 8), ("sgd-momentum", 12), ("sgd", 12), ("lars", 12),
                                                  ("adamw", 16), ("lamb", 16)])
def test_fp32_bytes_per_param(optimizer, per_param):
    cfg = MemoryConfig(params=1000, optimizer=optimizer)
    parts = static_bytes(cfg)
    assert sum(parts.values()) == per_param * 1000
    assert parts["master_weights_bytes"] == 0  # fp32: no master copy


def test_adafactor_factored_state_from_shapes():
    shapes = ((64, 32), (32,), (4, 8, 16))  # matrix: 64 + 32; vector: 32; batched: 4 × (8 + 16)
    cfg = MemoryConfig(params=64 * 32 + 32 + 4 * 8 * 16, optimizer="adafactor", param_shapes=shapes)
    assert static_bytes(cfg)["optimizer_states_bytes"] == 4 * (96 + 32 + 4 * 24)
    no_shapes = MemoryConfig(params=100, optimizer="adafactor")
    assert static_bytes(no_shapes)["optimizer_states_bytes"] == 0
    assert "needs the shapes" in breakdown(no_shapes, Activations(bytes_per_sample=1.0), 1).note


def test_largest_micro_batch_exact_at_every_boundary():
    cfg = MemoryConfig(params=1_000_000, optimizer="adamw")  # 16 MB static
    acts = Activations(bytes_per_sample=3_000_000, workspace_bytes=500_000)
    for t in (1, 2, 7, 100, 1000):
        at = 16_000_000 + 500_000 + 3_000_000 * t
        assert largest_micro_batch(cfg, acts, at) == t
        assert largest_micro_batch(cfg, acts, at - 1) == t - 1
        assert largest_micro_batch(cfg, acts, at + 2_999_999) == t
        assert breakdown(cfg, acts, t).total_bytes == at
    assert largest_micro_batch(cfg, acts, 16_000_000) == 0  # static alone fills it


def test_checkpointing_divides_activations_and_sharding_divides_states():
    acts = Activations(bytes_per_sample=8e6)
    plain = MemoryConfig(params=10_000_000, dp_world_size=8)
    ckpt = MemoryConfig(params=10_000_000, dp_world_size=8, checkpoint_divisor=4)
    z2 = MemoryConfig(params=10_000_000, dp_world_size=8, sharding="zero2")
    budget = 1e9
    assert largest_micro_batch(plain, acts, budget) == math.floor((budget - 160e6) / 8e6)
    assert largest_micro_batch(ckpt, acts, budget) == math.floor((budget - 160e6) / 2e6)
    assert largest_micro_batch(z2, acts, budget) == math.floor((budget - 40e6 - (40e6 + 80e6) / 8) / 8e6)  # weights whole; grads, states ÷ 8


def test_activations_from_points_recover_a_known_line():
    a, b, formula = 12_345_678.0, 4_736_000.0, 10_000_000.0
    acts = activations_from_points([(8, a + 8 * b), (16, a + 16 * b)], formula_static_bytes=formula)
    assert acts.bytes_per_sample == pytest.approx(b, rel=1e-12)
    assert acts.workspace_bytes == pytest.approx(a - formula, rel=1e-9)
    three = activations_from_points([(4, a + 4 * b + 10), (8, a + 8 * b - 20), (16, a + 16 * b + 10)])
    assert three.bytes_per_sample == pytest.approx(b, rel=1e-5)
    with pytest.raises(SettingError, match="at least two different micro-batch sizes"):
        activations_from_points([(8, 1.0), (8, 2.0)])


@pytest.mark.parametrize("kw, match", [
    ({"params": 0}, "params 0 is not allowed"), ({"optimizer": "adam"}, "optimizer 'adam' is not allowed"),
    ({"precision": "fp8"}, "precision 'fp8'"), ({"sharding": "zero4"}, "sharding 'zero4'"),
    ({"dp_world_size": 0}, "dp_world_size 0"), ({"checkpoint_divisor": 0.5}, "checkpoint_divisor 0.5")])
def test_bad_config_names_the_field(kw, match):
    with pytest.raises(SettingError, match=match):
        MemoryConfig(**{"params": 10, **kw})


def test_measured_prediction_matches_the_probe_on_tiny_tinygpt():
    """The model's prediction (formula + fwd/bwd activations at 8, 16) against the probe's measured largest."""
    from globalbatch.lab.probe_run import probe_task

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = probe_task("tinygpt", memory_limit_bytes=48 * 2**20, steps_per_trial=1, device="cpu",
                            task_overrides={"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32})
    finally:
        torch.set_num_threads(threads)
    assert result.predicted_micro_batch is not None
    assert abs(result.predicted_micro_batch - result.largest_fit) <= 0.1 * result.largest_fit
    assert "16 B (fp32 weights, AdamW)" in result.predicted_note


# --------------------------------------------------------------------------- CLI


class _Res:
    def __init__(self, exit_code, stdout, stderr):
        self.exit_code, self.stdout, self.stderr = exit_code, stdout, stderr
        self.output = stdout + stderr


def _run(capsys, args):
    with pytest.raises(SystemExit) as exc:
        main(args)
    out = capsys.readouterr()
    return _Res(exc.value.code, out.out, out.err)


def test_plan_memory_json_matches_the_closed_form(capsys):
    res = _run(capsys, ["plan", "--memory", "80GiB", "--params", "7B", "--activation-bytes-per-sample", "1GiB",
                            "--precision", "bf16-mixed", "--sharding", "zero3", "--dp", "8", "--json"])
    assert res.exit_code == 0, res.output
    mem = json.loads(res.stdout)["memory"]
    static = 16 * 7e9 / 8
    assert mem["largest_micro_batch"] == math.floor((80 * 2**30 - static) / 2**30)
    assert mem["breakdown"]["static_bytes"] == pytest.approx(static)
    assert mem["fits"] is True


def test_plan_memory_table_and_geometry_warning(capsys):
    res = _run(capsys, ["plan", "--memory", "10GiB", "--params", "100M", "--activation-bytes-per-sample",
                            "1GiB", "--global-batch", "64", "--micro-batch", "16", "--dp", "1"])
    assert res.exit_code == 0, res.output
    assert "optimizer states" in res.stdout and "largest micro-batch that fits: 8" in res.stdout
    assert "micro_batch 16 needs" in res.stderr and "the largest that fits is 8" in res.stderr
    # a small model's bytes in their own unit (it read "needs 0.00 GiB, more than --memory 4MiB")
    res = _run(capsys, ["plan", "--memory", "4MiB", "--params", "7408", "--activation-bytes-per-sample", "78KiB",
                        "--global-batch", "64", "--micro-batch", "64", "--dp", "1"])
    assert res.exit_code == 0 and "micro_batch 64 needs 4.99 MiB, more than --memory 4MiB; the largest that fits is 51" \
        in res.stderr


def test_plan_memory_uses_the_plans_dp_and_one_pipeline_stage(capsys, tmp_path):
    # a --config file's dp_world_size is the world ZeRO shards over (it was dp 1: 7B fp32 AdamW zero1 did not fit)
    cfg = tmp_path / "run.yaml"
    cfg.write_text("micro_batch: 2\ngrad_accum_steps: 8\ndp_world_size: 64\n")
    mem_flags = ["--memory", "80GiB", "--params", "7B", "--activation-bytes-per-sample", "1GiB", "--json"]
    res = _run(capsys, ["plan", "--config", str(cfg), *mem_flags, "--sharding", "zero1"])
    assert res.exit_code == 0, res.output
    mem = json.loads(res.stdout)["memory"]
    assert mem["dp_world_size"] == 64 and mem["breakdown"]["static_bytes"] == pytest.approx(8 * 7e9 + 8 * 7e9 / 64)
    assert mem["largest_micro_batch"] == math.floor((80 * 2**30 - 8 * 7e9 - 8 * 7e9 / 64) / 2**30)
    # with --pp-stages a device holds one stage's parameters: ceil(N / p)
    for geometry in (["--global-batch", "64", "--micro-batch", "1", "--dp", "4"], []):
        res = _run(capsys, ["plan", *geometry, *mem_flags, "--pp-stages", "8", "--params", "70B"])
        assert res.exit_code == 0, res.output
        mem = json.loads(res.stdout)["memory"]
        assert mem["pp_stages"] == 8 and mem["params"] == 8_750_000_000
        assert mem["breakdown"]["static_bytes"] == pytest.approx(16 * 70e9 / 8)
    res = _run(capsys, ["plan", *mem_flags, "--pp-stages", "0"])
    assert res.exit_code == 2 and res.stderr.strip() == "error: --pp-stages 0 is not allowed; allowed: a whole number ≥ 1"


def test_plan_memory_takes_params_from_a_config_file(capsys, tmp_path):
    """'--memory 80GiB' with a --config that says params: 7B said '--params is missing'."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("micro_batch: 2\ngrad_accum_steps: 8\ndp_world_size: 8\nparams: 7B\npp_stages: 4\n")
    res = _run(capsys, ["plan", "--config", str(cfg), "--memory", "80GiB", "--activation-bytes-per-sample", "1GiB",
                        "--json"])
    assert res.exit_code == 0, res.output
    mem = json.loads(res.stdout)["memory"]
    assert mem["params"] == 1_750_000_000 and mem["pp_stages"] == 4 and mem["dp_world_size"] == 8
    cfg.write_text("micro_batch: 2\ngrad_accum_steps: 8\nparams: lots\n")
    res = _run(capsys, ["plan", "--config", str(cfg), "--memory", "80GiB", "--activation-bytes-per-sample", "1GiB"])
    assert res.exit_code == 2 and res.stdout == "" and res.stderr.startswith(f"error: {cfg}: params 'lots' is not allowed")


@pytest.mark.parametrize("args, flag", [
    (["--memory", "lots", "--params", "1B", "--activation-bytes-per-sample", "1MiB"], "--memory 'lots'"),
    (["--memory", "0", "--params", "1B", "--activation-bytes-per-sample", "1MiB"], "--memory 0"),
    (["--memory", "8GiB", "--activation-bytes-per-sample", "1MiB"], "--memory 8GiB is not allowed (--params is missing)"),
    (["--memory", "8GiB", "--params", "1B"], "--memory 8GiB is not allowed (--activation-bytes-per-sample is missing)"),
    (["--memory", "8GiB", "--params", "x", "--activation-bytes-per-sample", "1MiB"], "--params 'x'"),
    (["--memory", "8GiB", "--params", "1B", "--activation-bytes-per-sample", "0"], "--activation-bytes-per-sample 0"),
    (["--memory", "8GiB", "--params", "1B", "--activation-bytes-per-sample", "1MiB", "--optimizer", "lion"],
     "--optimizer 'lion' is not allowed; allowed: adamw, sgd, lars, lamb, sgd-plain"),
    (["--memory", "8GiB", "--params", "1B", "--activation-bytes-per-sample", "1MiB", "--precision", "fp16"],
     "--precision 'fp16'"),
    (["--memory", "8GiB", "--params", "1B", "--activation-bytes-per-sample", "1MiB", "--sharding", "zero4"],
     "--sharding 'zero4'"),
    (["--memory", "8GiB", "--params", "1B", "--activation-bytes-per-sample", "1MiB", "--checkpoint-divisor", "0.5"],
     "--checkpoint-divisor 0.5"),
    (["--memory", "8GiB", "--params", "1B", "--activation-bytes-per-sample", "1MiB", "--dp", "0"], "--dp 0"),
    (["--memory", "8GiB", "--task", "tinygpt", "--params", "1B"], "--params 1B is not allowed (with --task tinygpt"),
    (["--memory", "8GiB", "--params", "1B", "--activation-bytes-per-sample", "1MiB", "--task-arg", "d_model=8"],
     "--task-arg d_model=8 is not allowed (without --task)"),
    (["--memory", "8GiB", "--task", "nosuch"], "--task 'nosuch'"),
    (["--memory", "8GiB", "--task", "tinygpt", "--task-arg", "d_model=-1"], "--task-arg"),
    (["--sharding", "zero1", "--global-batch", "8", "--micro-batch", "2", "--dp", "1"],
     "--sharding zero1 is not allowed (without --memory)"),
    (["--optimizer", "adafactor", "--global-batch", "8"], "--optimizer 'adafactor' is not allowed"),
])
def test_plan_memory_bad_flags_are_one_line_exit_2(capsys, args, flag):
    res = _run(capsys, ["plan", *args])
    assert res.exit_code == 2, res.output
    assert res.stdout == ""  # checked before anything is printed
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0], res.stderr


def test_adafactor_state_of_one_pipeline_stage_is_that_stages_matrices():
    """Adafactor's factored state (rows + cols per matrix) of one stage: the shapes are cut into contiguous stages of
    about equal parameter counts and the heaviest stage's state is the device's, not the whole model's."""
    from globalbatch.plan.memory import one_pipeline_stage, optimizer_state_elements, stage_shapes

    shapes = ((1000, 64), (64,), (64, 64), (64,), (64, 1000))  # embedding, norm, block, norm, head
    n = sum(math.prod(s) for s in shapes)
    cfg = MemoryConfig(params=n, optimizer="adafactor", param_shapes=shapes)
    stages = stage_shapes(shapes, 2)
    assert sum(stages, ()) == shapes  # every shape in one stage, in order
    assert stages == [shapes[:2], shapes[2:]]  # midpoints 32,000 and 64,032 of 132,224 → stage 0; the rest → 1
    one = one_pipeline_stage(cfg, 2)
    assert one.params == -(-n // 2) and one.param_shapes == shapes[2:]
    whole = optimizer_state_elements(cfg)[0]
    assert whole == (1000 + 64) + 64 + (64 + 64) + 64 + (64 + 1000)
    assert optimizer_state_elements(one)[0] == (64 + 64) + 64 + (64 + 1000) < whole  # stage 1: 1,256 of 2,384
    assert one_pipeline_stage(cfg, 1) is cfg
    assert len(stage_shapes(shapes, 8)) == 8 and sum(stage_shapes(shapes, 8), ()) == shapes  # empty stages allowed
    adam = one_pipeline_stage(MemoryConfig(params=n, optimizer="adamw", param_shapes=shapes), 4)
    assert optimizer_state_elements(adam)[0] == 2 * -(-n // 4)  # count-based optimizers: ⌈N / p⌉
    for bad in (0, -1, 1.5, True):
        with pytest.raises(SettingError, match="pp_stages"):
            stage_shapes(shapes, bad)
        with pytest.raises(SettingError, match="pp_stages"):
            one_pipeline_stage(cfg, bad)


def test_plan_memory_with_a_task_counts_adafactor_per_pipeline_stage(capsys):
    args = ["plan", "--memory", "8GiB", "--task", "tinygpt", "--task-arg", "max_corpus_bytes=200000",
            "--optimizer", "adafactor", "--json"]
    one = _run(capsys, args)
    two = _run(capsys, args + ["--pp-stages", "2"])
    assert one.exit_code == 0 and two.exit_code == 0, (one.output, two.output)
    s1 = json.loads(one.stdout)["memory"]["breakdown"]["optimizer_states_bytes"]
    s2 = json.loads(two.stdout)["memory"]["breakdown"]["optimizer_states_bytes"]
    assert 0 < s2 < s1  # the whole model's factored state was counted on each stage
