"""Hugging Face ``Trainer``: exact token-normalized accumulation, the plan check, B_simple in the Trainer's logs.

What the Trainer does by default (transformers 5.x, read from ``Trainer.get_batch_samples``,
``_get_num_items_in_batch``, ``compute_loss`` and ``training_step``): it prefetches the
``gradient_accumulation_steps`` micro-batches of a step, counts ``num_items_in_batch`` =
labels != -100 over them (all-reduced over ranks with ``average_tokens_across_devices``), and
passes that count to the model, whose loss divides its summed loss by it. The count is taken
over the *unshifted* labels unless the model's ``loss_type`` maps to ``ForCausalLMLoss``;
``GPT2LMHeadModel`` has ``loss_type=None`` (its class name matches no loss group), so the count
includes the first label of every row, which is never a target: one token too many per
sequence, and a gradient that is wrong by the ragged share of those extra tokens.

What :class:`GlobalBatchTrainerMixin` changes, at the Trainer's own extension points:

* ``get_batch_samples`` (public, documented as the place that counts items): the count is the
  number of **targets after the shift** (:func:`globalbatch.losses.count_causal_lm_targets`,
  honouring ``ignore_index`` and a collator's ``shift_labels``), all-reduced over the DP ranks
  together with the window's sequences and padded tokens (one collective per optimizer step);
* ``compute_loss``: the summed cross-entropy of the logits against the same shifted targets
  (:func:`globalbatch.losses.causal_lm_loss_sum`), × dp_world_size / global count (DDP averages
  over ranks; the factor undoes it), so the accumulated gradient is that of the token-mean loss
  of the whole global batch; ``loss_is_scaled_for_ga = True`` tells ``training_step`` not to
  divide by the accumulation steps again;
* ``training_step``: after each backward, feeds :class:`~globalbatch.noise.NoiseScaleMonitor`
  (Δ.grad = m_i · g_i with m_i = W · b_i / N), and closes its window after the syncing backward,
  before the Trainer clips;
* ``log``: adds the callback's metrics (B_simple with its interval, valid tokens per second,
  padding share) to the Trainer's own logs, so TensorBoard, W&B and ``state.log_history`` get them.

The prefetch is why this is the cleanest fit: the Trainer already knows the whole window's labels
before the first forward, so the global count can be all-reduced up front and each micro-batch's
loss divided by it (as torchtitan does); :class:`~globalbatch.step.StepDriver`'s
"sum, then rescale after the sync" would need a hook between the last backward and the Trainer's
clipping, which the Trainer does not offer.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from globalbatch.errors import Raw, SettingError
from globalbatch.integrations import require
from globalbatch.integrations._common import CallbackSettings, check_plan, derive_grad_accum_steps, noise_metrics, plan_line
from globalbatch.losses import IGNORE_INDEX, LossHead, causal_lm_head

transformers = require("transformers", "hf")
from transformers import Trainer, TrainerCallback  # noqa: E402

if not hasattr(Trainer, "loss_is_scaled_for_ga"):  # pragma: no cover - depends on the installed version
    raise ImportError(f"transformers {transformers.__version__} is not allowed; allowed: a version whose Trainer has "
                      "loss_is_scaled_for_ga (5.x; tested with 5.24): pip install -U 'globalbatch[hf]'")

__all__ = ["GlobalBatchCallback", "GlobalBatchTrainerMixin", "GlobalBatchTrainer"]

logger = logging.getLogger(__name__)

_SUPPORTED = ("NO", "MULTI_CPU", "MULTI_GPU")


class GlobalBatchCallback(CallbackSettings, TrainerCallback):
    """Plan check at train start and the metrics the mixin adds to the Trainer's logs.

    Args:
        global_batch: pin the global batch (sequences per optimizer step, all ranks). At train
            start a run whose ``per_device_train_batch_size × gradient_accumulation_steps ×
            world_size`` differs stops with the numbers (:class:`GlobalBatchTrainer` re-derives the
            accumulation steps from it first, so this only fires when that was bypassed).
        noise: measure B_simple (needs ≥ 2 micro-batches per window over all ranks).
        noise_config: a :class:`globalbatch.noise.NoiseConfig` (default: micro source, half-life
            of 20 windows).

    Alone (with a plain ``Trainer``) it prints and checks the plan; the throughput and noise
    metrics need :class:`GlobalBatchTrainerMixin`, which sees the batches and the gradients
    (Trainer callbacks see neither before the gradients are clipped).
    """

    def __init__(self, *, global_batch: Optional[int] = None, noise: bool = True, noise_config: Any = None) -> None:
        CallbackSettings.__init__(self, global_batch=global_batch, noise=noise, noise_config=noise_config)

    def on_train_begin(self, args, state, control, **kwargs):
        check_plan(global_batch=self.global_batch, micro_batch=args.per_device_train_batch_size,
                   grad_accum_steps=args.gradient_accumulation_steps, dp_world_size=args.world_size)
        self.plan = plan_line(micro_batch=args.per_device_train_batch_size,
                              grad_accum_steps=args.gradient_accumulation_steps, dp_world_size=args.world_size,
                              pinned=self.global_batch is not None)
        if state.is_world_process_zero:
            print(self.plan, flush=True)
        self.meter.start()
        return control

    def metrics(self) -> dict[str, float]:
        """Throughput and noise metrics since the last call (one host sync for the noise estimate)."""
        if self.meter.windows == 0:
            return {}
        return {**self.meter.read(), **noise_metrics(self.monitor)}


if TYPE_CHECKING:  # the checker reads the mixin as the Trainer it is mixed into
    _TrainerHost = Trainer
else:
    _TrainerHost = object


class GlobalBatchTrainerMixin(_TrainerHost):
    """Put before ``Trainer`` (``class MyTrainer(GlobalBatchTrainerMixin, Trainer)``): exact accumulation.

    Keyword arguments (the rest go to the Trainer):
        global_batch: pin the global batch in sequences; ``args.gradient_accumulation_steps`` is
            re-derived as ``global_batch / (per_device_train_batch_size × world_size)`` before the
            Trainer is built, or a ValueError with the numbers is raised. None: keep the args.
        noise: measure B_simple and log it (``noise/b_simple_tokens``…).
        noise_config: a :class:`globalbatch.noise.NoiseConfig`.
        loss_head: a :class:`globalbatch.losses.LossHead`: the summed loss from the model's outputs and
            the batch, and its count from the batch alone (taken for the whole window before its first
            forward). Built in: ``causal_lm_head()`` (the default), ``token_head(seq2seq=True)`` (seq2seq:
            labels not shifted, decoder inputs built from them), ``token_head()`` (masked LM, token
            classification), ``sequence_classification_head()``. The head's label keys are not passed
            to the model (its own loss is not used).
        ignore_index: label value without a loss (default -100), for the default head.
        shift_labels: for the default head: True (causal LM: logits at t predict labels[t+1], as HF's
            causal models do); False for models whose labels are already aligned with the logits.

    The loss is computed here from the outputs (the model's own loss is not used). Supported: one
    process, DDP over CPU/GPU ranks, or FSDP2 (``fsdp=True, fsdp_config={"fsdp_version": 2, ...}``:
    the reduce-scatter averages over ranks as DDP does, and the noise monitor hooks FSDP2's unsharded
    gradients, from the second window); DeepSpeed, FSDP1 and ``DataParallel`` (``n_gpu > 1``) raise
    at construction.
    """

    loss_is_scaled_for_ga = True

    def __init__(self, *args: Any, global_batch: Optional[int] = None, noise: bool = True, noise_config: Any = None,
                 ignore_index: int = IGNORE_INDEX, shift_labels: bool = True, loss_head: Optional[LossHead] = None,
                 **kwargs: Any) -> None:
        if loss_head is not None and not isinstance(loss_head, LossHead):
            raise SettingError("loss_head", Raw(type(loss_head).__name__), "a globalbatch.losses.LossHead "
                               "(e.g. sequence_classification_head()) or None")
        targs = kwargs.get("args") if "args" in kwargs else (args[1] if len(args) > 1 else None)
        if global_batch is not None:
            if targs is None:
                raise SettingError("args", None, "TrainingArguments (args=) when global_batch is set",
                                   why=f"global_batch {global_batch} needs the per-device batch and world size")
            targs.gradient_accumulation_steps = derive_grad_accum_steps(
                global_batch, targs.per_device_train_batch_size, targs.world_size)
        super().__init__(*args, **kwargs)
        dt = str(getattr(self.accelerator.distributed_type, "value", self.accelerator.distributed_type))
        if dt == "DEEPSPEED":
            raise SettingError(
                "distributed_type", Raw("DEEPSPEED"), "NO, MULTI_CPU, MULTI_GPU, FSDP (version 2)", why=
                "DeepSpeed owns the loss and the step: engine.backward divides each loss by its "
                "gradient_accumulation_steps (runtime/engine.py _scale_loss_by_gas; the Trainer turns that off with "
                "scale_wrt_gas=False), averages gradients over ranks, and clips and applies its own fp16 loss scale "
                "inside engine.step; under ZeRO-2/3 each micro-batch's gradients are reduced and partitioned during "
                "its backward, so the noise monitor never sees a micro-batch gradient")
        fsdp_version = getattr(getattr(self.accelerator.state, "fsdp_plugin", None), "fsdp_version", None)
        if dt == "FSDP" and fsdp_version != 2:
            raise SettingError("fsdp_version", fsdp_version, "2 (fsdp_config={'fsdp_version': 2}: FSDP2's "
                               "fully_shard, whose unsharded gradients the noise monitor hooks)")
        if dt not in _SUPPORTED and dt != "FSDP":
            raise SettingError("distributed_type", Raw(str(dt)), f"{', '.join(_SUPPORTED)}, FSDP "
                               "(single process, DDP or FSDP2)")
        if self.args.n_gpu > 1:
            raise SettingError("n_gpu", Raw(f"{self.args.n_gpu} (torch DataParallel)"), "1 per process "
                               "(launch with torchrun for data parallelism)")
        cb = next((c for c in self.callback_handler.callbacks if isinstance(c, GlobalBatchCallback)), None)
        if cb is None:
            cb = GlobalBatchCallback(global_batch=global_batch, noise=noise, noise_config=noise_config)
            self.add_callback(cb)
        elif global_batch is not None and cb.global_batch is None:
            cb.global_batch = global_batch
        self.gb_callback: GlobalBatchCallback = cb
        self.gb_ignore_index = int(ignore_index)
        self.gb_shift_labels = bool(shift_labels)
        self.gb_loss_head: LossHead = loss_head if loss_head is not None else causal_lm_head(
            ignore_index=self.gb_ignore_index, shift=self.gb_shift_labels)
        self._gb_window: Optional[torch.Tensor] = None  # [valid tokens, sequences, padded tokens], all ranks
        self._gb_micro_count: Optional[torch.Tensor] = None
        self._gb_measure = True

    # -- the window's count (once per optimizer step, one all-reduce) -------------------------------------

    def _gb_count(self, batch: dict) -> torch.Tensor:
        """The head's count of loss-bearing units (the default head: targets after the shift; a padding-free
        collator's ``shift_labels`` are already aligned)."""
        return torch.as_tensor(self.gb_loss_head.count(batch))

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Prefetch the window (as the Trainer does) and count its targets after the shift, over all ranks."""
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        if not batch_samples:
            return batch_samples, None
        if not any(k in batch_samples[0] for k in self.gb_loss_head.label_keys):
            raise SettingError("batch keys", sorted(batch_samples[0]), f"a batch with "
                               f"{' or '.join(map(repr, self.gb_loss_head.label_keys))} (GlobalBatchTrainer computes "
                               f"the {self.gb_loss_head.name} loss from them)")
        stats = torch.zeros(3, dtype=torch.float64, device=device)
        for b in batch_samples:
            ids = next((b[k] for k in ("input_ids", "labels", *self.gb_loss_head.label_keys) if k in b))
            stats += torch.stack([self._gb_count(b).to(device, torch.float64),
                                  torch.tensor(float(ids.shape[0]), dtype=torch.float64, device=device),
                                  torch.tensor(float(ids.numel()), dtype=torch.float64, device=device)])
        if self.accelerator.num_processes > 1 and dist.is_initialized():
            dist.all_reduce(stats)  # one collective per optimizer step: [valid tokens, sequences, padded tokens]
        self._gb_window = stats
        # B_simple needs ≥ 2 small batches per window over all ranks: a short last window of one
        # micro-batch on one process is trained exactly but not measured.
        self._gb_measure = len(batch_samples) * self.accelerator.num_processes >= 2
        return batch_samples, stats[0]

    # -- the loss ---------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The head's summed loss × dp_world_size / global count (training); its mean loss otherwise."""
        head = self.gb_loss_head
        if not any(k in inputs for k in head.label_keys):
            raise SettingError("inputs keys", sorted(inputs), f"inputs with {' or '.join(map(repr, head.label_keys))}")
        model_inputs = {k: v for k, v in inputs.items() if k not in head.label_keys}
        if head.decoder_inputs_from_labels and "decoder_input_ids" not in model_inputs:
            base = self.accelerator.unwrap_model(model)
            model_inputs["decoder_input_ids"] = base.prepare_decoder_input_ids_from_labels(labels=inputs["labels"])
        outputs = model(**model_inputs)
        loss_sum, count = head.loss_sum(outputs, inputs)
        count = torch.as_tensor(count, device=loss_sum.device)
        if model.training and num_items_in_batch is not None:
            self._gb_micro_count = count
            world = self.accelerator.num_processes
            loss = loss_sum * (world / num_items_in_batch.to(loss_sum.device, loss_sum.dtype).clamp(min=1.0))
        else:  # evaluation (or a caller without the window count): this batch's token mean
            loss = loss_sum / count.clamp(min=1).to(loss_sum.dtype)
        return (loss, outputs) if return_outputs else loss

    # -- per micro-batch: the noise monitor ---------------------------------------------------------------

    def _gb_monitor(self, model):
        cb = self.gb_callback
        if cb.noise and cb.monitor is None:
            from globalbatch.noise import NoiseConfig, NoiseScaleMonitor

            k = self.args.gradient_accumulation_steps * self.accelerator.num_processes
            if k < 2:
                logger.warning("globalbatch: B_simple needs two or more micro-batches per step over all ranks "
                               "(gradient_accumulation_steps × world_size = %d); not measured", k)
                cb.noise = False
                return None
            cfg = cb.noise_config if cb.noise_config is not None else NoiseConfig(sources=("micro",))
            # `model` is the wrapped model here (DDP under torchrun): the monitor's comm hook goes on it,
            # before its first backward.
            cb.monitor = NoiseScaleMonitor(model, optimizer=self.optimizer, config=cfg)
        return cb.monitor

    def training_step(self, model, inputs, num_items_in_batch=None):
        monitor = self._gb_monitor(model)
        loss = super().training_step(model, inputs, num_items_in_batch)
        if num_items_in_batch is None or self._gb_micro_count is None:
            return loss
        count = self._gb_micro_count
        self._gb_micro_count = None
        last = bool(self.accelerator.gradient_state.sync_gradients)
        if monitor is not None and self._gb_measure:
            samples = inputs["labels"].shape[0] if "labels" in inputs else None
            mult = count.to(torch.float64) * (self.accelerator.num_processes / num_items_in_batch.to(torch.float64))
            monitor.micro_backward(count, samples=samples, grad_multiplier=mult)
            if last:
                scaler = getattr(self.accelerator, "scaler", None)
                scale = getattr(scaler, "_scale", None) if scaler is not None else None
                monitor.window_end(loss_scale=scale, lr=self.optimizer.param_groups[0]["lr"])  # type: ignore[union-attr]  # built by now
        if last and self._gb_window is not None:
            # HOST SYNC, once per optimizer step: three numbers already all-reduced in get_batch_samples
            # (read after the window's backward passes, so they do not stall the compute).
            valid, seqs, padded = self._gb_window.tolist()
            self.gb_callback.meter.record(valid, padded, seqs)
            if self.gb_callback.meter.windows == 1 and self.is_world_process_zero():
                print(self.gb_callback.meter.first_window_line(), flush=True)
            self._gb_window = None
        return loss

    def log(self, logs, *args, **kwargs):
        """The Trainer's log, with the global-batch metrics added to training logs."""
        if "loss" in logs:  # a training log (evaluation logs carry eval_loss)
            logs.update(self.gb_callback.metrics())
        return super().log(logs, *args, **kwargs)


class GlobalBatchTrainer(GlobalBatchTrainerMixin, Trainer):
    """``transformers.Trainer`` with exact token-normalized accumulation (see :class:`GlobalBatchTrainerMixin`)."""
