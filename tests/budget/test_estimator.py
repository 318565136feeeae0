"""The budget formulas: vLLM V1's stock budget and the reserved-aware one."""

import os

import pytest
from conftest import EXAMPLES
from sidecar_fixtures import example_profile

from kvguard.budget.estimator import (
    FORMULAS,
    Profile,
    ProfileError,
    estimate,
    kv_layout_from_config,
    overcommit_bytes,
    recommended_gpu_memory_utilization,
    reserved_kv_cache_bytes,
    stock_kv_cache_bytes,
)
from kvguard.budget.model_config import load_model_config

GIB = 1 << 30
QWEN = kv_layout_from_config(load_model_config(os.path.join(EXAMPLES, "qwen2.5-7b-instruct")))


def test_stock_budget_is_vllm_v1_formula():
    # vLLM's docstring example: 2 GiB weights + 2 GiB activations + 1 GiB non-torch.
    profile = Profile(
        total_memory_bytes=80 * GIB,
        gpu_memory_utilization=0.5,
        weights_bytes=2 * GIB,
        peak_allocated_increase_bytes=2 * GIB,
        peak_reserved_increase_bytes=3 * GIB,
        non_torch_increase_bytes=1 * GIB,
    )
    assert stock_kv_cache_bytes(profile) == 40 * GIB - 5 * GIB
    assert reserved_kv_cache_bytes(profile) == 40 * GIB - 6 * GIB


def test_stock_budget_truncates_the_float_product_like_vllm():
    profile = Profile(
        total_memory_bytes=1001,
        gpu_memory_utilization=0.9,
        weights_bytes=0,
        peak_allocated_increase_bytes=0,
        peak_reserved_increase_bytes=0,
        non_torch_increase_bytes=0,
    )
    assert stock_kv_cache_bytes(profile) == 900  # int(900.9)


def test_seed_profile_reproduces_44292_and_42593_blocks():
    result = estimate(example_profile(), QWEN, max_model_len=32768)
    assert result.stock.num_blocks == 44292
    assert result.reserved.num_blocks == 42593
    assert round(result.stock.kv_cache_bytes / GIB, 2) == 37.85
    assert round(result.reserved.kv_cache_bytes / GIB, 2) == 36.40


def test_budgets_differ_by_reserved_minus_allocated_increase():
    profile = example_profile()
    result = estimate(profile)
    gap = profile.peak_reserved_increase_bytes - profile.peak_allocated_increase_bytes
    assert result.stock.kv_cache_bytes - result.reserved.kv_cache_bytes == gap
    assert result.overcommit_bytes == gap


def test_tokens_and_max_concurrency_follow_vllm():
    result = estimate(example_profile(), QWEN, max_model_len=32768)
    assert result.stock.num_tokens == 44292 * 16
    # vLLM logs "Maximum concurrency for 32,768 tokens per request: 21.63x"
    assert round(result.stock.max_concurrency, 2) == 21.63


def test_max_concurrency_rounds_partial_blocks_up_per_request():
    profile = example_profile()
    result = estimate(profile, QWEN, max_model_len=17)  # 17 tokens need 2 blocks of 16
    assert result.stock.max_concurrency == 44292 / 2


def test_overcommit_is_zero_when_reserved_budget_is_larger():
    assert overcommit_bytes(10, 12) == 0
    assert overcommit_bytes(12, 10) == 2


def test_recommended_utilization_is_the_largest_hundredth_that_fits():
    profile = example_profile()
    recommended = recommended_gpu_memory_utilization(profile)
    reserved = reserved_kv_cache_bytes(profile)
    fits = Profile(**{**profile.to_dict(), "gpu_memory_utilization": recommended})
    one_more = Profile(**{**profile.to_dict(), "gpu_memory_utilization": round(recommended + 0.01, 2)})
    assert stock_kv_cache_bytes(fits) <= reserved < stock_kv_cache_bytes(one_more)
    assert recommended == 0.87


def test_recommended_utilization_keeps_the_setting_when_nothing_is_overcommitted():
    profile = Profile(**{**example_profile().to_dict(), "peak_reserved_increase_bytes": 0})
    assert recommended_gpu_memory_utilization(profile) == 0.9


def test_recommended_kv_cache_memory_is_the_reserved_budget():
    result = estimate(example_profile(), QWEN)
    assert result.recommended_kv_cache_memory_bytes == result.reserved.kv_cache_bytes
    assert QWEN.num_blocks(result.recommended_kv_cache_memory_bytes) == 42593


def test_no_reserved_increase_means_no_reserved_budget():
    profile = Profile(**{**example_profile().to_dict(), "peak_reserved_increase_bytes": None})
    result = estimate(profile, QWEN)
    assert result.reserved is None and result.overcommit_bytes is None
    assert result.stock.num_blocks == 44292


def test_negative_budget_gives_zero_blocks():
    profile = Profile(
        total_memory_bytes=24 * GIB,
        gpu_memory_utilization=0.5,
        weights_bytes=15 * GIB,
        peak_allocated_increase_bytes=GIB,
        peak_reserved_increase_bytes=GIB,
        non_torch_increase_bytes=0,
    )
    result = estimate(profile, QWEN)
    assert result.stock.kv_cache_bytes < 0 and result.stock.num_blocks == 0
    assert result.recommended_kv_cache_memory_bytes == 0


@pytest.mark.parametrize("utilization", [0, -0.1, 1.01, float("nan")])
def test_utilization_outside_zero_one_is_refused(utilization):
    with pytest.raises(ProfileError, match="gpu_memory_utilization"):
        Profile(**{**example_profile().to_dict(), "gpu_memory_utilization": utilization})


def test_profile_file_with_missing_or_unknown_keys_is_refused():
    data = example_profile().to_dict()
    del data["weights_bytes"]
    with pytest.raises(ProfileError, match="missing weights_bytes"):
        Profile.from_dict(data)
    with pytest.raises(ProfileError, match="unknown keys extra"):
        Profile.from_dict({**example_profile().to_dict(), "extra": 1})


def test_negative_non_torch_increase_is_allowed_but_negative_weights_are_not():
    data = example_profile().to_dict()
    assert Profile.from_dict({**data, "non_torch_increase_bytes": -547_608_330}).non_torch_increase_bytes < 0
    with pytest.raises(ProfileError, match="weights_bytes must not be negative"):
        Profile.from_dict({**data, "weights_bytes": -1})


# ---------------------------------------------------------------------------- the era formulas


def classic(**overrides):
    values = dict(
        total_memory_bytes=150_754_820_096,
        gpu_memory_utilization=0.9,
        weights_bytes=16 * GIB,
        peak_allocated_increase_bytes=2 * GIB,
        peak_reserved_increase_bytes=3 * GIB,
        non_torch_increase_bytes=GIB,
    )
    values.update(overrides)
    return Profile(**values)


def test_ceil_request_from_0_14_is_one_byte_above_the_float_product():
    # 150754820096 * 0.9 = 135679338086.4: int() before 0.14, math.ceil from 0.14 (wu 0.14.0:258).
    float_era, ceil_era = classic(), classic(formula="peak_ceil")
    assert stock_kv_cache_bytes(ceil_era) - stock_kv_cache_bytes(float_era) == 1
    assert stock_kv_cache_bytes(float_era) == 135_679_338_086 - 19 * GIB


def test_cudagraph_estimate_is_subtracted_from_0_18_on():
    with_graphs = classic(formula="peak_ceil_cudagraph", cudagraph_memory_bytes=512 << 20)
    assert stock_kv_cache_bytes(classic(formula="peak_ceil")) - stock_kv_cache_bytes(with_graphs) == 512 << 20
    # The reserved-aware budget pays for the graphs too.
    assert reserved_kv_cache_bytes(with_graphs) == stock_kv_cache_bytes(with_graphs) - GIB


def consumed(**overrides):
    values = dict(
        total_memory_bytes=80 * GIB,
        gpu_memory_utilization=0.92,
        weights_bytes=15 * GIB,
        peak_allocated_increase_bytes=None,
        peak_reserved_increase_bytes=None,
        non_torch_increase_bytes=None,
        formula="consumed",
        total_consumed_bytes=17 * GIB,
        transient_peak_headroom_bytes=GIB,
        reserved_transient_peak_bytes=3 * GIB // 2,
        cudagraph_memory_bytes=256 << 20,
    )
    values.update(overrides)
    return Profile(**values)


def test_from_0_27_the_budget_is_request_less_consumed_less_transient_less_graphs():
    import math

    profile = consumed()
    assert stock_kv_cache_bytes(profile) == math.ceil(80 * GIB * 0.92) - 17 * GIB - GIB - (256 << 20)


def test_from_0_27_the_reserved_budget_swaps_in_the_transient_part_only():
    profile = consumed()
    # total_consumed already holds what empty_cache could not release: only the transient differs.
    assert stock_kv_cache_bytes(profile) - reserved_kv_cache_bytes(profile) == GIB // 2
    assert reserved_kv_cache_bytes(consumed(reserved_transient_peak_bytes=GIB // 2)) == stock_kv_cache_bytes(profile)


def test_consumed_formula_needs_its_inputs():
    with pytest.raises(ProfileError, match="total_consumed_bytes"):
        consumed(total_consumed_bytes=None)


def extensible(**overrides):
    values = dict(
        total_memory_bytes=80 * GIB,
        gpu_memory_utilization=1.0,
        weights_bytes=15 * GIB,
        peak_allocated_increase_bytes=None,
        peak_reserved_increase_bytes=None,
        non_torch_increase_bytes=None,
        formula="extensible",
        init_free_memory_bytes=79 * GIB,
        free_after_warmup_bytes=60 * GIB,
        kv_committed_bytes=GIB,
        kv_transient_peak_bytes=2 * GIB,
        torch_reserve_growth_bytes=3 * GIB,
    )
    values.update(overrides)
    return Profile(**values)


def test_0_34_extensible_cache_keeps_the_larger_of_transient_and_reserve_growth_free():
    # measure_kv_cache_bytes (extensible_kv_cache.py 0.34.0:592-618): non-KV used = 79 - 60 - 1 = 18 GiB;
    # min(80 - 18, 61 - max(1, 1.5)) = 59.5 GiB, less max(2, 3) GiB.
    assert stock_kv_cache_bytes(extensible()) == 59 * GIB + GIB // 2 - 3 * GIB


def test_0_34_extensible_cache_is_its_own_reserved_budget():
    result = estimate(extensible())
    assert result.overcommit_bytes == 0
    assert result.reserved_counts.startswith("nothing")


def test_vllm_ascend_before_0_15_adds_non_torch_only_when_positive_and_clamps_at_zero():
    negative = classic(formula="absolute_peak", non_torch_increase_bytes=-GIB)
    assert stock_kv_cache_bytes(negative) == int(150_754_820_096 * 0.9 - 18 * GIB)
    assert stock_kv_cache_bytes(classic(formula="absolute_peak", weights_bytes=200 * GIB)) == 0


def test_310p_halves_what_vllm_ascend_leaves():
    full = classic(formula="ascend_cleared", non_torch_cleared_bytes=GIB)
    halved = classic(formula="ascend_cleared_halved", non_torch_cleared_bytes=GIB)
    assert stock_kv_cache_bytes(halved) == (150_754_820_096 * 0.9 - 20 * GIB) // 2
    assert stock_kv_cache_bytes(full) == int(150_754_820_096 * 0.9 - 20 * GIB)


def test_vllm_mindspore_stock_budget_already_counts_the_reserved_increase():
    profile = classic(formula="mindspore_reserved", peak_allocated_increase_bytes=None)
    assert stock_kv_cache_bytes(profile) == reserved_kv_cache_bytes(profile)
    assert stock_kv_cache_bytes(profile) == int(150_754_820_096 * 0.9 - 20 * GIB)


def test_kv_cache_memory_bytes_skips_the_budget():
    profile = consumed(kv_cache_memory_bytes=40 * GIB)
    assert stock_kv_cache_bytes(profile) == reserved_kv_cache_bytes(profile) == 40 * GIB


def test_a_classic_profile_file_keeps_its_six_keys():
    assert set(classic().to_dict()) == set(Profile.REQUIRED)
    assert Profile.from_dict(consumed().to_dict()) == consumed()


def test_unknown_formula_is_one_line():
    with pytest.raises(ProfileError, match="unknown budget formula"):
        classic(formula="v99")


@pytest.mark.parametrize("formula", sorted(FORMULAS))
def test_kv_cache_memory_bytes_alone_is_a_budget_for_every_formula(formula):
    # --kv-cache-memory-bytes needs only the first three fields (required_fields); the era's own figures
    # were read anyway and crashed the 0.27+, 0.34 and vllm-ascend 0.7.3 formulas (found by mypy).
    profile = Profile(
        total_memory_bytes=80 * GIB,
        gpu_memory_utilization=0.9,
        weights_bytes=10 * GIB,
        peak_allocated_increase_bytes=None,
        peak_reserved_increase_bytes=None,
        non_torch_increase_bytes=None,
        formula=formula,
        kv_cache_memory_bytes=5 * GIB,
    )
    assert stock_kv_cache_bytes(profile) == 5 * GIB
    assert reserved_kv_cache_bytes(profile) is None
    assert estimate(profile).stock.kv_cache_bytes == 5 * GIB
