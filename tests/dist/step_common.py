"""Shared fixtures of the step tests: a tiny causal LM on ragged, padded token sequences.

Used by ``tests/test_step.py`` (single process) and ``tests/dist/step_equivalence_script.py``
(torchrun, 2 gloo ranks). The model is causal (a running mean over positions), so right
padding never changes the outputs at real positions: a micro-batch padded to its own
longest sequence gives the same per-token losses as the whole batch padded to the
global longest, and the only difference between accumulation schemes is normalization.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100
VOCAB = 13


class TinyLM(nn.Module):
    """Embedding → tanh(Linear) → causal running mean → Linear to logits."""

    def __init__(self, vocab: int = VOCAB, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab)

    def forward(self, ids_bt: torch.Tensor) -> torch.Tensor:
        h_btd = torch.tanh(self.mix(self.emb(ids_bt)))
        steps_t = torch.arange(1, ids_bt.shape[1] + 1, device=ids_bt.device, dtype=h_btd.dtype)
        h_btd = h_btd.cumsum(1) / steps_t[None, :, None]  # causal: position t sees 0..t only
        return self.out(h_btd)


def build_model(seed: int = 0, dtype: torch.dtype = torch.float64) -> TinyLM:
    g = torch.Generator().manual_seed(seed)
    model = TinyLM()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.to(dtype)


def make_sequences(n: int, *, max_len: int = 12, seed: int = 0) -> list[torch.Tensor]:
    """``n`` token sequences with lengths 2..max_len+1 (very ragged), seeded."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, max_len + 2, (n,), generator=g)
    # make the raggedness extreme: every 4th sequence is short
    lengths[::4] = 2
    return [torch.randint(0, VOCAB, (int(L),), generator=g) for L in lengths]


def collate(seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence of *this* batch; labels are -100 at padding."""
    width = max(len(s) for s in seqs)
    rows = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width - 1), IGNORE, dtype=torch.long)
    for r, s in enumerate(seqs):
        rows[r, : len(s)] = s
        labels[r, : len(s) - 1] = s[1:]
    return {"input_ids": rows[:, :-1], "labels": labels}


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross entropy and its count of non-padding labels."""
    logits = model(batch["input_ids"])
    labels = batch["labels"]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return loss, (labels != IGNORE).sum()


def chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def full_batch_grads(model: nn.Module, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """∇ of the token-mean loss over all ``seqs`` in one forward (the ground truth)."""
    model.zero_grad(set_to_none=True)
    loss, count = loss_fn(model, collate(seqs))
    (loss / count).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def reference_step(model: nn.Module, opt: torch.optim.Optimizer, seqs: list[torch.Tensor],
                   max_grad_norm: float | None) -> list[torch.Tensor]:
    """One optimizer step on the whole global batch; returns the pre-clip gradients."""
    model.zero_grad(set_to_none=True)
    loss, count = loss_fn(model, collate(seqs))
    (loss / count).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_grad_norm, foreach=True)
    opt.step()
    model.zero_grad(set_to_none=True)
    return grads


def naive_grads(model: nn.Module, micro_batches: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The mean of per-micro-batch token means (what ``loss.mean() / accum`` computes)."""
    model.zero_grad(set_to_none=True)
    for mb in micro_batches:
        loss, count = loss_fn(model, collate(mb))
        (loss / count / len(micro_batches)).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = max(float((x - y).abs().max()) for x, y in zip(a, b))
    den = max(float(y.abs().max()) for y in b)
    return num / den


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def clone_model_opt(model: nn.Module, lr: float = 1e-2, weight_decay: float = 0.1):
    m = copy.deepcopy(model)
    return m, torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=weight_decay)


def optimizer_state_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if sa["param_groups"] != sb["param_groups"] or sa["state"].keys() != sb["state"].keys():
        return False
    for k in sa["state"]:
        if sa["state"][k].keys() != sb["state"][k].keys():
            return False
        for name, v in sa["state"][k].items():
            w = sb["state"][k][name]
            if isinstance(v, torch.Tensor):
                if not torch.equal(v, w):
                    return False
            elif v != w:
                return False
    return True


class GradProbe:
    """Callback that records ``.grad`` at each hook (clones)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.micro: list[list[torch.Tensor]] = []
        self.window: list[list[torch.Tensor]] = []
        self.counts: list[tuple[float, float]] = []

    def on_micro_backward(self, driver, micro_index, local_count):
        self.micro.append([p.grad.detach().clone() for p in self.params])

    def on_window_end(self, driver, global_count, local_window_count):
        self.window.append([p.grad.detach().clone() for p in self.params])
        self.counts.append((float(global_count), float(local_window_count)))


def micro_batches(seqs: list[torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """Split into micro-batches of ``size`` (the last may be short), each padded on its own."""
    return [collate(c) for c in chunks(seqs, size)]


def samples_of(mbs: list[dict[str, torch.Tensor]]) -> list[int]:
    return [int(mb["input_ids"].shape[0]) for mb in mbs]
