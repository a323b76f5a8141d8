"""Any loss head: sequence classification and seq2seq through GlobalBatchTrainer and the Lightning mixin.

Tiny models from transformers config classes (nothing downloaded), float64: a BERT sequence classifier
(one label per row; every third row unlabelled, -100) and a BART encoder-decoder (labels not shifted,
the decoder inputs built from them). Ragged rows from stdlib sources, micro 2 × accumulation 2 on one
process, 10 rows: windows of 4, 4 and a short one of 2. SGD lr 1; the parameters after the three steps
equal three steps on each whole window in one forward (max-element relative ≤ 1e-10).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("transformers", reason="install the [hf] extra")

import torch  # noqa: E402

from integ_common import max_rel_diff, stdlib_documents  # noqa: E402

from globalbatch.losses import (IGNORE_INDEX, LossHead, causal_lm_head, sequence_classification_head,  # noqa: E402
                                token_head)

MICRO, ACCUM, ROWS = 2, 2, 10
LR = 1.0


def cls_rows() -> list[tuple[list[int], int]]:
    """(text, label): label = a property of the text in 3 classes; every third row unlabelled."""
    return [(d, IGNORE_INDEX if i % 3 == 2 else sum(d) % 3) for i, d in enumerate(stdlib_documents(ROWS, max_len=30))]


def cls_collate(rows) -> dict[str, torch.Tensor]:
    width = max(len(d) for d, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (d, _) in enumerate(rows):
        ids[r, :len(d)], mask[r, :len(d)] = torch.tensor(d), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([y for _, y in rows])}


def s2s_rows() -> list[tuple[list[int], list[int]]]:
    """(source, target): the two halves of a document (ragged on both sides)."""
    return [(d[:max(1, len(d) // 2)], d[max(1, len(d) // 2):] or d[:1]) for d in stdlib_documents(ROWS, max_len=30)]


def s2s_collate(rows) -> dict[str, torch.Tensor]:
    ws, wt = max(len(s) for s, _ in rows), max(len(t) for _, t in rows)
    ids = torch.zeros(len(rows), ws, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full((len(rows), wt), IGNORE_INDEX, dtype=torch.long)
    for r, (s, t) in enumerate(rows):
        ids[r, :len(s)], mask[r, :len(s)], labels[r, :len(t)] = torch.tensor(s), 1, torch.tensor(t)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def tiny_bert_classifier():
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=256, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     classifier_dropout=0.0, num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    return BertForSequenceClassification(cfg).double()


def tiny_bart():
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=256, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    torch.manual_seed(0)
    return BartForConditionalGeneration(cfg).double()


CASES = {
    "classification": (tiny_bert_classifier, cls_rows, cls_collate, sequence_classification_head),
    "seq2seq": (tiny_bart, s2s_rows, s2s_collate, lambda: token_head(seq2seq=True)),
}


def head_forward(model, head: LossHead, batch):
    inputs = {k: v for k, v in batch.items() if k not in head.label_keys}
    if head.decoder_inputs_from_labels:
        inputs["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
    return head.loss_sum(model(**inputs), batch)


def reference_delta(case: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    build, rows_fn, coll, head_fn = CASES[case]
    model, rows, head = build(), rows_fn(), head_fn()
    start = [p.detach().clone() for p in model.parameters()]
    window = MICRO * ACCUM
    for s in range(0, len(rows), window):
        model.zero_grad(set_to_none=True)
        loss_sum, count = head_forward(model, head, coll(rows[s:s + window]))
        (loss_sum / count).backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(LR * p.grad)
    return start, [p.detach() - s for p, s in zip(model.parameters(), start)]


def test_heads_count_what_they_sum():
    """Each head's count from the batch alone equals the count its loss returns; the summed loss equals
    a loop over the loss-bearing units."""
    batch = cls_collate(cls_rows()[:5])
    logits = torch.randn(5, 3, dtype=torch.float64)
    head = sequence_classification_head()
    loss, n = head.loss_sum({"logits": logits}, batch)
    keep = [r for r in range(5) if batch["labels"][r] != IGNORE_INDEX]
    brute = sum(float(torch.nn.functional.cross_entropy(logits[r:r + 1], batch["labels"][r:r + 1])) for r in keep)
    assert int(n) == int(head.count(batch)) == len(keep) == 4 and float(loss) == pytest.approx(brute, rel=1e-12)
    batch = s2s_collate(s2s_rows()[:5])
    logits = torch.randn(*batch["labels"].shape, 7, dtype=torch.float64)
    labels = batch["labels"].clamp(max=6).masked_fill(batch["labels"] == IGNORE_INDEX, IGNORE_INDEX)
    loss, n = token_head().loss_sum((logits,), {"labels": labels})
    assert int(n) == int(token_head().count({"labels": labels})) == int((labels != IGNORE_INDEX).sum())
    # the causal head scores one position fewer per row than the aligned head on the same labels
    assert int(causal_lm_head().count({"labels": labels})) == int(n) - sum(
        int(labels[r, 0] != IGNORE_INDEX) for r in range(5))
    with pytest.raises(ValueError, match="allowed: logits"):
        token_head().loss_sum(object(), {"labels": labels})


@pytest.mark.slow  # ~4 s for both cases
@pytest.mark.parametrize("case", sorted(CASES))
def test_trainer_with_a_loss_head_matches_one_full_batch(case, tmp_path):
    from transformers import TrainingArguments

    from globalbatch.integrations.hf import GlobalBatchTrainer

    build, rows_fn, coll, head_fn = CASES[case]
    start, ref = reference_delta(case)
    model, rows = build(), rows_fn()

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return {"row": rows[i]}

    from transformers import Trainer

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=MICRO,
                             gradient_accumulation_steps=ACCUM, num_train_epochs=1, learning_rate=LR,
                             lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, max_grad_norm=0.0,
                             train_sampling_strategy="sequential", remove_unused_columns=False, report_to=[],
                             use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True)
    collator = lambda items: coll([it["row"] for it in items])  # noqa: E731
    default = build()  # the plain Trainer with the model's own loss, on the same rows
    Trainer(model=default, args=args, train_dataset=Rows(), data_collator=collator).train()
    trainer = GlobalBatchTrainer(model=model, args=args, train_dataset=Rows(), data_collator=collator,
                                 loss_head=head_fn())
    trainer.train()
    assert trainer.state.global_step == 3
    err = max_rel_diff([p.detach() - s for p, s in zip(model.parameters(), start)], ref)
    err_default = max_rel_diff([p.detach() - s for p, s in zip(default.parameters(), start)], ref)
    print(f"HF Trainer {case}: update error vs one full batch: default {err_default:.2e}, ours {err:.2e}")
    assert err < 1e-10, err
    assert err_default > 1e-3, err_default  # the data is ragged enough for normalization to matter


@pytest.mark.slow  # ~5 s for both cases
@pytest.mark.parametrize("case", sorted(CASES))
def test_lightning_with_a_loss_head_matches_one_full_batch(case):
    pl = pytest.importorskip("lightning.pytorch")
    from globalbatch.integrations.lightning import ExactAccumulationMixin

    build, rows_fn, coll, head_fn = CASES[case]
    start, ref = reference_delta(case)

    class Module(ExactAccumulationMixin, pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build()
            self.configure_global_batch(micro_batch=MICRO, grad_accum_steps=ACCUM, loss_head=head_fn())

        def forward(self, **inputs):
            return self.model(**inputs)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    class Default(pl.LightningModule):  # what a Lightning user writes: the model's mean loss, accumulate_grad_batches
        def __init__(self) -> None:
            super().__init__()
            self.model = build()

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    modules = {}
    for name, module, kw in (("default", Default(), {"accumulate_grad_batches": ACCUM}), ("ours", Module(), {})):
        loader = torch.utils.data.DataLoader(rows_fn(), batch_size=MICRO, shuffle=False, collate_fn=coll)
        trainer = pl.Trainer(accelerator="cpu", devices=1, precision="64-true", max_epochs=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw)
        trainer.fit(module, loader)
        assert trainer.global_step == 3
        modules[name] = max_rel_diff([p.detach() - s for p, s in zip(module.model.parameters(), start)], ref)
    print(f"Lightning {case}: update error vs one full batch: accumulate_grad_batches {modules['default']:.2e}, "
          f"ours {modules['ours']:.2e}")
    assert modules["ours"] < 1e-10, modules
    assert modules["default"] > 1e-3, modules
