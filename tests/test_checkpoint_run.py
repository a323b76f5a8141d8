"""Checkpoints carry what defines the run: a resume with another schedule is an error naming both values."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from globalbatch.checkpoint import RunMismatch, load_checkpoint, run_definition, save_checkpoint
from globalbatch.schedule import TokenLRSchedule, constant_batch
from globalbatch.step import StepConfig, StepDriver

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tinygpt.py"
_TINY = ["--n-layer", "1", "--d-model", "32", "--seq-len", "32", "--val-batches", "1", "--log-every", "1",
         "--warmup-tokens", "300", "--global-batch", "16", "--micro-batch", "2"]


def _driver(total: int = 3000, batch: int = 4, warmup: int = 100):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = StepConfig(micro_batch=2, batch_schedule=constant_batch(batch),
                     lr_schedule=TokenLRSchedule(peak_lr=0.1, warmup=warmup, total=total))
    return model, opt, StepDriver(model, opt, cfg)


def test_run_definition_names_the_horizons():
    _, _, d = _driver()
    run = run_definition(d)
    assert run["lr_schedule.total"] == 3000 and run["lr_schedule.warmup"] == 100 and run["lr_schedule.peak_lr"] == 0.1
    assert run["batch_schedule.type"] == "StepBatchSchedule" and "batch_schedule.steps" in run


@pytest.mark.parametrize("change, key", [(dict(total=6000), "lr_schedule.total"),
                                         (dict(warmup=50), "lr_schedule.warmup"),
                                         (dict(batch=8), "batch_schedule.steps")])
def test_resume_with_another_schedule_is_an_error_naming_both_unless_override(tmp_path, caplog, change, key):
    model, opt, d = _driver()
    path = tmp_path / "c.pt"
    save_checkpoint(path, model, opt, d)
    m2, o2, d2 = _driver(**change)
    before = {k: v.clone() for k, v in m2.state_dict().items()}
    with pytest.raises(RunMismatch) as exc:
        load_checkpoint(path, m2, o2, d2)
    then, now = exc.value.diffs[key]
    assert then != now and f"{key}: checkpoint {then!r}, now {now!r}" in str(exc.value)
    assert all(torch.equal(before[k], v) for k, v in m2.state_dict().items())  # nothing restored
    with caplog.at_level(logging.WARNING, logger="globalbatch.checkpoint"):
        load_checkpoint(path, m2, o2, d2, override=True)
    assert key in caplog.text
    assert all(torch.equal(model.state_dict()[k], v) for k, v in m2.state_dict().items())
    load_checkpoint(path, *_driver())  # the same run resumes without a word


def test_example_resume_without_total_tokens_is_refused_with_both_horizons(tmp_path, capsys):
    """The issue's case: resumed without --total-tokens, the LR decayed over another horizon, silently."""
    spec = importlib.util.spec_from_file_location("train_tinygpt", _EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ck = tmp_path / "b.pt"
    assert mod.main(_TINY + ["--steps", "4", "--checkpoint", str(ck), "--checkpoint-every", "2"]) in (0, None)
    capsys.readouterr()
    assert mod.main(_TINY + ["--steps", "2", "--resume", str(ck)]) == 2  # --steps changes the estimated horizon
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lr_schedule.total: checkpoint " in err and "--override" in err, err
    assert mod.main(_TINY + ["--steps", "2", "--resume", str(ck), "--override"]) in (0, None)
