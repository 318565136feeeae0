"""Records that travel between sources, the probe, the spool and the collector.

Every size is an int number of bytes; None means the backend cannot tell.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

# No device or counter comes near 2**63; anything larger in untrusted input is garbage, and
# Python's unbounded ints would otherwise overflow later float conversions.
MAX_COUNTER = (1 << 63) - 1

# Label values of vLLM's own series: a served model name (a Kubernetes name at most) and an engine index.
MAX_MODEL_NAME_CHARS = 253
MAX_ENGINE_CHARS = 16

# Fields of DeviceMemory that hold byte counts or event counts (all optional ints).
_INT_FIELDS = (
    "allocated_bytes",
    "reserved_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "idle_bytes",
    "eager_free_bytes",
    "alloc_retries",
    "ooms",
    "total_bytes",
    "free_bytes",
    "used_bytes",
    "device_reserved_bytes",
    "process_used_bytes",
    "reclaimable_bytes",
    "largest_idle_bytes",
    "pool_figures_allocated_bytes",
)
# Unix seconds beyond year ~5000 are garbage (as the spool's own timestamps).
_MAX_UNIX_SECONDS = 1e11

# Device identity (label values that join kvguard's series to dcgm-exporter's and npu-exporter's):
# at most this many characters, and only what UUIDs and PCI addresses are written with
# (NVML "GPU-8c6b…", "MIG-…", "00000000:3B:00.0"; npu-smi "0000:C1:00.0"). Anything else is
# dropped, so a hostile snapshot cannot make a label of arbitrary text; one value per device
# keeps the label's cardinality that of the device label itself.
IDENTITY_FIELDS = ("device_uuid", "pci_bus_id")
MAX_IDENTITY_CHARS = 96
_NOT_IDENTITY = re.compile(r"[^A-Za-z0-9:._-]")


def identity_text(value: Any) -> str:
    """A device UUID or PCI bus id as a label value: str or bytes in, "" for anything unusable."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str):
        return ""
    return _NOT_IDENTITY.sub("", value.strip()[: MAX_IDENTITY_CHARS * 2])[:MAX_IDENTITY_CHARS]


@dataclass(frozen=True)
class ProcessMemory:
    """What a device-level source sees one process hold (NVML, npu-smi): reserved plus overhead."""

    pid: int
    used_bytes: int
    name: str = ""


@dataclass(frozen=True)
class DeviceMemory:
    """One device as one source sees it.

    Allocator sources (mindspore, torch) fill the allocator fields; device-level sources
    (nvml, npu-smi) fill total/used/free and the process table. ``process_used_bytes`` is
    the serving process's own footprint where the source knows it (host RSS, NVML per-pid).
    """

    device: str
    source: str
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    active_bytes: int | None = None
    inactive_split_bytes: int | None = None
    idle_bytes: int | None = None
    eager_free_bytes: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    used_bytes: int | None = None
    device_reserved_bytes: int | None = None
    process_used_bytes: int | None = None
    processes: tuple[ProcessMemory, ...] = field(default_factory=tuple)
    # Which physical (or MIG) device this is, where the source can tell; "" when it cannot.
    device_uuid: str = ""
    pci_bus_id: str = ""
    # Exact figures of MindSpore's pool, where its buffer lists were read (kvguard.sources.mindspore_dump:
    # the pool's MemoryDebugInfo dump; the simulator's pool model). None: the counters alone, which cannot
    # tell them (docs/explanation/guard.md). ``reclaimable_bytes`` (VMM): reserved less the 2 MiB pages that
    # used buffers touch, what a miss can unmap and map again; ``largest_idle_bytes`` (no VMM): the common
    # pool's largest idle buffer, the largest request served without a new block.
    # ``pool_figures_allocated_bytes``: the used bytes the lists held, and ``pool_figures_at`` (unix
    # seconds): when the pool wrote them; the guard uses them only while the pool still holds exactly those
    # bytes (kvguard.guard.judge.pool_figures_fresh).
    reclaimable_bytes: int | None = None
    largest_idle_bytes: int | None = None
    pool_figures_allocated_bytes: int | None = None
    pool_figures_at: float | None = None

    @property
    def fragmentation_bytes(self) -> int | None:
        """Reserved but not allocated: what the allocator holds and the model cannot use."""
        if self.reserved_bytes is None or self.allocated_bytes is None:
            return None
        return max(0, self.reserved_bytes - self.allocated_bytes)

    @property
    def fragmentation_ratio(self) -> float | None:
        frag = self.fragmentation_bytes
        if frag is None or not self.reserved_bytes:
            return None if frag is None else 0.0
        return frag / self.reserved_bytes

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["processes"] = [asdict(p) for p in self.processes]
        return data

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any],
        max_processes: int = 1024,
        process_name: Callable[[str], str] = lambda name: name[:128],
    ) -> "DeviceMemory":
        """Strict decoding for untrusted input (spool files): raises ValueError with one line. The first
        ``max_processes`` process entries are kept (and checked), the rest ignored; ``process_name``
        cleans each entry's name as it is built."""
        if not isinstance(data, Mapping):
            raise ValueError("memory record is not an object")
        device = data.get("device")
        source = data.get("source")
        if not isinstance(device, (str, int)) or isinstance(device, bool) or str(device) == "":
            raise ValueError("memory record has no device")
        if not isinstance(source, str):
            raise ValueError("memory record has no source")
        values: dict[str, Any] = {"device": str(device)[:64], "source": source[:64]}
        for name in _INT_FIELDS:
            value = data.get(name)
            if value is None:
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or value != value
                or value in (float("inf"), float("-inf"))
            ):
                raise ValueError(f"memory field {name} is not a number")
            if value < 0:
                raise ValueError(f"memory field {name} is negative")
            if value > MAX_COUNTER:
                raise ValueError(f"memory field {name} is out of range")
            values[name] = int(value)
        processes = data.get("processes") or []
        if not isinstance(processes, list):
            raise ValueError("memory field processes is not a list")
        parsed = []
        for entry in processes[:max_processes]:
            if (
                not isinstance(entry, Mapping)
                or not isinstance(entry.get("pid"), int)
                or not isinstance(entry.get("used_bytes"), int)
                or isinstance(entry.get("pid"), bool)
                or not 0 <= entry["pid"] <= MAX_COUNTER
                or entry["used_bytes"] > MAX_COUNTER
            ):
                raise ValueError("memory field processes has a malformed entry")
            parsed.append(
                ProcessMemory(
                    pid=entry["pid"],
                    used_bytes=max(0, entry["used_bytes"]),
                    name=process_name(str(entry.get("name", ""))),
                )
            )
        values["processes"] = tuple(parsed)
        at = data.get("pool_figures_at")
        if at is not None:
            if isinstance(at, bool) or not isinstance(at, (int, float)) or not 0 <= at <= _MAX_UNIX_SECONDS:
                raise ValueError("memory field pool_figures_at is not a time in unix seconds")
            values["pool_figures_at"] = float(at)
        for name in IDENTITY_FIELDS:  # absent from older snapshots: "" then
            value = data.get(name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"memory field {name} is not a string")
            values[name] = identity_text(value or "")
        return cls(**values)


def physical_reserved_bytes(memory: DeviceMemory) -> int:
    """The allocator's reservation in device memory. MindSpore's VMM pool counts reserved address
    space in ``total_reserved_memory`` on some releases (2.4-2.5: ``MemStat::alloc_size_``) and
    mapped pages on later ones, and the unmapped address space in ``total_eager_free_memory``
    (kvguard.allocators.mindspore_pool). A reservation larger than the memory the device has in use cannot
    be memory: then only reserved − eager-free is."""
    reserved = memory.reserved_bytes
    used = memory.process_used_bytes if memory.process_used_bytes is not None else memory.used_bytes
    if not memory.eager_free_bytes or used is None or reserved <= used:
        return reserved
    return max(0, min(used, reserved - memory.eager_free_bytes))


@dataclass(frozen=True)
class PoolFigures:
    """MindSpore's pool as its own buffer lists show it (its ``MemoryDebugInfo`` dump, or the simulator's
    pool model): what ``memory_stats()`` cannot tell (docs/explanation/guard.md).

    ``used_bytes``: the used buffers' bytes, both pools; ``pages_touched_by_used``: the distinct 2 MiB pages
    those buffers touch (VMM: what stays mapped when the pool eager-frees everything idle);
    ``largest_idle_common_bytes``: the largest idle buffer of the common pool's stream 0 (activations and
    the KV cache); ``vmm``: the pool runs on VMM; ``written_at``: unix seconds the pool wrote them."""

    vmm: bool
    used_bytes: int
    pages_touched_by_used: int
    largest_idle_common_bytes: int
    written_at: float | None = None


@dataclass(frozen=True)
class KVCacheAllocation:
    """The KV cache the serving engine actually allocated on this rank."""

    num_blocks: int
    block_bytes: int
    block_size: int
    # vLLM 0.34's extensible KV cache maps its pages with the CUDA driver, outside torch's
    # caching allocator: they show in the device's used memory, not in reserved.
    outside_allocator: bool = False

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


@dataclass(frozen=True)
class ReservedPeak:
    """The profile run's reserved peak by the allocator's own peak statistic, beside the figure the engine
    measured (vllm-mindspore only).

    vllm-mindspore measures ``memory_reserved()`` at the profile run's *end*, before its ``empty_cache``
    (``after_profile.measure()``, vllm_mindspore/utils.py:465-475 @ 0.5.1): ``measured_increase_bytes``,
    the profile's reserved increase. When the pool releases cached blocks during the run, the reserved
    memory it reached is more. ``peak_increase_bytes``: ``mindspore.runtime.max_memory_reserved()``
    (mindspore/runtime/memory.py:170 @ 2.7.1) after ``reset_peak_memory_stats()`` (:214) at the run's
    start, less ``memory_reserved()`` then (:142); None when it could not be read, ``error`` saying why.
    """

    measured_increase_bytes: int | None
    peak_increase_bytes: int | None
    error: str | None = None

    @property
    def above_measured(self) -> bool:
        """The peak was read and is above what the engine measured: the pool released blocks mid-run."""
        return self.peak_increase_bytes is not None and (
            self.measured_increase_bytes is None or self.peak_increase_bytes > self.measured_increase_bytes
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "ReservedPeak":
        """Strict decoding for untrusted input (spool files): ValueError with one line."""
        if not isinstance(data, Mapping):
            raise ValueError("reserved_peak is not an object")
        values: dict[str, Any] = {}
        for name in ("measured_increase_bytes", "peak_increase_bytes"):
            value = data.get(name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNTER
            ):
                raise ValueError(f"reserved_peak field {name} is not a non-negative integer in range")
            values[name] = value
        error = data.get("error")
        if error is not None and not isinstance(error, str):
            raise ValueError("reserved_peak field error is not a string")
        return cls(**values, error=error)
