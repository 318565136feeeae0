"""MindSpore's dynamic memory pool on Ascend, rule for rule, per release.

Follows ``AbstractDynamicMemPool`` / ``MemBufAllocator`` and
``AbstractAscendMemoryPoolSupport::CalMemBlockAllocSize``; the rules that differ between
releases are the switches of a :class:`~kvguard.allocators.mindspore_releases.MindSporeRelease` row,
each cited there (file:line @ tag in ``mindspore-ai/mindspore_test``). One stream.

Checked against the real thing: ``tests/upstream/test_oracle_mindspore.py`` replays op streams through
MindSpore 2.7.0-2.10.0's compiled pool (``tests/upstream/oracles/mindspore/``, the PyPI wheels on a fake ACL
device) and this model, and they agree after every op (reserved, allocated, peaks, out-of-memory,
addresses, idle and eager-free bytes, block sizes), with VMM on and off, task sink on and off,
near the memory limit and far from it. For 2.4-2.6, which no wheel here loads, the rules rest on
their source citations alone.

- the pool's budget (``total_mem_size``): 15/16 of the device's free memory when the pool starts,
  down to 2 MiB, less 10 MiB (``mindspore_releases.pool_budget_bytes``); blocks without VMM come
  out of what is left of it (``free_mem_size``), VMM handles stop at it;
- sizes aligned to 512 bytes (0 becomes 512);
- one allocator per pool: ``persistent`` (weights, constants) and ``common`` (activations,
  workspace, KV cache);
- an allocator with no block expands at once; otherwise it takes the smallest idle buffer that
  fits, ordered by (size, address); then (2.6+, VMM) the largest idle buffer whose eager-free next
  neighbour makes up the size grows into it, mapping only the missing pages
  (``SearchAvaliableMemBuf``); then the smallest eager-free (unmapped) buffer that fits; a buffer
  is split when at least 512 bytes remain; a freed buffer merges with same-status neighbours;
- a miss: a persistent request tries the common allocator when VMM is off (and stays there);
  with VMM every idle buffer is eager-freed and the allocator retried; then it expands; then,
  from 2.5, a failed *common* expansion tries the persistent allocator's idle memory; then, after
  syncing events, the allocator once more; then OOM;
- a block: the unit (1 GiB; 8 MiB in a graph run; a configured ``mempool_block_size`` for the
  common pool, capped at free − 1 GiB, when it is not the 1.0 GB default), grown by adding
  units under task sink (MindSpore's default, until a jit_level O0 compile) and by doubling
  otherwise, at most what is left of the budget, none when the request exceeds it;
- VMM: a block reserves ``max(block, total_mem_size)`` of address space; 2 MiB physical
  handles are mapped when a buffer is handed out, taken from a handle cache first and refused
  once the handles reach ``total_mem_size`` or the device has no page left (the handles taken
  before a refusal stay allocated, in the cache); eager free unmaps whole pages into the cache (still
  physically held); ``empty_cache`` (2.6+) eager-frees idle buffers and frees the cache, or
  without VMM releases wholly idle blocks; in 2.4 and 2.5 it does nothing.

Statistics: ``memory_stats()`` has the release's own key spellings. ``reserved_bytes`` is what
``memory_reserved()`` returns in that release (2.4/2.5: blocks, VMM address space included;
2.6+: physical handles under VMM, blocks otherwise). ``peak_allocated_bytes`` and
``peak_reserved_bytes`` are absolute peaks since the reset, what vLLM's profile arithmetic
needs; ``memory_stats()['max_*']`` follow the release (2.4/2.5: increase of used memory since
the reset and reserved now minus reserved at the reset; 2.6+: absolute peaks).

Not modelled: ``max_device_memory`` (a budget set by hand), ``NoAdditionalMemory`` (blocks of
exactly the request under cell reuse with task sink and GE kernels disabled, SUPPORT:73-82),
multiple streams and events.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from operator import index
from typing import Any

from kvguard.allocators.base import AllocatorOutOfMemory, FrozenKey, link_after
from kvguard.allocators.device import Device
from kvguard.allocators.mindspore_releases import (
    ALIGN_BYTES,
    VMM_PAGE_BYTES,
    MindSporeRelease,
    pool_budget_bytes,
    release,
)
from kvguard.records import PoolFigures

K_ALIGN = ALIGN_BYTES
GIB = 1 << 30
VMM_PAGE_SIZE = VMM_PAGE_BYTES
DEFAULT_VERSION = "2.7.1"  # what vllm-mindspore 0.5.x pins (mindspore_releases.VLLM_MINDSPORE_LAUNCHERS)

IDLE, USED, EAGER_FREE = 0, 1, 2
SIZE_T_MASK = (1 << 64) - 1


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
        self.idle: list[tuple[int, int]] = []  # sorted (size, addr)
        self.eager: list[tuple[int, int]] = []  # sorted (size, addr), VMM only
        self.bufs: dict[int, MemBuf] = {}  # free buffers by address

    def _insert(self, buf: MemBuf) -> None:
        insort(self.idle if buf.status == IDLE else self.eager, (buf.size, buf.addr))
        self.bufs[buf.addr] = buf

    def _remove(self, buf: MemBuf) -> None:
        entries = self.idle if buf.status == IDLE else self.eager
        del entries[bisect_left(entries, (buf.size, buf.addr))]
        del self.bufs[buf.addr]

    def malloc(self, size: int) -> MemBuf | None:
        """``MemBufAllocator::Malloc`` (POOL:88-117 @ r2.7.rc1): idle best fit, an idle buffer grown
        into its eager-free neighbour, eager-free best fit."""
        if not self.blocks:
            return self.malloc_expand_block(size)
        idle = self.idle
        index = bisect_left(idle, (size, 0))
        if index < len(idle):
            _, addr = idle.pop(index)
            buf = self.bufs.pop(addr)
            # _map_and_split of an idle buffer (nothing to map), link_after and _insert inlined: the hot path.
            remaining = buf.size - size
            if remaining >= K_ALIGN:
                rest = MemBuf(addr + size, remaining, IDLE, buf.block)
                nxt = rest.next = buf.next
                if nxt is not None:
                    nxt.prev = rest
                rest.prev = buf
                buf.next = rest
                buf.size = size
                insort(idle, (remaining, addr + size))
                self.bufs[addr + size] = rest
            buf.status = USED
            return buf
        if self.pool.enable_vmm and self.pool.release.grows_idle_into_eager_free:
            grown = self._grow_into_eager_free(size)
            if grown is not None:
                return grown
        index = bisect_left(self.eager, (size, 0))
        if index < len(self.eager):
            _, addr = self.eager.pop(index)
            return self._map_and_split(self.bufs.pop(addr), size)
        return None

    def _grow_into_eager_free(self, size: int) -> MemBuf | None:
        """``SearchAvaliableMemBuf`` (POOL:119-161 @ r2.7.rc1): from the largest idle buffer down, the
        first whose eager-free next neighbour makes up ``size`` takes the missing bytes from it, mapping
        only those; no split. A refused map ends the search (the caller goes on to eager-free buffers)."""
        for _, addr in reversed(self.idle):
            buf = self.bufs[addr]
            nxt = buf.next
            if nxt is None or nxt.status != EAGER_FREE or buf.size + nxt.size < size:
                continue
            need = size - buf.size
            if not self.pool._map(nxt.block, nxt.addr, need):
                return None
            self._remove(buf)
            buf.size = size
            buf.status = USED
            self._remove(nxt)
            nxt.addr += need
            nxt.size -= need
            if nxt.size == 0:
                buf.next = nxt.next
                if nxt.next is not None:
                    nxt.next.prev = buf
            else:
                self._insert(nxt)
            return buf
        return None

    def malloc_expand_block(self, size: int) -> MemBuf | None:
        block = self.pool._expand_block(size, self.persistent)
        if block is None:
            return None
        self.blocks.append(block)
        self.pool._blocks_key = None
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
        # _remove, absorb and _insert inlined: the hot path.
        buf.status = status
        entries = self.idle if status == IDLE else self.eager
        bufs = self.bufs
        prev = buf.prev
        if prev is not None and prev.status == status:
            del entries[bisect_left(entries, (prev.size, prev.addr))]
            del bufs[prev.addr]
            buf.addr = prev.addr
            before = buf.prev = prev.prev
            if before is not None:
                before.next = buf
            buf.size += prev.size
        nxt = buf.next
        if nxt is not None and nxt.status == status:
            del entries[bisect_left(entries, (nxt.size, nxt.addr))]
            del bufs[nxt.addr]
            after = buf.next = nxt.next
            if after is not None:
                after.prev = buf
            buf.size += nxt.size
        insort(entries, (buf.size, buf.addr))
        bufs[buf.addr] = buf

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
                self.pool._blocks_key = None
                self.pool._release_block(block)


class DynamicMemPool:
    """MindSpore's ``AbstractDynamicMemPool`` of one release on a simulated Ascend device.

    ``graph_mode`` / ``task_sink``: the execution mode and ``MS_CTX_ENABLE_TASK_SINK`` as the pool
    reads them. Task sink defaults on (``core/utils/ms_context.cc:621 @ r2.7.rc1``) and PyNative leaves
    it on; a jit_level O0 graph compile turns it off (:meth:`jit_o0_compile`). vllm-mindspore runs in
    PyNative with O0 jit graphs: task sink on while it loads weights, off from its first forward.
    ``mempool_block_size``: bytes set by ``mempool_block_size`` / ``set_memory(increase_size=)``
    (None or 1 GiB: the default rule). ``vmm_page_bytes``: ``vmm_align_size``.
    """

    name = "mindspore"

    def __init__(
        self,
        device: Device,
        *,
        version: str | MindSporeRelease = DEFAULT_VERSION,
        graph_mode: bool = False,
        task_sink: bool = True,
        mempool_block_size: int | None = None,
        enable_vmm: bool = False,
        vmm_page_bytes: int | None = None,
    ) -> None:
        self.release = version if isinstance(version, MindSporeRelease) else release(version)
        if mempool_block_size is not None and mempool_block_size <= 0:
            raise ValueError("mempool block size must be positive")
        if vmm_page_bytes is None:
            vmm_page_bytes = self.release.vmm_page_bytes
        if vmm_page_bytes <= 0 or vmm_page_bytes % VMM_PAGE_BYTES:
            raise ValueError("the VMM page size must be a positive multiple of 2 MiB")
        self.device = device
        self._align_bytes = self.release.align_bytes
        self.graph_mode = graph_mode
        self.task_sink = task_sink
        self.mempool_block_size = mempool_block_size
        self.enable_vmm = enable_vmm
        self.page = int(vmm_page_bytes)
        # The memory MindSpore may use: 15/16 of what was free on the device when the pool started,
        # less 10 MiB (mindspore_releases.pool_budget_bytes, ascend_memory_adapter.cc:135-137 @ r2.7.rc1).
        self.total_mem_size = pool_budget_bytes(device.free_bytes, self.page if enable_vmm else None)
        self._max_pages = self.total_mem_size // self.page
        self._static_bytes = 0  # AscendDynamicMemAdapter::has_alloc_size: blocks taken without VMM
        # common_unit_size_ / persist_unit_size_: 1 GiB until SetMemPoolBlockSize runs at an expansion.
        self._units = {False: self.release.default_unit_bytes, True: self.release.default_unit_bytes}
        self._allocators = {True: _BufAllocator(self, True), False: _BufAllocator(self, False)}
        self._used: dict[int, tuple[MemBuf, _BufAllocator]] = {}
        self._blocks_key: FrozenKey | None = None  # steady_state_key's, until a block or its pages change
        self._next_addr = 1 << 44
        self.alloc_size = 0  # MemStat::alloc_size_ (VMM: address space)
        self.used_size = 0  # total_allocated_memory
        self.eager_free_size = 0  # total_eager_free_memory
        self.physical_pages = 0  # VMM handles allocated (mapped + cached)
        self.cached_pages = 0  # VMM handles unmapped but kept
        self._peak_used = 0
        self._peak_reserved = 0
        self._used_at_reset = 0  # MemStat::temp_used_size_ (2.4/2.5)
        self._peak_increase = 0  # MemStat::temp_peak_size_ (2.4/2.5)
        self._alloc_at_reset = 0  # MemStat::temp_alloc_size_ (2.4/2.5)
        self._window_used = 0
        self._window_reserved = 0
        self.num_ooms = 0

    def jit_o0_compile(self) -> None:
        """A jit_level O0 graph compile: ``SetRunMode`` clears ``MS_CTX_ENABLE_TASK_SINK``
        (``pipeline/jit/ps/action.cc:1822-1855 @ r2.7.rc1``: "kernel by kernel by configuration",
        ``set_ctx(false, ...)``), so later blocks grow by doubling."""
        self.task_sink = False

    # ----------------------------------------------------------------- sizes
    @property
    def free_mem_size(self) -> int:
        """``FreeDevMemSize`` (ascend_dynamic_mem_adapter.cc:103 @ r2.7.rc1): the budget less the blocks
        taken without VMM. VMM blocks are address space and take nothing from it."""
        return self.total_mem_size - self._static_bytes

    def unit_size(self, persistent: bool, free: int | None = None) -> int:
        """``SetMemPoolBlockSize`` + ``MemAllocUnitSize``: the unit a new block of this pool starts from."""
        free = self.free_mem_size if free is None else free
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
        free = self.free_mem_size
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
            # Address space only, whole pages (VMM.cc AllocDeviceMem); pages are mapped when buffers are handed out.
            reserve = -(-max(block_size, self.total_mem_size) // self.page) * self.page
            block = MemBlock(self._next_addr, reserve, vmm=False)
            block.pages = bytearray(-(-reserve // self.page))
            self.eager_free_size += reserve
            self.alloc_size += reserve
        else:
            if not self.device.malloc(block_size):
                return None
            block = MemBlock(self._next_addr, block_size, vmm=False)
            self.alloc_size += block_size
            self._static_bytes += block_size
        self._next_addr += -(-block.size // self.page) * self.page + self.page
        self._note_reserved()
        return block

    def _release_block(self, block: MemBlock) -> None:
        self.alloc_size -= block.size
        if self.enable_vmm:
            self.eager_free_size -= block.size
        else:
            self.device.free(block.size)
            self._static_bytes -= block.size
        self._note_reserved()

    def _map(self, block: MemBlock, addr: int, size: int) -> bool:
        """``MmapDeviceMem`` (VMM.cc:107-200 @ r2.7.rc1): map the pages under [addr, addr + size), page by
        page, a cached handle first, else a new one while the handles stay under ``total_mem_size``; a
        refusal puts the handles this call mapped back in the cache (they stay allocated). The eager-free
        count drops by ``size`` before the call up to 2.7.0, after a successful one from 2.7.1
        (``eager_free_drops_on_refused_map``: the source says before, the 2.7.1+ binaries after)."""
        refused_drop = self.release.eager_free_drops_on_refused_map
        if refused_drop:
            self.eager_free_size -= size
        page = self.page
        first = (addr - block.addr) // page
        last = (addr + size - 1 - block.addr) // page
        pages = block.pages
        missing = (last - first + 1) - sum(pages[first : last + 1])
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
        pages[first : last + 1] = b"\x01" * (last - first + 1)
        self._blocks_key = None
        block.mapped_pages += missing
        if not refused_drop:
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
        self._blocks_key = None
        block.mapped_pages -= mapped
        self.cached_pages += mapped
        return mapped * page

    # ----------------------------------------------------------------- alloc / free
    def malloc(self, size: int, persistent: bool = False) -> int:
        """``AllocMemBuf``: own pool, other pool, eager free, expand, (2.5+) persistent fallback."""
        if size.__class__ is not int:
            size = index(size)  # a size_t: a float or None is refused, not rounded into the pool's books
        if size < 0:
            raise ValueError(f"{self.name}: cannot allocate a negative size ({size} bytes)")
        step = self._align_bytes
        # The request rounded up to the release's alignment (512 B), a zero-byte one to one step.
        size = -(-size // step) * step if size else step
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
            # "try to sync all events to release memory", then the allocator once more (POOL:399-401 @
            # v2.4.0, :537-539 @ r2.7.rc1). One stream and no events: it finds what it found, but its
            # refused maps count in the eager-free statistic (eager_free_drops_on_refused_map).
            buf = allocator.malloc(size)
        if buf is None:
            self.num_ooms += 1
            raise AllocatorOutOfMemory(
                size, self.name, self.device.free_bytes, f"{self.used_size} allocated, {self.reserved_bytes} reserved"
            )
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

    # ----------------------------------------------------------------- steady forwards (base.record_steady)
    def steady_state_key(self) -> tuple:
        """Everything a malloc / free sequence's outcome depends on: each allocator's blocks and free
        buffers, the mapped pages, the pool's sizes and modes, and the device's memory."""
        blocks = self._blocks_key
        if blocks is None:
            blocks = self._blocks_key = FrozenKey(
                tuple(
                    tuple((block.addr, block.size, bytes(block.pages)) for block in allocator.blocks)
                    for allocator in (self._allocators[False], self._allocators[True])
                )
            )
        common, persistent = self._allocators[False], self._allocators[True]
        device = self.device
        return (
            tuple(common.idle),
            tuple(common.eager),
            tuple(persistent.idle),
            tuple(persistent.eager),
            blocks,
            self._next_addr,
            self._static_bytes,
            self.alloc_size,
            self.used_size,
            self.eager_free_size,
            self.physical_pages,
            self.cached_pages,
            self.total_mem_size,
            self._units[False],
            self._units[True],
            self.task_sink,
            self._used_at_reset,
            device.allocator_bytes,
            device.non_allocator_bytes,
            device.capacity_bytes,
        )

    def steady_cells(self) -> tuple[list, list]:
        """(additive counters, high-water marks) as (object, attribute) pairs."""
        return (
            [(self, "num_ooms")],
            [
                (self, "_peak_used"),
                (self, "_peak_reserved"),
                (self, "_peak_increase"),
                (self, "_window_used"),
                (self, "_window_reserved"),
                (self.device, "peak_used_bytes"),
            ],
        )

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
                "blocks_info": {
                    block.addr: {"block_stream_id": 0, "block_memory_size": block.size} for block in allocator.blocks
                },
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
            "total_idle_memory": (
                self.alloc_size - self.used_size - (self.eager_free_size if rel.idle_excludes_eager_free else 0)
            )
            & SIZE_T_MASK,
            # A size_t: 2.7.0's refused maps can take it below zero, and it wraps (the oracle shows it).
            "total_eager_free_memory": self.eager_free_size & SIZE_T_MASK,
            "max_reserved_memory": max_reserved,
            "max_allocated_memory": max_allocated,
            rel.common_pool_key: pool_stats(False),
            "persistent_mem_pool_stats": pool_stats(True),
        }

    # ----------------------------------------------------------------- the pool's own lists
    def pool_figures(self, written_at: float | None = None) -> PoolFigures:
        """What MindSpore's ``MemoryDebugInfo`` dump of this pool would give (kvguard.sources.mindspore_dump
        reads the real one): the used bytes, the 2 MiB pages used buffers touch (absolute addresses, as the
        dump lists them) and the common pool's largest idle buffer. Read from the blocks and free lists (the
        used buffers are the gaps between the free ones), so the C engine answers it through the same views."""
        page = VMM_PAGE_SIZE
        touched = 0
        for allocator in self._allocators.values():
            free = sorted((addr, size) for size, addr in (*allocator.idle, *allocator.eager))
            at = 0
            for block in sorted(allocator.blocks, key=lambda b: b.addr):
                cursor, end, last_page = block.addr, block.addr + block.size, -1
                while at < len(free) and free[at][0] < end:
                    addr, size = free[at]
                    if addr > cursor:
                        first = max(cursor // page, last_page + 1)
                        last_page = (addr - 1) // page
                        touched += max(0, last_page - first + 1)
                    cursor = max(cursor, addr + size)
                    at += 1
                if cursor < end:
                    first = max(cursor // page, last_page + 1)
                    touched += max(0, (end - 1) // page - first + 1)
        idle = self._allocators[False].idle
        return PoolFigures(
            vmm=bool(self.enable_vmm),
            used_bytes=self.used_size,
            pages_touched_by_used=touched,
            largest_idle_common_bytes=idle[-1][0] if idle else 0,
            written_at=written_at,
        )

    # ----------------------------------------------------------------- introspection for tests
    def block_sizes(self, persistent: bool) -> list[int]:
        return [block.size for block in self._allocators[persistent].blocks]

    def idle_buffer_sizes(self, persistent: bool) -> list[int]:
        return [size for size, _ in self._allocators[persistent].idle]

    def buffer(self, addr: int) -> MemBuf:
        return self._used[addr][0]
