"""The critical batch over seeds: common targets, per-seed fits, one fit across targets, a recommendation.

McCandlish et al. 2018 (arXiv 1812.06162, eq. 2.11) fit S(B) = S_min·(1 + B_crit/B) to the
steps each batch needs to reach a loss; B_crit grows as the loss falls (their fig. 7).
Kaplan et al. 2020 ("Scaling Laws for Neural Language Models", arXiv 2001.08361, eq. 1.4)
write that dependence as a power law, B_crit(L) = B*/L^(1/α_B). What a single run gives
is one noisy draw: the data order and the initialisation move steps-to-target by tens of
per cent (a 4.5× range of B_crit over five seeds with a training-loss read-out, measured on
the demo task). This module reads a sweep run with several seeds:

1. **Common targets** (:func:`common_targets`, on the curves at each batch's one LR, item 2):
   losses every batch × seed reaches with a
   margin (on the monotone fit of its held-out curve at that LR), none of them reached
   before the end of LR warmup; the batch set is the same at every target.
2. **Per target**: steps- and examples-to-target per batch and seed at the batch's **one LR**
   (:func:`common_lr` at the primary target, held for every target and seed: the LR a
   practitioner would run that batch at). Each seed's own best LR at each target selects that
   seed's luck where the large batches' best LR sits at the edge of stability, and mixes runs
   across targets: on the tinygpt demo grid, 5 seeds, the worst max/min of B_crit across seeds
   over 5 targets was 1.72 with per-seed best LRs, 1.62 with one LR per target, 1.40 with one
   LR per batch and the targets it reaches (docs/sweep.md). Then a monotonicity check per seed (steps must not rise with the batch; examples
   are not checked: flat in the perfect-scaling regime; 3 % slack), the hyperbola fit per seed, their median and range, and a fit of the
   median steps with a bootstrap over seeds. Non-monotone cells are flagged and left out
   of every fit.
3. **Jointly** (:func:`fit_joint`): log S = a_t + log(1 + B_crit(L_t)/B) with
   B_crit(L) = B_ref·(L/L_ref)^k over every target and seed (``scipy.optimize.least_squares``),
   SE from the residual-scaled covariance, and a bootstrap over seeds (the seed-to-seed
   spread, which the covariance alone does not see). α_B = −1/k in Kaplan's notation.
4. **Recommendation** (:func:`recommend_over_seeds`): the winner per seed, the probability
   that each batch is the fastest (bootstrap over seeds of the median time to target), time
   to target per batch with its range over seeds, and ties stated as ties.

Pure numpy/scipy; no torch.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, cast

import numpy as np

from globalbatch.critical.curves import Curve, ema_smooth, steps_to_target
from globalbatch.critical.fit import HyperbolaFit, fit_hyperbola
from globalbatch.critical.readout import monotone_fit
from globalbatch.critical.recommend import TargetResult, points_for_target, recommend
from globalbatch.critical.settings import LR_SELECTIONS, AnalysisSettings, settings_from

__all__ = ["SeedTarget", "JointFit", "SeedRecommendation", "SeedAnalysis", "LrFall", "common_targets", "is_monotone",
           "common_lr", "fit_joint", "recommend_over_seeds", "analyze_seeds", "lr_falls", "lr_selection_text", "MONOTONE_SLACK",
           "LR_SELECTIONS"]



MONOTONE_SLACK = 0.03
"""Relative slack of the monotonicity check (interpolation between evaluations is not exact)."""
N_BOOT = 400


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------


def _fit_at(curve: Curve, examples: float) -> float:
    """The monotone fit of a curve's held-out loss at ``examples`` (linear in log examples)."""

    e, y = cast(np.ndarray, curve.eval_examples), cast(np.ndarray, curve.eval_loss)  # held-out curves only
    ok = np.isfinite(y) & (e > 0)
    if not ok.any():
        return math.inf
    e, y = e[ok], monotone_fit(y[ok])
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
                raise ValueError(f"trial {c.label or c.batch_size!r}: no loss reading after its first step; "
                                 "raise the budget (--tokens)")
            cells.setdefault((c.batch_size, c.seed), []).append(c)
    if not cells:
        raise ValueError("curves: no held-out evaluations; use readout='train'")
    ev = {id(c): cast(np.ndarray, c.eval_examples) for cs in cells.values() for c in cs}  # each has evaluations
    floor = max(min(_fit_at(c, float(ev[id(c)].max())) for c in cs) for cs in cells.values())
    ceiling = min(min(_fit_at(c, max(c.warmup_examples, float(ev[id(c)][ev[id(c)] > 0].min())))
                      if (ev[id(c)] > 0).any() else math.inf
                      for c in cs) for cs in cells.values())
    if not (math.isfinite(floor) and math.isfinite(ceiling)) or ceiling <= floor:
        raise ValueError(f"targets: no common loss range (after warmup {ceiling:.4g}, worst final {floor:.4g}): "
                         f"raise the budget or lower the warmup")
    span = ceiling - floor
    return [float(x) for x in np.linspace(floor + top * span, floor + margin * span, n_targets)]


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
    """Median over seeds of the usable per-seed B_crit."""
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

    @property
    def all_monotone(self) -> bool:
        return all(self.monotone.values())

    def interval(self) -> Optional[tuple[float, float]]:
        """The stated uncertainty of B_crit here: the hull of the seed range and the bootstrap interval; with one
        fitted seed, that seed's own 95 % interval (which does not contain the seed-to-seed spread)."""
        fitted = [s for s, v in self.b_crit_per_seed.items() if v is not None]
        if len(fitted) == 1:
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
        fit = fit_hyperbola(batches, med)
    except ValueError:
        return None
    return fit


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


def target_over_seeds(curves: Sequence[Curve], target: float, *, readout: str = "heldout",
                      min_window_examples: Optional[float] = None, rng_seed: int = 0) -> SeedTarget:
    """Steps per batch and seed (at each batch's :func:`common_lr`), monotonicity, per-seed fits and
    their spread at one ``target``."""
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
    vals = [v for v in st.b_crit_per_seed.values() if v is not None]
    if vals:
        st.b_crit = float(np.median(vals))
        st.b_crit_range = (float(min(vals)), float(max(vals)))
    good = [s for s in seeds if monotone[s]]
    st.median_fit = _median_steps_fit(st, good)
    if len(good) >= 2:
        rng = _rng(rng_seed)
        boots: list[float] = []
        cache: dict[tuple, Optional[float]] = {}  # the median depends only on the multiset drawn
        for _ in range(N_BOOT):
            draw = tuple(sorted(int(x) for x in rng.choice(good, size=len(good), replace=True)))
            if draw not in cache:
                f = _median_steps_fit(st, list(draw))
                cache[draw] = f.b_crit if f is not None and _usable(f) else None
            b_draw = cache[draw]
            if b_draw is not None:
                boots.append(b_draw)
        if len(boots) >= N_BOOT // 2:
            st.b_crit_boot = (float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5)))
    return st


# ---------------------------------------------------------------------------
# One fit across targets (Kaplan et al. 2020, B_crit(L) as a power law)
# ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class JointFit:
    """log S = a_t + log(1 + B_crit(L_t)/B), B_crit(L) = b_ref·(L/loss_ref)^k, over every target and seed."""

    b_ref: float
    """B_crit at ``loss_ref``."""
    loss_ref: float
    """Reference loss: the geometric mean of the targets."""
    k: float
    """d ln B_crit / d ln L (negative: B_crit rises as the loss falls). Kaplan's α_B = −1/k."""
    se_log_b_ref: float
    se_k: float
    cov: list[list[float]]
    """Covariance of (ln b_ref, k)."""
    n_points: int
    dof: int
    residual_std_log: float
    boot_log_b_ref: list[float] = field(default_factory=list)
    boot_k: list[float] = field(default_factory=list)
    """The same fit on bootstrap resamples of the seeds."""

    @property
    def alpha_b(self) -> float:
        return -1.0 / self.k if self.k != 0 else math.inf

    def b_crit(self, loss: float) -> float:
        return self.b_ref * (loss / self.loss_ref) ** self.k

    def se_log_b_crit(self, loss: float) -> float:
        g = np.array([1.0, math.log(loss / self.loss_ref)])
        return float(math.sqrt(max(g @ np.asarray(self.cov) @ g, 0.0)))

    def interval(self, loss: float, level: float = 0.95) -> tuple[float, float]:
        """Hull of the covariance interval and the seed-bootstrap percentiles of B_crit(loss)."""
        from scipy import stats

        q = float(stats.t.ppf(0.5 + level / 2, max(self.dof, 1)))
        c = self.b_crit(loss)
        half = min(q * self.se_log_b_crit(loss), 700.0)
        lo, hi = c * math.exp(-half), c * math.exp(half)
        if self.boot_k:
            x = math.log(loss / self.loss_ref)
            boot = np.exp(np.asarray(self.boot_log_b_ref) + np.asarray(self.boot_k) * x)
            a = (1 - level) / 2 * 100
            lo, hi = min(lo, float(np.percentile(boot, a))), max(hi, float(np.percentile(boot, 100 - a)))
        return lo, hi


def _joint_once(rows: list[tuple[int, float, float, float]], targets: list[float], loss_ref: float):
    from scipy.optimize import least_squares

    t_idx = np.array([r[0] for r in rows])
    b = np.array([r[1] for r in rows])
    y = np.log(np.array([r[2] for r in rows]))
    x = np.log(np.array([targets[i] for i in t_idx]) / loss_ref)
    nt = len(targets)
    lb0 = math.log(float(np.median(b)))

    def resid(p):
        return p[t_idx] + np.log1p(np.exp(p[nt] + p[nt + 1] * x) / b) - y

    best = None
    for start in (lb0 - 2, lb0, lb0 + 2):
        p0 = np.zeros(nt + 2)
        p0[nt], p0[nt + 1] = start, -2.0
        for i in range(nt):
            sel = t_idx == i
            p0[i] = float(np.mean(y[sel] - np.log1p(math.exp(start) / b[sel]))) if sel.any() else 0.0
        try:
            r = least_squares(resid, p0, method="trf", x_scale="jac", max_nfev=4000)
        except (ValueError, np.linalg.LinAlgError):
            continue
        if best is None or r.cost < best.cost:
            best = r
    return best


def fit_joint(points: Sequence[tuple[float, int, float, float]], *, n_boot: int = N_BOOT, rng_seed: int = 0) -> JointFit:
    """Fit B_crit(L) jointly over ``(target, seed, batch, steps)`` points (one per monotone cell × batch)."""
    targets = sorted({p[0] for p in points})
    if len(targets) < 2:
        raise ValueError(f"targets: {len(targets)}: the joint fit needs at least 2 targets")
    index = {t: i for i, t in enumerate(targets)}
    rows = [(index[t], b, s, seed) for t, seed, b, s in points]
    if len(rows) < len(targets) + 3:
        raise ValueError(f"points: {len(rows)}: too few for {len(targets) + 2} parameters and a residual")
    loss_ref = float(np.exp(np.mean(np.log(targets))))
    r = _joint_once([(i, b, s, 0) for i, b, s, _ in rows], targets, loss_ref)
    if r is None:
        raise ValueError("fit: least_squares did not converge")
    nt = len(targets)
    dof = len(rows) - (nt + 2)
    sse = float(np.sum(r.fun ** 2))
    try:
        cov = np.linalg.pinv(r.jac.T @ r.jac) * (sse / max(dof, 1))
    except np.linalg.LinAlgError:
        cov = np.full((nt + 2, nt + 2), np.inf)
    sub = cov[np.ix_([nt, nt + 1], [nt, nt + 1])]
    fit = JointFit(b_ref=float(math.exp(r.x[nt])), loss_ref=loss_ref, k=float(r.x[nt + 1]),
                   se_log_b_ref=float(math.sqrt(max(sub[0, 0], 0.0))), se_k=float(math.sqrt(max(sub[1, 1], 0.0))),
                   cov=[[float(v) for v in row] for row in sub], n_points=len(rows), dof=dof,
                   residual_std_log=math.sqrt(sse / dof) if dof > 0 else 0.0)
    seeds = sorted({row[3] for row in rows})
    if len(seeds) >= 2 and n_boot > 0:
        rng = _rng(rng_seed)
        cache: dict[tuple, Optional[tuple[float, float]]] = {}  # least squares depends only on the multiset drawn
        for _ in range(n_boot):
            draw = tuple(sorted(int(x) for x in rng.choice(seeds, size=len(seeds), replace=True)))
            if draw not in cache:
                boot_rows: list[tuple[int, float, float, float]] = [(i, b, s, 0) for d in draw for i, b, s, seed in rows
                                                                    if seed == d]
                rb = _joint_once(boot_rows, targets, loss_ref) if len(set(draw)) > 0 else None
                cache[draw] = None if rb is None else (float(rb.x[nt]), float(rb.x[nt + 1]))
            pair = cache[draw]
            if pair is not None:
                fit.boot_log_b_ref.append(pair[0])
                fit.boot_k.append(pair[1])
    return fit


# ---------------------------------------------------------------------------
# Recommendation over seeds
# ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class SeedRecommendation:
    batch_size: float
    lr: float
    target: float
    per_seed: dict[int, Optional[float]]
    """Seed → the batch (units per step) recommended on that seed alone."""
    probability_fastest: dict[float, float]
    """Batch → share of bootstrap resamples of the seeds in which its median time to target is the least."""
    time_to_target: dict[float, tuple[float, float, float]]
    """Batch → (median, min, max) over seeds of seconds to target (examples ÷ throughput)."""
    tie: list[float]
    """Batches the data cannot separate from the winner (within the tolerance, or fastest in ≥ 20 % of resamples)."""
    reasons: list[str] = field(default_factory=list)

    def text(self) -> str:
        return "\n".join(self.reasons)


def recommend_over_seeds(st: SeedTarget, throughput: dict[float, Optional[float]], *, tolerance: float = 0.05,
                         objective: str = "time", unit: str = "example",
                         label: Optional[Callable[[float], str]] = None, rng_seed: int = 0) -> Optional[SeedRecommendation]:
    """The batch to use at ``st``'s target, with the winner per seed and the probability of being fastest."""
    name = label if label is not None else (lambda b: f"batch {b:,.0f}")
    seeds = sorted(st.monotone)
    batches = [b for b in sorted(st.steps) if all(st.examples[b][s] is not None for s in seeds)]
    if not batches or (objective == "time" and any(not throughput.get(b) for b in batches)):
        return None

    def cost(b: float, s: int) -> float:
        e = cast(float, st.examples[b][s])  # batches: every seed reached the target
        return e / cast(float, throughput[b]) if objective == "time" else e

    per_seed: dict[int, Optional[float]] = {}
    for s in seeds:
        tr = st.per_seed[s]
        pts = [p for p in tr.points if p.batch_size in batches]
        try:
            per_seed[s] = recommend(pts, objective=objective, tolerance=tolerance, target=st.target,
                                    unit=unit).batch_size
        except ValueError:
            per_seed[s] = None
    times = {b: [cost(b, s) for s in seeds] for b in batches}
    med = {b: float(np.median(v)) for b, v in times.items()}
    rng = _rng(rng_seed)
    wins: Counter[float] = Counter()
    for _ in range(1000):
        draw = rng.integers(0, len(seeds), size=len(seeds))
        m = {b: float(np.median([times[b][i] for i in draw])) for b in batches}
        wins[min(m, key=lambda b: m[b])] += 1
    prob = {b: wins[b] / 1000 for b in batches}
    best = min(med.values())
    tie = [b for b in batches if med[b] <= best * (1 + tolerance) or prob[b] >= 0.2]
    ex_med = {b: float(np.median([cast(float, st.examples[b][s]) for s in seeds])) for b in batches}
    winner = min(tie, key=lambda b: (ex_med[b], med[b]))  # among ties: the fewest examples (least data and compute)
    lrs = [st.best_lr[winner][s] for s in seeds if st.best_lr[winner][s] is not None]
    lr = Counter(lrs).most_common(1)[0][0]
    what = "seconds to target" if objective == "time" else f"{unit}s to target"
    reasons = [f"target loss {st.target:.4f} (held-out); {len(seeds)} seed(s); {what}: median [min–max over seeds]"]
    for b in batches:
        v = times[b]
        reasons.append(f"  {name(b)}: {med[b]:,.1f} [{min(v):,.1f}–{max(v):,.1f}], {ex_med[b]:,.0f} {unit}s, "
                       f"P(fastest) {prob[b]:.0%}")
    reasons.append("winner per seed: " + ", ".join(f"seed {s}: {name(b) if b else '–'}" for s, b in per_seed.items()))
    if len(tie) > 1:
        reasons.append(f"tie: {', '.join(name(b) for b in tie)} cannot be separated (within {tolerance:.0%} or "
                       f"fastest in ≥ 20% of seed resamples); recommend {name(winner)}, the fewest {unit}s among them")
    else:
        reasons.append(f"recommend {name(winner)} at lr {lr:g}")
    return SeedRecommendation(batch_size=winner, lr=float(cast(float, lr)), target=st.target, per_seed=per_seed,
                              probability_fastest=prob,
                              time_to_target={b: (med[b], float(min(times[b])), float(max(times[b]))) for b in batches},
                              tie=tie, reasons=reasons)


# ---------------------------------------------------------------------------
# Everything
# ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class SeedAnalysis:
    unit: str
    readout: str
    seeds: list[int]
    targets: list[SeedTarget]
    joint: Optional[JointFit] = None
    joint_error: Optional[str] = None
    recommendation: Optional[SeedRecommendation] = None
    lr_edges: dict[float, str] = field(default_factory=dict)
    """Batch → "low"/"high" when its LR (the one for every seed, chosen at the primary target) is the edge of the LRs it ran."""
    lr_selection: str = "auto"
    """The rule of :data:`LR_SELECTIONS` the analysis ran with (each target says which it used: ``SeedTarget.lr_selection``)."""
    lr_falls: list["LrFall"] = field(default_factory=list)
    """Neighbouring batches whose chosen LR falls as the batch grows (at any target), against the optimizer's rule."""
    b_simple: dict[float, dict[str, Optional[float]]] = field(default_factory=dict)
    """Target → {"local": median B_simple at the crossing, "path_averaged": median mean B_simple up to it}."""
    warnings: list[str] = field(default_factory=list)

    @property
    def primary(self) -> SeedTarget:
        """The tightest target: the recommendation's."""
        return self.targets[-1]

    def monotone_share(self) -> float:
        cells = [m for t in self.targets for m in t.monotone.values()]
        return sum(cells) / len(cells) if cells else math.nan


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


def _lr_per_batch(st: SeedTarget) -> dict[float, float]:
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
        lr = _lr_per_batch(st)
        bs = sorted(lr)
        for lo, hi in zip(bs, bs[1:]):
            if lr[hi] < lr[lo] * (1 - 1e-6):
                found.setdefault((lo, hi, lr[lo], lr[hi]), []).append(st.target)
    return [LrFall(batch_low=k[0], batch_high=k[1], lr_low=k[2], lr_high=k[3], targets=tuple(v))
            for k, v in sorted(found.items())]


def _monotone_seeds(st: SeedTarget) -> int:
    return sum(bool(m) for m in st.monotone.values())


def _b_simple_at(curve: Curve, examples: float) -> tuple[Optional[float], Optional[float]]:
    pts = sorted(curve.b_simple)
    if not pts:
        return None, None
    e = np.array([p[0] for p in pts])
    v = np.array([p[1] for p in pts])
    local = float(np.exp(np.interp(math.log(max(examples, e[0])), np.log(np.maximum(e, 1e-12)), np.log(v))))
    upto = v[e <= examples]
    return local, float(np.mean(upto)) if upto.size else None


def analyze_seeds(curves: Sequence[Curve], *, settings: Optional[AnalysisSettings] = None,
                  min_window_examples: Optional[float] = None, unit: str = "example",
                  label: Optional[Callable[[float], str]] = None, warnings: Sequence[str] = (),
                  **old: Any) -> SeedAnalysis:
    """Targets, per-target results over seeds, the joint fit, LR-edge and falling-LR flags and the recommendation.

    ``settings``: a :class:`globalbatch.critical.AnalysisSettings` (targets, n_targets, readout, tolerance,
    objective, lr_selection). ``old``: the keywords before ``settings`` (deprecated,
    :func:`~globalbatch.critical.settings.settings_from`).

    ``lr_selection`` (:data:`LR_SELECTIONS`): where one LR per batch cannot serve every target — it
    leaves seeds non-monotone at a target (measured on a non-demo tinygpt: batch 16's LR 0.0020 below
    batch 8's 0.0042, so batch 16 needed more steps than batch 8 at the early targets) — ``auto`` reads
    that target at LRs re-chosen there, when that leaves fewer seeds non-monotone; each target states
    which rule it used and why (``SeedTarget.lr_selection``/``lr_selection_reason``).
    """
    s = settings_from(settings, old, caller="analyze_seeds")
    targets: Optional[Sequence[float]] = s.targets
    n_targets, readout, tolerance, objective, lr_selection = s.n_targets, s.readout, s.tolerance, s.objective, \
        s.lr_selection
    curves = list(curves)
    if not curves:
        raise ValueError("curves: empty; nothing to analyze")
    given = targets is not None
    if targets is None:
        targets = common_targets(curves, n_targets, readout=readout, min_window_examples=min_window_examples)
    targets = sorted((float(t) for t in targets), reverse=True)  # loosest first; the last is the primary
    seeds = sorted({c.seed for c in curves})
    # One LR per batch for every seed and target: its least median steps over seeds at the primary target.
    # The targets then come from those curves, so that every batch × seed reaches each of them at its
    # LR; the LR is chosen again at the new primary target until nothing changes (2–3 passes).
    lr_of: dict[float, float] = {}
    for _ in range(4):
        new = common_lr(curves, targets[-1], readout=readout, min_window_examples=min_window_examples)
        if new == lr_of:
            break
        lr_of = new
        chosen = [c for c in curves if c.lr == lr_of.get(c.batch_size)]
        if given:
            break
        targets = sorted(common_targets(chosen, n_targets, readout=readout, min_window_examples=min_window_examples),
                         reverse=True)
    results = [target_over_seeds(chosen, t, readout=readout, min_window_examples=min_window_examples) for t in targets]
    name = label if label is not None else (lambda b: f"batch {b:,.0f}")
    several = len({(c.batch_size, c.lr) for c in curves}) > len({c.batch_size for c in curves})
    for i, st in enumerate(results):
        st.lr_selection_reason = ("one LR per batch, chosen at the primary target"
                                  + (" (each batch ran one LR)" if not several else ""))
        if lr_selection == "per_batch" or not several or (lr_selection == "auto" and st.all_monotone):
            continue
        alt = target_over_seeds(curves, st.target, readout=readout, min_window_examples=min_window_examples)
        alt.lr_selection = "per_target"
        if lr_selection == "per_target":
            alt.lr_selection_reason = "LR re-chosen per batch at this target (lr_selection='per_target')"
            results[i] = alt
        elif _monotone_seeds(alt) > _monotone_seeds(st):
            bad = [s for s, m in st.monotone.items() if not m]
            alt.lr_selection_reason = (
                f"LR re-chosen per batch at this target: one LR per batch left seed(s) {', '.join(map(str, bad))} "
                f"non-monotone here ({_monotone_seeds(st)}/{len(st.monotone)} monotone; re-chosen: "
                f"{_monotone_seeds(alt)}/{len(alt.monotone)})")
            results[i] = alt
        else:
            st.lr_selection_reason += (f"; re-choosing the LR at this target leaves as many seeds non-monotone "
                                       f"({_monotone_seeds(alt)}/{len(alt.monotone)} monotone), so it is kept")
    out = SeedAnalysis(unit=unit, readout=readout, seeds=seeds, targets=results, warnings=list(warnings),
                       lr_selection=lr_selection)
    out.lr_falls = lr_falls(results)
    for f in out.lr_falls:
        out.warnings.append(f.text(name))
    for st in results:
        if st.reached_in_warmup:
            out.warnings.append(f"target {st.target:.4f} reached during LR warmup by {', '.join(st.reached_in_warmup)}")
        bad = [s for s, m in st.monotone.items() if not m]
        if bad:
            out.warnings.append(f"target {st.target:.4f}: non-monotone or unreached steps for seed(s) "
                                f"{', '.join(map(str, bad))}: left out of the fits")
    pts = [(st.target, s, b, cast(float, st.steps[b][s])) for st in results for s in seeds if st.monotone[s]
           for b in st.steps if st.steps[b][s] is not None]
    try:
        out.joint = fit_joint(pts)
        for st in results:
            st.joint_b_crit = out.joint.b_crit(st.target)
            st.joint_interval = out.joint.interval(st.target)
    except ValueError as exc:
        out.joint_error = str(exc)
    # LR edges at the primary target: the batch's LR (the same for every seed) against the LRs it ran.
    primary = out.primary
    for b in primary.best_lr:
        ran = sorted({c.lr for c in curves if c.batch_size == b})
        best = [lr for lr in primary.best_lr[b].values() if lr is not None]
        if len(ran) >= 2 and best:
            lr = Counter(best).most_common(1)[0][0]
            if lr == ran[0] or lr == ran[-1]:
                out.lr_edges[b] = "low" if lr == ran[0] else "high"
                out.warnings.append(f"{name(b)}: best LR {lr:g} is the {'smallest' if lr == ran[0] else 'largest'} "
                                    f"it ran ({', '.join(f'{x:g}' for x in ran)}): the optimum may lie beyond")
    # B_simple at the same losses, from the best-LR trials (LR-dependent).
    by_label = {(c.batch_size, c.seed, c.lr): c for c in curves}
    for st in results:
        loc, path = [], []
        for b in st.steps:
            for seed in seeds:
                e, lr_b = st.examples[b][seed], st.best_lr[b][seed]
                c = by_label.get((b, seed, cast(float, lr_b))) if e is not None else None
                if c is not None and e is not None and c.b_simple:
                    lo, pa = _b_simple_at(c, e)
                    if lo is not None:
                        loc.append(lo)
                    if pa is not None:
                        path.append(pa)
        if loc or path:
            out.b_simple[st.target] = {"local": float(np.median(loc)) if loc else None,
                                       "path_averaged": float(np.median(path)) if path else None}
    tput: dict[float, Optional[float]] = {}
    for b in primary.steps:
        v = [c.examples_per_s for c in curves if c.batch_size == b and c.examples_per_s]
        tput[b] = float(np.median(v)) if v else None
    out.recommendation = recommend_over_seeds(primary, tput, tolerance=tolerance, objective=objective, unit=unit,
                                              label=label)
    return out


def lr_selection_text(a: SeedAnalysis) -> str:
    """One line: which LR rule the targets were read with, and why where it differs."""
    per_target = [st for st in a.targets if st.lr_selection == "per_target"]
    if not per_target:
        return (f"LR selection {a.lr_selection}: one LR per batch at every target (chosen at the primary target, "
                f"the same for every seed)")
    parts = "; ".join(f"target {st.target:.4f}: {st.lr_selection_reason}" for st in per_target)
    return (f"LR selection {a.lr_selection}: one LR per batch except at {len(per_target)} of {len(a.targets)} "
            f"target(s), where it is re-chosen per batch at that target — {parts}")


def seed_analysis_json(a: SeedAnalysis, batch_key: Callable[[float], int]) -> dict:
    """The ``globalbatch report --json`` document: batches keyed by samples per step (as strings)."""

    def k(b: float) -> str:
        return str(batch_key(b))

    def num(x):
        return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x

    targets = []
    for st in a.targets:
        targets.append({
            "target_loss": st.target,
            "b_crit": num(st.b_crit),
            "b_crit_per_seed": {str(s): num(v) for s, v in st.b_crit_per_seed.items()},
            "b_crit_text_per_seed": {str(s): v for s, v in st.b_crit_text_per_seed.items()},
            "b_crit_range": list(st.b_crit_range) if st.b_crit_range else None,
            "b_crit_bootstrap_95": list(st.b_crit_boot) if st.b_crit_boot else None,
            "b_crit_interval": list(iv) if (iv := st.interval()) else None,
            "b_crit_joint": num(st.joint_b_crit),
            "b_crit_joint_95": list(st.joint_interval) if st.joint_interval else None,
            "steps_to_target": {k(b): {str(s): num(v) for s, v in d.items()} for b, d in st.steps.items()},
            "units_to_target": {k(b): {str(s): num(v) for s, v in d.items()} for b, d in st.examples.items()},
            "best_lr": {k(b): {str(s): num(v) for s, v in d.items()} for b, d in st.best_lr.items()},
            "monotone": st.all_monotone,
            "monotone_per_seed": {str(s): m for s, m in st.monotone.items()},
            "reached_in_warmup": st.reached_in_warmup,
            "lr_selection": st.lr_selection,
            "lr_selection_reason": st.lr_selection_reason,
            "b_simple": a.b_simple.get(st.target),
        })
    rec = a.recommendation
    doc = {
        "unit": a.unit, "readout": a.readout, "seeds": a.seeds, "targets": targets,
        "monotone_share": num(a.monotone_share()),
        "joint": None if a.joint is None else {
            "b_crit_at_ref": a.joint.b_ref, "loss_ref": a.joint.loss_ref, "k": a.joint.k, "se_k": a.joint.se_k,
            "se_log_b_ref": a.joint.se_log_b_ref, "alpha_b": num(a.joint.alpha_b), "n_points": a.joint.n_points,
            "dof": a.joint.dof, "residual_std_log": a.joint.residual_std_log,
            "model": "ln S = a_t + ln(1 + B_crit(L_t)/B), B_crit(L) = b_crit_at_ref·(L/loss_ref)^k"},
        "joint_error": a.joint_error,
        "lr_edges": {k(b): v for b, v in a.lr_edges.items()},
        "lr_selection": a.lr_selection,
        "lr_selection_text": lr_selection_text(a),
        "lr_falls": [{"batch_low": batch_key(f.batch_low), "batch_high": batch_key(f.batch_high), "lr_low": f.lr_low,
                      "lr_high": f.lr_high, "targets": list(f.targets)} for f in a.lr_falls],
        "recommendation": None if rec is None else {
            "batch": batch_key(rec.batch_size), "batch_units": rec.batch_size, "lr": rec.lr, "target_loss": rec.target,
            "per_seed": {str(s): (batch_key(b) if b is not None else None) for s, b in rec.per_seed.items()},
            "probability_fastest": {k(b): p for b, p in rec.probability_fastest.items()},
            "time_to_target_s": {k(b): {"median": v[0], "min": v[1], "max": v[2]} for b, v in rec.time_to_target.items()},
            "tie": [batch_key(b) for b in rec.tie], "text": rec.text()},
        "warnings": a.warnings,
    }
    return doc
