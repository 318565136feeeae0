"""What one sidecar exports is bounded whatever the spool holds: ranks, distinct engines, models and
pods, label-value length and the bytes of /metrics; what is cut is left out and counted by reason."""

from __future__ import annotations

import re
import subprocess
import time

import pytest
from monitoring import promtool
from prometheus_client.parser import text_string_to_metric_families
from sidecar_fixtures import snapshot, write

from kvguard.records import MAX_ENGINE_CHARS, MAX_MODEL_NAME_CHARS
from kvguard.sidecar.core import Sidecar, SidecarConfig
from kvguard.sidecar.exposition import Exposition

POD = {"pod": "", "namespace": "", "container": ""}
TEXT = "text/plain; version=0.0.4"


def _spool(tmp_path, count, **fields):
    """``count`` ranks, one per pid, written at one time (so the caps keep them in label order);
    ``fields`` maps a Snapshot field to a function of the index."""
    now = time.time()
    for index in range(count):
        write(
            tmp_path,
            snapshot(
                rank=index, pid=1000 + index, written_at=now, **{name: make(index) for name, make in fields.items()}
            ),
        )
    return str(tmp_path)


def _cut(body: bytes) -> dict[str, float]:
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    return {s.labels["reason"]: s.value for s in families["kvguard_ranks_cut"].samples}


def _exported_ranks(body: bytes) -> set[str]:
    return set(re.findall(rb'kvguard_guard_severity\{[^}]*pid="([0-9]+)"', body))


def _metrics(sidecar: Sidecar) -> bytes:
    return Exposition(sidecar).body(TEXT, False)[0]


def test_ranks_past_max_ranks_are_left_out_and_counted(tmp_path):
    sidecar = Sidecar(SidecarConfig(spool_dir=_spool(tmp_path, 7), pod_labels=POD, max_ranks=4))
    observation = sidecar.observe()
    assert len(observation.ranks) == 4 and observation.cut == {"max_ranks": 3}
    body = _metrics(sidecar)
    assert len(_exported_ranks(body)) == 4
    assert _cut(body) == {"max_ranks": 3, "max_engines": 0, "max_models": 0, "max_pods": 0, "max_bytes": 0}


def test_distinct_models_past_max_models_are_left_out_and_counted(tmp_path):
    spool = _spool(tmp_path, 6, model_name=lambda i: f"model-{i % 3}")
    observation = Sidecar(SidecarConfig(spool_dir=spool, pod_labels=POD, max_models=2)).observe()
    assert {r.labels["model_name"] for r in observation.ranks} == {"model-0", "model-1"}
    assert len(observation.ranks) == 4 and observation.cut == {"max_models": 2}


def test_distinct_pods_past_max_pods_are_left_out_and_counted(tmp_path):
    spool = _spool(tmp_path, 5, pod=lambda i: {"pod": f"vllm-{i}", "namespace": "llm", "container": "vllm"})
    observation = Sidecar(SidecarConfig(spool_dir=spool, pod_labels=POD, max_pods=3)).observe()
    assert len({r.labels["pod"] for r in observation.ranks}) == 3 and observation.cut == {"max_pods": 2}


def test_distinct_engines_past_max_engines_are_left_out_and_counted(tmp_path):
    spool = _spool(tmp_path, 6, engine=lambda i: str(i % 3))
    observation = Sidecar(SidecarConfig(spool_dir=spool, pod_labels=POD, max_engines=1)).observe()
    assert {r.labels["engine"] for r in observation.ranks} == {"0"} and observation.cut == {"max_engines": 4}


def test_a_label_value_past_max_label_chars_is_cut_and_counted(tmp_path):
    spool = _spool(tmp_path, 2, model_name=lambda i: f"{i}" * MAX_MODEL_NAME_CHARS)
    sidecar = Sidecar(SidecarConfig(spool_dir=spool, pod_labels=POD, max_label_chars=40))
    observation = sidecar.observe()
    assert {len(r.labels["model_name"]) for r in observation.ranks} == {40}
    assert observation.labels_truncated == 2
    families = {f.name: f for f in text_string_to_metric_families(_metrics(sidecar).decode())}
    assert families["kvguard_label_values_truncated"].samples[0].value == 2


def test_ranks_past_max_metrics_bytes_stay_out_of_metrics_and_are_counted(tmp_path):
    spool = _spool(tmp_path, 20, model_name=lambda i: f"m{i}".ljust(MAX_MODEL_NAME_CHARS, "x"))
    sidecar = Sidecar(SidecarConfig(spool_dir=spool, pod_labels=POD, max_metrics_bytes=200_000))
    body = _metrics(sidecar)
    kept = len(_exported_ranks(body))
    assert 0 < kept < 20 and _cut(body)["max_bytes"] == 20 - kept
    rank_lines = b"".join(line + b"\n" for line in body.splitlines() if b'rank="' in line)
    assert len(rank_lines) <= 200_000
    assert len(sidecar.observe().ranks) == 20  # /guard still shows them


@pytest.mark.parametrize(
    "accept",
    [
        TEXT,
        "application/openmetrics-text; version=1.0.0",
        "text/plain; version=1.0.0; escaping=values",
        "application/openmetrics-text; version=1.0.0; escaping=dots",
    ],
)
def test_a_spool_with_every_text_field_at_its_cap_makes_a_bounded_valid_exposition(tmp_path, accept):
    """The round-three attack: fields at their length caps, distinct models, pods and engines on every
    rank. At the default caps /metrics stays under 5 MB in every format and escaping, and promtool reads it."""
    long = lambda prefix: lambda i: f"{prefix}{i}-".ljust(MAX_MODEL_NAME_CHARS, "\\")  # noqa: E731
    spool = _spool(
        tmp_path,
        300,
        model_name=long("model"),
        engine=lambda i: str(i).rjust(MAX_ENGINE_CHARS, "9"),
        device=lambda i: f"cuda:{i}",
        pod=lambda i: {"pod": long("pod")(i)[:253], "namespace": "n" * 253, "container": "c" * 253},
    )
    sidecar = Sidecar(SidecarConfig(spool_dir=spool, pod_labels=POD))
    body, content_type = Exposition(sidecar).body(accept, False)
    assert len(body) < 5_000_000
    cut = sidecar.observe().cut
    assert sum(cut.values()) >= 300 - 128
    if "openmetrics" not in content_type:
        checked = subprocess.run([promtool(), "check", "metrics"], input=body, capture_output=True, timeout=60)
        assert checked.returncode == 0, checked.stderr[:300]


def test_every_text_format_shares_one_cached_body_and_the_librarys_encodings_keep_one(tmp_path):
    sidecar = Sidecar(SidecarConfig(spool_dir=_spool(tmp_path, 2), pod_labels=POD))
    exposition = Exposition(sidecar, max_age=3600)
    first = exposition.parts("text/plain; version=0.0.4", False)[0]
    assert exposition.parts("text/plain", False)[0] is first
    assert exposition.parts("*/*", False)[0] is first
    for escaping in ("values", "dots", "underscores"):
        exposition.parts(f"application/openmetrics-text; version=1.0.0; escaping={escaping}", False)
        exposition.parts(f"text/plain; version=1.0.0; escaping={escaping}", False)
    assert sum(key[0] == "library" for key in exposition._bodies) == 1


@pytest.mark.parametrize("field", ["pod", "namespace"])
def test_label_values_that_differ_only_past_the_cut_make_one_series_not_two(tmp_path, field):
    """Issue 37, round four: label values were cut after ranks were told apart, so two ranks whose
    pod (or namespace) differs only past character 128 became two series with one label set (40
    duplicated samples: Prometheus drops them; this promtool does not flag them, the parser check
    below does) and log_changes keyed both as one. Values are now cut before ranks are told apart:
    the newest is kept, the other counted as a duplicate (kvguard_spool_skipped_files)."""
    now = time.time()
    for index, host in enumerate(("node-a", "node-b")):  # two writers, same pid, device and rank
        value = ("x" * 128 + f"-{host}").ljust(253, "y")
        pod = {"pod": "vllm-0", "namespace": "llm", "container": "vllm", field: value}
        write(str(tmp_path), snapshot(host=host, pod=pod, written_at=now - 10 + index))
    sidecar = Sidecar(SidecarConfig(spool_dir=str(tmp_path), pod_labels=POD))
    observation = sidecar.observe()
    [rank] = observation.ranks
    assert rank.snapshot.host == "node-b" and len(rank.labels[field]) == 128
    assert observation.skipped["duplicate"] == 1 and observation.labels_truncated == 1
    body = _metrics(sidecar)
    for family in text_string_to_metric_families(body.decode()):
        label_sets = [(sample.name, tuple(sorted(sample.labels.items()))) for sample in family.samples]
        assert len(label_sets) == len(set(label_sets)), family.name
    assert len(re.findall(rb"^kvguard_guard_severity\{", body, re.M)) == 1
    skipped = {f.name: f for f in text_string_to_metric_families(body.decode())}["kvguard_spool_skipped_files"]
    assert {s.labels["reason"]: s.value for s in skipped.samples}["duplicate"] == 1
    checked = subprocess.run([promtool(), "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert checked.returncode == 0, checked.stderr[:300]
    sidecar.log_changes(observation)
    assert len(sidecar._logged_ranks) == 1


def test_junk_ranks_that_sort_first_cannot_push_a_live_rank_out(tmp_path):
    """Issue 37, item 1: ranks were admitted in label order, so max_ranks junk files whose labels
    sort first pushed out the one live rank. Now a writer /proc shows alive here goes first (the
    junk here is even dated later than the live rank), then a fresh one before a stale one."""
    import os
    import socket

    now = time.time()
    for index in range(6):  # device "a..." sorts before "npu:7"; pids no /proc here can check
        write(
            str(tmp_path), snapshot(rank=index, device=f"a{index}", pid=1000 + index, host="elsewhere", written_at=now)
        )
    live = snapshot(rank=7, device="npu:7", pid=os.getpid(), written_at=now - 2)
    write(str(tmp_path), live.__class__(**{**live.__dict__, "host": socket.gethostname(), "started_at": now - 1}))
    observation = Sidecar(SidecarConfig(spool_dir=str(tmp_path), pod_labels=POD, max_ranks=4)).observe()
    assert str(os.getpid()) in {view.labels["pid"] for view in observation.ranks}
    assert len(observation.ranks) == 4 and observation.cut == {"max_ranks": 3}


def test_past_a_cap_fresh_ranks_are_kept_over_stale_ones(tmp_path):
    """Ranks written within stale_after go before those written longer ago, whose labels sort first."""
    now = time.time()
    for index in range(6):  # ranks 0-3 a minute old (stale_after is 30 s), 4 and 5 fresh
        write(
            str(tmp_path),
            snapshot(
                rank=index,
                device=f"npu:{index}",
                pid=1000 + index,
                host="elsewhere",
                written_at=now - 60 if index < 4 else now - 5,
            ),
        )
    observation = Sidecar(SidecarConfig(spool_dir=str(tmp_path), pod_labels=POD, max_ranks=2)).observe()
    assert sorted(view.labels["rank"] for view in observation.ranks) == ["4", "5"]


def test_past_a_cap_the_admitted_ranks_stay_the_same_while_the_probes_rewrite_at_their_own_moments(tmp_path):
    """Review: ranks were admitted most recently written first, so each refresh kept whichever
    probes had just rewritten their snapshots, and the series past the cap came and went."""
    sidecar = Sidecar(SidecarConfig(spool_dir=str(tmp_path), pod_labels=POD, max_ranks=3))
    admitted = []
    now = time.time()
    for newest_first in (False, True):  # the high ranks written last, then the low ones
        for index in range(6):
            written_at = now - 10 + (5 - index if newest_first else index)
            write(
                str(tmp_path),
                snapshot(rank=index, device=f"npu:{index}", pid=1000 + index, host="elsewhere", written_at=written_at),
            )
        observation = sidecar.observe()
        assert observation.cut == {"max_ranks": 3}
        admitted.append(sorted(view.labels["rank"] for view in observation.ranks))
    assert admitted[0] == admitted[1] == ["0", "1", "2"]
