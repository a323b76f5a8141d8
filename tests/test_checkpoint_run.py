"""Checkpoints carry what defines the run: a resume with another schedule is an error naming both values."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from globalbatch.checkpoint import RunMismatch, load_checkpoint, run_definition, save_checkpoint
from globalbatch.schedule import LRSchedule, constant_batch
from globalbatch.step import StepConfig, StepDriver

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tinygpt.py"
_TINY = ["--n-layer", "1", "--d-model", "32", "--seq-len", "32", "--val-batches", "1", "--log-every", "1",
         "--warmup-tokens", "300", "--global-batch", "16", "--micro-batch", "2"]


def _driver(total: int = 3000, batch: int = 4, warmup: int = 100):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = StepConfig(micro_batch=2, batch_schedule=constant_batch(batch),
                     lr_schedule=LRSchedule(peak_lr=0.1, warmup=warmup, total=total))
    return model, opt, StepDriver(model, opt, cfg)


def test_run_definition_names_the_horizons():
    _, _, d = _driver()
    run = run_definition(d)
    assert run["lr_schedule.total"] == 3000 and run["lr_schedule.warmup"] == 100 and run["lr_schedule.peak_lr"] == 0.1
    assert run["batch_schedule.type"] == "StepBatchSchedule" and "batch_schedule.steps" in run
    assert run["unit"] == "token" and run["lr_schedule.type"] == "LRSchedule"  # the unit once, for both schedules


@pytest.mark.parametrize("change, key", [(dict(total=6000), "lr_schedule.total"),
                                         (dict(warmup=50), "lr_schedule.warmup"),
                                         (dict(batch=8), "batch_schedule.steps")])
def test_resume_with_another_schedule_is_an_error_naming_both_unless_override(tmp_path, caplog, change, key):
    model, opt, d = _driver()
    path = tmp_path / "c.pt"
    save_checkpoint(path, d)
    m2, o2, d2 = _driver(**change)
    before = {k: v.clone() for k, v in m2.state_dict().items()}
    with pytest.raises(RunMismatch) as exc:
        load_checkpoint(path, d2)
    then, now = exc.value.diffs[key]
    assert then != now and f"{key}: checkpoint {then!r}, now {now!r}" in str(exc.value)
    assert all(torch.equal(before[k], v) for k, v in m2.state_dict().items())  # nothing restored
    with caplog.at_level(logging.WARNING, logger="globalbatch.checkpoint"):
        load_checkpoint(path, d2, override=True)
    assert key in caplog.text
    assert all(torch.equal(model.state_dict()[k], v) for k, v in m2.state_dict().items())
    load_checkpoint(path, _driver()[2])  # the same run resumes without a word


@pytest.mark.parametrize("content, why", [
    (b"garbage", "torch.load(weights_only=True) cannot read it: UnpicklingError: "),
    (b"PK\x03\x04garbage", "torch.load(weights_only=True) cannot read it: RuntimeError: PytorchStreamReader"),
    ("other", "it has no model, optimizer, driver"),
])
def test_a_file_that_is_no_checkpoint_is_one_line_before_anything_is_restored(tmp_path, content, why):
    from globalbatch.errors import SettingError

    path = tmp_path / "c.pt"
    if content == "other":
        torch.save({"x": torch.ones(1)}, path)  # a torch file, not ours
    else:
        path.write_bytes(content)
    model, _, d = _driver()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(SettingError) as exc:
        load_checkpoint(path, d)
    line = str(exc.value)
    assert line.startswith(f"checkpoint {str(path)!r} is not allowed ({why}") and "\n" not in line
    assert line.endswith("allowed: a file written by globalbatch.save_checkpoint") and "weights_only=False" not in line
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and d.optimizer_steps == 0


@pytest.mark.parametrize("where, why", [
    (f"cuda:{torch.cuda.device_count()}", "this machine has"),  # one past the last CUDA device (cuda:0 on a CPU)
    ("nonsense", "not a torch device"),
])
def test_a_map_location_this_machine_lacks_is_named_not_blamed_on_the_file(tmp_path, where, why):
    from globalbatch.errors import SettingError

    model, _, d = _driver()
    path = tmp_path / "c.pt"
    save_checkpoint(path, d)
    with pytest.raises(SettingError) as exc:
        load_checkpoint(path, d, map_location=where)
    line = str(exc.value)
    assert line.startswith(f"map_location {where!r} is not allowed ({why}") and "\n" not in line
    assert "save_checkpoint" not in line
    load_checkpoint(path, d, map_location=torch.device("cpu"))  # a device it has: loads


def test_a_map_location_dict_to_an_absent_device_is_named_not_blamed_on_the_file(tmp_path):
    """A dict (torch checks it while it loads) mapping the file's CPU tensors onto one past the last CUDA device
    (cuda:0 on a machine without CUDA)."""
    from globalbatch.errors import SettingError

    model, _, d = _driver()
    path = tmp_path / "c.pt"
    save_checkpoint(path, d)
    where = {"cpu": f"cuda:{torch.cuda.device_count()}"}
    with pytest.raises(SettingError) as exc:
        load_checkpoint(path, d, map_location=where)
    line = str(exc.value)
    assert line.startswith(f"map_location {where!r} is not allowed (Attempting to deserialize object on")
    assert "\n" not in line and "save_checkpoint" not in line


def test_a_checkpoint_of_the_old_schedules_resumes_under_the_new_names(tmp_path):
    """Written with TokenLRSchedule(unit="token") (the old names): the same run now, with LRSchedule and one unit."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from globalbatch.schedule import TokenLRSchedule

        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        old = StepDriver(model, opt, StepConfig(micro_batch=2, batch_schedule=constant_batch(4, unit="token"),
                                                lr_schedule=TokenLRSchedule(peak_lr=0.1, warmup=100, total=3000,
                                                                            unit="token")))
        save_checkpoint(tmp_path / "old.pt", old)
    state = torch.load(tmp_path / "old.pt", weights_only=True)
    state["run"] = {k: v for k, v in state["run"].items() if k != "unit"}  # what the old version wrote:
    state["run"].update({"lr_schedule.type": "TokenLRSchedule", "lr_schedule.unit": "token",
                         "batch_schedule.unit": "token"})
    torch.save(state, tmp_path / "old.pt")
    load_checkpoint(tmp_path / "old.pt", _driver()[2])  # no RunMismatch: the same run
    state["run"]["lr_schedule.unit"] = state["run"]["batch_schedule.unit"] = "sample"
    torch.save(state, tmp_path / "sample.pt")
    with pytest.raises(RunMismatch, match="unit: checkpoint 'sample', now 'token'"):
        load_checkpoint(tmp_path / "sample.pt", _driver()[2])


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
