"""globalbatch.plan.config: file loaders (ours, DeepSpeed, HF) and the plan report."""

from __future__ import annotations

import dataclasses
import json

import pytest

from globalbatch.errors import SettingError

from globalbatch.plan.config import PlanConfig, read_config_file, resolve_plan_config
from globalbatch.plan.report import build_plan, make_plan


def load_config(path, dp_world_size=None, **flags):
    """File (+ flags) -> PlanConfig keyword arguments, as the CLI resolves them."""
    cfg, _ = resolve_plan_config(path, flags, dp_world_size=dp_world_size)
    return {k: v for k, v in cfg.__dict__.items()}


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_yaml_and_toml_agree(tmp_path):
    y = write(tmp_path, "a.yaml", "micro_batch: 2\ngrad_accum_steps: 8\ndp_world_size: 64\nseq_len: 2048\ntotal_tokens: 100B\n")
    t = write(tmp_path, "a.toml", 'micro_batch = 2\ngrad_accum_steps = 8\ndp_world_size = 64\nseq_len = 2048\ntotal_tokens = "100B"\n')
    ry = build_plan(PlanConfig(**load_config(y)))
    rt = build_plan(PlanConfig(**load_config(t)))
    assert dataclasses.replace(ry, source=None) == dataclasses.replace(rt, source=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ry.micro_batch = 4  # the report is frozen
    assert ry.global_batch_tokens == 2_097_152
    assert ry.optimizer_steps == 47_684  # ceil(1e11 / 2,097,152)


def test_unknown_key_in_our_schema_is_an_error(tmp_path):
    p = write(tmp_path, "a.yaml", "micro_batch: 2\ngrad_acum_steps: 8\n")
    with pytest.raises(SettingError, match=r"a.yaml: key 'grad_acum_steps' is not allowed \(unknown; did you mean 'grad_accum_steps'\?\); allowed: compute"):
        load_config(p)


@pytest.mark.parametrize(
    "text, match",
    [
        ("micro_batch: two\n", r"micro_batch 'two' is not allowed; allowed: a whole number"),
        ("seq_len: 2K\n", r"seq_len '2K' is not allowed; allowed: a whole number"),
        ("dp_world_size: 64\ndp_world_size: 32\n", r"duplicate key 'dp_world_size' at line 2"),
        ("micro_batch: 0\n", r"micro_batch 0 is not allowed"),
        ("no_sync: 3\n", r"no_sync 3 is not allowed; allowed: true or false"),
        ("- 1\n- 2\n", r"\(it holds a list\); allowed: a mapping"),
        ("a: [1,\n", r"cannot be parsed"),
        ("lr: fast\n", r"a.yaml: lr 'fast' is not allowed; allowed: a number"),
    ],
)
def test_bad_values_in_yaml(tmp_path, text, match):
    p = write(tmp_path, "a.yaml", text)
    with pytest.raises(SettingError, match=match):
        load_config(p)


def test_missing_file_and_bad_suffix(tmp_path):
    with pytest.raises(SettingError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(SettingError, match=r"suffix '.ini'\); allowed: a file ending .yaml, .yml, .toml or .json"):
        load_config(write(tmp_path, "a.ini", "x=1"))
    with pytest.raises(SettingError, match="is a directory"):
        load_config(tmp_path)


# DeepSpeed's solving table (peer-frameworks.md), with world size 4.
@pytest.mark.parametrize(
    "ds, expect",
    [
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, (64, 4, 4)),
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, (64, 4, 4)),
        ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, (64, 8, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, (32, 4, 2)),
        ({"train_batch_size": 64}, (64, 16, 1)),
        ({"train_micro_batch_size_per_gpu": 4}, (16, 4, 1)),
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}, (64, 16, 1)),
    ],
)
def test_deepspeed_rules(tmp_path, ds, expect):
    ds = dict(ds, zero_optimization={"stage": 2}, fp16={"enabled": True})  # unknown keys ignored
    p = write(tmp_path, "ds.json", json.dumps(ds))
    r = build_plan(PlanConfig(**load_config(p, dp_world_size=4)))
    assert (r.global_batch_sequences, r.micro_batch, r.grad_accum_steps) == expect
    assert r.dp_world_size == 4 and r.source == "deepspeed"


def test_deepspeed_inconsistent_and_missing(tmp_path):
    p = write(tmp_path, "ds.json", json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}))
    with pytest.raises(SettingError, match=r"global batch 16 != micro_batch 4 × grad_accum 8 × dp 4 = 128"):
        build_plan(PlanConfig(**load_config(p, dp_world_size=4)))
    p = write(tmp_path, "ds2.json", json.dumps({"gradient_accumulation_steps": 8}))
    with pytest.raises(SettingError, match="either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"):
        load_config(p, dp_world_size=4)
    p = write(tmp_path, "ds3.json", json.dumps({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4}))
    with pytest.raises(SettingError, match=r"global batch 100 is not divisible by micro_batch 4 × dp 8 = 32"):
        build_plan(PlanConfig(**load_config(p, dp_world_size=8)))


def test_hf_training_arguments(tmp_path):
    p = write(tmp_path, "args.json", json.dumps({
        "output_dir": "out", "per_device_train_batch_size": 8, "gradient_accumulation_steps": 4,
        "learning_rate": 5e-5, "warmup_steps": 100, "fp16": True, "unknown_future_key": 1,
    }))
    kw = load_config(p, dp_world_size=8, seq_len=512)
    r = build_plan(PlanConfig(**kw))
    assert (r.global_batch_sequences, r.micro_batch, r.grad_accum_steps, r.dp_world_size) == (256, 8, 4, 8)
    assert r.lr == 5e-5 and r.warmup_steps == 100 and r.warmup_tokens == 100 * 256 * 512


def test_a_file_value_the_geometry_refuses_names_the_file_and_its_key(tmp_path):
    # DeepSpeed solves GAS from train_batch_size / micro: 64 / 3 does not divide; the line names the file's key
    ds = write(tmp_path, "ds.json", json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 3,
                                                "gradient_accumulation_steps": "auto"}))
    with pytest.raises(SettingError, match=r"^.*ds\.json: train_batch_size 64 is not allowed \(global batch 64 is "
                                           r"not divisible by micro_batch 3 × dp 1 = 3") as info:
        make_plan(ds, {})
    assert info.value.field == f"{ds}: train_batch_size"
    ours = write(tmp_path, "ours.yaml", "global_batch: 100\nmicro_batch: 3\ndp_world_size: 4\n")
    with pytest.raises(SettingError, match=r"ours\.yaml: global_batch 100 is not allowed"):
        make_plan(ours, {})


def test_a_given_global_batch_is_checked_against_a_per_device_file_never_dropped(tmp_path):
    hf = write(tmp_path, "args.json", json.dumps({"per_device_train_batch_size": 3, "gradient_accumulation_steps": 2}))
    with pytest.raises(SettingError, match=r"global batch 100 != micro_batch 3 × grad_accum 2 × dp 4 = 24") as info:
        make_plan(hf, {"global_batch": 100}, dp_world_size=4)
    assert info.value.field == "global_batch"  # the given value: the CLI names --global-batch
    assert make_plan(hf, {"global_batch": 24}, dp_world_size=4).global_batch_sequences == 24


def test_valid_tokens_and_padding_fraction():
    r = build_plan(PlanConfig(micro_batch=2, grad_accum_steps=8, dp_world_size=64, seq_len=2048, valid_tokens_per_seq=1500))
    assert r.global_batch_valid_tokens == 1_536_000
    r2 = build_plan(PlanConfig(micro_batch=2, grad_accum_steps=8, dp_world_size=64, seq_len=2048, padding_fraction=0.25))
    assert r2.global_batch_valid_tokens == 1024 * 1536
    with pytest.raises(SettingError, match=r"disagrees with \(1 − padding_fraction 0.25\) × seq_len 2048 = 1,536 valid\); allowed: valid_tokens_per_seq or"):
        build_plan(PlanConfig(micro_batch=2, grad_accum_steps=8, dp_world_size=64, seq_len=2048, padding_fraction=0.25, valid_tokens_per_seq=1500))
    with pytest.raises(SettingError, match="valid_tokens_per_seq 3,000 is not allowed; allowed: ≤ seq_len 2048"):
        PlanConfig(seq_len=2048, valid_tokens_per_seq=3000)
    with pytest.raises(SettingError, match=r"padding_fraction 1.0 is not allowed; allowed: 0 ≤ x < 1"):
        PlanConfig(padding_fraction=1.0)


def test_budget_uses_valid_tokens_when_known():
    r = build_plan(PlanConfig(micro_batch=2, grad_accum_steps=8, dp_world_size=64, seq_len=2048, valid_tokens_per_seq=1500, total_tokens=1.536e9))
    assert r.optimizer_steps == 1000 and r.tokens_per_step_counted == "valid"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(micro_batch=2, grad_accum_steps=2, dp_world_size=2, total_tokens=1e9), r"total_tokens 1,000,000,000 is not allowed \(it needs seq_len\)"),
        (dict(micro_batch=2, grad_accum_steps=2, dp_world_size=2, warmup_tokens=5.0), r"warmup_tokens 5 is not allowed \(it needs seq_len to become steps\)"),
        (dict(micro_batch=2, grad_accum_steps=2, dp_world_size=2, max_bubble=0.1), r"max_bubble 0.1 is not allowed \(it needs pp_stages\)"),
        (dict(micro_batch=2, grad_accum_steps=2, dp_world_size=2, seq_len=8, padding_fraction=0.1, valid_tokens_per_seq=2.0), "disagrees"),
    ],
)
def test_missing_companions(kwargs, match):
    with pytest.raises(SettingError, match=match):
        build_plan(PlanConfig(**kwargs))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr_rule="cube"), "lr_rule 'cube' is not allowed; allowed: linear, sqrt, none"),
        (dict(lr=-1.0), "lr -1 is not allowed"),
        (dict(lr_base_batch=256), r"lr_base_batch 256 is not allowed; allowed: lr given as well \(the lr tuned at that batch\)"),
        (dict(virtual_stages=2), r"virtual_stages 2 is not allowed; allowed: pp_stages given as well"),
        (dict(warmup_tokens=1.0, warmup_steps=1), r"warmup_steps 1 is not allowed \(warmup_tokens is set too\); allowed: warmup_tokens or"),
        (dict(pp_stages=0), "pp_stages 0 is not allowed"),
    ],
)
def test_plan_config_validation(kwargs, match):
    with pytest.raises(SettingError, match=match):
        PlanConfig(**kwargs)


def test_pipeline_warning_and_allreduce_in_report():
    r = build_plan(PlanConfig(micro_batch=1, grad_accum_steps=2, dp_world_size=8, pp_stages=4, params=1e9, grad_bytes_per_param=2, no_sync=False))
    assert r.pipeline_bubble_fraction == pytest.approx(1.5)
    assert any("pipeline never fills" in w for w in r.warnings)
    # each of the 4 pipeline stages holds params / 4; 2 syncs per step without no_sync
    assert r.allreduce_bytes_per_step == pytest.approx(2 * 7 / 8 * (2e9 / 4) * 2)


def test_warmup_steps_without_seq_len_is_reported_in_steps():
    r = build_plan(PlanConfig(micro_batch=2, grad_accum_steps=2, dp_world_size=2, warmup_steps=5))
    assert r.warmup_steps == 5 and r.warmup_tokens is None


def test_warmup_longer_than_the_run_warns():
    r = build_plan(PlanConfig(micro_batch=2, grad_accum_steps=8, dp_world_size=64, seq_len=2048, total_tokens=1e9, warmup_tokens=1e10))
    assert any("longer than the whole run" in w for w in r.warnings)


def test_decimal_budgets_parse_exactly(tmp_path):
    p = write(tmp_path, "a.yaml", "micro_batch: 1\ngrad_accum_steps: 1\ndp_world_size: 1\nseq_len: 1000\ntotal_tokens: 4.1B\n")
    assert build_plan(PlanConfig(**load_config(p))).optimizer_steps == 4_100_000


def test_new_dp_for_a_file_whose_dp_is_solved(tmp_path):
    # the file gives global, micro, accum (dp solves to 64): --dp 32 keeps the global batch
    p = write(tmp_path, "a.yaml", "global_batch: 1024\nmicro_batch: 2\ngrad_accum_steps: 8\n")
    r = make_plan(p, {}, dp_world_size=32)
    assert (r.global_batch_sequences, r.grad_accum_steps, r.dp_world_size) == (1024, 16, 32)
    with pytest.raises(SettingError, match="not divisible by micro_batch 2 × dp 96 = 192"):
        make_plan(p, {}, dp_world_size=96)


def test_flag_overriding_a_file_value_that_changes_the_global_batch_warns(tmp_path):
    p = write(tmp_path, "a.yaml", "micro_batch: 2\ngrad_accum_steps: 8\ndp_world_size: 64\n")
    r = make_plan(p, {"micro_batch": 4})
    assert r.global_batch_sequences == 2048
    assert "micro_batch 4 overrides micro_batch 2" in r.warnings[0]  # the library names its fields
    assert "--micro-batch 4 overrides micro_batch 2" in make_plan(p, {"micro_batch": 4}, names={"micro_batch": "--micro-batch"}).warnings[0]
    assert "global batch 1,024" in r.warnings[1] and "2,048" in r.warnings[1]


def test_deepspeed_flags_fill_auto_values_before_deepspeeds_rules(tmp_path):
    p = write(tmp_path, "ds.json", json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                               "gradient_accumulation_steps": "auto", "optimizer": {"params": None}}))
    r = make_plan(p, {"micro_batch": 2, "grad_accum_steps": 4}, dp_world_size=8)
    assert r.global_batch_sequences == 64
    assert any("changes with dp_world_size" in w for w in r.warnings)
    p = write(tmp_path, "ds2.json", json.dumps({"train_batch_size": 1024}))
    r = make_plan(p, {"micro_batch": 2}, dp_world_size=64)
    assert (r.global_batch_sequences, r.grad_accum_steps) == (1024, 8)


def test_deepspeed_dp_is_solved_when_all_three_are_given(tmp_path):
    p = write(tmp_path, "ds.json", json.dumps({"train_batch_size": 1024, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8}))
    r = make_plan(p, {})
    assert r.dp_world_size == 64 and any("solved from" in w for w in r.warnings)


@pytest.mark.parametrize("content, kind", [
    ({"output_dir": "o", "warmup_steps": 10, "per_device_train_batch_size": 4}, "hf"),
    ({"output_dir": "o", "gradient_accumulation_steps": 8}, "hf"),
    ({"train_batch_size": 8}, "deepspeed"),
    ({"micro_batch": 2, "grad_accum_steps": 8}, "json"),
    ({"micro_batch": 2, "per_device_train_batch_size": 3}, "json"),  # ours, and the HF key is then unknown
])
def test_json_kind_detection(tmp_path, content, kind):
    p = write(tmp_path, "c.json", json.dumps(content))
    assert read_config_file(p)[0] == kind


def test_unusual_files(tmp_path):
    import os

    fifo = tmp_path / "f.yaml"
    os.mkfifo(fifo)
    with pytest.raises(SettingError, match="is not a regular file"):
        read_config_file(fifo)
    with pytest.raises(SettingError, match=r"\(not UTF-8 text \(byte"):
        read_config_file(_latin1(tmp_path))
    bom = tmp_path / "b.json"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"train_batch_size": 8}).encode())
    assert read_config_file(bom)[0] == "deepspeed"
    with pytest.raises(SettingError, match="cannot be parsed as JSON"):
        read_config_file(write(tmp_path, "e.json", "{"))
    with pytest.raises(SettingError, match="duplicate key 'lr'"):
        read_config_file(write(tmp_path, "d.json", '{"lr": 1, "lr": 2}'))


def _latin1(tmp_path):
    p = tmp_path / "l.yaml"
    p.write_bytes("micro_batch: 2 # café\n".encode("latin-1"))
    return p


def test_the_bubble_target_row_shows_its_arithmetic_and_the_interleaving_round_up():
    from rich.console import Console

    from globalbatch.plan.report import plan_table

    r = build_plan(PlanConfig(global_batch=4096, micro_batch=4, dp_world_size=128, pp_stages=8, virtual_stages=2,
                              max_bubble=0.05))
    # ⌈7/(2·0.05)⌉ = 70 micro-batches, rounded up to a multiple of 8 stages (interleaved 1F1B): 72 × 4 × 128
    assert r.min_global_batch_for_bubble == 72 * 4 * 128
    console = Console(width=200, record=True)
    console.print(plan_table(r))
    text = console.export_text()
    assert "128 ranks × 72 accum × 4 seq: (8−1)/(2·72) = 4.86% (accum a multiple of 8: interleaved)" in text
