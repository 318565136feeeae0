"""Log lines on stderr for `kvguard serve`: logfmt or JSON, as Prometheus exporters write them.

``--log.level`` and ``--log.format`` are exporter-toolkit's flag names (promslog: debug, info,
warn, error; logfmt, json). One line per event, with ``ts`` (RFC 3339, UTC, milliseconds),
``level``, ``msg`` and the event's own fields, e.g.

    ts=2026-12-03T14:02:11.507Z level=warn msg="source down" source=nvml error="NVML not found"
    {"ts": "2026-12-03T14:02:11.507Z", "level": "warn", "msg": "source down", "source": "nvml", ...}

The sidecar logs what changes, once per change (a source going down and coming back, a rank's
guard state); nothing is logged per scrape.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any, TextIO

from kvguard.text import one_line

LOGGER = "kvguard"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}
LEVEL_NAMES = {
    logging.DEBUG: "debug",
    logging.INFO: "info",
    logging.WARNING: "warn",
    logging.ERROR: "error",
    logging.CRITICAL: "error",
}
FORMATS = ("logfmt", "json")
# A logfmt value is written bare when it has none of these; otherwise quoted, as go-logfmt does.
_NEEDS_QUOTES = re.compile(r'[\s"=\\]|^$')
# Characters a terminal or a log viewer acts on instead of showing: C0 and C1 controls and DEL (escape
# sequences), the line and paragraph separators (a second line in viewers that split on them), and the
# bidirectional marks, embeddings, overrides and isolates (text that reads other than it is, the
# "Trojan Source" class, CVE-2021-42574), and lone surrogates (no UTF-8 stream can write them). Written as
# \uXXXX, in logfmt and in JSON alike.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape_unsafe(encoded: str) -> str:
    """``encoded`` (JSON text, where such characters can only stand inside strings) with each unsafe
    character written as a \\uXXXX escape, which JSON reads back as the same character."""
    return _UNSAFE.sub(lambda match: f"\\u{ord(match.group()):04x}", encoded)


def event(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """Log msg with fields (key=value pairs after msg)."""
    logger.log(level, msg, extra={"kvguard_fields": fields})


def _timestamp(record: logging.LogRecord) -> str:
    seconds = int(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int(record.msecs):03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = {"ts": _timestamp(record), "level": LEVEL_NAMES.get(record.levelno, "info"), "msg": record.getMessage()}
    fields.update(getattr(record, "kvguard_fields", None) or {})
    if record.exc_info and record.exc_info[1] is not None:
        fields["error"] = one_line(record.exc_info[1], with_type=True)
    return fields


def _logfmt_value(value: Any) -> str:
    text = "" if value is None else str(value)
    text = text.replace("\n", " ")
    if _NEEDS_QUOTES.search(text) or _UNSAFE.search(text):
        return _escape_unsafe(json.dumps(text, ensure_ascii=False))
    return text


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{key}={_logfmt_value(value)}" for key, value in _fields(record).items())


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return _escape_unsafe(json.dumps(_fields(record), ensure_ascii=False, default=str))


def setup(level: str = "info", fmt: str = "logfmt", stream: TextIO | None = None) -> logging.Logger:
    """Send the kvguard logger's records at ``level`` and above to ``stream`` (stderr) as ``fmt``."""
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}: expected one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    logger = logging.getLogger(LOGGER)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(LogfmtFormatter() if fmt == "logfmt" else JSONFormatter())
    logger.addHandler(handler)
    logger.setLevel(LEVELS[level])
    logger.propagate = False
    return logger
