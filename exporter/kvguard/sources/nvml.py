"""NVIDIA devices through NVML (nvidia-ml-py): total, used, free, reserved, per-process usage.

Device level only: NVML sees what each process holds (the allocator's reserved memory
plus the CUDA context), never the allocator's split. ``reserved`` is memory the driver
keeps for itself (``nvmlMemory_v2``; absent from older drivers, then None).
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

from kvguard.records import DeviceMemory, ProcessMemory
from kvguard.sources import SourceError, SourceUnavailable, count, free_total_used, one_line

# NVML return codes that mean "no NVIDIA driver here" rather than "a read failed".
_ABSENT_CODES = {9, 12}   # NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_LIBRARY_NOT_FOUND


def device_memory_from_nvml(index: int, memory: Any, processes: Iterable[Any] = ()) -> DeviceMemory:
    """NVML's memory struct (v1: total/free/used; v2 adds reserved) and process list as a record."""
    procs = []
    for proc in processes:
        pid = count(getattr(proc, "pid", None))
        used = count(getattr(proc, "usedGpuMemory", None))   # None where NVML cannot tell (WDDM, MIG)
        if pid is not None and used is not None:
            procs.append(ProcessMemory(pid=pid, used_bytes=used))
    fields = free_total_used(getattr(memory, "free", None), getattr(memory, "total", None),
                             getattr(memory, "used", None))
    return DeviceMemory(device=f"cuda:{index}", source="nvml", processes=tuple(procs),
                        device_reserved_bytes=count(getattr(memory, "reserved", None)), **fields)


class NvmlSource:
    """Every NVIDIA device NVML lists (NVML's index order)."""

    name = "nvml"

    def __init__(self, pynvml_module: Any = None):
        self._nvml = pynvml_module
        self._lock = threading.Lock()
        self._initialized = False

    def _init(self) -> Any:
        if self._nvml is None:
            try:
                import pynvml  # noqa: PLC0415 - imported only when this source is used
            except ImportError:
                raise SourceUnavailable("nvidia-ml-py is not installed (pip install 'kvguard[nvml]')") from None
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
                return [self._read(nvml, index) for index in range(nvml.nvmlDeviceGetCount())]
            except nvml.NVMLError as exc:
                raise SourceError(f"nvml: {one_line(exc)}") from None

    @staticmethod
    def _read(nvml: Any, index: int) -> DeviceMemory:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        version = getattr(nvml, "nvmlMemory_v2", None)
        try:
            memory = nvml.nvmlDeviceGetMemoryInfo(handle, version=version) if version else \
                nvml.nvmlDeviceGetMemoryInfo(handle)
        except nvml.NVMLError:
            # Drivers before r510 lack nvmlDeviceGetMemoryInfo_v2: fall back to v1 (no reserved).
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except nvml.NVMLError:
            processes = []   # not permitted in some containers: the device totals still count
        return device_memory_from_nvml(index, memory, processes)

    def close(self) -> None:
        with self._lock:
            if self._initialized:
                try:
                    self._nvml.nvmlShutdown()
                except Exception:  # noqa: BLE001
                    pass
                self._initialized = False
