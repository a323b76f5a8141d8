"""How each batch's LR is chosen in the analysis over seeds, and the flags on that choice.

A sweep runs every batch at several LRs; the analysis over seeds reads each batch at **one LR** for every
seed (:func:`globalbatch.critical.seed_targets.common_lr`: the least median steps over seeds at the
primary target), so that a seed's luck at an LR on the edge of stability does not select itself
(:func:`one_lr_per_batch`). Where that one LR cannot serve a looser target — it leaves seeds
non-monotone there — :func:`choose_lr_per_target` may re-choose it at that target
(:data:`~globalbatch.critical.settings.LR_SELECTIONS`). Two flags say where the choice is doubtful: a
batch whose LR is an edge of the LRs it ran (:func:`lr_edges`: the optimum may lie beyond) and a chosen
LR that falls as the batch grows (:class:`LrFall`, against the optimizer's rule). Pure numpy; no torch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from globalbatch.critical.curves import Curve
from globalbatch.critical.seed_targets import SeedTarget, common_lr, common_targets, target_over_seeds

__all__ = ["LrFall", "lr_falls", "one_lr_per_batch", "choose_lr_per_target", "lr_edges", "chosen_lr_per_batch"]


def one_lr_per_batch(curves: Sequence[Curve], targets: Sequence[float], *, fixed: bool, n_targets: int,
                     readout: str, min_window_examples: Optional[float]) -> tuple[list[Curve], list[float]]:
    """The curves at each batch's one LR for every seed and target, and the targets (loosest first).

    The LR is the least median steps over seeds at the primary (last) target. Unless the targets are
    ``fixed`` (given by the caller), they then come again from those curves, so that every batch × seed
    reaches each of them at its LR, and the LR is chosen again at the new primary target until nothing
    changes (2–3 passes)."""
    targets = list(targets)
    lr_of: dict[float, float] = {}
    chosen = list(curves)
    for _ in range(4):
        new = common_lr(curves, targets[-1], readout=readout, min_window_examples=min_window_examples)
        if new == lr_of:
            break
        lr_of = new
        chosen = [c for c in curves if c.lr == lr_of.get(c.batch_size)]
        if fixed:
            break
        targets = sorted(common_targets(chosen, n_targets, readout=readout, min_window_examples=min_window_examples),
                         reverse=True)
    return chosen, targets


def _monotone_seeds(st: SeedTarget) -> int:
    return sum(bool(m) for m in st.monotone.values())


def choose_lr_per_target(results: list[SeedTarget], curves: Sequence[Curve], lr_selection: str, *, readout: str,
                         min_window_examples: Optional[float]) -> list[SeedTarget]:
    """``results`` (read at one LR per batch) with each target re-read at LRs re-chosen there where
    ``lr_selection`` says so: ``per_target`` always, ``auto`` where that leaves fewer seeds non-monotone,
    ``per_batch`` never. Each target states the rule it used and why (``lr_selection``/``lr_selection_reason``)."""
    several = len({(c.batch_size, c.lr) for c in curves}) > len({c.batch_size for c in curves})
    out = list(results)
    for i, st in enumerate(out):
        st.lr_selection_reason = ("one LR per batch, chosen at the primary target"
                                  + (" (each batch ran one LR)" if not several else ""))
        if lr_selection == "per_batch" or not several or (lr_selection == "auto" and st.all_monotone):
            continue
        alt = target_over_seeds(curves, st.target, readout=readout, min_window_examples=min_window_examples)
        alt.lr_selection = "per_target"
        if lr_selection == "per_target":
            alt.lr_selection_reason = "LR re-chosen per batch at this target (lr_selection='per_target')"
            out[i] = alt
        elif _monotone_seeds(alt) > _monotone_seeds(st):
            bad = [s for s, m in st.monotone.items() if not m]
            alt.lr_selection_reason = (
                f"LR re-chosen per batch at this target: one LR per batch left seed(s) {', '.join(map(str, bad))} "
                f"non-monotone here ({_monotone_seeds(st)}/{len(st.monotone)} monotone; re-chosen: "
                f"{_monotone_seeds(alt)}/{len(alt.monotone)})")
            out[i] = alt
        else:
            st.lr_selection_reason += (f"; re-choosing the LR at this target leaves as many seeds non-monotone "
                                       f"({_monotone_seeds(alt)}/{len(alt.monotone)} monotone), so it is kept")
    return out


def lr_edges(primary: SeedTarget, curves: Sequence[Curve],
             name: Callable[[float], str]) -> tuple[dict[float, str], list[str]]:
    """Batch → ``"low"``/``"high"`` where its LR at the primary target (the same for every seed) is the smallest
    or largest it ran, and a warning for each (the optimum may lie beyond)."""
    edges: dict[float, str] = {}
    warnings: list[str] = []
    for b, lr in chosen_lr_per_batch(primary).items():
        ran = sorted({c.lr for c in curves if c.batch_size == b})
        if len(ran) >= 2:
            if lr == ran[0] or lr == ran[-1]:
                edges[b] = "low" if lr == ran[0] else "high"
                warnings.append(f"{name(b)}: best LR {lr:g} is the {'smallest' if lr == ran[0] else 'largest'} "
                                f"it ran ({', '.join(f'{x:g}' for x in ran)}): the optimum may lie beyond")
    return edges, warnings


@dataclass(kw_only=True, frozen=True, slots=True)
class LrFall:
    """A chosen LR that falls as the batch grows: ``lr_high`` at ``batch_high`` < ``lr_low`` at ``batch_low``.

    The LR rules across batches raise the LR with the batch (√k for Adam-type, ×k for SGD: Malladi et al. 2022,
    Goyal et al. 2017), so a fall between neighbouring batches says that one of the two LRs is off its optimum
    (a coarse grid, a noisy choice): the steps of those batches — and B_crit — carry it. The sweep refines
    the LR grid around such a pair (``lab/sweep/lr_edges.refine_cells``)."""

    batch_low: float
    """Units per step of the smaller batch."""
    batch_high: float
    lr_low: float
    """The chosen LR of the smaller batch."""
    lr_high: float
    targets: tuple[float, ...]
    """The targets at which the pair was chosen so."""

    def text(self, label: Optional[Callable[[float], str]] = None) -> str:
        name = label if label is not None else (lambda b: f"batch {b:,.0f}")
        where = ", ".join(f"{t:.4f}" for t in self.targets)
        return (f"the chosen LR falls as the batch grows: {name(self.batch_low)} at lr {self.lr_low:g}, "
                f"{name(self.batch_high)} at lr {self.lr_high:g} (target(s) {where}); the optimizer's rule raises "
                f"the LR with the batch (√k Adam-type, ×k SGD), so one of the two is off its optimum")


def chosen_lr_per_batch(st: SeedTarget) -> dict[float, float]:
    """Batch → the LR the analysis reads it at (at the primary target: the one LR for every seed, the least median
    steps over seeds; the most common over seeds where it was re-chosen per seed). The one rule for "the best LR":
    the LR-edge flags, the falling-LR flags and a narrow sweep's transfer (``lab/sweep/lr_edges``) all use it."""
    out = {}
    for b, by_seed in st.best_lr.items():
        lrs = [lr for lr in by_seed.values() if lr is not None]
        if lrs:
            out[b] = Counter(lrs).most_common(1)[0][0]
    return out


def lr_falls(results: Sequence[SeedTarget]) -> list[LrFall]:
    """Neighbouring batches whose LR (as chosen at each target) falls as the batch grows, merged over targets."""
    found: dict[tuple[float, float, float, float], list[float]] = {}
    for st in results:
        lr = chosen_lr_per_batch(st)
        bs = sorted(lr)
        for lo, hi in zip(bs, bs[1:]):
            if lr[hi] < lr[lo] * (1 - 1e-6):
                found.setdefault((lo, hi, lr[lo], lr[hi]), []).append(st.target)
    return [LrFall(batch_low=k[0], batch_high=k[1], lr_low=k[2], lr_high=k[3], targets=tuple(v))
            for k, v in sorted(found.items())]
