"""MindSpore's dynamic memory pool on Ascend, rule for rule.

Follows ``AbstractDynamicMemPool`` / ``MemBufAllocator``
(``mindspore/ccsrc/backend/common/mem_reuse/abstract_dynamic_mem_pool.cc``, 2.4-2.6) and
``AbstractAscendMemoryPoolSupport::CalMemBlockAllocSize``; one stream:

- sizes are rounded up to 512 bytes (0 becomes 512);
- one allocator per pool: ``persistent`` (weights, constants) and ``common``
  (activations, workspace, KV cache); idle memory of one serves only the other's
  fallback (below);
- an allocator finds the smallest idle buffer that fits, ordered by (size, address),
  then the smallest eager-free (unmapped) one; a buffer is split when the remainder is
  at least 512 bytes; a freed buffer merges with a neighbour of the same status;
- a miss: (VMM off, persistent request) try the common allocator; (VMM on) eager-free
  every idle buffer and retry; then expand the allocator with a new block; then fail;
- a new block is the pool's unit (``increase_size`` for the common pool, default
  2 GiB here as ``set_memory``'s documented default; 1 GiB for the persistent pool),
  grown by adding units until the request fits (graph mode; ``growth="double"`` for
  PyNative's doubling), capped by the device's free memory, refused when the request
  itself exceeds it;
- VMM (``enable_vmm``): a block reserves ``max(block, device total)`` of address space,
  counted in ``total_reserved_memory`` and ``total_eager_free_memory``; physical 2 MiB
  pages are mapped when a buffer is handed out and unmapped by eager free;
  ``empty_cache`` eager-frees idle buffers and releases blocks left wholly unmapped.
  Without VMM, ``empty_cache`` releases nothing (``AscendVmmAdapter::EmptyCache``).

Statistics are ``mindspore.runtime.memory_stats()``'s keys. ``max_allocated_memory`` is
``MemStat``'s ``temp_peak_size_`` (2.4-2.6, ``MaxMemAllocatedStatistics``): the peak
*increase* of used memory since the last ``reset_peak_memory_stats`` (the absolute peak
until the first reset), which is why ``max_memory_allocated()`` reads 0 right after a
reset; later builds (``iterUsedPeakSize_``) report the absolute peak since the reset.
``max_reserved_memory`` here is the absolute peak of reserved memory since the reset, as
later builds report it (``iterAllocPeakSize_``); 2.4-2.6 report reserved now minus
reserved at the reset, which is not a peak at all. The ``mindspore`` source therefore
exports ``max(reported, current)`` for both, which is right for every build (see
``kvguard.sources.mindspore``). ``peak_allocated_bytes`` and ``peak_reserved_bytes`` are
absolute peaks since the reset, what vLLM's profile arithmetic needs.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any

from .base import SimOutOfMemory, absorb, link_after
from .device import Device

K_ALIGN = 512
GIB = 1 << 30
DEFAULT_INCREASE_SIZE = 2 * GIB
PERSISTENT_UNIT_SIZE = 1 * GIB
VMM_PAGE_SIZE = 2 << 20

IDLE, USED, EAGER_FREE = 0, 1, 2


class MemBuf:
    __slots__ = ("addr", "size", "status", "prev", "next", "block")

    def __init__(self, addr: int, size: int, status: int, block: "MemBlock") -> None:
        self.addr = addr
        self.size = size
        self.status = status
        self.prev: MemBuf | None = None
        self.next: MemBuf | None = None
        self.block = block


class MemBlock:
    __slots__ = ("addr", "size", "pages", "mapped_pages")

    def __init__(self, addr: int, size: int, vmm: bool) -> None:
        self.addr = addr
        self.size = size
        # VMM: one byte per 2 MiB page, 1 when physically mapped.
        self.pages = bytearray(-(-size // VMM_PAGE_SIZE)) if vmm else None
        self.mapped_pages = 0


class _BufAllocator:
    """One ``MemBufAllocator``: the blocks and free buffers of one pool."""

    def __init__(self, pool: "DynamicMemPool", persistent: bool) -> None:
        self.pool = pool
        self.persistent = persistent
        self.blocks: list[MemBlock] = []
        self.idle: list[tuple[int, int]] = []        # sorted (size, addr)
        self.eager: list[tuple[int, int]] = []       # sorted (size, addr), VMM only
        self.bufs: dict[int, MemBuf] = {}            # free buffers by address

    def _insert(self, buf: MemBuf) -> None:
        insort(self.idle if buf.status == IDLE else self.eager, (buf.size, buf.addr))
        self.bufs[buf.addr] = buf

    def _remove(self, buf: MemBuf) -> None:
        entries = self.idle if buf.status == IDLE else self.eager
        del entries[bisect_left(entries, (buf.size, buf.addr))]
        del self.bufs[buf.addr]

    def malloc(self, size: int) -> MemBuf | None:
        if not self.blocks:
            return self.malloc_expand_block(size)
        for entries in (self.idle, self.eager):
            index = bisect_left(entries, (size, 0))
            if index < len(entries):
                _, addr = entries.pop(index)
                return self._map_and_split(self.bufs.pop(addr), size)
        return None

    def malloc_expand_block(self, size: int) -> MemBuf | None:
        block = self.pool._expand_block(size, self.persistent)
        if block is None:
            return None
        self.blocks.append(block)
        status = EAGER_FREE if self.pool.enable_vmm else IDLE
        # block_alloc_size never returns less than the request (0, refused, when it cannot).
        return self._map_and_split(MemBuf(block.addr, block.size, status, block), size)

    def _map_and_split(self, buf: MemBuf, size: int) -> MemBuf | None:
        remaining = buf.size - size
        if buf.status == EAGER_FREE:
            map_size = size if remaining >= K_ALIGN else buf.size
            if not self.pool._map(buf.block, buf.addr, map_size):
                self._insert(buf)
                return None
        if remaining >= K_ALIGN:
            rest = MemBuf(buf.addr + size, remaining, buf.status, buf.block)
            link_after(buf, rest)
            buf.size = size
            self._insert(rest)
        buf.status = USED
        return buf

    def free(self, buf: MemBuf, status: int = IDLE) -> None:
        buf.status = status
        prev = buf.prev
        if prev is not None and prev.status == status:
            self._remove(prev)
            absorb(buf, prev)
        nxt = buf.next
        if nxt is not None and nxt.status == status:
            self._remove(nxt)
            absorb(buf, nxt)
        self._insert(buf)

    def eager_free_idle(self) -> int:
        """Turn idle buffers eager-free and unmap their whole pages; bytes turned."""
        turned = 0
        for _, addr in list(self.idle):
            buf = self.bufs.get(addr)
            if buf is None or buf.status != IDLE:
                continue
            self._remove(buf)
            turned += buf.size
            self.free(buf, EAGER_FREE)
        for _, addr in self.eager:
            buf = self.bufs[addr]
            self.pool._unmap(buf.block, buf.addr, buf.size)
        return turned

    def release_unmapped_blocks(self) -> None:
        for block in list(self.blocks):
            buf = self.bufs.get(block.addr)
            if buf is not None and buf.status == EAGER_FREE and buf.size == block.size and block.mapped_pages == 0:
                self._remove(buf)
                self.blocks.remove(block)
                self.pool._release_block(block)


class DynamicMemPool:
    """MindSpore's ``AbstractDynamicMemPool`` on a simulated Ascend device."""

    name = "mindspore"

    def __init__(self, device: Device, *, increase_size: int = DEFAULT_INCREASE_SIZE,
                 persistent_unit_size: int = PERSISTENT_UNIT_SIZE, growth: str = "add",
                 enable_vmm: bool = False) -> None:
        if growth not in ("add", "double"):
            raise ValueError(f"block growth must be 'add' or 'double', got {growth!r}")
        if increase_size <= 0 or persistent_unit_size <= 0:
            raise ValueError("pool unit sizes must be positive")
        self.device = device
        self.increase_size = int(increase_size)
        self.persistent_unit_size = int(persistent_unit_size)
        self.growth = growth
        self.enable_vmm = enable_vmm
        # The memory MindSpore may use: what was free on the device when the pool started.
        self.total_mem_size = device.free_bytes
        self._allocators = {True: _BufAllocator(self, True), False: _BufAllocator(self, False)}
        self._used: dict[int, tuple[MemBuf, _BufAllocator]] = {}
        self._next_addr = 1 << 44
        self.alloc_size = 0           # total_reserved_memory
        self.used_size = 0            # total_allocated_memory
        self.eager_free_size = 0      # total_eager_free_memory
        self._peak_used = 0
        self._peak_alloc = 0
        self._used_at_reset = 0     # MemStat::temp_used_size_
        self._peak_increase = 0     # MemStat::temp_peak_size_
        self._window_used = 0
        self._window_alloc = 0
        self.num_ooms = 0

    # ----------------------------------------------------------------- sizes
    @staticmethod
    def align(size: int) -> int:
        if size == 0:
            return K_ALIGN
        return -(-size // K_ALIGN) * K_ALIGN

    def block_alloc_size(self, size: int, persistent: bool) -> int:
        """``CalMemBlockAllocSize``: 0 when the device cannot hold the request itself."""
        free = self.device.free_bytes
        if free < size:
            return 0
        unit = self.persistent_unit_size if persistent else self.increase_size
        block = unit
        while block < size:
            block = block + unit if self.growth == "add" else block * 2
        return min(block, free)

    # ----------------------------------------------------------------- device side
    def _expand_block(self, size: int, persistent: bool) -> MemBlock | None:
        block_size = self.block_alloc_size(size, persistent)
        if block_size == 0:
            return None
        if self.enable_vmm:
            # Address space only; pages are mapped when buffers are handed out.
            reserve = max(block_size, self.total_mem_size)
            block = MemBlock(self._next_addr, reserve, vmm=True)
            self.eager_free_size += reserve
            self.alloc_size += reserve
        else:
            if not self.device.malloc(block_size):
                return None
            block = MemBlock(self._next_addr, block_size, vmm=False)
            self.alloc_size += block_size
        self._next_addr += -(-block.size // VMM_PAGE_SIZE) * VMM_PAGE_SIZE + VMM_PAGE_SIZE
        self._note_alloc()
        return block

    def _release_block(self, block: MemBlock) -> None:
        self.alloc_size -= block.size
        self.eager_free_size -= block.size
        if not self.enable_vmm:
            self.device.free(block.size)

    def _map(self, block: MemBlock, addr: int, size: int) -> bool:
        first = (addr - block.addr) // VMM_PAGE_SIZE
        last = (addr + size - 1 - block.addr) // VMM_PAGE_SIZE
        pages = block.pages
        missing = (last - first + 1) - sum(pages[first:last + 1])
        if missing and not self.device.malloc(missing * VMM_PAGE_SIZE):
            return False
        pages[first:last + 1] = b"\x01" * (last - first + 1)
        block.mapped_pages += missing
        self.eager_free_size -= size
        return True

    def _unmap(self, block: MemBlock, addr: int, size: int) -> int:
        """Unmap the pages lying wholly inside [addr, addr + size); bytes unmapped."""
        first = -(-(addr - block.addr) // VMM_PAGE_SIZE)
        end = (addr + size - block.addr) // VMM_PAGE_SIZE
        if end <= first:
            return 0
        pages = block.pages
        mapped = sum(pages[first:end])
        if not mapped:
            return 0
        pages[first:end] = bytes(end - first)
        block.mapped_pages -= mapped
        self.device.free(mapped * VMM_PAGE_SIZE)
        return mapped * VMM_PAGE_SIZE

    # ----------------------------------------------------------------- alloc / free
    def malloc(self, size: int, persistent: bool = False) -> int:
        size = self.align(size)
        allocator = self._allocators[persistent]
        buf = allocator.malloc(size)
        if buf is None and persistent and not self.enable_vmm:
            other = self._allocators[False]
            buf = other.malloc(size)
            if buf is not None:
                allocator = other
        if buf is None and self.enable_vmm:
            self._eager_free_idle()
            buf = allocator.malloc(size)
        if buf is None:
            buf = allocator.malloc_expand_block(size)
        if buf is None:
            self.num_ooms += 1
            raise SimOutOfMemory(size, self.name, self.device.free_bytes,
                                 f"{self.used_size} allocated, {self.alloc_size} reserved")
        self._used[buf.addr] = (buf, allocator)
        self.used_size += buf.size
        if self.used_size > self._peak_used:
            self._peak_used = self.used_size
        if self.used_size - self._used_at_reset > self._peak_increase:
            self._peak_increase = self.used_size - self._used_at_reset
        if self.used_size > self._window_used:
            self._window_used = self.used_size
        return buf.addr

    def free(self, addr: int) -> None:
        buf, allocator = self._used.pop(addr)
        self.used_size -= buf.size
        allocator.free(buf)

    def _eager_free_idle(self) -> None:
        for allocator in self._allocators.values():
            self.eager_free_size += allocator.eager_free_idle()

    def empty_cache(self) -> None:
        if not self.enable_vmm:
            return
        self._eager_free_idle()
        for allocator in self._allocators.values():
            allocator.release_unmapped_blocks()

    def _note_alloc(self) -> None:
        if self.alloc_size > self._peak_alloc:
            self._peak_alloc = self.alloc_size
        if self.alloc_size > self._window_alloc:
            self._window_alloc = self.alloc_size

    # ----------------------------------------------------------------- counters
    @property
    def allocated_bytes(self) -> int:
        return self.used_size

    @property
    def reserved_bytes(self) -> int:
        return self.alloc_size

    @property
    def peak_allocated_bytes(self) -> int:
        return self._peak_used

    @property
    def peak_reserved_bytes(self) -> int:
        return self._peak_alloc

    def take_window_peaks(self) -> tuple[int, int]:
        peaks = (max(self._window_used, self.used_size), max(self._window_alloc, self.alloc_size))
        self._window_used = self.used_size
        self._window_alloc = self.alloc_size
        return peaks

    def reset_peak_memory_stats(self) -> None:
        self._peak_used = self.used_size
        self._peak_alloc = self.alloc_size
        self._used_at_reset = self.used_size
        self._peak_increase = 0

    def memory_stats(self) -> dict[str, Any]:
        """``mindspore.runtime.memory_stats()``: real key names; block addresses stand in for capsules."""

        def pool_stats(persistent: bool) -> dict[str, Any]:
            allocator = self._allocators[persistent]
            return {
                "block_unit_size": self.persistent_unit_size if persistent else self.increase_size,
                "block_counts": len(allocator.blocks),
                "blocks_info": {block.addr: {"block_stream_id": 0, "block_memory_size": block.size}
                                for block in allocator.blocks},
            }

        return {
            "total_reserved_memory": self.alloc_size,
            "total_allocated_memory": self.used_size,
            "total_idle_memory": self.alloc_size - self.used_size,
            "total_eager_free_memory": self.eager_free_size,
            "max_reserved_memory": self._peak_alloc,
            "max_allocated_memory": self._peak_increase,
            "common_mem_pool_stats": pool_stats(False),
            "persistent_mem_pool_stats": pool_stats(True),
        }

    # ----------------------------------------------------------------- introspection for tests
    def block_sizes(self, persistent: bool) -> list[int]:
        return [block.size for block in self._allocators[persistent].blocks]

    def idle_buffer_sizes(self, persistent: bool) -> list[int]:
        return [size for size, _ in self._allocators[persistent].idle]

    def buffer(self, addr: int) -> MemBuf:
        return self._used[addr][0]
