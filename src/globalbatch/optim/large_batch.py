"""LARS and LAMB: layer-wise trust ratios for large-batch training.

**LARS** — You, Gitman & Ginsburg 2017, "Large Batch Training of Convolutional Networks",
Algorithm 1 / eq. (6). For every parameter tensor ("layer") *l* with weights w, gradient g,
weight decay β, trust coefficient η, momentum μ and global LR γ::

    λ_l = η · ‖w‖ / (‖g‖ + β‖w‖ + eps)          local LR (eq. 6; eps = 0 in the paper)
    v   ← μ · v + λ_l · (g + β w)
    w   ← w − γ · v

The paper writes ``v ← μ v + γ λ (g + β w)``; we keep γ outside the buffer as
``torch.optim.SGD`` does (identical for a constant LR; under warmup this is Goyal et al.'s
"momentum correction"). ``v`` starts at zero, so the first step is ``−γ λ (g + β w)``.

**LAMB** — You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", Algorithm 2. With β₁, β₂, eps, weight decay λ and the scaling function φ::

    m ← β₁ m + (1 − β₁) g                 v ← β₂ v + (1 − β₂) g²
    m̂ = m / (1 − β₁ᵗ)                     v̂ = v / (1 − β₂ᵗ)          (bias_correction=True)
    r = m̂ / (√v̂ + eps) + λ w
    w ← w − γ · φ(‖w‖) / ‖r‖ · r          φ(z) = min(z, max_weight_norm)

Both papers exempt biases and normalization parameters from weight decay and from the trust
ratio. Here that is ``exclude_1d=True`` (default): every tensor with ``ndim ≤ 1`` gets the plain
update (momentum SGD, resp. Adam) with no decay and a trust ratio of 1, whatever its group
says. A group with ``trust_ratio=False`` switches the ratio off for all its tensors (LAMB then
is AdamW-like with L2 inside the update, LARS is momentum SGD). When ‖w‖ = 0 or the update's
norm is 0 the ratio (LARS: the local LR λ) is 1, as in both libraries (a zero-initialised layer still moves).

Library cross-checks (tests/test_optim_large_batch.py): LAMB with ``bias_correction=False``
equals ``torch_optimizer.Lamb(debias=False)`` (the paper's v3 update, which that library
implements), LARS equals ``pytorch_optimizer.LARS`` (which also exempts ``ndim ≤ 1``) — both
to 1e-6 after several steps; and a hand-computed two-step example of each paper's equations.
Why not use them at run time: ``torch-optimizer`` is unmaintained; ``pytorch-optimizer``'s
Lamb has no Adam bias correction of v̂ and applies decoupled decay outside the trust ratio by
default, and neither has a per-group switch for the trust ratio.

The trust ratio is computed per tensor on the device: no host sync (``torch.where`` instead of
an ``if`` on a norm).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from globalbatch.errors import SettingError
from globalbatch.validate import number

__all__ = ["LARS", "LAMB"]


def _check(name: str, value: float, low: float, high: float = float("inf"), *, open_low: bool = False,
           open_high: bool = False) -> None:
    rng = f"{'>' if open_low else '>='} {low}" + ("" if high == float("inf") else
                                                  f" and {'<' if open_high else '<='} {high}")
    number(value, name, low=low, high=None if high == float("inf") else high, low_open=open_low, high_open=open_high,
           allowed=f"a number {rng}")


def _trust_ratio(numerator: torch.Tensor, denominator: torch.Tensor, coefficient: float = 1.0) -> torch.Tensor:
    """coefficient × numerator / denominator, or 1 where either norm is 0 (device-side, no host sync)."""
    ok = (numerator > 0) & (denominator > 0)
    safe = torch.where(ok, denominator, torch.ones_like(denominator))
    return torch.where(ok, coefficient * numerator / safe, torch.ones_like(numerator))



def _dense_grads(group: dict[str, Any], name: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, gradient) of each parameter of ``group`` that has a gradient; a sparse one is refused."""
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(f"{name} does not support sparse gradients")
        yield p, p.grad


def _closure_loss(closure: Optional[Callable[[], Any]]) -> Any:
    """The loss of an optimizer's ``closure`` (run with gradients on), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()

class LARS(torch.optim.Optimizer):
    """Layer-wise Adaptive Rate Scaling (You et al. 2017, Alg. 1, eq. 6) on momentum SGD.

    Args:
        params: parameters or groups; a group may set ``trust_ratio=False``.
        lr: global learning rate γ.
        momentum: μ (0.9 in the paper).
        weight_decay: β, applied inside the trust ratio (``ndim ≥ 2`` tensors only with ``exclude_1d``).
        trust_coefficient: η (0.001 in the paper).
        eps: added to the trust-ratio denominator (0 in the paper).
        nesterov: Nesterov momentum on the scaled update.
        exclude_1d: tensors with ``ndim ≤ 1`` (biases, norm weights) get no decay and no trust ratio.
    """

    def __init__(self, params: Iterable[Any], lr: float = 0.1, *, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 0.0, nesterov: bool = False,
                 exclude_1d: bool = True, trust_ratio: bool = True) -> None:
        _check("lr", lr, 0.0, open_low=True)
        _check("momentum", momentum, 0.0, 1.0)
        _check("weight_decay", weight_decay, 0.0)
        _check("trust_coefficient", trust_coefficient, 0.0, open_low=True)
        _check("eps", eps, 0.0)
        if nesterov and momentum == 0:
            raise SettingError("nesterov", True, "False with momentum 0 (Nesterov needs momentum > 0)",
                               why="with momentum 0")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        eps=eps, nesterov=nesterov, exclude_1d=exclude_1d, trust_ratio=trust_ratio)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p, g in _dense_grads(group, "LARS"):
                layer = not (group["exclude_1d"] and p.ndim <= 1)  # False: a bias or norm weight
                wd_p = wd if layer else 0.0
                d = g.add(p, alpha=wd_p) if wd_p else g.clone()
                if layer and group["trust_ratio"]:
                    w_norm = torch.linalg.vector_norm(p)
                    g_norm = torch.linalg.vector_norm(g)
                    d.mul_(_trust_ratio(w_norm, g_norm + wd_p * w_norm + group["eps"], group["trust_coefficient"]))
                if mu:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = torch.zeros_like(p)
                    buf.mul_(mu).add_(d)
                    d = d.add(buf, alpha=mu) if group["nesterov"] else buf
                p.add_(d, alpha=-lr)
        return loss


class LAMB(torch.optim.Optimizer):
    """Layer-wise Adaptive Moments for Batch training (You et al. 2019, Algorithm 2).

    Args:
        params: parameters or groups; a group may set ``trust_ratio=False``.
        lr: global learning rate γ.
        betas: (β₁, β₂); the paper uses (0.9, 0.999).
        eps: ε in the Adam ratio (1e-6 in the paper's BERT runs).
        weight_decay: λ, added to the Adam ratio before the trust ratio (``ndim ≥ 2`` only with ``exclude_1d``).
        bias_correction: Adam's m̂, v̂ (Algorithm 2); False gives the paper's v3 / torch_optimizer update.
        max_weight_norm: φ(z) = min(z, max_weight_norm); None: φ(z) = z. 10 as in common implementations.
        exclude_1d: tensors with ``ndim ≤ 1`` get no decay and no trust ratio.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, *, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, bias_correction: bool = True,
                 max_weight_norm: Optional[float] = 10.0, exclude_1d: bool = True, trust_ratio: bool = True) -> None:
        _check("lr", lr, 0.0, open_low=True)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise SettingError("betas", betas, "two numbers in [0, 1)")
        for i, b in enumerate(betas):
            _check(f"betas[{i}]", b, 0.0, 1.0, open_high=True)
        _check("eps", eps, 0.0)
        _check("weight_decay", weight_decay, 0.0)
        if max_weight_norm is not None:
            _check("max_weight_norm", max_weight_norm, 0.0, open_low=True)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        max_weight_norm=max_weight_norm, exclude_1d=exclude_1d, trust_ratio=trust_ratio)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = _closure_loss(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p, g in _dense_grads(group, "LAMB"):
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                if group["bias_correction"]:
                    m_hat, v_hat = m / (1 - beta1 ** t), v / (1 - beta2 ** t)
                else:
                    m_hat, v_hat = m, v
                r = m_hat / v_hat.sqrt().add_(group["eps"])
                layer = not (group["exclude_1d"] and p.ndim <= 1)  # False: a bias or norm weight
                if layer and group["weight_decay"]:
                    r.add_(p, alpha=group["weight_decay"])
                if layer and group["trust_ratio"]:
                    w_norm = torch.linalg.vector_norm(p)
                    if group["max_weight_norm"] is not None:
                        w_norm = w_norm.clamp(max=group["max_weight_norm"])
                    r.mul_(_trust_ratio(w_norm, torch.linalg.vector_norm(r)))
                p.add_(r, alpha=-group["lr"])
        return loss
