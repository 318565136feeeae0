"""The plugin's failure handling, against a fake of the vLLM interface it patches (tests/support/fake_vllm).

What the plugin records and changes is tested against the real vLLM releases in
tests/upstream/test_vllm_real.py; this fake stays only for what a real release cannot be made to do on
demand: hooks and sources that fail, registration order, vLLM's own errors passing through.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys
import threading
import time

import pytest
from conftest import TESTS

pytest.importorskip("torch")  # the fake Worker keeps vLLM's @torch.inference_mode()

from kvguard import plugin, probe  # noqa: E402
from kvguard.budget.estimator import Profile, stock_kv_cache_bytes  # noqa: E402
from kvguard.plugin import (  # noqa: E402
    hooks,
    profile as plugin_profile,  # noqa: E402
    state,
)
from kvguard.sources import (
    register as register_source,  # noqa: E402
    unregister,
)
from kvguard.sources.torch import device_memory_from_stats  # noqa: E402
from kvguard.spool.io import read_spool  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
FAKE_ROOT = os.path.join(TESTS, "support", "fake_vllm")
# What the fake worker's startup measures (see tests/support/fake_vllm): 16 GiB weights, two 1.5 GiB
# activations that make the 2 GiB-segment allocator reserve 4 GiB more, 0.5 GiB of NCCL-like memory.
EXPECTED_PROFILE = Profile(
    total_memory_bytes=64 * GIB,
    gpu_memory_utilization=0.9,
    weights_bytes=16 * GIB,
    peak_allocated_increase_bytes=3 * GIB,
    peak_reserved_increase_bytes=4 * GIB,
    non_torch_increase_bytes=512 * MIB,
)


class FakeDeviceSource:
    """Reads the fake device's memory_stats() with the torch source's own key reader."""

    name = "fake-cuda"

    def sample(self):
        from fake_device import DEVICE

        free, total = DEVICE.mem_get_info()
        return [device_memory_from_stats(DEVICE.memory_stats(), "cuda:0", "torch", free_bytes=free, total_bytes=total)]


def _forget_fake_modules():
    for name in list(sys.modules):
        if name == "vllm" or name.startswith("vllm.") or name == "fake_device":
            del sys.modules[name]


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """A fresh fake vLLM on sys.path (not imported yet), a fresh plugin state, a test source."""
    _forget_fake_modules()
    monkeypatch.syspath_prepend(FAKE_ROOT)
    plugin.reset_for_tests()
    register_source("fake-cuda", FakeDeviceSource, replace=True)
    monkeypatch.setenv("KVGUARD_SOURCE", "fake-cuda")
    for name in ("KVGUARD_SPOOL_DIR", "KVGUARD_BUDGET", "KVGUARD_INTERVAL"):
        monkeypatch.delenv(name, raising=False)
    yield tmp_path / "spool"
    probe.stop()
    plugin.reset_for_tests()
    unregister("fake-cuda")
    _forget_fake_modules()


def start_worker(**kwargs):
    """What vLLM does in a worker after load_general_plugins(): resolve, init, load."""
    gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
    worker = gpu_worker.Worker(**kwargs)
    worker.init_device()
    worker.load_model()
    return worker


def kv_cache_config(available, layers=4):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype_size=2)
    num_blocks = available // (spec.page_size_bytes * layers)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=num_blocks * spec.page_size_bytes, shared_by=[n]) for n in names],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)],
    )


def snapshots(spool):
    current = probe.current()
    assert current is not None
    current.run_once()
    return read_spool(str(spool)).snapshots


# ---------------------------------------------------------------------------- registration


def test_entry_point_is_declared_for_vllm():
    [entry] = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "kvguard"]
    assert entry.value == "kvguard.plugin:register"
    assert entry.load() is plugin.register


def test_without_settings_nothing_is_patched(fake_vllm):
    plugin.register()
    gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
    assert not getattr(gpu_worker.Worker.determine_available_memory, "_kvguard_wrapped", False)


def test_worker_imported_after_register_is_patched(fake_vllm, monkeypatch):
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    plugin.register()
    assert "vllm.v1.worker.gpu_worker" not in sys.modules
    gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
    for name in ("init_device", "determine_available_memory", "initialize_from_config"):
        assert getattr(getattr(gpu_worker.Worker, name), "_kvguard_wrapped", False), name


def test_worker_imported_before_register_is_patched(fake_vllm, monkeypatch):
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
    plugin.register()
    assert getattr(gpu_worker.Worker.determine_available_memory, "_kvguard_wrapped", False)


def test_register_twice_wraps_once(fake_vllm, monkeypatch):
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
    plugin.register()
    wrapped = gpu_worker.Worker.determine_available_memory
    plugin.register()
    hooks.patch_worker_class(gpu_worker, "Worker")
    assert gpu_worker.Worker.determine_available_memory is wrapped


def test_register_never_raises(fake_vllm, monkeypatch):
    def broken(cls, environ=None):
        raise RuntimeError("environment unreadable")

    monkeypatch.setattr(plugin.Settings, "from_environment", classmethod(broken))
    plugin.register()
    assert plugin.hook_errors == {"register": 1}


def test_unknown_budget_falls_back_to_stock_with_a_warning(fake_vllm, monkeypatch, caplog):
    monkeypatch.setenv("KVGUARD_BUDGET", "generous")
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    with caplog.at_level(logging.WARNING, logger="kvguard.plugin"):
        plugin.register()
    worker = start_worker()
    assert worker.determine_available_memory() == stock_kv_cache_bytes(EXPECTED_PROFILE)
    assert "KVGUARD_BUDGET='generous' is not one of stock, reserved" in caplog.text


# ---------------------------------------------------------------------------- the probe and the profile


def test_init_device_starts_the_probe_with_the_worker_rank(fake_vllm, monkeypatch):
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    plugin.register()
    start_worker(rank=3)
    [snapshot] = snapshots(fake_vllm)
    assert (snapshot.rank, snapshot.device, snapshot.pid) == (3, "cuda:0", os.getpid())
    assert snapshot.memory.allocated_bytes == 16 * GIB
    assert snapshot.profile is None


def test_reserved_budget_without_a_reserved_reading_keeps_vllms(fake_vllm, monkeypatch):
    monkeypatch.setenv("KVGUARD_BUDGET", "reserved")
    monkeypatch.setenv("KVGUARD_SOURCE", "host")  # knows no allocator: no reserved peak
    plugin.register()
    assert start_worker().determine_available_memory() == stock_kv_cache_bytes(EXPECTED_PROFILE)
    assert plugin.hook_errors == {"budget": 1}


def test_a_replaced_memory_profiling_is_still_measured(fake_vllm, monkeypatch):
    # vllm-mindspore swaps in its own memory_profiling; kvguard wraps whatever the name holds.
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    plugin.register()
    gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
    original = gpu_worker.memory_profiling
    calls = []

    def ms_memory_profiling(*args, **kwargs):
        calls.append("ms")
        return original(*args, **kwargs)

    monkeypatch.setattr(gpu_worker, "memory_profiling", ms_memory_profiling)
    start_worker().determine_available_memory()
    [snapshot] = snapshots(fake_vllm)
    assert calls == ["ms"]
    assert snapshot.profile.peak_reserved_increase_bytes == 4 * GIB
    assert gpu_worker.memory_profiling is ms_memory_profiling


def test_a_failing_reserved_reading_leaves_the_profile_without_it(fake_vllm, monkeypatch):
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    plugin.register()

    class Broken:
        name = "broken"

        def sample(self):
            raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(state, "reader", Broken())
    start_worker().determine_available_memory()
    [snapshot] = snapshots(fake_vllm)
    assert snapshot.profile.peak_reserved_increase_bytes is None
    assert snapshot.profile.peak_allocated_increase_bytes == 3 * GIB
    assert plugin.hook_errors == {"memory_profiling": 3}  # before, after the run, after empty_cache


def test_vllms_own_errors_pass_through_unchanged(fake_vllm, monkeypatch):
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    plugin.register()
    gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
    worker = start_worker()
    worker.model_runner.activations = (200 * GIB,)
    with pytest.raises(MemoryError, match="CUDA out of memory"):
        worker.determine_available_memory()
    assert not getattr(gpu_worker.memory_profiling, "_kvguard_wrapped", False)


def test_a_probe_that_cannot_start_does_not_stop_the_worker(fake_vllm, monkeypatch):
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    monkeypatch.setenv("KVGUARD_SOURCE", "no-such-source")
    plugin.register()
    worker = start_worker()
    assert worker.determine_available_memory() == stock_kv_cache_bytes(EXPECTED_PROFILE)
    assert plugin.hook_errors["init_device"] == 1
    assert probe.current() is None


def test_engine_identity_reads_the_served_name_and_the_data_parallel_index():
    import types

    def worker(**parallel):
        config = types.SimpleNamespace(
            model_config=types.SimpleNamespace(served_model_name="qwen-7b"),
            parallel_config=types.SimpleNamespace(**parallel),
        )
        return types.SimpleNamespace(vllm_config=config)

    # data_parallel_index (0.14+) is the engine's index even where data_parallel_rank is overridden.
    assert plugin.engine_identity(worker(data_parallel_index=2, data_parallel_rank=0)) == ("qwen-7b", 2)
    assert plugin.engine_identity(worker(data_parallel_rank=1)) == ("qwen-7b", 1)
    assert plugin.engine_identity(types.SimpleNamespace()) == (None, None)


def test_a_worker_without_memory_profiling_says_once_why_nothing_is_recorded(fake_vllm, monkeypatch, caplog):
    # vLLM 0.8.5-0.9.0's worker reads torch.cuda inline (gpu_worker.py 0.9.0:167-214): nothing to capture.
    gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
    monkeypatch.setattr(gpu_worker.Worker, "determine_available_memory", lambda self: 40 * GIB)
    monkeypatch.setenv("KVGUARD_BUDGET", "reserved")
    plugin.register()
    worker = start_worker()
    with caplog.at_level(logging.INFO, logger="kvguard.plugin"):
        assert worker.determine_available_memory() == 40 * GIB
        assert worker.determine_available_memory() == 40 * GIB
    [line] = [r.getMessage() for r in caplog.records if "no startup profile recorded" in r.getMessage()]
    assert "runs no memory_profiling" in line and "KVGUARD_BUDGET=reserved keeps vLLM's budget" in line


# ---------------------------------------------------------------------------- the step boundary


class EngineOnlyFakeSource(FakeDeviceSource):
    """The fake device read as MindSpore's pool must be: on the engine's thread only (kvguard.sources.mindspore)."""

    name = "fake-engine-only"
    engine_thread_only = True
    threads: list = []
    fail_with = None

    def sample(self):
        from kvguard.sources import EngineError

        type(self).threads.append(threading.current_thread().name)
        if type(self).fail_with is not None:
            raise EngineError(type(self).fail_with, self.name)
        return super().sample()


def test_an_engine_thread_source_is_read_in_execute_model_on_the_workers_thread(fake_vllm, monkeypatch):
    register_source("fake-engine-only", EngineOnlyFakeSource, replace=True)
    EngineOnlyFakeSource.threads, EngineOnlyFakeSource.fail_with = [], None
    monkeypatch.setenv("KVGUARD_SOURCE", "fake-engine-only")
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    monkeypatch.setenv("KVGUARD_INTERVAL", "0.05")
    plugin.register()
    worker = start_worker()
    [snapshot] = snapshots(fake_vllm)
    assert snapshot.probe.sampling == "engine-step"
    for step in range(5):
        assert worker.execute_model(step) == step
        time.sleep(0.06)
    assert len(EngineOnlyFakeSource.threads) >= 5
    assert set(EngineOnlyFakeSource.threads) == {threading.current_thread().name}
    # The engine's own pending error, taken by the read, reaches vLLM's caller unchanged.
    error = RuntimeError("For 'Gather', the 'input_indices' should be in the range [0, 4), but got 99")
    EngineOnlyFakeSource.fail_with = error
    with pytest.raises(RuntimeError) as raised:
        worker.execute_model("next step")
    assert raised.value is error
    # A startup hook's reading (after initialize_from_config) that takes the engine's error hands it back too.
    with pytest.raises(RuntimeError) as raised:
        worker.initialize_from_config(kv_cache_config(GIB))
    assert raised.value is error
    assert "initialize_from_config" not in plugin.hook_errors and "engine_reading" not in plugin.hook_errors
    # vLLM's own error inside the step passes through too, and the probe goes on.
    EngineOnlyFakeSource.fail_with = None
    own = ValueError("the engine's own failure")
    with pytest.raises(ValueError) as raised:
        worker.execute_model(own)
    assert raised.value is own
    unregister("fake-engine-only")


# ---------------------------------------------------------------------------- exact mode on MindSpore


def test_exact_mode_merges_the_pools_dump_into_the_users_ms_alloc_conf(fake_vllm, monkeypatch):
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    monkeypatch.setenv("KVGUARD_MINDSPORE_DUMP", "1")
    monkeypatch.setenv("MS_ALLOC_CONF", "enable_vmm:True,memory_tracker:False")
    plugin.register()
    assert os.environ["MS_ALLOC_CONF"] == "enable_vmm:True,memory_tracker:False,defrag_memory_step_freq:100dump"
    assert not plugin.hook_errors
    # vLLM's next process (its workers inherit the environment) registers again: the value stays as it is.
    plugin.reset_for_tests()
    plugin.register()
    assert os.environ["MS_ALLOC_CONF"] == "enable_vmm:True,memory_tracker:False,defrag_memory_step_freq:100dump"


def test_a_bad_exact_mode_setting_is_counted_and_leaves_ms_alloc_conf_alone(fake_vllm, monkeypatch, caplog):
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    monkeypatch.setenv("KVGUARD_MINDSPORE_DUMP", "often")
    monkeypatch.setenv("MS_ALLOC_CONF", "enable_vmm:True")
    plugin.register()
    assert os.environ["MS_ALLOC_CONF"] == "enable_vmm:True"
    assert plugin.hook_errors == {"mindspore_dump": 1}
    assert "KVGUARD_MINDSPORE_DUMP='often'" in caplog.text


# ---------------------------------------------------------------------------- a worker that measures inline


def inline_worker_method(body: str) -> tuple[dict, object]:
    """A determine_available_memory in a module of its own that reaches the device through its global ``torch``
    and has no ``memory_profiling``, as vLLM 0.8.5-0.9.0's gpu_worker.py (0.9.0:166-214)."""
    import torch

    namespace = {"torch": torch, "seen": []}
    exec(f"def determine_available_memory(self):\n    seen.append(torch)\n{body}", namespace)
    return namespace, namespace["determine_available_memory"]


def test_an_inline_workers_own_error_passes_through_and_its_torch_is_put_back(fake_vllm, monkeypatch):
    import torch

    from kvguard.plugin.inline_readings import RecordingModule

    error = RuntimeError("CUDA error: out of memory")
    namespace, method = inline_worker_method("    raise ERROR\n")
    namespace["ERROR"] = error
    gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
    monkeypatch.setattr(gpu_worker.Worker, "determine_available_memory", method)
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    plugin.register()
    worker = start_worker()
    with pytest.raises(RuntimeError) as raised:
        worker.determine_available_memory()
    assert raised.value is error
    # While it ran, its torch recorded; afterwards it is torch again.
    assert isinstance(namespace["seen"][0], RecordingModule) and namespace["torch"] is torch
    assert not plugin.hook_errors


def test_an_inline_worker_whose_reads_are_not_its_eras_keeps_its_figure_and_records_nothing(fake_vllm, monkeypatch):
    # The fake vLLM's release is not an 0.8.5-0.9.0 row: whatever it read, its figure passes through untouched.
    namespace, method = inline_worker_method("    torch.cuda.is_available()\n    return 40 * (1 << 30)\n")
    gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
    monkeypatch.setattr(gpu_worker.Worker, "determine_available_memory", method)
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    monkeypatch.setenv("KVGUARD_BUDGET", "reserved")
    plugin.register()
    worker = start_worker()
    assert worker.determine_available_memory() == 40 * GIB
    [snapshot] = snapshots(fake_vllm)
    assert snapshot.profile is None


def test_profile_from_readings_needs_an_era_that_adds_the_absolute_non_torch_memory():
    from kvguard.plugin.inline_readings import Readings, profile_from_readings

    readings = Readings()
    readings.stats = [
        {"allocated_bytes.all.peak": 20 * GIB, "reserved_bytes.all.peak": 22 * GIB},
        {"allocated_bytes.all.current": 16 * GIB},
    ]
    readings.mem_info = [(40 * GIB, 80 * GIB), (30 * GIB, 80 * GIB), (62 * GIB, 80 * GIB)]
    profile = profile_from_readings(readings, formula="absolute_peak_signed", utilization=0.9, release="vllm:0.9.0")
    assert (
        profile.weights_bytes,
        profile.peak_allocated_increase_bytes,
        profile.peak_reserved_increase_bytes,
        profile.non_torch_increase_bytes,
    ) == (16 * GIB, 4 * GIB, 6 * GIB, 2 * GIB)
    assert stock_kv_cache_bytes(profile) == int(80 * GIB * 0.9 - (20 * GIB + 2 * GIB))
    assert profile_from_readings(readings, formula="peak", utilization=0.9, release="vllm:0.11.0") is None
    assert profile_from_readings(Readings(), formula="absolute_peak", utilization=0.9, release=None) is None


def test_a_device_read_kvguard_cannot_keep_leaves_the_workers_call_and_figure_alone(fake_vllm, monkeypatch):
    # A memory_stats() that returns what is no mapping: the worker gets it as it is; kvguard counts one failure.
    namespace, method = inline_worker_method("    stats = torch.cuda.memory_stats()\n    return stats\n")
    odd = object()

    class Cuda:
        @staticmethod
        def memory_stats():
            return odd

    namespace["torch"] = type("FakeTorch", (), {"cuda": Cuda})()
    gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
    monkeypatch.setattr(gpu_worker.Worker, "determine_available_memory", method)
    monkeypatch.setattr(plugin_profile, "running_release", lambda worker=None: "vllm:0.9.0")
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    plugin.register()
    worker = start_worker()
    assert worker.determine_available_memory() is odd
    assert plugin.hook_errors == {"profile": 1}
