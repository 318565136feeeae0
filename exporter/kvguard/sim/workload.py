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

then the final norm, the last-token hidden states, logits in the model dtype and in
fp32, probabilities, and sampled ids for ``S`` sequences. Tensor parallelism shards
heads, intermediate sizes and the vocabulary of the weights (logits are gathered whole).
Weights are listed tensor by tensor, as vLLM's fused modules hold them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from kvguard.budget.estimator import ConfigError, KVLayout, positive_int, text_config, kv_layout_from_config, model_dtype_bytes

Op = tuple[Any, "int | None"]


@dataclass(frozen=True)
class ModelShape:
    """Per-rank dimensions of a decoder-only model."""

    num_layers: int           # on this rank (the KV layout's: one pipeline stage)
    hidden_size: int
    num_heads: int            # per rank
    num_kv_heads: int         # per rank, the KV layout's (1 for MLA, whose paths do not use it)
    head_dim: int             # the KV layout's head size (for MLA the latent, unused by its paths)
    intermediate_size: int    # per rank
    vocab_size: int
    dtype_bytes: int
    weight_bytes_per_element: int
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
    moe_intermediate_size: int = 0      # per rank
    shared_intermediate_size: int = 0   # per rank, all shared experts together
    first_dense_layers: int = 0

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


def model_shape(config: Mapping[str, Any], tensor_parallel_size: int = 1,
                layout: KVLayout | None = None) -> ModelShape:
    """The per-rank shape of a model from its ``config.json`` (already parsed).

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
    quant = text.get("quantization_config") or config.get("quantization_config") or {}
    if not isinstance(quant, Mapping):
        quant = {}
    # Linear weights in one byte: fp8 checkpoints, and compressed-tensors ones whose every config group stores
    # 8-bit weights (int8 or fp8: vLLM creates them as torch.int8 / torch.float8_e4m3fn, vllm/model_executor/
    # layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_int8.py 0.11.0:56-61,
    # compressed_tensors_w8a8_fp8.py create_fp8_weight_parameter). Their per-channel fp32 scales (w8a8_int8.py
    # 0.11.0:68-72, 4 bytes an output row) are not counted: under 0.1% of the weights. Other bit widths keep
    # the model dtype (not modelled).
    method = str(quant.get("quant_method", "")).lower()
    groups = quant.get("config_groups") if method == "compressed-tensors" else None
    group_bits = [group["weights"].get("num_bits") if isinstance(group, Mapping)
                  and isinstance(group.get("weights"), Mapping) else None
                  for group in (groups.values() if isinstance(groups, Mapping) else ())]
    eight_bit = method in ("fp8", "fbgemm_fp8") or (bool(group_bits) and all(b == 8 for b in group_bits))
    weight_bytes = 1 if eight_bit else dtype_bytes
    n_experts = _int(text, "n_routed_experts", "num_local_experts", "num_experts", default=0, minimum=0)
    moe_inter = _int(text, "moe_intermediate_size", default=_int(text, "intermediate_size", default=0)) \
        if n_experts else 0
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
    )


def weight_tensors(shape: ModelShape) -> list[int]:
    """Bytes of each weight tensor one rank loads, in load order."""
    s = shape
    w = s.weight_bytes_per_element
    d = s.dtype_bytes
    h = s.hidden_size
    # VocabParallelEmbedding / ParallelLMHead pad the vocabulary to a multiple of 64, then split it evenly
    # (vllm/model_executor/layers/vocab_parallel_embedding.py 0.11.0:60-63 pad_vocab_size, 226-231, 263).
    padded_vocab = -(-s.vocab_size // 64) * 64
    vocab_shard = -(-padded_vocab // s.tensor_parallel_size)
    tensors = [vocab_shard * h * d]
    for layer in range(s.num_layers):
        tensors.append(h * d)  # input_layernorm
        if s.is_mla:
            qk = s.qk_nope_head_dim + s.qk_rope_head_dim
            if s.q_lora_rank:
                tensors += [s.q_lora_rank * h * w, s.q_lora_rank * d, s.num_heads * qk * s.q_lora_rank * w]
            else:
                tensors.append(s.num_heads * qk * h * w)
            tensors += [(s.kv_lora_rank + s.qk_rope_head_dim) * h * w, s.kv_lora_rank * d,
                        s.num_heads * (s.qk_nope_head_dim + s.v_head_dim) * s.kv_lora_rank * w,
                        h * s.num_heads * s.v_head_dim * w]
        else:
            qkv_out = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
            tensors.append(qkv_out * h * w)
            if s.qkv_bias:
                tensors.append(qkv_out * d)
            tensors.append(h * s.num_heads * s.head_dim * w)
        tensors.append(h * d)  # post_attention_layernorm
        if s.is_moe_layer(layer):
            tensors.append(s.num_experts * h * d)  # router
            tensors.append(s.num_experts * 2 * s.moe_intermediate_size * h * w)
            tensors.append(s.num_experts * h * s.moe_intermediate_size * w)
            if s.shared_intermediate_size:
                tensors += [2 * s.shared_intermediate_size * h * w, h * s.shared_intermediate_size * w]
        else:
            tensors += [2 * s.intermediate_size * h * w, h * s.intermediate_size * w]
    tensors.append(h * d)  # final norm
    if not s.tie_word_embeddings:
        tensors.append(vocab_shard * h * d)
    return tensors


def forward_ops(shape: ModelShape, num_tokens: int, num_seqs: int, gathered_kv_lens: tuple[int, ...] = (),
                sample: bool = True) -> Iterator[Op]:
    """Allocations and frees of one forward pass (and sampling) over ``num_tokens`` tokens."""
    head, layers, tail = forward_chunks(shape, num_tokens, num_seqs, gathered_kv_lens, sample)
    yield from head
    for layer in layers:
        yield from layer
    yield from tail


def forward_chunks(shape: ModelShape, num_tokens: int, num_seqs: int, gathered_kv_lens: tuple[int, ...] = (),
                   sample: bool = True) -> tuple[list[Op], list[list[Op]], list[Op]]:
    """``forward_ops`` in three parts: the ops before the first decoder layer, each layer's ops, and the
    ops after the last one. Layers with the same ops are the same list (the simulator skips repeats by it)."""
    s = shape
    t = num_tokens
    d = s.dtype_bytes
    h = t * s.hidden_size * d
    head: list[Op] = [("input_ids", t * 4), ("positions", t * 8), ("slot_mapping", t * 8), ("hidden", h)]
    made: dict[tuple[bool, str], list[Op]] = {}
    layers: list[list[Op]] = []
    residual = "hidden"
    for layer in range(s.num_layers):
        kind = (s.is_moe_layer(layer), residual)
        ops = made.get(kind)
        if ops is None:
            ops = made[kind] = list(_layer_ops(s, t, gathered_kv_lens, *kind))
        layers.append(ops)
        residual = "res_b"
    tail: list[Op] = [("norm", h), (residual, None)]
    if sample:
        v = s.vocab_size
        tail += [("last_hidden", num_seqs * s.hidden_size * d), ("norm", None), ("logits", num_seqs * v * d),
                 ("last_hidden", None), ("logits_fp32", num_seqs * v * 4), ("logits", None),
                 ("probs", num_seqs * v * 4), ("sampled", num_seqs * 8), ("logits_fp32", None), ("probs", None),
                 ("sampled", None)]
    else:
        tail.append(("norm", None))
    tail += [("input_ids", None), ("positions", None), ("slot_mapping", None)]
    return head, layers, tail


def _layer_ops(s: ModelShape, t: int, gathered_kv_lens: tuple[int, ...], moe: bool, residual: str) -> Iterator[Op]:
    """One decoder layer's ops over ``t`` tokens; it frees ``residual``, the previous layer's output."""
    d = s.dtype_bytes
    h = t * s.hidden_size * d
    yield ("x", h)
    if s.is_mla:
        qk = s.qk_nope_head_dim + s.qk_rope_head_dim
        yield ("q", t * s.num_heads * qk * d)
        yield ("kv_a", t * (s.kv_lora_rank + s.qk_rope_head_dim) * d)
        yield ("x", None)
        yield ("kv_b", t * s.num_heads * (s.qk_nope_head_dim + s.v_head_dim) * d)
        gathered = [(f"kv{i}", n * (s.kv_lora_rank + s.qk_rope_head_dim) * d)
                    for i, n in enumerate(gathered_kv_lens)]
        yield from gathered
        yield ("attn", t * s.num_heads * s.v_head_dim * d)
        for key, _ in gathered:
            yield (key, None)
        yield ("q", None)
        yield ("kv_a", None)
        yield ("kv_b", None)
    else:
        yield ("qkv", t * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim * d)
        yield ("x", None)
        yield ("q_rot", t * s.num_heads * s.head_dim * d)
        yield ("k_rot", t * s.num_kv_heads * s.head_dim * d)
        gathered = []
        for i, n in enumerate(gathered_kv_lens):
            size = n * s.num_kv_heads * s.head_dim * d
            gathered += [(f"k{i}", size), (f"v{i}", size)]
        yield from gathered
        yield ("attn", t * s.num_heads * s.head_dim * d)
        for key, _ in gathered:
            yield (key, None)
        yield ("q_rot", None)
        yield ("k_rot", None)
        yield ("qkv", None)
    yield ("o", h)
    yield ("attn", None)
    yield ("res_a", h)
    yield ("o", None)
    yield (residual, None)
    yield ("x2", h)
    if moe:
        k = s.experts_per_token
        yield ("router", t * s.num_experts * 4)
        yield ("topk_w", t * k * 4)
        yield ("topk_ids", t * k * 4)
        yield ("router", None)
        yield ("cache1", t * k * 2 * s.moe_intermediate_size * d)
        yield ("cache2", t * k * s.moe_intermediate_size * d)
        yield ("cache1", None)
        yield ("cache3", t * k * s.hidden_size * d)
        yield ("cache2", None)
        yield ("moe_out", h)
        yield ("cache3", None)
        yield ("topk_w", None)
        yield ("topk_ids", None)
        if s.shared_intermediate_size:
            yield ("gu", t * 2 * s.shared_intermediate_size * d)
            yield ("act", t * s.shared_intermediate_size * d)
            yield ("gu", None)
            yield ("down", h)
            yield ("act", None)
            yield ("down", None)
        yield ("x2", None)
        yield ("res_b", h)
        yield ("moe_out", None)
    else:
        yield ("gu", t * 2 * s.intermediate_size * d)
        yield ("x2", None)
        yield ("act", t * s.intermediate_size * d)
        yield ("gu", None)
        yield ("down", h)
        yield ("act", None)
        yield ("res_b", h)
        yield ("down", None)
    yield ("res_a", None)
