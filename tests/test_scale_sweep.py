"""The sweep path of ``globalbatch scale`` against ground truth: a synthetic 3-seed sweep directory whose steps to every
loss follow S = S_min(L)·(1 + B_crit/B) with B_crit = 1,600 tokens and S_min(L) = 10·(3/(L − 2) − 1), with noise on
the held-out readings. The fit must recover B_crit within 15 % at every target, S_min within 10 %, and predict the
steps of every batch within 10 %."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from globalbatch._util import atomic_write_json
from globalbatch.lab.sweep import SweepConfig

TOKENS_PER_SAMPLE = 20
B_CRIT = 1600.0


def _s_min(loss: float) -> float:
    return 10.0 * (3.0 / (loss - 2.0) - 1.0)


def write_seeded_sweep(out: Path) -> SweepConfig:
    cfg = SweepConfig(task="tinygpt", batches=[16, 32, 64, 128, 256], lrs=[1e-3], budget=300_000, lr_rule="none",
                      seeds=[0, 1, 2], eval_points=30, warmup=100)
    atomic_write_json(out / "manifest.json", cfg.manifest())
    for t in cfg.trials():
        rng = np.random.default_rng(1000 + t.seed * 17 + t.batch)
        b_tok = t.batch * TOKENS_PER_SAMPLE
        n = cfg.budget // b_tok
        tau = 10.0 * (1.0 + B_CRIT / b_tok) * math.exp(rng.normal(0.0, 0.02))  # seed-to-seed spread of the steps
        s = np.arange(0, n)
        loss = 2.0 + 3.0 / (1.0 + s / tau) + rng.normal(0.0, 0.01, n)
        rate = 2000.0 * math.sqrt(b_tok)
        evals = {int(p) for p in np.unique(np.round(np.geomspace(1, n, 40)))}
        recs = [{"kind": "header", "trial": t.name, "batch": t.batch, "lr": t.lr, "unit": "token", "seed": t.seed,
                 "warmup_units": 100},
                {"kind": "eval", "step": 0, "consumed": 0, "val_loss": 5.0}]
        for i in range(n):
            r = {"kind": "step", "step": i + 1, "consumed": int((i + 1) * b_tok), "batch": t.batch, "batch_units": b_tok,
                 "loss": float(loss[i]), "grad_norm": 1.0, "lr": t.lr, "skipped": False, "skipped_total": 0,
                 "units_per_s": rate, "train_time_s": (i + 1) * b_tok / rate}
            if i + 1 in evals:
                r["val_loss"] = float(2.0 + 3.0 / (1.0 + (i + 1) / tau) + rng.normal(0.0, 0.003))
            recs.append(r)
        d = out / "trials" / t.name
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        atomic_write_json(d / "summary.json", {
            "completed": True, "trial": t.name, "batch": t.batch, "lr": t.lr, "seed": t.seed, "unit": "token",
            "steps": n, "consumed": n * b_tok, "mean_batch_units": float(b_tok), "units_per_s": rate,
            "core_s_per_unit": 1 / rate, "skipped_windows": 0, "final_val_loss": float(loss[-1]),
            "train_time_s": n * b_tok / rate, "micro_batch": 16})
    return cfg


@pytest.mark.slow
def test_sweep_fit_recovers_b_crit_and_s_min(tmp_path, monkeypatch):
    import globalbatch.critical.seeds
    from globalbatch.cli.scale import convergence_from_sweep
    from test_bad_inputs import run_main

    write_seeded_sweep(tmp_path)
    conv, facts = convergence_from_sweep(str(tmp_path))
    lo, hi = conv.loss_range
    assert facts["tokens_per_sequence"] == pytest.approx(TOKENS_PER_SAMPLE)
    for L in np.linspace(lo, hi, 4):
        assert conv.b_crit(L) == pytest.approx(B_CRIT, rel=0.15), L
        assert conv.s_min(L) == pytest.approx(_s_min(L), rel=0.10), L
        for b in (320.0, 1280.0, 5120.0):
            assert conv.steps(b, L) == pytest.approx(_s_min(L) * (1 + B_CRIT / b), rel=0.10)
    assert abs(conv.b_crit_law.k) < 1.0  # B_crit does not move with the loss here
    assert not conv.extrapolated(0.5 * (lo + hi)) and conv.extrapolated(lo * 0.9)
    assert facts["joint_lack_of_fit"] == []  # the medians follow the law
    # a joint fit the report flags for lack of fit: scale still answers, and says so first
    monkeypatch.setattr(globalbatch.critical.seeds, "joint_flags", lambda *a, **k: ["lack of fit: (a stand-in)"])
    code, out, err = run_main(["scale", str(tmp_path), "--max-gpus", "16", "--json"])
    assert code == 0, err
    assert json.loads(out)["notes"][0].startswith("the sweep's joint fit B_crit(L) is flagged (lack of fit: (a stand-in))")
