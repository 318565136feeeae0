"""PyTorch's CUDA caching allocator (and torch_npu's variant), rule for rule.

Pinned to the native backend of torch 2.1-2.5 (``c10/cuda/CUDACachingAllocator.cpp``),
one device, one stream, no CUDA-graph private pools, no garbage-collection threshold:

- requests are rounded up to 512 bytes (torch_npu first adds 32 bytes);
- rounded sizes <= 1 MiB go to the small pool, others to the large pool;
- a new segment is 2 MiB for the small pool, 20 MiB for requests under 10 MiB, and the
  request rounded up to 2 MiB from 10 MiB on;
- a cached block is found by best fit on (size, address) within the pool; a block of
  ``max_split_size`` or more is never handed to a smaller request, nor a block 20 MiB
  or more larger than a request of ``max_split_size`` or more;
- a found block is split when the remainder is >= 512 bytes (small pool, or expandable
  segments), or, in the large pool, when the request is under ``max_split_size`` and
  the remainder is over 1 MiB;
- a freed block merges with free neighbours of its segment;
- when the device refuses a segment: free cached oversize blocks (only when
  ``max_split_size`` is set) and retry; then free every cached unsplit segment and
  retry (``num_alloc_retries`` += 1); then fail (``num_ooms`` += 1);
- ``expandable_segments``: one segment per pool reserves 1 1/8 x the device's memory of
  address space; physical pages (2 MiB small, 20 MiB large) are mapped as the segment
  grows and unmapped from free blocks on ``empty_cache`` or on the retry path.

Statistics use the real flattened key names of ``torch.cuda.memory_stats()``.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any

from .base import SimOutOfMemory, absorb, link_after
from .device import Device

K_MIN_BLOCK_SIZE = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20
NPU_SIZE_PAD = 32
_UNLIMITED = (1 << 64) - 1

STAT_ARRAYS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
               "active_bytes", "inactive_split_bytes", "requested_bytes")
STAT_POOLS = ("all", "small_pool", "large_pool")
STAT_FIELDS = ("current", "peak", "allocated", "freed")
# Indexes into the per-pool stat arrays.
_ALL, _SMALL, _LARGE = 0, 1, 2


class Block:
    __slots__ = ("addr", "size", "requested", "small", "prev", "next", "allocated", "mapped", "segment")

    def __init__(self, addr: int, size: int, small: bool, segment: "Segment") -> None:
        self.addr = addr
        self.size = size
        self.requested = 0
        self.small = small
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.mapped = True
        self.segment = segment

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class Segment:
    """A device allocation (or, expandable, a reserved address range with mapped pages)."""

    __slots__ = ("base", "size", "small", "expandable", "page_size")

    def __init__(self, base: int, size: int, small: bool, expandable: bool = False, page_size: int = 0) -> None:
        self.base = base
        self.size = size
        self.small = small
        self.expandable = expandable
        self.page_size = page_size


def _new_stat() -> list[list[int]]:
    return [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]


class CachingAllocator:
    """PyTorch's caching allocator on a simulated device.

    ``variant="torch_npu"`` applies torch_npu's 32-byte pad before rounding; everything
    else in ``NPUCachingAllocator.cpp`` follows the CUDA rules modelled here.
    """

    def __init__(self, device: Device, *, variant: str = "torch", max_split_size: int | None = None,
                 expandable_segments: bool = False) -> None:
        if variant not in ("torch", "torch_npu"):
            raise ValueError(f"unknown caching-allocator variant {variant!r}")
        if max_split_size is not None and max_split_size <= K_LARGE_BUFFER:
            raise ValueError("max_split_size must be larger than 20 MiB (kLargeBuffer)")
        if expandable_segments and max_split_size is not None:
            raise ValueError("expandable_segments cannot be combined with max_split_size")
        self.name = variant
        self.device = device
        self.pad = NPU_SIZE_PAD if variant == "torch_npu" else 0
        self.max_split_size = _UNLIMITED if max_split_size is None else int(max_split_size)
        self.expandable_segments = expandable_segments
        # Free blocks per pool as a sorted list of (size, addr): best fit is bisect_left.
        self._free = ([], [])  # index 0: large pool, 1: small pool (Block.small as int)
        self._free_blocks: dict[int, Block] = {}
        self._active: dict[int, Block] = {}
        # Expandable mode: unmapped free blocks per pool, sorted by address.
        self._unmapped: tuple[list[tuple[int, Block]], list[tuple[int, Block]]] = ([], [])
        self._segments: list[Segment] = []
        self._next_addr = 1 << 40
        self._stats = {name: _new_stat() for name in STAT_ARRAYS}
        for name in STAT_ARRAYS:
            setattr(self, f"_s_{name}", self._stats[name])
        self._oversize_allocations = [0, 0, 0, 0]
        self._oversize_segments = [0, 0, 0, 0]
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_sync_all_streams = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self._window_alloc = 0
        self._window_reserved = 0

    # ----------------------------------------------------------------- sizes
    def round_size(self, size: int) -> int:
        size += self.pad
        if size < K_MIN_BLOCK_SIZE:
            return K_MIN_BLOCK_SIZE
        return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE

    @staticmethod
    def allocation_size(size: int) -> int:
        if size <= K_SMALL_SIZE:
            return K_SMALL_BUFFER
        if size < K_MIN_LARGE_ALLOC:
            return K_LARGE_BUFFER
        return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE

    # ----------------------------------------------------------------- counters
    @property
    def allocated_bytes(self) -> int:
        return self._stats["allocated_bytes"][_ALL][0]

    @property
    def reserved_bytes(self) -> int:
        return self._stats["reserved_bytes"][_ALL][0]

    @property
    def peak_allocated_bytes(self) -> int:
        return self._stats["allocated_bytes"][_ALL][1]

    @property
    def peak_reserved_bytes(self) -> int:
        return self._stats["reserved_bytes"][_ALL][1]

    def take_window_peaks(self) -> tuple[int, int]:
        peaks = (max(self._window_alloc, self.allocated_bytes), max(self._window_reserved, self.reserved_bytes))
        self._window_alloc = self.allocated_bytes
        self._window_reserved = self.reserved_bytes
        return peaks

    # ----------------------------------------------------------------- free-list helpers
    def _insert_free(self, block: Block) -> None:
        insort(self._free[block.small], (block.size, block.addr))
        self._free_blocks[block.addr] = block

    def _remove_free(self, block: Block) -> None:
        entries = self._free[block.small]
        del entries[bisect_left(entries, (block.size, block.addr))]
        del self._free_blocks[block.addr]

    def _insert_unmapped(self, block: Block) -> None:
        insort(self._unmapped[block.small], (block.addr, block))

    def _remove_unmapped(self, block: Block) -> None:
        entries = self._unmapped[block.small]
        index = bisect_left(entries, (block.addr,))
        while entries[index][1] is not block:
            index += 1
        del entries[index]

    # ----------------------------------------------------------------- malloc
    def malloc(self, size: int, persistent: bool = False) -> int:
        requested = size
        size = self.round_size(size)
        small = size <= K_SMALL_SIZE
        pool = _SMALL if small else _LARGE
        block = self._get_free_block(size, small)
        if block is None:
            block = self._alloc_block(size, small, retry=False)
            if block is None and self._release_available_cached_blocks(size, small):
                block = self._alloc_block(size, small, retry=False)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(size, small, retry=True)
            if block is None:
                self.num_ooms += 1
                raise SimOutOfMemory(requested, self.name, self.device.free_bytes,
                                     f"{self.allocated_bytes} allocated, {self.reserved_bytes} reserved")
        self._split_and_activate(block, size, small, pool, requested)
        return block.addr

    def _get_free_block(self, size: int, small: bool) -> Block | None:
        entries = self._free[small]
        index = bisect_left(entries, (size, 0))
        if index == len(entries):
            return None
        block_size, addr = entries[index]
        max_split = self.max_split_size
        if size < max_split and block_size >= max_split:
            return None
        if size >= max_split and block_size >= size + K_LARGE_BUFFER:
            return None
        if self.expandable_segments:
            # Best fit counts a block's room to grow into unmapped space as part of its
            # size, so prefer a later candidate that cannot grow over one that can.
            block = self._free_blocks[addr]

            def expandable_size(b: Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

            while index + 1 < len(entries):
                nxt = self._free_blocks[entries[index + 1][1]]
                if expandable_size(nxt) < expandable_size(block):
                    index += 1
                    block = nxt
                else:
                    break
            addr = block.addr
        del entries[index]
        return self._free_blocks.pop(addr)

    def _split_and_activate(self, block: Block, size: int, small: bool, pool: int, requested: int) -> None:
        remaining_size = block.size - size
        expandable = block.segment.expandable
        if small or expandable:
            split = remaining_size >= K_MIN_BLOCK_SIZE
        else:
            split = size < self.max_split_size and remaining_size > K_SMALL_SIZE
        already_split = block.is_split()
        if split:
            remaining = Block(block.addr + size, remaining_size, small, block.segment)
            link_after(block, remaining)
            block.size = size
            self._insert_free(remaining)
            if not expandable:
                if already_split:
                    # An already-split inactive block shrinks by `size` bytes.
                    _dec(self._s_inactive_split_bytes, pool, size)
                else:
                    _inc(self._s_inactive_split_bytes, pool, remaining_size)
                    _inc(self._s_inactive_split, pool, 1)
        elif already_split and not expandable:
            _dec(self._s_inactive_split_bytes, pool, block.size)
            _dec(self._s_inactive_split, pool, 1)
        block.allocated = True
        block.requested = requested
        self._active[block.addr] = block
        # Unrolled: this is the hot path. `active` mirrors `allocation` (no stream events
        # are modelled, so nothing is freed-but-pending) and is filled in by memory_stats().
        size = block.size
        for stat in (self._s_allocation[_ALL], self._s_allocation[pool]):
            stat[0] += 1
            stat[2] += 1
            if stat[0] > stat[1]:
                stat[1] = stat[0]
        for stat in (self._s_allocated_bytes[_ALL], self._s_allocated_bytes[pool]):
            stat[0] += size
            stat[2] += size
            if stat[0] > stat[1]:
                stat[1] = stat[0]
        for stat in (self._s_requested_bytes[_ALL], self._s_requested_bytes[pool]):
            stat[0] += requested
            stat[2] += requested
            if stat[0] > stat[1]:
                stat[1] = stat[0]
        if block.size >= self.max_split_size:
            _bump(self._oversize_allocations, 1)
        allocated = self._stats["allocated_bytes"][_ALL][0]
        if allocated > self._window_alloc:
            self._window_alloc = allocated

    def _alloc_block(self, size: int, small: bool, retry: bool) -> Block | None:
        if retry:
            self.num_alloc_retries += 1
        if self.expandable_segments:
            return self._try_allocate_expandable_block(size, small)
        alloc_size = self.allocation_size(size)
        if not self.device.malloc(alloc_size):
            return None
        self.num_device_alloc += 1
        segment = Segment(self._next_addr, alloc_size, small)
        self._segments.append(segment)
        self._next_addr += alloc_size
        pool = _SMALL if small else _LARGE
        _inc(self._s_segment, pool, 1)
        _inc(self._s_reserved_bytes, pool, alloc_size)
        if alloc_size >= self.max_split_size:
            _bump(self._oversize_segments, 1)
        self._note_reserved()
        return Block(segment.base, alloc_size, small, segment)

    def _note_reserved(self) -> None:
        reserved = self._stats["reserved_bytes"][_ALL][0]
        if reserved > self._window_reserved:
            self._window_reserved = reserved

    # ----------------------------------------------------------------- free
    def free(self, addr: int) -> None:
        block = self._active.pop(addr)
        pool = _SMALL if block.small else _LARGE
        original_size = block.size
        for stat in (self._s_allocation[_ALL], self._s_allocation[pool]):
            stat[0] -= 1
            stat[3] += 1
        for stat in (self._s_allocated_bytes[_ALL], self._s_allocated_bytes[pool]):
            stat[0] -= original_size
            stat[3] += original_size
        requested = block.requested
        for stat in (self._s_requested_bytes[_ALL], self._s_requested_bytes[pool]):
            stat[0] -= requested
            stat[3] += requested
        if original_size >= self.max_split_size:
            _drop(self._oversize_allocations, 1)
        block.allocated = False
        block.requested = 0
        expandable = block.segment.expandable
        inactive_blocks = 0
        inactive_bytes = 0
        for candidate in (block.prev, block.next):
            subsumed = self._try_merge(block, candidate)
            if subsumed:
                inactive_blocks -= 1
                inactive_bytes -= subsumed
        self._insert_free(block)
        if block.is_split():
            inactive_blocks += 1
            inactive_bytes += block.size
        if not expandable:
            if inactive_blocks > 0:
                _inc(self._s_inactive_split, pool, inactive_blocks)
            elif inactive_blocks < 0:
                _dec(self._s_inactive_split, pool, -inactive_blocks)
            if inactive_bytes > 0:
                _inc(self._s_inactive_split_bytes, pool, inactive_bytes)
            elif inactive_bytes < 0:
                _dec(self._s_inactive_split_bytes, pool, -inactive_bytes)

    def _try_merge(self, dst: Block, src: Block | None) -> int:
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            self._remove_free(src)
        else:
            self._remove_unmapped(src)
        absorb(dst, src)
        return src.size

    # ----------------------------------------------------------------- releasing cached memory
    def _release_block(self, block: Block) -> None:
        """cudaFree a whole cached segment (the block must be its only block)."""
        self._remove_free(block)
        segment = block.segment
        self._segments.remove(segment)
        self.device.free(segment.size)
        self.num_device_free += 1
        pool = _SMALL if block.small else _LARGE
        _dec(self._s_segment, pool, 1)
        _dec(self._s_reserved_bytes, pool, segment.size)
        if segment.size >= self.max_split_size:
            _drop(self._oversize_segments, 1)

    def _release_available_cached_blocks(self, size: int, small: bool) -> bool:
        """Free cached oversize blocks (>= max_split_size) to make room; only with max_split_size set."""
        if self.max_split_size == _UNLIMITED:
            return False
        entries = self._free[small]
        key = max(size, self.max_split_size)
        index = bisect_left(entries, (key, 0))
        if index < len(entries):
            block = self._free_blocks[entries[index][1]]
            if block.is_split() or block.segment.expandable:
                return False
            self._release_block(block)
            return True
        released = 0
        index = len(entries) - 1
        while released < key and index >= 0 and entries[index][0] >= self.max_split_size:
            block = self._free_blocks[entries[index][1]]
            index -= 1
            if not block.is_split() and not block.segment.expandable:
                released += block.size
                self._release_block(block)
                index = min(index, len(entries) - 1)
        return released >= key

    def _release_cached_blocks(self) -> None:
        """Sync, then free every cached unsplit segment (expandable: unmap free pages)."""
        self.num_sync_all_streams += 1
        for entries in self._free:
            for _, addr in list(entries):
                block = self._free_blocks.get(addr)
                if block is None:
                    continue
                if block.segment.expandable:
                    self._unmap_block(block)
                elif not block.is_split():
                    self._release_block(block)

    def empty_cache(self) -> None:
        self._release_cached_blocks()

    # ----------------------------------------------------------------- expandable segments
    def _try_allocate_expandable_block(self, size: int, small: bool) -> Block | None:
        candidate = self._find_expandable_block(size, small)
        # Candidate shapes: unmapped -> ..., or free mapped -> unmapped -> ...
        if not candidate.mapped:
            if not self._map_block(candidate, min(candidate.size, size)):
                return None
        while candidate.size < size:
            following = candidate.next
            if following is None or following.mapped or following.allocated:
                return None
            # Mapping `following` merges the free block before it into it.
            if not self._map_block(following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        self._remove_free(candidate)
        return candidate

    def _find_expandable_block(self, size: int, small: bool) -> Block:
        def allocatable(b: Block | None) -> bool:
            return b is not None and not b.allocated

        for _, candidate in self._unmapped[small]:
            if allocatable(candidate.prev):
                candidate = candidate.prev
            room = 0
            walker: Block | None = candidate
            while room < size and allocatable(walker):
                room += walker.size
                walker = walker.next
            if room >= size:
                return candidate
        page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        total = self.device.capacity_bytes
        virtual = -(-(total + total // 8) // page) * page
        segment = Segment(self._next_addr, virtual, small, expandable=True, page_size=page)
        self._segments.append(segment)
        self._next_addr += virtual
        _inc(self._s_segment, _SMALL if small else _LARGE, 1)
        block = Block(segment.base, virtual, small, segment)
        block.mapped = False
        self._insert_unmapped(block)
        return block

    def _map_block(self, block: Block, size: int) -> bool:
        """Map whole pages covering the first ``size`` bytes of an unmapped block."""
        segment = block.segment
        page = segment.page_size
        mapped = min(-(-size // page) * page, block.size)
        if not self.device.malloc(mapped):
            return False
        self.num_device_alloc += 1
        self._remove_unmapped(block)
        if mapped < block.size:
            rest = Block(block.addr + mapped, block.size - mapped, block.small, segment)
            rest.mapped = False
            link_after(block, rest)
            block.size = mapped
            self._insert_unmapped(rest)
        block.mapped = True
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        self._insert_free(block)
        _inc(self._s_reserved_bytes, _SMALL if block.small else _LARGE, mapped)
        self._note_reserved()
        return True

    def _unmap_block(self, block: Block) -> None:
        """Unmap the whole pages inside a free mapped block of an expandable segment."""
        segment = block.segment
        page = segment.page_size
        offset = block.addr - segment.base
        start = segment.base + -(-offset // page) * page
        end = segment.base + ((block.addr + block.size - segment.base) // page) * page
        if end <= start:
            return
        self._remove_free(block)
        before = start - block.addr
        after = block.addr + block.size - end
        if before:
            head = Block(block.addr, before, block.small, segment)
            head.prev = block.prev
            if head.prev is not None:
                head.prev.next = head
            head.next = block
            block.prev = head
            self._insert_free(head)
        if after:
            tail = Block(end, after, block.small, segment)
            link_after(block, tail)
            self._insert_free(tail)
        block.addr = start
        block.size = end - start
        block.mapped = False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        self._insert_unmapped(block)
        unmapped = end - start
        self.device.free(unmapped)
        self.num_device_free += 1
        _dec(self._s_reserved_bytes, _SMALL if block.small else _LARGE, unmapped)

    # ----------------------------------------------------------------- torch.cuda API
    def reset_peak_memory_stats(self) -> None:
        for arrays in self._stats.values():
            for stat in arrays:
                stat[1] = stat[0]
        for stat in (self._oversize_allocations, self._oversize_segments):
            stat[1] = stat[0]

    def memory_stats(self) -> dict[str, Any]:
        """``torch.cuda.memory_stats()``: the flattened dict, real key names."""
        stats: dict[str, Any] = {}
        for name in STAT_ARRAYS:
            source = {"active": "allocation", "active_bytes": "allocated_bytes"}.get(name, name)
            for pool_name, stat in zip(STAT_POOLS, self._stats[source]):
                for field, value in zip(STAT_FIELDS, stat):
                    stats[f"{name}.{pool_name}.{field}"] = value
        for name, stat in (("oversize_allocations", self._oversize_allocations),
                           ("oversize_segments", self._oversize_segments)):
            for field, value in zip(STAT_FIELDS, stat):
                stats[f"{name}.{field}"] = value
        stats["num_alloc_retries"] = self.num_alloc_retries
        stats["num_ooms"] = self.num_ooms
        stats["num_sync_all_streams"] = self.num_sync_all_streams
        stats["num_device_alloc"] = self.num_device_alloc
        stats["num_device_free"] = self.num_device_free
        # torch reports SIZE_MAX through an int64, i.e. -1, when max_split_size is unset.
        stats["max_split_size"] = -1 if self.max_split_size == _UNLIMITED else self.max_split_size
        return dict(sorted(stats.items()))

    # ----------------------------------------------------------------- introspection for tests
    def segments(self) -> list[tuple[int, int, bool]]:
        """(base, size, small) of each device segment, in address order."""
        return sorted((s.base, s.size, s.small) for s in self._segments)

    def block_at(self, addr: int) -> Block:
        return self._active.get(addr) or self._free_blocks[addr]

    def free_block_sizes(self, small: bool) -> list[int]:
        return [size for size, _ in self._free[small]]


def _inc(arrays: list[list[int]], pool: int, amount: int) -> None:
    stat = arrays[_ALL]
    stat[0] += amount
    if stat[0] > stat[1]:
        stat[1] = stat[0]
    stat[2] += amount
    stat = arrays[pool]
    stat[0] += amount
    if stat[0] > stat[1]:
        stat[1] = stat[0]
    stat[2] += amount


def _dec(arrays: list[list[int]], pool: int, amount: int) -> None:
    stat = arrays[_ALL]
    stat[0] -= amount
    stat[3] += amount
    stat = arrays[pool]
    stat[0] -= amount
    stat[3] += amount


def _bump(stat: list[int], amount: int) -> None:
    stat[0] += amount
    if stat[0] > stat[1]:
        stat[1] = stat[0]
    stat[2] += amount


def _drop(stat: list[int], amount: int) -> None:
    stat[0] -= amount
    stat[3] += amount
