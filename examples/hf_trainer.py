"""A tiny GPT-2 trained with the Hugging Face Trainer and exact global batches (globalbatch.integrations.hf).

    python examples/hf_trainer.py                    # < 1 minute on 2 CPU cores, nothing downloaded

1. On the first global batch (ragged byte documents from the CPython standard library sources,
   right-padded per micro-batch) it takes one SGD step in float64 with the stock ``Trainer``
   and with :class:`~globalbatch.integrations.hf.GlobalBatchTrainer`, and prints how far each
   update is from one big batch (max-element relative).
2. It trains with ``GlobalBatchTrainer(global_batch=...)``: the accumulation is derived from the
   pinned global batch for the world size, the plan is printed at train start, and the Trainer's
   own logs carry ``noise/b_simple_tokens`` (with its interval), valid tokens per second and the
   padding share.

Under ``torchrun --nproc_per_node=2`` (gloo) the same script runs data-parallel; the global
batch, and so every optimizer step, stays the same.
"""

from __future__ import annotations

import argparse
import os
import re
import sysconfig
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from globalbatch.losses import IGNORE_INDEX, causal_lm_loss_sum  # noqa: E402

_BOUNDARY = re.compile(rb"^[ \t]*(?:def |class )", re.MULTILINE)


def stdlib_documents(n: int, max_bytes: int = 96, min_bytes: int = 8) -> list[list[int]]:
    """``n`` ragged byte documents: stdlib .py files (sorted, tests skipped) split at def/class lines."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[list[int]] = []
    for path in sorted(root.glob("*.py")):
        text = path.read_bytes()
        starts = [0] + [m.start() for m in _BOUNDARY.finditer(text) if m.start()]
        for a, b in zip(starts, starts[1:] + [len(text)]):
            for w in range(a, b, max_bytes):
                piece = text[w:min(w + max_bytes, b)]
                if len(piece) >= min_bytes:
                    docs.append(list(piece))
                if len(docs) == n:
                    return docs
    return docs


class Docs(torch.utils.data.Dataset):
    def __init__(self, docs):
        self.docs = docs

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return {"doc": self.docs[i]}


def collate(items) -> dict[str, torch.Tensor]:
    """Right-pad to the longest document of this micro-batch; labels -100 at padding."""
    docs = [it["doc"] if isinstance(it, dict) else it for it in items]
    width = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, d in enumerate(docs):
        ids[r, :len(d)], mask[r, :len(d)] = torch.tensor(d), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


def tiny_gpt2(dtype=torch.float32, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).to(dtype)


def training_args(out: str, *, micro_batch: int, accum: int, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accum,
                train_sampling_strategy="sequential", remove_unused_columns=False, report_to=[], use_cpu=True,
                save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                lr_scheduler_type="constant", weight_decay=0.0)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        base["ddp_backend"] = "gloo"
    base.update(kw)
    return TrainingArguments(**base)


def one_step_errors(docs, out: str, *, micro_batch: int, accum: int) -> dict[str, float]:
    """One float64 SGD step (lr 1) on ``docs`` (one global batch): each Trainer's update vs the big batch."""
    from transformers import Trainer

    from globalbatch.integrations.hf import GlobalBatchTrainer

    ref = tiny_gpt2(torch.float64)
    batch = collate(docs)
    loss_sum, count = causal_lm_loss_sum(ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                                         batch["labels"])
    (loss_sum / count).backward()
    big = [p.grad for p in ref.parameters()]
    scale = max(float(g.abs().max()) for g in big)
    errors = {}
    for name, cls in (("Trainer (default)", Trainer), ("GlobalBatchTrainer", GlobalBatchTrainer)):
        model = tiny_gpt2(torch.float64)
        start = [p.detach().clone() for p in model.parameters()]
        args = training_args(out, micro_batch=micro_batch, accum=accum, max_steps=1, learning_rate=1.0, optim="sgd",
                             max_grad_norm=0.0, logging_strategy="no")
        cls(model=model, args=args, train_dataset=Docs(docs), data_collator=collate).train()
        update = [s - p.detach() for s, p in zip(start, model.parameters())]
        errors[name] = max(float((u - g).abs().max()) for u, g in zip(update, big)) / scale
    return errors


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="hf_trainer.py", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12, help="optimizer steps to train (default 12)")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, all ranks (default 16)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward (default 4)")
    p.add_argument("--out", default=None, help="Trainer output directory (default: a temporary one)")
    a = p.parse_args(argv)
    for flag, v in (("--steps", a.steps), ("--global-batch", a.global_batch), ("--micro-batch", a.micro_batch)):
        if v < 1:
            p.error(f"{flag} {v} is not allowed; allowed: a whole number >= 1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.global_batch % (a.micro_batch * world):
        p.error(f"--global-batch {a.global_batch} is not allowed; allowed: a multiple of --micro-batch "
                f"{a.micro_batch} × {world} ranks")
    from globalbatch.integrations.hf import GlobalBatchTrainer  # after the flags are checked (imports transformers)

    with tempfile.TemporaryDirectory() as tmp:
        out = a.out or tmp
        docs = stdlib_documents(a.global_batch * (a.steps + 1))
        accum = a.global_batch // (a.micro_batch * world)
        errors = one_step_errors(docs[:a.global_batch], out, micro_batch=a.micro_batch, accum=accum)
        rank0 = int(os.environ.get("RANK", "0")) == 0
        if rank0:
            for name, e in errors.items():
                print(f"one step vs one big batch (float64, max-element relative): {name}: {e:.3e}")

        args = training_args(out, micro_batch=a.micro_batch, accum=1, max_steps=a.steps, learning_rate=3e-3,
                             optim="adamw_torch", max_grad_norm=1.0, logging_steps=max(1, a.steps // 3))
        trainer = GlobalBatchTrainer(model=tiny_gpt2(), args=args, train_dataset=Docs(docs), data_collator=collate,
                                     global_batch=a.global_batch)
        trainer.train()
        if rank0:
            for row in trainer.state.log_history:
                if "noise/b_simple_tokens" in row or "loss" in row:
                    keys = ("step", "loss", "globalbatch/valid_tokens_per_s", "globalbatch/padding_share",
                            "noise/b_simple_tokens", "noise/b_simple_low_tokens", "noise/b_simple_high_tokens")
                    print("log: " + ", ".join(f"{k}={row[k]:.4g}" for k in keys if k in row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
