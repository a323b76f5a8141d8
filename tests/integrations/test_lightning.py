"""Lightning: exact accumulation through the mixin vs accumulate_grad_batches (real lightning, tiny GPT-2)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("lightning", reason="install the [lightning] extra")
pytest.importorskip("transformers", reason="the test model is a transformers GPT-2")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from integ_common import (collate, list_logger, logged_per_window, max_rel_diff, reference_grads,  # noqa: E402
                          stdlib_documents, tiny_gpt2)

from globalbatch.errors import SettingError  # noqa: E402
from globalbatch.integrations.lightning import ExactAccumulationMixin, GlobalBatchCallback  # noqa: E402
from globalbatch.losses import causal_lm_loss_sum  # noqa: E402

MICRO, ACCUM = 2, 4


class DefaultLM(pl.LightningModule):
    """What a Lightning user writes: the model's mean loss, accumulate_grad_batches in the Trainer."""

    def __init__(self, lr: float = 1.0) -> None:
        super().__init__()
        self.model, self.lr = tiny_gpt2(), lr

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ExactLM(ExactAccumulationMixin, DefaultLM):
    def __init__(self, lr: float = 1.0, **geometry) -> None:
        super().__init__(lr)
        self.configure_global_batch(**(geometry or dict(micro_batch=MICRO, grad_accum_steps=ACCUM)))

    def loss_sum(self, batch):
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return causal_lm_loss_sum(out.logits, batch["labels"])


def _fit(module, docs, *, callbacks=(), logger=False, **kw):
    loader = torch.utils.data.DataLoader(docs, batch_size=MICRO, shuffle=False, collate_fn=collate)
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="64-true", max_epochs=1, logger=logger,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1, callbacks=list(callbacks), **kw)
    trainer.fit(module, loader)
    return trainer


def _reference(docs, windows, lr=1.0):
    model = tiny_gpt2()
    start = [p.detach().clone() for p in model.parameters()]
    for w in windows:
        for p, g in zip(model.parameters(), reference_grads(model, w)):
            p.data.sub_(lr * g)
    return start, [p.detach() - s for p, s in zip(model.parameters(), start)]


def test_mixin_matches_one_big_batch_and_accumulate_grad_batches_does_not():
    """10 ragged docs, micro 2 × accum 4: windows of 8 and 2 docs; float64 SGD lr 1."""
    docs = stdlib_documents(10)
    start, ref = _reference(docs, [docs[:8], docs[8:]])
    default, exact = DefaultLM(), ExactLM()
    t_default = _fit(default, docs, accumulate_grad_batches=ACCUM)
    t_exact = _fit(exact, docs)
    assert t_default.global_step == t_exact.global_step == 2
    err_default = max_rel_diff([p.detach() - s for p, s in zip(default.model.parameters(), start)], ref)
    err_exact = max_rel_diff([p.detach() - s for p, s in zip(exact.model.parameters(), start)], ref)
    print(f"Lightning update vs one big batch (max-element relative): accumulate_grad_batches {err_default:.3e}, "
          f"ours {err_exact:.3e}")
    assert err_exact < 1e-10
    assert err_default > 1e-3


def test_callback_logs_and_noise_matches_the_monitor(capsys):
    """B_simple logged through Lightning's logger equals NoiseScaleMonitor under StepDriver on the same windows."""
    from globalbatch.noise import NoiseConfig, NoiseScaleMonitor
    from globalbatch.step import StepConfig, StepDriver

    docs = stdlib_documents(40)
    logger = list_logger()
    module = ExactLM(lr=0.5)
    _fit(module, docs, callbacks=[GlobalBatchCallback(global_batch=MICRO * ACCUM)], logger=logger)
    rows = logged_per_window(logger, "noise/b_simple_tokens")
    logged = [m["noise/b_simple_tokens"] for m in rows]

    model = tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    monitor = NoiseScaleMonitor(model, optimizer=opt, config=NoiseConfig(sources=("micro",)))
    driver = StepDriver(model, opt, StepConfig(micro_batch=MICRO, global_batch=MICRO * ACCUM), callbacks=[monitor])
    expected, valid = [], []
    for w in range(len(docs) // 8):
        micro = [collate(docs[s:s + MICRO]) for s in range(w * 8, w * 8 + 8, MICRO)]
        res = driver.run_window(micro, lambda m, b: causal_lm_loss_sum(
            m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"]))
        expected.append(monitor.estimate().b_simple)
        valid.append(res.global_units)
    assert len(logged) == len(expected) == 5
    finite = [(a, b) for a, b in zip(logged, expected) if math.isfinite(b)]
    assert len(finite) >= 4
    worst = max(abs(a - b) / abs(b) for a, b in finite)
    print(f"Lightning logged B_simple vs NoiseScaleMonitor: max relative difference {worst:.2e}")
    assert worst < 1e-5  # float32 norms in the monitor
    assert [m["globalbatch/global_batch_valid_tokens"] for m in rows] == valid
    b = collate(docs[:8])
    assert rows[0]["globalbatch/padding_share"] == pytest.approx(1 - valid[0] / b["input_ids"].numel(), rel=1e-6)
    assert all(m["globalbatch/valid_tokens_per_s"] > 0 for m in rows)
    out = capsys.readouterr().out
    assert "globalbatch plan: global batch 8 sequences = micro_batch 2 × grad_accum_steps 4 × dp_world_size 1 (pinned)" in out
    assert f"globalbatch: first global batch 8 sequences, {valid[0]} valid target tokens" in out


def test_pinned_global_batch_mismatch_stops_before_any_step():
    docs = stdlib_documents(8)
    module = DefaultLM()
    with pytest.raises(SettingError, match=r"global_batch 16 is not allowed \(this run would train micro_batch 2 × "
                                           r"grad_accum_steps 4 × dp_world_size 1 = 8\)"):
        _fit(module, docs, callbacks=[GlobalBatchCallback(global_batch=16)], accumulate_grad_batches=ACCUM)
    # The mixin re-derives the accumulation from a pinned global batch for the world size.
    exact = ExactLM(micro_batch=MICRO, global_batch=8)
    trainer = _fit(exact, docs, callbacks=[GlobalBatchCallback(global_batch=8)])
    assert exact.gb_grad_accum_steps == 4 and trainer.global_step == 1


@pytest.mark.parametrize("geometry, line", [
    (dict(micro_batch=2, grad_accum_steps=1.5), "grad_accum_steps 1.5 is not allowed; allowed: a whole number ≥ 1"),
    (dict(micro_batch=2.5, grad_accum_steps=4), "micro_batch 2.5 is not allowed; allowed: a whole number ≥ 1"),
    (dict(micro_batch=2, grad_accum_steps=-1), "grad_accum_steps -1 is not allowed; allowed: a whole number ≥ 1"),
    (dict(micro_batch=2, global_batch=8, max_grad_norm=-1.0), "max_grad_norm -1 is not allowed"),
])
def test_configure_global_batch_checks_its_numbers_never_rounds_them(geometry, line):
    """int(1.5) was 1: the run trained another global batch without a word; -1 and a negative clip passed too."""
    with pytest.raises(SettingError) as exc:
        ExactLM(**geometry)
    assert str(exc.value).startswith(line)


def test_configure_global_batch_takes_numpy_integers_as_ints():
    """An exact integer from numpy (a config read with numpy, a computed accumulation) is a whole number."""
    import numpy as np

    lm = ExactLM(micro_batch=np.int64(2), grad_accum_steps=np.int32(4))
    assert (lm.gb_micro_batch, lm.gb_grad_accum_steps) == (2, 4) and type(lm.gb_grad_accum_steps) is int


def test_the_first_window_line_says_when_the_padding_share_is_unknown():
    from globalbatch.integrations._common import WindowMeter

    meter = WindowMeter()
    meter.record(88.0, 0.0, 8.0)  # a batch without input_ids: no padded count
    assert meter.first_window_line().endswith("88 valid target tokens (padding share unknown: the batch has no input_ids)")
    meter = WindowMeter()
    meter.record(75.0, 100.0, 8.0)
    assert meter.first_window_line().endswith("(padding share 25.0%)")
