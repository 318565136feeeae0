"""How a checkpoint stores its linear weights, from ``config.json``'s ``quantization_config``.

vLLM creates a quantized linear's parameters in its method's ``create_weights`` at the shapes the checkpoint
stores (packed integers, scales, zero points, ``g_idx``), and leaves some modules at full width (the
embeddings, norms and routers always; ``lm_head`` and the modules a config names in
``modules_to_not_convert`` / ``ignore`` / ``ignored_layers`` / ``llm_int8_skip_modules``). One
:class:`WeightFormat` per checkpoint answers, for one rank's share of one linear, how many bytes it holds
(:meth:`WeightFormat.linear_bytes`). Each rule cites vLLM 0.11.0's file and line
(``vllm/model_executor/layers/quantization/``, the wheel's source).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from kvguard.budget.estimator import ConfigError

# ggml's block sizes, (elements per block, bytes per block): gguf-py's GGML_QUANT_SIZES (gguf 0.19.0,
# gguf/constants.py:4232-4269), which vLLM's GGUF method reads to size each tensor (gguf.py 0.11.0:135, 293).
GGML_BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "IQ2_XXS": (256, 66),
    "IQ2_XS": (256, 74),
    "IQ3_XXS": (256, 98),
    "IQ1_S": (256, 50),
    "IQ4_NL": (32, 18),
    "IQ3_S": (256, 110),
    "IQ2_S": (256, 82),
    "IQ4_XS": (256, 136),
    "IQ1_M": (256, 56),
    "MXFP4": (32, 17),
}

# A GGUF file type (llama.cpp's ftype, the name a file carries: "Q4_K_M") -> its base tensor type
# (llama.cpp src/llama-quant.cpp @8784689, llama_model_quantize_impl's default_type switch).
GGUF_FILE_TYPES: dict[str, str] = {
    "F32": "F32",
    "F16": "F16",
    "BF16": "BF16",
    "Q4_0": "Q4_0",
    "Q4_1": "Q4_1",
    "Q5_0": "Q5_0",
    "Q5_1": "Q5_1",
    "Q8_0": "Q8_0",
    "Q2_K": "Q2_K",
    "Q3_K_S": "Q3_K",
    "Q3_K_M": "Q3_K",
    "Q3_K_L": "Q3_K",
    "Q4_K_S": "Q4_K",
    "Q4_K_M": "Q4_K",
    "Q5_K_S": "Q5_K",
    "Q5_K_M": "Q5_K",
    "Q6_K": "Q6_K",
}
# A K-quant whose row (the input size) is not whole blocks falls back (llama_tensor_get_type's
# convert_incompatible_tensor switch).
K_FALLBACK = {"Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def ggml_bytes(ggml_type: str, rows: int, columns: int) -> int:
    """Bytes of a ``rows x columns`` ggml tensor of this type (rows of whole blocks, as ggml stores them)."""
    elements, block_bytes = GGML_BLOCKS[ggml_type]
    return rows * -(-columns // elements) * block_bytes


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits (src/llama-quant.cpp): the first and last eighth of the layers, and every
    third one between them."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


@dataclass(frozen=True)
class Linear:
    """One rank's share of one linear module, as vLLM's ``LinearBase`` hands it to ``create_weights``."""

    name: str  # vLLM's module prefix, e.g. "model.layers.3.mlp.down_proj"
    input_size: int  # per rank (input_size_per_partition)
    output_size: int  # per rank, all fused partitions together (sum(output_partition_sizes))
    partitions: int = 1  # fused output partitions (qkv: 3, gate_up: 2)
    full_input_size: int = 0  # the layer's whole input (input_size); 0: the same as input_size
    row_parallel: bool = False
    layer: int = -1  # decoder layer index (GGUF mixes), -1 outside the layers
    layers: int = 0
    gqa: int = 1  # query heads per KV head (GGUF's Q2_K attn_v rule)

    @property
    def whole_input(self) -> int:
        return self.full_input_size or self.input_size


def _packed(bits: int, elements: int) -> int:
    """Bytes of ``elements`` ``bits``-wide integers packed into int32 words (32 // bits to a word)."""
    per_word = 32 // bits
    return -(-elements // per_word) * 4


@dataclass(frozen=True)
class WeightFormat:
    """How a checkpoint stores its linear weights. ``method`` "" is unquantized (the model dtype)."""

    method: str = ""
    bits: int = 16
    group_size: int = -1  # input elements per scale; -1: one per output channel
    zero_points: bool = False
    g_idx: bool = False  # GPTQ act-order / compressed-tensors actorder "group"
    desc_act: bool = False
    strategy: str = "channel"  # fp8 / int8 scales: tensor, channel, block
    block: tuple[int, int] = (0, 0)  # (block_n, block_k) of block-wise fp8 scales
    static_input_scale: bool = False
    double_quant: bool = False  # bitsandbytes 4-bit nested absmax
    blocksize: int = 64  # bitsandbytes 4-bit elements per absmax
    lm_head: bool = False  # lm_head quantized too
    skip: tuple[str, ...] = ()  # module names kept at full width
    skip_patterns: tuple[str, ...] = ()  # compressed-tensors "re:" ignore entries
    gguf_file_type: str = ""
    cite: str = "unquantized: the model dtype"

    @property
    def quantized(self) -> bool:
        return bool(self.method)

    @property
    def name(self) -> str:
        """What plan prints as the weights' storage, e.g. "awq int4 g128", "fp8", "gguf Q4_K_M"."""
        if not self.method:
            return ""
        if self.method == "gguf":
            return f"gguf {self.gguf_file_type}"
        if self.method in ("fp8", "compressed-tensors fp8"):
            return self.method
        if self.method == "mindformers_ptq":
            return "mindformers ptq int8 (W8A8)"
        group = f" g{self.group_size}" if self.group_size > 0 else ""
        return f"{self.method} int{self.bits}{group}"

    def skips(self, name: str) -> bool:
        """Whether vLLM leaves this module unquantized by the config's skip list."""
        if self.method in ("awq", "gguf"):
            # is_layer_skipped_awq: any listed name as a substring of the prefix (awq.py 0.11.0:120-121).
            return any(module in name for module in self.skip)
        if self.method == "bitsandbytes":
            # is_layer_skipped_bnb: a listed name as one of the prefix's dotted components, or a prefix of it
            # (bitsandbytes.py 0.11.0:141-155).
            parts = set(name.split("."))
            return bool(parts & set(self.skip)) or any(
                name.startswith(module + ".") or name == module for module in self.skip
            )
        # fp8's is_layer_skipped (quantization/utils/quant_utils.py 0.11.0:265-304) and compressed-tensors'
        # should_ignore_layer (compressed_tensors/utils.py 0.11.0:23-72, 154-170): the name itself, or with "re:"
        # a regex; a fused qkv / gate_up module by its checkpoint parts; experts by a listed name containing it.
        if ".experts." in name:
            return any(name in module for module in self.skip if "experts" in module)
        return all(p in self.skip or any(re.match(r, p) for r in self.skip_patterns) for p in _unfused(name))

    def covers(self, linear: Linear) -> bool:
        """Whether this linear is stored quantized."""
        if not self.method:
            return False
        if linear.name.endswith("lm_head"):
            return self.lm_head and not self.skips(linear.name)
        return not self.skips(linear.name)

    def linear_bytes(self, linear: Linear, dtype_bytes: int) -> int:
        """Bytes of every tensor vLLM holds for this rank's share of the linear."""
        k, n = linear.input_size, linear.output_size
        if self.method == "gguf":
            return ggml_bytes(self.gguf_type(linear), n, k)
        if not self.covers(linear):
            return k * n * dtype_bytes
        return getattr(self, "_" + self.method.replace("-", "_").replace(" ", "_"))(linear, dtype_bytes)

    def _groups(self, linear: Linear, partition: bool) -> int:
        group = self.group_size if self.group_size > 0 else linear.whole_input
        return (linear.input_size if partition else linear.whole_input) // group

    # AWQ (awq.py 0.11.0:139-189): qweight K x N/8 int32, qzeros K/g x N/8 int32, scales K/g x N in the
    # model dtype; group -1 is one group over the whole input (:140-143). awq_marlin, which vLLM picks for
    # an AWQ checkpoint on a GPU it supports, repacks these into the same bytes (awq_marlin.py 0.11.0).
    def _awq(self, linear: Linear, d: int) -> int:
        k, n = linear.input_size, linear.output_size
        groups = self._groups(linear, partition=True)
        return _packed(self.bits, k * n) + groups * _packed(self.bits, n) + groups * n * d

    # GPTQ (gptq.py 0.11.0:221-300): qweight K/pack x N int32, g_idx K int32, qzeros and scales of
    # input_size // g rows: the whole input's, except a row-parallel layer without act-order (:229-236).
    # gptq_marlin (gptq_marlin.py 0.11.0:341-400) has the same tensors; its scales repeat on every rank when
    # act-order or channel-wise meets a row-parallel layer (marlin_utils.py 0.11.0:216-221).
    def _gptq(self, linear: Linear, d: int) -> int:
        k, n = linear.input_size, linear.output_size
        partition = (
            linear.row_parallel and self.group_size != -1 and not self.desc_act
            if self.method == "gptq"
            else not (self.desc_act or (self.group_size == -1 and linear.row_parallel))
        )
        groups = self._groups(linear, partition)
        return _packed(self.bits, k * n) + k * 4 + groups * _packed(self.bits, n) + groups * n * d

    _gptq_marlin = _gptq

    # compressed-tensors W4A16 / W8A16 (pack-quantized; compressed_tensors_wNa16.py 0.11.0:98-186): weight_packed
    # N x K/pack int32, weight_scale N x groups in the model dtype, weight_shape 2 int64, weight_zero_point
    # N/pack x groups int32 when asymmetric, weight_g_idx K int32 with actorder "group"; scales repeat on
    # every rank as gptq_marlin's do (:100-108).
    def _compressed_tensors_wna16(self, linear: Linear, d: int) -> int:
        k, n = linear.input_size, linear.output_size
        partition = not (self.g_idx or (self.group_size == -1 and linear.row_parallel))
        groups = self._groups(linear, partition)
        zeros = _packed(self.bits, n) * groups if self.zero_points else 0
        return _packed(self.bits, k * n) + n * groups * d + 16 + zeros + (k * 4 if self.g_idx else 0)

    # 8-bit weights (int8 or fp8) with fp32 scales: per tensor one per fused partition, per channel one per
    # output row, per block one per block_n x block_k tile; a static input scale per partition.
    # fp8.py 0.11.0:285-330 (create_fp8_weight_parameter, create_fp8_scale_parameter: fp8_utils.py
    # 0.11.0:785-845); compressed_tensors_w8a8_int8.py 0.11.0:57-95; compressed_tensors_w8a8_fp8.py
    # 0.11.0:59-95.
    def _eight_bit(self, linear: Linear, d: int) -> int:
        k, n = linear.input_size, linear.output_size
        if self.strategy == "block":
            block_n, block_k = self.block
            scales = -(-n // block_n) * -(-k // block_k)
        elif self.strategy == "channel":
            scales = n
        else:
            scales = linear.partitions
        inputs = linear.partitions if self.static_input_scale else 0
        return k * n + 4 * (scales + inputs)

    _fp8 = _eight_bit
    _compressed_tensors_fp8 = _eight_bit
    _compressed_tensors_int8 = _eight_bit

    # bitsandbytes (bitsandbytes.py 0.11.0:186-230): 4-bit, uint8 K*N / quant_ratio (two weights a byte) plus
    # the quant state bitsandbytes_loader.py restores beside it: an absmax per `blocksize` weights, fp32, or
    # with double quantization uint8 with an fp32 absmax per 256 of them; 8-bit, int8 N x K plus an fp32 SCB
    # per output row.
    def _bitsandbytes(self, linear: Linear, d: int) -> int:
        k, n = linear.input_size, linear.output_size
        if self.bits == 8:
            return k * n + 4 * n
        blocks = -(-k * n // self.blocksize)
        absmax = blocks + 4 * -(-blocks // 256) if self.double_quant else 4 * blocks
        return -(-k * n // 2) + absmax

    # vllm-mindspore's golden-stick W8A8 (vllm_mindspore/model_executor/layers/quantization/golden_stick/
    # a8w8.py 0.5.1:39-111): int8 weight N x K, fp32 deq_scale and int32 quant_bias per output row (deq_scale
    # becomes int64 on 310P only, :113-120); input_scale (model dtype) and int8 input_offset per input column
    # (:71-82), or for ModelSlim checkpoints one of each plus a model-dtype beta per input column (:83-97).
    def _golden_stick(self, linear: Linear, d: int) -> int:
        k, n = linear.input_size, linear.output_size
        return k * n + 8 * n + k * (d + 1)

    def _modelslim(self, linear: Linear, d: int) -> int:
        k, n = linear.input_size, linear.output_size
        return k * n + 8 * n + 2 * d + k * d

    # MindFormers' DeepSeek-V3 under golden-stick's W8A8 'ptq' (vllm_mindspore mf_models/deepseek_v3.py r0.2:150-165
    # create_ptq; loads in deepseekv3_weight_processor.py r0.2): int8 weights everywhere but the blacklisted lkv2kv
    # (kv_b_proj) and lm_head, which stay in the model dtype. Attention (per-tensor activations, outlier
    # suppression plus): an int32 quant_bias and an fp32 deq_scale per output row, one input scale and int8 offset
    # (:428-506), and a model-dtype beta per input column on the layers after a norm, q_a / kv_a (from
    # input_layernorm.bias) and q_b (from q_a_layernorm.bias) (:506-530). Feed-forward layers, routed and shared
    # experts (per-token dynamic activations): one model-dtype weight_scale per output row (:115-399).
    def _mindformers_ptq(self, linear: Linear, d: int) -> int:
        k, n = linear.input_size, linear.output_size
        if linear.name.endswith("kv_b_proj"):
            return k * n * d
        if ".self_attn." in linear.name:
            after_norm = linear.name.endswith(("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj"))
            return k * n + 8 * n + d + 1 + (k * d if after_norm else 0)
        return k * n + d * n

    def gguf_type(self, linear: Linear) -> str:
        """The ggml type a GGUF file of this file type stores the linear in (embeddings too): llama.cpp's
        llama_tensor_get_type (src/llama-quant.cpp @8784689) for the dense tensors of a Llama-like model, the
        70B and eight-expert special cases left out."""
        file_type = self.gguf_file_type
        chosen = base = GGUF_FILE_TYPES[file_type]
        name, i, n = linear.name, linear.layer, linear.layers
        if self.skips(name):
            return "F32" if base == "F32" else "F16"
        if name.endswith("lm_head"):
            # output.weight (and a tied token_embd): Q6_K for every K-quant and legacy type but Q8_0.
            chosen = (
                "Q8_0"
                if base == "Q8_0" or linear.input_size % GGML_BLOCKS[base][0]
                else ("Q6_K" if base not in ("F32", "F16", "BF16") else base)
            )
        elif name.endswith("v_proj"):
            if file_type == "Q2_K":
                chosen = "Q4_K" if linear.gqa >= 4 else "Q3_K"
            elif file_type == "Q3_K_M":
                chosen = "Q5_K" if i < 2 else "Q4_K"
            elif file_type == "Q3_K_L":
                chosen = "Q5_K"
            elif file_type in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
                chosen = "Q6_K"
            elif file_type == "Q4_K_S" and i < 4:
                chosen = "Q5_K"
        elif name.endswith("down_proj"):
            if file_type == "Q2_K":
                chosen = "Q3_K"
            elif file_type == "Q3_K_M":
                chosen = "Q5_K" if i < n // 16 else "Q4_K"
            elif file_type == "Q3_K_L":
                chosen = "Q5_K"
            elif file_type in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
                chosen = "Q6_K"
            elif file_type == "Q4_K_S" and i < n // 8:
                chosen = "Q5_K"
        elif name.endswith("o_proj"):
            chosen = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(file_type, base)
        if chosen in K_FALLBACK and linear.input_size % GGML_BLOCKS[chosen][0]:
            chosen = K_FALLBACK[chosen]
        return chosen


def _unfused(name: str) -> list[str]:
    """A fused module's checkpoint names (vLLM's packed_modules_mapping for Llama / Qwen2 / DeepSeek)."""
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if name.endswith(fused):
            return [name[: -len(fused)] + part for part in parts]
    return [name]


def _bits(value: Any, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value <= 0:
        raise ConfigError(f"quantization_config bits is not a positive integer ({value!r})")
    return int(value)


def _names(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, (list, tuple)) else ()


def weight_format(config: Mapping[str, Any]) -> WeightFormat:
    """The weight format of a checkpoint from its ``quantization_config`` (top level or the text config's); a GGUF
    file's is ``{"quant_method": "gguf", "file_type": ...}`` (:func:`with_quantization_flag` writes it from the file's
    name). Unknown methods keep the model dtype."""
    quant = config.get("quantization_config")
    if not isinstance(quant, Mapping):
        nested = [config.get(key) for key in ("text_config", "llm_config", "language_config")]
        quant = next(
            (
                n.get("quantization_config")
                for n in nested
                if isinstance(n, Mapping) and isinstance(n.get("quantization_config"), Mapping)
            ),
            None,
        )
    quant = quant if isinstance(quant, Mapping) else {}
    method = str(quant.get("quant_method", "")).lower().replace("_", "-")
    if method == "gguf":
        file_type = str(quant.get("file_type", "")).upper()
        if file_type not in GGUF_FILE_TYPES:
            raise ConfigError(
                f"GGUF file type {file_type or '(none)'} is not one kvguard sizes (known: {', '.join(GGUF_FILE_TYPES)})"
            )
        # vLLM's GGUF method quantizes the embedding too (gguf.py 0.11.0:60-70: GGUFEmbeddingMethod for
        # VocabParallelEmbedding); norms and biases are F32 in the file and loaded in the model dtype.
        return WeightFormat("gguf", gguf_file_type=file_type, cite="vllm gguf.py 0.11.0:338-380; ggml blocks")
    if method in ("awq", "awq-marlin"):
        # AWQConfig.from_config (awq.py 0.11.0:68-79): w_bit / bits, q_group_size / group_size,
        # modules_to_not_convert; lm_head is never quantized (:84-91).
        return WeightFormat(
            "awq",
            bits=_bits(quant.get("bits", quant.get("w_bit")), 4),
            group_size=int(quant.get("group_size", quant.get("q_group_size", 128))),
            zero_points=bool(quant.get("zero_point", True)),
            skip=_names(quant.get("modules_to_not_convert")),
            cite="vllm awq.py 0.11.0:134-189",
        )
    if method in ("gptq", "gptq-marlin"):
        # GPTQConfig.from_config (gptq.py 0.11.0:113-128): bits, group_size, desc_act, lm_head.
        return WeightFormat(
            "gptq_marlin" if method == "gptq-marlin" else "gptq",
            bits=_bits(quant.get("bits"), 4),
            group_size=int(quant.get("group_size", 128)),
            zero_points=True,
            g_idx=True,
            desc_act=bool(quant.get("desc_act", False)),
            lm_head=bool(quant.get("lm_head", False)),
            cite="vllm gptq.py 0.11.0:197-300",
        )
    if method in ("fp8", "fbgemm-fp8"):
        # Fp8Config.from_config (fp8.py 0.11.0:110-135): activation_scheme, ignored_layers, weight_block_size.
        block = quant.get("weight_block_size")
        block_quant = isinstance(block, (list, tuple)) and len(block) == 2
        return WeightFormat(
            "fp8",
            bits=8,
            strategy="block" if block_quant else ("channel" if method == "fbgemm-fp8" else "tensor"),
            block=(int(block[0]), int(block[1])) if block_quant else (0, 0),
            static_input_scale=quant.get("activation_scheme") == "static",
            skip=_names(quant.get("ignored_layers") or quant.get("modules_to_not_convert")),
            cite="vllm fp8.py 0.11.0:258-330",
        )
    if method == "bitsandbytes":
        # BitsAndBytesConfig.from_config (bitsandbytes.py 0.11.0:86-127).
        eight = bool(quant.get("load_in_8bit", False))
        return WeightFormat(
            "bitsandbytes",
            bits=8 if eight else 4,
            double_quant=bool(quant.get("bnb_4bit_use_double_quant", False)),
            skip=_names(quant.get("llm_int8_skip_modules")),
            cite="vllm bitsandbytes.py 0.11.0:186-230",
        )
    if method in ("golden-stick", "goldenstick", "modelslim"):
        # vllm-mindspore's GoldenStickConfig / ModelSlimConfig (golden_stick/golden_stick.py 0.5.1:127-190).
        return WeightFormat(
            "modelslim" if method == "modelslim" else "golden_stick",
            bits=8,
            skip=_names(quant.get("ignore")),
            cite="vllm_mindspore golden_stick/a8w8.py 0.5.1:39-111",
        )
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    return WeightFormat()


MINDFORMERS_PTQ = WeightFormat(
    "mindformers_ptq", bits=8, cite="vllm_mindspore mf_models/deepseek_v3.py r0.2:150-165 (golden-stick W8A8 'ptq')"
)


def _compressed_tensors(quant: Mapping[str, Any]) -> WeightFormat:
    """compressed-tensors' scheme from its config group (compressed_tensors.py 0.11.0 _get_scheme_from_parts:
    wNa16 for 4/8-bit int weights without activations, W8A8 int8 / fp8 with them, W8A16 fp8)."""
    groups = quant.get("config_groups")
    weights = [
        g.get("weights")
        for g in (groups.values() if isinstance(groups, Mapping) else ())
        if isinstance(g, Mapping) and isinstance(g.get("weights"), Mapping)
    ]
    if not weights:
        return WeightFormat()
    # One scheme per checkpoint: the first group's (the checkpoints kvguard meets have one group of "Linear").
    w = weights[0]
    ignore = _names(quant.get("ignore"))
    skip = tuple(n for n in ignore if not n.startswith("re:"))
    patterns = tuple(n[3:] for n in ignore if n.startswith("re:"))
    bits = _bits(w.get("num_bits"), 8)
    kind = str(w.get("type", "int"))
    strategy = str(w.get("strategy") or "tensor")
    groups_of = w.get("group_size")
    cite = "vllm compressed_tensors/schemes 0.11.0"
    if kind == "float" and bits == 8:
        block = w.get("block_structure")
        return WeightFormat(
            "compressed-tensors fp8",
            bits=8,
            strategy=strategy,
            block=(int(block[0]), int(block[1])) if strategy == "block" and block else (0, 0),
            static_input_scale=_static_inputs(groups),
            skip=skip,
            skip_patterns=patterns,
            cite=cite + " compressed_tensors_w8a8_fp8.py:59-95",
        )
    if kind == "int" and bits == 8 and _has_inputs(groups):
        return WeightFormat(
            "compressed-tensors int8",
            bits=8,
            strategy=strategy,
            static_input_scale=_static_inputs(groups),
            skip=skip,
            skip_patterns=patterns,
            cite=cite + " compressed_tensors_w8a8_int8.py:36-95",
        )
    if kind == "int" and bits in (4, 8):
        return WeightFormat(
            "compressed-tensors wna16",
            bits=bits,
            group_size=int(groups_of) if strategy == "group" and groups_of else -1,
            zero_points=not w.get("symmetric", True),
            g_idx=w.get("actorder") == "group",
            skip=skip,
            skip_patterns=patterns,
            cite=cite + " compressed_tensors_wNa16.py:73-186",
        )
    return WeightFormat()


def _inputs(groups: Any) -> list[Mapping[str, Any]]:
    return [
        g["input_activations"]
        for g in (groups.values() if isinstance(groups, Mapping) else ())
        if isinstance(g, Mapping) and isinstance(g.get("input_activations"), Mapping)
    ]


def _has_inputs(groups: Any) -> bool:
    return bool(_inputs(groups))


def _static_inputs(groups: Any) -> bool:
    inputs = _inputs(groups)
    return bool(inputs) and not inputs[0].get("dynamic", True)


_GGUF_NAME = re.compile(r"(?i)[-._](" + "|".join(sorted(GGUF_FILE_TYPES, key=len, reverse=True)) + r")\.gguf$")


def gguf_file_type(model: str | None) -> str | None:
    """The file type a GGUF model path names (``qwen2.5-7b-instruct-q4_k_m.gguf`` -> ``Q4_K_M``); None for a
    model that is not a ``.gguf`` file. vLLM serves a GGUF checkpoint as one local ``.gguf`` file."""
    if not model or not model.lower().endswith(".gguf"):
        return None
    match = _GGUF_NAME.search(model)
    if match is None:
        raise ConfigError(
            f"GGUF file {model[-60:]!r} names no file type kvguard sizes (known: {', '.join(GGUF_FILE_TYPES)})"
        )
    return match.group(1).upper()


# What `--quantization` does to a checkpoint that has no quantization_config: vLLM quantizes it while loading.
# bitsandbytes: 4-bit, no double quantization (BitsAndBytesConfig's defaults, bitsandbytes.py 0.11.0:86-127);
# fp8: fp8 weights with one fp32 scale per fused partition once loaded (fp8.py 0.11.0:288-296, the
# non-serialized path, then process_weights_after_loading); golden-stick / modelslim: vllm-mindspore's W8A8.
IN_FLIGHT = {
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "golden-stick": {"quant_method": "golden-stick"},
    "modelslim": {"quant_method": "modelslim"},
}


def with_quantization_flag(config: Mapping[str, Any], flag: str | None, model: str | None = None) -> Mapping[str, Any]:
    """The config as vLLM loads it under ``--quantization flag``: a checkpoint's own quantization_config wins
    (vLLM checks the flag against it); without one, the in-flight methods above apply. A GGUF file served as
    ``model`` is read in its file's type (:func:`gguf_file_type`, from the name), whatever the config says."""
    file_type = gguf_file_type(model) if model else None
    if file_type:
        return {**config, "quantization_config": {"quant_method": "gguf", "file_type": file_type}}
    if not flag or weight_format(config).quantized:
        return config
    quant = IN_FLIGHT.get(flag.lower().replace("_", "-"))
    return {**config, "quantization_config": quant} if quant else config
