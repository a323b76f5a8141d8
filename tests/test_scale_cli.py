"""``globalbatch scale``: bad input is one line naming the flag or key, exit 2, nothing printed or written; the JSON keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_bad_inputs import _tree, run_main

PRIOR = ["scale", "--prior", "kaplan", "--params", "1B", "--target-loss", "2.6", "--max-gpus", "64"]
GOOD_YAML = ("name: mine\ngpus_per_node: 4\npeak_flops_per_s: 3.12e14\nmemory_bytes: 40e9\n"
             "intra_busbw_bytes_per_s: 2e11\ninter_busbw_bytes_per_s: 2.5e10\n")

FILES = {
    "good_yaml": ("c.yaml", GOOD_YAML),
    "neg_bw": ("c.yaml", GOOD_YAML.replace("2.5e10", "-5e9")),
    "unknown_key": ("c.yaml", GOOD_YAML + "nvlink_gbps: 900\n"),
    "missing_key": ("c.yaml", "name: x\ngpus_per_node: 8\n"),
    "yaml_list": ("c.yaml", "- 1\n"),
    "yaml_syntax": ("c.yaml", "gpus_per_node: [1,\n"),
    "python_tag": ("c.yaml", "gpus_per_node: !!python/object/apply:os.system ['echo PWNED']\n"),
    "probe_bad": ("p.json", "{not json"),
    "probe_no_mfu": ("p.json", json.dumps({"trials": [{"micro_batch": 1, "tokens_per_step": 64, "mfu": None}]})),
    "probe_opt_too_long": ("p.json", json.dumps({"optimizer_step_s": 0.01, "trials": [
        {"micro_batch": 1, "tokens_per_step": 64, "step_time_s": 0.005, "mfu": 0.2}]})),
    "dup_key": ("c.yaml", GOOD_YAML + "memory_bytes: 80e9\n"),
    "list_key": ("c.yaml", GOOD_YAML + "? [a, b]\n: 1\n"),
    "neg_tensor_cost": ("c.yaml", GOOD_YAML + "dp_tensor_overhead_s: -1e-5\n"),
    "probe_no_tokens": ("p.json", json.dumps({"trials": [
        {"micro_batch": 1, "tokens_per_step": None, "step_time_s": 0.005, "mfu": 0.2}]})),
    "probe_overhead_alone": ("p.json", json.dumps({"step_overhead_s": 0.01, "trials": [
        {"micro_batch": 1, "tokens_per_step": 64, "step_time_s": 0.005, "mfu": 0.2}]})),
}


def _c(id_, argv, field, *files):
    return pytest.param(list(argv), field, files, id=id_)


CASES = [
    _c("unknown-preset", PRIOR + ["--cluster", "h900"], "--cluster"),
    _c("negative-bandwidth", PRIOR + ["--cluster", "c.yaml"], "inter_busbw_bytes_per_s", "neg_bw"),
    _c("unknown-yaml-key", PRIOR + ["--cluster", "c.yaml"], "nvlink_gbps", "unknown_key"),
    _c("missing-yaml-key", PRIOR + ["--cluster", "c.yaml"], "peak_flops_per_s", "missing_key"),
    _c("yaml-list", PRIOR + ["--cluster", "c.yaml"], "--cluster", "yaml_list"),
    _c("yaml-syntax", PRIOR + ["--cluster", "c.yaml"], "--cluster", "yaml_syntax"),
    _c("yaml-python-tag", PRIOR + ["--cluster", "c.yaml"], "--cluster", "python_tag"),
    _c("unreachable-target", ["scale", "--prior", "kaplan", "--params", "1B", "--target-loss", "1.0"], "--target-loss"),
    _c("negative-target", ["scale", "--prior", "kaplan", "--params", "1B", "--target-loss", "-2"], "--target-loss"),
    _c("fits-no-geometry", ["scale", "--prior", "kaplan", "--params", "10T", "--target-loss", "2.5", "--max-gpus", "16"],
       "--params"),
    # the static bytes fit; micro-batch 1's activations do not (was blamed on --params)
    _c("activations-fit-no-geometry", PRIOR[:-1] + ["8", "--activation-bytes-per-token", "1e12"],
       "--activation-bytes-per-token 1e+12 is not allowed (micro-batch 1 needs "),
    _c("yaml-duplicate-key", PRIOR + ["--cluster", "c.yaml"], "duplicate key 'memory_bytes'", "dup_key"),
    _c("yaml-list-key", PRIOR + ["--cluster", "c.yaml"], "--cluster", "list_key"),
    _c("yaml-negative-tensor-cost", PRIOR + ["--cluster", "c.yaml"], "dp_tensor_overhead_s -1e-05 is not allowed",
       "neg_tensor_cost"),
    # no GPU count up to --max-gpus takes the TP × PP asked (was blamed on --params)
    _c("tp-pp-over-max-gpus", PRIOR[:-1] + ["16", "--tp", "8", "--pp", "4"], "--max-gpus 16 is not allowed"),
    _c("throughput-mfu-without-tokens", PRIOR + ["--throughput", "p.json"], "--throughput", "probe_no_tokens"),
    _c("no-source", ["scale", "--target-loss", "2.5"], "RUN_DIR"),
    _c("both-sources", ["scale", "somewhere", "--prior", "kaplan", "--params", "1B"], "RUN_DIR"),
    _c("prior-without-params", ["scale", "--prior", "kaplan", "--target-loss", "2.5"], "--params"),
    _c("prior-without-target", ["scale", "--prior", "kaplan", "--params", "1B"], "--target-loss"),
    _c("missing-run-dir", ["scale", "nodir"], "RUN_DIR"),
    _c("objective", PRIOR + ["--objective", "fast"], "--objective"),
    _c("max-gpus-zero", PRIOR[:-1] + ["0"], "--max-gpus"),
    _c("deadline-word", PRIOR + ["--deadline", "soon"], "--deadline"),
    _c("deadline-negative", PRIOR + ["--deadline", "-3h"], "--deadline"),
    _c("budget-zero", PRIOR + ["--budget-gpu-hours", "0"], "--budget-gpu-hours"),
    _c("overlap", PRIOR + ["--overlap", "1.5"], "--overlap"),
    _c("tp-zero", PRIOR + ["--tp", "0"], "--tp"),
    _c("params-word", ["scale", "--prior", "kaplan", "--params", "big", "--target-loss", "2.5"], "--params"),
    _c("throughput-missing", PRIOR + ["--throughput", "nope.json"], "--throughput"),
    _c("throughput-broken", PRIOR + ["--throughput", "p.json"], "--throughput", "probe_bad"),
    _c("throughput-no-mfu", PRIOR + ["--throughput", "p.json"], "--throughput", "probe_no_mfu"),
    _c("throughput-optimizer-step-longer-than-trial", PRIOR + ["--throughput", "p.json"], "--throughput",
       "probe_opt_too_long"),
    _c("throughput-overhead-without-params", PRIOR + ["--throughput", "p.json"], "--throughput", "probe_overhead_alone"),
    _c("plot-not-png", PRIOR + ["--plot", "x.pdf"], "--plot"),
    _c("max-stages", PRIOR + ["--max-stages", "0"], "--max-stages"),
    # degrees the search skips were blamed on --params ("static bytes exceed ..."); a larger --tokens-per-seq was
    # clamped to --seq-len without a word
    _c("tp-over-a-node", PRIOR + ["--cluster", "c.yaml", "--tp", "1,8"], "--tp 8 is not allowed (mine has 4 GPUs per node",
       "good_yaml"),
    _c("pp-over-the-layers", PRIOR + ["--pp", "64", "--layers", "16"], "--pp 64 is not allowed (the model has 16 layers)"),
    _c("tokens-per-seq-over-seq-len", PRIOR + ["--seq-len", "4096", "--tokens-per-seq", "5000"],
       "--tokens-per-seq 5000 is not allowed; allowed: at most --seq-len 4096"),
]


@pytest.mark.parametrize("argv, field, files", CASES)
def test_scale_bad_input_is_one_line_exit_2(argv, field, files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "120")
    for key in files:
        name, text = FILES[key]
        (tmp_path / name).write_text(text)
    before = _tree(tmp_path)
    code, out, err = run_main(argv)
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert out == "", out
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert field in lines[0], (field, lines[0])
    assert _tree(tmp_path) == before


def test_scale_json_keys_and_plot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(GOOD_YAML)
    code, out, err = run_main(["scale", "--prior", "kaplan", "--params", "1B", "--target-loss", "2.6", "--max-gpus", "256",
                               "--cluster", "c.yaml", "--objective", "pareto", "--plot", "front.png", "--json",
                               "--seq-len", "2048", "--activation-bytes-per-token", "2e5", "--tp", "1,2",
                               "--pp", "1,2"])
    assert code == 0, err
    d = json.loads(out)
    assert {"target_loss", "extrapolated", "b_crit_tokens", "b_crit_interval", "s_min", "objective", "rows", "best",
            "best_ramp", "pareto_gpus", "convergence", "cluster", "model", "throughput_source", "notes",
            "search_seconds", "evaluated_geometries", "plot"} <= set(d)
    row = d["rows"][0]
    assert {"gpus", "global_batch", "global_batch_tokens", "geometry", "steps", "steps_interval", "tokens", "step_s",
            "compute_s", "comm_exposed_s", "bubble_s", "mfu", "time_s", "gpu_hours", "statistical_efficiency",
            "meets_limits", "pareto"} <= set(row)
    assert {"micro_batch", "grad_accum_steps", "dp", "tp", "pp", "overhead_s"} <= set(row["geometry"])
    assert d["cluster"]["name"] == "mine" and d["cluster"]["gpus_per_node"] == 4
    assert d["best"]["gpus"] in d["pareto_gpus"]
    for r in d["rows"]:
        g = r["geometry"]
        assert g["micro_batch"] * g["grad_accum_steps"] * g["dp"] == r["global_batch"]
        assert g["dp"] * g["tp"] * g["pp"] == r["gpus"]
        assert r["time_s"] == pytest.approx(r["steps"] * r["step_s"])
    if d["best_ramp"] is not None:
        from globalbatch.schedule import parse_step_schedule

        sched = parse_step_schedule(d["best_ramp"]["schedule"])
        assert [b for _, b in sched.steps] == [s["global_batch"] for s in d["best_ramp"]["stages"]]
    assert Path("front.png").stat().st_size > 1000
    assert d["extrapolated"] is True and d["convergence"]["kind"] == "prior"


def test_a_sweep_whose_b_crit_falls_with_the_loss_is_refused_naming_the_run_dir(tmp_path, monkeypatch):
    """A sweep's joint fit with k > 0 (B_crit falling as the loss falls; a 2-seed GRU sweep gave k = 1.6, SE 1.41)
    makes the local noise scale negative along the path: the line names RUN_DIR and its fit, not a field."""
    import globalbatch.cli.scale as cli_scale
    from globalbatch.scale.convergence import BCritLaw, ConvergenceModel, SMinLaw

    conv = ConvergenceModel(b_crit_law=BCritLaw(b_ref_tokens=929.0, loss_ref=1.274, k=1.6),
                            s_min_law=SMinLaw(s_c=20.0, exponent=1.5, loss_floor=1.0), loss_range=(1.19, 1.36),
                            source="sweep", kind="fit")
    facts = {"task": "mnist", "task_overrides": {}, "primary_target": 1.2, "seq_len": 48}
    monkeypatch.setattr(cli_scale, "convergence_from_sweep", lambda run_dir: (conv, facts))
    monkeypatch.setattr(cli_scale, "_task_params", lambda task, overrides: 7408.0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sw").mkdir()
    code, out, err = run_main(["scale", "sw", "--max-gpus", "8"])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("error: RUN_DIR 'sw' is not allowed (its joint fit B_crit(L) ∝ L^k has k = 1.6: B_noise ≤ 0")
