"""Tests of globalbatch.lab.throughput and the experiment loop's FLOPs: exact against FlopCounterMode."""

from __future__ import annotations

import itertools

import pytest
import torch

from globalbatch.flops import count_flops
from globalbatch.lab.loop import Experiment
from globalbatch.lab.tasks import load_task
from globalbatch.lab.throughput import task_flops

TINY = {"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name, overrides", [("tinygpt", dict(TINY, seq_len=256)), ("mnist", {})])
def test_task_flops_equal_counted_flops_at_every_shape(name, overrides, one_thread):
    task = load_task(name, **overrides)
    model = task.build_model(0)
    flops = task_flops(task, model, "cpu")
    order = list(itertools.islice(task.sample_order(3), 40))
    loss = lambda m, b: task.loss_sum(m, b)[0]  # noqa: E731
    widths = set()
    for start, n in ((0, 1), (1, 2), (3, 5), (8, 16), (24, 3)):
        batch = task.collate(order[start:start + n])
        if "input_ids" in batch:
            widths.add(batch["input_ids"].shape[1])
        assert flops(batch, n) == pytest.approx(count_flops(model, batch, loss), rel=1e-12)
    if name == "tinygpt":
        assert len(widths) >= 2  # ragged: several padded widths, each exact without a new count


def test_experiment_reports_flops_and_mfu_and_trains_the_same(one_thread):
    task = load_task("tinygpt", **TINY)
    plain = Experiment(task, batch=8, micro_batch=2, lr=1e-3)
    counted = Experiment(task, batch=8, micro_batch=2, lr=1e-3, measure_flops=True)
    o1, o2 = task.sample_order(0), task.sample_order(0)
    for _ in range(2):
        a, b = plain.train_window(o1), counted.train_window(o2)
    assert a.result.model_flops is None and a.result.mfu is None
    loss = lambda m, batch: task.loss_sum(m, batch)[0]  # noqa: E731
    want = sum(count_flops(counted.model, task.collate(ix), loss) for ix in counted.split(b.drawn))
    assert b.result.model_flops == pytest.approx(want, rel=1e-12)
    dt = b.result.global_units / b.result.units_per_s
    assert b.result.mfu == pytest.approx(want / dt / counted.peak.flops_per_s, rel=1e-9)
    assert b.result.valid_tokens_per_s == b.result.units_per_s
    # counting and the peak measurement leave training untouched (RNG forked, gradients dropped)
    for p, q in zip(plain.model.parameters(), counted.model.parameters()):
        assert torch.equal(p, q)
