"""Model FLOPs per micro-batch, peak FLOP/s, and model FLOPs utilization (MFU).

MFU follows Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways", §4.1 and
Appendix B: the FLOPs the model needs per token, divided by the time taken, over the
hardware's peak FLOP/s. Recomputation (activation checkpointing) is not counted: a model FLOP
is a FLOP the model requires, not one the hardware ran.

Two ways to count the model FLOPs of one training micro-batch (forward + backward):

* **measured** (:func:`count_flops`, :class:`FlopsCounter`): ``torch.utils.flop_counter.
  FlopCounterMode`` around one forward + backward of the real model; it counts matmuls,
  convolutions and attention kernels (elementwise ops are not FLOPs in this convention).
  Counted once per batch shape and cached.
* **formula** (:func:`transformer_flops_per_token`, torch-free, used by ``plan``): PaLM's
  ``6·N + 12·L·H·Q·T`` per token (Appendix B; N non-embedding parameters, L layers, H heads,
  Q head dim, T sequence length; 6·N for the weight matmuls forward + backward, the second
  term for attention's QKᵀ and AV). Labelled ``formula`` wherever it is shown.

Peak FLOP/s: a small table of dense (no sparsity) tensor-core peaks from the vendors' data
sheets (SXM parts), by dtype, or a measured square-matmul peak on CPU
(:func:`measure_matmul_peak`); either can be overridden by a number.
Only the table lookup and the formula import no torch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from globalbatch._util import SettingError
from globalbatch.plan.arithmetic import dense_flops_per_token
from globalbatch.validate import positive

__all__ = ["PEAK_FLOPS", "transformer_flops_per_token", "dense_flops_per_token", "table_peak_flops", "measure_matmul_peak",
           "peak_flops_per_s", "count_flops", "FlopsCounter", "SequenceFlops", "mfu", "PeakFlops"]

PEAK_FLOPS: dict[str, dict[str, float]] = {
    # dense peak FLOP/s per device (NVIDIA data sheets, SXM; the sparsity figures are 2× these)
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "H100": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12},
    "H200": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12},
}
"""Dense peak FLOP/s by accelerator and dtype. H200 has H100's compute (more, faster memory)."""


def transformer_flops_per_token(*, params_non_embedding: float, n_layer: int, seq_len: int,
                                d_model: int) -> float:
    """Training (forward + backward) FLOPs per token: ``6·N + 12·L·d·T`` (PaLM App. B; H·Q = d_model)."""
    for name, value in (("params_non_embedding", params_non_embedding), ("n_layer", n_layer),
                        ("seq_len", seq_len), ("d_model", d_model)):
        positive(value, name, allowed="a number > 0")
    return 6.0 * params_non_embedding + 12.0 * n_layer * d_model * seq_len


def table_peak_flops(device_name: str, dtype: str) -> Optional[float]:
    """Peak FLOP/s of a known accelerator (matched by A100/H100/H200 in its name), else None."""
    upper = device_name.upper()
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in upper:
            return PEAK_FLOPS[key].get(dtype)
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class PeakFlops:
    """A peak FLOP/s and where it came from."""

    flops_per_s: float
    source: str
    """``table: H100 bf16``, ``measured: cpu fp32 matmul 512``, or ``given``."""


_MEASURED: dict[tuple[str, str, int, int], float] = {}


def measure_matmul_peak(dtype: str = "fp32", *, size: int = 512, repeats: int = 5, device: str = "cpu") -> float:
    """Best FLOP/s of ``repeats`` timed square matmuls (2·n³ FLOPs each) on ``device``; cached per process.

    The best, not the median: the peak is what the hardware can do, and a shared CPU only ever
    makes a run slower. It uses (and is cached per) the threads torch is set to use.
    """
    import torch

    key = (device, dtype, size, torch.get_num_threads())  # the peak of this thread count
    if key in _MEASURED:
        return _MEASURED[key]
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                   "fp64": torch.float64}.get(dtype)
    if torch_dtype is None:
        raise SettingError("dtype", dtype, "fp32, bf16, fp16, fp64")
    a = torch.randn(size, size, dtype=torch_dtype, device=device)
    b = torch.randn(size, size, dtype=torch_dtype, device=device)
    torch.mm(a, b)  # warm-up (allocations, kernel choice)
    best = math.inf
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()  # host sync: timing boundary of a benchmark, not a training step
        start = time.perf_counter()
        torch.mm(a, b)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    _MEASURED[key] = 2.0 * size ** 3 / best
    return _MEASURED[key]


def peak_flops_per_s(*, device: str = "cpu", dtype: str = "fp32", override: Optional[float] = None) -> PeakFlops:
    """The peak to divide by: ``override`` if given, else the table (CUDA), else a measured CPU matmul.

    On CUDA the device name comes from ``torch.cuda.get_device_name`` (not yet run on a
    GPU); an accelerator missing from the table needs ``override``.
    """
    if override is not None:
        positive(override, "peak_flops_per_s", allowed="a FLOP/s number > 0, e.g. 989e12")
        return PeakFlops(flops_per_s=float(override), source="given")
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(torch.device(device))
        peak = table_peak_flops(name, dtype)
        if peak is None:
            raise SettingError("peak_flops_per_s", None,
                               f"a number for {name!r} {dtype} (not in the table: {', '.join(PEAK_FLOPS)})")
        return PeakFlops(flops_per_s=peak, source=f"table: {name} {dtype} dense")
    size = 512
    return PeakFlops(flops_per_s=measure_matmul_peak(dtype, size=size, device=device),
                     source=f"measured: {device} {dtype} matmul {size}×{size}")


def count_flops(model: Any, batch: Any, loss_fn: Callable[[Any, Any], Any]) -> int:
    """FLOPs of one forward + backward of ``loss_fn(model, batch)`` (FlopCounterMode); gradients dropped after."""
    from torch.utils.flop_counter import FlopCounterMode

    model.zero_grad(set_to_none=True)
    counter = FlopCounterMode(display=False, custom_mapping=_cpu_attention_formulas())
    with counter:
        loss_fn(model, batch).backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def _cpu_attention_formulas() -> dict[Any, Any]:
    """FLOP formulas for CPU scaled-dot-product attention, missing from FlopCounterMode's registry.

    Measured negative result: torch 2.13's registry has the CUDA flash/efficient/cuDNN kernels but
    not ``_scaled_dot_product_flash_attention_for_cpu`` (and its backward), so on CPU attention
    counted 0 FLOPs (tinygpt: 4.92 M instead of 5.70 M per token). The CUDA kernels' own
    formulas apply: the CPU ops take (query, key, value, …) and (grad_out, query, key, value, …).
    """
    import torch
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    mapping: dict[Any, Any] = {}
    for name, cuda_op in (("_scaled_dot_product_flash_attention_for_cpu", aten._scaled_dot_product_flash_attention),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward",
                           aten._scaled_dot_product_flash_attention_backward)):
        op = getattr(aten, name, None)
        if op is None or op in fc.flop_registry or cuda_op not in fc.flop_registry:
            continue
        mapping[op] = _raw(fc.flop_registry[cuda_op])  # already shape-wrapped: must not be wrapped twice
    return mapping


def _raw(formula: Callable[..., int]) -> Callable[..., int]:
    def counted(*args: Any, **kwargs: Any) -> int:
        return formula(*args, **kwargs)

    counted._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode: call as is
    return counted


def _shape_key(batch: Any) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        return ("T", tuple(batch.shape), str(batch.dtype))
    if isinstance(batch, dict):
        return ("D", tuple((k, _shape_key(v)) for k, v in sorted(batch.items(), key=lambda kv: str(kv[0]))))
    if isinstance(batch, (list, tuple)):
        return ("L", tuple(_shape_key(v) for v in batch))
    return ("V", type(batch).__name__)


class FlopsCounter:
    """``counter(batch) -> FLOPs`` of one forward + backward, counted once per batch shape and cached.

    Counting runs an extra forward + backward (outside the training step: call it before the
    loop, or accept one extra pass per new shape). Padding counts: a padded token costs FLOPs
    like a real one, so the FLOPs follow the padded shape.
    """

    def __init__(self, model: Any, loss_fn: Callable[[Any, Any], Any]) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.cache: dict[Any, int] = {}

    def __call__(self, batch: Any) -> int:
        key = _shape_key(batch)
        if key not in self.cache:
            self.cache[key] = count_flops(self.model, batch, self.loss_fn)
        return self.cache[key]


class SequenceFlops:
    """FLOPs of a ``(batch, width)`` token batch from two counts: ``batch × (α·width + β·width²)``.

    A transformer's matmul FLOPs grow linearly with the tokens and its attention FLOPs with
    width², so counting one sequence at two widths (FlopCounterMode, :func:`count_flops`)
    determines α and β, and every other shape follows without another count: exact for
    models whose only counted ops are matmuls and attention (tested against :class:`FlopsCounter`).
    Useful for ragged batches, where every micro-batch may have a new padded width.

    ``make_batch(width)`` builds a batch of one sequence of that width.
    """

    def __init__(self, model: Any, make_batch: Callable[[int], Any], loss_fn: Callable[[Any, Any], Any], *,
                 widths: tuple[int, int]) -> None:
        w1, w2 = widths
        if not (isinstance(w1, int) and isinstance(w2, int) and 1 <= w1 < w2):
            raise SettingError("widths", widths, "two whole widths 1 ≤ w1 < w2, e.g. (64, 128)")
        f1, f2 = count_flops(model, make_batch(w1), loss_fn), count_flops(model, make_batch(w2), loss_fn)
        # f = α·w + β·w²  →  f/w = α + β·w: a line through (w1, f1/w1), (w2, f2/w2)
        self.quadratic = (f2 / w2 - f1 / w1) / (w2 - w1)
        self.linear = f1 / w1 - self.quadratic * w1
        self.widths = widths

    def __call__(self, batch_size: int, width: int) -> float:
        """Forward + backward FLOPs of ``batch_size`` sequences padded to ``width`` tokens."""
        return batch_size * (self.linear * width + self.quadratic * width * width)


def mfu(model_flops_per_s: float, peak_flops_per_s: float, devices: int = 1) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over ``devices × peak``."""
    return model_flops_per_s / (peak_flops_per_s * devices)
