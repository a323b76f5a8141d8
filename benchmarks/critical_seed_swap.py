"""Is a seed's different critical batch its initialisation or its data order? Trials with the two swapped.

A sweep's seed sets both the model's initialisation and the order of the training samples. Where one seed's
B_crit differs from the others' beyond their noise (``critical_stability.py``: the F-test of one shared B_crit),
this reruns cells of that sweep with seeds ``a`` and ``b`` crossed — initialisation ``a`` with the data order of
``b``, and the reverse — through the sweep's own trial (``run_trial``; the data order is swapped by wrapping
``Task.sample_order``, nothing else changes), and prints the held-out steps to the sweep's targets beside the
original trials'.

    python benchmarks/critical_seed_swap.py --config w32s32 --run DIR --cells 32:0.005657,64:0.008,4:0.004
        [--seeds 0,1] [--targets 2.8782,2.7012,2.6127,2.5242] [--out runs/critical_seed_swap]

``--run``: the finished sweep (its ``manifest.json`` gives the grid; its trials the originals).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from critical_stability import config_for  # noqa: E402


def _steps(run: Path, name: str, targets: list[float]) -> list:
    from globalbatch.critical.curves import steps_to_target
    from globalbatch.lab.sweep import load_sweep
    from globalbatch.lab.sweep.store import curves_from_sweep

    for c in curves_from_sweep(load_sweep(run)):
        if c.label == name:
            return [(r[0] if (r := steps_to_target(c, t, readout="heldout")) else None) for t in targets]
    return [None] * len(targets)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=("tinygpt", "mnist"), default="tinygpt")
    ap.add_argument("--config", default="w32s32")
    ap.add_argument("--run", required=True, help="the finished sweep whose cells are rerun")
    ap.add_argument("--cells", required=True, help="batch:lr pairs, comma-separated")
    ap.add_argument("--seeds", default="0,1", help="the two seeds to cross")
    ap.add_argument("--targets", required=True, help="held-out losses, comma-separated")
    ap.add_argument("--out", default="runs/critical_seed_swap")
    args = ap.parse_args(argv)

    from globalbatch.lab.sweep import run_trial
    from globalbatch.lab.tasks import base

    a, b = (int(x) for x in args.seeds.split(","))
    targets = [float(x) for x in args.targets.split(",")]
    cfg = dataclasses.asdict(dataclasses.replace(config_for(args.task, args.config), seeds=[a, b]))
    data_seed: dict[int, int] = {}
    sample_order = base.Task.sample_order
    base.Task.sample_order = lambda self, seed: sample_order(self, data_seed.get(seed, seed))  # type: ignore[method-assign]
    run = Path(args.run)
    print(f"steps to the held-out targets {', '.join(f'{t:g}' for t in targets)} (initialisation / data order)")
    for cell in args.cells.split(","):
        batch, lr = int(cell.split(":")[0]), float(cell.split(":")[1])
        name = f"b{batch}_lr{lr:g}"
        for init, data in ((a, a), (b, b), (a, b), (b, a)):
            if init == data:
                steps = _steps(run, f"{name}_s{init}", targets)
            else:
                out = Path(args.out) / f"init{init}_data{data}_b{batch}_lr{lr:g}"
                out.mkdir(parents=True, exist_ok=True)
                shutil.copy(run / "manifest.json", out / "manifest.json")
                data_seed.clear()
                data_seed[init] = data
                run_trial(cfg, {"batch": batch, "lr": lr, "seed": init}, str(out), threads=1)
                steps = _steps(out, f"{name}_s{init}", targets)
            print(f"  batch {batch}, lr {lr:g}: init {init} / data {data}: "
                  + ", ".join(f"{s:.1f}" if s is not None else "–" for s in steps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
