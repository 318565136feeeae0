"""MindSpore's dynamic memory pool on Ascend, rule for rule, per release.

Follows ``AbstractDynamicMemPool`` / ``MemBufAllocator`` and
``AbstractAscendMemoryPoolSupport::CalMemBlockAllocSize``; the rules that differ between
releases are the switches of a :class:`~kvguard.sim.mindspore_releases.MindSporeRelease` row,
each cited there (file:line @ tag in ``mindspore-ai/mindspore_test``). One stream.

- sizes aligned to 512 bytes (0 becomes 512);
- one allocator per pool: ``persistent`` (weights, constants) and ``common`` (activations,
  workspace, KV cache);
- an allocator with no block expands at once; otherwise it takes the smallest idle buffer that
  fits, ordered by (size, address), then the smallest eager-free (unmapped) one; a buffer is
  split when at least 512 bytes remain; a freed buffer merges with same-status neighbours;
- a miss: a persistent request tries the common allocator when VMM is off (and stays there);
  with VMM every idle buffer is eager-freed and the allocator retried; then it expands; then,
  from 2.5, a failed *common* expansion tries the persistent allocator's idle memory; then OOM;
- a block: the unit (1 GiB; 8 MiB in a graph run; a configured ``mempool_block_size`` for the
  common pool, capped at free − 1 GiB, when it is not the 1.0 GB default), grown by adding
  units under task sink and by doubling otherwise, at most the device's free memory, none
  when the request exceeds it;
- VMM: a block reserves ``max(block, total_mem_size)`` of address space; 2 MiB physical
  handles are mapped when a buffer is handed out, taken from a handle cache first and refused
  once the handles reach ``total_mem_size``; eager free unmaps whole pages into the cache (still
  physically held); ``empty_cache`` (2.6+) eager-frees idle buffers and frees the cache, or
  without VMM releases wholly idle blocks; in 2.4 and 2.5 it does nothing.

Statistics: ``memory_stats()`` has the release's own key spellings. ``reserved_bytes`` is what
``memory_reserved()`` returns in that release (2.4/2.5: blocks, VMM address space included;
2.6+: physical handles under VMM, blocks otherwise). ``peak_allocated_bytes`` and
``peak_reserved_bytes`` are absolute peaks since the reset, what vLLM's profile arithmetic
needs; ``memory_stats()['max_*']`` follow the release (2.4/2.5: increase of used memory since
the reset and reserved now minus reserved at the reset; 2.6+: absolute peaks).

Not modelled: ``SearchAvaliableMemBuf`` (an idle buffer extended into an eager-free neighbour,
POOL:118-158 @ v2.6.0), ``NoAdditionalMemory`` (blocks of exactly the request under cell reuse
with task sink and GE kernels disabled, SUPPORT:73-82), multiple streams and events.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any

from .base import SimOutOfMemory, absorb, link_after
from .device import Device
from .mindspore_releases import ALIGN_BYTES, VMM_PAGE_BYTES, MindSporeRelease, release

K_ALIGN = ALIGN_BYTES
GIB = 1 << 30
VMM_PAGE_SIZE = VMM_PAGE_BYTES
DEFAULT_VERSION = "2.7.1"     # what vllm-mindspore 0.5.x pins (mindspore_releases.VLLM_MINDSPORE_LAUNCHERS)

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
        self.pages = bytearray(-(-size // VMM_PAGE_SIZE)) if vmm else bytearray()
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

    def release_idle_blocks(self) -> None:
        """``ReleaseFreeBlocks``: blocks that are one idle buffer go back to the device (VMM off)."""
        for block in list(self.blocks):
            buf = self.bufs.get(block.addr)
            if buf is not None and buf.status == IDLE and buf.size == block.size:
                self._remove(buf)
                self.blocks.remove(block)
                self.pool._release_block(block)


class DynamicMemPool:
    """MindSpore's ``AbstractDynamicMemPool`` of one release on a simulated Ascend device.

    ``graph_mode`` / ``task_sink``: the execution mode and ``MS_CTX_ENABLE_TASK_SINK`` as the pool
    reads them. vllm-mindspore runs in PyNative with jit_level O0 graphs, kernel by kernel: task sink
    off. ``mempool_block_size``: bytes set by ``mempool_block_size`` / ``set_memory(increase_size=)``
    (None or 1 GiB: the default rule). ``vmm_page_bytes``: ``vmm_align_size``.
    """

    name = "mindspore"

    def __init__(self, device: Device, *, version: str | MindSporeRelease = DEFAULT_VERSION,
                 graph_mode: bool = False, task_sink: bool = False, mempool_block_size: int | None = None,
                 enable_vmm: bool = False, vmm_page_bytes: int | None = None) -> None:
        self.release = version if isinstance(version, MindSporeRelease) else release(version)
        if mempool_block_size is not None and mempool_block_size <= 0:
            raise ValueError("mempool block size must be positive")
        if vmm_page_bytes is None:
            vmm_page_bytes = self.release.vmm_page_bytes
        if vmm_page_bytes <= 0 or vmm_page_bytes % VMM_PAGE_BYTES:
            raise ValueError("the VMM page size must be a positive multiple of 2 MiB")
        self.device = device
        self.graph_mode = graph_mode
        self.task_sink = task_sink
        self.mempool_block_size = mempool_block_size
        self.enable_vmm = enable_vmm
        self.page = int(vmm_page_bytes)
        # The memory MindSpore may use: what was free on the device when the pool started.
        self.total_mem_size = device.free_bytes
        self._max_pages = -(-self.total_mem_size // self.page)
        # common_unit_size_ / persist_unit_size_: 1 GiB until SetMemPoolBlockSize runs at an expansion.
        self._units = {False: self.release.default_unit_bytes, True: self.release.default_unit_bytes}
        self._allocators = {True: _BufAllocator(self, True), False: _BufAllocator(self, False)}
        self._used: dict[int, tuple[MemBuf, _BufAllocator]] = {}
        self._next_addr = 1 << 44
        self.alloc_size = 0           # MemStat::alloc_size_ (VMM: address space)
        self.used_size = 0            # total_allocated_memory
        self.eager_free_size = 0      # total_eager_free_memory
        self.physical_pages = 0       # VMM handles allocated (mapped + cached)
        self.cached_pages = 0         # VMM handles unmapped but kept
        self._peak_used = 0
        self._peak_reserved = 0
        self._used_at_reset = 0     # MemStat::temp_used_size_ (2.4/2.5)
        self._peak_increase = 0     # MemStat::temp_peak_size_ (2.4/2.5)
        self._alloc_at_reset = 0    # MemStat::temp_alloc_size_ (2.4/2.5)
        self._window_used = 0
        self._window_reserved = 0
        self.num_ooms = 0

    # ----------------------------------------------------------------- sizes
    def align(self, size: int) -> int:
        step = self.release.align_bytes
        if size == 0:
            return step
        return -(-size // step) * step

    @property
    def _device_free(self) -> int:
        # Cached VMM handles are physical memory the pool can map again at once.
        return self.device.free_bytes + (self.cached_pages * self.page if self.enable_vmm else 0)

    def unit_size(self, persistent: bool, free: int | None = None) -> int:
        """``SetMemPoolBlockSize`` + ``MemAllocUnitSize``: the unit a new block of this pool starts from."""
        free = self._device_free if free is None else free
        rel = self.release
        configured = self.mempool_block_size
        if configured is not None and configured != rel.default_unit_bytes:
            if persistent:
                return rel.default_unit_bytes
            reserve = rel.persistent_reserve_bytes
            available = free - reserve if free > reserve else free
            return min(configured, available)
        if self.graph_mode and self.task_sink:
            return rel.graph_run_unit_bytes
        return rel.default_unit_bytes

    def block_alloc_size(self, size: int, persistent: bool) -> int:
        """``CalMemBlockAllocSize``: 0 when the device cannot hold the request itself."""
        free = self._device_free
        if free < size:
            return 0
        # SetMemPoolBlockSize(free) sets both units at every expansion; memory_stats reports them.
        self._units = {False: self.unit_size(False, free), True: self.unit_size(True, free)}
        unit = self._units[persistent]
        if unit <= 0:
            return 0
        block = unit
        while block < size:
            block = block + unit if self.task_sink else block * 2
        return min(block, free)

    # ----------------------------------------------------------------- device side
    def _expand_block(self, size: int, persistent: bool) -> MemBlock | None:
        block_size = self.block_alloc_size(size, persistent)
        if block_size == 0:
            return None
        if self.enable_vmm:
            # Address space only; pages are mapped when buffers are handed out.
            reserve = max(block_size, self.total_mem_size)
            block = MemBlock(self._next_addr, reserve, vmm=False)
            block.pages = bytearray(-(-reserve // self.page))
            self.eager_free_size += reserve
            self.alloc_size += reserve
        else:
            if not self.device.malloc(block_size):
                return None
            block = MemBlock(self._next_addr, block_size, vmm=False)
            self.alloc_size += block_size
        self._next_addr += -(-block.size // self.page) * self.page + self.page
        self._note_reserved()
        return block

    def _release_block(self, block: MemBlock) -> None:
        self.alloc_size -= block.size
        if self.enable_vmm:
            self.eager_free_size -= block.size
        else:
            self.device.free(block.size)
        self._note_reserved()

    def _map(self, block: MemBlock, addr: int, size: int) -> bool:
        """``MmapDeviceMem``: map the pages under [addr, addr + size), cached handles first."""
        page = self.page
        first = (addr - block.addr) // page
        last = (addr + size - 1 - block.addr) // page
        pages = block.pages
        missing = (last - first + 1) - sum(pages[first:last + 1])
        from_cache = min(missing, self.cached_pages)
        new = missing - from_cache
        possible = min(max(0, self._max_pages - self.physical_pages), self.device.free_bytes // page)
        if new > possible:
            # The handles allocated before the refusal go back to the cache, still allocated.
            if possible and self.device.malloc(possible * page):
                self.physical_pages += possible
                self.cached_pages += possible
            self._note_reserved()
            return False
        if new and not self.device.malloc(new * page):
            return False
        self.physical_pages += new
        self.cached_pages -= from_cache
        pages[first:last + 1] = b"\x01" * (last - first + 1)
        block.mapped_pages += missing
        self.eager_free_size -= size
        self._note_reserved()
        return True

    def _unmap(self, block: MemBlock, addr: int, size: int) -> int:
        """Unmap the pages lying wholly inside [addr, addr + size) into the handle cache; bytes unmapped."""
        page = self.page
        first = -(-(addr - block.addr) // page)
        end = (addr + size - block.addr) // page
        if end <= first:
            return 0
        pages = block.pages
        mapped = sum(pages[first:end])
        if not mapped:
            return 0
        pages[first:end] = bytes(end - first)
        block.mapped_pages -= mapped
        self.cached_pages += mapped
        return mapped * page

    # ----------------------------------------------------------------- alloc / free
    def malloc(self, size: int, persistent: bool = False) -> int:
        """``AllocMemBuf``: own pool, other pool, eager free, expand, (2.5+) persistent fallback."""
        size = self.align(size)
        allocator = self._allocators[persistent]
        buf = allocator.malloc(size)
        if buf is None and persistent and not self.enable_vmm:
            allocator = self._allocators[False]
            buf = allocator.malloc(size)
        if buf is None and self.enable_vmm and self.release.eager_free_on_miss:
            self._eager_free_idle()
            buf = allocator.malloc(size)
        if buf is None:
            buf = allocator.malloc_expand_block(size)
        if buf is None and not persistent and self.release.common_falls_back_to_persistent:
            other = self._allocators[True]
            buf = other.malloc(size)
            if buf is not None:
                allocator = other
        if buf is None:
            self.num_ooms += 1
            raise SimOutOfMemory(size, self.name, self.device.free_bytes,
                                 f"{self.used_size} allocated, {self.reserved_bytes} reserved")
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
        self._note_reserved()

    def empty_cache(self) -> None:
        """``mindspore.runtime.empty_cache()`` of the release (a no-op before 2.6)."""
        if self.release.empty_cache_rule == "none":
            return
        if self.enable_vmm:
            self._eager_free_idle()
            self.device.free(self.cached_pages * self.page)
            self.physical_pages -= self.cached_pages
            self.cached_pages = 0
        else:
            for allocator in self._allocators.values():
                allocator.release_idle_blocks()
        self._note_reserved()

    def _note_reserved(self) -> None:
        reserved = self.reserved_bytes
        if reserved > self._peak_reserved:
            self._peak_reserved = reserved
        if reserved > self._window_reserved:
            self._window_reserved = reserved

    # ----------------------------------------------------------------- counters
    @property
    def allocated_bytes(self) -> int:
        return self.used_size

    @property
    def reserved_bytes(self) -> int:
        """``memory_reserved()``: ``TotalMemStatistics`` of the release."""
        if self.enable_vmm and self.release.stats_rule == "iter":
            return self.physical_pages * self.page
        return self.alloc_size

    @property
    def peak_allocated_bytes(self) -> int:
        return self._peak_used

    @property
    def peak_reserved_bytes(self) -> int:
        return self._peak_reserved

    def take_window_peaks(self) -> tuple[int, int]:
        peaks = (max(self._window_used, self.used_size), max(self._window_reserved, self.reserved_bytes))
        self._window_used = self.used_size
        self._window_reserved = self.reserved_bytes
        return peaks

    def reset_peak_memory_stats(self) -> None:
        self._peak_used = self.used_size
        self._peak_reserved = self.reserved_bytes
        self._used_at_reset = self.used_size
        self._peak_increase = 0
        self._alloc_at_reset = self.alloc_size

    def memory_stats(self) -> dict[str, Any]:
        """``mindspore.runtime.memory_stats()`` with the release's keys; block addresses stand in for capsules."""
        rel = self.release

        def pool_stats(persistent: bool) -> dict[str, Any]:
            allocator = self._allocators[persistent]
            return {
                "block_unit_size": self._units[persistent],
                "block_counts": len(allocator.blocks),
                "blocks_info": {block.addr: {"block_stream_id": 0, "block_memory_size": block.size}
                                for block in allocator.blocks},
            }

        if rel.stats_rule == "temp":
            max_reserved = self.alloc_size - self._alloc_at_reset
            max_allocated = self._peak_increase
        else:
            max_reserved = self._peak_reserved
            max_allocated = self._peak_used
        return {
            "total_reserved_memory": self.reserved_bytes,
            rel.allocated_key: self.used_size,
            "total_idle_memory": self.alloc_size - self.used_size,
            "total_eager_free_memory": self.eager_free_size,
            "max_reserved_memory": max_reserved,
            "max_allocated_memory": max_allocated,
            rel.common_pool_key: pool_stats(False),
            "persistent_mem_pool_stats": pool_stats(True),
        }

    # ----------------------------------------------------------------- introspection for tests
    def block_sizes(self, persistent: bool) -> list[int]:
        return [block.size for block in self._allocators[persistent].blocks]

    def idle_buffer_sizes(self, persistent: bool) -> list[int]:
        return [size for size, _ in self._allocators[persistent].idle]

    def buffer(self, addr: int) -> MemBuf:
        return self._used[addr][0]
