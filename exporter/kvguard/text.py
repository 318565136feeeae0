"""Text at the edges: an exception as one line, and text made safe to export as a label value."""

from __future__ import annotations

import re


def one_line(exc: BaseException) -> str:
    """An exception as one short line, for errors that cross the source boundary."""
    try:
        text = " ".join(str(exc).split())
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises must still be one line
        text = ""
    try:
        name = type(exc).__name__
    except Exception:  # noqa: BLE001
        name = "Exception"
    return (text or str(name))[:300]


# Lone surrogates, C0 and C1 controls: not exportable as label values (encoding fails, or parsers choke).
_UNSAFE_TEXT = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def safe_text(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with what cannot be exported replaced by U+FFFD."""
    return _UNSAFE_TEXT.sub("\ufffd", text[:limit])
