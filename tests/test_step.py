"""Tests of globalbatch.step: exact accumulation, skip on non-finite, resume, schedules in the driver.

Single-process checks here; the same equivalences across 2 DDP ranks run in
``tests/dist/step_equivalence_script.py`` (marked ``dist``).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import math
import re
import textwrap
from pathlib import Path

import pytest
import torch

from globalbatch.schedule import LRSchedule, parse_step_schedule
from globalbatch.checkpoint import load_checkpoint, save_checkpoint
from globalbatch.errors import SettingError
from globalbatch.step import (
    NonFiniteError,
    StepConfig,
    StepDriver,
    plan_for_world,
)
from conftest import run_torchrun

_DIST = Path(__file__).parent / "dist"
_spec = importlib.util.spec_from_file_location("step_common", _DIST / "step_common.py")
sc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sc)


def _driver(model, opt, *, micro=2, global_batch=16, clip=None, k=8, lr_schedule=None, **kw):
    return StepDriver(model, opt, StepConfig(micro_batch=micro, global_batch=global_batch, max_grad_norm=clip,
                                             max_consecutive_skips=k, lr_schedule=lr_schedule), **kw)


# --------------------------------------------------------------------------- plan


def test_plan_for_world_derives_accum_and_refuses_non_dividing_world():
    g = plan_for_world(16, 2, 2)
    assert (g.global_batch, g.micro_batch, g.grad_accum_steps, g.dp_world_size) == (16, 2, 4, 2)
    with pytest.raises(SettingError, match=r"global batch 16 is not divisible by micro_batch 2 × dp 3 = 6"):
        plan_for_world(16, 2, 3)


def test_driver_refuses_schedule_batch_that_does_not_divide():
    model = sc.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = parse_step_schedule("0:8 1K:12")
    with pytest.raises(SettingError, match="global batch 12 is not divisible by micro_batch 8") as info:
        StepDriver(model, opt, StepConfig(micro_batch=8, batch_schedule=sched))
    # the line names what the user gave (the schedule), not a global_batch they never set
    assert info.value.field == "batch_schedule" and str(info.value).startswith(
        "batch_schedule 12 is not allowed (a global batch the schedule reaches; global batch 12 is not divisible")


@pytest.mark.parametrize("kw, match", [
    (dict(micro_batch=0, global_batch=4), "micro_batch 0"),
    (dict(micro_batch=2), "exactly one"),
    (dict(micro_batch=2, global_batch=4, batch_schedule=parse_step_schedule("0:4")), "exactly one"),
    (dict(micro_batch=2, global_batch=4, max_grad_norm=0.0), "max_grad_norm 0 is not allowed"),
    (dict(micro_batch=2, global_batch=4, max_consecutive_skips=0), "max_consecutive_skips 0"),
    (dict(micro_batch=2, batch_schedule="0:4"), "parse strings"),
    (dict(micro_batch=2, global_batch=4.0), r"^global_batch 4\.0 is not allowed; allowed: a whole number ≥ 1$"),
])
def test_step_config_errors_quote_the_value(kw, match):
    with pytest.raises(SettingError, match=match):
        StepConfig(**kw)


# --------------------------------------------------------------------------- equivalence


def _run_accum_vs_full(dtype, *, micro, steps, clip, window_sizes):
    """Driver (micro-batches of ``micro``) vs one full-batch forward, over several windows."""
    torch.manual_seed(0)
    base = sc.build_model(dtype=dtype)
    ours, opt = sc.clone_model_opt(base)
    ref, ref_opt = sc.clone_model_opt(base)
    probe = sc.GradProbe(ours)
    drv = _driver(ours, opt, micro=micro, global_batch=16, clip=clip, callbacks=[probe])
    seqs = sc.make_sequences(sum(window_sizes), seed=1)
    start, ref_grads, norms = 0, [], []
    for n in window_sizes[:steps]:
        window = seqs[start:start + n]
        start += n
        mbs = sc.micro_batches(window, micro)
        res = drv.run_window(mbs, sc.loss_fn, samples_per_micro=sc.samples_of(mbs))
        assert not res.skipped and res.global_samples == n
        ref_grads.append(sc.reference_step(ref, ref_opt, window, clip))
        norms.append(res.grad_norm)
    return ours, ref, probe, ref_grads, norms, seqs


def test_accumulation_equals_full_batch_float64_adamw_clipped():
    # micro 2 × accum 8 = 16, then a short last window of 5 samples (accum 3, last micro of 1)
    ours, ref, probe, ref_grads, norms, seqs = _run_accum_vs_full(
        torch.float64, micro=2, steps=4, clip=0.2, window_sizes=[16, 16, 16, 5])
    for got, want in zip(probe.window, ref_grads):
        assert sc.max_abs_diff(got, want) < 1e-10
    assert all(n > 0.2 for n in norms), norms  # clipping was active in every step
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-10, rtol=0)
    # the naive mean of micro-batch means differs measurably on this ragged data
    naive = sc.naive_grads(copy.deepcopy(sc.build_model()), sc.chunks(seqs[:16], 2))
    exact = sc.full_batch_grads(copy.deepcopy(sc.build_model()), seqs[:16])
    assert sc.max_rel_diff(naive, exact) > 1e-3


def test_accumulation_equals_full_batch_float32():
    ours, ref, probe, ref_grads, _, _ = _run_accum_vs_full(
        torch.float32, micro=4, steps=3, clip=None, window_sizes=[16, 16, 16])
    for got, want in zip(probe.window, ref_grads):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)


def test_callback_grad_state_running_sum_then_normalized():
    model = sc.build_model()
    probe = sc.GradProbe(model)
    drv = _driver(model, torch.optim.SGD(model.parameters(), lr=0.1), micro=2, global_batch=4, callbacks=[probe])
    seqs = sc.make_sequences(4, seed=3)
    twin = copy.deepcopy(model)
    drv.run_window(sc.micro_batches(seqs, 2), sc.loss_fn)
    # on_micro_backward after micro 0: ∇ loss_sum(micro 0), un-normalized
    twin.zero_grad()
    l0, c0 = sc.loss_fn(twin, sc.collate(seqs[:2]))
    l0.backward()
    assert sc.max_abs_diff(probe.micro[0], [p.grad for p in twin.parameters()]) < 1e-12
    # after micro 1: the running sum ∇(loss_sum0 + loss_sum1)
    l1, c1 = sc.loss_fn(twin, sc.collate(seqs[2:]))
    l1.backward()
    assert sc.max_abs_diff(probe.micro[1], [p.grad for p in twin.parameters()]) < 1e-12
    # on_window_end: normalized by the global count, before the optimizer step
    exact = sc.full_batch_grads(copy.deepcopy(sc.build_model()), seqs)
    assert sc.max_abs_diff(probe.window[0], exact) < 1e-12
    assert probe.counts[0] == (float(c0 + c1), float(c0 + c1))


def test_grad_scaler_path_matches_unscaled_path():
    base = sc.build_model(dtype=torch.float32)
    seqs = sc.make_sequences(32, seed=2)
    runs = []
    for use_scaler in (False, True):
        model, opt = sc.clone_model_opt(base)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if use_scaler else None
        drv = _driver(model, opt, micro=4, global_batch=16, clip=0.5, scaler=scaler)
        for w in sc.chunks(seqs, 16):
            res = drv.run_window(sc.micro_batches(w, 4), sc.loss_fn)
            assert not res.skipped
        runs.append(model)
    for p, q in zip(runs[0].parameters(), runs[1].parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_step_result_reports_global_loss_per_token():
    model = sc.build_model()
    drv = _driver(model, torch.optim.SGD(model.parameters(), lr=0.0 + 1e-9), micro=2, global_batch=6)
    seqs = sc.make_sequences(6, seed=5)
    with torch.no_grad():
        loss, count = sc.loss_fn(model, sc.collate(seqs))
    res = drv.run_window(sc.micro_batches(seqs, 2), sc.loss_fn)
    assert res.global_units == int(count) and res.global_samples == 6
    assert math.isclose(res.loss_per_unit, float(loss / count), rel_tol=1e-12)
    assert res.step == 1 and res.window == 1 and drv.consumed_units == int(count)


def test_step_without_backward_is_an_error():
    model = sc.build_model()
    drv = _driver(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="no micro-batch"):
        drv.step()


# --------------------------------------------------------------------------- non-finite


class _Poison:
    """Callback that turns one micro-batch's gradient into inf."""

    def __init__(self, at: set[tuple[int, int]]):
        self.at, self.window = at, 0

    def on_micro_backward(self, driver, micro_index, local_count):
        if (self.window, micro_index) in self.at:
            next(driver.model.parameters()).grad.fill_(float("inf"))

    def on_step_end(self, driver, result):
        self.window += 1


@pytest.mark.parametrize("how", ["nan_loss", "inf_grad", "empty_window"])
def test_non_finite_window_is_skipped_and_state_untouched(how, caplog):
    model, opt = sc.clone_model_opt(sc.build_model())
    poison = _Poison({(1, 1)} if how == "inf_grad" else set())
    sched = LRSchedule(peak_lr=1e-2, warmup=200, total=1000)
    drv = _driver(model, opt, micro=2, global_batch=4, clip=1.0, callbacks=[poison], lr_schedule=sched)
    seqs = sc.make_sequences(12, seed=4)
    drv.run_window(sc.micro_batches(seqs[:4], 2), sc.loss_fn)
    params = [p.detach().clone() for p in model.parameters()]
    opt_state = copy.deepcopy(opt.state_dict())
    trained, lr = drv.trained_units, opt.param_groups[0]["lr"]

    def bad_loss(m, batch):
        loss, count = sc.loss_fn(m, batch)
        if how == "nan_loss":
            loss = loss * float("nan")
        if how == "empty_window":
            return loss * 0, count * 0
        return loss, count

    mbs = sc.micro_batches(seqs[4:8], 2)
    with caplog.at_level(logging.WARNING, logger="globalbatch.step"):
        res = drv.run_window(mbs, bad_loss if how != "inf_grad" else sc.loss_fn)
    assert res.skipped and drv.skipped_windows == 1 and drv.consecutive_skips == 1
    assert drv.optimizer_steps == 1 and drv.windows == 2
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert sc.optimizer_state_equal(opt, _opt_from(model, opt_state))
    assert drv.trained_units == trained and opt.param_groups[0]["lr"] == lr
    assert "window 2 skipped on all ranks (optimizer steps so far: 1): " in caplog.text
    assert all(p.grad is None for p in model.parameters())
    # the next good window steps again and resets the consecutive counter
    res = drv.run_window(sc.micro_batches(seqs[8:12], 2), sc.loss_fn)
    assert not res.skipped and drv.consecutive_skips == 0 and drv.optimizer_steps == 2


@pytest.mark.parametrize("use_scaler", [False, True])
def test_window_larger_than_the_global_batch_is_refused_before_the_step(use_scaler):
    model, opt = sc.clone_model_opt(sc.build_model(dtype=torch.float32))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if use_scaler else None
    drv = _driver(model, opt, micro=2, global_batch=4, clip=1.0, scaler=scaler)
    seqs = sc.make_sequences(16, seed=11)
    drv.run_window(sc.micro_batches(seqs[:4], 2), sc.loss_fn)
    params = [p.detach().clone() for p in model.parameters()]
    opt_state = copy.deepcopy(opt.state_dict())
    before = drv.state_dict()
    scale = scaler.get_scale() if use_scaler else None
    too_big = sc.micro_batches(seqs[4:10], 2)  # 3 micro-batches of 2 (default samples): 6 > 4
    with pytest.raises(SettingError, match=r"^window samples 6 is not allowed \(window 2, all ranks: more than the "
                                           r"planned global batch\); allowed: at most the planned global batch 4") as info:
        drv.run_window(too_big, sc.loss_fn)
    assert "\n" not in str(info.value)
    with pytest.raises(SettingError, match=r"samples 5 is not allowed; allowed: a whole number in \[0, "
                                         r"StepConfig.micro_batch 2\]"):  # a micro-batch above the configured size
        drv.run_window(sc.micro_batches(seqs[10:12], 2)[:1], sc.loss_fn, samples_per_micro=[5])
    # nothing moved: parameters, optimizer state, counters, loss scale; gradients cleared
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert sc.optimizer_state_equal(opt, _opt_from(model, opt_state))
    assert drv.state_dict() == before and all(p.grad is None for p in model.parameters())
    if use_scaler:
        assert scaler.get_scale() == scale
    # still usable: a full window and a shorter one step normally
    res = drv.run_window(sc.micro_batches(seqs[12:16], 2), sc.loss_fn)
    assert not res.skipped and res.step == 2 and res.window == 2 and res.global_samples == 4
    res = drv.run_window(sc.micro_batches(seqs[:2], 2), sc.loss_fn)
    assert not res.skipped and res.global_samples == 2 and res.global_batch == 4


def _opt_from(model, state):
    o = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    o.load_state_dict(state)
    return o


def test_k_consecutive_skips_raise():
    model, opt = sc.clone_model_opt(sc.build_model())
    drv = _driver(model, opt, micro=2, global_batch=4, k=3)
    seqs = sc.make_sequences(4, seed=6)

    def nan_loss(m, batch):
        loss, count = sc.loss_fn(m, batch)
        return loss * float("nan"), count

    for _ in range(2):
        assert drv.run_window(sc.micro_batches(seqs, 2), nan_loss).skipped
    with pytest.raises(NonFiniteError, match=r"3 consecutive windows skipped .*; last: window 3 "
                                              r"\(optimizer steps so far: 0\): non-finite loss"):
        drv.run_window(sc.micro_batches(seqs, 2), nan_loss)


# --------------------------------------------------------------------------- resume


def _train(model, opt, drv, seqs, start_window, n_windows, per_window=8, micro=2):
    for w in range(start_window, start_window + n_windows):
        window = seqs[w * per_window:(w + 1) * per_window]
        drv.run_window(sc.micro_batches(window, micro), sc.loss_fn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_resume_is_bitwise_identical(tmp_path, dtype):
    seqs = sc.make_sequences(8 * 6, seed=7)
    sched = LRSchedule(peak_lr=1e-2, warmup=100, total=600, shape="cosine")
    bsched = parse_step_schedule("0:4 50:8")

    def fresh():
        model, opt = sc.clone_model_opt(sc.build_model(dtype=dtype))
        drv = StepDriver(model, opt, StepConfig(micro_batch=2, batch_schedule=bsched, max_grad_norm=0.5,
                                                lr_schedule=sched))
        return model, opt, drv

    def run(model, opt, drv, windows):
        consumed = drv.consumed_samples
        for _ in range(windows):
            gb = drv.global_batch
            window = seqs[consumed:consumed + gb]
            consumed += gb
            drv.run_window(sc.micro_batches(window, 2), sc.loss_fn)

    m1, o1, d1 = fresh()
    run(m1, o1, d1, 6)
    m2, o2, d2 = fresh()
    run(m2, o2, d2, 2)
    path = tmp_path / "ck" / "step.pt"
    save_checkpoint(path, d2, extra={"note": "k=2"})
    assert [p.name for p in path.parent.iterdir()] == ["step.pt"]  # no temporary left behind
    m3, o3, d3 = fresh()
    assert load_checkpoint(path, d3) == {"note": "k=2"}
    run(m3, o3, d3, 4)
    assert d1.global_batch == 8  # the batch schedule switched during the run
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m3.parameters()))
    assert sc.optimizer_state_equal(o1, o3)
    assert d1.state_dict() == d3.state_dict()
    torch.load(path, weights_only=True)  # loadable without unpickling arbitrary objects


# --------------------------------------------------------------------------- schedules in the driver


def test_batch_schedule_switches_at_threshold_and_rescales_lr(caplog):
    model = sc.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    bsched = parse_step_schedule("0:2 60:4 120:8", lr_rule="sqrt")
    drv = StepDriver(model, opt, StepConfig(micro_batch=2, batch_schedule=bsched))
    seqs = sc.make_sequences(60, seed=8)
    consumed, seen = 0, []
    with caplog.at_level(logging.INFO, logger="globalbatch.step"):
        for _ in range(10):
            before = drv.trained_units
            gb = drv.global_batch
            expected = 2 if before < 60 else 4 if before < 120 else 8
            assert gb == expected, (before, gb)
            res = drv.run_window(sc.micro_batches(seqs[consumed:consumed + gb], 2), sc.loss_fn)
            consumed += gb
            seen.append((res.global_batch, res.lr))
    lrs = {gb: lr for gb, lr in seen}
    assert set(lrs) == {2, 4, 8}
    assert math.isclose(lrs[4], 0.01 * math.sqrt(2), rel_tol=1e-12)
    assert math.isclose(lrs[8], 0.01 * 2, rel_tol=1e-12)
    assert "global batch 2 -> 4 at" in caplog.text and "lr 0.01 -> 0.0141 (sqrt)" in caplog.text
    assert "lr 0.0141 -> 0.02 (sqrt)" in caplog.text  # one notation on both sides of the arrow


@pytest.mark.parametrize("global_batch", [2, 4, 8])
def test_token_lr_schedule_applied_at_position_after_step(global_batch):
    """Whatever the batch, each step's LR is lr_at(tokens trained after it): the warmup is the same curve."""
    model = sc.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = LRSchedule(peak_lr=1e-3, warmup=1000, total=2000, shape="linear")
    drv = StepDriver(model, opt, StepConfig(micro_batch=2, global_batch=global_batch, lr_schedule=sched))
    seqs = sc.make_sequences(32, seed=9)
    seen = []
    for w in sc.chunks(seqs, global_batch):
        res = drv.run_window(sc.micro_batches(w, 2), sc.loss_fn)
        assert res.lr == pytest.approx(sched.lr_at(drv.trained_units), rel=1e-15)
        seen.append(res.lr)
    assert 0 < seen[0] < 1e-3 and seen == sorted(seen)  # inside the warmup: rising, never zero


# --------------------------------------------------------------------------- the example on the real task

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tinygpt.py"
_TINY = ["--n-layer", "1", "--d-model", "32", "--seq-len", "32", "--val-batches", "1", "--log-every", "1",
         "--warmup-tokens", "300", "--total-tokens", "3000", "--global-batch", "16", "--micro-batch", "2"]


def _example_main():
    spec = importlib.util.spec_from_file_location("train_tinygpt", _EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def _ck(path):
    return torch.load(path, weights_only=True)


def test_example_checkpoint_resume_is_bitwise(tmp_path, capsys):
    main = _example_main()
    a, b, c = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "c.pt"
    main(_TINY + ["--steps", "4", "--checkpoint", str(a), "--checkpoint-every", "4"])
    main(_TINY + ["--steps", "2", "--checkpoint", str(b), "--checkpoint-every", "2"])
    main(_TINY + ["--steps", "4", "--resume", str(b), "--checkpoint", str(c), "--checkpoint-every", "4"])
    out = capsys.readouterr().out
    assert "globalbatch: global batch 16 seq = 1 ranks × 8 accum × 2 seq" in out and "resumed from" in out
    sa, sc_ = _ck(a), _ck(c)
    assert sa["model"].keys() == sc_["model"].keys()
    assert all(torch.equal(sa["model"][k], sc_["model"][k]) for k in sa["model"])
    for k, st in sa["optimizer"]["state"].items():
        assert all(torch.equal(v, sc_["optimizer"]["state"][k][n]) for n, v in st.items())
    assert sa["driver"] == sc_["driver"] and sa["driver"]["optimizer_steps"] == 4


@pytest.mark.parametrize("args, match", [
    (["--resume", "MISSING"], r"--resume '.*missing\.pt' is not allowed; allowed: an existing checkpoint file"),
    (["--log-every", "0"], r"--log-every 0 is not allowed; allowed: a whole number >= 1"),
    (["--steps", "abc"], r"argument --steps: invalid int value: 'abc'"),
    (["--checkpoint", "x.pt"], r"--checkpoint 'x.pt' and --checkpoint-every 0 are not allowed"),
    (["--batch-schedule", "0:8 1K"], r"--batch-schedule: batch schedule entry '1K' is not allowed \(it is not THRESHOLD:BATCH\)"),
])
def test_example_argument_errors_are_one_line_exit_2(tmp_path, capsys, args, match):
    args = [str(tmp_path / "missing.pt") if a == "MISSING" else a for a in args]
    with pytest.raises(SystemExit) as info:
        _example_main()(_TINY + ["--steps", "1"] + args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and err.startswith("train_tinygpt.py: error: "), err
    assert re.search(match, err), err


def test_example_library_and_checkpoint_errors_are_one_line_exit_2(tmp_path, capsys):
    main = _example_main()
    assert main(_TINY + ["--steps", "1", "--micro-batch", "3"]) == 2  # found by the driver, after setup
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train_tinygpt.py: error: ") and (
        "global batch 16 is not divisible by micro_batch 3 × dp 1 = 3") in err, err
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint")
    assert main(_TINY + ["--steps", "1", "--resume", str(junk)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--resume '{junk}': cannot resume from it (" in err, err


@pytest.mark.dist
def test_example_two_ranks_matches_single_process(tmp_path, capsys):
    single, ddp = tmp_path / "single.pt", tmp_path / "ddp.pt"
    _example_main()(_TINY + ["--steps", "3", "--checkpoint", str(single), "--checkpoint-every", "3"])
    proc = run_torchrun(_EXAMPLE, *_TINY, "--steps", "3", "--checkpoint", str(ddp), "--checkpoint-every", "3")
    assert "globalbatch: global batch 16 seq = 2 ranks × 4 accum × 2 seq" in proc.stdout
    s1, s2 = _ck(single), _ck(ddp)
    assert s1["driver"]["consumed_units"] == s2["driver"]["consumed_units"]  # the same samples were drawn
    for k in s1["model"]:  # float32: summation order differs between 1 and 2 ranks
        torch.testing.assert_close(s2["model"][k], s1["model"][k], atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- review regressions


def test_lr_schedule_keeps_a_frozen_zero_lr_group_at_zero():
    model = sc.build_model()
    params = list(model.parameters())
    opt = torch.optim.SGD([{"params": params[:1], "lr": 0.0}, {"params": params[1:], "lr": 1e-2}], lr=1e-2)
    frozen = params[0].detach().clone()
    drv = _driver(model, opt, micro=2, global_batch=4, lr_schedule=LRSchedule(peak_lr=2e-3, total=10_000))
    drv.run_window(sc.micro_batches(sc.make_sequences(4, seed=7), 2), sc.loss_fn)
    assert opt.param_groups[0]["lr"] == 0.0 and opt.param_groups[1]["lr"] > 0
    assert torch.equal(params[0].detach(), frozen)


def test_batch_change_rescales_a_closed_form_torch_scheduler():
    model = sc.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    sched = parse_step_schedule("0:2 30:4", lr_rule="linear")
    drv = StepDriver(model, opt, StepConfig(micro_batch=2, batch_schedule=sched), lr_scheduler=lam)
    seqs = sc.make_sequences(40, seed=8)
    i = 0
    while drv.global_batch == 2:
        drv.run_window(sc.micro_batches(seqs[i:i + 2], 2), sc.loss_fn)
        i += 2
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02)
    n = drv.global_batch
    drv.run_window(sc.micro_batches(seqs[i:i + n], 2), sc.loss_fn)  # LambdaLR recomputes from base_lrs
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02)


def test_python_int_counts_equal_tensor_counts_and_bad_counts_are_rejected():
    seqs = sc.make_sequences(8, seed=9)
    runs = []
    for as_int in (False, True):
        model, opt = sc.clone_model_opt(sc.build_model())
        drv = _driver(model, opt, micro=2, global_batch=8)

        def loss_fn(m, b, as_int=as_int):
            loss, count = sc.loss_fn(m, b)
            return loss, int(count) if as_int else count

        res = drv.run_window(sc.micro_batches(seqs, 2), loss_fn)
        runs.append((model, res))
    assert runs[0][1].global_units == runs[1][1].global_units
    for p, q in zip(runs[0][0].parameters(), runs[1][0].parameters()):
        assert torch.equal(p, q)
    model, opt = sc.clone_model_opt(sc.build_model())
    drv = _driver(model, opt, micro=2, global_batch=4)
    loss, count = sc.loss_fn(model, sc.collate(seqs[:2]))
    with pytest.raises(SettingError, match=r"count shape \(2,\) is not allowed"):
        drv.backward(loss, torch.stack([count, count]), samples=2)
    with pytest.raises(SettingError, match="count -1 is not allowed"):
        drv.backward(loss, -1, samples=2)


def test_skip_with_scaler_when_no_parameter_has_a_gradient():
    model = sc.build_model(dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    drv = _driver(model, opt, micro=2, global_batch=2, scaler=scaler)
    with drv.micro_step(last=True):
        loss = torch.tensor(float("nan"), requires_grad=True)  # reaches no parameter
        drv.backward(loss, 3, samples=2)
    res = drv.step()
    assert res.skipped and drv.skipped_windows == 1


def test_checkpoint_defaults_to_the_drivers_scheduler(tmp_path):
    seqs = sc.make_sequences(16, seed=10)

    def make():
        model, opt = sc.clone_model_opt(sc.build_model())
        lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return model, opt, lam, _driver(model, opt, micro=2, global_batch=4, lr_scheduler=lam)

    model, opt, lam, drv = make()
    for w in sc.chunks(seqs, 4)[:2]:
        drv.run_window(sc.micro_batches(w, 2), sc.loss_fn)
    save_checkpoint(tmp_path / "c.pt", drv)
    model2, opt2, lam2, drv2 = make()
    load_checkpoint(tmp_path / "c.pt", drv2)
    assert lam2.last_epoch == lam.last_epoch == 2
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_compiled_ddp_wrapper_is_detected(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    model = sc.build_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    compiled = torch.compile(ddp)  # lazily compiled: nothing is traced until a forward
    drv = _driver(compiled, torch.optim.SGD(model.parameters(), lr=0.1), micro=2, global_batch=4)
    assert drv.parallel == "ddp"
    from globalbatch.step import unwrap_model

    assert unwrap_model(compiled) is model


_DOC = Path(__file__).resolve().parents[1] / "docs" / "step.md"


def _python_blocks(path: Path) -> list[str]:
    """The ```python blocks of a Markdown page, dedented, in order."""
    found = re.findall(r"^([ \t]*)```python\n(.*?)^\1```[ \t]*$", path.read_text(), flags=re.M | re.S)
    return [textwrap.dedent(code) for _, code in found]


def test_doc_snippets_run():
    """Every ```python block of _DOC runs as written (blocks share one namespace, in order)."""
    blocks = _python_blocks(_DOC)
    assert len(blocks) >= 1, f"{_DOC}: {len(blocks)} python blocks"
    namespace: dict = {"__name__": "doc_snippet"}
    for i, code in enumerate(blocks, 1):
        exec(compile(code, f"{_DOC.name} python block {i}", "exec"), namespace)  # noqa: S102 - test only


def test_callbacks_changed_after_construction_take_effect():
    """Issue 12: the driver cached its callback lists, so a late ``callbacks.append`` was ignored."""
    calls = []

    class Cb:
        def __init__(self, name):
            self.name = name

        def on_micro_backward(self, driver, i, count):
            calls.append((self.name, "micro", i))

        def on_step_end(self, driver, result):
            calls.append((self.name, "step", result.step))

    model = torch.nn.Linear(3, 1)
    drv = StepDriver(model, torch.optim.SGD(model.parameters(), lr=0.1), StepConfig(micro_batch=2, global_batch=4))
    a, b = Cb("a"), Cb("b")

    def window():
        for i in range(2):
            with drv.micro_step(last=i == 1):
                drv.backward(model(torch.randn(2, 3)).square().sum(), 2, samples=2)
        drv.step()

    drv.callbacks.append(a)
    window()
    drv.callbacks += [b]
    drv.callbacks.remove(a)
    window()
    drv.callbacks = []
    window()
    assert calls == [("a", "micro", 0), ("a", "micro", 1), ("a", "step", 1),
                     ("b", "micro", 0), ("b", "micro", 1), ("b", "step", 2)]
