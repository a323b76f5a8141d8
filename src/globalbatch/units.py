"""Quantities as users type them: counts (``2M``, ``4.1B``, ``2,048``) and byte sizes (``80GiB``).

Parsed exactly (Decimal), never through a float: ``4.1B`` is 4,100,000,000. Pure stdlib.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

from globalbatch.errors import SettingError

__all__ = ["parse_count", "parse_bytes", "fmt_int"]


def fmt_int(n: float) -> str:
    """``2097152`` → ``'2,097,152'``; non-integral numbers keep up to 2 decimals (``1,500.5``)."""
    if float(n).is_integer():
        return f"{int(n):,}"
    if abs(n) < 0.01:
        return f"{n:.3g}"
    return f"{n:,.2f}".rstrip("0").rstrip(".")


# ---------------------------------------------------------------------------
# Parsing human quantities
# ---------------------------------------------------------------------------

_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_SUFFIX = {
    "": 1, "B": 1,
    "K": 1024, "KB": 1000, "KIB": 1024,
    "M": 1024**2, "MB": 1000**2, "MIB": 1024**2,
    "G": 1024**3, "GB": 1000**3, "GIB": 1024**3,
    "T": 1024**4, "TB": 1000**4, "TIB": 1024**4,
}
# Digits with optional thousands separators in groups of three ("2,048", "1_000_000"),
# an optional decimal part and exponent, then an optional unit suffix.
_QTY = re.compile(
    r"^\s*((?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]{1,3}(?:_[0-9]{3})+|[0-9]+)(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)"
    r"\s*([A-Za-z]*)\s*$"
)


_MAX_EXPONENT = 30
"""Quantities above 1e30 are refused: they overflow floats downstream and are never meant."""


def _parse(text: object, field_name: str, table: dict[str, int], allowed: str) -> Decimal:
    """Parse exactly (Decimal): ``'4.1B'`` is 4,100,000,000, not 4,099,999,999.9999995."""
    if isinstance(text, bool):
        raise SettingError(field_name, text, allowed)
    if isinstance(text, int):
        value = Decimal(text)
    elif isinstance(text, float):
        if not math.isfinite(text) or abs(text) >= 10.0 ** (_MAX_EXPONENT + 1):
            raise SettingError(field_name, text, f"{allowed}, at most 1e{_MAX_EXPONENT}")
        value = Decimal(repr(text))
    else:
        match = _QTY.match(str(text))
        suffix = match.group(2).upper() if match else None
        if not match or suffix not in table:
            raise SettingError(field_name, text, allowed, why="not a quantity")
        digits = Decimal(match.group(1).replace(",", "").replace("_", ""))
        if digits.adjusted() > _MAX_EXPONENT:  # 1e400, 1e999999999: an error, not an Overflow later
            raise SettingError(field_name, text, f"{allowed}, at most 1e{_MAX_EXPONENT}", why="too large")
        try:
            value = digits * table[suffix]
        except InvalidOperation:  # pragma: no cover - the regex admits only valid numbers
            raise SettingError(field_name, text, allowed, why="not a quantity") from None
    if value < 0:
        raise SettingError(field_name, text, allowed)
    if value != 0 and value.adjusted() > _MAX_EXPONENT:
        raise SettingError(field_name, text, f"{allowed}, at most 1e{_MAX_EXPONENT}", why="too large")
    return value


def parse_count(text: object, field_name: str = "count") -> int:
    """``'2M'`` → 2,000,000; ``'4.1B'`` → 4,100,000,000. K/M/B/T are decimal (B = billion).

    Thousands separators must group by three (``2,048``; ``1,5B`` is rejected). The result
    must be whole.
    """
    allowed = "a number with an optional K, M, B or T suffix, e.g. 2M, 4.1B or 100B"
    value = _parse(text, field_name, _COUNT_SUFFIX, allowed)
    if value != value.to_integral_value():
        raise SettingError(field_name, text, allowed, why="not a whole number")
    return int(value)


def parse_bytes(text: object, field_name: str = "memory") -> int:
    """``'8GiB'`` → 8·2³⁰. KiB/MiB/GiB/TiB (and bare K/M/G/T) are binary; KB/MB/GB/TB decimal."""
    allowed = "bytes with an optional KiB, MiB, GiB, TiB (binary) or KB, MB, GB, TB (decimal) suffix"
    return int(_parse(text, field_name, _BYTE_SUFFIX, allowed))
