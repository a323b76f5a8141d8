"""Batch × LR sweeps: every trial on the same data order and the same token budget.

The measurement McCandlish et al. 2018 (arXiv 1812.06162, §3) base their critical
batch on: train at several batch sizes, tune the LR at each, and record the loss
against examples consumed. The package follows the seams of that job:

* :mod:`~globalbatch.lab.sweep.config` — the grid and recipe (:class:`SweepConfig`), in the manifest;
* :mod:`~globalbatch.lab.sweep.trial` — one trial through the lab's one loop
  (:class:`globalbatch.lab.loop.Experiment`), crash-safe (``summary.json`` is the done marker);
* :mod:`~globalbatch.lab.sweep.timing` — the sequential timing pass (throughput measured alone);
* :mod:`~globalbatch.lab.sweep.runner` — local processes or Ray Tune, resumable after ``kill -9``;
* :mod:`~globalbatch.lab.sweep.store` — reading a sweep back and analysing it.
"""

from globalbatch.lab.sweep.config import SweepConfig, TrialSpec, demo_config
from globalbatch.lab.sweep.runner import SweepResult, run_sweep
from globalbatch.lab.sweep.store import SweepData, analyze_sweep, analyze_sweep_seeds, curves_from_sweep, load_sweep
from globalbatch.lab.sweep.timing import run_timing_pass
from globalbatch.lab.sweep.trial import run_trial

__all__ = ["SweepConfig", "TrialSpec", "SweepResult", "SweepData", "run_sweep", "run_trial", "load_sweep",
           "analyze_sweep", "analyze_sweep_seeds", "curves_from_sweep", "run_timing_pass", "demo_config"]
