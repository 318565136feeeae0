"""The source registry and the auto source."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from kvguard.records import DeviceMemory
from kvguard.sources import Source, SourceError, free_total_used, get_source, register, source_names, unregister
from kvguard.sources.auto import AutoSource, framework_in_process


class Fixed:
    name = "fixed"

    def __init__(self, device="x:0"):
        self.device = device

    def sample(self):
        return [DeviceMemory(device=self.device, source=self.name)]


def test_builtin_names():
    assert source_names() == ["auto", "host", "mindspore", "npu-smi", "nvml", "sim", "torch"]


def test_registered_factory_gets_the_options():
    register("fixed", Fixed)
    try:
        assert get_source("fixed", device="y:1").sample()[0].device == "y:1"
        assert "fixed" in source_names()
    finally:
        unregister("fixed")


def test_builtin_name_cannot_be_taken_by_accident():
    with pytest.raises(ValueError, match="already registered"):
        register("nvml", Fixed)


def test_unknown_name_is_a_one_line_error():
    with pytest.raises(SourceError, match=r"unknown source 'rocm-smi' \(choose from auto, host, "):
        get_source("rocm-smi")


def test_unknown_option_is_a_source_error():
    with pytest.raises(SourceError, match="source 'host'"):
        get_source("host", colour="blue")


def test_every_builtin_satisfies_the_protocol():
    for name in ("host", "nvml", "npu-smi", "torch", "mindspore", "auto"):
        assert isinstance(get_source(name), Source), name


def test_naming_the_registry_imports_no_framework():
    code = (
        "import sys, kvguard.sources as s, kvguard.sources.auto, kvguard.probe; s.source_names();"
        "print(sorted(m for m in ('torch', 'mindspore', 'pynvml') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_auto_without_frameworks_imports_none_and_reports_the_host():
    code = (
        "import sys; from kvguard.sources import get_source; r = get_source('auto').sample();"
        "print(r[-1].device, sorted(m for m in ('torch', 'mindspore') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "host []"


def test_auto_uses_mindspore_when_imported_on_a_device(monkeypatch):
    stats = {"total_allocated_memory": 7, "total_reserved_memory": 9}
    fake = types.SimpleNamespace(
        get_context=lambda key: {"device_target": "Ascend", "device_id": 2}[key],
        runtime=types.SimpleNamespace(memory_stats=lambda: stats),
    )
    monkeypatch.setitem(sys.modules, "mindspore", fake)
    assert framework_in_process() == "mindspore"
    [record] = AutoSource().sample()
    assert (record.device, record.source, record.allocated_bytes) == ("npu:2", "mindspore", 7)


def test_auto_ignores_mindspore_on_cpu(monkeypatch):
    fake = types.SimpleNamespace(get_context=lambda key: {"device_target": "CPU", "device_id": 0}[key])
    monkeypatch.setitem(sys.modules, "mindspore", fake)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert framework_in_process() is None


def test_auto_with_torch_before_the_device_is_touched_samples_nothing(monkeypatch):
    # In a serving process that has imported torch but not initialised CUDA: no snapshot for a wrong device.
    cuda = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: False)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.delitem(sys.modules, "mindspore", raising=False)
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    assert AutoSource().sample() == []


def test_free_total_used_takes_a_backends_own_used_count_over_total_minus_free():
    assert free_total_used(30, 100) == {"free_bytes": 30, "total_bytes": 100, "used_bytes": 70}
    assert free_total_used(30, 100, used=65) == {"free_bytes": 30, "total_bytes": 100, "used_bytes": 65}
    assert free_total_used(30, 100, used=-1)["used_bytes"] == 70  # not a count: total - free
    assert free_total_used(None, None, used=5) == {"free_bytes": None, "total_bytes": None, "used_bytes": 5}
    assert free_total_used(120, 100)["used_bytes"] is None
