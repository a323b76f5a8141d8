"""What the driver reads from the user's inputs: how a loss was reduced, and a micro-batch's samples."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch



_PASS_THROUGH = frozenset({"ToCopyBackward0", "CloneBackward0", "ViewBackward0", "ReshapeAliasBackward0",
                           "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0",
                           "AliasBackward0", "SelectBackward0"})
_MEAN_REDUCTION = 1  # at::Reduction::Mean, as saved by the loss nodes (None 0, Mean 1, Sum 2)


def mean_reduction(loss: torch.Tensor) -> Optional[str]:
    """How ``loss`` was averaged, read from its autograd graph (no host sync), or None when it was not.

    Looks through casts and views at the last operation: ``.mean()`` (``MeanBackward``), a loss built with
    ``reduction="mean"`` (``F.cross_entropy``'s and ``F.mse_loss``'s default, and every loss node that saves
    its reduction), or a division (``loss_sum / count``, ``kl_div(reduction="batchmean")``). A summed loss,
    a product or anything else is None."""
    node = loss.grad_fn
    for _ in range(8):
        if node is None:
            return None
        name = type(node).__name__
        if name not in _PASS_THROUGH:
            break
        nxt = [f for f, _ in node.next_functions if f is not None]
        node = nxt[0] if len(nxt) == 1 else None
    if node is None:
        return None
    name = type(node).__name__
    if name.startswith("MeanBackward"):
        return "a .mean()"
    if getattr(node, "_saved_reduction", None) == _MEAN_REDUCTION:
        return f"a reduction='mean' loss ({name})"
    if name.startswith("DivBackward"):
        return "a division (e.g. loss_sum / count)"
    return None


def batch_samples(batch: Any) -> Optional[int]:
    """Samples in a collated micro-batch: the first dimension of a tensor, or of every tensor of a dict
    or tuple when they agree; None when it cannot be read."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    values = list(batch.values()) if isinstance(batch, Mapping) else list(batch) if isinstance(batch, tuple) else []
    sizes = {int(v.shape[0]) for v in values if isinstance(v, torch.Tensor) and v.dim()}
    return sizes.pop() if len(sizes) == 1 else None
