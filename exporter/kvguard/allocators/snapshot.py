"""Exact replay of a PyTorch ``_dump_snapshot`` pickle on the caching-allocator model.

A snapshot (``torch.cuda.memory._record_memory_history()`` then
``torch.cuda.memory._dump_snapshot(path)``) holds, per device, the allocator's trace
(``device_traces[D]``) and its state when the snapshot was taken (``segments``, with
their blocks), plus ``allocator_settings``. The replay:

1. **Seeds** each device's allocator with the state in which recording began, rebuilt
   by undoing the trace from the end state: a segment is there at the start unless the
   trace allocated it (``segment_alloc``), plus every segment the trace frees without
   having allocated it; a block is allocated at the start if it is allocated at the end
   and the trace did not allocate it, or if the trace frees it without having allocated
   it (a *pre-existing free*).
   A pre-existing free carries only the requested size. Its block size is inferred as
   the request rounded as the allocator rounds it, extended over the gap to the next
   start-allocated block (or the segment's end) when that gap is too small to have been
   split off (``should_split``: large pool, gap of 1 MiB or less; the small pool and
   expandable segments split any 512-byte remainder, so their gaps are never extended).
   Every large-pool block is larger than 1 MiB, so such a gap cannot be a block of its
   own. Both counts are reported (``preexisting_frees``, ``preexisting_extended``).
   An expandable segment is seeded with the pages mapped at the start: the recorded mapped
   ranges with the trace's ``segment_map`` entries undone and its ``segment_unmap`` entries
   restored (``_expandable_at_start``); with none, the start's mapping is the end's.
   A dump taken without recording (an empty device trace) is its own start state: nothing
   is replayed (0 events, ``history_recorded`` False) and the end state is rebuilt and compared.
   ``_dump_snapshot`` pickles ``_snapshot()`` (torch/cuda/memory.py:893-904 at v2.6.0), which
   holds one trace per device allocator (c10/cuda/CUDACachingAllocator.cpp:3552-3553 at
   v2.6.0), filled only while history is recorded (``record_trace``, :3237-3238; turning
   recording off clears it, ``recordHistory``, :1127-1129).
2. **Honours** ``allocator_settings``: ``expandable_segments``, ``max_split_size``,
   ``roundup_power2_divisions``, ``garbage_collection_threshold`` (which acts only with
   a memory fraction, which a snapshot does not record, so it stays inactive).
3. **Replays** every device's trace in order: ``alloc`` through the model's own rules
   (compared with the recorded address), frees at ``free_completed`` (or
   ``free_requested`` for a trace without them), new segment addresses taken from the
   ``segment_alloc`` / ``segment_map`` entries that precede an allocation, releases
   (``segment_free``, ``segment_unmap``) applied as recorded (they follow
   ``empty_cache`` calls, the device's free memory and garbage collection, none of which
   a trace records) and checked to be possible in the model, and ``oom`` entries checked
   to be requests the model cannot serve from its cache.
4. **Compares** each device's end state with the snapshot's own segments.

Knows nothing of files: ``kvguard.allocators.traces`` reads the pickle.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from kvguard.allocators.base import AllocatorOutOfMemory
from kvguard.allocators.device import Device
from kvguard.allocators.torch_alloc import K_SMALL_BUFFER, K_SMALL_SIZE, CachingAllocator
from kvguard.text import one_line

_ALLOC, _FREE, _SEG_ALLOC, _SEG_FREE, _MAP, _UNMAP, _OOM = range(7)
_ACTIONS = {
    "alloc": _ALLOC,
    "segment_alloc": _SEG_ALLOC,
    "segment_free": _SEG_FREE,
    "segment_map": _MAP,
    "segment_unmap": _UNMAP,
    "oom": _OOM,
}
# Effectively unlimited physical memory: the trace, not the model, says when memory ran out.
_UNLIMITED_DEVICE = 1 << 56


class SnapshotError(ValueError):
    """A snapshot whose content cannot be replayed; message is one line."""


@dataclass(frozen=True)
class DeviceReplay:
    """One device's replay: agreement counts and the end state, in bytes."""

    device: int
    history_recorded: bool  # False: the device's trace is empty (recorded without history)
    events: int
    allocs: int
    allocs_matched: int
    first_mismatch_index: int | None
    frees: int
    frees_skipped: int  # frees of blocks the seed could not place
    seeded_segments: int
    seeded_blocks: int
    preexisting_frees: int
    preexisting_extended: int
    segment_allocs: int
    segment_allocs_matched: int
    segment_frees: int
    segment_frees_matched: int
    maps: int
    maps_matched: int
    unmaps: int
    unmaps_matched: int
    ooms: int
    ooms_matched: int
    end_state_matches: bool
    end_state_detail: str
    reserved_bytes: int
    allocated_bytes: int
    inactive_split_bytes: int
    segment_bytes: tuple[int, ...]
    memory_stats: dict[str, Any] = field(repr=False, default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "memory_stats"}
        out["segment_bytes"] = list(self.segment_bytes)
        return out


@dataclass(frozen=True)
class Settings:
    expandable_segments: bool = False
    max_split_size: int | None = None
    roundup_power2_divisions: Any = None
    garbage_collection_threshold: float = 0.0


def settings_of(snapshot: dict[str, Any]) -> Settings:
    raw = snapshot.get("allocator_settings")
    if raw is None:
        return Settings()
    if not isinstance(raw, dict):
        raise SnapshotError("snapshot allocator_settings is not a dict")
    max_split = raw.get("max_split_size", -1)
    if not isinstance(max_split, int) or isinstance(max_split, bool):
        raise SnapshotError(f"snapshot allocator_settings.max_split_size is not an integer: {max_split!r}")
    gc = raw.get("garbage_collection_threshold", 0.0) or 0.0
    if not isinstance(gc, (int, float)) or isinstance(gc, bool):
        raise SnapshotError(f"snapshot allocator_settings.garbage_collection_threshold is not a number: {gc!r}")
    return Settings(
        expandable_segments=bool(raw.get("expandable_segments", False)),
        max_split_size=None if max_split < 0 or max_split >= (1 << 63) - 1 else max_split,
        roundup_power2_divisions=raw.get("roundup_power2_divisions"),
        garbage_collection_threshold=float(gc),
    )


@dataclass
class _Trace:
    """A device trace's replayed entries, and what the seed needs to know of them (one pass)."""

    entries: list[tuple[int, int, int, int, int]]  # (position, action code, addr, size, stream)
    allocs: int = 0
    frees: int = 0
    live: set[int] = field(default_factory=set)  # allocated in the trace, not freed in it
    preexisting: dict[int, tuple[int, int]] = field(default_factory=dict)  # addr -> (requested, free position)
    live_segments: set[int] = field(default_factory=set)
    freed_segments: dict[int, tuple[int, int]] = field(default_factory=dict)  # base -> (size, stream)
    page_events: list[tuple[int, int, int]] = field(default_factory=list)  # (_MAP or _UNMAP, addr, size)


def _entries(trace: list[dict[str, Any]], device: int) -> _Trace:
    """Read and check a device trace's replayed entries, and note what the seed needs."""
    actions = dict(_ACTIONS)
    free_name = "free_requested"
    for entry in trace:
        if type(entry) is dict and entry.get("action") == "free_completed":
            free_name = "free_completed"
            break
    actions[free_name] = _FREE
    actions_get = actions.get
    out: list[tuple[int, int, int, int, int]] = []
    append = out.append
    scan = _Trace(out)
    live, preexisting = scan.live, scan.preexisting
    live_add, live_remove = live.add, live.remove
    allocs = frees = 0
    for index, entry in enumerate(trace):
        if type(entry) is not dict:
            raise SnapshotError(f"snapshot device_traces[{device}][{index}] is not a dict")
        try:
            code = actions_get(entry["action"])
        except (KeyError, TypeError):  # no action, or an unhashable one: not a replayed entry
            continue
        if code is None:
            continue
        try:
            addr = entry["addr"]
            size = entry["size"]
            stream = entry["stream"] or 0
        except KeyError:
            addr, size, stream = entry.get("addr"), entry.get("size"), entry.get("stream") or 0
        if code == _OOM:
            addr = 0
        if not (int is type(addr) is type(size) is type(stream)) or (addr | size | stream) < 0 or (addr | size) >> 64:
            if int is type(addr) is type(size) is type(stream) and (addr | size | stream) >= 0:
                raise SnapshotError(
                    f"snapshot device_traces[{device}][{index}] ({entry.get('action')}): "
                    f"addr and size must be below 2**64, got {addr!r}, {size!r}"[:200]
                )
            raise SnapshotError(
                f"snapshot device_traces[{device}][{index}] ({entry.get('action')}): "
                f"addr, size and stream must be non-negative integers, got "
                f"{addr!r}, {size!r}, {stream!r}"[:200]
            )
        append((index, code, addr, size, stream))
        if code == _ALLOC:
            allocs += 1
            live_add(addr)
        elif code == _FREE:
            frees += 1
            try:
                live_remove(addr)
            except KeyError:
                if addr not in preexisting:
                    preexisting[addr] = (size, index)
        elif code == _SEG_ALLOC:
            scan.live_segments.add(addr)
        elif code == _SEG_FREE:
            if addr in scan.live_segments:
                scan.live_segments.discard(addr)
            else:
                scan.freed_segments.setdefault(addr, (size, stream))
        elif code == _MAP or code == _UNMAP:
            scan.page_events.append((code, addr, size))
    scan.allocs, scan.frees = allocs, frees
    return scan


# A recorded segment: (address, total_size, small, stream, expandable,
# [(block address, size, allocated, requested), ...]), block addresses filled in when absent.
_EndSegment = tuple[int, int, bool, int, bool, list[tuple[int, int, bool, int]]]


def _end_segments(snapshot: dict[str, Any], device: int) -> list[_EndSegment]:
    segments = snapshot.get("segments") or []
    if not isinstance(segments, list):
        raise SnapshotError("snapshot segments is not a list")
    out = []
    for index, segment in enumerate(segments):
        if type(segment) is not dict and not isinstance(segment, dict):
            raise SnapshotError(f"snapshot segments[{index}] is not a segment dict")
        blocks = segment.get("blocks", [])
        if type(blocks) is not list and not isinstance(blocks, list):
            raise SnapshotError(f"snapshot segments[{index}] is not a segment dict")
        if segment.get("device", 0) != device:
            continue
        for name in ("address", "total_size"):
            value = segment.get(name)
            if type(value) is not int and (not isinstance(value, int) or isinstance(value, bool)):
                raise SnapshotError(f"snapshot segments[{index}].{name} is not an integer")
        addr = segment["address"]
        block_list: list[tuple[int, int, bool, int]] = []
        append = block_list.append
        for block in blocks:
            if type(block) is not dict and not isinstance(block, dict):
                raise SnapshotError(f"snapshot segments[{index}] has a block without an integer size")
            try:  # the keys _dump_snapshot writes; any missing one takes the slower path
                size, addr, state, requested = block["size"], block["address"], block["state"], block["requested_size"]
            except KeyError:
                size, addr, state = block.get("size"), block.get("address", addr), block.get("state")
                requested = block.get("requested_size", 0)
            if (
                type(size) is not int
                and not isinstance(size, int)
                or type(addr) is not int
                and not isinstance(addr, int)
            ):
                raise SnapshotError(f"snapshot segments[{index}] has a block without an integer size")
            requested = requested or 0
            if type(requested) is not int and not isinstance(requested, int):
                raise SnapshotError(f"snapshot segments[{index}] has a block whose requested_size is not an integer")
            append((addr, size, state != "inactive", requested))
            addr += size
        stream = segment.get("stream") or 0
        if type(stream) is not int or stream < 0:
            raise SnapshotError(f"snapshot segments[{index}].stream is not a non-negative integer")
        out.append(
            (
                segment["address"],
                segment["total_size"],
                segment.get("segment_type") == "small",
                stream,
                bool(segment.get("is_expandable")),
                block_list,
            )
        )
    return out


def replay_device(
    snapshot: dict[str, Any],
    device: int,
    *,
    address_space_bytes: int,
    log: Callable[[int, int, int, int], None] | None = None,
) -> DeviceReplay:
    traces = snapshot.get("device_traces")
    trace = traces[device] if isinstance(traces, list) and device < len(traces) else []
    if not isinstance(trace, list):
        raise SnapshotError(f"snapshot device_traces[{device}] is not a list")
    scan = _entries(trace, device)
    entries = scan.entries
    settings = settings_of(snapshot)
    try:
        model = CachingAllocator(
            Device(_UNLIMITED_DEVICE),
            max_split_size=settings.max_split_size,
            expandable_segments=settings.expandable_segments,
            roundup_power2_divisions=settings.roundup_power2_divisions,
            garbage_collection_threshold=settings.garbage_collection_threshold,
        )
    except ValueError as exc:
        raise SnapshotError(f"snapshot allocator_settings: {one_line(exc)}") from None
    model.address_space_total = address_space_bytes
    end = _end_segments(snapshot, device)
    seed = _seed(model, scan, end)

    pending_segments: deque[tuple[int, int]] = deque()
    pending_maps: list[tuple[int, int]] = []
    model_maps: list[tuple[int, int]] = []
    used_segments: list[tuple[int, int]] = []

    def segment_address(size: int, small: bool) -> int | None:
        if pending_segments:
            addr, recorded = pending_segments.popleft()
            used_segments.append((addr, int(recorded == size)))
            return addr
        # A new expandable segment starts at the first page the allocation maps: one allocation
        # maps pages of one segment only (``try_allocate_expandable_block`` has one candidate).
        return pending_maps[0][0] if pending_maps else None

    model.segment_address = segment_address
    model.on_map = lambda addr, size: model_maps.append((addr, size))
    addr_map: dict[int, int] = {addr: addr for addr in model._active}
    matched = frees_skipped = seg_allocs = seg_allocs_matched = seg_frees = seg_frees_matched = 0
    maps = maps_matched = unmaps = unmaps_matched = ooms = ooms_matched = 0
    first_mismatch = None
    malloc, free, active = model.malloc, model.free, model._active
    pop = addr_map.pop
    # After an allocation, the segment and map entries before it are settled. Only a log, an
    # expandable model (which maps pages itself) or such an entry makes that work necessary.
    always = log is not None or model.expandable_segments
    settle = always
    for position, code, addr, size, stream in entries:
        if code == _ALLOC:
            try:
                got = malloc(size, False, stream)
            except AllocatorOutOfMemory:
                # The model's device is effectively unlimited (2**56 bytes): only a request no
                # real device could have served gets here.
                raise SnapshotError(
                    f"snapshot device_traces[{device}][{position}] (alloc): {size} bytes cannot be served on any device"
                ) from None
            if got == addr:
                matched += 1
            elif first_mismatch is None:
                first_mismatch = position
            addr_map[addr] = got
            if settle:
                if log is not None:
                    log(device, position, got, size)
                if used_segments:
                    seg_allocs_matched += sum(ok for _, ok in used_segments)
                    used_segments.clear()
                pending_segments.clear()
                if pending_maps:
                    maps_matched += sum(1 for m in pending_maps if m in model_maps)
                    pending_maps.clear()
                model_maps.clear()
                settle = always
        elif code == _FREE:
            target = pop(addr, None)
            if target in active:
                free(target)
            else:
                frees_skipped += 1
        elif code == _SEG_ALLOC:
            seg_allocs += 1
            pending_segments.append((addr, size))
            settle = True
        elif code == _SEG_FREE:
            seg_frees += 1
            seg_frees_matched += model.release_segment_at(addr)
        elif code == _MAP:
            maps += 1
            pending_maps.append((addr, size))
            settle = True
        elif code == _UNMAP:
            unmaps += 1
            unmaps_matched += model.unmap_range(addr, size)
        else:  # _OOM: the size is the rounded request (``malloc``'s TraceEntry::OOM uses params.size())
            ooms += 1
            ooms_matched += not model.fits_in_cache(size, stream)
    modelled = model.segment_layout()
    matches, detail = _compare_end_state(modelled, end)
    if not trace:
        detail += "; no history recorded: 0 events replayed, the end state is the start state"
    stats = model.memory_stats()
    return DeviceReplay(
        device=device,
        history_recorded=bool(trace),
        events=len(entries),
        allocs=scan.allocs,
        allocs_matched=matched,
        first_mismatch_index=first_mismatch,
        frees=scan.frees,
        frees_skipped=frees_skipped,
        seeded_segments=seed[0],
        seeded_blocks=seed[1],
        preexisting_frees=seed[2],
        preexisting_extended=seed[3],
        segment_allocs=seg_allocs,
        segment_allocs_matched=seg_allocs_matched,
        segment_frees=seg_frees,
        segment_frees_matched=seg_frees_matched,
        maps=maps,
        maps_matched=maps_matched,
        unmaps=unmaps,
        unmaps_matched=unmaps_matched,
        ooms=ooms,
        ooms_matched=ooms_matched,
        end_state_matches=matches,
        end_state_detail=detail,
        reserved_bytes=stats["reserved_bytes.all.current"],
        allocated_bytes=stats["allocated_bytes.all.current"],
        inactive_split_bytes=stats["inactive_split_bytes.all.current"],
        segment_bytes=tuple(sorted(total for _, total, _ in modelled)),
        memory_stats=stats,
    )


def _seed(model: CachingAllocator, scan: _Trace, end: list[_EndSegment]) -> tuple[int, int, int, int]:
    """Give ``model`` the state in which recording began; (segments, blocks, pre-existing frees, extended)."""
    live, preexisting = scan.live, scan.preexisting
    # Start segments, and each expandable segment's ranges mapped at the start: (base, size, small, stream,
    # [(addr, size, requested)] of blocks allocated at the start).
    start: dict[int, list[Any]] = {}
    premapped_blocks: list[tuple[int, int, int]] = []
    for base, total, small, stream, expandable, block_list in end:
        if expandable:
            premapped_blocks += [(a, s, r) for a, s, allocated, r in block_list if allocated and a not in live]
            continue
        if base in scan.live_segments:
            continue
        blocks = [(a, s, r) for a, s, allocated, r in block_list if allocated and a not in live]
        start[base] = [base, total, small, stream, blocks]
    for base, (size, stream) in scan.freed_segments.items():
        start.setdefault(base, [base, size, size == K_SMALL_BUFFER, stream, []])
    reservations = _expandable_at_start(model, scan, end)
    in_reservation: set[int] = set()
    for _, _, small, stream, ranges in reservations:
        for low, high in ranges:
            start[low] = [low, high - low, small, stream, []]
            in_reservation.add(low)
    if premapped_blocks:
        lows = sorted(in_reservation)
        for addr, size, requested in premapped_blocks:
            index = bisect_right(lows, addr) - 1
            if index < 0 or addr + size > lows[index] + start[lows[index]][1]:
                raise SnapshotError(
                    f"snapshot segments: the block at {addr:#x}, allocated before recording began, "
                    f"lies in expandable-segment pages that the trace maps"
                )
            start[lows[index]][4].append((addr, size, requested))
    bases = sorted(start)
    extended = 0
    by_segment: dict[int, list[tuple[int, int, int]]] = {}
    for addr, (requested, freed_at) in preexisting.items():
        index = bisect_right(bases, addr) - 1
        if index < 0:
            continue
        base = bases[index]
        if addr >= base + start[base][1]:
            continue
        by_segment.setdefault(base, []).append((addr, requested, freed_at))
    first_alloc: dict[int, int] = {}  # addr -> position of the trace's first allocation there
    allocated: list[int] | None = None  # those addresses sorted; both built when first needed
    for base, frees in by_segment.items():
        _, size, small, _, blocks = start[base]
        starts = sorted([a for a, _, _ in blocks] + [a for a, _, _ in frees])
        for addr, requested, freed_at in frees:
            block = model.round_size(requested)
            following = starts[bisect_right(starts, addr)] if bisect_right(starts, addr) < len(starts) else base + size
            if not small and not model.expandable_segments:
                # An allocation the trace places within 1 MiB past the rounded end while this block
                # is still allocated starts the next block: this block ends there. (The trace's
                # first allocation at an address is its earliest.)
                if allocated is None:
                    for position, code, allocated_addr, _, _ in scan.entries:
                        if code == _ALLOC and allocated_addr not in first_alloc:
                            first_alloc[allocated_addr] = position
                    allocated = sorted(first_alloc)
                index = bisect_left(allocated, addr + block)
                limit = min(addr + block + K_SMALL_SIZE, following)
                while index < len(allocated) and allocated[index] <= limit:
                    if first_alloc[allocated[index]] < freed_at:
                        following = allocated[index]
                        break
                    index += 1
            gap = following - (addr + block)
            if gap < 0 or (not small and not model.expandable_segments and 0 < gap <= K_SMALL_SIZE):
                block = following - addr
                extended += 1
            blocks.append((addr, block, requested))
    plain = [start[base] for base in bases if base not in in_reservation]
    try:
        model.seed_segments((base, size, small, blocks, stream) for base, size, small, stream, blocks in plain)
        for base, size, small, stream, ranges in reservations:
            model.seed_expandable_segment(
                base, size, small, ranges, [block for low, _ in ranges for block in start[low][4]], stream
            )
    except ValueError as exc:
        raise SnapshotError(f"snapshot segments: {one_line(exc)}") from None
    seeded_blocks = sum(len(start[base][4]) for base in bases)
    return len(plain) + len(reservations), seeded_blocks, len(preexisting), extended


def _expandable_at_start(
    model: CachingAllocator, scan: _Trace, end: list[_EndSegment]
) -> list[tuple[int, int, bool, int, list[tuple[int, int]]]]:
    """The expandable segments that had pages mapped when recording began, rebuilt from the end state:
    (reservation base, reservation size, small, stream, [(start, end) of each range mapped then]).

    Rules, c10/cuda/CUDACachingAllocator.cpp at v2.6.0 (the same code as at 001074d2):

    - a snapshot reports one segment per contiguous mapped range of an expandable segment
      (``snapshot``, :1969-1971 and :1989), so the recorded ranges of one pool and stream with no
      other segment between them are one reservation: ``find_expandable_block`` (:2239) grows the
      pool's and stream's existing reservation, lowest unmapped address first (:2258), and makes
      a new one only when none has room;
    - every page mapped or unmapped is a trace entry while history is on: ``map_block`` records
      SEGMENT_MAP (:2349-2350), ``unmap_block`` SEGMENT_UNMAP (:3037-3038), ``record_trace``
      (:3237). So the pages mapped at the start are the end state's with the trace's maps undone
      and its unmaps restored, latest first; with no such entry, the start's mapping is the end's;
    - a reservation is 1 1/8 of the GPU's memory in whole pages (``ExpandableSegment``, :376;
      ``find_expandable_block``, :2278). It starts at the lowest address known to be in it and is
      cut at the next recorded segment, since reservations do not overlap.
    """
    groups: list[list[Any]] = []  # [small, stream, [(start, end)], low, high]
    current: list[Any] | None = None
    previous_end = 0
    for base, total, small, stream, expandable, _ in sorted(end, key=lambda segment: segment[0]):
        if expandable and current is not None and (current[0], current[1]) == (small, stream):
            current[2].append((base, base + total))
        else:
            if current is not None:
                current[4] = base
            current = [small, stream, [(base, base + total)], previous_end, 1 << 64] if expandable else None
            if current is not None:
                groups.append(current)
        previous_end = base + total
    out = []
    for small, stream, ranges, low, high in groups:
        page, reservation = model.expandable_reservation(small)
        pages = {addr for start, stop in ranges for addr in range(start, stop, page)}
        known_low, known_high = ranges[0][0], ranges[-1][1]
        for code, addr, size in reversed(scan.page_events):
            if not low <= addr < high:
                continue
            known_low, known_high = min(known_low, addr), max(known_high, addr + size)
            if code == _MAP:
                pages.difference_update(range(addr, addr + size, page))
            else:
                pages.update(range(addr, addr + size, page))
        if not pages:
            continue  # mapped while recording: the trace's maps place it
        mapped: list[tuple[int, int]] = []
        for addr in sorted(pages):
            if mapped and mapped[-1][1] == addr:
                mapped[-1] = (mapped[-1][0], addr + page)
            else:
                mapped.append((addr, addr + page))
        base = min(known_low, mapped[0][0])
        size = max(min(reservation, high - base), max(known_high, mapped[-1][1]) - base)
        out.append((base, size, small, stream, mapped))
    return out


def _compare_end_state(
    modelled: list[tuple[int, int, tuple[tuple[int, int, bool], ...]]], end: list[_EndSegment]
) -> tuple[bool, str]:
    """Compare ``CachingAllocator.segment_layout()`` with the snapshot's segments."""
    want = sorted(
        (base, total, tuple((a, z, allocated) for a, z, allocated, _ in block_list))
        for base, total, _, _, _, block_list in end
    )
    got = modelled
    if want == got:
        return True, f"{len(got)} segments equal"
    want_set, got_set = set(want), set(got)
    return False, (
        f"{len(want_set & got_set)} of {len(want)} recorded segments equal; "
        f"{len(got_set - want_set)} modelled segments differ"
    )


def replay_snapshot(
    snapshot: dict[str, Any], *, address_space_bytes: int, log: Callable[[int, int, int, int], None] | None = None
) -> list[DeviceReplay]:
    """Replay every device that has a trace or segments."""
    traces = snapshot.get("device_traces")
    if not isinstance(traces, list):
        raise SnapshotError("snapshot has no device_traces list")
    devices = {d for d, t in enumerate(traces) if t}
    devices |= {s.get("device", 0) for s in snapshot.get("segments") or [] if isinstance(s, dict)}
    return [replay_device(snapshot, d, address_space_bytes=address_space_bytes, log=log) for d in sorted(devices)]
