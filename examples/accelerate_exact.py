"""A tiny GPT-2 trained with an ``accelerator.accumulate`` loop made exact (globalbatch.integrations.accelerate).

    python examples/accelerate_exact.py              # one process, ~10 s on 2 CPU cores, nothing downloaded
    accelerate launch --config_file examples/configs/accelerate_cpu_2proc.yaml examples/accelerate_exact.py

The loop is the one in Accelerate's documentation (prepared model, optimizer and data loader,
``with accelerator.accumulate(model)``, ``accelerator.backward``), with two changes:
``exact.backward(loss_sum, count)`` instead of ``accelerator.backward(mean loss)``, and
``exact.normalize()`` on the syncing micro-batch, before clipping.

1. Two float64 SGD steps (lr 1) on ragged byte documents from the CPython standard library sources
   (the second window short), once with the documented loop (mean loss per micro-batch) and once
   with :class:`~globalbatch.integrations.accelerate.ExactAccumulation`, each compared with the same
   two steps taken on each whole window in one forward (max-element relative, printed by rank 0).
2. A few AdamW steps with the noise monitor, logging the loss per token and B_simple.

Under ``accelerate launch`` with 2 processes, the prepared loader deals the micro-batches to the ranks;
the global batch (micro × accumulation × processes) and so each step are the same as on one process
with twice the accumulation.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from hf_trainer import collate, stdlib_documents, tiny_gpt2  # noqa: E402  (the same data and model)

from globalbatch.losses import causal_lm_loss_sum  # noqa: E402


LAUNCH_TWO = ["accelerate", "launch", "--config_file", "examples/configs/accelerate_2proc.yaml", "examples/accelerate_exact.py"]
"""The two-process launch (on a CPU-only machine with ACCELERATE_USE_CPU=true in the environment)."""


def loss_of(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return causal_lm_loss_sum(logits, batch["labels"])


def reference_delta(docs, window_docs: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One float64 SGD step (lr 1) per whole window of ``window_docs`` documents, in one forward each."""
    model = tiny_gpt2(torch.float64)
    start = [p.detach().clone() for p in model.parameters()]
    for s in range(0, len(docs), window_docs):
        model.zero_grad(set_to_none=True)
        loss_sum, count = loss_of(model, collate(docs[s:s + window_docs]))
        (loss_sum / count).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(p.grad)
    return start, [p.detach() - s for p, s in zip(model.parameters(), start)]


def run(docs, *, micro_batch: int, accum: int, exact: bool, dtype=torch.float64, lr: float = 1.0,
        optimizer: str = "sgd", noise: bool = False, log=print):
    """The accumulate loop of Accelerate's docs on ``docs``; ``exact`` switches to ExactAccumulation."""
    from accelerate import Accelerator

    from globalbatch.integrations.accelerate import ExactAccumulation

    accelerator = Accelerator(gradient_accumulation_steps=accum)
    model = tiny_gpt2(dtype)
    opt_cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
    loader = torch.utils.data.DataLoader(docs, batch_size=micro_batch, shuffle=False, collate_fn=collate)
    model, opt, loader = accelerator.prepare(model, opt_cls(model.parameters(), lr=lr), loader)
    monitor = None
    if noise:
        from globalbatch.noise import NoiseConfig, NoiseScaleMonitor

        monitor = NoiseScaleMonitor(model, config=NoiseConfig(sources=("micro",)))
    ex = ExactAccumulation(accelerator, model, monitor=monitor) if exact else None
    steps = 0
    for batch in loader:
        with accelerator.accumulate(model):
            if ex is not None:
                loss_sum, count = loss_of(model, batch)
                ex.backward(loss_sum, count, samples=len(batch["input_ids"]))
                if accelerator.sync_gradients:
                    loss_per_token = ex.normalize()  # before clipping
            else:  # the documented loop: the mean loss of each micro-batch
                loss_sum, count = loss_of(model, batch)
                accelerator.backward(loss_sum / count)
            if accelerator.sync_gradients:
                if optimizer != "sgd":  # part 1 compares plain SGD steps: no clipping there
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                steps += 1
                if ex is not None and monitor is not None and accelerator.is_main_process:
                    est = monitor.estimate()  # a host sync: at log steps only (every step in this tiny example)
                    log(f"log: step={steps}, loss_per_token={float(loss_per_token):.4g}, "
                        f"noise/b_simple_tokens={est.b_simple:.4g}, noise/windows={est.windows}")
            opt.step()
            opt.zero_grad()
    return accelerator, accelerator.unwrap_model(model), steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="accelerate_exact.py", description=__doc__.split("\n")[0])
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per forward/backward (default 2)")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step per process (default 2)")
    p.add_argument("--steps", type=int, default=4, help="AdamW steps in part 2 (default 4; 0: part 1 only)")
    a = p.parse_args(argv)
    for flag, v in (("--micro-batch", a.micro_batch), ("--accum", a.accum)):
        if v < 1:
            p.error(f"{flag} {v} is not allowed; allowed: a whole number >= 1")
    if a.steps < 0:
        p.error(f"--steps {a.steps} is not allowed; allowed: a whole number >= 0")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        print("one process; two: " + " ".join(LAUNCH_TWO), flush=True)
    window = a.micro_batch * a.accum * world
    docs = stdlib_documents(window + window // 2)  # a full window and a short one (half of it)
    start, ref = reference_delta(docs, window)
    errors = {}
    for name, exact in (("accumulate + mean loss (default)", False), ("ExactAccumulation", True)):
        accelerator, model, steps = run(docs, micro_batch=a.micro_batch, accum=a.accum, exact=exact)
        errors[name] = max(float((p.detach() - s - r).abs().max()) for p, s, r in
                           zip(model.parameters(), start, ref)) / max(float(r.abs().max()) for r in ref)
        if accelerator.is_main_process:
            print(f"{steps} steps on {accelerator.num_processes} process(es), windows of {window} and {window // 2} "
                  f"documents, vs one big batch per window (float64, max-element relative): {name}: "
                  f"{errors[name]:.3e}", flush=True)
    if a.steps:
        run(stdlib_documents(window * a.steps), micro_batch=a.micro_batch, accum=a.accum, exact=True,
            dtype=torch.float32, lr=3e-3, optimizer="adamw", noise=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
