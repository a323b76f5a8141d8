"""The ``globalbatch probe`` output: the table (one row per size tried, picks marked) and its summary lines."""

from __future__ import annotations

from typing import Any, Optional

from globalbatch.probe.search import ProbeResult
from globalbatch.probe.trial import format_bytes


def probe_table(result: ProbeResult, title: str = "probe") -> Any:
    """A rich Table: one row per size tried, in size order, with the picks marked."""
    from rich.table import Table

    use_tokens = result.unit != "sample" and all(
        t.tokens_per_step is not None for t in result.trials if t.fits and t.step_time_s)
    show_valid = any(t.valid_tokens_per_s() is not None for t in result.trials)
    show_mfu = result.peak_flops_per_s is not None and any(t.model_flops_per_s() is not None for t in result.trials)
    table = Table(title=title)
    columns = ["micro_batch", "fits", "peak memory", "step time", "tokens/s" if use_tokens else "samples/s"]
    columns += ["valid tok/s"] if show_valid else []
    columns += ["MFU"] if show_mfu else []
    for name in columns + ["trial #", "note"]:
        table.add_column(name, justify="right" if name not in ("fits", "note") else "left")
    order = {id(t): i + 1 for i, t in enumerate(result.trials)}
    for t in result.by_size():
        rate = t.tokens_per_s() if use_tokens else t.samples_per_s()
        marks = [m for m, size in (("largest", result.largest_fit), ("fastest", result.fastest))
                 if size == t.micro_batch]
        cells = [str(t.micro_batch), "yes" if t.fits else "no", format_bytes(t.peak_memory_bytes),
                 "-" if t.step_time_s is None else f"{t.step_time_s * 1e3:,.1f} ms",
                 "-" if rate is None else f"{rate:,.0f}"]
        if show_valid:
            valid = t.valid_tokens_per_s()
            cells.append("-" if valid is None else f"{valid:,.0f}")
        if show_mfu:
            share = t.mfu(result.peak_flops_per_s)
            cells.append("-" if share is None else f"{share:.1%}")
        table.add_row(*cells, str(order[id(t)]), ", ".join(marks) if marks else t.note)
    return table


def geometry_text(geometry: Any, unit: Optional[str] = None) -> str:
    """``256 seq = 1 rank × 16 accum × 16 seq``; ``samples`` instead of ``seq`` for a sample task."""
    noun = "samples" if unit == "sample" else "seq"
    ranks = "rank" if geometry.dp_world_size == 1 else "ranks"
    return (f"{geometry.global_batch:,} {noun} = {geometry.dp_world_size} {ranks} × "
            f"{geometry.grad_accum_steps} accum × {geometry.micro_batch} {noun}")


def limit_text(result: ProbeResult, *, max_micro_batch: Optional[int] = None, global_batch: Optional[int] = None,
               dp_world_size: int = 1, flag_names: bool = False) -> str:
    """What stopped the search: ``memory``, ``global batch ÷ dp (= 32)``, ``--max-micro-batch (= 64)``...

    ``max_micro_batch`` and ``global_batch`` are what the caller passed (None: not given);
    ``flag_names`` names the CLI flag rather than the argument.
    """
    if result.limited_by != "max_micro_batch":
        return result.limited_by
    if max_micro_batch is not None:
        return f"{'--max-micro-batch' if flag_names else 'max_micro_batch'} (= {result.largest_fit})"
    if global_batch is not None:
        return f"global batch ÷ dp (= {result.largest_fit})"
    return f"the default cap (= {result.largest_fit}; raise it with " \
           f"{'--max-micro-batch' if flag_names else 'max_micro_batch'})"
