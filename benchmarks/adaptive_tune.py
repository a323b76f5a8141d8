"""Tune the noise-tracking policy's c on tuning seeds (not the reported ones): fixed arms once, then one
directory per c sharing those fixed runs. Prints the analysis of each c. Usage:
    python benchmarks/adaptive_tune.py OUT SEED,SEED C,C,...
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from globalbatch.lab.adaptive_run import AdaptiveConfig, analyze_adaptive, run_adaptive, run_arm


def main() -> None:
    out, seeds, cs = Path(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")], [float(c) for c in sys.argv[3].split(",")]
    base = AdaptiveConfig(seeds=seeds, eval_points=16)  # as the fixed tuning runs were read out
    fixed_dir = out / "fixed"
    fixed_dir.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        for b in base.batches:
            from globalbatch.lab.adaptive_run import run_done
            if not run_done(fixed_dir, f"b{b}", seed, base):
                s = run_arm(base, fixed_dir, f"b{b}", seed)
                print(f"b{b}/s{seed}: {s['steps']} steps {s['wall_s']:.0f} s", flush=True)
    for c in cs:
        d = out / f"c{c:g}"
        for b in base.batches:
            src = fixed_dir / "runs" / f"b{b}"
            if not (d / "runs" / f"b{b}").exists():
                shutil.copytree(src, d / "runs" / f"b{b}")
        cfg = AdaptiveConfig(seeds=seeds, c=c, eval_points=16)
        run_adaptive(cfg, d, threads=1, log=lambda m: print(f"c={c:g} {m}", flush=True))
        a = analyze_adaptive(d)
        print(f"c={c:g}: target {a.target:.4f}; front ratio {a.front_ratio['mean']:.3f}; {a.verdict}", flush=True)
        for seed, chs in a.changes.items():
            print(f"   seed {seed}: " + ", ".join(f"{ch['old_batch']}->{ch['new_batch']}@{ch['position']}" for ch in chs))


if __name__ == "__main__":
    main()
