"""What a cheaper design of the critical-batch sweep gives against the full 5-seed sweep, per unit of compute.

For one task (the demo tinygpt configuration, or MNIST's): the full design with 5 seeds once (the reference;
the same run directory as ``benchmarks/critical_stability.py``), then each cheap design of
:mod:`globalbatch.lab.sweep.designs` ``--reps`` times with independent seeds (rep r uses seeds 100 + 10·r, …).
Every design trains through ``run_sweep`` (the one trial loop); a design whose cells are a subset of another
run's (narrow1 ⊂ seeds1 at the same seed, the first seed of narrow2 too) reuses those finished trials by hard
link (trials are deterministic: a rerun reproduces them bit for bit), and its compute counts them all.

Prints per design: its tokens as a fraction of the full sweep's (median over reps), and at each of the full
sweep's common targets the ratio of its B_crit to the full sweep's (median over seeds there), median and
worst (the largest of r and 1/r) over the reps that have a point estimate there, with how many do (a seed's
fit beyond the swept batches is a one-sided bound, non-monotone cells are not fitted); and the same from the
joint fit B_crit(L) = B_ref·(L/L_ref)^k over targets and seeds (Kaplan's form), which gives a point at every
target.

The numbers ``globalbatch sweep --budget`` states (and from which it decides which design holds) are these:
``--record src/globalbatch/lab/sweep/measured.json`` merges them, per task and design, into that file with the
command that measured them (read by :mod:`globalbatch.lab.sweep.measured`).

    python benchmarks/critical_cost.py --task tinygpt|mnist [--full-dir DIR] [--out DIR] [--reps 3]
        [--designs seeds1,narrow1,narrow2,halving,branch] [--workers 2] [--threads 1] [--analyze-only]
        [--record FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from critical_stability import config_for  # noqa: E402

REP_SEED0 = 100


def _link_trials(src: Path, dst: Path, names) -> int:
    """Hard-link finished trial directories ``names`` from run ``src`` into run ``dst`` (skip those present)."""
    n = 0
    for name in names:
        a, b = src / "trials" / name, dst / "trials" / name
        if not (a / "summary.json").is_file() or (b / "summary.json").is_file():
            continue
        b.mkdir(parents=True, exist_ok=True)
        for f in ("metrics.jsonl", "summary.json"):  # summary last: it is the done marker
            if not (b / f).exists():
                os.link(a / f, b / f)
        n += 1
    return n


def _tokens(run: Path) -> float:
    """Every unit the run trained: finished trials and the paused ones (cells successive halving stopped)."""
    from globalbatch.lab.sweep.halving import trained_units

    return trained_units(run)["total"]


def _reuse(cfg, run: Path, donors: list[Path]) -> int:
    """Link into ``run`` every cell the design will ask for that a donor run already finished."""
    from globalbatch.lab.sweep.lr_edges import edge_cells, finished_summaries, transfer_cells
    from globalbatch.lab.sweep.runner import narrow_choice

    names = {t.name for t in cfg.trials()}
    linked = 0
    for _ in range(6):  # the design's later cells follow from the linked ones
        for d in donors:
            linked += _link_trials(d, run, names)
        done = finished_summaries(run, cfg) if (run / "trials").is_dir() else []
        more = {t.name for t in edge_cells(cfg, done, None)}
        if cfg.design.startswith("narrow"):  # the LR the runner will transfer: the analysis' choice, as it reads it
            more |= {t.name for t in transfer_cells(cfg, done, narrow_choice(run, cfg) if done else None)}
        if more <= names:
            break
        names |= more
    return linked


def _halving_note(run: Path) -> str:
    """Successive halving: the cells stopped at each rung and the stopped cells' share of the run's tokens."""
    import json

    from globalbatch.lab.sweep.halving import LOG_NAME, trained_units

    if not (run / LOG_NAME).is_file():
        return ""
    log, units = json.loads((run / LOG_NAME).read_text()), trained_units(run)
    stops = "/".join(str(len(d["stopped"])) for d in log["decisions"])
    return (f"; halving: stopped {stops} cells at rungs {log['rungs']}, {len(log.get('finished', []))} finished, "
            f"stopped cells {units['stopped'] / units['total']:.0%} of its tokens, margin "
            f"{log['decisions'][0]['margin']:.4f} ({log['decisions'][0]['margin_source']})")


def _b_crit_by_target(sa) -> tuple[dict[float, float | None], dict[float, float | None]]:
    return ({st.target: st.b_crit for st in sa.targets}, {st.target: st.joint_b_crit for st in sa.targets})


def ratio_cells(rs: dict, targets) -> list:
    """Per target: (median, worst = max of r and 1/r, n) over the repetitions with a ratio there; None where none."""
    out = []
    for t in targets:
        ok = [x for x in rs[t] if x]
        out.append(None if not ok else (round(statistics.median(ok), 3), round(max(max(x, 1 / x) for x in ok), 3),
                                        len(ok)))
    return out


def record(path, task: str, reference: dict, designs: dict) -> None:
    """Merge ``designs`` (name → compute per rep, per-target and joint ratio cells) for ``task`` into the JSON file
    ``path`` (``src/globalbatch/lab/sweep/measured.json``: what ``sweep --budget`` states), with the command that
    measured them and when, and print them."""
    import json

    doc = json.loads(Path(path).read_text()) if path and Path(path).is_file() else {}
    doc.setdefault("provenance", {"about": "benchmarks/critical_cost.py --record: each design's repetitions against "
                                           "one full 5-seed sweep per task", "commands": []})
    entry = doc.setdefault("tasks", {}).setdefault(task, {"reference": reference, "designs": {}})
    if entry["reference"] != reference:  # another reference: the old rows compared against something else
        entry.update(reference=reference, designs={})
    entry["designs"].update(designs)
    cmd = " ".join(["python", *sys.argv])
    old = [c for c in doc["provenance"]["commands"] if c["command"] == cmd]
    doc["provenance"]["commands"] = [c for c in doc["provenance"]["commands"] if c["command"] != cmd] + [
        {"command": cmd, "task": task, "designs": sorted(set(designs).union(*(c["designs"] for c in old))),
         "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}]
    if path:
        tmp = Path(str(path) + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    print(f"\nmeasured ({task}, for {path or 'src/globalbatch/lab/sweep/measured.json'}):")
    print(json.dumps({"reference": reference, "designs": designs}, sort_keys=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=("tinygpt", "mnist"), default="tinygpt")
    ap.add_argument("--full-dir", default=None, help="the full 5-seed sweep (run here when missing)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--designs", default="seeds1,narrow1,narrow2", help="also: halving")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--analyze-only", action="store_true")
    ap.add_argument("--record", default=None, help="merge the measured rows into this JSON file (see the docstring)")
    ap.add_argument("--reps-only", action="store_true", help="run the designs' repetitions only (the full sweep may "
                    "still be running elsewhere); analyse later with --analyze-only")
    args = ap.parse_args(argv)

    from globalbatch.critical import AnalysisSettings
    from globalbatch.lab.sweep import analyze_sweep_seeds, run_sweep

    base = config_for(args.task)
    full_dir = Path(args.full_dir or f"runs/critical_stability_{args.task}")
    out = Path(args.out or f"runs/critical_cost_{args.task}")
    designs = [d for d in args.designs.split(",") if d]
    if "branch" in designs:  # the branch test at several points, B_crit(L): its own runner, the same reference
        from critical_cost_branch import main as branch_main

        designs.remove("branch")
        branch_main(["--task", args.task, "--reps", str(args.reps), "--threads", str(args.threads)]
                    + [x for flag, v in (("--full-dir", args.full_dir), ("--out", args.out)) if v for x in (flag, v)]
                    + (["--analyze-only"] if args.analyze_only else [])
                    + (["--record", args.record] if args.record else []))
        if not designs:
            return 0
    t0 = time.time()
    full_cfg = dataclasses.replace(base, seeds=list(range(5)))
    if args.reps_only:
        for name in designs:
            for r in range(args.reps):
                cfg = dataclasses.replace(base, seeds=[REP_SEED0 + 10 * r + i for i in range(5)], design=name)
                run = out / f"rep{r}" / name
                run.mkdir(parents=True, exist_ok=True)
                donors = [out / f"rep{r}" / d for d in ("seeds1", "narrow1", "narrow2") if d != name]
                linked = _reuse(cfg, run, [d for d in donors if d.is_dir() and name != "halving"])
                res = run_sweep(cfg, run, workers=args.workers, threads=args.threads, progress=False, timing_steps=0)
                print(f"  {name} rep {r}: {len(res.ran)} trials run, {linked} reused, {time.time() - t0:,.0f} s so far",
                      flush=True)
        return 0
    if not args.analyze_only:
        run_sweep(full_cfg, full_dir, workers=args.workers, threads=args.threads, progress=False, timing_steps=0)
    _, full = analyze_sweep_seeds(full_dir)
    full_tokens = _tokens(full_dir)
    targets = [st.target for st in full.targets]
    ref, ref_joint = _b_crit_by_target(full)
    print(f"task {args.task}: full design, 5 seeds: {full_tokens:,.0f} units, {full.monotone_share():.0%} monotone; "
          "B_crit (median over seeds) at its targets: "
          + ", ".join(f"{t:.4f}: {ref[t]:,.0f}" if ref[t] else f"{t:.4f}: –" for t in targets))
    rows = {}
    for name in designs:
        fracs, ratios, jratios, notes = [], {t: [] for t in targets}, {t: [] for t in targets}, []
        for r in range(args.reps):
            seeds = [REP_SEED0 + 10 * r + i for i in range(5)]
            cfg = dataclasses.replace(base, seeds=seeds, design=name)
            run = out / f"rep{r}" / name
            donors = [out / f"rep{r}" / d for d in ("seeds1", "narrow1", "narrow2") if d != name]
            if not args.analyze_only:
                run.mkdir(parents=True, exist_ok=True)
                linked = _reuse(cfg, run, [d for d in donors if d.is_dir() and name != "halving"])  # halving pauses
                res = run_sweep(cfg, run, workers=args.workers, threads=args.threads, progress=False, timing_steps=0)
                print(f"  {name} rep {r}: {len(res.ran)} trials run, {linked} reused, {time.time() - t0:,.0f} s so far",
                      flush=True)
            try:
                _, sa = analyze_sweep_seeds(run, settings=AnalysisSettings(targets=targets))
            except Exception as exc:  # a design that cannot be analysed at the full sweep's targets is a miss
                notes.append(f"rep {r}: {exc}")
                fracs.append(_tokens(run) / full_tokens)
                for t in targets:
                    ratios[t].append(None)
                    jratios[t].append(None)
                continue
            fracs.append(_tokens(run) / full_tokens)
            mine, joint = _b_crit_by_target(sa)
            for t in targets:
                ratios[t].append(mine[t] / ref[t] if mine.get(t) and ref[t] else None)
                jratios[t].append(joint[t] / ref_joint[t] if joint.get(t) and ref_joint[t] else None)
            sel = {st.lr_selection for st in sa.targets}
            notes.append(f"rep {r}: seeds {sa.seeds}, LR selection {'/'.join(sorted(sel))}, "
                         f"{sa.monotone_share():.0%} monotone, {len(sa.lr_falls)} falling-LR pair(s)"
                         + _halving_note(run))
        rows[name] = (fracs, ratios, jratios, notes)

    def worst(xs):  # over the reps with a point estimate at this target
        ok = [max(x, 1 / x) for x in xs if x]
        return max(ok) if ok else math.nan

    def med(xs):
        ok = [x for x in xs if x]
        return statistics.median(ok) if ok else math.nan

    print(f"\n{'design':<9} {'compute':>8}  " + "  ".join(f"{t:>17.4f}" for t in targets) + "   worst (all targets)")
    print(f"{'':<9} {'':>8}  " + "  ".join(f"{'median / worst (n)':>17}" for _ in targets)
          + "   (n: reps with a point estimate there; a one-seed fit beyond the swept batches is a bound, not a point)")
    for name, (fracs, ratios, jratios, notes) in rows.items():
        for label, rs in (("per-target", ratios), ("joint", jratios)):
            cells = [f"{med(rs[t]):.2f} / {worst(rs[t]):.2f} ({sum(1 for x in rs[t] if x)}/{len(rs[t])})"
                     for t in targets]
            w = max((worst(rs[t]) for t in targets if any(rs[t])), default=math.nan)
            print(f"{name if label == 'per-target' else '':<9} "
                  f"{(f'{statistics.median(fracs):.1%}' if label == 'per-target' else label):>8}  "
                  + "  ".join(f"{c:>17}" for c in cells) + f"   {w:.2f} ({label})")
        for n in notes:
            print(f"    {n}")
        print(f"    compute per rep: {', '.join(f'{f:.1%}' for f in fracs)}")
    record(args.record, args.task, reference_record(full_dir, full, full_tokens),
           {name: {"reps": len(fracs), "compute": [round(f, 4) for f in fracs], "per_target": ratio_cells(rs, targets),
                   "joint": ratio_cells(js, targets)} for name, (fracs, rs, js, _) in rows.items()})
    print(f"\nwall {time.time() - t0:,.0f} s; goal: a design within 2× at every common target with ≤ 10% of the compute")
    return 0


def reference_record(full_dir: Path, full, units: float) -> dict:
    """The full sweep the ratios are taken against: where, its seeds and units, B_crit (median over seeds) per target
    (None: no point estimate there)."""
    return {"dir": str(full_dir), "seeds": len(full.seeds), "units": round(units),
            "targets": [round(st.target, 4) for st in full.targets],
            "b_crit": [None if st.b_crit is None else round(st.b_crit, 1) for st in full.targets]}


if __name__ == "__main__":
    sys.exit(main())
