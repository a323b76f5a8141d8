"""2-rank gloo checks of GlobalBatchTrainer under FSDP2 (Accelerate's FSDP plugin through TrainingArguments).

Launched by tests/dist/integrations_all.py (tests/integrations/test_two_ranks.py, 2 gloo ranks) and, on a GPU machine, by benchmarks/gpu_check.py
(``--only fsdp``: the ranks it has GPUs for, NCCL, Accelerate unpatched). On CPU, Accelerate 1.15 drops the FSDP plugin without a word:
``AcceleratorState.__init__`` turns ``distributed_type`` into FSDP only when it is one of MULTI_GPU, MULTI_MLU,
MULTI_SDAA, MULTI_MUSA, MULTI_NPU, MULTI_XPU, MULTI_HPU or MULTI_NEURON, so a ``use_cpu=True`` run is MULTI_CPU
and the Trainer wraps the model in DDP (measured: ``is_fsdp_enabled`` False, ``model_wrapped`` a
DistributedDataParallel). torch's FSDP2 itself runs on CPU with gloo, so this script lifts that one gate
(:func:`allow_fsdp_on_cpu`: after ``AcceleratorState.__init__``, a MULTI_CPU state given an FSDP plugin becomes
FSDP, as a GPU state would) and everything else is the Trainer's and Accelerate's own FSDP2 path:
``fully_shard`` per GPT2Block, sharded DTensor parameters, the reduce-scatter, Accelerate's FSDP2 clipping.
The same checks run without the patch on a GPU machine (benchmarks/gpu_check.py, ``--fsdp``).

* hf-fsdp-exact: GlobalBatchTrainer, micro 2 × accum 2 × 2 ranks, 12 ragged documents (windows of 8 and 4),
  float64 SGD lr 1: the full parameters after the two steps equal the single-process big batch (≤ 1e-10);
  the stock Trainer on the same FSDP2 setup is off by more than 1e-3.
* hf-fsdp-noise: B_simple logged by the Trainer under FSDP2 equals NoiseScaleMonitor under a DDP StepDriver
  fed the same micro-batches on the same ranks from the second window on (FSDP2's unsharded parameters, which
  the monitor hooks, appear at the first forward), relative 1e-6.
* lightning-fsdp-exact / lightning-fsdp-noise: the same for the Lightning mixin under ``ModelParallelStrategy``
  (Lightning's FSDP2: ``fully_shard`` in ``configure_model``), against ``accumulate_grad_batches`` under the same
  strategy as the default.

Argument 1: a scratch directory.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
import integ_common as ic  # noqa: E402  (sets HF_HUB_OFFLINE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MICRO, ACCUM = 2, 2


def allow_fsdp_on_cpu() -> None:
    """Lift Accelerate's device gate on FSDP (see the module docstring); a no-op where CUDA runs it anyway."""
    import accelerate.state as st
    from accelerate.utils import DistributedType

    if getattr(st.AcceleratorState.__init__, "_globalbatch_cpu_fsdp", False):
        return
    original = st.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    init._globalbatch_cpu_fsdp = True
    st.AcceleratorState.__init__ = init


def args(out: str, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
                num_train_epochs=1, learning_rate=1.0, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0,
                max_grad_norm=0.0, train_sampling_strategy="sequential", remove_unused_columns=False, report_to=[],
                use_cpu=not torch.cuda.is_available(), ddp_backend="gloo" if not torch.cuda.is_available() else None,
                save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
                fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"],
                                        "reshard_after_forward": True})
    base.update(kw)
    return TrainingArguments(**base)


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()


def main() -> None:
    from transformers import Trainer

    from globalbatch.integrations.hf import GlobalBatchTrainer

    out = sys.argv[1]
    if not torch.cuda.is_available():
        allow_fsdp_on_cpu()
    if not dist.is_initialized():  # torchrun's environment (one rank too); the Trainer reuses this group
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    docs = ic.stdlib_documents(6 * world)
    world_batch = MICRO * ACCUM * world
    ref_model = ic.tiny_gpt2()
    start = [p.detach().clone() for p in ref_model.parameters()]
    for s in range(0, len(docs), world_batch):
        for p, g in zip(ref_model.parameters(), ic.reference_grads(ref_model, docs[s:s + world_batch])):
            p.data.sub_(g)
    ref_delta = [p.detach() - s for p, s in zip(ref_model.parameters(), start)]

    errors = {}
    for cls in (Trainer, GlobalBatchTrainer):
        model = ic.tiny_gpt2()
        trainer = cls(model=model, args=args(out), train_dataset=ic.DocDataset(docs), data_collator=ic.hf_collator)
        assert trainer.is_fsdp_enabled and str(trainer.accelerator.distributed_type).endswith("FSDP"), \
            trainer.accelerator.distributed_type
        trainer.train()
        assert trainer.state.global_step == 2, trainer.state.global_step
        assert any(hasattr(p, "full_tensor") for p in trainer.model.parameters()), "parameters are not sharded"
        errors[cls.__name__] = ic.max_rel_diff([full(p) - s for p, s in zip(trainer.model.parameters(), start)],
                                               ref_delta)
    rank = dist.get_rank()
    if rank == 0:
        print(f"hf-fsdp2 update error vs one big batch: default {errors['Trainer']:.3e} "
              f"ours {errors['GlobalBatchTrainer']:.3e}", flush=True)
    assert errors["GlobalBatchTrainer"] < 1e-10, errors
    assert errors["Trainer"] > 1e-3, errors
    if rank == 0:
        print("PASS hf-fsdp-exact", flush=True)

    # Noise: 24 docs = 3 windows of 8; the Trainer's logged B_simple vs the monitor under DDP + StepDriver.
    from torch.nn.parallel import DistributedDataParallel as DDP

    from globalbatch.losses import causal_lm_loss_sum
    from globalbatch.noise import NoiseConfig, NoiseScaleMonitor
    from globalbatch.step import StepConfig, StepDriver

    docs = ic.stdlib_documents(12 * world)
    # the plain mean of the measured windows (half_life inf): the Trainer's monitor has seen one window more
    # than it measured, which an EMA would weigh in (it forgets per trained unit)
    config = NoiseConfig(sources=("micro",), half_life=math.inf)
    trainer = GlobalBatchTrainer(model=ic.tiny_gpt2(), args=args(out, learning_rate=0.5),
                                 train_dataset=ic.DocDataset(docs), data_collator=ic.hf_collator, noise_config=config)
    trainer.train()
    logged = [h["noise/b_simple_tokens"] for h in trainer.state.log_history if "noise/b_simple_tokens" in h]
    assert trainer.gb_callback.monitor._fsdp is not None, "the monitor did not see an FSDP2 model"

    model = DDP(ic.tiny_gpt2().to(trainer.args.device))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    driver = StepDriver(model, opt, StepConfig(micro_batch=MICRO, global_batch=world_batch))
    batches = [docs[s:s + MICRO] for s in range(0, len(docs), MICRO)]
    mine = batches[rank::world]  # Accelerate deals a sequential sampler's batches round-robin to the ranks
    expected = []
    for w in range(len(docs) // world_batch):
        if w == 1:  # FSDP2's monitor measures from the second window (built now: its hooks see only what it owns)
            monitor = NoiseScaleMonitor(model, optimizer=opt, config=config)
            driver.callbacks.append(monitor)
        micro = [{k: v.to(trainer.args.device) for k, v in ic.collate(b).items()}
                 for b in mine[w * ACCUM:(w + 1) * ACCUM]]
        driver.run_window(micro, lambda m, b: causal_lm_loss_sum(
            m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"]))
        expected.append(monitor.estimate().b_simple if w else math.nan)
    assert len(logged) == len(expected) == 3, (logged, expected)
    assert math.isnan(logged[0]), logged
    worst = max(abs(a - b) / abs(b) for a, b in zip(logged[1:], expected[1:]))
    if rank == 0:
        print(f"hf-fsdp2 B_simple logged {logged} DDP monitor {expected} max relative difference {worst:.2e}",
              flush=True)
    assert worst < 1e-6, (logged, expected)
    if rank == 0:
        print("PASS hf-fsdp-noise", flush=True)
    lightning_checks(rank, world, expected)


def lightning_checks(rank: int, world: int, expected_noise: list[float]) -> None:
    """The Lightning mixin under ``ModelParallelStrategy`` (Lightning's FSDP2: ``fully_shard`` in
    ``configure_model``), the same windows; 64-true is not offered by that strategy, so the model is float64
    under 32-true (which casts nothing)."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from globalbatch.integrations.lightning import ExactAccumulationMixin, GlobalBatchCallback
    from globalbatch.losses import causal_lm_loss_sum
    from globalbatch.noise import NoiseConfig

    class DefaultLM(pl.LightningModule):
        def __init__(self, lr: float = 1.0) -> None:
            super().__init__()
            self.model, self.lr = ic.tiny_gpt2(), lr

        def configure_model(self):
            for block in self.model.transformer.h:
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    class ExactLM(ExactAccumulationMixin, DefaultLM):
        def __init__(self, lr: float = 1.0) -> None:
            super().__init__(lr)
            self.configure_global_batch(micro_batch=MICRO, global_batch=MICRO * ACCUM * world)

        def loss_sum(self, batch):
            out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            return causal_lm_loss_sum(out.logits, batch["labels"])

    def fit(module, docs, **kw):
        batches = [docs[s:s + MICRO] for s in range(0, len(docs), MICRO)]
        mine = [d for b in batches[rank::world] for d in b]
        loader = torch.utils.data.DataLoader(mine, batch_size=MICRO, shuffle=False, collate_fn=ic.collate)
        trainer = pl.Trainer(accelerator="cuda" if torch.cuda.is_available() else "cpu", devices=world,
                             strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                             precision="32-true", max_epochs=1, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, use_distributed_sampler=False, log_every_n_steps=1, **kw)
        trainer.fit(module, loader)
        return trainer

    docs = ic.stdlib_documents(6 * world)
    world_batch = MICRO * ACCUM * world
    ref_model = ic.tiny_gpt2()
    start = [p.detach().clone() for p in ref_model.parameters()]
    for s in range(0, len(docs), world_batch):
        for p, g in zip(ref_model.parameters(), ic.reference_grads(ref_model, docs[s:s + world_batch])):
            p.data.sub_(g)
    ref_delta = [p.detach() - s for p, s in zip(ref_model.parameters(), start)]
    errors = {}
    for name, module, kw in (("default", DefaultLM(), {"accumulate_grad_batches": ACCUM, "logger": False}),
                             ("ours", ExactLM(), {"logger": False})):
        trainer = fit(module, docs, **kw)
        assert trainer.global_step == 2, trainer.global_step
        assert any(hasattr(p, "full_tensor") for p in module.model.parameters()), "parameters are not sharded"
        errors[name] = ic.max_rel_diff([full(p) - s for p, s in zip(module.model.parameters(), start)], ref_delta)
    if rank == 0:
        print(f"lightning-fsdp2 update error vs one big batch: default {errors['default']:.3e} "
              f"ours {errors['ours']:.3e}", flush=True)
    assert errors["ours"] < 1e-10 and errors["default"] > 1e-3, errors
    if rank == 0:
        print("PASS lightning-fsdp-exact", flush=True)

    logger = ic.list_logger()
    cb = GlobalBatchCallback(noise_config=NoiseConfig(sources=("micro",), half_life=math.inf))
    module = ExactLM(lr=0.5)
    fit(module, ic.stdlib_documents(12 * world), logger=logger, callbacks=[cb])
    assert cb.monitor is not None and cb.monitor._fsdp is not None and cb.monitor.dp_world_size == world
    if rank == 0:  # Lightning's loggers write on rank 0
        rows = ic.logged_per_window(logger, "noise/windows")
        logged = [m.get("noise/b_simple_tokens", math.nan) for m in rows]
        worst = max(abs(a - b) / abs(b) for a, b in zip(logged[1:], expected_noise[1:]))
        print(f"lightning-fsdp2 B_simple logged {logged} DDP monitor {expected_noise} max relative difference "
              f"{worst:.2e}", flush=True)
        assert len(logged) == 3 and math.isnan(logged[0]) and worst < 1e-6, (logged, expected_noise)
        print("PASS lightning-fsdp-noise", flush=True)


if __name__ == "__main__":
    from clean_exit import clean_exit

    main()
    clean_exit()  # every check passed: skip gloo's teardown (see clean_exit.py)
