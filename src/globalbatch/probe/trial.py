"""One trial's record (:class:`TrialResult`), and how the ranks agree on it.

Under ``torch.distributed`` every rank runs the same size, then the flag (0 fits, 1 OOM,
2 failed) and every measured field are all-reduced, each as its declaration says (peak memory,
step time, tokens and FLOPs with MAX, the capacity with MIN: :func:`_agree`), so all ranks take
the same next size. Without an initialised
process group the agreement is the identity.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from globalbatch.validate import field_types, whole

log = logging.getLogger(__name__)

# The trial's flag, all-reduced with MAX ahead of the measured fields (:func:`_agree`).
_FITS, _OOM, _FAILED = 0.0, 1.0, 2.0
_SIGN = {"max": 1.0, "min": -1.0}
"""How ranks agree on a measured field → the sign it is all-reduced with under MAX."""


def _measured(agree: str) -> Any:
    """A field one trial measures (None: not measured), and how the ranks agree on it (``"max"`` or ``"min"``)."""
    return dataclasses.field(default=None, metadata={"agree": agree})


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
    peak_memory_bytes: Optional[int] = _measured("max")
    """Peak bytes during the trial (:mod:`globalbatch.probe` says what is counted); None if not measured."""
    step_time_s: Optional[float] = _measured("max")
    """Median seconds per timed training step (warm-up excluded); None for a failed trial."""
    forward_backward_s: Optional[float] = _measured("max")
    """Median seconds of the forward + backward part of those steps (each step split after its backward, in
    place: the rest is the optimizer's ``step(); zero_grad()``); None for a failed trial."""
    tokens_per_step: Optional[int] = _measured("max")
    """Tokens (padding included) per micro-batch on this rank; None when the batch has no token count."""
    capacity_bytes: Optional[int] = _measured("min")
    """Bytes the device could hold for this process (CUDA: free + reserved by torch); None if unknown."""
    model_flops_per_step: Optional[float] = _measured("max")
    """Model FLOPs of one forward + backward of this micro-batch (FlopCounterMode); None if not counted."""
    valid_tokens_per_step: Optional[int] = _measured("max")
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


_MEASURED = [(f.name, _SIGN[f.metadata["agree"]]) for f in dataclasses.fields(TrialResult) if "agree" in f.metadata]
_WHOLE = {name for name, (kind, _) in field_types(TrialResult).items() if kind == "int"}


def _agree(result: Optional[TrialResult], micro_batch: int, flag: float) -> TrialResult:
    """All ranks agree on the trial: MAX of the flag, and each measured field as it declares (MAX, or MIN of
    the capacity); a field no rank measured stays None, the step time of a trial that did not fit too."""
    r = result or TrialResult(micro_batch=micro_batch, oom=flag != _FITS)
    local = [flag] + [_encode(None if (v := getattr(r, name)) is None else sign * v) for name, sign in _MEASURED]
    if not _dist_ready():
        return r
    agreed_flag, *values = _all_reduce_max(local)
    if agreed_flag == _FAILED and flag != _FAILED:
        raise RuntimeError(f"probe: another rank failed at micro_batch {micro_batch} (see its log)")
    agreed: dict[str, Any] = {}
    for (name, sign), x in zip(_MEASURED, values):
        v = _decode(x)
        agreed[name] = None if v is None else int(sign * v) if name in _WHOLE else sign * v
    if agreed_flag != _FITS:
        agreed["step_time_s"] = None
    note = r.note if flag == agreed_flag else "another rank ran out of memory"
    return TrialResult(micro_batch=micro_batch, oom=agreed_flag != _FITS, note=note, **agreed)



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

