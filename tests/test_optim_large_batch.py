"""LARS and LAMB: hand-computed two-step examples of the papers' equations, the libraries to 1e-6,
the 1-D exemption from decay and trust ratio, and the registry entries."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from globalbatch.errors import SettingError
from globalbatch.optim import build_optimizer, lr_for_batch, lr_scaling_rule, optimizer_names
from globalbatch.optim.large_batch import LAMB, LARS


def _norm(xs):
    return math.sqrt(sum(x * x for x in xs))


def _run(opt_cls, w0, grads, **kw):
    """Apply ``grads`` (list of lists) to one 1×n weight matrix; returns the weights after each step."""
    w = nn.Parameter(torch.tensor([w0], dtype=torch.float64))
    opt = opt_cls([w], **kw)
    out = []
    for g in grads:
        w.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
        out.append(w.detach()[0].tolist())
    return out


# ----------------------------------------------------------------------------- LARS, by hand


def test_lars_two_steps_by_hand():
    # You et al. 2017, eq. 6: λ = η‖w‖ / (‖g‖ + β‖w‖); v ← μv + λ(g + βw); w ← w − γv.
    w0, g1, g2 = [3.0, 4.0], [0.6, 0.8], [0.0, 1.0]
    eta, beta, mu, gamma = 0.003, 0.1, 0.9, 1.0
    # Step 1 with round numbers: ‖w‖ = 5, ‖g‖ = 1, λ = 0.003·5/(1 + 0.5) = 0.01,
    # g + βw = [0.9, 1.2], v = [0.009, 0.012], w = [2.991, 3.988].
    w1 = [2.991, 3.988]
    v1 = [0.009, 0.012]
    # Step 2 from the equations, in plain Python.
    lam2 = eta * _norm(w1) / (_norm(g2) + beta * _norm(w1))
    v2 = [mu * v + lam2 * (g + beta * w) for v, g, w in zip(v1, g2, w1)]
    w2 = [w - gamma * v for w, v in zip(w1, v2)]
    got = _run(LARS, w0, [g1, g2], lr=gamma, momentum=mu, weight_decay=beta, trust_coefficient=eta)
    assert got[0] == pytest.approx(w1, abs=1e-12)
    assert got[1] == pytest.approx(w2, abs=1e-12)
    # the trust ratio matters: plain momentum SGD with decay lands far away
    sgd = _run(torch.optim.SGD, w0, [g1, g2], lr=gamma, momentum=mu, weight_decay=beta)
    assert abs(sgd[1][0] - w2[0]) > 0.1


def test_lamb_two_steps_by_hand():
    # You et al. 2019, Alg. 2 with bias correction: after step 1, m̂ = g and v̂ = g², so
    # r = g/(|g| + eps) = sign(g) for eps = 0.
    w0, g1, g2 = [3.0, 4.0], [0.6, -0.8], [0.2, 0.4]
    b1, b2, lam, gamma = 0.9, 0.999, 0.1, 0.01
    # Step 1: r + λw = [1.3, −0.6]; ratio = 5 / √2.05.
    ratio1 = 5.0 / math.sqrt(2.05)
    w1 = [3.0 - gamma * ratio1 * 1.3, 4.0 + gamma * ratio1 * 0.6]
    m1 = [(1 - b1) * g for g in g1]
    v1 = [(1 - b2) * g * g for g in g1]
    m2 = [b1 * m + (1 - b1) * g for m, g in zip(m1, g2)]
    v2 = [b2 * v + (1 - b2) * g * g for v, g in zip(v1, g2)]
    r2 = [(m / (1 - b1 ** 2)) / math.sqrt(v / (1 - b2 ** 2)) + lam * w for m, v, w in zip(m2, v2, w1)]
    w2 = [w - gamma * _norm(w1) / _norm(r2) * r for w, r in zip(w1, r2)]
    got = _run(LAMB, w0, [g1, g2], lr=gamma, betas=(b1, b2), eps=0.0, weight_decay=lam)
    assert got[0] == pytest.approx(w1, abs=1e-12)
    assert got[1] == pytest.approx(w2, abs=1e-12)
    # without bias correction the Adam ratio is m/√v = 0.1/√0.001 · sign(g) at t = 1, so with decay
    # the direction of r + λw changes: the switch is measurable
    nb = _run(LAMB, w0, [g1, g2], lr=gamma, betas=(b1, b2), eps=0.0, weight_decay=lam, bias_correction=False)
    assert abs(nb[0][0] - w1[0]) > 1e-3


def test_lamb_phi_clamps_weight_norm():
    # ‖w‖ = 50 > 10: the step's norm is γ·10, not γ·50.
    w0 = [30.0, 40.0]
    got = _run(LAMB, w0, [[1.0, 1.0]], lr=0.01, eps=0.0)
    assert _norm([a - b for a, b in zip(got[0], w0)]) == pytest.approx(0.01 * 10.0, rel=1e-12)
    got = _run(LAMB, w0, [[1.0, 1.0]], lr=0.01, eps=0.0, max_weight_norm=None)
    assert _norm([a - b for a, b in zip(got[0], w0)]) == pytest.approx(0.01 * 50.0, rel=1e-12)


def test_zero_weights_get_ratio_one():
    got = _run(LARS, [0.0, 0.0], [[1.0, 2.0]], lr=0.5, momentum=0.0)
    assert got[0] == pytest.approx([-0.5, -1.0], abs=1e-15)
    got = _run(LAMB, [0.0, 0.0], [[1.0, -2.0]], lr=0.5, eps=0.0)
    assert got[0] == pytest.approx([-0.5, 0.5], abs=1e-15)


# ------------------------------------------------------------------- the 1-D exemption


def _net(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    # no bias before the BatchNorm: its gradient is rounding noise (~1e-17), which a trust ratio
    # turns into a full-size step, so two correct implementations would diverge on it
    return nn.Sequential(nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).to(dtype)


def _train(model, opt, steps=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def test_biases_and_norm_weights_get_plain_update():
    # With momentum 0, a 1-D tensor's LARS step is exactly −lr·g (no decay, no trust ratio) while a
    # matrix's is scaled by its trust ratio.
    model = _net()
    opt = build_optimizer("lars", model, lr=0.1, weight_decay=0.01, momentum=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(16, 6, dtype=torch.float64)
    nn.functional.cross_entropy(model(x), torch.arange(16) % 3).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    for p, b, g in zip(model.parameters(), before, grads):
        if p.ndim <= 1:
            torch.testing.assert_close(p.detach(), b - 0.1 * g, atol=1e-15, rtol=0)
        else:
            ratio = 0.001 * b.norm() / (g.norm() + 0.01 * b.norm())
            torch.testing.assert_close(p.detach(), b - 0.1 * ratio * (g + 0.01 * b), atol=1e-15, rtol=1e-12)
            assert ratio < 0.1  # the ratio is far from 1: the exemption is visible
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]


def test_group_switch_turns_trust_ratio_off():
    w = nn.Parameter(torch.tensor([[3.0, 4.0]], dtype=torch.float64))
    opt = LAMB([{"params": [w], "trust_ratio": False}], lr=0.1, eps=0.0)
    w.grad = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.tensor([[2.9, 4.1]], dtype=torch.float64), atol=1e-15, rtol=0)


# ------------------------------------------------------------------------ the libraries


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_lamb_matches_torch_optimizer(weight_decay):
    torch_optimizer = pytest.importorskip("torch_optimizer")  # dev extra: the reference only
    # torch_optimizer.Lamb(debias=False) is the paper's v3 update without exemptions: compare with
    # exclude_1d=False, then the exemption with a second reference instance in "adam" mode for 1-D.
    a, b = _net(), _net()
    ours = LAMB(a.parameters(), lr=1e-2, weight_decay=weight_decay, bias_correction=False, exclude_1d=False)
    ref = torch_optimizer.Lamb(b.parameters(), lr=1e-2, weight_decay=weight_decay, eps=1e-6)
    _train(a, ours, steps=6)
    _train(b, ref, steps=6)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
        torch.testing.assert_close(p, q, atol=1e-12, rtol=0)  # float64: the same arithmetic

    a, b = _net(), _net()
    ours = LAMB(a.parameters(), lr=1e-2, weight_decay=weight_decay, bias_correction=False)
    mats = [p for p in b.parameters() if p.ndim >= 2]
    vecs = [p for p in b.parameters() if p.ndim < 2]
    r1 = torch_optimizer.Lamb(mats, lr=1e-2, weight_decay=weight_decay, eps=1e-6)
    r2 = torch_optimizer.Lamb(vecs, lr=1e-2, weight_decay=0.0, eps=1e-6, adam=True)

    class Both:
        def zero_grad(self):
            r1.zero_grad(), r2.zero_grad()

        def step(self):
            r1.step(), r2.step()

    _train(a, ours, steps=6)
    _train(b, Both(), steps=6)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=0)


@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_matches_pytorch_optimizer(nesterov):
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer")  # dev extra: the reference only
    # pytorch_optimizer.LARS also exempts ndim ≤ 1 from decay and trust ratio.
    a, b = _net(), _net()
    ours = LARS(a.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-2, trust_coefficient=1e-3, nesterov=nesterov)
    ref = pytorch_optimizer.LARS(b.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-2, trust_coefficient=1e-3,
                                 nesterov=nesterov)
    _train(a, ours, steps=6)
    _train(b, ref, steps=6)
    moved = 0.0
    for p, q, p0 in zip(a.parameters(), b.parameters(), _net().parameters()):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=0)
        moved = max(moved, (p - p0).abs().max().item())
    assert moved > 1e-3  # the comparison is not between two untouched models


def test_lars_float32_matches_pytorch_optimizer_to_1e6():
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
    a, b = _net(torch.float32), _net(torch.float32)
    ours = LARS(a.parameters(), lr=0.5, weight_decay=1e-2)
    ref = pytorch_optimizer.LARS(b.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-2, trust_coefficient=1e-3)
    for opt, model in ((ours, a), (ref, b)):
        g = torch.Generator().manual_seed(3)
        for _ in range(6):
            x = torch.randn(16, 6, generator=g)
            y = torch.randint(0, 3, (16,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


# -------------------------------------------------------------------------- the registry


def test_registry_names_rules_and_classes():
    assert {"lars", "lamb"} <= set(optimizer_names())
    assert lr_scaling_rule("lars") == "linear" and lr_scaling_rule("lamb") == "sqrt"
    assert lr_for_batch("lars", 0.1, 256, 1024) == pytest.approx(0.4)
    assert lr_for_batch("lamb", 1e-3, 256, 1024) == pytest.approx(2e-3)
    model = _net()
    assert isinstance(build_optimizer("lars", model, lr=0.1), LARS)
    opt = build_optimizer("lamb", model, lr=1e-3, weight_decay=0.01)
    assert isinstance(opt, LAMB) and opt.defaults["bias_correction"] and opt.defaults["eps"] == 1e-6
    with pytest.raises(SettingError, match="allowed: .*lamb"):
        build_optimizer("lion", model, lr=1e-3)


def test_registry_table_imports_no_torch():
    code = ("import sys; from globalbatch.optim.registry import optimizer_names, lr_for_batch; "
            "assert {'lars', 'lamb'} <= set(optimizer_names()); lr_for_batch('lars', 0.1, 1, 2); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.parametrize("kw,field", [({"lr": 0.0}, "lr"), ({"momentum": 1.5}, "momentum"),
                                      ({"trust_coefficient": -1.0}, "trust_coefficient")])
def test_lars_bad_settings_name_the_field(kw, field):
    args = {"lr": 0.1, **kw}
    with pytest.raises(SettingError, match=f"^{field} .* is not allowed; allowed"):
        LARS([nn.Parameter(torch.zeros(2, 2))], **args)


def test_lamb_bad_betas():
    with pytest.raises(SettingError, match=r"^betas\[1\] 1 is not allowed; allowed: a number >= 0.0 and < 1.0$"):
        LAMB([nn.Parameter(torch.zeros(2, 2))], betas=(0.9, 1.0))


def _plan(*args):
    import json
    import os

    env = dict(os.environ, COLUMNS="120", NO_COLOR="1")
    proc = subprocess.run([sys.executable, "-m", "globalbatch.cli", "plan", "--micro-batch", "2", "--grad-accum", "8",
                           "--dp", "4", "--lr-base-batch", "16", *args], capture_output=True, text=True, env=env,
                          timeout=60)
    return proc, (json.loads(proc.stdout) if proc.returncode == 0 and "--json" in args else None)


def test_plan_names_lars_and_lamb_and_takes_their_lr_rule():
    _, rep = _plan("--lr", "0.1", "--optimizer", "lars", "--json")
    assert rep["lr_rule"] == "linear" and rep["lr"] == pytest.approx(0.4) and rep["optimizer"] == "lars"
    _, rep = _plan("--lr", "0.001", "--optimizer", "lamb", "--json")
    assert rep["lr_rule"] == "sqrt" and rep["lr"] == pytest.approx(0.002)
    _, rep = _plan("--lr", "0.001", "--optimizer", "lamb", "--lr-rule", "none", "--json")  # an explicit rule wins
    assert rep["lr"] == pytest.approx(0.001)
    proc, _ = _plan("--optimizer", "lion")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "error: --optimizer 'lion' is not allowed; allowed: adamw, sgd, lars, lamb"


def test_front_door_names_the_toolbox():
    import globalbatch as gb
    from globalbatch.nn import GhostBatchNorm2d, convert_to_ghost_bn

    assert gb.LARS is LARS and gb.LAMB is LAMB and gb.lr_for_batch is lr_for_batch
    assert gb.convert_to_ghost_bn is convert_to_ghost_bn and gb.GhostBatchNorm2d is GhostBatchNorm2d


def test_noise_command_trains_with_lamb(tmp_path, capsys):
    # every --optimizer goes through the registry: the noise command runs with LAMB end to end (in this process: the
    # CLI's own entry point, as the other CLI tests call it)
    from globalbatch.cli import main

    def cli(*argv):
        with pytest.raises(SystemExit) as exit_info:
            main(list(argv))
        cap = capsys.readouterr()
        return exit_info.value.code, cap.out, cap.err

    threads = torch.get_num_threads()
    try:
        code, out, err = cli("noise", "--task", "mnist", "--micro-batch", "8", "--grad-accum", "2", "--steps", "3",
                             "--log-every", "3", "--optimizer", "lamb", "--lr", "0.01", "--threads", "1", "--out",
                             str(tmp_path))
    finally:
        torch.set_num_threads(threads)
    assert code in (0, None), err[-2000:]
    assert (tmp_path / "noise.csv").exists() and "B_simple" in out
    code, _, err = cli("noise", "--optimizer", "lion")
    assert code == 2 and "lars, lamb" in err
