"""Prompt-masked instruction data on a tiny GPT-NeoX (from a config, nothing downloaded): the count-0 tests.

Each row is a prompt followed by its response, both real text (a CPython standard-library document
cut in two): the labels are -100 on the prompt and on padding, so only the response carries a loss.
A *masked row* keeps its prompt and lost its response (truncated away, as happens when a long prompt
fills the context): every label is -100, and a micro-batch of such rows has no target at all
(count 0). Micro-batches are padded to their own longest row, on the right or on the left;
``position_ids`` follow the attention mask, so a row's logits do not depend on its padding and the
whole window in one forward is the reference.

The deal is the one Accelerate (and so the HF Trainer) uses for a sequential sampler: micro-batch ``j``
of the run goes to rank ``j % world``. :data:`MASKED_ROWS` makes, with micro 2 × accumulation 2 × 2
ranks (windows of 8 rows):

* window 0 — rank 1's first micro-batch has no target (rows 2, 3);
* window 1 — rank 1's whole window has no target (rows 10, 11, 14, 15);
* window 2 — only rank 0's first micro-batch has targets: one small batch over all ranks, so the noise
  estimate cannot use the window and must skip it (rows 18–23);
* window 3 — no target on any rank (rows 24–31): nothing to learn; the StepDriver skips the step, a
  framework that steps anyway steps on a zero gradient (the same parameters under SGD).

Used by tests/dist/integrations_empty.py.
"""

from __future__ import annotations

import integ_common as ic  # sets HF_HUB_OFFLINE
import torch

from globalbatch.losses import IGNORE_INDEX, causal_lm_loss_sum

MICRO, ACCUM, WORLD = 2, 2, 2
WINDOW = MICRO * ACCUM * WORLD
MASKED_ROWS = frozenset({2, 3, 10, 11, 14, 15, *range(18, 32)})


def instruction_rows(n: int, masked: frozenset[int] = MASKED_ROWS) -> list[tuple[list[int], list[int]]]:
    """``n`` (prompt, response) byte lists from stdlib documents; rows in ``masked`` have no response."""
    rows = []
    for i, doc in enumerate(ic.stdlib_documents(n, min_len=4)):
        cut = max(2, len(doc) // 2)
        rows.append((doc[:cut], [] if i in masked else doc[cut:]))
    return rows


def collate(rows: list[tuple[list[int], list[int]]], side: str = "right") -> dict[str, torch.Tensor]:
    """Pad to the longest row on ``side``: input_ids (pad 0), attention_mask, position_ids, labels
    (-100 on the prompt and the padding)."""
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for j, (p, r) in enumerate(rows):
        n = len(p) + len(r)
        at = 0 if side == "right" else width - n
        ids[j, at:at + n] = torch.tensor(p + r)
        mask[j, at:at + n] = 1
        if r:
            labels[j, at + len(p):at + n] = torch.tensor(r)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "labels": labels}


class RowDataset(torch.utils.data.Dataset):
    def __init__(self, rows: list) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"row": self.rows[i]}


def hf_collator(side: str = "right"):
    return lambda items: collate([it["row"] for it in items], side)


def tiny_neox(seed: int = 0, dtype: torch.dtype = torch.float64):
    """A 2-layer GPT-NeoX (Pythia's architecture: rotary positions, parallel residual) of width 16 from a config.

    Not Qwen2 or Llama: their RMSNorm computes in float32 whatever the model's dtype, so a float64 model
    is float64 only outside it, and a sum-then-rescale step (StepDriver, Accelerate, Lightning) differs
    from a loss divided before the backward by float32 rounding (1.2e-7 measured on a tiny Qwen2, where
    GPT-NeoX gives 2.7e-16): not what a float64 exactness test can hold to 1e-10."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=ic.VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, max_position_embeddings=128, rotary_pct=0.5, hidden_dropout=0.0,
                           attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(config).to(dtype)


def lm_loss_sum(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits
    return causal_lm_loss_sum(logits, batch["labels"])


def reference_deltas(model, rows: list, lr: float, side: str = "right") -> list[torch.Tensor]:
    """Parameter change after one SGD step (lr) per window of :data:`WINDOW` rows, each window in one forward
    (a window without any target takes no step)."""
    start = [p.detach().clone() for p in model.parameters()]
    for s in range(0, len(rows), WINDOW):
        model.zero_grad(set_to_none=True)
        loss_sum, count = lm_loss_sum(model, collate(rows[s:s + WINDOW], side))
        if int(count) == 0:
            continue
        (loss_sum / count).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(lr * p.grad)
    model.zero_grad(set_to_none=True)
    return [p.detach() - s for p, s in zip(model.parameters(), start)]


def my_micro_batches(rows: list, rank: int, side: str = "right") -> list[dict]:
    """This rank's micro-batches, dealt as Accelerate deals a sequential sampler's batches."""
    batches = [rows[s:s + MICRO] for s in range(0, len(rows), MICRO)]
    return [collate(b, side) for b in batches[rank::WORLD]]
