"""Reading a small text file an operator points kvguard at, bounded, with one-line errors."""

from __future__ import annotations

import os
import stat


def read_text(
    path: str, what: str, max_bytes: int, error: type[Exception], *, encoding: str = "utf-8", regular_only: bool = False
) -> str:
    """The text of ``path`` (at most ``max_bytes``, decoded as ``encoding``), or ``error`` with one line
    naming ``what``. ``regular_only``: opened without waiting, and a FIFO or other non-regular file is
    refused, never read."""
    try:
        if regular_only:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            handle = os.fdopen(fd, "rb")
        else:
            handle = open(path, "rb")
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    with handle:
        if regular_only and not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise error(f"{what} {path} is not a regular file")
        try:
            raw = handle.read(max_bytes + 1)
        except OSError as exc:
            raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:
        raise error(f"{what} {path} is larger than {max_bytes} bytes")
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError:
        raise error(f"{what} {path} is not UTF-8") from None
