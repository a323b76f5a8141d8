"""Layers for batch-size-aware training: Ghost BatchNorm (:mod:`globalbatch.nn.ghost_bn`)."""

from globalbatch.nn.ghost_bn import (  # noqa: F401
    GhostBatchNorm1d,
    GhostBatchNorm2d,
    GhostBatchNorm3d,
    batchnorm_accumulation_warning,
    convert_to_ghost_bn,
)

__all__ = ["GhostBatchNorm1d", "GhostBatchNorm2d", "GhostBatchNorm3d", "batchnorm_accumulation_warning",
           "convert_to_ghost_bn"]
