"""A tiny GPT-2 trained with PyTorch Lightning and exact global batches (globalbatch.integrations.lightning).

    python examples/lightning_module.py              # < 1 minute on 2 CPU cores, nothing downloaded

1. On the first two windows of ragged byte documents from the CPython standard library sources
   (right-padded per micro-batch, the second window short), one float64 SGD step each with
   ``Trainer(accumulate_grad_batches=k)`` and with :class:`ExactAccumulationMixin`; prints how far
   each update is from one big batch per window (max-element relative).
2. Trains with the mixin and :class:`GlobalBatchCallback(global_batch=...)`: the plan is printed
   and checked at train start; the loss per token, valid tokens per second, padding share and
   B_simple with its interval go through ``self.log`` to Lightning's loggers (CSV here).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from hf_trainer import collate, stdlib_documents, tiny_gpt2  # noqa: E402  (the same data and model)

import lightning.pytorch as pl  # noqa: E402

from globalbatch.integrations.lightning import ExactAccumulationMixin, GlobalBatchCallback  # noqa: E402
from globalbatch.losses import causal_lm_loss_sum  # noqa: E402


class DefaultLM(pl.LightningModule):
    """The usual module: the model's mean loss; accumulation by Trainer(accumulate_grad_batches=k)."""

    def __init__(self, dtype=torch.float32, lr=3e-3, optimizer="adamw"):
        super().__init__()
        self.model, self.lr, self.opt_name = tiny_gpt2(dtype), lr, optimizer

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        if self.opt_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


class ExactLM(ExactAccumulationMixin, DefaultLM):
    """The same module with exact accumulation: implement loss_sum, configure the global batch."""

    def __init__(self, *, micro_batch, global_batch, max_grad_norm=None, **kw):
        super().__init__(**kw)
        self.configure_global_batch(micro_batch=micro_batch, global_batch=global_batch, max_grad_norm=max_grad_norm)

    def loss_sum(self, batch):
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return causal_lm_loss_sum(logits, batch["labels"])  # (summed loss, targets after the shift)


def _trainer(**kw):
    base = dict(accelerator="cpu", devices=1, max_epochs=1, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, logger=False)
    base.update(kw)
    return pl.Trainer(**base)


def update_errors(docs, micro_batch: int, accum: int) -> dict[str, float]:
    """Two float64 SGD steps (lr 1) on ``docs``: each update vs the big batch, worst over the two."""
    windows = [docs[i:i + micro_batch * accum] for i in range(0, len(docs), micro_batch * accum)]
    ref = tiny_gpt2(torch.float64)
    start = [p.detach().clone() for p in ref.parameters()]
    for w in windows:
        b = collate(w)
        ls, n = causal_lm_loss_sum(ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
        ref.zero_grad()
        (ls / n).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p.sub_(p.grad)
    ref_delta = [p.detach() - s for p, s in zip(ref.parameters(), start)]
    scale = max(float(d.abs().max()) for d in ref_delta)
    out = {}
    loader = torch.utils.data.DataLoader(docs, batch_size=micro_batch, shuffle=False, collate_fn=collate)
    for name, module, kw in (
        ("accumulate_grad_batches (default)", DefaultLM(torch.float64, lr=1.0, optimizer="sgd"),
         dict(accumulate_grad_batches=accum)),
        ("ExactAccumulationMixin", ExactLM(micro_batch=micro_batch, global_batch=micro_batch * accum,
                                           dtype=torch.float64, lr=1.0, optimizer="sgd"), {}),
    ):
        _trainer(precision="64-true", **kw).fit(module, loader)
        delta = [p.detach() - s for p, s in zip(module.model.parameters(), start)]
        out[name] = max(float((d - r).abs().max()) for d, r in zip(delta, ref_delta)) / scale
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="lightning_module.py", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12, help="optimizer steps to train (default 12)")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step (default 16)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward (default 4)")
    a = p.parse_args(argv)
    for flag, v in (("--steps", a.steps), ("--global-batch", a.global_batch), ("--micro-batch", a.micro_batch)):
        if v < 1:
            p.error(f"{flag} {v} is not allowed; allowed: a whole number >= 1")
    if a.global_batch % a.micro_batch:
        p.error(f"--global-batch {a.global_batch} is not allowed; allowed: a multiple of --micro-batch {a.micro_batch}")
    accum = a.global_batch // a.micro_batch
    docs = stdlib_documents(a.global_batch * a.steps)
    # a full window and a short one (half a window): what the end of an epoch looks like
    errors = update_errors(docs[:a.global_batch + a.global_batch // 2], a.micro_batch, accum)
    for name, e in errors.items():
        print(f"two steps vs one big batch each (float64, max-element relative): {name}: {e:.3e}")

    with tempfile.TemporaryDirectory() as tmp:
        module = ExactLM(micro_batch=a.micro_batch, global_batch=a.global_batch, max_grad_norm=1.0)
        loader = torch.utils.data.DataLoader(docs, batch_size=a.micro_batch, shuffle=False, collate_fn=collate)
        logger = pl.loggers.CSVLogger(tmp, name="lightning_module")
        trainer = _trainer(logger=logger, log_every_n_steps=max(1, a.steps // 3),
                           callbacks=[GlobalBatchCallback(global_batch=a.global_batch)])
        trainer.fit(module, loader)
        logger.save()
        with open(Path(logger.log_dir) / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r.get("noise/b_simple_tokens")]
        # Lightning re-sends the latest values with every batch: one row per optimizer step, noise at log steps
        per_step = {int(float(r["globalbatch/optimizer_step"])): r for r in rows}
        every = max(1, a.steps // 3)
        for step, r in sorted(per_step.items()):
            if step % every:
                continue
            keys = ("globalbatch/optimizer_step", "train/loss_per_token", "globalbatch/valid_tokens_per_s",
                    "globalbatch/padding_share", "noise/b_simple_tokens", "noise/b_simple_low_tokens",
                    "noise/b_simple_high_tokens")
            print("log: " + ", ".join(f"{k}={float(r[k]):.4g}" for k in keys if r.get(k)))
    print(f"trained {trainer.global_step} optimizer steps of {a.global_batch} sequences")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
