"""A plain allocator op stream: read it, replay it through any allocator model, record one.

The format is JSON lines, one op a line (``kvguard simulate --ops FILE``)::

    {"op": "malloc", "size": 1048576, "persistent": false}
    {"op": "free", "index": 0}
    {"op": "empty_cache"}

- ``malloc``: ``size`` bytes (an int, 0 or more); ``persistent`` (default false) selects
  MindSpore's persistent pool and is ignored by the PyTorch models.
- ``free``: frees the block of the malloc at ``index``, its 0-based position among the
  file's ops. Freeing a malloc that ran out of memory (or returned no block, as a 0-byte
  request does on torch_npu) does nothing. An index that is not an earlier malloc, or is
  freed twice, is an error.
- ``empty_cache``: the allocator's ``empty_cache()``.

Blank lines are not ops. Unknown ops or keys are refused, so a typo (``"sz"``) is an error,
not a silent 0. The same file drives the real allocators in ``tests/upstream/oracles/`` and the models
here, which is what makes a step-by-step comparison possible.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from kvguard.allocators.base import AllocatorOutOfMemory
from kvguard.text import one_line

MAX_OPS = 5_000_000  # about 0.5 GiB of parsed ops; a longer stream is refused, not swapped
MAX_LINE_CHARS = 4096  # an op is a few dozen characters
MAX_SIZE_BYTES = 1 << 50  # 1 PiB: larger than any device, small enough to stay exact in JSON
OP_KEYS = {"malloc": {"op", "size", "persistent"}, "free": {"op", "index"}, "empty_cache": {"op"}}


class OpsError(ValueError):
    """A malformed op stream; the message is one line naming the op."""


@dataclass(frozen=True, slots=True)
class Op:
    kind: str  # "malloc" | "free" | "empty_cache"
    size: int = 0  # malloc: bytes requested
    persistent: bool = False  # malloc: MindSpore's persistent pool
    index: int = -1  # free: the position of the malloc freed

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "malloc":
            return {"op": "malloc", "size": self.size, "persistent": self.persistent}
        if self.kind == "free":
            return {"op": "free", "index": self.index}
        return {"op": self.kind}

    def to_line(self) -> str:
        """``json.dumps(self.to_dict(), separators=(",", ":"))``, formatted directly (streams run to
        millions of ops)."""
        if self.kind == "malloc":
            return f'{{"op":"malloc","size":{self.size},"persistent":{"true" if self.persistent else "false"}}}'
        if self.kind == "free":
            return f'{{"op":"free","index":{self.index}}}'
        return f'{{"op":"{self.kind}"}}'


def _parse_one(text: str, position: int, ops: list[Op], freed: set[int]) -> Op:
    where = f"op {position}"
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise OpsError(f"{where}: not JSON ({one_line(exc, with_type=True)[:120]})") from None
    if not isinstance(record, dict):
        raise OpsError(f"{where}: expected a JSON object, got {type(record).__name__}")
    kind = record.get("op")
    if not isinstance(kind, str) or kind not in OP_KEYS:
        raise OpsError(f"{where}: unknown op {str(kind)[:40]!r} (malloc, free or empty_cache)")
    unknown = set(record) - OP_KEYS[kind]
    if unknown:
        raise OpsError(f"{where}: unknown key(s) for {kind}: {', '.join(sorted(map(str, unknown)))[:80]}")
    if kind == "malloc":
        size = record.get("size")
        if type(size) is not int or not 0 <= size <= MAX_SIZE_BYTES:
            raise OpsError(f"{where}: malloc size must be an integer from 0 to {MAX_SIZE_BYTES}, got {str(size)[:40]}")
        persistent = record.get("persistent", False)
        if type(persistent) is not bool:
            raise OpsError(f"{where}: persistent must be true or false, got {str(persistent)[:40]}")
        return Op("malloc", size=size, persistent=persistent)
    if kind == "free":
        index = record.get("index")
        if type(index) is not int or not 0 <= index < position or ops[index].kind != "malloc":
            raise OpsError(f"{where}: free index must name an earlier malloc, got {str(index)[:40]}")
        if index in freed:
            raise OpsError(f"{where}: frees malloc {index} a second time")
        freed.add(index)
        return Op("free", index=index)
    return Op("empty_cache")


def parse_ops(lines: Iterable[str]) -> list[Op]:
    """The ops of a JSON-lines stream, checked; :class:`OpsError` (one line) on the first bad op."""
    ops: list[Op] = []
    freed: set[int] = set()
    for line in lines:
        text = line.strip()
        if not text:
            continue
        if len(text) > MAX_LINE_CHARS:
            raise OpsError(f"op {len(ops)}: line longer than {MAX_LINE_CHARS} characters")
        if len(ops) >= MAX_OPS:
            raise OpsError(f"more than {MAX_OPS} ops; split the stream")
        ops.append(_parse_one(text, len(ops), ops, freed))
    return ops


def read_ops(path: str) -> list[Op]:
    """:func:`parse_ops` of a file, read line by line with bounded lines (a 4 GB line is refused, not read)."""

    def lines(handle) -> Iterator[str]:
        while True:
            line = handle.readline(MAX_LINE_CHARS + 2)
            if not line:
                return
            if len(line) > MAX_LINE_CHARS and not line.endswith("\n"):
                raise OpsError(f"{path}: a line longer than {MAX_LINE_CHARS} characters")
            yield line

    try:
        with open(path, encoding="utf-8") as handle:
            return parse_ops(lines(handle))
    except OSError as exc:
        raise OpsError(f"cannot read {path}: {exc.strerror or exc.__class__.__name__}") from None
    except UnicodeDecodeError:
        raise OpsError(f"{path}: not UTF-8 text") from None


def write_ops(ops: Iterable[Op], handle) -> None:
    handle.writelines(op.to_line() + "\n" for op in ops)


def replay_ops(allocator: Any, ops: Iterable[Op]) -> Iterator[dict[str, Any]]:
    """Run ``ops`` through ``allocator`` (the :class:`~kvguard.allocators.base.Allocator` protocol).

    Yields one record per op, after it ran: ``reserved_bytes``, ``allocated_bytes``,
    ``peak_allocated_bytes``, ``oom`` (this op ran out of memory) and ``address`` (a malloc's
    block, None otherwise), the fields an oracle reports for the same op.
    """
    addresses: dict[int, int] = {}
    for position, op in enumerate(ops):
        oom = False
        address = None
        if op.kind == "malloc":
            try:
                address = allocator.malloc(op.size, op.persistent)
            except AllocatorOutOfMemory:
                oom = True
            else:
                if address:
                    addresses[position] = address
        elif op.kind == "free":
            freed = addresses.pop(op.index, None)
            if freed is not None:
                allocator.free(freed)
        else:
            allocator.empty_cache()
        yield {
            "op": position,
            "kind": op.kind,
            "reserved_bytes": allocator.reserved_bytes,
            "allocated_bytes": allocator.allocated_bytes,
            "peak_allocated_bytes": allocator.peak_allocated_bytes,
            "oom": oom,
            "address": address,
        }


class Recorder:
    """Wraps an allocator and records what is asked of it as ops (``.ops``), to replay elsewhere.

    Everything else (counters, ``memory_stats()``, peaks) reads through to the wrapped allocator.
    A malloc that runs out of memory is recorded too, and re-raised: a replay meets the same request.
    MindSpore's ``jit_o0_compile()`` (task sink cleared, ``sim/mindspore_pool.py``) is no op of the
    stream but a change of the pool's context: ``compiled_at`` keeps the op positions it came before.
    """

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator
        self.ops: list[Op] = []
        self.compiled_at: list[int] = []
        self._malloc_of: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.allocator, name)
        if name == "jit_o0_compile":

            def jit_o0_compile() -> None:
                self.compiled_at.append(len(self.ops))
                attribute()

            return jit_o0_compile
        return attribute

    def malloc(self, size: int, persistent: bool = False) -> int:
        position = len(self.ops)
        self.ops.append(Op("malloc", size=size, persistent=persistent))
        address = self.allocator.malloc(size, persistent)
        if address:
            self._malloc_of[address] = position
        return address

    def free(self, addr: int) -> None:
        self.ops.append(Op("free", index=self._malloc_of.pop(addr)))
        self.allocator.free(addr)

    def empty_cache(self) -> None:
        self.ops.append(Op("empty_cache"))
        self.allocator.empty_cache()
