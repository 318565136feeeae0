"""The Prometheus collector: fresh metric families from the sidecar's latest observation.

A custom collector in client_python's sense: ``collect()`` builds new families on every
scrape and the class holds no gauges, so a rank that disappears leaves no stale series.
Names, labels and HELP are the contract in docs/metrics.md.

The families are made one at a time (a generator, family by family over every rank), so a
spool of thousands of ranks never holds all its samples at once while it is encoded.
"""

from __future__ import annotations

import platform
from typing import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvguard import __version__
from kvguard.guard.judge import REASON_CODES, SEVERITY, STATES
from kvguard.sidecar.core import Sidecar
from kvguard.sidecar.observation import (
    AGED_OUT_REASONS,
    CUT_REASONS,
    DUPLICATE,
    RANK_LABELS,
    SPOOL,
    Observation,
    RankView,
)
from kvguard.spool.io import SKIP_REASONS
from kvguard.text import safe_text

DEVICE_LABELS = ("device", "source", "pod", "namespace", "container")
# Which device a series is about, for joins with dcgm-exporter and npu-exporter (docs/metrics.md):
# on device series, and on rank series with the vLLM engine the rank serves ("" where unknown):
# model_name and engine as vLLM labels its own series (engine: the data-parallel index), engine_id
# the same on every pod of one engine, so that rules aggregate a multi-node engine once.
IDENTITY_LABELS = ("device_uuid", "pci_bus_id")
RANK_IDENTITY_LABELS = IDENTITY_LABELS + ("model_name", "engine", "engine_id")
SKIP_REASON_VALUES = SKIP_REASONS + (DUPLICATE,)
# The families this exporter builds: both take samples with add_metric(labels, value).
_Family = GaugeMetricFamily | CounterMetricFamily


class _Families:
    """Families in declaration order; empty ones are left out of the exposition."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}

    def gauge(self, name: str, doc: str, labels: Iterable[str] = ()) -> _Family:
        return self._families.setdefault(name, GaugeMetricFamily(name, doc, labels=list(labels)))

    def counter(self, name: str, doc: str, labels: Iterable[str] = ()) -> _Family:
        return self._families.setdefault(name, CounterMetricFamily(name, doc, labels=list(labels)))

    def __getitem__(self, name: str) -> _Family:
        return self._families[name]

    def __iter__(self) -> Iterator[Metric]:
        return (family for family in self._families.values() if family.samples)


def _add(family: _Family, labels: list[str], value: float | int | None) -> None:
    """Add one sample; a value that is not a number float() can hold is left out, never raised."""
    if value is None:
        return
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):  # e.g. an int beyond 1.8e308 from a hostile snapshot
        return
    family.add_metric(labels, number)


class KVGuardCollector(Collector):
    def __init__(self, sidecar: Sidecar):
        self.sidecar = sidecar
        # The server renders one observation for every scrape of a refresh: it pins it here.
        self.pinned: Observation | None = None

    def describe(self) -> list[Metric]:
        # Registering must not read the spool or the sources (client_python calls collect()
        # at registration otherwise).
        return []

    def collect(self) -> Iterator[Metric]:
        return iter(families(self.pinned if self.pinned is not None else self.sidecar.observe()))


def _memory(field: str) -> Callable[[RankView], tuple]:
    return lambda v: (((), getattr(v.snapshot.memory, field)),) if v.snapshot is not None else ()


def _verdict(field: str) -> Callable[[RankView], tuple]:
    return lambda v: (((), getattr(v.verdict, field)),)


def _profile(field: str) -> Callable[[RankView], tuple]:
    return lambda v: (((), getattr(v.profile, field)),) if v.profile is not None else ()


def _activation_peaks(view: RankView) -> tuple:
    if view.profile is None:
        return ()
    return (
        (("allocated",), view.profile.peak_allocated_increase_bytes),
        (("reserved",), view.verdict.activation_reserved_peak_bytes),
    )


def _reason_samples(verdict) -> tuple:
    active = set(verdict.reason_codes)
    return tuple(((code,), 1.0 if code in active else 0.0) for code in REASON_CODES)


def _reasons(view: RankView) -> tuple:
    return _reason_samples(view.verdict)


def _at_budget(samples: Callable) -> Callable[[RankView], tuple]:
    """Samples of the budget-time verdict, for the ranks that have one."""
    return lambda v: samples(v.at_budget) if v.at_budget is not None else ()


# (type, name, HELP, extra labels, samples) for every per-rank family, in exposition order;
# samples(view) gives (extra label values, value) pairs, a value of None leaving the sample out.
_RANK_FAMILIES = (
    (
        "gauge",
        "kvguard_allocator_allocated_bytes",
        "Bytes the framework allocator has handed out to tensors "
        "(torch allocated_bytes.all.current, MindSpore total_allocated_memory).",
        (),
        _memory("allocated_bytes"),
    ),
    (
        "gauge",
        "kvguard_allocator_reserved_bytes",
        "Bytes the framework allocator holds from the device (reserved_bytes.all.current, total_reserved_memory).",
        (),
        _memory("reserved_bytes"),
    ),
    (
        "gauge",
        "kvguard_allocator_peak_allocated_bytes",
        "Peak allocated bytes since start or the last peak reset.",
        (),
        _memory("peak_allocated_bytes"),
    ),
    (
        "gauge",
        "kvguard_allocator_peak_reserved_bytes",
        "Peak reserved bytes since start or the last peak reset.",
        (),
        _memory("peak_reserved_bytes"),
    ),
    (
        "gauge",
        "kvguard_allocator_fragmentation_bytes",
        "Reserved minus allocated: memory the allocator holds that tensors cannot use.",
        (),
        _memory("fragmentation_bytes"),
    ),
    (
        "gauge",
        "kvguard_allocator_fragmentation_ratio",
        "Fragmentation bytes over reserved bytes (0 when nothing is reserved).",
        (),
        _memory("fragmentation_ratio"),
    ),
    (
        "gauge",
        "kvguard_allocator_inactive_split_bytes",
        "Free bytes inside split segments that cannot be released (torch inactive_split_bytes.all.current).",
        (),
        _memory("inactive_split_bytes"),
    ),
    (
        "counter",
        "kvguard_allocator_alloc_retries_total",
        "Allocations that succeeded only after the allocator flushed its cache and retried (num_alloc_retries).",
        (),
        _memory("alloc_retries"),
    ),
    (
        "counter",
        "kvguard_allocator_ooms_total",
        "Out-of-memory errors the allocator raised (num_ooms).",
        (),
        _memory("ooms"),
    ),
    (
        "gauge",
        "kvguard_kv_cache_allocated_bytes",
        "KV cache the serving engine allocated (num_gpu_blocks x block "
        "bytes); the stock budget when the block count is unknown.",
        (),
        _verdict("kv_cache_bytes"),
    ),
    (
        "gauge",
        "kvguard_kv_cache_allocated_blocks",
        "KV-cache blocks the serving engine allocated (vLLM num_gpu_blocks).",
        (),
        lambda v: (((), v.kv_cache_blocks),),
    ),
    (
        "gauge",
        "kvguard_kv_cache_usage_ratio",
        "Fraction of KV-cache blocks in use, from vLLM vllm:kv_cache_usage_perc.{cached}",
        (),
        lambda v: (((), v.kv_cache_usage_ratio),),
    ),
    (
        "gauge",
        "kvguard_kv_cache_budget_bytes",
        "KV-cache budget from the startup profile: stock is vLLM's (total x "
        "utilization - weights - allocated activation peak - non-torch), reserved uses the reserved activation peak "
        "instead.",
        ("budget",),
        lambda v: ((("stock",), v.verdict.stock_budget_bytes), (("reserved",), v.verdict.reserved_budget_bytes)),
    ),
    (
        "gauge",
        "kvguard_kv_cache_overcommit_bytes",
        "How much the stock budget exceeds the reserved-aware budget (0 when it does not).",
        (),
        _verdict("overcommit_bytes"),
    ),
    (
        "gauge",
        "kvguard_profile_weights_bytes",
        "Model weights on this rank, from the startup profile.",
        (),
        _profile("weights_bytes"),
    ),
    (
        "gauge",
        "kvguard_profile_activation_peak_bytes",
        "Increase of the allocator's allocated (or reserved) peak during vLLM's profiling run.",
        ("measure",),
        _activation_peaks,
    ),
    (
        "gauge",
        "kvguard_profile_non_torch_bytes",
        "Increase of memory outside the framework allocator during profiling (may be negative).",
        (),
        _profile("non_torch_increase_bytes"),
    ),
    (
        "gauge",
        "kvguard_profile_gpu_memory_utilization_ratio",
        "vLLM's gpu_memory_utilization for this rank.",
        (),
        _profile("gpu_memory_utilization"),
    ),
    (
        "gauge",
        "kvguard_guard_state",
        "1 for the guard's current state of this rank, 0 for the other two states.",
        ("state",),
        lambda v: tuple(((name,), 1.0 if v.verdict.state == name else 0.0) for name in STATES),
    ),
    (
        "gauge",
        "kvguard_guard_severity",
        "Guard state as a number: 0 ok, 1 warning, 2 critical.",
        (),
        lambda v: (((), float(SEVERITY[v.verdict.state])),),
    ),
    (
        "gauge",
        "kvguard_guard_reason",
        "1 for each reason the guard currently reports for this rank, 0 for the other reason codes.",
        ("reason",),
        _reasons,
    ),
    (
        "gauge",
        "kvguard_guard_projected_peak_bytes",
        "Projected device peak: weights + KV cache allocated + reserved activation peak + non-torch.",
        (),
        _verdict("projected_peak_bytes"),
    ),
    (
        "gauge",
        "kvguard_guard_capacity_bytes",
        "Device memory the projected peak must fit in (the profile's total memory).",
        (),
        _verdict("capacity_bytes"),
    ),
    (
        "gauge",
        "kvguard_guard_headroom_bytes",
        "Capacity minus projected peak; negative means the projected peak does not fit.",
        (),
        _verdict("headroom_bytes"),
    ),
    (
        "gauge",
        "kvguard_guard_budget_severity",
        "The budget-time verdict (judged when vLLM fixed its KV budget, "
        "before the KV cache existed) as a number: 0 ok, 1 warning, 2 critical.",
        (),
        _at_budget(lambda verdict: (((), float(SEVERITY[verdict.state])),)),
    ),
    (
        "gauge",
        "kvguard_guard_budget_reason",
        "1 for each reason of the budget-time verdict, 0 for the other reason codes.",
        ("reason",),
        _at_budget(_reason_samples),
    ),
    (
        "gauge",
        "kvguard_guard_budget_headroom_bytes",
        "Capacity minus projected peak at budget time, the KV tensors placed by the allocator's rules.",
        (),
        _at_budget(lambda verdict: (((), verdict.headroom_bytes),)),
    ),
    (
        "gauge",
        "kvguard_snapshot_age_seconds",
        "Seconds since the probe wrote this rank's latest snapshot, as of the last spool read.{spool_cached}",
        (),
        lambda v: (((), v.age_seconds),) if v.snapshot is not None else (),
    ),
    (
        "gauge",
        "kvguard_snapshot_stale",
        "1 when the snapshot is older than --stale-after.",
        (),
        lambda v: (((), 1 if v.stale else 0),) if v.snapshot is not None else (),
    ),
    (
        "counter",
        "kvguard_probe_samples_total",
        "Samples the in-process probe has taken.",
        (),
        lambda v: (((), v.snapshot.probe.samples_total),) if v.snapshot is not None else (),
    ),
    (
        "counter",
        "kvguard_probe_errors_total",
        "Samples the in-process probe failed to take or write.",
        (),
        lambda v: (
            (((), v.snapshot.probe.errors_total + v.snapshot.probe.write_errors_total),)
            if v.snapshot is not None
            else ()
        ),
    ),
    (
        "counter",
        "kvguard_probe_engine_thread_seconds_total",
        "Seconds the serving engine's own thread spent in the "
        "probe's samples (sources read between the engine's steps, MindSpore's; 0 where the probe samples on a thread "
        "of its own).",
        (),
        lambda v: (((), v.snapshot.probe.engine_thread_seconds_total),) if v.snapshot is not None else (),
    ),
    (
        "counter",
        "kvguard_probe_skipped_total",
        "Inputs beside the counters the probe skipped (MindSpore's pool dump "
        "in exact mode: too large, not text, cut short or malformed); the first of each kind is logged.",
        (),
        lambda v: (((), v.snapshot.probe.skipped_total),) if v.snapshot is not None else (),
    ),
    (
        "gauge",
        "kvguard_probe_sample_age_seconds",
        "Seconds between the reading of the rank's memory counters and the "
        "probe's write of the snapshot (between an idle engine's steps the probe rewrites its last reading).",
        (),
        lambda v: (
            (((), max(0.0, v.snapshot.written_at - v.snapshot.probe.sampled_at)),)
            if v.snapshot is not None and v.snapshot.probe.sampled_at is not None
            else ()
        ),
    ),
)


def _samples_per_rank() -> int:
    """The most samples one rank can have across _RANK_FAMILIES."""
    wider = {
        "kvguard_kv_cache_budget_bytes": 2,
        "kvguard_profile_activation_peak_bytes": 2,
        "kvguard_guard_state": len(STATES),
        "kvguard_guard_reason": len(REASON_CODES),
        "kvguard_guard_budget_reason": len(REASON_CODES),
    }
    return sum(wider.get(name, 1) for _, name, _, _, _ in _RANK_FAMILIES)


SAMPLES_PER_RANK = _samples_per_rank()
# A sample line's bytes beside its rank's label text: the longest name with _total, the widest
# extra label (reason="..."), braces, commas and quotes, a value as floatToGoString writes it, and
# "escaping=values" writing a name as U__ with its dots.
SAMPLE_OVERHEAD_BYTES = (
    2 * max(len(name) for _, name, _, _, _ in _RANK_FAMILIES) + 20 + max(len(code) for code in REASON_CODES) + 40
)


def _rank_bytes(labels: list[str]) -> int:
    """An upper bound on the bytes of one rank's sample lines in either format."""
    text = sum(len(name) + 4 for name in RANK_LABELS + RANK_IDENTITY_LABELS) + sum(
        2 * len(value.encode("utf-8")) for value in labels
    )  # escaping at most doubles a value
    return SAMPLES_PER_RANK * (SAMPLE_OVERHEAD_BYTES + text)


def families(obs: Observation) -> Iterator[Metric]:
    """Every non-empty family, in exposition order, one at a time. Ranks whose series would take
    the exposition past ``obs.max_metrics_bytes`` are left out (counted as max_bytes)."""
    cached = f" Cached: read in the background every {obs.interval_seconds:g}s, see kvguard_source_cache_age_seconds."
    spool_cached = (
        f" The spool is read in the background every {obs.interval_seconds:g}s, "
        'see kvguard_source_cache_age_seconds{source="spool"}.'
    )
    rank_labels = []
    ranks = []
    used = 0
    over_bytes = 0
    for view in obs.ranks:
        identity = view.identity()
        labels = [view.labels[k] for k in RANK_LABELS] + [identity[k] for k in RANK_IDENTITY_LABELS]
        cost = _rank_bytes(labels)
        if obs.max_metrics_bytes is not None and used + cost > obs.max_metrics_bytes:
            over_bytes += 1
            continue
        used += cost
        ranks.append(view)
        rank_labels.append(labels)
    for kind, name, doc, extra, samples in _RANK_FAMILIES:
        doc = doc.replace("{cached}", cached).replace("{spool_cached}", spool_cached)
        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
            name, doc, labels=list(RANK_LABELS + RANK_IDENTITY_LABELS + extra)
        )
        for view, labels in zip(ranks, rank_labels):
            for extra_values, value in samples(view):
                _add(family, labels + list(extra_values), value)
        if family.samples:
            yield family
    yield from _other_families(obs, cached, over_bytes)


def _other_families(obs: Observation, cached: str, over_bytes: int = 0) -> _Families:
    fam = _Families()
    dev_labels = list(DEVICE_LABELS + IDENTITY_LABELS)
    dev_total = fam.gauge(
        "kvguard_device_total_bytes",
        "Device memory capacity as the device-level source reports it." + cached,
        dev_labels,
    )
    dev_used = fam.gauge("kvguard_device_used_bytes", "Device memory in use by all processes." + cached, dev_labels)
    dev_free = fam.gauge("kvguard_device_free_bytes", "Device memory free." + cached, dev_labels)
    dev_driver = fam.gauge(
        "kvguard_device_driver_reserved_bytes",
        "Device memory the driver keeps for itself, outside total - free (NVML nvmlMemory_v2 reserved)." + cached,
        dev_labels,
    )
    dev_process = fam.gauge(
        "kvguard_device_process_used_bytes",
        "Device memory one process holds, as the driver sees it (reserved plus context overhead)." + cached,
        dev_labels + ["pid"],
    )
    seen_devices: set[tuple] = set()
    for view in obs.devices:
        labels = [safe_text(str(view.labels[k]), 253) for k in DEVICE_LABELS]  # names a driver reported
        labels += [view.memory.device_uuid, view.memory.pci_bus_id]  # identity_text already
        if tuple(labels) in seen_devices:
            continue
        seen_devices.add(tuple(labels))
        _add(dev_total, labels, view.memory.total_bytes)
        _add(dev_used, labels, view.memory.used_bytes)
        _add(dev_free, labels, view.memory.free_bytes)
        _add(dev_driver, labels, view.memory.device_reserved_bytes)
        seen_pids = set()
        for process in view.memory.processes:
            if process.pid not in seen_pids:
                seen_pids.add(process.pid)
                _add(dev_process, labels + [str(process.pid)], process.used_bytes)

    up = fam.gauge("kvguard_source_up", "1 if the source's last read succeeded within its time limit.", ["source"])
    errors = fam.counter(
        "kvguard_source_errors_total",
        "Reads of the source that failed or ran past their time limit since the exporter started.",
        ["source"],
    )
    duration = fam.gauge(
        "kvguard_source_read_duration_seconds", "How long the source's last completed read took.", ["source"]
    )
    cache_age = fam.gauge(
        "kvguard_source_cache_age_seconds",
        "Age of the value served for the source (reads run in the background; a scrape never waits on them).",
        ["source"],
    )
    for source in obs.sources:
        _add(up, [source.name], 1 if source.up else 0)
        _add(errors, [source.name], source.errors_total)
        _add(duration, [source.name], source.duration_seconds)
        _add(cache_age, [source.name], source.age_seconds())

    snapshots = fam.gauge("kvguard_spool_snapshots", "Snapshots read from the spool at its last read." + cached)
    clamped = fam.gauge(
        "kvguard_spool_clamped_timestamps",
        "Snapshots at the spool's last read dated more than "
        "10 s in the future: their age counts from when the sidecar first saw them." + cached,
    )
    skipped = fam.gauge(
        "kvguard_spool_skipped_files", "Spool files skipped at the spool's last read, by reason." + cached, ["reason"]
    )
    aged_out = fam.gauge(
        "kvguard_spool_aged_out_ranks",
        "Ranks left out at the spool's last read as dead, by "
        "reason: process_exited (the snapshot's pid runs no more on this host, where the sidecar "
        "shares its pid namespace), not_written (no write for --forget-after)." + cached,
        ["reason"],
    )
    if any(s.name == SPOOL for s in obs.sources):
        _add(snapshots, [], obs.spool_snapshots)
        _add(clamped, [], obs.spool_clamped)
        for reason in SKIP_REASON_VALUES:
            _add(skipped, [reason], obs.skipped.get(reason, 0))
        for reason in AGED_OUT_REASONS:
            _add(aged_out, [reason], obs.aged_out.get(reason, 0))

    cut = fam.gauge(
        "kvguard_ranks_cut",
        "Ranks left out at the last refresh by a cap that bounds what the sidecar "
        "exports, by reason: max_ranks, max_engines (distinct engine_id and engine), max_models, max_pods "
        "(serve --max-ranks, --max-engines, --max-models, --max-pods), max_bytes (their series would "
        "take /metrics past --max-metrics-bytes; still in /guard).",
        ["reason"],
    )
    truncated = fam.gauge(
        "kvguard_label_values_truncated", "Rank label values cut to --max-label-length characters at the last refresh."
    )
    for reason in CUT_REASONS:
        _add(cut, [reason], obs.cut.get(reason, 0) + (over_bytes if reason == "max_bytes" else 0))
    _add(truncated, [], obs.labels_truncated)

    reload_ok = fam.gauge(
        "kvguard_web_config_last_reload_successful",
        "1 when the last reload of --web.config.file "
        "was applied, 0 when it failed or was refused (it would have weakened authentication or "
        "TLS) and the previous config stays in force.",
    )
    reloads = fam.counter(
        "kvguard_web_config_reloads_total",
        "Reloads of --web.config.file since the exporter "
        "started, by result: success, failure (it did not load), refused_weaker (kept the old "
        "config: it would have weakened authentication or TLS), and for refused_weaker the "
        "reason: auth_off, tls_on_off, client_auth (lower client_auth_type), min_version.",
        ["result", "reason"],
    )
    if obs.web_config is not None:
        applied, results = obs.web_config
        _add(reload_ok, [], 1 if applied else 0)
        for (result, reason), count in results.items():
            _add(reloads, [result, reason], count)

    build = fam.gauge(
        "kvguard_build_info", "Always 1; the kvguard build that serves these metrics.", ["version", "python_version"]
    )
    build.add_metric([__version__, platform.python_version()], 1)
    return fam
