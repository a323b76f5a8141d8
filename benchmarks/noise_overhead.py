"""Overhead of the online noise-scale monitor (small MLPs and tinygpt), and a per-example baseline.

One run measures, on the same batches:

0. Small models (one process, 1 thread): MLPs 64-64-32-10 (6.6k parameters), 64-256-256-10 (85k)
   and 64-512-512-10 (301k) at micro 32 × accum 8, the last also with ``every=4``, with the cost
   budget (``NoiseConfig(budget=0.02)``: the monitor picks ``every`` from the cost it measures) and at
   micro 128 × accum 4 — where a fixed cost per micro-batch shows most. With ``--budget-rows`` tinygpt runs
   with every window and with the budget, both reading the plain mean of their measured windows
   (``half_life=math.inf``), and prints each arm's B_simple with its interval and windows. The "floor" row runs,
   instead of the monitor, bare hooks that only read each incoming gradient's norm once: what any
   per-micro-batch estimator must pay, without its bookkeeping. Budget rows print the windows the
   monitor measured, the ``every`` it chose and the cost it measured of itself.
1. Accumulation path (one process): step time of StepDriver training with and without
   NoiseScaleMonitor (micro source: one snapshot copy + difference norms per micro-batch).
2. DDP path (torchrun, 2 gloo ranks, launched from this script): the same with the DDP
   comm hook (micro + rank sources) against plain DDP.
3. Per-example estimator (B_small = 1 sample, brute force with torch.func vmap(grad))
   on the same windows: its time per window, and the error of both estimators against
   the truth at fixed parameters (per-example gradients of a fixed pool of full-length
   samples, windows drawn from the pool with replacement).

Timing: baseline (A) and monitored (B) models train the same batches, interleaved
ABBA step by step so that machine load hits both alike; the ratio is the median of the
per-step ratios B/A. Usage::

    python benchmarks/noise_overhead.py              # ~5-8 min on 2 CPU cores
    python benchmarks/noise_overhead.py --quick      # fewer steps
    python benchmarks/noise_overhead.py --only mlp   # the small-model table only (~2 min)
    python benchmarks/noise_overhead.py --only mlp,tinygpt --budget-rows --threads 0   # the budget rows,
        # beside every=1 and the floor, with torch's default threads (--threads 1: one thread)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from globalbatch.noise import NoiseConfig, NoiseScaleEstimator, NoiseScaleMonitor
from globalbatch.step import StepConfig, StepDriver
from globalbatch.lab.tasks import load_task

MICRO, ACCUM = 8, 4


def _windows(task, n_windows: int, per_rank: int, seed: int, rank: int = 0, world: int = 1):
    order = task.sample_order(seed)
    out = []
    for _ in range(n_windows):
        micros = []
        for _ in range(ACCUM):
            draw = [next(order) for _ in range(per_rank * world)]
            micros.append(task.collate(draw[rank * per_rank:(rank + 1) * per_rank]))
        out.append(micros)
    return out


def _bare_norm_hooks(model) -> None:
    """The floor of any per-micro-batch estimator: each parameter's incoming gradient norm read once,
    in a hook, into a preallocated slot — no estimator, no bookkeeping."""
    buf = torch.zeros(4096)
    model._floor_slots = (buf.unbind(0), [0])
    views, at = model._floor_slots

    def hook(grad):
        torch.linalg.vector_norm(grad, out=views[at[0]])
        at[0] += 1

    for p in model.parameters():
        p.register_hook(hook)


class _SlotReset:
    def __init__(self, model):
        self.at = model._floor_slots[1]

    def on_window_end(self, driver, global_count, local_window_count):
        self.at[0] = 0


def _samples(batch) -> int:
    """The samples of a micro-batch: an MLP's (x, y) or a token task's dict."""
    return len(batch[1]) if isinstance(batch, tuple) else int(batch["input_ids"].shape[0])


def _train_window(driver, loss_sum, model, micros) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one window. On a machine shared with other
    jobs the process CPU time leaves out the time spent descheduled, so its ratio is less noisy."""
    t0, c0 = time.perf_counter(), time.process_time()
    for i, batch in enumerate(micros):
        with driver.micro_step(last=i == len(micros) - 1):
            driver.backward(*loss_sum(model, batch), samples=_samples(batch))
    driver.step()  # contains the step's one host sync, so the timing is complete
    return time.perf_counter() - t0, time.process_time() - c0


def ab_timing(loss_sum, make_model, windows, *, warmup: int, monitor_kwargs: dict, unit: str = "token",
              micro: int = MICRO) -> dict:
    """Median per-step ratio monitored/baseline, interleaved ABBA on the same batches."""
    drivers = []
    accum = len(windows[0])
    floor = monitor_kwargs.get("floor", False)
    for monitored in (False, True):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if monitored and floor:
            _bare_norm_hooks(model)
            cbs = [_SlotReset(model)]
        else:
            cbs = [NoiseScaleMonitor(model, optimizer=opt, unit=unit, **monitor_kwargs)] if monitored else []
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        drivers.append((StepDriver(model, opt, StepConfig(micro_batch=micro, global_batch=micro * accum * world),
                                   callbacks=cbs), model, cbs))
    times = {False: [], True: []}
    cpu = {False: [], True: []}
    for step, micros in enumerate(windows):
        order = (False, True) if step % 2 == 0 else (True, False)
        for monitored in order:
            driver, model, _ = drivers[monitored]
            dt, dc = _train_window(driver, loss_sum, model, micros)
            if step >= warmup:
                times[monitored].append(dt)
                cpu[monitored].append(dc)
    ratios = [b / a for a, b in zip(times[False], times[True])]
    cpu_ratios = [b / a for a, b in zip(cpu[False], cpu[True]) if a > 0]
    q = statistics.quantiles(ratios, n=4)
    mon = drivers[True][2][0]
    est = mon.estimate() if not floor else None
    cost = mon.cost().to_dict() if not floor else None
    return {"monitor_cost": cost, "base_s": statistics.median(times[False]), "monitored_s": statistics.median(times[True]),
            "ratio_median": statistics.median(ratios), "ratio_of_means": sum(times[True]) / sum(times[False]),
            "cpu_ratio_median": statistics.median(cpu_ratios), "ratio_iqr": [q[0], q[2]],
            "steps": len(ratios), "b_simple": est.b_simple if est else None,
            "b_simple_interval": [est.low, est.high] if est else None, "estimate_windows": est.windows if est else None,
            "estimate_flags": list(est.flags) if est else [],
            "trained_model": drivers[True][1]}


# ---------------------------------------------------------------------------
# Small models: where a fixed cost per micro-batch shows
# ---------------------------------------------------------------------------

MLP_CASES = (  # widths, micro, accum, every ("floor": bare in-hook norm reads instead of the monitor;
    # "budget": NoiseConfig(budget=--budget), every chosen by the monitor)
    ((64, 64, 32, 10), 32, 8, 1),
    ((64, 64, 32, 10), 32, 8, "budget"),
    ((64, 256, 256, 10), 32, 8, 1),
    ((64, 512, 512, 10), 32, 8, 1),
    ((64, 512, 512, 10), 32, 8, "floor"),
    ((64, 512, 512, 10), 32, 8, 4),
    ((64, 512, 512, 10), 32, 8, "budget"),
    ((64, 512, 512, 10), 128, 4, 1),
)
BUDGET_CASES = (  # --budget-rows: the 301k MLP's budget row beside every=1 and the floor
    ((64, 512, 512, 10), 32, 8, 1),
    ((64, 512, 512, 10), 32, 8, "floor"),
    ((64, 512, 512, 10), 32, 8, "budget"),
)


def _mlp(widths, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _mlp_loss_sum(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y, reduction="sum"), len(y)


def mlp_timing(widths, micro: int, accum: int, every: int | str, *, steps: int, warmup: int, seed: int,
               budget: float = 0.02) -> dict:
    """Noisy teacher-labelled data (64 features, 10 classes); the same windows for both arms."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8192, widths[0], generator=g)
    y = (x @ torch.randn(widths[0], widths[-1], generator=g) + 2.0 * torch.randn(8192, widths[-1], generator=g)).argmax(1)
    windows = []
    for _ in range(steps + warmup):
        idx = torch.randint(0, len(x), (accum, micro), generator=g)
        windows.append([(x[i], y[i]) for i in idx])
    kwargs = ({"floor": True} if every == "floor" else {"config": NoiseConfig(budget=budget)} if every == "budget"
              else {"config": NoiseConfig(every=every)})
    res = ab_timing(_mlp_loss_sum, lambda: _mlp(widths, seed), windows, warmup=warmup, unit="sample", micro=micro,
                    monitor_kwargs=kwargs)
    res.pop("trained_model")
    res["params"] = sum(p.numel() for p in _mlp(widths, seed).parameters())
    return res


def _cost_text(cost: dict | None) -> str:
    """The windows the monitor measured and the cost it measured of itself."""
    if not cost:
        return ""
    changes = " → ".join(str(n) for _, n in cost["every_changes"]) or "none"
    text = (f"\n      monitor: {cost['windows_measured']:,} of {cost['windows']:,} windows measured, every "
            f"{cost['every']} (changes: {changes}); its own cost {cost['fraction']:.2%} of the bare step in its timed "
            "regions" + (f" over all windows, {cost['fraction_now']:.2%} at the last every" if cost.get("budget") else ""))
    if cost.get("budget") and not math.isnan(cost.get("fraction_all", math.nan)):
        text += (f"\n      by the windows' spans: a measured window {cost['wall_extra_s'] * 1e6:,.0f} µs longer than one "
                 f"left out ({cost['timed_window_s'] * 1e6:,.0f} µs timed); cost over all windows "
                 f"{cost['fraction_all']:.2%}; {len(cost['left_out_at_every_1'])} window(s) left out at every 1")
    return text


def _estimate_text(res: dict) -> str:
    """The estimate the monitored arm read: B_simple with its interval, over the windows it measured."""
    lo, hi = res["b_simple_interval"]
    flags = ", ".join(res["estimate_flags"]) or "none"
    return (f"\n      B_simple {res['b_simple']:,.4g} [{lo:,.4g}, {hi:,.4g}] over {res['estimate_windows']} measured windows "
            f"(flags: {flags})")


def _threads_text(args) -> str:
    return f"{torch.get_num_threads()} thread(s)" + (" (torch's default)" if args.threads == 0 else "")


def run_mlp_table(args) -> list[dict]:
    rows = []
    print(f"small models ({_threads_text(args)}, {args.mlp_steps} timed steps per arm, interleaved ABBA; "
          "ratio = median of per-step ratios monitored/plain):")
    for widths, micro, accum, every in (BUDGET_CASES if args.budget_rows else MLP_CASES):
        r = mlp_timing(widths, micro, accum, every, steps=args.mlp_steps, warmup=10, seed=args.seed, budget=args.budget)
        r.update(model="mlp " + "-".join(map(str, widths)), micro=micro, accum=accum, every=every)
        rows.append(r)
        what = ("floor  " if every == "floor" else f"budget {args.budget:g}" if every == "budget" else f"every={every}")
        print(f"  {r['model']:<18} {r['params']:>8,} params  micro {micro:>3} × accum {accum}  {what}:  "
              f"base {r['base_s'] * 1e3:6.2f} ms/step  ratio {r['ratio_median']:.3f} (IQR {r['ratio_iqr'][0]:.3f}–"
              f"{r['ratio_iqr'][1]:.3f}; ratio of means {r['ratio_of_means']:.3f}; CPU-time ratio "
              f"{r['cpu_ratio_median']:.3f})" + _cost_text(r["monitor_cost"]), flush=True)
    return rows


# ---------------------------------------------------------------------------
# Per-example gradients (the brute-force estimator and the truth)
# ---------------------------------------------------------------------------


def per_example_sq_and_sum(task, model, batch, chunk: int = 8):
    """Per-sample token-mean gradients: their squared norms (n,) and their sum (flat float64)."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, ids, labels):
        out = functional_call(model, p, (ids[None],))
        loss, count = task.loss_sum(_Wrap(out), {"input_ids": ids[None], "labels": labels[None]})
        return loss / count

    g = vmap(grad(one), in_dims=(None, 0, 0))
    sqs, total = [], None
    for s in range(0, batch["input_ids"].shape[0], chunk):
        grads = g(params, batch["input_ids"][s:s + chunk], batch["labels"][s:s + chunk])
        flat = torch.cat([grads[k].reshape(grads[k].shape[0], -1) for k in params], 1).double()
        sqs.append(flat.square().sum(1))
        part = flat.sum(0)
        total = part if total is None else total + part
    return torch.cat(sqs), total


class _Wrap(torch.nn.Module):
    """Lets task.loss_sum(model, batch) run on precomputed logits."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, _ids):
        return self.logits


def full_length_pool(task, size: int, seed: int) -> list[int]:
    """Training indices whose document fills the context: every sample has seq_len loss tokens."""
    order = task.sample_order(seed)
    pool = []
    while len(pool) < size:
        i = next(order)
        if int(task.train_lengths[i]) == task.seq_len + 1:
            pool.append(i)
    return pool


def accuracy_vs_truth(task, model, n_windows: int, pool_size: int, seed: int) -> dict:
    """B_simple in samples at fixed parameters: micro-source vs per-example, both against the truth."""
    model = copy.deepcopy(model).eval()  # no dropout in TinyGPT; eval() only for clarity
    pool = full_length_pool(task, pool_size, seed)
    t0 = time.perf_counter()
    sq_sum, g_sum = 0.0, None
    for s in range(0, len(pool), 32):
        sq, tot = per_example_sq_and_sum(task, model, task.collate(pool[s:s + 32]))
        sq_sum += float(sq.sum())
        g_sum = tot if g_sum is None else g_sum + tot
    g_sq_true = float((g_sum / len(pool)).square().sum())
    tr_true = sq_sum / len(pool) - g_sq_true
    truth = tr_true / g_sq_true
    truth_s = time.perf_counter() - t0

    gen = torch.Generator().manual_seed(seed + 1)
    mon_model = copy.deepcopy(model)
    mon = NoiseScaleMonitor(mon_model, unit="sample", config=NoiseConfig(half_life=math.inf))
    pe = NoiseScaleEstimator(unit="sample", half_life=math.inf)
    t_step, t_pe = [], []
    for _ in range(n_windows):
        micros = [task.collate([pool[int(j)] for j in torch.randint(0, len(pool), (MICRO,), generator=gen)])
                  for _ in range(ACCUM)]
        t0 = time.perf_counter()
        for i, batch in enumerate(micros):
            loss, count = task.loss_sum(mon_model, batch)
            (loss * MICRO / count).backward()  # every sample has seq_len tokens: Δ.grad = MICRO·(sample mean)
            mon.micro_backward(MICRO)
        for p in mon_model.parameters():
            p.grad /= MICRO * ACCUM
        mon.window_end()
        mon_model.zero_grad(set_to_none=True)
        t_step.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sqs, total = [], None
        for batch in micros:
            sq, tot = per_example_sq_and_sum(task, model, batch)
            sqs.append(sq)
            total = tot if total is None else total + tot
        sq_all = torch.cat(sqs)
        pe.update(sq_all, torch.ones_like(sq_all), (total / len(sq_all)).square().sum())
        t_pe.append(time.perf_counter() - t0)
    out = {"truth_b_simple_samples": truth, "truth_tr_sigma": tr_true, "truth_g_sq": g_sq_true,
           "truth_pool": len(pool), "truth_s": truth_s, "windows": n_windows}
    for name, e, t in (("micro", mon.estimate(), t_step), ("per_example", pe.estimate(), t_pe)):
        out[name] = {"b_simple_samples": e.b_simple, "stderr": e.stderr, "low": e.low, "high": e.high,
                     "rel_error": e.b_simple / truth - 1, "z": (e.b_simple - truth) / e.stderr,
                     "window_s": statistics.median(t), "flags": list(e.flags)}
    return out


# ---------------------------------------------------------------------------
# DDP worker (torchrun)
# ---------------------------------------------------------------------------


def ddp_worker(args) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    task = load_task("tinygpt", **json.loads(args.task_overrides))
    windows = _windows(task, args.steps + args.warmup, MICRO, args.seed, rank, world)
    res = ab_timing(task.loss_sum, lambda: DDP(task.build_model(args.seed)), windows, warmup=args.warmup,
                    monitor_kwargs={"config": NoiseConfig(sources=("micro", "rank"))})
    res.pop("trained_model")
    if rank == 0:
        print("DDP_RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()


def run_ddp(args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           "--ddp-worker", "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
           "--task-overrides", args.task_overrides]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("DDP_RESULT "):
            return json.loads(line[len("DDP_RESULT "):])
    raise RuntimeError(f"DDP worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="timed tinygpt steps per arm (after warm-up)")
    ap.add_argument("--mlp-steps", type=int, default=300, help="timed steps per arm of each small-model case")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--accuracy-windows", type=int, default=30)
    ap.add_argument("--pool", type=int, default=256, help="full-length samples defining the truth")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads of the single-process runs (0: torch's default, all cores)")
    ap.add_argument("--budget", type=float, default=0.02, help="the budget rows' NoiseConfig(budget=)")
    ap.add_argument("--budget-rows", action="store_true",
                    help="the small-model table as the 301k MLP at every=1, the floor and the budget; tinygpt also "
                         "with the budget")
    ap.add_argument("--task-overrides", default="{}", help='JSON, e.g. {"d_model": 64}')
    ap.add_argument("--quick", action="store_true", help="10 steps, 100 MLP steps, 10 accuracy windows, pool 128")
    ap.add_argument("--only", default="mlp,tinygpt,ddp,accuracy",
                    help="comma-separated parts to run: mlp, tinygpt, ddp, accuracy")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--skip-ddp", action="store_true")
    args = ap.parse_args()
    if args.ddp_worker:
        return ddp_worker(args)
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    bad = parts - {"mlp", "tinygpt", "ddp", "accuracy"}
    if bad:
        ap.error(f"--only {args.only} is not allowed; allowed: a comma-separated subset of mlp, tinygpt, ddp, accuracy")
    if args.skip_ddp:
        parts.discard("ddp")
    if args.quick:
        args.steps, args.mlp_steps, args.accuracy_windows, args.pool = 10, 100, 10, 128
    if args.threads < 0:
        ap.error(f"--threads {args.threads} is not allowed; allowed: a whole number ≥ 1, or 0 (torch's default)")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())} (1 / 5 / 15 min) on {os.cpu_count()} "
          f"cores at the start", flush=True)
    warnings.filterwarnings("ignore", message=".*batching rule.*")  # vmap SDPA fallback: part of its cost
    out: dict = {}
    if "mlp" in parts:
        out["mlp"] = run_mlp_table(args)
    if not parts & {"tinygpt", "ddp", "accuracy"}:
        print(f"load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        return
    task = load_task("tinygpt", **json.loads(args.task_overrides))
    n_params = sum(p.numel() for p in task.build_model(args.seed).parameters())
    print(f"tinygpt: {n_params:,} parameters, micro {MICRO} × accum {ACCUM}, seq_len {task.seq_len}, "
          f"{_threads_text(args)}, torch {torch.__version__}")

    model = None
    if parts & {"tinygpt", "accuracy"}:
        windows = _windows(task, args.steps + args.warmup, MICRO, args.seed)
        # --budget-rows: both tinygpt arms read the plain mean over their measured windows (half_life inf), so
        # that the estimate's interval says what the windows the budget left out cost in precision
        plain = {"half_life": math.inf} if args.budget_rows else {}
        acc = ab_timing(task.loss_sum, lambda: task.build_model(args.seed), windows, warmup=args.warmup,
                        monitor_kwargs={"config": NoiseConfig(**plain)}, unit=task.unit)
        model = acc.pop("trained_model")
        out["accumulation"] = acc
        print(f"accumulation path: base {acc['base_s'] * 1e3:.1f} ms/step, with monitor {acc['monitored_s'] * 1e3:.1f} "
              f"ms/step, ratio {acc['ratio_median']:.3f} (median of per-step ratios, IQR {acc['ratio_iqr'][0]:.3f}–"
              f"{acc['ratio_iqr'][1]:.3f}; ratio of means {acc['ratio_of_means']:.3f}; CPU-time ratio "
              f"{acc['cpu_ratio_median']:.3f}, {acc['steps']} steps)" + _cost_text(acc["monitor_cost"]), flush=True)
    if "tinygpt" in parts and args.budget_rows:
        bud = ab_timing(task.loss_sum, lambda: task.build_model(args.seed), windows, warmup=args.warmup,
                        monitor_kwargs={"config": NoiseConfig(budget=args.budget, **plain)}, unit=task.unit)
        bud.pop("trained_model")
        out["accumulation_budget"] = bud
        print(f"accumulation path, budget {args.budget:g}: base {bud['base_s'] * 1e3:.1f} ms/step, with monitor "
              f"{bud['monitored_s'] * 1e3:.1f} ms/step, ratio {bud['ratio_median']:.3f} (IQR {bud['ratio_iqr'][0]:.3f}–"
              f"{bud['ratio_iqr'][1]:.3f}; ratio of means {bud['ratio_of_means']:.3f}; CPU-time ratio "
              f"{bud['cpu_ratio_median']:.3f}, {bud['steps']} steps)" + _cost_text(bud["monitor_cost"]) + _estimate_text(bud)
              + "\n      every window: " + _estimate_text(acc).strip(), flush=True)

    if "ddp" in parts:
        ddp = out["ddp"] = run_ddp(args)
        print(f"DDP path (torchrun 2 ranks, gloo, 1 thread each): base {ddp['base_s'] * 1e3:.1f} ms/step, with "
              f"monitor {ddp['monitored_s'] * 1e3:.1f} ms/step, ratio {ddp['ratio_median']:.3f} (IQR "
              f"{ddp['ratio_iqr'][0]:.3f}–{ddp['ratio_iqr'][1]:.3f}; ratio of means {ddp['ratio_of_means']:.3f}, "
              f"{ddp['steps']} steps)")

    if "accuracy" in parts:
        accu = out["accuracy"] = accuracy_vs_truth(task, model, args.accuracy_windows, args.pool, args.seed)
        m, pe = accu["micro"], accu["per_example"]
        print(f"truth at fixed parameters (after the timed steps): B_simple = {accu['truth_b_simple_samples']:.4g} "
              f"samples (pool of {accu['truth_pool']} full-length samples, {accu['truth_s']:.1f} s)")
        print(f"  micro-batch source ({accu['windows']} windows, k={ACCUM}): {m['b_simple_samples']:.4g} ± "
              f"{m['stderr']:.2g}, error {m['rel_error']:+.1%} ({m['z']:+.1f} SE), {m['window_s'] * 1e3:.1f} ms/window "
              f"(fwd+bwd+monitor)")
        print(f"  per-example (vmap grad, k={MICRO * ACCUM}): {pe['b_simple_samples']:.4g} ± {pe['stderr']:.2g}, "
              f"error {pe['rel_error']:+.1%} ({pe['z']:+.1f} SE), {pe['window_s'] * 1e3:.1f} ms/window "
              f"({pe['window_s'] / m['window_s']:.2f}× the monitored window)")
    print(f"load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
