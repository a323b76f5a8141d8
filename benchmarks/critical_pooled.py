"""The shared-S_min per-seed fit (critical/pooled.py) against ground truth, with partial pooling beside it.

docs/critical.md §1b's tables. Synthetic steps-to-target tables, 5 seeds: ln B_crit per seed scattered by 0.1 around
the truth, ln S_min per seed by ``tau`` (or one seed's S_min ``lag``× the others'), log-normal noise on the steps of
the size the real 5-seed runs show. Per setting and estimator: the RMS error of ln B_crit per seed (clipped at ±3),
its bias (mean error), the median over tables of max/min of B_crit across seeds (the truth's beside it), and the
paired difference in RMS from the gate at alpha 0.2 (what critical/pooled.py used before) ± its Monte-Carlo SE (the SE of
the per-table mean squared-error difference, over 2·RMS); also how often the F-test rejected sharing and the mean F
statistic (to set beside the real runs': ``benchmarks/critical_stability.py`` prints theirs).

Estimators: ``own`` (each seed's two-parameter fit), ``gate a`` (the shared-S_min fit where the F-test's p ≥ a, else
the own fits: what critical/pooled.py used before), ``LT 0.5`` (what it uses now: ``PooledFit.b_crit``, below), and
other partial-pooling estimators, measured and not adopted (docs/critical.md §1b). Each shrinks each seed's ln S_min
toward the shared fit's, ln S_s = ln S_shared + w_s·(ln S_own,s − ln S_shared), and refits that seed's B_crit at its
S_s (one parameter; w = 0 is the shared fit, w = 1 the own fit), or puts a test first:

* ``LT d``: ``JS 1-1/F`` with limited translation (Efron & Morris 1972, JASA 67:130–139): no seed's ln S_min moves
  more than d of its own fit's SEs (pooled residual variance) from that fit's value; ``LT 0.5`` is the library's;

* ``JS 1-1/F``: the positive-part weight w = max(0, 1 − 1/F) — the method-of-moments empirical-Bayes estimate of
  τ²/(τ² + σ²) (Morris 1983, "Parametric empirical Bayes inference", JASA 78:47–55, with the moment
  estimate of the prior variance);
* ``JS (K-3)``: the James–Stein constant with an estimated variance (James & Stein 1961, Proc. 4th Berkeley Symp.
  1:361–379; Efron & Morris 1973, JASA 68:117–130, the positive part and the factor ν/(ν + 2)):
  w = max(0, 1 − (K − 3)·ν / ((K − 1)(ν + 2)·F)), K seeds, ν = n − 2K; with K ≤ 3 it is the own fits;
* ``DL``: a weight per seed, w_s = τ²/(τ² + v_s), v_s the variance of the seed's own ln S_min (its fit's unscaled
  covariance × the pooled residual variance SSE_own/ν) and τ² the DerSimonian–Laird moment estimate from the own
  ln S_min (DerSimonian & Laird 1986, Controlled Clinical Trials 7:177–188);
* ``PT a``: the preliminary-test Stein estimator (Saleh 2006, *Theory of Preliminary Test and Stein-Type
  Estimation with Applications*): the own fits where the F-test rejects sharing at ``a``, else ``JS 1-1/F``.

    python benchmarks/critical_pooled.py [--tables 200] [--seeds 5] [--rng-seed 0]
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

from globalbatch.critical.pooled import PooledFit

GRIDS = {"MNIST": ([8, 16, 32, 64, 128, 256, 512], 250.0, 0.11), "demo": ([124, 248, 496, 992, 1978], 600.0, 0.075)}
"""name → (batches, true B_crit, noise SD in ln steps): the real grids, B_crit and residual SD of their fits."""
SETTINGS = ((0.0, 1.0), (0.05, 1.0), (0.1, 1.0), (0.2, 1.0), (0.0, 1.3), (0.0, 1.5), (0.0, 2.0), (0.0, 3.0))
"""(spread of ln S_min over seeds, one seed's S_min factor)."""
ALPHAS = (0.05, 0.2)


def _b_crit_at(b: np.ndarray, y: np.ndarray, ln_s_min: float, lo: float, hi: float) -> float:
    """The B_crit that fits one seed's ln steps ``y`` best with S_min fixed (a grid, then bounded Brent)."""
    from scipy.optimize import minimize_scalar

    def sse(t: float) -> float:
        return float(np.sum((ln_s_min + np.log1p(math.exp(t) / b) - y) ** 2))

    grid = np.linspace(lo, hi, 61)
    i = int(np.argmin([sse(t) for t in grid]))
    r = minimize_scalar(sse, bounds=(grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]), method="bounded",
                        options={"xatol": 1e-6})
    return math.exp(float(r.x))


def _own_var_log_s_min(b: np.ndarray, ln_b_crit: float) -> float:
    """Unscaled variance of ln S_min in one seed's two-parameter log-space fit (inverse of JᵀJ at its B_crit)."""
    x = math.exp(ln_b_crit) / b
    j = np.column_stack([np.ones_like(b), x / (1.0 + x)])
    return float(np.linalg.pinv(j.T @ j)[0, 0])


def estimates(b: np.ndarray, steps: dict[int, np.ndarray]) -> tuple[dict[str, dict[int, float]], PooledFit]:
    """Estimator name → seed → B_crit, and the shared fit (with its F-test)."""
    from globalbatch.critical.fit import fit_hyperbola
    from globalbatch.critical.pooled import fit_shared_s_min

    p = fit_shared_s_min(b.tolist(), {s: np.asarray(v, dtype=float).tolist() for s, v in steps.items()})
    seeds = sorted(steps)
    k, nu, f = len(seeds), p.dof_den, p.f_stat
    own = {s: fit_hyperbola(b.tolist(), np.asarray(steps[s], dtype=float).tolist()) for s in seeds}
    y = {s: np.log(np.asarray(steps[s], dtype=float)) for s in seeds}
    a = math.log(p.s_min)
    lo, hi = math.log(b.min()) - 12.0, math.log(b.max()) + 12.0
    dev = {s: math.log(own[s].s_min) - a for s in seeds}
    out: dict[str, dict[int, float]] = {"own": {s: own[s].b_crit for s in seeds}}
    for alpha in ALPHAS:
        out[f"gate {alpha:g}"] = dict(p.b_crit_shared) if p.p_value >= alpha else dict(out["own"])
    out["LT 0.5"] = dict(p.b_crit)  # what critical/pooled.py gives: JS 1-1/F limited to 0.5 SE

    def shrunk(w: dict[int, float]) -> dict[int, float]:
        return {s: (p.b_crit_shared[s] if w[s] <= 0 else own[s].b_crit if w[s] >= 1
                    else _b_crit_at(b, y[s], a + w[s] * dev[s], lo, hi)) for s in seeds}

    def js(c: float) -> float:
        return 1.0 if not math.isfinite(f) else max(0.0, 1.0 - c / f) if f > 0 else 0.0

    out["JS 1-1/F"] = shrunk(dict.fromkeys(seeds, js(1.0)))
    s2 = p.sse_own / nu
    var_own = {s: _own_var_log_s_min(b, math.log(own[s].b_crit)) * s2 for s in seeds}
    # limited translation at 1 SE: no seed's ln S_min moves more than 1 SE of its own fit from that fit's
    lt1 = {s: math.log(own[s].s_min) + max(-math.sqrt(var_own[s]), min(math.sqrt(var_own[s]), -(1 - js(1.0)) * dev[s]))
           for s in seeds}
    out["LT 1"] = {s: (own[s].b_crit if lt1[s] == math.log(own[s].s_min) else _b_crit_at(b, y[s], lt1[s], lo, hi))
                   for s in seeds}
    for alpha in (0.01, 0.05):  # a preliminary test in front: the own fits where it rejects sharing at alpha
        out[f"PT {alpha:g}"] = dict(out["own"]) if p.p_value < alpha else out["JS 1-1/F"]
    out["JS (K-3)"] = shrunk(dict.fromkeys(seeds, js(max(k - 3, 0) / (k - 1) * nu / (nu + 2))))
    v = np.array([var_own[s] for s in seeds])
    ln_own = np.array([math.log(own[s].s_min) for s in seeds])
    wi = np.where(v > 0, 1.0 / np.maximum(v, 1e-300), 0.0)
    tau2 = 0.0
    if wi.sum() > 0:
        q = float(np.sum(wi * (ln_own - np.sum(wi * ln_own) / wi.sum()) ** 2))
        c = float(wi.sum() - np.sum(wi ** 2) / wi.sum())
        tau2 = max(0.0, (q - (k - 1)) / c) if c > 0 else 0.0
    out["DL"] = shrunk({s: (tau2 / (tau2 + v[i]) if tau2 + v[i] > 0 else 0.0) for i, s in enumerate(seeds)})
    return out, p


def run(batches, b_crit, sigma, tau, lag, tables, seed=0, k=5):
    """Errors of every estimator over ``tables`` synthetic tables: one row of the table per estimator."""
    rng = np.random.default_rng(seed)
    b = np.asarray(batches, dtype=float)
    err: dict[str, list[np.ndarray]] = {}
    ratio: dict[str, list[float]] = {}
    ratio_true, f_stats, rejected = [], [], dict.fromkeys(ALPHAS, 0)
    for _ in range(tables):
        lb = math.log(b_crit) + rng.normal(0.0, 0.1, k)
        ls = math.log(1000.0) + rng.normal(0.0, tau, k)
        ls[0] += math.log(lag)
        steps = {s: np.exp(ls[s] + np.log1p(np.exp(lb[s]) / b) + rng.normal(0.0, sigma, b.size)) for s in range(k)}
        out, p = estimates(b, steps)
        f_stats.append(p.f_stat)
        for alpha in ALPHAS:
            rejected[alpha] += p.p_value < alpha
        ratio_true.append(math.exp(lb.max() - lb.min()))
        for name, e in out.items():
            err.setdefault(name, []).append(np.clip([math.log(e[s]) - lb[s] for s in range(k)], -3, 3))
            ratio.setdefault(name, []).append(max(e.values()) / min(e.values()))
    gate = np.square(np.array(err["gate 0.2"])).mean(axis=1)
    rows = {}
    for name, e_list in err.items():
        arr = np.array(e_list)
        rms = math.sqrt(float(np.mean(arr ** 2)))
        d = np.square(arr).mean(axis=1) - gate
        rows[name] = (rms, float(np.mean(arr)), float(np.median(ratio[name])), float(np.mean(d)) / (2 * rms),
                      float(np.std(d) / math.sqrt(tables)) / (2 * rms))
    head = (f"mean F {np.mean(f_stats):.2f}, rejected " + ", ".join(f"{rejected[a] / tables:.0%} at {a:g}" for a in ALPHAS)
            + f"; truth's median max/min {np.median(ratio_true):.2f}")
    return head, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=5, help="seeds per table (K)")
    ap.add_argument("--rng-seed", type=int, default=0, help="seed of the tables' generator")
    args = ap.parse_args(argv)
    print(f"{args.tables} tables per row, {args.seeds} seeds, generator seed {args.rng_seed}; Δ = RMS − the gate's (alpha 0.2) ± 1 Monte-Carlo SE")
    for tau, lag in SETTINGS:
        for name, (batches, b_crit, sigma) in GRIDS.items():
            what = f"spread of ln S_min {tau:g}" if lag == 1.0 else f"one seed's S_min {lag:g}×"
            head, rows = run(batches, b_crit, sigma, tau, lag, args.tables, seed=args.rng_seed, k=args.seeds)
            print(f"{name} grid, {what}: {head}")
            for est, (rms, bias, r, d, se) in rows.items():
                print(f"    {est:9s} rms {rms:.3f}  bias {bias:+.3f}  max/min {r:.2f}  Δ {d:+.4f} ± {se:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
