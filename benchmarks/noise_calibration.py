"""B_simple along one run, calibrated to B_crit (lab/noise_calibration.py), checked against the full 5-seed sweep.

1. The calibration sweep: the task's sweep configuration (benchmarks/critical_stability.config_for) run with
   ``noise=True`` on ``--cal-seeds`` (default 2 seeds, 200 and 201: independent of the reference's 0–4); the
   factor F = B_crit / B_simple (local, at each common target's crossing) per target, its median and range.
2. Another run: one trial of the same task at the middle batch of the grid (``--run-batch``; at the smallest, 2
   micro-batches of 4, every estimate was flagged too noisy) and the middle LR of its grid, seed 300, with the
   noise monitor (no LR grid, no edges): its B_simple along the run (unflagged estimates only, as the sweep's
   analysis reads them), read where its held-out loss crosses each of the reference's targets, times F.
3. Printed per reference target: the reference's B_crit (median over its seeds), the run's B_simple there, the
   calibrated F·B_simple [F's range], and the ratios calibrated / reference and raw B_simple / reference; the
   compute of the calibration sweep and of the one run as fractions of the reference's units.

    python benchmarks/noise_calibration.py --task mnist|tinygpt [--full-dir DIR] [--out DIR] [--cal-seeds 200,201]
        [--workers 1] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from critical_cost_branch import reference  # noqa: E402
from critical_cost_branch import sweep_units as _tokens  # noqa: E402
from critical_stability import config_for  # noqa: E402


def crossing(curve, target: float):
    """Units where the run's held-out loss (non-increasing isotonic fit) first reaches ``target``; None if never."""
    from scipy.optimize import isotonic_regression

    e, y = np.asarray(curve.eval_examples, dtype=float), np.asarray(curve.eval_loss, dtype=float)
    iso = isotonic_regression(y, increasing=False).x
    below = np.nonzero(iso <= target)[0]
    if below.size == 0:
        return None
    i = int(below[0])
    if i == 0:
        return float(e[0])
    x0, x1, l0, l1 = math.log(e[i - 1]), math.log(e[i]), iso[i - 1], iso[i]
    return float(math.exp(x0 + (x1 - x0) * (l0 - target) / (l0 - l1))) if l0 != l1 else float(e[i])


def readings(run_dir: Path, curve, mode: str) -> list[tuple[float, float]]:
    """The trial's B_simple readings: ``unflagged`` as the sweep's analysis reads them (``Curve.b_simple``), or
    ``raw``: every finite positive estimate, flagged ``wide_interval``/``too_noisy`` included (the estimator's
    point value; under an EMA of few windows most readings late in a run are flagged wide)."""
    import json

    if mode == "unflagged":
        return sorted(curve.b_simple)
    out = []
    for line in (run_dir / "trials" / curve.label / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        b = r.get("b_simple")
        if r.get("val_loss") is not None and b is not None and math.isfinite(b) and b > 0:
            out.append((float(r["consumed"]), float(b)))
    return sorted(out)


def b_simple_at(points, units: float):
    """Log-log interpolation inside the readings; None outside them (no extrapolation from a distant reading)."""
    if not points or not points[0][0] <= units <= points[-1][0]:
        return None
    e = np.log([p[0] for p in points])
    v = np.log([p[1] for p in points])
    return float(np.exp(np.interp(math.log(units), e, v)))


def sweep_b_simple(run_dir: Path, analysis, mode: str) -> dict:
    """Target → {"local": median over seeds and batches of the chosen-LR trial's B_simple at its crossing}."""
    from globalbatch.lab.sweep import load_sweep
    from globalbatch.lab.sweep.store import _finished_curves

    by = {(c.batch_size, c.seed, c.lr): c for c in _finished_curves(load_sweep(run_dir))}
    out = {}
    for st in analysis.targets:
        vals = []
        for b in st.steps:
            for seed, e in st.examples[b].items():
                c = by.get((b, seed, st.best_lr[b][seed])) if e is not None else None
                v = b_simple_at(readings(run_dir, c, mode), e) if c is not None else None
                if v is not None:
                    vals.append(v)
        if vals:
            out[st.target] = {"local": float(np.median(vals))}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=("tinygpt", "mnist"), default="mnist")
    ap.add_argument("--full-dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cal-seeds", default="200,201")
    ap.add_argument("--run-seed", type=int, default=300)
    ap.add_argument("--run-batch", type=int, default=None, help="the one run's batch (default: the grid's middle)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    from types import SimpleNamespace

    from globalbatch.lab.noise_calibration import calibrate
    from globalbatch.lab.sweep import analyze_sweep_seeds, load_sweep, run_sweep

    t0 = time.time()
    full_dir = Path(args.full_dir or f"runs/critical_stability_{args.task}")
    out = Path(args.out or f"runs/noise_calibration_{args.task}")
    targets, ref_b_crit, _, full_units, label = reference(args.task, full_dir)
    print(f"reference: {label}")
    base = config_for(args.task)
    cal_cfg = dataclasses.replace(base, seeds=[int(s) for s in args.cal_seeds.split(",")], noise=True)
    cal_dir = out / "calibration_sweep"
    run_sweep(cal_cfg, cal_dir, workers=args.workers, threads=args.threads, progress=False, timing_steps=0)
    _, cal_analysis = analyze_sweep_seeds(cal_dir)
    b0 = args.run_batch or sorted(base.batches)[len(base.batches) // 2]
    grid = base.lrs_for(b0)
    one_cfg = dataclasses.replace(base, seeds=[args.run_seed], batches=[b0], lrs=[grid[len(grid) // 2]],
                                  base_batch=b0, noise=True, lr_edge_extend=0, lr_refine=0)
    one_dir = out / f"one_run_b{b0}"
    run_sweep(one_cfg, one_dir, workers=1, threads=args.threads, progress=False, timing_steps=0)
    data = load_sweep(one_dir)
    from globalbatch.lab.sweep.store import _finished_curves

    (curve,) = _finished_curves(data)
    print(f"one run: batch {b0}, lr {grid[len(grid) // 2]:g}, seed {args.run_seed}; compute: calibration sweep "
          f"{_tokens(cal_dir) / full_units:.1%}, one run {_tokens(one_dir) / full_units:.1%} of the reference "
          f"({full_units:,.0f} units)")
    for mode in ("raw", "unflagged"):
        try:
            cal = calibrate(SimpleNamespace(targets=cal_analysis.targets,
                                            b_simple=sweep_b_simple(cal_dir, cal_analysis, mode)),
                            source=f"the sweep {cal_dir} ({len(cal_analysis.seeds)} seed(s)), {mode} B_simple")
        except ValueError as exc:  # no target with both: say so, go on
            print(f"\n{mode}: no calibration ({exc})")
            continue
        print(f"\n{mode}: calibration {cal.label}")
        print("  per target: " + ", ".join(f"{t:.4f}: {f:.3g}" for t, f in sorted(cal.per_target.items(), reverse=True)))
        for n in cal.notes:
            print(f"  {n}")
        compare(curve, readings(one_dir, curve, mode), cal, targets, ref_b_crit)
    print(f"\nwall {time.time() - t0:,.0f} s")
    return 0


def compare(curve, points, cal, targets, ref_b_crit) -> None:
    print(f"{'target':>8} {'ref B_crit':>11} {'B_simple':>9} {'calibrated [range]':>26} {'cal/ref':>8} {'raw/ref':>8}")
    worst = 0.0
    for target in targets:
        u = crossing(curve, target)
        bs = None if u is None else b_simple_at(points, u)
        if bs is None:
            print(f"{target:>8.4f} {'–':>11}  " + ("the run does not reach this target" if u is None
                                                   else "no B_simple reading around its crossing"))
            continue
        c, lo, hi = cal.factor * bs, cal.low * bs, cal.high * bs
        ref = ref_b_crit.get(target)
        inside = cal.loss_range[0] <= target <= cal.loss_range[1]
        r = c / ref if ref else math.nan
        if ref:
            worst = max(worst, r, 1 / r)
        print(f"{target:>8.4f} {(f'{ref:,.0f}' if ref else '–'):>11} {bs:>9,.1f} "
              f"{f'{c:,.0f} [{lo:,.0f}–{hi:,.0f}]':>26} {r:>8.2f} {(bs / ref if ref else math.nan):>8.2f}"
              + ("" if inside else "  (outside the calibrated losses)"))
    print(f"worst calibrated ratio (max of r, 1/r) where the reference has a point: {worst:.2f}")


if __name__ == "__main__":
    sys.exit(main())
