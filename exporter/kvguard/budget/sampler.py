"""vLLM's sampling in tensor sizes: the logits of a batch's sequences and the sampler as it runs for that batch.

Shared by the simulator's forward pass (``kvguard.sim.workload``) and the guard, which needs the sampler's
peak where a release's profile run leaves the sampler out (``unprofiled_sampler_peak_bytes``). Ops are
``(key, size)`` to allocate and ``(key, None)`` to free, in the order an eager runtime does both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

Op = tuple[Any, "int | None"]

# What a request asks of vLLM's sampler (SamplingParams): greedy (temperature < 1e-5, which also clears its
# top-k and top-p, vllm/sampling_params.py 0.11.0:353-356); random with neither top-k nor top-p; top-k
# (0 < top_k < vocab) alone; top-p (< 1) alone; both.
SAMPLING_KINDS = ("greedy", "random", "top_k", "top_p", "top_k_top_p")


@dataclass(frozen=True)
class SamplingBatch:
    """What vLLM V1's sampler does for one batch, decided from the requests in it, not request by request:
    ``InputBatch`` keeps the greedy, random, top-p and top-k request sets (vllm/v1/worker/gpu_input_batch.py
    0.11.0:356-371) and hands the sampler ``all_greedy`` (no random request), ``all_random`` (no greedy one),
    and ``top_k`` / ``top_p`` tensors or None when no request sets one (:755-758, 832-845)."""

    greedy: bool = True  # some request is greedy: the argmax runs (not all_random)
    random: bool = False  # some request samples: the random path runs (not all_greedy)
    top_k: bool = False  # some request sets top-k
    top_p: bool = False  # some request sets top-p

    @classmethod
    def of(cls, kinds: Iterable[str]) -> "SamplingBatch":
        """The batch of requests of these kinds (``SAMPLING_KINDS``)."""
        seen = set(kinds)
        unknown = seen - set(SAMPLING_KINDS)
        if unknown:
            raise ValueError(
                f"unknown sampling kind(s) {', '.join(sorted(unknown))} (known: {', '.join(SAMPLING_KINDS)})"
            )
        return cls(
            greedy="greedy" in seen,
            random=bool(seen - {"greedy"}),
            top_k=bool(seen & {"top_k", "top_k_top_p"}),
            top_p=bool(seen & {"top_p", "top_k_top_p"}),
        )


# _dummy_sampler_run's metadata: all_greedy and all_random False, top-p 0.9 and top-k vocab - 1 for every
# dummy request (vllm/v1/worker/gpu_model_runner.py 0.11.0:3198-3203).
PROFILE_SAMPLING = SamplingBatch(greedy=True, random=True, top_k=True, top_p=True)


def vocab_shard(vocab_size: int, tensor_parallel_size: int) -> int:
    """One rank's rows of the embedding and the LM head: VocabParallelEmbedding / ParallelLMHead pad the
    vocabulary to a multiple of 64, then split it evenly (vllm/model_executor/layers/vocab_parallel_embedding.py
    0.11.0:60-63 pad_vocab_size, 226-231, 263)."""
    padded_vocab = -(-vocab_size // 64) * 64
    return -(-padded_vocab // tensor_parallel_size)


def logits_ops(num_seqs: int, vocab_size: int, tensor_parallel_size: int, dtype_bytes: int) -> list[Op]:
    """``compute_logits`` for ``num_seqs`` rows: leaves ``logits``, the whole vocabulary's, live."""
    seqs = num_seqs
    shard = vocab_shard(vocab_size, tensor_parallel_size)
    if tensor_parallel_size == 1:
        # The LM head's output (logits_processor.py 0.11.0:90-92); one rank gathers nothing
        # (distributed/parallel_state.py 0.11.0:372).
        return [("logits", seqs * shard * dtype_bytes)]
    # V1 all-gathers the logits (logits_processor.py 0.11.0:69-77; platforms/interface.py 0.11.0:468-477):
    # into a [tp x n, shard] buffer, then movedim + reshape to [n, tp x shard], a copy
    # (distributed/device_communicators/base_device_communicator.py 0.11.0:137-153).
    full = seqs * shard * tensor_parallel_size * dtype_bytes
    return [
        ("logits_shard", seqs * shard * dtype_bytes),
        ("gathered", full),
        ("logits", full),
        ("gathered", None),
        ("logits_shard", None),
    ]


def sampler_ops(num_seqs: int, vocab_size: int, batch: SamplingBatch) -> list[Op]:
    """vLLM V1's ``Sampler.forward`` over ``num_seqs`` rows of logits for a batch of ``batch``'s requests,
    through the PyTorch-native top-k/top-p path (FlashInfer's replaces it only where the optional
    ``flashinfer`` extra is installed, topk_topp_sampler.py 0.11.0:37-70). Each op cites the line that
    allocates or frees it; leaves ``sampled`` (int32 ids) live. Per-request metadata (a few bytes a request)
    and top-k-only's ``topk`` values (rows x the largest top-k) are left out.

    The fp32 logits, the sort of them with int64 indices and the masks scale with sequences x vocabulary on
    every tensor-parallel rank: only the LM head's output is a shard."""
    n = num_seqs
    nv = n * vocab_size  # after the gather, the padding is sliced off (logits_processor.py 0.11.0:97-99)
    ops: list[Op] = [("logits_fp32", nv * 4)]  # Sampler.forward: logits.to(torch.float32) (sampler.py 0.11.0:86)
    if batch.greedy:
        ops.append(("greedy", n * 8))  # greedy_sample's argmax, int64 (sampler.py 0.11.0:139-140, 158)
    if not batch.random:  # all_greedy: the argmax is the answer (sampler.py 0.11.0:159-166)
        return ops + [
            ("sampled", n * 4),  # sampled.to(torch.int32) (sampler.py 0.11.0:115)
            ("greedy", None),
            ("logits_fp32", None),
        ]  # Sampler.forward returns
    # apply_temperature divides in place (sampler.py 0.11.0:137); then apply_top_k_top_p
    # (topk_topp_sampler.py 0.11.0:164-204) returns the logits untouched without top-k or top-p (176-178).
    filtered = "logits_fp32"
    if batch.top_p:
        # The sort -> fp32 values + int64 indices (183),
        ops += [("logits_sort", nv * 4), ("logits_idx", nv * 8)]
        if batch.top_k:
            ops.append(("top_k_mask", nv))  # logits_sort < top_k_mask, bool (190)
        ops += [
            ("probs_sort", nv * 4),  # softmax (195); the top-p cumsum writes into it (out=probs_sort, 196)
            ("top_p_mask", nv),  # probs_sum <= 1 - p, bool (197)
            ("top_k_top_p", nv * 4),
        ]  # logits_sort.scatter(...), a new tensor (203)
        ops += [
            (key, None)
            for key in ("logits_sort", "logits_idx", "top_k_mask", "probs_sort", "top_p_mask")
            if key != "top_k_mask" or batch.top_k
        ]  # the function's locals, freed at its return
        filtered = "top_k_top_p"
    elif batch.top_k:
        # apply_top_k_only, no sort (180-181, 207-229): logits < top_k_mask, a bool mask, then masked_fill_ in place.
        ops += [("top_k_mask", nv), ("top_k_mask", None)]
    ops += [
        ("probs", nv * 4),  # forward_native: softmax in fp32 (topk_topp_sampler.py 0.11.0:96)
        ("q", nv * 4),  # random_sample: torch.empty_like(probs) (241)
        ("random", n * 8),  # probs.div_(q).argmax(...) (253)
        ("q", None),
        ("probs", None),
    ]
    if filtered != "logits_fp32":
        ops.append((filtered, None))  # forward_native returns
    if batch.greedy:
        ops.append(("random", None))  # torch.where(..., out=greedy_sampled) (sampler.py 0.11.0:190-195)
        kept = "greedy"
    else:
        kept = "random"  # all_random: the random ids are the answer (sampler.py 0.11.0:187-188)
    return ops + [
        ("sampled", n * 4),  # sampled.to(torch.int32) (sampler.py 0.11.0:115)
        (kept, None),
        ("logits_fp32", None),
    ]  # Sampler.forward returns


def sampling_tail_ops(
    num_tokens: int,
    num_seqs: int,
    hidden_size: int,
    vocab_size: int,
    tensor_parallel_size: int,
    dtype_bytes: int,
    batch: SamplingBatch,
) -> list[Op]:
    """What ``execute_model`` does after the final norm (whose output, ``norm``, is live over ``num_tokens``):
    hidden_states[logits_indices] (a copy), compute_logits, then the sampler; the model's output, the copy and the
    logits are its locals until it returns (vllm/v1/worker/gpu_model_runner.py 0.11.0:2330-2331, 2366); the
    sampled ids are read back (.tolist(), 2144) and dropped with them."""
    return [
        ("last_hidden", num_seqs * hidden_size * dtype_bytes),
        *logits_ops(num_seqs, vocab_size, tensor_parallel_size, dtype_bytes),
        *sampler_ops(num_seqs, vocab_size, batch),
        ("logits", None),
        ("last_hidden", None),
        ("norm", None),
        ("sampled", None),
    ]


def live_peak_bytes(ops: Iterable[Op], held: int = 0) -> int:
    """The most bytes live at once while ``ops`` run, on top of ``held`` bytes live before them (a key freed
    that the ops did not allocate is part of ``held`` and stays counted)."""
    live: dict[Any, int] = {}
    now = peak = held
    for key, size in ops:
        if size is None:
            now -= live.pop(key, 0)
        else:
            now += size - live.get(key, 0)
            live[key] = size
            peak = max(peak, now)
    return peak


def unprofiled_sampler_peak_bytes(
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    hidden_size: int,
    vocab_size: int,
    tensor_parallel_size: int,
    dtype_bytes: int,
) -> int:
    """The activation peak of sampling the batch vLLM budgets for, for a release whose profile run computes the
    logits and runs no sampler (vllm-ascend's ``_dummy_sampler_run``; the era column ``profile_runs_sampler``):
    ``min(max_num_seqs, max_num_batched_tokens)`` sequences (vllm/v1/worker/gpu_model_runner.py 0.11.0:2977)
    sharing ``max_num_batched_tokens``, sampled with greedy, random, top-k and top-p requests together
    (``PROFILE_SAMPLING``: every path one batch can take at once, the most it holds). Live besides the tail
    (``sampling_tail_ops``): the step's input ids (int32), positions and slot mapping (int64), and the final
    norm's output over every token."""
    tokens = max_num_batched_tokens
    seqs = min(max_num_seqs, tokens)
    held = tokens * (4 + 8 + 8) + tokens * hidden_size * dtype_bytes
    tail = sampling_tail_ops(tokens, seqs, hidden_size, vocab_size, tensor_parallel_size, dtype_bytes, PROFILE_SAMPLING)
    return live_peak_bytes(tail, held)
