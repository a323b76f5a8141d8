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

Other heads: a :class:`LossHead` pairs a summed loss with a count taken from the batch alone (the
Hugging Face Trainer integration counts a whole window before its first forward). Built in:
:func:`causal_lm_head` (the default), :func:`token_head` (labels already aligned with the logits:
seq2seq decoders such as BART/T5, masked LM, token classification) and
:func:`sequence_classification_head` (one label per row; ``ignore_index`` rows carry no loss).
Any other loss: ``LossHead(loss_sum=..., count=...)`` with the same contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F

from globalbatch.errors import Raw, SettingError

__all__ = ["IGNORE_INDEX", "causal_lm_targets", "causal_lm_loss_sum", "count_causal_lm_targets", "LossHead",
           "causal_lm_head", "token_head", "sequence_classification_head", "logits_of", "model_loss", "causal_lm_loss"]

IGNORE_INDEX = -100
"""PyTorch's and Hugging Face's default label for "no loss here" (padding, prompts)."""


def causal_lm_targets(labels_bt: torch.Tensor, *, shift: bool = True, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The targets aligned with the logits: ``labels[:, 1:]`` padded with ``ignore_index`` when ``shift``.

    Same layout as the logits' first two dimensions, so ``logits[:, t]`` is scored against ``targets[:, t]``.
    """
    if labels_bt.dim() < 1:
        raise SettingError("labels shape", Raw(str(tuple(labels_bt.shape))), "(batch, time) or (time,)")
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
        raise SettingError("logits shape", Raw(str(tuple(logits_btv.shape))), "logits (..., time, vocab) with labels (..., time)",
                           why=f"with labels shape {tuple(labels_bt.shape)}")
    if upcast is not None and logits_btv.dtype.is_floating_point and logits_btv.dtype.itemsize < upcast.itemsize:
        logits_btv = logits_btv.to(upcast)
    targets = causal_lm_targets(labels_bt, shift=shift, ignore_index=ignore_index).to(logits_btv.device)
    loss_sum = F.cross_entropy(logits_btv.reshape(-1, logits_btv.shape[-1]), targets.reshape(-1),
                               ignore_index=ignore_index, reduction="sum")
    return loss_sum, (targets != ignore_index).sum()


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits of a model's outputs: ``outputs["logits"]`` (a Hugging Face ``ModelOutput`` or a dict),
    ``outputs.logits``, the first element of a tuple, or the tensor itself."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping) and "logits" in outputs:
        return outputs["logits"]
    if hasattr(outputs, "logits"):
        return outputs.logits
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise SettingError("outputs", Raw(f"of type {type(outputs).__name__}"), "logits, a dict or ModelOutput with "
                       "'logits', or a tuple whose first element is the logits")


@dataclass(frozen=True, kw_only=True, slots=True)
class LossHead:
    """A loss the integrations normalize exactly over a global batch: its sum and its count.

    Both callables must agree: ``count(batch)`` is the count ``loss_sum`` returns, taken from the
    batch alone (no forward), as a 0-d tensor or a number."""

    loss_sum: Callable[[Any, Mapping[str, Any]], tuple[torch.Tensor, Any]]
    """``(model outputs, batch) -> (summed loss over the loss-bearing units, their count)``."""
    count: Callable[[Mapping[str, Any]], Any]
    """``batch -> count`` of loss-bearing units (targets, or labelled rows)."""
    name: str = "custom"
    """For messages and logs."""
    label_keys: tuple[str, ...] = ("labels",)
    """Batch keys the model must not receive (the head reads them); the rest go to the model."""
    decoder_inputs_from_labels: bool = False
    """Seq2seq: when the batch has no ``decoder_input_ids``, build them from the labels with the model's
    ``prepare_decoder_input_ids_from_labels`` (Hugging Face BART, T5, ...), as its own loss path would."""


def _labels(batch: Mapping[str, Any], key: str = "labels") -> torch.Tensor:
    if key not in batch:
        raise SettingError("batch keys", sorted(batch), f"a batch with {key!r}")
    return batch[key]


def causal_lm_head(*, ignore_index: int = IGNORE_INDEX, shift: bool = True,
                   upcast: Optional[torch.dtype] = torch.float32) -> LossHead:
    """Causal LM: the logit at ``t`` scored against ``labels[t + 1]`` (``shift=False``: labels aligned).
    A batch's ``shift_labels`` (a padding-free collator's already-aligned targets) win over ``labels``."""

    def targets(batch: Mapping[str, Any]) -> tuple[torch.Tensor, bool]:
        if "shift_labels" in batch:
            return batch["shift_labels"], False
        return _labels(batch), shift

    def loss_sum(outputs: Any, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        labels, sh = targets(batch)
        return causal_lm_loss_sum(logits_of(outputs), labels, shift=sh, ignore_index=ignore_index, upcast=upcast)

    def count(batch: Mapping[str, Any]) -> torch.Tensor:
        labels, sh = targets(batch)
        return count_causal_lm_targets(labels, shift=sh, ignore_index=ignore_index)

    return LossHead(loss_sum=loss_sum, count=count, name="causal_lm", label_keys=("labels", "shift_labels"))


def token_head(*, ignore_index: int = IGNORE_INDEX, seq2seq: bool = False,
               upcast: Optional[torch.dtype] = torch.float32) -> LossHead:
    """One label per logit position, not shifted: a seq2seq decoder (``seq2seq=True``: decoder inputs
    built from the labels when the batch has none), masked LM, token classification."""

    def loss_sum(outputs: Any, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_lm_loss_sum(logits_of(outputs), _labels(batch), shift=False, ignore_index=ignore_index,
                                  upcast=upcast)

    def count(batch: Mapping[str, Any]) -> torch.Tensor:
        return count_causal_lm_targets(_labels(batch), shift=False, ignore_index=ignore_index)

    return LossHead(loss_sum=loss_sum, count=count, name="seq2seq" if seq2seq else "token",
                    decoder_inputs_from_labels=seq2seq)


def sequence_classification_head(*, ignore_index: int = IGNORE_INDEX,
                                 upcast: Optional[torch.dtype] = torch.float32) -> LossHead:
    """One class label per row: logits ``(batch, classes)``, labels ``(batch,)``; rows labelled
    ``ignore_index`` carry no loss. The count is the labelled rows."""

    def loss_sum(outputs: Any, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        logits, labels = logits_of(outputs), _labels(batch)
        if logits.dim() != 2 or labels.dim() != 1 or logits.shape[0] != labels.shape[0]:
            raise SettingError("logits shape", Raw(str(tuple(logits.shape))), "logits (batch, classes) with labels (batch,)",
                               why=f"with labels shape {tuple(labels.shape)}")
        if upcast is not None and logits.dtype.is_floating_point and logits.dtype.itemsize < upcast.itemsize:
            logits = logits.to(upcast)
        labels = labels.to(logits.device)
        loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
        return loss, (labels != ignore_index).sum()

    def count(batch: Mapping[str, Any]) -> torch.Tensor:
        return (_labels(batch) != ignore_index).sum()

    return LossHead(loss_sum=loss_sum, count=count, name="sequence_classification")


def model_loss(head: LossHead) -> Callable[[Any, Any], tuple[torch.Tensor, Any]]:
    """A ``loss_fn(model, batch) -> (loss_sum, count)`` for :meth:`globalbatch.step.StepDriver.run_window`, from a head.

    The model gets the batch minus the head's label keys: ``model(input_ids)`` when ``input_ids`` is the only
    input (any module taking token ids), else ``model(**inputs)`` (Hugging Face: ``input_ids``,
    ``attention_mask``, …). The head scores the outputs (``logits``, a ``ModelOutput`` or a tuple) against the
    batch's labels."""
    if head.decoder_inputs_from_labels:
        raise SettingError("head", head.name, "a head without decoder_inputs_from_labels (build the decoder inputs "
                           "in the collate function)", why="not here")
    keys = set(head.label_keys)

    def loss_fn(model: Any, batch: Mapping[str, Any]) -> tuple[torch.Tensor, Any]:
        inputs = {k: v for k, v in batch.items() if k not in keys}
        outputs = model(inputs["input_ids"]) if list(inputs) == ["input_ids"] else model(**inputs)
        return head.loss_sum(outputs, batch)

    loss_fn.__name__ = f"{head.name}_loss"
    loss_fn.__doc__ = f"Summed {head.name} loss of ``model`` on ``batch`` and its count (from :func:`model_loss`)."
    return loss_fn


causal_lm_loss = model_loss(causal_lm_head())
"""The ready causal-LM ``loss_fn`` for ``driver.run_window``: batches with ``input_ids`` (and any other model
inputs) and ``labels`` in the Hugging Face convention (``labels = input_ids``, ``-100`` at padding; the model's
logit at ``t`` is scored against ``labels[t + 1]``). Returns the summed cross-entropy and its count of targets."""
