"""Shared fixtures: every test leaves no process group behind and the default dtype as it was.

The fast lane: ``pytest -m "not slow"`` runs the unit tests (the whole suite, ``make test``,
runs everything). ``slow`` = a test that took ≥ ~1.5 s on the loaded 2-core machine, every
``dist`` test (torchrun start-up alone is several seconds), and the users of an expensive
module fixture (a real sweep, a real report), listed in :data:`SLOW_TESTS` below.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SLOW_TESTS = {
    # measured with --durations=0 on the loaded machine (seconds, setup + call); module-fixture users together
    "test_loop.py::test_cli_sweep_in_bf16_on_cpu_records_device_and_precision",  # 41
    "test_sweep.py::test_sigkill_mid_trial_then_resume_equals_uninterrupted",  # 10, the reference sweep's users:
    "test_sweep.py::test_sweep_records_every_step_and_eval",
    "test_sweep.py::test_same_data_order_for_every_trial",
    "test_sweep.py::test_rerun_skips_finished_trials_and_changed_grid_is_an_error",
    "test_sweep.py::test_analyze_sweep_gives_points_and_recommendation",
    "test_sweep.py::test_timing_pass_is_sequential_recorded_and_used_by_the_analysis",
    "test_sweep.py::test_cli_sweep_then_report",  # 6
    "test_noise.py::test_interval_covers_the_truth_about_95_percent",  # 6
    "test_noise.py::test_adam_variant_within_10_percent_of_preconditioned_truth",  # 2
    "test_noise.py::test_mlp_accumulation_within_10_percent_of_per_example_truth",  # 2
    "test_noise.py::test_ragged_counts_unbiased_within_5_percent_of_synthetic_truth",  # 2
    "test_branch.py::test_tiny_branch_run_resume_and_redecide",  # 6
    "test_branch.py::test_false_alarm_rate_at_the_tolerance_boundary_is_alpha",  # 3
    "test_branch.py::test_every_branch_trains_on_the_same_samples",  # 2
    "test_report.py::test_header_throughput_source_and_load_warning",  # 6
    "test_report.py::test_html_renders_in_headless_chromium",  # 4, the report fixture's users:
    "test_report.py::test_report_recovers_known_b_crit_end_to_end",
    "test_report.py::test_report_files_and_html_embed_every_plot",
    "test_report.py::test_no_noise_plot_without_b_simple_and_partial_sweep_is_reported",  # 3
    "test_report.py::test_extrapolated_b_crit_is_reported_as_a_one_sided_bound",  # 3
    "test_report.py::test_throughput_comes_from_the_timing_pass_not_the_contended_trials",  # 2
    "test_report.py::test_no_legend_warning_when_nothing_is_labelled",  # 2
    "test_probe.py::test_real_probe_on_cpu_restores_model_and_memory",  # 5
    "test_layout.py::test_front_door_imports_no_torch_and_resolves_the_core",  # 4
    "test_step.py::test_compiled_ddp_wrapper_is_detected",  # 3
    "test_critical.py::test_standard_error_covers_truth_at_stated_rate",  # 2
    "test_cli_plan.py::test_world_size_change_from_config_keeps_the_global_batch",  # 2
    "test_plan.py::test_lr_scaling_round_trips",  # 2
    "test_branch.py::test_cli_branch",  # 3
    "test_branch.py::test_upper_bound_covers_the_true_difference_at_its_level",  # 2
    "test_probe.py::test_cli_tinygpt_json",  # 3
    "test_cli_plan.py::test_golden_table_and_json",  # 2 (subprocesses)
    "test_cli_plan.py::test_seed_example_json",  # 2
    "test_optim_large_batch.py::test_noise_command_trains_with_lamb",  # 11
    "test_optim_large_batch.py::test_plan_names_lars_and_lamb_and_takes_their_lr_rule",  # 2
    "test_experiments.py::test_large_batch_optimizers_tinygpt_tiny_mode",  # 5
    "test_experiments.py::test_accumulation_experiment_measures_float_agreement",  # 4
    "test_experiments.py::test_experiment_tiny_mode",  # 1-3 each
    "integrations/test_examples.py::test_hf_trainer_example",  # 3
    "integrations/test_examples.py::test_lightning_example",  # 1
    "integrations/test_hf.py::test_trainer_matches_one_big_batch_and_default_does_not",  # 2
    "integrations/test_hf.py::test_noise_scale_in_the_logs_matches_the_monitor",  # 1
    "test_plan.py::test_warmup_steps_tokens_round_trip",  # 2 (hypothesis)
    "test_probe.py::test_real_probe_with_memory_limit_brackets_and_keeps_global_batch",  # 1
    "test_memory.py::test_measured_prediction_matches_the_probe_on_tiny_tinygpt",  # 1.5-2
    "test_cli_voice.py::test_noise_json",
    "test_cli_voice.py::test_plan_and_report_json",
}
"""Tests marked ``slow`` here (node id without parameters, relative to tests/), beside ``@pytest.mark.slow``."""


FIRST = ("test_types.py::test_mypy_is_clean_on_src",)
"""Started before everything else under xdist: mypy alone takes ~35 s on a clean clone (no cache)."""


def _shares_a_module_fixture(item) -> bool:
    """Whether ``item`` uses (directly or through another fixture) a module- or session-scoped fixture that its own
    module defines and does not autouse: an expensive run (a sweep, a report, a torchrun launch) shared by the
    module's tests, built once per worker that runs one of them."""
    info = getattr(item, "_fixtureinfo", None)
    module = getattr(getattr(item, "module", None), "__name__", None)
    if info is None or module is None:
        return False
    for defs in info.name2fixturedefs.values():
        d = defs[-1]
        if d.scope in ("module", "session") and not getattr(d, "_autouse", False) and getattr(d.func, "__module__", None) == module:
            return True
    return False


def pytest_collection_modifyitems(config, items):
    """Mark the slow tests; under xdist start the longest ones first (mypy, then every slow test that shares no
    module fixture), so that no long test is left to run alone at the end.

    xdist deals the first tests out one by one in turn: the users of a shared module fixture stay where they are
    (together, later in the order, where xdist sends runs of neighbouring tests), or both workers would build it.
    """
    for item in items:
        rel = item.nodeid.split("tests/", 1)[-1].split("[", 1)[0]
        if rel in SLOW_TESTS or item.get_closest_marker("dist") is not None:
            item.add_marker(pytest.mark.slow)
    if getattr(config.option, "numprocesses", None):
        def first(item):
            if item.nodeid.split("tests/", 1)[-1].startswith(FIRST):
                return 0
            return 1 if item.get_closest_marker("slow") is not None and not _shares_a_module_fixture(item) else 2

        items.sort(key=first)  # stable: the order within each module is kept


_CPU_LOG = os.environ.get("GB_TEST_CPU_LOG")
"""``GB_TEST_CPU_LOG=path``: append each test's CPU seconds (this process and the children it waited for: torchrun,
subprocesses, pool workers) and wall seconds to ``path``, one tab-separated line per test. On a shared machine wall
times swing with the load; CPU seconds show where the suite's time goes."""

if _CPU_LOG:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        import time

        t0, w0 = os.times(), time.perf_counter()
        yield
        t1 = os.times()
        cpu = sum(t1[i] - t0[i] for i in range(4))
        with open(_CPU_LOG, "a") as f:
            f.write(f"{cpu:.2f}\t{time.perf_counter() - w0:.2f}\t{item.nodeid}\n")


@pytest.fixture(autouse=True)
def _clean_torch_state():
    try:
        import torch
    except ImportError:  # plan tests run without torch
        yield
        return
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run_torchrun(script: Path, *args: str, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """Launch ``script`` under ``torchrun --standalone`` with gloo-friendly settings.

    Fails the calling test with the script's output when it exits non-zero.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", str(script), *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"torchrun {script.name} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (a sweep's pool workers; the resource tracker too), from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out
