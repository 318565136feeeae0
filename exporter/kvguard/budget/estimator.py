"""vLLM's KV-cache budget, reproduced exactly, beside the reserved-aware budget.

One definition of each formula lives here; the CLI, the guard, the simulator and the
vLLM plugin all call these functions. Pure logic: no I/O, no imports of torch or
mindspore. Every size is an int number of bytes.

Sources (see docs/explanation/budget.md; which release runs which formula, with
the upstream file and line of each, is the era table in ``kvguard/vllm/eras.py``):
- vLLM V1 ``Worker.determine_available_memory``, up to 0.26:
  ``available = requested - (weights + Δ allocated_bytes.all.peak + Δ non-torch)
  [- CUDA-graph estimate]``; from 0.27 ``requested - (total consumed + transient peak
  headroom) - CUDA-graph estimate`` (``vllm/utils/mem_utils.py`` ``memory_profiling``).
- vllm-mindspore's fix (Gitee PR !428): the same with Δ ``memory_reserved()``.
- ``vllm/v1/kv_cache_interface.py``: page size per layer
  ``block_size * num_kv_heads * (head_size + head_size_v) * dtype_size``; MLA stores one
  latent per token (no factor 2).
- ``vllm/v1/core/kv_cache_utils.py``: ``num_blocks = available // page_size // num_layers``;
  max concurrency ``num_blocks / cdiv(max_model_len, block_size)``.

Each formula is also read backwards (``solve_for_budget``, ``profile_for_budget``, at the end): the
figure a log does not state, from the budget vLLM decided, such that the forward formula gives that
budget again to the byte.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Sequence

from kvguard.budget.fields import PROFILE_FIELDS

# Bytes per element of the KV cache for each --kv-cache-dtype and model dtype name.
_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
    "int8": 1,
    "uint8": 1,
}
KV_CACHE_DTYPES = (
    "auto",
    "bfloat16",
    "float16",
    "half",
    "float32",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_ds_mla",
)
# DeepSeek's fp8_ds_mla packs a token's latent into 656 bytes (kv_cache_interface.MLAAttentionSpec).
_FP8_DS_MLA_TOKEN_BYTES = 656


# Larger than any device; bounds untrusted profiles so float arithmetic cannot overflow.
_MAX_BYTES = (1 << 63) - 1


class ConfigError(ValueError):
    """A model config or option that cannot describe a KV cache; message is one line."""


class ProfileError(ValueError):
    """A startup profile that is incomplete or out of range; message is one line."""


@dataclass(frozen=True)
class KVLayout:
    """What one rank stores per KV-cache block, as vLLM sizes it."""

    num_layers: int  # attention layers on this pipeline stage
    num_kv_heads: int  # KV heads on this tensor-parallel rank (1 for MLA)
    head_size: int  # K head size (for MLA: kv_lora_rank + qk_rope_head_dim)
    head_size_v: int  # V head size (0 for MLA: one latent, no separate V)
    dtype_bytes: int
    block_size: int  # tokens per block
    is_mla: bool = False
    kv_cache_dtype: str = "auto"

    @property
    def page_bytes_per_layer(self) -> int:
        if self.is_mla and self.kv_cache_dtype == "fp8_ds_mla":
            return self.block_size * _FP8_DS_MLA_TOKEN_BYTES
        return self.block_size * self.num_kv_heads * (self.head_size + self.head_size_v) * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers of this rank: vLLM's unit of allocation."""
        return self.page_bytes_per_layer * self.num_layers

    def num_blocks(self, kv_cache_bytes: int) -> int:
        return max(int(kv_cache_bytes) // self.block_bytes, 0)

    def blocks_per_request(self, max_model_len: int) -> int:
        return -(-max_model_len // self.block_size)


# How a release allocates the KV cache's tensors: the ``kv_tensor_style`` column of its era row
# (kvguard.vllm.eras, where each row cites its own lines); kv_cache_tensor_bytes is the one rule the
# plugin, ``kvguard budget --allocator``, the guard and the simulator call.
# - "per_layer": vLLM V1 through 0.28, one raw int8 tensor per layer (per KVCacheTensor: layers of
#   several groups share one), num_blocks x page size, viewed as K and V by the backend
#   (get_kv_cache_shape (2, num_blocks, ...)). 0.28 packs one backing only for DeepSeek V4 or
#   enable_cross_layers_blocks (kv_cache_utils.py 0.28.0:1274-1293): not modelled.
# - "per_layer_k_v": a key and a value tensor per layer, half the page each (vllm-ascend, vllm-mindspore).
#   An MLA layer is one tensor: vllm-mindspore's coef is 1 for MLAAttentionSpec (one latent per token).
#   Not modelled, same bytes: vllm-mindspore's RingMLA (quantized MLA with ms_custom_ops) and vllm-ascend's
#   DeepSeek MLA split that tensor in two, kv_lora_rank : qk_rope_head_dim.
# - "one_backing": from vLLM 0.29, one backing allocation for every layer (torch.zeros(buf_size) once).
#   The extensible KV cache (0.34) maps its pages outside the allocator instead.
KV_TENSOR_STYLES = ("per_layer", "per_layer_k_v", "one_backing")


@dataclass(frozen=True)
class LayerPage:
    """One attention layer's page: what vLLM's ``KVCacheSpec.page_size_bytes`` says, and whether the
    spec is MLA's (one latent per token, no separate V)."""

    page_bytes: int
    is_mla: bool = False


def layer_pages(layout: KVLayout) -> tuple[LayerPage, ...]:
    """A layout's layers as pages, for kv_cache_tensor_bytes."""
    return (LayerPage(layout.page_bytes_per_layer, layout.is_mla),) * layout.num_layers


def kv_cache_tensor_bytes(
    pages: KVLayout | Sequence[LayerPage], num_blocks: int, style: str = "per_layer"
) -> tuple[int, ...]:
    """The KV-cache tensors a release allocates for ``num_blocks`` blocks over its per-layer pages (a
    KVLayout's, or a worker's own specs), in allocation order; ``style`` is the era row's."""
    if style not in KV_TENSOR_STYLES:
        raise ValueError(f"unknown KV tensor style {style!r} (one of {', '.join(KV_TENSOR_STYLES)})")
    if isinstance(pages, KVLayout):
        pages = layer_pages(pages)
    blocks = max(0, int(num_blocks))
    if style == "one_backing":
        return (blocks * sum(page.page_bytes for page in pages),)
    tensors: list[int] = []
    for page in pages:
        size = blocks * page.page_bytes
        if style == "per_layer_k_v" and not page.is_mla:
            tensors += (size // 2, size - size // 2)
        else:
            tensors.append(size)
    return tuple(tensors)


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten multimodal configs: the language model's fields win over the wrapper's."""
    merged = dict(config)
    for nested in ("text_config", "llm_config", "language_config"):
        inner = config.get(nested)
        if isinstance(inner, Mapping):
            merged.update({k: v for k, v in inner.items() if v is not None})
            break
    return merged


def positive_int(config: Mapping[str, Any], *names: str, minimum: int = 1) -> int | None:
    """The first of ``names`` the config sets, as an integer >= ``minimum`` (1 or 0); None if none is set.

    Integral floats are accepted (JSON may write them); anything else, ``inf`` included, is a ConfigError.
    """
    for name in names:
        value = config.get(name)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value))
            or int(value) != value
            or value < minimum
        ):
            kind = "positive" if minimum >= 1 else "non-negative"
            raise ConfigError(f"config field {name!r} must be a {kind} integer, got {_short_repr(value)}")
        return int(value)
    return None


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def model_dtype_bytes(config: Mapping[str, Any]) -> int:
    """Bytes of the model's activation dtype, which ``--kv-cache-dtype auto`` follows.

    A float32 (or unspecified) checkpoint is served in 16-bit by vLLM's ``dtype=auto``.
    """
    text = text_config(config)
    name = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or config.get("dtype")
    if name is None:
        return 2
    name = str(name).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ConfigError(f"unknown model dtype {name!r} in config (torch_dtype/dtype)")
    return min(_DTYPE_BYTES[name], 2)


def kv_layout_from_config(
    config: Mapping[str, Any],
    *,
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> KVLayout:
    """The KV layout one rank gets for a Hugging Face ``config.json`` (already parsed)."""
    if not isinstance(config, Mapping):
        raise ConfigError("model config must be a JSON object")
    for option, value in (
        ("block size", block_size),
        ("tensor parallel size", tensor_parallel_size),
        ("pipeline parallel size", pipeline_parallel_size),
    ):
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{option} must be a positive integer, got {value!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"unknown KV cache dtype {kv_cache_dtype!r} (choose from {', '.join(KV_CACHE_DTYPES)})")

    text = text_config(config)
    num_layers = positive_int(text, "num_hidden_layers", "num_layers", "n_layer")
    if num_layers is None:
        raise ConfigError("model config has no layer count (num_hidden_layers)")
    if pipeline_parallel_size > num_layers:
        raise ConfigError(f"pipeline parallel size {pipeline_parallel_size} exceeds the {num_layers} layers")
    # vLLM splits layers evenly and gives the remainder to the stages before the last;
    # the fullest stage holds ceil(L / pp) layers and sets the block count for all.
    layers_per_stage = -(-num_layers // pipeline_parallel_size)

    dtype_bytes = model_dtype_bytes(config) if kv_cache_dtype == "auto" else min(_DTYPE_BYTES[kv_cache_dtype], 4)

    num_heads = positive_int(text, "num_attention_heads", "n_head", "num_heads")
    # vLLM refuses this before it sizes anything (config/model.py verify_with_parallel_config,
    # 0.11.0:1045-1052, 0.34.0:1577-1584); its message, word for word.
    if num_heads is not None and num_heads % tensor_parallel_size:
        raise ConfigError(
            f"Total number of attention heads ({num_heads}) must be divisible by tensor parallel "
            f"size ({tensor_parallel_size})."
        )

    kv_lora_rank = text.get("kv_lora_rank")
    if kv_lora_rank is not None:
        rope = positive_int(text, "qk_rope_head_dim")
        lora = positive_int(text, "kv_lora_rank")
        if rope is None:
            raise ConfigError("MLA config has kv_lora_rank but no qk_rope_head_dim")
        assert lora is not None  # kv_lora_rank is set: positive_int returns it or raises
        # One compressed latent per token, shared by all heads: not split by TP, no V copy.
        return KVLayout(
            num_layers=layers_per_stage,
            num_kv_heads=1,
            head_size=lora + rope,
            head_size_v=0,
            dtype_bytes=dtype_bytes,
            block_size=block_size,
            is_mla=True,
            kv_cache_dtype=kv_cache_dtype,
        )

    num_kv_heads = positive_int(text, "num_key_value_heads", "num_kv_heads", "n_head_kv") or num_heads
    if num_kv_heads is None:
        raise ConfigError("model config has no head count (num_attention_heads / num_key_value_heads)")
    head_size = positive_int(text, "head_dim")
    if head_size is None:
        hidden = positive_int(text, "hidden_size", "n_embd", "d_model")
        if hidden is None or num_heads is None:
            raise ConfigError("model config has no head size (head_dim, or hidden_size and num_attention_heads)")
        head_size = hidden // num_heads
    return KVLayout(
        num_layers=layers_per_stage,
        num_kv_heads=max(1, num_kv_heads // tensor_parallel_size),
        head_size=head_size,
        head_size_v=head_size,
        dtype_bytes=dtype_bytes,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
    )


# ---------------------------------------------------------------------------- budget formulas


@dataclass(frozen=True)
class BudgetFormula:
    """How one family of releases turns its startup profile into the KV-cache budget.

    ``requested``: ``"product"`` is ``total × utilization`` as a float, the result truncated by
    ``int()``; ``"ceil"`` is ``math.ceil(total × utilization)``.
    ``non_kv``: ``"peak"`` is weights + Δ peak + Δ non-torch; ``"consumed"`` is the drop in free
    device memory since the init snapshot plus the transient peak headroom (allocated peak −
    allocated after the profile); ``"measured_after_warmup"`` is 0.34's extensible KV cache.
    ``cudagraph``: the CUDA-graph memory estimate is subtracted.
    ``peak``: which peak vLLM's own formula counts: ``"allocated"``, or ``"reserved"``
    (vllm-mindspore's ``memory_profiling`` measures ``memory_reserved()``).
    ``non_torch``: ``"increase"``, or ``"positive"`` (V0, V1 0.8.5-0.9.0 and vllm-ascend before 0.15 add
    the absolute non-torch memory only when positive; their peak holds the weights). ``cleared``: vllm-ascend 0.15+
    also subtracts the
    non-torch memory ``empty_cache`` cleared. ``halved``: 310P halves the result for workspace.
    ``floor_zero``: the result is clamped at 0.
    ``transient``: ``"consumed"`` adds the transient peak headroom (0.27+); vllm-ascend 0.7.3 takes the
    free-memory drop alone.
    The release ranges and their upstream lines live in :mod:`kvguard.vllm.eras`.
    """

    name: str
    requested: str
    non_kv: str
    cudagraph: bool = False
    peak: str = "allocated"
    non_torch: str = "increase"
    cleared: bool = False
    halved: bool = False
    floor_zero: bool = False
    transient: bool = True
    reserved_counts: str = "the reserved increase in place of the allocated peak increase"


FORMULAS: dict[str, BudgetFormula] = {
    f.name: f
    for f in (
        BudgetFormula("peak", requested="product", non_kv="peak"),
        BudgetFormula("peak_ceil", requested="ceil", non_kv="peak"),
        BudgetFormula("peak_ceil_cudagraph", requested="ceil", non_kv="peak", cudagraph=True),
        BudgetFormula(
            "consumed",
            requested="ceil",
            non_kv="consumed",
            cudagraph=True,
            reserved_counts="the reserved transient peak in place of the allocated one "
            "(total consumed already holds what empty_cache could not release)",
        ),
        # 0.34's extensible KV cache: sized after warm-up from measured free memory, keeping free the
        # larger of the transient peak and torch's reserve growth (a *reserved* figure): vLLM itself
        # budgets what the reserved-aware budget adds, so the two are equal.
        BudgetFormula(
            "extensible",
            requested="ceil",
            non_kv="measured_after_warmup",
            reserved_counts="nothing: vLLM keeps torch's reserved growth free itself",
        ),
        # V0 (0.6.4), V1 0.8.5-0.9.0 and vllm-ascend before 0.15: the allocated peak with the weights in it
        # plus the absolute non-torch memory when positive; V0 and vllm-ascend clamp at 0, early V1 does not.
        BudgetFormula("absolute_peak", requested="product", non_kv="peak", non_torch="positive", floor_zero=True),
        BudgetFormula("absolute_peak_signed", requested="product", non_kv="peak", non_torch="positive"),
        BudgetFormula("ascend_cleared", requested="product", non_kv="peak", cleared=True),
        BudgetFormula("ascend_cleared_halved", requested="product", non_kv="peak", cleared=True, halved=True),
        BudgetFormula(
            "mindspore_reserved",
            requested="product",
            non_kv="peak",
            peak="reserved",
            reserved_counts="nothing: vllm-mindspore's profile already counts the reserved increase",
        ),
        # vllm-ascend 0.7.3 (V0 NPUWorker.determine_num_available_blocks, vllm_ascend/worker/worker.py 0.7.3:239-281,
        # the same in 0.7.3.post1): blocks = max(int((total * util - (init free - free after the profile run))
        # // block bytes), 0), the init snapshot taken after empty_cache in init_device (:184-185), the free
        # memory read after profile_run with no empty_cache between (:255-262): the drop holds the weights, what
        # torch_npu's pool still reserves after the run, and every non-torch byte since the snapshot (HCCL too,
        # :190). int(x // b) of a float x >= 0 is int(x) // b: the formula in bytes, floored at 0.
        BudgetFormula(
            "ascend_free_drop",
            requested="product",
            non_kv="consumed",
            floor_zero=True,
            transient=False,
            reserved_counts="the reserved transient peak (reserved peak - reserved after the profile run): "
            "the free-memory drop already holds what torch_npu's pool kept reserved",
        ),
    )
}
# v1/worker/extensible_kv_cache.py 0.34.0:64-65: KV_CACHE_MARGIN_FLOOR_BYTES, 1 GiB (CUDA).
EXTENSIBLE_MARGIN_FLOOR_BYTES = 1 << 30
DEFAULT_FORMULA = "peak"


@dataclass(frozen=True)
class Profile:
    """A startup memory profile, in vLLM's terms; the profile file holds these keys.

    The first six are every era's; the rest are ``None`` where the era (``formula``) does not
    use them. ``peak_reserved_increase_bytes`` is None when only the allocated peak was
    measured (vLLM's own logs never carry the reserved increase).

    - ``total_consumed_bytes``: 0.27+, init-snapshot free memory − free memory after the profile.
    - ``transient_peak_headroom_bytes``: 0.27+, allocated peak − allocated after the profile.
    - ``reserved_transient_peak_bytes``: kvguard's reserved twin of the headroom: the reserved
      peak during the profile − reserved after it.
    - ``cudagraph_memory_bytes``: the CUDA-graph estimate vLLM subtracted (0 when disabled).
    - ``kv_cache_memory_bytes``: vLLM's ``--kv-cache-memory-bytes``; vLLM then skips the budget.
    - ``vllm_version``: ``project:version`` of the release that measured it (``vllm:0.34.0``).
    - 0.34's extensible KV cache (formula ``extensible``), measured after warm-up by
      ``measure_kv_cache_blocks``: ``init_free_memory_bytes``, ``free_after_warmup_bytes``,
      ``kv_committed_bytes`` (KV pages mapped then), ``kv_transient_peak_bytes`` (the cache's
      ``reserved_headroom_bytes``) and ``torch_reserve_growth_bytes``.
    - ``non_torch_cleared_bytes``: vllm-ascend 0.15+, the non-torch memory the profile's
      ``empty_cache`` cleared (absolute non-torch before it − the non-torch increase).
    - ``unprofiled_sampler_bytes``: where the release's profile run runs no sampler (vllm-ascend V1), the
      activation peak of sampling a full batch (``kvguard.budget.sampler.unprofiled_sampler_peak_bytes``);
      no formula reads it, the guard projects it.
    """

    total_memory_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    peak_allocated_increase_bytes: int | None
    peak_reserved_increase_bytes: int | None
    non_torch_increase_bytes: int | None
    formula: str = DEFAULT_FORMULA
    vllm_version: str | None = None
    total_consumed_bytes: int | None = None
    transient_peak_headroom_bytes: int | None = None
    reserved_transient_peak_bytes: int | None = None
    cudagraph_memory_bytes: int | None = None
    kv_cache_memory_bytes: int | None = None
    init_free_memory_bytes: int | None = None
    free_after_warmup_bytes: int | None = None
    kv_committed_bytes: int | None = None
    kv_transient_peak_bytes: int | None = None
    torch_reserve_growth_bytes: int | None = None
    non_torch_cleared_bytes: int | None = None
    unprofiled_sampler_bytes: int | None = None

    REQUIRED = (
        "total_memory_bytes",
        "gpu_memory_utilization",
        "weights_bytes",
        "peak_allocated_increase_bytes",
        "peak_reserved_increase_bytes",
        "non_torch_increase_bytes",
    )
    # Which fields are sizes, and which may be negative, is the field table's (kvguard.budget.fields).
    _BYTES = tuple(row.name for row in PROFILE_FIELDS if row.kind != "float")
    _SIGNED = tuple(row.name for row in PROFILE_FIELDS if row.kind == "signed_size")

    def __post_init__(self) -> None:
        if (
            not isinstance(self.gpu_memory_utilization, (int, float))
            or isinstance(self.gpu_memory_utilization, bool)
            or not 0 < self.gpu_memory_utilization <= 1
        ):
            raise ProfileError(
                f"gpu_memory_utilization must be in (0, 1], got {_short_repr(self.gpu_memory_utilization)}"
            )
        if self.formula not in FORMULAS:
            raise ProfileError(f"unknown budget formula {_short_repr(self.formula)} (one of {', '.join(FORMULAS)})")
        if self.vllm_version is not None and (not isinstance(self.vllm_version, str) or len(self.vllm_version) > 64):
            raise ProfileError(f"vllm_version must be a short string, got {_short_repr(self.vllm_version)}")
        needed = required_fields(self.formula, self.kv_cache_memory_bytes)
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ProfileError(f"formula {self.formula!r} needs {', '.join(missing)}")
        for name in self._BYTES:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ProfileError(f"{name} must be an integer number of bytes, got {_short_repr(value)}")
            if abs(value) > _MAX_BYTES:
                raise ProfileError(f"{name} is out of range: {_short_repr(value)}")
            if value < 0 and name not in self._SIGNED:
                raise ProfileError(f"{name} must not be negative, got {value}")
        if self.total_memory_bytes <= 0:
            raise ProfileError(f"total_memory_bytes must be positive, got {self.total_memory_bytes}")

    @property
    def budget_formula(self) -> BudgetFormula:
        return FORMULAS[self.formula]

    def to_dict(self) -> dict[str, Any]:
        """The six keys every era has, then only what this era measured (None and the default formula
        are left out, so a classic profile file keeps its six keys)."""
        data = asdict(self)
        return {
            k: v
            for k, v in data.items()
            if k in self.REQUIRED or (v is not None and not (k == "formula" and v == DEFAULT_FORMULA))
        }

    @classmethod
    def unknown_keys(cls, data: Mapping[str, Any]) -> list[str]:
        """The keys of ``data`` that are no Profile field (a newer writer's, or typos), sorted."""
        names = {f.name for f in fields(cls)}
        return sorted(str(k) for k in data if k not in names)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Profile":
        if not isinstance(data, Mapping):
            raise ProfileError("profile must be a JSON object")
        missing = [n for n in cls.REQUIRED if n not in data]
        unknown = [k[:40] for k in cls.unknown_keys(data)]
        if missing:
            raise ProfileError(f"profile is missing {', '.join(missing)}")
        if unknown:
            raise ProfileError(f"profile has unknown keys {', '.join(unknown)}")
        values = dict(data)
        for name in cls._BYTES:
            if isinstance(values.get(name), float) and values[name].is_integer() and abs(values[name]) <= _MAX_BYTES:
                values[name] = int(values[name])
        if values.get("formula") is None:
            values.pop("formula", None)
        return cls(**values)


EXTENSIBLE_INPUTS = (
    "init_free_memory_bytes",
    "free_after_warmup_bytes",
    "kv_committed_bytes",
    "kv_transient_peak_bytes",
    "torch_reserve_growth_bytes",
)


def required_fields(formula: str, kv_cache_memory_bytes: int | None = None) -> tuple[str, ...]:
    """The profile fields a formula cannot do without (``--kv-cache-memory-bytes`` needs only the first
    three: vLLM then skips its budget). The peak formulas need the allocated (vllm-mindspore: reserved)
    peak and the non-torch increase; 0.27+ its consumed and transient figures, which is all its logs state."""
    base = ("total_memory_bytes", "gpu_memory_utilization", "weights_bytes")
    budget = FORMULAS[formula]
    if kv_cache_memory_bytes is not None:
        return base
    if budget.non_kv == "peak":
        peak = "peak_reserved_increase_bytes" if budget.peak == "reserved" else "peak_allocated_increase_bytes"
        return base + (peak, "non_torch_increase_bytes")
    if budget.non_kv == "consumed":
        return base + ("total_consumed_bytes",) + (("transient_peak_headroom_bytes",) if budget.transient else ())
    return base + EXTENSIBLE_INPUTS


def formula_inputs(formula: str) -> tuple[str, ...]:
    """Every profile field the formula reads (non_kv_cache_bytes, _budget): its required fields, the
    reserved twins the reserved-aware budget reads, the CUDA-graph estimate, the cleared non-torch memory."""
    budget = FORMULAS[formula]
    inputs = required_fields(formula) + ("kv_cache_memory_bytes",)
    if budget.non_kv == "peak":
        inputs += ("peak_reserved_increase_bytes",) + (("non_torch_cleared_bytes",) if budget.cleared else ())
    elif budget.non_kv == "consumed":
        inputs += ("reserved_transient_peak_bytes",)
    return inputs + (("cudagraph_memory_bytes",) if budget.cudagraph else ())


def requested_memory_bytes(profile: Profile) -> int | float:
    """What vLLM requests of the device: ``total × utilization``, a float before 0.14 (gpu_worker.py
    ``init_device``) and ``math.ceil`` of it since (v1/worker/utils.py ``request_memory``)."""
    return _requested(profile.budget_formula, profile.total_memory_bytes, profile.gpu_memory_utilization)


def _requested(formula: BudgetFormula, total_memory_bytes: int, gpu_memory_utilization: float) -> int | float:
    product = total_memory_bytes * gpu_memory_utilization
    return math.ceil(product) if formula.requested == "ceil" else product


def non_kv_cache_bytes(profile: Profile, *, reserved: bool = False) -> int | None:
    """What the era's formula keeps out of the KV cache (the CUDA-graph estimate aside).

    ``reserved``: the reserved-aware twin (None when that reserved figure was not measured).
    None also when the profile lacks the formula's figures: given ``--kv-cache-memory-bytes``, vLLM
    measures nothing (``required_fields``).
    """
    formula = profile.budget_formula
    if formula.non_kv == "measured_after_warmup":
        # Measured after warm-up; the reserved growth is already kept free (extensible_kv_cache_bytes).
        init_free, after_warmup = profile.init_free_memory_bytes, profile.free_after_warmup_bytes
        committed = profile.kv_committed_bytes
        if init_free is None or after_warmup is None or committed is None:
            return None
        return init_free - after_warmup - committed
    if formula.non_kv == "consumed":
        consumed = profile.total_consumed_bytes
        transient = profile.transient_peak_headroom_bytes if formula.transient else 0
        if consumed is None or transient is None:
            return None
        if reserved:
            if profile.reserved_transient_peak_bytes is None:
                return None
            # What the reserved peak adds on top of the allocated one; never less than vLLM's.
            transient = max(transient, profile.reserved_transient_peak_bytes)
        return consumed + transient
    peak = profile.peak_reserved_increase_bytes if formula.peak == "reserved" else profile.peak_allocated_increase_bytes
    if reserved:
        if profile.peak_reserved_increase_bytes is None:
            return None
        peak = profile.peak_reserved_increase_bytes
    non_torch = profile.non_torch_increase_bytes
    if peak is None or non_torch is None:
        return None
    if formula.non_torch == "positive":
        non_torch = max(0, non_torch)
    cleared = (profile.non_torch_cleared_bytes or 0) if formula.cleared else 0
    return profile.weights_bytes + peak + non_torch + cleared


def extensible_kv_cache_bytes(profile: Profile) -> int:
    """0.34's extensible KV cache, sized after warm-up (v1/worker/extensible_kv_cache.py 0.34.0:592-618,
    ``measure_kv_cache_bytes``): the smaller of what the request leaves after the non-KV memory used
    and the free memory less a margin, less the larger of the transient peak and torch's reserve growth."""
    init_free, after_warmup, committed = (
        profile.init_free_memory_bytes,
        profile.free_after_warmup_bytes,
        profile.kv_committed_bytes,
    )
    transient, growth = profile.kv_transient_peak_bytes, profile.torch_reserve_growth_bytes
    # The extensible formula's required fields (EXTENSIBLE_INPUTS): Profile refuses a profile without them.
    assert init_free is not None and after_warmup is not None and committed is not None
    assert transient is not None and growth is not None
    non_kv_used = init_free - after_warmup - committed
    headroom = after_warmup + committed
    margin = _extensible_margin(transient)
    available = min(int(requested_memory_bytes(profile)) - non_kv_used, headroom - margin)
    available -= max(transient, growth)
    return max(available, 0)


def _extensible_margin(kv_transient_peak_bytes: int) -> int:
    return max(EXTENSIBLE_MARGIN_FLOOR_BYTES, int(kv_transient_peak_bytes * 0.75))


def _budget(profile: Profile, non_kv: int | None) -> int:
    if profile.kv_cache_memory_bytes is not None:
        return profile.kv_cache_memory_bytes
    if profile.formula == "extensible":
        return extensible_kv_cache_bytes(profile)
    formula = profile.budget_formula
    cudagraph = (profile.cudagraph_memory_bytes or 0) if formula.cudagraph else 0
    # Without --kv-cache-memory-bytes the formula's figures are required (required_fields): non_kv is known.
    assert non_kv is not None
    return _available(formula, requested_memory_bytes(profile), non_kv, cudagraph)


def _available(formula: BudgetFormula, requested: int | float, non_kv: int, cudagraph: int) -> int:
    """The peak formulas' and 0.27+'s last step: what the request leaves after the non-KV memory."""
    available = requested - non_kv - cudagraph
    if formula.halved:
        available = available // 2  # vllm_ascend/_310p/worker_310p.py 0.18.0:94-97 (float floor division)
    available = int(available)
    return max(available, 0) if formula.floor_zero else available


def stock_kv_cache_bytes(profile: Profile) -> int:
    """vLLM's own budget for the profile's era (or ``--kv-cache-memory-bytes`` when it was given)."""
    return _budget(profile, non_kv_cache_bytes(profile))


def reserved_kv_cache_bytes(profile: Profile) -> int | None:
    """The reserved-aware budget: the era's formula with the allocator's reserved peak in place of
    the allocated one (vllm-mindspore's fix). None if the reserved figure was not measured."""
    non_kv = non_kv_cache_bytes(profile, reserved=True)
    if non_kv is None:
        return None
    if profile.kv_cache_memory_bytes is not None:
        return profile.kv_cache_memory_bytes
    return _budget(profile, non_kv)


@dataclass(frozen=True)
class Budget:
    """A KV-cache budget: bytes, and what they hold for a given layout."""

    kv_cache_bytes: int
    num_blocks: int | None = None
    num_tokens: int | None = None
    max_concurrency: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def budget_for(kv_cache_bytes: int, layout: KVLayout | None, max_model_len: int | None = None) -> Budget:
    if layout is None:
        return Budget(kv_cache_bytes=kv_cache_bytes)
    num_blocks = layout.num_blocks(kv_cache_bytes)
    return Budget(
        kv_cache_bytes=kv_cache_bytes,
        num_blocks=num_blocks,
        num_tokens=num_blocks * layout.block_size,
        max_concurrency=max_concurrency(num_blocks, layout, max_model_len),
    )


def max_concurrency(num_blocks: int, layout: KVLayout, max_model_len: int | None) -> float | None:
    """vLLM's ``Maximum concurrency for N tokens per request``: blocks over blocks per request."""
    if not max_model_len:
        return None
    return num_blocks / layout.blocks_per_request(max_model_len)


def overcommit_bytes(stock_bytes: int, reserved_bytes: int) -> int:
    """How much more KV cache the stock formula grants than the reserved-aware one."""
    return max(0, stock_bytes - reserved_bytes)


def recommended_gpu_memory_utilization(profile: Profile) -> float | None:
    """The utilization, rounded down to 0.01, at which stock no longer exceeds the reserved budget.

    None when the reserved increase is unknown or no positive utilization is safe.
    """
    reserved = reserved_kv_cache_bytes(profile)
    if reserved is None or profile.kv_cache_memory_bytes is not None:
        return None
    if stock_kv_cache_bytes(profile) <= reserved:
        return profile.gpu_memory_utilization

    def stock_at(hundredths: int) -> int:
        return stock_kv_cache_bytes(_with_utilization(profile, hundredths / 100))

    reserved_non_kv, stock_non_kv = non_kv_cache_bytes(profile, reserved=True), non_kv_cache_bytes(profile)
    # Both known: the reserved budget is (its non-KV figure is), and no --kv-cache-memory-bytes was given.
    assert reserved_non_kv is not None and stock_non_kv is not None
    gap = reserved_non_kv - stock_non_kv
    hundredths = math.floor(100 * profile.gpu_memory_utilization - 100 * gap / profile.total_memory_bytes)
    # A reserved increase near or past the device's size puts the estimate at or below zero: no
    # utilization is safe, and none below 0.01 may be built into a Profile.
    hundredths = max(0, min(hundredths, math.floor(100 * profile.gpu_memory_utilization)))
    # Float rounding can land one step off either way: settle on the largest safe value.
    while hundredths > 0 and stock_at(hundredths) > reserved:
        hundredths -= 1
    while hundredths + 1 <= 100 * profile.gpu_memory_utilization and stock_at(hundredths + 1) <= reserved:
        hundredths += 1
    if hundredths <= 0:
        return None
    return hundredths / 100


def _with_utilization(profile: Profile, utilization: float) -> Profile:
    return Profile(**{**profile.to_dict(), "gpu_memory_utilization": utilization})


@dataclass(frozen=True)
class Estimate:
    """Both budgets for one profile, the gap between them, and how to close it."""

    stock: Budget
    reserved: Budget | None
    overcommit_bytes: int | None
    recommended_gpu_memory_utilization: float | None
    recommended_kv_cache_memory_bytes: int | None
    reserved_counts: str = ""  # what the reserved-aware budget counts on top of the stock one

    def to_dict(self) -> dict[str, Any]:
        return {
            "budgets": {"stock": self.stock.to_dict(), "reserved": self.reserved.to_dict() if self.reserved else None},
            "reserved_counts": self.reserved_counts,
            "overcommit_bytes": self.overcommit_bytes,
            "recommended_gpu_memory_utilization": self.recommended_gpu_memory_utilization,
            "recommended_kv_cache_memory_bytes": self.recommended_kv_cache_memory_bytes,
        }


def estimate(profile: Profile, layout: KVLayout | None = None, max_model_len: int | None = None) -> Estimate:
    stock_bytes = stock_kv_cache_bytes(profile)
    reserved_bytes = reserved_kv_cache_bytes(profile)
    stock = budget_for(stock_bytes, layout, max_model_len)
    counts = profile.budget_formula.reserved_counts
    if profile.kv_cache_memory_bytes is not None:
        counts = "nothing: --kv-cache-memory-bytes fixes the KV cache, vLLM skips its budget"
    if reserved_bytes is None:
        return Estimate(stock, None, None, None, None, counts)
    return Estimate(
        reserved_counts=counts,
        stock=stock,
        reserved=budget_for(reserved_bytes, layout, max_model_len),
        overcommit_bytes=overcommit_bytes(stock_bytes, reserved_bytes),
        recommended_gpu_memory_utilization=recommended_gpu_memory_utilization(profile),
        recommended_kv_cache_memory_bytes=max(0, reserved_bytes),
    )


# ---------------------------------------------------------------------------- the formulas read backwards


def solved_field(formula: str) -> str:
    """The profile figure the inverse solves for: the one a startup log at INFO does not state (the peak
    formulas' activation peak, 0.27+'s total consumed, 0.34's free memory after warm-up)."""
    budget = FORMULAS[formula]
    if budget.non_kv == "peak":
        return "peak_reserved_increase_bytes" if budget.peak == "reserved" else "peak_allocated_increase_bytes"
    if budget.non_kv == "consumed":
        return "total_consumed_bytes"
    return "free_after_warmup_bytes"


def solve_for_budget(fields: Mapping[str, Any], kv_cache_bytes: int) -> int:
    """The figure ``solved_field`` for which the formula ``fields["formula"]`` decides ``kv_cache_bytes``,
    every other input as ``fields`` gives it (an unmeasured non-torch increase, CUDA-graph estimate or
    cleared non-torch memory counts 0). The figure may be out of its field's range (a peak below zero when
    the other figures are rounded); ProfileError where no figure gives that budget."""
    name = fields.get("formula") or DEFAULT_FORMULA
    if name not in FORMULAS:
        raise ProfileError(f"unknown budget formula {_short_repr(name)} (one of {', '.join(FORMULAS)})")
    formula = FORMULAS[name]
    if fields.get("kv_cache_memory_bytes") is not None:
        raise ProfileError("--kv-cache-memory-bytes fixes the KV cache: vLLM's budget reads no profile figure")
    if kv_cache_bytes < 0 and (formula.floor_zero or formula.non_kv == "measured_after_warmup"):
        raise ProfileError(f"formula {name!r} never decides a negative budget ({kv_cache_bytes} B)")
    requested = _requested(formula, fields["total_memory_bytes"], fields["gpu_memory_utilization"])
    if formula.non_kv == "measured_after_warmup":
        # available = min(int(requested) - used, init_free - used - margin) - kept: both branches drop by the
        # non-KV memory used (init_free - free_after - kv_committed), so it is solved for once.
        kept = max(fields["kv_transient_peak_bytes"], fields["torch_reserve_growth_bytes"])
        ceiling = min(
            int(requested), fields["init_free_memory_bytes"] - _extensible_margin(fields["kv_transient_peak_bytes"])
        )
        used = ceiling - kept - kv_cache_bytes
        return fields["init_free_memory_bytes"] - fields["kv_committed_bytes"] - used
    cudagraph = (fields.get("cudagraph_memory_bytes") or 0) if formula.cudagraph else 0
    # int() truncates towards zero and 310P floor-halves: start from the exact solution of the real-valued
    # equation, then settle on the integer the forward step itself maps onto the budget.
    whole = math.floor(requested)
    if formula.halved:
        non_kv = whole - cudagraph - 2 * kv_cache_bytes
    else:
        non_kv = whole - cudagraph - kv_cache_bytes + (1 if kv_cache_bytes < 0 and requested != whole else 0)
    for step in (0, 1, -1, 2, -2):
        if _available(formula, requested, non_kv + step, cudagraph) == kv_cache_bytes:
            non_kv += step
            break
    else:
        raise ProfileError(f"formula {name!r} decides no budget of exactly {kv_cache_bytes} B here")
    if formula.non_kv == "consumed":
        return non_kv - (fields["transient_peak_headroom_bytes"] if formula.transient else 0)
    non_torch = fields.get("non_torch_increase_bytes") or 0
    if formula.non_torch == "positive":
        non_torch = max(0, non_torch)
    cleared = (fields.get("non_torch_cleared_bytes") or 0) if formula.cleared else 0
    return non_kv - fields["weights_bytes"] - non_torch - cleared


def profile_for_budget(fields: Mapping[str, Any], kv_cache_bytes: int) -> Profile:
    """The profile whose budget is ``kv_cache_bytes``: ``fields`` with ``solved_field`` solved for
    (``solve_for_budget``). ``stock_kv_cache_bytes(profile_for_budget(f, b)) == b`` to the byte."""
    name = fields.get("formula") or DEFAULT_FORMULA
    value = solve_for_budget(fields, kv_cache_bytes)
    formula = FORMULAS[name]
    filled = {k: v for k, v in fields.items() if v is not None}
    if formula.non_kv == "peak":
        filled.setdefault("non_torch_increase_bytes", 0)
    if formula.cudagraph:
        filled.setdefault("cudagraph_memory_bytes", 0)
    filled[solved_field(name)] = value
    return Profile(**{**{k: None for k in Profile.REQUIRED}, **filled})
