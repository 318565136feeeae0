"""What vLLM's own ``/metrics`` says about its KV cache.

``vllm:cache_config_info`` is a gauge fixed at 1 whose labels are CacheConfig's fields
(``num_gpu_blocks``, ``block_size``, ``gpu_memory_utilization``, …); ``vllm:kv_cache_usage_perc``
is the fraction of blocks in use (0–1 despite the name; ``vllm:gpu_cache_usage_perc`` before
0.9). The fetch is bounded in time and size: the whole exchange (connect, headers, body) ends at
``timeout`` even when the endpoint trickles bytes, so the next poll can run. Anything that is not
Prometheus text is an error with one line, never a traceback.

Engines. vLLM labels its series with ``model_name`` (the served model name) and ``engine`` (the
engine index: the data-parallel rank), and emits one ``cache_config_info`` per engine, labelled with
``engine`` but not ``model_name`` (vllm/v1/metrics/loggers.py, 0.14.0:411-416 and 1002-1024,
0.34.0:499-500 and 1114-1135). :func:`parse` keeps one :class:`VllmEngineState` per engine
(at most :data:`MAX_ENGINES`), its model name taken from the engine's ``vllm:`` series; a
``cache_config_info`` without an ``engine`` label (releases before the label) holds for every engine.
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

from kvguard.records import MAX_COUNTER, MAX_ENGINE_CHARS, MAX_MODEL_NAME_CHARS
from kvguard.text import one_line, safe_text

MAX_METRICS_BYTES = 8 * 1024 * 1024
_CHUNK = 64 * 1024

CACHE_CONFIG = "vllm:cache_config_info"
USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
MAX_ENGINES = 64  # engines past this many (a hostile or broken endpoint) are left out


class VllmMetricsError(Exception):
    """One line saying why vLLM's metrics could not be read."""


@dataclass(frozen=True)
class VllmEngineState:
    """One engine's KV-cache facts and identity, as vLLM's series label them."""

    model_name: str = ""
    engine: str = ""
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_usage_ratio: float | None = None


@dataclass(frozen=True)
class VllmCacheState:
    """Every engine's state (``engines``, in engine order); the flat fields are the first engine's."""

    num_gpu_blocks: int | None = None
    block_size: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_usage_ratio: float | None = None
    engines: tuple[VllmEngineState, ...] = ()

    def engine_for(self, model_name: str = "", engine: str = "") -> VllmEngineState | None:
        """The engine a rank belongs to: the one its (model name, engine index) names, else the only
        engine there is; None when that is ambiguous or names none (never a guess)."""
        if model_name or engine:
            found = [
                e
                for e in self.engines
                if (not engine or e.engine == engine)
                and (not model_name or not e.model_name or e.model_name == model_name)
            ]
            return found[0] if len(found) == 1 else None
        return self.engines[0] if len(self.engines) == 1 else None


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
            raise VllmMetricsError(f"{url}: {one_line(reason, first_line=True)}") from None
        if deadline.expired:  # the shutdown can look like the end of the body
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

    configs: dict[str, dict[str, str]] = {}  # engine label ("" when absent) -> cache_config_info labels
    usages: dict[str, float] = {}
    models: dict[str, str] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sample.labels
                engine = safe_text(str(labels.get("engine", "")), MAX_ENGINE_CHARS)
                known = engine in configs or engine in usages or engine in models
                if not known and len(set(configs) | set(usages) | set(models)) >= MAX_ENGINES:
                    continue
                if sample.name == CACHE_CONFIG:
                    configs.setdefault(engine, dict(labels))
                    continue
                if sample.name in USAGE_NAMES and engine not in usages and math.isfinite(sample.value):
                    usages[engine] = min(max(float(sample.value), 0.0), 1.0)
                if "model_name" in labels and engine not in models and sample.name.startswith("vllm:"):
                    models[engine] = safe_text(str(labels["model_name"]), MAX_MODEL_NAME_CHARS)
    except Exception as exc:  # the parser raises ValueError, IndexError, … on garbage
        raise VllmMetricsError(f"not Prometheus metrics text ({type(exc).__name__})") from None
    if not configs and not usages:
        raise VllmMetricsError(f"no {CACHE_CONFIG} or {USAGE_NAMES[0]} in the metrics")
    names = set(configs) | set(usages)
    if len(names) > 1:
        names.discard("")  # a cache_config_info without an engine label holds for every engine
    shared = configs.get("", {})
    engines = tuple(
        _engine(name, configs.get(name, shared), usages.get(name, usages.get("")), models.get(name, models.get("", "")))
        for name in sorted(names, key=_engine_order)
    )
    first = engines[0]
    return VllmCacheState(
        num_gpu_blocks=first.num_gpu_blocks,
        block_size=first.block_size,
        gpu_memory_utilization=first.gpu_memory_utilization,
        kv_cache_usage_ratio=first.kv_cache_usage_ratio,
        engines=engines,
    )


def _engine_order(name: str) -> tuple[int, int, str]:
    return (0, int(name), "") if name.isdigit() and len(name) < 10 else (1, 0, name)


def _engine(name: str, config: dict[str, str], usage: float | None, model_name: str) -> VllmEngineState:
    return VllmEngineState(
        model_name=model_name,
        engine=name,
        num_gpu_blocks=_positive_int(config.get("num_gpu_blocks")),
        block_size=_positive_int(config.get("block_size")),
        gpu_memory_utilization=_ratio(config.get("gpu_memory_utilization")),
        kv_cache_usage_ratio=usage,
    )


def _positive_int(text: str | None) -> int | None:
    try:
        value = int(str(text))
    except (TypeError, ValueError):  # also a number of more than 4300 digits
        return None
    return value if 0 < value <= MAX_COUNTER else None  # a bigger count is garbage, not a block count


def _ratio(text: str | None) -> float | None:
    try:
        value = float(str(text))
    except (TypeError, ValueError):
        return None
    return value if 0 < value <= 1 else None
