"""Hugging Face Accelerate: make an ``accelerator.accumulate`` loop exact.

What Accelerate does by default (1.x, ``Accelerator.backward``): every backward divides the loss
by ``gradient_accumulation_steps``; a loop that back-propagates each micro-batch's *mean* loss
steps on the mean of the micro-batch means (wrong on ragged batches, and a short last window is
still divided by the full accumulation), and DDP averages over ranks whatever their token counts.

:class:`ExactAccumulation` keeps the user's loop and Accelerate's ``accumulate``/``no_sync``
machinery and changes two lines: back-propagate the **summed** loss with its count
(:meth:`ExactAccumulation.backward`), and, on the syncing micro-batch, call
:meth:`ExactAccumulation.normalize` before clipping. ``normalize`` all-reduces the window's
``[count, loss sum]`` once (one collective per optimizer step) and multiplies the gradients by
``dp_world_size × gradient_accumulation_steps / global count``: Accelerate divided by the
accumulation steps and DDP averaged over ranks, so the factor turns ``.grad`` into the gradient of
the token-mean loss over the whole global batch, exactly as :class:`~globalbatch.step.StepDriver`
does in a plain loop::

    exact = ExactAccumulation(accelerator, model)                 # after accelerator.prepare
    for batch in loader:
        with accelerator.accumulate(model):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss_sum, count = causal_lm_loss_sum(logits, batch["labels"])
            exact.backward(loss_sum, count, samples=len(batch["input_ids"]))
            if accelerator.sync_gradients:
                loss_per_token = exact.normalize()                # before clipping
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

With ``monitor=`` a :class:`~globalbatch.noise.NoiseScaleMonitor` (built on the prepared model, before
the first backward) is fed each micro-batch and closed in ``normalize``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from globalbatch.errors import Raw, SettingError
from globalbatch.integrations import require

require("accelerate", "hf")

__all__ = ["ExactAccumulation"]


class ExactAccumulation:
    """Token-normalized accumulation for a loop using ``accelerator.accumulate`` and ``accelerator.backward``.

    Args:
        accelerator: the ``accelerate.Accelerator`` (its ``gradient_accumulation_steps`` and ranks).
        model: the prepared model (DDP under a multi-process launch).
        monitor: optional :class:`~globalbatch.noise.NoiseScaleMonitor` on the same prepared model.
    """

    def __init__(self, accelerator: Any, model: torch.nn.Module, *, monitor: Any = None) -> None:
        dt = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
        if dt not in ("NO", "MULTI_CPU", "MULTI_GPU"):
            raise SettingError("distributed_type", Raw(str(dt)), "NO, MULTI_CPU, MULTI_GPU "
                               "(DeepSpeed scales the loss itself; FSDP shards the gradients)")
        self.accelerator = accelerator
        self.model = model
        self.monitor = monitor
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._stats: Optional[torch.Tensor] = None  # float64 [count, loss sum], this rank's window
        self._micros = 0  # micro-batches in this window (this rank)
        self._unmeasured = False  # the monitor is detached for this window (see backward)

    def backward(self, loss_sum: torch.Tensor, count: Any, *, samples: Optional[int] = None) -> None:
        """``accelerator.backward`` of one micro-batch's **summed** loss; its count joins the window's."""
        if loss_sum.dim() != 0:
            raise SettingError("loss_sum shape", Raw(str(tuple(loss_sum.shape))), "a 0-d summed loss")
        count_t = torch.as_tensor(count, device=loss_sum.device).detach().to(torch.float64).reshape(())
        pair = torch.stack([count_t, loss_sum.detach().to(torch.float64)])
        self._stats = pair if self._stats is None else self._stats + pair
        self.accelerator.backward(loss_sum)  # Accelerate divides by gradient_accumulation_steps
        self._micros += 1
        if (self.monitor is not None and self._micros == 1 and self.accelerator.sync_gradients
                and self.accelerator.num_processes == 1):
            # a window of one micro-batch on one process (a short last window): trained exactly, but one
            # small batch gives no B_simple: the monitor leaves it out instead of refusing it
            self.monitor.detach()
            self._unmeasured = True
        if self.monitor is not None:
            ga = self.accelerator.gradient_accumulation_steps
            self.monitor.micro_backward(count_t, samples=samples, grad_multiplier=count_t / ga)

    def normalize(self) -> torch.Tensor:
        """On the syncing micro-batch, before clipping: ``.grad`` ← gradient of the global token-mean loss.

        Returns the global loss per token (a 0-d float64 device tensor; no host sync).
        """
        if not self.accelerator.sync_gradients:
            raise RuntimeError("normalize() called on a micro-batch without gradient sync; allowed: only when "
                               "accelerator.sync_gradients is True (the window's last micro-batch)")
        if self._stats is None:
            raise RuntimeError("normalize() called with no backward() since the last window")
        stats = self._stats
        self._stats = None
        world = self.accelerator.num_processes
        if world > 1:
            stats = self.accelerator.reduce(stats, reduction="sum")  # one collective per optimizer step
        count = stats[0].clamp(min=1.0)
        factor = world * self.accelerator.gradient_accumulation_steps / count
        grads = [p.grad for p in self._params if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for dtype, group in by_dtype.items():
            f = factor.to(dtype) if dtype in (torch.float32, torch.float64) else factor.to(torch.float32)
            torch._foreach_mul_(group, f)
        if self.monitor is not None:
            scaler = getattr(self.accelerator, "scaler", None)
            scale = getattr(scaler, "_scale", None) if scaler is not None else None
            # Still loss-scaled here (Accelerate unscales in clip/step): both norms are divided by the scale.
            self.monitor.window_end(loss_scale=scale, big_grad_multiplier=scale)
            if self._unmeasured:
                self.monitor.attach()
        self._micros, self._unmeasured = 0, False
        return stats[1] / count
