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
  present) has no events: only its end state, which ``kvguard.allocators.snapshot`` replays.
  Frees of blocks allocated before recording started are skipped and counted;
  ``segment_*``, ``snapshot`` and ``oom`` entries are the recording allocator's own
  decisions and are not replayed. Pickles are read by a reader of their opcodes that
  builds only builtin containers and scalars: anything else in the file is refused,
  nothing in it is executed, and bytes, objects, memory (a copy counted by its bytes), memo
  entries, items in a container, values reached through shared references and the work of
  hashing and comparing keys are each held to a budget (``SNAPSHOT_MAX_*``); a key that holds
  a tuple or frozenset is refused. Entries must have the types ``_dump_snapshot`` writes (dicts with a
  string ``action``; integer ``addr``, ``size`` >= 0 and ``stream`` on the replayed
  actions): anything else is a :class:`TraceError`, not a guess.

``replay`` drives the events through any simulated allocator and reports where it ran
out of memory, if it did.
"""

from __future__ import annotations

import csv
import gc
import io
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass
from itertools import compress, repeat
from operator import is_
from typing import Any, Iterable

from kvguard.allocators.base import AllocatorOutOfMemory
from kvguard.text import one_line

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
    source: str  # "mindspore_memory_block" or "torch_snapshot"
    events: tuple[TraceEvent, ...]
    skipped: int = 0  # rows or entries not replayed (see the module docstring)

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
    value = float(text)  # "2048.0", "1e3"; ValueError for words
    if not math.isfinite(value):  # "inf", "nan", "1e400"
        raise ValueError(f"not a finite number: {text[:40]!r}")
    return int(value)


def parse_memory_block_csv(text: str) -> Trace:
    """Parse a MindSpore ``memory_block.csv``."""
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        rows = [row for row in csv.reader(io.StringIO(text)) if any(cell.strip() for cell in row)]
    except csv.Error as exc:  # a stray carriage return, a cell past the csv module's field limit
        raise TraceError(f"memory_block.csv is not a readable CSV: {one_line(exc)}") from None
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
            raise TraceError(f"memory_block.csv row {number + 1}: {one_line(exc)}") from None
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
                raise TraceError(f"memory_block.csv row {number + 1}: stream_id: {one_line(exc)}") from None
        timed.append((start, 1, TraceEvent(number, size, kind in PERSISTENT_TYPES, stream)))
        if end is not None and end >= 0:
            timed.append((end, 0, TraceEvent(number, None, kind in PERSISTENT_TYPES, stream)))
    # At equal timestamps, frees first: the tracker stamps every event, so ties are rare.
    timed.sort(key=lambda item: (item[0], item[1]))
    return Trace("mindspore_memory_block", tuple(event for _, _, event in timed), skipped)


# ----------------------------------------------------------------------------- PyTorch pickle
# The reader walks the pickle's opcodes itself (their codes and arguments as CPython's
# Lib/pickle.py defines them, v3.11.7 lines 107-193, and loads them, lines 1187-1745) and
# builds only builtin scalars and containers, plus the allow-listed constructors below,
# within budgets. CPython's own unpickler cannot be bounded: a 9-byte pickle storing memo
# index 200,000,000 makes the C unpickler grow its memo to twice that (3 GiB).
#
# The budgets are sized from the 64 real snapshots in ../shared/torch-snapshots*: at most
# 4,186,457 bytes, 179,228 objects built, 63,867 memo entries, 8,934,684 values when every
# shared reference is counted as what it refers to (torch shares frame dicts between trace
# entries), 27,358 items in one container, containers 9 deep and strings of 3,289 bytes.
SNAPSHOT_MAX_BYTES = 32 << 20  # 8x the largest real snapshot
SNAPSHOT_MAX_OBJECTS = 2_000_000  # values built, references to them not counted: 11x
SNAPSHOT_MAX_VALUES = 64_000_000  # values, each shared reference counted in full: 7x
SNAPSHOT_MAX_CONTAINER_ITEMS = 1_000_000  # items in one list, dict, tuple or set: 36x
SNAPSHOT_MAX_MEMO = 1_000_000  # memo entries stored: 15x
SNAPSHOT_MAX_STRING_BYTES = 1 << 20  # one str, bytes or bytearray: 300x
SNAPSHOT_MAX_DEPTH = 100  # containers within containers: 11x
# Memory as CPython 3.11 on 64 bits spends it, per object built and per reference a container holds
# (memo references included: a set filled by BINGETs costs its table, not one object): the budget
# is 256 MiB, 9.5x the largest real snapshot's estimate (27 MiB). An empty set costs 216 bytes
# (2,000,000 of them from a 2 MB file were 467 MiB).
SNAPSHOT_MAX_MEMORY_BYTES = 256 << 20
_OBJECT_BYTES = 64  # an int, float, str header, list or dict, rounded up
_EMPTY_SET_BYTES = 216 - _OBJECT_BYTES  # the rest of an empty set (or frozenset) beyond that
_ITEM_BYTES = {list: 9, dict: 48, set: 64, frozenset: 64, tuple: 8, OrderedDict: 104}
# Keys (or set items) of one container that share a hash: each insert walks all of them, so
# k x (2**61 - 1) integer keys, which all hash to 0, made dict and set building quadratic (40,000
# keys, 559 kB, took 25.6 s). Integers below 2**64 share a hash at most 8 at a time; strings and
# bytes hash with a per-process key, so only other keys are counted.
SNAPSHOT_MAX_SAME_HASH = 16
# Steps of hashing and comparing keys (tuple and frozenset keys, and strings over 64 bytes): an item
# each, a string's 16 bytes as one, once to hash a key and once per key of its hash it is compared
# with. One tuple of 1,000,000 items as the key of 1,000 dicts (2 MB) took 20 s; two equal strings of
# 1,000,000 bytes as the keys of 1,600,000 dicts (20 MB) compared them for over 60 s. The real
# snapshots' keys are strings of at most 64 bytes and integers, which cost no step.
SNAPSHOT_MAX_KEY_WORK = 16_000_000

_CONTAINER_TYPES = frozenset({dict, list, tuple, set, frozenset, OrderedDict})
_HASHABLE_CONTAINERS = (tuple, frozenset)


class _Refused(Exception):
    """Something a snapshot never holds, or more of it than the budget: the message says what."""


class _Unreadable(_Refused):
    """Not a pickle, or a broken one: cut short, or an opcode without what it takes."""


def _bytearray(source: Any = b"", encoding: Any = None) -> bytearray:
    # bytearray.__reduce_ex__ writes (bytes,) at protocols 3-4 and (str, "latin-1") at 2
    # (Objects/bytearrayobject.c, bytearray_reduce_ex): never a count, which would allocate that many bytes.
    if type(source) is bytes and encoding is None:
        return bytearray(source)
    if type(source) is str and encoding == "latin-1":
        return bytearray(source, "latin-1")
    raise _Refused(f"bytearray of {_kind(source)} (a pickled bytearray holds bytes)")


def _set(items: Any = ()) -> set:
    # set.__reduce__ writes (set, ([items],)) (Objects/setobject.c, set_reduce): a list already in budget.
    if type(items) not in (list, tuple):
        raise _Refused(f"set of {_kind(items)} (a pickled set holds a list)")
    return set(items)


def _frozenset(items: Any = ()) -> frozenset:
    if type(items) not in (list, tuple):
        raise _Refused(f"frozenset of {_kind(items)} (a pickled frozenset holds a list)")
    return frozenset(items)


def _bytes(*args: Any) -> bytes:
    # Protocol 2 writes b"" as bytes(), other bytes as _codecs.encode(str, "latin1") (Lib/pickle.py, save_bytes).
    if args:
        raise _Refused("bytes with arguments (a pickled b'' has none)")
    return b""


def _encode(text: Any, encoding: Any) -> bytes:
    if type(text) is not str or encoding != "latin1":
        raise _Refused(f"_codecs.encode of {_kind(text)} as {str(encoding)[:20]!r} (a pickled bytes is latin1 text)")
    return text.encode("latin-1")


def _ordered_dict(*args: Any) -> OrderedDict:
    # OrderedDict.__reduce__ passes no arguments; SETITEMS adds the items (Lib/collections/__init__.py).
    if args:
        raise _Refused("OrderedDict with arguments (a pickled OrderedDict has none)")
    return OrderedDict()


_CONSTRUCTORS = {
    ("builtins", "bytearray"): _bytearray,
    ("builtins", "set"): _set,
    ("builtins", "frozenset"): _frozenset,
    ("collections", "OrderedDict"): _ordered_dict,
    # protocol 2 names builtins as Python 2 did (Lib/_compat_pickle.py, IMPORT_MAPPING)
    ("__builtin__", "bytearray"): _bytearray,
    ("__builtin__", "set"): _set,
    ("__builtin__", "frozenset"): _frozenset,
    # protocol 2 writes bytes as these (Lib/pickle.py, save_bytes)
    ("__builtin__", "bytes"): _bytes,
    ("builtins", "bytes"): _bytes,
    ("_codecs", "encode"): _encode,
}
_CONSTRUCTOR_FUNCTIONS = (_bytearray, _set, _frozenset, _ordered_dict, _bytes, _encode)

# Bytes after an opcode that are read before any length is known (Lib/pickletools.py's ArgumentDescriptors).
_ARGUMENT_BYTES = {
    0x68: 1,
    0x6A: 4,
    0x8A: 1,
    0x4B: 1,
    0x4D: 2,
    0x4A: 4,
    0x8C: 1,
    0x58: 4,
    0x8D: 8,
    0x95: 8,
    0x71: 1,
    0x72: 4,
    0x47: 8,
    0x8B: 4,
    0x43: 1,
    0x42: 4,
    0x8E: 8,
    0x96: 8,
    0x80: 1,
}


def _opcode_name(code: int) -> str:
    import pickletools

    return next((op.name for op in pickletools.opcodes if op.code == chr(code)), f"opcode 0x{code:02x}")


def _over_budget(what: str, count: int, limit: int) -> _Refused:
    return _Refused(f"{count:,} {what}, over the budget of {limit:,}")


_HASH_LIMIT = (1 << 61) - 1  # CPython's modulus for numeric hashes (sys.hash_info.modulus)
_HASH_ENTRY_BYTES = 128  # one (container, hash) count in _Keys, or one tuple's note
_SHORT_TEXT = 64  # str or bytes keys this long or shorter cost next to nothing


class _Keys:
    """What putting keys into dicts and sets costs: refused before the keys go in.

    - More than SNAPSHOT_MAX_SAME_HASH keys with one hash in one container (each insert walks
      all of them). Only keys whose hashes a writer can make collide are counted, and long
      strings (two equal strings share a hash, and are compared byte by byte): short strings
      and bytes hash with a per-process key, and distinct integers below the modulus have
      distinct hashes (but -1 and -2).
    - A key that holds a tuple or frozenset: CPython does not keep a tuple's hash, so hashing
      t = (u, u), u = (v, v), ... walks every path through it, 2**depth. Snapshot keys are
      strings and integers.
    - SNAPSHOT_MAX_KEY_WORK steps of hashing and comparing, all keys together: a key costs its
      items (a string's 16 bytes as one), once to hash it and once per key of the same hash
      it is compared with.

    The counts are kept per container, with the container (held, so its id is never another's);
    a container built whole (a frozenset) is counted on its own."""

    __slots__ = ("containers", "tuples", "work")

    def __init__(self, tuples: dict[int, tuple[int, int]]) -> None:
        self.containers: dict[int, tuple[Any, dict[int, int]]] = {}  # id -> (container, hash -> keys)
        self.tuples = tuples  # _note_tuple's (depth, cost) of tuples and frozensets, by id
        self.work = 0

    def check(self, what: str, keys: Any, target: Any = None, counts: dict[int, int] | None = None) -> int:
        """Refuse ``keys`` going into ``target`` (or into a container counted in ``counts``); the bytes
        of memory the counts took."""
        added = 0
        for key in keys:
            kind = type(key)
            if kind is str or kind is bytes:
                if len(key) <= _SHORT_TEXT:
                    continue
                cost = (len(key) >> 4) + 1
            elif kind is int and -_HASH_LIMIT < key < _HASH_LIMIT or key is None:
                continue
            elif kind is tuple or kind is frozenset:
                noted = self.tuples.get(id(key))
                if noted is None:
                    cost = len(key) + 1
                elif noted[0] > 1:
                    raise _Refused(
                        f"a {what} key that holds a tuple or frozenset (hashing it walks every path "
                        f"through it; a snapshot's keys are strings and integers)"
                    )
                else:
                    cost = noted[1]
            else:
                cost = 1
            self.work += cost
            if self.work > SNAPSHOT_MAX_KEY_WORK:
                raise _over_budget("steps hashing and comparing keys", self.work, SNAPSHOT_MAX_KEY_WORK)
            if counts is None:
                if target is None:
                    counts = {}
                else:
                    held = self.containers.get(id(target))
                    if held is None:
                        counts = {}
                        self.containers[id(target)] = (target, counts)
                        added += _HASH_ENTRY_BYTES
                    else:
                        counts = held[1]
            slot = hash(key)
            count = counts.get(slot, 0) + 1
            if count > SNAPSHOT_MAX_SAME_HASH:
                raise _Refused(
                    f"more than {SNAPSHOT_MAX_SAME_HASH} keys with one hash in one {what} "
                    f"(building it would take time quadratic in its size)"
                )
            if count == 1:
                added += _HASH_ENTRY_BYTES
            else:  # compared with each key of that hash already in
                self.work += cost * (count - 1)
                if self.work > SNAPSHOT_MAX_KEY_WORK:
                    raise _over_budget("steps hashing and comparing keys", self.work, SNAPSHOT_MAX_KEY_WORK)
            counts[slot] = count
        return added

    def adopt(self, target: Any, counts: dict[int, int]) -> int:
        """Go on counting ``counts`` (taken by check for a container still to be built) as ``target``'s."""
        if not counts:
            return 0
        self.containers[id(target)] = (target, counts)
        return _HASH_ENTRY_BYTES


def _load_bounded(data: bytes) -> Any:
    """Run the pickle in ``data`` within the budgets. Raises _Refused, or what a corrupt pickle gives."""
    n = len(data)
    stack: list[Any] = []
    push, pop = stack.append, stack.pop
    marks: list[int] = []
    memo: list[Any] = []
    memo_references: list[int] = []  # memo references to each entry
    memoize = memo.append
    tuples: dict[int, tuple[int, int]] = {}  # _note_tuple's notes: (depth, cost as a key) by id
    value: Any  # what an opcode builds or takes off the stack
    unpack = struct.unpack_from
    max_items, max_objects = SNAPSHOT_MAX_CONTAINER_ITEMS, SNAPSHOT_MAX_OBJECTS
    objects = 0
    keys = _Keys(tuples)
    # Bytes beyond _OBJECT_BYTES per object: what containers hold, and what empty sets cost more.
    memory = 0
    max_memory = SNAPSHOT_MAX_MEMORY_BYTES
    item_bytes = _ITEM_BYTES
    pos = 0
    op = -1
    try:
        while True:
            op = data[pos]
            # The opcodes of real snapshots first, the most frequent first.
            if op == 0x68:  # BINGET
                index = data[pos + 1]
                push(memo[index])
                memo_references[index] += 1
                pos += 2
            elif op == 0x6A:  # LONG_BINGET
                index = unpack("<I", data, pos + 1)[0]
                push(memo[index])
                memo_references[index] += 1
                pos += 5
            elif op == 0x94:  # MEMOIZE
                memoize(stack[-1])
                memo_references.append(0)
                if len(memo) > SNAPSHOT_MAX_MEMO:
                    raise _over_budget("memo entries", len(memo), SNAPSHOT_MAX_MEMO)
                pos += 1
            elif op == 0x8A:  # LONG1
                start = pos + 2
                end = start + data[pos + 1]
                if end > n:
                    raise _Unreadable(f"an integer of {end - start} bytes past the end of the data")
                push(int.from_bytes(data[start:end], "little", signed=True))
                pos = end
                objects += 1
                if objects > max_objects:
                    raise _over_budget("objects", objects, max_objects)
            elif op == 0x28:  # MARK
                marks.append(len(stack))
                pos += 1
            elif op == 0x4B:  # BININT1
                push(data[pos + 1])
                pos += 2
                objects += 1
                if objects > max_objects:
                    raise _over_budget("objects", objects, max_objects)
            elif op == 0x7D:  # EMPTY_DICT
                push({})
                pos += 1
                objects += 1
                if objects > max_objects:
                    raise _over_budget("objects", objects, max_objects)
            elif op == 0x75:  # SETITEMS
                mark = marks.pop()
                target = stack[mark - 1]
                if mark == 0 or not isinstance(target, dict):
                    raise _Unreadable(f"SETITEMS on {'nothing' if mark == 0 else _kind(target)}")
                memory += keys.check("dict", stack[mark::2], target)
                memory += (len(stack) - mark) // 2 * item_bytes[type(target)]
                if memory + objects * _OBJECT_BYTES > max_memory:
                    raise _over_budget("bytes of memory", memory + objects * _OBJECT_BYTES, max_memory)
                flat = iter(stack[mark:])
                del stack[mark:]
                target.update(zip(flat, flat))
                if next(flat, target) is not target:
                    raise _Unreadable("SETITEMS with a key and no value")
                if len(target) > max_items:
                    raise _over_budget("items in one dict", len(target), max_items)
                pos += 1
            elif op == 0x4A:  # BININT
                push(unpack("<i", data, pos + 1)[0])
                pos += 5
                objects += 1
                if objects > max_objects:
                    raise _over_budget("objects", objects, max_objects)
            elif op == 0x5D:  # EMPTY_LIST
                push([])
                pos += 1
                objects += 1
                if objects > max_objects:
                    raise _over_budget("objects", objects, max_objects)
            elif op == 0x65:  # APPENDS
                mark = marks.pop()
                target = stack[mark - 1]
                if mark == 0 or type(target) is not list:
                    raise _Unreadable(f"APPENDS on {'nothing' if mark == 0 else _kind(target)}")
                memory += (len(stack) - mark) * 9
                if memory + objects * _OBJECT_BYTES > max_memory:
                    raise _over_budget("bytes of memory", memory + objects * _OBJECT_BYTES, max_memory)
                target += stack[mark:]
                del stack[mark:]
                if len(target) > max_items:
                    raise _over_budget("items in one list", len(target), max_items)
                pos += 1
            elif op == 0x8C or op == 0x58 or op == 0x8D:  # SHORT_BINUNICODE, BINUNICODE, BINUNICODE8
                if op == 0x8C:
                    length, start = data[pos + 1], pos + 2
                else:
                    wide = op != 0x58  # an 8-byte length, not 4
                    length, start = unpack("<Q" if wide else "<I", data, pos + 1)[0], pos + (9 if wide else 5)
                    if length > SNAPSHOT_MAX_STRING_BYTES:
                        raise _over_budget("bytes in one string", length, SNAPSHOT_MAX_STRING_BYTES)
                end = start + length
                if end > n:
                    raise _Unreadable(f"a string of {length:,} bytes past the end of the data")
                push(str(data[start:end], "utf-8", "surrogatepass"))
                pos = end
                objects += 1
                if objects > max_objects:
                    raise _over_budget("objects", objects, max_objects)
            elif op == 0x4D:  # BININT2
                push(data[pos + 1] | data[pos + 2] << 8)
                pos += 3
                objects += 1
                if objects > max_objects:
                    raise _over_budget("objects", objects, max_objects)
            elif op == 0x89 or op == 0x88 or op == 0x4E:  # NEWFALSE, NEWTRUE, NONE
                push(False if op == 0x89 else True if op == 0x88 else None)
                pos += 1
                objects += 1
                if objects > max_objects:
                    raise _over_budget("objects", objects, max_objects)
            elif 0x85 <= op <= 0x87 or op == 0x74 or op == 0x29:  # TUPLE1-3, TUPLE (from a mark), EMPTY_TUPLE
                if op == 0x74:
                    mark = marks.pop()
                elif op == 0x29:
                    mark = len(stack)
                else:
                    mark = len(stack) - (op - 0x84)
                    if mark < (marks[-1] if marks else 0):
                        raise _Unreadable(f"{_opcode_name(op)} with too little on the stack")
                if len(stack) - mark > max_items:
                    raise _over_budget("items in one tuple", len(stack) - mark, max_items)
                memory += (len(stack) - mark) * 8
                value = tuple(stack[mark:])
                del stack[mark:]
                memory += _note_tuple(value, tuples)
                push(value)
                pos += 1
                objects += 1
                if objects > max_objects:
                    raise _over_budget("objects", objects, max_objects)
            elif op == 0x95:  # FRAME: a hint for buffered readers
                frame = unpack("<Q", data, pos + 1)[0]
                if pos + 9 + frame > n:
                    raise _Unreadable(f"the data ends at byte {n:,}, inside a frame of {frame:,} bytes")
                pos += 9
            elif op == 0x61 or op == 0x73:  # APPEND, SETITEM
                if len(stack) - (marks[-1] if marks else 0) < (2 if op == 0x61 else 3):
                    raise _Unreadable(f"{'APPEND' if op == 0x61 else 'SETITEM'} with too little on the stack")
                value = pop()
                if op == 0x73:
                    key = pop()
                    target = stack[-1]
                    if not isinstance(target, dict):
                        raise _Unreadable(f"SETITEM on {_kind(target)}")
                    memory += keys.check("dict", (key,), target)
                    memory += item_bytes[type(target)]
                    target[key] = value
                else:
                    target = stack[-1]
                    if type(target) is not list:
                        raise _Unreadable(f"APPEND on {_kind(target)}")
                    memory += 9
                    target.append(value)
                if len(target) > max_items:
                    raise _over_budget("items in one container", len(target), max_items)
                if memory + objects * _OBJECT_BYTES > max_memory:
                    raise _over_budget("bytes of memory", memory + objects * _OBJECT_BYTES, max_memory)
                pos += 1
            elif op == 0x2E:  # STOP
                if not stack:
                    raise _Unreadable("STOP with nothing built")
                _count_values(objects, memo, memo_references)
                return stack[-1]
            elif op == 0x47:  # BINFLOAT
                push(unpack(">d", data, pos + 1)[0])
                pos += 9
                objects += 1
                if objects > max_objects:
                    raise _over_budget("objects", objects, max_objects)
            elif op == 0x71 or op == 0x72:  # BINPUT, LONG_BINPUT
                index = data[pos + 1] if op == 0x71 else unpack("<I", data, pos + 1)[0]
                # The pickler stores at len(memo) (Lib/pickle.py:509), never elsewhere. Further out
                # is a sparse memo, which CPython's C unpickler grows to twice the index.
                if index != len(memo):
                    raise _Refused(f"memo index {index:,} stored where the next is {len(memo):,}")
                memoize(stack[-1])
                memo_references.append(0)
                if len(memo) > SNAPSHOT_MAX_MEMO:
                    raise _over_budget("memo entries", len(memo), SNAPSHOT_MAX_MEMO)
                pos += 2 if op == 0x71 else 5
            elif op == 0x8B:  # LONG4
                length = unpack("<i", data, pos + 1)[0]
                if not 0 <= length <= 255:  # a snapshot's integers are addresses and sizes
                    raise _over_budget("bytes in one integer", length, 255)
                start = pos + 5
                end = start + length
                if end > n:
                    raise _Unreadable(f"an integer of {length} bytes past the end of the data")
                push(int.from_bytes(data[start:end], "little", signed=True))
                pos = end
                objects += 1
                if objects > max_objects:
                    raise _over_budget("objects", objects, max_objects)
            elif op in (0x43, 0x42, 0x8E, 0x96):  # SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8
                if op == 0x43:
                    length, start = data[pos + 1], pos + 2
                else:
                    wide = op != 0x42  # an 8-byte length, not 4
                    length, start = unpack("<Q" if wide else "<I", data, pos + 1)[0], pos + (9 if wide else 5)
                if length > SNAPSHOT_MAX_STRING_BYTES:
                    raise _over_budget("bytes in one string", length, SNAPSHOT_MAX_STRING_BYTES)
                end = start + length
                if end > n:
                    raise _Unreadable(f"a string of {length:,} bytes past the end of the data")
                push((bytearray if op == 0x96 else bytes)(data[start:end]))
                pos = end
                objects += 1
                if objects > max_objects:
                    raise _over_budget("objects", objects, max_objects)
            elif op == 0x8F:  # EMPTY_SET
                push(set())
                pos += 1
                objects += 1
                memory += _EMPTY_SET_BYTES
                if objects > max_objects:
                    raise _over_budget("objects", objects, max_objects)
                if memory + objects * _OBJECT_BYTES > max_memory:
                    raise _over_budget("bytes of memory", memory + objects * _OBJECT_BYTES, max_memory)
            elif op == 0x90 or op == 0x91:  # ADDITEMS, FROZENSET (from a mark)
                mark = marks.pop()
                items = stack[mark:]
                del stack[mark:]
                memory += len(items) * item_bytes[set] + (_EMPTY_SET_BYTES if op == 0x91 else 0)
                if memory + objects * _OBJECT_BYTES > max_memory:
                    raise _over_budget("bytes of memory", memory + objects * _OBJECT_BYTES, max_memory)
                if op == 0x90:
                    target = stack[-1] if stack else None
                    if type(target) is not set:
                        raise _Unreadable(f"ADDITEMS on {_kind(target)}")
                    memory += keys.check("set", items, target)
                    target.update(items)
                else:
                    memory += keys.check("frozenset", items)
                    target = frozenset(items)
                    memory += _note_tuple(target, tuples)
                    push(target)
                    objects += 1
                    if objects > max_objects:
                        raise _over_budget("objects", objects, max_objects)
                if len(target) > max_items:
                    raise _over_budget("items in one set", len(target), max_items)
                pos += 1
            elif op == 0x30:  # POP
                if marks and marks[-1] == len(stack):
                    marks.pop()  # an empty frame: POP takes the mark (Lib/pickle.py, load_pop)
                else:
                    pop()
                pos += 1
            elif op == 0x31:  # POP_MARK
                del stack[marks.pop() :]
                pos += 1
            elif op == 0x63 or op == 0x93:  # GLOBAL, STACK_GLOBAL
                if op == 0x63:
                    end_module = data.find(b"\n", pos + 1, pos + 258)
                    end_name = data.find(b"\n", end_module + 1, end_module + 258)
                    if end_module < 0 or end_name < 0:
                        raise _Unreadable("GLOBAL without two lines of names")
                    module = data[pos + 1 : end_module].decode("utf-8", "replace")
                    name = data[end_module + 1 : end_name].decode("utf-8", "replace")
                    pos = end_name + 1
                else:
                    if len(stack) - (marks[-1] if marks else 0) < 2:
                        raise _Unreadable("STACK_GLOBAL with too little on the stack")
                    name, module = pop(), pop()
                    if type(name) is not str or type(module) is not str:
                        raise _Unreadable("STACK_GLOBAL of names that are not strings")
                    pos += 1
                constructor = _CONSTRUCTORS.get((module, name))
                if constructor is None:
                    raise _Refused(f"refusing to load {module[:80]}.{name[:80]} from a snapshot pickle")
                push(constructor)
            elif op == 0x52:  # REDUCE
                if len(stack) - (marks[-1] if marks else 0) < 2:
                    raise _Unreadable("REDUCE with too little on the stack")
                args = pop()
                constructor = stack[-1]
                if constructor not in _CONSTRUCTOR_FUNCTIONS or type(args) is not tuple:
                    raise _Refused(f"REDUCE of {_kind(constructor)}")
                counts: dict[int, int] = {}
                text = 0  # bytes of the str, bytes or bytearray built: a copy, however few bytes asked for it
                if (constructor is _set or constructor is _frozenset) and args and type(args[0]) in (list, tuple):
                    memory += keys.check("set" if constructor is _set else "frozenset", args[0], counts=counts)
                    memory += len(args[0]) * item_bytes[set] + _EMPTY_SET_BYTES
                elif (constructor is _encode or constructor is _bytearray) and args and type(args[0]) in (str, bytes):
                    text = len(args[0])  # latin-1: a byte a character
                    memory += text
                if memory + objects * _OBJECT_BYTES > max_memory:
                    raise _over_budget("bytes of memory", memory + objects * _OBJECT_BYTES, max_memory)
                value = constructor(*args)
                if len(value) > max_items:
                    raise _over_budget("items in one container", len(value), max_items)
                kind = type(value)
                if kind is frozenset:
                    memory += _note_tuple(value, tuples)
                elif kind is set:
                    memory += keys.adopt(value, counts)
                elif (kind is bytes or kind is bytearray or kind is str) and len(value) > text:
                    memory += len(value) - text
                    if memory + objects * _OBJECT_BYTES > max_memory:
                        raise _over_budget("bytes of memory", memory + objects * _OBJECT_BYTES, max_memory)
                stack[-1] = value
                pos += 1
                objects += 1
                if objects > max_objects:
                    raise _over_budget("objects", objects, max_objects)
            elif op == 0x80:  # PROTO
                if not 2 <= data[pos + 1] <= 5:
                    raise _Unreadable(f"pickle protocol {data[pos + 1]} (a snapshot is written at 2 to 5)")
                pos += 2
            else:
                raise _Unreadable(f"{_opcode_name(op)} (not an opcode of a pickle of dicts, lists and numbers)")
    except _Refused as exc:
        raise exc.__class__(f"{exc} at byte {pos:,}") from None
    except (IndexError, struct.error):
        if pos >= n or pos + 1 + _ARGUMENT_BYTES.get(op, 0) > n:
            raise _Unreadable(f"the data ends at byte {n:,} without STOP") from None
        if op == 0x68 or op == 0x6A:
            index = data[pos + 1] if op == 0x68 else unpack("<I", data, pos + 1)[0]
            raise _Unreadable(
                f"memo index {index:,} was never stored ({len(memo):,} entries) at byte {pos:,}"
            ) from None
        raise _Unreadable(f"{_opcode_name(op)} with nothing to take from the stack at byte {pos:,}") from None


def _note_tuple(value: Any, tuples: dict[int, tuple[int, int]]) -> int:
    """Note a new tuple or frozenset's depth and its cost as a key (see _Keys), where they are not
    what a tuple of scalars has (1, and its length + 1); refuse it nested deeper than the budget:
    hashing it recurses in C. Returns the bytes of memory the note took.

    Every tuple and frozenset built is noted here (or its id cleared), so a note found by the id
    of a live one is its own, never one of a tuple gone since."""
    deepest = 0
    cost = len(value) + 1
    for item in value:
        kind = type(item)
        if kind is str or kind is bytes:
            if len(item) > _SHORT_TEXT:
                cost += len(item) >> 4  # compared byte by byte with an equal string
        elif kind in _HASHABLE_CONTAINERS:
            deepest = max(deepest, tuples.get(id(item), (1,))[0])
    if type(value) is frozenset and cost > 1:
        # comparing two frozensets looks each item up in the other: up to that many keys of its hash
        cost = 1 + (cost - 1) * SNAPSHOT_MAX_SAME_HASH
    if deepest >= SNAPSHOT_MAX_DEPTH:
        raise _Refused(f"tuples nested over {SNAPSHOT_MAX_DEPTH} deep")
    if not deepest and cost == len(value) + 1:
        tuples.pop(id(value), None)  # the id of a tuple gone since
        return 0
    tuples[id(value)] = (deepest + 1, cost)
    return _HASH_ENTRY_BYTES


def _count_values(objects: int, memo: list[Any], memo_references: list[int]) -> None:
    """Refuse a pickle whose values, each memo reference counted as the whole value it refers to, are over budget.

    A walk that treats the snapshot as a tree (as its readers do) visits a shared value each
    time it is referred to: a few hundred bytes of references that double at each level
    would make it walk for ever. Every value built is counted once, and each reference as
    all the values in what it refers to, as it stands at the end. Values built but dropped
    (POP) count too: a bound, not an exact figure."""
    shared = _Shared()
    total = objects
    for value, references in zip(memo, memo_references):
        if references:
            total += references * shared.count(value)
            if total > SNAPSHOT_MAX_VALUES:
                raise _over_budget("values with every shared reference counted in full", total, SNAPSHOT_MAX_VALUES)


class _Shared:
    """Values in each container (values in it, and in what it holds, counted as a tree), computed once each.

    A container that holds itself is refused."""

    def __init__(self) -> None:
        # id -> values in it; -1 while it is being counted. Ids stay unique: the memo keeps all of them alive.
        self.values: dict[int, int] = {}

    def count(self, obj: Any, depth: int = 0) -> int:
        if type(obj) not in _CONTAINER_TYPES:
            return 1
        known = self.values.get
        key = id(obj)
        total = known(key)
        if total is not None:
            if total < 0:
                raise _Refused("a container that holds itself")
            return total
        if depth > SNAPSHOT_MAX_DEPTH:
            raise _Refused(f"containers nested over {SNAPSHOT_MAX_DEPTH} deep")
        self.values[key] = -1
        parts: tuple[Any, ...]
        if isinstance(obj, dict):
            total, parts = 1 + 2 * len(obj), (obj, obj.values())
        else:
            total, parts = 1 + len(obj), (obj,)
        for part in parts:
            if set(map(type, part)).isdisjoint(_CONTAINER_TYPES):
                continue
            sizes = list(map(known, map(id, part)))  # None: a scalar, or a container not counted yet
            if -1 in sizes:
                raise _Refused("a container that holds itself")
            uncounted = sizes.count(None)
            total += sum(filter(None, sizes)) - (len(sizes) - uncounted)
            if uncounted:
                for item in compress(part, map(is_, sizes, repeat(None))):
                    if type(item) in _CONTAINER_TYPES:
                        total += self.count(item, depth + 1) - 1
        self.values[key] = total
        return total


def load_snapshot_pickle(data: bytes) -> dict[str, Any]:
    """Read a ``_dump_snapshot`` pickle within the budgets above; anything else is a one-line TraceError."""
    if len(data) > SNAPSHOT_MAX_BYTES:
        raise TraceError(f"snapshot pickle of {len(data):,} bytes, over the budget of {SNAPSHOT_MAX_BYTES:,}")
    # The cyclic collector walks every container built so far each time it runs: with millions
    # of containers that is most of the time spent (2,000,000 empty sets: 5 s). What is built here
    # holds no cycles that are kept (a container that holds itself is refused).
    collecting = gc.isenabled()
    gc.disable()
    try:
        snapshot = _load_bounded(data)
    except _Unreadable as exc:
        raise TraceError(f"cannot read snapshot pickle: {exc}") from None
    except _Refused as exc:
        raise TraceError(f"not a plain snapshot pickle: {exc}") from None
    except Exception as exc:  # a corrupt file: unhashable keys, bad UTF-8
        raise TraceError(
            f"cannot read snapshot pickle: {one_line(exc, first_line=True, with_type=True)}"[:300]
        ) from None
    finally:
        if collecting:
            gc.enable()
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
        return  # segment_*, snapshot, oom: not replayed, not checked
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
    """The file's bytes; a snapshot pickle is read no further than one byte past its budget."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(1)
            if not is_snapshot_pickle(head):
                return head + handle.read()
            data = head + handle.read(SNAPSHOT_MAX_BYTES)
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    if len(data) > SNAPSHOT_MAX_BYTES:
        raise TraceError(f"snapshot pickle {path} is over the budget of {SNAPSHOT_MAX_BYTES:,} bytes")
    return data


def is_snapshot_pickle(data: bytes) -> bool:
    return data[:1] == b"\x80"  # pickle protocol 2+


def load_trace(path: str) -> Trace:
    """Read a trace file, telling the format from its content."""
    data = read_trace_bytes(path)
    if is_snapshot_pickle(data):
        return parse_torch_snapshot(load_snapshot_pickle(data))
    try:
        text = data.decode("utf-8-sig")  # a BOM from a spreadsheet round trip is not a header cell
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
                samples.append(
                    (
                        index,
                        allocator.allocated_bytes,
                        allocator.reserved_bytes,
                        device.used_bytes if device is not None else 0,
                    )
                )
    except AllocatorOutOfMemory as exc:
        return ReplayResult(
            index,
            True,
            index,
            exc.requested_bytes,
            allocator.peak_allocated_bytes,
            allocator.peak_reserved_bytes,
            allocator.memory_stats(),
            tuple(samples),
        )
    return ReplayResult(
        index + 1,
        False,
        None,
        None,
        allocator.peak_allocated_bytes,
        allocator.peak_reserved_bytes,
        allocator.memory_stats(),
        tuple(samples),
    )
