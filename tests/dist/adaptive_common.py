"""A synthetic regression run with an adaptive batch, shared by the unit tests and the torchrun script.

y = x·w* + noise (x ∈ R^8): the per-sample gradient noise is large next to |G|² once the model
is near w*, so B_simple grows during training and the noise-tracking policy grows the batch.
The loss is the per-sample squared error (unit "sample").
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from globalbatch.adaptive import AdaptiveBatchSchedule, FeasibleBatches, NoiseTrackingPolicy
from globalbatch.noise import NoiseConfig, NoiseScaleMonitor
from globalbatch.step import StepConfig, StepDriver

DIM = 8


def make_data(seed: int, n: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.linspace(-1.0, 1.0, DIM).unsqueeze(1)
    x = torch.randn(n, DIM, generator=g)
    y = x @ w + 0.5 * torch.randn(n, 1, generator=g)
    return x, y


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(DIM, 1)


def build(model: nn.Module, *, micro: int = 2, world: int = 1, min_batch: int = 8, max_batch: int = 128,
          initial: int = 8, c: float = 3.0, lr: float = 0.02, lr_rule: str = "sqrt", decide_every: int = 2,
          min_interval_steps: int = 4, patience: int = 2, policy: Any = None, monitor: bool = True,
          dp_group: Any = None) -> tuple[StepDriver, AdaptiveBatchSchedule, Optional[NoiseScaleMonitor]]:
    """Driver + schedule + monitor on ``model`` (a plain module or its DDP wrapper)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    feasible = FeasibleBatches(micro_batch=micro, dp_world_size=world, min_batch=min_batch, max_batch=max_batch,
                               powers_of_two=True)
    sched = AdaptiveBatchSchedule(policy if policy is not None else NoiseTrackingPolicy(c=c), feasible, initial,
                                  lr_rule=lr_rule, decide_every=decide_every,
                                  min_interval_steps=min_interval_steps, patience=patience)
    mon = None
    callbacks: list[Any] = []
    if monitor:
        mon = NoiseScaleMonitor(model, optimizer=opt, unit="sample",
                                config=NoiseConfig(sources=("micro",), half_life_windows=10.0, min_windows=3))
        callbacks.append(mon)
        sched.attach(mon)
    driver = StepDriver(model, opt, StepConfig(micro_batch=micro, batch_schedule=sched, unit="sample"),
                        callbacks=callbacks, dp_group=dp_group)
    return driver, sched, mon


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    x, y = batch
    return ((model(x) - y) ** 2).sum(), x.shape[0]


def run_steps(driver: StepDriver, x: torch.Tensor, y: torch.Tensor, steps: int, *, rank: int = 0,
              world: int = 1) -> list[int]:
    """Train ``steps`` windows from the driver's sample position (wrapping around the data);
    rank r takes the r-th micro-batch of each accumulation step. Returns the batch of each window."""
    micro = driver.config.micro_batch
    batches = []
    n = x.shape[0]
    for _ in range(steps):
        gb = driver.global_batch
        start = driver.consumed_samples
        idx = [(start + i) % n for i in range(gb)]
        micros = []
        for a in range(0, gb, micro * world):
            ix = idx[a + rank * micro:a + (rank + 1) * micro]
            micros.append((x[ix], y[ix]))
        driver.run_window(micros, loss_fn)
        batches.append(gb)
    return batches


def params_vector(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


__all__ = ["make_data", "make_model", "build", "loss_fn", "run_steps", "params_vector", "DIM", "math"]
