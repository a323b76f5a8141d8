"""The real trial: a few training steps of the user's model (:class:`TrainStepRunner`) and
:func:`probe` (the search on them, model restored afterwards). The probe of a lab task
(``globalbatch probe``) is :func:`globalbatch.lab.probe_run.probe_task`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from globalbatch.errors import SettingError
from globalbatch.probe import memory  # memory.release_memory() looked up per call: tests patch it
from globalbatch.probe.memory import _CpuTensorPeak, _read_status_kib, _reset_peak_rss, _static_bytes
from globalbatch.probe.search import (
    DEFAULT_START_MICRO_BATCH,
    ProbeResult,
    probe_micro_batch,
)
from globalbatch.probe.trial import TrialResult, _over_budget
from globalbatch.validate import whole


@dataclass(kw_only=True, slots=True)
class TrialConfig:
    """How :class:`TrainStepRunner` runs and measures one trial."""

    steps_per_trial: int = 3
    """Timed training steps per trial (after the warm-up)."""
    warmup_steps: int = 2
    """Untimed steps first: the first allocates optimizer state, the second is the first steady step.
    On CPU memory is measured over them."""
    memory_limit_bytes: Optional[int] = None
    """Stop a trial after the warm-up when its peak is above this (saves the timed steps)."""
    cpu_memory: str = "tensors"
    """CPU peak memory: ``"tensors"`` (profiler allocation events) or ``"rss"`` (process peak RSS)."""

    def __post_init__(self) -> None:
        whole(self.steps_per_trial, "steps_per_trial")
        whole(self.warmup_steps, "warmup_steps", allowed="a whole number ≥ 1 (the first step allocates optimizer state)")
        if self.cpu_memory not in ("tensors", "rss"):
            raise SettingError("cpu_memory", self.cpu_memory, "'tensors' or 'rss'")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes < 1:
            raise SettingError("memory_limit_bytes", self.memory_limit_bytes, "None or ≥ 1")



def _default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    from globalbatch.optim import build_optimizer  # the registry's AdamW: the same state as a sweep's

    return build_optimizer("adamw", params, lr=1e-3)


def _default_count_tokens(batch: Any) -> Optional[int]:
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        return int(batch["input_ids"].numel())
    return None


class TrainStepRunner:
    """``run_trial`` for :func:`probe_micro_batch`: real training steps on the user's model.

    Each call builds one batch with ``make_batch(micro_batch)``, a fresh optimizer with
    ``optimizer_factory(model.parameters())``, runs ``warmup_steps`` untimed and
    ``steps_per_trial`` timed steps of ``loss_fn(model, batch).backward(); opt.step();
    opt.zero_grad(set_to_none=True)``, and frees everything it made (gradients set to
    None, optimizer state dropped). The steps change the weights: :func:`probe` restores
    them afterwards. Out of memory inside the trial is returned as ``oom=True``.
    """

    def __init__(self, model: nn.Module, make_batch: Callable[[int], Any],
                 loss_fn: Callable[[nn.Module, Any], torch.Tensor], *,
                 optimizer_factory: Optional[Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = None,
                 count_tokens: Optional[Callable[[Any], Optional[int]]] = None,
                 config: Optional[TrialConfig] = None,
                 count_step: Optional[Callable[[Any], tuple[Optional[float], Optional[int]]]] = None) -> None:
        self.model = model
        self.make_batch = make_batch
        self.loss_fn = loss_fn
        self.optimizer_factory = optimizer_factory or _default_optimizer
        self.count_tokens = count_tokens or _default_count_tokens
        self.config = config or TrialConfig()
        self.count_step = count_step  # batch -> (model FLOPs, valid tokens): run after the timed steps
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")

    def __call__(self, micro_batch: int) -> TrialResult:
        return memory.run_or_oom(self._trial, micro_batch, cleanup=lambda: self.model.zero_grad(set_to_none=True))

    def _step(self, batch: Any, optimizer: torch.optim.Optimizer, mark: Callable[[], Any] = lambda: None) -> Any:
        """One training step; ``mark()`` is called between the backward and the optimizer step (what it returns
        is returned: the timed steps split the step there)."""
        loss = self.loss_fn(self.model, batch)
        loss.backward()
        middle = mark()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return middle

    def _trial(self, micro_batch: int) -> TrialResult:
        cfg = self.config
        cuda = self.device.type == "cuda"
        self.model.zero_grad(set_to_none=True)
        self.model.train()
        capacity = None
        if cuda:
            torch.cuda.synchronize(self.device)  # host sync: trial boundary, outside the timed steps
            gc.collect()
            torch.cuda.empty_cache()
            free_bytes, _total = torch.cuda.mem_get_info(self.device)
            capacity = int(free_bytes + torch.cuda.memory_reserved(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        optimizer = self.optimizer_factory(self.model.parameters())
        try:
            # -- warm-up (untimed): memory is measured here on CPU ---------------------
            if cuda:
                batch = self.make_batch(micro_batch)
                for _ in range(cfg.warmup_steps):
                    self._step(batch, optimizer)
                torch.cuda.synchronize(self.device)  # host sync: read the peak after the warm-up
                peak = int(torch.cuda.max_memory_allocated(self.device))
            elif cfg.cpu_memory == "rss":
                _reset_peak_rss()
                batch = self.make_batch(micro_batch)
                for _ in range(cfg.warmup_steps):
                    self._step(batch, optimizer)
                peak = _read_status_kib("VmHWM") * 1024
            else:
                static = _static_bytes(self.model)
                with _CpuTensorPeak() as window:
                    batch = self.make_batch(micro_batch)
                    for _ in range(cfg.warmup_steps):
                        self._step(batch, optimizer)
                peak = static + window.peak_bytes()
            tokens = self.count_tokens(batch)
            if cfg.memory_limit_bytes is not None and peak > cfg.memory_limit_bytes:
                return TrialResult(micro_batch=micro_batch, oom=True, peak_memory_bytes=peak,
                                   tokens_per_step=tokens, capacity_bytes=capacity,
                                   note=_over_budget(peak, cfg.memory_limit_bytes))
            # -- timed steps: the median step, robust to a stall of a shared CPU ----------
            # Each step is also split after its backward (an event on CUDA: no extra host sync), so the forward +
            # backward time is measured in place, with the caches as a real step leaves them.
            step_times_s, fb_times_s = [], []
            if cuda:
                ends = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.steps_per_trial + 1)]
                middles = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.steps_per_trial)]
                ends[0].record()
                for i in range(cfg.steps_per_trial):
                    self._step(batch, optimizer, middles[i].record)
                    ends[i + 1].record()
                torch.cuda.synchronize(self.device)  # host sync: once, after the timed steps
                step_times_s = [ends[i].elapsed_time(ends[i + 1]) / 1e3 for i in range(cfg.steps_per_trial)]
                fb_times_s = [ends[i].elapsed_time(middles[i]) / 1e3 for i in range(cfg.steps_per_trial)]
                peak = max(peak, int(torch.cuda.max_memory_allocated(self.device)))
            else:
                for _ in range(cfg.steps_per_trial):
                    start = time.perf_counter()
                    middle = self._step(batch, optimizer, time.perf_counter)
                    step_times_s.append(time.perf_counter() - start)
                    fb_times_s.append(middle - start)
            flops, valid = (None, None)
            if self.count_step is not None:  # after the peak and the timing: it runs one more forward + backward
                flops, valid = self.count_step(batch)
            return TrialResult(micro_batch=micro_batch, peak_memory_bytes=peak,
                               step_time_s=float(np.median(step_times_s)),
                               forward_backward_s=float(np.median(fb_times_s)), tokens_per_step=tokens,
                               capacity_bytes=capacity, model_flops_per_step=flops, valid_tokens_per_step=valid)
        finally:
            optimizer.state.clear()
            del optimizer


@contextlib.contextmanager
def _restored(model: nn.Module) -> Iterator[None]:
    """Put back the weights, buffers and RNG state that the trial steps change."""
    snapshot = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    was_training = model.training
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            model.load_state_dict(snapshot)
            model.train(was_training)
            model.zero_grad(set_to_none=True)
            del snapshot
            memory.release_memory()


def probe_model(
    model: nn.Module,
    make_batch: Callable[[int], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    global_batch: Optional[int] = None,
    dp_world_size: int = 1,
    memory_limit_bytes: Optional[int] = None,
    max_micro_batch: Optional[int] = None,
    start_micro_batch: int = DEFAULT_START_MICRO_BATCH,
    steps_per_trial: int = 3,
    warmup_steps: int = 2,
    tolerance: float = 0.05,
    optimizer_factory: Optional[Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = None,
    count_tokens: Optional[Callable[[Any], Optional[int]]] = None,
    cpu_memory: str = "tensors",
    use_memory_model: bool = True,
    count_step: Optional[Callable[[Any], tuple[Optional[float], Optional[int]]]] = None,
) -> ProbeResult:
    """Probe ``model`` on its current device; leave its weights, RNG and memory as they were.

    Args:
        model: the model to train (on the device to probe). Under torchrun pass the plain
            module, not the DDP wrapper: a rank that runs out of memory mid-backward would
            leave the others waiting in DDP's gradient all-reduce.
        make_batch: ``make_batch(micro_batch) -> batch`` on the model's device.
        loss_fn: ``loss_fn(model, batch) -> scalar loss`` to call ``backward()`` on.
        global_batch: samples per optimizer step over all ranks, to report the accumulation.
        dp_world_size: data-parallel ranks.
        memory_limit_bytes: budget; a larger measured peak counts as out of memory.
        max_micro_batch: the largest size tried (default global ÷ dp, else 8192).
        start_micro_batch: the first size tried (default 2; if it fails, 1 runs next).
        steps_per_trial: timed steps per trial; warmup_steps: untimed steps before them.
        tolerance: "fastest" = smallest size within this fraction of the best throughput.
        optimizer_factory: ``params -> optimizer``; default AdamW (its state is part of the peak).
        count_tokens: ``batch -> tokens``; default ``batch["input_ids"].numel()`` when present.
        cpu_memory: ``"tensors"`` or ``"rss"`` (see :mod:`globalbatch.probe`).
        use_memory_model: cut the search with the fitted memory line.
        count_step: ``batch -> (model FLOPs of one forward + backward, valid tokens)``, run once per
            fitting trial after its timed steps (for MFU and valid tokens/s); None: not counted.
    """
    runner = TrainStepRunner(
        model, make_batch, loss_fn, optimizer_factory=optimizer_factory, count_tokens=count_tokens, count_step=count_step,
        config=TrialConfig(steps_per_trial=steps_per_trial, warmup_steps=warmup_steps,
                           memory_limit_bytes=memory_limit_bytes, cpu_memory=cpu_memory))
    with _restored(model):
        result = probe_micro_batch(
            runner, max_micro_batch=max_micro_batch, start_micro_batch=start_micro_batch,
            memory_limit_bytes=memory_limit_bytes, tolerance=tolerance,
            use_memory_model=use_memory_model, global_batch=global_batch, dp_world_size=dp_world_size)
    return dataclasses.replace(result, params=memory.trainable_params(model))


probe = probe_model
"""The old name of :func:`probe_model` (``globalbatch.probe.probe``)."""
