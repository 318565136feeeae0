"""MindSpore's dynamic memory pool model on a C engine: the same pool as
:class:`~kvguard.allocators.mindspore_pool.DynamicMemPool`, faster.

``NativeDynamicMemPool`` takes the same arguments and answers the same calls, with the same
addresses, out-of-memory errors and statistics after every operation
(``tests/allocators/test_alloc_native_mindspore.py`` compares the two op by op;
``tests/upstream/test_oracle_mindspore.py``
runs it against MindSpore's compiled pool). The buffers, blocks, free lists and counters live in
``_cmspool.c``; ``malloc`` and ``free`` are its C methods. What runs once per block expansion
(``block_alloc_size``) and what reads the pool for people (``memory_stats``, peaks, steady cells) are
the Python model's own methods, run on this class: each rule keeps one home.

``unsupported(**kwargs)`` says why a configuration is left to the Python model (None when the C engine
runs it); ``kvguard.allocators.native`` picks the engine with it.
"""

from __future__ import annotations

from typing import Any

from kvguard.allocators._cmspool import SIZE_BEYOND, STEP_LIMIT, Pool
from kvguard.allocators.device import Device
from kvguard.allocators.mindspore_pool import DEFAULT_VERSION, USED, DynamicMemPool, MemBlock, MemBuf
from kvguard.allocators.mindspore_releases import VMM_PAGE_BYTES, MindSporeRelease, pool_budget_bytes, release

# Byte counts above SIZE_BEYOND (2**62) do not fit the engine's 64-bit cells with room for their sums; pages
# and alignments stay within STEP_LIMIT (2**40). The engine's module holds both.
_LIMIT_BYTES = SIZE_BEYOND
_STEP_LIMIT = STEP_LIMIT


def unsupported(
    *,
    device: Any = None,
    version: str | MindSporeRelease = DEFAULT_VERSION,
    mempool_block_size: Any = None,
    vmm_page_bytes: Any = None,
    **_: Any,
) -> str | None:
    """Why ``NativeDynamicMemPool`` would not run this configuration (its keyword arguments, and the
    device when given), or None. Arguments the Python model refuses (an unknown version, a bad page size)
    are None here: both refuse them alike."""
    if device is not None:
        # A Device's capacity, else what a duck-typed device says is free: byte counts the engine reads.
        capacity = getattr(device, "capacity_bytes", None)
        if capacity is None:
            capacity = getattr(device, "free_bytes", None)
        if capacity.__class__ is not int or capacity >= _LIMIT_BYTES:
            return f"device capacity {capacity!r} is not an int below 2**62 bytes"
    if mempool_block_size is not None and mempool_block_size.__class__ is not int:
        return f"mempool_block_size {mempool_block_size!r} is not an int"
    try:
        row = version if isinstance(version, MindSporeRelease) else release(version)
    except ValueError:
        return None
    if row.align_bytes.__class__ is not int or not 0 < row.align_bytes <= _STEP_LIMIT:
        return f"alignment {row.align_bytes!r} is not an int from 1 to 2**40"
    page = row.vmm_page_bytes if vmm_page_bytes is None else vmm_page_bytes
    try:
        pages = int(page)  # what both constructors take (a Decimal or a numpy integer too)
    except (TypeError, ValueError, OverflowError):
        return None  # refused alike by both constructors
    if pages >= _STEP_LIMIT:
        return f"VMM page {page!r} is 2**40 bytes or more"
    return None


class _AllocatorView:
    """One allocator's blocks and idle buffers as the Python model's methods read them (``.blocks``, ``.idle``)."""

    __slots__ = ("_pool", "_persistent")

    def __init__(self, pool: "NativeDynamicMemPool", persistent: bool) -> None:
        self._pool = pool
        self._persistent = persistent

    @property
    def blocks(self) -> list[MemBlock]:
        return [MemBlock(addr, size, vmm=False) for addr, size in self._pool._block_list(self._persistent)]

    @property
    def idle(self) -> list[tuple[int, int]]:
        return self._pool._idle_list(self._persistent)

    @property
    def eager(self) -> list[tuple[int, int]]:
        return self._pool._eager_list(self._persistent)


class NativeDynamicMemPool(Pool):
    """:class:`~kvguard.allocators.mindspore_pool.DynamicMemPool` on the C engine (``_cmspool``)."""

    name = DynamicMemPool.name

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
        rel = version if isinstance(version, MindSporeRelease) else release(version)
        if mempool_block_size is not None and mempool_block_size <= 0:
            raise ValueError("mempool block size must be positive")
        if vmm_page_bytes is None:
            vmm_page_bytes = rel.vmm_page_bytes
        if vmm_page_bytes <= 0 or vmm_page_bytes % VMM_PAGE_BYTES:
            raise ValueError("the VMM page size must be a positive multiple of 2 MiB")
        reason = unsupported(
            device=device, version=rel, mempool_block_size=mempool_block_size, vmm_page_bytes=vmm_page_bytes
        )
        if reason is not None:
            raise NotImplementedError(f"the C engine does not run this pool: {reason}")
        self.release = rel
        self.graph_mode = graph_mode
        self.task_sink = task_sink
        self.mempool_block_size = mempool_block_size
        self.enable_vmm = enable_vmm
        page = int(vmm_page_bytes)
        # SetMemPoolBlockSize sets both units at each expansion (block_alloc_size, called back from C).
        self._units = {False: rel.default_unit_bytes, True: rel.default_unit_bytes}
        super().__init__(
            device,
            pool_budget_bytes(device.free_bytes, page if enable_vmm else None),
            page,
            rel.align_bytes,
            enable_vmm,
            rel.grows_idle_into_eager_free,
            rel.eager_free_on_miss,
            rel.common_falls_back_to_persistent,
            rel.eager_free_drops_on_refused_map,
            bool(enable_vmm) and rel.stats_rule == "iter",
            rel.empty_cache_rule != "none",
        )

    # The Python model's own rules and readers, on this class's counters.
    jit_o0_compile = DynamicMemPool.jit_o0_compile
    free_mem_size = DynamicMemPool.free_mem_size
    unit_size = DynamicMemPool.unit_size
    block_alloc_size = DynamicMemPool.block_alloc_size
    allocated_bytes = DynamicMemPool.allocated_bytes
    peak_allocated_bytes = DynamicMemPool.peak_allocated_bytes
    peak_reserved_bytes = DynamicMemPool.peak_reserved_bytes
    take_window_peaks = DynamicMemPool.take_window_peaks
    steady_cells = DynamicMemPool.steady_cells
    reset_peak_memory_stats = DynamicMemPool.reset_peak_memory_stats
    memory_stats = DynamicMemPool.memory_stats
    block_sizes = DynamicMemPool.block_sizes
    idle_buffer_sizes = DynamicMemPool.idle_buffer_sizes
    pool_figures = DynamicMemPool.pool_figures

    @property
    def _allocators(self) -> dict[bool, _AllocatorView]:
        # Made on each call: views kept on the instance would be a reference cycle, left to the cyclic GC.
        return {True: _AllocatorView(self, True), False: _AllocatorView(self, False)}

    def steady_state_key(self) -> tuple:
        """What ``DynamicMemPool.steady_state_key`` holds, the engine's part as bytes: equal exactly when
        the model's keys are equal."""
        device = self.device
        return (
            self._free_state(),
            self._blocks_state(),
            self._units[False],
            self._units[True],
            self.task_sink,
            device.allocator_bytes,
            device.non_allocator_bytes,
            device.capacity_bytes,
        )

    def buffer(self, addr: int) -> MemBuf:
        """The used buffer at ``addr`` (its address and size; a copy, without block links)."""
        start, size = self._buffer_size(addr)
        return MemBuf(start, size, USED, None)  # type: ignore[arg-type]  # a copy: no block to link
