"""examples/hf_trainer.py and examples/lightning_module.py run end to end (CPU, nothing downloaded).

Run in this process (the frameworks are imported once for the whole test session); `main(argv)` is
what `python examples/<script>.py` runs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="install the [hf] extra")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # lightning_module.py imports the data and model of hf_trainer.py
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _errors(out: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"max-element relative\): (.+?): (\S+)", out)}


def test_hf_trainer_example(capsys):
    assert _example("hf_trainer").main(["--steps", "3"]) == 0
    out = capsys.readouterr().out
    err = _errors(out)
    assert err["GlobalBatchTrainer"] < 1e-10 and err["Trainer (default)"] > 1e-3, out
    assert "global batch 16 sequences = micro_batch 4 × grad_accum_steps 4 × dp_world_size 1 (pinned)" in out
    logs = [line for line in out.splitlines() if line.startswith("log: ")]
    assert len(logs) == 3 and all("noise/b_simple_tokens=" in line for line in logs), out


def test_lightning_example(capsys):
    pytest.importorskip("lightning", reason="install the [lightning] extra")
    assert _example("lightning_module").main(["--steps", "3"]) == 0
    out = capsys.readouterr().out
    err = _errors(out)
    assert err["ExactAccumulationMixin"] < 1e-10 and err["accumulate_grad_batches (default)"] > 1e-3, out
    assert "trained 3 optimizer steps of 16 sequences" in out
    logs = [line for line in out.splitlines() if line.startswith("log: ")]
    assert len(logs) == 3 and all("noise/b_simple_tokens=" in line for line in logs), out


@pytest.mark.slow  # ~8 s: two tiny models, one float64 step each with both Trainers, then 3 AdamW steps
def test_hf_loss_heads_example(capsys):
    assert _example("hf_loss_heads").main(["--steps", "3"]) == 0
    out = capsys.readouterr().out
    for task in ("classification", "seq2seq"):
        err = {m.group(1): float(m.group(2)) for m in re.finditer(
            rf"{task}: one step vs one big batch \(float64, max-element relative\): (.+?): (\S+)", out)}
        # the stock Trainer sums the micro-batch means (these models accept loss kwargs but ignore them)
        assert err["GlobalBatchTrainer"] < 1e-10 and err["Trainer (default)"] > 1e-3, out
        assert len([line for line in out.splitlines() if line.startswith(f"{task} log: ")]) == 3, out


def test_examples_refuse_bad_flags_with_exit_code_2(capsys):
    for name in ("hf_trainer", "lightning_module", "hf_loss_heads"):
        with pytest.raises(SystemExit) as exc:
            _example(name).main(["--global-batch", "10"])
        assert exc.value.code == 2
        assert "--global-batch 10 is not allowed; allowed: a multiple of --micro-batch 4" in capsys.readouterr().err
