"""What vLLM's own ``/metrics`` says about its KV cache.

``vllm:cache_config_info`` is a gauge fixed at 1 whose labels are CacheConfig's fields
(``num_gpu_blocks``, ``block_size``, ``gpu_memory_utilization``, …); ``vllm:kv_cache_usage_perc``
is the fraction of blocks in use (0–1 despite the name; ``vllm:gpu_cache_usage_perc`` before
0.9). The fetch is bounded in time and size, and anything that is not Prometheus text is an
error with one line, never a traceback.
"""

from __future__ import annotations

import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

MAX_METRICS_BYTES = 8 * 1024 * 1024

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


def fetch(url: str, timeout: float) -> VllmCacheState:
    """GET ``url`` and parse it. Raises VllmMetricsError."""
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in ("http", "https"):
        raise VllmMetricsError(f"not an http(s) URL: {url!r}")
    request = urllib.request.Request(url, headers={"Accept": "text/plain; version=0.0.4"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (scheme checked)
            body = response.read(MAX_METRICS_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise VllmMetricsError(f"{url}: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise VllmMetricsError(f"{url}: {str(reason).splitlines()[0] if str(reason) else type(exc).__name__}") \
            from None
    if len(body) > MAX_METRICS_BYTES:
        raise VllmMetricsError(f"{url}: response larger than {MAX_METRICS_BYTES} bytes")
    return parse(body.decode("utf-8", errors="replace"))


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
    except (TypeError, ValueError):
        return None
    return value if value > 0 else None


def _ratio(text: str | None) -> float | None:
    try:
        value = float(str(text))
    except (TypeError, ValueError):
        return None
    return value if 0 < value <= 1 else None
