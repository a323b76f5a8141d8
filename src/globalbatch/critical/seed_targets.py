"""The critical batch over seeds, one target at a time: common targets and the per-target results.

McCandlish et al. 2018 (arXiv 1812.06162, eq. 2.11) fit S(B) = S_min·(1 + B_crit/B) to the
steps each batch needs to reach a loss. What a single run gives is one noisy draw: the data order
and the initialisation move steps-to-target by tens of per cent (a 4.5× range of B_crit over five
seeds with a training-loss read-out, measured on the demo task). For a sweep run with several seeds:

1. **Common targets** (:func:`common_targets`, on the curves at each batch's one LR,
   :mod:`globalbatch.critical.lr_choice`): losses every batch × seed reaches with a margin (on the
   monotone fit of its held-out curve at that LR), none of them reached before the end of LR warmup;
   the batch set is the same at every target.
2. **Per target** (:func:`target_over_seeds`): steps- and examples-to-target per batch and seed at the
   batch's **one LR** (:func:`common_lr` at the primary target, held for every target and seed: the LR a
   practitioner would run that batch at). Each seed's own best LR at each target selects that
   seed's luck where the large batches' best LR sits at the edge of stability, and mixes runs
   across targets: on the tinygpt demo grid, 5 seeds, the worst max/min of B_crit across seeds
   over 5 targets was 1.72 with per-seed best LRs, 1.62 with one LR per target, 1.40 with one
   LR per batch and the targets it reaches (docs/sweep.md). Then a monotonicity check per seed (steps must
   not rise with the batch; examples are not checked: flat in the perfect-scaling regime; 3 % slack), the
   hyperbola fit per seed, their median and range, and a fit of the median steps with a bootstrap over
   seeds. Non-monotone cells are flagged and left out of every fit.
3. **Each seed's S_min partially pooled** toward one shared by the monotone seeds
   (:mod:`globalbatch.critical.pooled`): each seed keeps its own B_crit, refitted at an S_min moved from its own
   fit's toward the shared one by the James–Stein weight of the extra-sum-of-squares F statistic, at most half its
   own SE. Each target states the test, its p-value and the weights (:attr:`SeedTarget.pooled`).
4. **Whether the seeds differ** (:mod:`globalbatch.critical.seed_spread`): the F-test of one B_crit shared by the
   monotone seeds, each with its own S_min (:attr:`SeedTarget.seed_spread`) — whether the seed range is the seeds'
   own or their estimates' noise.

The fit across targets is :mod:`globalbatch.critical.joint`; the whole analysis with its
recommendation, :mod:`globalbatch.critical.seeds`. Pure numpy/scipy; no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, cast

import numpy as np

from globalbatch.critical.curves import Curve, ema_smooth, steps_to_target
from globalbatch.critical.errors import NoAnswerError, TargetNotReachedError
from globalbatch.critical.fit import HyperbolaFit, fit_hyperbola
from globalbatch.critical.pooled import POOL_ALPHA, PooledFit, pooled_for_target
from globalbatch.critical.readout import heldout_fit
from globalbatch.critical.recommend import TargetResult, points_for_target
from globalbatch.critical.seed_spread import SeedSpread, seed_spread_for_target
from globalbatch.errors import SettingError

__all__ = ["MONOTONE_SLACK", "N_BOOT", "SeedTarget", "censored_median", "common_targets", "check_targets_reached",
           "is_monotone", "common_lr", "target_over_seeds",
           "pooling_summary"]


MONOTONE_SLACK = 0.03
"""Relative slack of the monotonicity check (interpolation between evaluations is not exact)."""
N_BOOT = 400
"""Bootstrap resamples of the seeds (the median-steps fit, the joint fit)."""


def bootstrap_rng(seed: int = 0) -> np.random.Generator:
    """The analyses' bootstrap generator (seeded: the same sweep gives the same intervals)."""
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------


def _fit_at(curve: Curve, examples: float) -> float:
    """The read-out's fit of a curve's held-out loss (:func:`heldout_fit`) at ``examples`` (linear in log examples)."""

    e, y = cast(np.ndarray, curve.eval_examples), cast(np.ndarray, curve.eval_loss)  # held-out curves only
    ok = np.isfinite(y) & (e > 0)
    if not ok.any():
        return math.inf
    e, y = e[ok], heldout_fit(e[ok], y[ok])
    if examples <= e[0]:
        return float(y[0])
    return float(np.interp(math.log(examples), np.log(e), y))


def _smoothed_as_eval(c: Curve, min_window_examples: Optional[float]) -> Curve:
    """A copy of ``c`` whose "held-out" points are its lag-corrected, EMA-smoothed training loss (for targets)."""
    from dataclasses import replace

    n = c.loss.size
    half = max(0.5, 0.05 * n, (min_window_examples or 0.0) / c.batch_size)
    sm, lag = ema_smooth(c.loss, half)
    at = np.unique(np.clip(np.round(np.geomspace(1, max(n - 1, 1), 60)).astype(int), 0, n - 1))  # n = 1: step 0
    steps = np.maximum(at - lag[at], 0.0)
    ex = np.interp(steps, np.arange(0, n + 1, dtype=float), np.concatenate([[0.0], c.examples]))
    keep = ex > 0
    return replace(c, eval_examples=ex[keep], eval_steps=steps[keep], eval_loss=sm[at][keep])


def common_targets(curves: Sequence[Curve], n_targets: int = 5, *, margin: float = 0.08,
                   top: float = 0.75, readout: str = "heldout",
                   min_window_examples: Optional[float] = None) -> list[float]:
    """``n_targets`` held-out losses, loosest first, that every batch × seed reaches with a margin.

    floor = the worst (highest) over batches and seeds of the best final loss over that
    batch's LRs (monotone fit); ceiling = the lowest over batches and seeds of the best loss
    at the end of LR warmup (at the first evaluation when there is no warmup). Targets are
    evenly spaced from floor + ``top``·(ceiling − floor) down to floor + ``margin``·(ceiling − floor),
    so no cell reaches one during warmup. When the largest batch learns little within the
    budget the range is narrow (measured on the demo config: 3.06 → 2.99 nats); a ceiling from
    the largest batch alone was tried and was worse (targets inside the small batches' warmup:
    40 % monotone cells instead of 80 %).
    With ``readout="train"`` the curves are the lag-corrected EMA of the training loss.
    """
    if readout == "train":
        curves = [_smoothed_as_eval(c, min_window_examples) for c in curves if c.loss.size]
    cells: dict[tuple[float, int], list[Curve]] = {}
    for c in curves:
        if c.eval_loss is not None:
            if not (np.asarray(c.eval_examples) > 0).any():
                raise NoAnswerError(f"trial {c.label or c.batch_size!r}: no loss reading after its first step; "
                                    "raise the budget")
            cells.setdefault((c.batch_size, c.seed), []).append(c)
    if not cells:
        raise SettingError("readout", "heldout", "train (these curves have no held-out evaluations)")
    ev = {id(c): cast(np.ndarray, c.eval_examples) for cs in cells.values() for c in cs}  # each has evaluations
    floor = max(min(_fit_at(c, float(ev[id(c)].max())) for c in cs) for cs in cells.values())
    ceiling = min(min(_fit_at(c, max(c.warmup_examples, float(ev[id(c)][ev[id(c)] > 0].min())))
                      if (ev[id(c)] > 0).any() else math.inf
                      for c in cs) for cs in cells.values())
    if not (math.isfinite(floor) and math.isfinite(ceiling)) or ceiling <= floor:
        raise NoAnswerError(f"targets: no common loss range (after warmup {ceiling:.4g}, worst final {floor:.4g}): "
                            f"raise the budget or lower the warmup")
    span = ceiling - floor
    return [float(x) for x in np.linspace(floor + top * span, floor + margin * span, n_targets)]


def check_targets_reached(curves: Sequence[Curve], targets: Sequence[float], *, readout: str = "heldout",
                          min_window_examples: Optional[float] = None) -> None:
    """Raise :class:`TargetNotReachedError` (field ``targets``) when a given target lies below the lowest loss
    any trial's read-out reaches (the monotone fit of its held-out curve, or its smoothed training loss): no
    batch reaches it, so nothing at that target can be answered."""
    if readout == "train":
        curves = [_smoothed_as_eval(c, min_window_examples) for c in curves if c.loss.size]
    lows = [_fit_at(c, float(np.max(cast(np.ndarray, c.eval_examples)))) for c in curves
            if c.eval_loss is not None and c.eval_loss.size]
    lows = [x for x in lows if math.isfinite(x)]  # a diverged trial's curve has no low
    if not lows or not targets:
        return
    low = min(lows)
    below = [t for t in targets if t < low]
    if below:
        shown = math.ceil(low * 1e4) / 1e4  # rounded up: a target of exactly this value is reached
        name = "held-out" if readout == "heldout" else "smoothed training"
        raise TargetNotReachedError(
            "targets", below[0], f"targets ≥ {shown:.4f}",
            why=f"no batch reaches {', '.join(f'{t:g}' for t in below)}; the lowest {name} loss any trial "
                f"reached is {shown:.4f}")


# ---------------------------------------------------------------------------
# Per target
# ---------------------------------------------------------------------------


def is_monotone(batches: Sequence[float], steps: Sequence[float], examples: Sequence[float],
                slack: float = MONOTONE_SLACK) -> bool:
    """Steps non-increasing in the batch (within ``slack``).

    Examples are not checked: in the perfect-scaling regime E is flat in B and its noise
    decides the sign (measured on MNIST: a 3 % rule on E flagged 88 % of the cells whose
    steps halve cleanly with every doubling of the batch). ``examples`` is kept for callers.
    """
    order = np.argsort(batches)
    s = np.asarray(steps, dtype=float)[order]
    return bool(np.all(s[1:] <= s[:-1] * (1 + slack)))


def _usable(fit: Optional[HyperbolaFit]) -> bool:
    return fit is not None and fit.degenerate is None and not fit.extrapolated


@dataclass(kw_only=True)
class SeedTarget:
    target: float
    per_seed: dict[int, TargetResult]
    steps: dict[float, dict[int, Optional[float]]]
    """Batch (units per step) → seed → steps to target (None: not reached)."""
    examples: dict[float, dict[int, Optional[float]]]
    best_lr: dict[float, dict[int, Optional[float]]]
    monotone: dict[int, bool]
    reached_in_warmup: list[str] = field(default_factory=list)
    """``"batch B seed S"`` cells whose best LR reached the target before the end of warmup."""
    b_crit_per_seed: dict[int, Optional[float]] = field(default_factory=dict)
    """Per-seed B_crit: None when that seed's cell is non-monotone, its fit degenerate or extrapolated."""
    b_crit_text_per_seed: dict[int, str] = field(default_factory=dict)
    b_crit: Optional[float] = None
    """Median over the fitted seeds of their B_crit, a seed that only bounds it counted by its bound
    (:func:`censored_median`); None where that median is itself only a bound (:attr:`b_crit_median_bound`)."""
    b_crit_bound_per_seed: dict[int, tuple[str, float]] = field(default_factory=dict)
    """Seed → ``("lower", X)`` (B_crit > X: every batch in the perfect-scaling regime) or ``("upper", X)`` where its
    fit gives a one-sided bound instead of a point."""
    b_crit_median_bound: Optional[tuple[str, float]] = None
    """``("lower", X)``: the median over seeds is > X (at least half the seeds only give lower bounds); ``("upper", X)``
    likewise; None where the median is a point (:attr:`b_crit`) or there is nothing to take it over."""
    b_crit_range: Optional[tuple[float, float]] = None
    median_fit: Optional[HyperbolaFit] = None
    """Fit of the median steps over the monotone seeds."""
    b_crit_boot: Optional[tuple[float, float]] = None
    """2.5–97.5 % of the median-steps fit's B_crit over bootstrap resamples of the seeds."""
    joint_b_crit: Optional[float] = None
    joint_interval: Optional[tuple[float, float]] = None
    lr_selection: str = "per_batch"
    """How each batch's LR was chosen here: ``"per_batch"`` (one LR per batch for every target, chosen at
    the primary target) or ``"per_target"`` (re-chosen at this target, :data:`LR_SELECTIONS`)."""
    lr_selection_reason: str = ""
    """Why, in one sentence (stated in the report and the JSON)."""
    pooled: Optional[PooledFit] = None
    """The partially pooled fit of the monotone seeds and its F-test (None: fewer than 2 such seeds, or pooling off);
    its B_crit are the per-seed values."""
    b_crit_own_per_seed: dict[int, Optional[float]] = field(default_factory=dict)
    """Per-seed B_crit from each seed's own two-parameter fit (what :attr:`b_crit_per_seed` holds without pooling)."""
    seed_spread: Optional[SeedSpread] = None
    """The F-test of one B_crit shared by the monotone seeds (:mod:`globalbatch.critical.seed_spread`): whether their
    spread is the seeds' or their estimates' (None: fewer than 2 such seeds)."""

    @property
    def pooling_text(self) -> str:
        """One line: whether this target's per-seed B_crit share S_min, and the test that decided it."""
        return self.pooled.text() if self.pooled is not None else "per-seed fits (fewer than 2 seeds to pool)"

    @property
    def all_monotone(self) -> bool:
        return all(self.monotone.values())

    @property
    def interval_source(self) -> str:
        """What :meth:`interval` is, in words (its label on the report page)."""
        fitted = [s for s, v in self.b_crit_per_seed.items() if v is not None]
        if len(fitted) == 1:
            return f"seed {fitted[0]}'s own 95 % CI, the only seed with a point; not the seed-to-seed spread"
        return "seed range ∪ bootstrap 95 %"

    @property
    def median_text(self) -> str:
        """The median over seeds in words: ``"1,234"``, ``"> 512"`` (at least half the seeds only bound it from
        below; how many), or ``"–"``."""
        if self.b_crit is not None:
            return f"{self.b_crit:,.0f}"
        if self.b_crit_median_bound is None:
            return "–"
        kind, x = self.b_crit_median_bound
        return f"{'>' if kind == 'lower' else '<'} {x:,.0f} ({self.bound_note})"

    @property
    def bound_note(self) -> str:
        """``"2 of 3 seeds give only a lower bound"`` for :attr:`b_crit_median_bound`'s side ("" without one)."""
        if self.b_crit_median_bound is None:
            return ""
        kind = self.b_crit_median_bound[0]
        n = sum(1 for s, b in self.b_crit_bound_per_seed.items() if b[0] == kind and self.b_crit_per_seed.get(s) is None)
        return f"{n} of {len(self.monotone)} seeds give only {'a lower' if kind == 'lower' else 'an upper'} bound"

    def interval(self) -> Optional[tuple[float, float]]:
        """The stated uncertainty of B_crit here: the hull of the seed range and the bootstrap interval; with one
        fitted seed, that seed's own 95 % interval (which does not contain the seed-to-seed spread)."""
        fitted = [s for s, v in self.b_crit_per_seed.items() if v is not None]
        if self.b_crit is None:  # no point (or only a bound) to put an interval around
            return None
        if len(fitted) == 1:
            if self.pooled is not None and fitted[0] in self.pooled.b_crit:
                return self.pooled.interval(fitted[0])
            return self.per_seed[fitted[0]].b_crit_ci95
        parts = [x for x in (self.b_crit_range, self.b_crit_boot) if x is not None]
        if not parts:
            return None
        return min(p[0] for p in parts), max(p[1] for p in parts)


def _median_steps_fit(st: SeedTarget, seeds: Sequence[int]) -> Optional[HyperbolaFit]:
    batches = [b for b in sorted(st.steps) if all(st.steps[b].get(s) is not None for s in seeds)]
    if len(batches) < 3 or not seeds:
        return None
    med = [float(np.median([st.steps[b][s] for s in seeds])) for b in batches]
    try:
        return fit_hyperbola(batches, med)
    except NoAnswerError:
        return None


def common_lr(curves: Sequence[Curve], target: float, *, readout: str = "heldout",
              min_window_examples: Optional[float] = None) -> dict[float, float]:
    """Batch → the one LR used for every seed at ``target``: the fewest seeds that never reach the
    target first (an LR that leaves seeds behind would keep only the lucky ones in the fits), then
    the least median steps-to-target over the seeds, then the smaller LR."""
    seeds = sorted({c.seed for c in curves})
    cells: dict[tuple[float, float], dict[int, Curve]] = {}
    for c in curves:
        cells.setdefault((c.batch_size, c.lr), {})[c.seed] = c
    best: dict[float, tuple[int, float, float]] = {}
    for (b, lr), by_seed in cells.items():
        steps = []
        for s in seeds:
            cs_ = by_seed.get(s)
            r = steps_to_target(cs_, target, readout=readout, min_window_examples=min_window_examples) if cs_ else None
            steps.append(r[0] if r is not None else math.inf)
        key = (sum(math.isinf(x) for x in steps), float(np.median(steps)), lr)
        if b not in best or key < best[b]:
            best[b] = key
    return {b: k[2] for b, k in best.items()}


def pooling_summary(targets: Sequence[SeedTarget]) -> str:
    """One line for an analysis: how far each target's per-seed S_min were pooled, and the F-test's p-values."""
    tested = [(st.target, st.pooled) for st in targets if st.pooled is not None]
    if not tested:
        return "per-seed fits at every target (fewer than 2 monotone seeds to pool S_min)"
    first = tested[0][1]
    rejected = [f"{t:.4f}" for t, p in tested if not p.shared]
    return (f"S_min partially pooled at {len(tested)} of {len(targets)} target(s), each seed keeping w = 1 − 1/F of its "
            f"own deviation (limited to {first.limit_se:g} SE): " + ", ".join(
                f"{t:.4f} w {p.weight:.2f} (p {p.p_value:.3f})" for t, p in tested)
            + (f"; the F-test rejects one shared S_min (p < {first.alpha:g}) at {', '.join(rejected)}" if rejected else ""))


def censored_median(points: Sequence[float], bounds: Sequence[tuple[str, float]]) -> tuple[Optional[float],
                                                                                            Optional[tuple[str, float]]]:
    """The median over seeds where some give only a one-sided bound: ``(value, None)`` when it is a point, or
    ``(None, ("lower", X))`` / ``(None, ("upper", X))`` when it is only bounded. Each seed's B_crit lies in
    [lo, hi] — a point v in [v, v], ``("lower", x)`` in [x, ∞), ``("upper", x)`` in (0, x] — and the median is monotone
    in every seed's value, so it lies in [median of the lo, median of the hi]; both are equal when the seeds at the
    middle are points. ``(None, None)`` without seeds."""
    lo = [float(v) for v in points] + [x if k == "lower" else 0.0 for k, x in bounds]
    hi = [float(v) for v in points] + [math.inf if k == "lower" else x for k, x in bounds]
    if not lo:
        return None, None
    m_lo, m_hi = float(np.median(lo)), float(np.median(hi))
    if m_lo == m_hi:
        return m_lo, None
    if math.isinf(m_hi):
        return None, ("lower", m_lo)
    if m_lo == 0.0:
        return None, ("upper", m_hi)
    return None, ("lower", m_lo)  # bounds on both sides of the middle: the lower one is what the seeds support


def _use_pooled(st: SeedTarget, pooled: Optional[PooledFit]) -> None:
    """Record the partially pooled fit; its B_crit become the per-seed values (a seed whose B_crit lies beyond the
    swept batches gets no point, as with its own fit)."""
    st.pooled = pooled
    st.b_crit_own_per_seed = dict(st.b_crit_per_seed)
    if pooled is None:
        return
    for s in pooled.seeds:
        v = pooled.b_crit[s]
        if pooled.inside(s):
            lo, hi = pooled.interval(s)
            st.b_crit_per_seed[s] = v
            st.b_crit_text_per_seed[s] = (f"{v:,.0f} (95% CI {lo:,.0f}–{hi:,.0f}; S_min partially pooled, kept "
                                          f"{pooled.weight_per_seed[s]:.2f})")
        else:
            side = ">" if v > max(pooled.batches) else "<"
            edge = max(pooled.batches) if side == ">" else min(pooled.batches)
            st.b_crit_per_seed[s] = None
            st.b_crit_bound_per_seed[s] = ("lower" if side == ">" else "upper", float(edge))
            st.b_crit_text_per_seed[s] = (f"B_crit {side} {edge:,.0f} (partially pooled fit {v:,.0f}, beyond the swept "
                                          f"batches; own fit: {st.b_crit_text_per_seed.get(s, '–')})")


def target_over_seeds(curves: Sequence[Curve], target: float, *, readout: str = "heldout",
                      min_window_examples: Optional[float] = None, rng_seed: int = 0,
                      pool_alpha: Optional[float] = POOL_ALPHA) -> SeedTarget:
    """Steps per batch and seed (at each batch's :func:`common_lr`), monotonicity, per-seed fits and
    their spread at one ``target``; with ``pool_alpha`` (None: off) the per-seed B_crit come from each seed's
    partially pooled S_min, the F-test's verdict stated at that level (:mod:`globalbatch.critical.pooled`)."""
    seeds = sorted({c.seed for c in curves})
    if len({(c.batch_size, c.lr) for c in curves}) > len({c.batch_size for c in curves}):  # not yet one LR per batch
        lr_of = common_lr(curves, target, readout=readout, min_window_examples=min_window_examples)
        curves = [c for c in curves if c.lr == lr_of[c.batch_size]]
    per_seed = {s: points_for_target([c for c in curves if c.seed == s], target, readout=readout,
                                     min_window_examples=min_window_examples) for s in seeds}
    batches = sorted({c.batch_size for c in curves})
    steps: dict[float, dict[int, Optional[float]]] = {b: {s: None for s in seeds} for b in batches}
    examples: dict[float, dict[int, Optional[float]]] = {b: {s: None for s in seeds} for b in batches}
    best_lr: dict[float, dict[int, Optional[float]]] = {b: {s: None for s in seeds} for b in batches}
    warm = {c.batch_size: c.warmup_examples for c in curves}
    in_warmup = []
    for s, tr in per_seed.items():
        for p in tr.points:
            steps[p.batch_size][s], examples[p.batch_size][s], best_lr[p.batch_size][s] = p.steps, p.examples, p.lr
            if p.examples < warm.get(p.batch_size, 0.0):
                in_warmup.append(f"batch {p.batch_size:,.0f} seed {s}")
    monotone = {}
    for s, tr in per_seed.items():
        pts = sorted(tr.points, key=lambda p: p.batch_size)
        monotone[s] = not tr.unreached and is_monotone([p.batch_size for p in pts], [p.steps for p in pts],
                                                       [p.examples for p in pts])
    st = SeedTarget(target=float(target), per_seed=per_seed, steps=steps, examples=examples, best_lr=best_lr,
                    monotone=monotone, reached_in_warmup=in_warmup)
    for s, tr in per_seed.items():
        if not monotone[s]:
            st.b_crit_per_seed[s] = None
            st.b_crit_text_per_seed[s] = ("not reached by every batch" if tr.unreached
                                          else "non-monotone steps: not fitted")
        elif tr.fit is None:
            st.b_crit_per_seed[s] = None
            st.b_crit_text_per_seed[s] = tr.fit_error or "no fit"
        else:
            st.b_crit_per_seed[s] = tr.fit.b_crit if _usable(tr.fit) else None
            st.b_crit_text_per_seed[s] = tr.fit.b_crit_text()
            if (bound := tr.fit.b_crit_bound(0.95)) is not None:
                st.b_crit_bound_per_seed[s] = bound
    good = [s for s in seeds if monotone[s]]
    st.seed_spread = seed_spread_for_target(batches, steps, good)
    _use_pooled(st, pooled_for_target(batches, steps, good, alpha=pool_alpha) if pool_alpha is not None else None)
    vals = [v for v in st.b_crit_per_seed.values() if v is not None]
    st.b_crit, st.b_crit_median_bound = censored_median(
        vals, [b for s, b in st.b_crit_bound_per_seed.items() if st.b_crit_per_seed.get(s) is None])
    if vals:
        st.b_crit_range = (float(min(vals)), float(max(vals)))
    st.median_fit = _median_steps_fit(st, good)
    if len(good) >= 2:
        gen = bootstrap_rng(rng_seed)
        boots: list[float] = []
        cache: dict[tuple, Optional[float]] = {}  # the median depends only on the multiset drawn
        for _ in range(N_BOOT):
            draw = tuple(sorted(int(x) for x in gen.choice(good, size=len(good), replace=True)))
            if draw not in cache:
                f = _median_steps_fit(st, list(draw))
                cache[draw] = f.b_crit if f is not None and _usable(f) else None
            b_draw = cache[draw]
            if b_draw is not None:
                boots.append(b_draw)
        if len(boots) >= N_BOOT // 2:
            st.b_crit_boot = (float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5)))
    return st
