"""The causal-LM summed loss and its count of targets after the shift (globalbatch.losses)."""

from __future__ import annotations

import math

import pytest

from globalbatch.errors import SettingError
import torch

from globalbatch.losses import IGNORE_INDEX, causal_lm_loss_sum, causal_lm_targets, count_causal_lm_targets


def _ragged(seed: int = 0, rows: int = 5, width: int = 9, vocab: int = 11):
    g = torch.Generator().manual_seed(seed)
    lengths = [9, 2, 5, 1, 7][:rows]
    labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
    for r, n in enumerate(lengths):
        labels[r, :n] = torch.randint(0, vocab, (n,), generator=g)
    labels[0, :3] = IGNORE_INDEX  # a masked prompt inside a row
    logits = torch.randn(rows, width, vocab, generator=g, dtype=torch.float64)
    return logits, labels, lengths


def test_sum_and_count_equal_a_brute_force_loop_over_positions():
    logits, labels, _ = _ragged()
    total, n = 0.0, 0
    for r in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):  # logit t predicts label t + 1
            y = int(labels[r, t + 1])
            if y != IGNORE_INDEX:
                total += float(-torch.log_softmax(logits[r, t], -1)[y])
                n += 1
    loss_sum, count = causal_lm_loss_sum(logits, labels)
    assert count.dtype == torch.int64 and int(count) == n == int(count_causal_lm_targets(labels))
    assert math.isclose(float(loss_sum), total, rel_tol=1e-12)
    assert loss_sum.dtype == torch.float64  # float64 logits are not downcast


def test_count_after_the_shift_is_one_per_row_less_than_the_unshifted_count():
    _, labels, lengths = _ragged()
    unshifted = int((labels != IGNORE_INDEX).sum())
    shifted = int(count_causal_lm_targets(labels))
    # rows whose first label is a target lose exactly that one; row 0's first label is masked already
    assert unshifted - shifted == sum(1 for r, n in enumerate(lengths) if n >= 1 and labels[r, 0] != IGNORE_INDEX)
    assert int(count_causal_lm_targets(labels, shift=False)) == unshifted
    assert torch.equal(causal_lm_targets(labels, shift=False), labels)
    assert (causal_lm_targets(labels)[:, -1] == IGNORE_INDEX).all()


def test_matches_the_hugging_face_causal_lm_loss_times_the_shifted_count():
    pytest.importorskip("transformers")
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits, labels, _ = _ragged(seed=3)
    loss_sum, count = causal_lm_loss_sum(logits, labels)
    hf_mean = ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])  # HF upcasts to float32 only
    assert float(hf_mean) * int(count) == pytest.approx(float(loss_sum), rel=1e-6)
    # HF's loss with num_items_in_batch = the unshifted count is the sum over the wrong denominator
    wrong = ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1],
                            num_items_in_batch=(labels != IGNORE_INDEX).sum())
    assert float(wrong) < float(loss_sum / count) * (1 - 1e-3)


def test_half_precision_logits_are_upcast_and_no_shift_mode():
    logits, labels, _ = _ragged(seed=1)
    s16, c16 = causal_lm_loss_sum(logits.to(torch.bfloat16), labels)
    assert s16.dtype == torch.float32
    s64, c64 = causal_lm_loss_sum(logits, labels)
    assert int(c16) == int(c64) and float(s16) == pytest.approx(float(s64), rel=2e-2)
    aligned = causal_lm_targets(labels)
    s, c = causal_lm_loss_sum(logits, aligned, shift=False)
    assert float(s) == float(s64) and int(c) == int(c64)


def test_ignore_index_is_honoured_and_bad_shapes_are_one_line_errors():
    logits, labels, _ = _ragged(seed=2)
    other = labels.masked_fill(labels == IGNORE_INDEX, -1)
    a = causal_lm_loss_sum(logits, labels)
    b = causal_lm_loss_sum(logits, other, ignore_index=-1)
    assert float(a[0]) == float(b[0]) and int(a[1]) == int(b[1])
    with pytest.raises(SettingError, match=r"^logits shape \(5, 9, 11\) is not allowed \(with labels shape \(5, 8\)\)"):
        causal_lm_loss_sum(logits, labels[:, :8])
