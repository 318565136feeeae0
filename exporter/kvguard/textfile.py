"""Reading a small text file an operator points kvguard at, bounded, with one-line errors."""

from __future__ import annotations


def read_text(path: str, what: str, max_bytes: int, error: type[Exception]) -> str:
    """The UTF-8 text of ``path`` (at most ``max_bytes``), or ``error`` with one line naming ``what``."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(max_bytes + 1)
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:
        raise error(f"{what} {path} is larger than {max_bytes} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{what} {path} is not UTF-8") from None
