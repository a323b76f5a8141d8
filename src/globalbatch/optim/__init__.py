"""Optimizers: the one registry every command builds from (:mod:`globalbatch.optim.registry`)."""

from globalbatch.optim.registry import (  # noqa: F401
    OPTIMIZERS,
    OptimizerRecipe,
    build_optimizer,
    decay_param_groups,
    lr_for_batch,
    lr_scaling_rule,
    optimizer_names,
    register_optimizer,
)

__all__ = ["OPTIMIZERS", "OptimizerRecipe", "build_optimizer", "decay_param_groups", "lr_for_batch", "lr_scaling_rule",
           "optimizer_names", "register_optimizer"]
