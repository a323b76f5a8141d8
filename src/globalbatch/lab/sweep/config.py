"""The sweep's grid and training recipe (:class:`SweepConfig`), its trials, and the demo configuration."""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from globalbatch._util import SettingError
from globalbatch.lab.device import PRECISIONS
from globalbatch.lab.loop import default_micro_batch
from globalbatch.optim import optimizer_names

__all__ = ["SweepConfig", "TrialSpec", "demo_config", "MANIFEST_VERSION", "BACKENDS", "RAY_HINT"]

MANIFEST_VERSION = 2  # 2: device and precision in the grid; optimizers from the registry
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
    """Peak learning rates; every batch is trained at every LR."""
    budget: int
    """Loss-bearing units (tokens for a token task, samples otherwise) each trial trains on."""
    seed: int = 0
    """Seed of the model initialisation and of the shared data order."""
    micro_batch: Optional[int] = None
    """Samples per forward/backward; None: min(batch, 16) (must divide every batch)."""
    eval_every: Optional[int] = None
    """Units between validation evaluations; None: budget ÷ 8."""
    max_val_samples: int = 256
    """Evaluate on the first this many validation samples (same ones every time)."""
    optimizer: str = "adamw"
    """A name in the optimizer registry (:mod:`globalbatch.optim`): ``adamw`` (betas 0.9/0.95), ``sgd`` (momentum 0.9), ..."""
    weight_decay: float = 0.0
    warmup_fraction: float = 0.05
    """Linear LR warmup over this fraction of ``budget`` (in units, so the same for every batch)."""
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
        if not self.batches or any(isinstance(b, bool) or int(b) != b or b < 1 for b in self.batches) \
                or len(set(self.batches)) != len(self.batches):
            raise E("batches", list(self.batches), "distinct whole numbers ≥ 1, e.g. 16,32,64")
        self.batches = [int(b) for b in self.batches]
        if not self.lrs or any(not (float(x) > 0 and math.isfinite(float(x))) for x in self.lrs) \
                or len(set(self.lrs)) != len(self.lrs):
            raise E("lrs", [float(x) for x in self.lrs], "distinct finite numbers > 0, e.g. 3e-4,1e-3")
        self.lrs = [float(x) for x in self.lrs]
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or int(self.budget) != self.budget \
                or self.budget < 1:
            raise E("budget", self.budget, "a whole number of units ≥ 1, e.g. 2M")
        self.budget = int(self.budget)
        if isinstance(self.seed, bool) or int(self.seed) != self.seed or self.seed < 0:
            raise E("seed", self.seed, "a whole number ≥ 0")
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
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise E("warmup_fraction", self.warmup_fraction, "0 ≤ warmup_fraction < 1")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise E("max_grad_norm", self.max_grad_norm, "a number > 0, or None (no clipping)")
        if not isinstance(self.task_overrides, dict):
            raise E("task_overrides", self.task_overrides, "a dict of task overrides")

    def micro_batch_for(self, batch: int) -> int:
        """Samples per micro-batch for a trial of ``batch`` samples."""
        return default_micro_batch(batch, self.micro_batch, at_least_two=self.noise)

    def eval_every_units(self) -> int:
        return self.eval_every if self.eval_every is not None else max(1, self.budget // 8)

    def trials(self) -> list["TrialSpec"]:
        """Every (batch, LR) pair, smallest batch and LR first."""
        return [TrialSpec(batch=b, lr=lr) for b, lr in itertools.product(sorted(self.batches), sorted(self.lrs))]

    def manifest(self) -> dict[str, Any]:
        """The grid as stored in ``manifest.json`` (what a resumed sweep must match)."""
        d = asdict(self)
        d["batches"] = sorted(d["batches"])
        d["lrs"] = sorted(d["lrs"])
        return {"version": MANIFEST_VERSION, "grid": d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SweepConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(kw_only=True, frozen=True)
class TrialSpec:
    batch: int
    """Global batch in samples per step."""
    lr: float

    @property
    def name(self) -> str:
        return f"b{self.batch}_lr{self.lr:g}"


def demo_config() -> SweepConfig:
    """The ``globalbatch demo`` sweep: a 2-layer, width-64 tinygpt, 5 batches × 3 LRs, 300K tokens each.

    Sized for ≤ 5 minutes on 2 CPU cores (docs/sweep.md has the measured time).
    """
    return SweepConfig(
        task="tinygpt",
        task_overrides={"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 64, "max_corpus_bytes": 2_000_000},
        batches=[4, 8, 16, 32, 64],
        lrs=[1e-3, 3e-3, 1e-2],
        budget=300_000,
        max_val_samples=128,
    )
