"""Byte sizes at the edges: parsing what users type, formatting what they read.

Everything inside kvguard is an int number of bytes; only the CLI and log parsing
convert from and to units.
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10, "ki": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20, "mi": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "gi": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40, "ti": 1 << 40,
}

_SIZE_RE = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse ``"37.85GiB"``, ``"512MiB"``, ``"64GB"`` or ``"1024"`` into bytes.

    Raises ValueError with a message fit for a one-line CLI error.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        if str(text).strip().startswith("-"):
            raise ValueError(f"size must not be negative: {text!r}")
        raise ValueError(f"not a size: {text!r} (use bytes or a number with a unit, e.g. 37.85GiB, 512MiB, 64GB)")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    value = float(number.replace(",", "").replace("_", "")) * factor
    if not math.isfinite(value):
        raise ValueError(f"not a size: {text!r}")
    return int(value)


def gib(n_bytes: float) -> float:
    return n_bytes / (1 << 30)


def format_gib(n_bytes: float) -> str:
    """Always in GiB, two decimals: ``228170137`` -> ``"0.21 GiB"`` (guard reasons, logs)."""
    return f"{gib(n_bytes):.2f} GiB"


def format_bytes(n_bytes: int | float | None) -> str:
    """Human-readable IEC size: ``40637976576`` -> ``"37.85 GiB"``."""
    if n_bytes is None:
        return "-"
    sign = "-" if n_bytes < 0 else ""
    value = abs(float(n_bytes))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    return f"{sign}{value:.2f} TiB"
