"""The guard's verdict, one behaviour per test, on profiles shaped like real vLLM startups."""

from __future__ import annotations

import dataclasses

import pytest

from kvguard.budget import estimator as estimator
from kvguard.budget.estimator import Profile
from kvguard.guard.judge import (
    CRITICAL,
    LIVE_RESERVED_EXCEEDS,
    NO_PROFILE,
    OK,
    OOMS_CLIMBING,
    OVERCOMMITTED,
    PEAK_EXCEEDS_CAPACITY,
    RETRIES_CLIMBING,
    SNAPSHOT_STALE,
    WARNING,
    CounterWindow,
    GuardInput,
    judge,
    worst,
)
from kvguard.records import DeviceMemory

GIB = 1 << 30

# Qwen2.5-7B-Instruct on a 64 GiB Ascend 910B, vllm-ascend with the reserved increase measured.
NPU_910B = Profile(
    total_memory_bytes=64 * GIB,
    gpu_memory_utilization=0.9,
    weights_bytes=int(14.25 * GIB),
    peak_allocated_increase_bytes=int(4.26 * GIB),
    peak_reserved_increase_bytes=int(6.10 * GIB),
    non_torch_increase_bytes=int(1.30 * GIB),
)


def at_utilization(profile: Profile, utilization: float) -> Profile:
    return dataclasses.replace(profile, gpu_memory_utilization=utilization)


def test_budgets_come_from_the_estimator():
    verdict = judge(GuardInput(NPU_910B))
    assert verdict.stock_budget_bytes == estimator.stock_kv_cache_bytes(NPU_910B)
    assert verdict.reserved_budget_bytes == estimator.reserved_kv_cache_bytes(NPU_910B)
    assert verdict.overcommit_bytes == verdict.stock_budget_bytes - verdict.reserved_budget_bytes


def test_overcommit_that_fits_in_the_utilization_slack_is_a_warning():
    verdict = judge(GuardInput(NPU_910B))
    assert verdict.state == WARNING
    assert verdict.reason_codes == (OVERCOMMITTED,)
    assert verdict.headroom_bytes > 0


def test_projected_peak_is_weights_kv_reserved_activation_and_non_torch():
    kv = 30 * GIB
    verdict = judge(GuardInput(NPU_910B, kv_cache_bytes=kv))
    assert verdict.projected_peak_bytes == (
        NPU_910B.weights_bytes + kv + NPU_910B.peak_reserved_increase_bytes + NPU_910B.non_torch_increase_bytes
    )
    assert verdict.headroom_bytes == NPU_910B.total_memory_bytes - verdict.projected_peak_bytes


def test_headroom_with_the_stock_kv_cache_is_the_slack_minus_the_overcommit():
    verdict = judge(GuardInput(NPU_910B))
    slack = NPU_910B.total_memory_bytes * (1 - NPU_910B.gpu_memory_utilization)
    assert abs(verdict.headroom_bytes - (slack - verdict.overcommit_bytes)) <= 2


def test_overcommit_larger_than_the_slack_is_critical():
    profile = at_utilization(NPU_910B, 0.98)  # slack 1.28 GiB, overcommit 1.84 GiB
    verdict = judge(GuardInput(profile))
    assert verdict.state == CRITICAL
    assert PEAK_EXCEEDS_CAPACITY in verdict.reason_codes
    assert OVERCOMMITTED in verdict.reason_codes
    assert verdict.headroom_bytes < 0


def test_critical_reasons_come_first():
    verdict = judge(GuardInput(at_utilization(NPU_910B, 0.98)))
    assert verdict.reasons[0].code == PEAK_EXCEEDS_CAPACITY


def test_kv_cache_within_the_reserved_budget_is_ok():
    reserved = estimator.reserved_kv_cache_bytes(NPU_910B)
    verdict = judge(GuardInput(NPU_910B, kv_cache_bytes=reserved - GIB))
    assert verdict.state == OK
    assert verdict.reasons == ()


def test_without_an_allocation_the_stock_budget_stands_in_and_says_so():
    verdict = judge(GuardInput(NPU_910B))
    assert verdict.kv_cache_bytes == verdict.stock_budget_bytes
    assert verdict.kv_cache_estimated
    assert not judge(GuardInput(NPU_910B, kv_cache_bytes=GIB)).kv_cache_estimated


def test_unknown_reserved_peak_is_inferred_from_live_fragmentation():
    from_log = dataclasses.replace(NPU_910B, peak_reserved_increase_bytes=None)
    live = DeviceMemory(
        device="npu:0", source="mindspore", allocated_bytes=50 * GIB, reserved_bytes=50 * GIB + int(1.84 * GIB)
    )
    verdict = judge(GuardInput(from_log, memory=live))
    assert verdict.reserved_budget_estimated
    assert verdict.reserved_budget_bytes == estimator.reserved_kv_cache_bytes(
        dataclasses.replace(
            from_log, peak_reserved_increase_bytes=from_log.peak_allocated_increase_bytes + int(1.84 * GIB)
        )
    )
    assert verdict.state == WARNING


def test_unknown_reserved_peak_without_live_counters_has_no_reserved_budget():
    from_log = dataclasses.replace(NPU_910B, peak_reserved_increase_bytes=None)
    verdict = judge(GuardInput(from_log))
    assert verdict.reserved_budget_bytes is None
    assert verdict.overcommit_bytes is None
    assert verdict.state == OK


def test_ooms_climbing_is_critical_even_when_the_budget_fits():
    reserved = estimator.reserved_kv_cache_bytes(NPU_910B)
    verdict = judge(GuardInput(NPU_910B, kv_cache_bytes=reserved, ooms_increase=1))
    assert verdict.state == CRITICAL
    assert verdict.reason_codes == (OOMS_CLIMBING,)


def test_alloc_retries_climbing_is_critical():
    verdict = judge(GuardInput(NPU_910B, kv_cache_bytes=GIB, alloc_retries_increase=3))
    assert verdict.state == CRITICAL
    assert verdict.reason_codes == (RETRIES_CLIMBING,)


def test_counters_that_did_not_grow_say_nothing():
    verdict = judge(GuardInput(NPU_910B, kv_cache_bytes=GIB, alloc_retries_increase=0, ooms_increase=0))
    assert verdict.state == OK


def test_a_live_reserved_peak_above_the_projection_raises_the_projection():
    kv = estimator.reserved_kv_cache_bytes(NPU_910B)
    projected = NPU_910B.weights_bytes + kv + NPU_910B.peak_reserved_increase_bytes + NPU_910B.non_torch_increase_bytes
    live_peak = projected - NPU_910B.non_torch_increase_bytes + 2 * GIB
    live = DeviceMemory(
        device="npu:0", source="torch", allocated_bytes=40 * GIB, reserved_bytes=45 * GIB, peak_reserved_bytes=live_peak
    )
    verdict = judge(GuardInput(NPU_910B, kv_cache_bytes=kv, memory=live))
    assert LIVE_RESERVED_EXCEEDS in verdict.reason_codes
    assert verdict.projected_peak_bytes == projected + 2 * GIB
    assert verdict.state == WARNING


def test_a_live_reserved_peak_beyond_capacity_is_critical():
    live = DeviceMemory(
        device="npu:0", source="torch", allocated_bytes=60 * GIB, reserved_bytes=63 * GIB, peak_reserved_bytes=63 * GIB
    )
    verdict = judge(GuardInput(NPU_910B, kv_cache_bytes=GIB, memory=live))
    assert verdict.state == CRITICAL
    assert PEAK_EXCEEDS_CAPACITY in verdict.reason_codes


def test_no_profile_is_a_warning_that_says_why():
    verdict = judge(GuardInput(None))
    assert verdict.state == WARNING
    assert verdict.reason_codes == (NO_PROFILE,)
    assert verdict.projected_peak_bytes is None


def test_no_profile_with_ooms_is_still_critical():
    assert judge(GuardInput(None, ooms_increase=2)).state == CRITICAL


def test_a_stale_snapshot_is_at_least_a_warning():
    verdict = judge(GuardInput(NPU_910B, kv_cache_bytes=GIB, snapshot_stale=True))
    assert verdict.state == WARNING
    assert verdict.reason_codes == (SNAPSHOT_STALE,)


def test_negative_non_torch_increase_is_accepted():
    profile = dataclasses.replace(NPU_910B, non_torch_increase_bytes=int(-0.51 * GIB))
    verdict = judge(GuardInput(profile))
    assert verdict.projected_peak_bytes is not None


def test_verdict_serialises_with_reasons():
    data = judge(GuardInput(at_utilization(NPU_910B, 0.98))).to_dict()
    assert data["state"] == CRITICAL
    assert {r["code"] for r in data["reasons"]} == {PEAK_EXCEEDS_CAPACITY, OVERCOMMITTED}
    assert all(r["message"] for r in data["reasons"])


def test_worst_state_of_several_ranks():
    assert worst([judge(GuardInput(NPU_910B, kv_cache_bytes=GIB)), judge(GuardInput(NPU_910B))]) == WARNING
    assert worst([]) == WARNING  # judging nothing is no all-clear


def test_counter_window_reports_growth_within_the_window():
    window = CounterWindow(window_seconds=60)
    assert window.observe("r0", 0.0, 5) == 0
    assert window.observe("r0", 10.0, 7) == 2
    assert window.observe("r0", 100.0, 7) == 0  # the growth left the window


def test_counter_window_restarts_when_a_counter_goes_down():
    window = CounterWindow(window_seconds=60)
    window.observe("r0", 0.0, 9)
    assert window.observe("r0", 1.0, 1) == 0


def test_counter_window_ignores_unknown_values():
    assert CounterWindow().observe("r0", 0.0, None) is None


def test_activations_the_profile_ran_in_idle_memory_still_need_their_bytes_once_the_kv_cache_took_it():
    # MindSpore's pool: the profile run's activations fit in the weights' idle block tails, so the
    # reserved increase is 0; the KV cache then fills those tails and the device. The next peak needs
    # the allocated increase anew (a held-out-grid miss, Qwen2.5-7B-FP8 on 24 GiB).
    profile = Profile(
        total_memory_bytes=24 * GIB,
        gpu_memory_utilization=0.92,
        weights_bytes=8_705_944_576,
        peak_allocated_increase_bytes=990_019_584,
        peak_reserved_increase_bytes=0,
        non_torch_increase_bytes=0,
    )
    memory = DeviceMemory(
        device="npu:0",
        source="mindspore",
        allocated_bytes=22_718_065_664,
        reserved_bytes=23 * GIB,
        total_bytes=24 * GIB,
        free_bytes=0,
        used_bytes=24 * GIB,
    )
    verdict = judge(GuardInput(profile, kv_cache_bytes=22_718_065_664 - 8_705_944_576, memory=memory))
    assert verdict.state == CRITICAL and PEAK_EXCEEDS_CAPACITY in verdict.reason_codes
    assert verdict.headroom_bytes == -990_019_584


def mindspore_rank(reserved: int, outside: int, total: int = 64 * GIB) -> DeviceMemory:
    """A MindSpore rank's counters (total_idle_memory present: the pool's) with ``outside`` held beside the pool."""
    return DeviceMemory(
        device="npu:0",
        source="mindspore",
        allocated_bytes=reserved,
        reserved_bytes=reserved,
        idle_bytes=0,
        eager_free_bytes=0,
        total_bytes=total,
        used_bytes=reserved + outside,
        free_bytes=total - reserved - outside,
    )


def test_a_mindspore_peak_that_fits_the_device_but_not_the_pools_budget_is_critical():
    # 64 GiB with 1.30 GiB outside the pool when it started: MindSpore's pool may hold 15/16 of the 62.70 GiB
    # free, less 10 MiB (the compiled pool reports 64,414,023,680 B for 64 GiB free:
    # tests/upstream/test_oracle_mindspore.py).
    outside = NPU_910B.non_torch_increase_bytes
    pool_budget = (64 * GIB - outside) * 15 // 16 // (2 << 20) * (2 << 20) - (10 << 20)
    allocator_peak = NPU_910B.weights_bytes + NPU_910B.peak_reserved_increase_bytes
    kv = pool_budget - allocator_peak + GIB  # 1 GiB past the pool's budget, 2.9 GiB inside the device
    memory = mindspore_rank(NPU_910B.weights_bytes + kv, outside)
    verdict = judge(GuardInput(NPU_910B, kv_cache_bytes=kv, memory=memory))
    assert verdict.state == CRITICAL and PEAK_EXCEEDS_CAPACITY in verdict.reason_codes
    assert verdict.headroom_bytes == -GIB
    assert "pool budget" in dict((r.code, r.message) for r in verdict.reasons)[PEAK_EXCEEDS_CAPACITY]
    # The same bytes on a PyTorch rank (no pool budget) fit the device.
    torch_memory = dataclasses.replace(memory, idle_bytes=None, eager_free_bytes=None)
    assert judge(GuardInput(NPU_910B, kv_cache_bytes=kv, memory=torch_memory)).headroom_bytes > 2 * GIB


@pytest.mark.parametrize("formula", sorted(estimator.FORMULAS))
def test_a_profile_with_kv_cache_memory_bytes_alone_is_judged(formula):
    # Such a profile carries no more than the weights (required_fields); judge read the era's figures
    # anyway and raised TypeError for every formula (found by mypy). Unknown figures count as nothing, so
    # the projection is a floor: a warning that says so where the floor fits, critical where it does not.
    def profile(weights: int, kv: int) -> Profile:
        return Profile(
            total_memory_bytes=80 * GIB,
            gpu_memory_utilization=0.9,
            weights_bytes=weights,
            peak_allocated_increase_bytes=None,
            peak_reserved_increase_bytes=None,
            non_torch_increase_bytes=None,
            formula=formula,
            kv_cache_memory_bytes=kv,
        )

    verdict = judge(GuardInput(profile=profile(10 * GIB, 5 * GIB), kv_cache_bytes=5 * GIB))
    assert verdict.state == WARNING
    assert [r.code for r in verdict.reasons] == ["no_profile"] and "activation peak" in verdict.reasons[0].message
    assert verdict.headroom_bytes == 80 * GIB - 10 * GIB - 5 * GIB
    too_big = judge(GuardInput(profile=profile(70 * GIB, 15 * GIB), kv_cache_bytes=15 * GIB))
    assert too_big.state == CRITICAL and too_big.headroom_bytes == 80 * GIB - 70 * GIB - 15 * GIB


def test_a_sampler_the_profile_run_left_out_adds_what_it_passes_the_allocated_peak_by():
    # vllm-ascend's profile run samples nothing (Profile.unprofiled_sampler_bytes): a full batch's sampling
    # peak above the profile's allocated peak is the next activation peak's too.
    kv = 30 * GIB
    base = judge(GuardInput(NPU_910B, kv_cache_bytes=kv))
    above = dataclasses.replace(NPU_910B, unprofiled_sampler_bytes=NPU_910B.peak_allocated_increase_bytes + GIB)
    verdict = judge(GuardInput(above, kv_cache_bytes=kv))
    assert verdict.projected_peak_bytes == base.projected_peak_bytes + GIB
    below = dataclasses.replace(NPU_910B, unprofiled_sampler_bytes=NPU_910B.peak_allocated_increase_bytes - GIB)
    assert judge(GuardInput(below, kv_cache_bytes=kv)).projected_peak_bytes == base.projected_peak_bytes


def test_a_left_out_sampler_that_tips_the_peak_over_the_device_is_critical_and_named():
    # Headroom with the stock KV cache is the slack less the overcommit; a sampler 1 GiB above it tips it.
    headroom = judge(GuardInput(NPU_910B)).headroom_bytes
    profile = dataclasses.replace(
        NPU_910B, unprofiled_sampler_bytes=NPU_910B.peak_allocated_increase_bytes + headroom + GIB
    )
    verdict = judge(GuardInput(profile))
    assert verdict.state == CRITICAL and verdict.reason_codes[0] == PEAK_EXCEEDS_CAPACITY
    assert "of sampling the profile run left out" in verdict.reasons[0].message


def test_a_vllm_ascend_profile_without_the_sampler_peak_is_a_floor_and_says_so():
    # vllm-ascend's profile run samples nothing (its era rows): a profile that does not carry the sampler peak
    # (an older plugin's snapshot, a hand-written file) projects a floor, a no_profile warning at least.
    ascend = dataclasses.replace(NPU_910B, vllm_version="vllm-ascend:0.18.0")
    verdict = judge(GuardInput(ascend, kv_cache_bytes=30 * GIB))
    assert NO_PROFILE in verdict.reason_codes and verdict.state == WARNING
    assert "samples nothing" in next(r.message for r in verdict.reasons if r.code == NO_PROFILE)
    carried = dataclasses.replace(ascend, unprofiled_sampler_bytes=GIB)
    assert NO_PROFILE not in judge(GuardInput(carried, kv_cache_bytes=30 * GIB)).reason_codes
    cuda = dataclasses.replace(NPU_910B, vllm_version="vllm:0.11.0")
    assert NO_PROFILE not in judge(GuardInput(cuda, kv_cache_bytes=30 * GIB)).reason_codes
