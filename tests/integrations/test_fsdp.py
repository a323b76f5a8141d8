"""GlobalBatchTrainer under FSDP2 (Accelerate's FSDP plugin through TrainingArguments) on 2 gloo ranks.

Accelerate 1.15 drops the FSDP plugin on CPU without a word (``AcceleratorState`` turns FSDP on only for
GPU-like distributed types; a ``use_cpu=True`` run stays MULTI_CPU and the Trainer wraps the model in DDP):
tests/dist/integrations_fsdp.py lifts that one gate and runs the Trainer's own FSDP2 path (``fully_shard``
per block, sharded DTensor parameters, the reduce-scatter). The same script runs unpatched on a GPU machine
from benchmarks/gpu_check.py. That 2-rank run is in tests/integrations/test_two_ranks.py (one launch with the other
integration checks); here: what is refused at construction.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="install the [hf] extra")
pytest.importorskip("accelerate", reason="install the [hf] extra")

from globalbatch.errors import SettingError  # noqa: E402


@pytest.mark.parametrize("dt, fsdp_version, match", [
    ("DEEPSPEED", None, "engine.backward divides each loss by its gradient_accumulation_steps"),
    ("FSDP", 1, "fsdp_version 1 is not allowed; allowed: 2"),
])
def test_deepspeed_and_fsdp1_are_refused_naming_why(monkeypatch, dt, fsdp_version, match):
    """The refusals at construction (the Trainer's own __init__ replaced: deepspeed is not installed here)."""
    from types import SimpleNamespace

    import transformers

    from globalbatch.integrations.hf import GlobalBatchTrainer

    def fake_init(self, *args, **kwargs):
        self.accelerator = SimpleNamespace(distributed_type=dt,
                                           state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=fsdp_version)))
        self.args = SimpleNamespace(n_gpu=1)

    monkeypatch.setattr(transformers.Trainer, "__init__", fake_init)
    with pytest.raises(SettingError, match=match):
        GlobalBatchTrainer(model=None)
