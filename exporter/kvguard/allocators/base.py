"""What every simulated allocator offers the workload, and the error it raises."""

from __future__ import annotations

from typing import Any, Protocol

from kvguard.allocators.device import Device


class AllocatorOutOfMemory(MemoryError):
    """The allocator could not serve a request, after its own retries.

    Mirrors ``torch.OutOfMemoryError`` / MindSpore's "Out of Memory" device error.
    """

    def __init__(self, requested_bytes: int, allocator: str, free_bytes: int, detail: str = "") -> None:
        self.requested_bytes = requested_bytes
        self.allocator = allocator
        self.free_bytes = free_bytes
        message = f"{allocator}: out of memory allocating {requested_bytes} bytes ({free_bytes} bytes free on device)"
        super().__init__(message + (f"; {detail}" if detail else ""))


def link_after(node: Any, new: Any) -> None:
    """Splice ``new`` into a block list (``prev``/``next`` links) right after ``node``."""
    nxt = node.next
    new.next = nxt
    if nxt is not None:
        nxt.prev = new
    new.prev = node
    node.next = new


def absorb(dst: Any, src: Any) -> None:
    """Merge ``src``, ``dst``'s neighbour in a block list, into ``dst``: its bytes and its place."""
    if dst.prev is src:
        dst.addr = src.addr
        prev = dst.prev = src.prev
        if prev is not None:
            prev.next = dst
    else:
        nxt = dst.next = src.next
        if nxt is not None:
            nxt.prev = dst
    dst.size += src.size


class Allocator(Protocol):
    """The common face of the simulated allocators.

    ``malloc`` returns an address (an int); ``persistent`` selects MindSpore's persistent
    pool and is ignored by the PyTorch models. Counters use the real allocator's names
    in ``memory_stats()``; the properties below are what the workload reads each step.
    """

    name: str
    device: Device

    def malloc(self, size: int, persistent: bool = False) -> int: ...

    def free(self, addr: int) -> None: ...

    def empty_cache(self) -> None: ...

    def reset_peak_memory_stats(self) -> None: ...

    def memory_stats(self) -> dict[str, Any]: ...

    @property
    def allocated_bytes(self) -> int: ...

    @property
    def reserved_bytes(self) -> int: ...

    @property
    def peak_allocated_bytes(self) -> int: ...

    @property
    def peak_reserved_bytes(self) -> int: ...

    def take_window_peaks(self) -> tuple[int, int]:
        """(max allocated, max reserved) since the last call; does not touch ``memory_stats`` peaks."""
        ...


# ----------------------------------------------------------------------------- steady forwards
# A serving step allocates and frees its activations; once the allocator's cache has settled, the
# step leaves it exactly as it found it, and only counters (freed totals) and peaks move. Such a
# step is recorded once (``record_steady``) and replayed (``replay_steady``) whenever the allocator
# is in the same state before the same op sequence: the models are deterministic, so the replay
# leaves every counter, peak and address as executing the ops would.
#
# An allocator that supports it has ``steady_state_key()`` (everything the ops' outcome depends on,
# hashable; None when it cannot say) and ``steady_cells()`` (its additive counters and its
# high-water marks, as (container, index-or-attribute) pairs, the same order every call).

# One cell: (container, index) or (object, attribute name).
SteadyCell = tuple[Any, int | str]
# What ``steady_cells()`` returns: (additive counters, high-water marks).
SteadyCells = tuple[list[SteadyCell], list[SteadyCell]]

_NO_PEAK = -(1 << 62)  # below any byte count, and within a C engine's int64 cell: a mark left at it was not raised


class FrozenKey:
    """A hashable value with its hash computed once (a tuple of hundreds of segments, compared rarely)."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: Any) -> None:
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, FrozenKey) and self._hash == other._hash and self.value == other.value
        )


def record_steady(allocator: Any, run: Any) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """Call ``run()`` and return what it did to ``allocator``'s counters and peaks: (counter index,
    increase) and (peak index, highest value reached) for those that moved. The peaks end as
    ``run()`` leaves them, also when it raises."""
    counters, peaks = allocator.steady_cells()
    # Cells read and written inline: a forward is recorded layer by layer.
    before = [getattr(obj, key) if key.__class__ is str else obj[key] for obj, key in counters]
    marks = [getattr(obj, key) if key.__class__ is str else obj[key] for obj, key in peaks]
    for obj, key in peaks:
        if key.__class__ is str:
            setattr(obj, key, _NO_PEAK)
        else:
            obj[key] = _NO_PEAK
    try:
        run()
    finally:
        reached = [getattr(obj, key) if key.__class__ is str else obj[key] for obj, key in peaks]
        for (obj, key), mark, high in zip(peaks, marks, reached):
            if key.__class__ is str:
                setattr(obj, key, mark if mark >= high else high)
            else:
                obj[key] = mark if mark >= high else high
    after = [getattr(obj, key) if key.__class__ is str else obj[key] for obj, key in counters]
    increases = tuple((i, new - old) for i, (new, old) in enumerate(zip(after, before)) if new != old)
    return increases, tuple((i, high) for i, high in enumerate(reached) if high != _NO_PEAK)


def replay_steady(
    allocator: Any, recorded: tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]], times: int = 1
) -> None:
    """Apply a recorded steady run (``record_steady``) to ``allocator`` in the state it was recorded in,
    ``times`` times over."""
    counters, peaks = allocator.steady_cells()
    increases, highs = recorded
    for index, amount in increases:
        amount *= times
        obj, key = counters[index]
        if isinstance(key, str):
            setattr(obj, key, getattr(obj, key) + amount)
        else:
            obj[key] += amount
    for index, high in highs:
        obj, key = peaks[index]
        if isinstance(key, str):
            if high > getattr(obj, key):
                setattr(obj, key, high)
        elif high > obj[key]:
            obj[key] = high
