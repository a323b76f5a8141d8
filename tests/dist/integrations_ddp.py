"""2-rank gloo checks of the HF Trainer and Lightning integrations (launched by tests/dist/integrations_all.py for tests/integrations/test_two_ranks.py).

Each check prints ``PASS <name>`` (and measured numbers) on rank 0 or raises. The reference is one
process taking each whole global batch in one forward, computed on every rank. Argument 1: a scratch dir.

* hf-ddp-exact: GlobalBatchTrainer, micro 2 × accum 2 × 2 ranks (global 8), a full window and a short
  one (12 ragged docs), float64 SGD: parameters equal the single-process big batch to 1e-10; the
  default Trainer on the same data and ranks is off by more than 1e-3.
* hf-ddp-pinned: GlobalBatchTrainer(global_batch=8) on 2 ranks derives accumulation 2 from
  gradient_accumulation_steps=1; global_batch=6 raises the one-line error with the numbers.
* hf-ddp-noise: B_simple logged by the Trainer equals NoiseScaleMonitor under a DDP StepDriver fed the
  same micro-batches on the same ranks (relative 1e-5: the monitor's norms are float32).
* lightning-ddp-exact / lightning-ddp-noise: the same for ExactAccumulationMixin under Lightning's DDP
  strategy (reusing the process group), against Trainer(accumulate_grad_batches=2) as the default. The
  noise check also shows that the non-last micro-batches did not sync: the monitor raises when a DDP
  gradient sync precedes a micro-batch of the same window.
* lightning-ddp-bf16: the mixin under DDP with ``precision="bf16-mixed"`` (float32 weights): within 3e-2 of
  the float64 big-batch update (bfloat16 matmuls on other padding widths), accumulate_grad_batches=2 in the
  same precision more than ten times that away.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
import integ_common as ic  # noqa: E402  (sets HF_HUB_OFFLINE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from globalbatch.integrations.hf import GlobalBatchTrainer  # noqa: E402

MICRO, ACCUM = 2, 2


def args(out: str, **kw) -> TrainingArguments:
    base = dict(output_dir=out, per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
                num_train_epochs=1, learning_rate=1.0, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0,
                max_grad_norm=0.0, train_sampling_strategy="sequential", remove_unused_columns=False, report_to=[],
                use_cpu=True, ddp_backend="gloo", save_strategy="no", logging_steps=1, disable_tqdm=True,
                dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


def main() -> None:
    out = sys.argv[1]
    docs = ic.stdlib_documents(12)
    world_batch = MICRO * ACCUM * 2
    windows = [docs[s:s + world_batch] for s in range(0, len(docs), world_batch)]  # 8 and 4
    ref_model = ic.tiny_gpt2()
    start = [p.detach().clone() for p in ref_model.parameters()]
    for w in windows:
        grads = ic.reference_grads(ref_model, w)
        with torch.no_grad():
            for p, g in zip(ref_model.parameters(), grads):
                p.sub_(g)
    ref_delta = [p.detach() - s for p, s in zip(ref_model.parameters(), start)]

    errors = {}
    for cls in (Trainer, GlobalBatchTrainer):
        model = ic.tiny_gpt2()
        trainer = cls(model=model, args=args(out), train_dataset=ic.DocDataset(docs), data_collator=ic.hf_collator)
        trainer.train()
        assert trainer.state.global_step == 2, trainer.state.global_step
        errors[cls.__name__] = ic.max_rel_diff([p.detach() - s for p, s in zip(model.parameters(), start)], ref_delta)
    rank = dist.get_rank()
    if rank == 0:
        print(f"hf-ddp update error vs one big batch: default {errors['Trainer']:.3e} "
              f"ours {errors['GlobalBatchTrainer']:.3e}", flush=True)
    assert errors["GlobalBatchTrainer"] < 1e-10, errors
    assert errors["Trainer"] > 1e-3, errors
    if rank == 0:
        print("PASS hf-ddp-exact", flush=True)

    # A pinned global batch on 2 ranks: the accumulation is re-derived (8 = 2 × 2 × 2), or a one-line error.
    pinned = GlobalBatchTrainer(model=ic.tiny_gpt2(), args=args(out, gradient_accumulation_steps=1),
                                train_dataset=ic.DocDataset(docs), data_collator=ic.hf_collator, global_batch=8)
    assert pinned.args.gradient_accumulation_steps == 2, pinned.args.gradient_accumulation_steps
    try:
        GlobalBatchTrainer(model=ic.tiny_gpt2(), args=args(out), train_dataset=ic.DocDataset(docs),
                           data_collator=ic.hf_collator, global_batch=6)
        raise AssertionError("global_batch 6 on 2 ranks × micro 2 was accepted")
    except ValueError as e:
        assert "global batch 6 is not divisible by micro_batch 2 × dp 2 = 4" in str(e), str(e)
    if rank == 0:
        print("PASS hf-ddp-pinned", flush=True)

    # Noise: 24 docs = 3 windows of 8; the Trainer's logged B_simple vs the monitor under DDP + StepDriver.
    from torch.nn.parallel import DistributedDataParallel as DDP

    from globalbatch.losses import causal_lm_loss_sum
    from globalbatch.noise import NoiseConfig, NoiseScaleMonitor
    from globalbatch.step import StepConfig, StepDriver

    docs = ic.stdlib_documents(24)
    trainer = GlobalBatchTrainer(model=ic.tiny_gpt2(), args=args(out, learning_rate=0.5),
                                 train_dataset=ic.DocDataset(docs), data_collator=ic.hf_collator)
    trainer.train()
    logged = [h["noise/b_simple_tokens"] for h in trainer.state.log_history if "noise/b_simple_tokens" in h]

    model = DDP(ic.tiny_gpt2())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    monitor = NoiseScaleMonitor(model, optimizer=opt, config=NoiseConfig(sources=("micro",)))
    driver = StepDriver(model, opt, StepConfig(micro_batch=MICRO, global_batch=world_batch), callbacks=[monitor])
    batches = [docs[s:s + MICRO] for s in range(0, len(docs), MICRO)]
    mine = batches[rank::2]  # accelerate deals the batches of a sequential sampler round-robin to the ranks
    expected = []
    for w in range(len(docs) // world_batch):
        micro = [ic.collate(b) for b in mine[w * ACCUM:(w + 1) * ACCUM]]
        driver.run_window(micro, lambda m, b: causal_lm_loss_sum(
            m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"]))
        expected.append(monitor.estimate().b_simple)
    assert len(logged) == len(expected) == 3, (logged, expected)
    finite = [(a, b) for a, b in zip(logged, expected) if math.isfinite(b)]
    assert len(finite) >= 2, (logged, expected)
    worst = max(abs(a - b) / abs(b) for a, b in finite)
    if rank == 0:
        print(f"hf-ddp B_simple logged {logged} monitor {expected} max relative difference {worst:.2e}", flush=True)
    assert worst < 1e-5, (logged, expected)
    if rank == 0:
        print("PASS hf-ddp-noise", flush=True)
    lightning_checks(rank, expected)


def lightning_checks(rank: int, expected_noise: list[float]) -> None:
    import lightning.pytorch as pl

    from globalbatch.integrations.lightning import ExactAccumulationMixin, GlobalBatchCallback
    from globalbatch.losses import causal_lm_loss_sum

    class DefaultLM(pl.LightningModule):
        def __init__(self, lr: float = 1.0) -> None:
            super().__init__()
            self.model, self.lr = ic.tiny_gpt2(), lr

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    class ExactLM(ExactAccumulationMixin, DefaultLM):
        def __init__(self, lr: float = 1.0) -> None:
            super().__init__(lr)
            self.configure_global_batch(micro_batch=MICRO, global_batch=MICRO * ACCUM * 2)

        def loss_sum(self, batch):
            out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            return causal_lm_loss_sum(out.logits, batch["labels"])

    def fit(module, docs, precision="64-true", **kw):
        batches = [docs[s:s + MICRO] for s in range(0, len(docs), MICRO)]
        mine = [d for b in batches[rank::2] for d in b]  # the same round-robin deal as accelerate's
        loader = torch.utils.data.DataLoader(mine, batch_size=MICRO, shuffle=False, collate_fn=ic.collate)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", precision=precision, max_epochs=1,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             use_distributed_sampler=False, log_every_n_steps=1, **kw)
        trainer.fit(module, loader)
        return trainer

    docs = ic.stdlib_documents(12)
    world_batch = MICRO * ACCUM * 2
    ref_model = ic.tiny_gpt2()
    start = [p.detach().clone() for p in ref_model.parameters()]
    for w in (docs[:world_batch], docs[world_batch:]):
        for p, g in zip(ref_model.parameters(), ic.reference_grads(ref_model, w)):
            p.data.sub_(g)
    ref_delta = [p.detach() - s for p, s in zip(ref_model.parameters(), start)]
    errors = {}
    for name, module, kw in (("default", DefaultLM(), {"accumulate_grad_batches": ACCUM, "logger": False}),
                             ("ours", ExactLM(), {"logger": False})):
        trainer = fit(module, docs, **kw)
        assert trainer.global_step == 2, trainer.global_step
        errors[name] = ic.max_rel_diff([p.detach() - s for p, s in zip(module.model.parameters(), start)], ref_delta)
    if rank == 0:
        print(f"lightning-ddp update error vs one big batch: default {errors['default']:.3e} "
              f"ours {errors['ours']:.3e}", flush=True)
    assert errors["ours"] < 1e-10 and errors["default"] > 1e-3, errors
    if rank == 0:
        print("PASS lightning-ddp-exact", flush=True)

    # bf16-mixed under DDP: float32 weights, the same windows, against the float64 big-batch update.
    bf16 = {}
    for name, module, kw in (("default", DefaultLM(), {"accumulate_grad_batches": ACCUM, "logger": False}),
                             ("ours", ExactLM(), {"logger": False})):
        module.model.float()
        trainer = fit(module, docs, precision="bf16-mixed", **kw)
        assert trainer.global_step == 2, trainer.global_step
        bf16[name] = ic.max_rel_diff([p.detach().double() - s for p, s in zip(module.model.parameters(), start)],
                                     ref_delta)
    if rank == 0:
        print(f"lightning-ddp bf16-mixed update error vs the float64 big batch: default {bf16['default']:.3e} "
              f"ours {bf16['ours']:.3e}", flush=True)
    assert bf16["ours"] < 3e-2 and bf16["default"] > 3e-1, bf16
    if rank == 0:
        print("PASS lightning-ddp-bf16", flush=True)

    logger = ic.list_logger()
    module = ExactLM(lr=0.5)
    cb = GlobalBatchCallback(global_batch=world_batch)
    fit(module, ic.stdlib_documents(24), logger=logger, callbacks=[cb])
    assert cb.monitor is not None and cb.monitor.dp_world_size == 2
    if rank == 0:  # Lightning's loggers write on rank 0
        logged = [m["noise/b_simple_tokens"] for m in ic.logged_per_window(logger, "noise/b_simple_tokens")]
        assert len(logged) == len(expected_noise) == 3, (logged, expected_noise)
        finite = [(a, b) for a, b in zip(logged, expected_noise) if math.isfinite(b)]
        worst = max(abs(a - b) / abs(b) for a, b in finite)
        print(f"lightning-ddp B_simple logged {logged} max relative difference {worst:.2e}", flush=True)
        assert len(finite) >= 2 and worst < 1e-5, (logged, expected_noise)
        print("PASS lightning-ddp-noise", flush=True)


if __name__ == "__main__":
    from clean_exit import clean_exit

    main()
    clean_exit()  # every check passed: skip gloo's teardown (see clean_exit.py)
