"""What ``benchmarks/critical_cost.py`` measured for each cheap design of the critical-batch sweep against one full
5-seed sweep per task: the one place ``globalbatch sweep --budget`` and the report take a design's measured agreement
from (:func:`globalbatch.lab.sweep.designs.agreement_text`) and decide from whether it holds
(:func:`~globalbatch.lab.sweep.designs.shown_to_hold`).

The numbers live in ``measured.json`` beside this module, written by the benchmark itself
(``--record src/globalbatch/lab/sweep/measured.json``; nothing in it is typed by hand), with ``provenance``: every
command that wrote into it and when. Per task (``tasks``): ``reference``, the full sweep (where it was read, its
seeds, the units it trained, its common targets and its B_crit there, median over seeds; None: only a bound, every
batch in the perfect-scaling regime); per design, ``reps`` repetitions with independent seeds (100 + 10·r, …),
``compute`` = the units each trained ÷ the reference's, and per target ``[median, worst, n]`` of the ratio of its
B_crit to the reference's over the ``n`` repetitions with a point estimate there (worst = the largest of r and 1/r;
None: no repetition has one). ``per_target`` is against the reference's B_crit at that target; ``joint`` compares
joint fits B_crit(L) = B_ref·(L/L_ref)^k (a sweep design's own joint fit, or a branch design's curve, against the
reference's). ``branch``: the branch test at several points of one base run (``benchmarks/critical_cost_branch.py``;
``n``: repetitions whose fitted points span the target); ``branch_*``: the same with one setting changed
(``absolute``: Merrill's fixed tolerance 0.01 instead of the half-window rule; ``keep``: the Adam second moments as
in the checkpoint instead of divided by k; ``split``: only their noise share divided by k; ``wf``: each window that
fraction of its point; ``lr``: the base run's LR).

The run directories the recorded commands name (ignored by git, kept on the machine that measured them): the
references ``/tmp/s9/ref_tinygpt`` (the full 5-seed demo tinygpt sweep, ``runs/critical_cost_full_tinygpt``
completed under the current code: 120 trials) and ``/tmp/s9/ref_mnist`` (``runs/critical_stability_mnist`` with its
batch-edge cells: 190 trials); the sweep designs' repetitions ``/tmp/s9/cost_{task}`` (completed under the current
code: the narrow designs' transferred cells rerun with the LR the analysis chooses); the branch designs' in
``/tmp/h6b`` and ``runs/critical_cost_*``. Every row was read by the code of commit bcd95a5, except tinygpt's
``seeds1`` row: run and read by commit 734f323 (the same trial and read-out code), and both tasks' ``narrow1`` and
``narrow2`` rows: completed with their batch-edge cells and read by commit 2a2cfd0.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

__all__ = ["MEASURED", "PROVENANCE", "SOURCE"]

_DOC: dict[str, Any] = json.loads(resources.files(__package__).joinpath("measured.json").read_text(encoding="utf-8"))
MEASURED: dict[str, Any] = _DOC["tasks"]
"""Task (``tinygpt``: the demo configuration; ``mnist``) → its reference and each design's ratios."""
PROVENANCE: dict[str, Any] = _DOC["provenance"]
"""The commands that recorded :data:`MEASURED` (``command``, ``task``, ``designs``, ``utc``)."""
SOURCE = "benchmarks/critical_cost.py, recorded in globalbatch/lab/sweep/measured.json"
"""How a statement built from these numbers names where they come from."""
