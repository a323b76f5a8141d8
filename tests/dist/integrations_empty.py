"""2-rank gloo checks: micro-batches and whole rank windows without a target (count 0), every integration.

Launched by tests/dist/integrations_all.py (tests/integrations/test_two_ranks.py). Data and model: tests/integrations/masked_common.py
(prompt-masked instruction rows on a tiny GPT-NeoX, float64; micro 2 × accumulation 2 × 2 ranks). Three
windows: rank 1 has a count-0 micro-batch (window 0), rank 1's whole window is count 0 (window 1), one
small batch with targets over all ranks (window 2), then a window with no target anywhere (window 3: the
driver skips its step; the HF Trainer and Accelerate step on a zero gradient, the same under SGD). For each of the plain StepDriver + NoiseScaleMonitor,
GlobalBatchTrainer (HF), ExactAccumulation (Accelerate) and the Lightning mixin:

* exact: the parameters after the SGD steps equal one step on each whole window with targets in one
  forward (max-element relative difference ≤ 1e-10);
* noise: no exception, and every rank holds the same estimate: windows 0 and 1 measured with the empty
  micro-batches left out (tr(Σ) and |G|² equal a one-process monitor fed the same micro-batches, to
  1e-8), windows 2 and 3 counted in ``skipped_windows``; the B_simple the framework logs is that estimate.
  The driver also runs the ``rank`` source (DDP comm hook): a window where a rank had no target is
  skipped there (it is no small batch, and that source's k is the ranks).

Each check prints ``PASS <name>`` with its numbers on rank 0. Argument 1: a scratch directory.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
import integ_common as ic  # noqa: E402  (sets HF_HUB_OFFLINE)
import masked_common as mc  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from globalbatch.noise import NoiseConfig, NoiseScaleMonitor  # noqa: E402
from globalbatch.step import StepConfig, StepDriver  # noqa: E402

LR = 0.5
ROWS = mc.instruction_rows(4 * mc.WINDOW)


def say(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


def reference_noise(config: NoiseConfig, side: str) -> dict:
    """One process, one window per global window, all its micro-batches in order (count-0 ones left out
    by the one-replica path): the estimate the 2-rank run must reproduce."""
    model = mc.tiny_neox()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    monitor = NoiseScaleMonitor(model, optimizer=opt, config=config)
    warnings.filterwarnings("ignore", message="StepDriver got a plain")  # one process on purpose
    driver = StepDriver(model, opt, StepConfig(micro_batch=mc.MICRO, global_batch=mc.WINDOW), callbacks=[monitor])
    batches = [mc.collate(ROWS[s:s + mc.MICRO], side) for s in range(0, len(ROWS), mc.MICRO)]
    per_window = mc.WINDOW // mc.MICRO
    for w in range(len(batches) // per_window):
        driver.run_window(batches[w * per_window:(w + 1) * per_window], mc.lm_loss_sum)
    return monitor.estimates()


def same_on_all_ranks(x: float) -> bool:
    t = torch.tensor([x, -x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return (t[0] == x and t[1] == -x) or (math.isnan(x) and t.isnan().all())


def check_estimate(name: str, est, ref, *, skipped: int = 2) -> None:
    assert est.windows == ref.windows == 2, (name, est, ref)
    assert est.skipped_windows == skipped and ref.skipped_windows == 0, (name, est, ref)
    rel = max(abs(est.tr_sigma - ref.tr_sigma) / abs(ref.tr_sigma), abs(est.g_sq - ref.g_sq) / abs(ref.g_sq))
    assert rel < 1e-8, (name, est, ref)
    assert same_on_all_ranks(est.b_simple) and same_on_all_ranks(float(est.skipped_windows)), name
    say(f"{name} B_simple {est.b_simple:.6g} (one process {ref.b_simple:.6g}) tokens over {est.windows} windows, {est.skipped_windows} skipped; "
        f"tr(Σ), |G|² vs one process: {rel:.1e}")


def check_driver(out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    ref_delta = mc.reference_deltas(mc.tiny_neox(), ROWS, LR)
    model = DDP(mc.tiny_neox())
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    monitor = NoiseScaleMonitor(model, optimizer=opt, config=NoiseConfig())  # micro and rank (comm hook)
    driver = StepDriver(model, opt, StepConfig(micro_batch=mc.MICRO, global_batch=mc.WINDOW), callbacks=[monitor])
    mine = mc.my_micro_batches(ROWS, rank)
    counts = []
    for w in range(4):
        window = mine[w * mc.ACCUM:(w + 1) * mc.ACCUM]
        counts.append([int((b["labels"][:, 1:] != -100).sum()) for b in window])
        driver.run_window(window, mc.lm_loss_sum)
    err = ic.max_rel_diff([p.detach() - s for p, s in zip(model.parameters(), start)], ref_delta)
    all_counts = [None, None]
    dist.all_gather_object(all_counts, counts)
    say(f"driver targets per micro-batch (rank 0, rank 1) by window: {list(zip(*all_counts))}")
    assert all_counts[1][0][0] == 0 and all_counts[1][1] == [0, 0] and all_counts[0][2][1] == 0, all_counts
    assert all_counts[0][3] == all_counts[1][3] == [0, 0], all_counts
    assert driver.skipped_windows == 1 and driver.optimizer_steps == 3, (driver.skipped_windows, driver.optimizer_steps)
    say(f"driver update error vs one full batch: {err:.2e}")
    assert err < 1e-10, err
    ref = reference_noise(NoiseConfig(sources=("micro",)), "right")
    check_estimate("driver micro", monitor.estimate("micro", "token"), ref["micro/token"])
    rank_est = monitor.estimate("rank", "token")
    # the rank source: window 0 only (in windows 1–3 rank 1 had no target)
    assert rank_est.windows == 1 and rank_est.skipped_windows == 3, rank_est
    assert same_on_all_ranks(rank_est.tr_sigma), rank_est
    say(f"driver rank source: {rank_est.windows} window, {rank_est.skipped_windows} skipped")
    say("PASS driver-empty")


def check_hf(out: str) -> None:
    from transformers import TrainingArguments

    from globalbatch.integrations.hf import GlobalBatchTrainer

    side = "left"
    ref_delta = mc.reference_deltas(mc.tiny_neox(), ROWS, LR, side)
    model = mc.tiny_neox()
    start = [p.detach().clone() for p in model.parameters()]
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=mc.MICRO, gradient_accumulation_steps=mc.ACCUM,
                             num_train_epochs=1, learning_rate=LR, lr_scheduler_type="constant", optim="sgd",
                             weight_decay=0.0, max_grad_norm=0.0, train_sampling_strategy="sequential",
                             remove_unused_columns=False, report_to=[], use_cpu=True, ddp_backend="gloo",
                             save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0)
    trainer = GlobalBatchTrainer(model=model, args=args, train_dataset=mc.RowDataset(ROWS),
                                 data_collator=mc.hf_collator(side))
    trainer.train()
    assert trainer.state.global_step == 4, trainer.state.global_step  # the Trainer steps the empty window too
    err = ic.max_rel_diff([p.detach() - s for p, s in zip(model.parameters(), start)], ref_delta)
    say(f"hf update error vs one full batch (left padding): {err:.2e}")
    assert err < 1e-10, err
    est = trainer.gb_callback.monitor.estimate()
    check_estimate("hf", est, reference_noise(NoiseConfig(sources=("micro",)), side)["micro/token"])
    logged = [h for h in trainer.state.log_history if "noise/b_simple_tokens" in h]
    assert len(logged) == 4 and [h["noise/windows"] for h in logged] == [1.0, 2.0, 2.0, 2.0], logged
    assert [h["noise/skipped_windows"] for h in logged] == [0.0, 0.0, 1.0, 2.0], logged
    assert logged[-1]["noise/b_simple_tokens"] == est.b_simple, (logged[-1], est)
    say("PASS hf-empty")


def check_accelerate(out: str) -> None:
    from accelerate import Accelerator

    from globalbatch.integrations.accelerate import ExactAccumulation

    rank = dist.get_rank()
    ref_delta = mc.reference_deltas(mc.tiny_neox(), ROWS, LR)
    accelerator = Accelerator(gradient_accumulation_steps=mc.ACCUM, cpu=True)
    assert accelerator.num_processes == 2, accelerator.num_processes
    raw = mc.tiny_neox()
    start = [p.detach().clone() for p in raw.parameters()]
    model, opt = accelerator.prepare(raw, torch.optim.SGD(raw.parameters(), lr=LR))
    monitor = NoiseScaleMonitor(model, config=NoiseConfig(sources=("micro",)))
    exact = ExactAccumulation(accelerator, model, monitor=monitor)
    for batch in mc.my_micro_batches(ROWS, rank):
        with accelerator.accumulate(model):
            loss_sum, count = mc.lm_loss_sum(model, batch)
            exact.backward(loss_sum, count, samples=len(batch["input_ids"]))
            if accelerator.sync_gradients:
                exact.normalize()
            opt.step()
            opt.zero_grad()
    err = ic.max_rel_diff([p.detach() - s for p, s in zip(raw.parameters(), start)], ref_delta)
    say(f"accelerate update error vs one full batch: {err:.2e}")
    assert err < 1e-10, err
    check_estimate("accelerate", monitor.estimate(), reference_noise(NoiseConfig(sources=("micro",)), "right")["micro/token"])
    say("PASS accelerate-empty")


def check_lightning(out: str) -> None:
    import lightning.pytorch as pl

    from globalbatch.integrations.lightning import ExactAccumulationMixin, GlobalBatchCallback

    rank = dist.get_rank()

    class LM(ExactAccumulationMixin, pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = mc.tiny_neox()
            self.configure_global_batch(micro_batch=mc.MICRO, global_batch=mc.WINDOW)

        def loss_sum(self, batch):
            return mc.lm_loss_sum(self.model, batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    ref_delta = mc.reference_deltas(mc.tiny_neox(), ROWS, LR)
    module = LM()
    start = [p.detach().clone() for p in module.model.parameters()]
    mine = [r for b in [ROWS[s:s + mc.MICRO] for s in range(0, len(ROWS), mc.MICRO)][rank::mc.WORLD] for r in b]
    loader = torch.utils.data.DataLoader(mine, batch_size=mc.MICRO, shuffle=False, collate_fn=mc.collate)
    logger = ic.list_logger()
    cb = GlobalBatchCallback(global_batch=mc.WINDOW)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", precision="64-true", max_epochs=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, log_every_n_steps=1, logger=logger, callbacks=[cb])
    trainer.fit(module, loader)
    assert trainer.global_step == 3, trainer.global_step  # the driver skipped the window without a target
    assert module.gb_driver.skipped_windows == 1
    err = ic.max_rel_diff([p.detach() - s for p, s in zip(module.model.parameters(), start)], ref_delta)
    say(f"lightning update error vs one full batch: {err:.2e}")
    assert err < 1e-10, err
    est = cb.monitor.estimate()
    check_estimate("lightning", est, reference_noise(NoiseConfig(sources=("micro",)), "right")["micro/token"])
    if rank == 0:  # Lightning's loggers write on rank 0
        rows = ic.logged_per_window(logger, "noise/windows")
        assert [m["noise/windows"] for m in rows] == [1.0, 2.0, 2.0, 2.0], rows
        assert [m["noise/skipped_windows"] for m in rows] == [0.0, 0.0, 1.0, 2.0], rows
        assert rows[-1]["noise/b_simple_tokens"] == est.b_simple, (rows[-1], est)
    say("PASS lightning-empty")


def main() -> None:
    out = sys.argv[1]
    if not dist.is_initialized():  # torchrun's environment; the frameworks reuse this group
        dist.init_process_group("gloo")
    checks = {"hf": check_hf, "driver": check_driver, "accelerate": check_accelerate, "lightning": check_lightning}
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(checks)
    for name in only:
        checks[name](out)


if __name__ == "__main__":
    from clean_exit import clean_exit

    main()
    clean_exit()  # every check passed: skip gloo's teardown (see clean_exit.py)
