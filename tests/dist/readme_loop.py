"""The README's loop, run as written there, under torchrun with 2 gloo ranks (launched by tests/test_step_readme.py).

The ```python block of README.md that calls ``gb.rank_windows`` is extracted and executed with the names it
leaves to the user: ``model`` (a DDP causal LM, float64), ``opt`` (AdamW), ``documents`` (ragged token
sequences, the same on every rank), ``collate`` (pads a micro-batch on its own, Hugging Face labels) and
``CKPT``. It runs three times:

1. on the first 32 documents (2 windows of 16), saving its checkpoint at the end;
2. on all 37 documents with a freshly initialized model: it resumes from the checkpoint and trains the
   short last window (5 documents: 3 on rank 0, 2 on rank 1);
3. on all 37 documents from scratch, uninterrupted.

Then ``BEFORE``, the same loop written with the API before (cut by hand, the old checkpoint signatures, the
monitor's state by hand), runs on full windows and is checked the same way; both loops' glue lines are counted
by one rule (``GLUE before=… after=…``).

The same windows and loss also run under FSDP2 (``fully_shard``), short last window included (both ranks
run two micro-steps), against the same reference.

Checks (rank 0 prints ``PASS <name>``; any failure raises): the block names globalbatch on at most 8 lines;
the resumed run's parameters equal one process taking each global batch in one forward (AdamW, clipping)
to 1e-10 in float64; the naive mean of micro-batch means on the same cut is measurably off (> 1e-3);
resumed and uninterrupted runs are bitwise equal, noise estimate included; the batch arithmetic was printed.
Argument 1: a scratch directory. Prints ``NUMBERS ...`` with the measured differences.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
import step_common as sc  # noqa: E402

from globalbatch.windows import cut_window  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"
RANK = 0

BEFORE = """
import itertools
import os
import torch.distributed as dist
from globalbatch import NoiseScaleMonitor, StepConfig, StepDriver
from globalbatch.checkpoint import load_checkpoint, save_checkpoint
from globalbatch.losses import causal_lm_loss_sum

monitor = NoiseScaleMonitor(model, optimizer=opt)
driver = StepDriver(model, opt, StepConfig(micro_batch=2, global_batch=16, max_grad_norm=1.0), callbacks=[monitor])
if os.path.exists(CKPT):
    extra = load_checkpoint(CKPT, model, opt, driver)
    monitor.load_state_dict(extra["noise"])
order = itertools.islice(iter(documents), driver.consumed_samples, None)
rank = dist.get_rank()
while window := list(itertools.islice(order, driver.global_batch)):
    g = driver.geometry
    per_rank = g.micro_batch * g.grad_accum_steps
    mine = window[rank * per_rank:(rank + 1) * per_rank]
    micro = [mine[i:i + g.micro_batch] for i in range(0, len(mine), g.micro_batch)]
    for i, docs in enumerate(micro):
        batch = collate(docs)
        with driver.micro_step(last=i == len(micro) - 1):
            loss_sum, count = causal_lm_loss_sum(model(batch["input_ids"]), batch["labels"])
            driver.backward(loss_sum, count, samples=len(docs))
    driver.step()
save_checkpoint(CKPT, model, opt, driver, extra={"noise": monitor.state_dict()})
print(monitor.estimate())
"""
"""The same loop with the API before ``rank_windows``, ``causal_lm_loss`` and checkpoints from the driver (it still
runs: the old forms warn). Its cut leaves a rank empty on a short last window (a hang under DDP), so it runs on
full windows only."""


def glue_lines(code: str) -> list[str]:
    """The lines that name a globalbatch API: ``globalbatch``, a name imported from it (``gb`` included), or an
    attribute of an object it gave (``driver.``, ``monitor.``, the geometry ``g.``)."""
    names = {"gb", "driver", "monitor", "g"}
    for m in re.finditer(r"^from globalbatch[\w.]* import (.+)$", code, flags=re.M):
        names.update(n.strip() for n in m.group(1).split(","))
    pattern = re.compile(r"globalbatch|\b(?:" + "|".join(sorted(names)) + r")\b(?!\s*=[^=])")
    return [line for line in code.splitlines() if pattern.search(line.split("#")[0])]


def readme_loop() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```[ \t]*$", README.read_text(), flags=re.M | re.S)
    found = [b for b in blocks if "gb.rank_windows(" in b]
    if len(found) != 1:
        raise AssertionError(f"README.md has {len(found)} python blocks calling gb.rank_windows; expected 1")
    return found[0]


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(f"rank {RANK}: {msg}")


def collate(docs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pad to this micro-batch's longest document; Hugging Face labels (= input_ids, -100 at padding)."""
    width = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    labels = torch.full((len(docs), width), -100, dtype=torch.long)
    for r, d in enumerate(docs):
        ids[r, :len(d)] = d
        labels[r, :len(d)] = d
    return {"input_ids": ids, "labels": labels}


def summed_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's own loss (not globalbatch's): next-token cross entropy, summed, and its targets."""
    logits = model(batch["input_ids"])[:, :-1]
    targets = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                           reduction="sum")
    return loss, (targets != -100).sum()


def grads_of(model: torch.nn.Module) -> list[torch.Tensor]:
    out = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def reference(base: torch.nn.Module, windows: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """One process, each global batch in one forward (AdamW, clipping at 1): the parameters after them."""
    ref, ref_opt = sc.clone_model_opt(base)
    for w in windows:
        loss, count = summed_loss(ref, collate(w))
        (loss / count).backward()
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0, foreach=True)
        ref_opt.step()
        ref.zero_grad(set_to_none=True)
    return [p.detach() for p in ref.parameters()]


def max_abs(a, b) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a, b))


def fsdp2_params(base: torch.nn.Module, documents: list) -> list[torch.Tensor]:
    """The README's windows and loss under FSDP2 (fully_shard; no checkpoint: FSDP2's is torch.distributed.checkpoint)."""
    import globalbatch as gb
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    for sub in (model.emb, model.mix, model.out):
        fully_shard(sub)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    driver = gb.StepDriver(model, opt, gb.StepConfig(micro_batch=2, global_batch=16, max_grad_norm=1.0,
                                                     print_geometry=False))
    check(driver.parallel == "fsdp2", driver.parallel)
    for window in gb.rank_windows(documents, driver, collate=collate):
        driver.run_window(window, gb.causal_lm_loss)  # the short last window: 2 micro-steps on both ranks
    return [p.full_tensor().detach() for p in model.parameters()]


def run_block(code: str, model: torch.nn.Module, documents: list, ckpt: Path) -> dict:
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    namespace = {"__name__": "readme_loop", "model": ddp, "opt": opt, "documents": documents, "collate": collate,
                 "CKPT": str(ckpt)}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - the README's own block, test only
    return namespace


def main() -> None:
    global RANK
    dist.init_process_group("gloo")
    RANK = dist.get_rank()
    scratch = Path(sys.argv[1])
    code = readme_loop()
    glue = glue_lines(code)
    check(len(glue) <= 8, f"the README loop names globalbatch on {len(glue)} lines (> 8): {glue}")
    before = glue_lines(BEFORE)
    if RANK == 0:
        print(f"GLUE before={len(before)} after={len(glue)} (imports: {sum(x.startswith(('from ', 'import ')) for x in before)} "
              f"and {sum(x.startswith(('from ', 'import ')) for x in glue)})", flush=True)
        print(f"PASS glue-lines {len(glue)}", flush=True)

    torch.manual_seed(0)
    base = sc.build_model(seed=0, dtype=torch.float64)
    documents = sc.make_sequences(37, max_len=12, seed=3)
    ckpt = scratch / "readme.pt"

    # 1. two windows, checkpoint at the end; 2. resumed with another model's initial weights, the short last window
    first = run_block(code, copy.deepcopy(base), documents[:32], ckpt)
    check(first["driver"].optimizer_steps == 2 and first["driver"].consumed_samples == 32, "first run: 2 steps")
    resumed = run_block(code, sc.build_model(seed=99, dtype=torch.float64), documents, ckpt)
    drv = resumed["driver"]
    check(drv.optimizer_steps == 3 and drv.consumed_samples == 37 and drv.skipped_windows == 0,
          f"resumed run: {drv.optimizer_steps} steps, {drv.consumed_samples} samples")

    # the reference: one process, each global batch in one forward (same AdamW, same clipping)
    windows = [documents[0:16], documents[16:32], documents[32:37]]
    ours = [p.detach() for p in resumed["model"].module.parameters()]
    param_diff = max_abs(ours, reference(base, windows))
    check(param_diff <= 1e-10, f"README loop vs full batch: max |Δparam| {param_diff:.3e} > 1e-10")

    fsdp2_diff = max_abs(fsdp2_params(base, documents), reference(base, windows))
    check(fsdp2_diff <= 1e-10, f"FSDP2 windows vs full batch: max |Δparam| {fsdp2_diff:.3e} > 1e-10")
    if RANK == 0:
        print(f"PASS fsdp2-windows-exact {fsdp2_diff:.3e}", flush=True)

    # the naive mean of micro-batch means on the README's own cut (every rank's micro-batches of window 1)
    probe = copy.deepcopy(base)
    loss, count = summed_loss(probe, collate(windows[0]))
    (loss / count).backward()
    exact = grads_of(probe)
    micros = [m for r in range(2) for m in cut_window(windows[0], 2, 2, r)]
    for m in micros:
        loss, count = summed_loss(probe, collate(m))
        (loss / count / len(micros)).backward()
    naive = grads_of(probe)
    naive_gap = sc.max_rel_diff(naive, exact)
    check(naive_gap > 1e-3, f"naive mean-of-means gap {naive_gap:.3e} is not > 1e-3: the data is not ragged enough")

    # 3. uninterrupted: bitwise the same parameters and the same noise estimate as the resumed run
    whole = run_block(code, copy.deepcopy(base), documents, scratch / f"never-{RANK}.pt")
    same = all(torch.equal(p, q) for p, q in zip(ours, whole["model"].module.parameters()))
    check(same, "resumed and uninterrupted parameters differ")
    est_resumed, est_whole = resumed["monitor"].estimate(), whole["monitor"].estimate()
    check(est_whole.windows == 3 and est_resumed.windows == est_whole.windows,
          f"monitor windows {est_resumed.windows} resumed vs {est_whole.windows} uninterrupted")
    check(est_resumed.b_simple == est_whole.b_simple, f"B_simple {est_resumed.b_simple} resumed vs {est_whole.b_simple}")
    # the loop before: the same result on full windows (its cut leaves a rank empty on a short one), old API
    run_block(BEFORE, copy.deepcopy(base), documents[:16], scratch / "before.pt")
    old = run_block(BEFORE, sc.build_model(seed=98, dtype=torch.float64), documents[:32], scratch / "before.pt")
    before_diff = max_abs(old["model"].module.parameters(), reference(base, windows[:2]))
    check(before_diff <= 1e-10, f"the loop before vs full batch: max |Δparam| {before_diff:.3e}")
    check(old["monitor"].estimate().windows == 2, "the loop before: monitor state not restored")
    if RANK == 0:
        print(f"PASS before-loop-exact {before_diff:.3e}", flush=True)
        print(f"NUMBERS max_abs_param_diff={param_diff:.3e} before_loop_diff={before_diff:.3e} naive_rel_gap={naive_gap:.3e} "
              f"b_simple={est_whole.b_simple:.6g} windows={est_whole.windows}", flush=True)
        print("PASS readme-loop-exact", flush=True)
        print("PASS readme-loop-naive-gap", flush=True)
        print("PASS readme-loop-resume-bitwise", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
