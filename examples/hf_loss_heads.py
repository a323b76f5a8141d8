"""Exact global batches for heads other than a causal LM: sequence classification and seq2seq (HF Trainer).

    python examples/hf_loss_heads.py                 # ~10 s on 2 CPU cores, nothing downloaded

``GlobalBatchTrainer(loss_head=...)`` takes any :class:`globalbatch.losses.LossHead`: the summed loss
from the model's outputs and the batch, and its count from the batch alone. Two built in here:

* ``sequence_classification_head()``: a tiny BERT classifies stdlib code snippets (does the snippet
  open a ``def``, a ``class`` or neither); rows labelled -100 carry no loss, so micro-batches hold
  different numbers of labelled rows;
* ``token_head(seq2seq=True)``: a tiny BART maps each snippet's first half to its second half (labels
  not shifted; the decoder inputs are built from them, as the model's own loss would).

For each it takes one float64 SGD step on one global batch with the stock ``Trainer`` (the model's
own mean loss) and with ``GlobalBatchTrainer``, prints each update's distance from the same step on
the whole batch in one forward, then trains a few AdamW steps with the loss logged by the Trainer.
Under ``torchrun --nproc_per_node=2`` the same script runs data-parallel (gloo).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_trainer import stdlib_documents, training_args  # noqa: E402

from globalbatch.losses import IGNORE_INDEX, sequence_classification_head, token_head  # noqa: E402


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"row": self.rows[i]}


def classification_rows(n: int) -> list[tuple[list[int], int]]:
    """(snippet bytes, class): 0 opens a def, 1 a class, 2 neither; every fourth row unlabelled."""
    rows = []
    for i, d in enumerate(stdlib_documents(n, max_bytes=48)):
        text = bytes(d).lstrip()
        label = 0 if text.startswith(b"def ") else 1 if text.startswith(b"class ") else 2
        rows.append((d, IGNORE_INDEX if i % 4 == 3 else label))
    return rows


def classification_collate(items) -> dict[str, torch.Tensor]:
    rows = [it["row"] for it in items]
    width = max(len(d) for d, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (d, _) in enumerate(rows):
        ids[r, :len(d)], mask[r, :len(d)] = torch.tensor(d), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([y for _, y in rows])}


def seq2seq_rows(n: int) -> list[tuple[list[int], list[int]]]:
    return [(d[:len(d) // 2], d[len(d) // 2:]) for d in stdlib_documents(n, max_bytes=48)]


def seq2seq_collate(items) -> dict[str, torch.Tensor]:
    rows = [it["row"] for it in items]
    ws, wt = max(len(s) for s, _ in rows), max(len(t) for _, t in rows)
    ids = torch.zeros(len(rows), ws, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full((len(rows), wt), IGNORE_INDEX, dtype=torch.long)
    for r, (s, t) in enumerate(rows):
        ids[r, :len(s)], mask[r, :len(s)], labels[r, :len(t)] = torch.tensor(s), 1, torch.tensor(t)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def tiny_bert_classifier(dtype=torch.float32, seed=0):
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     classifier_dropout=0.0, num_labels=3, pad_token_id=0)
    torch.manual_seed(seed)
    return BertForSequenceClassification(cfg).to(dtype)


def tiny_bart(dtype=torch.float32, seed=0):
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=256, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    torch.manual_seed(seed)
    return BartForConditionalGeneration(cfg).to(dtype)


TASKS = {
    "classification": (tiny_bert_classifier, classification_rows, classification_collate, sequence_classification_head),
    "seq2seq": (tiny_bart, seq2seq_rows, seq2seq_collate, lambda: token_head(seq2seq=True)),
}


def one_step_errors(task: str, rows, out: str, *, micro_batch: int, accum: int) -> dict[str, float]:
    """One float64 SGD step (lr 1) on ``rows`` (one global batch): each Trainer's update vs the whole batch."""
    from transformers import Trainer

    from globalbatch.integrations.hf import GlobalBatchTrainer

    build, _, collate, head_fn = TASKS[task]
    head = head_fn()
    ref = build(torch.float64)
    batch = collate([{"row": r} for r in rows])
    inputs = {k: v for k, v in batch.items() if k not in head.label_keys}
    if head.decoder_inputs_from_labels:
        inputs["decoder_input_ids"] = ref.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
    loss_sum, count = head.loss_sum(ref(**inputs), batch)
    (loss_sum / count).backward()
    big = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ref.parameters()]
    scale = max(float(g.abs().max()) for g in big)
    errors = {}
    for name, cls, kw in (("Trainer (default)", Trainer, {}), ("GlobalBatchTrainer", GlobalBatchTrainer,
                                                                  {"loss_head": head, "noise": False})):
        model = build(torch.float64)
        start = [p.detach().clone() for p in model.parameters()]
        args = training_args(out, micro_batch=micro_batch, accum=accum, max_steps=1, learning_rate=1.0, optim="sgd",
                             max_grad_norm=0.0, logging_strategy="no")
        cls(model=model, args=args, train_dataset=Rows(rows), data_collator=collate, **kw).train()
        update = [s - p.detach() for s, p in zip(start, model.parameters())]
        errors[name] = max(float((u - g).abs().max()) for u, g in zip(update, big)) / scale
    return errors


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="hf_loss_heads.py", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help="AdamW steps to train each model (default 6)")
    p.add_argument("--global-batch", type=int, default=16, help="rows per optimizer step, all ranks (default 16)")
    p.add_argument("--micro-batch", type=int, default=4, help="rows per forward/backward (default 4)")
    a = p.parse_args(argv)
    for flag, v in (("--steps", a.steps), ("--global-batch", a.global_batch), ("--micro-batch", a.micro_batch)):
        if v < 1:
            p.error(f"{flag} {v} is not allowed; allowed: a whole number >= 1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.global_batch % (a.micro_batch * world):
        p.error(f"--global-batch {a.global_batch} is not allowed; allowed: a multiple of --micro-batch "
                f"{a.micro_batch} × {world} ranks")
    from globalbatch.integrations.hf import GlobalBatchTrainer  # after the flags are checked (imports transformers)

    rank0 = int(os.environ.get("RANK", "0")) == 0
    accum = a.global_batch // (a.micro_batch * world)
    with tempfile.TemporaryDirectory() as out:
        for task, (build, rows_fn, collate, head_fn) in TASKS.items():
            rows = rows_fn(a.global_batch * (a.steps + 1))
            errors = one_step_errors(task, rows[:a.global_batch], out, micro_batch=a.micro_batch, accum=accum)
            if rank0:
                for name, e in errors.items():
                    print(f"{task}: one step vs one big batch (float64, max-element relative): {name}: {e:.3e}")
            args = training_args(out, micro_batch=a.micro_batch, accum=1, max_steps=a.steps, learning_rate=3e-3,
                                 optim="adamw_torch", max_grad_norm=1.0, logging_steps=max(1, a.steps // 3))
            trainer = GlobalBatchTrainer(model=build(), args=args, train_dataset=Rows(rows), data_collator=collate,
                                         global_batch=a.global_batch, loss_head=head_fn())
            trainer.train()
            if rank0:
                for row in trainer.state.log_history:
                    if "loss" in row:
                        keys = ("step", "loss", "noise/b_simple_tokens")
                        print(f"{task} log: " + ", ".join(f"{k}={row[k]:.4g}" for k in keys if k in row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
