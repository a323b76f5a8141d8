"""PyTorch Lightning: exact token-normalized accumulation through :class:`~globalbatch.step.StepDriver`.

What Lightning does by default (2.x, read from ``loops/optimization/automatic.py``): with
``Trainer(accumulate_grad_batches=k)`` the closure divides each micro-batch's returned loss by
``k`` (``ClosureResult.from_training_step_output(..., normalize=k)``) and back-propagates it; the
step is the gradient of the **mean of the micro-batch means**. On ragged padded batches that weights
a token of a short micro-batch more than one of a long micro-batch, and a last window with fewer
than ``k`` micro-batches is divided by ``k`` anyway. A world-size change silently changes the global
batch (``k`` is per rank).

:class:`ExactAccumulationMixin` switches the module to manual optimization and runs each window
through a :class:`~globalbatch.step.StepDriver`: the user's ``loss_sum(batch)`` returns the
summed loss and its count (``globalbatch.losses.causal_lm_loss_sum`` for a causal LM); the driver
back-propagates the sum, all-reduces the count once per window, rescales the gradients to the
global token mean, clips and steps (through Lightning's optimizer wrapper, so ``global_step``,
``max_steps`` and the precision plugin's ``optimizer_step`` still apply). Under DDP, Lightning runs
``training_step`` inside the DDP forward and, in manual optimization, arms DDP's reducer only in
``manual_backward``; the mixin arms it (``prepare_for_backward``) for the last micro-batch of each
window only, so the others accumulate locally, as under ``no_sync``.

:class:`GlobalBatchCallback` prints and checks the plan at train start (a pinned global batch that
the run would not train stops it with the numbers) and logs, through ``pl_module.log``, the valid
tokens per second, the padding share, the global batch in valid tokens and B_simple with its
interval (:class:`~globalbatch.noise.NoiseScaleMonitor` fed by the driver).

Mixed precision: ``bf16-mixed`` needs nothing (autocast wraps ``training_step``); under ``16-mixed``
the precision plugin's GradScaler is lent to the driver, which scales each micro-batch's backward,
unscales once per window before the noise monitor and the clipping, and updates the scale; the plugin
steps the optimizer without unscaling again. FSDP2: under ``ModelParallelStrategy`` (``fully_shard`` in ``configure_model``) the driver runs on the
outermost sharded module. Limits: one optimizer; the FSDP1 ``FSDPStrategy`` and DeepSpeed are not
supported. Tested on one process, under DDP and under ModelParallelStrategy with 2 gloo ranks
(tests/dist/integrations_ddp.py, tests/dist/integrations_fsdp.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch

from globalbatch.errors import Raw, SettingError
from globalbatch.integrations import require
from globalbatch.integrations._common import CallbackSettings, check_plan, derive_grad_accum_steps, noise_metrics, plan_line
from globalbatch.step import StepConfig, StepDriver, StepResult
from globalbatch.validate import number, whole

if TYPE_CHECKING:
    import lightning.pytorch as pl

    _ModuleHost = pl.LightningModule  # the checker reads the mixin as the LightningModule it is mixed into
else:
    pl = require("lightning.pytorch", "lightning")
    _ModuleHost = object

__all__ = ["ExactAccumulationMixin", "GlobalBatchCallback"]


class GlobalBatchCallback(CallbackSettings, pl.Callback):
    """Plan check at train start; throughput, padding and B_simple logged through ``pl_module.log``.

    Args:
        global_batch: pin the global batch (sequences per optimizer step, all ranks); a run that
            would train another stops at train start with the numbers.
        noise: measure B_simple (with :class:`ExactAccumulationMixin`; needs ≥ 2 micro-batches per
            window over all ranks).
        noise_config: a :class:`globalbatch.noise.NoiseConfig` (default: micro source).
        log_noise_every_n_steps: read the estimate (one host sync) every this many optimizer steps;
            default: the Trainer's ``log_every_n_steps``.
    """

    def __init__(self, *, global_batch: Optional[int] = None, noise: bool = True, noise_config: Any = None,
                 log_noise_every_n_steps: Optional[int] = None) -> None:
        CallbackSettings.__init__(self, global_batch=global_batch, noise=noise, noise_config=noise_config)
        self.log_noise_every_n_steps = log_noise_every_n_steps

    def _geometry(self, trainer: Any, pl_module: Any) -> tuple[int, int, int]:
        if isinstance(pl_module, ExactAccumulationMixin):
            micro: Any = pl_module.gb_micro_batch
            accum = pl_module.gb_grad_accum_steps
        else:
            loader = trainer.train_dataloader
            micro = getattr(loader, "batch_size", None)
            if micro is None:
                raise SettingError("train_dataloader batch_size", None, "a DataLoader with a fixed batch_size "
                                   "(the plan is micro_batch × accumulation × ranks)")
            accum = trainer.accumulate_grad_batches
        return micro, accum, trainer.world_size

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        micro, accum, world = self._geometry(trainer, pl_module)
        check_plan(global_batch=self.global_batch, micro_batch=micro, grad_accum_steps=accum, dp_world_size=world)
        self.plan = plan_line(micro_batch=micro, grad_accum_steps=accum, dp_world_size=world,
                              pinned=self.global_batch is not None)
        if trainer.is_global_zero:
            print(self.plan, flush=True)
        self.meter.start()

    def on_window_end(self, pl_module: Any, result: StepResult, padded_tokens: float) -> None:
        """Called by the mixin after each driver step (host numbers from the step's one sync)."""
        self.meter.record(result.global_units, padded_tokens, result.global_samples)
        if self.meter.windows == 1 and pl_module.trainer.is_global_zero:
            print(self.meter.first_window_line(), flush=True)
        every = self.log_noise_every_n_steps or pl_module.trainer.log_every_n_steps or 1
        # optimizer_step repeats for a window the driver skipped (no target anywhere, a non-finite loss): window
        # tells every window apart
        metrics = {**self.meter.read(), "globalbatch/optimizer_step": float(result.step),
                   "globalbatch/window": float(self.meter.windows)}
        if self.monitor is not None and result.step % every == 0:
            metrics.update(noise_metrics(self.monitor))
        metrics = {k: v for k, v in metrics.items() if v == v}  # NaN-free (Lightning rejects nothing, but loggers do)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=int(result.global_samples))


class ExactAccumulationMixin(_ModuleHost):
    """Put before ``LightningModule``: each window of micro-batches is one exact global-batch step.

    Call :meth:`configure_global_batch` in ``__init__`` and implement ``loss_sum(batch)`` returning
    ``(summed loss, count of loss-bearing units)``. Do not define ``training_step`` (the mixin's
    runs the window) and do not pass ``accumulate_grad_batches`` to the Trainer (manual
    optimization forbids it; the mixin accumulates ``grad_accum_steps`` batches itself).
    ``configure_optimizers`` returns one optimizer, optionally with a step-based LR scheduler.
    """

    # -- configuration -----------------------------------------------------------------------------

    def configure_global_batch(self, *, micro_batch: int, grad_accum_steps: Optional[int] = None,
                               global_batch: Optional[int] = None, max_grad_norm: Optional[float] = None,
                               dp_world_size: Optional[int] = None, loss_head: Any = None) -> None:
        """Set the geometry: give ``grad_accum_steps`` (per rank), or pin ``global_batch`` (then the
        accumulation is re-derived for the world size at fit start, or a ValueError with the numbers).

        ``loss_head``: a :class:`globalbatch.losses.LossHead` (``sequence_classification_head()``,
        ``token_head(seq2seq=True)``, ``causal_lm_head()``, or your own); with it, the default
        :meth:`loss_sum` calls ``self(**batch without the head's label keys)`` and scores the outputs
        with the head. Without it, define ``loss_sum(batch)`` yourself."""
        from globalbatch.losses import LossHead

        if loss_head is not None and not isinstance(loss_head, LossHead):
            raise SettingError("loss_head", Raw(type(loss_head).__name__), "a globalbatch.losses.LossHead or None")
        self.gb_loss_head = loss_head
        if (grad_accum_steps is None) == (global_batch is None):
            raise SettingError("grad_accum_steps", grad_accum_steps, "exactly one of grad_accum_steps and global_batch",
                               why=f"global_batch {global_batch!r}")
        # checked, never rounded: int(1.5) would silently train another global batch
        micro_batch = whole(micro_batch, "micro_batch")
        if grad_accum_steps is not None:
            grad_accum_steps = whole(grad_accum_steps, "grad_accum_steps")
        if global_batch is not None:
            global_batch = whole(global_batch, "global_batch")
        if dp_world_size is not None:
            dp_world_size = whole(dp_world_size, "dp_world_size")
        if max_grad_norm is not None:
            number(max_grad_norm, "max_grad_norm", low=0.0, low_open=True, allowed="a finite number > 0 or None")
        self.automatic_optimization = False
        self.gb_micro_batch = micro_batch
        self.gb_pinned_global_batch = global_batch
        self.gb_grad_accum_steps = grad_accum_steps if grad_accum_steps is not None else \
            derive_grad_accum_steps(global_batch, micro_batch, dp_world_size or 1)  # type: ignore[arg-type]  # checked above
        self.gb_max_grad_norm = max_grad_norm
        self.gb_driver: Optional[StepDriver] = None
        self.gb_last_result: Optional[StepResult] = None
        self._gb_padded = 0.0

    def loss_sum(self, batch: Any) -> tuple[torch.Tensor, Any]:
        """``(summed loss, count of loss-bearing units)`` of a micro-batch: override it, or configure a
        ``loss_head`` (then the module's ``forward`` gets the batch without the labels)."""
        head = getattr(self, "gb_loss_head", None)
        if head is None:
            raise NotImplementedError("loss_sum(batch) must return (summed loss, count of loss-bearing units); "
                                      "define it, or pass configure_global_batch(loss_head=...)")
        inputs = {k: v for k, v in batch.items() if k not in head.label_keys}
        if head.decoder_inputs_from_labels and "decoder_input_ids" not in inputs:
            base = getattr(self, "model", None)
            prepare = getattr(base, "prepare_decoder_input_ids_from_labels", None)
            if prepare is None:
                raise SettingError("batch keys", sorted(batch), "a batch with decoder_input_ids for a seq2seq head",
                                   why="the module has no self.model.prepare_decoder_input_ids_from_labels")
            inputs["decoder_input_ids"] = prepare(labels=batch["labels"])
        return head.loss_sum(self(**inputs), batch)

    def batch_samples(self, batch: Any) -> int:
        """Sequences in a batch: ``batch['input_ids']`` rows for a dict, else ``len(batch[0])``."""
        if isinstance(batch, dict):
            first = batch.get("input_ids", next(iter(batch.values())))
            return int(first.shape[0])
        return len(batch[0])

    def batch_tokens(self, batch: Any) -> float:
        """Padded tokens in a batch (``input_ids.numel()``), for the padding share; 0 if unknown."""
        if isinstance(batch, dict) and "input_ids" in batch:
            return float(batch["input_ids"].numel())
        return 0.0

    # -- the window --------------------------------------------------------------------------------

    def _gb_callback(self) -> Optional[GlobalBatchCallback]:
        callbacks: Any = getattr(self.trainer, "callbacks")  # the Trainer's list (not in its type stubs)
        return next((c for c in callbacks if isinstance(c, GlobalBatchCallback)), None)

    def on_fit_start(self) -> None:
        if getattr(self, "gb_micro_batch", None) is None:
            raise SettingError("configure_global_batch", Raw("not called"), "call it in __init__")
        if self.trainer.accumulate_grad_batches != 1:  # pragma: no cover - Lightning refuses this first
            raise SettingError("accumulate_grad_batches", Raw(str(self.trainer.accumulate_grad_batches)),
                               "1 (configure_global_batch sets the accumulation)")
        world = self.trainer.world_size
        if self.gb_pinned_global_batch is not None:
            self.gb_grad_accum_steps = derive_grad_accum_steps(self.gb_pinned_global_batch, self.gb_micro_batch, world)
        super().on_fit_start()

    def _gb_data_parallel_model(self) -> torch.nn.Module:
        """What syncs the gradients: Lightning's DDP wrapper, else the outermost FSDP2 module that
        ``configure_model`` sharded (``ModelParallelStrategy``), else the module itself."""
        strategy_model = self.trainer.strategy.model
        if isinstance(strategy_model, torch.nn.parallel.DistributedDataParallel):
            return strategy_model
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover - torch without FSDP2
            return self
        root = next((m for m in self.modules() if isinstance(m, FSDPModule)), None)
        if root is None or root is self:
            return self if root is None else root
        inside = {id(p) for p in root.parameters()}
        outside = [n for n, p in self.named_parameters() if p.requires_grad and id(p) not in inside]
        if outside:
            raise SettingError("model", Raw(f"with trainable parameters outside the fully_shard root "
                                            f"{type(root).__name__} ({', '.join(outside[:3])}"
                                            f"{', ...' if len(outside) > 3 else ''})"),
                               "shard the module that holds every trainable parameter last in configure_model")
        return root

    def _gb_build_driver(self) -> StepDriver:
        model = self._gb_data_parallel_model()
        optimizer = self.optimizers()
        if isinstance(optimizer, list):
            raise SettingError("optimizers", Raw(str(len(optimizer))), "one")
        schedulers = self.lr_schedulers()
        cb = self._gb_callback()
        callbacks = []
        world = self.trainer.world_size
        if cb is not None and cb.noise and self.gb_grad_accum_steps * world >= 2:
            from globalbatch.noise import NoiseConfig, NoiseScaleMonitor

            cfg = cb.noise_config if cb.noise_config is not None else NoiseConfig(sources=("micro",))
            raw: Any = getattr(optimizer, "optimizer", optimizer)
            cb.monitor = NoiseScaleMonitor(model, optimizer=raw, config=cfg)
            callbacks.append(cb.monitor)
        config = StepConfig(micro_batch=self.gb_micro_batch,
                            global_batch=self.gb_micro_batch * self.gb_grad_accum_steps * world,
                            max_grad_norm=self.gb_max_grad_norm)
        # The LightningOptimizer: its step() goes through the strategy and advances global_step. A loss-scaling
        # precision plugin (16-mixed) lends its GradScaler to the driver, which scales each micro-batch's
        # backward, unscales before the callbacks and the clipping, and updates the scale (see training_step).
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        return StepDriver(model, optimizer, config, lr_scheduler=schedulers, callbacks=callbacks,  # type: ignore[arg-type]
                          scaler=scaler)  # the LightningOptimizer wraps a torch Optimizer

    def _gb_fit_loss_scale(self, scaler: Any, count: Any) -> None:
        """Once, before a fresh run's first scaled backward: divide the GradScaler's initial scale by about
        the units of a window per rank: the first micro-batch's count (the largest over ranks) ×
        grad_accum_steps, up to a power of two.

        The driver back-propagates *summed* losses: n times the gradients of a mean over n units, so a
        scale fitted to a mean loss (Lightning's 65536 for the mean over a rank's batch) overflows float16
        and the scaler would only back off by halving, one skipped window each (8 in a row raise).
        Measured on the test's tiny GPT-2 (micro-batches of 20–80 targets, windows of 4): from 65536 the
        first 5 windows were skipped; the first micro-batch's count alone (÷ 64) still skipped 2; ÷ count ×
        accumulation (256) none. One host read and, under DP, one tiny all-reduce, once per run; the scaler
        stays dynamic afterwards (it grows back if the scale is too small)."""
        n_t = torch.as_tensor(count, dtype=torch.float64).reshape(()).to(self.device)
        if self.trainer.world_size > 1:
            n_t = self.trainer.strategy.reduce(n_t, reduce_op="max")
        n = max(float(n_t) * self.gb_grad_accum_steps, 1.0)
        scaler._init_scale = max(1.0, scaler._init_scale / 2.0 ** math.ceil(math.log2(n)))

    def _gb_is_last(self, batch_idx: int) -> bool:
        return (batch_idx % self.gb_grad_accum_steps == self.gb_grad_accum_steps - 1
                or batch_idx == self.trainer.num_training_batches - 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        if self.gb_driver is None:
            self.gb_driver = self._gb_build_driver()
        driver = self.gb_driver
        last = self._gb_is_last(batch_idx)
        ddp = self.trainer.strategy.model
        # A short last window of one micro-batch on one process is trained exactly but gives no B_simple
        # (one small batch): the monitor leaves it out instead of refusing it.
        cb = self._gb_callback()
        alone = cb.monitor if (cb is not None and cb.monitor is not None and last and self.trainer.world_size == 1
                               and batch_idx % self.gb_grad_accum_steps == 0) else None
        if alone is not None:
            alone.detach()
        with driver.micro_step(last=last):
            loss_sum, count = self.loss_sum(batch)
            if last and isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
                # Lightning runs training_step inside the DDP forward and, in manual optimization, leaves
                # DDP's reducer unarmed until manual_backward; arm it for the window's syncing backward only
                # (the other micro-batches stay local: that is the no_sync).
                from lightning.pytorch.overrides.distributed import prepare_for_backward

                prepare_for_backward(ddp, loss_sum)
            if driver.scaler is not None and driver.scaler._scale is None and self.trainer.global_step == 0:
                self._gb_fit_loss_scale(driver.scaler, count)
            driver.backward(loss_sum, count, samples=self.batch_samples(batch))
        self._gb_padded += self.batch_tokens(batch)
        if last:
            padded = torch.tensor(self._gb_padded, dtype=torch.float64)
            self._gb_padded = 0.0
            if self.trainer.world_size > 1:  # one more tiny collective per window, for the padding share
                padded = self.trainer.strategy.reduce(padded.to(self.device), reduce_op="sum")
            plugin: Any = self.trainer.precision_plugin
            lent = driver.scaler is not None and getattr(plugin, "scaler", None) is driver.scaler
            if lent:  # the driver unscaled and checked the window: the plugin must not unscale or step it again
                plugin.scaler = None
            try:
                result = driver.step()  # the window's one host sync (float(padded) below rides after it)
            finally:
                if lent:
                    plugin.scaler = driver.scaler
                if alone is not None:
                    alone.attach()
            self.gb_last_result = result
            if result.loss_per_unit == result.loss_per_unit:  # NaN for a window without any target: not logged
                self.log("train/loss_per_token", result.loss_per_unit, on_step=True, on_epoch=False, prog_bar=True,
                         batch_size=int(result.global_samples))
            if cb is not None:
                cb.on_window_end(self, result, float(padded))
        return None
