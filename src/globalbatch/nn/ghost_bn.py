"""Ghost Batch Normalization (Hoffer, Hubara & Soudry 2017, "Train longer, generalize better", Alg. 1).

A BatchNorm layer normalizes with the mean and variance of the batch it is given. Under
gradient accumulation that batch is the *micro*-batch, not the global batch: the statistics —
and so the model — depend on how the global batch was cut. Ghost BatchNorm makes the
statistics' batch size a deliberate, fixed number: in training mode the input is split
along dim 0 into consecutive *ghost batches* of ``ghost_batch_size`` samples (the last one
may be shorter), and each is normalized with its own statistics (Hoffer et al., Alg. 1)::

    x̂_i = (x_i − μ_g) / √(σ²_g + eps) · γ + β      for every sample i of ghost batch g

Running statistics: updated **once per ghost batch, in order**, with the layer's momentum
(unbiased variance of that ghost batch), exactly as if each ghost batch had been a separate
forward call. So a big batch B with ghost size m gives the same outputs *and* the same
running statistics as B/m accumulated micro-batches of m through plain BatchNorm
(``docs/reproductions.md``, experiment a). ``momentum=None`` (cumulative average) counts
every ghost batch in ``num_batches_tracked``.

Eval mode: the running statistics, as in BatchNorm (no ghost split). With
``track_running_stats=False`` there are none, and eval also normalizes per ghost batch.

When ``ghost_batch_size`` ≥ the batch, a ghost layer *is* a BatchNorm layer (tested to 1e-6).
"""

from __future__ import annotations

from typing import Optional, Type, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from globalbatch.errors import SettingError
from globalbatch.validate import whole

__all__ = ["GhostBatchNorm1d", "GhostBatchNorm2d", "GhostBatchNorm3d", "convert_to_ghost_bn",
           "batchnorm_accumulation_warning"]


def _check_ghost(ghost_batch_size: object) -> int:
    return whole(ghost_batch_size, "ghost_batch_size")


class _GhostBatchNorm(_BatchNorm):
    ghost_batch_size: int
    _input_dims: tuple[tuple[int, ...], str]
    """The input dimensions allowed, and how the error says them."""

    def __init__(self, num_features: int, ghost_batch_size: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.ghost_batch_size = _check_ghost(ghost_batch_size)

    def _check_input_dim(self, x: torch.Tensor) -> None:
        dims, allowed = self._input_dims
        if x.dim() not in dims:
            raise SettingError("input dimensions", x.dim(), allowed)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", ghost_batch_size={self.ghost_batch_size}"

    def _bn(self, x: torch.Tensor) -> torch.Tensor:
        # The body of torch.nn.BatchNorm's forward, applied to one ghost batch.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        return F.batch_norm(x, self.running_mean if track else None, self.running_var if track else None,
                            self.weight, self.bias, use_batch_stats, factor, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if not use_batch_stats or x.shape[0] <= self.ghost_batch_size:
            return self._bn(x)
        return torch.cat([self._bn(chunk) for chunk in x.split(self.ghost_batch_size, dim=0)], dim=0)


class GhostBatchNorm1d(_GhostBatchNorm):
    """BatchNorm1d with statistics over ghost batches of ``ghost_batch_size`` samples."""

    _input_dims = ((2, 3), "2 or 3 (N, C[, L])")


class GhostBatchNorm2d(_GhostBatchNorm):
    """BatchNorm2d with statistics over ghost batches of ``ghost_batch_size`` samples."""

    _input_dims = ((4,), "4 (N, C, H, W)")


class GhostBatchNorm3d(_GhostBatchNorm):
    """BatchNorm3d with statistics over ghost batches of ``ghost_batch_size`` samples."""

    _input_dims = ((5,), "5 (N, C, D, H, W)")


_GHOST: dict[type, Type[_GhostBatchNorm]] = {
    nn.BatchNorm1d: GhostBatchNorm1d, nn.BatchNorm2d: GhostBatchNorm2d, nn.BatchNorm3d: GhostBatchNorm3d,
}


def _to_ghost(bn: _BatchNorm, ghost_batch_size: int) -> _GhostBatchNorm:
    cls = _GHOST[type(bn)]
    ref = bn.weight if bn.weight is not None else bn.running_mean
    ghost = cls(bn.num_features, ghost_batch_size, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                device=None if ref is None else ref.device, dtype=None if ref is None else ref.dtype)
    ghost.load_state_dict(bn.state_dict())
    if bn.affine:  # keep the Parameter objects: an optimizer built before the conversion still holds them
        ghost.weight, ghost.bias = bn.weight, bn.bias
    ghost.train(bn.training)
    return ghost


def convert_to_ghost_bn(model: nn.Module, ghost_batch_size: int) -> nn.Module:
    """Replace every ``BatchNorm1d/2d/3d`` in ``model`` by its ghost version (in place; returns the model).

    Weights (the same Parameter objects), running statistics, momentum, eps and train/eval mode
    carry over; ``SyncBatchNorm`` and existing ghost layers are left alone. A ``model`` that is
    itself a BatchNorm layer is returned converted (like ``SyncBatchNorm.convert_sync_batchnorm``).
    """
    _check_ghost(ghost_batch_size)
    if type(model) in _GHOST:
        return _to_ghost(cast(_BatchNorm, model), ghost_batch_size)
    for name, child in model.named_children():
        new = convert_to_ghost_bn(child, ghost_batch_size)
        if new is not child:
            setattr(model, name, new)
    return model


def batchnorm_accumulation_warning(model: nn.Module, *, micro_batch: int, global_batch: int,
                                   micro_steps: int, dp_world_size: int = 1) -> Optional[str]:
    """The warning text when BatchNorm statistics cover fewer samples than the global batch, else None.

    A BatchNorm layer in training mode normalizes over one micro-batch on one rank
    (``SyncBatchNorm``: over the micro-batch of all DP ranks). Under accumulation
    (``micro_steps > 1``) or whenever that is fewer samples than the global batch, the model
    trained depends on the micro-batch, not on the global batch alone. Ghost layers are a
    deliberate choice and stay silent.
    """
    plain = sync = 0
    for m in model.modules():
        if isinstance(m, _GhostBatchNorm) or not isinstance(m, _BatchNorm) or not m.training:
            continue
        if isinstance(m, nn.SyncBatchNorm):
            sync += 1
        else:
            plain += 1
    if not plain and not sync:
        return None
    covered = micro_batch * dp_world_size if (sync and not plain) else micro_batch
    if micro_steps <= 1 and covered >= global_batch:
        return None
    kinds = ", ".join(k for k, n in (("BatchNorm", plain), ("SyncBatchNorm", sync)) if n)
    return (
        f"{plain + sync} {kinds} layer(s) in training mode normalize over {covered} samples per forward "
        f"(micro-batch {micro_batch}{' x dp ' + str(dp_world_size) if covered != micro_batch else ''}), "
        f"not over the global batch {global_batch} ({micro_steps} micro-step(s) per step): their statistics are "
        "per micro-batch, so the model depends on how the batch is cut. Choices: make it deliberate with "
        "globalbatch.nn.convert_to_ghost_bn(model, ghost_batch_size) (Ghost BatchNorm), use "
        "torch.nn.SyncBatchNorm across DP ranks (covers micro-batch x dp, not accumulation), or a norm without "
        "batch statistics (LayerNorm/GroupNorm)."
    )
