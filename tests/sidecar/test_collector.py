"""The collector: fresh families per scrape from real spool snapshots, sources and vLLM."""

from __future__ import annotations

import os
import threading
import time

import pytest
from helpers import within
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sidecar_fixtures import GIB, snapshot, write

from kvguard.records import DeviceMemory, ProcessMemory
from kvguard.sidecar.collector import KVGuardCollector
from kvguard.sidecar.core import Sidecar, SidecarConfig
from kvguard.vllm.log import parse_lines

POD = {"pod": "", "namespace": "", "container": ""}


def scrape(sidecar: Sidecar) -> dict[str, list]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KVGuardCollector(sidecar))
    text = generate_latest(registry).decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def scrape_within(sidecar: Sidecar, seconds: float = 30) -> dict[str, list]:
    """A scrape that must return within ``seconds`` whatever the sources are doing."""
    return within(seconds, lambda: scrape(sidecar), "a scrape")


def value(samples, name, **labels):
    matches = [v for got, v in samples.get(name, []) if all(got.get(k) == str(x) for k, x in labels.items())]
    assert len(matches) == 1, f"{name} {labels}: {matches}"
    return matches[0]


def sidecar_for(spool_dir, **options) -> Sidecar:
    return Sidecar(SidecarConfig(spool_dir=str(spool_dir), pod_labels=dict(POD), **options))


class StaticSource:
    def __init__(self, records):
        self.records = records

    def sample(self):
        return self.records


class HangingSource:
    def __init__(self):
        self.release = threading.Event()

    def sample(self):
        self.release.wait()
        return []


class FailingSource:
    def sample(self):
        raise RuntimeError("nvmlInit failed: NVML_ERROR_DRIVER_NOT_LOADED")


def test_every_rank_gets_allocator_series_with_rank_labels(tmp_path):
    write(
        tmp_path,
        snapshot(rank=0, device="npu:0", pid=100, allocated=52 * GIB, reserved=54 * GIB),
        snapshot(rank=1, device="npu:1", pid=101, allocated=52 * GIB, reserved=54 * GIB),
    )
    samples = scrape(sidecar_for(tmp_path))
    for rank, device, pid in ((0, "npu:0", 100), (1, "npu:1", 101)):
        labels = dict(rank=rank, device=device, pid=pid, pod="vllm-0", namespace="llm", container="vllm")
        assert value(samples, "kvguard_allocator_allocated_bytes", **labels) == 52 * GIB
        assert value(samples, "kvguard_allocator_reserved_bytes", **labels) == 54 * GIB


def test_fragmentation_is_reserved_minus_allocated(tmp_path):
    write(tmp_path, snapshot(allocated=50 * GIB, reserved=53 * GIB))
    samples = scrape(sidecar_for(tmp_path))
    assert value(samples, "kvguard_allocator_fragmentation_bytes") == 3 * GIB
    assert value(samples, "kvguard_allocator_fragmentation_ratio") == pytest.approx(3 / 53)


def test_counters_are_exposed_with_total_suffix(tmp_path):
    write(tmp_path, snapshot(retries=3, ooms=1))
    samples = scrape(sidecar_for(tmp_path))
    assert value(samples, "kvguard_allocator_alloc_retries_total") == 3
    assert value(samples, "kvguard_allocator_ooms_total") == 1


def test_budgets_overcommit_and_guard_state_per_rank(tmp_path):
    write(tmp_path, snapshot())
    samples = scrape(sidecar_for(tmp_path))
    stock = value(samples, "kvguard_kv_cache_budget_bytes", budget="stock")
    reserved = value(samples, "kvguard_kv_cache_budget_bytes", budget="reserved")
    assert value(samples, "kvguard_kv_cache_overcommit_bytes") == stock - reserved > 0
    assert value(samples, "kvguard_guard_state", state="warning") == 1
    assert value(samples, "kvguard_guard_state", state="ok") == 0
    assert value(samples, "kvguard_guard_severity") == 1
    assert value(samples, "kvguard_guard_reason", reason="overcommitted") == 1


def test_projected_peak_beyond_capacity_is_critical_with_negative_headroom(tmp_path):
    write(tmp_path, snapshot(utilization=0.99))
    samples = scrape(sidecar_for(tmp_path))
    assert value(samples, "kvguard_guard_state", state="critical") == 1
    assert value(samples, "kvguard_guard_headroom_bytes") < 0
    assert value(samples, "kvguard_guard_projected_peak_bytes") > value(samples, "kvguard_guard_capacity_bytes")


def test_a_rank_that_disappears_leaves_no_series(tmp_path):
    write(tmp_path, snapshot(rank=0, pid=100), snapshot(rank=1, device="npu:1", pid=101))
    sidecar = sidecar_for(tmp_path)
    assert len(scrape(sidecar)["kvguard_allocator_allocated_bytes"]) == 2
    os.unlink(next(p for p in tmp_path.iterdir() if "-101-" in p.name))
    sidecar.refresh_background(wait=5)  # the next background spool read
    assert len(scrape(sidecar)["kvguard_allocator_allocated_bytes"]) == 1


def test_hostile_spool_files_are_counted_by_reason(tmp_path):
    write(tmp_path, snapshot())
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"kind": "something else"}')
    (tmp_path / "huge.json").write_bytes(b" " * (300 * 1024))
    os.symlink("/etc/passwd", tmp_path / "link.json")
    samples = scrape(sidecar_for(tmp_path))
    assert value(samples, "kvguard_spool_snapshots") == 1
    assert value(samples, "kvguard_spool_skipped_files", reason="invalid_json") == 1
    assert value(samples, "kvguard_spool_skipped_files", reason="invalid_snapshot") == 1
    assert value(samples, "kvguard_spool_skipped_files", reason="too_large") == 1
    assert value(samples, "kvguard_spool_skipped_files", reason="not_regular_file") == 1


def test_two_snapshots_with_the_same_labels_keep_the_newest_and_count_a_duplicate(tmp_path):
    older, newer = snapshot(written_at=1000.0), snapshot(written_at=2000.0, allocated=51 * GIB)
    write(tmp_path, older)
    other_host = newer.__class__(**{**newer.__dict__, "host": "node-8"})
    write(tmp_path, other_host)
    samples = scrape(sidecar_for(tmp_path, stale_after=1e12))
    assert value(samples, "kvguard_allocator_allocated_bytes") == 51 * GIB
    assert value(samples, "kvguard_spool_skipped_files", reason="duplicate") == 1


def test_missing_spool_directory_is_a_down_source_not_an_error(tmp_path):
    samples = scrape(sidecar_for(tmp_path / "absent"))
    assert value(samples, "kvguard_source_up", source="spool") == 0
    assert value(samples, "kvguard_source_errors_total", source="spool") == 1


def test_snapshot_age_and_staleness(tmp_path):
    write(tmp_path, snapshot(written_at=time.time() - 60))
    samples = scrape(sidecar_for(tmp_path, stale_after=30))
    assert value(samples, "kvguard_snapshot_age_seconds") > 30
    assert value(samples, "kvguard_snapshot_stale") == 1
    assert value(samples, "kvguard_guard_reason", reason="snapshot_stale") == 1


def test_pod_labels_come_from_the_downward_api_when_the_snapshot_has_none(tmp_path):
    write(tmp_path, snapshot(pod={}, allocated=52 * GIB))
    sidecar = Sidecar(
        SidecarConfig(
            spool_dir=str(tmp_path), pod_labels={"pod": "vllm-7", "namespace": "serving", "container": "kvguard"}
        )
    )
    samples = scrape(sidecar)
    assert (
        value(samples, "kvguard_allocator_allocated_bytes", pod="vllm-7", namespace="serving", container="kvguard")
        == 52 * GIB
    )


def test_device_sources_export_total_used_free_and_processes_as_cached(tmp_path):
    record = DeviceMemory(
        device="0",
        source="nvml",
        total_bytes=80 * GIB,
        used_bytes=70 * GIB,
        free_bytes=10 * GIB,
        processes=(ProcessMemory(pid=2171, used_bytes=69 * GIB, name="python3"),),
    )
    sidecar = Sidecar(SidecarConfig(sources=[("nvml", StaticSource([record]))], pod_labels=dict(POD)))
    sidecar.refresh_background(wait=5)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KVGuardCollector(sidecar))
    text = generate_latest(registry).decode()
    samples = scrape(sidecar)
    assert value(samples, "kvguard_device_total_bytes", device="0", source="nvml") == 80 * GIB
    assert value(samples, "kvguard_device_free_bytes", device="0", source="nvml") == 10 * GIB
    assert value(samples, "kvguard_device_process_used_bytes", pid=2171) == 69 * GIB
    assert value(samples, "kvguard_source_up", source="nvml") == 1
    assert (
        "# HELP kvguard_device_total_bytes Device memory capacity as the device-level source reports it. Cached" in text
    )


def test_a_hanging_source_never_holds_up_a_scrape(tmp_path):
    hanging = HangingSource()
    sidecar = Sidecar(SidecarConfig(sources=[("npu-smi", hanging)], read_timeout=0.05, pod_labels=dict(POD)))
    try:
        sidecar.refresh_background(wait=0.05)
        result = scrape_within(sidecar)
        assert value(result, "kvguard_source_up", source="npu-smi") == 0
        assert value(result, "kvguard_source_errors_total", source="npu-smi") == 1
    finally:
        hanging.release.set()


class CountingSource:
    def __init__(self, delay=0.0):
        self.delay = delay
        self.reads = 0

    def sample(self):
        self.reads += 1
        time.sleep(self.delay)
        return []


def test_a_background_refresh_reads_each_source_once():
    # The slow source is waited on first: by then the fast one has finished, and waiting on
    # it must not read it again.
    slow, fast = CountingSource(delay=0.2), CountingSource()
    sidecar = Sidecar(SidecarConfig(sources=[("slow", slow), ("fast", fast)], pod_labels=dict(POD)))
    sidecar.refresh_background(wait=5)
    assert (slow.reads, fast.reads) == (1, 1)
    sidecar.refresh_background(wait=5)
    assert (slow.reads, fast.reads) == (2, 2)


def test_a_failing_source_is_down_and_says_why_in_the_guard(tmp_path):
    sidecar = Sidecar(SidecarConfig(sources=[("nvml", FailingSource())], pod_labels=dict(POD)))
    sidecar.refresh_background(wait=5)
    samples = scrape(sidecar)
    assert value(samples, "kvguard_source_up", source="nvml") == 0
    assert (
        sidecar.observe().guard_dict()["sources"]["nvml"]["last_error"]
        == "nvmlInit failed: NVML_ERROR_DRIVER_NOT_LOADED"
    )


def test_retries_climbing_between_scrapes_turn_the_rank_critical(tmp_path):
    sidecar = sidecar_for(tmp_path)
    write(tmp_path, snapshot(retries=2, utilization=0.8))
    assert value(scrape(sidecar), "kvguard_guard_state", state="critical") == 0
    write(tmp_path, snapshot(retries=5, utilization=0.8))
    sidecar.refresh_background(wait=5)
    samples = scrape(sidecar)
    assert value(samples, "kvguard_guard_state", state="critical") == 1
    assert value(samples, "kvguard_guard_reason", reason="alloc_retries_climbing") == 1


def test_the_background_loop_samples_the_counters_the_next_scrape_judges(tmp_path):
    # What the background loop does between scrapes: read the spool, feed the counter window.
    sidecar = sidecar_for(tmp_path)
    write(tmp_path, snapshot(retries=2, ooms=1, utilization=0.8))
    sidecar.refresh_background(wait=5)
    sidecar.sample_counters()
    write(tmp_path, snapshot(retries=5, ooms=1, utilization=0.8))
    sidecar.refresh_background(wait=5)
    verdict = sidecar.observe().ranks[0].verdict
    assert verdict.state == "critical"
    assert "alloc_retries_climbing" in verdict.reason_codes and "ooms_climbing" not in verdict.reason_codes


def test_from_log_alone_judges_the_engine_the_log_describes(data_path):
    with open(data_path("logs", "v1-tp2-debug.log"), encoding="utf-8") as handle:
        startup = parse_lines(handle)
    samples = scrape(Sidecar(SidecarConfig(startup_log=startup, pod_labels=dict(POD))))
    assert value(samples, "kvguard_kv_cache_budget_bytes", budget="stock") > 37 * GIB
    assert value(samples, "kvguard_kv_cache_allocated_bytes") == startup.available_kv_cache_bytes
    assert value(samples, "kvguard_guard_state", state="ok") == 1  # no reserved peak known: nothing to flag


def test_the_log_profile_fills_in_for_a_snapshot_without_one(tmp_path, data_path):
    with open(data_path("logs", "v1-tp2-debug.log"), encoding="utf-8") as handle:
        startup = parse_lines(handle)
    write(tmp_path, snapshot(profile=None, allocated=50 * GIB, reserved=52 * GIB))
    samples = scrape(sidecar_for(tmp_path, startup_log=startup))
    assert value(samples, "kvguard_profile_weights_bytes") == startup.weights_bytes
    # reserved activation peak inferred: allocated peak + live fragmentation
    assert (
        value(samples, "kvguard_profile_activation_peak_bytes", measure="reserved")
        == startup.peak_allocated_increase_bytes + 2 * GIB
    )


def test_build_info_is_always_there(tmp_path):
    samples = scrape(Sidecar(SidecarConfig(pod_labels=dict(POD))))
    ((labels, one),) = samples["kvguard_build_info"]
    assert one == 1 and labels["version"]


def test_a_device_number_no_float_can_hold_is_left_out_not_a_failed_scrape():
    record = DeviceMemory(device="0", source="npu-smi", total_bytes=10**400, used_bytes=70 * GIB)
    sidecar = Sidecar(SidecarConfig(sources=[("npu-smi", StaticSource([record]))], pod_labels=dict(POD)))
    sidecar.refresh_background(wait=5)
    samples = scrape(sidecar)
    assert "kvguard_device_total_bytes" not in samples
    assert value(samples, "kvguard_device_used_bytes", device="0") == 70 * GIB


def test_a_scrape_serves_the_last_background_spool_read(tmp_path):
    write(tmp_path, snapshot(rank=0, pid=100))
    sidecar = sidecar_for(tmp_path)
    assert len(scrape(sidecar)["kvguard_allocator_allocated_bytes"]) == 1  # the first read
    write(tmp_path, snapshot(rank=1, device="npu:1", pid=101))
    assert len(scrape(sidecar)["kvguard_allocator_allocated_bytes"]) == 1  # no read at scrape time
    sidecar.refresh_background(wait=5)
    assert len(scrape(sidecar)["kvguard_allocator_allocated_bytes"]) == 2


def test_spool_families_say_they_are_read_in_the_background(tmp_path):
    write(tmp_path, snapshot())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KVGuardCollector(sidecar_for(tmp_path)))
    text = generate_latest(registry).decode()
    assert "# HELP kvguard_spool_snapshots Snapshots read from the spool at its last read. Cached" in text
    assert (
        "as of the last spool read. The spool is read in the background every 5s, see "
        'kvguard_source_cache_age_seconds{source="spool"}' in text
    )


def test_a_spool_read_stops_at_its_byte_budget(tmp_path):
    import os

    from kvguard.spool.io import read_spool

    write(tmp_path, *(snapshot(rank=r, device=f"npu:{r}", pid=100 + r) for r in range(3)))
    # The reader takes the newest files first: give them distinct ages so which two fit is defined.
    files = sorted(tmp_path.iterdir())
    for age, path in enumerate(files):
        os.utime(path, (1_700_000_000 - age, 1_700_000_000 - age))
    sizes = [p.stat().st_size for p in files]  # newest first
    result = read_spool(str(tmp_path), max_total_bytes=sizes[0] + sizes[1])
    assert len(result.snapshots) == 2
    assert result.skipped == {"too_many_files": 1}


def test_a_spool_that_cannot_be_listed_says_so_once(tmp_path):
    missing = tmp_path / "missing"
    sidecar = sidecar_for(missing)
    assert (
        sidecar.observe().guard_dict()["sources"]["spool"]["last_error"]
        == f"cannot list spool directory {missing}: No such file or directory"
    )


def test_ranks_aged_out_are_counted_by_reason_and_export_no_series(tmp_path):
    write(tmp_path, snapshot(pid=10, written_at=time.time() - 1000), snapshot(pid=11, device="npu:1", rank=1))
    samples = scrape(sidecar_for(tmp_path, stale_after=30))
    assert value(samples, "kvguard_spool_aged_out_ranks", reason="not_written") == 1
    assert value(samples, "kvguard_spool_aged_out_ranks", reason="process_exited") == 0
    assert [labels["pid"] for labels, _ in samples["kvguard_guard_severity"]] == ["11"]
