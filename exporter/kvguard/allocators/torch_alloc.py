"""PyTorch's CUDA caching allocator (and torch_npu's variant), rule for rule.

Follows the native backend, ``c10/cuda/CUDACachingAllocator.cpp`` as pytorch/pytorch holds
it at commit 001074d2 (the torch 2.5-2.6 line; each rule below names the function it
follows there), per stream, no CUDA-graph private pools:

- requests are rounded up to 512 bytes (torch_npu first adds 32 bytes); with
  ``roundup_power2_divisions`` set for a size's power-of-two interval, a request over
  512 x divisions is rounded up to the next of that many equal steps between two powers
  of two (``round_size`` / ``roundup_power2_next_division``; the interval index is
  ``floor(log2(size)) - 20``, clamped to 0..15, ``AllocatorConfig::roundup_power2_divisions``);
- rounded sizes <= 1 MiB go to the small pool, others to the large pool (``get_pool``);
- a new segment is 2 MiB for the small pool, 20 MiB for requests under 10 MiB, and the
  request rounded up to 2 MiB from 10 MiB on (``get_allocation_size``);
- a cached block is found by best fit on (stream, size, address) within the pool, same
  stream only (``BlockComparatorSize``, ``get_free_block``); a block of ``max_split_size``
  or more is never handed to a smaller request, nor a block 20 MiB or more larger than
  a request of ``max_split_size`` or more;
- a found block is split when the remainder is >= 512 bytes (small pool, or expandable
  segments on), or, in the large pool, when the request is under ``max_split_size`` and
  the remainder is over 1 MiB (``should_split``);
- a freed block merges with free neighbours of its segment (``free_block``,
  ``try_merge_blocks``);
- a miss: garbage collection first when ``garbage_collection_threshold`` > 0 and a memory
  fraction is set (``malloc`` -> ``garbage_collect_cached_blocks``: while reserved memory
  exceeds threshold x allowed maximum, release unsplit cached large blocks whose age, in
  ``get_free_block`` calls since they were cached, is at least the average); then a new
  segment, refused past the allowed maximum when a fraction is set (``alloc_block``);
  then free cached oversize blocks (only when ``max_split_size`` is set,
  ``release_available_cached_blocks``) and retry; then free every cached unsplit segment
  and retry (``release_cached_blocks``, ``num_alloc_retries`` += 1); then fail
  (``num_ooms`` += 1);
- ``expandable_segments``: one segment per pool and stream reserves 1 1/8 x the device's
  memory of address space (``find_expandable_block``); physical pages (2 MiB small,
  20 MiB large) are mapped as the segment grows (``map_block``) and unmapped from free
  blocks on ``empty_cache`` or on the retry path (``release_blocks`` -> ``unmap_block``);
  a segment left wholly unmapped is released there (``release_expandable_segment``).
  Expandable segments never count in the ``segment`` statistic (only ``alloc_block``
  raises it) nor in ``inactive_split`` (``free_block``).

Statistics use the real flattened key names of ``torch.cuda.memory_stats()``.

For exact trace replay (``kvguard.allocators.snapshot``) the allocator can be seeded with a
recorded state (``seed_segment``, ``seed_segments``), take new segment addresses from a
callback (``segment_address``), release or unmap what a trace says the real allocator
released (``release_segment_at``, ``unmap_range``), and give its end state as tuples
(``segment_layout``).

Speed (``bench/bench_sim.py``): free blocks are kept per pool as a sorted list of one packed
int each, ``stream << 128 | size << 64 | address``, so best fit is a C-level ``bisect`` over
ints; ``malloc``'s cache hit, split and activation and ``free``'s merge are written inline;
statistics keep current and peak (and freed per pool), "allocated" being current + freed.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any, Callable, Iterable, Iterator, TypeGuard

from kvguard.allocators.base import AllocatorOutOfMemory, FrozenKey, SteadyCell, SteadyCells, absorb, link_after
from kvguard.allocators.device import Device

K_MIN_BLOCK_SIZE = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20
K_EXTRA_LARGE_BUFFER = 1 << 30  # torch_npu's 1 GiB page (page_size:1g)
K_ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB
K_ROUNDUP_START_LOG2 = 20  # log2(kRoundUpPowerOfTwoStart), 1 MiB: the first interval's size
NPU_SIZE_PAD = 32
_UNLIMITED = (1 << 64) - 1

STAT_ARRAYS = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
STAT_POOLS = ("all", "small_pool", "large_pool")
STAT_FIELDS = ("current", "peak", "allocated", "freed")
# Indexes into the per-pool stat arrays.
_ALL, _SMALL, _LARGE = 0, 1, 2
# A free block's sort key is one int, (stream, size, address) packed as
# stream << 128 | size << 64 | address: ints compare in C, tuples element by element.
_KEY_SIZE = 64
_KEY_STREAM = 128
_MASK64 = (1 << 64) - 1


class Block:
    __slots__ = (
        "addr",
        "size",
        "requested",
        "small",
        "prev",
        "next",
        "allocated",
        "mapped",
        "segment",
        "stream",
        "gc_base",
        "key",
    )

    def __init__(self, addr: int, size: int, small: bool, segment: "Segment", stream: int = 0) -> None:
        self.addr = addr
        self.size = size
        self.requested = 0
        self.small = small
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.mapped = True
        self.segment = segment
        self.stream = stream
        self.gc_base = 0
        self.key = 0  # its sort key while it is in a free list

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class Segment:
    """A device allocation (or, expandable, a reserved address range with mapped pages)."""

    __slots__ = ("base", "size", "small", "expandable", "page_size", "stream")

    def __init__(
        self, base: int, size: int, small: bool, expandable: bool = False, page_size: int = 0, stream: int = 0
    ) -> None:
        self.base = base
        self.size = size
        self.small = small
        self.expandable = expandable
        self.page_size = page_size
        self.stream = stream


def _new_stat() -> list[list[int]]:
    return [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]


def roundup_divisions_table(value: Any) -> tuple[int, ...]:
    """``roundup_power2_divisions`` as 16 per-interval values.

    Accepts one int (every interval), a sequence of 16, or the dict a snapshot's
    ``allocator_settings`` holds (keys "1" .. "32768": the interval's lower bound in MiB).
    """
    if value is None:
        return (0,) * K_ROUNDUP_INTERVALS
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * K_ROUNDUP_INTERVALS
    if isinstance(value, dict):
        per_interval = [0] * K_ROUNDUP_INTERVALS
        for key, divisions in value.items():
            mib = int(key)
            if mib <= 0 or mib & (mib - 1) or mib.bit_length() > K_ROUNDUP_INTERVALS:
                raise ValueError(f"roundup_power2_divisions: {key!r} is not a power-of-two MiB interval")
            per_interval[mib.bit_length() - 1] = int(divisions)
        value = per_interval
    table = tuple(int(v) for v in value)
    if len(table) != K_ROUNDUP_INTERVALS:
        raise ValueError(f"roundup_power2_divisions needs {K_ROUNDUP_INTERVALS} values, got {len(table)}")
    for divisions in table:
        if divisions and (divisions < 0 or divisions & (divisions - 1)):
            raise ValueError(f"roundup_power2_divisions must be powers of two, got {divisions}")
    return table


class CachingAllocator:
    """PyTorch's caching allocator on a simulated device.

    ``variant="torch_npu"`` is torch_npu's ``NPUCachingAllocator`` (torch-npu 2.13.0, whose
    binary matches Ascend/pytorch tag v26.2.0-beta.1-pytorch2.13.0, commit 94c0533b; files below
    are under ``torch_npu/csrc/core/npu/`` there). It differs from the CUDA rules in:

    - ``add_pad_size`` (default on): 32 bytes are added before rounding, unless the SoC is
      Ascend950 or later and CANN is 9.1.0 or later (``AddPadSize``, NPUCachingAllocator.cpp:161-174;
      ``round_size``, :2202-2214);
    - a 0-byte request returns null and allocates nothing (``raw_alloc_with_stream``, :4137-4140);
    - ``base_addr_aligned_kb`` (default 16, 0-16; NPUAllocatorConfig.h:151, parsed in
      NPUAllocatorConfig.cpp:120-142): with expandable segments, a request of 2 MiB or more whose
      found block does not start on that boundary is moved up to it, when it still fits, and the gap
      is left behind as a free block of its own (``malloc``, NPUCachingAllocator.cpp:1396-1421);
    - ``segment_size`` (``segment_size_mb``, 20-512 MiB) and ``page_size_1g``: the large pool's
      expandable page (``get_custom_expandable_segment_size``, :2762-2769; ``find_expandable_block``,
      :2461-2465). ``page_size_1g`` also rounds non-expandable large segments up to 1 GiB (``malloc``,
      :1193-1196); it acts only with CANN >= 8.1.RC1 and driver >= 25.0.RC1 (``IsMallocPage1GMem``,
      :130-159), which the caller decides;
    - ``memory_fraction`` (``per_process_memory_fraction``) is applied at construction, and only
      below 1.0 (``DeviceCachingAllocator`` constructor, :1033; ``setMemoryFraction``, :1712-1721);
    - ``throw_on_npumalloc_oom``: see the constructor.

    Two options of c10's AcceleratorAllocatorConfig (c10/core/AllocatorConfig.cpp, torch 2.13),
    followed as torch_npu uses them: ``large_segment_size`` (``large_segment_size_mb``, default
    20 MiB) is the segment for requests between 1 and 10 MiB (``get_allocation_size``, :2771-2779)
    and the lower bound of ``max_split_size`` and ``max_non_split_rounding_size``;
    ``max_non_split_rounding_size`` (``max_non_split_rounding_mb``, default ``large_segment_size``)
    replaces 20 MiB in the rule that keeps an oversize block from a much smaller oversize request
    (``get_free_block``, :2831-2834). The CUDA code at 001074d2 has both as the constant 20 MiB,
    so at their defaults the ``torch`` variant is unchanged.
    """

    def __init__(
        self,
        device: Device,
        *,
        variant: str = "torch",
        max_split_size: int | None = None,
        expandable_segments: bool = False,
        roundup_power2_divisions: Any = None,
        garbage_collection_threshold: float = 0.0,
        large_segment_size: int = K_LARGE_BUFFER,
        max_non_split_rounding_size: int | None = None,
        memory_fraction: float | None = None,
        add_pad_size: bool | None = None,
        base_addr_aligned_kb: int | None = None,
        segment_size: int = 0,
        page_size_1g: bool = False,
        throw_on_npumalloc_oom: bool = False,
    ) -> None:
        if variant not in ("torch", "torch_npu"):
            raise ValueError(f"unknown caching-allocator variant {variant!r}")
        npu = variant == "torch_npu"
        if not npu and (
            add_pad_size is not None
            or base_addr_aligned_kb is not None
            or segment_size
            or page_size_1g
            or throw_on_npumalloc_oom
        ):
            raise ValueError(
                "add_pad_size, base_addr_aligned_kb, segment_size, page_size_1g and "
                "throw_on_npumalloc_oom are torch_npu's"
            )
        if large_segment_size <= K_MIN_LARGE_ALLOC:
            raise ValueError("large_segment_size must be larger than 10 MiB (kMinLargeAlloc)")
        if max_split_size is not None and not npu and max_split_size <= K_LARGE_BUFFER:
            raise ValueError("max_split_size must be larger than 20 MiB (kLargeBuffer)")
        if max_split_size is not None and max_split_size < large_segment_size:
            raise ValueError("max_split_size must be at least large_segment_size")
        if max_non_split_rounding_size is not None and max_non_split_rounding_size < large_segment_size:
            raise ValueError("max_non_split_rounding_size must be at least large_segment_size")
        if not 0.0 <= garbage_collection_threshold < 1.0:
            raise ValueError("garbage_collection_threshold must be in [0, 1)")
        if base_addr_aligned_kb is not None and not 0 <= base_addr_aligned_kb <= 16:
            raise ValueError("base_addr_aligned_kb must be in 0..16")
        if segment_size and not 20 * K_SMALL_SIZE <= segment_size <= 512 * K_SMALL_SIZE:
            raise ValueError("segment_size must be 20..512 MiB")
        self.name = variant
        self.device = device
        self.pad = NPU_SIZE_PAD if npu and add_pad_size is not False else 0
        # torch_npu hands out null for 0 bytes (raw_alloc_with_stream); the CUDA model keeps 512 bytes.
        self._null_for_zero = npu
        self.base_addr_aligned = (16 if base_addr_aligned_kb is None else base_addr_aligned_kb) * 1024 if npu else 0
        self.large_segment_size = int(large_segment_size)
        self.max_non_split_rounding_size = (
            self.large_segment_size if max_non_split_rounding_size is None else int(max_non_split_rounding_size)
        )
        self.page_size_1g = page_size_1g
        # The large pool's expandable page: 1 GiB pages, else large_segment_size_mb when set, else
        # segment_size_mb when set, else 20 MiB (get_custom_expandable_segment_size).
        if page_size_1g:
            self.large_page_size = K_EXTRA_LARGE_BUFFER
        elif self.large_segment_size != K_LARGE_BUFFER or not segment_size:
            self.large_page_size = self.large_segment_size
        else:
            self.large_page_size = int(segment_size)
        self.max_split_size = _UNLIMITED if max_split_size is None else int(max_split_size)
        self.expandable_segments = expandable_segments
        self._aligns_base = bool(self.base_addr_aligned and expandable_segments)
        self.roundup_power2_divisions = roundup_divisions_table(roundup_power2_divisions)
        self._rounds_power2 = any(self.roundup_power2_divisions)
        self._plain_rounding = not self._rounds_power2 and not self.pad
        self.garbage_collection_threshold = float(garbage_collection_threshold)
        self.allowed_memory_maximum = 0
        self.set_fraction = False
        self._gc_enabled = False  # garbage collection acts only once a memory fraction is set
        # Free blocks per pool as a sorted list of packed (stream, size, addr) keys: best fit is bisect_left.
        self._free: tuple[list[int], list[int]] = ([], [])  # index 0: large pool, 1: small pool (Block.small)
        self._free_blocks: dict[int, Block] = {}
        self._active: dict[int, Block] = {}
        # Expandable mode: unmapped blocks per pool, sorted by (stream, address).
        # Entries are (stream, address, id(block), block): the id keeps equal keys from comparing blocks.
        self._unmapped: tuple[list[tuple[int, int, int, Block]], list[tuple[int, int, int, Block]]] = ([], [])
        self._segments: list[Segment] = []
        self._segments_key: FrozenKey | None = None  # steady_state_key's, until the segments change
        self._steady_cells: SteadyCells | None = None
        self._gc_calls = [0, 0]  # BlockPool::get_free_blocks_call_count, per pool
        # cudaGetDeviceProperties().totalGlobalMem, which sizes expandable segments; None: the device's capacity.
        self.address_space_total: int | None = None
        self._next_addr = 1 << 40
        # Trace replay: where a new segment goes (base address) and what is mapped where.
        self.segment_address: Callable[[int, bool], int | None] | None = None
        self.on_map: Callable[[int, int], None] | None = None
        stats = self._stats = {name: _new_stat() for name in STAT_ARRAYS}
        # Each stat array also as an attribute of its own, for the hot paths.
        self._s_allocation = stats["allocation"]
        self._s_segment = stats["segment"]
        self._s_active = stats["active"]
        self._s_inactive_split = stats["inactive_split"]
        self._s_allocated_bytes = stats["allocated_bytes"]
        self._s_reserved_bytes = stats["reserved_bytes"]
        self._s_active_bytes = stats["active_bytes"]
        self._s_inactive_split_bytes = stats["inactive_split_bytes"]
        self._s_requested_bytes = stats["requested_bytes"]
        self._oversize_allocations = [0, 0, 0, 0]
        self._oversize_segments = [0, 0, 0, 0]
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_sync_all_streams = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self._window_alloc = 0
        self._window_reserved = 0
        # throw_on_npumalloc_oom (torch_npu's alloc_block, NPUCachingAllocator.cpp:2949-2981): a new
        # segment that would take reserved past per_process_memory_fraction x the device's memory is
        # refused before the device is asked, and malloc then skips its retries (:1262-1276) and
        # raises OutOfMemoryError without counting num_ooms (:1297-1325, :3601-3612). Below a
        # fraction of 1 the allowed-maximum check (same bound) refuses first, so it acts only at 1.
        self.throw_on_npumalloc_oom = throw_on_npumalloc_oom
        self._rejection_limit = int((1.0 if memory_fraction is None else memory_fraction) * device.capacity_bytes)
        self._rejected = False
        if memory_fraction is not None:
            self.set_memory_fraction(memory_fraction)

    # ----------------------------------------------------------------- sizes
    def round_size(self, size: int) -> int:
        size += self.pad
        if size < K_MIN_BLOCK_SIZE:
            return K_MIN_BLOCK_SIZE
        if self._rounds_power2:
            index = min(max(size.bit_length() - 1 - K_ROUNDUP_START_LOG2, 0), K_ROUNDUP_INTERVALS - 1)
            divisions = self.roundup_power2_divisions[index]
            if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
                return _roundup_power2_next_division(size, divisions)
        return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE

    @staticmethod
    def allocation_size(size: int) -> int:
        if size <= K_SMALL_SIZE:
            return K_SMALL_BUFFER
        if size < K_MIN_LARGE_ALLOC:
            return K_LARGE_BUFFER
        return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE

    def segment_size(self, size: int) -> int:
        """The device allocation for a rounded request that misses the cache, with this
        allocator's options (``large_segment_size``, ``page_size_1g``): torch_npu's ``malloc``
        (NPUCachingAllocator.cpp:1193-1196) and ``get_allocation_size`` (:2771-2779)."""
        if size <= K_SMALL_SIZE:
            return K_SMALL_BUFFER
        if self.page_size_1g:
            return -(-size // K_EXTRA_LARGE_BUFFER) * K_EXTRA_LARGE_BUFFER
        if size < K_MIN_LARGE_ALLOC:
            return self.large_segment_size
        return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE

    def set_memory_fraction(self, fraction: float) -> None:
        """``torch.cuda.set_per_process_memory_fraction``: caps reserved memory (``setMemoryFraction``)."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"memory fraction must be in [0, 1], got {fraction}")
        self.allowed_memory_maximum = int(fraction * self.device.capacity_bytes)
        self.set_fraction = True
        self._gc_enabled = self.garbage_collection_threshold > 0.0

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

    # ----------------------------------------------------------------- steady forwards (base.record_steady)
    def steady_state_key(self) -> tuple[Any, ...] | None:
        """Everything a malloc / free sequence's outcome depends on: the free and unmapped blocks, the
        segments, the next segment address, the device's memory and the limits; None with garbage
        collection (block ages) or trace-replay callbacks."""
        if self._gc_enabled or self.segment_address is not None or self.on_map is not None:
            return None
        segments = self._segments_key  # None after any change to the segments
        if segments is None:
            segments = self._segments_key = FrozenKey(
                tuple((s.base, s.size, s.small, s.expandable, s.page_size, s.stream) for s in self._segments)
            )
        unmapped = (
            (
                tuple((s, a, b.size) for s, a, _, b in self._unmapped[0]),
                tuple((s, a, b.size) for s, a, _, b in self._unmapped[1]),
            )
            if self._unmapped[0] or self._unmapped[1]
            else None
        )
        device = self.device
        return (
            tuple(self._free[0]),
            tuple(self._free[1]),
            unmapped,
            segments,
            self._next_addr,
            device.allocator_bytes,
            device.non_allocator_bytes,
            device.capacity_bytes,
            self.allowed_memory_maximum,
            self.set_fraction,
            self.address_space_total,
        )

    def steady_cells(self) -> SteadyCells:
        """(additive counters, high-water marks) as (container, index or attribute) pairs."""
        cells = self._steady_cells
        if cells is None:
            stats = [stat for name in STAT_ARRAYS for stat in self._stats[name]]
            stats += [self._oversize_allocations, self._oversize_segments]
            counters: list[SteadyCell] = [(stat, i) for stat in stats for i in (0, 2, 3)]
            counters += [
                (self, name)
                for name in (
                    "num_alloc_retries",
                    "num_ooms",
                    "num_sync_all_streams",
                    "num_device_alloc",
                    "num_device_free",
                )
            ]
            peaks: list[SteadyCell] = [(stat, 1) for stat in stats]
            peaks += [(self, "_window_alloc"), (self, "_window_reserved"), (self.device, "peak_used_bytes")]
            cells = self._steady_cells = (counters, peaks)
        return cells

    # ----------------------------------------------------------------- free-list helpers
    def _insert_free(self, block: Block) -> None:
        if self._gc_enabled:  # the call count stays 0 until garbage collection is on
            block.gc_base = self._gc_calls[block.small]
        key = (block.size << _KEY_SIZE) | block.addr
        if block.stream:
            key |= block.stream << _KEY_STREAM
        block.key = key
        insort(self._free[block.small], key)
        self._free_blocks[block.addr] = block

    def _remove_free(self, block: Block) -> None:
        entries = self._free[block.small]
        del entries[bisect_left(entries, block.key)]
        del self._free_blocks[block.addr]

    def _insert_unmapped(self, block: Block) -> None:
        insort(self._unmapped[block.small], (block.stream, block.addr, id(block), block))

    def _remove_unmapped(self, block: Block) -> None:
        entries = self._unmapped[block.small]
        index = bisect_left(entries, (block.stream, block.addr))
        while entries[index][3] is not block:
            index += 1
        del entries[index]

    # ----------------------------------------------------------------- malloc
    def malloc(self, size: int, persistent: bool = False, stream: int = 0) -> int:
        if not size and self._null_for_zero:
            return 0
        requested = size
        if self._plain_rounding:
            size = K_MIN_BLOCK_SIZE if size < K_MIN_BLOCK_SIZE else (size + 511) & ~511
        else:
            size = self.round_size(size)
        small = size <= K_SMALL_SIZE
        if self.expandable_segments or self._gc_enabled:
            block = self._get_free_block(size, small, stream)
        else:
            # _get_free_block without expandable segments or garbage collection, inlined: the hot path.
            block = None
            entries = self._free[small]
            index = bisect_left(entries, (stream << _KEY_STREAM) | (size << _KEY_SIZE) if stream else size << _KEY_SIZE)
            if index < len(entries):
                key = entries[index]
                if key >> _KEY_STREAM == stream:
                    block_size = (key >> _KEY_SIZE) & _MASK64
                    max_split = self.max_split_size
                    if not (
                        (size < max_split <= block_size)
                        or (size >= max_split and block_size >= size + self.max_non_split_rounding_size)
                    ):
                        del entries[index]
                        block = self._free_blocks.pop(key & _MASK64)
        if block is None:
            if self._gc_enabled:
                self._garbage_collect_cached_blocks()
            self._rejected = False
            block = self._alloc_block(size, small, stream, retry=False)
            # A request refused by throw_on_npumalloc_oom skips the retries (torch_npu's malloc).
            if block is None and not self._rejected and self._release_available_cached_blocks(size, small, stream):
                block = self._alloc_block(size, small, stream, retry=False)
            if block is None and not self._rejected:
                self._release_cached_blocks()
                block = self._alloc_block(size, small, stream, retry=True)
            if block is None:
                if not self._rejected:
                    self.num_ooms += 1
                raise AllocatorOutOfMemory(
                    requested,
                    self.name,
                    self.device.free_bytes,
                    f"{self.allocated_bytes} allocated, {self.reserved_bytes} reserved",
                )
        if self._aligns_base and size >= K_ROUND_LARGE and block.addr % self.base_addr_aligned:
            block = self._align_base(block, size)
        # Split off the remainder (``should_split``) and activate the block; the rest of this
        # method is _split_and_activate inlined, the hot path.
        pool = _SMALL if small else _LARGE
        addr = block.addr
        remaining_size = block.size - size
        if small or self.expandable_segments:
            split = remaining_size >= K_MIN_BLOCK_SIZE
        else:
            split = size < self.max_split_size and remaining_size > K_SMALL_SIZE
        segment = block.segment
        if split:
            # Splice the remainder in after the block (base.link_after) and cache it (_insert_free).
            block_stream = block.stream
            remaining = Block(addr + size, remaining_size, small, segment, block_stream)
            nxt = block.next
            already_split = nxt is not None or block.prev is not None
            remaining.next = nxt
            if nxt is not None:
                nxt.prev = remaining
            remaining.prev = block
            block.next = remaining
            block.size = size
            if self._gc_enabled:
                remaining.gc_base = self._gc_calls[small]
            key = (remaining_size << _KEY_SIZE) | (addr + size)
            if block_stream:
                key |= block_stream << _KEY_STREAM
            remaining.key = key
            insort(self._free[small], key)
            self._free_blocks[addr + size] = remaining
            if not segment.expandable:
                arrays = self._s_inactive_split_bytes
                if already_split:
                    # An already-split inactive block shrinks by `size` bytes.
                    arrays[_ALL][0] -= size
                    stat = arrays[pool]
                    stat[0] -= size
                    stat[3] += size
                else:
                    stat = arrays[_ALL]
                    value = stat[0] = stat[0] + remaining_size
                    if value > stat[1]:
                        stat[1] = value
                    stat = arrays[pool]
                    value = stat[0] = stat[0] + remaining_size
                    if value > stat[1]:
                        stat[1] = value
                    _inc(self._s_inactive_split, pool, 1)
        elif (block.prev is not None or block.next is not None) and not segment.expandable:
            # A split inactive block becomes active whole.
            arrays = self._s_inactive_split_bytes
            amount = block.size
            arrays[_ALL][0] -= amount
            stat = arrays[pool]
            stat[0] -= amount
            stat[3] += amount
            arrays = self._s_inactive_split
            arrays[_ALL][0] -= 1
            stat = arrays[pool]
            stat[0] -= 1
            stat[3] += 1
        block.allocated = True
        block.requested = requested
        self._active[addr] = block
        # Each stat keeps current and peak ("allocated" is current + freed, filled in by
        # memory_stats()); `active` mirrors `allocation` (no stream events are modelled, so
        # nothing is freed-but-pending).
        size = block.size
        arrays = self._s_allocation
        stat = arrays[_ALL]
        value = stat[0] = stat[0] + 1
        if value > stat[1]:
            stat[1] = value
        stat = arrays[pool]
        value = stat[0] = stat[0] + 1
        if value > stat[1]:
            stat[1] = value
        arrays = self._s_allocated_bytes
        stat = arrays[_ALL]
        allocated = stat[0] = stat[0] + size
        if allocated > stat[1]:
            stat[1] = allocated
        if allocated > self._window_alloc:
            self._window_alloc = allocated
        stat = arrays[pool]
        value = stat[0] = stat[0] + size
        if value > stat[1]:
            stat[1] = value
        if requested:
            arrays = self._s_requested_bytes
            stat = arrays[_ALL]
            value = stat[0] = stat[0] + requested
            if value > stat[1]:
                stat[1] = value
            stat = arrays[pool]
            value = stat[0] = stat[0] + requested
            if value > stat[1]:
                stat[1] = value
        if size >= self.max_split_size:
            _bump(self._oversize_allocations, 1)
        return addr

    def _align_base(self, block: Block, size: int) -> Block:
        """torch_npu's base alignment (``malloc``, NPUCachingAllocator.cpp:1396-1421): start the
        request at the next ``base_addr_aligned`` boundary inside the found block, if it still fits
        there, and cache the gap before it as a free block of its own (it is not merged)."""
        offset = self.base_addr_aligned - block.addr % self.base_addr_aligned
        if offset + size > block.size:
            return block
        aligned = Block(block.addr + offset, block.size - offset, block.small, block.segment, block.stream)
        link_after(block, aligned)
        block.size = offset
        self._insert_free(block)
        return aligned

    def fits_in_cache(self, size: int, stream: int = 0) -> bool:
        """Whether a request of ``size`` (already rounded) would be served from cached blocks."""
        small = size <= K_SMALL_SIZE
        entries = self._free[small]
        index = bisect_left(entries, (stream << _KEY_STREAM) | (size << _KEY_SIZE))
        if index == len(entries) or entries[index] >> _KEY_STREAM != stream:
            return False
        block_size = (entries[index] >> _KEY_SIZE) & _MASK64
        if size < self.max_split_size <= block_size:
            return False
        return not (size >= self.max_split_size and block_size >= size + self.max_non_split_rounding_size)

    def _get_free_block(self, size: int, small: bool, stream: int) -> Block | None:
        if self._gc_enabled:
            self._gc_calls[small] += 1
        entries = self._free[small]
        index = bisect_left(entries, (stream << _KEY_STREAM) | (size << _KEY_SIZE))
        if index == len(entries):
            return None
        key = entries[index]
        if key >> _KEY_STREAM != stream:
            return None
        block_size, addr = (key >> _KEY_SIZE) & _MASK64, key & _MASK64
        if self.expandable_segments and self._free_blocks[addr].segment.expandable:
            # Best fit counts a block's room to grow into unmapped space as part of its
            # size, so prefer a later candidate that cannot grow over one that can.
            block = self._free_blocks[addr]

            def expandable_size(b: Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

            while block.segment.expandable and index + 1 < len(entries) and entries[index + 1] >> _KEY_STREAM == stream:
                nxt = self._free_blocks[entries[index + 1] & _MASK64]
                if expandable_size(nxt) < expandable_size(block):
                    index += 1
                    block = nxt
                else:
                    break
            block_size, addr = block.size, block.addr
        max_split = self.max_split_size
        if size < max_split and block_size >= max_split:
            return None
        if size >= max_split and block_size >= size + self.max_non_split_rounding_size:
            return None
        del entries[index]
        return self._free_blocks.pop(addr)

    def _new_segment_base(self, size: int, small: bool) -> int:
        base = self.segment_address(size, small) if self.segment_address is not None else None
        if base is None:
            base = self._next_addr
        self._next_addr = max(self._next_addr, base + size)
        return base

    def _alloc_block(self, size: int, small: bool, stream: int, retry: bool) -> Block | None:
        if retry:
            self.num_alloc_retries += 1
        # The fraction check uses the segment size even in expandable mode (``alloc_block``).
        alloc_size = self.segment_size(size)
        if self.set_fraction and self.reserved_bytes + alloc_size > self.allowed_memory_maximum:
            return None
        if self.throw_on_npumalloc_oom and self.reserved_bytes + alloc_size > self._rejection_limit:
            self._rejected = True
            return None
        if self.expandable_segments:
            return self._try_allocate_expandable_block(size, small, stream)
        if not self.device.malloc(alloc_size):
            return None
        self.num_device_alloc += 1
        segment = Segment(self._new_segment_base(alloc_size, small), alloc_size, small, stream=stream)
        self._segments.append(segment)
        self._segments_key = None
        pool = _SMALL if small else _LARGE
        _inc(self._s_segment, pool, 1)
        _inc(self._s_reserved_bytes, pool, alloc_size)
        if alloc_size >= self.max_split_size:
            _bump(self._oversize_segments, 1)
        self._note_reserved()
        return Block(segment.base, alloc_size, small, segment, stream)

    def _note_reserved(self) -> None:
        reserved = self._stats["reserved_bytes"][_ALL][0]
        if reserved > self._window_reserved:
            self._window_reserved = reserved

    # ----------------------------------------------------------------- free
    def free(self, addr: int) -> None:
        if not addr:  # null, as torch_npu hands out for 0 bytes: nothing to free
            return
        block = self._active.pop(addr)
        small = block.small
        pool = _SMALL if small else _LARGE
        original_size = block.size
        arrays = self._s_allocation
        arrays[_ALL][0] -= 1
        stat = arrays[pool]
        stat[0] -= 1
        stat[3] += 1
        arrays = self._s_allocated_bytes
        arrays[_ALL][0] -= original_size
        stat = arrays[pool]
        stat[0] -= original_size
        stat[3] += original_size
        requested = block.requested
        if requested:
            arrays = self._s_requested_bytes
            arrays[_ALL][0] -= requested
            stat = arrays[pool]
            stat[0] -= requested
            stat[3] += requested
            block.requested = 0
        if original_size >= self.max_split_size:
            _drop(self._oversize_allocations, 1)
        block.allocated = False
        # Merge with free mapped neighbours (``free_block`` -> ``try_merge_blocks``, base.absorb
        # inlined). An allocated block is mapped, so an unmapped neighbour never merges here.
        entries = self._free[small]
        free_blocks = self._free_blocks
        merged_blocks = merged_bytes = 0
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated and prev.mapped:
            del entries[bisect_left(entries, prev.key)]
            del free_blocks[prev.addr]
            block.addr = prev.addr
            before = block.prev = prev.prev
            if before is not None:
                before.next = block
            block.size += prev.size
            merged_blocks += 1
            merged_bytes += prev.size
        if nxt is not None and not nxt.allocated and nxt.mapped:
            del entries[bisect_left(entries, nxt.key)]
            del free_blocks[nxt.addr]
            after = block.next = nxt.next
            if after is not None:
                after.prev = block
            block.size += nxt.size
            merged_blocks += 1
            merged_bytes += nxt.size
        if self._gc_enabled:
            block.gc_base = self._gc_calls[small]
        addr = block.addr
        key = (block.size << _KEY_SIZE) | addr
        if block.stream:
            key |= block.stream << _KEY_STREAM
        block.key = key
        insort(entries, key)
        free_blocks[addr] = block
        if not block.segment.expandable:
            if block.prev is not None or block.next is not None:
                inactive_blocks = 1 - merged_blocks
                inactive_bytes = block.size - merged_bytes
            else:
                inactive_blocks = -merged_blocks
                inactive_bytes = -merged_bytes
            if inactive_blocks:
                arrays = self._s_inactive_split
                if inactive_blocks > 0:
                    stat = arrays[_ALL]
                    value = stat[0] = stat[0] + inactive_blocks
                    if value > stat[1]:
                        stat[1] = value
                    stat = arrays[pool]
                    value = stat[0] = stat[0] + inactive_blocks
                    if value > stat[1]:
                        stat[1] = value
                else:
                    arrays[_ALL][0] += inactive_blocks
                    stat = arrays[pool]
                    stat[0] += inactive_blocks
                    stat[3] -= inactive_blocks
            if inactive_bytes:
                arrays = self._s_inactive_split_bytes
                if inactive_bytes > 0:
                    stat = arrays[_ALL]
                    value = stat[0] = stat[0] + inactive_bytes
                    if value > stat[1]:
                        stat[1] = value
                    stat = arrays[pool]
                    value = stat[0] = stat[0] + inactive_bytes
                    if value > stat[1]:
                        stat[1] = value
                else:
                    arrays[_ALL][0] += inactive_bytes
                    stat = arrays[pool]
                    stat[0] += inactive_bytes
                    stat[3] -= inactive_bytes

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
        self._segments_key = None
        self.device.free(segment.size)
        self.num_device_free += 1
        pool = _SMALL if block.small else _LARGE
        _dec(self._s_segment, pool, 1)
        _dec(self._s_reserved_bytes, pool, segment.size)
        if segment.size >= self.max_split_size:
            _drop(self._oversize_segments, 1)

    def _release_available_cached_blocks(self, size: int, small: bool, stream: int) -> bool:
        """Free cached oversize blocks (>= max_split_size) to make room; only with max_split_size set."""
        if self.max_split_size == _UNLIMITED:
            return False
        entries = self._free[small]
        key = max(size, self.max_split_size)
        index = bisect_left(entries, (stream << _KEY_STREAM) | (key << _KEY_SIZE))
        if index < len(entries) and entries[index] >> _KEY_STREAM == stream:
            block = self._free_blocks[entries[index] & _MASK64]
            if block.is_split() or block.segment.expandable:
                return False
            self._release_block(block)
            return True
        released = 0
        index -= 1
        while (
            released < key
            and index >= 0
            and (entries[index] >> _KEY_SIZE) & _MASK64 >= self.max_split_size
            and entries[index] >> _KEY_STREAM == stream
        ):
            block = self._free_blocks[entries[index] & _MASK64]
            index -= 1
            if not block.is_split() and not block.segment.expandable:
                released += block.size
                self._release_block(block)
                index = min(index, len(entries) - 1)
        return released >= key

    def _release_cached_blocks(self) -> None:
        """Sync, then free every cached unsplit segment; expandable: unmap free pages, drop empty segments."""
        self.num_sync_all_streams += 1
        for entries in self._free:  # large pool first, as release_cached_blocks does
            to_unmap = []
            for key in list(entries):
                block = self._free_blocks.get(key & _MASK64)
                if block is None:
                    continue
                if block.segment.expandable:
                    to_unmap.append(block)
                elif not block.is_split():
                    self._release_block(block)
            for block in to_unmap:
                if block.addr in self._free_blocks:
                    self._unmap_block(block)
                self._release_if_unmapped(block)

    def _garbage_collect_cached_blocks(self) -> None:
        """``garbage_collect_cached_blocks``: release old unsplit cached large blocks down to the threshold."""
        threshold = int(self.garbage_collection_threshold * self.allowed_memory_maximum)
        reserved = self.reserved_bytes
        if reserved <= threshold:
            return
        target = reserved - threshold
        calls = self._gc_calls[False]
        freeable = [self._free_blocks[key & _MASK64] for key in self._free[False]]
        freeable = [b for b in freeable if not b.is_split() and not b.segment.expandable]
        if not freeable:
            return
        total_age = sum(calls - b.gc_base for b in freeable)
        count = len(freeable)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for key in list(self._free[False]):
                block = self._free_blocks.get(key & _MASK64)
                if block is None or block.is_split() or block.segment.expandable:
                    continue
                age = calls - block.gc_base
                if age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    def empty_cache(self) -> None:
        self._release_cached_blocks()

    # ----------------------------------------------------------------- expandable segments
    def _try_allocate_expandable_block(self, size: int, small: bool, stream: int) -> Block | None:
        candidate = self._find_expandable_block(size, small, stream)
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

    def _find_expandable_block(self, size: int, small: bool, stream: int) -> Block:
        def allocatable(b: Block | None) -> TypeGuard[Block]:
            return b is not None and not b.allocated

        entries = self._unmapped[small]
        for index in range(bisect_left(entries, (stream, 0)), len(entries)):
            if entries[index][0] != stream:
                break
            candidate = entries[index][3]
            if allocatable(candidate.prev):
                candidate = candidate.prev
            room = 0
            walker: Block | None = candidate
            while room < size and allocatable(walker):
                room += walker.size
                walker = walker.next
            if room >= size:
                return candidate
        page, virtual = self.expandable_reservation(small)
        segment = Segment(
            self._new_segment_base(virtual, small), virtual, small, expandable=True, page_size=page, stream=stream
        )
        self._segments.append(segment)
        self._segments_key = None
        block = Block(segment.base, virtual, small, segment, stream)
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
            rest = Block(block.addr + mapped, block.size - mapped, block.small, segment, block.stream)
            rest.mapped = False
            link_after(block, rest)
            block.size = mapped
            self._insert_unmapped(rest)
        block.mapped = True
        map_addr = block.addr
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        self._insert_free(block)
        _inc(self._s_reserved_bytes, _SMALL if block.small else _LARGE, mapped)
        self._note_reserved()
        if self.on_map is not None:
            self.on_map(map_addr, mapped)
        return True

    def _unmap_block(self, block: Block, start: int | None = None, end: int | None = None) -> int:
        """Unmap the whole pages inside a free mapped block (or its [start, end) part); bytes unmapped."""
        segment = block.segment
        page = segment.page_size
        if start is None:
            offset = block.addr - segment.base
            start = segment.base + -(-offset // page) * page
            end = segment.base + ((block.addr + block.size - segment.base) // page) * page
        assert end is not None  # a caller that names the range names both ends (unmap_range)
        if end <= start:
            return 0
        self._remove_free(block)
        before = start - block.addr
        after = block.addr + block.size - end
        if before:
            head = Block(block.addr, before, block.small, segment, block.stream)
            head.prev = block.prev
            if head.prev is not None:
                head.prev.next = head
            head.next = block
            block.prev = head
            self._insert_free(head)
        if after:
            tail = Block(end, after, block.small, segment, block.stream)
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
        return unmapped

    def _release_if_unmapped(self, block: Block) -> bool:
        """``release_expandable_segment``: drop a segment whose one block is unmapped."""
        if block.mapped or block.is_split() or block.allocated:
            return False
        segment = block.segment
        if segment not in self._segments:
            return False
        self._remove_unmapped(block)
        self._segments.remove(segment)
        self._segments_key = None
        return True

    # ----------------------------------------------------------------- trace replay
    def seed_segment(
        self, base: int, size: int, small: bool, blocks: Iterable[tuple[int, int, int]], stream: int = 0
    ) -> None:
        """Add a segment as a recording found it: ``blocks`` are its allocated (addr, size, requested).

        The free space between them becomes free blocks, merged as the allocator keeps them.
        Counters are those of the seeded state; peaks start there.
        """
        self.seed_segments([(base, size, small, blocks, stream)])

    def seed_segments(self, segments: Iterable[tuple[int, int, bool, Iterable[tuple[int, int, int]], int]]) -> None:
        """``seed_segment`` for many (base, size, small, blocks, stream) at once, counters added once per pool."""
        segments = list(segments)
        for base, size, _, _, _ in segments:
            if base < 0 or size < 0 or (base + size) >> _KEY_SIZE:
                raise ValueError(f"seeded segment {base:#x}+{size} lies outside the 64-bit address space")
        total = sum(size for _, size, _, _, _ in segments)
        if not self.device.malloc(total):
            raise ValueError(f"seeded segments of {total} bytes do not fit the device")
        active = self._active
        max_split = self.max_split_size
        # Per pool (index 0 large, 1 small): segments, reserved, allocations, allocated, requested,
        # inactive split blocks and bytes. Every increment is positive, so adding each sum once
        # leaves the same current and peak as adding its parts one by one.
        sums = [[0] * 7, [0] * 7]
        oversize_segments = oversize_allocations = 0
        free: list[Block] = []
        for base, size, small, blocks, stream in segments:
            end = base + size
            segment = Segment(base, size, small, stream=stream)
            self._segments.append(segment)
            self._segments_key = None
            if end > self._next_addr:
                self._next_addr = end
            counts = sums[small]
            counts[0] += 1
            counts[1] += size
            if size >= max_split:
                oversize_segments += 1
            first_free = len(free)
            cursor = base
            previous: Block | None = None
            pieces = 0
            for addr, block_size, requested in sorted(blocks):
                if addr < cursor or addr + block_size > end:
                    raise ValueError(f"seeded block at {addr:#x} does not fit segment {base:#x}+{size}")
                if addr > cursor:
                    gap = Block(cursor, addr - cursor, small, segment, stream)
                    if previous is not None:
                        previous.next = gap
                        gap.prev = previous
                    previous = gap
                    free.append(gap)
                    pieces += 1
                block = Block(addr, block_size, small, segment, stream)
                if previous is not None:
                    previous.next = block
                    block.prev = previous
                previous = block
                block.allocated = True
                block.requested = requested
                active[addr] = block
                pieces += 1
                counts[2] += 1
                counts[3] += block_size
                counts[4] += requested
                if block_size >= max_split:
                    oversize_allocations += 1
                cursor = addr + block_size
            if cursor < end:
                gap = Block(cursor, end - cursor, small, segment, stream)
                if previous is not None:
                    previous.next = gap
                    gap.prev = previous
                free.append(gap)
                pieces += 1
            if pieces > 1:  # every free block of a segment with several is split off another
                for gap in free[first_free:]:
                    counts[5] += 1
                    counts[6] += gap.size
        for pool_index, counts in enumerate(sums):
            pool = _SMALL if pool_index else _LARGE
            for arrays, amount in zip(
                (
                    self._s_segment,
                    self._s_reserved_bytes,
                    self._s_allocation,
                    self._s_allocated_bytes,
                    self._s_requested_bytes,
                    self._s_inactive_split,
                    self._s_inactive_split_bytes,
                ),
                counts,
            ):
                if amount:
                    _inc(arrays, pool, amount)
        if oversize_segments:
            _bump(self._oversize_segments, oversize_segments)
        if oversize_allocations:
            _bump(self._oversize_allocations, oversize_allocations)
        for block in free:
            self._insert_free(block)
        self._note_reserved()
        self._window_alloc = max(self._window_alloc, self.allocated_bytes)

    def expandable_reservation(self, small: bool) -> tuple[int, int]:
        """(page size, address space) of a new expandable segment of a pool: 1 1/8 x the GPU's
        memory in whole pages (``ExpandableSegment``, c10/cuda/CUDACachingAllocator.cpp:376 at v2.6.0)."""
        page = K_SMALL_BUFFER if small else self.large_page_size
        total = self.address_space_total or self.device.capacity_bytes
        return page, -(-(total + total // 8) // page) * page

    def seed_expandable_segment(
        self,
        base: int,
        size: int,
        small: bool,
        mapped: Iterable[tuple[int, int]],
        blocks: Iterable[tuple[int, int, int]],
        stream: int = 0,
    ) -> None:
        """Add an expandable segment as a recording found it: the address range [base, base + size)
        that ``find_expandable_block`` reserved, its ``mapped`` (start, end) ranges, and the allocated
        (addr, size, requested) blocks in them.

        Free space inside a mapped range is one free block per gap, the rest of the reservation
        unmapped blocks: a mapped block never merges with an unmapped one (``try_merge_blocks``,
        c10/cuda/CUDACachingAllocator.cpp:2474-2476 at v2.6.0). Mapped pages count in reserved
        bytes (``map_block``, :2340), never in ``segment`` (only ``alloc_block`` raises it, :2783)
        nor in ``inactive_split`` (``free_block`` skips expandable blocks, :2450).
        """
        page = self.expandable_reservation(small)[0]
        end = base + size
        if base < 0 or size <= 0 or end >> _KEY_SIZE:
            raise ValueError(f"seeded expandable segment {base:#x}+{size} lies outside the 64-bit address space")
        ranges = sorted(mapped)
        cursor = base
        for start, stop in ranges:
            if start < cursor or stop > end or stop <= start or (start - base) % page or (stop - start) % page:
                raise ValueError(
                    f"seeded mapped range {start:#x}-{stop:#x} is not whole {page}-byte pages "
                    f"of expandable segment {base:#x}+{size}"
                )
            cursor = stop
        mapped_bytes = sum(stop - start for start, stop in ranges)
        if not self.device.malloc(mapped_bytes):
            raise ValueError(f"seeded segments of {mapped_bytes} bytes do not fit the device")
        segment = Segment(base, size, small, expandable=True, page_size=page, stream=stream)
        self._segments.append(segment)
        self._segments_key = None
        self._next_addr = max(self._next_addr, end)
        pieces: list[Block] = []

        def piece(addr: int, piece_size: int, is_mapped: bool) -> Block:
            block = Block(addr, piece_size, small, segment, stream)
            block.mapped = is_mapped
            if pieces:
                link_after(pieces[-1], block)
            pieces.append(block)
            return block

        pending = sorted(blocks)
        index = 0
        allocations = allocated = requested_bytes = 0
        cursor = base
        for start, stop in ranges:
            if cursor < start:
                piece(cursor, start - cursor, False)
            cursor = start
            while index < len(pending) and pending[index][0] < stop:
                addr, block_size, requested = pending[index]
                if addr < cursor or addr + block_size > stop:
                    raise ValueError(
                        f"seeded block at {addr:#x} does not fit a mapped range of expandable segment {base:#x}+{size}"
                    )
                if addr > cursor:
                    piece(cursor, addr - cursor, True)
                block = piece(addr, block_size, True)
                block.allocated = True
                block.requested = requested
                self._active[addr] = block
                allocations += 1
                allocated += block_size
                requested_bytes += requested
                if block_size >= self.max_split_size:
                    _bump(self._oversize_allocations, 1)
                cursor = addr + block_size
                index += 1
            if cursor < stop:
                piece(cursor, stop - cursor, True)
            cursor = stop
        if index < len(pending):
            raise ValueError(
                f"seeded block at {pending[index][0]:#x} lies outside the mapped ranges of "
                f"expandable segment {base:#x}+{size}"
            )
        if cursor < end:
            piece(cursor, end - cursor, False)
        for block in pieces:
            if not block.mapped:
                self._insert_unmapped(block)
            elif not block.allocated:
                self._insert_free(block)
        pool = _SMALL if small else _LARGE
        for arrays, amount in (
            (self._s_reserved_bytes, mapped_bytes),
            (self._s_allocation, allocations),
            (self._s_allocated_bytes, allocated),
            (self._s_requested_bytes, requested_bytes),
        ):
            if amount:
                _inc(arrays, pool, amount)
        self._note_reserved()
        self._window_alloc = max(self._window_alloc, self.allocated_bytes)

    def release_segment_at(self, base: int) -> bool:
        """Release the segment at ``base`` if it is one wholly free block (a trace's ``segment_free``)."""
        block = self._free_blocks.get(base)
        if block is None or block.is_split() or block.segment.expandable or block.segment.base != base:
            return False
        self._release_block(block)
        return True

    def unmap_range(self, addr: int, size: int) -> bool:
        """Unmap [addr, addr + size) of an expandable segment, as a trace's ``segment_unmap`` says."""
        for key in list(self._free[False]) + list(self._free[True]):
            block = self._free_blocks.get(key & _MASK64)
            if block is None or not block.segment.expandable:
                continue
            if block.addr <= addr and addr + size <= block.addr + block.size:
                segment = block.segment
                page = segment.page_size
                if (addr - segment.base) % page or size % page:
                    return False
                self._unmap_block(block, addr, addr + size)
                unmapped = self._unmapped_block_at(addr, segment)
                if unmapped is not None:
                    self._release_if_unmapped(unmapped)
                return True
        return False

    def _unmapped_block_at(self, addr: int, segment: Segment) -> Block | None:
        for _, block_addr, _, block in self._unmapped[segment.small]:
            if block.segment is segment and block.addr <= addr < block.addr + block.size:
                return block
        return None

    def _mapped_ranges(self) -> Iterator[tuple[Segment, tuple[tuple[int, int, bool], ...]]]:
        """(segment, ((block address, size, allocated), ...)) per contiguous mapped range of each segment."""
        heads: dict[int, Block] = {}
        block: Block | None
        for blocks in (self._active.values(), self._free_blocks.values()):
            for block in blocks:
                if block.prev is None:
                    heads[id(block.segment)] = block
        for entries in self._unmapped:
            for entry in entries:
                if entry[3].prev is None:
                    heads[id(entry[3].segment)] = entry[3]
        for segment in self._segments:
            block = heads.get(id(segment))
            current: list[tuple[int, int, bool]] = []
            while block is not None:
                if block.mapped:
                    current.append((block.addr, block.size, block.allocated))
                elif current:
                    yield segment, tuple(current)
                    current = []
                block = block.next
            if current:
                yield segment, tuple(current)

    def snapshot_segments(self) -> list[dict[str, Any]]:
        """The segments as ``torch.cuda.memory._snapshot()`` reports them (``snapshot()``).

        One entry per contiguous mapped range of an expandable segment; blocks as
        ``{"address", "size", "allocated"}``; sorted by address.
        """
        out = [
            {
                "address": blocks[0][0],
                "total_size": sum(size for _, size, _ in blocks),
                "small": segment.small,
                "expandable": segment.expandable,
                "stream": segment.stream,
                "blocks": [{"address": addr, "size": size, "allocated": allocated} for addr, size, allocated in blocks],
            }
            for segment, blocks in self._mapped_ranges()
        ]
        return sorted(out, key=lambda s: s["address"])

    def segment_layout(self) -> list[tuple[int, int, tuple[tuple[int, int, bool], ...]]]:
        """``snapshot_segments`` reduced to what an end-state check compares, sorted by address:
        (address, total_size, ((block address, size, allocated), ...)) per contiguous mapped range."""
        return sorted((blocks[0][0], sum(size for _, size, _ in blocks), blocks) for _, blocks in self._mapped_ranges())

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
            for pool_name, stat in zip(STAT_POOLS, _filled(self._stats[source])):
                for field, value in zip(STAT_FIELDS, stat):
                    stats[f"{name}.{pool_name}.{field}"] = value
        for name, stat in (
            ("oversize_allocations", self._oversize_allocations),
            ("oversize_segments", self._oversize_segments),
        ):
            for field, value in zip(STAT_FIELDS, (stat[0], stat[1], stat[0] + stat[3], stat[3])):
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
        return [(key >> _KEY_SIZE) & _MASK64 for key in self._free[small]]


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: the next of ``divisions`` equal steps above a power of two."""
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


# ----------------------------------------------------------------- PYTORCH_{NPU,CUDA}_ALLOC_CONF
# The keys each variant's real parser accepts. Common to both: c10's AcceleratorAllocatorConfig
# (c10/core/AllocatorConfig.cpp, getMutableKeys; the key set read in torch 2.13.0's libc10.so,
# which adds the two pinned_max_* keys to the source this cites).
_C10_KEYS = (
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "pinned_use_background_threads",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
)
# torch_npu: NPUAllocatorConfig::getKeys (NPUAllocatorConfig.h:131-142) and the c10 keys it lets
# through, kNPUSupportAccKeys (NPUAllocatorConfig.cpp:33-42: all of them at 2.13.0).
_NPU_KEYS = (
    "pin_memory_expandable_segments",
    "pinned_mem_register",
    "base_addr_aligned_kb",
    "page_size",
    "segment_size_mb",
    "multi_stream_lazy_reclaim",
    "pinned_reserve_segment_size_mb",
    "per_process_memory_fraction",
    "release_lock_on_npumalloc",
    "throw_on_npumalloc_oom",
)
# torch: CUDAAllocatorConfig::parseArgs (c10/cuda/CUDAAllocatorConfig.cpp, pytorch/pytorch 01f9ef32).
_CUDA_KEYS = (
    "backend",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
)
# Keys that change nothing a device allocator places (locks, host/pinned memory, event reaping on one
# stream): checked like the real parser checks them, then left out of the keyword arguments.
_NO_PLACEMENT = {
    "pinned_use_background_threads",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
    "pin_memory_expandable_segments",
    "pinned_mem_register",
    "multi_stream_lazy_reclaim",
    "pinned_reserve_segment_size_mb",
    "release_lock_on_npumalloc",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "graph_capture_record_stream_reuse",
}
_MIB = 1 << 20


def _conf_tokens(text: str) -> list[str]:
    """``ConfigTokenizer`` (c10/core/AllocatorConfig.h): ``,`` ``:`` ``[`` ``]`` are tokens, whitespace is dropped."""
    tokens: list[str] = []
    buffer = ""
    for char in text:
        if char in ",:[]":
            if buffer:
                tokens.append(buffer)
                buffer = ""
            tokens.append(char)
        elif not char.isspace():
            buffer += char
    if buffer:
        tokens.append(buffer)
    return tokens


def _conf_int(key: str, value: str) -> int:
    if not value.isdigit():
        raise ValueError(f"alloc conf: {key} needs a whole number, got {value!r}")
    return int(value)


def _conf_float(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"alloc conf: {key} needs a number, got {value!r}") from None


def _conf_bool(key: str, value: str) -> bool:
    if value not in ("True", "False"):  # ConfigTokenizer::toBool: exactly True or False
        raise ValueError(f"alloc conf: {key} needs True or False, got {value!r}")
    return value == "True"


def _conf_divisions(value: str | list[tuple[str, str]]) -> tuple[int, ...]:
    """``parseRoundUpPower2Divisions`` (c10/core/AllocatorConfig.cpp): one power of two for every
    interval, or ``[MiB:divisions, ..., >:divisions]``, where the first entry also fills the
    intervals below it and ``>`` fills every interval after the last one named."""
    key = "roundup_power2_divisions"
    if isinstance(value, str):
        divisions = _conf_int(key, value)
        if divisions <= 0 or divisions & (divisions - 1):
            raise ValueError(f"alloc conf: {key} must be a power of 2, got {divisions}")
        return (divisions,) * K_ROUNDUP_INTERVALS
    table = [0] * K_ROUNDUP_INTERVALS
    first = True
    last_index = 0
    for bound, text in value:
        divisions = _conf_int(key, text)
        if divisions & (divisions - 1):
            raise ValueError(f"alloc conf: {key} divisions must be 0 or a power of 2, got {divisions}")
        if bound == ">":
            table[last_index + 1 :] = [divisions] * (K_ROUNDUP_INTERVALS - last_index - 1)
            continue
        mib = _conf_int(key, bound)
        if mib <= 0 or mib & (mib - 1):
            raise ValueError(f"alloc conf: {key} intervals must be powers of 2, got {mib}")
        index = min(mib.bit_length() - 1, K_ROUNDUP_INTERVALS - 1)
        if first:
            table[:index] = [divisions] * index
            first = False
        table[index] = divisions
        last_index = index
    return tuple(table)


def _conf_pairs(text: str) -> list[tuple[str, str | list[tuple[str, str]]]]:
    """``key:value`` pairs, a value being a token or a ``[a:b, ...]`` list."""
    tokens = _conf_tokens(text)
    pairs: list[tuple[str, str | list[tuple[str, str]]]] = []
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if key in ",:[]" or i + 1 >= len(tokens) or tokens[i + 1] != ":":
            raise ValueError(f"alloc conf: expected key:value at {key!r}")
        if i + 2 >= len(tokens):
            raise ValueError(f"alloc conf: {key} has no value")
        i += 2
        if tokens[i] == "[":
            items: list[tuple[str, str]] = []
            i += 1
            while i < len(tokens) and tokens[i] != "]":
                if i + 2 >= len(tokens) or tokens[i + 1] != ":" or tokens[i + 2] in ",:[]":
                    raise ValueError(f"alloc conf: {key} list entries must be bound:value")
                items.append((tokens[i], tokens[i + 2]))
                i += 3
                if i < len(tokens) and tokens[i] == ",":
                    i += 1
            if i >= len(tokens):
                raise ValueError(f"alloc conf: {key} list has no closing ]")
            value: str | list[tuple[str, str]] = items
        elif tokens[i] in ",:]":
            raise ValueError(f"alloc conf: {key} has no value")
        else:
            value = tokens[i]
        pairs.append((key, value))
        i += 1
        if i < len(tokens):
            if tokens[i] != ",":
                raise ValueError(f"alloc conf: expected ',' after {key}'s value")
            i += 1
    return pairs


def parse_alloc_conf(text: str, variant: str, *, skip_unknown_keys: bool = False) -> dict[str, Any]:
    """``PYTORCH_NPU_ALLOC_CONF`` (variant ``torch_npu``) or ``PYTORCH_CUDA_ALLOC_CONF`` (``torch``)
    as keyword arguments for :class:`CachingAllocator`.

    Accepts exactly the keys that variant's real parser accepts, with its value rules (ranges from
    c10/core/AllocatorConfig.cpp and NPUAllocatorConfig.cpp:68-234); a bad key or value is a
    one-line ValueError naming it. Keys that change no placement are checked, then dropped.
    Refused although the real parser takes it, because the model does not follow it:
    ``backend:cudaMallocAsync``. ``skip_unknown_keys``: a key this table does not know is left out
    instead of refused (the vLLM plugin reads a running engine's variable, which a newer torch than
    the table's may have accepted).
    """
    if variant not in ("torch", "torch_npu"):
        raise ValueError(f"unknown caching-allocator variant {variant!r}")
    npu = variant == "torch_npu"
    accepted = set(_C10_KEYS) | set(_NPU_KEYS if npu else _CUDA_KEYS)
    name = "PYTORCH_NPU_ALLOC_CONF" if npu else "PYTORCH_CUDA_ALLOC_CONF"
    kwargs: dict[str, Any] = {}
    pairs = _conf_pairs(text)
    if skip_unknown_keys:
        pairs = [(key, value) for key, value in pairs if key in accepted]
    # large_segment_size_mb first: it bounds max_split_size_mb and max_non_split_rounding_mb
    # (AcceleratorAllocatorConfig::parseArgs reads it in a pass of its own).
    large_segment_mib = K_LARGE_BUFFER // _MIB
    for key, value in pairs:
        if key not in accepted:
            raise ValueError(f"alloc conf: unknown key {key!r} for {name}")
        if isinstance(value, list):
            if key != "roundup_power2_divisions":
                raise ValueError(f"alloc conf: {key} takes one value, not a list")
        elif key == "large_segment_size_mb":
            large_segment_mib = _conf_int(key, value)
            if large_segment_mib <= K_MIN_LARGE_ALLOC // _MIB:
                raise ValueError(f"alloc conf: large_segment_size_mb must be > {K_MIN_LARGE_ALLOC // _MIB}")
            kwargs["large_segment_size"] = large_segment_mib * _MIB
    fraction = 1.0
    for key, raw in pairs:
        if key == "roundup_power2_divisions":
            kwargs["roundup_power2_divisions"] = _conf_divisions(raw)
            continue
        assert isinstance(raw, str)  # the pass above refused a list for every other key
        value = raw
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            mib = _conf_int(key, value)
            if mib < large_segment_mib:
                raise ValueError(f"alloc conf: {key} must be >= {large_segment_mib}")
            kwargs["max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding_size"] = mib * _MIB
        elif key == "garbage_collection_threshold":
            threshold = _conf_float(key, value)
            if not 0.0 < threshold < 1.0:
                raise ValueError(f"alloc conf: {key} must be in (0.0, 1.0), got {value}")
            kwargs["garbage_collection_threshold"] = threshold
        elif key == "expandable_segments":
            kwargs["expandable_segments"] = _conf_bool(key, value)
        elif key == "base_addr_aligned_kb":
            aligned = _conf_int(key, value)
            if aligned > 16 or value != str(aligned):
                raise ValueError(f"alloc conf: {key} must be an int in 0..16, got {value}")
            kwargs["base_addr_aligned_kb"] = aligned
        elif key == "page_size":
            if value != "1g":
                raise ValueError(f"alloc conf: page_size supports only 1g, got {value!r}")
            kwargs["page_size_1g"] = True
        elif key == "segment_size_mb":
            mib = _conf_int(key, value)
            if not 20 <= mib <= 512:
                raise ValueError(f"alloc conf: {key} must be in 20..512, got {mib}")
            kwargs["segment_size"] = mib * _MIB
        elif key == "per_process_memory_fraction":
            fraction = _conf_float(key, value)
            if not 0.0 <= fraction <= 1.0:
                raise ValueError(f"alloc conf: {key} must be in [0.0, 1.0], got {value}")
        elif key == "backend":
            if value not in ("native", "cudaMallocAsync"):
                raise ValueError(f"alloc conf: backend must be native or cudaMallocAsync, got {value!r}")
            if value != "native":
                raise ValueError("alloc conf: backend:cudaMallocAsync is not modelled")
        elif key == "throw_on_npumalloc_oom":
            if _conf_bool(key, value):
                kwargs["throw_on_npumalloc_oom"] = True
        elif key in (
            "pinned_num_register_threads",
            "pinned_max_round_threshold_mb",
            "pinned_max_cached_size_mb",
            "pinned_reserve_segment_size_mb",
        ):
            _conf_int(key, value)
        elif key in _NO_PLACEMENT:
            _conf_bool(key, value)
    # setMemoryFraction keeps no maximum at 1.0 (NPUCachingAllocator.cpp:1712-1721).
    if fraction < 1.0:
        kwargs["memory_fraction"] = fraction
    # NPUAllocatorConfig.cpp:306-312: neither splits limit nor garbage collection with expandable segments.
    if (
        npu
        and kwargs.get("expandable_segments")
        and ("max_split_size" in kwargs or "garbage_collection_threshold" in kwargs)
    ):
        raise ValueError(
            "alloc conf: max_split_size_mb or garbage_collection_threshold cannot be used with expandable_segments:True"
        )
    return kwargs


# A stat is [current, peak, allocated, freed] for all pools, the small pool and the large pool.
# Only current and peak are kept everywhere, and freed per pool: "allocated" is current + freed
# (every change goes through these helpers), and the all-pool freed is the pools' sum; both
# are filled in by memory_stats(). The hot paths (malloc, free) follow the same scheme inline.


def _inc(arrays: list[list[int]], pool: int, amount: int) -> None:
    stat = arrays[_ALL]
    value = stat[0] = stat[0] + amount
    if value > stat[1]:
        stat[1] = value
    stat = arrays[pool]
    value = stat[0] = stat[0] + amount
    if value > stat[1]:
        stat[1] = value


def _dec(arrays: list[list[int]], pool: int, amount: int) -> None:
    arrays[_ALL][0] -= amount
    stat = arrays[pool]
    stat[0] -= amount
    stat[3] += amount


def _bump(stat: list[int], amount: int) -> None:
    value = stat[0] = stat[0] + amount
    if value > stat[1]:
        stat[1] = value


def _drop(stat: list[int], amount: int) -> None:
    stat[0] -= amount
    stat[3] += amount


def _filled(arrays: list[list[int]]) -> list[list[int]]:
    """A stat's [current, peak, allocated, freed] per pool with allocated and freed filled in."""
    freed = arrays[_SMALL][3] + arrays[_LARGE][3]
    out = [[arrays[_ALL][0], arrays[_ALL][1], arrays[_ALL][0] + freed, freed]]
    out += [[stat[0], stat[1], stat[0] + stat[3], stat[3]] for stat in arrays[1:]]
    return out
