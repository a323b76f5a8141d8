"""The shared-S_min per-seed fit (critical/pooled.py) against ground truth: docs/critical.md §1b's table.

Synthetic steps-to-target tables, 5 seeds: ln B_crit per seed scattered by 0.1 around the truth, ln S_min per seed
by ``tau`` (or one seed's S_min ``lag``× the others'), log-normal noise on the steps of the size the real 5-seed
runs show. Prints, per setting, the RMS error of ln B_crit per seed (clipped at ±3) for each seed's own fit and for
the gated pooled fit at alpha 0.05 and 0.2, the median error and how often the F-test rejected sharing, and the
mean F statistic (to set beside the real runs': ``benchmarks/critical_stability.py`` prints theirs).

    python benchmarks/critical_pooled.py [--tables 200]
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

GRIDS = {"MNIST": ([8, 16, 32, 64, 128, 256, 512], 250.0, 0.11), "demo": ([124, 248, 496, 992, 1978], 600.0, 0.075)}
"""name → (batches, true B_crit, noise SD in ln steps): the real grids, B_crit and residual SD of their fits."""


def run(batches, b_crit, sigma, tau, lag, tables, seed=0, alphas=(0.05, 0.2), k=5):
    from globalbatch.critical.fit import fit_hyperbola
    from globalbatch.critical.pooled import fit_shared_s_min

    rng = np.random.default_rng(seed)
    b = np.asarray(batches, dtype=float)
    own: list[float] = []
    gated: dict[float, list[float]] = {a: [] for a in alphas}
    rejected = {a: 0 for a in alphas}
    f_stats: list[float] = []
    for _ in range(tables):
        lb = math.log(b_crit) + rng.normal(0.0, 0.1, k)
        ls = math.log(1000.0) + rng.normal(0.0, tau, k)
        ls[0] += math.log(lag)
        steps = {s: np.exp(ls[s] + np.log1p(np.exp(lb[s]) / b) + rng.normal(0.0, sigma, b.size)) for s in range(k)}
        p = fit_shared_s_min(b, steps)
        f_stats.append(p.f_stat)
        mine = {s: fit_hyperbola(b, steps[s]).b_crit for s in steps}
        own += [math.log(mine[s]) - lb[s] for s in steps]
        for a in alphas:
            shared = p.p_value >= a
            rejected[a] += not shared
            gated[a] += [math.log(p.b_crit[s] if shared else mine[s]) - lb[s] for s in steps]

    def rms(e):
        return float(np.sqrt(np.mean(np.clip(e, -3, 3) ** 2)))

    parts = [f"mean F {np.mean(f_stats):.2f}", f"own rms {rms(own):.3f} (median {np.median(own):+.3f})"]
    parts += [f"alpha {a:g}: rms {rms(e):.3f} (median {np.median(e):+.3f}), rejected {rejected[a] / tables:.0%}"
              for a, e in gated.items()]
    return " | ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", type=int, default=200)
    args = ap.parse_args(argv)
    for tau, lag in ((0.0, 1.0), (0.05, 1.0), (0.1, 1.0), (0.2, 1.0), (0.0, 1.3), (0.0, 1.5), (0.0, 2.0)):
        for name, (batches, b_crit, sigma) in GRIDS.items():
            what = f"spread of ln S_min {tau:g}" if lag == 1.0 else f"one seed's S_min {lag:g}×"
            print(f"{name} grid, {what}: {run(batches, b_crit, sigma, tau, lag, args.tables)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
