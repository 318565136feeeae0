"""What every simulated allocator offers the workload, and the error it raises."""

from __future__ import annotations

from typing import Any, Protocol


class SimOutOfMemory(MemoryError):
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
