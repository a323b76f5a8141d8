"""The CPU a sweep's progress display takes from its trials: the lab's display against one bar per cell.

A sweep's trials use every core (the demo: 2 workers on 2 cores), so the main process's rendering is paid out of
the trials' time. Baseline: one rich bar per pending cell (45 in the demo's base round), redrawn at rich's default
10 times a second. Ours (``globalbatch.lab.sweep.runner.progress_display``): an overall bar and the running trials'
bars only (2 in the demo), redrawn ``PROGRESS_REFRESH_PER_S`` times a second, and a printed line per finished trial.

Both render the same made-up progress — ``--cells`` cells, ``--workers`` running at a time, each moving forward every
0.1 s — into a terminal console writing to memory (a real terminal pays the escape sequences' writes on top), for
``--seconds`` each, alternately ``--pairs`` times; reported: process CPU seconds per wall second of each and the
median ratio (baseline / ours) over the pairs, and the share of one core each takes.

    python benchmarks/progress_overhead.py                 # 45 cells, 2 running, 5 s × 2 × 3 pairs: ~30 s
    python benchmarks/progress_overhead.py --cells 200 --workers 8
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _console():
    from rich.console import Console

    return Console(file=io.StringIO(), force_terminal=True, width=160)


def before(cells: int, workers: int, seconds: float) -> float:
    """One bar per cell at rich's default refresh: CPU seconds per wall second."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn("{task.description:>16}"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                    TimeElapsedColumn(), transient=False, console=_console())
    ids = [prog.add_task(f"b{i}_lr0.002_s0", total=1000) for i in range(cells)]
    return _drive(prog, seconds, cells, workers, lambda i, done: prog.update(ids[i], completed=done))


def now(cells: int, workers: int, seconds: float) -> float:
    """The lab's display: the overall bar, the running cells' bars, a line per finished cell."""
    from globalbatch.lab.sweep.runner import progress_display

    prog = progress_display(_console())
    overall = prog.add_task("trials", total=cells, unit="trials")
    running: dict[int, int] = {}
    finished = [0]

    def step(i: int, done: int) -> None:
        if i not in running:
            running[i] = prog.add_task(f"b{i}_lr0.002_s0", total=1000, unit="tokens")
        prog.update(running[i], completed=done)
        if done >= 1000:
            prog.remove_task(running.pop(i))
            finished[0] += 1
            prog.update(overall, completed=finished[0])
            prog.console.print(f"  b{i}_lr0.002_s0 done ({finished[0]}/{cells})", highlight=False)

    return _drive(prog, seconds, cells, workers, step)


def _drive(prog, seconds: float, cells: int, workers: int, update) -> float:
    """``workers`` cells at a time move 50 units every 0.1 s (20 s per cell) for ``seconds``."""
    c0, w0 = time.process_time(), time.perf_counter()
    prog.start()
    progress = {i: 0 for i in range(cells)}
    active = list(range(min(workers, cells)))
    nxt = len(active)
    while time.perf_counter() - w0 < seconds:
        for k, i in enumerate(list(active)):
            progress[i] = min(1000, progress[i] + 50)
            update(i, progress[i])
            if progress[i] >= 1000:
                active[k] = nxt % cells
                nxt += 1
        time.sleep(0.1)
    prog.stop()
    return (time.process_time() - c0) / (time.perf_counter() - w0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", type=int, default=45)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for k in range(args.pairs):
        order = (before, now) if k % 2 == 0 else (now, before)
        got = {fn.__name__: fn(args.cells, args.workers, args.seconds) for fn in order}
        rows.append(got)
        print(f"pair {k + 1}: one bar per cell {got['before']:.3f}, the lab's display {got['now']:.3f} CPU s per s")
    b = statistics.median(r["before"] for r in rows)
    n = statistics.median(r["now"] for r in rows)
    ratio = statistics.median(r["before"] / r["now"] for r in rows)
    print(f"\n{args.cells} cells, {args.workers} running: one bar per cell at 10 Hz takes {b:.1%} of a core, the lab's "
          f"display {n:.1%}; ratio (baseline / ours) {ratio:.1f}× (median of {args.pairs} pairs)")


if __name__ == "__main__":
    main()
