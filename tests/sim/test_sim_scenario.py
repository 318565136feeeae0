"""vLLM serving scenarios on the simulated allocators: the stepper API, the startup
measurement, the seed story and a scenario suite across models, devices and allocators."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvguard.budget.estimator import ConfigError, kv_layout_from_config, reserved_kv_cache_bytes, stock_kv_cache_bytes
from kvguard.sim.scenario import ScenarioConfig, ServingScenario
from kvguard.sim.workload import forward_ops, model_shape, weight_tensors

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def model(name):
    for base in (ROOT / "tests/data/configs", ROOT / "exporter/kvguard/examples"):
        path = base / name / "config.json"
        if path.exists():
            return json.loads(path.read_text())
    raise FileNotFoundError(name)


QWEN = model("qwen2.5-7b-instruct")
MIB = 1 << 20
# The seed story's setting: Qwen2.5-7B-Instruct on a 32 GiB device (an Atlas 910B4), MindSpore's pool,
# utilization 0.9, long requests, under the releases of the seed's time: vllm-mindspore 0.2.0 at the
# fix (PR !428) pins MindSpore master b6f48709 (2.6.0's pool rules) and sets no MS_ALLOC_CONF, so VMM
# is MindSpore's own default on a 910B: on.
STORY = ScenarioConfig(
    model_config=QWEN,
    device_memory_bytes=32 * GIB,
    gpu_memory_utilization=0.9,
    allocator="mindspore",
    requests=8,
    long_request_fraction=1.0,
    seed=0,
    vllm_mindspore_version="0.2.0",
)
NO_VMM = replace(STORY, ms_alloc_conf="enable_vmm:False")


def run(config, **overrides):
    return ServingScenario(replace(config, **overrides)).run()


# ----------------------------------------------------------------------------- the seed story, re-derived
def test_story_runs_on_mindspore_2_6_rules_with_vmm_on():
    assert (STORY.mindspore_release.version, STORY.enable_vmm) == ("2.6.0", True)
    assert (NO_VMM.mindspore_release.version, NO_VMM.enable_vmm) == ("2.6.0", False)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_story_with_the_seed_era_defaults_neither_budget_runs_out(seed):
    # VMM maps 2 MiB pages and eager-frees idle ones on a miss, so no block tail is lost: the stock
    # budget's headroom (32 - 1 runtime - 14.19 weights - 13.69 KV = 3.12 GiB) holds every serving step.
    for budget in ("stock", "reserved"):
        result = run(STORY, budget=budget, seed=seed)
        assert not result.oom, (budget, seed)
        assert result.requests_finished == STORY.requests


def test_story_under_vmm_the_reserved_increase_is_whole_pages_above_the_allocated_one():
    profile = ServingScenario(STORY).startup()
    assert profile.peak_reserved_increase_bytes % (2 * MIB) == 0
    assert profile.peak_allocated_increase_bytes < profile.peak_reserved_increase_bytes


def test_without_vmm_the_weights_spill_into_the_common_pool():
    # A persistent miss goes to the common allocator, which expands: one persistent block stays.
    scenario = ServingScenario(NO_VMM)
    scenario.startup()
    stats = scenario.memory_stats()
    assert stats["persistent_mem_pool_stats"]["block_counts"] == 1
    assert stats["commom_mem_pool_stats"]["block_counts"] > 1


def test_without_vmm_the_profile_run_fits_the_spilled_blocks_tails():
    profile = ServingScenario(NO_VMM).startup()
    assert profile.peak_reserved_increase_bytes == 0 < profile.peak_allocated_increase_bytes


def test_without_vmm_the_reserved_budget_grants_more_and_cannot_place_its_kv_cache():
    # Delta reserved 0 < delta allocated: the fix's budget is 0.92 GiB (1,079 blocks) larger; one K
    # tensor of 17,103 blocks x 16 KiB (267 MiB) finds no block tail and no room for a block.
    # The stock budget places its cache but, inside MindSpore's pool budget (15/16 of the 31 GiB free
    # less 10 MiB: 29.05 GiB), runs out at the first serving step.
    stock, reserved = run(NO_VMM, budget="stock"), run(NO_VMM, budget="reserved")
    assert (stock.oom_phase, stock.requests_finished) == ("serving", 0)
    assert reserved.num_blocks - stock.num_blocks == 1079
    assert (reserved.oom_phase, reserved.oom_request_bytes) == ("kv_cache", 17103 * 16384)


def watched(config):
    """A scenario whose allocator notes its counters at each peak reset and before each empty_cache."""
    scenario = ServingScenario(config)
    alloc = scenario.allocator
    resets, before_empty = [], []
    real_reset, real_empty = alloc.reset_peak_memory_stats, alloc.empty_cache

    def reset():
        real_reset()
        resets.append((alloc.allocated_bytes, alloc.reserved_bytes))

    def empty_cache():
        before_empty.append((alloc.peak_allocated_bytes, alloc.peak_reserved_bytes))
        real_empty()

    alloc.reset_peak_memory_stats, alloc.empty_cache = reset, empty_cache
    return scenario, resets, before_empty


def test_story_budgets_differ_by_the_profile_runs_reserved_minus_allocated_increase():
    scenario, resets, before_empty = watched(replace(STORY, budget="stock"))
    stock = scenario.run()
    reserved = run(STORY, budget="reserved")
    assert stock.profile == reserved.profile
    # What the allocator itself saw over the profile run: from the second peak reset (memory_profiling's)
    # to the empty_cache after the forward.
    (allocated_at_reset, reserved_at_reset), (peak_allocated, peak_reserved) = resets[1], before_empty[1]
    gap = (peak_reserved - reserved_at_reset) - (peak_allocated - allocated_at_reset)
    assert gap > 0
    assert stock.kv_cache_bytes - reserved.kv_cache_bytes == gap


def test_story_at_a_roomy_utilization_neither_budget_runs_out_with_vmm():
    for budget in ("stock", "reserved"):
        result = run(STORY, budget=budget, gpu_memory_utilization=0.8)
        assert not result.oom, budget
        assert result.requests_finished == STORY.requests


def test_story_at_a_roomy_utilization_without_vmm_the_reserved_budget_fills_the_pool_budget():
    # 0.8 x 32 GiB is below the pool's 29.05 GiB budget, but without VMM the reserved budget's larger
    # KV cache and the 1 GiB blocks' tails reach it (29.0 GiB of blocks, 25.6 GiB allocated).
    stock = run(NO_VMM, budget="stock", gpu_memory_utilization=0.8)
    reserved = run(NO_VMM, budget="reserved", gpu_memory_utilization=0.8)
    assert (stock.oom, stock.requests_finished) == (False, NO_VMM.requests)
    assert (reserved.oom_phase, reserved.requests_finished) == ("serving", 0)


# ----------------------------------------------------------------------------- startup as vLLM measures it
def test_weights_are_measured_as_the_allocated_increase():
    scenario = ServingScenario(STORY)
    profile = scenario.startup()
    assert profile.weights_bytes == sum(weight_tensors(model_shape(QWEN))) == 15_231_233_024


def test_profile_allocated_increase_is_the_forward_pass_live_peak():
    scenario = ServingScenario(STORY)
    profile = scenario.startup()
    live, peak, current = {}, 0, 0
    for key, size in forward_ops(model_shape(QWEN), STORY.max_num_batched_tokens, STORY.max_num_seqs):
        if size is None:
            current -= live.pop(key)
        else:
            live[key] = -(-size // 512) * 512  # MindSpore's 512-byte alignment
            current += live[key]
            peak = max(peak, current)
    assert profile.peak_allocated_increase_bytes == peak


def test_kv_cache_is_sized_by_the_estimator_and_allocated_per_layer():
    for budget, formula in (("stock", stock_kv_cache_bytes), ("reserved", reserved_kv_cache_bytes)):
        scenario = ServingScenario(replace(STORY, budget=budget))
        profile = scenario.startup()
        layout = kv_layout_from_config(QWEN)
        assert scenario.kv_cache_bytes == formula(profile)
        assert scenario.num_blocks == layout.num_blocks(scenario.kv_cache_bytes)
        expected = profile.weights_bytes + scenario.num_blocks * layout.block_bytes
        assert scenario.allocator.allocated_bytes == expected


def test_profile_has_the_estimator_schema():
    data = run(STORY, budget="reserved").to_dict()
    assert set(data["profile"]) == {
        "total_memory_bytes",
        "gpu_memory_utilization",
        "weights_bytes",
        "peak_allocated_increase_bytes",
        "peak_reserved_increase_bytes",
        "non_torch_increase_bytes",
    }
    assert data["profile"]["total_memory_bytes"] == 32 * GIB


def test_non_allocator_growth_during_the_profile_run_is_the_non_torch_increase():
    profile = ServingScenario(replace(STORY, profile_non_allocator_growth_bytes=200 << 20)).startup()
    assert profile.non_torch_increase_bytes == 200 << 20


# ----------------------------------------------------------------------------- the stepper API
def test_stepper_reports_torch_stats_and_device_memory_each_step():
    scenario = ServingScenario(replace(STORY, allocator="torch", requests=2))
    scenario.startup()
    record = scenario.step()
    assert record.phase == "serving" and record.step == 0
    stats = scenario.memory_stats()
    assert stats["allocated_bytes.all.current"] == scenario.allocator.allocated_bytes
    assert stats["reserved_bytes.all.peak"] >= stats["reserved_bytes.all.current"]
    free, total = scenario.device_memory()
    assert total == 32 * GIB
    assert free == total - scenario.config.resolved_non_allocator_bytes - stats["reserved_bytes.all.current"]


def test_stepper_reports_mindspore_stats():
    scenario = ServingScenario(replace(STORY, budget="reserved", requests=2))
    scenario.step()  # starts up first
    stats = scenario.memory_stats()
    assert stats["total_allocated_memory"] == scenario.allocator.allocated_bytes
    assert "commom_mem_pool_stats" in stats  # MindSpore 2.6's spelling
    assert stats["persistent_mem_pool_stats"]["block_counts"] > 0


def test_step_after_the_end_returns_the_last_record():
    scenario = ServingScenario(replace(STORY, budget="reserved", requests=1))
    result = scenario.run()
    assert scenario.finished and result.requests_finished == 1
    assert scenario.step() == scenario.timeline[-1]


def test_same_seed_same_result_and_another_seed_another_mix():
    config = replace(
        STORY,
        allocator="torch",
        long_request_fraction=0.5,
        requests=6,
        long_output_tokens=(4, 16),
        short_output_tokens=(4, 32),
    )
    assert run(config).to_dict() == run(config).to_dict()
    assert ServingScenario(config).requests != ServingScenario(replace(config, seed=7)).requests


@pytest.mark.parametrize("long_fraction", [0.0, 1.0])
def test_requests_fit_a_short_max_model_len(long_fraction):
    # Default output ranges (up to 256 tokens) and prompts of at least 32 tokens against a 64-token
    # limit: every request is clamped to prompt + output <= max_model_len, as vLLM would insist.
    config = replace(STORY, max_model_len=64, requests=32, long_request_fraction=long_fraction)
    requests = ServingScenario(config).requests
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in requests)
    assert max(r.prompt_tokens + r.output_tokens for r in requests) <= 64


def test_no_memory_for_the_cache_blocks_is_an_error_not_an_oom():
    result = run(STORY, gpu_memory_utilization=0.45)
    assert result.error.startswith("No available memory for the cache blocks")
    assert not result.oom


def test_weights_larger_than_the_device_run_out_at_load():
    # 15 GiB less the 1 GiB runtime share holds less than the 14.19 GiB of weights, pages or blocks.
    result = run(STORY, device_memory_bytes=15 * GIB)
    assert (result.oom, result.oom_phase, result.profile) == (True, "weights", None)


# ----------------------------------------------------------------------------- odd model configs
def test_zero_attention_heads_is_a_config_error_not_a_division_by_zero():
    config = {**QWEN, "num_attention_heads": 0}
    with pytest.raises(ConfigError, match="'num_attention_heads' must be a positive integer, got 0"):
        ServingScenario(replace(STORY, model_config=config))


@pytest.mark.parametrize(
    "field", ["hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "max_position_embeddings"]
)
def test_an_infinite_config_field_is_a_config_error(field):
    # json.loads("1e400") is float("inf"): a config file can hold it.
    config = {**QWEN, field: json.loads("1e400")}
    with pytest.raises(ConfigError, match=f"'{field}' must be a positive integer, got inf"):
        ServingScenario(replace(STORY, model_config=config))


def test_a_string_config_field_is_a_config_error():
    with pytest.raises(ConfigError, match="'hidden_size' must be a positive integer, got 'abc'"):
        model_shape({**QWEN, "hidden_size": "abc"})


def test_a_negative_moe_field_is_a_config_error():
    config = {**model("deepseek-v2-lite-chat"), "n_shared_experts": -2}
    with pytest.raises(ConfigError, match="'n_shared_experts' must be a non-negative integer, got -2"):
        model_shape(config)


def test_the_workload_takes_layers_kv_heads_and_head_size_from_the_estimators_layout():
    # Falcon-style n_head_kv: the KV cache and the simulated k/v tensors agree on it.
    config = {k: v for k, v in QWEN.items() if k != "num_key_value_heads"}
    config["n_head_kv"] = 2
    for tp in (1, 2, 4):
        layout = kv_layout_from_config(config, tensor_parallel_size=tp)
        shape = model_shape(config, tp)
        assert (
            (shape.num_layers, shape.num_kv_heads, shape.head_dim)
            == (layout.num_layers, layout.num_kv_heads, layout.head_size)
            == (28, max(1, 2 // tp), 128)
        )
        assert ServingScenario(replace(STORY, model_config=config, tensor_parallel_size=tp)).shape == shape


def test_the_estimators_layout_is_checked_before_the_workload_shape():
    # hidden_size missing: both would refuse it; the estimator's message (the one `kvguard budget`
    # gives for the same file) wins.
    config = {k: v for k, v in QWEN.items() if k not in ("hidden_size", "head_dim")}
    with pytest.raises(ConfigError, match="no head size"):
        ServingScenario(replace(STORY, model_config=config))


# ----------------------------------------------------------------------------- the scenario suite
# (model, device GiB, TP, allocator, utilization, seed, MS_ALLOC_CONF) -> outcome (stock, reserved).
# "ok": every request served; "serving"/"kv_cache": where the allocator ran out. MindSpore rows run
# vllm-mindspore 0.5.1's defaults (MindSpore 2.7.1, VMM on), or with VMM turned off.
#
# MindSpore's pool may use 15/16 of the memory free when it starts, less 10 MiB (29.05 GiB of the
# 31 GiB free on 32 GiB): utilization 0.95 (30.4 GiB with the 1 GiB runtime) asks for more, so
# the KV cache does not fit under either budget, with VMM or without.
# VMM on: pages are mapped 2 MiB at a time and idle pages reclaimed on a miss; the two budgets
# differ only by page slack (0.15-0.24 GiB) and both serve at 0.90. VMM off, 1 GiB units doubled:
# - Qwen 0.90: delta reserved is 0 (the spilled weight blocks' tails hold the profile run), so the
#   reserved budget is larger and its 267 MiB K/V tensors find no room (see the story tests); the
#   stock budget places them and runs out in serving, against the pool's budget;
# - Qwen2.5-72B TP8 0.92: 40 GiB of 258 MiB K/V tensors lose their block tails under both budgets (at 0.90
#   they fit since the profile run samples its full batch, as vllm-mindspore 0.5.1's does: ok under both).
SUITE = [
    ("qwen2.5-7b-instruct", 32, 1, "mindspore", 0.90, 1, None, ("ok", "ok")),
    ("qwen2.5-7b-instruct", 32, 1, "mindspore", 0.80, 0, None, ("ok", "ok")),
    ("llama-3-8b-instruct", 32, 1, "mindspore", 0.95, 0, None, ("kv_cache", "kv_cache")),
    ("mistral-nemo-instruct-2407", 32, 1, "mindspore", 0.95, 0, None, ("kv_cache", "kv_cache")),
    ("qwen2.5-72b-instruct", 64, 8, "mindspore", 0.90, 0, None, ("ok", "ok")),
    ("qwen2.5-7b-instruct", 32, 1, "mindspore", 0.90, 1, "enable_vmm:False", ("serving", "kv_cache")),
    ("qwen2.5-7b-instruct", 32, 1, "mindspore", 0.80, 0, "enable_vmm:False", ("ok", "ok")),
    ("llama-3-8b-instruct", 32, 1, "mindspore", 0.95, 0, "enable_vmm:False", ("kv_cache", "kv_cache")),
    ("mistral-nemo-instruct-2407", 32, 1, "mindspore", 0.95, 0, "enable_vmm:False", ("kv_cache", "kv_cache")),
    ("qwen2.5-72b-instruct", 64, 8, "mindspore", 0.90, 0, "enable_vmm:False", ("ok", "ok")),
    ("qwen2.5-72b-instruct", 64, 8, "mindspore", 0.92, 0, "enable_vmm:False", ("kv_cache", "kv_cache")),
    ("qwen2.5-7b-instruct", 32, 1, "torch", 0.95, 0, None, ("ok", "ok")),
    ("qwen2.5-7b-instruct", 32, 1, "torch_npu", 0.90, 0, None, ("ok", "ok")),
    ("llama-3-8b-instruct", 80, 1, "torch", 0.95, 0, None, ("ok", "ok")),
    ("deepseek-v2-lite-chat", 64, 1, "torch", 0.90, 0, None, ("ok", "ok")),
]


@pytest.mark.parametrize("name, device_gib, tp, allocator, utilization, seed, alloc_conf, expected", SUITE)
def test_scenario_suite(name, device_gib, tp, allocator, utilization, seed, alloc_conf, expected):
    config = ScenarioConfig(
        model_config=model(name),
        device_memory_bytes=device_gib * GIB,
        gpu_memory_utilization=utilization,
        allocator=allocator,
        requests=8,
        tensor_parallel_size=tp,
        seed=seed,
        short_output_tokens=(8, 64),
        long_output_tokens=(8, 32),
        ms_alloc_conf=alloc_conf,
    )
    outcomes = []
    for budget in ("stock", "reserved"):
        result = run(config, budget=budget)
        outcomes.append(result.oom_phase or ("error" if result.error else "ok"))
        for record in result.timeline:
            assert record.peak_reserved_bytes >= record.peak_allocated_bytes
            assert record.device_used_bytes <= device_gib * GIB
    assert tuple(outcomes) == expected


# The profile run's sampler (vLLM V1 on CUDA, vllm/v1/worker/gpu_model_runner.py 0.11.0:3393-3397
# _dummy_sampler_run): top-k and top-p over min(max_num_seqs, max_num_batched_tokens) dummy requests.
SMALL_BIG_VOCAB = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 128000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def test_the_v1_profile_peak_is_the_top_k_top_p_sort_when_the_vocabulary_dominates():
    # A model whose layers are tiny next to 256 x 128000 logits: the peak is the sampler's live set at
    # apply_top_k_top_p's scatter (vllm/v1/sample/ops/topk_topp_sampler.py 0.11.0:183-203): the bf16 logits
    # (the caller's), their fp32 copy (sampler.py:86), sorted values fp32 + indices int64, the top-k and top-p
    # masks (bool), the softmax of the sorted values, the scatter's output; with the final norm's output and
    # the last tokens' hidden states held by profile_run, their torch.rand_like copy, the greedy ids (int64)
    # and the forward's input ids, positions and slot mapping. Every size is a multiple of 512 (no rounding);
    # PyTorch counts a whole cached block when it reuses one whose remainder is too small to split (at most
    # 1 MiB in the large pool, c10/cuda/CUDACachingAllocator.cpp should_split, kSmallSize): up to 1 MiB more
    # for each of the 15 live tensors.
    tokens = seqs = 256
    config = ScenarioConfig(
        model_config=SMALL_BIG_VOCAB,
        device_memory_bytes=80 * GIB,
        allocator="torch",
        max_num_batched_tokens=tokens,
        max_num_seqs=seqs,
        max_model_len=256,
    )
    profile = ServingScenario(config).startup()
    nv = seqs * 128000
    sampler = nv * (2 + 4 + 4 + 8 + 1 + 1 + 4 + 4)
    held = tokens * 512 * 2 + 2 * seqs * 512 * 2 + seqs * 8 + tokens * (4 + 8 + 8)
    assert sampler + held <= profile.peak_allocated_increase_bytes <= sampler + held + 15 * MIB


def test_the_profile_sampler_does_not_shrink_with_tensor_parallelism():
    # Real logs: Meta-Llama-3-8B at 8192 tokens and 256 sequences states the same activation peak, 1.26 GiB, at
    # TP 1 and TP 2 (tests/data/logs/real/MANIFEST.json r01, r38): the logits are gathered to the full
    # vocabulary on every rank (logits_processor.py 0.11.0:69-77) and the sampler sorts all of it.
    llama = model("llama-3-8b-instruct")
    peaks = [
        ServingScenario(
            ScenarioConfig(
                model_config=llama,
                device_memory_bytes=80 * GIB,
                allocator="torch",
                max_model_len=8192,
                tensor_parallel_size=tp,
            )
        )
        .startup()
        .peak_allocated_increase_bytes
        for tp in (1, 2)
    ]
    assert abs(peaks[1] - peaks[0]) < 0.05 * peaks[0]


@pytest.mark.parametrize(
    "allocator, launcher", [("torch_npu", "0.5.1"), ("mindspore", "0.2.0")], ids=["vllm-ascend", "vllm-mindspore-0.2"]
)
def test_profiles_without_a_sampler_run_do_not_get_one(allocator, launcher, monkeypatch):
    # vllm-ascend's profile_run computes the logits but runs no sampler (vllm_ascend/worker/model_runner_v1.py
    # 0.11.0:2596-2598); the seed's vllm-mindspore 0.2.0 (V0) keeps its plain sampling ops, its V0 sampler not
    # modelled: neither may reach the V1 sampler run.
    import kvguard.sim.workload as workload

    def refuse(*args, **kwargs):
        raise AssertionError("profile_sampler_ops called")

    monkeypatch.setattr(workload, "profile_sampler_ops", refuse)
    config = ScenarioConfig(
        model_config=QWEN, device_memory_bytes=32 * GIB, allocator=allocator, vllm_mindspore_version=launcher
    )
    assert ServingScenario(config).startup() is not None
    for sampling in ("torch", "mindspore"):  # vLLM V1 on CUDA, and vllm-mindspore 0.5.1 on vLLM 0.11.0's profile_run
        with pytest.raises(AssertionError, match="profile_sampler_ops"):
            ServingScenario(
                ScenarioConfig(model_config=QWEN, device_memory_bytes=32 * GIB, allocator=sampling)
            ).startup()
