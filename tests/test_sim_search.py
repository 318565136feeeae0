"""``simulate --search-utilization``: bisection to the highest utilization that serves without an OOM."""

import json

import pytest
from click.testing import CliRunner

from kvguard.cli import main
from kvguard.budget.model_config import bundled_model_config_path, load_model_config
from kvguard.sim.scenario import ScenarioConfig, run_scenario, search_gpu_memory_utilization


@pytest.mark.parametrize("allocator", ["torch", "torch_npu", "mindspore"])
def test_search_lands_on_the_last_utilization_that_serves(allocator):
    config = ScenarioConfig(model_config=load_model_config(bundled_model_config_path()), device_memory_bytes=32 << 30,
                            allocator=allocator, requests=8, long_request_fraction=1.0)
    search = search_gpu_memory_utilization(config, (0, 1))
    found = search.gpu_memory_utilization
    assert found is not None
    for seed in (0, 1):
        assert not run_scenario(config, gpu_memory_utilization=found, seed=seed).oom
    if found < 1.0:
        assert any(run_scenario(config, gpu_memory_utilization=round(found + 0.01, 2), seed=seed).oom
                   for seed in (0, 1))
    # A search, not a sweep: about log2(100) probes per seed.
    assert len(search.runs) <= 2 * 9
    assert search.kv_cache_memory_bytes == run_scenario(config, gpu_memory_utilization=found).kv_cache_bytes


def test_search_json_fields():
    result = CliRunner().invoke(main, ["simulate", "--allocator", "mindspore", "--requests", "8", "--long-fraction",
                                       "1", "--search-utilization", "--seed", "0", "--seed", "2", "--json"])
    assert result.exit_code == 0, result.output
    search = json.loads(result.output)["search"]
    assert set(search) >= {"gpu_memory_utilization", "kv_cache_memory_bytes", "num_runs", "runs",
                           "recommended_gpu_memory_utilization"}
    assert {run["seed"] for run in search["runs"]} == {0, 2}


def test_several_seeds_without_search_is_refused():
    result = CliRunner().invoke(main, ["simulate", "--seed", "0", "--seed", "1"])
    assert result.exit_code == 1 and "with --search-utilization" in result.output
