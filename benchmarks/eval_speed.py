"""The held-out evaluation of a sweep trial: the lab's ``evaluate`` against the way it was read before, same run.

Before: every evaluation collated its held-out documents again and ran them in forwards of the grid's
``eval_batch`` (256 samples for the demo), each transformer block allocating its GELU output and residual sum.
Now (:func:`globalbatch.lab.loop.evaluate`): the task keeps its collated held-out batches, on a CPU a token
task's forwards take at most ``EVAL_CPU_TOKENS`` (4,096) token slots (64 documents of the demo tinygpt), and
under ``torch.inference_mode`` the block computes its GELU and residual sum in place. Both read the same
documents with the same model and must give the same loss to float32 rounding (checked here and in
``tests/test_loop.py``). The old way runs under ``torch.no_grad``, which takes the block's out-of-place path.

Both are timed on the same model in alternation (a seeded random order within each pair), one intra-op
thread like a sweep worker; reported: the median seconds per evaluation and the median of the per-pair
ratios (old / new) with a bootstrap 95 % interval, for wall-clock and for process CPU time, and the minor page
faults per evaluation (glibc maps the old 16 MB logits afresh and trims them off the heap when freed, so they fault
their pages in at every evaluation, and the training steps after them too). ``--trial BATCH`` then runs a whole
demo trial with each evaluation and compares their CPU time and records.

    python benchmarks/eval_speed.py                  # the demo tinygpt, 512 documents, eval_batch 256: ~1 min
    python benchmarks/eval_speed.py --pairs 0 --trial 8 --trial-pairs 2    # two demo trials each way: ~1 min
    python benchmarks/eval_speed.py --task-arg d_model=128 --task-arg seq_len=128 --eval-batch 64
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time
from typing import Any

import torch

from globalbatch.lab.loop import EVAL_CPU_TOKENS, eval_micro_batch, evaluate
from globalbatch.lab.sweep import demo_config
from globalbatch.lab.tasks import load_task
from globalbatch.lab.tasks.base import val_order


def old_evaluate(task: Any, model: torch.nn.Module, max_samples: int, eval_batch: int) -> float:
    """The evaluation as it was: held-out documents collated at every call, forwards of ``eval_batch`` samples."""
    total = torch.zeros((), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    order = val_order(task.num_val_samples)[:max_samples]
    model.eval()
    with torch.no_grad():  # not inference mode: the blocks' out-of-place GELU and residual sum, as before
        for s in range(0, len(order), eval_batch):
            ix = order[s:s + eval_batch]
            batch = task._collate(task.val_offsets[ix], task.val_lengths[ix], None)
            loss_sum, n = task.loss_sum(model, batch)
            total += loss_sum.double()
            count += n.double()
    model.train()
    return float(total / count)


def paired_ratio(a: list[float], b: list[float], rng: random.Random, reps: int = 2000) -> tuple[float, float, float]:
    """Median of a_i / b_i with a bootstrap 95 % interval."""
    ratios = [x / y for x, y in zip(a, b)]
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(reps))
    return statistics.median(ratios), boot[int(0.025 * reps)], boot[int(0.975 * reps)]


def timed(fn) -> tuple[float, float, int, float]:
    """(wall s, process CPU s, minor page faults, value) of one call."""
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0, t0 = time.process_time(), time.perf_counter()
    value = fn()
    t1, c1 = time.perf_counter(), time.process_time()
    return t1 - t0, c1 - c0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, value


def compare(task: Any, model: torch.nn.Module, args: argparse.Namespace, label: str, rng: random.Random) -> None:
    ways = {"old": lambda: old_evaluate(task, model, args.val_samples, args.eval_batch),
            "new": lambda: evaluate(task, model, args.val_samples, eval_batch=args.eval_batch)}
    for fn in ways.values():  # warm-up: first-call costs (and the task's collation, once) are not timed
        fn()
    runs: dict[str, list[tuple[float, float, int, float]]] = {k: [] for k in ways}
    for _ in range(args.pairs):
        names = list(ways)
        rng.shuffle(names)
        for k in names:
            runs[k].append(timed(ways[k]))
    old, new = runs["old"], runs["new"]
    values = {k: v[0][3] for k, v in runs.items()}
    rel = abs(values["new"] - values["old"]) / abs(values["old"])
    print(f"\n{label}: {args.pairs} pairs; loss old {values['old']:.10f}, new {values['new']:.10f} "
          f"(|rel diff| {rel:.1e})")
    for i, what in ((0, "wall"), (1, "CPU")):
        r, lo, hi = paired_ratio([x[i] for x in old], [x[i] for x in new], rng)
        print(f"  {what:>4}: old {statistics.median(x[i] for x in old):.4f} s, new "
              f"{statistics.median(x[i] for x in new):.4f} s per evaluation; old/new {r:.2f}x [{lo:.2f}, {hi:.2f}]")
    print(f"  minor page faults per evaluation: old {statistics.median(x[2] for x in old):,.0f}, "
          f"new {statistics.median(x[2] for x in new):,.0f}")


def trial_ab(args: argparse.Namespace, rng: random.Random) -> None:
    """One demo trial (``--trial BATCH``, the demo's middle LR, seed 0) with the old evaluation and with the new, in
    alternation; each run's process CPU time (user + system), minor faults and its records' train and eval seconds.
    The training records must be identical and the held-out losses equal to float32 rounding."""
    import dataclasses
    import json
    import tempfile
    from pathlib import Path
    from unittest import mock

    import globalbatch.lab.loop as loop
    from globalbatch.lab.sweep.config import TrialSpec
    from globalbatch.lab.sweep.trial import run_trial

    cfg = demo_config()
    spec = TrialSpec(batch=args.trial, lr=cfg.lrs_for(args.trial)[1], seed=0)

    def old_loop_evaluate(task, model, max_samples, *, device=None, precision=None, eval_batch=loop.EVAL_BATCH):
        return old_evaluate(task, model, max_samples, eval_batch)

    def run(way: str) -> tuple[float, float, int, dict, list[dict]]:
        with tempfile.TemporaryDirectory() as out:
            patch = mock.patch.object(loop, "evaluate", old_loop_evaluate) if way == "old" else mock.patch.object(
                loop, "evaluate", loop.evaluate)
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            with patch:
                summary = run_trial(dataclasses.asdict(cfg), dataclasses.asdict(spec), out, threads=args.threads)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            lines = (Path(out) / "trials" / spec.name / "metrics.jsonl").read_text().splitlines()
        recs = [json.loads(x) for x in lines if '"kind": "header"' not in x]
        return (r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt, summary, recs)

    load_task(cfg.task, **cfg.task_overrides)  # the corpus is read once, outside the timed runs
    print(f"\ntrial {spec.name}, {args.threads} thread(s), {args.trial_pairs} pairs (old, new):")
    results: dict[str, list] = {"old": [], "new": []}
    for _ in range(args.trial_pairs):
        ways = ["old", "new"]
        rng.shuffle(ways)
        for way in ways:
            user, sys_s, faults, s, recs = run(way)
            results[way].append(recs)
            print(f"  {way}: CPU user {user:6.2f} s + system {sys_s:5.2f} s, {faults:>9,} minor faults; records: "
                  f"train {s['train_time_s']:.2f} s, eval {s['eval_time_s']:.2f} s")
    old, new = results["old"][0], results["new"][0]
    steps = [(a["loss"], b["loss"]) for a, b in zip(old, new) if a["kind"] == "step"]
    vals = [(a["val_loss"], b["val_loss"]) for a, b in zip(old, new) if "val_loss" in a]
    worst = max(abs(b - a) / abs(a) for a, b in vals)
    print(f"  training losses identical at all {len(steps)} steps: {all(a == b for a, b in steps)}; "
          f"{len(vals)} held-out losses, largest |rel diff| {worst:.1e}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=15, help="timed (old, new) pairs")
    ap.add_argument("--val-samples", type=int, default=512, help="held-out documents per evaluation (the demo's)")
    ap.add_argument("--eval-batch", type=int, default=256, help="the grid's eval_batch (the demo's: 256)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (a demo worker has 1)")
    ap.add_argument("--task-arg", action="append", default=[], metavar="K=V",
                    help="tinygpt override on top of the demo's model (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trial", type=int, default=None, metavar="BATCH",
                    help="then a whole demo trial of this batch, old and new evaluation (e.g. 8: ~15 s each)")
    ap.add_argument("--trial-pairs", type=int, default=2, help="(old, new) pairs of --trial")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = dict(demo_config().task_overrides)
    for kv in args.task_arg:
        k, _, v = kv.partition("=")
        overrides[k] = int(v)
    task = load_task("tinygpt", **overrides)
    model = task.build_model(args.seed)
    print(f"tinygpt {overrides}; {args.val_samples} held-out documents; eval_batch {args.eval_batch} -> "
          f"{eval_micro_batch(task, args.eval_batch, 'cpu')} per CPU forward (EVAL_CPU_TOKENS {EVAL_CPU_TOKENS}); "
          f"{torch.get_num_threads()} thread(s)")
    rng = random.Random(args.seed)
    if args.pairs:
        compare(task, model, args, "held-out evaluation", rng)
    if args.trial is not None:
        trial_ab(args, rng)


if __name__ == "__main__":
    main()
