"""Ghost BatchNorm: equal to BatchNorm when the ghost batch is the batch, equal to accumulation over
micro-batches of the ghost size (outputs, gradients and running statistics), conversion, eval; and
the StepDriver's BatchNorm-under-accumulation warning."""

from __future__ import annotations

import copy
import warnings

import pytest

from globalbatch.errors import SettingError
import torch
from torch import nn

from globalbatch.nn import GhostBatchNorm1d, GhostBatchNorm2d, convert_to_ghost_bn
from globalbatch.step import StepConfig, StepDriver


def _cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 5 * 5, 6, bias=False), nn.BatchNorm1d(6), nn.ReLU(),
                         nn.Linear(6, 3))


def _state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("ghost", [16, 64])
def test_ghost_equals_batchnorm_when_ghost_covers_the_batch(ghost):
    torch.manual_seed(1)
    x = torch.randn(16, 2, 5, 5)
    ref = _cnn()
    gm = convert_to_ghost_bn(copy.deepcopy(ref), ghost)
    assert isinstance(gm[1], GhostBatchNorm2d) and isinstance(gm[5], GhostBatchNorm1d)
    for _ in range(3):  # several training forwards: running stats follow too
        y_ref, y = ref(x), gm(x)
        torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-6)
    for k, v in _state(ref).items():
        torch.testing.assert_close(_state(gm)[k], v, atol=1e-6, rtol=1e-6)
    ref.eval(), gm.eval()
    torch.testing.assert_close(gm(x), ref(x), atol=1e-6, rtol=1e-6)


def test_ghost_on_big_batch_equals_accumulated_micro_batches_float64():
    # A batch of 12 with ghost size 4 == three micro-batches of 4 through plain BatchNorm, summed
    # losses: same loss, same gradients, same running statistics (float64, 1e-10). A ragged ghost
    # size (5: 5+5+2) equals micro-batches 5, 5, 2.
    torch.manual_seed(2)
    x = torch.randn(12, 2, 5, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (12,))
    for ghost in (4, 5):
        ref = _cnn().double()
        gm = convert_to_ghost_bn(copy.deepcopy(ref), ghost)
        loss_ref = sum(nn.functional.cross_entropy(ref(xc), yc, reduction="sum")
                       for xc, yc in zip(x.split(ghost), y.split(ghost)))
        loss_ref.backward()
        loss = nn.functional.cross_entropy(gm(x), y, reduction="sum")
        loss.backward()
        torch.testing.assert_close(loss, loss_ref, atol=1e-10, rtol=0)
        for p, q in zip(gm.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-10, rtol=0)
        for k, v in _state(ref).items():
            torch.testing.assert_close(_state(gm)[k], v, atol=1e-10, rtol=0)
        assert int(gm[1].num_batches_tracked) == len(x.split(ghost))
        # ...while plain BatchNorm over the whole batch is measurably different
        big = _cnn().double()
        loss_big = nn.functional.cross_entropy(big(x), y, reduction="sum")
        assert abs(loss_big.item() - loss_ref.item()) > 1e-3


def test_momentum_none_counts_every_ghost_batch():
    torch.manual_seed(3)
    x = torch.randn(12, 4, dtype=torch.float64)
    ref = nn.BatchNorm1d(4, momentum=None).double()
    g = convert_to_ghost_bn(copy.deepcopy(ref), 3)
    for xc in x.split(3):
        ref(xc)
    g(x)
    torch.testing.assert_close(g.running_mean, ref.running_mean, atol=1e-12, rtol=0)
    torch.testing.assert_close(g.running_var, ref.running_var, atol=1e-12, rtol=0)


def test_eval_uses_running_stats_without_split_and_no_running_stats_splits():
    torch.manual_seed(4)
    x = torch.randn(8, 4)
    g = GhostBatchNorm1d(4, ghost_batch_size=2)
    g.running_mean.fill_(0.5)
    g.eval()
    torch.testing.assert_close(g(x), (x - 0.5) / torch.sqrt(torch.tensor(1.0 + 1e-5)), atol=1e-6, rtol=0)
    g2 = GhostBatchNorm1d(4, ghost_batch_size=2, track_running_stats=False).eval()
    out = g2(x)
    torch.testing.assert_close(out[:2], nn.functional.batch_norm(x[:2], None, None, training=True), atol=1e-6, rtol=0)


def test_convert_keeps_parameters_mode_and_leaves_syncbn_alone():
    m = _cnn()
    m[1].eval()
    w = m[1].weight
    m.add_module("sync", nn.SyncBatchNorm(3))
    out = convert_to_ghost_bn(m, 8)
    assert out is m and out[1].weight is w and not out[1].training
    assert type(out.sync) is nn.SyncBatchNorm
    assert isinstance(convert_to_ghost_bn(nn.BatchNorm1d(3), 2), GhostBatchNorm1d)
    assert "ghost_batch_size=8" in repr(out[1])


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_ghost_size(bad):
    with pytest.raises(SettingError, match="ghost_batch_size .* is not allowed; allowed: a whole number ≥ 1"):
        convert_to_ghost_bn(_cnn(), bad)


# --------------------------------------------------------------- the StepDriver warning


def _drive(model, *, micro, global_batch, windows=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    driver = StepDriver(model, opt, StepConfig(micro_batch=micro, global_batch=global_batch))
    torch.manual_seed(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # without it Python would hide repeats and a second warning
        for _ in range(windows):
            n = global_batch // micro
            for i in range(n):
                with driver.micro_step(last=i == n - 1):
                    x = torch.randn(micro, 2, 5, 5)
                    y = torch.randint(0, 3, (micro,))
                    driver.backward(nn.functional.cross_entropy(model(x), y, reduction="sum"), micro)
            driver.step()
    return [str(w.message) for w in caught if "normalize over" in str(w.message)]


def test_driver_warns_once_under_accumulation_and_names_the_choices():
    msgs = _drive(_cnn(), micro=4, global_batch=16)
    assert len(msgs) == 1
    m = msgs[0]
    assert "2 BatchNorm layer(s)" in m and "over 4 samples" in m and "global batch 16" in m
    assert "convert_to_ghost_bn" in m and "SyncBatchNorm" in m and "Ghost BatchNorm" in m


def test_driver_silent_without_batchnorm_with_ghost_bn_in_eval_or_without_accumulation():
    plain = nn.Sequential(nn.Flatten(), nn.Linear(50, 3))
    assert _drive(plain, micro=4, global_batch=16) == []
    assert _drive(convert_to_ghost_bn(_cnn(), 4), micro=4, global_batch=16) == []
    assert _drive(_cnn().eval(), micro=4, global_batch=16) == []
    assert _drive(_cnn(), micro=16, global_batch=16) == []


def test_warning_arithmetic_with_syncbatchnorm():
    from globalbatch.nn import batchnorm_accumulation_warning as warn

    sync = nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4))
    # SyncBatchNorm covers micro-batch x dp: 4 x 4 = the global batch 16 with one micro-step -> silent
    assert warn(sync, micro_batch=4, global_batch=16, micro_steps=1, dp_world_size=4) is None
    msg = warn(sync, micro_batch=4, global_batch=32, micro_steps=2, dp_world_size=4)
    assert "1 SyncBatchNorm layer(s)" in msg and "over 16 samples" in msg and "x dp 4" in msg
    # plain BatchNorm beside it: the per-rank micro-batch is what counts
    mixed = nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4), nn.BatchNorm1d(4))
    assert "over 4 samples" in warn(mixed, micro_batch=4, global_batch=16, micro_steps=1, dp_world_size=4)
