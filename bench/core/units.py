"""Byte sizes as people write them (`4GiB`, `512MB`, `1e9`) and as the reports print them."""

from __future__ import annotations

import math
import re

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
KiB = 2**10
MiB = 2**20  # bytes in a mebibyte: the unit of every table and chart that prints memory
# The largest size any option or configuration may name: beyond it is a typo (`1e30`), and the searches, charts and
# CSV writes that follow would work on absurd figures (an int64 column overflows at 8 EiB)
MAX_SIZE_BYTES = 2**50  # 1 PiB

_SIZE = re.compile(r"\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str | int | float) -> int:
    """'4GiB' -> 4294967296. B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024), any case,
    optional space; a bare number (`123`, `1e9`) is bytes. Raises ValueError naming the text otherwise."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _SIZE.fullmatch(str(text))
        if not match:
            raise ValueError(f"cannot read {text!r} as a size: expected a number and a unit, e.g. 4GiB, 512MB, 1.5GB")
        number, unit = match.groups()
        multiplier = _UNITS.get(unit.lower() or "b")
        if multiplier is None:
            raise ValueError(f"unknown unit {unit!r} in size {text!r}: use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
        value = float(number) * multiplier
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"cannot read {text!r} as a size: it must be a finite, non-negative number of bytes")
    if value > MAX_SIZE_BYTES:
        raise ValueError(f"{text!r} is more than {format_size(MAX_SIZE_BYTES)}, the largest size membench takes "
                         "(no machine has that much memory)")
    return int(round(value))


def parse_positive_size(text: str | int | float) -> int:
    """`parse_size`, and more than 0 bytes; a ValueError naming the text otherwise."""
    value = parse_size(text)
    if value <= 0:
        raise ValueError(f"{text!r} is not a positive number of bytes")
    return value


def fraction_or_size(text: str | int | float) -> float | None:
    """The fraction a budget such as `0.6` names (a number in (0, 1]); None when it must be read as a size."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if 0 < value <= 1 else None


def format_size(n_bytes: float) -> str:
    """4294967296 -> '4.0 GiB'."""
    for unit, factor in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n_bytes) >= factor:
            return f"{n_bytes / factor:.1f} {unit}"
    return f"{int(n_bytes)} B"


def format_mib(n_bytes: float) -> str:
    """1572864 -> '1.5': bytes as MiB to one decimal with thousands separators, for columns headed MiB."""
    return f"{n_bytes / MiB:,.1f}"
