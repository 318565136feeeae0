"""torch_alloc's inlined hot path against the same allocator spelled out through its general helpers.

``CachingAllocator.malloc`` inlines the cache hit (``_get_free_block``), the split and activation
(upstream's ``should_split`` and ``alloc_found_block``) and the statistic updates (``_inc``,
``_dec``, ``_bump``); ``free`` inlines the merge (``_try_merge``, ``base.absorb``) and
``free_block``'s inactive-split accounting. ``GeneralPath`` below overrides only those two
methods, written step by step as c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch v2.6.0) has
them, out of the model's general helpers. Everything else (rounding, the miss path's segment
allocation and releases, expandable segments, torch_npu's base alignment) is the model's own code.

The same seeded op streams are replayed on both, and after every op the returned address (or
the out-of-memory error), ``memory_stats()``, the window peaks and the device's allocator bytes
must agree; at the end the free lists and the segment layout must. The inlined side runs on the Python
model and on the C engine (tests/support/alloc_engines.py), which inlines the same steps in C.
"""

from __future__ import annotations

import random

import pytest
from alloc_engines import ENGINES, engine  # noqa: F401  (engine: the fixture the test uses)

from kvguard.allocators import native
from kvguard.allocators.base import AllocatorOutOfMemory, link_after
from kvguard.allocators.device import Device
from kvguard.allocators.torch_alloc import (
    _LARGE,
    _SMALL,
    K_MIN_BLOCK_SIZE,
    K_ROUND_LARGE,
    K_SMALL_SIZE,
    Block,
    CachingAllocator,
    _bump,
    _dec,
    _drop,
    _inc,
    parse_alloc_conf,
)

MIB = 1 << 20
DEVICE_BYTES = 256 * MIB  # small enough that the streams below run into out-of-memory
OPS_PER_STREAM = 1500
SEEDS = (1, 2)
# The Python model on every seed, the C engine on the first (tests/allocators/test_alloc_native_torch.py compares the
# engine with the model op by op on many more streams): CI time.
ENGINE_SEEDS = [(name, seed) for name in ENGINES for seed in SEEDS if name == "python" or seed == SEEDS[0]]
WINDOW_OPS = 7


class GeneralPath(CachingAllocator):
    """The allocator with ``malloc`` and ``free`` written through the general helpers, not inlined."""

    def malloc(self, size: int, persistent: bool = False, stream: int = 0) -> int:
        if not size and self._null_for_zero:
            return 0
        requested = size
        size = self.round_size(size)
        small = size <= K_SMALL_SIZE
        block = self._get_free_block(size, small, stream)
        if block is None:
            block = self._allocate_new_block(requested, size, small, stream)
        if self._aligns_base and size >= K_ROUND_LARGE and block.addr % self.base_addr_aligned:
            block = self._align_base(block, size)
        return self._alloc_found_block(block, size, requested)

    def _allocate_new_block(self, requested: int, size: int, small: bool, stream: int) -> Block:
        # The miss path as CachingAllocator.malloc has it (it only calls methods, nothing inlined).
        if self._gc_enabled:
            self._garbage_collect_cached_blocks()
        self._rejected = False
        block = self._alloc_block(size, small, stream, retry=False)
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
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        # should_split: small pool or expandable segments split down to 512 bytes; the large
        # pool only under max_split_size and when more than 1 MiB remains.
        remaining = block.size - size
        if block.small or self.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.max_split_size and remaining > K_SMALL_SIZE

    def _alloc_found_block(self, block: Block, size: int, requested: int) -> int:
        # alloc_found_block: split off the remainder, move inactive-split counts, activate.
        pool = _SMALL if block.small else _LARGE
        already_split = block.is_split()
        counts_inactive = not block.segment.expandable
        if self._should_split(block, size):
            remaining = Block(block.addr + size, block.size - size, block.small, block.segment, block.stream)
            link_after(block, remaining)
            block.size = size
            self._insert_free(remaining)
            if already_split and counts_inactive:
                _dec(self._s_inactive_split_bytes, pool, size)
            elif counts_inactive:
                _inc(self._s_inactive_split_bytes, pool, remaining.size)
                _inc(self._s_inactive_split, pool, 1)
        elif already_split and counts_inactive:
            _dec(self._s_inactive_split_bytes, pool, block.size)
            _dec(self._s_inactive_split, pool, 1)
        block.allocated = True
        block.requested = requested
        self._active[block.addr] = block
        _inc(self._s_allocation, pool, 1)
        _inc(self._s_allocated_bytes, pool, block.size)
        _inc(self._s_requested_bytes, pool, requested)
        if block.size >= self.max_split_size:
            _bump(self._oversize_allocations, 1)
        self._window_alloc = max(self._window_alloc, self.allocated_bytes)
        return block.addr

    def free(self, addr: int) -> None:
        # free_block: merge with both neighbours (try_merge_blocks), cache the result, then apply
        # the net change in inactive split blocks and bytes (none for expandable segments,
        # CUDACachingAllocator.cpp:2450 at v2.6.0).
        if not addr:
            return
        block = self._active.pop(addr)
        pool = _SMALL if block.small else _LARGE
        original_size, requested = block.size, block.requested
        if original_size >= self.max_split_size:
            _drop(self._oversize_allocations, 1)
        block.allocated = False
        block.requested = 0
        net_blocks = net_bytes = 0
        for candidate in (block.prev, block.next):
            subsumed = self._try_merge(block, candidate)
            if subsumed:
                net_blocks -= 1
                net_bytes -= subsumed
        self._insert_free(block)
        if block.is_split():
            net_blocks += 1
            net_bytes += block.size
        if not block.segment.expandable:
            for arrays, net in ((self._s_inactive_split, net_blocks), (self._s_inactive_split_bytes, net_bytes)):
                if net > 0:
                    _inc(arrays, pool, net)
                elif net < 0:
                    _dec(arrays, pool, -net)
        _dec(self._s_allocation, pool, 1)
        _dec(self._s_allocated_bytes, pool, original_size)
        _dec(self._s_requested_bytes, pool, requested)


# (variant, alloc conf, memory fraction set through torch.cuda.set_per_process_memory_fraction).
# Without expandable segments or garbage collection malloc's cache hit is inlined too; with
# either, only the split, activation and free are (the hit goes through _get_free_block).
CONFIGS = [
    ("torch", "", None),
    ("torch", "max_split_size_mb:32", None),
    ("torch", "expandable_segments:True", None),
    ("torch", "expandable_segments:True,max_split_size_mb:32", None),
    ("torch", "roundup_power2_divisions:4", None),  # rounding through round_size
    ("torch", "garbage_collection_threshold:0.5", 0.75),  # cache hit through _get_free_block
    ("torch_npu", "", None),  # 32-byte pad, null for 0 bytes
    ("torch_npu", "max_split_size_mb:32", None),
    ("torch_npu", "expandable_segments:True", None),  # 16 KiB base alignment
    ("torch_npu", "expandable_segments:True,base_addr_aligned_kb:0", None),
    ("torch_npu", "per_process_memory_fraction:0.75,garbage_collection_threshold:0.5", None),
]


def request_size(rng: random.Random) -> int:
    """Any byte count half the time, whole 128 KiB or MiB steps the other half: those meet the
    rules' exact boundaries (a remainder of exactly 1 MiB, a cached block exactly 20 MiB larger
    than an oversize request, a block ending on an expandable page)."""
    kind = rng.random()
    whole_steps = rng.random() < 0.5
    if kind < 0.02:
        return 0
    if kind < 0.5:  # small pool
        return rng.randint(1, 8) * (K_SMALL_SIZE // 8) if whole_steps else rng.randint(1, K_SMALL_SIZE)
    if kind < 0.82:  # large pool, a 20 MiB segment for several
        return rng.randint(1, 9) * MIB if whole_steps else rng.randint(K_SMALL_SIZE + 1, 10 * MIB - 1)
    # Large pool, a segment of its own; from 32 MiB on oversize where max_split_size_mb:32.
    return rng.randint(10, 56) * MIB if whole_steps else rng.randint(10 * MIB, 56 * MIB)


def op_stream(seed: int) -> list[tuple]:
    """Mallocs (mostly stream 0, some on stream 1), frees of a random live one, and now and then
    empty_cache and reset_peak_memory_stats. Frees name the malloc they undo by its index.

    Phases of 150 ops alternate between growing (into out-of-memory) and draining (back into
    the cache, so that the next growth reuses split and merged blocks)."""
    rng = random.Random(seed)
    ops: list[tuple] = []
    live: list[int] = []
    for index in range(OPS_PER_STREAM):
        free_share = 0.4 if index // 150 % 2 == 0 else 0.7
        roll = rng.random()
        if roll < 0.03:
            ops.append(("empty_cache",))
        elif roll < 0.04:
            ops.append(("reset_peak_memory_stats",))
        elif live and roll < 0.04 + free_share:
            ops.append(("free", live.pop(rng.randrange(len(live)))))
        else:
            ops.append(("malloc", request_size(rng), 1 if rng.random() < 0.1 else 0))
            live.append(index)
    return ops


def build(cls: type[CachingAllocator] | None, variant: str, conf: str, fraction: float | None) -> CachingAllocator:
    """``cls`` None: the allocator ``native`` builds (the engine the ``engine`` fixture chose)."""
    construct = native.caching_allocator if cls is None else cls
    allocator = construct(Device(DEVICE_BYTES), variant=variant, **parse_alloc_conf(conf, variant))
    if fraction is not None:
        allocator.set_memory_fraction(fraction)
    return allocator


def apply(allocator: CachingAllocator, op: tuple, addresses: dict[int, int], index: int) -> object:
    """One op; what it returned (an address, or the out-of-memory error's message)."""
    if op[0] == "malloc":
        try:
            addresses[index] = allocator.malloc(op[1], stream=op[2])
        except AllocatorOutOfMemory as error:
            return ("oom", str(error))
        return addresses[index]
    if op[0] == "free":
        if op[1] in addresses:  # the malloc it undoes may have run out of memory
            allocator.free(addresses.pop(op[1]))
        return None
    getattr(allocator, op[0])()
    return None


def state(allocator: CachingAllocator) -> tuple:
    return allocator.memory_stats(), allocator.device.allocator_bytes


def end_state(allocator: CachingAllocator, internals: bool = True) -> tuple:
    """The free lists and segments; with ``internals``, the Python model's block tables too (the C engine
    keeps its own, checked by its ``_check``)."""
    public = (
        allocator.free_block_sizes(True),
        allocator.free_block_sizes(False),
        allocator.segment_layout(),
        allocator.segments(),
    )
    if not internals:
        return public
    return public + (sorted(allocator._free_blocks), sorted(allocator._active))


@pytest.mark.usefixtures("engine")
@pytest.mark.parametrize("engine, seed", ENGINE_SEEDS, indirect=["engine"])
@pytest.mark.parametrize(
    "variant, conf, fraction",
    CONFIGS,
    ids=[f"{v}-{c or 'default'}{f'-fraction{f}' if f else ''}" for v, c, f in CONFIGS],
)
def test_inlined_malloc_and_free_match_the_general_path(variant, conf, fraction, seed):
    inlined = build(None, variant, conf, fraction)
    general = build(GeneralPath, variant, conf, fraction)
    inlined_addresses: dict[int, int] = {}
    general_addresses: dict[int, int] = {}
    ooms = 0
    for index, op in enumerate(op_stream(seed)):
        result = apply(inlined, op, inlined_addresses, index)
        assert result == apply(general, op, general_addresses, index), f"op {index} {op}"
        assert state(inlined) == state(general), f"after op {index} {op}"
        if index % WINDOW_OPS == 0:  # a window over several ops, so a peak inside it can be missed
            assert inlined.take_window_peaks() == general.take_window_peaks(), f"window ending at op {index}"
        ooms += isinstance(result, tuple)
    internals = native.engine(inlined) == "python"
    assert end_state(inlined, internals) == end_state(general, internals)
    if not internals:
        inlined._check()
    # The stream must have reached the paths it is meant to compare.
    stats = inlined.memory_stats()
    assert ooms > 0 and stats["num_ooms"] > 0
    assert stats["inactive_split.all.allocated"] > 0 or inlined.expandable_segments
    assert stats["allocation.small_pool.allocated"] > 0 and stats["allocation.large_pool.allocated"] > 0
