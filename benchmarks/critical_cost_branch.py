"""The branch test at several points of one base run (B_crit(L), lab/branch.py) as a cheap design of the
critical-batch measurement, against the full 5-seed sweep of ``benchmarks/critical_cost.py``.

Per repetition r (seed 100 + 10·r for the base run's init and data order): one base run at the sweep's smallest
batch B, at the middle of that batch's LR grid (the design sees no sweep result), to a quarter of one sweep
trial's units; ``--points`` branch points spaced geometrically from 1/64 to 1/4 of a trial's units (a small
batch reaches the sweep's targets early: at B ≪ B_crit it needs about E_min units); at each, branches at every
swept batch (k = batch / B, LR × the optimizer's rule), ``--seeds`` data orders each, each branch training as
many units as its point's (``--window-fraction`` 1: B_crit read locally, short windows early; 0.5 read lower),
its Adam second moments divided by k (``--second-moment scaled``; ``keep`` read B_crit 2–4× low on MNIST).
Each point gives B_crit at the loss the k = 1 branches reach, and ``branch_curve`` fits B_crit(L) =
B_ref·(L/L_ref)^k over the points (the sweep's joint form).

Prints per tolerance rule (the decision is re-made without training): ``half_window`` (the branch test reading
McCandlish's B_crit, docs/critical.md §3) and ``absolute`` 0.01 (Merrill et al.'s): the compute as a fraction of
the full sweep's tokens, and at each of the full sweep's common targets the ratio of the curve's B_crit to the
full sweep's (median over seeds there, and its joint fit where the run directory is here), median and worst
(max of r, 1/r) over the repetitions whose fitted points span that target (n; the line "extrap." counts every
repetition with a fit, extrapolating the power law beyond its points). Without the full sweep's run directory on this machine the reference is the
one quoted in docs/critical.md (``DOC_REFERENCE``, labelled as such in the output).

    python benchmarks/critical_cost_branch.py --task tinygpt|mnist [--full-dir DIR] [--out DIR] [--reps 3]
        [--points 5] [--seeds 3] [--window-fraction 1] [--window UNITS] [--threads 1] [--analyze-only]
    python benchmarks/critical_cost.py --task tinygpt|mnist --designs branch   # the same, from critical_cost.py
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from critical_stability import config_for  # noqa: E402

REP_SEED0 = 100
RULES = (("half_window", None), ("absolute", 0.01))
DOC_REFERENCE = {
    # The full 5-seed demo tinygpt sweep (114 trials of 150K tokens; runs/critical_cost_full_tinygpt on the machine
    # that ran it)
    # analysed with the read-out of docs/critical.md (the held-out curve smoothed before its isotonic fit): B_crit
    # median over seeds at its common targets. Used only when its run directory is absent.
    "tinygpt": {"tokens": 17_144_929, "b_crit": {2.8495: 506.0, 2.7852: 570.0, 2.7209: 651.0, 2.6566: 715.0,
                                                  2.5923: 784.0}},
}


def branch_config(task: str, seed: int, *, points: int, seeds: int, window: int | None, window_fraction: float = 1.0,
                  lr: float | None = None, second_moment: str = "keep"):
    """The design's BranchConfig from the sweep's configuration of ``task``."""
    import numpy as np

    from globalbatch.lab.branch import BranchConfig

    cfg = config_for(task)
    base = min(cfg.batches)
    grid = cfg.lrs_for(base)
    at = sorted({int(round(x)) for x in np.geomspace(cfg.budget / 64, cfg.budget / 4, points)})
    return BranchConfig(task=cfg.task, task_overrides=dict(cfg.task_overrides), base_batch=base,
                        ks=[b // base for b in cfg.batches], lr=lr or grid[len(grid) // 2], optimizer=cfg.optimizer,
                        branch_at=at, window=window or 1, window_fraction=None if window else window_fraction, seeds=seeds, seed=seed,
                        micro_batch=cfg.micro_batch, max_val_samples=cfg.max_val_samples,
                        max_grad_norm=cfg.max_grad_norm, second_moment=second_moment)


def sweep_units(run: Path) -> float:
    """The units every finished trial of a sweep directory trained."""
    from globalbatch.lab.sweep import load_sweep

    data = load_sweep(run)
    return float(sum(float(s.consumed if hasattr(s, "consumed") else s["consumed"]) for s in data.summaries.values()))


def reference(task: str, full_dir: Path):
    """(targets, B_crit per target, joint B_crit per target or None, full tokens, label, the reference's record for
    ``critical_cost.record``)."""
    short = ""
    if (full_dir / "manifest.json").is_file():
        from globalbatch.lab.sweep import analyze_sweep_seeds

        _, full = analyze_sweep_seeds(full_dir)
        targets = [st.target for st in full.targets]
        if len(full.seeds) < 5 and task in DOC_REFERENCE:  # a full sweep still running: not the reference yet
            short = f"; {full_dir} holds {len(full.seeds)} seed(s) so far"
        else:
            from critical_cost import reference_record

            units = sweep_units(full_dir)
            return (targets, {st.target: st.b_crit for st in full.targets},
                    {st.target: st.joint_b_crit for st in full.targets}, units,
                    f"the full sweep in {full_dir} ({len(full.seeds)} seeds)", reference_record(full_dir, full, units))
    if task not in DOC_REFERENCE:
        raise SystemExit(f"no full sweep in {full_dir} and no quoted reference for {task}")
    doc = DOC_REFERENCE[task]
    targets = sorted(doc["b_crit"], reverse=True)
    return (targets, dict(doc["b_crit"]), None, float(doc["tokens"]),
            f"the full 5-seed sweep as quoted in DOC_REFERENCE (its run directory is not on this machine, or not "
            f"complete{short})", {"dir": "DOC_REFERENCE", "seeds": 5, "units": doc["tokens"], "targets": targets,
                                  "b_crit": [doc["b_crit"][t] for t in targets]})


def design_name(rule: str, args) -> str:
    """``branch`` for the design measured best (half-window rule, second moments divided by k, window = point,
    the base grid's middle LR, 5 points, 3 data orders); any other setting named by what differs."""
    return "branch" + ("" if rule == "half_window" else "_absolute") \
        + ("" if args.second_moment == "scaled" else f"_{args.second_moment}") \
        + ("" if args.window is None and args.window_fraction == 1 else
           f"_window{args.window}" if args.window else f"_wf{args.window_fraction:g}") \
        + ("" if args.lr is None else f"_lr{args.lr:g}") \
        + ("" if args.points == 5 else f"_points{args.points}") + ("" if args.seeds == 3 else f"_seeds{args.seeds}")


def used_units(res) -> float:
    """The base run's units (its last branch point) and every branch's."""
    return float(res.config.branch_at[-1]) + sum(float(b["units"]) for b in res.branches)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=("tinygpt", "mnist"), default="tinygpt")
    ap.add_argument("--full-dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--points", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--window", type=int, default=None, help="units per branch (default: half each point's units)")
    ap.add_argument("--window-fraction", type=float, default=1.0, help="each branch trains this × its point's units")
    ap.add_argument("--lr", type=float, default=None, help="the base run's LR (default: the middle of the base batch's "
                    "grid; the sweep's result is not used)")
    ap.add_argument("--second-moment", choices=("keep", "scaled", "split"), default="scaled",
                    help="scaled (the design measured best): a k-branch's Adam exp_avg_sq divided by k; keep: as is")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--analyze-only", action="store_true")
    ap.add_argument("--record", default=None, help="merge the measured rows into this JSON file "
                    "(critical_cost.py's --record)")
    args = ap.parse_args(argv)

    from critical_cost import ratio_cells, record

    from globalbatch.lab.branch import load_branch_results, run_branch_test

    t0 = time.time()
    full_dir = Path(args.full_dir or f"runs/critical_stability_{args.task}")
    out = Path(args.out or f"runs/critical_cost_{args.task}")
    targets, ref, ref_joint, full_tokens, label, ref_record = reference(args.task, full_dir)
    print(f"task {args.task}: reference {label}: {full_tokens:,.0f} units; B_crit at its targets: "
          + ", ".join(f"{t:.4f}: {ref[t]:,.0f}" if ref.get(t) else f"{t:.4f}: –" for t in targets), flush=True)
    runs = []
    for r in range(args.reps):
        cfg = branch_config(args.task, REP_SEED0 + 10 * r, points=args.points, seeds=args.seeds, window=args.window,
                            window_fraction=args.window_fraction, lr=args.lr, second_moment=args.second_moment)
        run = out / f"rep{r}" / "branch_points"
        if not args.analyze_only:
            run.mkdir(parents=True, exist_ok=True)
        if args.analyze_only:
            res = load_branch_results(run)
        else:
            res = run_branch_test(cfg, run, threads=args.threads, progress=False)
            print(f"  branch rep {r}: base batch {cfg.base_batch}, ks {cfg.ks}, lr {cfg.lr:g}, points {cfg.branch_at}, "
                  f"{res.compute_s:,.0f} s of training, {time.time() - t0:,.0f} s so far", flush=True)
        runs.append((run, res))

    def worst(xs):
        ok = [max(x, 1 / x) for x in xs if x]
        return max(ok) if ok else math.nan

    def med(xs):
        ok = [x for x in xs if x]
        return statistics.median(ok) if ok else math.nan

    fracs = [used_units(res) / full_tokens for _, res in runs]
    print(f"\ncompute per rep: {', '.join(f'{f:.1%}' for f in fracs)} of the reference's units "
          f"(median {statistics.median(fracs):.1%}); windows (samples) by point {runs[0][1].window_samples_by_point}")
    print(f"{'rule':<12} {'vs':<15}  " + "  ".join(f"{t:>17.4f}" for t in targets) + "   worst")
    recorded = {}
    for rule, tol in RULES:
        per_rep = [load_branch_results(run, tolerance_rule=rule, **({} if tol is None else {"tolerance": tol}))
                   for run, _ in runs]
        curves = [res.curve for res in per_rep]

        def spans(c, t):
            used = [p.loss for p in c.points if not p.censored]
            return bool(used) and min(used) <= t <= max(used)

        for name, refs in (("median", ref), ("joint", ref_joint)):
            if refs is None:
                continue
            for scope in ("spanned", "extrap."):
                rs = {t: [c.fit.b_crit(t) / refs[t] if c is not None and c.fit is not None and refs.get(t)
                          and (scope == "extrap." or spans(c, t)) else None for c in curves] for t in targets}
                if scope == "spanned":
                    recorded.setdefault(design_name(rule, args), {"reps": len(runs), "compute": [round(f, 4) for f in fracs],
                                                                  "per_target": None, "joint": None})[
                        "per_target" if name == "median" else "joint"] = ratio_cells(rs, targets)
                cells = [f"{med(rs[t]):.2f} / {worst(rs[t]):.2f} ({sum(1 for x in rs[t] if x)})" for t in targets]
                w = max((worst(rs[t]) for t in targets if any(rs[t])), default=math.nan)
                label = rule + ("" if tol is None else f" {tol:g}")
                print(f"{label:<12} {name + ' ' + scope:<15}  " + "  ".join(f"{c:>17}" for c in cells) + f"   {w:.2f}")
        for r, c in enumerate(curves):
            if c is None:
                continue
            span = [p.loss for p in c.points if not p.censored]
            pts = ", ".join(f"{p.loss:.3f}: {p.bound}{p.b_crit_units:,.0f}" for p in c.points)
            fit = (f"B_crit(L) = {c.fit.b_ref:,.0f}·(L/{c.fit.loss_ref:.3f})^{c.fit.k:.2f}" if c.fit is not None
                   else f"no fit ({c.note})")
            print(f"    rep {r}: points {pts}; {fit}; fitted losses "
                  + (f"{min(span):.3f}–{max(span):.3f}" if span else "none"))
    record(args.record, args.task, ref_record, recorded)
    load_branch_results(runs[0][0])  # leave result.json at the default tolerance
    for run, _ in runs[1:]:
        load_branch_results(run)
    print(f"\nwall {time.time() - t0:,.0f} s; goal: within 2× at every common target with ≤ 10% of the compute")
    return 0


if __name__ == "__main__":
    sys.exit(main())
