"""Tests of globalbatch.flops and the driver's model FLOP/s, MFU and valid tokens/s."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

from globalbatch.errors import SettingError
import torch
from torch import nn

from globalbatch.flops import (
    PEAK_FLOPS,
    FlopsCounter,
    count_flops,
    measure_matmul_peak,
    mfu,
    peak_flops_per_s,
    table_peak_flops,
    transformer_flops_per_token,
)
from globalbatch.step import StepConfig, StepDriver

_spec = importlib.util.spec_from_file_location("step_common", Path(__file__).parent / "dist" / "step_common.py")
sc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sc)


def test_formula_is_palm_appendix_b():
    # 6·N + 12·L·d·T: GPT-3 175B (L 96, d 12288, T 2048) attention adds 12·96·12288·2048 ≈ 2.9e10 per token.
    got = transformer_flops_per_token(params_non_embedding=175e9, n_layer=96, seq_len=2048, d_model=12288)
    assert got == 6 * 175e9 + 12 * 96 * 12288 * 2048
    with pytest.raises(SettingError, match="n_layer 0 is not allowed"):
        transformer_flops_per_token(params_non_embedding=1e6, n_layer=0, seq_len=8, d_model=8)


def test_counted_flops_of_a_linear_layer_are_six_b_in_out():
    """Closed form: forward 2·B·i·o; backward grad-input 2·B·i·o + grad-weight 2·B·i·o."""
    torch.manual_seed(0)
    b, i, o = 32, 48, 24
    model = nn.Linear(i, o, bias=False)
    x = torch.randn(b, i, requires_grad=False)
    got = count_flops(model, x, lambda m, batch: m(batch).sum())
    # no grad w.r.t. the input (x does not require it): forward + grad-weight only
    assert got == 2 * b * i * o + 2 * b * i * o
    x.requires_grad_(True)
    assert count_flops(model, x, lambda m, batch: m(batch).sum()) == 6 * b * i * o
    assert model.weight.grad is None  # gradients dropped after counting


def test_flops_counter_caches_per_shape_and_padding_counts():
    model = sc.build_model(dtype=torch.float32)
    counter = FlopsCounter(model, lambda m, batch: sc.loss_fn(m, batch)[0])
    seqs = sc.make_sequences(8, seed=1)
    a = sc.collate(seqs[:4])
    b = sc.collate(seqs[4:])
    fa = counter(a)
    fa2 = counter({k: v.clone() for k, v in a.items()})
    assert fa == fa2 and len(counter.cache) == 1  # same shape: counted once
    fb = counter(b)
    width_a, width_b = a["input_ids"].shape[1], b["input_ids"].shape[1]
    assert len(counter.cache) == (1 if width_a == width_b else 2)
    if width_a != width_b:
        assert fa != fb  # FLOPs follow the padded width


def test_peak_table_and_override():
    assert table_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == PEAK_FLOPS["H100"]["bf16"] == 989.4e12
    assert table_peak_flops("NVIDIA H200", "bf16") == 989.4e12
    assert table_peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert table_peak_flops("Tesla T4", "bf16") is None
    assert peak_flops_per_s(override=1e12).flops_per_s == 1e12
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(SettingError, match="peak_flops_per_s .* is not allowed"):
            peak_flops_per_s(override=bad)


def test_measured_cpu_matmul_peak_is_plausible():
    peak = measure_matmul_peak("fp32", size=128, repeats=3)
    assert 1e8 < peak < 1e13  # between 0.1 GFLOP/s and 10 TFLOP/s on any CPU
    assert peak_flops_per_s(device="cpu").source.startswith("measured: cpu fp32 matmul")
    assert mfu(5e9, 1e10) == 0.5 and mfu(5e9, 1e10, devices=2) == 0.25


def test_formula_modules_import_no_torch():
    code = "import sys, globalbatch.flops, globalbatch.plan.memory, globalbatch.plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# --------------------------------------------------------------------------- the driver


def _window(drv, mbs, flops=None):
    for i, mb in enumerate(mbs):
        with drv.micro_step(last=i == len(mbs) - 1):
            loss_sum, count = sc.loss_fn(drv.model, mb)
            drv.backward(loss_sum, count, samples=mb["input_ids"].shape[0],
                         flops=None if flops is None else flops[i])
    return drv.step()


def test_step_reports_flops_mfu_and_valid_tokens_on_a_ragged_batch():
    model = sc.build_model(dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    peak = 1e9
    drv = StepDriver(model, opt, StepConfig(micro_batch=2, global_batch=8, flops_per_sample=1000.0,
                                            peak_flops_per_s=peak))
    seqs = sc.make_sequences(8, seed=3)
    mbs = sc.micro_batches(seqs, 2)
    res = _window(drv, mbs)
    valid = sum(int((mb["labels"] != -100).sum()) for mb in mbs)
    padded = sum(mb["labels"].numel() for mb in mbs)
    assert valid < padded  # ragged: padding is measurably there
    assert res.global_units == valid
    assert res.model_flops == 8 * 1000.0  # flops_per_sample × samples of the window
    dt = res.global_units / res.units_per_s  # the window's seconds, recovered
    assert res.valid_tokens_per_s == pytest.approx(valid / dt, rel=1e-12)
    assert res.model_flops_per_s == pytest.approx(8000.0 / dt, rel=1e-12)
    assert res.mfu == pytest.approx(8000.0 / dt / peak, rel=1e-12)


def test_per_micro_batch_flops_override_and_missing_counts():
    model = sc.build_model(dtype=torch.float32)
    counter = FlopsCounter(model, lambda m, batch: sc.loss_fn(m, batch)[0])
    drv = StepDriver(model, torch.optim.SGD(model.parameters(), lr=1e-3), StepConfig(micro_batch=2, global_batch=4))
    mbs = sc.micro_batches(sc.make_sequences(4, seed=4), 2)
    counts = [counter(mb) for mb in mbs]
    res = _window(drv, mbs, flops=counts)
    assert res.model_flops == sum(counts) and res.mfu is None  # no peak given: no MFU
    res2 = _window(drv, mbs, flops=[counts[0], None])  # one micro-batch without a count
    assert res2.model_flops is None and res2.model_flops_per_s is None
    res3 = _window(drv, mbs)
    assert res3.model_flops is None and res3.valid_tokens_per_s == res3.units_per_s


def test_sample_loss_has_no_valid_tokens_and_bad_settings_are_named():
    model = sc.build_model(dtype=torch.float32)
    drv = StepDriver(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                     StepConfig(micro_batch=2, global_batch=2, unit="sample"))
    res = _window(drv, sc.micro_batches(sc.make_sequences(2, seed=5), 2))
    assert res.valid_tokens_per_s is None
    for kw, match in (({"unit": "byte"}, "unit 'byte'"), ({"flops_per_sample": 0.0}, "flops_per_sample 0 is not allowed"),
                      ({"peak_flops_per_s": math.inf}, "peak_flops_per_s inf")):
        with pytest.raises(SettingError, match=match):
            StepConfig(micro_batch=1, global_batch=1, **kw)
    with pytest.raises(SettingError, match="flops -1 is not allowed"):
        drv.backward(torch.zeros((), requires_grad=True), 1, samples=1, flops=-1)


def test_step_keeps_one_host_sync(monkeypatch):
    """The FLOPs ride on the one ``tolist()`` per step: no .item()/.tolist() added."""
    model = sc.build_model(dtype=torch.float32)
    drv = StepDriver(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                     StepConfig(micro_batch=2, global_batch=4, flops_per_sample=10.0, peak_flops_per_s=1e9))
    mbs = sc.micro_batches(sc.make_sequences(4, seed=6), 2)
    calls = {"tolist": 0, "item": 0}
    real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item

    def tolist(self):
        calls["tolist"] += 1
        return real_tolist(self)

    def item(self):
        calls["item"] += 1
        return real_item(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(torch.Tensor, "item", item)
    res = _window(drv, mbs)
    assert calls == {"tolist": 1, "item": 0}
    assert res.model_flops == 40.0


def test_cpu_attention_is_counted_with_the_cuda_kernels_formulas():
    """FlopCounterMode's registry lacks the CPU SDPA ops (counted 0 before); ours adds torch's own formulas."""
    from torch.nn import functional as F
    from torch.utils import flop_counter as fc

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return F.scaled_dot_product_attention(x * self.scale, x, x, is_causal=True)

    b, h, s, d = 2, 4, 16, 8
    x = torch.randn(b, h, s, d)
    got = count_flops(Attn(), x, lambda m, batch: m(batch).sum())
    shape = (b, h, s, d)
    forward = fc.sdpa_flop_count(shape, shape, shape)
    assert forward == 2 * (2 * b * h * s * s * d)  # QKᵀ and AV
    assert got == forward + fc.sdpa_backward_flop_count(shape, shape, shape, shape)


def test_sequence_flops_from_two_counts_match_every_counted_shape():
    """tinygpt (matmuls + attention): α·w + β·w² from widths 16 and 32 equals FlopCounterMode at other shapes."""
    from globalbatch.flops import SequenceFlops
    from globalbatch.lab.tasks import load_task

    task = load_task("tinygpt", n_layer=2, d_model=32, n_head=2, seq_len=64, max_corpus_bytes=200_000)
    model = task.build_model(0)

    def loss(m, batch):
        loss_sum, count = task.loss_sum(m, batch)
        return loss_sum

    def batch_of(b, w):
        ids = torch.randint(0, 256, (b, w))
        return {"input_ids": ids, "labels": ids.clone()}

    seq = SequenceFlops(model, lambda w: batch_of(1, w), loss, widths=(16, 32))
    assert seq.quadratic > 0  # attention is there
    for b, w in ((1, 7), (3, 64), (5, 41)):
        assert seq(b, w) == pytest.approx(count_flops(model, batch_of(b, w), loss), rel=1e-12)
    with pytest.raises(SettingError, match="widths"):
        SequenceFlops(model, lambda w: batch_of(1, w), loss, widths=(32, 16))
