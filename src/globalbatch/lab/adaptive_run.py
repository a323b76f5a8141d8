"""``globalbatch adaptive``: an adaptive-batch policy against fixed batches at equal tokens, over seeds.

For every seed, each arm — the fixed batches and the adaptive policy
(:mod:`globalbatch.adaptive`) — trains the same model initialisation on the same data order to
the same token budget through :class:`globalbatch.lab.loop.Experiment`, reading the held-out loss
at log-spaced points. Fixed batches use the adaptive run's LR rule from its base batch
(``lr × √(B/B₀)`` for ``sqrt``), so the arms differ only in how the batch is chosen.

Run directory (resumable: a finished run is skipped; ``manifest.json`` must match except ``seeds`` and the
policy settings, :data:`POLICY_FIELDS`: each policy setting runs in its own ``adaptive-…`` directory beside
the shared fixed-batch runs, so several policies are compared against one set of fixed runs)::

    OUT/manifest.json  events.jsonl
    OUT/runs/<b4|…|adaptive-noise-c1-sqrt-1a2b3c>/s<seed>/metrics.jsonl
        header, one "eval" line per read-out, one "change" line per batch change
    OUT/runs/<arm>/s<seed>/summary.json    the done marker

:func:`analyze_adaptive` reads the runs back: tokens- and steps-to-target per arm with
95 % t-intervals over seeds, the paired ratios adaptive / best fixed batch by tokens, and
whether the adaptive run lies on or beyond the fixed batches' steps–tokens front.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from globalbatch._util import SettingError, atomic_write_json
from globalbatch.adaptive import loglog_interpolate
from globalbatch.lab.adaptive_config import (
    ADAPTIVE_MANIFEST_VERSION,
    POLICIES,
    POLICY_FIELDS,
    AdaptiveConfig,
    eval_points,
)
from globalbatch.lab.records import ArmSummary, damaged, read_records, read_summary
from globalbatch.lab.rundir import append_event, check_manifest, remove_stale_tmp
from globalbatch.validate import whole

__all__ = ["AdaptiveConfig", "run_adaptive", "run_arm", "analyze_adaptive", "AdaptiveAnalysis", "eval_points",
           "POLICIES", "ADAPTIVE_MANIFEST_VERSION"]


def throughput_from_timing(sweep_dir: str | os.PathLike) -> dict[int, float]:
    """Samples/s per batch from a sweep's timing pass (:mod:`globalbatch.lab.sweep.timing`)."""
    from globalbatch.lab.sweep.timing import timing_path

    from globalbatch.lab.records import TIMING, WHOLE, NUMBER, read_record

    table = {}
    for path in sorted(timing_path(Path(sweep_dir), 0).parent.glob("b*.json")):
        rec = read_record(path, {"batch": WHOLE, "steps": WHOLE, "seconds": NUMBER}, {**TIMING[0], **TIMING[1]},
                          run_dir=sweep_dir, field="throughput_from")  # a damaged record is refused, not skipped
        b, steps, secs = rec["batch"], rec["steps"], float(rec["seconds"])
        if secs > 0 and steps > 0:
            table[b] = b * steps / secs  # samples per second: steps × batch samples in secs
    if not table:
        raise SettingError("throughput_from", str(sweep_dir), "a sweep directory with a timing pass (timing/b*.json)")
    return table


def _build_policy(cfg: AdaptiveConfig, throughput: dict[int, float]):
    from globalbatch.adaptive import BatchPolicy, GoodputPolicy, NoiseTrackingPolicy

    if cfg.policy == "noise":
        return NoiseTrackingPolicy(c=cfg.c)
    if cfg.policy == "goodput":
        return GoodputPolicy(throughput=throughput)
    import importlib

    mod, _, fn = cfg.policy.partition(":")
    try:
        factory = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as exc:
        raise SettingError("policy", cfg.policy, "noise, goodput or an importable package.module:function",
                           why=str(exc)) from None
    policy = factory(cfg)
    if not isinstance(policy, BatchPolicy):
        raise SettingError("policy", cfg.policy, "a factory returning an object with name and propose(obs, feasible)")
    return policy


def _run_dir(out: Path, arm: str, seed: int, cfg: AdaptiveConfig) -> Path:
    return Path(out) / "runs" / (cfg.adaptive_dir() if arm == "adaptive" else arm) / f"s{seed}"


def run_done(out: Path, arm: str, seed: int, cfg: AdaptiveConfig) -> bool:
    p = _run_dir(out, arm, seed, cfg) / "summary.json"
    try:
        s = json.loads(p.read_text())
    except (OSError, ValueError):
        return False
    return bool(s.get("completed")) and s.get("arm") == arm and s.get("seed") == seed


def run_arm(cfg: AdaptiveConfig, out: str | os.PathLike, arm: str, seed: int, *,
            throughput: Optional[dict[int, float]] = None) -> dict[str, Any]:
    """Train one arm at one seed to the budget; writes ``metrics.jsonl`` then ``summary.json`` (the done marker)."""
    import torch

    from globalbatch.adaptive import AdaptiveBatchSchedule, FeasibleBatches
    from globalbatch.lab.loop import Experiment
    from globalbatch.lab.tasks import load_task
    from globalbatch.noise import NoiseConfig, NoiseScaleMonitor
    from globalbatch.schedule import LRSchedule

    out = Path(out)
    rdir = _run_dir(out, arm, seed, cfg)
    rdir.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(rdir, also_own=True)
    task = load_task(cfg.task, **cfg.task_overrides)
    unit = task.unit
    adaptive = arm == "adaptive"
    batch = cfg.start_batch if adaptive else int(arm[1:])
    micro = cfg.adaptive_micro_batch if adaptive else min(cfg.micro_batch, batch)
    lr = cfg.fixed_lr(batch)  # the adaptive run's LR at its first batch; changes rescale it from there
    lr_schedule = LRSchedule(peak_lr=lr, total=cfg.budget, warmup=int(cfg.warmup_fraction * cfg.budget),
                             shape="constant")  # in the task's unit (Experiment: StepConfig.unit)
    sched = None
    if adaptive:
        feasible = FeasibleBatches(micro_batch=micro, min_batch=batch, max_batch=cfg.top_batch,
                                   powers_of_two=cfg.powers_of_two)
        sched = AdaptiveBatchSchedule(_build_policy(cfg, throughput or {}), feasible, batch,
                                      lr_rule=cfg.lr_rule, decide_every=cfg.decide_every,
                                      min_interval_steps=cfg.min_interval_steps, patience=cfg.patience)

    def callbacks(model, opt):
        if sched is None:
            return []
        mon = NoiseScaleMonitor(model, optimizer=opt, unit=unit,
                                config=NoiseConfig(sources=("micro",), half_life_windows=cfg.noise_half_life_windows))
        return [mon]  # the schedule (StepConfig.batch_schedule) finds its monitor among the callbacks

    exp = Experiment(task, batch=None if adaptive else batch, batch_schedule=sched, micro_batch=micro,
                     optimizer=cfg.optimizer, lr=lr, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                     seed=seed, lr_schedule=lr_schedule, callbacks=callbacks, device=cfg.device,
                     precision=cfg.precision)
    driver = exp.driver
    order = task.sample_order(seed)
    points = eval_points(cfg.budget, cfg.eval_points)
    tmp = rdir / f"metrics.jsonl.tmp-{os.getpid()}"
    append_event(out, event="start", arm=arm, seed=seed)
    started = time.time()
    train_s = 0.0
    n_changes = 0
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps({"kind": "header", "arm": arm, "seed": seed, "batch": batch, "lr": lr, "micro_batch": micro,
                            "unit": unit, "task": task.name, "config": cfg.manifest()["adaptive"],
                            "device": str(exp.device), "torch": torch.__version__,
                            "python": platform.python_version(), "started_at": started}) + "\n")
        f.write(json.dumps({"kind": "eval", "step": 0, "consumed": 0, "batch": driver.global_batch,
                            "val_loss": exp.evaluate(cfg.max_val_samples), "lr": lr}) + "\n")
        nxt = 0
        while driver.trained_units < cfg.budget:
            t0 = time.perf_counter()
            res = exp.train_window(order).result
            train_s += time.perf_counter() - t0
            if sched is not None and len(sched.history) > n_changes:
                for ch in sched.history[n_changes:]:
                    f.write(json.dumps({"kind": "change", **ch.as_dict(),
                                        "decision": sched.decisions[-1]}, default=float) + "\n")
                n_changes = len(sched.history)
            if nxt < len(points) and driver.trained_units >= points[nxt]:
                f.write(json.dumps({"kind": "eval", "step": driver.optimizer_steps, "consumed": driver.trained_units,
                                    "batch": res.global_batch, "next_batch": driver.global_batch,
                                    "val_loss": exp.evaluate(cfg.max_val_samples), "lr": res.lr,
                                    "train_loss": res.loss_per_unit, "train_s": train_s}) + "\n")
                while nxt < len(points) and driver.trained_units >= points[nxt]:
                    nxt += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, rdir / "metrics.jsonl")
    summary = ArmSummary(arm=arm, seed=seed, batch=batch, lr=lr, steps=driver.optimizer_steps, consumed=driver.trained_units,
                         skipped_windows=driver.skipped_windows, train_time_s=train_s,
                         units_per_s=driver.trained_units / train_s if train_s > 0 else math.nan,
                         final_batch=driver.global_batch, changes=sched.summary() if sched is not None else [],
                         decisions=len(sched.decisions) if sched is not None else 0,
                         wall_time_s=time.time() - started).to_json()
    atomic_write_json(rdir / "summary.json", summary)
    append_event(out, event="done", arm=arm, seed=seed)
    return summary


@dataclass(kw_only=True)
class AdaptiveRunResult:
    ran: list[str]
    skipped: list[str]
    wall_time_s: float


def run_adaptive(cfg: AdaptiveConfig, out: str | os.PathLike, *, threads: Optional[int] = None,
                 log: Any = None) -> AdaptiveRunResult:
    """Run every arm × seed not finished yet, sequentially (fixed arms first: the goodput policy reads their
    measured throughput). Resumable; the manifest must match (``seeds`` may change)."""
    import torch

    from globalbatch.lab.tasks import load_task_checked
    from globalbatch.lab.device import check_device

    if threads is not None:
        whole(threads, "threads")
    check_device(cfg.device, cfg.precision)  # bad input: before anything is written
    load_task_checked(cfg.task, cfg.task_overrides)
    if ":" in cfg.policy:
        _build_policy(cfg, {})
    if cfg.throughput_from is not None:
        throughput_from_timing(cfg.throughput_from)
    from globalbatch.lab.rundir import lock_run_dir
    from globalbatch.validate import make_out_dir
    from globalbatch.validate import out_dir as out_dir_checked

    out = out_dir_checked(out, "out")
    make_out_dir(out, "out")
    with lock_run_dir(out):  # a second comparison into this directory: one error line, exit 2
        check_manifest(out, cfg.manifest(), section="adaptive", mutable=POLICY_FIELDS)
        if threads is not None:
            torch.set_num_threads(max(1, int(threads)))
        return _run_locked(cfg, out, log)


def _run_locked(cfg: AdaptiveConfig, out: Path, log: Any) -> AdaptiveRunResult:
    t0 = time.time()
    ran, skipped = [], []
    for seed in cfg.seeds:
        for arm in cfg.arms():
            name = f"{arm}/s{seed}"
            if run_done(out, arm, seed, cfg):
                skipped.append(name)
                continue
            table = None
            if arm == "adaptive" and cfg.policy == "goodput" and cfg.throughput_from is not None:
                table = throughput_from_timing(cfg.throughput_from)
            elif arm == "adaptive" and cfg.policy == "goodput":
                table = {}
                for b in cfg.batches:
                    if run_done(out, f"b{b}", seed, cfg):
                        fixed = read_summary(ArmSummary, _run_dir(out, f"b{b}", seed, cfg) / "summary.json",
                                             run_dir=out, field="out")
                        tok_per_sample = fixed.consumed / max(1, fixed.steps) / b
                        table[b] = fixed.units_per_s / tok_per_sample
            s = run_arm(cfg, out, arm, seed, throughput=table)
            if log is not None:
                log(f"{name}: {s['steps']} steps, final batch {s['final_batch']}, {s['wall_time_s']:.1f} s")
            ran.append(name)
    return AdaptiveRunResult(ran=ran, skipped=skipped, wall_time_s=time.time() - t0)


# ---------------------------------------------------------------------------- analysis


def _crossing(evals: list[dict], target: float) -> tuple[float, float]:
    """(units, steps) where the held-out loss first reaches ``target``, linearly interpolated between read-outs."""
    prev = None
    for e in evals:
        if e["val_loss"] <= target:
            if prev is None:
                return float(e["consumed"]), float(e["step"])
            w = (prev["val_loss"] - target) / (prev["val_loss"] - e["val_loss"])
            return (prev["consumed"] + w * (e["consumed"] - prev["consumed"]),
                    prev["step"] + w * (e["step"] - prev["step"]))
        prev = e
    return math.nan, math.nan


def _t_interval(values: list[float], log: bool = False) -> dict[str, Any]:
    """Mean (geometric with ``log``) and 95 % t-interval over seeds; NaN when any value is NaN or fewer than 2."""
    import numpy as np
    from scipy import stats

    v = np.asarray(values, dtype=float)
    n = len(v)
    if n == 0 or not np.all(np.isfinite(v)) or (log and np.any(v <= 0)):
        return {"mean": math.nan, "low": math.nan, "high": math.nan, "n": n, "values": list(map(float, v))}
    x = np.log(v) if log else v
    m = float(x.mean())
    if n < 2:
        lo = hi = m
    else:
        half = float(stats.t.ppf(0.975, n - 1) * x.std(ddof=1) / math.sqrt(n))
        lo, hi = m - half, m + half
    f = (lambda z: float(math.exp(z))) if log else float
    return {"mean": f(m), "low": f(lo), "high": f(hi), "n": n, "values": list(map(float, v))}


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The non-dominated (steps, units) points (no other point has both fewer steps and fewer units), by steps."""
    pts = sorted(p for p in points if math.isfinite(p[0]) and math.isfinite(p[1]))
    front: list[tuple[float, float]] = []
    for p in pts:  # ascending steps: keep a point only if it needs fewer units than every point with fewer steps
        if not front or p[1] < front[-1][1]:
            front.append(p)
    return front


def _front_units(points: list[tuple[float, float]], steps: float) -> float:
    """Units on the fixed batches' Pareto front at ``steps``: log-log interpolation between its points; outside its
    step range, the nearest end point's units (flat). Beyond the largest step count the true front can only be
    lower, so the ratio to it is then a lower bound; below the smallest, an upper bound."""
    return loglog_interpolate(pareto_front(points), steps) if math.isfinite(steps) else math.nan


@dataclass(kw_only=True)
class AdaptiveAnalysis:
    target: float
    target_source: str
    arms: dict[str, dict[str, Any]]
    """Per arm: tokens and steps to target (per seed and their intervals), final loss."""
    best_fixed: Optional[str]
    tokens_ratio: dict[str, Any]
    """Adaptive / best fixed tokens-to-target, paired over seeds (geometric mean, 95 % t-interval)."""
    steps_ratio: dict[str, Any]
    front_ratio: dict[str, Any]
    """Adaptive units / the fixed batches' Pareto front's units at the adaptive run's steps, per seed (≤ 1: on or
    beyond the front; see :func:`_front_units` outside the front's step range)."""
    dominated_by: dict[int, list[str]]
    """Per seed: the fixed batches that reached the target in both fewer steps and fewer units than the adaptive run."""
    verdict: str
    seeds: list[int]
    curves: dict[str, dict[int, list[dict]]] = field(repr=False, default_factory=dict)
    changes: dict[int, list[dict]] = field(repr=False, default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("curves")
        return d


Curves = dict[str, dict[int, list[dict]]]


def load_runs(out: str | os.PathLike,
              overrides: Optional[dict[str, Any]] = None) -> tuple[AdaptiveConfig, Curves, dict[int, list[dict]]]:
    """The manifest's config, each finished run's eval records ``curves[arm][seed]`` and the adaptive changes."""
    out = Path(out)
    try:
        man = json.loads((out / "manifest.json").read_text())
        cfg_d = dict(man["adaptive"])
    except (OSError, ValueError, KeyError, TypeError):
        raise SettingError("out", str(out), "a directory written by globalbatch adaptive",
                           why="no readable manifest.json") from None
    seeds = sorted(int(p.name[1:]) for p in (out / "runs").glob("*/s*") if p.name[1:].isdigit())
    cfg = AdaptiveConfig.from_dict({**cfg_d, "seeds": sorted(set(seeds)) or [0], **(overrides or {})})
    curves: dict[str, dict[int, list[dict]]] = {}
    changes: dict[int, list[dict]] = {}
    for arm in cfg.arms():
        for seed in sorted(set(seeds)):
            rdir = _run_dir(out, arm, seed, cfg)
            if not run_done(out, arm, seed, cfg):
                if (rdir / "summary.json").is_file():  # written last and atomically: unreadable or another run's is damage
                    s = read_summary(ArmSummary, rdir / "summary.json", run_dir=out, field="out")
                    raise damaged(out, str(rdir / "summary.json"), f"it names arm {s.arm!r}, seed {s.seed}, not this "
                                  "directory's finished run", field="out")
                continue
            read_summary(ArmSummary, rdir / "summary.json", run_dir=out, field="out")
            recs = read_records(rdir / "metrics.jsonl", run_dir=out, field="out")
            curves.setdefault(arm, {})[seed] = [r for r in recs if r.get("kind") == "eval"]
            if arm == "adaptive":
                changes[seed] = [r for r in recs if r.get("kind") == "change"]
    return cfg, curves, changes


def analyze_adaptive(out: str | os.PathLike, *, target: Optional[float] = None, margin: float = 0.01,
                     policy: Optional[dict[str, Any]] = None, default: str = "all") -> AdaptiveAnalysis:
    """Tokens- and steps-to-target with intervals; the verdict on "within 1.1× the tokens of the best fixed batch
    while taking fewer steps". Only seeds where every arm finished are compared. Without ``target``:
    ``default="all"`` — the worst final loss of any fixed batch and seed + ``margin`` (every fixed batch reaches
    it in every seed); ``"half"`` — the median over fixed batches of their worst seed's final loss + ``margin``.
    ``policy`` selects the adaptive arm by its settings (default: the manifest's, i.e. the last run's)."""
    cfg, curves, changes = load_runs(out, policy)
    arms = cfg.arms()
    seeds = sorted(set.intersection(*[set(curves.get(a, {})) for a in arms])) if curves else []
    if not seeds:
        raise SettingError("out", str(out), "a directory with every arm finished for at least one seed",
                           why="no seed has all arms")
    fixed = arms[:-1]
    final = {a: _t_interval([curves[a][s][-1]["val_loss"] for s in seeds]) for a in arms}
    if target is None:
        import statistics

        if default not in ("all", "half"):
            raise SettingError("default", default, "all or half")
        finals = [max(final[a]["values"]) for a in fixed]  # each fixed batch's worst seed
        if default == "all":
            target = max(finals) + margin
            source = f"every fixed batch reaches it in every seed: worst final loss + {margin:g}"
        else:
            target = statistics.median(finals) + margin
            source = f"about half the fixed batches reach it in every seed: median of their worst final losses + {margin:g}"
    else:
        source = "given"
    per: dict[str, dict[str, Any]] = {}
    cross = {a: {s: _crossing(curves[a][s], target) for s in seeds} for a in arms}
    for a in arms:
        per[a] = {"tokens": _t_interval([cross[a][s][0] for s in seeds]),
                  "steps": _t_interval([cross[a][s][1] for s in seeds]), "final_loss": final[a]}
    reached = [a for a in fixed if math.isfinite(per[a]["tokens"]["mean"])]
    best = min(reached, key=lambda a: per[a]["tokens"]["mean"]) if reached else None
    nan: dict[str, Any] = {"mean": math.nan, "low": math.nan, "high": math.nan, "n": len(seeds), "values": []}
    tok_r, stp_r, front_r = dict(nan), dict(nan), dict(nan)
    dominated: dict[int, list[str]] = {}
    if best is not None:
        tok_r = _t_interval([cross["adaptive"][s][0] / cross[best][s][0] for s in seeds], log=True)
        stp_r = _t_interval([cross["adaptive"][s][1] / cross[best][s][1] for s in seeds], log=True)
        fr = []
        for s in seeds:
            pts = [(cross[a][s][1], cross[a][s][0]) for a in fixed]
            fr.append(cross["adaptive"][s][0] / _front_units(pts, cross["adaptive"][s][1]))
            sa, ea = cross["adaptive"][s][1], cross["adaptive"][s][0]
            tol = 1 - 1e-6  # interpolation rounding: an equal run is not dominated
            dominated[s] = [a for a in fixed if cross[a][s][1] < sa * tol and cross[a][s][0] < ea * tol]
        front_r = _t_interval(fr, log=True)
    verdict = _verdict(tok_r, stp_r, best, len(seeds))
    return AdaptiveAnalysis(target=target, target_source=source, arms=per, best_fixed=best, tokens_ratio=tok_r,
                            steps_ratio=stp_r, front_ratio=front_r, dominated_by=dominated, verdict=verdict,
                            seeds=seeds, curves=curves, changes=changes)


def _verdict(tok: dict, stp: dict, best: Optional[str], n: int) -> str:
    if best is None:
        return "no fixed batch reached the target: no comparison"
    if not math.isfinite(tok["mean"]):
        return "the adaptive run did not reach the target in every seed: NO"
    ci = lambda d: f"{d['mean']:.3f} [{d['low']:.3f}, {d['high']:.3f}]"  # noqa: E731
    head = (f"adaptive / best fixed ({best}) over {n} seeds (geometric mean, 95% t-interval): tokens {ci(tok)}, "
            f"steps {ci(stp)}")
    if tok["high"] <= 1.1 and stp["high"] < 1.0:
        return head + " -> YES: within 1.1x the tokens with fewer steps (both intervals clear)"
    if tok["mean"] > 1.1 or stp["mean"] >= 1.0:
        why = []
        if tok["mean"] > 1.1:
            why.append("more than 1.1x the tokens")
        if stp["mean"] >= 1.0:
            why.append("not fewer steps")
        return head + f" -> NO: {' and '.join(why)}"
    return head + " -> INCONCLUSIVE: the point estimates meet the bar but an interval crosses it"
