"""``simulate --search-utilization``: a gallop from a guess and bisection to the highest utilization that serves
without an OOM."""

import json

import pytest
from click.testing import CliRunner

from kvguard.budget.model_config import bundled_model_config_path, load_model_config
from kvguard.budget.sampler import SamplingBatch
from kvguard.cli import main
from kvguard.sim.scenario import (
    ForwardMemo,
    ScenarioConfig,
    ServingScenario,
    run_scenario,
    search_gpu_memory_utilization,
)
from kvguard.sim.workload import forward_ops


@pytest.mark.parametrize("allocator", ["torch", "torch_npu", "mindspore"])
def test_search_lands_on_the_last_utilization_that_serves(allocator):
    config = ScenarioConfig(
        model_config=load_model_config(bundled_model_config_path()),
        device_memory_bytes=32 << 30,
        allocator=allocator,
        requests=8,
        long_request_fraction=1.0,
    )
    search = search_gpu_memory_utilization(config, (0, 1))
    found = search.gpu_memory_utilization
    assert found is not None
    for seed in (0, 1):
        assert not run_scenario(config, gpu_memory_utilization=found, seed=seed).oom
    if found < 1.0:
        assert any(
            run_scenario(config, gpu_memory_utilization=round(found + 0.01, 2), seed=seed).oom for seed in (0, 1)
        )
    # A search, not a sweep: about log2(100) probes per seed.
    assert len(search.runs) <= 2 * 9
    assert search.kv_cache_memory_bytes == run_scenario(config, gpu_memory_utilization=found).kv_cache_bytes


@pytest.mark.parametrize("guess", [None, 0.01, 0.5, 0.99])
def test_the_answer_does_not_depend_on_the_guess_the_gallop_starts_from(guess, monkeypatch):
    # The search starts from the estimator's recommendation; from any start it lands where bisection does.
    import kvguard.budget.estimator as estimator

    config = ScenarioConfig(
        model_config=load_model_config(bundled_model_config_path()),
        device_memory_bytes=32 << 30,
        allocator="torch",
        requests=8,
        long_request_fraction=1.0,
    )
    unguided = search_gpu_memory_utilization(config, (0, 1)).gpu_memory_utilization
    monkeypatch.setattr(estimator, "recommended_gpu_memory_utilization", lambda profile: guess)
    search = search_gpu_memory_utilization(config, (0, 1))
    assert search.gpu_memory_utilization == unguided
    assert not run_scenario(config, gpu_memory_utilization=unguided, seed=0).oom
    # Galloping from a guess d hundredths off: about 2 log2(d) + 2 probes, each up to two seeds.
    assert len(search.runs) <= 2 * 16


def test_a_search_where_nothing_serves_finds_none():
    # Qwen2.5-7B's 15 GiB of weights on an 8 GiB device: every utilization runs out of memory loading them.
    config = ScenarioConfig(
        model_config=load_model_config(bundled_model_config_path()),
        device_memory_bytes=8 << 30,
        allocator="torch",
        requests=8,
        long_request_fraction=1.0,
    )
    search = search_gpu_memory_utilization(config, (0,))
    assert search.gpu_memory_utilization is None and search.kv_cache_memory_bytes is None
    assert [run.gpu_memory_utilization for run in search.runs][-1] == 0.01 and all(run.oom for run in search.runs)


def test_search_json_fields():
    result = CliRunner().invoke(
        main,
        [
            "simulate",
            "--allocator",
            "mindspore",
            "--requests",
            "8",
            "--long-fraction",
            "1",
            "--search-utilization",
            "--seed",
            "0",
            "--seed",
            "2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    search = json.loads(result.output)["search"]
    assert set(search) >= {
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "num_runs",
        "runs",
        "recommended_gpu_memory_utilization",
    }
    assert {run["seed"] for run in search["runs"]} == {0, 2}


def test_several_seeds_without_search_is_refused():
    result = CliRunner().invoke(main, ["simulate", "--seed", "0", "--seed", "1"])
    assert result.exit_code == 64 and "with --search-utilization" in result.output  # usage, in one line
    assert len(result.output.strip().splitlines()) == 1


# The forward memo (ServingScenario._forward): a steady forward replayed from the same allocator state, and
# repeated decoder layers skipped, must leave every figure as executing each op does.


def _plain_forward(self, num_tokens, num_seqs, gathered, profile_sampler=False, sampling=SamplingBatch()):
    self._execute(
        list(
            forward_ops(self.shape, num_tokens, num_seqs, gathered, profile_sampler=profile_sampler, sampling=sampling)
        )
    )


def _everything(result):
    return (result.to_dict(), result.timeline, result.memory_stats, result.device_peak_used_bytes)


QWEN = load_model_config(bundled_model_config_path())
# Llama-3.1-70B's architecture (its public config.json's fields), at TP 4: 80 identical decoder layers.
LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MEMO_CASES = {
    "torch": dict(model_config=QWEN, device_memory_bytes=32 << 30, allocator="torch"),
    "torch near OOM": dict(
        model_config=QWEN,
        device_memory_bytes=32 << 30,
        allocator="torch",
        gpu_memory_utilization=0.97,
        long_request_fraction=1.0,
        requests=16,
    ),
    "torch_npu expandable": dict(
        model_config=QWEN, device_memory_bytes=32 << 30, allocator="torch_npu", expandable_segments=True
    ),
    "torch max_split_size": dict(
        model_config=QWEN,
        device_memory_bytes=24 << 30,
        allocator="torch",
        alloc_conf="max_split_size_mb:64",
        tensor_parallel_size=2,
        seed=3,
    ),
    "mindspore VMM": dict(model_config=QWEN, device_memory_bytes=32 << 30, allocator="mindspore"),
    "mindspore no VMM": dict(
        model_config=QWEN,
        device_memory_bytes=32 << 30,
        allocator="mindspore",
        ms_alloc_conf="enable_vmm: false",
        seed=1,
    ),
    "llama 70B TP4": dict(
        model_config=LLAMA_70B, device_memory_bytes=80 << 30, allocator="torch", tensor_parallel_size=4, requests=24
    ),
}


@pytest.mark.parametrize("case", list(MEMO_CASES))
def test_a_run_with_the_forward_memo_equals_one_that_runs_every_op(case, monkeypatch):
    config = ScenarioConfig(**MEMO_CASES[case])
    memo = ForwardMemo()
    fast = ServingScenario(config, memo).run()
    assert memo.steady, "no forward was recorded: the memo was not exercised"
    monkeypatch.setattr(ServingScenario, "_forward", _plain_forward)
    assert _everything(fast) == _everything(ServingScenario(config).run())


@pytest.mark.parametrize("allocator, utilization", [("torch", 0.99), ("mindspore", 0.92)])
def test_a_run_that_runs_out_of_memory_in_a_forward_is_the_same_with_the_memo(allocator, utilization, monkeypatch):
    config = ScenarioConfig(
        **{**MEMO_CASES["torch near OOM"], "allocator": allocator, "gpu_memory_utilization": utilization}
    )
    fast = ServingScenario(config).run()
    assert fast.oom and fast.oom_phase == "serving"
    monkeypatch.setattr(ServingScenario, "_forward", _plain_forward)
    assert _everything(fast) == _everything(ServingScenario(config).run())


@pytest.mark.parametrize("allocator", ["torch", "mindspore"])
def test_a_search_sharing_its_forwards_equals_one_that_runs_every_op(allocator, monkeypatch):
    config = ScenarioConfig(model_config=QWEN, device_memory_bytes=32 << 30, allocator=allocator, requests=24)
    fast = search_gpu_memory_utilization(config, (0, 1, 2))
    monkeypatch.setattr(ServingScenario, "_forward", _plain_forward)
    slow = search_gpu_memory_utilization(config, (0, 1, 2))
    assert fast.to_dict() == slow.to_dict()
    assert [_everything(r) for r in fast.results] == [_everything(r) for r in slow.results]


def test_a_watched_allocator_sees_every_op_of_the_profile_forward():
    # guarded.BudgetWatch records the allocator's calls up to the budget and rebuilds the allocator from them:
    # no forward may be replayed or have its layers skipped while it watches.
    from kvguard.sim.guarded import BudgetWatch
    from kvguard.sim.workload import weight_tensors

    config = ScenarioConfig(**MEMO_CASES["llama 70B TP4"])
    scenario = ServingScenario(config)
    watch = BudgetWatch(scenario)
    scenario.startup()
    assert watch.captured
    profile_ops = forward_ops(
        scenario.shape,
        config.max_num_batched_tokens,
        min(config.max_num_seqs, config.max_num_batched_tokens),
        profile_sampler=config.profile_runs_sampler,
    )
    expected = len(weight_tensors(scenario.shape)) + sum(1 for _, size in profile_ops if size is not None)
    assert sum(1 for name, _, _ in watch.events if name == "malloc") == expected
