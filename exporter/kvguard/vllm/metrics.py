"""What vLLM's own ``/metrics`` says about its KV cache.

``vllm:cache_config_info`` is a gauge fixed at 1 whose labels are CacheConfig's fields
(``num_gpu_blocks``, ``block_size``, ``gpu_memory_utilization``, …); ``vllm:kv_cache_usage_perc``
is the fraction of blocks in use (0–1 despite the name; ``vllm:gpu_cache_usage_perc`` before
0.9). The fetch is bounded in time and size: the whole exchange (connect, headers, body) ends at
``timeout`` even when the endpoint trickles bytes, so the next poll can run. Anything that is not
Prometheus text is an error with one line, never a traceback.
"""

from __future__ import annotations

import http.client
import math
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from kvguard.records import MAX_COUNTER

MAX_METRICS_BYTES = 8 * 1024 * 1024
_CHUNK = 64 * 1024

CACHE_CONFIG = "vllm:cache_config_info"
USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


class VllmMetricsError(Exception):
    """One line saying why vLLM's metrics could not be read."""


@dataclass(frozen=True)
class VllmCacheState:
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_usage_ratio: float | None = None


class _Deadline:
    """Shuts down every socket of one fetch once its time is up, which ends a blocked read."""

    def __init__(self, timeout: float):
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.expired = False
        self._timer = threading.Timer(timeout, self.expire)
        self._timer.daemon = True

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            expired = self.expired
        if expired:
            _shutdown(sock)

    def expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shutdown(sock)

    def __enter__(self) -> "_Deadline":
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except (OSError, ValueError):
        pass


def _opener(deadline: _Deadline) -> urllib.request.OpenerDirector:
    def tracked(http_class):
        class Tracked(http_class):
            def connect(self):
                super().connect()
                deadline.add(self.sock)
        return Tracked

    class HTTPHandler(urllib.request.HTTPHandler):
        def do_open(self, http_class, req, **kwargs):
            return super().do_open(tracked(http_class), req, **kwargs)

    class HTTPSHandler(urllib.request.HTTPSHandler):
        def do_open(self, http_class, req, **kwargs):
            return super().do_open(tracked(http_class), req, **kwargs)

    return urllib.request.build_opener(HTTPHandler, HTTPSHandler)


def fetch(url: str, timeout: float) -> VllmCacheState:
    """GET ``url`` within ``timeout`` seconds in all and parse it. Raises VllmMetricsError."""
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in ("http", "https"):
        raise VllmMetricsError(f"not an http(s) URL: {url!r}")
    request = urllib.request.Request(url, headers={"Accept": "text/plain; version=0.0.4"})
    late = VllmMetricsError(f"{url}: no complete answer within {timeout:g}s")
    with _Deadline(timeout) as deadline:
        try:
            with _opener(deadline).open(request, timeout=timeout) as response:
                body = _read_body(response, deadline)
        except urllib.error.HTTPError as exc:
            raise VllmMetricsError(f"{url}: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
            if deadline.expired:
                raise late from None
            reason = getattr(exc, "reason", None) or exc
            raise VllmMetricsError(f"{url}: {str(reason).splitlines()[0] if str(reason) else type(exc).__name__}") \
                from None
        if deadline.expired:   # the shutdown can look like the end of the body
            raise late
    if len(body) > MAX_METRICS_BYTES:
        raise VllmMetricsError(f"{url}: response larger than {MAX_METRICS_BYTES} bytes")
    return parse(body.decode("utf-8", errors="replace"))


def _read_body(response, deadline: _Deadline) -> bytes:
    """At most MAX_METRICS_BYTES + 1 bytes, chunk by chunk, stopping once the deadline has passed."""
    chunks, size = [], 0
    while size <= MAX_METRICS_BYTES and not deadline.expired:
        chunk = response.read1(min(_CHUNK, MAX_METRICS_BYTES + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def parse(text: str) -> VllmCacheState:
    """Parse Prometheus text. Raises VllmMetricsError when it is not metrics text or has no vLLM KV facts."""
    from prometheus_client.parser import text_string_to_metric_families

    config_labels: dict[str, str] | None = None
    usage: float | None = None
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == CACHE_CONFIG and config_labels is None:
                    config_labels = dict(sample.labels)
                elif sample.name in USAGE_NAMES and usage is None and math.isfinite(sample.value):
                    usage = min(max(float(sample.value), 0.0), 1.0)
    except Exception as exc:  # the parser raises ValueError, IndexError, … on garbage
        raise VllmMetricsError(f"not Prometheus metrics text ({type(exc).__name__})") from None
    if config_labels is None and usage is None:
        raise VllmMetricsError(f"no {CACHE_CONFIG} or {USAGE_NAMES[0]} in the metrics")
    config_labels = config_labels or {}
    return VllmCacheState(
        num_gpu_blocks=_positive_int(config_labels.get("num_gpu_blocks")),
        block_size=_positive_int(config_labels.get("block_size")),
        gpu_memory_utilization=_ratio(config_labels.get("gpu_memory_utilization")),
        kv_cache_usage_ratio=usage,
    )


def _positive_int(text: str | None) -> int | None:
    try:
        value = int(str(text))
    except (TypeError, ValueError):   # also a number of more than 4300 digits
        return None
    return value if 0 < value <= MAX_COUNTER else None   # a bigger count is garbage, not a block count


def _ratio(text: str | None) -> float | None:
    try:
        value = float(str(text))
    except (TypeError, ValueError):
        return None
    return value if 0 < value <= 1 else None
