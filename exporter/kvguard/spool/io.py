"""The spool: one JSON snapshot per (host, pid, device), shared by probe and sidecar.

The probe writes ``<host>-<pid>-<device>.json`` by writing a temporary file whose name
does not end in ``.json`` and renaming it over the old one, so a reader sees either the
old snapshot or the new one, never half of one. Every regular file ending in ``.json``
is one rank's snapshot; anything else in the directory is ignored.

The reader treats the directory as hostile: files are opened without following links,
non-regular files are never opened, sizes are capped, and every rejected file is counted
under a reason instead of raising.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

from kvguard.budget.estimator import Profile, ProfileError
from kvguard.records import MAX_COUNTER, DeviceMemory

# Timestamps beyond year ~5000 are garbage; this also keeps float() from overflowing on huge ints.
_MAX_SECONDS = 1e11

SCHEMA_VERSION = 1
KIND = "kvguard.snapshot"
MAX_SNAPSHOT_BYTES = 256 * 1024
MAX_SPOOL_FILES = 4096

# Reasons a spool file is skipped; exported as a label, so the set is fixed.
SKIP_REASONS = ("not_regular_file", "too_large", "unreadable", "invalid_json", "invalid_snapshot",
                "unsupported_schema", "too_many_files")

# A snapshot's pod identity: key <- the downward-API environment variable the chart sets.
# The probe reads all four; the sidecar labels ranks with all but node.
POD_ENV = {"pod": "POD_NAME", "namespace": "POD_NAMESPACE", "container": "CONTAINER_NAME", "node": "NODE_NAME"}
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]+")
# Lone surrogates, C0 and C1 controls: not exportable as label values (encoding fails, or parsers choke).
_UNSAFE_TEXT = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
# A snapshot's device process table is not exported per rank; a few entries are kept for /guard.
MAX_SNAPSHOT_PROCESSES = 64
MAX_MODEL_NAME_CHARS = 253   # a served model name is a label value of vLLM's own series
MAX_ENGINE_CHARS = 16


def safe_text(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with what cannot be exported replaced by U+FFFD."""
    return _UNSAFE_TEXT.sub("\ufffd", text[:limit])


def _process_name(name: str) -> str:
    return safe_text(name, 128)


@dataclass(frozen=True)
class KVCacheAllocation:
    """The KV cache the serving engine actually allocated on this rank."""

    num_blocks: int
    block_bytes: int
    block_size: int
    # vLLM 0.34's extensible KV cache maps its pages with the CUDA driver, outside torch's
    # caching allocator: they show in the device's used memory, not in reserved.
    outside_allocator: bool = False

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


@dataclass(frozen=True)
class ProbeStatus:
    samples_total: int = 0
    errors_total: int = 0
    write_errors_total: int = 0
    last_error: str | None = None
    interval_seconds: float | None = None
    overruns_total: int = 0           # ticks at which the previous sample had not finished (schema 1 extension)


@dataclass(frozen=True)
class Snapshot:
    """One rank's latest state, as written by the probe."""

    written_at: float                 # unix seconds when the probe wrote it
    started_at: float                 # unix seconds when the probe started
    sequence: int                     # increases by one per write
    host: str
    pid: int
    device: str
    memory: DeviceMemory
    rank: int | None = None
    pod: Mapping[str, str] = field(default_factory=dict)   # pod, namespace, container, node
    profile: Profile | None = None
    kv_cache: KVCacheAllocation | None = None
    probe: ProbeStatus = field(default_factory=ProbeStatus)
    # The serving engine this rank belongs to, as vLLM labels its own series (schema 1 extension;
    # "" in older snapshots): the served model name, and the engine index (data-parallel rank).
    model_name: str = ""
    engine: str = ""
    budget_verdict: Any = None        # kvguard.guard.judge.Verdict (phase "budget"): judged before the KV cache existed
    schema: int = SCHEMA_VERSION
    clamped_from: float | None = None  # the written_at the file claimed, when it lay in the future (not written)
    # The writer's pid namespace ("pid:[4026531836]"; schema 1 extension, "" where unknown): the
    # sidecar checks that ``pid`` still runs only where it shares host and namespace with it.
    pid_namespace: str = ""

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
            memory = DeviceMemory.from_dict(data.get("memory"), max_processes=MAX_SNAPSHOT_PROCESSES,
                                            process_name=_process_name)
            profile = Profile.from_dict(data["profile"]) if data.get("profile") is not None else None
            kv_cache = None
            if data.get("kv_cache") is not None:
                kv = data["kv_cache"]
                if not isinstance(kv, Mapping):
                    raise ValueError("kv_cache is not an object")
                kv_cache = KVCacheAllocation(num_blocks=_int(kv, "num_blocks"), block_bytes=_int(kv, "block_bytes"),
                                             block_size=_int(kv, "block_size"),
                                             outside_allocator=kv.get("outside_allocator") is True)
            budget_verdict = None
            if data.get("budget_verdict") is not None:
                from kvguard.guard.judge import BUDGET, Verdict
                budget_verdict = Verdict.from_dict(data["budget_verdict"])
                if budget_verdict.phase != BUDGET:
                    raise ValueError("budget_verdict is not of phase 'budget'")
                budget_verdict = replace(budget_verdict, reasons=tuple(
                    replace(r, message=safe_text(r.message, 1024)) for r in budget_verdict.reasons))
            probe_raw = data.get("probe") or {}
            if not isinstance(probe_raw, Mapping):
                raise ValueError("probe is not an object")
            last_error = probe_raw.get("last_error")
            interval = probe_raw.get("interval_seconds")
            probe = ProbeStatus(
                samples_total=_int(probe_raw, "samples_total", 0),
                errors_total=_int(probe_raw, "errors_total", 0),
                write_errors_total=_int(probe_raw, "write_errors_total", 0),
                last_error=str(last_error)[:512] if last_error is not None else None,
                interval_seconds=float(interval) if isinstance(interval, (int, float)) and not isinstance(interval, bool) else None,
                overruns_total=_int(probe_raw, "overruns_total", 0),
            )
            model_name, engine, pid_namespace = (_text(data, key) for key in ("model_name", "engine", "pid_namespace"))
        except (ValueError, TypeError, OverflowError, ProfileError) as exc:
            raise SnapshotError("invalid_snapshot", str(exc)) from None
        # Every string becomes a label value or a JSON field: lone surrogates (what surrogateescape makes
        # of non-UTF-8 device names) and control characters would break the whole exposition.
        memory = replace(memory, device=safe_text(memory.device, 64), source=safe_text(memory.source, 64))
        probe = replace(probe, last_error=None if probe.last_error is None else safe_text(probe.last_error, 512))
        return cls(written_at=written_at, started_at=started_at, sequence=sequence, host=safe_text(host, 253),
                   pid=pid, device=safe_text(str(device), 64), memory=memory, rank=rank,
                   pod={k: safe_text(v, 253) for k, v in pod.items()}, profile=profile, kv_cache=kv_cache,
                   probe=probe, model_name=safe_text(model_name, MAX_MODEL_NAME_CHARS),
                   engine=safe_text(engine, MAX_ENGINE_CHARS), budget_verdict=budget_verdict,
                   pid_namespace=safe_text(pid_namespace, 64))


class SnapshotError(ValueError):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _number(data: Mapping[str, Any], key: str) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or not -_MAX_SECONDS <= value <= _MAX_SECONDS:
        raise ValueError(f"{key} is not a number in range")
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


def own_pid_namespace() -> str:
    """This process's pid namespace as /proc names it (``pid:[4026531836]``), or "" without /proc."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def write_snapshot(spool_dir: str, snapshot: Snapshot) -> str:
    """Atomically replace this rank's snapshot. Raises OSError on failure (the probe counts it).
    A snapshot of the writing process itself (the in-process probe's) records its pid namespace."""
    name = snapshot_filename(snapshot.host, snapshot.pid, snapshot.device)
    data = snapshot.to_dict()
    if snapshot.pid == os.getpid() and not snapshot.pid_namespace:
        data["pid_namespace"] = own_pid_namespace()
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).encode()
    fd, tmp_path = tempfile.mkstemp(dir=spool_dir, prefix=f".{name}.", suffix=".tmp")
    try:
        # mkstemp makes 0600 files; the sidecar usually runs as another (non-root) user.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
        os.replace(tmp_path, os.path.join(spool_dir, name))
    except BaseException:
        try:
            os.unlink(tmp_path)
        except OSError:
            pass
        raise
    return name


# One read's budget, so its memory and time do not grow with what others write into the spool:
# directory entries looked at, files opened, and bytes read. Files past it wait (or are junk).
MAX_SPOOL_ENTRIES = 16384
MAX_SPOOL_READ_BYTES = 16 * 1024 * 1024
# A snapshot's written_at this far past the reader's clock is suspicious (the probe and the
# sidecar share a node's clock): clamped to when the reader first saw it, and counted.
FUTURE_TOLERANCE_SECONDS = 10.0
MAX_ERRORS = 64
# The probe's own file names (snapshot_filename); files named so are read first.
_PROBE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}-[0-9]{1,20}-[A-Za-z0-9_.-]{1,32}\.json\Z")


@dataclass
class SpoolRead:
    snapshots: list[Snapshot] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)     # reason -> files
    errors: list[str] = field(default_factory=list)       # "file: reason: message", for logs (at most MAX_ERRORS)
    listing_error: str | None = None                      # why the directory itself could not be listed
    clamped: int = 0                                      # snapshots dated in the future, clamped

    def error(self, line: str) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(line)


def read_spool(spool_dir: str, max_bytes: int = MAX_SNAPSHOT_BYTES, max_files: int = MAX_SPOOL_FILES,
               max_total_bytes: int = MAX_SPOOL_READ_BYTES, max_entries: int = MAX_SPOOL_ENTRIES,
               now: float | None = None, first_seen: dict | None = None) -> SpoolRead:
    """Read the ``*.json`` snapshots, newest first; never raises, only counts.

    Junk must not hide live ranks, so files are read by validity and recency, not by name: files
    named as the probe names them first, each group newest (mtime) first. An mtime more than
    FUTURE_TOLERANCE_SECONDS past ``now`` is not believed (the probe writes with the node's
    clock): such files are read after every believably dated one, so a year-ahead junk flood
    never fills a read before a live rank. ``max_bytes`` caps one
    file; ``max_files`` files and ``max_total_bytes`` bytes cap the read (the rest is counted as
    ``too_many_files``); at most ``max_entries`` directory entries are looked at.

    A ``written_at`` more than FUTURE_TOLERANCE_SECONDS past ``now`` is clamped to the time the
    reader first saw that snapshot (``first_seen``, kept by the caller across reads: then it ages
    and goes stale like any other), and counted in ``clamped``.
    """
    result = SpoolRead()
    now = time.time() if now is None else now
    latest_ns = int((now + FUTURE_TOLERANCE_SECONDS) * 1e9)
    candidates = []
    try:
        with os.scandir(spool_dir) as entries:
            for seen, entry in enumerate(entries):
                if seen >= max_entries:
                    result.skipped["too_many_files"] += 1 + sum(1 for _ in entries)
                    result.error(f"{spool_dir}: too_many_files: more than {max_entries} directory entries")
                    break
                name = entry.name
                if not name.endswith(".json") or name.startswith("."):
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError as exc:
                    result.skipped["unreadable"] += 1
                    result.error(f"{name}: unreadable: {exc.strerror or exc}")
                    continue
                if not stat.S_ISREG(info.st_mode):
                    result.skipped["not_regular_file"] += 1
                    result.error(f"{name}: not_regular_file: not a regular file")
                    continue
                if info.st_size > max_bytes:
                    result.skipped["too_large"] += 1
                    result.error(f"{name}: too_large: {info.st_size} bytes exceeds {max_bytes}")
                    continue
                believable = info.st_mtime_ns <= latest_ns
                candidates.append((_PROBE_NAME.match(name) is not None, believable,
                                   info.st_mtime_ns if believable else 0, name))
    except OSError as exc:
        result.listing_error = str(exc.strerror or exc)
        result.errors.append(f"{spool_dir}: {result.listing_error}")
        return result
    candidates.sort(reverse=True)
    if len(candidates) > max_files:
        result.skipped["too_many_files"] += len(candidates) - max_files
        result.error(f"{spool_dir}: too_many_files: {len(candidates)} files, {max_files} are read")
        del candidates[max_files:]
    used = 0
    clamped_keys: set = set()
    for index, (_, _, _, name) in enumerate(candidates):
        try:
            raw = _read_file(os.path.join(spool_dir, name), min(max_bytes, max_total_bytes - used), max_bytes)
            if raw is None:   # longer than what is left of this read's budget, not than one snapshot
                result.skipped["too_many_files"] += len(candidates) - index
                result.error(f"{name}: too_many_files: this read's {max_total_bytes} bytes are used up")
                break
            used += len(raw)
            snapshot = _decode(raw)
        except SnapshotError as exc:
            result.skipped[exc.reason] += 1
            result.error(f"{name}: {exc.reason}: {exc}")
            continue
        if snapshot.written_at > now + FUTURE_TOLERANCE_SECONDS:
            key = (name, snapshot.written_at, snapshot.sequence)
            clamped_keys.add(key)
            seen_at = now if first_seen is None else first_seen.setdefault(key, now)
            snapshot = replace(snapshot, written_at=seen_at, clamped_from=snapshot.written_at)
            result.clamped += 1
        result.snapshots.append(snapshot)
    if first_seen is not None:   # forget what is gone, so the memo stays as small as the spool
        for key in set(first_seen) - clamped_keys:
            del first_seen[key]
    return result


class SpoolReader:
    """Reads one spool again and again, remembering when it first saw each future-dated snapshot."""

    def __init__(self, spool_dir: str, **limits: Any):
        self.spool_dir = spool_dir
        self.limits = limits
        self._first_seen: dict = {}

    def read(self) -> SpoolRead:
        return read_spool(self.spool_dir, first_seen=self._first_seen, **self.limits)
def _read_file(path: str, limit: int, max_bytes: int) -> bytes | None:
    """A regular file's bytes, opened without following links. None when it is longer than
    ``limit`` < ``max_bytes`` (the read's budget ran out, not the file's own cap)."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise SnapshotError("unreadable", exc.strerror or str(exc)) from None
    if not stat.S_ISREG(info.st_mode):
        raise SnapshotError("not_regular_file", "not a regular file")
    if info.st_size > max_bytes:
        raise SnapshotError("too_large", f"{info.st_size} bytes exceeds {max_bytes}")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise SnapshotError("not_regular_file", "not a regular file")
            raw = handle.read(limit + 1)
    except OSError as exc:
        raise SnapshotError("unreadable", exc.strerror or str(exc)) from None
    if len(raw) > limit:
        if limit < max_bytes:
            return None
        raise SnapshotError("too_large", f"more than {max_bytes} bytes")
    return raw


def _decode(raw: bytes) -> Snapshot:
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SnapshotError("invalid_json", (str(exc).splitlines() or [""])[0][:200]) from None
    return Snapshot.from_dict(data)
