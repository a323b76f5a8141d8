"""The F-test of one B_crit shared by the seeds (critical/seed_spread.py): its size and power on ground truth.

docs/critical.md §1b's numbers. Synthetic steps-to-target tables S = S_min,seed·(1 + B_crit,seed/B) at MNIST's
batches (8 … 512), 5 seeds, the seeds' S_min scattered by 0.3 in ln, log-normal noise of SD ``sigma`` on the steps
(the real 5-seed runs' per-seed residual SD: 0.02–0.32, median ≈ 0.1). Prints how often the test rejects one shared
B_crit at the 5 % level: where the seeds share it (size: should be ≈ 5 %) and where one seed's is 2× or 0.5× the
others' (power).

    python benchmarks/critical_seed_spread.py [--tables 400]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from globalbatch.critical.seed_spread import shared_b_crit_f_test

BATCHES = np.array([8.0, 16, 32, 64, 128, 256, 512])


def rejection_rate(b_crits, sigma: float, tables: int, seed: int = 0, s_min_sd: float = 0.3) -> float:
    """The share of ``tables`` synthetic tables on which the test rejects one shared B_crit at 5 %."""
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(tables):
        steps = {s: 5.0 * math.exp(rng.normal(0, s_min_sd)) * (1 + bc / BATCHES) * np.exp(rng.normal(0, sigma, BATCHES.size))
                 for s, bc in enumerate(b_crits)}
        hits += shared_b_crit_f_test(BATCHES, steps).differ
    return hits / tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", type=int, default=400)
    args = ap.parse_args(argv)
    t0 = time.time()
    print(f"{args.tables} tables per cell; 5 seeds × batches {', '.join(f'{b:g}' for b in BATCHES)}; rejection rate "
          "at the 5 % level")
    print(f"{'noise SD':>8}  {'shared 200 (size)':>17}  {'one seed 2× (power)':>19}  {'one seed 0.5× (power)':>21}")
    for sigma in (0.05, 0.15, 0.3):
        print(f"{sigma:>8g}  {rejection_rate([200.0] * 5, sigma, args.tables):>17.1%}  "
              f"{rejection_rate([200.0] * 4 + [400.0], sigma, args.tables):>19.1%}  "
              f"{rejection_rate([200.0] * 4 + [100.0], sigma, args.tables):>21.1%}")
    print(f"size with B_crit beyond the batches (1,000): {rejection_rate([1000.0] * 5, 0.15, args.tables):.1%}; "
          f"below them (20): {rejection_rate([20.0] * 5, 0.15, args.tables):.1%} (noise SD 0.15)")
    print(f"{time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
