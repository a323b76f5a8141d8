"""The exact global-batch optimizer step: a driver that plugs into the user's own loop.

The user keeps the loop and the data loader. For each micro-batch they compute the
**summed** loss and its count of loss-bearing units (the tokens that are *targets* of the
loss, or samples) and hand both to the driver; after the last micro-batch of the window they call
:meth:`StepDriver.step`. The result is the optimizer step of the token-mean loss
over the whole global batch, whatever the padding, the micro-batch sizes, the
number of DP ranks or a short last window::

    driver = StepDriver(ddp_model, opt, StepConfig(micro_batch=2, global_batch=16, max_grad_norm=1.0))
    for window in rank_windows(documents, driver, collate=collate):   # this rank's micro-batches
        result = driver.run_window(window, causal_lm_loss)            # (globalbatch.windows, .losses)

    # run_window, written out:
    for i, micro in enumerate(window):
        with driver.micro_step(last=i == len(window) - 1):   # DDP no_sync around fwd AND bwd
            loss_sum, count = loss_fn(ddp_model, micro)
            driver.backward(loss_sum, count, samples=window.samples[i])
    result = driver.step()                           # sync, normalize, clip, skip or step

Per window the driver

1. runs micro-steps 0..M−2 without gradient sync (DDP ``no_sync`` around forward
   *and* backward, FSDP2 ``set_requires_gradient_sync(False)``) and syncs on the last;
2. back-propagates the summed loss, so ``.grad`` accumulates Σ ∇loss_sum;
3. under DP, all-reduces once a float64 vector ``[count, loss sum, samples, flops]`` (a non-finite
   loss anywhere makes the global sum non-finite: it is the flag; a rank without a FLOPs count
   sends −inf) over the DP group (kept on the device), then multiplies the gradients by
   ``dp_world_size / global_count`` with one ``torch._foreach_mul_`` (DDP/FSDP2
   averaged over ranks, which the factor undoes) — the gradient of the global
   token-mean loss;
4. unscales (GradScaler), calls ``on_window_end`` callbacks, clips once; under DP a second,
   one-element all-reduce sums the flag "this rank's gradient norm is non-finite", so every
   rank skips or none does;
5. reads **one** small tensor to the host (``[count, loss, samples, flops, grad_norm]``):
   the skip decision needs it, exactly as ``GradScaler.step`` does. This is the only
   host sync per step; the reported numbers ride along with it;
6. refuses a window of more samples (all ranks) than the planned global batch with a
   ``SettingError`` before the optimizer step (a shorter window is fine);
7. on a non-finite loss or gradient on any rank (or an empty window), skips the step on
   every rank: parameters, optimizer state and LR schedule untouched, a counter
   increased, a warning naming the step; ``max_consecutive_skips`` in a row raise
   :class:`NonFiniteError`.

Modules: :mod:`~globalbatch.step.config` (``StepConfig``, ``StepResult``), :mod:`~globalbatch.step.inputs`
(what the driver reads from the loss and the batch), :mod:`~globalbatch.step.callbacks` (the hook list),
:mod:`~globalbatch.step.accumulate` (the driver's counters and the window's accumulation) and
:mod:`~globalbatch.step.driver` (``StepDriver``: the window's end, the sync, the skip and the step).

See ``docs/step.md`` for the state of ``.grad`` at each callback and the measured
overhead against a hand-written loop.
"""

from globalbatch.parallel import unwrap_model
from globalbatch.step.callbacks import CALLBACK_HOOKS
from globalbatch.step.config import NonFiniteError, StepConfig, StepResult, plan_for_world
from globalbatch.step.driver import StepCallback, StepDriver
from globalbatch.step.inputs import batch_samples, mean_reduction

__all__ = [
    "StepCallback",
    "CALLBACK_HOOKS",
    "StepConfig",
    "StepDriver",
    "StepResult",
    "NonFiniteError",
    "plan_for_world",
    "unwrap_model",
    "batch_samples",
    "mean_reduction",
]
