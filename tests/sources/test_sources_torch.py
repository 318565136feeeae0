"""The torch source against the real torch CPU build and real memory_stats key shapes."""

from __future__ import annotations

import json
import types

import pytest

torch = pytest.importorskip("torch")

from kvguard.sources import SourceError, SourceUnavailable, get_source  # noqa: E402
from kvguard.sources.torch import TorchSource, device_memory_from_stats  # noqa: E402

GIB = 1 << 30


@pytest.fixture
def nested_stats(data_path):
    with open(data_path("memory_stats", "torch-cuda-nested-vllm-serving.json")) as handle:
        return json.load(handle)


@pytest.fixture
def npu_stats(data_path):
    with open(data_path("memory_stats", "torch-npu-flat-vllm-ascend.json")) as handle:
        return json.load(handle)


@pytest.fixture
def cuda_as_if_initialized(monkeypatch, nested_stats):
    """The real torch.cuda module with only the C++ boundary replaced: torch's own code flattens."""
    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", lambda device=None: nested_stats)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * GIB, 80 * GIB))
    return torch


def test_cpu_build_memory_stats_is_empty_and_reads_as_unknown():
    stats = torch.cuda.memory_stats()
    record = device_memory_from_stats(stats, "cuda:0")
    assert stats == {}
    assert (record.allocated_bytes, record.reserved_bytes, record.alloc_retries) == (None, None, None)


def test_cpu_build_source_is_unavailable_with_one_line():
    with pytest.raises(SourceUnavailable) as info:
        TorchSource(backend="cuda").sample()
    assert "torch.cuda is not available" in str(info.value)
    assert "\n" not in str(info.value)


def test_source_does_not_initialize_cuda_when_told_not_to():
    assert TorchSource(backend="cuda", initialize=False).sample() == []
    assert not torch.cuda.is_initialized()


def test_memory_stats_flattened_by_real_torch_are_read(cuda_as_if_initialized, nested_stats):
    flat = torch.cuda.memory_stats()
    record = device_memory_from_stats(flat, "cuda:0")
    assert "allocated_bytes.all.current" in flat
    assert record.allocated_bytes == nested_stats["allocated_bytes"]["all"]["current"]
    assert record.reserved_bytes == nested_stats["reserved_bytes"]["all"]["current"]
    assert record.peak_allocated_bytes == nested_stats["allocated_bytes"]["all"]["peak"]
    assert record.peak_reserved_bytes == nested_stats["reserved_bytes"]["all"]["peak"]
    assert record.active_bytes == nested_stats["active_bytes"]["all"]["current"]
    assert record.inactive_split_bytes == nested_stats["inactive_split_bytes"]["all"]["current"]
    assert (record.alloc_retries, record.ooms) == (3, 0)


def test_source_samples_current_device_with_mem_get_info(cuda_as_if_initialized, nested_stats):
    [record] = TorchSource(backend="cuda", torch_module=torch).sample()
    assert record.device == "cuda:0"
    assert record.source == "torch"
    assert (record.free_bytes, record.total_bytes, record.used_bytes) == (3 * GIB, 80 * GIB, 77 * GIB)
    assert record.fragmentation_bytes == (
        nested_stats["reserved_bytes"]["all"]["current"] - nested_stats["allocated_bytes"]["all"]["current"]
    )


def test_source_samples_every_device_when_asked(cuda_as_if_initialized, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    records = TorchSource(backend="cuda", device="all", torch_module=torch).sample()
    assert [r.device for r in records] == ["cuda:0", "cuda:1"]


def test_torch_npu_stats_use_the_same_keys(npu_stats):
    fake_npu = types.SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        current_device=lambda: 3,
        memory_stats=lambda device=None: npu_stats,
        mem_get_info=lambda device=None: (5 * GIB, 64 * GIB),
    )
    fake_torch = types.SimpleNamespace(npu=fake_npu, cuda=None)
    [record] = TorchSource(backend="npu", torch_module=fake_torch).sample()
    assert record.device == "npu:3"
    assert record.allocated_bytes == npu_stats["allocated_bytes.all.current"]
    assert record.reserved_bytes == npu_stats["reserved_bytes.all.current"]
    assert record.ooms == 1


def test_auto_backend_picks_npu_when_torch_npu_is_loaded(monkeypatch, npu_stats):
    fake_npu = types.SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        current_device=lambda: 0,
        memory_stats=lambda device=None: npu_stats,
        mem_get_info=lambda device=None: (5 * GIB, 64 * GIB),
    )
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", types.ModuleType("torch_npu"))
    fake_torch = types.SimpleNamespace(npu=fake_npu)
    assert TorchSource(torch_module=fake_torch).sample()[0].device == "npu:0"


def test_missing_keys_stay_none_not_zero():
    record = device_memory_from_stats({"allocated_bytes.all.current": 1024}, "cuda:0")
    assert record.allocated_bytes == 1024
    assert record.reserved_bytes is None


def test_hostile_values_are_dropped_not_raised():
    stats = {
        "allocated_bytes.all.current": -5,
        "reserved_bytes.all.current": float("nan"),
        "num_ooms": True,
        "num_alloc_retries": "7",
    }
    record = device_memory_from_stats(stats, "cuda:0")
    assert (record.allocated_bytes, record.reserved_bytes, record.ooms, record.alloc_retries) == (None,) * 4


def test_a_torch_error_becomes_one_line_source_error(cuda_as_if_initialized, monkeypatch):
    def broken(device=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors ...")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    with pytest.raises(SourceError) as info:
        TorchSource(backend="cuda", torch_module=torch).sample()
    assert str(info.value).startswith("torch.cuda: CUDA error: an illegal memory access")
    assert "\n" not in str(info.value)


def test_bad_options_are_one_line_errors():
    with pytest.raises(SourceError, match="unknown torch backend 'rocm'"):
        get_source("torch", backend="rocm")
    with pytest.raises(SourceError, match="torch device must be"):
        get_source("torch", device=-1)
