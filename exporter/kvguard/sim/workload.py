"""Tensor sizes of a vLLM forward pass, from a Hugging Face ``config.json``.

A forward is a list of ops, ``(key, size)`` to allocate and ``(key, None)`` to free, in
the order an eager runtime allocates and frees them (reference counting frees a
tensor right after its last use). Per decoder layer, for ``T`` scheduled tokens:

- attention: input norm ``T x hidden``; fused ``qkv_proj``; rotary outputs for q and k;
  the attention output; ``o_proj``; the residual add;
- MLA (``kv_lora_rank``): ``q_proj``, ``kv_a_proj`` (latent + rope), the ``kv_b_proj``
  up-projection, the attention output;
- MLP: post-attention norm, fused ``gate_up_proj`` (``T x 2 x intermediate``), the
  SiLU-and-mul output, ``down_proj``, the residual add;
- MoE (``n_routed_experts``): router logits (fp32), top-k weights and ids, the fused-MoE
  intermediate caches (``T x k x 2 x moe_intermediate``, ``T x k x moe_intermediate``,
  ``T x k x hidden``), plus shared experts as an MLP;
- chunked-prefill gather (MindSpore's FlashAttention path for second and later prefill
  chunks): the paged K and V of a sequence's whole context gathered into contiguous
  tensors for that layer's attention;

then the final norm, the last-token hidden states, the logits of ``S`` sequences and vLLM V1's sampler
on them as it runs for that batch (``sampler_ops``: greedy, top-k, top-p, both, as the batch's requests
ask, :class:`SamplingBatch`); or, for vLLM V1's profile run, its dummy sampler run with top-k and top-p
(``profile_sampler_ops``). Tensor parallelism shards
heads, intermediate sizes and the vocabulary of the weights (logits are gathered whole).
Weights are listed tensor by tensor, as vLLM's fused modules hold them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from kvguard.budget.estimator import (
    ConfigError,
    KVLayout,
    kv_layout_from_config,
    model_dtype_bytes,
    positive_int,
    text_config,
)
from kvguard.budget.sampler import (
    PROFILE_SAMPLING,
    Op,
    SamplingBatch,
    logits_ops,
    sampler_ops,
    sampling_tail_ops,
    vocab_shard,
)
from kvguard.sim.mindformers import MindFormersPath
from kvguard.sim.quantization import MINDFORMERS_PTQ, Linear, WeightFormat, weight_format


@dataclass(frozen=True)
class ModelShape:
    """Per-rank dimensions of a decoder-only model."""

    num_layers: int  # on this rank (the KV layout's: one pipeline stage)
    hidden_size: int
    num_heads: int  # per rank
    num_kv_heads: int  # per rank, the KV layout's (1 for MLA, whose paths do not use it)
    head_dim: int  # the KV layout's head size (for MLA the latent, unused by its paths)
    intermediate_size: int  # per rank
    vocab_size: int
    dtype_bytes: int
    weight_bytes_per_element: int  # 1 for 8-bit linear weights (int8, fp8), else the model dtype's
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    tensor_parallel_size: int = 1
    # MLA
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # per rank
    shared_intermediate_size: int = 0  # per rank, all shared experts together
    first_dense_layers: int = 0
    weight_format: WeightFormat = WeightFormat()
    # The token embedding whole on every rank (MindFormers' VocabEmbedding: kvguard.sim.mindformers), not
    # vLLM's vocab-parallel split.
    whole_embedding: bool = False
    # DeepSeek-V3's noaux_tc routing: an fp32 e_score_correction_bias per routed expert beside the router
    # (vllm/model_executor/models/deepseek_v2.py 0.11.0:163-167; MindFormers' loader casts it to fp32 too,
    # deepseekv3_weight_processor.py r0.2:128-135). vLLM 0.7.3 makes it in the model dtype (:123-125): 2 bytes
    # an expert less there, not modelled (29 KiB for DeepSeek-V3).
    router_score_bias: bool = False

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_dense_layers


def _int(text: Mapping[str, Any], *names: str, default: int | None = None, minimum: int = 1) -> int:
    """The first of ``names`` the config sets, as an integer >= ``minimum``; ConfigError otherwise."""
    value = positive_int(text, *names, minimum=minimum)
    if value is not None:
        return value
    if default is None:
        raise ConfigError(f"model config has no {names[0]}")
    return default


def model_shape(
    config: Mapping[str, Any],
    tensor_parallel_size: int = 1,
    layout: KVLayout | None = None,
    mindformers: MindFormersPath | None = None,
) -> ModelShape:
    """The per-rank shape of a model from its ``config.json`` (already parsed); ``mindformers``: the model runs
    MindFormers' network (kvguard.sim.mindformers), with its recipe's weights and embedding.

    Layers, KV heads and head size are the estimator's :class:`KVLayout` for the same config and
    tensor-parallel size (``layout``; built here when not given), so the simulated attention
    tensors and the KV cache vLLM sizes come from one reading of the config.

    Sizes and counts must be positive integers (integral floats are accepted, as JSON
    may write them), the optional MLA / MoE fields non-negative ones: anything else,
    ``inf`` and ``1e400`` included, is a :class:`ConfigError`.
    """
    if not isinstance(config, Mapping):
        raise ConfigError("model config must be a JSON object")
    if layout is None:
        layout = kv_layout_from_config(config, tensor_parallel_size=tensor_parallel_size)
    text = text_config(config)
    tp = tensor_parallel_size
    hidden = _int(text, "hidden_size", "n_embd", "d_model")
    heads = _int(text, "num_attention_heads", "n_head", "num_heads")
    dtype_bytes = model_dtype_bytes(config)
    weights = weight_format(config)
    if mindformers is not None and mindformers.quant_method == "ptq":
        weights = MINDFORMERS_PTQ
    weight_bytes = 1 if weights.quantized and weights.bits == 8 and weights.method != "gguf" else dtype_bytes
    n_experts = _int(text, "n_routed_experts", "num_local_experts", "num_experts", default=0, minimum=0)
    moe_inter = (
        _int(text, "moe_intermediate_size", default=_int(text, "intermediate_size", default=0)) if n_experts else 0
    )
    shared = _int(text, "n_shared_experts", default=0, minimum=0)
    return ModelShape(
        num_layers=layout.num_layers,
        hidden_size=hidden,
        num_heads=max(1, heads // tp),
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_size,
        intermediate_size=_int(text, "intermediate_size", default=4 * hidden) // tp,
        vocab_size=_int(text, "vocab_size"),
        dtype_bytes=dtype_bytes,
        weight_bytes_per_element=weight_bytes,
        weight_format=weights,
        qkv_bias=bool(text.get("attention_bias")) or text.get("model_type") == "qwen2",
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        tensor_parallel_size=tp,
        kv_lora_rank=_int(text, "kv_lora_rank", default=0, minimum=0),
        q_lora_rank=_int(text, "q_lora_rank", default=0, minimum=0),
        qk_nope_head_dim=_int(text, "qk_nope_head_dim", default=0, minimum=0),
        qk_rope_head_dim=_int(text, "qk_rope_head_dim", default=0, minimum=0),
        v_head_dim=_int(text, "v_head_dim", default=0, minimum=0),
        num_experts=n_experts,
        experts_per_token=_int(text, "num_experts_per_tok", default=0, minimum=0),
        moe_intermediate_size=moe_inter // tp if n_experts else 0,
        shared_intermediate_size=(shared * moe_inter) // tp if n_experts else 0,
        first_dense_layers=_int(text, "first_k_dense_replace", default=0, minimum=0),
        whole_embedding=mindformers is not None and not mindformers.vocab_parallel_embedding,
        router_score_bias=text.get("topk_method") == "noaux_tc",
    )


def _vocab_shard(shape: ModelShape) -> int:
    return vocab_shard(shape.vocab_size, shape.tensor_parallel_size)


def weight_tensors(shape: ModelShape) -> list[int]:
    """Bytes of each weight module one rank loads, in load order: norms, routers and biases in the model
    dtype, each linear as the checkpoint stores it (``shape.weight_format``: packed weights with their
    scales, zero points and ``g_idx``, or the model dtype for the modules left unquantized)."""
    dtype_bytes = shape.dtype_bytes
    hidden = shape.hidden_size
    fmt = shape.weight_format
    tp = shape.tensor_parallel_size
    vocab_shard = _vocab_shard(shape)

    def linear(
        name: str, k: int, n: int, layer: int = -1, partitions: int = 1, row: bool = False, count: int = 1
    ) -> int:
        # Row-parallel layers split their input over the ranks (RowParallelLinear), column-parallel and
        # replicated ones keep it whole (vllm/model_executor/layers/linear.py 0.11.0).
        module = Linear(
            name,
            k,
            n,
            partitions,
            k * tp if row else k,
            row and tp > 1,
            layer,
            shape.num_layers,
            max(1, shape.num_heads // max(1, shape.num_kv_heads)),
        )
        return count * fmt.linear_bytes(module, dtype_bytes)

    # GGUF quantizes the embedding too (gguf.py 0.11.0:60-70), a tied one as llama.cpp quantizes the output.
    embedding = "lm_head" if shape.tie_word_embeddings else "model.embed_tokens"
    embedding_rows = shape.vocab_size if shape.whole_embedding else vocab_shard
    tensors = [
        linear(embedding, hidden, vocab_shard) if fmt.method == "gguf" else embedding_rows * hidden * dtype_bytes
    ]
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}."
        tensors.append(hidden * dtype_bytes)  # input_layernorm
        if shape.is_mla:
            qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
            if shape.q_lora_rank:
                tensors += [
                    linear(prefix + "self_attn.q_a_proj", hidden, shape.q_lora_rank, layer),
                    shape.q_lora_rank * dtype_bytes,
                    linear(prefix + "self_attn.q_b_proj", shape.q_lora_rank, shape.num_heads * qk, layer),
                ]
            else:
                tensors.append(linear(prefix + "self_attn.q_proj", hidden, shape.num_heads * qk, layer))
            tensors += [
                linear(
                    prefix + "self_attn.kv_a_proj_with_mqa", hidden, shape.kv_lora_rank + shape.qk_rope_head_dim, layer
                ),
                shape.kv_lora_rank * dtype_bytes,
                linear(
                    prefix + "self_attn.kv_b_proj",
                    shape.kv_lora_rank,
                    shape.num_heads * (shape.qk_nope_head_dim + shape.v_head_dim),
                    layer,
                ),
                linear(prefix + "self_attn.o_proj", shape.num_heads * shape.v_head_dim, hidden, layer, row=True),
            ]
        else:
            qkv_out = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
            if fmt.method == "gguf":  # GGUF keeps q, k and v apart, each its own ggml type
                tensors.append(
                    linear(prefix + "self_attn.q_proj", hidden, shape.num_heads * shape.head_dim, layer)
                    + linear(prefix + "self_attn.k_proj", hidden, shape.num_kv_heads * shape.head_dim, layer)
                    + linear(prefix + "self_attn.v_proj", hidden, shape.num_kv_heads * shape.head_dim, layer)
                )
            else:
                tensors.append(linear(prefix + "self_attn.qkv_proj", hidden, qkv_out, layer, partitions=3))
            if shape.qkv_bias:
                tensors.append(qkv_out * dtype_bytes)
            tensors.append(
                linear(prefix + "self_attn.o_proj", shape.num_heads * shape.head_dim, hidden, layer, row=True)
            )
        tensors.append(hidden * dtype_bytes)  # post_attention_layernorm
        if shape.is_moe_layer(layer):
            tensors.append(shape.num_experts * hidden * dtype_bytes)  # router (a ReplicatedLinear without quant_config)
            if shape.router_score_bias:
                tensors.append(shape.num_experts * 4)
            tensors.append(
                linear(
                    prefix + "mlp.experts.gate_up_proj",
                    hidden,
                    2 * shape.moe_intermediate_size,
                    layer,
                    partitions=2,
                    count=shape.num_experts,
                )
            )
            tensors.append(
                linear(
                    prefix + "mlp.experts.down_proj",
                    shape.moe_intermediate_size,
                    hidden,
                    layer,
                    row=True,
                    count=shape.num_experts,
                )
            )
            if shape.shared_intermediate_size:
                tensors += [
                    linear(
                        prefix + "mlp.shared_experts.gate_up_proj",
                        hidden,
                        2 * shape.shared_intermediate_size,
                        layer,
                        partitions=2,
                    ),
                    linear(
                        prefix + "mlp.shared_experts.down_proj", shape.shared_intermediate_size, hidden, layer, row=True
                    ),
                ]
        else:
            tensors += [
                linear(prefix + "mlp.gate_up_proj", hidden, 2 * shape.intermediate_size, layer, partitions=2),
                linear(prefix + "mlp.down_proj", shape.intermediate_size, hidden, layer, row=True),
            ]
    tensors.append(hidden * dtype_bytes)  # final norm
    if not shape.tie_word_embeddings:
        tensors.append(linear("lm_head", hidden, vocab_shard))
    return tensors


def forward_ops(
    shape: ModelShape,
    num_tokens: int,
    num_seqs: int,
    gathered_kv_lens: tuple[int, ...] = (),
    sample: bool = True,
    profile_sampler: bool = False,
    sampling: SamplingBatch = SamplingBatch(),
) -> Iterator[Op]:
    """Allocations and frees of one forward pass (and sampling) over ``num_tokens`` tokens: the sampler as
    it runs for a batch of ``sampling`` (default: all greedy); with ``profile_sampler``, vLLM V1's profile
    run's (:func:`profile_sampler_ops`)."""
    head, layers, tail = forward_chunks(
        shape, num_tokens, num_seqs, gathered_kv_lens, sample, profile_sampler, sampling
    )
    yield from head
    for layer in layers:
        yield from layer
    yield from tail


def forward_chunks(
    shape: ModelShape,
    num_tokens: int,
    num_seqs: int,
    gathered_kv_lens: tuple[int, ...] = (),
    sample: bool = True,
    profile_sampler: bool = False,
    sampling: SamplingBatch = SamplingBatch(),
) -> tuple[list[Op], list[list[Op]], list[Op]]:
    """``forward_ops`` in three parts: the ops before the first decoder layer, each layer's ops, and the
    ops after the last one. Layers with the same ops are the same list (the simulator skips repeats by it)."""
    tokens = num_tokens
    dtype_bytes = shape.dtype_bytes
    hidden_bytes = tokens * shape.hidden_size * dtype_bytes
    head: list[Op] = [
        ("input_ids", tokens * 4),
        ("positions", tokens * 8),
        ("slot_mapping", tokens * 8),
        ("hidden", hidden_bytes),
    ]
    made: dict[tuple[bool, str], list[Op]] = {}
    layers: list[list[Op]] = []
    residual = "hidden"
    for layer in range(shape.num_layers):
        kind = (shape.is_moe_layer(layer), residual)
        ops = made.get(kind)
        if ops is None:
            ops = made[kind] = list(_layer_ops(shape, tokens, gathered_kv_lens, *kind))
        layers.append(ops)
        residual = "res_b"
    tail: list[Op] = [("norm", hidden_bytes), (residual, None)]
    if profile_sampler:
        # profile_run holds the model's output (the final norm's) and the last tokens' hidden states
        # (hidden_states[logit_indices], a copy) across the sampler run, and deletes them after it
        # (vllm/v1/worker/gpu_model_runner.py 0.11.0:3180, 3387-3402).
        tail += [
            ("last_hidden", num_seqs * shape.hidden_size * dtype_bytes),
            *profile_sampler_ops(shape, num_seqs),
            ("last_hidden", None),
            ("norm", None),
        ]
    elif sample:
        tail += sampling_tail_ops(
            num_tokens,
            num_seqs,
            shape.hidden_size,
            shape.vocab_size,
            shape.tensor_parallel_size,
            dtype_bytes,
            sampling,
        )
    else:
        tail.append(("norm", None))
    tail += [("input_ids", None), ("positions", None), ("slot_mapping", None)]
    return head, layers, tail


def profile_sampler_ops(shape: ModelShape, num_seqs: int) -> list[Op]:
    """vLLM V1's ``_dummy_sampler_run`` on CUDA (0.11.0), the end of its profile run: ``num_seqs`` dummy requests
    (min(max_num_seqs, max_num_batched_tokens), gpu_model_runner.py 0.11.0:2977) sampled at temperature 0.5,
    top-p 0.9 and top-k vocab - 1 (3198-3203), through the PyTorch-native top-k/top-p path (FlashInfer is an
    optional extra, topk_topp_sampler.py 0.11.0:37-59). Each op cites the line that allocates or frees it. Its
    per-request metadata tensors (a few bytes a request) are left out.

    The sort of fp32 logits with int64 indices, and the gathered logits, scale with sequences x vocabulary on
    every tensor-parallel rank: only the LM head's output is a shard."""
    n = num_seqs
    return [
        ("rand_hidden", n * shape.hidden_size * shape.dtype_bytes),  # torch.rand_like (gpu_model_runner.py 0.11.0:3189)
        *logits_ops(n, shape.vocab_size, shape.tensor_parallel_size, shape.dtype_bytes),
        *sampler_ops(n, shape.vocab_size, PROFILE_SAMPLING),
        ("logits", None),
        ("rand_hidden", None),  # _dummy_sampler_run returns
        ("sampled", None),
    ]  # del output (gpu_model_runner.py 0.11.0:3401)


def _layer_ops(
    shape: ModelShape, tokens: int, gathered_kv_lens: tuple[int, ...], moe: bool, residual: str
) -> Iterator[Op]:
    """One decoder layer's ops over ``t`` tokens; it frees ``residual``, the previous layer's output."""
    dtype_bytes = shape.dtype_bytes
    hidden_bytes = tokens * shape.hidden_size * dtype_bytes
    yield ("x", hidden_bytes)
    if shape.is_mla:
        qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
        yield ("q", tokens * shape.num_heads * qk * dtype_bytes)
        yield ("kv_a", tokens * (shape.kv_lora_rank + shape.qk_rope_head_dim) * dtype_bytes)
        yield ("x", None)
        yield ("kv_b", tokens * shape.num_heads * (shape.qk_nope_head_dim + shape.v_head_dim) * dtype_bytes)
        gathered = [
            (f"kv{i}", n * (shape.kv_lora_rank + shape.qk_rope_head_dim) * dtype_bytes)
            for i, n in enumerate(gathered_kv_lens)
        ]
        yield from gathered
        yield ("attn", tokens * shape.num_heads * shape.v_head_dim * dtype_bytes)
        for key, _ in gathered:
            yield (key, None)
        yield ("q", None)
        yield ("kv_a", None)
        yield ("kv_b", None)
    else:
        yield ("qkv", tokens * (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim * dtype_bytes)
        yield ("x", None)
        yield ("q_rot", tokens * shape.num_heads * shape.head_dim * dtype_bytes)
        yield ("k_rot", tokens * shape.num_kv_heads * shape.head_dim * dtype_bytes)
        gathered = []
        for i, n in enumerate(gathered_kv_lens):
            size = n * shape.num_kv_heads * shape.head_dim * dtype_bytes
            gathered += [(f"k{i}", size), (f"v{i}", size)]
        yield from gathered
        yield ("attn", tokens * shape.num_heads * shape.head_dim * dtype_bytes)
        for key, _ in gathered:
            yield (key, None)
        yield ("q_rot", None)
        yield ("k_rot", None)
        yield ("qkv", None)
    yield ("o", hidden_bytes)
    yield ("attn", None)
    yield ("res_a", hidden_bytes)
    yield ("o", None)
    yield (residual, None)
    yield ("x2", hidden_bytes)
    if moe:
        k = shape.experts_per_token
        yield ("router", tokens * shape.num_experts * 4)
        yield ("topk_w", tokens * k * 4)
        yield ("topk_ids", tokens * k * 4)
        yield ("router", None)
        yield ("cache1", tokens * k * 2 * shape.moe_intermediate_size * dtype_bytes)
        yield ("cache2", tokens * k * shape.moe_intermediate_size * dtype_bytes)
        yield ("cache1", None)
        yield ("cache3", tokens * k * shape.hidden_size * dtype_bytes)
        yield ("cache2", None)
        yield ("moe_out", hidden_bytes)
        yield ("cache3", None)
        yield ("topk_w", None)
        yield ("topk_ids", None)
        if shape.shared_intermediate_size:
            yield ("gu", tokens * 2 * shape.shared_intermediate_size * dtype_bytes)
            yield ("act", tokens * shape.shared_intermediate_size * dtype_bytes)
            yield ("gu", None)
            yield ("down", hidden_bytes)
            yield ("act", None)
            yield ("down", None)
        yield ("x2", None)
        yield ("res_b", hidden_bytes)
        yield ("moe_out", None)
    else:
        yield ("gu", tokens * 2 * shape.intermediate_size * dtype_bytes)
        yield ("x2", None)
        yield ("act", tokens * shape.intermediate_size * dtype_bytes)
        yield ("gu", None)
        yield ("down", hidden_bytes)
        yield ("act", None)
        yield ("res_b", hidden_bytes)
        yield ("down", None)
    yield ("res_a", None)
