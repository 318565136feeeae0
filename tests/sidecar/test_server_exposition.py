"""/metrics is made once per sidecar refresh and written byte for byte as prometheus_client writes it.

The fast encoder (kvguard.sidecar.exposition) is held to the library's own generate_latest, text and
OpenMetrics, on real snapshots and on fuzzed label text and values; the cache is held to one
observation and one collection per refresh, whatever the formats and encodings scrapers ask for.
"""

from __future__ import annotations

import gzip
import math
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.process_collector import ProcessCollector
from sidecar_fixtures import http_get as get, snapshot, write

from kvguard.sidecar.collector import families
from kvguard.sidecar.core import Sidecar, SidecarConfig
from kvguard.sidecar.exposition import Exposition, _Pinned, encode
from kvguard.sidecar.limits import MAX_RANKS

POD = {"pod": "vllm-0", "namespace": "llm", "container": "kvguard"}
OPENMETRICS = "application/openmetrics-text; version=1.0.0"
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;"
    "q=0.4,text/plain;version=0.0.4;q=0.2,*/*;q=0.1"
)
FUZZ = settings(
    derandomize=True, max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def hostile_spool(tmp_path):
    """Ranks whose device names hold what label escaping must get right, and one without a profile."""
    write(
        tmp_path,
        snapshot(rank=0, pid=1),
        snapshot(rank=1, device='npu:"1"\\\n', pid=2, retries=3, ooms=1),
        snapshot(rank=2, device="npu:é2", pid=3, profile=None),
        snapshot(rank=3, device="npu:3", pid=4, utilization=0.99),
    )
    return Sidecar(SidecarConfig(spool_dir=str(tmp_path), pod_labels=POD))


def collected(sidecar) -> list:
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    observation = sidecar.observe()
    return list(families(observation)) + list(registry.collect())


# ------------------------------------------------------------------ the encoder against the library


@pytest.mark.parametrize(
    "accept",
    [
        "",
        "*/*",
        "text/plain; version=0.0.4",
        OPENMETRICS,
        PROMETHEUS_ACCEPT,
        "application/openmetrics-text; version=1.0.0; escaping=allow-utf-8",
    ],
)
def test_the_encoder_writes_the_librarys_bytes_for_real_ranks(tmp_path, accept):
    metrics = collected(hostile_spool(tmp_path))
    body, content_type = encode(metrics, accept)
    library = generate_openmetrics if content_type.startswith("application/openmetrics-text") else generate_latest
    assert body == library(_Pinned(metrics))
    # The quote and backslash escaped; the newline was made U+FFFD by the spool reader (safe text).
    assert 'device="npu:\\"1\\"\\\\\ufffd"'.encode() in body


@pytest.mark.parametrize(
    "accept",
    [
        "application/openmetrics-text; version=1.0.0; escaping=dots",
        "application/openmetrics-text; version=1.0.0; escaping=values",
        "text/plain; version=1.0.0; escaping=dots",
    ],
)
def test_another_escaping_scheme_is_left_to_the_librarys_encoder(tmp_path, accept):
    metrics = collected(hostile_spool(tmp_path))
    body, content_type = encode(metrics, accept)
    library = generate_openmetrics if content_type.startswith("application/openmetrics-text") else generate_latest
    escaping = accept.rsplit("=", 1)[1]
    assert body == library(_Pinned(metrics), escaping=escaping)
    assert b"kvguard__guard__state" in body or b"U__kvguard__guard__state" in body


LABEL_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12) | st.sampled_from(
    ['"', "\\", "\n", "\\n", '\\"', "\ufffd", "", "{}", "a=b,c"]
)
VALUES = (
    st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, -0.0, 1e-300, 123456.0, 1234567.0, 2**63, 1e22, 0.1])
)


@FUZZ
@given(
    rows=st.lists(st.tuples(LABEL_TEXT, LABEL_TEXT, VALUES), max_size=6),
    counter=st.booleans(),
    extra=st.sampled_from(["state", "budget", "aaa", "zzz"]),
)
def test_any_label_text_and_value_encode_as_the_library_does(rows, counter, extra):
    kind = CounterMetricFamily if counter else GaugeMetricFamily
    shared = kind("kvguard_fuzz", 'doc with "quotes", \\ and\nnewline', labels=["device", "rank"])
    with_extra = kind("kvguard_fuzz_extra", "the same labels and one more", labels=["device", "rank", extra])
    for device, rank, value in rows:
        shared.add_metric([device, rank], value)
        with_extra.add_metric([device, rank, device + rank], value)
    plain = GaugeMetricFamily("kvguard_fuzz_plain", "no labels", value=rows[0][2] if rows else 1.0)
    metrics = [shared, with_extra, plain]
    assert encode(metrics, "")[0] == generate_latest(_Pinned(metrics))
    assert encode(metrics, OPENMETRICS)[0] == generate_openmetrics(_Pinned(metrics))


def test_a_family_the_encoder_does_not_write_goes_to_the_library_whole():
    from prometheus_client.core import HistogramMetricFamily

    histogram = HistogramMetricFamily("kvguard_h", "a histogram", buckets=[("1.0", 2), ("+Inf", 3)], sum_value=4)
    metrics = [GaugeMetricFamily("kvguard_g", "a gauge", value=1), histogram]
    assert encode(metrics, "")[0] == generate_latest(_Pinned(metrics))
    assert encode(metrics, OPENMETRICS)[0] == generate_openmetrics(_Pinned(metrics))


# ------------------------------------------------------------------ once per refresh


class Counting:
    """Wraps the exposition's collector: how many times the registry ran it."""

    def __init__(self, exposition: Exposition):
        self.calls = 0
        collect = exposition.collector.collect

        def counted():
            self.calls += 1
            return collect()

        exposition.collector.collect = counted


def test_two_scrapes_within_a_refresh_are_the_same_bytes_from_one_collection(serve):
    server = serve(snapshot(rank=0, pid=10), snapshot(rank=1, device="npu:1", pid=11))
    counting = Counting(server.exposition)
    first, second = get(server), get(server)
    assert first[0] == second[0] == 200
    assert first[2] == second[2]
    assert counting.calls == 1 and server.exposition.observations_total == 1


def test_a_new_refresh_makes_a_new_body(serve, tmp_path):
    server = serve(snapshot(rank=0, pid=10, retries=1))
    counting = Counting(server.exposition)
    before = get(server)[2]
    write(tmp_path / "spool", snapshot(rank=0, pid=10, retries=7))
    server.sidecar.refresh_background(wait=5.0)
    after = get(server)[2]
    assert counting.calls == 2 and server.exposition.observations_total == 2
    assert b"kvguard_allocator_alloc_retries_total" in after and after != before
    retries = {
        s.value
        for f in text_string_to_metric_families(after.decode())
        for s in f.samples
        if s.name == "kvguard_allocator_alloc_retries_total"
    }
    assert retries == {7.0}


def test_a_refresh_is_taken_after_max_age_even_when_no_read_completed(tmp_path):
    write(tmp_path, snapshot())
    now = [100.0]
    sidecar = Sidecar(SidecarConfig(spool_dir=str(tmp_path), pod_labels=POD, interval=5.0))
    exposition = Exposition(sidecar, clock=lambda: now[0])
    exposition.body("", False)
    now[0] += 4.9
    exposition.body("", False)
    assert exposition.observations_total == 1
    now[0] += 0.2
    exposition.body("", False)
    assert exposition.observations_total == 2


def test_every_format_and_encoding_of_a_refresh_comes_from_one_collection(serve):
    server = serve(snapshot())
    counting = Counting(server.exposition)
    text = get(server)
    om = get(server, headers={"Accept": OPENMETRICS})
    text_gz = get(server, headers={"Accept-Encoding": "gzip"})
    om_gz = get(server, headers={"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"})
    assert counting.calls == 1
    assert text[1]["Content-Type"].startswith("text/plain; version=0.0.4") and "Content-Encoding" not in text[1]
    assert om[1]["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    assert om_gz[1]["Content-Type"] == om[1]["Content-Type"] and om_gz[1]["Content-Encoding"] == "gzip"
    assert gzip.decompress(text_gz[2]) == text[2]
    assert gzip.decompress(om_gz[2]) == om[2] and om[2].endswith(b"# EOF\n")
    assert text[2].replace(b"# EOF\n", b"") != om[2]  # counters' HELP and TYPE differ between the two


def test_a_cached_body_is_never_served_without_credentials(serve):
    server = serve(snapshot(), basic_auth_user="prometheus", basic_auth_password="s3cret")
    import base64

    token = base64.b64encode(b"prometheus:s3cret").decode()
    status, _, body = get(server, headers={"Authorization": f"Basic {token}"})
    assert status == 200 and b"kvguard_guard_state" in body
    status, _, body = get(server)
    assert status == 401 and b"kvguard" not in body


def test_a_large_exposition_arrives_whole_with_its_length(serve):
    server = serve(*[snapshot(rank=r, device=f"npu:{r % 16}", pid=1000 + r) for r in range(MAX_RANKS)])
    status, headers, body = get(server)
    assert status == 200 and int(headers["Content-Length"]) == len(body) > 400_000
    assert body == server.exposition.body("", False)[0]
    ranks = {
        s.labels["rank"]
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
        if s.name == "kvguard_guard_severity"
    }
    assert len(ranks) == MAX_RANKS
    status, head_headers, head_body = get(server, method="HEAD")
    assert status == 200 and head_body == b"" and head_headers["Content-Length"] == headers["Content-Length"]


def test_the_age_gauges_are_as_of_the_refresh_they_were_rendered_in(serve):
    """What caching costs: within a refresh, the source cache age is the render's, not the scrape's."""
    server = serve(snapshot())
    first = get(server)[2]
    time.sleep(0.05)
    second = get(server)[2]
    ages = [
        {
            s.labels.get("source"): s.value
            for f in text_string_to_metric_families(b.decode())
            for s in f.samples
            if s.name == "kvguard_source_cache_age_seconds"
        }
        for b in (first, second)
    ]
    assert ages[0] == ages[1] and not math.isnan(ages[0]["spool"])


def test_parallel_guard_readers_share_one_build_per_refresh(serve, monkeypatch):
    """/guard with 10,000 ranks and 8 readers peaked over the chart's memory limit when each
    reader built its own JSON: one build per refresh, like /metrics."""
    from kvguard.sidecar.observation import Observation

    builds = []
    guard_dict = Observation.guard_dict
    monkeypatch.setattr(Observation, "guard_dict", lambda self: builds.append(1) or guard_dict(self))
    server = serve(snapshot(rank=0, pid=10), snapshot(rank=1, device="npu:1", pid=11))
    answers = []
    readers = [threading.Thread(target=lambda: answers.append(get(server, "/guard"))) for _ in range(8)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    assert [status for status, _, _ in answers] == [200] * 8
    assert len({body for _, _, body in answers}) == 1
    assert len(builds) == 1
