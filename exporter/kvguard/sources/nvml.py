"""NVIDIA devices through NVML (nvidia-ml-py): total, used, free, reserved, per-process usage.

Device level only: NVML sees what each process holds (the allocator's reserved memory
plus the CUDA context), never the allocator's split. ``reserved`` is memory the driver
keeps for itself (``nvmlMemory_v2``; absent from older drivers, then None).

Identity: every record carries the device's UUID (``nvmlDeviceGetUUID``: ``GPU-…``, ``MIG-…``
for a MIG device) and PCI bus id (``nvmlDeviceGetPciInfo_v3().busId``, ``00000000:3B:00.0``),
the keys dcgm-exporter labels its series with (``UUID``, ``pci_bus_id``).

MIG (``mig=True``, ``kvguard serve --nvml-mig``): a GPU in MIG mode
(``nvmlDeviceGetMigMode`` current mode ``NVML_DEVICE_MIG_ENABLE``) is followed by one record
per MIG device (``nvmlDeviceGetMaxMigDeviceCount`` slots, ``nvmlDeviceGetMigDeviceHandleByIndex``;
an empty slot answers ``NVML_ERROR_NOT_FOUND``), labelled ``cuda:<gpu>/mig:<slot>`` with the MIG
device's own UUID and its parent's PCI bus id; another NVML error there ends that GPU's MIG list,
never the read. It is off by default: it costs one call per slot
(seven on an H100) per sample, on every GPU.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

from kvguard.records import DeviceMemory, ProcessMemory, identity_text
from kvguard.sources import SourceError, SourceUnavailable, count, free_total_used
from kvguard.text import install_hint, one_line

# NVML return codes that mean "no NVIDIA driver here" rather than "a read failed".
_ABSENT_CODES = {9, 12}  # NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_LIBRARY_NOT_FOUND
_NOT_FOUND = 6  # NVML_ERROR_NOT_FOUND: an empty MIG slot
_MIG_ENABLE = 1  # NVML_DEVICE_MIG_ENABLE
MAX_MIG_SLOTS = 64  # a bound on a hostile or broken library's slot count (H100/H200: 7)


def device_memory_from_nvml(
    index: int | str, memory: Any, processes: Iterable[Any] = (), *, uuid: Any = "", pci_bus_id: Any = ""
) -> DeviceMemory:
    """NVML's memory struct (v1: total/free/used; v2 adds reserved) and process list as a record.
    ``index`` is the GPU's NVML index (label ``cuda:N``) or a label of its own (a MIG device)."""
    procs = []
    for proc in processes:
        pid = count(getattr(proc, "pid", None))
        used = count(getattr(proc, "usedGpuMemory", None))  # None where NVML cannot tell (WDDM, MIG)
        if pid is not None and used is not None:
            procs.append(ProcessMemory(pid=pid, used_bytes=used))
    fields = free_total_used(
        getattr(memory, "free", None), getattr(memory, "total", None), getattr(memory, "used", None)
    )
    device = index if isinstance(index, str) else f"cuda:{index}"
    return DeviceMemory(
        device=device,
        source="nvml",
        processes=tuple(procs),
        device_reserved_bytes=count(getattr(memory, "reserved", None)),
        device_uuid=identity_text(uuid),
        pci_bus_id=identity_text(pci_bus_id),
        **fields,
    )


class NvmlSource:
    """Every NVIDIA device NVML lists (NVML's index order); with ``mig``, each GPU's MIG devices too."""

    name = "nvml"

    def __init__(self, pynvml_module: Any = None, mig: bool = False):
        if not isinstance(mig, bool):
            raise SourceError(f"nvml mig must be true or false, got {mig!r}")
        self._mig = mig
        self._nvml = pynvml_module
        self._lock = threading.Lock()
        self._initialized = False

    def _init(self) -> Any:
        if self._nvml is None:
            try:
                import pynvml  # noqa: PLC0415 - imported only when this source is used
            except ImportError:
                raise SourceUnavailable(f"nvidia-ml-py is not installed ({install_hint('nvml')})") from None
            self._nvml = pynvml
        if not self._initialized:
            try:
                self._nvml.nvmlInit()
            except self._nvml.NVMLError as exc:
                kind = SourceUnavailable if getattr(exc, "value", None) in _ABSENT_CODES else SourceError
                raise kind(f"nvml: {one_line(exc)}") from None
            self._initialized = True
        return self._nvml

    def sample(self) -> list[DeviceMemory]:
        with self._lock:
            nvml = self._init()
            try:
                records = []
                for index in range(nvml.nvmlDeviceGetCount()):
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                    record = self._read(nvml, handle, index)
                    records.append(record)
                    if self._mig:
                        records.extend(self._read_mig(nvml, handle, index, record.pci_bus_id))
                return records
            except nvml.NVMLError as exc:
                raise SourceError(f"nvml: {one_line(exc)}") from None

    @classmethod
    def _read(cls, nvml: Any, handle: Any, label: int | str, pci_bus_id: str | None = None) -> DeviceMemory:
        memory = cls._memory(nvml, handle)
        try:
            processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except nvml.NVMLError:
            processes = []  # not permitted in some containers: the device totals still count
        uuid = _optional(nvml, nvml.nvmlDeviceGetUUID, handle)
        if pci_bus_id is None:
            pci_bus_id = _bus_id(_optional(nvml, nvml.nvmlDeviceGetPciInfo_v3, handle))
        return device_memory_from_nvml(label, memory, processes, uuid=uuid or "", pci_bus_id=pci_bus_id)

    @classmethod
    def _read_mig(cls, nvml: Any, handle: Any, index: int, pci_bus_id: str) -> list[DeviceMemory]:
        """The MIG devices of one GPU, when it is in MIG mode (else none)."""
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError:
            return []  # NVML_ERROR_NOT_SUPPORTED: a GPU without MIG
        if current != _MIG_ENABLE:
            return []
        records: list[DeviceMemory] = []
        try:
            slots = min(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)), MAX_MIG_SLOTS)
            for slot in range(slots):
                try:
                    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                except nvml.NVMLError as exc:
                    if getattr(exc, "value", None) == _NOT_FOUND:
                        continue  # an empty slot
                    raise
                # The MIG device's own PCI info is its parent's: reuse the parent's bus id.
                records.append(cls._read(nvml, mig, f"cuda:{index}/mig:{slot}", pci_bus_id))
        except nvml.NVMLError:
            pass  # MIG devices are an extra: a failure there never costs the GPUs' own records
        return records

    @staticmethod
    def _memory(nvml: Any, handle: Any) -> Any:
        version = getattr(nvml, "nvmlMemory_v2", None)
        try:
            memory = (
                nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
                if version
                else nvml.nvmlDeviceGetMemoryInfo(handle)
            )
        except nvml.NVMLError:
            # Drivers before r510 lack nvmlDeviceGetMemoryInfo_v2: fall back to v1 (no reserved).
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        return memory

    def close(self) -> None:
        with self._lock:
            if self._initialized:
                try:
                    self._nvml.nvmlShutdown()
                except Exception:  # noqa: BLE001
                    pass
                self._initialized = False


def _optional(nvml: Any, call: Any, handle: Any) -> Any:
    """An identity call's answer; None where NVML does not support it (the memory still counts)."""
    try:
        return call(handle)
    except nvml.NVMLError:
        return None


def _bus_id(pci: Any) -> str:
    """``nvmlPciInfo_t.busId``; "" when absent or not text (nvidia-ml-py decodes the bytes as UTF-8
    on access and raises UnicodeDecodeError for anything else)."""
    try:
        return identity_text(getattr(pci, "busId", ""))
    except (UnicodeDecodeError, ValueError):
        return ""
