"""Text at the edges: an exception as one line, and text made safe to export as a label value."""

from __future__ import annotations

import re


def one_line(exc: object, *, first_line: bool = False, with_type: bool = False) -> str:
    """An exception as one short line, for errors that reach a user, a log line or a scrape.

    The message's whitespace runs become single spaces; with ``first_line``, only its first non-blank
    line is kept (for readers that echo the input on the lines after, as PyYAML does). With
    ``with_type``, the type's name comes first (``ValueError: ...``). An empty message, or one whose
    ``__str__`` raises, gives the type's name alone. At most 300 characters.
    """
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises must still be one line
        text = ""
    if first_line:
        text = next((line for line in text.splitlines() if line.strip()), "")
    text = " ".join(text.split())
    try:
        name = str(type(exc).__name__)
    except Exception:  # noqa: BLE001
        name = "Exception"
    if with_type and text:
        text = f"{name}: {text}"
    return (text or name)[:300]


# Lone surrogates, C0 and C1 controls: not exportable as label values (encoding fails, or parsers choke).
_UNSAFE_TEXT = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def safe_text(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with what cannot be exported replaced by U+FFFD."""
    return _UNSAFE_TEXT.sub("\ufffd", text[:limit])


def install_hint(extra: str) -> str:
    """How to add an optional extra (pyproject.toml's [project.optional-dependencies]) where kvguard came from a
    checkout, as it does today (no kvguard is published on a registry): ``.venv/bin/pip install -e '.[plot]'``
    in the clone, or ``pip install 'kvguard-X.whl[plot]'`` for a built wheel."""
    return (
        f"from the clone: .venv/bin/pip install -e '.[{extra}]' (a built wheel: pip install 'kvguard-*.whl[{extra}]')"
    )
