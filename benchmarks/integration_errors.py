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
mostly normalized away. Usage::

    python benchmarks/integration_errors.py          # ~1-2 min on 2 CPU cores
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


def hf_update(docs, out, exact, *, optim="sgd", lr=1.0, steps=1):
    from transformers import Trainer

    from globalbatch.integrations.hf import GlobalBatchTrainer

    cls = GlobalBatchTrainer if exact else Trainer
    model = tiny_gpt2(torch.float64)
    start = flat(model)
    args = training_args(out, micro_batch=MICRO, accum=ACCUM, max_steps=steps, learning_rate=lr, optim=optim,
                         max_grad_norm=0.0, logging_strategy="no")
    kw = {"noise": False} if exact else {}
    cls(model=model, args=args, train_dataset=Docs(docs), data_collator=collate, **kw).train()
    return start - flat(model)


def lightning_update(docs, exact):
    import lightning.pytorch as pl

    from lightning_module import DefaultLM, ExactLM

    module = (ExactLM(micro_batch=MICRO, global_batch=MICRO * ACCUM, dtype=torch.float64, lr=1.0, optimizer="sgd")
              if exact else DefaultLM(torch.float64, lr=1.0, optimizer="sgd"))
    start = flat(module.model)
    kw = {} if exact else {"accumulate_grad_batches": ACCUM}
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, precision="64-true", logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw).fit(
        module, torch.utils.data.DataLoader(docs, batch_size=MICRO, shuffle=False, collate_fn=collate))
    return start - flat(module.model)


def accelerate_update(docs, exact):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from globalbatch.integrations.accelerate import ExactAccumulation

    acc = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    model = tiny_gpt2(torch.float64)
    start = flat(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = torch.utils.data.DataLoader(docs, batch_size=MICRO, shuffle=False, collate_fn=collate)
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="integration_errors.py", description=__doc__.split("\n")[0])
    p.add_argument("--windows", type=int, default=3, help="windows of the corpus to measure (default 3)")
    a = p.parse_args(argv)
    gb = MICRO * ACCUM
    corpus = stdlib_documents(gb * 40)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in range(a.windows):
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
