"""NVML: the real nvidia-ml-py structs and errors; a device-less stand-in for the library calls."""

from __future__ import annotations

import types

import pytest

pynvml = pytest.importorskip("pynvml")

from kvguard.sources import SourceError, SourceUnavailable  # noqa: E402
from kvguard.sources.nvml import NvmlSource, device_memory_from_nvml  # noqa: E402

GIB = 1 << 30


def memory_v2(total, reserved, free, used):
    struct = pynvml.c_nvmlMemory_v2_t()
    struct.version, struct.total, struct.reserved, struct.free, struct.used = \
        pynvml.nvmlMemory_v2, total, reserved, free, used
    return struct


def process(pid, used):
    struct = pynvml.c_nvmlProcessInfo_t()
    struct.pid, struct.usedGpuMemory = pid, used
    return pynvml.nvmlStructToFriendlyObject(struct)


class FakeNvml(types.SimpleNamespace):
    """The pynvml calls NvmlSource makes, answering from the real structs; errors are real NVMLError."""

    NVMLError = pynvml.NVMLError
    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def __init__(self, devices, init_error=None, v2=True, processes_error=None):
        super().__init__(devices=devices, init_error=init_error, v2=v2, processes_error=processes_error,
                         inits=0, shutdowns=0)

    def nvmlInit(self):
        self.inits += 1
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        memory, _ = self.devices[handle]
        if version is not None:
            if not self.v2:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return memory
        v1 = pynvml.c_nvmlMemory_t()
        v1.total, v1.free, v1.used = memory.total, memory.free, memory.used
        return v1

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        if self.processes_error is not None:
            raise pynvml.NVMLError(self.processes_error)
        return self.devices[handle][1]


H200_TOTAL = 143_771_140_096
H200 = memory_v2(total=H200_TOTAL, reserved=560_594_944, free=9 * GIB, used=H200_TOTAL - 560_594_944 - 9 * GIB)


def test_real_structs_become_a_device_record():
    record = device_memory_from_nvml(0, H200, [process(4242, 120 * GIB)])
    assert record.device == "cuda:0"
    assert (record.total_bytes, record.free_bytes, record.used_bytes) == (H200.total, 9 * GIB, H200.used)
    assert record.device_reserved_bytes == 560_594_944
    assert [(p.pid, p.used_bytes) for p in record.processes] == [(4242, 120 * GIB)]


def test_process_without_memory_figure_is_skipped():
    # nvidia-ml-py turns NVML_VALUE_NOT_AVAILABLE into None (WDDM, some MIG setups).
    record = device_memory_from_nvml(0, H200, [process(1, 0), types.SimpleNamespace(pid=2, usedGpuMemory=None)])
    assert [p.pid for p in record.processes] == [1]


def test_source_reads_every_device():
    nvml = FakeNvml([(H200, [process(10, GIB)]), (H200, [])])
    records = NvmlSource(nvml).sample()
    assert [r.device for r in records] == ["cuda:0", "cuda:1"]
    assert [len(r.processes) for r in records] == [1, 0]


def test_source_initialises_nvml_once():
    nvml = FakeNvml([(H200, [])])
    source = NvmlSource(nvml)
    source.sample()
    source.sample()
    assert nvml.inits == 1


def test_old_driver_without_memory_v2_falls_back_to_v1():
    record = NvmlSource(FakeNvml([(H200, [])], v2=False)).sample()[0]
    assert record.device_reserved_bytes is None
    assert record.total_bytes == H200.total


def test_process_list_denied_keeps_the_device_totals():
    record = NvmlSource(FakeNvml([(H200, [])], processes_error=pynvml.NVML_ERROR_NO_PERMISSION)).sample()[0]
    assert record.processes == ()
    assert record.free_bytes == 9 * GIB


def test_real_library_without_a_driver_is_unavailable():
    with pytest.raises(SourceUnavailable) as info:
        NvmlSource().sample()
    assert str(info.value) == "nvml: NVML Shared Library Not Found"


def test_driver_not_loaded_is_unavailable():
    with pytest.raises(SourceUnavailable, match="Driver Not Loaded"):
        NvmlSource(FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)).sample()


def test_other_init_failures_are_errors_not_absence():
    with pytest.raises(SourceError) as info:
        NvmlSource(FakeNvml([], init_error=pynvml.NVML_ERROR_NO_PERMISSION)).sample()
    assert not isinstance(info.value, SourceUnavailable)
    assert str(info.value) == "nvml: Insufficient Permissions"


def test_close_shuts_nvml_down():
    nvml = FakeNvml([(H200, [])])
    source = NvmlSource(nvml)
    source.sample()
    source.close()
    assert nvml.shutdowns == 1
