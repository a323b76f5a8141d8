"""The branch test: measure the critical batch directly from checkpoints of one small-batch run.

Merrill et al. 2025, "Critical Batch Size Revisited: A Simple Empirical Approach to
Large-Batch Language Model Training" (AI2, arXiv 2505.23971), §3: from a checkpoint of a
run at a small batch B, branch short runs at k·B with the learning rate scaled by √k
(Adam; × k for SGD), train every branch on the same number of tokens, and compare the
smoothed losses. The critical batch at that checkpoint is the largest k·B whose loss
stays within a tolerance (they used 0.01) of the k = 1 branch. They found it far above
the gradient noise scale for Adam, and growing from near 0 to a plateau during training.

Here every branch point (``branch_at``, units trained by the base run, after the base
run's LR warmup) gets ``seeds`` branches per k. Seed s fixes the order of the data the
branch sees after the checkpoint, the same for every k. The window is counted in
samples: ``window`` units are converted with the base run's measured units per sample
and rounded **up** to a multiple of max(ks)·base_batch samples, so every k-branch takes a
whole number of steps, all branches of a seed train on exactly the same samples and stop
at the same sample (the k-branch consumes the 1-branch's samples k steps' worth at a
time). The rounded window is stated in the output.

The loss compared is, by default, the validation loss at the end of the window on a
fixed set of held-out samples (``metric="val"``): every branch is scored at its final
parameters on the same data. ``metric="train"`` (the token-weighted training loss of
the steps in the last quarter of the window) is kept as an option but is **biased
against large k**: each step's loss is measured before its update, so a k-branch's
tail losses are taken at parameters that are up to one (k times larger) step staler.

Its statistics (the decision per k, B_crit(L) over points) are in :mod:`globalbatch.lab.branch_stats`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from globalbatch._util import SettingError, atomic_write_json, read_json_checked
from globalbatch.lab.tasks import load_task_checked
from globalbatch.lab.device import PRECISIONS, check_device
from globalbatch.lab.branch_stats import (TESTS, BranchCurve, CurvePoint, KVerdict, Verdicts, branch_curve,
                                           branch_verdicts, evenly_spaced_points)
from globalbatch.lab.loop import default_micro_batch
from globalbatch.lab.rundir import check_manifest, known_fields, lock_run_dir
from globalbatch.validate import make_out_dir, whole
from globalbatch.validate import out_dir as out_dir_checked
from globalbatch.optim import lr_scaling_rule, optimizer_names

__all__ = ["BranchConfig", "KVerdict", "Verdicts", "PointResult", "BranchResult", "CurvePoint", "BranchCurve",
           "branch_verdicts", "branch_curve", "evenly_spaced_points", "run_branch_test", "load_branch_results"]

METRICS = ("val", "train")
TOLERANCE_RULES = ("absolute", "half_window")
SECOND_MOMENTS = ("keep", "scaled", "split")
MANIFEST_VERSION = 3  # 2: the window in samples, rounded up to max(ks)·base_batch; 3: device, precision, registry optimizers


@dataclass(kw_only=True)
class BranchConfig:
    """One base run and its branches; everything here is in ``manifest.json``."""

    task: str = "tinygpt"
    task_overrides: dict[str, Any] = field(default_factory=dict)
    base_batch: int = 16
    """Global batch of the base run, in samples (sequences) per step."""
    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """Batch multipliers; must include 1 (the reference branch)."""
    lr: float = 1e-3
    """Peak LR of the base run at ``base_batch``; a k-branch scales it by the optimizer's rule (√k for adamw, k for sgd)."""
    optimizer: str = "adamw"
    """A name in the optimizer registry (:mod:`globalbatch.optim`)."""
    branch_at: list[int]
    """Units (tokens or samples) the base run has trained at each branch point."""
    window: int
    """Units every branch trains after its branch point."""
    window_fraction: Optional[float] = None
    """Instead of ``window``: each point's window is this fraction of that point's units (rounded up the same
    way), so early points get short windows and late ones long (B_crit is read locally at every point)."""
    seeds: int = 3
    """Branches per (point, k), each with its own data order; at least 2 for the test."""
    seed: int = 0
    """Seed of the model initialisation and the base run's data order."""
    micro_batch: Optional[int] = None
    """Samples per forward/backward; None: min(batch, 16)."""
    base_warmup_fraction: float = 0.05
    """The base run warms its LR up linearly over this fraction of the last branch point."""
    tolerance: float = 0.01
    """Loss (per unit) a k-branch may lose against k = 1 before it counts as worse (Merrill: 0.01)."""
    tolerance_rule: str = "absolute"
    """``absolute``: ``tolerance`` at every point (Merrill et al.). ``half_window``: at each point the loss the
    k = 1 branches drop over the second half of the window (mean over seeds) — the loss a branch at
    McCandlish et al.'s B_crit gives up (it needs twice the examples), so the critical k·B reads B_crit
    (module docstring); needs ``metric="val"``."""
    alpha: float = 0.05
    metric: str = "val"
    test: str = "paired"
    max_val_samples: int = 256
    max_grad_norm: Optional[float] = 1.0
    device: str = "cpu"
    """``cpu``, ``cuda``, ``cuda:N`` or ``mps``; in the manifest."""
    precision: str = "fp32"
    """``fp32``, ``bf16`` or ``fp16``; in the manifest."""
    second_moment: str = "keep"
    """The base run's Adam second moments at a k-branch: ``keep`` them (the checkpoint as it is), ``scaled``:
    divided by k, the noise-dominated limit E[g²] ≈ tr Σ / batch (a diagnostic: a large-k branch otherwise starts
    with the small batch's larger ``exp_avg_sq``, which shrinks its first ≈ 1/(1 − β₂) steps), or ``split``: only
    the noise part divided by k, per coordinate, from the first moment (:func:`split_second_moment`)."""

    def __post_init__(self) -> None:
        self.ks = sorted(int(k) for k in self.ks)
        self.branch_at = sorted(int(x) for x in self.branch_at)
        E = SettingError
        if not 0.0 <= self.base_warmup_fraction < 1.0:
            raise E("base_warmup_fraction", self.base_warmup_fraction, "0 ≤ base_warmup_fraction < 1")
        if 1 not in self.ks or any(k < 1 for k in self.ks) or len(set(self.ks)) != len(self.ks) or len(self.ks) < 2:
            raise E("ks", self.ks, "distinct whole numbers ≥ 1 including 1 (the reference branch) and at least one k > 1, "
                    "e.g. 1,2,4,8")
        if self.base_batch < 1:
            raise E("base_batch", self.base_batch, "a whole number ≥ 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise E("lr", self.lr, "a finite number > 0")
        if self.optimizer not in optimizer_names():
            raise E("optimizer", self.optimizer, ", ".join(f"{n} (LR × {'√k' if lr_scaling_rule(n) == 'sqrt' else 'k'})"
                                                           for n in optimizer_names()))
        if self.precision not in PRECISIONS:
            raise E("precision", self.precision, ", ".join(PRECISIONS))
        if not self.branch_at or self.branch_at[0] < 1:
            raise E("branch_at", self.branch_at, "one or more branch points ≥ 1 unit")
        if self.window < 1:
            raise E("window", self.window, "a whole number of units ≥ 1")
        if self.window_fraction is not None and not (0 < self.window_fraction <= 100 and math.isfinite(self.window_fraction)):
            raise E("window_fraction", self.window_fraction, "a fraction of each branch point's units, 0 < f ≤ 100")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise E("micro_batch", self.micro_batch, "a whole number ≥ 1")
        warm = self.base_warmup_units()
        early = [p for p in self.branch_at if p < warm]
        if early:
            raise E("branch_at", early, "branch points after the base run's LR warmup (branches train at the constant "
                    "peak LR × multiplier)",
                    why=f"inside the warmup: the first {warm:,} units = base_warmup_fraction {self.base_warmup_fraction} "
                        f"× the last branch point {self.branch_at[-1]:,}")
        if self.seeds < 2:
            raise E("seeds", self.seeds, "a whole number ≥ 2 (the test needs two seeds per k)")
        whole(self.seed, "seed", minimum=0)  # before the run directory's manifest is written
        if not self.tolerance >= 0 or not math.isfinite(self.tolerance):
            raise E("tolerance", self.tolerance, "a loss difference ≥ 0 (Merrill et al.: 0.01)")
        if not 0 < self.alpha < 1:
            raise E("alpha", self.alpha, "0 < alpha < 1 (e.g. 0.05)")
        if self.metric not in METRICS:
            raise E("metric", self.metric, ", ".join(METRICS))
        if self.tolerance_rule not in TOLERANCE_RULES:
            raise E("tolerance_rule", self.tolerance_rule, ", ".join(TOLERANCE_RULES))
        if self.tolerance_rule == "half_window" and self.metric != "val":
            raise E("tolerance_rule", self.tolerance_rule, "absolute with metric train",
                    why="the half-window rule reads the k = 1 branches' validation loss half-way through the window")
        if self.test not in TESTS:
            raise E("test", self.test, ", ".join(TESTS))
        if self.second_moment not in SECOND_MOMENTS:
            raise E("second_moment", self.second_moment, ", ".join(SECOND_MOMENTS))

    def base_warmup_units(self) -> int:
        """Units over which the base run warms its LR up (branch points must not be earlier)."""
        return int(self.base_warmup_fraction * self.branch_at[-1]) if self.branch_at else 0

    def window_samples(self, units_per_sample: float, point: Optional[int] = None) -> int:
        """The window in samples: ``window`` units (or ``window_fraction`` × ``point``) rounded up to a multiple of
        max(ks)·base_batch."""
        quantum = max(self.ks) * self.base_batch
        units = self.window if self.window_fraction is None or point is None else self.window_fraction * point
        samples = math.ceil(units / max(float(units_per_sample), 1e-12) - 1e-9)
        return max(1, math.ceil(samples / quantum)) * quantum

    def lr_for(self, k: int) -> float:
        """The branch LR: √k scaling for Adam-type optimizers, linear for SGD."""
        from globalbatch.plan import scale_lr

        return float(scale_lr(self.lr, self.base_batch, k * self.base_batch, lr_scaling_rule(self.optimizer)))

    def micro_batch_for(self, batch: int) -> int:
        return default_micro_batch(batch, self.micro_batch)

    def manifest(self) -> dict[str, Any]:
        d = asdict(self)
        # The decision settings do not change any run: they may differ on a rerun.
        for key in ("tolerance", "tolerance_rule", "alpha", "metric", "test"):
            d.pop(key)
        if d["window_fraction"] is None:  # as before it existed: older directories stay resumable
            d.pop("window_fraction")
        if d["second_moment"] == "keep":
            d.pop("second_moment")
        return {"version": MANIFEST_VERSION, "branch": d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BranchConfig":
        return cls(**known_fields(cls, d))


# ---------------------------------------------------------------------------
# Running the base run and the branches
# ---------------------------------------------------------------------------


def split_second_moment(state: dict, k: int, betas: Optional[tuple[float, float]]) -> None:
    """A k-branch's Adam ``exp_avg_sq`` with only its noise share divided by k (``second_moment="split"``).

    Over one parameter tensor, after t steps at batch B, Adam's bias-corrected second moment v̂ ≈ g² + n per
    coordinate (the squared mean gradient and the noise variance σ²/B) and its first moment's square m̂² ≈ g² + c·n,
    c = (1 − β₁)/(1 + β₁) (the variance left in an EMA of independent noise). So the tensor's noise share is
    f = Σ(v̂ − m̂²) / ((1 − c)·Σv̂), clipped to [0, 1] (summed over the tensor: one coordinate's EMAs are too noisy
    to split it alone), and at batch kB its second moment is v̂·(1 − f + f/k): ``keep`` where the gradient is all
    signal, ``scaled`` (÷ k) where it is all noise (McCandlish et al. 2018's noise-dominated regime). Edits
    ``state`` in place."""
    if betas is None or "exp_avg" not in state or "step" not in state:
        raise ValueError("second_moment='split' needs an Adam-type optimizer state (exp_avg, exp_avg_sq, step, betas)")
    beta1, beta2 = betas
    t = float(state["step"])
    v = state["exp_avg_sq"]
    v_sum = float(v.sum()) / (1 - beta2 ** t)
    m_sq = float((state["exp_avg"] * state["exp_avg"]).sum()) / (1 - beta1 ** t) ** 2
    c = (1 - beta1) / (1 + beta1)
    share = min(max((v_sum - m_sq) / ((1 - c) * v_sum), 0.0), 1.0) if v_sum > 0 else 0.0
    v.mul_(1 - share + share / k)


def _train(exp, order, batch: int, until_units: Optional[int] = None, n_steps: Optional[int] = None,
           tail_from_step: Optional[int] = None, after_step: Optional[Any] = None) -> tuple[float, float, list[int]]:
    """Train ``exp`` (a :class:`globalbatch.lab.loop.Experiment`) until ``trained_units >= until_units`` (the
    base run) or for exactly ``n_steps`` windows of ``batch`` samples (a branch); returns (token-weighted
    training loss of the windows from index ``tail_from_step`` on, seconds, the sample ids drawn)."""

    tail_loss = tail_units = 0.0
    drawn: list[int] = []
    t0 = time.perf_counter()
    i_step = 0
    driver = exp.driver
    while (driver.trained_units < until_units) if n_steps is None else (i_step < n_steps):
        w = exp.train_window(order, batch)
        drawn.extend(w.drawn)
        res = w.result
        if tail_from_step is not None and i_step >= tail_from_step and not res.skipped:
            tail_loss += res.loss_per_unit * res.global_units
            tail_units += res.global_units
        i_step += 1
        if after_step is not None:  # an evaluation: its seconds are not training
            t_eval = time.perf_counter()
            after_step(i_step)
            t0 += time.perf_counter() - t_eval
    return (tail_loss / tail_units if tail_units else math.nan), time.perf_counter() - t0, drawn


@dataclass(kw_only=True)
class PointResult:
    branch_at: int
    verdicts: list[KVerdict]
    critical_k: int
    """Largest k not significantly worse than k = 1 (every smaller k too)."""
    critical_k_shown: int
    """Largest k *shown* within tolerance (every smaller k too); ≤ critical_k."""
    critical_batch: int
    """critical_k × base_batch, in samples per step."""
    critical_batch_units: float
    """The same in units (tokens) per step, from the measured mean units per sample."""
    tolerance: float = math.nan
    """The tolerance the decision used here (``tolerance``, or the half-window rule's drop)."""


@dataclass(kw_only=True)
class BranchResult:
    out_dir: str
    config: BranchConfig
    unit: str
    points: list[PointResult]
    branches: list[dict]
    window_samples: int = 0
    """The window every branch trained on, in samples (``window`` rounded up to a multiple of max(ks)·base_batch)."""
    window_units: float = 0.0
    """The same in units, from the base run's units per sample."""
    window_samples_by_point: dict[int, int] = field(default_factory=dict)
    """Branch point → its window in samples (all equal to ``window_samples`` unless ``window_fraction``; then
    ``window_samples`` is the last point's)."""
    compute_s: float
    """Training seconds of the base run and every branch (evaluation excluded), summed."""
    wall_s: float
    """Wall-clock of this call (0 work when everything was already done)."""
    curve: Optional[BranchCurve] = None
    """B_crit(L) over the branch points (two or more points), :func:`branch_curve`."""

    def to_dict(self) -> dict:
        return {**asdict(self), "curve": None if self.curve is None else self.curve.to_dict()}

    def text(self) -> str:
        c = self.config
        metric = ("validation loss (fixed held-out samples, end of window)" if c.metric == "val"
                  else "training loss of the last quarter (biased against large k)")
        window = (f"window {c.window:,} {self.unit}s → {self.window_samples:,} samples (≈{self.window_units:,.0f} "
                  f"{self.unit}s; " if c.window_fraction is None else
                  f"window {c.window_fraction:g} × each point's {self.unit}s → "
                  f"{', '.join(f'{w:,}' for w in self.window_samples_by_point.values())} samples (")
        lines = [f"branch test: base batch {c.base_batch}, lr {c.lr:g} ({c.optimizer}: LR × {'√k' if c.optimizer == 'adamw' else 'k'}), "
                 + window +
                 f"rounded up to a multiple of max k × base batch = {max(c.ks) * c.base_batch}, the same samples for every k), "
                 f"{c.seeds} seeds, {c.test} one-sided t-test, alpha {c.alpha}, "
                 + (f"tolerance {c.tolerance}" if c.tolerance_rule == "absolute" else
                    "tolerance at each point = the k = 1 branches' loss drop over the window's second half "
                    "(half-window rule: the critical k·B reads McCandlish's B_crit)")
                 + f" on the {metric}",
                 "a k passes when it is not significantly worse AND its mean loss is within the tolerance of k = 1"]
        for p in self.points:
            lines.append(f"at {p.branch_at:,} {self.unit}s: critical k = {p.critical_k} → batch {p.critical_batch} "
                         f"(≈{p.critical_batch_units:,.0f} {self.unit}s); shown within tolerance up to k = {p.critical_k_shown}"
                         + (f"; tolerance {p.tolerance:.4f}" if c.tolerance_rule != "absolute" else ""))
            for v in p.verdicts:
                if v.k == 1:
                    lines.append(f"  k=1: loss {v.mean:.4f} ± {v.std:.4f} (reference)")
                else:
                    lines.append(f"  k={v.k}: loss {v.mean:.4f} ± {v.std:.4f}, diff {v.diff:+.4f} "
                                 f"(upper {1 - c.alpha:.0%} bound {v.upper:+.4f}), p = {v.p_value:.3g} → {v.status} "
                                 f"({'pass' if v.passes else 'fail'})")
        if self.curve is not None:
            lines.append(self.curve.text())
        lines.append(f"compute: {self.compute_s:,.1f} s of training")
        return "\n".join(lines)


def _branch_name(point: int, k: int, seed: int) -> str:
    return f"p{point}_k{k}_s{seed}"


def run_branch_test(config: BranchConfig, out_dir: str | os.PathLike, *, threads: Optional[int] = None,
                    progress: bool = True) -> BranchResult:
    """Run the base run (checkpointing at every branch point) and every branch; resumable.

    Finished branches (``branches/<name>.json``) and base checkpoints are reused on a
    rerun into the same ``out_dir``; a different ``seeds`` adds (or leaves out) seeds'
    branches, any other changed run setting is an error. Settings and the task are
    checked before anything is written.
    """
    # Every setting is checked, and the task built, before anything is written.
    if threads is not None:
        whole(threads, "threads")
    check_device(config.device, config.precision)
    task = load_task_checked(config.task, config.task_overrides)
    out = out_dir_checked(out_dir, "out")
    make_out_dir(out, "out")
    with lock_run_dir(out):  # a second branch test into this directory: one error line, exit 2
        return _run_locked(config, out, task, threads=threads, progress=progress)


def _run_locked(config: BranchConfig, out: Path, task: Any, *, threads: Optional[int], progress: bool) -> BranchResult:
    """:func:`run_branch_test` once the settings are checked and ``out`` is locked."""
    import torch

    from globalbatch.checkpoint import load_checkpoint, save_checkpoint
    from globalbatch.lab.loop import Experiment
    from globalbatch.schedule import LRSchedule

    check_manifest(out, config.manifest(), section="branch", mutable=("seeds",))
    if threads is not None:
        torch.set_num_threads(int(threads))
    t_wall = time.time()
    unit = task.unit

    def fresh(batch: int, lr: float, lr_schedule=None):
        return Experiment(task, batch=batch, micro_batch=config.micro_batch_for(batch), optimizer=config.optimizer,
                          lr=lr, max_grad_norm=config.max_grad_norm, seed=config.seed, lr_schedule=lr_schedule,
                          device=config.device, precision=config.precision)

    n_total = len(config.branch_at) * len(config.ks) * config.seeds
    bar = _bar(progress, n_total + 1)

    # 1. The base run, checkpointing at every branch point (one run; resumed from its last checkpoint).
    ckpt_dir = out / "base"
    base_meta_path = ckpt_dir / "base.json"
    base_meta = (_read_base_meta(base_meta_path, out) if base_meta_path.is_file()
                 else {"train_time_s": 0.0, "units_per_sample": None, "unit": unit})
    missing_ckpts = [p for p in config.branch_at if not (ckpt_dir / f"ckpt_{p}.pt").is_file()]
    if missing_ckpts:
        warm = config.base_warmup_units()
        sched = LRSchedule(peak_lr=config.lr, total=config.branch_at[-1], warmup=warm, shape="constant")  # in the task's unit
        exp = fresh(config.base_batch, config.lr, sched)
        model, opt, driver = exp.model, exp.optimizer, exp.driver
        order = task.sample_order(config.seed)
        done = [p for p in config.branch_at if p not in missing_ckpts]
        if done:  # resume the base run from its latest checkpoint
            extra = load_checkpoint(ckpt_dir / f"ckpt_{done[-1]}.pt", driver, map_location=exp.device)
            for _ in range(int((extra or {})["samples_drawn"])):
                next(order)
        for p in config.branch_at:
            if p in done:
                continue
            _, secs, _ = _train(exp, order, config.base_batch, until_units=p)
            base_meta["train_time_s"] += secs
            base_meta["units_per_sample"] = driver.trained_units / max(driver.trained_samples, 1)
            save_checkpoint(ckpt_dir / f"ckpt_{p}.pt", driver,
                            extra={"samples_drawn": driver.consumed_samples, "trained_units": driver.trained_units})
            atomic_write_json(base_meta_path, base_meta)
    bar.advance()

    # 2. The branches: every one trains on exactly ``w_samples`` samples (a whole number of steps for every k).
    ups = float(base_meta.get("units_per_sample") or 1.0)
    quantum = max(config.ks) * config.base_batch
    branches: list[dict] = []
    for p in config.branch_at:
        w_samples = config.window_samples(ups, p)
        # metric="train": the steps over the last quarter, starting at the same sample for every k.
        tail_sample = min(math.ceil(0.75 * w_samples / quantum) * quantum, w_samples - quantum)
        for k in config.ks:
            for s in range(config.seeds):
                name = _branch_name(p, k, s)
                path = out / "branches" / f"{name}.json"
                if path.is_file():
                    branches.append(_read_branch(path, out))
                    bar.advance()
                    continue
                batch = k * config.base_batch
                lr_k = config.lr_for(k)
                exp = fresh(batch, lr_k)
                model, opt, driver = exp.model, exp.optimizer, exp.driver
                state = torch.load(ckpt_dir / f"ckpt_{p}.pt", map_location=exp.device, weights_only=True)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])  # Adam moments continue; the LR is set next
                if config.second_moment != "keep" and k > 1:
                    for g in opt.param_groups:
                        for st in (opt.state[q] for q in g["params"] if "exp_avg_sq" in opt.state.get(q, {})):
                            if config.second_moment == "scaled":
                                st["exp_avg_sq"].div_(k)
                            else:
                                split_second_moment(st, k, g.get("betas"))
                for g in opt.param_groups:
                    g["lr"] = lr_k
                # Same order for every k at this seed: k-branches consume the 1-branch's samples k at a time,
                # and all stop after the same w_samples samples.
                order = task.sample_order(config.seed + 1 + 1000 * (config.branch_at.index(p)) + s)
                mid: dict[str, float] = {}
                n_steps = w_samples // batch

                def at_mid(i: int, n_half: int = n_steps // 2, exp: Any = exp, mid: dict = mid) -> None:
                    if i == n_half:  # the k = 1 branch half-way: the half-window tolerance rule reads it
                        mid["val"] = exp.evaluate(config.max_val_samples)

                tail, secs, drawn = _train(exp, order, batch, n_steps=n_steps, tail_from_step=tail_sample // batch,
                                           after_step=at_mid if k == 1 and n_steps >= 2 else None)
                val = exp.evaluate(config.max_val_samples)
                rec = {"name": name, "branch_at": p, "k": k, "seed": s, "batch": batch, "lr": lr_k,
                       "units": driver.trained_units, "samples": driver.trained_samples, "steps": driver.optimizer_steps,
                       "window_samples": w_samples, "samples_sha1": hashlib.sha1(json.dumps(drawn).encode()).hexdigest(),
                       "skipped": driver.skipped_windows, "val_loss": val, "train_tail_loss": tail, "train_time_s": secs}
                if "val" in mid:
                    rec["val_loss_mid"] = mid["val"]
                atomic_write_json(path, rec)
                branches.append(rec)
                bar.advance()
    bar.stop()
    return _summarise(out, config, unit, branches, base_meta, time.time() - t_wall)


def _summarise(out: Path, config: BranchConfig, unit: str, branches: list[dict], base_meta: dict, wall: float) -> BranchResult:
    key = "val_loss" if config.metric == "val" else "train_tail_loss"
    points = []
    ups = base_meta.get("units_per_sample") or 1.0
    by_point: dict[int, dict[int, Sequence[float]]] = {}
    drops: Optional[dict[int, Sequence[float]]] = {} if config.tolerance_rule == "half_window" else None
    for p in config.branch_at:
        losses: dict[int, Sequence[float]] = {}
        for k in config.ks:
            rows = sorted((b for b in branches if b["branch_at"] == p and b["k"] == k), key=lambda b: b["seed"])
            losses[k] = [b[key] for b in rows]
            if k == 1 and drops is not None:
                if any(b.get("val_loss_mid") is None for b in rows):
                    raise SettingError("tolerance_rule", config.tolerance_rule, "absolute",
                                       why=f"the k = 1 branches at {p:,} have no mid-window validation loss "
                                           "(a window of one step, or trained before it was recorded)")
                drops[p] = [float(b["val_loss_mid"]) - float(b["val_loss"]) for b in rows]
        by_point[p] = losses
        tol = config.tolerance if drops is None else max(float(np.mean(drops[p])), 0.0)
        v = branch_verdicts(losses, tolerance=tol, alpha=config.alpha, test=config.test)
        kc = v.critical_k
        points.append(PointResult(branch_at=p, verdicts=v.per_k, critical_k=kc, critical_k_shown=v.critical_k_shown,
                                  critical_batch=kc * config.base_batch,
                                  critical_batch_units=kc * config.base_batch * ups, tolerance=tol))
    compute = float(base_meta.get("train_time_s", 0.0)) + sum(float(b["train_time_s"]) for b in branches)
    by_point_w = {p: config.window_samples(ups, p) for p in config.branch_at}
    w_samples = by_point_w[config.branch_at[-1]]
    curve = (branch_curve(by_point, base_batch_units=config.base_batch * ups, tolerance=config.tolerance,
                          alpha=config.alpha, test=config.test, unit=unit, drops_by_point=drops)
             if len(config.branch_at) >= 2 else None)
    result = BranchResult(out_dir=str(out), config=config, unit=unit, points=points, branches=branches,
                          window_samples=w_samples, window_units=w_samples * ups, window_samples_by_point=by_point_w,
                          compute_s=compute, wall_s=wall,
                          curve=curve)
    atomic_write_json(out / "result.json", result.to_dict())
    return result


def load_branch_results(out_dir: str | os.PathLike, **decision: Any) -> BranchResult:
    """Re-decide a finished branch test (e.g. another ``tolerance``/``alpha``/``test``) without training."""
    out = Path(out_dir)
    path = out / "manifest.json"
    if not path.is_file():
        raise SettingError("out", str(out), "a branch-test directory", why="no manifest.json")
    doc = read_json_checked(path, field="out")
    stored = doc.get("branch") if isinstance(doc, dict) else None
    if not isinstance(stored, dict):
        raise SettingError("out", str(out), "a branch-test directory", why=f"{path} holds no branch test")
    cfg = BranchConfig.from_dict({**stored, **decision})
    branches = []
    for f in sorted((out / "branches").glob("*.json")):
        b = _read_branch(f, out)
        if b["seed"] < cfg.seeds:
            branches.append(b)
    base_meta = _read_base_meta(out / "base" / "base.json", out)
    return _summarise(out, cfg, base_meta.get("unit", "unit"), branches, base_meta, 0.0)


def _read_branch(path: Path, out: Path) -> dict[str, Any]:
    """A branch record, every field the decision reads checked (``train_s`` of older files read as ``train_time_s``)."""
    from globalbatch.lab.records import BRANCH, read_renamed

    return read_renamed(path, BRANCH, run_dir=out, field="out", old_names={"train_s": "train_time_s"})


def _read_base_meta(path: Path, out: Path) -> dict[str, Any]:
    from globalbatch.lab.records import BRANCH_BASE, read_renamed

    return read_renamed(path, BRANCH_BASE, run_dir=out, field="out", old_names={"train_s": "train_time_s"})


class _NoBar:
    def advance(self) -> None: ...

    def stop(self) -> None: ...


class _Bar:
    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import Progress

        self.p = Progress(transient=False, console=Console(stderr=True))
        self.id = self.p.add_task("branch test (base run + branches)", total=total)
        self.p.start()

    def advance(self) -> None:
        self.p.advance(self.id)

    def stop(self) -> None:
        self.p.stop()


def _bar(enabled: bool, total: int):
    return _Bar(total) if enabled else _NoBar()
