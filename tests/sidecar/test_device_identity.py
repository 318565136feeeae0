"""Device identity (device_uuid, pci_bus_id) and the serving engine (model_name, engine) from every
source through the spool to the exposition: the labels that join kvguard to dcgm-exporter and
npu-exporter."""

from __future__ import annotations

import json
import types
from dataclasses import replace

import pytest
from sidecar_fixtures import snapshot, write
from test_collector import StaticSource, scrape, sidecar_for, value

from kvguard.records import DeviceMemory
from kvguard.sources.npu_smi import device_memory_from_npu_smi, parse_npu_smi_info
from kvguard.sources.torch import TorchSource, device_identity
from kvguard.spool.io import read_spool, write_snapshot

UUID0 = "GPU-8c6b5a0e-2f7c-9d1a-33b2-5e9f0c1d2a3b"


def identified(snap, uuid=UUID0, bus="00000000:3B:00.0", **fields):
    return replace(snap, memory=replace(snap.memory, device_uuid=uuid, pci_bus_id=bus), **fields)


# ------------------------------------------------------------------ spool


def test_identity_and_engine_survive_the_spool(tmp_path):
    snap = identified(snapshot(device="cuda:0"), model_name="Qwen/Qwen2.5-7B-Instruct", engine="1")
    write_snapshot(str(tmp_path), snap)
    [read] = read_spool(str(tmp_path)).snapshots
    assert (read.memory.device_uuid, read.memory.pci_bus_id) == (UUID0, "00000000:3B:00.0")
    assert (read.model_name, read.engine) == ("Qwen/Qwen2.5-7B-Instruct", "1")


def test_a_snapshot_from_before_the_identity_fields_still_reads_with_empty_labels(tmp_path):
    data = snapshot(device="cuda:0").to_dict()
    for key in ("model_name", "engine"):
        del data[key]
    for key in ("device_uuid", "pci_bus_id"):
        del data["memory"][key]
    (tmp_path / "old.json").write_text(json.dumps(data))
    [read] = read_spool(str(tmp_path)).snapshots
    assert (read.memory.device_uuid, read.memory.pci_bus_id, read.model_name, read.engine) == ("", "", "", "")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["memory"].update(device_uuid=7),
        lambda d: d["memory"].update(pci_bus_id=["0000:01:00.0"]),
        lambda d: d.update(model_name={"x": 1}),
        lambda d: d.update(engine=0),
    ],
)
def test_identity_fields_of_the_wrong_type_make_the_snapshot_invalid(tmp_path, mutate):
    data = snapshot().to_dict()
    mutate(data)
    (tmp_path / "bad.json").write_text(json.dumps(data))
    assert read_spool(str(tmp_path)).skipped["invalid_snapshot"] == 1


def test_hostile_identity_text_is_cut_to_safe_bounded_label_values(tmp_path):
    data = snapshot().to_dict()
    data["memory"]["device_uuid"] = 'GPU-1"} evil{x="y"}\n' + "A" * 10_000
    data["memory"]["pci_bus_id"] = "\ud800\x00"
    data["model_name"] = "m\x1b[31m" + "x" * 10_000
    (tmp_path / "hostile.json").write_text(json.dumps(data))
    [read] = read_spool(str(tmp_path)).snapshots
    assert read.memory.device_uuid.startswith("GPU-1evilxy") and len(read.memory.device_uuid) == 96
    assert read.memory.pci_bus_id == ""
    assert len(read.model_name) == 253 and "\x1b" not in read.model_name


# ------------------------------------------------------------------ exposition


def test_rank_and_device_series_carry_the_identity(tmp_path):
    write(tmp_path, identified(snapshot(rank=0, device="cuda:0"), model_name="llama", engine="0"))
    write(
        tmp_path,
        identified(
            snapshot(rank=1, device="cuda:1", pid=4243),
            uuid="GPU-1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718",
            bus="00000000:86:00.0",
        ),
    )
    device = DeviceMemory(
        device="cuda:0",
        source="nvml",
        total_bytes=80 << 30,
        used_bytes=1,
        free_bytes=2,
        device_reserved_bytes=3,
        device_uuid=UUID0,
        pci_bus_id="00000000:3B:00.0",
    )
    sidecar = sidecar_for(tmp_path, sources=[("nvml", StaticSource([device]))])
    samples = scrape(sidecar)
    assert (
        value(
            samples,
            "kvguard_allocator_reserved_bytes",
            rank=0,
            device_uuid=UUID0,
            pci_bus_id="00000000:3B:00.0",
            model_name="llama",
            engine="0",
        )
        > 0
    )
    assert value(
        samples,
        "kvguard_guard_severity",
        rank=1,
        device_uuid="GPU-1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718",
        pci_bus_id="00000000:86:00.0",
        model_name="",
        engine="",
    ) in (0, 1, 2)
    assert (
        value(samples, "kvguard_device_used_bytes", device="cuda:0", device_uuid=UUID0, pci_bus_id="00000000:3B:00.0")
        == 1
    )
    assert value(samples, "kvguard_device_driver_reserved_bytes", device="cuda:0", device_uuid=UUID0) == 3
    # Every rank family has the four identity labels, in one place after the rank labels.
    for name, rows in samples.items():
        if name.startswith(("kvguard_allocator_", "kvguard_guard_", "kvguard_kv_cache_")):
            assert all({"device_uuid", "pci_bus_id", "model_name", "engine"} <= set(labels) for labels, _ in rows)


def test_a_rank_without_identity_has_empty_labels_not_missing_ones(tmp_path):
    write(tmp_path, snapshot(rank=0, device="npu:0"))
    samples = scrape(sidecar_for(tmp_path))
    assert value(
        samples, "kvguard_guard_severity", rank=0, device_uuid="", pci_bus_id="", model_name="", engine=""
    ) in (0, 1, 2)


# ------------------------------------------------------------------ torch


class FakeCudaProps:
    """torch.cuda's _CudaDeviceProperties as a release without PCI fields has it: uuid's str() is bare."""

    def __init__(self, uuid, **pci):
        self.uuid = _Uuid(uuid)
        for key, val in pci.items():
            setattr(self, key, val)


class _Uuid:
    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text


def fake_cuda(props):
    stats = {"allocated_bytes.all.current": 1 << 30, "reserved_bytes.all.current": 2 << 30}
    calls = []

    def get_device_properties(index):
        calls.append(index)
        return props

    module = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: 0,
        is_initialized=lambda: True,
        mem_get_info=lambda i: (1, 80 << 30),
        memory_stats=lambda i: stats,
        get_device_properties=get_device_properties,
    )
    return types.SimpleNamespace(cuda=module), calls


def test_torch_uuid_gets_nvmls_prefix_and_pci_fields_make_nvmls_bus_id():
    torch, calls = fake_cuda(
        FakeCudaProps("8c6b5a0e-2f7c-9d1a-33b2-5e9f0c1d2a3b", pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    )
    source = TorchSource(backend="cuda", torch_module=torch)
    [record] = source.sample()
    assert (record.device_uuid, record.pci_bus_id) == (UUID0, "00000000:3B:00.0")
    source.sample()
    assert calls == [0]  # properties do not change: asked once per device


def test_torch_without_pci_fields_has_only_the_uuid():
    torch, _ = fake_cuda(FakeCudaProps("8c6b5a0e-2f7c-9d1a-33b2-5e9f0c1d2a3b"))
    [record] = TorchSource(backend="cuda", torch_module=torch).sample()
    assert (record.device_uuid, record.pci_bus_id) == (UUID0, "")


def test_torch_npu_properties_without_uuid_leave_both_empty():
    props = types.SimpleNamespace(name="Ascend910B3", total_memory=64 << 30, cube_core_num=20, vector_core_num=40)
    assert device_identity("npu", types.SimpleNamespace(get_device_properties=lambda i: props), 0) == ("", "")


def test_torch_properties_that_raise_leave_the_counters_alone():
    def broken(index):
        raise RuntimeError("CUDA driver error")

    assert device_identity("cuda", types.SimpleNamespace(get_device_properties=broken), 0) == ("", "")


def test_real_torch_properties_class_declares_uuid():
    # The CPU build cannot make a _CudaDeviceProperties, but its stub names the attribute we read.
    torch = pytest.importorskip("torch")
    import inspect
    import pathlib

    stub = pathlib.Path(inspect.getfile(torch)).parent / "_C" / "__init__.pyi"
    text = stub.read_text()
    block = text[text.index("class _CudaDeviceProperties") :][:2000]
    assert "uuid: str" in block


# ------------------------------------------------------------------ npu-smi


@pytest.mark.parametrize(
    "fixture, expected",
    [
        ("910b3-24.1.rc1-vllm-tp8.txt", [("npu:0", "", "0000:C1:00.0"), ("npu:7", "", "0000:42:00.0")]),
        (
            "ascend910-a3-25.2.0-dual-die.txt",
            [("npu:0.0", "npu-phy-0", "0000:9C:00.0"), ("npu:1.1", "npu-phy-3", "0000:39:00.0")],
        ),
        (
            "310p3-23.0.rc3-duo.txt",
            [("npu:0", "npu-logic-0", "0000:01:00.0"), ("npu:3", "npu-logic-3", "0000:81:00.0")],
        ),
    ],
)
def test_npu_smi_chips_carry_the_bus_id_and_the_id_the_table_prints(data_path, fixture, expected):
    records = device_memory_from_npu_smi(parse_npu_smi_info(open(data_path("npu-smi", fixture)).read()))
    by_device = {r.device: (r.device, r.device_uuid, r.pci_bus_id) for r in records}
    assert [by_device[device] for device, _, _ in expected] == expected


def test_npu_smi_bus_id_that_is_not_an_address_is_dropped(data_path):
    text = open(data_path("npu-smi", "910b4-23.0.6-idle.txt")).read().replace("0000:C1:00.0", "0000:C1:zz.0")
    [first, *_] = device_memory_from_npu_smi(parse_npu_smi_info(text))
    assert first.pci_bus_id == ""
