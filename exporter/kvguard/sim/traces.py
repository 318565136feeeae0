"""Real allocation traces, read and replayed on a simulated allocator.

Two formats are read:

- **MindSpore ``memory_tracker``** (``MS_ALLOC_CONF=memory_tracker:True``):
  ``rank_<N>/memory_block.csv``, one row per pool allocation. Columns are found by the
  header (``start_time_stamp``, ``end_time_stamp``, ``size``, ``type``, ``stream_id``,
  ``device_addr``); a file without a header falls back to the positions
  ``memory_py.cc``'s replay parser uses (0 start, 1 end, 3 stream, 5 size, 9 type: the
  tracker's own column order, ``actual_peak_memory`` at 6, ``file_name`` and
  ``line_num`` at 7 and 8).
  A row allocates at ``start_time_stamp`` and frees at ``end_time_stamp`` (the tracker's
  shared event counter); an end of ``-1`` or empty means never freed. Types ``Weight``,
  ``ConstantValue`` and ``GeConst`` go to the persistent pool. Rows with a start of
  ``-1`` (SOMAS-planned, inside a static block) are skipped. A negative size or a
  number that is not finite (``inf``, ``1e400``) is a :class:`TraceError`.
- **PyTorch ``_dump_snapshot`` pickles** (``torch.cuda.memory._record_memory_history()``
  then ``torch.cuda.memory._dump_snapshot(path)``): the ``device_traces`` list of the
  first device that has one (or ``device=``), actions ``alloc`` and ``free_completed``
  (``free_requested`` when a trace has no ``free_completed``: a single-stream trace).
  A dump taken without recording (every ``device_traces`` list empty, ``segments``
  present) has no events: only its end state, which ``kvguard.sim.snapshot`` replays.
  Frees of blocks allocated before recording started are skipped and counted;
  ``segment_*``, ``snapshot`` and ``oom`` entries are the recording allocator's own
  decisions and are not replayed. Pickles are read with an unpickler that builds only
  builtin containers and scalars: anything else in the file is refused, nothing in it
  is executed. Entries must have the types ``_dump_snapshot`` writes (dicts with a
  string ``action``; integer ``addr``, ``size`` >= 0 and ``stream`` on the replayed
  actions): anything else is a :class:`TraceError`, not a guess.

``replay`` drives the events through any simulated allocator and reports where it ran
out of memory, if it did.
"""

from __future__ import annotations

import csv
import io
import math
import pickle
from dataclasses import dataclass
from typing import Any, Iterable

from .base import SimOutOfMemory

PERSISTENT_TYPES = frozenset({"Weight", "ConstantValue", "GeConst"})
_POSITIONS = {"start_time_stamp": 0, "end_time_stamp": 1, "stream_id": 3, "size": 5, "type": 9}


class TraceError(ValueError):
    """A trace file that cannot be read; message is one line."""


@dataclass(frozen=True)
class TraceEvent:
    """One allocation (``size`` set) or free (``size`` None) of block ``block_id``."""

    block_id: Any
    size: int | None
    persistent: bool = False
    stream: int = 0


@dataclass(frozen=True)
class Trace:
    source: str                      # "mindspore_memory_block" or "torch_snapshot"
    events: tuple[TraceEvent, ...]
    skipped: int = 0                 # rows or entries not replayed (see the module docstring)

    @property
    def num_allocs(self) -> int:
        return sum(1 for e in self.events if e.size is not None)


@dataclass(frozen=True)
class ReplayResult:
    events_replayed: int
    oom: bool
    oom_at_event: int | None
    oom_request_bytes: int | None
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    memory_stats: dict[str, Any]
    samples: tuple[tuple[int, int, int, int], ...]  # (event index, allocated, reserved, device used)


# ----------------------------------------------------------------------------- MindSpore CSV
def _int_field(text: str) -> int | None:
    text = text.strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        pass
    value = float(text)            # "2048.0", "1e3"; ValueError for words
    if not math.isfinite(value):   # "inf", "nan", "1e400"
        raise ValueError(f"not a finite number: {text[:40]!r}")
    return int(value)


def parse_memory_block_csv(text: str) -> Trace:
    """Parse a MindSpore ``memory_block.csv``."""
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        rows = [row for row in csv.reader(io.StringIO(text)) if any(cell.strip() for cell in row)]
    except csv.Error as exc:     # a stray carriage return, a cell past the csv module's field limit
        raise TraceError(f"memory_block.csv is not a readable CSV: {exc}") from None
    if not rows:
        raise TraceError("memory_block.csv is empty")
    header = [cell.strip() for cell in rows[0]]
    if "size" in header and "start_time_stamp" in header:
        columns = {name: header.index(name) for name in _POSITIONS if name in header}
        body = rows[1:]
    else:
        columns = dict(_POSITIONS)
        body = rows
    timed: list[tuple[int, int, TraceEvent]] = []
    skipped = 0
    for number, row in enumerate(body):
        try:
            start = _int_field(row[columns["start_time_stamp"]])
            end = _int_field(row[columns["end_time_stamp"]]) if "end_time_stamp" in columns else None
            size = _int_field(row[columns["size"]])
        except (IndexError, ValueError) as exc:
            raise TraceError(f"memory_block.csv row {number + 1}: {exc}") from None
        if start is None or start < 0 or size is None:
            skipped += 1
            continue
        if size < 0:
            raise TraceError(f"memory_block.csv row {number + 1}: negative size {size}")
        kind = row[columns["type"]].strip() if "type" in columns and columns["type"] < len(row) else ""
        stream = 0
        if "stream_id" in columns and columns["stream_id"] < len(row):
            try:
                stream = _int_field(row[columns["stream_id"]]) or 0
            except ValueError as exc:
                raise TraceError(f"memory_block.csv row {number + 1}: stream_id: {exc}") from None
        timed.append((start, 1, TraceEvent(number, size, kind in PERSISTENT_TYPES, stream)))
        if end is not None and end >= 0:
            timed.append((end, 0, TraceEvent(number, None, kind in PERSISTENT_TYPES, stream)))
    # At equal timestamps, frees first: the tracker stamps every event, so ties are rare.
    timed.sort(key=lambda item: (item[0], item[1]))
    return Trace("mindspore_memory_block", tuple(event for _, _, event in timed), skipped)


# ----------------------------------------------------------------------------- PyTorch pickle
class _Refused(pickle.UnpicklingError):
    pass


class _ContainersOnlyUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, sets, strings, bytes and numbers; refuses every class."""

    _ALLOWED = {("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"),
                ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise _Refused(f"refusing to load {module}.{name} from a snapshot pickle")


def load_snapshot_pickle(data: bytes) -> dict[str, Any]:
    try:
        snapshot = _ContainersOnlyUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise TraceError(f"not a plain snapshot pickle: {exc}") from None
    except Exception as exc:  # truncated or corrupt files raise many kinds of errors
        raise TraceError(f"cannot read snapshot pickle: {exc.__class__.__name__}: {exc}") from None
    if not isinstance(snapshot, dict):
        raise TraceError("snapshot pickle does not hold a dict")
    return snapshot


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_torch_snapshot(snapshot: dict[str, Any], device: int | None = None) -> Trace:
    traces = snapshot.get("device_traces")
    segments = snapshot.get("segments")
    if not isinstance(traces, list) or not (any(traces) or isinstance(segments, list) and segments):
        raise TraceError("snapshot has no device_traces (record with torch.cuda.memory._record_memory_history())")
    for index, trace in enumerate(traces):
        if not isinstance(trace, list):
            raise TraceError(f"snapshot device_traces[{index}] is {_kind(trace)}, not a list of entries")
    if not any(traces) and device is None:
        # Dumped without recording: every device's history is empty (``record_trace`` stores entries
        # only while history is on, c10/cuda/CUDACachingAllocator.cpp:3237-3238 at v2.6.0); only the
        # end state is there.
        return Trace("torch_snapshot", ())
    if device is None:
        device = next(i for i, t in enumerate(traces) if t)
    if not 0 <= device < len(traces):
        raise TraceError(f"snapshot has no device {device}")
    entries = traces[device]
    for index, entry in enumerate(entries):
        _check_entry(device, index, entry)
    actions = {e["action"] for e in entries}
    free_action = "free_completed" if "free_completed" in actions else "free_requested"
    events: list[TraceEvent] = []
    live: set[int] = set()
    skipped = 0
    for entry in entries:
        action = entry["action"]
        addr = entry.get("addr")
        if action == "alloc":
            live.add(addr)
            events.append(TraceEvent(addr, entry["size"], False, entry.get("stream") or 0))
        elif action == free_action:
            if addr in live:
                live.discard(addr)
                events.append(TraceEvent(addr, None, False, entry.get("stream") or 0))
            else:
                skipped += 1
    return Trace("torch_snapshot", tuple(events), skipped)


def _check_entry(device: int, index: int, entry: Any) -> None:
    """Refuse a trace entry whose fields do not have the types ``_dump_snapshot`` writes."""
    where = f"snapshot device_traces[{device}][{index}]"
    if not isinstance(entry, dict):
        raise TraceError(f"{where} is {_kind(entry)}, not a dict")
    action = entry.get("action")
    if not isinstance(action, str):
        raise TraceError(f"{where}: action is {_kind(action)}, not a string")
    if action not in ("alloc", "free_requested", "free_completed"):
        return      # segment_*, snapshot, oom: not replayed, not checked
    fields = ("addr", "size") if action == "alloc" else ("addr",)
    for name in fields:
        if not _is_int(entry.get(name)):
            raise TraceError(f"{where} ({action}): {name} is {_kind(entry.get(name))}, not an integer")
    if action == "alloc" and entry["size"] < 0:
        raise TraceError(f"{where} (alloc): negative size {entry['size']}")
    stream = entry.get("stream")
    if stream is not None and not _is_int(stream):
        raise TraceError(f"{where} ({action}): stream is {_kind(stream)}, not an integer")


def _kind(value: Any) -> str:
    if value is None:
        return "missing"
    name = type(value).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def read_trace_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None


def is_snapshot_pickle(data: bytes) -> bool:
    return data[:1] == b"\x80"  # pickle protocol 2+


def load_trace(path: str) -> Trace:
    """Read a trace file, telling the format from its content."""
    data = read_trace_bytes(path)
    if is_snapshot_pickle(data):
        return parse_torch_snapshot(load_snapshot_pickle(data))
    try:
        text = data.decode("utf-8-sig")     # a BOM from a spreadsheet round trip is not a header cell
    except UnicodeDecodeError:
        raise TraceError(f"{path} is neither a snapshot pickle nor a memory_block.csv") from None
    return parse_memory_block_csv(text)


# ----------------------------------------------------------------------------- replay
def replay(events: Iterable[TraceEvent], allocator, sample_every: int = 1) -> ReplayResult:
    """Drive ``events`` through ``allocator``; stops at the first OOM."""
    addrs: dict[Any, int] = {}
    samples: list[tuple[int, int, int, int]] = []
    malloc, free = allocator.malloc, allocator.free
    index = -1
    device = getattr(allocator, "device", None)
    try:
        for index, event in enumerate(events):
            if event.size is None:
                addr = addrs.pop(event.block_id, None)
                if addr is not None:
                    free(addr)
            else:
                addrs[event.block_id] = malloc(event.size, event.persistent)
            if index % sample_every == 0:
                samples.append((index, allocator.allocated_bytes, allocator.reserved_bytes,
                                device.used_bytes if device is not None else 0))
    except SimOutOfMemory as exc:
        return ReplayResult(index, True, index, exc.requested_bytes, allocator.peak_allocated_bytes,
                            allocator.peak_reserved_bytes, allocator.memory_stats(), tuple(samples))
    return ReplayResult(index + 1, False, None, None, allocator.peak_allocated_bytes, allocator.peak_reserved_bytes,
                        allocator.memory_stats(), tuple(samples))
