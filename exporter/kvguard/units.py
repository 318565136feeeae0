"""Byte sizes at the edges: parsing what users type, formatting what they read.

Everything inside kvguard is an int number of bytes; only the CLI and log parsing
convert from and to units.
"""

from __future__ import annotations

import math
import re

# What a SIZE accepts, everywhere (every command's SIZE options, plan's --device): SI units are powers of 1000
# (64GB is 64,000,000,000 bytes, 59.60 GiB), IEC units powers of 1024 (64GiB; Kubernetes' 64Gi too).
_UNITS = {
    "b": 1,
    "kb": 1000,
    "kib": 1 << 10,
    "ki": 1 << 10,
    "mb": 1000**2,
    "mib": 1 << 20,
    "mi": 1 << 20,
    "gb": 1000**3,
    "gib": 1 << 30,
    "gi": 1 << 30,
    "tb": 1000**4,
    "tib": 1 << 40,
    "ti": 1 << 40,
}
# One letter means 1000s to some tools (Kubernetes) and 1024s to others (docker, java, free -g): refused.
_AMBIGUOUS = {"k", "m", "g", "t"}
UNITS_TEXT = "B; KB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB (powers of 1024)"
SIZE_HELP = (
    f"SIZE is a number with a unit: {UNITS_TEXT}. 64GB is 64,000,000,000 bytes (59.60 GiB); 64GiB is "
    f"68,719,476,736 bytes, as vLLM's logs print GiB. A bare number (0 excepted) and a one-letter unit "
    f"(64G: GB or GiB?) are refused."
)

_SIZE_RE = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse ``"37.85GiB"``, ``"512MiB"``, ``"64GB"`` or ``"1024B"`` into bytes.

    Raises ValueError with a message fit for a one-line CLI error: a bare number (``64``: bytes or GiB?)
    and a one-letter unit (``64G``) are refused, with the units listed; ``0`` needs none.
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
        raise ValueError(f"not a size: {text!r} (a number with a unit: {UNITS_TEXT})")
    number, unit = match.groups()
    value_text = number.replace(",", "").replace("_", "")
    if not unit:
        if float(value_text) == 0:
            return 0
        raise ValueError(f"{text!r} has no unit: write {number}GiB, {number}GB or {number}B ({UNITS_TEXT})")
    if unit.lower() in _AMBIGUOUS:
        raise ValueError(
            f"{text!r}: {unit} alone is ambiguous: write {number}{unit.upper()}iB "
            f"(powers of 1024) or {number}{unit.upper()}B (powers of 1000)"
        )
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r} (use {UNITS_TEXT})")
    value = float(value_text) * factor
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
