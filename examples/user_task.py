"""A minimal user task: softmax regression on Gaussian blobs, generated from a seed.

Load it like a built-in task, from a file or (with ``examples/`` on ``sys.path``) a module::

    from globalbatch.lab.tasks import load_task
    task = load_task("examples/user_task.py:make_task", num_classes=3)
    task = load_task("user_task:make_task")

Run it directly to train 100 SGD steps and print the validation loss before and after::

    python examples/user_task.py
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from globalbatch.lab.tasks import Task, to_device


@dataclass(kw_only=True)
class BlobsTask(Task):
    """Classify points drawn around ``num_classes`` random centres; one unit = one point."""

    train_x: torch.Tensor = field(repr=False)
    """Training points ``(num_train_samples, dim)``."""
    train_y: torch.Tensor = field(repr=False)
    """Their classes."""
    val_x: torch.Tensor = field(repr=False)
    """Validation points."""
    val_y: torch.Tensor = field(repr=False)
    """Their classes."""

    def build_model(self, seed: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):  # deterministic, and the caller's RNG is untouched
            torch.manual_seed(seed)
            return nn.Linear(self.train_x.shape[1], int(self.train_y.max()) + 1)

    def collate(self, indices: Sequence[int], device=None) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(list(indices), dtype=torch.int64)
        return to_device({"x": self.train_x[idx], "y": self.train_y[idx]}, device)

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(batch["x"].to(next(model.parameters()).dtype))
        y = batch["y"]
        # A sum, never a mean: the caller divides once by the global count.
        return F.cross_entropy(logits, y, reduction="sum"), torch.tensor(y.shape[0], device=y.device)

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["y"].shape[0])

    def val_batches(self, micro_batch: int) -> Iterator[dict[str, torch.Tensor]]:
        return ({"x": self.val_x[s:s + micro_batch], "y": self.val_y[s:s + micro_batch]}
                for s in range(0, len(self.val_y), micro_batch))


def make_task(num_samples: int = 512, num_val: int = 128, dim: int = 8, num_classes: int = 4,
              seed: int = 1234) -> BlobsTask:
    """Build the task; every keyword is an override accepted by ``load_task``."""
    if num_samples < 1 or num_val < 1 or dim < 1 or num_classes < 2:
        raise ValueError(f"make_task: num_samples={num_samples}, num_val={num_val}, dim={dim}, "
                         f"num_classes={num_classes}: need >= 1, >= 1, >= 1, >= 2")
    g = torch.Generator().manual_seed(seed)
    centres = 2.0 * torch.randn(num_classes, dim, generator=g)
    y = torch.arange(num_samples + num_val) % num_classes
    x = centres[y] + torch.randn(len(y), dim, generator=g)
    return BlobsTask(name="blobs", unit="sample", seq_len=None, num_train_samples=num_samples,
                     train_x=x[:num_samples], train_y=y[:num_samples], val_x=x[num_samples:], val_y=y[num_samples:])


def _val_loss(task: BlobsTask, model: nn.Module) -> float:
    with torch.no_grad():
        total, count = 0.0, 0
        for batch in task.val_batches(64):
            loss, n = task.loss_sum(model, batch)
            total, count = total + loss.item(), count + int(n)
    return total / count


if __name__ == "__main__":
    task = make_task()
    model = task.build_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    order = task.sample_order(seed=0)
    before = _val_loss(task, model)
    for _ in range(100):
        loss, n = task.loss_sum(model, task.collate([next(order) for _ in range(32)]))
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
    print(f"{task.name}: val loss {before:.3f} -> {_val_loss(task, model):.3f} after 100 steps of 32 samples")
