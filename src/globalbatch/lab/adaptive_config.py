"""The settings of ``globalbatch adaptive`` (:class:`AdaptiveConfig`): task, fixed arms, policy and recipe,
checked when built; what goes in the manifest, and the held-out read-out points (:func:`eval_points`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from globalbatch._util import SettingError
from globalbatch.lab.device import PRECISIONS
from globalbatch.lab.rundir import known_fields
from globalbatch.lab.sweep.config import demo_config
from globalbatch.optim import optimizer_names
from globalbatch.validate import positive, whole, whole_list

__all__ = ["AdaptiveConfig", "eval_points", "POLICIES", "POLICY_FIELDS", "ADAPTIVE_MANIFEST_VERSION"]

ADAPTIVE_MANIFEST_VERSION = 1
POLICY_FIELDS = ("policy", "c", "initial_batch", "throughput_from", "lr_rule", "max_batch", "powers_of_two", "decide_every", "min_interval_steps",
                 "patience", "noise_half_life_windows")
"""Settings that change only the adaptive arm: they may change between reruns into one directory (each policy
setting gets its own run directory, and the fixed batches' runs are shared)."""
POLICIES = ("noise", "goodput")
"""Built-in policies; ``package.module:function`` names a factory ``f(config) -> BatchPolicy``."""


def _demo_overrides() -> dict[str, Any]:
    return dict(demo_config().task_overrides)


@dataclass(kw_only=True)
class AdaptiveConfig:
    """The comparison: task, fixed arms, policy and recipe. Everything here is in the manifest."""

    task: str = "tinygpt"
    """Task name or ``module:function``."""
    task_overrides: dict[str, Any] = field(default_factory=_demo_overrides)
    """Task overrides; default: the demo's tinygpt (``globalbatch.lab.sweep.demo_config``)."""
    batches: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 64])
    """The fixed global batches (samples) to compare against."""
    lr: float = 3e-3
    """Peak LR at ``base_batch``; every other batch (fixed or adaptive) scales it by ``lr_rule``."""
    base_batch: int = 8
    """The batch ``lr`` belongs to (fixed batch B trains at ``lr × rule(B/base_batch)``)."""
    initial_batch: Optional[int] = None
    """The adaptive run's first batch (default: the smallest fixed batch); its LR follows the same rule, so at
    any batch the adaptive run trains at the fixed run's LR of that batch (sqrt, linear, none)."""
    lr_rule: str = "sqrt"
    """``sqrt``, ``linear``, ``adascale`` (adaptive only; fixed batches then use sqrt) or ``none``."""
    policy: str = "noise"
    """``noise`` (B = c·B_simple on its lower bound), ``goodput`` (Pollux) or ``module:function``."""
    throughput_from: Optional[str] = None
    """Goodput: a sweep directory whose timing pass (``timing/b<batch>.json``) gives samples/s per batch; None: the
    fixed runs of the same seed (each trained alone, in sequence)."""
    c: float = 2.0
    """Noise-tracking multiple: B = c·B_simple (2: tuned on the demo tinygpt, seeds 101 and 102; docs/adaptive.md)."""
    max_batch: Optional[int] = None
    """Largest adaptive batch (default: the largest fixed batch)."""
    powers_of_two: bool = True
    """Adaptive batches are powers of two."""
    decide_every: int = 10
    """Applied steps between decisions."""
    min_interval_steps: int = 50
    """Applied steps between two changes."""
    patience: int = 2
    """Decisions in a row that must agree before a change."""
    noise_half_life_windows: float = 20.0
    """EMA half-life of the noise monitor, in windows of the first batch."""
    budget: int = 300_000
    """Loss-bearing units (tokens) every run trains on."""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """Seeds (model init and data order); every arm runs every seed."""
    micro_batch: int = 4
    """Samples per forward/backward for every arm; the adaptive run uses min(micro_batch, initial_batch ÷ 2)
    (its noise monitor needs ≥ 2 micro-batches per window)."""
    eval_points: int = 24
    """Held-out read-outs, log-spaced over the budget (plus one at 0)."""
    max_val_samples: int = 128
    """Held-out samples per read-out (the same ones every time)."""
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    warmup_fraction: float = 0.05
    """Linear warmup over this fraction of the budget (tokens: the same for every arm)."""
    max_grad_norm: Optional[float] = 1.0
    device: str = "cpu"
    precision: str = "fp32"

    def __post_init__(self) -> None:
        E = SettingError
        self.batches = sorted(whole_list(self.batches, "batches", allowed="distinct whole numbers ≥ 1, e.g. 4,8,16,32,64"))
        positive(self.lr, "lr")
        if self.lr_rule not in ("sqrt", "linear", "adascale", "none"):
            raise E("lr_rule", self.lr_rule, "sqrt, linear, adascale or none")
        if self.policy not in POLICIES and ":" not in self.policy:
            raise E("policy", self.policy, "noise, goodput or package.module:function")
        positive(self.c, "c")
        whole(self.micro_batch, "micro_batch")
        bad = [b for b in self.batches if b % self.micro_batch and b > self.micro_batch]
        if bad:
            raise E("micro_batch", self.micro_batch, "a whole number that divides every batch larger than it",
                    why=f"does not divide {', '.join(map(str, bad))}")
        whole(self.base_batch, "base_batch")
        first = self.start_batch
        if isinstance(first, bool) or not isinstance(first, int) or first < 2 or first % self.adaptive_micro_batch:
            raise E("initial_batch", first, f"a whole number ≥ 2 with ≥ 2 micro-batches of "
                    f"min(micro_batch {self.micro_batch}, batch ÷ 2) (the noise scale needs two)")
        top = self.max_batch if self.max_batch is not None else self.batches[-1]
        if top < first:
            raise E("max_batch", top, f"≥ initial_batch {first}")
        if self.powers_of_two and first & (first - 1):
            raise E("initial_batch", first, "a power of two (or turn off powers_of_two)")
        if isinstance(self.budget, bool) or int(self.budget) != self.budget or self.budget < 1:
            raise E("budget", self.budget, "a whole number of units ≥ 1, e.g. 300K")
        self.budget = int(self.budget)
        self.seeds = whole_list(self.seeds, "seeds", minimum=0,
                                allowed="distinct whole numbers ≥ 0, at least one (≥ 3 for intervals)")
        for name in ("decide_every", "patience", "eval_points"):
            whole(getattr(self, name), name)
        whole(self.min_interval_steps, "min_interval_steps", minimum=0)
        positive(self.noise_half_life_windows, "noise_half_life_windows")
        if self.optimizer not in optimizer_names():
            raise E("optimizer", self.optimizer, ", ".join(optimizer_names()))
        if self.precision not in PRECISIONS:
            raise E("precision", self.precision, ", ".join(PRECISIONS))
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise E("warmup_fraction", self.warmup_fraction, "0 ≤ warmup_fraction < 1")
        if self.max_val_samples < 1:
            raise E("max_val_samples", self.max_val_samples, "a whole number ≥ 1")

    @property
    def start_batch(self) -> int:
        """The adaptive run's first batch."""
        return self.initial_batch if self.initial_batch is not None else self.batches[0]

    @property
    def adaptive_micro_batch(self) -> int:
        b = self.initial_batch if self.initial_batch is not None else self.batches[0]
        return max(1, min(self.micro_batch, b // 2))

    @property
    def top_batch(self) -> int:
        return self.max_batch if self.max_batch is not None else self.batches[-1]

    def arms(self) -> list[str]:
        """``b<batch>`` for each fixed batch, then ``adaptive``."""
        return [f"b{b}" for b in self.batches] + ["adaptive"]

    def adaptive_dir(self) -> str:
        """The adaptive arm's run-directory name: the policy settings, readable, plus a short hash of all of them."""
        import hashlib

        d = {k: getattr(self, k) for k in POLICY_FIELDS}
        h = hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:6]
        name = self.policy.replace(":", "_").replace("/", "_").replace(".", "_")
        return f"adaptive-{name}-c{self.c:g}-{self.lr_rule}-{h}"

    def fixed_lr(self, batch: int) -> float:
        from globalbatch.adaptive import lr_multiplier

        rule = "sqrt" if self.lr_rule == "adascale" else self.lr_rule
        return self.lr * lr_multiplier(rule, batch, self.base_batch)

    def manifest(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("seeds")
        return {"version": ADAPTIVE_MANIFEST_VERSION, "adaptive": d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AdaptiveConfig":
        return cls(**known_fields(cls, d))


def eval_points(budget: int, n: int, first_fraction: float = 1 / 64) -> list[int]:
    """``n`` log-spaced unit counts from ``budget × first_fraction`` to ``budget`` (distinct, ascending)."""
    lo = max(1.0, budget * first_fraction)
    if n == 1:
        return [budget]
    pts = sorted({int(round(lo * (budget / lo) ** (i / (n - 1)))) for i in range(n)})
    pts[-1] = budget
    return pts
