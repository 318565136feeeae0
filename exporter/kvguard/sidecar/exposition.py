"""The /metrics body: made once per sidecar refresh, whatever the scrape rate.

``Exposition`` takes one observation per refresh (the sidecar's ``generation``), collects its
families once, writes their sample lines once (they are the same in both formats), and assembles
and gzips each format a scraper asks for once; concurrent scrapes share it.

``encode`` writes the bytes prometheus_client's own encoders write, for the families kvguard
exports (gauges and counters, legacy names, no timestamps, exemplars or units), three to four
times faster (bench/bench_metrics.py): each rank's label set is escaped and joined once per
render, not once per sample, and each value formatted once. The rules followed, as in
prometheus_client 0.26.0: ``exposition.py`` generate_latest (line 283; sample_line, line 294:
labels sorted by name; counters as ``NAME_total`` in HELP and TYPE, line 322) and
``openmetrics/exposition.py`` generate_latest (line 58: HELP escaped as label values, TYPE by
family name, ``# EOF``); label values escaped as ``_escape`` does for allow-utf-8 (line 219);
values by ``utils.floatToGoString`` itself. Anything else (another escaping scheme, a
histogram, a timestamp) goes to the library's encoder, whole. tests/sidecar/test_server_exposition.py
holds the two to the same bytes, on real ranks and on fuzzed labels and values.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import threading
import time
import zlib
from typing import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, exposition as text_format
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvguard.sidecar.collector import KVGuardCollector
from kvguard.sidecar.core import Sidecar
from kvguard.sidecar.observation import Observation

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
# Escaping schemes under which a legacy name is written unchanged (the library's escape_*_name).
_PLAIN_ESCAPING = (openmetrics.UNDERSCORES, openmetrics.ALLOWUTF8)
GZIP_LEVEL = 6


class _Pinned(Collector):
    """Families already collected, for the library's encoders (which take a registry)."""

    def __init__(self, metrics: Sequence):
        self._metrics = metrics

    def collect(self) -> Iterable:
        return iter(self._metrics)


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def fast_format(accept: str) -> bool | None:
    """True for OpenMetrics, False for the text format, None when the fast encoder does not
    write what prometheus_client would answer this Accept header with."""
    encoder, _ = choose_encoder(accept)
    function = getattr(encoder, "func", encoder)
    escaping = getattr(encoder, "keywords", {}).get("escaping", openmetrics.UNDERSCORES)
    if escaping not in _PLAIN_ESCAPING:
        return None
    if function is openmetrics.generate_latest:
        return True
    if function is text_format.generate_latest:
        return False
    return None


def sample_blocks(metrics: Iterable) -> list[tuple[str, str, str, bytes]] | None:
    """(name, type, HELP, sample lines) per family; the sample lines are the same in both formats.
    None when a family is one the fast encoder does not write. ``metrics`` is read once, one
    family at a time (the collector makes them so)."""
    blocks = []
    # Label text by label names, then by values: a rank's labels are escaped and joined once for
    # all its families with the same label names, not once per sample. A family with one label
    # more than such a set (guard_state's "state") builds on it and keeps nothing.
    label_sets: dict[tuple, dict[tuple, tuple[str, list[str]]]] = {}
    escaped: dict[str, str] = {}
    names_ok: set[str] = set()
    values: dict = {}

    def part(label: str, value: str) -> str:
        if label not in names_ok:
            if not _LABEL_NAME.match(label):
                raise ValueError(label)
            names_ok.add(label)
        value_text = escaped.get(value)
        if value_text is None:
            value_text = escaped[value] = _escape_value(value)
        return f'{label}="{value_text}"'

    for metric in metrics:
        name, kind, unit = metric.name, metric.type, getattr(metric, "unit", "")
        if kind not in ("gauge", "counter") or unit or not _METRIC_NAME.match(name):
            return None
        sample_name = name + "_total" if kind == "counter" else name
        lines: list[str] = []
        append = lines.append
        names: tuple = ()
        texts: dict = {}
        base: dict | None = None
        for sample in metric.samples:
            if (
                sample.name != sample_name
                or sample.timestamp is not None
                or sample.exemplar is not None
                or getattr(sample, "native_histogram", None) is not None
            ):
                return None
            labels = sample.labels
            if labels:
                if len(labels) != len(names) or not all(a is b or a == b for a, b in zip(labels, names)):
                    names = tuple(labels)
                    base = label_sets.get(names[:-1]) if len(names) > 1 and names not in label_sets else None
                    texts = label_sets.setdefault(names, {}) if base is None else {}
                    position = sum(label < names[-1] for label in names[:-1])
                key = tuple(labels.values())
                entry = base.get(key[:-1]) if base is not None else texts.get(key)
                try:
                    if base is not None and entry is not None:
                        parts = entry[1][:]
                        parts.insert(position, part(names[-1], key[-1]))
                        text = "{" + ",".join(parts) + "}"
                    elif entry is not None:
                        text = entry[0]
                    else:
                        parts = [part(label, value) for label, value in sorted(zip(names, key))]
                        text = "{" + ",".join(parts) + "}"
                        if base is None:
                            texts[key] = (text, parts)
                except ValueError:  # a label name outside the legacy set
                    return None
            else:
                text = ""
            value = sample.value
            value_key = value if value else (value, math.copysign(1.0, value))  # 0.0 == -0.0, "0.0" != "-0.0"
            number = values.get(value_key)
            if number is None:
                number = values[value_key] = floatToGoString(value)
            append(f"{sample_name}{text} {number}\n")
        blocks.append((name, kind, metric.documentation, "".join(lines).encode("utf-8")))
    return blocks


def _chunks(blocks: Sequence[tuple[str, str, str, bytes]], om: bool) -> Iterator[bytes]:
    for name, kind, doc, lines in blocks:
        if om:
            head = f"# HELP {name} {_escape_value(doc)}\n# TYPE {name} {kind}\n"
        else:
            sample_name = name + "_total" if kind == "counter" else name
            doc = doc.replace("\\", r"\\").replace("\n", r"\n")
            head = f"# HELP {sample_name} {doc}\n# TYPE {sample_name} {kind}\n"
        yield head.encode("utf-8")
        yield lines
    if om:
        yield b"# EOF\n"


def assemble(blocks: Sequence[tuple[str, str, str, bytes]], om: bool) -> bytes:
    return b"".join(_chunks(blocks, om))


def assemble_gzip(blocks: Sequence[tuple[str, str, str, bytes]], om: bool) -> bytes:
    """The gzip of assemble(blocks, om), without making the uncompressed body."""
    compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)  # wbits 31: a gzip stream
    parts = [compressor.compress(chunk) for chunk in _chunks(blocks, om)]
    parts.append(compressor.flush())
    return b"".join(parts)


def encode(metrics: Sequence, accept: str) -> tuple[bytes, str]:
    """(body, content type) for the Accept header, as prometheus_client would answer it."""
    encoder, content_type = choose_encoder(accept)
    om = fast_format(accept)
    blocks = sample_blocks(metrics) if om is not None else None
    if blocks is not None and om is not None:  # (blocks are made only for a fast format)
        return assemble(blocks, om), content_type
    return encoder(_Pinned(metrics)), content_type


class Exposition:
    """The latest observation and its encodings (/metrics, and /guard's JSON), made once per
    sidecar refresh.

    A new observation is taken when the sidecar's background reads have moved on (its
    ``generation``) or the cached one is older than ``max_age`` seconds. Its families are
    collected once, their sample lines written once for both formats, each format assembled
    once and gzipped once; concurrent callers share them. Every Accept header the fast encoder
    answers shares one body per format (text or OpenMetrics, plain or gzipped); of the library's
    encodings (other escapings) one is kept at a time, so 14 content types no longer keep 14
    copies of a refresh. The collector keeps the ranks' series under the sidecar's
    max_metrics_bytes, so each body is bounded too.
    """

    def __init__(
        self,
        sidecar: Sidecar,
        registry: CollectorRegistry | None = None,
        max_age: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.sidecar = sidecar
        self.collector = KVGuardCollector(sidecar)
        if registry is None:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(self.collector)
            ProcessCollector(registry=registry)
        self.registry = registry
        self.max_age = sidecar.config.interval if max_age is None else max_age
        self._clock = clock
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._made_at = 0.0
        self._observation: Observation | None = None
        self._blocks: list | None = None
        self._bodies: dict[tuple, tuple[bytes, ...]] = {}
        self._guard: bytes | None = None
        self.observations_total = 0  # observations taken (one per refresh)
        self.renders_total = 0  # collections of the registry (one per observation, as a rule)

    def _fresh(self) -> Observation:
        """Take a new observation when the cached one is out of date (the caller holds the lock);
        the cached one, current now."""
        key = self.sidecar.generation()
        now = self._clock()
        observation = self._observation
        if observation is None or key != self._key or now - self._made_at >= self.max_age:
            # Let go of the old one first: with thousands of ranks, two at once is what peaks.
            observation = None  # this reference too
            self._observation, self._blocks, self._bodies, self._guard = None, None, {}, None
            observation = self._observation = self.sidecar.observe()
            self.sidecar.log_changes(observation)
            self._key = self.sidecar.generation()
            self._made_at = now
            self.observations_total += 1
        return observation

    def _current(self) -> bool:
        """The cached observation is still the one _fresh would keep (the caller holds the lock)."""
        return (
            self._observation is not None
            and self.sidecar.generation() == self._key
            and self._clock() - self._made_at < self.max_age
        )

    def readiness_now(self, fail_on_critical: bool) -> tuple[int, str] | None:
        """/readyz's answer from the cached observation, or None when that would mean waiting
        (another thread is building) or observing anew: the server's event loop asks this, and
        never blocks."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            observation = self._observation
            return observation.readiness(fail_on_critical) if observation is not None and self._current() else None
        finally:
            self._lock.release()

    def stale_now(self) -> bool:
        """True when the next scrape would have to take a new observation and nobody is taking
        one now (the server then builds ahead of it, off the event loop). Never waits."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return not self._current()
        finally:
            self._lock.release()

    def parts_now(self, accept: str, gzipped: bool) -> tuple[tuple[bytes, ...], str] | None:
        """parts() when its answer is already made, or None (never builds, never waits)."""
        _, content_type = choose_encoder(accept)
        key = self._body_key(accept, content_type, gzipped)
        if not self._lock.acquire(blocking=False):
            return None
        try:
            body = self._bodies.get(key) if self._current() else None
            return (body, content_type) if body is not None else None
        finally:
            self._lock.release()

    def _collect(self) -> Iterator:
        """The registry's families for the cached observation, one at a time."""
        self.renders_total += 1
        self.collector.pinned = self._observation
        try:
            yield from self.registry.collect()
        finally:
            self.collector.pinned = None

    def observation(self) -> Observation:
        with self._lock:
            return self._fresh()

    def guard_json(self) -> bytes:
        """/guard's body for the current observation: built once per refresh, whatever the number
        of readers (10,000 ranks read by 8 clients at once went past the chart's memory limit
        when each built its own)."""
        with self._lock:
            observation = self._fresh()
            if self._guard is None:
                self._guard = json.dumps(observation.guard_dict(), indent=2).encode() + b"\n"
            return self._guard

    def parts(self, accept: str, gzipped: bool) -> tuple[tuple[bytes, ...], str]:
        """The body for this Accept header (gzipped or not) as chunks to send in order, and its
        content type. The text of a format is kept as the families' sample blocks, shared by
        both formats, never joined into a second copy."""
        encoder, content_type = choose_encoder(accept)
        om = fast_format(accept)
        key = self._body_key(accept, content_type, gzipped)
        with self._lock:
            self._fresh()
            body = self._bodies.get(key)
            if body is not None:
                return body, content_type
            if om is not None and self._blocks is None:
                self._blocks = sample_blocks(self._collect()) or []
            if om is not None and self._blocks:
                body = (assemble_gzip(self._blocks, om),) if gzipped else tuple(_chunks(self._blocks, om))
            else:  # a format the fast encoder does not write: the library's encoder
                # One such body at a time: each Accept type and escaping would otherwise keep its own
                # copy of the exposition for the refresh (14 of them went past the memory limit).
                for other in [k for k in self._bodies if k[0] == "library"]:
                    del self._bodies[other]
                plain = encoder(_Pinned(list(self._collect())))
                body = (gzip.compress(plain, compresslevel=GZIP_LEVEL) if gzipped else plain,)
            self._bodies[key] = body
            return body, content_type

    @staticmethod
    def _body_key(accept: str, content_type: str, gzipped: bool) -> tuple:
        """What a cached body is kept under: the fast formats by format (every Accept header that
        gets the text format, whatever its content type's parameters, shares one body; the
        OpenMetrics ones another), the library's encodings by content type."""
        om = fast_format(accept)
        return ("fast", om, gzipped) if om is not None else ("library", content_type, gzipped)

    def body(self, accept: str, gzipped: bool) -> tuple[bytes, str]:
        """parts(), joined."""
        parts, content_type = self.parts(accept, gzipped)
        return b"".join(parts), content_type
