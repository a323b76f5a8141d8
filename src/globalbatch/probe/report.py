"""The ``globalbatch probe`` table: one row per size tried, with the picks marked."""

from __future__ import annotations

from typing import Any

from globalbatch.probe.search import ProbeResult
from globalbatch.probe.trial import format_bytes


def probe_table(result: ProbeResult, title: str = "probe") -> Any:
    """A rich Table: one row per size tried, in size order, with the picks marked."""
    from rich.table import Table

    use_tokens = all(t.tokens_per_step is not None for t in result.trials if t.fits and t.step_time_s)
    table = Table(title=title)
    for name in ("micro_batch", "fits", "peak memory", "step time", "tokens/s" if use_tokens else "samples/s",
                 "trial #", "note"):
        table.add_column(name, justify="right" if name not in ("fits", "note") else "left")
    order = {id(t): i + 1 for i, t in enumerate(result.trials)}
    for t in result.by_size():
        rate = t.tokens_per_s() if use_tokens else t.samples_per_s()
        marks = [m for m, size in (("largest", result.largest_fit), ("fastest", result.fastest))
                 if size == t.micro_batch]
        table.add_row(
            str(t.micro_batch), "yes" if t.fits else "no", format_bytes(t.peak_memory_bytes),
            "-" if t.step_time_s is None else f"{t.step_time_s * 1e3:,.1f} ms",
            "-" if rate is None else f"{rate:,.0f}", str(order[id(t)]),
            ", ".join(marks) if marks else t.note)
    return table
