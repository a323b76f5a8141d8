"""Lightning mixed precision: the mixin under ``bf16-mixed`` and ``16-mixed`` against Lightning's own full-batch step.

CPU autocast supports both bfloat16 and float16 here (torch 2.13). Lightning 2.6 turns
``precision="16-mixed"`` on CPU into ``bf16-mixed`` with a warning ("AMP with fp16 is not supported on
CPU"), so the 16-mixed case passes Lightning's own ``MixedPrecision("16-mixed", "cpu")`` plugin (float16
autocast and ``torch.amp.GradScaler("cpu")``, what a GPU run gets from ``precision="16-mixed"``). Tiny GPT-2 (float32 weights), 10 ragged stdlib documents,
micro 2 × accumulation 4 (windows of 8 and 2), SGD lr 1. The reference is Lightning's own step on each
whole window as one batch (automatic optimization, the token-mean loss, the same precision plugin and
its GradScaler). The mixin's micro-batches see other padding widths than the whole window, so
half-precision matmuls round differently: the tolerance is a relative one, on the parameter update
(max-element relative), stated per precision below. ``accumulate_grad_batches=4`` is measured beside
it (the mean of micro-batch means and the short window divided by 4).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("lightning", reason="install the [lightning] extra")
pytest.importorskip("transformers", reason="the test model is a transformers GPT-2")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from integ_common import collate, max_rel_diff, stdlib_documents, tiny_gpt2  # noqa: E402

from globalbatch.integrations.lightning import ExactAccumulationMixin, GlobalBatchCallback  # noqa: E402
from globalbatch.losses import causal_lm_loss_sum  # noqa: E402

MICRO, ACCUM, DOCS = 2, 4, 10
TOLERANCE = {"bf16-mixed": 3e-2, "16-mixed": 3e-3}  # relative, on the update; measured: see the test's print


class TokenMeanLM(pl.LightningModule):
    """Lightning's own step: the token-mean loss of the batch it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_gpt2(dtype=torch.float32)

    def loss_sum(self, batch):
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return causal_lm_loss_sum(out.logits, batch["labels"])

    def training_step(self, batch, batch_idx):
        loss_sum, count = self.loss_sum(batch)
        return loss_sum / count

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


class ExactLM(ExactAccumulationMixin, TokenMeanLM):
    def __init__(self) -> None:
        super().__init__()
        self.configure_global_batch(micro_batch=MICRO, grad_accum_steps=ACCUM)

    def loss_sum(self, batch):  # the mixin comes first in the MRO: name the user's loss here
        return TokenMeanLM.loss_sum(self, batch)


def _fit(module, batch_size, precision, **kw):
    loader = torch.utils.data.DataLoader(stdlib_documents(DOCS), batch_size=batch_size, shuffle=False,
                                         collate_fn=collate)
    if precision == "16-mixed":
        # Lightning turns precision="16-mixed" on CPU into bf16-mixed ("AMP with fp16 is not supported on
        # CPU"); torch's CPU autocast does support float16, so the plugin is given explicitly (what a GPU
        # run gets from precision="16-mixed": autocast to float16 and a GradScaler).
        from lightning.pytorch.plugins.precision import MixedPrecision

        kw["plugins"] = [MixedPrecision(precision="16-mixed", device="cpu")]
    else:
        kw["precision"] = precision
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw)
    trainer.fit(module, loader)
    return trainer


@pytest.mark.slow  # ~6 s: three fits per precision
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixin_under_mixed_precision_matches_lightnings_full_batch_step(precision):
    start = [p.detach().clone() for p in tiny_gpt2(dtype=torch.float32).parameters()]
    deltas = {}
    for name, module, batch, kw in (("full batch (Lightning)", TokenMeanLM(), MICRO * ACCUM, {}),
                                    ("accumulate_grad_batches", TokenMeanLM(), MICRO, {"accumulate_grad_batches": ACCUM}),
                                    ("ours", ExactLM(), MICRO, {"callbacks": [GlobalBatchCallback()]})):
        trainer = _fit(module, batch, precision, **kw)
        assert trainer.global_step == 2, (name, trainer.global_step)
        deltas[name] = [p.detach() - s for p, s in zip(module.model.parameters(), start)]
        if name == "ours":
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            assert (scaler is not None) == (precision == "16-mixed")
            if scaler is not None:  # the driver scaled, unscaled and updated through the plugin's own scaler,
                # from 65536 / (first micro-batch's targets × accumulation, up to a power of two); none skipped
                assert module.gb_driver.scaler is scaler and module.gb_driver.skipped_windows == 0
                first = int((collate(stdlib_documents(DOCS)[:MICRO])["labels"][:, 1:] != -100).sum())
                assert scaler.get_scale() == 65536.0 / 2 ** math.ceil(math.log2(first * ACCUM)), scaler.get_scale()
            est = next(c for c in trainer.callbacks if isinstance(c, GlobalBatchCallback)).monitor.estimate()
            assert est.windows == 1 and est.skipped_windows == 0  # the short window has one micro-batch
            b_simple = est.b_simple
    ref = deltas["full batch (Lightning)"]
    err = {k: max_rel_diff(v, ref) for k, v in deltas.items() if k != "full batch (Lightning)"}
    print(f"{precision}: update vs Lightning's full-batch step (max-element relative): "
          f"accumulate_grad_batches {err['accumulate_grad_batches']:.2e}, ours {err['ours']:.2e}; "
          f"B_simple {b_simple:.4g} tokens (loss scale divided out)")
    assert err["ours"] < TOLERANCE[precision], err
    assert err["accumulate_grad_batches"] > 10 * TOLERANCE[precision], err
    assert b_simple > 0


def test_32_bit_baseline_is_exact_to_float32_rounding():
    """The same comparison in 32-true: what is left in the mixed-precision tolerance is half-precision rounding."""
    start = [p.detach().clone() for p in tiny_gpt2(dtype=torch.float32).parameters()]
    ref, ours = TokenMeanLM(), ExactLM()
    _fit(ref, MICRO * ACCUM, "32-true")
    _fit(ours, MICRO, "32-true")
    err = max_rel_diff([p.detach() - s for p, s in zip(ours.model.parameters(), start)],
                       [p.detach() - s for p, s in zip(ref.model.parameters(), start)])
    print(f"32-true: ours vs Lightning's full-batch step {err:.2e}")
    assert err < 1e-5, err
