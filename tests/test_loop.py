"""The lab's one experiment loop: devices, precision, the optimizer registry, the rank split."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import globalbatch.lab.loop as loop
from globalbatch.lab.device import Precision, check_device, resolve_device
from globalbatch.lab.loop import EVAL_CPU_TOKENS, Experiment, default_micro_batch, eval_micro_batch
from globalbatch.lab.tasks.base import val_order
from globalbatch.lab.tasks import load_task
from globalbatch.optim import OPTIMIZERS, build_optimizer

TINY = dict(n_layer=1, d_model=16, n_head=2, seq_len=16, max_corpus_bytes=200_000)


@pytest.fixture(scope="module")
def task():
    return load_task("tinygpt", **TINY)


def _train(task, precision, steps=6, **kw):
    exp = Experiment(task, batch=8, micro_batch=4, lr=3e-3, seed=0, precision=precision, max_grad_norm=1.0, **kw)
    order = task.sample_order(0)
    losses = [exp.train_window(order).result.loss_per_unit for _ in range(steps)]
    return exp, losses


def test_bf16_autocast_trains_on_cpu_close_to_fp32(task):
    exp32, l32 = _train(task, "fp32")
    exp16, l16 = _train(task, "bf16")
    assert all(map(torch.isfinite, map(torch.tensor, l16)))
    # the first step sees the same parameters: bf16 rounding only (~3 significant digits)
    assert l16[0] == pytest.approx(l32[0], rel=2e-2) and l16[0] != l32[0]
    assert l16[-1] < l16[0] and l32[-1] < l32[0]
    # parameters, gradients and optimizer states stay float32 under autocast
    assert all(p.dtype == torch.float32 for p in exp16.model.parameters())
    with exp16.precision.autocast(exp16.device):
        logits = exp16.model(task.collate([0, 1])["input_ids"])
    assert logits.dtype == torch.bfloat16


def test_fp16_runs_through_a_grad_scaler(task):
    exp, losses = _train(task, "fp16", steps=4)
    assert exp.driver.scaler is not None and exp.driver.scaler.get_scale() > 0
    assert exp.driver.optimizer_steps + exp.driver.skipped_windows == 4
    assert losses[-1] == losses[-1]  # not NaN


def test_one_optimizer_recipe_everywhere(task):
    exp = Experiment(task, batch=4, micro_batch=4, lr=1e-3)
    assert type(exp.optimizer).__name__ == "AdamW" and exp.optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    from globalbatch.probe.runner import _default_optimizer

    probe_opt = _default_optimizer(torch.nn.Linear(2, 2).parameters())
    assert probe_opt.param_groups[0]["betas"] == OPTIMIZERS["adamw"].defaults["betas"]
    sgd = build_optimizer("sgd", torch.nn.Linear(2, 2), lr=0.1, weight_decay=0.01)
    assert [g["weight_decay"] for g in sgd.param_groups] == [0.01, 0.0]  # matrices decay, biases do not
    assert [len(g["params"]) for g in sgd.param_groups] == [1, 1]
    with pytest.raises(ValueError, match="optimizer 'adam' is not allowed; allowed: adamw, sgd, lars, lamb"):
        build_optimizer("adam", torch.nn.Linear(2, 2), lr=0.1)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_the_multi_tensor_update_is_bit_identical_to_the_per_tensor_loop(task, name):
    """The registry builds AdamW and SGD with ``foreach=True`` (fewer calls per step on a CPU): the same losses,
    parameters and optimizer states as torch's per-tensor loop, bit for bit, with weight decay and clipping."""
    runs = []
    for foreach in (True, False):
        exp = Experiment(task, batch=8, micro_batch=4, lr=3e-3, seed=0, optimizer=name, weight_decay=0.1,
                         max_grad_norm=0.5)
        assert all(g["foreach"] for g in exp.optimizer.param_groups)  # the registry's default
        for g in exp.optimizer.param_groups:
            g["foreach"] = foreach
        order = task.sample_order(0)
        losses = [exp.train_window(order).result.loss_per_unit for _ in range(12)]
        tensors = [p.detach() for p in exp.model.parameters()] + [
            t for st in exp.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
        runs.append((losses, tensors))
    (la, ta), (lb, tb) = runs
    assert la == lb and len(ta) == len(tb) and all(torch.equal(a, b) for a, b in zip(ta, tb))
    assert la[-1] < la[0]


def test_a_fused_optimizer_drops_the_foreach_default():
    """torch refuses ``fused`` with ``foreach``: a caller's ``fused=True`` wins over the registry's foreach default."""
    from globalbatch.optim import build_optimizer

    model = torch.nn.Linear(3, 2)
    for name in ("adamw", "sgd"):
        opt = build_optimizer(name, model, lr=1e-3, fused=True)
        assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    assert all(g["foreach"] for g in build_optimizer("adamw", model, lr=1e-3).param_groups)


def test_split_gives_each_rank_its_slice_of_every_accumulation_step(task):
    """The deprecated Experiment.split is the library's one cut (globalbatch.windows.cut_window)."""
    exp = Experiment(task, batch=8, micro_batch=2, lr=1e-3)
    drawn = list(range(100, 108))
    with pytest.warns(FutureWarning, match="Experiment.split is deprecated"):
        assert exp.split(drawn) == [[100, 101], [102, 103], [104, 105], [106, 107]]
        exp.world, exp.rank = 2, 1  # what a 2-rank run sees: the window is 2 accum steps × 2 ranks × 2 samples
        assert exp.split(drawn) == [[102, 103], [106, 107]]
        exp.rank = 0
        assert exp.split(drawn) == [[100, 101], [104, 105]]


def test_evaluate_reads_exactly_max_samples_and_restores_train_mode(task):
    exp = Experiment(task, batch=4, micro_batch=4, lr=1e-3)
    a = exp.evaluate(5, eval_batch=2)
    b = exp.evaluate(5, eval_batch=64)  # the batch size of the evaluation does not change the answer
    assert a == pytest.approx(b, rel=1e-6) and exp.model.training
    assert exp.evaluate(6) != pytest.approx(a, rel=1e-9)


def _reference_val_loss(task, model, n):
    """The plain definition: each of the first ``n`` held-out documents alone, unpadded, its summed cross-entropy
    in float64; divided once by the number of labels."""
    total, count = 0.0, 0
    model.eval()
    with torch.inference_mode():
        for i in val_order(task.num_val_samples)[:n].tolist():
            o, n_bytes = int(task.val_offsets[i]), int(task.val_lengths[i])
            doc = torch.from_numpy(task.corpus_u8[o:o + n_bytes].astype(np.int64))
            logits = model(doc[None, :-1])[0]
            total += float(F.cross_entropy(logits.double(), doc[1:], reduction="sum"))
            count += n_bytes - 1
    model.train()
    return total / count


def test_evaluate_equals_documents_one_by_one_on_ragged_padded_batches(monkeypatch):
    task = load_task("tinygpt", **{**TINY, "seq_len": 64})  # 1 in 5 documents is shorter than a window
    exp, _ = _train(task, "fp32", steps=30)  # trained: documents' losses differ, so a mean of means is wrong
    n = 99
    assert task.num_val_samples > n
    ref = _reference_val_loss(task, exp.model, n)
    lengths = task.val_lengths[val_order(task.num_val_samples)[:n]]
    assert (lengths < task.seq_len + 1).mean() > 0.1  # ragged: the batches carry padding
    # A CPU's forwards take at most EVAL_CPU_TOKENS token slots (64 documents of this task): eval_batch 16 as it is,
    # 256 cut to 64; with a budget of 192 token slots, forwards of 3 documents.
    assert [eval_micro_batch(task, b, "cpu") for b in (16, 256)] == [16, EVAL_CPU_TOKENS // 64] == [16, 64]
    values = [exp.evaluate(n, eval_batch=b) for b in (16, 256)]
    monkeypatch.setattr(loop, "EVAL_CPU_TOKENS", 192)
    assert eval_micro_batch(task, 256, "cpu") == 3
    values.append(exp.evaluate(n, eval_batch=256))
    # float32 forwards, float64 sums: equal to the reference to float32 rounding
    assert values == pytest.approx([ref] * len(values), rel=1e-6, abs=0)
    # the naive mean of those forwards' means is wrong by far more than the tolerance (4e-4 of the loss)
    exp.model.eval()
    with torch.inference_mode():
        means = [float(loss / count) for loss, count in (task.loss_sum(exp.model, b)
                                                         for b in itertools.islice(task.val_batches(3), n // 3))]
    exp.model.train()
    assert abs(sum(means) / len(means) - ref) > 1e-4 * ref
    assert exp.evaluate(n) == exp.evaluate(n)  # the kept batches: the same value at every evaluation


def test_eval_micro_batch_cuts_only_token_tasks_on_a_cpu(task):
    sample_task = SimpleNamespace(unit="sample", seq_len=None)
    assert eval_micro_batch(task, 256, torch.device("cpu")) == EVAL_CPU_TOKENS // task.seq_len
    assert eval_micro_batch(task, 256, None) == EVAL_CPU_TOKENS // task.seq_len  # None: the batches stay on the CPU
    assert eval_micro_batch(task, 256, "cuda:0") == 256
    assert eval_micro_batch(sample_task, 256, "cpu") == 256
    assert eval_micro_batch(SimpleNamespace(unit="token", seq_len=10 * EVAL_CPU_TOKENS), 8, "cpu") == 1


def test_default_micro_batch():
    assert default_micro_batch(8) == 8 and default_micro_batch(48) == 16 and default_micro_batch(24, 16) == 8
    assert default_micro_batch(8, at_least_two=True) == 4 and default_micro_batch(1, at_least_two=True) == 1


@pytest.mark.parametrize("text, why", [("cuda", "CUDA is not available"), ("cuda:99", "CUDA is not available"),
                                       ("tpu", "allowed: cpu, cuda, cuda:N or mps"), ("", "allowed: cpu"),
                                       ("cpu:3", "one CPU device"), ("mps", "MPS is not available")])
def test_missing_or_malformed_devices_are_setting_errors(monkeypatch, text, why):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=why) as info:
        resolve_device(text, field="--device")
    assert info.value.field == "--device"


def test_precision_choices():
    assert resolve_device("CPU") == torch.device("cpu")
    check_device("cpu", "bf16")
    with pytest.raises(ValueError, match="precision 'fp8' is not allowed; allowed: fp32, bf16, fp16"):
        Precision("fp8")
    assert Precision("bf16").grad_scaler("cpu") is None and Precision("fp16").grad_scaler("cpu") is not None


def _cli(capsys, *argv):
    from globalbatch.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    cap = capsys.readouterr()
    return exit_info.value.code, cap.out, cap.err


TINY_ARGS = [a for k, v in TINY.items() for a in ("--task-arg", f"{k}={v}")]


def test_cli_sweep_in_bf16_on_cpu_records_device_and_precision(tmp_path, capsys):
    out = tmp_path / "sweep"
    code, stdout, err = _cli(capsys, "sweep", "--out", str(out), "--batches", "2,4", "--lrs", "3e-3", "--tokens", "1200",
                             "--workers", "1", "--threads", "1", "--device", "cpu", "--precision", "bf16", "--lr-rule",
                             "none", *TINY_ARGS)
    assert code in (0, None), err
    grid = json.loads((out / "manifest.json").read_text())["grid"]
    assert (grid["device"], grid["precision"]) == ("cpu", "bf16")
    summary = json.loads((out / "trials" / "b4_lr0.003_s0" / "summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["device"] == "cpu" and summary["completed"]
    # resuming with another precision is refused, naming the difference
    code, _, err = _cli(capsys, "sweep", "--out", str(out), "--batches", "2,4", "--lrs", "3e-3", "--tokens", "1200",
                        "--workers", "1", "--threads", "1", "--precision", "fp32", "--lr-rule", "none", *TINY_ARGS)
    assert code == 2 and "precision: 'bf16' -> 'fp32'" in err and err.count("\n") == 1


@pytest.mark.parametrize("command", [["sweep", "--batches", "2", "--lrs", "1e-3", "--tokens", "100"],
                                     ["branch", "--warmup-tokens", "1K", "--window-tokens", "1K"],
                                     ["noise", "--steps", "1"], ["probe"], ["demo"]])
@pytest.mark.parametrize("flag, value, shown", [("--device", "cuda", "--device 'cuda' is not allowed (CUDA is not available"),
                                                ("--precision", "fp8", "--precision 'fp8' is not allowed; allowed: fp32, bf16, fp16")])
def test_cli_missing_device_or_bad_precision_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, command,
                                                                            flag, value, shown):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    out = ["--out", str(tmp_path / "o")] if command[0] != "probe" else []
    code, stdout, err = _cli(capsys, *command, *out, *TINY_ARGS if command[0] != "demo" else [], flag, value)
    assert code == 2 and stdout == "", (stdout, err)
    assert err.startswith("error: " + shown) and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []
