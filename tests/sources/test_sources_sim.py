"""The sim source: simulated ranks read by the real sources' key-reading code, restarted forever."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from kvguard.budget.model_config import bundled_model_config_path, load_model_config
from kvguard.sim.source import SimSource
from kvguard.sources import SourceError, get_source, mindspore as mindspore_source, rank_contexts, torch as torch_source


def sampled_and_reread(allocator, reader, device):
    """One sim rank's record, and what ``reader`` (a real source's stats reader) makes of that rank's stats and
    device memory, given the record's identity labels (the sim's, which the reader does not make)."""
    source = SimSource(ranks=1, allocator=allocator)
    [record] = source.sample()
    scenario = source._scenarios[0]
    free, total = scenario.device_memory()
    reread = reader(scenario.memory_stats(), device, "sim", free_bytes=free, total_bytes=total)
    return record, replace(reread, device_uuid=record.device_uuid, pci_bus_id=record.pci_bus_id)


def test_torch_ranks_are_read_with_the_torch_sources_reader():
    record, reread = sampled_and_reread("torch", torch_source.device_memory_from_stats, "cuda:0")
    assert record == reread
    assert record.reserved_bytes >= record.allocated_bytes > 0


def test_mindspore_ranks_are_read_with_the_mindspore_sources_reader():
    record, reread = sampled_and_reread("mindspore", mindspore_source.device_memory_from_stats, "npu:0")
    assert record == reread
    assert record.idle_bytes is not None and record.alloc_retries is None


def test_n_ranks_have_distinct_devices_ranks_and_seeds():
    source = get_source("sim", ranks=3, allocator="torch_npu")
    records = source.sample()
    contexts = rank_contexts(source)
    assert [r.device for r in records] == ["npu:0", "npu:1", "npu:2"]
    assert [contexts[d].rank for d in ("npu:0", "npu:1", "npu:2")] == [0, 1, 2]
    assert [s.config.seed for s in source._scenarios] == [0, 1, 2]


def test_each_rank_carries_its_profile_and_kv_cache():
    source = SimSource(ranks=2)
    source.sample()
    context = rank_contexts(source)["cuda:1"]
    scenario = source._scenarios[1]
    assert context.profile == scenario.profile
    assert context.kv_cache.num_blocks == scenario.num_blocks
    assert context.kv_cache.block_bytes == scenario.kv_layout.block_bytes


def test_steps_per_sample_sets_the_pace():
    source = SimSource(ranks=1, steps_per_sample=7)
    source.sample()
    source.sample()
    assert source._scenarios[0].step_index == 14


def test_a_finished_scenario_is_shown_once_then_restarted_with_a_new_seed():
    source = SimSource(ranks=2, requests=2, steps_per_sample=10_000)
    source.sample()  # runs both ranks to the end
    assert all(s.finished for s in source._scenarios)
    source.sample()  # restarts them
    assert source.restarts == 2
    assert [s.config.seed for s in source._scenarios] == [2, 3]


def test_an_oom_scenario_keeps_the_demo_running():
    # MindSpore's pool without VMM under the reserved budget cannot place its KV cache on this device
    # (tests/sim/test_sim_scenario.py, the seed story without VMM).
    source = SimSource(ranks=1, allocator="mindspore", budget="reserved", ms_alloc_conf="enable_vmm:False")
    for _ in range(4):
        assert len(source.sample()) == 1
    assert source.restarts >= 1


def test_model_configs_are_read_by_the_model_config_loader(tmp_path):
    bundled = load_model_config(bundled_model_config_path())
    assert bundled["model_type"] == "qwen2"
    assert SimSource()._base.model_config == bundled
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 28,')
    with pytest.raises(SourceError, match=f"^sim model config {tmp_path}: model config .* is not valid JSON"):
        SimSource(model_config=str(tmp_path))  # a model directory, as everywhere else


def test_bad_options_are_one_line_errors():
    with pytest.raises(SourceError, match="sim ranks must be an integer from 1 to 64"):
        SimSource(ranks=0)
    with pytest.raises(SourceError, match="sim scenario: unknown allocator 'jax'"):
        SimSource(allocator="jax")
    with pytest.raises(SourceError, match="sim model config /nonexistent.json"):
        SimSource(model_config="/nonexistent.json")


def test_simulated_devices_have_stable_distinct_identities_shaped_like_the_real_ones():
    first = SimSource(ranks=3, allocator="torch").sample()
    again = SimSource(ranks=3, allocator="torch", seed=99).sample()  # another run, other requests
    assert [(r.device_uuid, r.pci_bus_id) for r in first] == [(r.device_uuid, r.pci_bus_id) for r in again]
    assert len({r.device_uuid for r in first}) == len({r.pci_bus_id for r in first}) == 3
    hexes = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    assert all(re.fullmatch(f"GPU-{hexes}", r.device_uuid) for r in first)
    assert all(re.fullmatch(r"[0-9A-F]{8}:[0-9A-F]{2}:00\.0", r.pci_bus_id) for r in first)
    npus = SimSource(ranks=64, allocator="mindspore").sample()
    assert [r.device_uuid for r in npus[:2]] == ["npu-phy-0", "npu-phy-1"]
    assert all(re.fullmatch(r"0000:[0-9A-F]{2}:00\.0", r.pci_bus_id) for r in npus)
