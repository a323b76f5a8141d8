"""How far each framework's default gradient accumulation is from one big batch, and ours (docs/integrations.md).

Real ``transformers`` Trainer, ``accelerate`` and ``lightning``; the tiny GPT-2 (2 layers, width 32,
byte vocabulary) and the ragged stdlib documents of ``examples/hf_trainer.py``; float64; micro 4 ×
accum 4 = global batch 16 sequences, right-padded per micro-batch. For each of several windows of
the corpus (different documents), one SGD step (lr 1) from the same initial model, and the update
compared with the gradient of the token-mean loss of the whole window in one forward:

* ``max_rel``: max |Δ − g_big| / max |g_big| (the tests' measure);
* ``cos``: cosine between the update and g_big (1: only the length is wrong);
* ``norm_ratio``: |Δ| / |g_big|.

Also a short window (2 micro-batches of 4: the end of an epoch), and 5 AdamW steps (lr 1e-2) with
the HF default against ours: Adam divides by √v, so a gradient that is wrong only by a scale is
mostly normalized away.

``masked``: the same windows as prompt-masked instruction rows (the first half of each row's labels
-100, the second micro-batch prompt-only: every label -100, count 0). ``heads``: sequence
classification (tiny BERT) and seq2seq (tiny BART) from ``examples/hf_loss_heads.py``, one window of
16 rows each, with the HF Trainer and Lightning defaults (the models' own mean losses). Usage::

    python benchmarks/integration_errors.py                      # ~2-3 min on 2 CPU cores
    python benchmarks/integration_errors.py --cases masked,heads
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from hf_trainer import Docs, collate, stdlib_documents, tiny_gpt2, training_args  # noqa: E402

from globalbatch.losses import causal_lm_loss_sum  # noqa: E402

MICRO, ACCUM = 4, 4


def big_grad(docs):
    m = tiny_gpt2(torch.float64)
    b = collate(docs)
    ls, n = causal_lm_loss_sum(m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
    (ls / n).backward()
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()])


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def compare(update, g):
    return {"max_rel": float((update - g).abs().max() / g.abs().max()),
            "cos": float(update @ g / (update.norm() * g.norm())), "norm_ratio": float(update.norm() / g.norm())}


def hf_update(docs, out, exact, *, optim="sgd", lr=1.0, steps=1, coll=None):
    from transformers import Trainer

    from globalbatch.integrations.hf import GlobalBatchTrainer

    cls = GlobalBatchTrainer if exact else Trainer
    model = tiny_gpt2(torch.float64)
    start = flat(model)
    args = training_args(out, micro_batch=MICRO, accum=ACCUM, max_steps=steps, learning_rate=lr, optim=optim,
                         max_grad_norm=0.0, logging_strategy="no")
    kw = {"noise": False} if exact else {}
    cls(model=model, args=args, train_dataset=Docs(docs), data_collator=coll or collate, **kw).train()
    return start - flat(model)


def lightning_update(docs, exact, coll=None):
    import lightning.pytorch as pl

    from lightning_module import DefaultLM, ExactLM

    module = (ExactLM(micro_batch=MICRO, global_batch=MICRO * ACCUM, dtype=torch.float64, lr=1.0, optimizer="sgd")
              if exact else DefaultLM(torch.float64, lr=1.0, optimizer="sgd"))
    start = flat(module.model)
    kw = {} if exact else {"accumulate_grad_batches": ACCUM}
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, precision="64-true", logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw).fit(
        module, torch.utils.data.DataLoader(docs, batch_size=MICRO, shuffle=False, collate_fn=coll or collate))
    return start - flat(module.model)


def accelerate_update(docs, exact, coll=None):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from globalbatch.integrations.accelerate import ExactAccumulation

    acc = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    model = tiny_gpt2(torch.float64)
    start = flat(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = torch.utils.data.DataLoader(docs, batch_size=MICRO, shuffle=False, collate_fn=coll or collate)
    model, opt, loader = acc.prepare(model, opt, loader)
    helper = ExactAccumulation(acc, model)
    for batch in loader:
        with acc.accumulate(model):
            if exact:
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                helper.backward(*causal_lm_loss_sum(logits, batch["labels"]))
                if acc.sync_gradients:
                    helper.normalize()
            else:
                acc.backward(model(**batch).loss)
            opt.step()
            opt.zero_grad()
    out = start - flat(acc.unwrap_model(model))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return out


def masked_collate(items) -> dict[str, torch.Tensor]:
    """Prompt-masked rows: the labels of a row's first half are -100 (its prompt); a row whose document index
    is in the masked micro-batch has every label -100 (no response: a count-0 micro-batch)."""
    batch = collate(items)
    labels = batch["labels"].clone()
    for r, it in enumerate(items):
        doc = it["doc"] if isinstance(it, dict) else it
        cut = len(doc) if doc[0] == MASK_MARK else max(1, len(doc) // 2)
        labels[r, :cut] = -100
    return {**batch, "labels": labels}


MASK_MARK = 35  # '#': documents of the masked micro-batch start with it (set by prompt_masked)


def prompt_masked(docs: list[list[int]]) -> list[list[int]]:
    """The window with its second micro-batch made prompt-only (first byte replaced by the marker)."""
    return [([MASK_MARK] + d[1:]) if MICRO <= i < 2 * MICRO else ([d[0] if d[0] != MASK_MARK else 32] + d[1:])
            for i, d in enumerate(docs)]


def big_grad_masked(docs):
    m = tiny_gpt2(torch.float64)
    b = masked_collate(docs)
    ls, n = causal_lm_loss_sum(m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
    (ls / n).backward()
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()])


def head_rows(task: str, n: int):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import hf_loss_heads as heads

    build, rows_fn, coll, head_fn = heads.TASKS[task]
    return heads, build, rows_fn(n), coll, head_fn


def head_big_grad(task: str, rows):
    heads, build, _, coll, head_fn = head_rows(task, 1)
    head, m = head_fn(), build(torch.float64)
    batch = coll([{"row": r} for r in rows])
    inputs = {k: v for k, v in batch.items() if k not in head.label_keys}
    if head.decoder_inputs_from_labels:
        inputs["decoder_input_ids"] = m.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
    ls, n = head.loss_sum(m(**inputs), batch)
    (ls / n).backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in m.parameters()])


def head_updates(task: str, rows, out) -> dict[str, torch.Tensor]:
    """One float64 SGD step (lr 1) on one window of ``rows``: HF Trainer default and ours, Lightning
    accumulate_grad_batches (the model's own mean loss) and ours."""
    import lightning.pytorch as pl
    from transformers import Trainer

    from globalbatch.integrations.hf import GlobalBatchTrainer
    from globalbatch.integrations.lightning import ExactAccumulationMixin

    heads, build, _, coll, head_fn = head_rows(task, 1)
    res = {}
    for name, cls, kw in (("hf default", Trainer, {}), ("hf ours", GlobalBatchTrainer,
                                                         {"loss_head": head_fn(), "noise": False})):
        model = build(torch.float64)
        start = flat(model)
        args = training_args(out, micro_batch=MICRO, accum=ACCUM, max_steps=1, learning_rate=1.0, optim="sgd",
                             max_grad_norm=0.0, logging_strategy="no")
        cls(model=model, args=args, train_dataset=heads.Rows(rows), data_collator=coll, **kw).train()
        res[name] = start - flat(model)

    class Default(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build(torch.float64)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1.0)

    class Ours(ExactAccumulationMixin, Default):
        def __init__(self):
            super().__init__()
            self.configure_global_batch(micro_batch=MICRO, grad_accum_steps=ACCUM, loss_head=head_fn())

        def forward(self, **inputs):
            return self.model(**inputs)

    for name, module, kw in (("lightning default", Default(), {"accumulate_grad_batches": ACCUM}),
                             ("lightning ours", Ours(), {})):
        start = flat(module.model)
        loader = torch.utils.data.DataLoader([{"row": r} for r in rows], batch_size=MICRO, shuffle=False,
                                             collate_fn=coll)
        pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, precision="64-true", logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw).fit(
            module, loader)
        res[name] = start - flat(module.model)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="integration_errors.py", description=__doc__.split("\n")[0])
    p.add_argument("--windows", type=int, default=3, help="windows of the corpus to measure (default 3)")
    p.add_argument("--cases", default="plain,masked,heads",
                   help="comma-separated: plain (the windows above), masked (prompt-masked rows with a count-0 "
                        "micro-batch), heads (sequence classification and seq2seq); default all")
    a = p.parse_args(argv)
    cases = set(a.cases.split(","))
    gb = MICRO * ACCUM
    corpus = stdlib_documents(gb * 40)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if "masked" in cases:
            for w in range(a.windows):
                full = prompt_masked(corpus[w * 10 * gb:(w * 10 + 1) * gb])
                g = big_grad_masked(full)
                labels = masked_collate(full)["labels"]
                counts = [int((labels[i:i + MICRO, 1:] != -100).sum()) for i in range(0, gb, MICRO)]
                for fw, fn in (("hf", lambda d, e: hf_update(d, tmp, e, coll=masked_collate)),
                               ("lightning", lambda d, e: lightning_update(d, e, coll=masked_collate)),
                               ("accelerate", lambda d, e: accelerate_update(d, e, coll=masked_collate))):
                    for exact in (False, True):
                        r = compare(fn(full, exact), g)
                        print(f"masked window {w} {fw:10s} {'ours' if exact else 'default':7s} "
                              f"max_rel {r['max_rel']:.3e}  cos {r['cos']:.9f}  norm_ratio {r['norm_ratio']:.6f}"
                              f"  (targets per micro-batch {counts})", flush=True)
        if "heads" in cases:
            for task in ("classification", "seq2seq"):
                _, _, rows_all, _, _ = head_rows(task, gb * 10 * a.windows + gb)
                for w in range(a.windows):
                    window = rows_all[w * 10 * gb:(w * 10 + 1) * gb]
                    g = head_big_grad(task, window)
                    for name, upd in head_updates(task, window, tmp).items():
                        r = compare(upd, g)
                        print(f"{task} window {w} {name:17s} max_rel {r['max_rel']:.3e}  cos {r['cos']:.9f}  "
                              f"norm_ratio {r['norm_ratio']:.6f}", flush=True)
        for w in range(a.windows if "plain" in cases else 0):
            full = corpus[w * 10 * gb:(w * 10 + 1) * gb]
            short = full[:2 * MICRO]
            g_full, g_short = big_grad(full), big_grad(short)
            labels = collate(full)["labels"]
            n_lab, n_tgt = int((labels != -100).sum()), int((labels[:, 1:] != -100).sum())
            for fw, fn in (("hf", lambda d, e: hf_update(d, tmp, e)), ("lightning", lightning_update),
                           ("accelerate", accelerate_update)):
                for exact in (False, True):
                    for kind, docs, g in (("full", full, g_full), ("short", short, g_short)):
                        if fw == "hf" and kind == "short":
                            continue  # the Trainer counts a short window like a full one: same scale error
                        r = compare(fn(docs, exact), g)
                        rows.append((w, fw, "ours" if exact else "default", kind, r))
                        print(f"window {w} {fw:10s} {'ours' if exact else 'default':7s} {kind:5s} "
                              f"max_rel {r['max_rel']:.3e}  cos {r['cos']:.9f}  norm_ratio {r['norm_ratio']:.6f}"
                              + (f"  (labels {n_lab}, targets {n_tgt}, rows {len(full)})"
                                 if fw == "hf" and not exact else ""), flush=True)
            # AdamW, 5 steps from the same start: HF default vs ours (both against each other)
            docs5 = corpus[w * 10 * gb:(w * 10 + 5) * gb]
            d_def = hf_update(docs5, tmp, False, optim="adamw_torch", lr=1e-2, steps=5)
            d_our = hf_update(docs5, tmp, True, optim="adamw_torch", lr=1e-2, steps=5)
            print(f"window {w} hf AdamW 5 steps: default vs ours, max |Δ_default − Δ_ours| / max |Δ_ours| = "
                  f"{float((d_def - d_our).abs().max() / d_our.abs().max()):.3e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
