"""The user's loop in few lines: windows cut by the library, a ready LM loss, callbacks, checkpoints from the driver,
each quantity given once and checked, a mean loss refused, the batch arithmetic printed once."""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path

import pytest

from globalbatch.errors import SettingError
import torch
import torch.nn.functional as F

import globalbatch as gb
from globalbatch.adaptive import AdaptiveBatchSchedule, FeasibleBatches, Proposal
from globalbatch.checkpoint import load_checkpoint, save_checkpoint
from globalbatch.losses import causal_lm_loss, causal_lm_loss_sum
from globalbatch.noise import NoiseScaleMonitor
from globalbatch.schedule import LRSchedule, parse_step_schedule
from globalbatch.step import StepCallback, StepConfig, StepDriver, batch_samples, mean_reduction
from globalbatch.windows import MicroBatches, cut_window, rank_windows, window_layout

_DIST = Path(__file__).parent / "dist"
_spec = importlib.util.spec_from_file_location("step_common", _DIST / "step_common.py")
sc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sc)


def _hf_collate(docs):
    width = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    labels = torch.full((len(docs), width), -100, dtype=torch.long)
    for r, d in enumerate(docs):
        ids[r, :len(d)] = d
        labels[r, :len(d)] = d
    return {"input_ids": ids, "labels": labels}


def _driver(micro=2, global_batch=8, **cfg):
    model = sc.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, StepDriver(model, opt, StepConfig(micro_batch=micro, global_batch=global_batch,
                                                         print_geometry=False, **cfg))


# --------------------------------------------------------------------------- windows


def test_window_layout_full_short_and_too_short():
    assert window_layout(16, 2, 2) == [[2, 2, 2, 2], [2, 2, 2, 2]]
    assert window_layout(5, 2, 2) == [[2, 1], [1, 1]]  # shares 3 and 2, two micro-steps on each rank
    assert window_layout(5, 2, 1) == [[2, 2, 1]]
    assert window_layout(7, 4, 2) == [[4], [3]]
    assert window_layout(1, 2, 2) is None  # a rank would have no micro-batch
    assert window_layout(2, 2, 1) == [[2]] and window_layout(2, 2, 1, min_micro_steps=2) == [[1, 1]]
    for n in range(2, 40):
        for m in (2, 3, 4):
            lay = window_layout(n, m, 2)
            assert sum(map(sum, lay)) == n and max(max(r) for r in lay) <= m
            assert len({len(r) for r in lay}) == 1  # the same number of micro-steps on every rank (FSDP2)


def test_cut_window_is_the_labs_row_by_row_cut_and_covers_every_sample_once():
    drawn = list(range(100, 108))
    assert cut_window(drawn, 2, 1, 0) == [[100, 101], [102, 103], [104, 105], [106, 107]]
    assert cut_window(drawn, 2, 2, 0) == [[100, 101], [104, 105]]
    assert cut_window(drawn, 2, 2, 1) == [[102, 103], [106, 107]]
    short = list(range(5))
    parts = [cut_window(short, 2, 2, r) for r in range(2)]
    assert parts == [[[0, 1], [3]], [[2], [4]]]
    assert sorted(x for p in parts for m in p for x in m) == short
    with pytest.raises(SettingError, match="samples 1 is not allowed"):
        cut_window([0], 2, 2, 0)


def test_rank_windows_follow_the_batch_schedule_skip_on_resume_and_end_with_a_short_window(caplog):
    model = sc.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = parse_step_schedule("0:4 60:8")
    drv = StepDriver(model, opt, StepConfig(micro_batch=2, batch_schedule=sched, print_geometry=False))
    docs = sc.make_sequences(30, seed=1)
    sizes = []
    for window in rank_windows(docs, drv, collate=_hf_collate):
        assert isinstance(window, MicroBatches) and window.samples == [int(b["input_ids"].shape[0]) for b in window]
        sizes.append(window.window_samples)
        drv.run_window(window, causal_lm_loss)
    assert sizes[0] == 4 and 8 in sizes and sum(sizes) == 30 and drv.consumed_samples == 30
    assert sizes[-1] == 30 - sum(sizes[:-1]) and sizes[-1] <= 8
    first = sizes.index(8)
    assert all(s == 4 for s in sizes[:first])  # the batch grew when the schedule said so, not before
    # resume: start skips what was drawn
    again = next(rank_windows(docs, drv, collate=None, start=26))  # 4 left at batch 8: a short window
    assert again.window_samples == 4 and again == [docs[26:28], docs[28:30]]
    tail = next(rank_windows(docs, drv, collate=None, start=27))  # 3 left: still two micro-batches (noise monitor)
    assert tail.samples == [2, 1]
    assert next(rank_windows(docs, drv, start=28)).samples == [1, 1]
    with caplog.at_level(logging.WARNING, logger="globalbatch.windows"):
        assert list(rank_windows(docs, drv, start=29)) == []  # one sample: one small batch, left out
    assert "the last sample is left out: alone it is one micro-batch" in caplog.text


def test_rank_windows_refuse_drawing_ahead_and_leave_out_a_tail_smaller_than_the_ranks(caplog):
    _, _, drv = _driver(micro=2, global_batch=4)
    data = list(range(10))
    with pytest.raises(SettingError, match="samples a DataLoader with batch_size 2 is not allowed"):
        rank_windows(torch.utils.data.DataLoader(data, batch_size=2), drv)  # refused before anything is drawn
    one_by_one = next(rank_windows(torch.utils.data.DataLoader(data, batch_size=None), drv))
    assert [[int(x) for x in m] for m in one_by_one] == [[0, 1], [2, 3]]
    drv.run_window([sc.collate(sc.make_sequences(2, seed=0))] * 2, sc.loss_fn)
    it = rank_windows(range(100), drv)
    next(it)
    with pytest.raises(RuntimeError, match="drawn before step"):
        next(it)

    class TwoRanks:  # what rank 1 of 2 sees: the cut needs only these four attributes
        global_batch, dp_world_size, dp_rank, windows = 8, 2, 1, 0

        class config:
            micro_batch = 2

    fake = TwoRanks()
    out = []
    with caplog.at_level(logging.WARNING, logger="globalbatch.windows"):
        for w in rank_windows(range(17), fake):
            out.append(w)
            fake.windows += 1
    assert [list(w) for w in out] == [[[2, 3], [6, 7]], [[10, 11], [14, 15]]]
    assert "the last 1 samples are fewer than the 2 data-parallel ranks" in caplog.text


# --------------------------------------------------------------------------- the loss, samples, the mean guard


def test_causal_lm_loss_is_the_summed_shifted_cross_entropy_and_its_targets():
    model = sc.build_model()
    batch = _hf_collate(sc.make_sequences(4, seed=2))
    loss, count = causal_lm_loss(model, batch)
    logits = model(batch["input_ids"])
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                          ignore_index=-100, reduction="sum")
    assert torch.equal(loss, ref) and int(count) == int((batch["labels"][:, 1:] != -100).sum())
    assert torch.equal(loss, causal_lm_loss_sum(logits, batch["labels"])[0])


@pytest.mark.parametrize("make, how", [
    (lambda lg, y: F.cross_entropy(lg, y), "reduction='mean'"),
    (lambda lg, y: F.cross_entropy(lg, y, reduction="none").mean(), ".mean()"),
    (lambda lg, y: F.cross_entropy(lg, y, reduction="sum") / y.numel(), "division"),
    (lambda lg, y: F.cross_entropy(lg.double(), y).float(), "reduction='mean'"),  # through a cast
    (lambda lg, y: F.mse_loss(lg, torch.zeros_like(lg)), "reduction='mean'"),
])
def test_a_mean_loss_is_refused_before_its_backward(make, how):
    model, opt, drv = _driver()
    x = torch.randint(0, sc.VOCAB, (2, 5))
    y = torch.randint(0, sc.VOCAB, (10,))
    with drv.micro_step(last=True):
        loss = make(model(x).reshape(10, -1), y)
        assert how in mean_reduction(loss)
        with pytest.raises(SettingError, match="loss_sum from .* is not allowed .*the driver divides by the global count"):
            drv.backward(loss, 10, samples=2)
    assert all(p.grad is None for p in model.parameters())  # refused before any gradient


def test_the_guard_catches_the_wrong_gradient_it_would_give_and_passes_sums():
    """A mean loss through the driver is divided twice: measurably wrong. The guard stops it; a sum passes."""
    seqs = sc.make_sequences(8, seed=4)
    mbs = sc.micro_batches(seqs, 2)

    def mean_loss(m, b):
        loss, count = sc.loss_fn(m, b)
        return loss / count, count

    grads = {}
    for name, fn, check in (("sum", sc.loss_fn, True), ("mean", mean_loss, False)):
        model, opt, drv = _driver(micro=2, global_batch=8, check_summed_loss=check)
        probe = sc.GradProbe(model)
        drv.callbacks.append(probe)
        drv.run_window(mbs, fn)
        grads[name] = probe.window[0]
    truth = sc.full_batch_grads(sc.build_model(), seqs)
    assert sc.max_rel_diff(grads["sum"], truth) < 1e-10
    assert sc.max_rel_diff(grads["mean"], truth) > 0.5  # what the guard prevents
    model, opt, drv = _driver(micro=2, global_batch=8)
    with pytest.raises(SettingError, match="loss_sum from a division"):
        drv.run_window(mbs, mean_loss)
    assert mean_reduction(sc.loss_fn(model, mbs[0])[0]) is None
    assert mean_reduction(torch.tensor(3.0)) is None


def test_samples_are_given_once_inferred_and_checked():
    model, opt, drv = _driver(micro=2, global_batch=8)
    assert batch_samples({"input_ids": torch.zeros(3, 4), "labels": torch.zeros(3, 4)}) == 3
    assert batch_samples((torch.zeros(2, 1), torch.zeros(2))) == 2 and batch_samples([1, 2]) is None
    res = drv.run_window(sc.micro_batches(sc.make_sequences(5, seed=5), 2), sc.loss_fn)  # 2 + 2 + 1, read from the batches
    assert res.global_samples == 5
    with drv.micro_step(last=True):
        loss, count = sc.loss_fn(model, sc.collate(sc.make_sequences(2, seed=6)))
        with pytest.raises(SettingError, match=r"samples 3 is not allowed; allowed: a whole number in \[0, "):
            drv.backward(loss, count, samples=3)
        with pytest.warns(FutureWarning, match="backward\\(\\) without samples= assumes a full micro-batch"):
            drv.backward(loss, count)
    drv.step()


# --------------------------------------------------------------------------- callbacks


def test_callbacks_conform_to_step_callback_and_misspelled_hooks_are_refused():
    model, opt, drv = _driver()
    monitor = NoiseScaleMonitor(model, optimizer=opt)
    assert isinstance(monitor, StepCallback)

    class Typo:
        def on_step_ended(self, driver, result):
            pass

    with pytest.raises(SettingError, match="callbacks Typo with on_step_ended is not allowed; allowed: hooks named"):
        drv.callbacks.append(Typo())
    with pytest.raises(SettingError, match="callbacks object is not allowed"):
        StepDriver(model, opt, StepConfig(micro_batch=2, global_batch=8), callbacks=[object()])


class _Grow:
    name = "grow"

    def propose(self, obs, feasible):
        return Proposal(batch=feasible.next_above(obs.global_batch) or obs.global_batch, reason="grow")


def _adaptive(**kw):
    feasible = FeasibleBatches(micro_batch=2, dp_world_size=1, min_batch=4, max_batch=16)
    return AdaptiveBatchSchedule(_Grow(), feasible, 4, decide_every=1, min_interval_steps=0, patience=1, **kw)


def test_the_adaptive_schedule_is_passed_once_and_finds_its_monitor():
    model = sc.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = _adaptive()
    monitor = NoiseScaleMonitor(model, optimizer=opt)
    order = []

    class Last:
        def on_step_end(self, driver, result):
            order.append("callback")

    real = sched.on_step_end
    sched.on_step_end = lambda d, r: (order.append("schedule"), real(d, r))
    drv = StepDriver(model, opt, StepConfig(micro_batch=2, batch_schedule=sched, print_geometry=False),
                     callbacks=[monitor, Last()])
    assert sched.monitor is monitor and sched not in drv.callbacks
    docs = sc.make_sequences(40, seed=7)
    for w in rank_windows(docs[:12], drv, collate=sc.collate):
        drv.run_window(w, sc.loss_fn)
    assert order[:2] == ["callback", "schedule"] and order.count("schedule") == drv.optimizer_steps
    assert drv.global_batch > 4  # the schedule decided, once per step
    sched2 = _adaptive()
    m2 = sc.build_model()
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    mon2 = NoiseScaleMonitor(m2, optimizer=o2)
    with pytest.warns(FutureWarning, match="pass it once"):  # the old way: also in callbacks
        d2 = StepDriver(m2, o2, StepConfig(micro_batch=2, batch_schedule=sched2), callbacks=[mon2, sched2.attach(mon2)])
    assert list(d2.callbacks) == [mon2, sched2] and d2._schedule_hook is None  # called there, once
    with pytest.raises(SettingError, match="callbacks 2 noise monitors is not allowed"):
        StepDriver(m2, o2, StepConfig(micro_batch=2, batch_schedule=_adaptive()), callbacks=[mon2, mon2])


# --------------------------------------------------------------------------- checkpoints from the driver


def test_checkpoint_takes_everything_from_the_driver_monitor_included(tmp_path):
    docs = sc.make_sequences(24, seed=8)

    def make(seed=0):
        model = sc.build_model(seed=seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        monitor = NoiseScaleMonitor(model, optimizer=opt)
        lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        drv = StepDriver(model, opt, StepConfig(micro_batch=2, global_batch=4, print_geometry=False),
                         callbacks=[monitor], lr_scheduler=lam)
        return model, drv, monitor

    model, drv, monitor = make()
    for w in rank_windows(docs[:12], drv, collate=sc.collate):
        drv.run_window(w, sc.loss_fn)
    save_checkpoint(tmp_path / "c.pt", drv)
    m2, d2, mon2 = make(seed=5)
    load_checkpoint(tmp_path / "c.pt", d2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), m2.parameters()))
    assert d2.state_dict() == drv.state_dict() and d2.lr_scheduler.last_epoch == 3
    assert mon2.estimate().windows == monitor.estimate().windows == 3
    assert mon2.estimate().b_simple == monitor.estimate().b_simple
    for a, b in ((drv, docs[12:]), (d2, docs[12:])):
        for w in rank_windows(b, a, collate=sc.collate):
            a.run_window(w, sc.loss_fn)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), m2.parameters()))
    assert mon2.estimate().b_simple == monitor.estimate().b_simple and monitor.estimate().windows == 6
    with pytest.warns(FutureWarning, match=r"save_checkpoint\(path, model, optimizer, driver\) is deprecated"):
        save_checkpoint(tmp_path / "old.pt", model, drv.optimizer, drv)
    with pytest.warns(FutureWarning, match="load_checkpoint"):
        load_checkpoint(tmp_path / "old.pt", m2, d2.optimizer, d2)
    with pytest.raises(SettingError, match="arguments Linear is not allowed; allowed: save_checkpoint"):
        save_checkpoint(tmp_path / "x.pt", torch.nn.Linear(1, 1))
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    assert list(state["callbacks"]) == ["0:NoiseScaleMonitor"]


# --------------------------------------------------------------------------- the arithmetic, once


def test_the_batch_arithmetic_is_printed_once_and_can_be_silenced(capsys):
    model = sc.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    drv = StepDriver(model, opt, StepConfig(micro_batch=2, global_batch=8, seq_len=12))
    docs = sc.make_sequences(16, seed=9)
    for w in rank_windows(docs, drv, collate=sc.collate):
        drv.run_window(w, sc.loss_fn)
    out = capsys.readouterr().out
    assert out.count("globalbatch:") == 1
    assert ("globalbatch: global batch 8 seq = 1 ranks × 4 accum × 2 seq; tokens per step ≤ 96 = 8 seq × 12 seq_len "
            "(padding included)") in out
    _, _, quiet = _driver()
    quiet.run_window(sc.micro_batches(docs[:8], 2), sc.loss_fn)
    assert capsys.readouterr().out == ""


def test_front_door_names():
    assert gb.rank_windows is rank_windows and gb.causal_lm_loss is causal_lm_loss and gb.LRSchedule is LRSchedule
    assert math.isclose(LRSchedule(peak_lr=1.0, total=10, shape="linear").lr_at(5), 0.5)
