"""The one experiment loop: every lab command trains through :class:`Experiment`.

Sweep trials and the timing pass, the branch test, ``globalbatch noise`` and the
probe's task runner all build their model, optimizer and step driver here, so they
train the same way (one optimizer recipe per name, :mod:`globalbatch.optim`), on the
same device and precision, and read the same held-out loss:

1. the task's model is built with ``seed`` and moved to ``device``; wrapped in DDP when a
   process group of more than one rank is initialized (``ddp=True``);
2. the optimizer comes from the registry (``build_optimizer(name, model, lr=…)``);
3. every window goes through :class:`globalbatch.step.StepDriver` (token-normalised
   accumulation, clipping after accumulation, whole-window skip), the forward pass under
   the precision's autocast, fp16 through a ``GradScaler``;
4. :meth:`Experiment.train_window` draws the driver's current global batch from a sample
   order and cuts it with :func:`globalbatch.windows.cut_window`, the library's one cut: accumulation
   step ``a`` takes the next ``micro × dp`` samples, rank ``r`` its ``r``-th micro-batch of them — so
   one process and two ranks train on the same samples in the same windows;
5. :meth:`Experiment.evaluate` reads the held-out loss per unit under
   ``torch.inference_mode`` in eval mode, with a large evaluation batch.
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from globalbatch.lab.device import Precision, resolve_device
from globalbatch.lab.tasks import to_device
from globalbatch.optim import build_optimizer
from globalbatch.schedule import BatchSchedule, LRSchedule
from globalbatch.step import StepConfig, StepDriver, StepResult
from globalbatch.windows import cut_window

__all__ = ["Experiment", "Window", "EVAL_BATCH", "EVAL_CPU_TOKENS", "default_micro_batch", "eval_micro_batch", "evaluate"]

EVAL_BATCH = 64
"""Samples per forward pass of the held-out evaluation (no gradients: larger than a training micro-batch)."""

EVAL_CPU_TOKENS = 4096
"""On a CPU, a token task's held-out forward passes take at most this many token slots (``eval_batch`` is cut to
``EVAL_CPU_TOKENS // seq_len`` samples, at least 1). Forwards of the demo's 256 documents (16,384 tokens) make
4-16 MB activations, which glibc maps afresh or trims at every evaluation (page faults) and which overflow a core's
cache; at 4,096 tokens its evaluation takes less CPU (``benchmarks/eval_speed.py``). The loss is summed per forward
in float64, so it changes only by float32 rounding (``tests/test_loop.py``)."""


def default_micro_batch(batch: int, cap: Optional[int] = None, *, at_least_two: bool = False) -> int:
    """Samples per micro-batch for a global ``batch``: the batch itself up to ``cap`` (default 16), else
    gcd(batch, cap); with ``at_least_two`` (the noise scale needs two micro-batches) the largest proper divisor."""
    m = cap if cap is not None else 16
    micro = batch if batch <= m else math.gcd(batch, m)
    if at_least_two and micro == batch and batch > 1:
        micro = max(d for d in range(1, batch) if batch % d == 0)
    return micro


@dataclass(frozen=True, slots=True)
class Window:
    """One trained window: the driver's result and the training indices it drew (all ranks)."""

    result: StepResult
    drawn: list[int]


class Experiment:
    """A task's model on a device, its optimizer and the step driver: what every lab command trains with.

    Args:
        task: a :class:`globalbatch.lab.tasks.Task` (or duck-typed user task).
        batch: global batch in samples per optimizer step (or give ``batch_schedule``).
        micro_batch: samples per forward/backward on one rank.
        optimizer, lr, weight_decay: the registry name and its settings.
        max_grad_norm: clip after accumulation (None: no clipping).
        seed: model initialisation (the data order is the caller's: ``task.sample_order(seed)``).
        lr_schedule: an :class:`LRSchedule` over trained units (the task's unit).
        batch_schedule: a :class:`BatchSchedule` instead of a fixed ``batch``.
        callbacks: ``(model, optimizer) -> [callbacks]``: driver callbacks built on this
            experiment's model and optimizer (e.g. a :class:`~globalbatch.noise.NoiseScaleMonitor`).
        device: ``cpu``, ``cuda``, ``cuda:N``, ``mps`` or a ``torch.device``.
        precision: ``fp32``, ``bf16`` or ``fp16``.
        ddp: wrap in DDP when a process group of > 1 ranks is initialized.
        measure_flops: count the model's FLOPs at set-up (:mod:`globalbatch.lab.throughput`) and measure
            the device peak, so every window's :class:`StepResult` has ``model_flops_per_s`` and ``mfu``.
    """

    def __init__(
        self,
        task: Any,
        *,
        batch: Optional[int] = None,
        micro_batch: int,
        optimizer: str = "adamw",
        lr: float,
        weight_decay: float = 0.0,
        max_grad_norm: Optional[float] = None,
        seed: int = 0,
        lr_schedule: Optional[LRSchedule] = None,
        batch_schedule: Optional[BatchSchedule] = None,
        callbacks: Optional[Callable[[torch.nn.Module, torch.optim.Optimizer], Sequence[Any]]] = None,
        device: Any = "cpu",
        precision: str = "fp32",
        ddp: bool = False,
        measure_flops: bool = False,
    ) -> None:
        self.task = task
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        self.precision = Precision(precision)
        self.world = dist.get_world_size() if ddp and dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        torch.manual_seed(seed)
        model = task.build_model(seed).to(self.device)
        model.train()
        self.flops_of: Optional[Callable[[Any, int], float]] = None
        self.peak = None
        if measure_flops:  # counted on the plain model, before DDP, outside every timed window
            from globalbatch.lab.throughput import task_flops, task_peak

            with torch.random.fork_rng(devices=[]):  # the matmul peak draws random numbers: training must not see it
                self.flops_of = task_flops(task, model, self.device)
                self.peak = task_peak(self.device, self.precision.name)
            model.zero_grad(set_to_none=True)
        if self.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        self.model = model
        self.optimizer = build_optimizer(optimizer, model, lr=lr, weight_decay=weight_decay)
        self.driver = StepDriver(
            model, self.optimizer,
            StepConfig(micro_batch=micro_batch, global_batch=None if batch_schedule is not None else batch,
                       batch_schedule=batch_schedule, max_grad_norm=max_grad_norm, lr_schedule=lr_schedule,
                       unit="token" if getattr(task, "unit", "token") == "token" else "sample",
                       peak_flops_per_s=None if self.peak is None else self.peak.flops_per_s,
                       print_geometry=False),  # the lab's commands print their own tables (and --json)
            scaler=self.precision.grad_scaler(self.device),
            callbacks=list(callbacks(model, self.optimizer)) if callbacks is not None else (),
        )
        self.micro_batch = micro_batch

    # ------------------------------------------------------------------ training

    def loss_fn(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]):
        """The task's summed loss under the precision's autocast (the sum in float32)."""
        with self.precision.autocast(self.device):
            loss_sum, count = self.task.loss_sum(model, batch)
        return loss_sum.float(), count

    def split(self, indices: Sequence[int]) -> list[list[int]]:
        """Deprecated (FutureWarning): :func:`globalbatch.windows.cut_window` with this experiment's geometry."""
        warnings.warn("Experiment.split is deprecated; use globalbatch.windows.cut_window(indices, micro_batch, "
                      "dp_world_size, rank)", FutureWarning, stacklevel=2)
        return cut_window(indices, self.micro_batch, self.world, self.rank)

    def train_window(self, order: Iterator[int], batch: Optional[int] = None) -> Window:
        """Draw one global batch (``batch``, default the driver's current one) from ``order`` and train on it."""
        n = batch if batch is not None else self.driver.global_batch
        drawn = [int(i) for i in itertools.islice(order, n)]
        micros = cut_window(drawn, self.micro_batch, self.world, self.rank)
        batches = [self.task.collate(ix, self.device) for ix in micros]
        flops = None if self.flops_of is None else [self.flops_of(b, len(ix)) for b, ix in zip(batches, micros)]
        result = self.driver.run_window(batches, self.loss_fn, samples_per_micro=[len(ix) for ix in micros],
                                        flops_per_micro=flops)
        return Window(result=result, drawn=drawn)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, max_samples: int, eval_batch: int = EVAL_BATCH) -> float:
        """Held-out loss per unit over the task's first ``max_samples`` validation samples (every rank the same)."""
        return evaluate(self.task, self.model, max_samples, device=self.device, precision=self.precision,
                        eval_batch=eval_batch)


def eval_micro_batch(task: Any, eval_batch: int, device: Any = None) -> int:
    """Samples per held-out forward pass: ``eval_batch``, on a CPU at most :data:`EVAL_CPU_TOKENS` token slots of a
    token task (``seq_len`` each)."""
    seq_len = getattr(task, "seq_len", None)
    on_cpu = device is None or torch.device(device).type == "cpu"
    if on_cpu and getattr(task, "unit", "token") == "token" and isinstance(seq_len, int) and seq_len > 0:
        return max(1, min(eval_batch, EVAL_CPU_TOKENS // seq_len))
    return eval_batch


def evaluate(task: Any, model: torch.nn.Module, max_samples: int, *, device: Any = None,
             precision: Precision = Precision("fp32"), eval_batch: int = EVAL_BATCH) -> float:
    """Loss per unit over the first ``max_samples`` validation samples: inference mode, eval mode, float64 sums.

    ``eval_batch`` samples per forward pass, fewer on a CPU (:func:`eval_micro_batch`)."""
    eval_batch = eval_micro_batch(task, eval_batch, device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    seen = 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for batch in task.val_batches(eval_batch):
                first = next(iter(batch.values()))
                take = min(int(first.shape[0]), max_samples - seen)
                if take < int(first.shape[0]):
                    batch = {k: v[:take] for k, v in batch.items()}
                batch = to_device(batch, device)
                with precision.autocast(device if device is not None else "cpu"):
                    loss_sum, n = task.loss_sum(model, batch)
                total += loss_sum.double()
                count += n.double() if hasattr(n, "double") else float(n)
                seen += take
                if seen >= max_samples:
                    break
    finally:
        model.train(was_training)
    value = float(total / count.clamp(min=1.0))  # host sync: evaluation points only
    return value
