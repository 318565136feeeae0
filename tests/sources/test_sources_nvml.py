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
    struct.version, struct.total, struct.reserved, struct.free, struct.used = (
        pynvml.nvmlMemory_v2,
        total,
        reserved,
        free,
        used,
    )
    return struct


def process(pid, used):
    struct = pynvml.c_nvmlProcessInfo_t()
    struct.pid, struct.usedGpuMemory = pid, used
    return pynvml.nvmlStructToFriendlyObject(struct)


def pci_info(bus_id: bytes):
    """The real nvmlPciInfo_t (nvmlDeviceGetPciInfo_v3's answer): busId is bytes, as ctypes gives it."""
    struct = pynvml.nvmlPciInfo_t()
    struct.busId = bus_id
    struct.busIdLegacy = bus_id
    return struct


class FakeNvml(types.SimpleNamespace):
    """The pynvml calls NvmlSource makes, answering from the real structs; errors are real NVMLError.

    GPU handles are NVML indices; a MIG device's handle is ("mig", gpu, slot). ``uuids`` and
    ``bus_ids`` per GPU index; ``migs``: {gpu index: {slot: (uuid, memory struct, processes)}} for GPUs
    in MIG mode, ``mig_slots`` the slot count each reports (nvmlDeviceGetMaxMigDeviceCount).
    """

    NVMLError = pynvml.NVMLError
    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def __init__(
        self,
        devices,
        init_error=None,
        v2=True,
        processes_error=None,
        uuids=None,
        bus_ids=None,
        migs=None,
        mig_slots=7,
        mig_capable=True,
        uuid_error=None,
        mig_error=None,
    ):
        super().__init__(
            devices=devices,
            init_error=init_error,
            v2=v2,
            processes_error=processes_error,
            inits=0,
            shutdowns=0,
            calls=[],
            migs=migs or {},
            mig_slots=mig_slots,
            mig_capable=mig_capable,
            uuid_error=uuid_error,
            mig_error=mig_error,
            uuids=uuids or [f"GPU-{i:08x}-1111-2222-3333-444455556666" for i in range(len(devices))],
            bus_ids=bus_ids or [f"00000000:{0x18 + i:02X}:00.0".encode() for i in range(len(devices))],
        )

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

    def _device(self, handle):
        if isinstance(handle, tuple):
            _, gpu, slot = handle
            uuid, memory, processes = self.migs[gpu][slot]
            return memory, processes
        return self.devices[handle]

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        self.calls.append(("memory", handle))
        memory, _ = self._device(handle)
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
        return self._device(handle)[1]

    def nvmlDeviceGetUUID(self, handle):
        if self.uuid_error is not None:
            raise pynvml.NVMLError(self.uuid_error)
        if isinstance(handle, tuple):
            return self.migs[handle[1]][handle[2]][0]
        return self.uuids[handle]  # str: nvidia-ml-py's convertStrBytes decodes the buffer

    def nvmlDeviceGetPciInfo_v3(self, handle):
        self.calls.append(("pci", handle))
        return pci_info(self.bus_ids[handle])

    def nvmlDeviceGetMigMode(self, handle):
        self.calls.append(("mig_mode", handle))
        if not self.mig_capable:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if handle in self.migs else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        return self.mig_slots

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, index):
        self.calls.append(("mig_handle", handle, index))
        if self.mig_error is not None and index == 1:
            raise pynvml.NVMLError(self.mig_error)
        if index not in self.migs.get(handle, {}):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return ("mig", handle, index)


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


def test_source_initialises_nvml_once_and_shuts_it_down_on_close():
    nvml = FakeNvml([(H200, [])])
    source = NvmlSource(nvml)
    source.sample()
    source.sample()
    assert (nvml.inits, nvml.shutdowns) == (1, 0)
    source.close()
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


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


def test_every_real_call_the_fake_answers_exists_in_nvidia_ml_py():
    # The fake stands in for these library functions only: each must be nvidia-ml-py's own name.
    names = [n for n, v in vars(FakeNvml).items() if n.startswith("nvml") and callable(v)]
    assert names and all(callable(getattr(pynvml, n, None)) for n in names), names


def test_records_carry_the_uuid_and_the_pci_bus_id():
    uuids = ["GPU-8c6b5a0e-2f7c-9d1a-33b2-5e9f0c1d2a3b", "GPU-1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718"]
    nvml = FakeNvml([(H200, []), (H200, [])], uuids=uuids, bus_ids=[b"00000000:3B:00.0", b"00000000:86:00.0"])
    records = NvmlSource(nvml).sample()
    assert [(r.device_uuid, r.pci_bus_id) for r in records] == [
        (uuids[0], "00000000:3B:00.0"),
        (uuids[1], "00000000:86:00.0"),
    ]


def test_a_uuid_nvml_will_not_give_leaves_the_label_empty_not_the_device_out():
    record = NvmlSource(FakeNvml([(H200, [])], uuid_error=pynvml.NVML_ERROR_NOT_SUPPORTED)).sample()[0]
    assert (record.device_uuid, record.pci_bus_id, record.total_bytes) == ("", "00000000:18:00.0", H200.total)


def test_hostile_identity_text_is_cut_to_label_safe_characters():
    record = NvmlSource(FakeNvml([(H200, [])], uuids=['GPU-1"}\n evil{x="y'], bus_ids=[b"0000:3B\n{}"])).sample()[0]
    assert (record.device_uuid, record.pci_bus_id) == ("GPU-1evilxy", "0000:3B")
    # Bytes that are not UTF-8: nvidia-ml-py's own decode raises; the label is empty, the device kept.
    record = NvmlSource(FakeNvml([(H200, [])], bus_ids=[b"\xff00:3B"])).sample()[0]
    assert (record.pci_bus_id, record.total_bytes) == ("", H200.total)


def test_reserved_memory_is_exported_as_a_device_series():
    from kvguard.sidecar.collector import families
    from kvguard.sidecar.core import Sidecar, SidecarConfig

    sidecar = Sidecar(
        SidecarConfig(
            sources=[("nvml", NvmlSource(FakeNvml([(H200, [])])))],
            pod_labels={"pod": "", "namespace": "", "container": ""},
        )
    )
    sidecar.refresh_background(wait=5)
    fam = families(sidecar.observe())
    samples = [s for f in fam if f.name == "kvguard_device_driver_reserved_bytes" for s in f.samples]
    assert [(s.labels["device"], s.labels["device_uuid"], s.value) for s in samples] == [
        ("cuda:0", "GPU-00000000-1111-2222-3333-444455556666", 560_594_944)
    ]


MIG_1G = memory_v2(total=17_071_734_784, reserved=0, free=15 * GIB, used=17_071_734_784 - 15 * GIB)
MIG_3G = memory_v2(total=51_808_043_008, reserved=0, free=40 * GIB, used=51_808_043_008 - 40 * GIB)
MIG_UUIDS = ["MIG-5f0c6b3e-9a1d-5c2e-8f4a-0b1c2d3e4f50", "MIG-7a8b9c0d-1e2f-5a3b-9c4d-5e6f7a8b9c0d"]


def test_mig_devices_are_read_as_their_own_devices_behind_the_flag():
    # GPU 0 in MIG mode with slots 0 and 2 filled (slot 1 empty: NVML_ERROR_NOT_FOUND), GPU 1 not.
    migs = {0: {0: (MIG_UUIDS[0], MIG_1G, [process(77, 3 * GIB)]), 2: (MIG_UUIDS[1], MIG_3G, [])}}
    nvml = FakeNvml([(H200, []), (H200, [])], migs=migs, bus_ids=[b"00000000:3B:00.0", b"00000000:86:00.0"])
    records = NvmlSource(nvml, mig=True).sample()
    assert [(r.device, r.device_uuid, r.pci_bus_id) for r in records] == [
        ("cuda:0", "GPU-00000000-1111-2222-3333-444455556666", "00000000:3B:00.0"),
        ("cuda:0/mig:0", MIG_UUIDS[0], "00000000:3B:00.0"),
        ("cuda:0/mig:2", MIG_UUIDS[1], "00000000:3B:00.0"),
        ("cuda:1", "GPU-00000001-1111-2222-3333-444455556666", "00000000:86:00.0"),
    ]
    assert (records[1].total_bytes, records[1].free_bytes) == (MIG_1G.total, 15 * GIB)
    assert [(p.pid, p.used_bytes) for p in records[1].processes] == [(77, 3 * GIB)]
    # Every slot the GPU reports is asked once; a MIG device's PCI info is its parent's, not asked.
    assert [c for c in nvml.calls if c[0] == "mig_handle"] == [("mig_handle", 0, s) for s in range(7)]
    assert ("pci", ("mig", 0, 0)) not in nvml.calls


def test_without_the_flag_mig_is_never_asked():
    nvml = FakeNvml([(H200, [])], migs={0: {0: (MIG_UUIDS[0], MIG_1G, [])}})
    assert [r.device for r in NvmlSource(nvml).sample()] == ["cuda:0"]
    assert not [c for c in nvml.calls if c[0].startswith("mig")]


def test_a_gpu_without_mig_support_is_one_device_with_the_flag():
    nvml = FakeNvml([(H200, [])], mig_capable=False)
    assert [r.device for r in NvmlSource(nvml, mig=True).sample()] == ["cuda:0"]


def test_a_broken_library_slot_count_is_bounded():
    from kvguard.sources.nvml import MAX_MIG_SLOTS

    nvml = FakeNvml([(H200, [])], migs={0: {}}, mig_slots=10**9)
    assert [r.device for r in NvmlSource(nvml, mig=True).sample()] == ["cuda:0"]
    assert len([c for c in nvml.calls if c[0] == "mig_handle"]) == MAX_MIG_SLOTS


def test_mig_flag_must_be_a_bool():
    with pytest.raises(SourceError, match="mig must be true or false"):
        NvmlSource(FakeNvml([]), mig="yes")


def test_a_mig_read_that_fails_keeps_the_gpus_and_the_mig_devices_read_before_it():
    migs = {0: {0: (MIG_UUIDS[0], MIG_1G, []), 2: (MIG_UUIDS[1], MIG_3G, [])}}
    nvml = FakeNvml([(H200, []), (H200, [])], migs=migs, mig_error=pynvml.NVML_ERROR_NO_PERMISSION)
    assert [r.device for r in NvmlSource(nvml, mig=True).sample()] == ["cuda:0", "cuda:0/mig:0", "cuda:1"]
