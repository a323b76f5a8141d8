"""Validation of ``globalbatch scale`` (docs/scale.md): the five checks of its method card, and the transfer check.

1. Leave one batch out: on a 3-seed tinygpt sweep, refit B_crit(L) and S_min(L) without one batch and predict
   that batch's steps to each common target; compare with its measured median over seeds.
2. Step time: predicted (probe-measured MFU curve + the per-step overhead measured without data + the 2-process
   gloo cluster measured without the model: all-reduce α–β and the data-parallel bookkeeping, written as a
   ``--cluster`` YAML) vs measured step time of tinygpt on 1 and 2 gloo processes at several (micro, accum)
   geometries; the 2-process rows from a probe and an overhead measured as 2 processes at once; inputs and windows
   in ``--rounds`` interleaved rounds, each side the median over them (this VM's speed wanders within seconds).
3. Llama 3 405B (arXiv 2407.21783 Table 4): TP 8, PP 16, DP 64 → 128, sequence 8,192, 16M-token batch;
   one efficiency constant (the kernel MFU) set at 8,192 GPUs, the MFU at 16,384 predicted.
4. A ramp, run: the ramp ``scale`` proposes for the demo target on this CPU, trained through StepDriver's batch
   schedule over 3 seeds, against the best constant batch (measured in the sweep) and the predictions.
5. Timing: ``scale`` over 1 … 10,000 GPUs in CPU seconds (library call and the command end to end).
T. Transfer: B_crit(L) of tinygpt at two widths at their common losses (needs ``--sweep2``).

Usage (CPU, a few minutes besides the sweeps; run it on an otherwise idle machine for check 2)::

    python benchmarks/scale_validation.py --sweep runs/demo [--sweep2 runs/demo_d128] [--checks 1,2,3,4,5,T] \
        [--work /tmp/scale_validation] [--out results.json] [--cluster FILE.yaml]
    python benchmarks/scale_validation.py --measure-cluster FILE.yaml   # only the 2-process gloo cluster

Without ``--sweep`` the demo sweep (``globalbatch demo``, ≈ 4 min on 2 idle cores) is run into ``--work``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

DEMO_TASK = {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 64, "max_corpus_bytes": 2_000_000}
GEOMETRIES = [(2, 1), (4, 2), (8, 1), (8, 4), (16, 2)]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(SRC))


# ---------------------------------------------------------------------------
# 1. Leave one batch out
# ---------------------------------------------------------------------------

def check_lobo(sweep: str) -> dict:
    import numpy as np

    from globalbatch.critical.seeds import fit_joint
    from globalbatch.lab.sweep.store import analyze_sweep_seeds
    from globalbatch.scale import BCritLaw
    from globalbatch.scale.convergence import from_points

    _, a = analyze_sweep_seeds(sweep)
    pts = [(st.target, s, b, st.steps[b][s]) for st in a.targets for s in a.seeds if st.monotone[s]
           for b in st.steps if st.steps[b][s] is not None]
    batches = sorted({p[2] for p in pts})
    rows = []
    for held in batches:
        train = [p for p in pts if p[2] != held]
        j = fit_joint(train, n_boot=0)
        law = BCritLaw(b_ref_tokens=j.b_ref, loss_ref=j.loss_ref, k=j.k, cov=tuple(map(tuple, j.cov)), dof=j.dof)
        conv = from_points(train, law)
        for st in a.targets:
            meas = [st.steps[held][s] for s in a.seeds if st.steps[held].get(s) is not None]
            if not meas:
                continue
            pred = conv.steps(held, st.target)
            lo, hi = conv.steps_interval(held, st.target)
            med = float(np.median(meas))
            rows.append({"held_out_batch_tokens": held, "target": st.target, "predicted_steps": pred,
                         "interval": [lo, hi], "measured_median_steps": med, "measured_range": [min(meas), max(meas)],
                         "error": pred / med - 1, "edge": held in (batches[0], batches[-1])})
    errs = [abs(r["error"]) for r in rows]
    inner = [abs(r["error"]) for r in rows if not r["edge"]]
    covered = sum(r["interval"][0] <= r["measured_median_steps"] <= r["interval"][1] for r in rows)
    print("\n[1] leave one batch out (refit without the batch, predict its steps at every common target)")
    print(f"    {'batch':>8} {'target':>7} {'predicted':>10} {'measured (median, range)':>28} {'error':>8}")
    for r in rows:
        print(f"    {r['held_out_batch_tokens']:8.0f} {r['target']:7.4f} {r['predicted_steps']:10.1f} "
              f"{r['measured_median_steps']:10.1f} [{r['measured_range'][0]:6.1f}–{r['measured_range'][1]:6.1f}] "
              f"{r['error']:+8.1%}")
    out = {"rows": rows, "median_abs_error": statistics.median(errs), "median_abs_error_interior": statistics.median(inner),
           "max_abs_error": max(errs), "interval_coverage": covered / len(rows), "pass": statistics.median(errs) <= 0.15}
    print(f"    median |error| {out['median_abs_error']:.1%} (interior batches {out['median_abs_error_interior']:.1%}, "
          f"max {out['max_abs_error']:.1%}); 95% interval covers the median in {covered}/{len(rows)}; "
          f"{'PASS' if out['pass'] else 'FAIL'} (≤ 15 %)")
    return out


# ---------------------------------------------------------------------------
# 2. Step time on 1 and 2 gloo processes
# ---------------------------------------------------------------------------

def steptime_worker(out: str, steps: int) -> None:
    """Under torchrun: the step times of each geometry (``StepDriver`` windows of the tinygpt demo model)."""
    import torch
    import torch.distributed as dist

    from globalbatch.lab.loop import Experiment
    from globalbatch.lab.tasks import load_task
    from globalbatch.windows import cut_window

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    res: dict = {"world": world, "geometries": []}
    task = load_task("tinygpt", **DEMO_TASK)
    for micro, accum in GEOMETRIES:
        exp = Experiment(task, batch=micro * accum * world, micro_batch=micro, lr=1e-3, seed=0, ddp=world > 1)
        order = task.sample_order(0)
        times = []
        for i in range(steps + 2):
            import itertools

            drawn = [int(x) for x in itertools.islice(order, micro * accum * world)]
            micros = cut_window(drawn, micro, world, rank)
            batches = [task.collate(ix, exp.device) for ix in micros]
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            exp.driver.run_window(batches, exp.loss_fn, samples_per_micro=[len(ix) for ix in micros])
            dt = time.perf_counter() - t0
            if i >= 2:
                times.append(dt)
        res["geometries"].append({"micro_batch": micro, "grad_accum_steps": accum, "step_s": statistics.median(times),
                                  "step_s_all": times})
    if world > 1:
        all_res = [None] * world
        dist.all_gather_object(all_res, res)
        dist.destroy_process_group()
        if rank == 0:  # a step ends when the slower rank ends: the max over ranks, step by step
            for i, g in enumerate(res["geometries"]):
                per_step = [max(r["geometries"][i]["step_s_all"][k] for r in all_res) for k in range(len(g["step_s_all"]))]
                g["step_s_all"] = per_step
                g["step_s"] = statistics.median(per_step)
                g["step_s_min"] = _least_contended(per_step)
    else:
        for g in res["geometries"]:
            g["step_s_min"] = _least_contended(g["step_s_all"])
    if rank == 0:
        Path(out).write_text(json.dumps(res))


def overhead_worker(out: str, reps: int = 60) -> None:
    """The per-step overhead, measured without data (one process, one thread), as two numbers:

    * ``optimizer_step_s``: ``optimizer.step(); optimizer.zero_grad(set_to_none=True)`` of the probe's AdamW on the
      model with gradients cloned just before it — printed beside the probe's in-place reading of the same call
      (each probe step is split after its backward; the curve uses that split, not this number);
    * ``step_overhead_s``: ``StepDriver.step()`` alone (counts, gradient scaling, the clipping norm, the optimizer
      step, the one host sync) after a micro-batch whose loss is 0·Σθ (no data: every gradient present, zero).

    Neither runs a forward or backward of a micro-batch: they are inputs of the step-time model, independent of the
    windows check 2 compares against. Medians over ``reps`` after 5 warm-ups."""
    import torch

    from globalbatch.lab.loop import Experiment
    from globalbatch.lab.tasks import load_task
    from globalbatch.optim import build_optimizer

    torch.set_num_threads(1)
    task = load_task("tinygpt", **DEMO_TASK)
    model = task.build_model(0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer("adamw", params, lr=1e-3)
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    bare = []
    for i in range(reps + 5):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 5:
            bare.append(time.perf_counter() - t0)
    exp = Experiment(task, batch=1, micro_batch=1, lr=1e-3, seed=0)
    drv = exp.driver
    eparams = [p for p in exp.model.parameters() if p.requires_grad]
    step = []
    for i in range(reps + 5):
        with drv.micro_step(last=True):
            loss_sum = torch.stack([(p * 0.0).sum() for p in eparams]).sum()
            drv.backward(loss_sum, 1, samples=1)
        t0 = time.perf_counter()
        drv.step()
        if i >= 5:
            step.append(time.perf_counter() - t0)
    Path(out).write_text(json.dumps({"optimizer_step_s": statistics.median(bare), "step_overhead_s": statistics.median(step),
                                     "overhead_params": sum(p.numel() for p in params),
                                     "optimizer_step_s_all": bare, "step_overhead_s_all": step}))


def _concurrent(cmds: list[list[str]], timeout: int) -> list[str]:
    """Run the commands at the same time (as the ranks of a job share the machine); their stdouts."""
    procs = [subprocess.Popen(c, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(p.args[:4])} failed: {err[-2000:]}")
        outs.append(out)
    return outs


def _overhead_once(work: Path, procs: int, tag: str) -> dict:
    """The per-step overhead (``optimizer_step_s``, ``step_overhead_s``, ``overhead_params``) measured by ``procs``
    processes at once: the slower one's numbers."""
    outs = [work / f"overhead_{procs}_{tag}_{i}.json" for i in range(procs)]
    _concurrent([[sys.executable, str(Path(__file__).resolve()), "--overhead-worker", str(o)] for o in outs], 600)
    runs = [json.loads(o.read_text()) for o in outs]
    ov = {k: max(r[k] for r in runs) for k in ("optimizer_step_s", "step_overhead_s")}
    ov["overhead_params"] = runs[0]["overhead_params"]
    return ov


def _calibrated_probe(work: Path, probe_runs: list[dict], overheads: list[dict], procs: int, tag: str) -> Path:
    """``probe.json`` with the per-step overhead: what :func:`globalbatch.scale.mfu_curve_from_probe` reads. Each
    probe size's median run over ``probe_runs`` and each overhead's median over ``overheads``: one run's reading is
    already a median over its steps; across runs, the median keeps one lucky or crowded run from deciding."""
    path = _combine_probes(probe_runs, work / f"probe_calibrated_{procs}_{tag}.json", pick="median")
    data = json.loads(path.read_text())
    data.update({k: statistics.median_low([o[k] for o in overheads]) for k in ("optimizer_step_s", "step_overhead_s")},
                overhead_params=overheads[0]["overhead_params"])
    path.write_text(json.dumps(data))
    return path


def _least_contended(step_s: list[float], group: int = 5) -> float:
    """One window's reading in one round: the fastest of the medians of consecutive groups of ``group`` steps (a
    group is about as long as a probe run's 8 timed steps, whose median is the probe's reading). The cluster
    measurement uses it too. Check 2 then takes the median of these readings over its rounds."""
    meds = [statistics.median(step_s[i:i + group]) for i in range(0, len(step_s) - group + 1, group)]
    return min(meds) if meds else statistics.median(step_s)


def _probe_once(procs: int = 1) -> dict:
    """One ``globalbatch probe --json`` run; ``procs`` > 1: that many probes at once (the ranks of a ``procs``-process
    job share this machine's cores, memory bandwidth and caches: that is the device a rank has), each size's trial
    the slower probe's (a DDP step waits for the slower rank)."""
    cmd = [sys.executable, "-m", "globalbatch.cli", "probe", "--device", "cpu", "--max-micro-batch", "32",
           "--steps-per-trial", "8", "--json"] + [x for k, v in DEMO_TASK.items() for x in ("--task-arg", f"{k}={v}")]
    outs = [json.loads(o) for o in _concurrent([cmd] * procs, 900)]
    return dict(outs[0], trials=[max((next(t for t in o["trials"] if t["micro_batch"] == t0["micro_batch"])
                                      for o in outs), key=lambda t: t.get("step_time_s") or 0.0)
                                 for t0 in outs[0]["trials"]])


def _combine_probes(runs: list[dict], path: Path, pick: str = "fastest") -> Path:
    """Write ``path``: each size's trial from the probe ``runs`` — the fastest (the least contended reading on a
    shared machine) or, ``pick="median"``, the median run's (the lower one of an even count) — with its MFU against
    the largest measured peak, and every run's step time per size."""
    peak = max(r["peak_flops_per_s"] for r in runs)
    by_size: dict[int, list[dict]] = {}
    for r in runs:
        for t in r["trials"]:
            if t.get("step_time_s"):
                by_size.setdefault(t["micro_batch"], []).append(dict(t))
    best = {m: sorted(ts, key=lambda t: t["step_time_s"])[0 if pick == "fastest" else (len(ts) - 1) // 2]
            for m, ts in by_size.items()}
    for t in best.values():
        t["mfu"] = t["model_flops_per_step"] / (t["step_time_s"] * peak) if t.get("model_flops_per_step") else None
    out = dict(runs[0], trials=[best[m] for m in sorted(best)], peak_flops_per_s=peak, repeats=len(runs),
               step_times_s={str(m): [next((t["step_time_s"] for t in r["trials"] if t["micro_batch"] == m), None)
                                      for r in runs] for m in sorted(best)})
    path.write_text(json.dumps(out))
    return path


def _run_probe(work: Path, repeats: int = 3, procs: int = 1) -> Path:
    """``probe.json`` (kept in ``work``): each size's fastest step over ``repeats`` probe runs."""
    path = work / ("probe.json" if procs == 1 else f"probe_{procs}proc.json")
    if path.exists():
        return path
    return _combine_probes([_probe_once(procs) for _ in range(repeats)], path)


def _run_steptime(work: Path, nproc: int, steps: int, tag: str = "") -> dict:
    out = work / f"steptime_{nproc}{tag}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(Path(__file__).resolve()), "--steptime-worker", str(out), "--steps", str(steps)]
    out.unlink(missing_ok=True)
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        # gloo sometimes aborts at process exit ("terminate called without an active exception") after rank 0
        # wrote its complete results: those are used; anything else is a failure
        try:
            return json.loads(out.read_text())
        except (OSError, json.JSONDecodeError):
            raise RuntimeError(f"step-time run ({nproc}) failed: {proc.stderr[-3000:]}") from None
    return json.loads(out.read_text())


def _gloo_cluster(allreduce: list[dict], peak: float):
    """A one-node 'cluster' of 2 CPU processes: t = a + 2(n−1)/n·S/busbw fitted to the all-reduce sweep."""
    import numpy as np

    from globalbatch.scale import Cluster

    S = np.array([r["bytes"] for r in allreduce], dtype=float)
    t = np.array([r["seconds"] for r in allreduce], dtype=float)
    b, a = np.polyfit(S, t, 1)
    busbw = (2 * (2 - 1) / 2) / b
    return Cluster(name="cpu-gloo", gpus_per_node=2, peak_flops_per_s=peak, memory_bytes=64e9,
                   intra_busbw_bytes_per_s=busbw, inter_busbw_bytes_per_s=busbw, base_latency_s=max(a, 0.0),
                   intra_hop_latency_s=0.0, inter_hop_latency_s=0.0, tree_intra_latency_s=1.0, tree_inter_latency_s=1.0,
                   source="measured: gloo all-reduce sweep on this machine"), {"alpha_s": a, "busbw_bytes_per_s": busbw}


def _tinygpt_params() -> int:
    from globalbatch.lab.tasks import load_task

    return sum(p.numel() for p in load_task("tinygpt", **DEMO_TASK).build_model(0).parameters())


def _tinygpt_tensors() -> int:
    from globalbatch.lab.tasks import load_task

    return len(list(load_task("tinygpt", **DEMO_TASK).build_model(0).parameters()))


# ---------------------------------------------------------------------------
# The 2-process gloo "cluster", measured without the model (as nccl-tests measure one)
# ---------------------------------------------------------------------------

ALLREDUCE_BYTES = (8, 1_024, 16_384, 262_144, 1_048_576, 4_194_304)
CLUSTER_WINDOWS = (  # (name, parameter shapes, micro-batches per step, DDP bucket_cap_mb)
    ("one_1", "one", 1, 25.0), ("one_4", "one", 4, 25.0), ("eight_1bucket", "eight", 1, 25.0),
    ("eight_8buckets", "eight", 1, 1e-9), ("sixtyfour_1", "sixtyfour", 1, 25.0), ("big_1", "big", 1, 25.0),
    ("tinygpt_1", "tinygpt", 1, 25.0))
TENSORS_WINDOW = 64  # one-element parameters in one bucket: DDP's cost per parameter tensor against "one"
BIG_PARAM_ELEMENTS = 1 << 20  # one 4 MB fp32 parameter: the gradient bytes of a DDP step (its bus bandwidth)


def cluster_worker(out: str, reps: int = 40) -> None:
    """Under torchrun, 2 processes over gloo, 1 thread each: the 'cluster' of check 2, measured without the model.

    * **all-reduce**: one ``all_reduce`` of S bytes right after a barrier, S = 8 B … 4 MB (nccl-tests'
      ``all_reduce_perf`` over gloo), per size the slower rank;
    * **what a data-parallel step costs beyond its collectives**: ``StepDriver`` windows whose loss is 0·Σθ on a
      module with no compute (its forward is that sum), under DDP and as a plain module (no DP) in the same two
      processes, step for step in turn: a one-parameter module with 1 and 4 micro-batches per step, eight
      one-element parameters in one DDP bucket and in eight, 64 in one bucket, one 4 MB parameter, and the tinygpt
      demo model's
      parameter shapes (a check of the decomposition: no forward or backward of the model).

    Each timed step starts after a barrier; per step the slower rank. Raw seconds to ``out`` (JSON)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from globalbatch.lab.tasks import load_task
    from globalbatch.optim import build_optimizer
    from globalbatch.step import StepConfig, StepDriver

    class ParamBag(nn.Module):
        def __init__(self, shapes: list[tuple[int, ...]]) -> None:
            super().__init__()
            self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.stack([p.sum() for p in self.ps]).sum() * 0.0 * x

    torch.set_num_threads(1)
    logging.getLogger("globalbatch.step").setLevel(logging.ERROR)  # "a plain module under a process group": meant here
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    tiny_shapes = [tuple(p.shape) for p in load_task("tinygpt", **DEMO_TASK).build_model(0).parameters()]
    shapes = {"one": [(1,)], "eight": [(1,)] * 8, "sixtyfour": [(1,)] * TENSORS_WINDOW, "big": [(BIG_PARAM_ELEMENTS,)],
              "tinygpt": tiny_shapes}
    res: dict = {"world": world, "allreduce": {}, "windows": {}}
    for n in ALLREDUCE_BYTES:
        t = torch.zeros(max(n // 4, 1))
        for _ in range(3):
            dist.all_reduce(t)
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        res["allreduce"][str(n)] = times
    x = torch.ones(())
    for name, shape, accum, cap_mb in CLUSTER_WINDOWS:
        runs = {}
        for kind in ("plain", "ddp"):
            torch.manual_seed(0)
            m: nn.Module = ParamBag(shapes[shape])
            if kind == "ddp":
                m = nn.parallel.DistributedDataParallel(m, bucket_cap_mb=cap_mb)
            drv = StepDriver(m, build_optimizer("adamw", m, lr=1e-3),
                             StepConfig(micro_batch=1, global_batch=accum * (world if kind == "ddp" else 1),
                                        unit="sample", print_geometry=False))
            runs[kind] = (m, drv, [])
        for i in range(reps + 5):
            for kind in ("plain", "ddp"):  # in turn, so that both see the same machine
                m, drv, times = runs[kind]
                dist.barrier()
                t0 = time.perf_counter()
                for k in range(accum):
                    with drv.micro_step(last=k == accum - 1):
                        drv.backward(m(x), 1, samples=1)
                drv.step()
                if i >= 5:
                    times.append(time.perf_counter() - t0)
        for kind in ("plain", "ddp"):
            res["windows"][f"{kind}_{name}"] = runs[kind][2]
        res.setdefault("buckets", {})[name] = len(runs["ddp"][0].reducer._get_zeros_like_grad_buckets())
    res["tinygpt_params"] = sum(math.prod(s) for s in shapes["tinygpt"])
    res["tinygpt_tensors"] = len(shapes["tinygpt"])
    all_res: list = [None] * world
    dist.all_gather_object(all_res, res)
    if rank == 0:
        for key in res["allreduce"]:
            res["allreduce"][key] = [max(r["allreduce"][key][k] for r in all_res) for k in range(reps)]
        for key in res["windows"]:
            res["windows"][key] = [max(r["windows"][key][k] for r in all_res) for k in range(reps)]
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def measure_cluster(path: Path, work: Path) -> dict:
    """Measure the 2-process gloo 'cluster' (:func:`cluster_worker`) and write its description to ``path`` (the
    YAML ``globalbatch scale --cluster`` reads), each measured key labelled with how it was measured."""
    from globalbatch.flops import peak_flops_per_s
    from dataclasses import replace

    from globalbatch.scale import Cluster, ModelSpec, ThroughputCurve, allreduce_time, dp_comm_time, step_overhead_time

    raw_path = work / "cluster_raw.json"
    raw_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).resolve()), "--cluster-worker", str(raw_path)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    if not raw_path.exists():  # gloo may abort at exit after rank 0 wrote its results (see _run_steptime)
        raise RuntimeError(f"cluster measurement failed ({proc.returncode}): {proc.stderr[-3000:]}")
    raw = json.loads(raw_path.read_text())
    ar = {int(k): _least_contended(v) for k, v in raw["allreduce"].items()}
    alpha = ar[min(ar)]
    sizes = [s for s in ar if s > min(ar)]
    # t = α + 2(n−1)/n · S/busbw with n = 2: least squares of t − α on S through the origin
    slope = sum(s * (ar[s] - alpha) for s in sizes) / sum(s * s for s in sizes)
    busbw_barrier = 1.0 / slope
    win = {k: _least_contended(v) for k, v in raw["windows"].items()}
    # the bus bandwidth inside a DDP step: one 4 MB parameter against one 4-byte parameter (DDP − no DP each)
    extra_big = (win["ddp_big_1"] - win["plain_big_1"]) - (win["ddp_one_1"] - win["plain_one_1"])
    big_bytes = 4.0 * (BIG_PARAM_ELEMENTS - 1)
    busbw = big_bytes / extra_big if extra_big > 0 else busbw_barrier
    base: Cluster = Cluster(name="cpu-gloo-2proc", gpus_per_node=2, peak_flops_per_s=1.0, memory_bytes=1.0,
                   intra_busbw_bytes_per_s=busbw, inter_busbw_bytes_per_s=busbw, base_latency_s=alpha,
                   intra_hop_latency_s=0.0, inter_hop_latency_s=0.0, tree_intra_latency_s=1.0, tree_inter_latency_s=1.0)
    # each collective of a step beyond its α–β: 8 one-element parameters in 8 DDP buckets against 1 bucket
    n8, n1 = raw["buckets"]["eight_8buckets"], raw["buckets"]["eight_1bucket"]
    if n8 <= n1:
        raise RuntimeError(f"DDP made {n8} buckets of the 8 parameters with a tiny bucket_cap_mb, {n1} without")
    per_bucket = (win["ddp_eight_8buckets"] - win["ddp_eight_1bucket"]) / (n8 - n1)
    dp_call = max(per_bucket - allreduce_time(4.0, 2, 1, base)[0], 0.0)
    base = replace(base, dp_call_overhead_s=dp_call)

    def modelled(params: int) -> float:
        """The window's collectives as ``base`` models them: the gradient bucket(s) and StepDriver's all-reduces."""
        spec = ModelSpec(params=params, seq_len=1, grad_bytes_per_param=4.0)
        none = ThroughputCurve(tokens=(1.0,), mfu=(1.0,), source="none", step_overhead_s=0.0, overhead_params=1.0)
        return dp_comm_time(spec, base, dp=2, tp=1, pp=1)[0] + step_overhead_time(spec, base, none, dp=2, tp=1, pp=1)

    extra_1 = win["ddp_one_1"] - win["plain_one_1"]
    extra_4 = win["ddp_one_4"] - win["plain_one_4"]
    extra_64 = win["ddp_sixtyfour_1"] - win["plain_sixtyfour_1"]
    dp_micro = max((extra_4 - extra_1) / 3, 0.0)
    dp_tensor = max((extra_64 - extra_1) / (TENSORS_WINDOW - 1), 0.0)  # the same bucket, 63 more tensors
    dp_step = max(extra_1 - modelled(1) - dp_micro - dp_tensor, 0.0)
    shaped_pred = (win["plain_tinygpt_1"] + modelled(raw["tinygpt_params"]) + dp_step + dp_micro
                   + dp_tensor * raw["tinygpt_tensors"])
    peak = peak_flops_per_s(device="cpu", dtype="fp32")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2
    how = "measured on this machine by benchmarks/scale_validation.py --measure-cluster"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = f"""# The 2-process gloo "cluster" of check 2: two CPU processes on one machine, 1 thread each, gloo over loopback.
# {how} ({when}, load average {os.getloadavg()[0]:.1f}):
# all-reduce after a barrier, 8 B – 4 MB, and zero-loss StepDriver windows of a module without compute, DDP against
# no DP in the same two processes (no model runs); each number the least contended reading (the fastest median of
# groups of 5 timed repetitions, per repetition the slower process).
name: cpu-gloo-2proc
gpus_per_node: 2                     # the 2 processes are one "node"
peak_flops_per_s: {peak.flops_per_s:.6g}         # measured on this machine: {peak.source}, 1 thread
memory_bytes: {memory:.6g}              # this machine's RAM (os.sysconf), one half per process
# {how}: inside a DDP step, zero-loss windows with one 4 MB parameter against one 4-byte parameter
# (DDP − no DP: {extra_big * 1e3:.3f} ms more for 4 MB); all-reduces 16 KB – 4 MB timed after a barrier read
# {busbw_barrier / 1e9:.3f} GB/s ((t − α) = S/busbw by least squares)
intra_busbw_bytes_per_s: {busbw:.6g}
inter_busbw_bytes_per_s: {busbw:.6g}    # one node: not used
base_latency_s: {alpha:.6g}             # {how}: the 8-byte all-reduce (α, the latency of one call)
intra_hop_latency_s: 0.0             # α is one all-reduce's whole latency on 2 processes
inter_hop_latency_s: 0.0
tree_intra_latency_s: 1.0            # gloo has no tree all-reduce: 1 s keeps the ring
tree_inter_latency_s: 1.0
# {how}: zero-loss DDP windows of 8 one-element parameters in {n8} buckets against {n1}:
# ({per_bucket * 1e3:.3f} ms per extra bucket) − one 4-byte all-reduce's α–β
dp_call_overhead_s: {dp_call:.6g}
# {how}: a one-parameter zero-loss window under DDP − the same without DP ({extra_1 * 1e3:.3f} ms),
# − its 3 all-reduces (one bucket, the driver's two) with dp_call_overhead_s ({modelled(1) * 1e3:.3f} ms)
# − one micro-batch's and one tensor's share (below)
dp_step_overhead_s: {dp_step:.6g}
# {how}: (DDP − no DP with 4 micro-batches per step ({extra_4 * 1e3:.3f} ms) − the same with 1) / 3
dp_micro_overhead_s: {dp_micro:.6g}
# {how}: (DDP − no DP with {TENSORS_WINDOW} one-element parameters in one bucket ({extra_64 * 1e3:.3f} ms) − the same
# with one) / {TENSORS_WINDOW - 1}: DDP's cost per parameter tensor (its autograd hook, the bucket copies)
dp_tensor_overhead_s: {dp_tensor:.6g}
source: "{how} ({when})"
"""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return {"alpha_s": alpha, "busbw_bytes_per_s": busbw, "busbw_after_barrier_bytes_per_s": busbw_barrier,
            "dp_call_overhead_s": dp_call, "dp_step_overhead_s": dp_step,
            "dp_micro_overhead_s": dp_micro, "dp_tensor_overhead_s": dp_tensor, "buckets": raw["buckets"],
            "allreduce_s": {str(k): v for k, v in ar.items()}, "windows_s": win,
            "tinygpt_shaped_ddp_window": {"measured_s": win["ddp_tinygpt_1"], "predicted_s": shaped_pred,
                                          "without_dp_s": win["plain_tinygpt_1"]}}


def _merge_steptimes(runs: list[dict]) -> dict:
    """One step-time result from several interleaved runs: per geometry every step, the median of all of them, and
    the median over the runs of each run's least contended reading (its fastest median of a group of steps)."""
    out = dict(runs[0], geometries=[])
    for i, g in enumerate(runs[0]["geometries"]):
        per_run = [r["geometries"][i] for r in runs]
        steps = [x for gr in per_run for x in gr["step_s_all"]]
        out["geometries"].append(dict(g, step_s_all=steps, step_s=statistics.median(steps),
                                      step_s_min=statistics.median_low([gr["step_s_min"] for gr in per_run]),
                                      step_s_min_per_round=[gr["step_s_min"] for gr in per_run]))
    return out


def check_step_time(work: Path, steps: int = 10, cluster_file: str | None = None, rounds: int = 5) -> dict:
    from globalbatch.scale import ModelSpec, load_cluster, mfu_curve_from_probe, step_time

    load_before = os.getloadavg()[0]
    # the inputs, measured without running any of the compared windows: the cluster (gloo's all-reduce and what a
    # data-parallel step costs beyond it, from windows without a model), the probe's MFU curve and the per-step
    # overhead, each measured alone (for 1-process rows) and as 2 processes at once (for 2-process rows).
    # The machine's speed drifts by more than the goal over a minute (other tenants, caches, frequency), so the
    # inputs and the compared windows are measured in interleaved rounds — probe, overhead, windows; 1 process,
    # then 2 — and both sides keep the median over the same rounds of one reading per round (the probe: its median
    # of 8 steps per size; a window: its fastest median of a group of 5 steps, per step the slower rank).
    measured = None
    if cluster_file is None:
        cluster_file = str(work / "gloo_cluster.yaml")
        measured = measure_cluster(Path(cluster_file), work)
    cluster = load_cluster(cluster_file)
    probes: dict[int, list[dict]] = {1: [], 2: []}
    overheads: dict[int, list[dict]] = {1: [], 2: []}
    windows: dict[int, list[dict]] = {1: [], 2: []}
    for r in range(rounds):
        for procs in (1, 2):
            probes[procs].append(_probe_once(procs))
            overheads[procs].append(_overhead_once(work, procs, f"r{r}"))
            windows[procs].append(_run_steptime(work, procs, steps, tag=f"_r{r}"))

    def inputs_of(procs: int, which: list[int], tag: str):
        path = _calibrated_probe(work, [probes[procs][i] for i in which], [overheads[procs][i] for i in which],
                                 procs, tag)
        data = json.loads(path.read_text())  # the probe with the overheads' medians (_calibrated_probe)
        return mfu_curve_from_probe(str(path)), data["peak_flops_per_s"], \
            {k: data[k] for k in ("optimizer_step_s", "step_overhead_s", "overhead_params")}

    everything = list(range(rounds))
    inputs = {procs: inputs_of(procs, everything, "all") for procs in (1, 2)}
    per_round_inputs = {procs: [inputs_of(procs, [r], f"r{r}") for r in everything] for procs in (1, 2)}
    probe = json.loads(_combine_probes(probes[1], work / "probe.json").read_text())
    _combine_probes(probes[2], work / "probe_2proc.json")
    peak = probe["peak_flops_per_s"]
    ov = inputs[1][2]
    timed = [t for t in probe["trials"] if t.get("model_flops_per_step") and t.get("tokens_per_step")]
    flops_per_token = max(timed, key=lambda t: t["micro_batch"])
    flops_per_token = flops_per_token["model_flops_per_step"] / flops_per_token["tokens_per_step"]
    model = ModelSpec(params=_tinygpt_params(), seq_len=64, flops_per_token=flops_per_token, grad_bytes_per_param=4.0,
                      param_tensors=_tinygpt_tensors(),
                      precision="fp32")
    one, two = _merge_steptimes(windows[1]), _merge_steptimes(windows[2])
    load_after = os.getloadavg()[0]
    rows = []
    for world, run in ((1, one), (2, two)):
        curve, peak_w, _ = inputs[world]
        for g in run["geometries"]:
            st = step_time(model, cluster, curve, micro_batch=g["micro_batch"], grad_accum_steps=g["grad_accum_steps"],
                           dp=world, overlap=0.0, peak_flops_per_s=peak_w)
            # the same row from the inputs measured by one process alone (the probe as a single run gives them)
            alone = step_time(model, cluster, inputs[1][0], micro_batch=g["micro_batch"],
                              grad_accum_steps=g["grad_accum_steps"], dp=world, overlap=0.0,
                              peak_flops_per_s=inputs[1][1])
            # the same row, each round's inputs against that round's windows: the spread the machine's drift makes
            by_round = [step_time(model, cluster, per_round_inputs[world][r][0], micro_batch=g["micro_batch"],
                                  grad_accum_steps=g["grad_accum_steps"], dp=world, overlap=0.0,
                                  peak_flops_per_s=per_round_inputs[world][r][1]).total_s / g["step_s_min_per_round"][r] - 1
                        for r in everything]
            rows.append({"processes": world, "micro_batch": g["micro_batch"], "grad_accum_steps": g["grad_accum_steps"],
                         "error_per_round": by_round,
                         "predicted_s": st.total_s, "compute_s": st.compute_s, "comm_s": st.comm_exposed_s,
                         "overhead_s": st.overhead_s, "predicted_from_1proc_inputs_s": alone.total_s,
                         "measured_s": g["step_s_min"], "measured_median_s": g["step_s"],
                         "error": st.total_s / g["step_s_min"] - 1,
                         "error_from_1proc_inputs": alone.total_s / g["step_s_min"] - 1})
    c = cluster
    print("\n[2] step time: probe MFU curve + the measured gloo cluster vs measured (tinygpt demo model, 1 thread per "
          "process)")
    print(f"    load average {load_before:.1f} before, {load_after:.1f} after ({os.cpu_count()} cores)")
    print(f"    cluster {cluster_file} ({'measured in this run' if measured else 'given'}): all-reduce α = "
          f"{c.base_latency_s * 1e6:.0f} µs, bus bandwidth in a DDP step {c.intra_busbw_bytes_per_s / 1e9:.2f} GB/s; data-parallel "
          f"bookkeeping {c.dp_call_overhead_s * 1e3:.2f} ms per collective + {c.dp_step_overhead_s * 1e3:.2f} ms per "
          f"step + {c.dp_micro_overhead_s * 1e3:.3f} ms per micro-batch + {c.dp_tensor_overhead_s * 1e6:.1f} µs per "
          f"parameter tensor ({model.param_tensors} in tinygpt); probe peak {peak / 1e9:.1f} GFLOP/s")
    if measured:
        sh = measured["tinygpt_shaped_ddp_window"]
        print(f"    decomposition check, no model run: a zero-loss DDP window with tinygpt's {model.params:,.0f} "
              f"parameters measured {sh['measured_s'] * 1e3:.2f} ms, predicted {sh['predicted_s'] * 1e3:.2f} ms "
              f"(without DP {sh['without_dp_s'] * 1e3:.2f} ms + its all-reduces + the bookkeeping; "
              f"{sh['predicted_s'] / sh['measured_s'] - 1:+.1%})")
    ov2 = inputs[2][2]
    in_place = {t["micro_batch"]: t["step_time_s"] - t["forward_backward_s"] for t in timed if t.get("forward_backward_s")}
    print("    compute: each probe step's forward + backward, timed in place (the step split after its backward); the "
          "rest of a probe step, the optimizer's step() + zero_grad(), reads "
          + ", ".join(f"{v * 1e3:.2f}" for v in in_place.values()) + f" ms at micro-batches {', '.join(map(str, in_place))}"
          f" — the same call timed alone on gradients cloned just before it: {ov['optimizer_step_s'] * 1e3:.2f} ms")
    print(f"    per-step overhead measured without data: StepDriver.step() {ov['step_overhead_s'] * 1e3:.2f} ms at "
          f"{ov['overhead_params']:,} parameters (added per step); as 2 processes at once: "
          f"{ov2['step_overhead_s'] * 1e3:.2f} ms")
    print("    1-process rows: probe and overhead measured alone; 2-process rows: both measured as 2 processes at once "
          "(each rank's core shares the machine with the other rank); 'alone' = the 2-process row predicted from the "
          "1-process inputs")
    print(f"    {rounds} interleaved rounds (each: probe, overhead, windows; 1 process, then 2); both sides the median "
          f"over the same rounds of one reading per round: each probe size's median of 8 steps and the overhead's "
          f"median of 60; each geometry's fastest median of groups of 5 timed steps ({steps} steps per round; per step "
          "the slower rank); the median of all its steps is shown too; 'rounds' = each round's inputs against that "
          "round's windows alone (the machine's drift)")
    print(f"    {'procs':>5} {'micro':>5} {'accum':>5} {'predicted':>10} {'(compute + comm + overhead)':>28} "
          f"{'measured':>10} {'median':>9} {'error':>7} {'alone':>7}  rounds")
    for r in rows:
        print(f"    {r['processes']:5d} {r['micro_batch']:5d} {r['grad_accum_steps']:5d} {r['predicted_s'] * 1e3:8.1f}ms "
              f"({r['compute_s'] * 1e3:6.1f} + {r['comm_s'] * 1e3:4.1f} + {r['overhead_s'] * 1e3:4.1f} ms) "
              f"{r['measured_s'] * 1e3:8.1f}ms "
              f"{r['measured_median_s'] * 1e3:7.1f}ms {r['error']:+7.1%} {r['error_from_1proc_inputs']:+7.1%}  "
              + " ".join(f"{e:+.0%}" for e in r["error_per_round"]))
    worst = max(abs(r["error"]) for r in rows)
    out = {"rows": rows, "cluster_file": cluster_file, "cluster_measurement": measured,
           "cluster": {"base_latency_s": c.base_latency_s, "busbw_bytes_per_s": c.intra_busbw_bytes_per_s,
                       "dp_call_overhead_s": c.dp_call_overhead_s, "dp_step_overhead_s": c.dp_step_overhead_s,
                       "dp_micro_overhead_s": c.dp_micro_overhead_s, "dp_tensor_overhead_s": c.dp_tensor_overhead_s},
           "probe_peak_flops_per_s": peak, "max_abs_error": worst, "overhead": ov,
           "overhead_2proc": ov2, "max_abs_error_from_1proc_inputs": max(abs(r["error_from_1proc_inputs"]) for r in rows),
           "load_average": [load_before, load_after],
           "median_abs_error": statistics.median(abs(r["error"]) for r in rows), "rounds": rounds,
           "max_abs_error_per_round": [max(abs(r["error_per_round"][i]) for r in rows) for i in everything],
           "pass": worst <= 0.20}
    print(f"    max |error| {worst:.1%}, median {out['median_abs_error']:.1%}: {'PASS' if out['pass'] else 'FAIL'} (≤ 20 %); "
          "each round alone: max |error| " + ", ".join(f"{e:.1%}" for e in out["max_abs_error_per_round"]))
    return out


# ---------------------------------------------------------------------------
# 3. Llama 3 405B
# ---------------------------------------------------------------------------

def check_llama3() -> dict:
    from globalbatch.scale import PRESETS, ModelSpec, ThroughputCurve, step_time

    c = PRESETS["h100-ib"]
    inputs = {"params": 405e9, "layers": 126, "seq_len": 8192, "global_batch_sequences": 2048,
              "tokens_per_batch": 2048 * 8192, "tp": 8, "pp": 16, "dp": [64, 128], "gpus": [8192, 16384],
              "micro_batch": 1, "sharding": "fsdp (no reshard after forward: one all-gather per step)",
              "grad_bytes_per_param": 2, "overlap": 1.0, "cluster": "h100-ib preset (989 TFLOPS BF16, 8 GPUs/node)",
              "flops_per_token": "6N", "published_mfu": [0.43, 0.41]}
    out = {"inputs": inputs, "by_virtual_stages": []}
    print("\n[3] Llama 3 405B, Table 4: TP 8, PP 16, seq 8,192, 16M tokens/batch, DP 64 → 128")
    print("    inputs: " + "; ".join(f"{k} {v}" for k, v in inputs.items()))
    for v in (1, 2, 4, 5, 8):
        model = ModelSpec(params=405e9, seq_len=8192, sharding="fsdp", reshard_after_forward=False, virtual_stages=v,
                          layers=126)
        unit = ThroughputCurve(tokens=(8192.0,), mfu=(1.0,), source="unit")
        mfus = []
        for dp in (64, 128):
            st = step_time(model, c, unit, micro_batch=1, grad_accum_steps=2048 // dp, dp=dp, tp=8, pp=16, overlap=1.0)
            mfus.append(st)
        # The one efficiency constant: the kernel MFU κ, chosen so that 8,192 GPUs give the published 43 %.
        kappa = 0.43 / mfus[0].mfu()
        pred = kappa * mfus[1].mfu()
        kappa = min(kappa, 1.0)
        row = {"virtual_stages": v, "kernel_mfu": kappa, "predicted_mfu_16k": pred,
               "bubble_share": [s.bubble_s / s.total_s for s in mfus],
               "comm_exposed_share": [s.comm_exposed_s / s.total_s for s in mfus],
               "comm_total_s": [s.comm_total_s for s in mfus], "step_s_at_unit_mfu": [s.total_s for s in mfus],
               "within_2_points": abs(pred - 0.41) <= 0.02}
        out["by_virtual_stages"].append(row)
        print(f"    v = {v}: κ = {kappa:.3f}; bubble {row['bubble_share'][0]:.1%} → {row['bubble_share'][1]:.1%} of the step, "
              f"exposed comm {row['comm_exposed_share'][0]:.2%} → {row['comm_exposed_share'][1]:.2%}; "
              f"predicted MFU 43.0 % → {pred:.1%} (published 41 %) {'within' if row['within_2_points'] else 'OUTSIDE'} ±2 points")
    inferred = next(r for r in out["by_virtual_stages"] if r["virtual_stages"] == 8)
    out["inferred_v"] = 8
    out["predicted_mfu_16k"] = inferred["predicted_mfu_16k"]
    out["pass"] = inferred["within_2_points"]
    passing = [r["virtual_stages"] for r in out["by_virtual_stages"] if r["within_2_points"]]
    out["smallest_v_within_2_points"] = min(passing) if passing else None
    print("    v = 8 is inferred, not published: 126 layers on 16 stages ≈ 8 layers per stage (the first and last one "
          f"layer fewer), one layer per virtual stage; within ±2 points for v ≥ {out['smallest_v_within_2_points']} "
          "of those tried")
    return out


# ---------------------------------------------------------------------------
# 4. A ramp, run
# ---------------------------------------------------------------------------

def _train_schedule(sweep_cfg, schedule_text: str, lr: float, seed: int, target: float, work: Path) -> dict:
    """One run through StepDriver's batch schedule with the sweep's recipe; held-out evaluations at the sweep's
    positions until two evaluations are below the target."""
    import numpy as np

    from globalbatch.critical import Curve, steps_to_target
    from globalbatch.lab.loop import Experiment
    from globalbatch.lab.tasks import load_task
    from globalbatch.schedule import LRSchedule, parse_step_schedule

    task = load_task(sweep_cfg.task, **sweep_cfg.task_overrides)
    sched = parse_step_schedule(schedule_text, lr_rule="sqrt")  # thresholds count the run's unit (tokens here)
    first = sched.first_batch
    micro = min(sched.all_batches())
    warm = sweep_cfg.warmup_units(first * task.seq_len)
    lr_s = LRSchedule(peak_lr=lr, total=sweep_cfg.budget, warmup=warm, shape=sweep_cfg.lr_shape)
    exp = Experiment(task, micro_batch=micro, batch_schedule=sched, optimizer=sweep_cfg.optimizer, lr=lr,
                     weight_decay=sweep_cfg.weight_decay, max_grad_norm=sweep_cfg.max_grad_norm, seed=seed,
                     lr_schedule=lr_s)
    order = task.sample_order(seed)
    positions = sweep_cfg.eval_positions()
    eb = sweep_cfg.eval_batch
    ex, lo, ev_ex, ev_st, ev_lo = [], [], [0.0], [0.0], [exp.evaluate(sweep_cfg.max_val_samples, eb)]
    nxt, below, step = 0, 0, 0
    while exp.driver.trained_units < sweep_cfg.budget and below < 2:
        res = exp.train_window(order).result
        step = res.step
        ex.append(float(exp.driver.trained_units))
        lo.append(float(res.loss_per_unit))
        if nxt < len(positions) and exp.driver.trained_units >= positions[nxt]:  # as the sweep's trials do
            v = exp.evaluate(sweep_cfg.max_val_samples, eb)
            ev_ex.append(float(exp.driver.trained_units))
            ev_st.append(float(step))
            ev_lo.append(v)
            below = below + 1 if v < target else 0
            while nxt < len(positions) and positions[nxt] <= exp.driver.trained_units:
                nxt += 1
    curve = Curve(batch_size=float(first), lr=lr, examples=np.array(ex), loss=np.array(lo), label=schedule_text,
                  seed=seed, eval_examples=np.array(ev_ex), eval_steps=np.array(ev_st), eval_loss=np.array(ev_lo),
                  warmup_examples=float(warm))
    r = steps_to_target(curve, target, readout="heldout")
    return {"seed": seed, "steps": None if r is None else r[0], "tokens": None if r is None else r[1],
            "final_step": step, "final_tokens": ex[-1] if ex else 0.0}


def check_ramp(sweep: str, work: Path, seeds=(0, 1, 2)) -> dict:
    import numpy as np

    from globalbatch.cli.scale import convergence_from_sweep
    from globalbatch.lab.sweep.store import analyze_sweep_seeds, load_sweep
    from globalbatch.scale import ModelSpec, ScaleConfig, mfu_curve_from_probe, scale

    conv, facts = convergence_from_sweep(sweep)
    data = load_sweep(sweep)
    _, a = analyze_sweep_seeds(sweep)
    primary = a.primary
    target = primary.target
    probe_path = _run_probe(work)
    probe = json.loads(probe_path.read_text())
    curve = mfu_curve_from_probe(str(probe_path))
    cluster, _ = _gloo_cluster([{"bytes": 1, "seconds": 1e-4}, {"bytes": 1e6, "seconds": 1e-3}], probe["peak_flops_per_s"])
    timed = max((t for t in probe["trials"] if t.get("model_flops_per_step")), key=lambda t: t["micro_batch"])
    model = ModelSpec(params=_tinygpt_params(), seq_len=64, tokens_per_sequence=facts["tokens_per_sequence"],
                      flops_per_token=timed["model_flops_per_step"] / timed["tokens_per_step"], precision="fp32",
                      grad_bytes_per_param=4.0, layers=2)
    batches = sorted(data.batch_units())
    cfg = ScaleConfig(target_loss=target, max_gpus=1, min_global_batch=batches[0], max_global_batch=batches[-1],
                      max_stages=3, lr_rule="sqrt")
    res = scale(conv, model, cluster, curve, cfg)
    best, ramp = res.best, res.best_ramp
    tps = facts["tokens_per_sequence"]
    b_const = best.step.global_batch
    const_units = b_const * tps
    key = min(primary.steps, key=lambda u: abs(u - const_units))
    meas_const = [primary.steps[key][s] for s in a.seeds if primary.steps[key].get(s) is not None]
    meas_const_tok = [primary.examples[key][s] for s in a.seeds if primary.examples[key].get(s) is not None]
    print(f"\n[4] a ramp, run: target {target:.4f} (the demo's primary held-out target), objective time on this CPU")
    print(f"    best constant batch: {b_const} seq ({const_units:.0f} tokens): predicted {best.steps:.1f} steps, "
          f"{best.tokens:,.0f} tokens; measured (sweep, 3 seeds) median {np.median(meas_const):.1f} steps "
          f"[{min(meas_const):.1f}–{max(meas_const):.1f}], {np.median(meas_const_tok):,.0f} tokens")
    if ramp is None:
        print("    scale proposed no ramp (no two feasible stage batches): nothing to run")
        return {"ramp": None, "pass": False}
    # the ramp's first LR: the sweep's one LR of that batch (the sqrt rule then follows the batch)
    first_units = ramp.stages[0][1] * tps
    first_key = min(primary.best_lr, key=lambda u: abs(u - first_units))
    lrs = [v for v in primary.best_lr[first_key].values() if v is not None]
    lr = statistics.mode(lrs)
    print(f"    proposed ramp: \"{ramp.schedule}\" ({ramp.lr_text}), first LR {lr:g} (the sweep's for that batch): "
          f"predicted {ramp.steps:.1f} steps, {ramp.tokens:,.0f} tokens, {ramp.time_s / ramp.constant_time_s:.3f}× the "
          f"constant batch's time")
    runs = [_train_schedule(data.config, ramp.schedule, lr, s, target, work) for s in seeds]
    st = [r["steps"] for r in runs if r["steps"] is not None]
    tk = [r["tokens"] for r in runs if r["tokens"] is not None]
    for r in runs:
        print(f"    seed {r['seed']}: steps {r['steps']}, tokens {r['tokens']}")
    out = {"target": target, "constant": {"global_batch": b_const, "predicted_steps": best.steps,
                                          "predicted_tokens": best.tokens, "measured_steps": meas_const,
                                          "measured_tokens": meas_const_tok},
           "ramp": {"schedule": ramp.schedule, "lr": lr, "predicted_steps": ramp.steps, "predicted_tokens": ramp.tokens,
                    "predicted_time_ratio": ramp.time_s / ramp.constant_time_s, "runs": runs}}
    if len(st) == len(runs):
        in_spread = min(st) <= ramp.steps <= max(st) or abs(ramp.steps / np.median(st) - 1) <= \
            (max(st) - min(st)) / np.median(st)
        out["ramp"].update(measured_steps_median=float(np.median(st)), measured_tokens_median=float(np.median(tk)),
                           steps_error=ramp.steps / float(np.median(st)) - 1,
                           tokens_error=ramp.tokens / float(np.median(tk)) - 1, within_seed_spread=bool(in_spread))
        out["measured_steps_ratio_vs_constant"] = float(np.median(st) / np.median(meas_const))
        out["measured_tokens_ratio_vs_constant"] = float(np.median(tk) / np.median(meas_const_tok))
        out["pass"] = bool(in_spread)
        print(f"    ramp measured: median {np.median(st):.1f} steps [{min(st):.1f}–{max(st):.1f}], "
              f"{np.median(tk):,.0f} tokens; predicted {ramp.steps:.1f} steps ({out['ramp']['steps_error']:+.1%}), "
              f"{ramp.tokens:,.0f} tokens ({out['ramp']['tokens_error']:+.1%})")
        print(f"    ramp vs constant, measured: {out['measured_steps_ratio_vs_constant']:.3f}× the steps, "
              f"{out['measured_tokens_ratio_vs_constant']:.3f}× the tokens")
    else:
        out["pass"] = False
        print("    some ramp runs never reached the target")
    return out


# ---------------------------------------------------------------------------
# 5. Timing
# ---------------------------------------------------------------------------

def check_timing(sweep: str | None) -> dict:
    import resource

    from globalbatch.scale import PRESETS, ModelSpec, ScaleConfig, default_mfu_curve, kaplan_prior, scale

    conv = kaplan_prior(params=7e9)
    model = ModelSpec(params=7e9, seq_len=4096, activation_bytes_per_token=34 * 4096 * 32, sharding="zero1", layers=32)
    cfg = ScaleConfig(target_loss=2.2, max_gpus=10_000, tp_options=(1, 2, 4, 8), pp_options=(1, 2, 4, 8, 16))
    times, n = [], 0
    for _ in range(3):
        t0 = time.process_time()
        r = scale(conv, model, PRESETS["h100-ib"], default_mfu_curve(), cfg)
        times.append(time.process_time() - t0)
        n = r.evaluated_geometries
    # Baseline in the same run: the same geometries costed one by one with the scalar step_time (no numpy grid).
    from globalbatch.scale import gpu_counts, largest_micro, step_time

    c, curve = PRESETS["h100-ib"], default_mfu_curve()
    t0 = time.process_time()
    n_scalar = 0
    for g in gpu_counts(cfg.max_gpus, c.gpus_per_node):
        for tp in cfg.tp_options:
            for pp in cfg.pp_options:
                if tp > c.gpus_per_node or g % (tp * pp) or pp > model.layers:
                    continue
                dp = g // (tp * pp)
                m_max = largest_micro(model, c, dp=dp, tp=tp, pp=pp)
                per_rep = 1
                while m_max >= 1 and per_rep * dp <= cfg.max_global_batch:
                    m = 1
                    while m <= min(per_rep, m_max):
                        step_time(model, c, curve, micro_batch=m, grad_accum_steps=per_rep // m, dp=dp, tp=tp, pp=pp)
                        n_scalar += 1
                        m *= 2
                    per_rep *= 2
    scalar_s = time.process_time() - t0
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = [sys.executable, "-m", "globalbatch.cli", "scale", "--prior", "kaplan", "--params", "7B", "--target-loss", "2.2",
           "--max-gpus", "10000", "--tp", "1,2,4,8", "--pp", "1,2,4,8,16", "--layers", "32", "--sharding", "zero1",
           "--activation-bytes-per-token", str(34 * 4096 * 32), "--json"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cli_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out = {"library_cpu_s": times, "geometries": n, "gpu_counts": len(r.rows), "cli_cpu_s": cli_cpu,
           "scalar_baseline_cpu_s": scalar_s, "scalar_baseline_geometries": n_scalar,
           "speedup_vs_scalar": scalar_s / min(times),
           "cli_ok": proc.returncode == 0, "pass": max(times) < 2.0 and cli_cpu < 2.0 and proc.returncode == 0}
    print("\n[5] timing: 7B model, h100-ib, 1 … 10,000 GPUs, TP 1–8 × PP 1–16")
    print(f"    library: {min(times):.2f}–{max(times):.2f} s CPU for {n:,} geometries over {len(r.rows)} GPU counts; "
          f"baseline (the same {n_scalar:,} geometries one by one with the scalar step_time, costing only): "
          f"{scalar_s:.2f} s = {scalar_s / min(times):.1f}× the search; "
          f"the command end to end (interpreter, imports, JSON): {cli_cpu:.2f} s CPU: "
          f"{'PASS' if out['pass'] else 'FAIL'} (< 2 s)")
    return out


# ---------------------------------------------------------------------------
# T. Transfer across model sizes
# ---------------------------------------------------------------------------

def check_transfer(sweep: str, sweep2: str) -> dict:
    from globalbatch.critical import AnalysisSettings
    from globalbatch.lab.sweep.store import analyze_sweep_seeds

    _, a1 = analyze_sweep_seeds(sweep)
    targets = [st.target for st in a1.targets]
    try:
        _, a2 = analyze_sweep_seeds(sweep2, settings=AnalysisSettings(targets=targets))
    except ValueError as exc:
        print(f"\n[T] transfer: the second sweep does not reach the first one's targets ({exc})")
        return {"error": str(exc)}
    from globalbatch.cli.scale import _task_params
    from globalbatch.lab.sweep.store import load_sweep

    params = [_task_params(d.config.task, dict(d.config.task_overrides)) for d in (load_sweep(sweep), load_sweep(sweep2))]
    rows = []
    print("\n[T] transfer: B_crit(L) at the common targets, two model sizes (joint fit of each sweep): "
          f"{params[0]:,.0f} vs {params[1]:,.0f} parameters")
    for st1, st2 in zip(a1.targets, a2.targets):
        if a1.joint is None or a2.joint is None:
            break
        b1, b2 = a1.joint.b_crit(st1.target), a2.joint.b_crit(st2.target)
        i1, i2 = a1.joint.interval(st1.target), a2.joint.interval(st2.target)
        overlap = not (i1[1] < i2[0] or i2[1] < i1[0])
        per = [(st.b_crit, st.interval()) for st in (st1, st2)]
        rows.append({"target": st1.target, "b_crit_1": b1, "interval_1": list(i1), "b_crit_2": b2, "interval_2": list(i2),
                     "ratio": b2 / b1, "intervals_overlap": overlap,
                     "per_target_median_1": per[0][0], "per_target_interval_1": per[0][1],
                     "per_target_median_2": per[1][0], "per_target_interval_2": per[1][1]})

        def _pt(x):
            b, iv = x
            return "n/a" if b is None else f"{b:.0f}" + (f" [{iv[0]:.0f}–{iv[1]:.0f}]" if iv else "")
        print(f"    L = {st1.target:.4f}: joint {b1:6.0f} [{i1[0]:.0f}–{i1[1]:.0f}] vs {b2:6.0f} [{i2[0]:.0f}–{i2[1]:.0f}] "
              f"tokens, ratio {b2 / b1:.2f}, intervals {'overlap' if overlap else 'DISJOINT'}; per-target median over "
              f"seeds {_pt(per[0])} vs {_pt(per[1])}")
    k = [a1.joint.k if a1.joint else None, a2.joint.k if a2.joint else None]
    print(f"    d ln B_crit / d ln L: {k[0]:.2f} vs {k[1]:.2f}; warnings of the second sweep: "
          + ("; ".join(a2.warnings[:4]) or "none"))
    return {"rows": rows, "k": k, "params": params, "warnings_2": list(a2.warnings)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", help="A finished 3-seed tinygpt demo sweep (default: run one into --work/demo).")
    ap.add_argument("--sweep2", help="The same grid at another model size (check T).")
    ap.add_argument("--checks", default="1,2,3,4,5,T")
    ap.add_argument("--work", default="/tmp/scale_validation")
    ap.add_argument("--out", default=None, help="Write the results as JSON here.")
    ap.add_argument("--steps", type=int, default=20, help="Timed steps per geometry and round (check 2).")
    ap.add_argument("--rounds", type=int, default=5, help="Interleaved measurement rounds (check 2).")
    ap.add_argument("--cluster", default=None, help="Check 2: this cluster description (YAML) instead of measuring one.")
    ap.add_argument("--measure-cluster", default=None, metavar="FILE.yaml",
                    help="Only measure the 2-process gloo cluster and write its description here.")
    ap.add_argument("--steptime-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cluster-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--overhead-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steptime_worker:
        steptime_worker(args.steptime_worker, args.steps)
        return
    if args.overhead_worker:
        overhead_worker(args.overhead_worker)
        return
    if args.cluster_worker:
        cluster_worker(args.cluster_worker)
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.measure_cluster:
        print(json.dumps(measure_cluster(Path(args.measure_cluster), work), indent=2))
        return
    checks = set(args.checks.split(","))
    sweep = args.sweep
    if sweep is None and checks & {"1", "4", "T"}:
        sweep = str(work / "demo")
        if not (Path(sweep) / "report").exists():
            subprocess.run([sys.executable, "-m", "globalbatch.cli", "demo", "--out", sweep], env=_env(), check=True)
    results: dict = {}
    for name, fn in (("1", lambda: check_lobo(sweep)), ("2", lambda: check_step_time(work, args.steps, args.cluster, args.rounds)),
                     ("3", check_llama3), ("4", lambda: check_ramp(sweep, work)), ("5", lambda: check_timing(sweep)),
                     ("T", lambda: check_transfer(sweep, args.sweep2) if args.sweep2 else None)):
        if name in checks:
            results[name] = fn()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=float))
    print("\nsummary: " + ", ".join(f"{k}: {'PASS' if isinstance(v, dict) and v.get('pass') else 'see above'}"
                                   for k, v in results.items()))


if __name__ == "__main__":
    main()
