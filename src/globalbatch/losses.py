"""Summed losses and their counts of loss-bearing units, the input :class:`~globalbatch.step.StepDriver` needs.

An exact global-batch step needs, for every micro-batch, the **sum** of the per-token
losses and the **number of tokens that carry a loss**. For a causal LM whose model shifts
the labels internally (Hugging Face ``*ForCausalLM`` / ``GPT2LMHeadModel`` with
``labels=input_ids``), position ``t`` predicts ``labels[t + 1]``: the targets are
``labels[..., 1:]``, and the first label of every row is never a target. Counting
``labels != ignore_index`` over the unshifted labels counts one token too many per
sequence — the error behind the Trainer's mis-normalized accumulation (docs/integrations.md).

:func:`causal_lm_loss_sum` works on logits of any model, so the count and the loss always
come from the same targets.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "causal_lm_targets", "causal_lm_loss_sum", "count_causal_lm_targets"]

IGNORE_INDEX = -100
"""PyTorch's and Hugging Face's default label for "no loss here" (padding, prompts)."""


def causal_lm_targets(labels_bt: torch.Tensor, *, shift: bool = True, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The targets aligned with the logits: ``labels[:, 1:]`` padded with ``ignore_index`` when ``shift``.

    Same layout as the logits' first two dimensions, so ``logits[:, t]`` is scored against ``targets[:, t]``.
    """
    if labels_bt.dim() < 1:
        raise ValueError(f"labels shape {tuple(labels_bt.shape)} is not allowed; allowed: (batch, time) or (time,)")
    if not shift:
        return labels_bt
    return F.pad(labels_bt[..., 1:], (0, 1), value=ignore_index)


def count_causal_lm_targets(labels_bt: torch.Tensor, *, shift: bool = True,
                            ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Tokens that carry a loss: ``labels[..., 1:] != ignore_index`` when ``shift`` (a 0-d int64 tensor, no sync)."""
    targets = labels_bt[..., 1:] if shift else labels_bt
    return (targets != ignore_index).sum()


def causal_lm_loss_sum(logits_btv: torch.Tensor, labels_bt: torch.Tensor, *, shift: bool = True,
                       ignore_index: int = IGNORE_INDEX,
                       upcast: Optional[torch.dtype] = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of a causal LM and its count of targets.

    Args:
        logits_btv: ``(batch, time, vocab)`` logits (``model(...).logits``).
        labels_bt: ``(batch, time)`` labels. With ``shift=True`` (Hugging Face convention:
            ``labels = input_ids`` with padding set to ``ignore_index``) the logit at ``t`` is
            scored against ``labels[:, t + 1]``; with ``shift=False`` the labels are already
            the targets of each position.
        ignore_index: label value that carries no loss (padding, masked prompt tokens).
        upcast: compute the loss in at least this dtype (half-precision logits are upcast to
            float32, as Hugging Face does; float64 logits stay float64). None: the logits' dtype.

    Returns:
        ``(loss_sum, count)``: 0-d tensors, the summed loss over all targets and the number of
        targets (``int64``), ready for ``StepDriver.backward(loss_sum, count)``. No host sync.
    """
    if logits_btv.dim() != labels_bt.dim() + 1 or logits_btv.shape[:-1] != labels_bt.shape:
        raise ValueError(f"logits shape {tuple(logits_btv.shape)} and labels shape {tuple(labels_bt.shape)} are not "
                         "allowed; allowed: logits (..., time, vocab) with labels (..., time)")
    if upcast is not None and logits_btv.dtype.is_floating_point and logits_btv.dtype.itemsize < upcast.itemsize:
        logits_btv = logits_btv.to(upcast)
    targets = causal_lm_targets(labels_bt, shift=shift, ignore_index=ignore_index).to(logits_btv.device)
    loss_sum = F.cross_entropy(logits_btv.reshape(-1, logits_btv.shape[-1]), targets.reshape(-1),
                               ignore_index=ignore_index, reduction="sum")
    return loss_sum, (targets != ignore_index).sum()
