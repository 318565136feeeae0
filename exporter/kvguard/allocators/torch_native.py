"""PyTorch's caching allocator (and torch_npu's) on the C engine ``_ctorch``.

:class:`NativeCachingAllocator` is :class:`~kvguard.allocators.torch_alloc.CachingAllocator` (the
specification, whose rules it follows step for step) with the state and the steps in C: the same
constructor, the same addresses, out-of-memory errors, ``memory_stats()``, peaks, device calls and
steady-forward support (``steady_state_key``, ``steady_cells``), at several times the speed.
``malloc`` and ``free`` are the engine's C methods, looked up with no Python in between.

The constructor builds a ``CachingAllocator`` first, so that options are checked, and settings
derived, by the model's own code; the engine takes those settings. What the engine leaves to the
Python model: trace replay's seeding and releases (``seed_segment(s)``, ``seed_expandable_segment``,
``release_segment_at``, ``unmap_range``), devices of 2**62 bytes or more, and sizes or addresses
past 64 bits in options. :func:`unsupported` names the reason, so that a caller can fall back.

Where the model's behaviour on nonsense input is an accident of Python, the engine refuses instead:
a ``stream`` that is not an int in the int64 range, a negative request below -2**63, and a size that
is not an int but survives the model's rounding (a small float: the model then stores a float
``requested``) are TypeError / OverflowError. Everything else (negative sizes, sizes past 64 bits,
zero, unknown or non-int addresses to ``free``) behaves as the model does. Python code the engine runs
in the middle of a ``malloc``, ``free`` or ``empty_cache`` (device methods, ``segment_address``,
``on_map``, a non-int address's ``__eq__``) cannot call those three again: RuntimeError, where the
model would run them nested.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, NoReturn

from kvguard.allocators.device import Device
from kvguard.allocators.torch_alloc import (
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    STAT_ARRAYS,
    CachingAllocator,
)

try:
    from kvguard.allocators._ctorch import (
        C_OVERSIZE_ALLOCATIONS,
        C_OVERSIZE_SEGMENTS,
        MAX_DEVICE_BYTES,
        N_STAT_FIELDS,
        N_STAT_POOLS,
        Engine,
    )
except ImportError:  # no C compiler where kvguard was installed: the Python model only
    Engine = None
    C_OVERSIZE_ALLOCATIONS = C_OVERSIZE_SEGMENTS = MAX_DEVICE_BYTES = N_STAT_FIELDS = N_STAT_POOLS = 0

# Sizes and addresses are uint64 in the engine: a rounded request past 2**64 - 1 saturates there, larger than
# any device it takes, and 1 1/8 x the device (an expandable reservation) must stay within 64 bits: the engine
# takes devices below MAX_DEVICE_BYTES (2**62). (Statistics are 128-bit cells: exact, like the model's ints,
# whatever the device.) The engine's limits and cell layout are its module's constants, read here.
_MAX_DEVICE_BYTES = MAX_DEVICE_BYTES
_SIZE_OPTIONS = ("max_split_size", "large_segment_size", "max_non_split_rounding_size", "segment_size")


def unsupported(device: Device | None = None, **kwargs: Any) -> str | None:
    """Why :class:`NativeCachingAllocator` cannot run these constructor arguments (None: it can).

    Arguments the model itself refuses are not reasons: the constructor raises the model's error.
    """
    if Engine is None:
        return "the C engine kvguard.allocators._ctorch is not built"
    capacity = getattr(device, "capacity_bytes", 0)
    if isinstance(capacity, int) and capacity >= _MAX_DEVICE_BYTES:
        return f"a device of {capacity} bytes (the C engine takes less than 2**62)"
    for name in _SIZE_OPTIONS:
        value = kwargs.get(name)
        if isinstance(value, (int, float)) and not 0 <= value < 1 << 64:
            return f"{name}={value} is outside the 64-bit range of the C engine"
    return None


def _odd_size(rules: CachingAllocator, size: Any) -> int:
    """``malloc`` of a size that is not an int: the model's steps with it (``not size``, its rounding,
    the free-list key through ``fits_in_cache``) raise what they raise; one that survives them is
    refused. Returns 0 where the model returns null (torch_npu, a falsy size)."""
    if not size and rules._null_for_zero:
        return 0
    if rules._plain_rounding:  # malloc's inlined rounding
        rounded = K_MIN_BLOCK_SIZE if size < K_MIN_BLOCK_SIZE else (size + 511) & ~511
    else:
        rounded = rules.round_size(size)
    rules.fits_in_cache(rounded)
    raise TypeError(f"malloc size must be an int, not {type(size).__name__}")


def _replay_only(name: str) -> NoReturn:
    raise NotImplementedError(f"{name} (trace replay) is the Python model's: use torch_alloc.CachingAllocator")


_BaseEngine: Any = Engine if Engine is not None else object


class NativeCachingAllocator(_BaseEngine):
    """:class:`~kvguard.allocators.torch_alloc.CachingAllocator` on the C engine (same arguments)."""

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
        rules = CachingAllocator(
            device,
            variant=variant,
            max_split_size=max_split_size,
            expandable_segments=expandable_segments,
            roundup_power2_divisions=roundup_power2_divisions,
            garbage_collection_threshold=garbage_collection_threshold,
            large_segment_size=large_segment_size,
            max_non_split_rounding_size=max_non_split_rounding_size,
            memory_fraction=memory_fraction,
            add_pad_size=add_pad_size,
            base_addr_aligned_kb=base_addr_aligned_kb,
            segment_size=segment_size,
            page_size_1g=page_size_1g,
            throw_on_npumalloc_oom=throw_on_npumalloc_oom,
        )
        reason = unsupported(
            device,
            max_split_size=rules.max_split_size,
            large_segment_size=rules.large_segment_size,
            max_non_split_rounding_size=rules.max_non_split_rounding_size,
            segment_size=rules.large_page_size,
        )
        if reason is not None:
            raise NotImplementedError(f"NativeCachingAllocator: {reason}")
        super().__init__(
            device,
            rules.name,
            lambda size: _odd_size(rules, size),
            rules.pad,
            rules._null_for_zero,
            rules.base_addr_aligned,
            rules.large_segment_size,
            rules.max_non_split_rounding_size,
            bool(rules.page_size_1g),
            rules.large_page_size,
            rules.max_split_size,
            bool(rules.expandable_segments),
            rules.roundup_power2_divisions,
            rules.garbage_collection_threshold,
            bool(rules.throw_on_npumalloc_oom),
            rules._rejection_limit,
        )
        self._rules = rules
        if rules.set_fraction:
            self._set_fraction(rules.allowed_memory_maximum, rules._gc_enabled)

    # ----------------------------------------------------------------- settings, as the model derived them
    pad = property(lambda self: self._rules.pad)
    base_addr_aligned = property(lambda self: self._rules.base_addr_aligned)
    large_segment_size = property(lambda self: self._rules.large_segment_size)
    max_non_split_rounding_size = property(lambda self: self._rules.max_non_split_rounding_size)
    page_size_1g = property(lambda self: self._rules.page_size_1g)
    large_page_size = property(lambda self: self._rules.large_page_size)
    max_split_size = property(lambda self: self._rules.max_split_size)
    expandable_segments = property(lambda self: self._rules.expandable_segments)
    roundup_power2_divisions = property(lambda self: self._rules.roundup_power2_divisions)
    garbage_collection_threshold = property(lambda self: self._rules.garbage_collection_threshold)
    throw_on_npumalloc_oom = property(lambda self: self._rules.throw_on_npumalloc_oom)

    def round_size(self, size: int) -> int:
        return self._rules.round_size(size)

    allocation_size = staticmethod(CachingAllocator.allocation_size)

    def segment_size(self, size: int) -> int:
        return self._rules.segment_size(size)

    expandable_reservation = CachingAllocator.expandable_reservation

    def set_memory_fraction(self, fraction: float) -> None:
        self._rules.set_memory_fraction(fraction)
        self._set_fraction(self._rules.allowed_memory_maximum, self._rules._gc_enabled)

    # ----------------------------------------------------------------- statistics, read by the model's code
    @property
    def _stats(self) -> dict[str, list[list[int]]]:
        cells = tuple(self._stat_cells())
        pools, fields = N_STAT_POOLS, N_STAT_FIELDS
        return {
            name: [[cells[(a * pools + pool) * fields + field] for field in range(fields)] for pool in range(pools)]
            for a, name in enumerate(STAT_ARRAYS)
        }

    @property
    def _oversize_allocations(self) -> list[int]:
        base = C_OVERSIZE_ALLOCATIONS
        return list(tuple(self._stat_cells())[base : base + N_STAT_FIELDS])

    @property
    def _oversize_segments(self) -> list[int]:
        base = C_OVERSIZE_SEGMENTS
        return list(tuple(self._stat_cells())[base : base + N_STAT_FIELDS])

    memory_stats = CachingAllocator.memory_stats

    # ----------------------------------------------------------------- introspection
    def _mapped_ranges(self):
        for small, expandable, stream, blocks in self._engine_ranges():
            yield SimpleNamespace(small=small, expandable=expandable, stream=stream), blocks

    snapshot_segments = CachingAllocator.snapshot_segments
    segment_layout = CachingAllocator.segment_layout

    def block_at(self, addr: int) -> SimpleNamespace:
        """The allocated or cached block at ``addr`` (its fields as the model's ``Block`` names them)."""
        info = self._block_info(addr) if isinstance(addr, int) else None
        if info is None:
            raise KeyError(addr)
        fields = ("addr", "size", "requested", "small", "allocated", "mapped", "stream")
        return SimpleNamespace(**dict(zip(fields, info)))

    # ----------------------------------------------------------------- trace replay: the Python model's
    def seed_segment(self, *args: Any, **kwargs: Any) -> None:
        _replay_only("seed_segment")

    def seed_segments(self, *args: Any, **kwargs: Any) -> None:
        _replay_only("seed_segments")

    def seed_expandable_segment(self, *args: Any, **kwargs: Any) -> None:
        _replay_only("seed_expandable_segment")

    def release_segment_at(self, *args: Any, **kwargs: Any) -> bool:
        _replay_only("release_segment_at")

    def unmap_range(self, *args: Any, **kwargs: Any) -> bool:
        _replay_only("unmap_range")
