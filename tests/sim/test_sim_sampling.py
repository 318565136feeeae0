"""The serving workload samples as vLLM V1's sampler does, decided per batch from its requests.

Sizes are vLLM's tensors, written out here from their dtypes (bf16 logits, fp32 copies and probabilities,
int64 sort indices and argmax ids, bool masks, int32 sampled ids; vllm/v1/sample/sampler.py and
vllm/v1/sample/ops/topk_topp_sampler.py 0.11.0), not read back from the workload module.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvguard.budget.sampler import SamplingBatch
from kvguard.cli import main
from kvguard.sim.scenario import ScenarioConfig, ServingScenario, make_requests, parse_sampling_mix
from kvguard.sim.workload import forward_ops, model_shape

REPO = Path(__file__).resolve().parents[2]
QWEN3 = json.loads((REPO / "tests" / "data" / "configs" / "qwen3-0.6b" / "config.json").read_text())
VOCAB, HIDDEN = 151_936, 1024  # Qwen3-0.6B: bf16, a vocabulary that is a multiple of 64 (no padding)
GIB = 1 << 30


def decode_peak(kinds: list[str]) -> int:
    """The live-bytes peak of a decode step (one token a sequence) for requests of these sampling kinds."""
    live: dict[object, int] = {}
    now = peak = 0
    for key, size in forward_ops(model_shape(QWEN3), len(kinds), len(kinds), sampling=SamplingBatch.of(kinds)):
        if size is None:
            now -= live.pop(key)
        else:
            live[key] = size
            now += size
            peak = max(peak, now)
    assert not live
    return peak


def held_across_sampling(n: int) -> int:
    """What execute_model holds while it samples n rows: input ids (int32), positions and slot mapping
    (int64), the model's output and the sampled rows' hidden states (bf16), the bf16 logits."""
    return n * (4 + 8 + 8) + n * HIDDEN * 2 + n * HIDDEN * 2 + n * VOCAB * 2


N = 8


def test_an_all_greedy_batch_takes_the_argmax_of_the_fp32_logits_and_never_sorts():
    # all_greedy: logits.to(float32), argmax (int64), .to(int32) (sampler.py 0.11.0:86, 139-140, 159-166, 115)
    assert decode_peak(["greedy"] * N) == held_across_sampling(N) + N * VOCAB * 4 + N * 8 + N * 4


def test_a_top_k_top_p_batch_sorts_every_row_of_the_vocabulary():
    # apply_top_k_top_p (topk_topp_sampler.py 0.11.0:183-203): fp32 logits, sorted values (fp32) and indices
    # (int64), the top-k mask (bool), softmax (fp32), the top-p mask (bool), the scattered result (fp32).
    assert decode_peak(["top_k_top_p"] * N) == held_across_sampling(N) + N * VOCAB * (4 + 4 + 8 + 1 + 4 + 1 + 4)


def test_one_top_k_top_p_request_makes_the_whole_batch_sort_and_keeps_the_greedy_argmax():
    # The sampler decides per batch: top_k / top_p tensors for every row once one request sets them
    # (gpu_input_batch.py 0.11.0:757-758), and the argmax unless every request samples (sampler.py 155-158).
    kinds = ["greedy"] * (N - 1) + ["top_k_top_p"]
    assert decode_peak(kinds) == held_across_sampling(N) + N * VOCAB * 26 + N * 8


def test_top_p_alone_sorts_without_a_top_k_mask():
    assert decode_peak(["top_p"] * N) == held_across_sampling(N) + N * VOCAB * (4 + 4 + 8 + 4 + 1 + 4)


@pytest.mark.parametrize("kind", ["top_k", "random"])
def test_top_k_alone_and_plain_random_sampling_do_not_sort(kind):
    # apply_top_k_only masks in place with a bool mask (topk_topp_sampler.py 0.11.0:207-229); then softmax
    # (fp32) and the exponential draws q (fp32), the random ids int64 (96, 241, 253).
    assert decode_peak([kind] * N) == held_across_sampling(N) + N * VOCAB * (4 + 4 + 4) + N * 8


def test_the_batch_sorts_from_its_first_top_k_top_p_request_and_drops_the_argmax_with_its_last_greedy_one():
    peaks = [decode_peak(["greedy"] * (N - k) + ["top_k_top_p"] * k) for k in range(N + 1)]
    assert peaks[0] < peaks[1] and peaks[1:N] == [peaks[1]] * (N - 1)
    assert peaks[N] == peaks[1] - N * 8  # all_random: no argmax (sampler.py 0.11.0:155-156)


def test_the_sampling_mix_changes_no_prompt_or_output_length():
    base = ScenarioConfig(model_config=QWEN3, device_memory_bytes=16 * GIB, requests=200, seed=3)
    greedy = make_requests(ScenarioConfig(**{**base.__dict__, "sampling_mix": (("greedy", 1.0),)}))
    half = make_requests(ScenarioConfig(**{**base.__dict__, "sampling_mix": (("greedy", 1.0), ("top_k_top_p", 1.0))}))
    assert [(r.prompt_tokens, r.output_tokens) for r in greedy] == [(r.prompt_tokens, r.output_tokens) for r in half]
    assert {r.sampling for r in greedy} == {"greedy"}
    assert 70 <= sum(r.sampling == "top_k_top_p" for r in half) <= 130


@pytest.mark.parametrize(
    "text, message",
    [
        ("greedy:0.5,beam:0.5", "unknown sampling kind 'beam'"),
        ("greedy", "expected KIND:SHARE"),
        ("greedy:0", "not all 0"),
        ("greedy:-1,top_p:1", "at least 0"),
        ("greedy:1,greedy:1", "names a kind twice"),
        ("top_p:nan", "finite"),
    ],
)
def test_a_bad_sampling_mix_is_refused_in_one_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse_sampling_mix(text)
    result = CliRunner().invoke(
        main,
        ["simulate", "--model-config", str(REPO / "tests" / "data" / "configs" / "qwen3-0.6b"), "--sampling-mix", text],
    )
    assert result.exit_code == 64 and len(result.output.strip().splitlines()) == 1, result.output
    assert message in result.output


def test_serving_steps_with_top_k_top_p_requests_peak_above_greedy_ones():
    def serving_peak(mix: tuple) -> int:
        config = ScenarioConfig(
            model_config=QWEN3,
            device_memory_bytes=8 * GIB,
            allocator="torch_npu",
            requests=6,
            gpu_memory_utilization=0.5,
            max_model_len=2048,
            max_num_batched_tokens=256,
            sampling_mix=mix,
        )
        result = ServingScenario(config).run()
        assert not result.oom and result.requests_finished == 6
        return max(step.peak_allocated_bytes for step in result.timeline if step.phase == "serving")

    greedy, sorting = serving_peak((("greedy", 1.0),)), serving_peak((("top_k_top_p", 1.0),))
    # A decode step of the 6 requests sorts their rows: at least the sorted values and their int64 indices more
    # (greedy's own highest step may be a prefill chunk's, above its decode steps).
    assert sorting - greedy >= 6 * VOCAB * (4 + 8)


def test_simulate_takes_the_sampling_mix_and_reports_it():
    result = CliRunner().invoke(
        main,
        [
            "simulate",
            "--model-config",
            str(REPO / "tests" / "data" / "configs" / "qwen3-0.6b"),
            "--total-memory",
            "8GiB",
            "--requests",
            "2",
            "--max-model-len",
            "2048",
            "--sampling-mix",
            "greedy:3,top_p:1",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["config"]["sampling_mix"] == [["greedy", 3.0], ["top_p", 1.0]]
