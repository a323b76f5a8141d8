"""Shared fixtures of the integration tests: a tiny GPT-2 (from a config, no download) on ragged byte sequences.

The sequences are real text: chunks of the CPython standard library sources split at
``def``/``class`` lines (as the tinygpt task reads its corpus), so lengths are ragged the way
documents are. Each micro-batch is right-padded to its own longest row; the reference is the
whole window in one forward, padded to the window's longest row. GPT-2 is causal and padded
positions are masked, so padding never changes a real position's logits: the only difference
between accumulation schemes is normalization.

Used by tests/integrations/*.py and tests/dist/integrations_ddp.py.
"""

from __future__ import annotations

import os
import re
import sysconfig
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from globalbatch.losses import IGNORE_INDEX, causal_lm_loss_sum

VOCAB = 256  # bytes
_BOUNDARY = re.compile(rb"^[ \t]*(?:def |class )", re.MULTILINE)


def stdlib_documents(n: int, *, max_len: int = 40, min_len: int = 3, files=("bisect.py", "heapq.py", "fnmatch.py",
                                                                           "colorsys.py", "keyword.py")) -> list[list[int]]:
    """``n`` byte sequences (2 < length ≤ ``max_len``) from stdlib sources split at def/class lines.

    Every fifth document is cut to ``min_len`` bytes, so micro-batches differ a lot in token counts.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[list[int]] = []
    for name in files:
        text = (root / name).read_bytes()
        starts = [0] + [m.start() for m in _BOUNDARY.finditer(text) if m.start()]
        for a, b in zip(starts, starts[1:] + [len(text)]):
            chunk = text[a:b]
            for w in range(0, len(chunk), max_len):
                piece = chunk[w:w + max_len]
                if len(piece) >= min_len:
                    docs.append(list(piece))
    if len(docs) < n:
        raise ValueError(f"n {n} is not allowed; allowed: at most {len(docs)} documents from {files}")
    docs = docs[:n]
    for i in range(0, n, 5):
        docs[i] = docs[i][:min_len]
    return docs


def collate(docs: list[list[int]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row: input_ids (pad 0), attention_mask, labels = input_ids with -100 at padding."""
    width = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for r, d in enumerate(docs):
        ids[r, :len(d)] = torch.tensor(d)
        mask[r, :len(d)] = 1
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class DocDataset(torch.utils.data.Dataset):
    """A map-style dataset of documents (the Trainer collates with :func:`hf_collator`)."""

    def __init__(self, docs: list[list[int]]) -> None:
        self.docs = docs

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> dict:
        return {"doc": self.docs[i]}


def hf_collator(items: list[dict]) -> dict[str, torch.Tensor]:
    return collate([it["doc"] for it in items])


def tiny_gpt2(seed: int = 0, dtype: torch.dtype = torch.float64, n_layer: int = 2, n_embd: int = 16):
    """A 2-layer GPT-2 of width 16 from a config (no hub access), in ``dtype``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=n_embd, n_layer=n_layer, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).to(dtype)


def reference_grads(model, docs: list[list[int]]) -> list[torch.Tensor]:
    """Gradient of the token-mean loss of ``docs`` in one forward (the big batch)."""
    model.zero_grad(set_to_none=True)
    batch = collate(docs)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss_sum, count = causal_lm_loss_sum(logits, batch["labels"])
    (loss_sum / count).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max |a − b| over all elements, relative to max |b| (the "max-element relative" error)."""
    num = max(float((x - y).abs().max()) for x, y in zip(a, b))
    den = max(float(y.abs().max()) for y in b)
    return num / den


def list_logger():
    """A Lightning logger that keeps what Lightning sends to its loggers (the path to TensorBoard, W&B, CSV)."""
    from lightning.pytorch.loggers.logger import Logger

    class ListLogger(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int, dict]] = []

        @property
        def name(self) -> str:
            return "list"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics, step=None) -> None:
            self.rows.append((step, dict(metrics)))

        def log_hyperparams(self, params, *args, **kwargs) -> None:
            pass

    return ListLogger()


def logged_per_window(logger, key: str) -> list[dict]:
    """One row per window (Lightning re-sends the latest values with every batch)."""
    rows = {m["globalbatch/window"]: m for _, m in logger.rows if key in m and "globalbatch/window" in m}
    return [rows[k] for k in sorted(rows)]
