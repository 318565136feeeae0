"""The peak burst (``ScenarioConfig.peak_burst``): after a run's requests drain, the batch vLLM budgets for,
formed by real requests.

vLLM's profile run is ``_dummy_run(max_num_tokens)``: ``min(max_num_seqs, num_tokens)`` requests, each
``num_tokens // num_reqs`` tokens, the last one the remainder more (vllm/v1/worker/gpu_model_runner.py
0.11.0:2977-2980, 3392). The expected splits below are that rule worked by hand.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from kvguard.sim.guarded import run_guarded
from kvguard.sim.scenario import ScenarioConfig, ServingScenario, make_peak_burst, make_requests

REPO = Path(__file__).resolve().parents[2]
QWEN3 = json.loads((REPO / "tests" / "data" / "configs" / "qwen3-0.6b" / "config.json").read_text())
HIDDEN = 1024  # Qwen3-0.6B's hidden_size, bf16
GIB = 1 << 30


def config(**overrides) -> ScenarioConfig:
    base = dict(
        model_config=QWEN3,
        device_memory_bytes=80 * GIB,
        gpu_memory_utilization=0.9,
        allocator="torch",
        seed=2,
        requests=4,
        peak_burst=True,
    )
    return ScenarioConfig(**{**base, **overrides})


def serving(result) -> list:
    return [record for record in result.timeline if record.phase == "serving"]


def test_the_burst_splits_the_token_budget_as_the_profile_run_does():
    burst = make_peak_burst(config(max_num_seqs=100, max_num_batched_tokens=8190))
    # 8190 // 100 = 81 each; the last one takes 8190 % 100 = 90 more.
    assert [r.prompt_tokens for r in burst] == [81] * 99 + [171]
    assert [r.request_id for r in burst] == list(range(4, 104))  # after the run's own requests
    # Fewer tokens than max_num_seqs: one token a request, as min(num_tokens, max_num_reqs) gives.
    assert [r.prompt_tokens for r in make_peak_burst(config(max_num_seqs=256, max_num_batched_tokens=200))] == [1] * 200


def test_the_burst_arrives_once_the_requests_have_drained_and_is_scheduled_in_one_step():
    result = ServingScenario(config(max_num_seqs=100, max_num_batched_tokens=8190)).run()
    steps = serving(result)
    burst_steps = [i for i, record in enumerate(steps) if record.num_running == 100]
    assert burst_steps, "the burst never filled the batch"
    first = burst_steps[0]
    assert steps[first].num_tokens == 8190
    assert steps[first - 1].num_running == 0 and steps[first - 1].num_waiting == 0  # the requests had drained
    assert result.requests_finished == 4 + 100 and not result.oom


def test_the_burst_leaves_the_runs_own_requests_and_steps_unchanged():
    plain = ServingScenario(config(peak_burst=False)).run()
    burst = ServingScenario(config()).run()
    assert make_requests(config()) == make_requests(config(peak_burst=False))
    assert serving(burst)[: len(serving(plain))] == serving(plain)
    assert burst.steps > plain.steps


def test_a_mixed_burst_reaches_the_profile_peak_less_the_profile_runs_random_hidden_states():
    # A batch holding greedy and top-k/top-p requests runs the sampler the profile run runs
    # (budget.sampler.PROFILE_SAMPLING). The one tensor only the profile has: _dummy_sampler_run's
    # torch.rand_like hidden states, 256 rows x hidden_size in bf16 (gpu_model_runner.py 0.11.0:3189).
    mixed = ServingScenario(config(sampling_mix=(("greedy", 0.5), ("top_k_top_p", 0.5)))).run()
    steps = serving(mixed)
    first = next(i for i, record in enumerate(steps) if record.num_running == 256)
    burst_increase = steps[first].peak_allocated_bytes - steps[first - 1].allocated_bytes
    assert mixed.profile.peak_allocated_increase_bytes - burst_increase == 256 * HIDDEN * 2
    # All greedy: no sort of the vocabulary, far below the profile's peak.
    greedy = ServingScenario(config(sampling_mix=(("greedy", 1.0),))).run()
    steps = serving(greedy)
    first = next(i for i, record in enumerate(steps) if record.num_running == 256)
    assert steps[first].peak_allocated_bytes - steps[first - 1].allocated_bytes < burst_increase / 2


def test_a_burst_that_does_not_fit_runs_out_of_memory_where_the_guard_called_it_critical():
    # One of the first held-out grid's false criticals without the burst
    # (bench/results/false-criticals-2026-12-07.txt: qwen3-0.6b 12GiB u0.96 torch stock s2, "risk real").
    held_out = config(device_memory_bytes=12 * GIB, gpu_memory_utilization=0.96, budget="stock", requests=32)
    plain = run_guarded(ServingScenario(replace(held_out, peak_burst=False)))
    assert not plain.result.oom and plain.critical_ever
    burst = run_guarded(ServingScenario(held_out))
    assert burst.result.oom and burst.result.oom_phase == "serving"
    assert serving(burst.result)[-1].num_running == 256  # the burst's step is the one that failed
    assert burst.caught_at_budget and burst.caught_before_oom


def test_simulate_peak_burst_through_the_cli():
    from click.testing import CliRunner

    from kvguard.cli import main

    args = ["simulate", "--model-config", str(REPO / "tests/data/configs/qwen3-0.6b/config.json")]
    args += ["--device", "12GiB", "--gpu-memory-utilization", "0.96", "--requests", "32", "--seed", "2"]
    plain = CliRunner().invoke(main, args)
    assert plain.exit_code == 0, plain.output
    assert "32/32 requests finished" in plain.output and "Outcome      no OOM" in plain.output
    burst = CliRunner().invoke(main, [*args, "--peak-burst"])
    assert burst.exit_code == 0, burst.output
    assert "/288 requests finished (the peak burst's 256 included)" in burst.output
    assert "Outcome      OOM during serving step" in burst.output
    figures = json.loads(CliRunner().invoke(main, [*args, "--peak-burst", "--json", "--device", "24GiB"]).output)
    assert (figures["requests"], figures["peak_burst_requests"], figures["requests_finished"]) == (32, 256, 288)


def test_on_vllm_ascend_the_burst_passes_the_profile_and_the_guard_projects_the_sampler_it_left_out():
    # torch_npu stands for vllm-ascend, whose profile run samples nothing (its era rows' profile_runs_sampler):
    # a tuning-grid run (bench/guard_grid.py) that the burst runs out of memory in the sampler, and that the
    # guard called ok before it was given the sampler's peak.
    llama = json.loads((REPO / "tests" / "data" / "configs" / "llama-3-8b-instruct" / "config.json").read_text())
    run = run_guarded(
        ServingScenario(
            config(
                model_config=llama,
                device_memory_bytes=32 * GIB,
                gpu_memory_utilization=0.95,
                allocator="torch_npu",
                budget="stock",
                seed=0,
                requests=32,
            )
        )
    )
    assert run.result.oom and run.result.oom_phase == "serving"
    assert serving(run.result)[-1].num_running == 256
    profile = run.result.profile
    # 256 rows of Llama-3's 128,256-entry vocabulary, sorted in fp32 with int64 indices, dominate the peak.
    assert profile.unprofiled_sampler_bytes > profile.peak_allocated_increase_bytes
    assert run.caught_at_budget
    assert "of sampling the profile run left out" in run.at_budget.reasons[0].message
    # On CUDA, vLLM's profile run samples the full batch itself: nothing is added.
    cuda = ServingScenario(config(model_config=llama, device_memory_bytes=32 * GIB, requests=1))
    assert cuda.startup().unprofiled_sampler_bytes is None
