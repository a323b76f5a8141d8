"""The one optimizer registry: one recipe per name, the same defaults in every command.

Every harness command (sweep trials and the timing pass, branch, noise, the probe's task
runner, the examples) builds its optimizer here, so ``noise --optimizer adamw`` and
``sweep --noise`` measure with the same update. The table (names, defaults, LR scaling rule)
imports no torch, so ``globalbatch plan`` can name and check an optimizer; building one
imports torch lazily.

Parameter groups: weight decay applies to matrices (``p.ndim ≥ 2``) only; biases and
normalization weights (1-D) get none — the convention of GPT-2/3 and of the LARS/LAMB papers.
LARS and LAMB (:mod:`globalbatch.optim.large_batch`) also leave 1-D tensors out of the trust ratio.
With ``weight_decay=0`` (the harness default) there is a single group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from globalbatch.errors import SettingError

__all__ = ["OptimizerRecipe", "OPTIMIZERS", "optimizer_names", "register_optimizer", "build_optimizer",
           "decay_param_groups", "lr_scaling_rule", "lr_for_batch"]


@dataclass(frozen=True)
class OptimizerRecipe:
    """How one named optimizer is built."""

    name: str
    """The name a command line or config uses (``--optimizer adamw``)."""
    description: str
    """One line for ``--help`` and docs/tasks.md's optimizer table."""
    factory: str
    """``module:attribute`` of the optimizer class; imported only when built."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Keyword defaults beyond ``lr`` and ``weight_decay`` (betas, momentum, ...)."""
    lr_scaling: str = "sqrt"
    """The LR rule across batch sizes this optimizer family follows: ``sqrt`` (Adam-type) or ``linear`` (SGD)."""
    build: Callable[..., Any] | None = None
    """Optional ``(param_groups, lr=, weight_decay=, **defaults) -> Optimizer`` instead of the class."""


OPTIMIZERS: dict[str, OptimizerRecipe] = {}


def register_optimizer(recipe: OptimizerRecipe) -> OptimizerRecipe:
    """Add (or replace) a recipe; returns it."""
    if recipe.lr_scaling not in ("sqrt", "linear"):
        raise SettingError("lr_scaling", recipe.lr_scaling, "sqrt, linear")
    OPTIMIZERS[recipe.name] = recipe
    return recipe


# foreach: torch's multi-tensor update, its default on CUDA, also on a CPU: the same arithmetic per tensor (bit-identical:
# tests/test_loop.py), one call per operation instead of one per parameter (~1 ms less per step of the demo tinygpt).
register_optimizer(OptimizerRecipe(
    name="adamw", description="AdamW, betas 0.9/0.95, eps 1e-8 (decoupled weight decay on matrices)",
    factory="torch.optim:AdamW", defaults={"betas": (0.9, 0.95), "eps": 1e-8, "foreach": True}, lr_scaling="sqrt"))
register_optimizer(OptimizerRecipe(
    name="sgd", description="SGD with momentum 0.9 (weight decay on matrices)",
    factory="torch.optim:SGD", defaults={"momentum": 0.9, "foreach": True}, lr_scaling="linear"))
register_optimizer(OptimizerRecipe(
    name="lars", description="LARS (You et al. 2017): momentum 0.9, trust coefficient 0.001; no decay or trust ratio on 1-D",
    factory="globalbatch.optim.large_batch:LARS", defaults={"momentum": 0.9, "trust_coefficient": 0.001},
    lr_scaling="linear"))
register_optimizer(OptimizerRecipe(
    name="lamb", description="LAMB (You et al. 2019): betas 0.9/0.999, eps 1e-6, bias-corrected; no decay or trust ratio on 1-D",
    factory="globalbatch.optim.large_batch:LAMB", defaults={"betas": (0.9, 0.999), "eps": 1e-6}, lr_scaling="sqrt"))


def optimizer_names() -> tuple[str, ...]:
    return tuple(OPTIMIZERS)


def lr_scaling_rule(name: str) -> str:
    """``sqrt`` or ``linear``: how this optimizer's LR should follow the batch size."""
    return _recipe(name).lr_scaling


def lr_for_batch(name: str, base_lr: float, base_batch: float, global_batch: float) -> float:
    """The LR at ``global_batch`` from ``base_lr`` tuned at ``base_batch``, by ``name``'s rule.

    ``lars``/``sgd``: linear (Goyal et al. 2017); ``lamb``/``adamw``: square root (You et al. 2019).
    The arithmetic is :func:`globalbatch.plan.scale_lr`; warmup goes in tokens through
    :class:`globalbatch.schedule.TokenLRSchedule`.
    """
    from globalbatch.plan import scale_lr

    return scale_lr(base_lr, base_batch, global_batch, lr_scaling_rule(name))


def _recipe(name: str) -> OptimizerRecipe:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise SettingError("optimizer", name, ", ".join(OPTIMIZERS)) from None


def decay_param_groups(params_or_model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups: decay on ``ndim ≥ 2`` tensors, none on biases and norm weights.

    Accepts a module, an iterable of parameters, or ready-made parameter groups (returned as is).
    """
    if hasattr(params_or_model, "parameters") and callable(params_or_model.parameters):
        params = [p for p in params_or_model.parameters() if p.requires_grad]
    else:
        params = list(params_or_model)
        if params and isinstance(params[0], dict):
            return params
    if not weight_decay:
        return [{"params": params, "weight_decay": 0.0}]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": float(weight_decay)}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(name: str, params_or_model: Any, *, lr: float, weight_decay: float = 0.0, **overrides: Any):
    """Build the optimizer ``name`` over a model's parameters (or given params/groups) with its recipe's defaults."""
    import importlib

    recipe = _recipe(name)
    groups = decay_param_groups(params_or_model, weight_decay)
    kwargs = {**recipe.defaults, **overrides}
    if kwargs.get("fused") and "foreach" not in overrides:  # torch refuses both; the caller's fused wins
        kwargs.pop("foreach", None)
    if recipe.build is not None:
        return recipe.build(groups, lr=lr, weight_decay=weight_decay, **kwargs)
    module, attr = recipe.factory.split(":")
    cls = getattr(importlib.import_module(module), attr)
    return cls(groups, lr=lr, **kwargs)
