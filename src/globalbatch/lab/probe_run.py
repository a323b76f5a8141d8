"""``globalbatch probe`` on a lab task: the probe search (:func:`globalbatch.probe.probe`) on a task's model,
built on the requested device and precision, with the optimizer registry's AdamW."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import nn

from globalbatch.errors import SettingError
from globalbatch.lab.throughput import task_peak
from globalbatch.probe.runner import probe
from globalbatch.probe.search import DEFAULT_MAX_MICRO_BATCH, ProbeResult, check_probe_settings

__all__ = ["probe_task"]




def probe_task(
    task: Any,
    *,
    global_batch: Optional[int] = None,
    dp_world_size: int = 1,
    memory_limit_bytes: Optional[int] = None,
    max_micro_batch: Optional[int] = None,
    steps_per_trial: int = 3,
    tolerance: float = 0.05,
    device: Optional[str] = None,
    precision: str = "fp32",
    seed: int = 0,
    task_overrides: Optional[dict[str, Any]] = None,
) -> ProbeResult:
    """:func:`probe` on a :mod:`globalbatch.lab.tasks` task (a name such as ``"tinygpt"`` or a Task).

    Batches are the first samples of ``task.sample_order(seed)`` (cycled when the
    micro-batch is larger than the data set); the loss is ``loss_sum / count``; tokens per
    step are ``task.tokens_in(batch)`` (padding included) for a token task and not counted for a
    sample task (throughput is then samples/s). ``task_overrides`` are the task's keyword
    overrides (``globalbatch probe --task-arg``), e.g. ``{"d_model": 64}``; only with a task name.
    ``device`` and ``precision`` as in every lab command (the forward pass under the
    precision's autocast). Every setting is checked before the model is built.
    """
    from itertools import islice

    from globalbatch.lab.device import Precision, resolve_device
    from globalbatch.lab.tasks import load_task

    check_probe_settings(global_batch=global_batch, dp_world_size=dp_world_size, max_micro_batch=max_micro_batch,
                         steps_per_trial=steps_per_trial, tolerance=tolerance, memory_limit_bytes=memory_limit_bytes)
    if isinstance(task, str):
        task = load_task(task, **(task_overrides or {}))
    elif task_overrides:
        raise SettingError("task_overrides", task_overrides, "overrides with a task name (a Task object is used "
                                                             "as it is)")
    torch_device = resolve_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    autocast = Precision(precision).autocast
    model = task.build_model(seed).to(torch_device)
    cap = max_micro_batch or (global_batch // dp_world_size if global_batch else DEFAULT_MAX_MICRO_BATCH)
    pool = list(islice(task.sample_order(seed), min(int(cap), task.num_train_samples)))

    def make_batch(micro_batch: int) -> Any:
        indices = [pool[i % len(pool)] for i in range(micro_batch)]
        return task.collate(indices, torch_device)

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        with autocast(torch_device):
            loss_sum, count = task.loss_sum(m, batch)
        return loss_sum.float() / count.clamp(min=1)

    unit = getattr(task, "unit", None)
    count_tokens = (lambda batch: None) if unit == "sample" else task.tokens_in
    predicted, predicted_note = None, ""
    if memory_limit_bytes is not None:  # predict before running: the memory model, fwd+bwd at 8 and 16
        from globalbatch.plan.memory import MemoryConfig, largest_micro_batch
        from globalbatch.probe.activations import measure_activations
        from globalbatch.probe.memory import trainable_params

        acts = measure_activations(model, make_batch, loss_fn)
        n = trainable_params(model)
        predicted = min(largest_micro_batch(MemoryConfig(params=n, optimizer="adamw", precision="fp32"), acts,
                                            memory_limit_bytes), cap)
        predicted_note = (f"memory model: {n:,} params × 16 B (fp32 weights, AdamW) + activations "
                          f"{acts.bytes_per_sample / 2**20:,.3f} MiB/sample ({acts.source})")
    result = probe(model, make_batch, loss_fn, global_batch=global_batch, dp_world_size=dp_world_size,
                   memory_limit_bytes=memory_limit_bytes, max_micro_batch=max_micro_batch,
                   steps_per_trial=steps_per_trial, tolerance=tolerance, count_tokens=count_tokens,
                   count_step=_task_step_counter(task, model, unit))
    peak = task_peak(torch_device, precision)
    return dataclasses.replace(result, unit=unit, predicted_micro_batch=predicted, predicted_note=predicted_note,
                               peak_flops_per_s=None if peak is None else peak.flops_per_s,
                               peak_flops_source="" if peak is None else peak.source)


def _task_step_counter(task: Any, model: nn.Module,
                       unit: Optional[str]) -> Callable[[Any], tuple[Optional[float], Optional[int]]]:
    """``batch -> (FLOPs, valid tokens)`` in one counted forward + backward; valid tokens are the loss count."""
    from globalbatch.flops import count_flops

    def count(batch: Any) -> tuple[Optional[float], Optional[int]]:
        seen: list[int] = []

        def loss(m: nn.Module, b: Any) -> torch.Tensor:
            loss_sum, n = task.loss_sum(m, b)
            seen.append(int(n))  # host read: once per trial, outside the timed steps
            return loss_sum

        flops = float(count_flops(model, batch, loss))
        return flops, (seen[-1] if seen and unit != "sample" else None)

    return count



