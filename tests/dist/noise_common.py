"""Ground truth for the noise-scale tests: an MLP on a fixed dataset, brute-force per-example gradients.

Used by ``tests/test_noise.py`` (single process) and ``tests/dist/noise_ddp.py`` (torchrun,
2 gloo ranks). Truth at fixed parameters: with per-example gradients g_n of the N
examples, G = mean_n g_n and Σ = mean_n (g_n − G)(g_n − G)ᵀ (the population covariance,
because the tests draw micro-batches *with replacement* from the N examples), so
tr(Σ) = mean_n |g_n|² − |G|², computed with ``torch.func.vmap(grad)`` in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D_IN, HIDDEN, CLASSES = 12, 24, 4


def make_data(n: int = 4096, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A noisy teacher-labelled classification set (float32 inputs, int64 labels)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    teacher = torch.randn(D_IN, CLASSES, generator=g)
    logits = x @ teacher + 1.5 * torch.randn(n, CLASSES, generator=g)
    return x, logits.argmax(1)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


def loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy and the count of samples (the loss-bearing units here)."""
    return F.cross_entropy(model(x), y, reduction="sum"), torch.tensor(len(y))


def pretrain(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 150, lr: float = 0.5) -> None:
    """Full-batch gradient descent so that |G| is small against the noise (B_simple of tens)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        (loss_sum(model, x, y)[0] / len(y)).backward()
        opt.step()
    opt.zero_grad(set_to_none=True)


def per_example_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                      precond: list[torch.Tensor] | None = None) -> torch.Tensor:
    """(N, P) float64 per-example gradients (each optionally multiplied by ``precond``)."""
    from torch.func import functional_call, grad, vmap

    m64 = _double(model)
    params = {k: v.detach() for k, v in m64.named_parameters()}

    def one(p, xi, yi):
        return F.cross_entropy(functional_call(m64, p, (xi[None],)), yi[None], reduction="sum")

    grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x.double(), y)
    flat = [grads[k].reshape(len(x), -1) for k in params]
    if precond is not None:
        flat = [f * c.reshape(1, -1).double() for f, c in zip(flat, precond)]
    return torch.cat(flat, 1)


def truth(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
          precond: list[torch.Tensor] | None = None) -> tuple[float, float]:
    """(tr Σ, |G|²) per sample from brute-force per-example gradients of the whole set."""
    g_np = per_example_grads(model, x, y, precond)
    big = g_np.mean(0)
    g_sq = float(big.square().sum())
    return float(g_np.square().sum(1).mean()) - g_sq, g_sq


def _double(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model).double()
