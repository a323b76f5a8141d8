"""One trial's record (:class:`TrialResult`), and how the ranks agree on it.

Under ``torch.distributed`` every rank runs the same size, then the flag (0 fits, 1 OOM,
2 failed), peak memory, step time and tokens are all-reduced with MAX and the capacity
with MIN (:func:`_agree`), so all ranks take the same next size. Without an initialised
process group the agreement is the identity.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from globalbatch.validate import whole

log = logging.getLogger(__name__)

# The all-reduced per-trial record: flag, peak bytes, step seconds, tokens per step, −capacity.
_FITS, _OOM, _FAILED = 0.0, 1.0, 2.0


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def _bytes_in(value: float, unit: str) -> str:
    scaled = float(value) / 1024 ** _UNITS.index(unit)
    return f"{scaled:,.0f} B" if unit == "B" else f"{scaled:,.2f} {unit}"


def _unit_for(num_bytes: float) -> str:
    unit = "B"
    for unit in _UNITS:
        if abs(num_bytes) < 1024 ** (_UNITS.index(unit) + 1):
            break
    return unit


def _over_budget(peak: int, limit: int) -> str:
    """``peak 3.10 MiB > limit 1.00 KiB``; ``peak 1,026.26 MiB > limit 1,024.00 MiB`` when close.

    Each number in the unit its size calls for (KiB, MiB, GiB...); when the two would read the
    same, both go one unit down until the difference shows.
    """
    a, b = format_bytes(peak), format_bytes(limit)
    unit = min(_unit_for(peak), _unit_for(limit), key=_UNITS.index)
    while a == b and unit != "B":
        a, b = _bytes_in(peak, unit), _bytes_in(limit, unit)
        unit = _UNITS[_UNITS.index(unit) - 1]
    return f"peak {a} > limit {b}"


def format_bytes(num_bytes: Optional[float]) -> str:
    """``1610612736`` → ``'1.50 GiB'``, ``3250585`` → ``'3.10 MiB'``; the unit follows the size; None → ``'-'``."""
    if num_bytes is None:
        return "-"
    return _bytes_in(num_bytes, _unit_for(float(num_bytes)))


def _one_line(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrialResult:
    """What one trial at one micro-batch size measured."""

    micro_batch: int
    """Samples per forward/backward on this rank."""
    oom: bool = False
    """True when the trial ran out of memory or its peak exceeded the memory budget."""
    peak_memory_bytes: Optional[int] = None
    """Peak bytes during the trial (:mod:`globalbatch.probe` says what is counted); None if not measured."""
    step_time_s: Optional[float] = None
    """Median seconds per timed training step (warm-up excluded); None for a failed trial."""
    tokens_per_step: Optional[int] = None
    """Tokens (padding included) per micro-batch on this rank; None when the batch has no token count."""
    capacity_bytes: Optional[int] = None
    """Bytes the device could hold for this process (CUDA: free + reserved by torch); None if unknown."""
    model_flops_per_step: Optional[float] = None
    """Model FLOPs of one forward + backward of this micro-batch (FlopCounterMode); None if not counted."""
    valid_tokens_per_step: Optional[int] = None
    """Non-padding (loss-bearing) tokens per micro-batch; None for a sample task or when not counted."""
    note: str = ""
    """Why a trial failed (one line), or extra detail."""

    def __post_init__(self) -> None:
        whole(self.micro_batch, "micro_batch")

    @property
    def fits(self) -> bool:
        """The trial ran to the end within memory."""
        return not self.oom

    def samples_per_s(self) -> Optional[float]:
        """Samples per second on this rank (None without a timing)."""
        if self.oom or not self.step_time_s:
            return None
        return self.micro_batch / self.step_time_s

    def tokens_per_s(self) -> Optional[float]:
        """Tokens per second on this rank (None without a timing or a token count)."""
        if self.oom or not self.step_time_s or self.tokens_per_step is None:
            return None
        return self.tokens_per_step / self.step_time_s

    def valid_tokens_per_s(self) -> Optional[float]:
        """Non-padding tokens per second on this rank (None without a timing or a count)."""
        if self.oom or not self.step_time_s or self.valid_tokens_per_step is None:
            return None
        return self.valid_tokens_per_step / self.step_time_s

    def model_flops_per_s(self) -> Optional[float]:
        """Model FLOP/s on this rank: forward + backward FLOPs over the median step (the optimizer step
        is not a model FLOP); None without a timing or a count."""
        if self.oom or not self.step_time_s or self.model_flops_per_step is None:
            return None
        return self.model_flops_per_step / self.step_time_s

    def mfu(self, peak_flops_per_s: Optional[float]) -> Optional[float]:
        """Model FLOPs utilization of one device against ``peak_flops_per_s`` (None if either is unknown)."""
        rate = self.model_flops_per_s()
        return None if rate is None or not peak_flops_per_s else rate / peak_flops_per_s

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["samples_per_s"] = self.samples_per_s()
        out["tokens_per_s"] = self.tokens_per_s()
        out["valid_tokens_per_s"] = self.valid_tokens_per_s()
        out["model_flops_per_s"] = self.model_flops_per_s()
        return out



# ---------------------------------------------------------------------------
# Agreeing across ranks
# ---------------------------------------------------------------------------


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _all_reduce_max(values: list[float]) -> list[float]:
    """Element-wise MAX over ranks (identity without an initialised process group)."""
    if not _dist_ready():
        return values
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    buf = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return buf.tolist()  # host sync: once per trial, the search needs the agreed values


def _encode(x: Optional[float]) -> float:
    return -math.inf if x is None else float(x)


def _decode(x: float) -> Optional[float]:
    return None if x == -math.inf else x


def _agree(result: Optional[TrialResult], micro_batch: int, flag: float) -> TrialResult:
    """All ranks agree on the trial: MAX of the flag, peak, step time, tokens; MIN of capacity."""
    r = result or TrialResult(micro_batch=micro_batch, oom=flag != _FITS)
    local = [flag, _encode(r.peak_memory_bytes), _encode(r.step_time_s), _encode(r.tokens_per_step),
             _encode(None if r.capacity_bytes is None else -r.capacity_bytes), _encode(r.model_flops_per_step),
             _encode(r.valid_tokens_per_step)]
    if not _dist_ready():
        return r
    agreed_flag, peak, step, tokens, neg_cap, flops, valid = _all_reduce_max(local)
    if agreed_flag == _FAILED and flag != _FAILED:
        raise RuntimeError(f"probe: another rank failed at micro_batch {micro_batch} (see its log)")
    note = r.note if flag == agreed_flag else "another rank ran out of memory"
    cap = _decode(neg_cap)
    return TrialResult(
        micro_batch=micro_batch,
        oom=agreed_flag != _FITS,
        peak_memory_bytes=None if _decode(peak) is None else int(peak),
        step_time_s=None if agreed_flag != _FITS else _decode(step),
        tokens_per_step=None if _decode(tokens) is None else int(tokens),
        capacity_bytes=None if cap is None else int(-cap),
        model_flops_per_step=_decode(flops),
        valid_tokens_per_step=None if _decode(valid) is None else int(valid),
        note=note,
    )



def _log_trial(t: TrialResult) -> None:
    if _dist_ready():
        import torch.distributed as dist

        if dist.get_rank() != 0:
            return
    if t.fits:
        tps = t.tokens_per_s()
        rate = f"{tps:,.0f} tok/s" if tps is not None else (
            f"{t.samples_per_s():,.1f} samples/s" if t.samples_per_s() is not None else "untimed")
        log.info("probe: micro_batch %d fits: peak %s, %s", t.micro_batch, format_bytes(t.peak_memory_bytes), rate)
    else:
        log.info("probe: micro_batch %d -> out of memory (%s)", t.micro_batch, t.note)

