"""The snapshot record: one rank's latest state as the probe writes it, and its strict decoding.

Pure: no I/O here (spool/io.py reads and writes the directory). Decoding treats every byte as
hostile: bounded numbers, bounded text, and a SnapshotError with a reason instead of anything else."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

from kvguard.budget.estimator import Profile, ProfileError
from kvguard.guard.judge import BUDGET, Verdict
from kvguard.records import (
    MAX_COUNTER,
    MAX_ENGINE_CHARS,
    MAX_MODEL_NAME_CHARS,
    DeviceMemory,
    KVCacheAllocation,
    ReservedPeak,
)
from kvguard.text import one_line, safe_text

# Timestamps beyond year ~5000 are garbage; this also keeps float() from overflowing on huge ints.
_MAX_SECONDS = 1e11
SCHEMA_VERSION = 1
KIND = "kvguard.snapshot"
MAX_SNAPSHOT_BYTES = 256 * 1024
# A snapshot's pod identity: key <- the downward-API environment variable the chart sets.
# The probe reads all four; the sidecar labels ranks with all but node.
POD_ENV = {"pod": "POD_NAME", "namespace": "POD_NAMESPACE", "container": "CONTAINER_NAME", "node": "NODE_NAME"}
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]+")
# A snapshot's device process table is not exported per rank; a few entries are kept for /guard.
MAX_SNAPSHOT_PROCESSES = 64


def _process_name(name: str) -> str:
    return safe_text(name, 128)


@dataclass(frozen=True)
class ProbeStatus:
    samples_total: int = 0
    errors_total: int = 0
    write_errors_total: int = 0
    last_error: str | None = None
    interval_seconds: float | None = None
    overruns_total: int = 0  # ticks at which the previous sample had not finished (schema 1 extension)
    # Schema 1 extensions (absent in older snapshots): where the samples are taken ("thread": the probe's own
    # worker thread; "engine-step": the engine's thread between its steps, for sources whose reads synchronise
    # the engine, kvguard.probe), when the written memory record was read (unix seconds; None: at the write),
    # and the seconds the engine's thread has spent in the probe's samples.
    sampling: str = "thread"
    sampled_at: float | None = None
    engine_thread_seconds_total: float = 0.0
    skipped_total: int = 0  # inputs beside the counters the source skipped (MindSpore's pool dumps)


SAMPLING_MODES = ("thread", "engine-step")


@dataclass(frozen=True)
class Snapshot:
    """One rank's latest state, as written by the probe."""

    written_at: float  # unix seconds when the probe wrote it
    started_at: float  # unix seconds when the probe started
    sequence: int  # increases by one per write
    host: str
    pid: int
    device: str
    memory: DeviceMemory
    rank: int | None = None
    pod: Mapping[str, str] = field(default_factory=dict)  # pod, namespace, container, node
    profile: Profile | None = None
    kv_cache: KVCacheAllocation | None = None
    probe: ProbeStatus = field(default_factory=ProbeStatus)
    # The serving engine this rank belongs to, as vLLM labels its own series (schema 1 extension;
    # "" in older snapshots): the served model name, and the engine index (data-parallel rank).
    model_name: str = ""
    engine: str = ""
    budget_verdict: Verdict | None = None  # phase "budget": judged before the KV cache existed
    schema: int = SCHEMA_VERSION
    clamped_from: float | None = None  # the written_at the file claimed, when it lay in the future (not written)
    # The writer's pid namespace ("pid:[4026531836]"; schema 1 extension, "" where unknown): the
    # sidecar checks that ``pid`` still runs only where it shares host and namespace with it.
    pid_namespace: str = ""
    # vllm-mindspore: the profile run's reserved peak by MindSpore's max_memory_reserved, beside the
    # end-of-run figure the engine measured (schema 1 extension; None elsewhere and in older snapshots).
    reserved_peak: ReservedPeak | None = None
    # Read, never written: profile keys this release does not know (a newer probe's fields: a plugin
    # upgraded before its sidecar). The profile is judged on the fields it knows, and the guard says so
    # (``profile_fields_unknown``) rather than dropping the rank. At most MAX_UNKNOWN_FIELDS names.
    profile_unknown_fields: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": KIND,
            "schema": self.schema,
            "written_at": self.written_at,
            "started_at": self.started_at,
            "sequence": self.sequence,
            "host": self.host,
            "pid": self.pid,
            "rank": self.rank,
            "device": self.device,
            "pod": dict(self.pod),
            "memory": self.memory.to_dict(),
            "profile": self.profile.to_dict() if self.profile else None,
            "kv_cache": None if self.kv_cache is None else asdict(self.kv_cache),
            "probe": asdict(self.probe),
            "model_name": self.model_name,
            "engine": self.engine,
            "budget_verdict": None if self.budget_verdict is None else self.budget_verdict.to_dict(),
            "pid_namespace": self.pid_namespace,
            "reserved_peak": None if self.reserved_peak is None else self.reserved_peak.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Any) -> "Snapshot":
        """Strict decoding; raises SnapshotError(reason, message)."""
        if not isinstance(data, Mapping) or data.get("kind") != KIND:
            raise SnapshotError("invalid_snapshot", "not a kvguard snapshot")
        if data.get("schema") != SCHEMA_VERSION:
            raise SnapshotError("unsupported_schema", f"schema {data.get('schema')!r} is not {SCHEMA_VERSION}")
        try:
            written_at = _number(data, "written_at")
            started_at = _number(data, "started_at")
            sequence = _int(data, "sequence")
            pid = _int(data, "pid")
            rank = data.get("rank")
            if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
                raise ValueError("rank is not a non-negative integer")
            host = data.get("host")
            device = data.get("device")
            if not isinstance(host, str) or not isinstance(device, (str, int)) or isinstance(device, bool):
                raise ValueError("host or device missing")
            pod_raw = data.get("pod") or {}
            if not isinstance(pod_raw, Mapping):
                raise ValueError("pod is not an object")
            pod = {k: str(pod_raw[k])[:253] for k in POD_ENV if isinstance(pod_raw.get(k), str) and pod_raw[k]}
            memory_raw = data.get("memory")
            if not isinstance(memory_raw, Mapping):  # (DeviceMemory.from_dict's own check and message)
                raise ValueError("memory record is not an object")
            memory = DeviceMemory.from_dict(
                memory_raw, max_processes=MAX_SNAPSHOT_PROCESSES, process_name=_process_name
            )
            profile, unknown_fields = _profile(data.get("profile"))
            kv_cache = None
            if data.get("kv_cache") is not None:
                kv = data["kv_cache"]
                if not isinstance(kv, Mapping):
                    raise ValueError("kv_cache is not an object")
                kv_cache = KVCacheAllocation(
                    num_blocks=_int(kv, "num_blocks"),
                    block_bytes=_int(kv, "block_bytes"),
                    block_size=_int(kv, "block_size"),
                    outside_allocator=kv.get("outside_allocator") is True,
                )
            budget_verdict = None
            if data.get("budget_verdict") is not None:
                budget_verdict = Verdict.from_dict(data["budget_verdict"])
                if budget_verdict.phase != BUDGET:
                    raise ValueError("budget_verdict is not of phase 'budget'")
                budget_verdict = replace(
                    budget_verdict,
                    reasons=tuple(replace(r, message=safe_text(r.message, 1024)) for r in budget_verdict.reasons),
                    reserved_peak_note=None
                    if budget_verdict.reserved_peak_note is None
                    else safe_text(budget_verdict.reserved_peak_note, 1024),
                )
            reserved_peak = None
            if data.get("reserved_peak") is not None:
                reserved_peak = ReservedPeak.from_dict(data["reserved_peak"])
                if reserved_peak.error is not None:
                    reserved_peak = replace(reserved_peak, error=safe_text(reserved_peak.error, 512))
            probe_raw = data.get("probe") or {}
            if not isinstance(probe_raw, Mapping):
                raise ValueError("probe is not an object")
            last_error = probe_raw.get("last_error")
            interval = probe_raw.get("interval_seconds")
            sampling = probe_raw.get("sampling")
            probe = ProbeStatus(
                samples_total=_int(probe_raw, "samples_total", 0),
                errors_total=_int(probe_raw, "errors_total", 0),
                write_errors_total=_int(probe_raw, "write_errors_total", 0),
                last_error=str(last_error)[:512] if last_error is not None else None,
                interval_seconds=float(interval)
                if isinstance(interval, (int, float)) and not isinstance(interval, bool)
                else None,
                overruns_total=_int(probe_raw, "overruns_total", 0),
                sampling=sampling if isinstance(sampling, str) and sampling in SAMPLING_MODES else "thread",
                sampled_at=_number(probe_raw, "sampled_at") if probe_raw.get("sampled_at") is not None else None,
                engine_thread_seconds_total=_seconds_total(probe_raw, "engine_thread_seconds_total"),
                skipped_total=_int(probe_raw, "skipped_total", 0),
            )
            model_name, engine, pid_namespace = (_text(data, key) for key in ("model_name", "engine", "pid_namespace"))
        except (ValueError, TypeError, OverflowError, ProfileError) as exc:
            raise SnapshotError("invalid_snapshot", one_line(exc)) from None
        # Every string becomes a label value or a JSON field: lone surrogates (what surrogateescape makes
        # of non-UTF-8 device names) and control characters would break the whole exposition.
        memory = replace(memory, device=safe_text(memory.device, 64), source=safe_text(memory.source, 64))
        probe = replace(probe, last_error=None if probe.last_error is None else safe_text(probe.last_error, 512))
        return cls(
            written_at=written_at,
            started_at=started_at,
            sequence=sequence,
            host=safe_text(host, 253),
            pid=pid,
            device=safe_text(str(device), 64),
            memory=memory,
            rank=rank,
            pod={k: safe_text(v, 253) for k, v in pod.items()},
            profile=profile,
            kv_cache=kv_cache,
            probe=probe,
            model_name=safe_text(model_name, MAX_MODEL_NAME_CHARS),
            engine=safe_text(engine, MAX_ENGINE_CHARS),
            budget_verdict=budget_verdict,
            pid_namespace=safe_text(pid_namespace, 64),
            reserved_peak=reserved_peak,
            profile_unknown_fields=unknown_fields,
        )


MAX_UNKNOWN_FIELDS = 8


def _profile(raw: Any) -> tuple[Profile | None, tuple[str, ...]]:
    """The snapshot's profile and the keys of it this release does not know (left out, named: the first
    MAX_UNKNOWN_FIELDS in sorted order, each cut to 40 characters). Known keys are checked as strictly as
    ever: a bad value still makes the snapshot invalid."""
    if raw is None:
        return None, ()
    if not isinstance(raw, Mapping):
        return Profile.from_dict(raw), ()  # raises ProfileError with the usual message
    unknown = Profile.unknown_keys(raw)
    if not unknown:
        return Profile.from_dict(raw), ()
    dropped = set(unknown)
    profile = Profile.from_dict({k: v for k, v in raw.items() if k not in dropped})
    return profile, tuple(safe_text(name, 40) for name in unknown[:MAX_UNKNOWN_FIELDS])


class SnapshotError(ValueError):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _number(data: Mapping[str, Any], key: str) -> float:
    value = data.get(key)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value != value
        or not -_MAX_SECONDS <= value <= _MAX_SECONDS
    ):
        raise ValueError(f"{key} is not a number in range")
    return float(value)


def _seconds_total(data: Mapping[str, Any], key: str) -> float:
    """A non-negative, finite count of seconds; 0 where absent."""
    value = data.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= _MAX_SECONDS:
        raise ValueError(f"{key} is not a non-negative number of seconds")
    return float(value)


def _text(data: Mapping[str, Any], key: str) -> str:
    value = data.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{key} is not a string")
    return value


def _int(data: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNTER:
        raise ValueError(f"{key} is not a non-negative integer in range")
    return value


def snapshot_filename(host: str, pid: int, device: str) -> str:
    return f"{_SAFE_NAME.sub('_', host)[:64]}-{pid}-{_SAFE_NAME.sub('_', str(device))[:32]}.json"


def decode_snapshot(raw: bytes) -> Snapshot:
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SnapshotError("invalid_json", one_line(exc, first_line=True)[:200]) from None
    return Snapshot.from_dict(data)
