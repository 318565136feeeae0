"""The sampler's peak the guard adds where a release's profile run leaves the sampler out
(``kvguard.budget.sampler.unprofiled_sampler_peak_bytes``).

Expected sizes are written out here from vLLM's dtypes (vllm/v1/sample/sampler.py and
vllm/v1/sample/ops/topk_topp_sampler.py 0.11.0; vllm/v1/worker/gpu_model_runner.py 0.11.0), not read back
from the module: a batch of greedy, random, top-k and top-p requests holds, at the sort, the fp32 logits (4),
the greedy argmax (int64 a row), the sorted values (4) and indices (8), the top-k mask (1), the softmax (4),
the top-p mask (1) and the scattered result (4) per row and vocabulary entry.
"""

from __future__ import annotations

import pytest

from kvguard.budget.sampler import unprofiled_sampler_peak_bytes

SORT_BYTES_PER_ENTRY = 4 + 4 + 8 + 1 + 4 + 1 + 4


def peak(tokens: int, seqs: int, hidden: int, vocab: int, tp: int = 1) -> int:
    return unprofiled_sampler_peak_bytes(
        max_num_batched_tokens=tokens,
        max_num_seqs=seqs,
        hidden_size=hidden,
        vocab_size=vocab,
        tensor_parallel_size=tp,
        dtype_bytes=2,
    )


def held(tokens: int, hidden: int) -> int:
    # input ids int32, positions and slot mapping int64, the final norm's bf16 output over every token
    return tokens * (4 + 8 + 8) + tokens * hidden * 2


def test_one_rank_holds_the_bf16_logits_and_the_top_k_top_p_sort_of_every_row():
    tokens, seqs, hidden, vocab = 8192, 256, 1024, 151_936  # Qwen3-0.6B, vLLM's default limits
    expected = held(tokens, hidden) + seqs * hidden * 2 + seqs * vocab * 2 + seqs * vocab * SORT_BYTES_PER_ENTRY
    expected += seqs * 8
    assert peak(tokens, seqs, hidden, vocab) == expected


def test_with_tensor_parallelism_the_gathered_logits_are_the_padded_vocabulary_and_the_sort_the_real_one():
    # 32,001 pads to 32,064 (a multiple of 64), 8,016 a rank; the all-gather's buffer and its reshaped copy
    # are both whole (logits_processor.py, base_device_communicator.py 0.11.0); the sampler sees the
    # vocabulary with the padding sliced off.
    tokens, seqs, hidden, vocab = 2048, 128, 4096, 32_001
    full = seqs * 8016 * 4 * 2
    expected = held(tokens, hidden) + seqs * hidden * 2 + full + seqs * vocab * SORT_BYTES_PER_ENTRY + seqs * 8
    assert peak(tokens, seqs, hidden, vocab, tp=4) == expected


@pytest.mark.parametrize("tokens,seqs,rows", [(8192, 256, 256), (100, 256, 100)])
def test_the_batch_has_min_max_num_seqs_max_num_batched_tokens_rows(tokens, seqs, rows):
    hidden, vocab = 64, 1000
    expected = held(tokens, hidden) + rows * hidden * 2 + rows * 1024 * 2 + rows * vocab * SORT_BYTES_PER_ENTRY
    expected += rows * 8  # (1,000 pads to 1,024 for the LM head's output)
    assert peak(tokens, seqs, hidden, vocab) == expected
