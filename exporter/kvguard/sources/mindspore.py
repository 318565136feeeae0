"""MindSpore's memory pool: ``mindspore.runtime.memory_stats()`` (2.5+), else ``mindspore.hal``.

Keys come from the C++ binding ``_memory_stats`` (pybind_api/hal/memory_py.cc). Some
releases misspell two of them (``total_allocatd_memory``, ``commom_mem_pool_stats``);
both spellings are read. :func:`device_memory_from_stats` is the one reader of those
keys: the simulator's counters go through it too.

MindSpore has no allocation-retry or OOM counter and no inactive-split figure; those
fields stay None. It does report idle memory (held by the pool, free for reuse) and
eager-free memory (idle buffers whose physical pages were unmapped under VMM). How much of the
idle memory the next request can reuse it cannot tell, with VMM or without (docs/explanation/guard.md):
under VMM a miss reclaims only the 2 MiB pages no used buffer touches, without VMM a request
larger than every idle buffer takes a new block. So the inactive split stays None under VMM
too (the guard then credits no idle memory), and the exact figures come only from the pool's
own lists (:class:`kvguard.records.PoolFigures`: kvguard.sources.mindspore_dump reads them from
MindSpore's dump, the simulator from its pool model), passed as ``figures``.

Release by release (kvguard.allocators.mindspore_releases): 2.4.x spell ``total_allocatd_memory``;
2.4 to 2.7 spell ``commom_mem_pool_stats``; 2.8+ ``common_mem_pool_stats``.

Peaks. ``max_allocated_memory`` / ``max_reserved_memory`` do not mean the same thing in
every build. In the 2.4-2.5 ``AbstractDynamicMemPool`` (``MemStat::temp_*``),
``max_allocated_memory`` is the peak *increase* of used memory since the last
``reset_peak_memory_stats`` (0 right after one; the absolute peak only before the first)
and ``max_reserved_memory`` is reserved memory now minus reserved at the reset; 2.6 and
later (``iter_used_peak_size_`` / ``iter_alloc_peak_size_``) report absolute peaks since the
reset. vLLM resets the peaks while it profiles, so the exported peaks are
``max(reported, current)``: never below what is allocated (reserved) now, exact on the
later builds, a lower bound on the earlier ones.

The pool dicts (``common_mem_pool_stats``, misspelled ``commom_mem_pool_stats`` up to 2.7;
``persistent_mem_pool_stats``)
are read by :func:`pool_blocks` for their ``block_counts`` and ``block_unit_size``;
their ``blocks_info`` keys are pointer capsules and are never read.

Identity: MindSpore exposes no device UUID or PCI address. ``hal.get_device_properties`` has
``name``, ``total_memory`` and ``free_memory`` on Ascend (plus compute-capability fields on GPU) in
2.10 (hal/device.py); MindSpore itself learns a chip's PCIe address by running ``npu-smi info -t board`` and
reading its ``PCIe Bus Info`` line (runtime/thread_bind_core.py ``_get_pcie_info``, 2.10). So
``device_uuid`` and ``pci_bus_id`` stay empty on MindSpore ranks; the npu-smi device source carries
the chip's Bus-Id.

Threads. ``_memory_stats`` (pybind_api/hal/memory_py.cc:64-106 @ r2.7.rc1; the same at v2.4.0) first runs
``runtime::Pipeline::Get().WaitAll()`` (:65), which releases the GIL and busy-waits until the runtime
pipeline's queues are empty (``while (!tasks_queue_->IsEmpty()) {}``, async_rqueue.cc:201-202), then
``MsException::CheckException()`` (:203), which clears and rethrows the pending asynchronous error of the
ops already queued (ms_exception.h:55-62; the same in the 2.8.0 and 2.10.0 headers). Called from any thread
but the engine's, it stalls that thread for the whole in-flight pipeline and *takes the engine's error*:
the engine's own next sync then returns data. So this source is ``engine_thread_only``: the probe samples
it on the engine's thread at a step boundary (kvguard.probe), and an error the call rethrows is handed
back to the engine unchanged (:class:`kvguard.sources.EngineError`). No Python API of 2.4-2.10 reads the
pool's counters without that wait.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from kvguard.allocators.mindspore_releases import VMM_PAGE_BYTES
from kvguard.records import DeviceMemory, PoolFigures, physical_reserved_bytes
from kvguard.sources import EngineError, SourceError, SourceUnavailable, count, free_total_used
from kvguard.text import one_line

log = logging.getLogger("kvguard.sources.mindspore")

# DeviceMemory field <- memory_stats keys, preferred spelling first.
STATS_KEYS: dict[str, tuple[str, ...]] = {
    "allocated_bytes": ("total_allocated_memory", "total_allocatd_memory"),
    "reserved_bytes": ("total_reserved_memory",),
    "peak_allocated_bytes": ("max_allocated_memory",),
    "peak_reserved_bytes": ("max_reserved_memory",),
    "idle_bytes": ("total_idle_memory",),
    "eager_free_bytes": ("total_eager_free_memory",),
}
# Pool name <- the pool dict's key, preferred spelling first.
POOL_KEYS: dict[str, tuple[str, ...]] = {
    "common": ("common_mem_pool_stats", "commom_mem_pool_stats"),
    "persistent": ("persistent_mem_pool_stats",),
}


@dataclass(frozen=True)
class PoolBlocks:
    """One pool's block count and unit (the size a new block is grown by); None when unreadable."""

    block_counts: int | None
    block_unit_size: int | None


# MindSpore's device_target -> the device prefix kvguard uses everywhere.
_DEVICE_PREFIX = {"Ascend": "npu", "GPU": "cuda", "CPU": "cpu"}


def is_mindspore_stats(stats: Mapping[str, Any]) -> bool:
    return any(key in stats for keys in (*STATS_KEYS.values(), *POOL_KEYS.values()) for key in keys)


def pool_blocks(stats: Mapping[str, Any]) -> dict[str, PoolBlocks]:
    """``{"common": PoolBlocks, "persistent": PoolBlocks}`` for the pools the dict has.

    Both spellings of the common pool's key are read; a pool entry that is not a dict, or
    counters that are not non-negative integers, read as None rather than raising.
    """
    pools = {}
    if not isinstance(stats, Mapping):
        return pools
    for pool, keys in POOL_KEYS.items():
        entry = _first(stats, keys)
        if entry is None:
            continue
        if not isinstance(entry, Mapping):
            pools[pool] = PoolBlocks(None, None)
            continue
        pools[pool] = PoolBlocks(count(entry.get("block_counts")), count(entry.get("block_unit_size")))
    return pools


def _first(stats: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if key in stats:
            return stats[key]
    return None


def device_memory_from_stats(
    stats: Mapping[str, Any],
    device: str,
    source: str = "mindspore",
    *,
    free_bytes: int | None = None,
    total_bytes: int | None = None,
    figures: PoolFigures | None = None,
) -> DeviceMemory:
    """A ``memory_stats()`` dict as a DeviceMemory; a key the dict lacks stays None. ``figures``: the
    pool's own lists read beside it (:func:`with_pool_figures`)."""
    if not isinstance(stats, Mapping):
        raise SourceError(f"memory_stats() returned {type(stats).__name__}, not a dict")
    values = {field: count(_first(stats, keys)) for field, keys in STATS_KEYS.items()}
    # Some builds report the peaks as increases since the last reset (module docstring): never
    # export a peak below the current figure.
    for peak, current in (("peak_allocated_bytes", "allocated_bytes"), ("peak_reserved_bytes", "reserved_bytes")):
        if values[peak] is not None and values[current] is not None:
            values[peak] = max(values[peak], values[current])
    # No inactive split, with VMM or without (module docstring): what a miss can reuse is in the pool's
    # lists, not in these counters.
    memory = DeviceMemory(device=device, source=source, **free_total_used(free_bytes, total_bytes), **values)
    return memory if figures is None else with_pool_figures(memory, figures)


def with_pool_figures(memory: DeviceMemory, figures: PoolFigures) -> DeviceMemory:
    """``memory`` with the exact figures of its pool: under VMM ``reclaimable_bytes``, the pool's physical
    reservation less the 2 MiB pages used buffers touch (eager free unmaps the rest into the handle cache,
    and a miss maps from that cache first: ``MmapDeviceMem``, ascend_vmm_adapter.cc:107-189 @ r2.7.rc1);
    without VMM ``largest_idle_bytes``. The reservation is the counters' (read with the figures or after).
    """
    if figures.vmm:
        held = physical_reserved_bytes(memory) if memory.reserved_bytes is not None else None
        values = {
            "reclaimable_bytes": None if held is None else max(0, held - figures.pages_touched_by_used * VMM_PAGE_BYTES)
        }
    else:
        values = {"largest_idle_bytes": figures.largest_idle_common_bytes}
    return replace(
        memory, **values, pool_figures_allocated_bytes=figures.used_bytes, pool_figures_at=figures.written_at
    )


def read_telling_engine_errors(read: Callable[[], Any], source: str = "mindspore") -> Any:
    """``read()``, a MindSpore memory call made on the engine's thread, telling the engine's error from the
    call's own failure.

    The call rethrows the pipeline's pending error once and clears it (``CheckException``, ms_exception.h:55-62
    @ r2.7.rc1), and on the engine's thread nothing new is queued while it runs: so a second call right after a
    failure succeeds when the first failure was the engine's pending error, and fails again when the call
    itself fails (a device not set up, an unsupported backend). The first: :class:`EngineError` (the original
    error, for the engine); the second: :class:`SourceError`, one line."""
    try:
        return read()
    except Exception as first:  # noqa: BLE001 - MindSpore raises RuntimeError/ValueError/IndexError alike
        try:
            read()
        except Exception as again:  # noqa: BLE001
            raise SourceError(f"{source}: {one_line(again)}") from None
        raise EngineError(first, source) from None


def device_label(device_target: str, device_id: int) -> str:
    prefix = _DEVICE_PREFIX.get(device_target, str(device_target).lower())
    return "cpu" if prefix == "cpu" else f"{prefix}:{device_id}"


class MindSporeSource:
    """The memory pool of this process's MindSpore device (``device_target``/``device_id`` context)."""

    name = "mindspore"
    # memory_stats() drains the runtime pipeline and rethrows the engine's pending error (module docstring).
    engine_thread_only = True

    def __init__(self, mindspore_module: Any = None):
        self._ms = mindspore_module
        self._skips_logged: set[str] = set()

    def _module(self) -> Any:
        if self._ms is None:
            try:
                import mindspore  # noqa: PLC0415 - imported only when this source is used
            except ImportError:
                raise SourceUnavailable("mindspore is not installed") from None
            except Exception as exc:  # noqa: BLE001 - a broken install must not raise its own type
                raise SourceUnavailable(f"mindspore failed to import: {one_line(exc)}") from None
            self._ms = mindspore
        return self._ms

    def sample(self) -> list[DeviceMemory]:
        ms = self._module()
        try:
            device_target = str(ms.get_context("device_target"))
            device_id = int(ms.get_context("device_id") or 0)
            stats = self._stats(ms, device_target)
            free, total = self._device_memory(ms, device_target, device_id)
        except SourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - MindSpore raises RuntimeError/ValueError alike
            raise SourceError(f"mindspore: {one_line(exc)}") from None
        return [
            device_memory_from_stats(
                stats, device_label(device_target, device_id), self.name, free_bytes=free, total_bytes=total
            )
        ]

    def complete(self, records: list[DeviceMemory]) -> list[DeviceMemory]:
        """The records with the pool's exact figures from its newest dump, where exact mode is on: file reading,
        which the probe runs on its own thread, never the engine's (kvguard.sources.complete_records)."""
        if self._ms is None:
            return records
        done = []
        for record in records:
            figures = self._dump_figures(self._ms, record.eager_free_bytes)
            done.append(record if figures is None else with_pool_figures(record, figures))
        return done

    @staticmethod
    def _stats(ms: Any, device_target: str) -> Mapping[str, Any]:
        runtime = getattr(ms, "runtime", None)
        reader = getattr(runtime, "memory_stats", None)
        args: tuple[Any, ...] = ()
        if not callable(reader):
            # hal.memory_stats (2.4+, deprecated) calls the same _memory_stats; it returns {} until the
            # backend has run something.
            reader = getattr(getattr(ms, "hal", None), "memory_stats", None)
            args = (device_target,)
        if not callable(reader):
            raise SourceUnavailable("this mindspore has neither runtime.memory_stats nor hal.memory_stats (need 2.3+)")
        return read_telling_engine_errors(lambda: reader(*args), "mindspore")

    @staticmethod
    def _device_memory(ms: Any, device_target: str, device_id: int) -> tuple[int | None, int | None]:
        """(free, total) where MindSpore tells them: Ascend device properties (2.3+)."""
        if device_target != "Ascend":
            return None, None
        getter = getattr(getattr(ms, "hal", None), "get_device_properties", None)
        if not callable(getter):
            return None, None
        try:
            properties = getter(device_id, device_target)
        except Exception:  # noqa: BLE001 - device totals are an extra; the pool counters still count
            return None, None
        total = count(getattr(properties, "total_memory", None))
        free = count(getattr(properties, "free_memory", None))
        # Before the device is initialised both read 0: unknown, not an empty device.
        return (free, total) if total else (None, None)

    # ------------------------------------------------------------------ exact mode (KVGUARD_MINDSPORE_DUMP)
    _dump_reader: Any = None

    def _dump_figures(self, ms: Any, eager_free: int | None) -> PoolFigures | None:
        """The pool's own lists from its newest MemoryDebugInfo dump (kvguard.sources.mindspore_dump), when
        ``KVGUARD_MINDSPORE_DUMP`` turned the dump on (the vLLM plugin merges it into ``MS_ALLOC_CONF`` at
        launch); None otherwise, or before the first dump. A file it cannot read is a counted skip
        (``dump_skipped``), never an error of the sample."""
        from kvguard.sources import mindspore_dump  # noqa: PLC0415 - only when exact mode is on

        try:
            if mindspore_dump.dump_every(os.environ.get(mindspore_dump.DUMP_ENV)) is None:
                return None
        except ValueError:
            return None
        reader = self._dump_reader
        if reader is None or reader.rank is None:
            rank = _distributed_rank(ms)
            if reader is None or rank is not None:
                folder = mindspore_dump.dump_directory(os.environ.get(mindspore_dump.ALLOC_CONF_ENV), os.getcwd(), rank)
                previous = reader
                reader = self._dump_reader = mindspore_dump.DumpReader(folder, rank=rank)
                if previous is not None:
                    reader.skipped.update(previous.skipped)
        reader.vmm = bool(eager_free)  # 2.7.0's file does not say; under VMM the unmapped space is eager-free
        figures = reader.read()
        for reason in set(reader.skipped) - self._skips_logged:
            self._skips_logged.add(reason)
            log.warning(
                "kvguard: MindSpore's pool dump skipped (%s): %s (counted in kvguard_probe_skipped_total; "
                "further %s skips are not logged)",
                reason,
                reader.last_error or reason,
                reason,
            )
        return figures

    @property
    def skipped_total(self) -> int:
        """Files beside the counters skipped so far (the pool's dumps that could not be read): the probe exports it."""
        return sum(self.dump_skipped.values())

    @property
    def dump_skipped(self) -> dict[str, int]:
        """Dump files skipped so far, by reason (kvguard.sources.mindspore_dump.SKIP_REASONS)."""
        return dict(self._dump_reader.skipped) if self._dump_reader is not None else {}


def _distributed_rank(ms: Any) -> int | None:
    """The job's global rank once MindSpore's communication is initialised (the pool then writes its dumps
    under ``rank_<id>/``), else None."""
    try:
        rank = ms.communication.get_rank()
    except Exception:  # noqa: BLE001 - not initialised (RuntimeError), or no communication module
        return None
    return rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else None
