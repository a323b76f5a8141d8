"""Hugging Face Trainer: exact accumulation, the plan check and B_simple in the logs (real transformers, tiny GPT-2)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("transformers", reason="install the [hf] extra")

import torch  # noqa: E402

from integ_common import (DocDataset, collate, hf_collator, max_rel_diff, reference_grads,  # noqa: E402
                          stdlib_documents, tiny_gpt2)
from transformers import Trainer, TrainingArguments  # noqa: E402

from globalbatch.errors import SettingError  # noqa: E402
from globalbatch.integrations.hf import GlobalBatchCallback, GlobalBatchTrainer  # noqa: E402
from globalbatch.losses import causal_lm_loss_sum  # noqa: E402

MICRO, ACCUM = 2, 4


def _args(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
                num_train_epochs=1, learning_rate=1.0, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0,
                max_grad_norm=0.0, train_sampling_strategy="sequential", remove_unused_columns=False, report_to=[],
                use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


def _reference_sgd(model, windows, lr=1.0):
    """Plain SGD on the token-mean loss of each whole window in one forward (the big batch)."""
    for docs in windows:
        grads = reference_grads(model, docs)
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p.sub_(lr * g)
    return [p.detach().clone() for p in model.parameters()]


def test_trainer_matches_one_big_batch_and_default_does_not(tmp_path):
    """10 ragged docs, micro 2 × accum 4: a full window of 8 and a short one of 2 (float64, SGD lr 1)."""
    docs = stdlib_documents(10)
    windows = [docs[:8], docs[8:]]
    ref = _reference_sgd(tiny_gpt2(), windows)
    start = [p.detach().clone() for p in tiny_gpt2().parameters()]
    ref_delta = [r - s for r, s in zip(ref, start)]
    errors = {}
    for cls in (Trainer, GlobalBatchTrainer):
        model = tiny_gpt2()
        trainer = cls(model=model, args=_args(tmp_path), train_dataset=DocDataset(docs), data_collator=hf_collator)
        trainer.train()
        assert trainer.state.global_step == 2
        delta = [p.detach() - s for p, s in zip(model.parameters(), start)]
        errors[cls.__name__] = max_rel_diff(delta, ref_delta)
    print(f"HF Trainer update vs one big batch (max-element relative): default {errors['Trainer']:.3e}, "
          f"ours {errors['GlobalBatchTrainer']:.3e}")
    assert errors["GlobalBatchTrainer"] < 1e-10
    assert errors["Trainer"] > 1e-3


def test_logged_loss_and_metrics_are_the_global_token_mean(tmp_path, capsys):
    docs = stdlib_documents(16)
    model = tiny_gpt2()
    with torch.no_grad():  # the exact loss of window 1, at the initial parameters
        b = collate(docs[:8])
        loss_sum, count = causal_lm_loss_sum(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                             b["labels"])
        exact = float(loss_sum / count)
        padding = 1.0 - float(count) / b["input_ids"].numel()
    trainer = GlobalBatchTrainer(model=model, args=_args(tmp_path), train_dataset=DocDataset(docs),
                                 data_collator=hf_collator, noise=False)
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(exact, rel=1e-6)  # the Trainer logs in float32
    assert first["globalbatch/global_batch_valid_tokens"] == float(count)
    assert first["globalbatch/global_batch_sequences"] == 8.0
    assert first["globalbatch/padding_share"] == pytest.approx(padding, rel=1e-12)
    assert first["globalbatch/valid_tokens_per_s"] > 0
    assert "noise/b_simple_tokens" not in first
    out = capsys.readouterr().out
    assert ("globalbatch plan: global batch 8 sequences = micro_batch 2 × grad_accum_steps 4 × dp_world_size 1; "
            in out)
    assert (f"globalbatch: first global batch 8 sequences, {int(count)} valid target tokens "
            f"(padding share {padding:.1%})" in out)


def test_noise_scale_in_the_logs_matches_the_monitor(tmp_path):
    """B_simple logged by the Trainer each step equals NoiseScaleMonitor under StepDriver on the same windows."""
    from globalbatch.noise import NoiseConfig, NoiseScaleMonitor
    from globalbatch.step import StepConfig, StepDriver

    docs = stdlib_documents(40)
    steps = len(docs) // (MICRO * ACCUM)
    trainer = GlobalBatchTrainer(model=tiny_gpt2(), args=_args(tmp_path, learning_rate=0.5),
                                 train_dataset=DocDataset(docs), data_collator=hf_collator)
    trainer.train()
    logged = [h["noise/b_simple_tokens"] for h in trainer.state.log_history if "noise/b_simple_tokens" in h]

    model = tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    monitor = NoiseScaleMonitor(model, optimizer=opt, config=NoiseConfig(sources=("micro",)))
    driver = StepDriver(model, opt, StepConfig(micro_batch=MICRO, global_batch=MICRO * ACCUM), callbacks=[monitor])
    expected = []
    for w in range(steps):
        micro = [collate(docs[s:s + MICRO]) for s in range(w * 8, w * 8 + 8, MICRO)]

        def loss_fn(m, b):
            return causal_lm_loss_sum(m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                      b["labels"])
        driver.run_window(micro, loss_fn)
        expected.append(monitor.estimate().b_simple)
    assert len(logged) == steps == 5
    finite = [(a, b) for a, b in zip(logged, expected) if math.isfinite(b)]
    assert len(finite) >= 4  # the first window alone has no spread (few_windows), but a value
    worst = max(abs(a - b) / abs(b) for a, b in finite)
    print(f"HF logged B_simple vs NoiseScaleMonitor: max relative difference {worst:.2e} over {len(finite)} windows")
    assert worst < 1e-5  # the monitor takes squared norms in float32 (noise/monitor.py _sq_sum)
    assert all(math.isfinite(x) == math.isfinite(y) for x, y in zip(logged, expected))


def test_pinned_global_batch_rederives_accumulation_or_stops(tmp_path):
    docs = stdlib_documents(8)
    trainer = GlobalBatchTrainer(model=tiny_gpt2(), args=_args(tmp_path, gradient_accumulation_steps=1),
                                 train_dataset=DocDataset(docs), data_collator=hf_collator, global_batch=8)
    assert trainer.args.gradient_accumulation_steps == 4
    with pytest.raises(SettingError, match=r"global batch 7 is not divisible by micro_batch 2"):
        GlobalBatchTrainer(model=tiny_gpt2(), args=_args(tmp_path), train_dataset=DocDataset(docs),
                           data_collator=hf_collator, global_batch=7)
    # A plain Trainer with the callback: the plan is checked at train start, before any step.
    plain = Trainer(model=tiny_gpt2(), args=_args(tmp_path), train_dataset=DocDataset(docs),
                    data_collator=hf_collator, callbacks=[GlobalBatchCallback(global_batch=16)])
    with pytest.raises(SettingError, match=r"global_batch 16 is not allowed \(this run would train micro_batch 2 × "
                                           r"grad_accum_steps 4 × dp_world_size 1 = 8\)"):
        plain.train()
    assert plain.state.global_step == 0
