"""vLLM's KV-cache budget, reproduced exactly, beside the reserved-aware budget.

One definition of each formula lives here; the CLI, the guard, the simulator and the
vLLM plugin all call these functions. Pure logic: no I/O, no imports of torch or
mindspore. Every size is an int number of bytes.

Sources (see README, "How the budget is computed"):
- vLLM V1 ``Worker.determine_available_memory``:
  ``available = total * gpu_memory_utilization - (weights + Δ allocated_bytes.all.peak
  + Δ non-torch)``.
- vllm-mindspore's fix (Gitee PR !428): the same with Δ ``memory_reserved()``.
- ``vllm/v1/kv_cache_interface.py``: page size per layer
  ``block_size * num_kv_heads * (head_size + head_size_v) * dtype_size``; MLA stores one
  latent per token (no factor 2).
- ``vllm/v1/core/kv_cache_utils.py``: ``num_blocks = available // page_size // num_layers``;
  max concurrency ``num_blocks / cdiv(max_model_len, block_size)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

# Bytes per element of the KV cache for each --kv-cache-dtype and model dtype name.
_DTYPE_BYTES = {
    "float32": 4, "float": 4,
    "bfloat16": 2, "float16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "fp8_ds_mla": 1,
    "int8": 1, "uint8": 1,
}
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
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

    num_layers: int          # attention layers on this pipeline stage
    num_kv_heads: int        # KV heads on this tensor-parallel rank (1 for MLA)
    head_size: int           # K head size (for MLA: kv_lora_rank + qk_rope_head_dim)
    head_size_v: int         # V head size (0 for MLA: one latent, no separate V)
    dtype_bytes: int
    block_size: int          # tokens per block
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


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten multimodal configs: the language model's fields win over the wrapper's."""
    merged = dict(config)
    for nested in ("text_config", "llm_config", "language_config"):
        inner = config.get(nested)
        if isinstance(inner, Mapping):
            merged.update({k: v for k, v in inner.items() if v is not None})
            break
    return merged


def _positive_int(config: Mapping[str, Any], *names: str, minimum: int = 1) -> int | None:
    """The first of ``names`` the config sets, as an integer >= ``minimum`` (1 or 0); None if none is set.

    Integral floats are accepted (JSON may write them); anything else, ``inf`` included, is a ConfigError.
    """
    for name in names:
        value = config.get(name)
        if value is None:
            continue
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or (isinstance(value, float) and not math.isfinite(value)) or int(value) != value or value < minimum):
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
    text = _text_config(config)
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
    for option, value in (("block size", block_size), ("tensor parallel size", tensor_parallel_size),
                          ("pipeline parallel size", pipeline_parallel_size)):
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{option} must be a positive integer, got {value!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"unknown KV cache dtype {kv_cache_dtype!r} (choose from {', '.join(KV_CACHE_DTYPES)})")

    text = _text_config(config)
    num_layers = _positive_int(text, "num_hidden_layers", "num_layers", "n_layer")
    if num_layers is None:
        raise ConfigError("model config has no layer count (num_hidden_layers)")
    if pipeline_parallel_size > num_layers:
        raise ConfigError(f"pipeline parallel size {pipeline_parallel_size} exceeds the {num_layers} layers")
    # vLLM splits layers evenly and gives the remainder to the stages before the last;
    # the fullest stage holds ceil(L / pp) layers and sets the block count for all.
    layers_per_stage = -(-num_layers // pipeline_parallel_size)

    dtype_bytes = model_dtype_bytes(config) if kv_cache_dtype == "auto" else min(_DTYPE_BYTES[kv_cache_dtype], 4)

    kv_lora_rank = text.get("kv_lora_rank")
    if kv_lora_rank is not None:
        rope = _positive_int(text, "qk_rope_head_dim")
        lora = _positive_int(text, "kv_lora_rank")
        if rope is None:
            raise ConfigError("MLA config has kv_lora_rank but no qk_rope_head_dim")
        # One compressed latent per token, shared by all heads: not split by TP, no V copy.
        return KVLayout(num_layers=layers_per_stage, num_kv_heads=1, head_size=lora + rope, head_size_v=0,
                        dtype_bytes=dtype_bytes, block_size=block_size, is_mla=True, kv_cache_dtype=kv_cache_dtype)

    num_heads = _positive_int(text, "num_attention_heads", "n_head", "num_heads")
    num_kv_heads = _positive_int(text, "num_key_value_heads", "num_kv_heads", "n_head_kv") or num_heads
    if num_kv_heads is None:
        raise ConfigError("model config has no head count (num_attention_heads / num_key_value_heads)")
    head_size = _positive_int(text, "head_dim")
    if head_size is None:
        hidden = _positive_int(text, "hidden_size", "n_embd", "d_model")
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


@dataclass(frozen=True)
class Profile:
    """A startup memory profile, in vLLM's terms. The profile file holds exactly these keys.

    ``peak_reserved_increase_bytes`` is None when only the allocated peak was measured
    (vLLM's own logs never carry the reserved increase).
    """

    total_memory_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    peak_allocated_increase_bytes: int
    peak_reserved_increase_bytes: int | None
    non_torch_increase_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.gpu_memory_utilization, (int, float)) or isinstance(self.gpu_memory_utilization, bool) \
                or not 0 < self.gpu_memory_utilization <= 1:
            raise ProfileError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("total_memory_bytes", "weights_bytes", "peak_allocated_increase_bytes",
                     "peak_reserved_increase_bytes", "non_torch_increase_bytes"):
            value = getattr(self, name)
            if value is None and name == "peak_reserved_increase_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ProfileError(f"{name} must be an integer number of bytes, got {value!r}")
            if value is not None and abs(value) > _MAX_BYTES:
                raise ProfileError(f"{name} is out of range: {value}")
        if self.total_memory_bytes <= 0:
            raise ProfileError(f"total_memory_bytes must be positive, got {self.total_memory_bytes}")
        for name in ("weights_bytes", "peak_allocated_increase_bytes", "peak_reserved_increase_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ProfileError(f"{name} must not be negative, got {value}")
        # non_torch_increase_bytes may be negative: vLLM logs show "non_torch_memory takes -0.51GiB".

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Profile":
        if not isinstance(data, Mapping):
            raise ProfileError("profile must be a JSON object")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data]
        unknown = sorted(set(data) - set(names))
        if missing:
            raise ProfileError(f"profile is missing {', '.join(missing)}")
        if unknown:
            raise ProfileError(f"profile has unknown keys {', '.join(unknown)}")
        values = dict(data)
        for name in names:
            if name != "gpu_memory_utilization" and isinstance(values[name], float) and values[name].is_integer():
                values[name] = int(values[name])
        return cls(**values)


def stock_kv_cache_bytes(profile: Profile) -> int:
    """vLLM V1: total × utilization − (weights + Δ allocated peak + Δ non-torch)."""
    return int(profile.total_memory_bytes * profile.gpu_memory_utilization
               - (profile.weights_bytes + profile.peak_allocated_increase_bytes + profile.non_torch_increase_bytes))


def reserved_kv_cache_bytes(profile: Profile) -> int | None:
    """vllm-mindspore's fix: the same with the increase of reserved memory. None if unmeasured."""
    if profile.peak_reserved_increase_bytes is None:
        return None
    return int(profile.total_memory_bytes * profile.gpu_memory_utilization
               - (profile.weights_bytes + profile.peak_reserved_increase_bytes + profile.non_torch_increase_bytes))


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
    if reserved is None:
        return None
    if stock_kv_cache_bytes(profile) <= reserved:
        return profile.gpu_memory_utilization

    def stock_at(hundredths: int) -> int:
        return stock_kv_cache_bytes(_with_utilization(profile, hundredths / 100))

    gap = profile.peak_reserved_increase_bytes - profile.peak_allocated_increase_bytes
    hundredths = math.floor(100 * profile.gpu_memory_utilization - 100 * gap / profile.total_memory_bytes)
    hundredths = min(hundredths, math.floor(100 * profile.gpu_memory_utilization))
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "budgets": {"stock": self.stock.to_dict(),
                        "reserved": self.reserved.to_dict() if self.reserved else None},
            "overcommit_bytes": self.overcommit_bytes,
            "recommended_gpu_memory_utilization": self.recommended_gpu_memory_utilization,
            "recommended_kv_cache_memory_bytes": self.recommended_kv_cache_memory_bytes,
        }


def estimate(profile: Profile, layout: KVLayout | None = None, max_model_len: int | None = None) -> Estimate:
    stock_bytes = stock_kv_cache_bytes(profile)
    reserved_bytes = reserved_kv_cache_bytes(profile)
    stock = budget_for(stock_bytes, layout, max_model_len)
    if reserved_bytes is None:
        return Estimate(stock, None, None, None, None)
    return Estimate(
        stock=stock,
        reserved=budget_for(reserved_bytes, layout, max_model_len),
        overcommit_bytes=overcommit_bytes(stock_bytes, reserved_bytes),
        recommended_gpu_memory_utilization=recommended_gpu_memory_utilization(profile),
        recommended_kv_cache_memory_bytes=max(0, reserved_bytes),
    )
