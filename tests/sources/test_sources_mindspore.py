"""The mindspore source against the real MindSpore CPU build, plus real key shapes of other releases."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest

mindspore = pytest.importorskip("mindspore")

from kvguard.records import PoolFigures  # noqa: E402
from kvguard.sources import SourceError, SourceUnavailable, get_source  # noqa: E402
from kvguard.sources.mindspore import (  # noqa: E402
    MindSporeSource,
    PoolBlocks,
    device_label,
    device_memory_from_stats,
    is_mindspore_stats,
    pool_blocks,
)

GIB = 1 << 30
MIB = 1 << 20


def load(data_path, name):
    with open(data_path("memory_stats", name)) as handle:
        return json.load(handle)


def test_real_runtime_memory_stats_has_the_keys_the_source_reads():
    stats = mindspore.runtime.memory_stats()
    for key in (
        "total_reserved_memory",
        "total_allocated_memory",
        "total_idle_memory",
        "total_eager_free_memory",
        "max_reserved_memory",
        "max_allocated_memory",
    ):
        assert isinstance(stats[key], int), key


def test_real_cpu_sample_reads_zero_counters_as_zero():
    [record] = MindSporeSource().sample()
    assert record.device == "cpu"
    assert record.source == "mindspore"
    counters = (
        record.allocated_bytes,
        record.reserved_bytes,
        record.peak_allocated_bytes,
        record.peak_reserved_bytes,
        record.idle_bytes,
        record.eager_free_bytes,
    )
    assert counters == (0, 0, 0, 0, 0, 0)


def test_real_cpu_sample_leaves_fields_mindspore_lacks_as_none():
    [record] = get_source("mindspore").sample()
    assert (record.alloc_retries, record.ooms, record.inactive_split_bytes, record.active_bytes) == (None,) * 4
    assert (record.total_bytes, record.free_bytes) == (None, None)  # CPU has no device properties


def test_without_runtime_api_the_real_hal_api_is_used(monkeypatch):
    # Releases before 2.5 have no mindspore.runtime memory API; hal.memory_stats(device_target) serves.
    monkeypatch.delattr(mindspore.runtime, "memory_stats")
    calls = []
    real = mindspore.hal.memory_stats
    monkeypatch.setattr(mindspore.hal, "memory_stats", lambda target=None: calls.append(target) or real(target))
    [record] = MindSporeSource().sample()
    assert calls == ["CPU"]
    assert record.device == "cpu"


def test_real_hal_stats_after_an_op_are_read(monkeypatch):
    import numpy as np

    mindspore.Tensor(np.ones((4, 4), np.float32)) + 1  # initialises the CPU backend
    monkeypatch.delattr(mindspore.runtime, "memory_stats")
    assert "total_allocated_memory" in mindspore.hal.memory_stats("CPU")
    [record] = MindSporeSource().sample()
    assert (record.allocated_bytes, record.reserved_bytes, record.idle_bytes) == (0, 0, 0)


def test_hal_before_backend_initialised_gives_unknown_counters(monkeypatch):
    # The real hal.memory_stats returns {} until the backend has run something.
    monkeypatch.delattr(mindspore.runtime, "memory_stats")
    monkeypatch.setattr(mindspore.hal, "memory_stats", lambda target=None: {})
    [record] = MindSporeSource().sample()
    assert (record.allocated_bytes, record.reserved_bytes) == (None, None)


def test_neither_api_is_a_one_line_unavailable():
    bare = types.SimpleNamespace(
        get_context=lambda key: {"device_target": "Ascend", "device_id": 0}[key],
        runtime=types.SimpleNamespace(),
        hal=types.SimpleNamespace(),
    )
    with pytest.raises(SourceUnavailable, match="neither runtime.memory_stats nor hal.memory_stats"):
        MindSporeSource(bare).sample()


def test_ascend_stats_and_device_properties_are_read(data_path):
    stats = load(data_path, "mindspore-2.5-ascend-serving.json")
    properties = types.SimpleNamespace(name="Ascend910B3", total_memory=64 * GIB, free_memory=4 * GIB)
    fake = types.SimpleNamespace(
        get_context=lambda key: {"device_target": "Ascend", "device_id": 5}[key],
        runtime=types.SimpleNamespace(memory_stats=lambda: stats),
        hal=types.SimpleNamespace(get_device_properties=lambda device_id, target=None: properties),
    )
    [record] = MindSporeSource(fake).sample()
    assert record.device == "npu:5"
    assert record.allocated_bytes == stats["total_allocated_memory"]
    assert record.reserved_bytes == stats["total_reserved_memory"]
    assert record.idle_bytes == stats["total_idle_memory"]
    assert (record.total_bytes, record.free_bytes, record.used_bytes) == (64 * GIB, 4 * GIB, 60 * GIB)


def test_misspelled_allocated_key_is_accepted(data_path):
    stats = load(data_path, "mindspore-2.3-misspelled-keys.json")
    record = device_memory_from_stats(stats, "npu:0")
    assert "total_allocated_memory" not in stats
    assert record.allocated_bytes == stats["total_allocatd_memory"]
    assert record.fragmentation_bytes == stats["total_reserved_memory"] - stats["total_allocatd_memory"]


def test_correct_spelling_wins_over_the_misspelling():
    record = device_memory_from_stats({"total_allocated_memory": 10, "total_allocatd_memory": 99}, "npu:0")
    assert record.allocated_bytes == 10


def test_eager_free_memory_is_reported(data_path):
    stats = dict(load(data_path, "mindspore-2.5-ascend-serving.json"), total_eager_free_memory=3 * GIB)
    assert device_memory_from_stats(stats, "npu:0").eager_free_bytes == 3 * GIB


def test_uninitialised_ascend_device_properties_read_as_unknown():
    properties = types.SimpleNamespace(name="", total_memory=0, free_memory=0)
    fake = types.SimpleNamespace(
        get_context=lambda key: {"device_target": "Ascend", "device_id": 0}[key],
        runtime=types.SimpleNamespace(memory_stats=lambda: {}),
        hal=types.SimpleNamespace(get_device_properties=lambda device_id, target=None: properties),
    )
    [record] = MindSporeSource(fake).sample()
    assert (record.total_bytes, record.free_bytes) == (None, None)


def test_a_mindspore_error_becomes_one_line_source_error():
    def broken():
        raise RuntimeError("The pointer[device_context] is null.\n\n----------------------------------------")

    fake = types.SimpleNamespace(
        get_context=lambda key: {"device_target": "Ascend", "device_id": 0}[key],
        runtime=types.SimpleNamespace(memory_stats=broken),
    )
    with pytest.raises(SourceError) as info:
        MindSporeSource(fake).sample()
    assert str(info.value).startswith("mindspore: The pointer[device_context] is null.")
    assert "\n" not in str(info.value)


def test_device_labels_follow_kvguard_names():
    assert [device_label("Ascend", 3), device_label("GPU", 1), device_label("CPU", 0)] == ["npu:3", "cuda:1", "cpu"]


# ---------------------------------------------------------------------------- peaks after a reset


def test_a_peak_reported_as_an_increase_since_the_reset_is_never_below_allocated(data_path):
    # A 2.4-2.6 build after vLLM's reset_peak_memory_stats(): max_allocated_memory is the peak
    # *increase* since the reset (here 2 GiB over 25 GiB held), max_reserved_memory reserved now
    # minus reserved at the reset.
    stats = dict(
        load(data_path, "mindspore-2.5-ascend-serving.json"),
        total_allocated_memory=25 * GIB,
        total_reserved_memory=30 * GIB,
        max_allocated_memory=2 * GIB,
        max_reserved_memory=0,
    )
    record = device_memory_from_stats(stats, "npu:0")
    assert (record.peak_allocated_bytes, record.peak_reserved_bytes) == (25 * GIB, 30 * GIB)


def test_an_absolute_peak_above_the_current_figure_is_kept(data_path):
    stats = load(data_path, "mindspore-2.5-ascend-serving.json")
    record = device_memory_from_stats(stats, "npu:0")
    assert record.peak_allocated_bytes == stats["max_allocated_memory"] > stats["total_allocated_memory"]
    assert record.peak_reserved_bytes == stats["max_reserved_memory"] > stats["total_reserved_memory"]


def test_the_simulated_pool_after_a_reset_reads_with_its_peak_at_least_allocated():
    from kvguard.allocators.device import Device
    from kvguard.allocators.mindspore_pool import DynamicMemPool

    pool = DynamicMemPool(Device(64 * GIB), version="2.5.0")
    pool.malloc(20 * GIB)
    pool.reset_peak_memory_stats()
    pool.free(pool.malloc(1 * GIB))
    stats = pool.memory_stats()
    assert stats["max_allocated_memory"] == 1 * GIB  # the increase since the reset
    record = device_memory_from_stats(stats, "npu:0")
    assert record.peak_allocated_bytes == record.allocated_bytes == 20 * GIB


@pytest.mark.parametrize(
    "version", ["2.4.0", "2.4.1", "2.4.10", "2.5.0", "2.6.0", "2.7.0", "2.7.1", "2.7.2", "2.8.0", "2.9.0", "2.10.0"]
)
def test_every_release_of_the_simulated_pool_reads_back_through_the_source(version):
    # 20 GiB used in a 32 GiB common block (the 1 GiB unit doubled five times), 1 GiB persistent block.
    from kvguard.allocators.device import Device
    from kvguard.allocators.mindspore_pool import DynamicMemPool

    pool = DynamicMemPool(Device(64 * GIB), version=version, task_sink=False)  # doubling: after a compile
    pool.malloc(1 * GIB, persistent=True)
    pool.malloc(20 * GIB)
    stats = pool.memory_stats()
    record = device_memory_from_stats(stats, "npu:0")
    assert (record.allocated_bytes, record.reserved_bytes) == (21 * GIB, 33 * GIB)
    assert pool_blocks(stats) == {"common": PoolBlocks(1, GIB), "persistent": PoolBlocks(1, GIB)}


# ---------------------------------------------------------------------------- the pool dicts


def test_pool_blocks_are_read_under_the_misspelled_common_key(data_path):
    stats = load(data_path, "mindspore-2.3-misspelled-keys.json")
    assert "common_mem_pool_stats" not in stats and "commom_mem_pool_stats" in stats
    assert pool_blocks(stats) == {"common": PoolBlocks(6, GIB), "persistent": PoolBlocks(24, GIB)}


def test_pool_blocks_are_read_under_the_correct_common_key(data_path):
    stats = load(data_path, "mindspore-2.5-ascend-serving.json")
    assert pool_blocks(stats) == {"common": PoolBlocks(9, 2 * GIB), "persistent": PoolBlocks(18, 2 * GIB)}


def test_the_real_cpu_build_has_readable_pool_dicts():
    assert pool_blocks(mindspore.runtime.memory_stats()) == {"common": PoolBlocks(0, 0), "persistent": PoolBlocks(0, 0)}


def test_odd_pool_dicts_read_as_unknown_not_errors(data_path):
    stats = dict(load(data_path, "mindspore-2.3-misspelled-keys.json"), persistent_mem_pool_stats=[1, 2])
    stats["commom_mem_pool_stats"] = {"block_counts": -1, "block_unit_size": "1GiB", "blocks_info": {}}
    assert pool_blocks(stats) == {"common": PoolBlocks(None, None), "persistent": PoolBlocks(None, None)}
    assert device_memory_from_stats(stats, "npu:0").allocated_bytes == stats["total_allocatd_memory"]


def test_a_dict_with_only_pool_stats_is_recognised_as_mindspores():
    assert is_mindspore_stats({"commom_mem_pool_stats": {"block_counts": 0, "block_unit_size": 0}})


# ---------------------------------------------------------------------------- idle memory: no credit from counters


@pytest.mark.parametrize(
    "stats, total",
    [
        # 2.6+ under VMM: reserved (3 GiB of 2 MiB handles) fits the device; eager-free address space > 0. The
        # compiled pool gives this dict byte for byte for a state where a 30 MiB request is served and one where
        # it is refused (40 idle 1 MiB pieces between used ones): the counters cannot say how much a miss reclaims.
        (
            {"total_reserved_memory": 3 * GIB, "total_allocated_memory": 2 * GIB, "total_eager_free_memory": 28 * GIB},
            32 * GIB,
        ),
        (
            {"total_reserved_memory": 3 * GIB, "total_allocated_memory": 2 * GIB, "total_eager_free_memory": 0},
            32 * GIB,
        ),  # VMM off: block tails
        (
            {"total_reserved_memory": 64 * GIB, "total_allocated_memory": 2 * GIB, "total_eager_free_memory": 61 * GIB},
            32 * GIB,
        ),  # 2.4/2.5: address space
        (
            {"total_reserved_memory": 3 * GIB, "total_allocated_memory": 2 * GIB, "total_eager_free_memory": 28 * GIB},
            None,
        ),  # device size unknown
    ],
)
def test_the_inactive_split_stays_unknown_with_vmm_or_without(stats, total):
    record = device_memory_from_stats(stats, "npu:0", total_bytes=total)
    assert (record.inactive_split_bytes, record.reclaimable_bytes, record.largest_idle_bytes) == (None, None, None)


def test_exact_figures_under_vmm_give_reserved_less_the_pages_used_buffers_touch():
    stats = {"total_reserved_memory": 3 * GIB, "total_allocated_memory": 2 * GIB, "total_eager_free_memory": 28 * GIB}
    figures = PoolFigures(
        vmm=True, used_bytes=2 * GIB, pages_touched_by_used=1100, largest_idle_common_bytes=0, written_at=1.7e9
    )
    record = device_memory_from_stats(stats, "npu:0", free_bytes=28 * GIB, total_bytes=32 * GIB, figures=figures)
    assert (record.reclaimable_bytes, record.largest_idle_bytes) == (3 * GIB - 1100 * 2 * MIB, None)
    assert (record.pool_figures_allocated_bytes, record.pool_figures_at) == (2 * GIB, 1.7e9)


def test_exact_figures_without_vmm_give_the_common_pools_largest_idle_buffer():
    stats = {"total_reserved_memory": 3 * GIB, "total_allocated_memory": 2 * GIB, "total_eager_free_memory": 0}
    figures = PoolFigures(vmm=False, used_bytes=2 * GIB, pages_touched_by_used=1100, largest_idle_common_bytes=96 * MIB)
    record = device_memory_from_stats(stats, "npu:0", figures=figures)
    assert (record.reclaimable_bytes, record.largest_idle_bytes) == (None, 96 * MIB)


def test_with_the_dump_setting_the_source_reads_the_newest_dump_of_its_working_directory(
    data_path, tmp_path, monkeypatch
):
    dump = Path(data_path("mindspore_dump", "2.7.1-vmm-MemoryDebugInfo0.txt"))
    truth = json.loads(Path(data_path("mindspore_dump", "2.7.1-vmm-pool-lists.json")).read_text())
    shutil.copy(dump, tmp_path / "MemoryDebugInfo3.txt")
    monkeypatch.chdir(tmp_path)
    stats = {
        "total_reserved_memory": truth["reserved_bytes"],
        "total_allocated_memory": truth["allocated_bytes"],
        "total_eager_free_memory": 10 * GIB,
    }
    fake = types.SimpleNamespace(
        get_context=lambda key: {"device_target": "Ascend", "device_id": 0}[key],
        runtime=types.SimpleNamespace(memory_stats=lambda: stats),
        hal=types.SimpleNamespace(),
    )
    source = MindSporeSource(fake)

    def read():
        # The counters on the engine's thread (sample), the file on the probe's (complete): kvguard.probe.
        return source.complete(source.sample())

    monkeypatch.delenv("KVGUARD_MINDSPORE_DUMP", raising=False)
    assert read()[0].reclaimable_bytes is None
    monkeypatch.setenv("KVGUARD_MINDSPORE_DUMP", "1")
    assert source.sample()[0].reclaimable_bytes is None  # the engine's part reads no file
    [record] = read()
    assert record.reclaimable_bytes == truth["reserved_bytes"] - truth["pages_touched_by_used"] * 2 * MIB
    assert record.pool_figures_allocated_bytes == truth["used_bytes"] == record.allocated_bytes
    (tmp_path / "MemoryDebugInfo4.txt").write_text("cut sh")
    assert read()[0].reclaimable_bytes == record.reclaimable_bytes
    assert source.dump_skipped == {"truncated": 1}


# ---------------------------------------------------------------------------- the engine's error or the call's own


def test_a_read_that_fails_once_hands_back_the_engines_error_and_one_that_fails_again_is_the_sources():
    """MindSpore's memory calls rethrow the pipeline's pending error once and clear it (ms_exception.h:55-62
    @ r2.7.rc1): a second call tells the engine's error (it then succeeds) from the call's own failure."""
    from kvguard.sources import EngineError
    from kvguard.sources.mindspore import read_telling_engine_errors

    pending = [RuntimeError("For 'Gather', the 'input_indices' should be in the range [0, 4), but got 99")]

    def memory_stats():
        if pending:
            raise pending.pop()
        return {"total_reserved_memory": GIB}

    with pytest.raises(EngineError) as raised:
        read_telling_engine_errors(memory_stats)
    assert "Gather" in str(raised.value.original)
    assert read_telling_engine_errors(memory_stats) == {"total_reserved_memory": GIB}

    def broken():
        raise RuntimeError("The pointer[device_context] is null.")

    with pytest.raises(SourceError) as raised:
        read_telling_engine_errors(broken)
    assert not isinstance(raised.value, EngineError)


def test_a_dump_the_probe_cannot_read_is_a_visible_counted_skip(data_path, tmp_path, monkeypatch, caplog):
    """Exact mode through the probe: a cut-short dump leaves no figures and no error of the sample, but a
    skipped_total in the snapshot, logged once."""
    from kvguard.probe import Probe
    from kvguard.spool.io import read_spool

    folder = tmp_path / "cwd"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setenv("KVGUARD_MINDSPORE_DUMP", "1")
    dump = Path(data_path("mindspore_dump", "2.7.1-vmm-MemoryDebugInfo0.txt")).read_text()
    (folder / "MemoryDebugInfo0.txt").write_text(dump[: len(dump) // 3])
    stats = {"total_reserved_memory": 3 * GIB, "total_allocated_memory": 2 * GIB, "total_eager_free_memory": GIB}
    fake = types.SimpleNamespace(
        get_context=lambda key: {"device_target": "Ascend", "device_id": 0}[key],
        runtime=types.SimpleNamespace(memory_stats=lambda: stats),
        hal=types.SimpleNamespace(),
    )
    probe = Probe(str(tmp_path / "spool"), MindSporeSource(fake), interval=60)
    try:
        assert probe.run_once() == 1  # read on this (the engine's) thread; the dump on the writer's
        [snapshot] = read_spool(str(tmp_path / "spool")).snapshots
    finally:
        probe.stop()
    assert snapshot.memory.reclaimable_bytes is None and snapshot.probe.errors_total == 0
    assert snapshot.probe.skipped_total == 1
    assert "truncated" in caplog.text and "MemoryDebugInfo0.txt" in caplog.text
