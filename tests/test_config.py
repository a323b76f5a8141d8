"""globalbatch.config: file loaders (ours, DeepSpeed, HF) and the plan report."""

from __future__ import annotations

import json

import pytest

from globalbatch.config import PlanConfig, build_plan, load_config


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_yaml_and_toml_agree(tmp_path):
    y = write(tmp_path, "a.yaml", "micro_batch: 2\ngrad_accum_steps: 8\ndp_world_size: 64\nseq_len: 2048\ntotal_tokens: 100B\n")
    t = write(tmp_path, "a.toml", 'micro_batch = 2\ngrad_accum_steps = 8\ndp_world_size = 64\nseq_len = 2048\ntotal_tokens = "100B"\n')
    ry = build_plan(PlanConfig(**load_config(y)))
    rt = build_plan(PlanConfig(**load_config(t)))
    ry.pop("source"), rt.pop("source")
    assert ry == rt
    assert ry["global_batch_tokens"] == 2_097_152
    assert ry["optimizer_steps"] == 47_684  # ceil(1e11 / 2,097,152)


def test_unknown_key_in_our_schema_is_an_error(tmp_path):
    p = write(tmp_path, "a.yaml", "micro_batch: 2\ngrad_acum_steps: 8\n")
    with pytest.raises(ValueError, match=r"unknown key 'grad_acum_steps'; allowed: global_batch, micro_batch"):
        load_config(p)


@pytest.mark.parametrize(
    "text, match",
    [
        ("micro_batch: two\n", r"micro_batch 'two' is not a quantity"),
        ("micro_batch: 0\n", r"micro_batch 0 is not allowed"),
        ("no_sync: 3\n", r"no_sync 3 is not allowed; allowed: true or false"),
        ("- 1\n- 2\n", r"holds list; allowed: a mapping"),
        ("a: [1,\n", r"cannot be parsed"),
        ("lr: fast\n", r"lr 'fast' is not a number"),
    ],
)
def test_bad_values_in_yaml(tmp_path, text, match):
    p = write(tmp_path, "a.yaml", text)
    with pytest.raises(ValueError, match=match):
        load_config(p)


def test_missing_file_and_bad_suffix(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match=r"has suffix '.ini'; allowed: .yaml, .yml, .toml, .json"):
        load_config(write(tmp_path, "a.ini", "x=1"))
    with pytest.raises(ValueError, match="is a directory"):
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
    assert (r["global_batch_sequences"], r["micro_batch"], r["grad_accum_steps"]) == expect
    assert r["dp_world_size"] == 4 and r["source"] == "deepspeed"


def test_deepspeed_inconsistent_and_missing(tmp_path):
    p = write(tmp_path, "ds.json", json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}))
    with pytest.raises(ValueError, match=r"global batch 16 != micro_batch 4 × grad_accum 8 × dp 4 = 128"):
        build_plan(PlanConfig(**load_config(p, dp_world_size=4)))
    p = write(tmp_path, "ds2.json", json.dumps({"gradient_accumulation_steps": 8}))
    with pytest.raises(ValueError, match="either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"):
        load_config(p, dp_world_size=4)
    p = write(tmp_path, "ds3.json", json.dumps({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4}))
    with pytest.raises(ValueError, match=r"global batch 100 is not divisible by micro_batch 4 × dp 8 = 32"):
        build_plan(PlanConfig(**load_config(p, dp_world_size=8)))


def test_hf_training_arguments(tmp_path):
    p = write(tmp_path, "args.json", json.dumps({
        "output_dir": "out", "per_device_train_batch_size": 8, "gradient_accumulation_steps": 4,
        "learning_rate": 5e-5, "warmup_steps": 100, "fp16": True, "unknown_future_key": 1,
    }))
    kw = load_config(p, dp_world_size=8)
    r = build_plan(PlanConfig(**kw, seq_len=512))
    assert (r["global_batch_sequences"], r["micro_batch"], r["grad_accum_steps"], r["dp_world_size"]) == (256, 8, 4, 8)
    assert r["lr"] == 5e-5 and r["warmup_steps"] == 100 and r["warmup_tokens"] == 100 * 256 * 512


def test_valid_tokens_and_padding_fraction():
    r = build_plan(PlanConfig(micro_batch=2, grad_accum_steps=8, dp_world_size=64, seq_len=2048, valid_tokens_per_seq=1500))
    assert r["global_batch_valid_tokens"] == 1_536_000
    r2 = build_plan(PlanConfig(micro_batch=2, grad_accum_steps=8, dp_world_size=64, seq_len=2048, padding_fraction=0.25))
    assert r2["global_batch_valid_tokens"] == 1024 * 1536
    with pytest.raises(ValueError, match="disagrees with padding_fraction"):
        build_plan(PlanConfig(micro_batch=2, grad_accum_steps=8, dp_world_size=64, seq_len=2048, padding_fraction=0.25, valid_tokens_per_seq=1500))
    with pytest.raises(ValueError, match="valid_tokens_per_seq 3,000 is not allowed; allowed: ≤ seq_len 2048"):
        PlanConfig(seq_len=2048, valid_tokens_per_seq=3000)
    with pytest.raises(ValueError, match=r"padding_fraction 1.0 is not allowed; allowed: 0 ≤ x < 1"):
        PlanConfig(padding_fraction=1.0)


def test_budget_uses_valid_tokens_when_known():
    r = build_plan(PlanConfig(micro_batch=2, grad_accum_steps=8, dp_world_size=64, seq_len=2048, valid_tokens_per_seq=1500, total_tokens=1.536e9))
    assert r["optimizer_steps"] == 1000 and r["tokens_per_step_counted"] == "valid"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(micro_batch=2, grad_accum_steps=2, dp_world_size=2, total_tokens=1e9), "total_tokens needs seq_len"),
        (dict(micro_batch=2, grad_accum_steps=2, dp_world_size=2, warmup_steps=5), "warmup conversion needs seq_len"),
        (dict(micro_batch=2, grad_accum_steps=2, dp_world_size=2, max_bubble=0.1), "max_bubble needs pp_stages"),
        (dict(micro_batch=2, grad_accum_steps=2, dp_world_size=2, seq_len=8, padding_fraction=0.1, valid_tokens_per_seq=2.0), "disagrees"),
    ],
)
def test_missing_companions(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_plan(PlanConfig(**kwargs))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr_rule="cube"), "lr_rule 'cube' is not allowed; allowed: linear, sqrt, none"),
        (dict(lr=-1.0), "lr -1.0 is not allowed"),
        (dict(warmup_tokens=1.0, warmup_steps=1), "one of them"),
        (dict(pp_stages=0), "pp_stages 0 is not allowed"),
    ],
)
def test_plan_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanConfig(**kwargs)


def test_pipeline_warning_and_allreduce_in_report():
    r = build_plan(PlanConfig(micro_batch=1, grad_accum_steps=2, dp_world_size=8, pp_stages=4, params=1e9, grad_bytes_per_param=2, no_sync=False))
    assert r["pipeline_bubble_fraction"] == pytest.approx(1.5)
    assert any("pipeline never fills" in w for w in r["warnings"])
    assert r["allreduce_bytes_per_step"] == pytest.approx(2 * 7 / 8 * 2e9 * 2)
