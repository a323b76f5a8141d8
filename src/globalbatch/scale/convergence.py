"""Steps and tokens to a target loss for any batch, constant or ramped: the convergence model of ``scale``.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training" (arXiv 1812.06162):

* eq. 2.11 — at a fixed loss L, a constant batch B (tokens per step) needs
  ``S = S_min(L)·(1 + B_crit(L)/B)`` steps and ``E = E_min(L)·(1 + B/B_crit(L))`` tokens, with
  ``E_min = B_crit·S_min``;
* App. D — a batch that changes along training: ``S = ∫(1 + B_noise(s)/B(s)) ds_min`` and
  ``E = ∫(B(s) + B_noise(s)) ds_min``, and the schedule that minimises ``S + E/r`` is
  ``B(s) = √(r·B_noise(s))`` (r: the exchange rate of time against compute).

What a constant-batch sweep measures at a target is the *path average*: with ``e_min(u) = ∫₀ᵘ B_noise ds_min``
the constant-batch integral gives ``S = u + e_min(u)/B``, so ``B_crit(L) = e_min(u)/u`` at ``u = S_min(L)``.
This module therefore takes ``e_min(u) = B_crit(L(u))·u`` and the local noise scale
``B_noise(u) = de_min/du = B_crit·(1 + k·d ln L/d ln u)`` (larger than the measured B_crit when B_crit
rises as the loss falls). A constant batch reproduces eq. 2.11 exactly (tested); a schedule is the exact
piecewise integral ``S = Σ_k [Δu_k + Δe_min,k / B_k]``, ``E = Σ_k [B_k·Δu_k + Δe_min,k]``.

The two laws (both along the loss L, in nats):

* ``B_crit(L) = b_ref·(L/L_ref)^k`` — Kaplan et al. 2020 (arXiv 2001.08361) eq. 5.2 write it
  ``B*/L^(1/α_B)``; the project's joint fit over targets and seeds
  (``globalbatch.critical.seeds.fit_joint``) gives b_ref, k and their covariance.
* ``S_min(L) = S_c·(L − L_∞)^(−p)`` — Kaplan et al. 2020 eq. 5.6 (``L(N, S_min) = (N_c/N)^α_N + (S_c/S_min)^α_S``
  at a fixed model size: ``L_∞ = (N_c/N)^α_N``, ``p = 1/α_S``). A target at or below L_∞ is unreachable.

Pure arithmetic (numpy, scipy): no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from globalbatch._util import SettingError
from globalbatch.validate import positive

__all__ = ["BCritLaw", "SMinLaw", "ConvergenceModel", "ScheduleCost", "fit_s_min", "s_min_at_targets", "from_points",
           "kaplan_prior",
           "deepseek_batch_prior", "KAPLAN", "DEEPSEEK"]

KAPLAN = ("Kaplan et al. 2020, 'Scaling Laws for Neural Language Models', arXiv 2001.08361: "
          "B_crit(L) = 2.0e8/L^(1/0.21) tokens (eq. 5.2), S_min from L(N, S_min) = (N_c/N)^0.077 + (2.1e3/S_min)^0.76 "
          "(eq. 5.6, Table 3: α_N = 0.077, N_c = 6.5e13, α_S = 0.76, S_c = 2.1e3); WebText2, their BPE tokenizer, loss in nats, Adam, 1024-token context")
DEEPSEEK = ("DeepSeek LLM 2024, arXiv 2401.02954, eq. 1: B_opt = 0.2920·C^0.3271 tokens, η_opt = 0.3118·C^-0.1250 "
            "(C in FLOPs; their data, loss-optimal batch at a compute budget, not B_crit)")


def _t_quantile(dof: int, level: float = 0.95) -> float:
    """Student-t's two-sided ``level`` quantile (the normal's without dof), from ``scipy.special`` — the functions
    ``scipy.stats`` calls, without its import (about 2 s of CPU, most of ``globalbatch scale``'s time)."""
    from scipy.special import ndtri, stdtrit

    return float(stdtrit(max(int(dof), 1), 0.5 + level / 2)) if dof > 0 else float(ndtri(0.5 + level / 2))


@dataclass(frozen=True, kw_only=True, slots=True)
class BCritLaw:
    """``B_crit(L) = b_ref_tokens·(L/loss_ref)^k`` with the covariance of ``(ln b_ref, k)``."""

    b_ref_tokens: float
    """B_crit at ``loss_ref``, in tokens per step."""
    loss_ref: float
    """Reference loss (nats), e.g. the geometric mean of the fitted targets."""
    k: float
    """d ln B_crit / d ln L (negative: B_crit rises as the loss falls); Kaplan's α_B = −1/k."""
    cov: tuple[tuple[float, float], tuple[float, float]] = ((0.0, 0.0), (0.0, 0.0))
    """Covariance of (ln b_ref, k); zeros for a prior (no stated uncertainty)."""
    dof: int = 0
    """Residual degrees of freedom of the fit (0: use the normal quantile)."""
    boot: tuple[tuple[float, float], ...] = ()
    """(ln b_ref, k) refitted on bootstrap resamples of the seeds; the interval is the hull of both."""

    def __post_init__(self) -> None:
        for name in ("b_ref_tokens", "loss_ref"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise SettingError(name, v, "a number > 0")
        if not (isinstance(self.k, (int, float)) and math.isfinite(self.k)):
            raise SettingError("k", self.k, "a finite number")

    def b_crit(self, loss: float) -> float:
        return self.b_ref_tokens * (loss / self.loss_ref) ** self.k

    def se_log(self, loss: float) -> float:
        """Standard error of ln B_crit(loss) from the covariance (grows away from loss_ref)."""
        g = np.array([1.0, math.log(loss / self.loss_ref)])
        return float(math.sqrt(max(float(g @ np.asarray(self.cov, dtype=float) @ g), 0.0)))

    def interval(self, loss: float, level: float = 0.95) -> tuple[float, float]:
        c = self.b_crit(loss)
        half = min(_t_quantile(self.dof, level) * self.se_log(loss), 700.0)
        lo, hi = c * math.exp(-half), c * math.exp(half)
        if self.boot:
            x = math.log(loss / self.loss_ref)
            vals = np.exp(np.clip([a + k * x for a, k in self.boot], -700, 700))
            q = (1 - level) / 2 * 100
            lo, hi = min(lo, float(np.percentile(vals, q))), max(hi, float(np.percentile(vals, 100 - q)))
        return lo, hi


@dataclass(frozen=True, kw_only=True, slots=True)
class SMinLaw:
    """``S_min(L) = s_c·(L − loss_floor)^(−exponent)`` (Kaplan et al. 2020 eq. 5.6 at one model size)."""

    s_c: float
    """Scale (steps at L − L_∞ = 1 nat)."""
    exponent: float
    """p = 1/α_S > 0."""
    loss_floor: float = 0.0
    """L_∞: the loss this model approaches with unlimited steps; targets ≤ it are unreachable."""
    resid_std_log: float = 0.0
    """Residual standard deviation of ln S_min in the fit (0 for a prior)."""
    n_points: int = 0
    x_mean: float = 0.0
    """Mean of ln(L − L_∞) over the fitted targets (for the prediction interval)."""
    x_sxx: float = 0.0
    """Σ (ln(L − L_∞) − x_mean)² over the fitted targets."""

    def __post_init__(self) -> None:
        for name in ("s_c", "exponent"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise SettingError(name, v, "a number > 0")
        if not (math.isfinite(self.loss_floor) and self.loss_floor >= 0):
            raise SettingError("loss_floor", self.loss_floor, "a number ≥ 0")

    def s_min(self, loss: float) -> float:
        return self.s_c * (loss - self.loss_floor) ** (-self.exponent)

    def loss_at(self, s_min: float) -> float:
        """Inverse: the loss after ``s_min`` steps at the smallest batches."""
        return self.loss_floor + (self.s_c / s_min) ** (1.0 / self.exponent)

    def se_log(self, loss: float) -> float:
        """Prediction standard error of ln S_min(loss) (regression in ln(L − L_∞)); 0 for a prior."""
        if self.n_points < 3 or self.resid_std_log == 0.0:
            return 0.0
        x = math.log(loss - self.loss_floor)
        lever = 1.0 / self.n_points + ((x - self.x_mean) ** 2 / self.x_sxx if self.x_sxx > 0 else 0.0)
        return self.resid_std_log * math.sqrt(lever)


def fit_s_min(targets: Sequence[float], s_min: Sequence[float]) -> SMinLaw:
    """Fit ``S_min(L) = s_c·(L − L_∞)^(−p)`` to S_min at several targets (``scipy.optimize.least_squares`` in logs).

    ``L_∞`` is bounded to [0, 0.999·min target]; with fewer than 4 targets it is fixed at 0 (a power law).
    """
    from scipy.optimize import least_squares

    L = np.asarray(targets, dtype=float)
    y = np.log(np.asarray(s_min, dtype=float))
    if L.size < 2 or not np.all(np.isfinite(y)) or np.any(L <= 0):
        raise SettingError("targets", L.tolist(), "at least 2 losses > 0, each with a finite S_min > 0 (the S_min(L) "
                                                  "fit)")
    hi_floor = 0.999 * float(L.min())

    def model(p, floor):
        return p[0] - p[1] * np.log(L - floor)

    best = None
    floors = [0.0] if L.size < 4 else [0.0, 0.5 * hi_floor, 0.9 * hi_floor]
    for f0 in floors:
        if L.size < 4:
            r = least_squares(lambda p: model(p, 0.0) - y, [float(y.mean()), 1.0], bounds=([-np.inf, 1e-6], [np.inf, np.inf]))
            params = (r.x[0], r.x[1], 0.0)
        else:
            r = least_squares(lambda p: model(p[:2], p[2]) - y, [float(y.mean()), 1.0, f0],
                              bounds=([-np.inf, 1e-6, 0.0], [np.inf, np.inf, hi_floor]))
            params = (r.x[0], r.x[1], r.x[2])
        if best is None or r.cost < best[0]:
            best = (r.cost, params)
    assert best is not None
    cost, (a, p, floor) = best
    n_par = 2 if L.size < 4 else 3
    dof = L.size - n_par
    x = np.log(L - floor)
    return SMinLaw(s_c=float(math.exp(a)), exponent=float(p), loss_floor=float(floor),
                   resid_std_log=float(math.sqrt(2 * cost / dof)) if dof > 0 else 0.0, n_points=int(L.size),
                   x_mean=float(x.mean()), x_sxx=float(((x - x.mean()) ** 2).sum()))


def s_min_at_targets(points: Sequence[tuple[float, int, float, float]], law: BCritLaw) -> dict[float, float]:
    """S_min at each target given B_crit(L): the least-squares ``ln S_min = mean(ln S − ln(1 + B_crit/B))`` over the
    ``(target, seed, batch_tokens, steps)`` points at that target (eq. 2.11 in logs, as the joint fit)."""
    by_t: dict[float, list[float]] = {}
    for t, _seed, b, s in points:
        by_t.setdefault(float(t), []).append(math.log(s) - math.log1p(law.b_crit(t) / b))
    return {t: float(math.exp(np.mean(v))) for t, v in sorted(by_t.items())}


def from_points(points: Sequence[tuple[float, int, float, float]], law: BCritLaw, *, source: str = "",
                conditions: str = "") -> "ConvergenceModel":
    """A fitted model from a B_crit(L) law (``globalbatch.critical``'s joint fit) and the steps it was fitted on:
    S_min at each target, then :func:`fit_s_min` across targets."""
    if law.k >= 0:  # the model integrates a noise scale that grows as the loss falls; a fit that falls is no law for it
        se = math.sqrt(max(law.cov[1][1], 0.0))
        raise SettingError("b_crit_law", f"k = {law.k:.3g}" + (f" (SE {se:.2g})" if se > 0 else ""),
                           "a B_crit(L) law that rises as the loss falls (k < 0)",
                           why="its B_crit does not rise as the loss falls")
    sm = s_min_at_targets(points, law)
    ts = sorted(sm)
    s_law = fit_s_min(ts, [sm[t] for t in ts])
    return ConvergenceModel(b_crit_law=law, s_min_law=s_law, loss_range=(ts[0], ts[-1]), source=source, kind="fit",
                            conditions=conditions)


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleCost:
    """Steps and tokens to a target for a batch schedule (constant: one stage)."""

    steps: float
    tokens: float
    stage_steps: tuple[float, ...]
    """Optimizer steps spent in each stage (0 for a stage the target is reached before)."""
    stage_tokens: tuple[float, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class ConvergenceModel:
    """B_crit(L) and S_min(L), from a sweep's fit or a published prior, with where they were measured."""

    b_crit_law: BCritLaw
    s_min_law: SMinLaw
    loss_range: Optional[tuple[float, float]] = None
    """(lowest, highest) fitted target loss; None for a prior (every target is an extrapolation of its data)."""
    source: str = ""
    """Where the laws come from (the sweep directory, or the paper)."""
    kind: str = "fit"
    """``"fit"`` (measured) or ``"prior"`` (published law)."""
    conditions: str = ""
    """When the laws apply (data, tokenizer, optimizer)."""

    # -- validity -----------------------------------------------------------------

    def check_target(self, loss: float, field: str = "target_loss") -> float:
        """The target as a float, or a SettingError naming ``field`` when the fit cannot reach it."""
        positive(loss, field, allowed="a loss in nats > 0")
        if loss <= self.s_min_law.loss_floor * (1 + 1e-9):
            raise SettingError(field, loss, f"a loss above {self.s_min_law.loss_floor:.4g} nats",
                               why=f"the S_min(L) law's loss floor is {self.s_min_law.loss_floor:.4g}: "
                                   "no number of steps reaches it")
        return float(loss)

    def extrapolated(self, loss: float) -> bool:
        """True outside the fitted loss range (always for a prior)."""
        if self.loss_range is None:
            return True
        lo, hi = self.loss_range
        return not (lo * (1 - 1e-9) <= loss <= hi * (1 + 1e-9))

    # -- eq. 2.11 at a constant batch ---------------------------------------------------

    def b_crit(self, loss: float) -> float:
        return self.b_crit_law.b_crit(loss)

    def s_min(self, loss: float) -> float:
        return self.s_min_law.s_min(loss)

    def e_min(self, loss: float) -> float:
        return self.b_crit(loss) * self.s_min(loss)

    def steps(self, batch_tokens: float, loss: float) -> float:
        """``S_min(1 + B_crit/B)``: optimizer steps to ``loss`` at a constant batch of ``batch_tokens``."""
        return self.s_min(loss) * (1.0 + self.b_crit(loss) / batch_tokens)

    def tokens(self, batch_tokens: float, loss: float) -> float:
        """``E_min(1 + B/B_crit)``: tokens to ``loss`` at a constant batch."""
        return self.e_min(loss) * (1.0 + batch_tokens / self.b_crit(loss))

    def steps_interval(self, batch_tokens: float, loss: float, level: float = 0.95) -> tuple[float, float]:
        """Steps at a constant batch with B_crit's interval and S_min's prediction interval (both widen
        away from the fitted targets; a prior has no stated interval: the point twice)."""
        lo_b, hi_b = self.b_crit_law.interval(loss, level)
        q = _t_quantile(max(self.s_min_law.n_points - 3, 0), level) if self.s_min_law.n_points else 0.0
        f = math.exp(min(q * self.s_min_law.se_log(loss), 700.0))
        s = self.s_min(loss)
        return s / f * (1 + lo_b / batch_tokens), s * f * (1 + hi_b / batch_tokens)

    def efficiency(self, batch_tokens: float, loss: float) -> float:
        """Statistical efficiency E_min/E = 1/(1 + B/B_crit): the share of tokens doing useful work."""
        return 1.0 / (1.0 + batch_tokens / self.b_crit(loss))

    # -- App. D along the path ---------------------------------------------------

    def _path(self, u: float) -> tuple[float, float]:
        """(e_min(u), B_noise(u)) at path position u = s_min."""
        law = self.s_min_law
        if u <= 0:
            return 0.0, 0.0
        L = law.loss_at(u)
        bc = self.b_crit_law.b_crit(L)
        g = -(L - law.loss_floor) / (law.exponent * L)  # d ln L / d ln u
        return bc * u, bc * (1.0 + self.b_crit_law.k * g)

    def e_min_path(self, u: float) -> float:
        return self._path(u)[0]

    def b_noise(self, u: float) -> float:
        """Local noise scale at path position u (= de_min/du)."""
        return self._path(u)[1]

    def check_path(self, loss: float) -> None:
        """B_noise must stay > 0 along the path to ``loss`` (a fit with B_crit falling steeply as the loss falls
        would give a negative local noise scale)."""
        u_t = self.s_min(loss)
        for u in np.geomspace(u_t * 1e-6, u_t, 64):
            if not self.b_noise(float(u)) > 0:
                raise SettingError("b_crit_law", f"k = {self.b_crit_law.k:.3g}",
                                   "a B_crit(L) law whose local noise scale stays > 0 along the path",
                                   why=f"B_noise ≤ 0 at S_min = {u:.3g}")

    def schedule_cost(self, stages: Sequence[tuple[float, float]], loss: float) -> ScheduleCost:
        """Steps and tokens to ``loss`` for a piecewise-constant batch: ``stages`` = ``(threshold_tokens, batch_tokens)``,
        the first threshold 0, thresholds rising (Megatron's ``--step-batch-size-schedule``, in tokens)."""
        from scipy.optimize import brentq

        u_t = self.s_min(loss)
        e_t = self.e_min_path(u_t)
        u0, e0, tok0 = 0.0, 0.0, 0.0
        st_steps, st_tok = [], []
        total_s = 0.0
        for i, (_, b) in enumerate(stages):
            nxt = stages[i + 1][0] if i + 1 < len(stages) else math.inf
            end_tok = tok0 + b * (u_t - u0) + (e_t - e0)
            if end_tok <= nxt:
                u1, e1 = u_t, e_t
            else:
                def f(u: float) -> float:
                    return tok0 + b * (u - u0) + (self.e_min_path(u) - e0) - nxt

                u1 = brentq(f, u0, u_t, xtol=1e-12 * max(u_t, 1.0), rtol=1e-12)
                e1 = self.e_min_path(u1)
            ds = (u1 - u0) + (e1 - e0) / b
            dtok = b * (u1 - u0) + (e1 - e0)
            st_steps.append(ds)
            st_tok.append(dtok)
            total_s += ds
            u0, e0, tok0 = u1, e1, tok0 + dtok
            if u1 >= u_t:
                st_steps += [0.0] * (len(stages) - i - 1)
                st_tok += [0.0] * (len(stages) - i - 1)
                break
        return ScheduleCost(steps=total_s, tokens=tok0, stage_steps=tuple(st_steps), stage_tokens=tuple(st_tok))

    def ramp_stages(self, b_final: float, feasible: Sequence[float], loss: float, *, max_stages: int = 3,
                    round_digits: int = 2) -> list[tuple[float, float]]:
        """A few-stage ramp ending at ``b_final``: McCandlish's ``B(u) = √(r·B_noise(u))`` with r set so that
        ``B(u_target) = b_final``, snapped to ``feasible`` batches (tokens). Between two adjacent stage batches
        B₁ < B₂ the switch is where ``√(r·B_noise) = √(B₁B₂)`` (where their per-step costs S + E/r are equal);
        thresholds are rounded to ``round_digits`` significant digits. Returns ``[(threshold_tokens, batch_tokens)]``."""
        u_t = self.s_min(loss)
        bn_t = self.b_noise(u_t)
        r = b_final ** 2 / bn_t
        feas = sorted(b for b in set(float(x) for x in feasible) if b <= b_final * (1 + 1e-9))
        if not feas or max_stages < 2:
            return [(0.0, b_final)]
        # The smallest batch worth a stage: the ideal batch at 1 % of the path.
        b_start = math.sqrt(r * self.b_noise(u_t * 0.01))
        cands = [b for b in feas if b >= b_start / math.sqrt(2)] or [feas[-1]]
        if len(cands) > max_stages:
            idx = np.unique(np.round(np.linspace(0, len(cands) - 1, max_stages)).astype(int))
            cands = [cands[i] for i in idx]
        if cands[-1] != b_final:
            cands[-1] = b_final
        stages: list[tuple[float, float]] = [(0.0, cands[0])]
        from scipy.optimize import brentq

        for b_lo, b_hi in zip(cands, cands[1:]):
            switch_b = math.sqrt(b_lo * b_hi)
            if math.sqrt(r * self.b_noise(u_t)) <= switch_b:
                break

            def g(u: float) -> float:
                return math.sqrt(r * self.b_noise(u)) - switch_b

            lo = u_t * 1e-9
            if g(lo) >= 0:
                u_sw = lo
            else:
                u_sw = brentq(g, lo, u_t, rtol=1e-10)
            # tokens consumed at u_sw under the stages so far
            tok = self._tokens_at(stages, u_sw)
            tok = _round_sig(tok, round_digits)
            if tok <= stages[-1][0]:
                stages[-1] = (stages[-1][0], b_hi)  # the switch rounds onto the previous one: merge
                continue
            stages.append((tok, b_hi))
        return stages

    def _tokens_at(self, stages: Sequence[tuple[float, float]], u_end: float) -> float:
        """Tokens consumed when the path reaches ``u_end`` under ``stages`` (the last stage runs to u_end)."""
        from scipy.optimize import brentq

        u0, e0, tok0 = 0.0, 0.0, 0.0
        for i, (_, b) in enumerate(stages):
            nxt = stages[i + 1][0] if i + 1 < len(stages) else math.inf
            e_end = self.e_min_path(u_end)
            end_tok = tok0 + b * (u_end - u0) + (e_end - e0)
            if end_tok <= nxt:
                return end_tok

            def f(u: float) -> float:
                return tok0 + b * (u - u0) + (self.e_min_path(u) - e0) - nxt

            u1 = brentq(f, u0, u_end, rtol=1e-12)
            e1 = self.e_min_path(u1)
            tok0 += b * (u1 - u0) + (e1 - e0)
            u0, e0 = u1, e1
        return tok0

    # -- other model sizes ----------------------------------------------------------

    def for_params(self, params: float, swept_params: float, *, alpha_n: float = 0.077) -> "ConvergenceModel":
        """The same laws for a model of ``params`` instead of ``swept_params`` parameters, under Kaplan's
        transfer assumptions: B_crit depends on the loss only (§5.1), and in ``L(N, S_min) = (N_c/N)^α_N +
        (S_c/S_min)^α_S`` only the floor moves, ``L_∞' = L_∞·(N/N')^α_N`` (α_N = 0.077, Kaplan Table 3). A prior
        for the step count, not a measurement; the result is marked as extrapolated everywhere."""
        if params == swept_params:
            return self
        law = self.s_min_law
        floor = law.loss_floor * (swept_params / params) ** alpha_n
        new = SMinLaw(s_c=law.s_c, exponent=law.exponent, loss_floor=floor, resid_std_log=law.resid_std_log,
                      n_points=law.n_points, x_mean=law.x_mean, x_sxx=law.x_sxx)
        return ConvergenceModel(b_crit_law=self.b_crit_law, s_min_law=new, loss_range=None,
                                source=f"{self.source}, moved from {swept_params:.3g} to {params:.3g} parameters "
                                       f"(Kaplan's L(N, S_min), α_N = {alpha_n})",
                                kind=self.kind, conditions=self.conditions)

    def to_dict(self) -> dict:
        b, s = self.b_crit_law, self.s_min_law
        return {"kind": self.kind, "source": self.source, "conditions": self.conditions,
                "loss_range": list(self.loss_range) if self.loss_range else None,
                "b_crit_law": {"b_ref_tokens": b.b_ref_tokens, "loss_ref": b.loss_ref, "k": b.k,
                               "alpha_b": (-1.0 / b.k) if b.k else None, "cov": [list(r) for r in b.cov], "dof": b.dof},
                "s_min_law": {"s_c": s.s_c, "exponent": s.exponent, "loss_floor": s.loss_floor,
                              "resid_std_log": s.resid_std_log, "n_points": s.n_points}}


def _round_sig(x: float, digits: int) -> float:
    if x <= 0:
        return 0.0
    e = math.floor(math.log10(x)) - digits + 1
    return float(round(x / 10 ** e) * 10 ** e) if e > 0 else float(round(x))


def kaplan_prior(*, params: float) -> ConvergenceModel:
    """Kaplan et al. 2020 as a prior for a model of ``params`` non-embedding parameters: B_crit(L) = 2·10⁸/L^(1/0.21)
    tokens (eq. 5.2) and S_min from eq. 5.6 with Table 3's fit (α_N = 0.077, α_S = 0.76, N_c = 6.5·10¹³, S_c = 2.1·10³).
    WebText2 with their tokenizer, loss in nats: other data or tokenizers shift every loss."""
    positive(params, "params", allowed="a number of parameters > 0")
    floor = (6.5e13 / params) ** 0.077
    return ConvergenceModel(
        b_crit_law=BCritLaw(b_ref_tokens=2.0e8, loss_ref=1.0, k=-1.0 / 0.21),
        s_min_law=SMinLaw(s_c=2.1e3, exponent=1.0 / 0.76, loss_floor=floor),
        loss_range=None, source="Kaplan et al. 2020 (arXiv 2001.08361) eq. 5.2 and 5.6, Table 3", kind="prior",
        conditions="WebText2, GPT-2 BPE tokenizer, 1024-token context, Adam; loss in nats; "
                   f"this model's floor (N_c/N)^0.077 = {floor:.3f} nats")


def deepseek_batch_prior(compute_flops: float) -> dict:
    """DeepSeek LLM's loss-optimal batch and LR at a compute budget (eq. 1): a reference point, not a convergence
    model (it says nothing about steps to a loss)."""
    if not (isinstance(compute_flops, (int, float)) and math.isfinite(compute_flops) and compute_flops > 0):
        raise SettingError("compute_flops", compute_flops, "FLOPs > 0")
    return {"source": DEEPSEEK, "b_opt_tokens": 0.2920 * compute_flops ** 0.3271,
            "lr_opt": 0.3118 * compute_flops ** -0.1250, "compute_flops": float(compute_flops)}
