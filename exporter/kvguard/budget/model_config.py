"""Reading a Hugging Face ``config.json`` from disk (the I/O half of the KV layout).

The file is untrusted: ``load_model_config`` bounds its size, its nesting and its numbers, and
checks the fields the KV layout and the simulator read (positive integers of believable size,
a head size of at least one), so every caller (``budget``, ``simulate``, the sim source) gets a
one-line ConfigError, never a RecursionError, ZeroDivisionError or OverflowError.
"""

from __future__ import annotations

import json
import os
from typing import Any

from kvguard.budget.estimator import ConfigError
from kvguard.text import one_line
from kvguard.textfile import read_text

MAX_CONFIG_BYTES = 16 * 1024 * 1024
# Real configs nest three or four levels (text_config, quantization_config, rope_scaling ...).
MAX_CONFIG_DEPTH = 64
# No model field comes near this (vocab sizes are ~10^6, layer counts ~10^2); a bigger integer
# is garbage that would overflow float arithmetic later.
MAX_CONFIG_INT = 1 << 40
# Where a multimodal config keeps its language model (estimator.text_config reads the same keys).
_NESTED = ("text_config", "llm_config", "language_config")
# Fields read as sizes or counts: must be integers in [1, MAX_CONFIG_INT] (integral floats too) when set.
_POSITIVE = (
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "num_attention_heads",
    "n_head",
    "num_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_head_kv",
    "head_dim",
    "hidden_size",
    "n_embd",
    "d_model",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "qk_rope_head_dim",
    "kv_lora_rank",
    "moe_intermediate_size",
)
# Optional MLA / MoE fields that may be 0.
_NON_NEGATIVE = (
    "q_lora_rank",
    "qk_nope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "first_k_dense_replace",
)
# The config `kvguard simulate` and the sim source use when given none: Qwen2.5-7B-Instruct.
BUNDLED_MODEL = "qwen2.5-7b-instruct"


def bundled_model_config_path() -> str:
    """Path of the bundled Qwen2.5-7B-Instruct ``config.json`` (package data), for ``load_model_config``."""
    return os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", BUNDLED_MODEL, "config.json"
    )


def load_model_config(path: str) -> dict[str, Any]:
    """Load ``path`` (a config.json, or a model directory holding one). Raises ConfigError."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    text = read_text(path, "model config", MAX_CONFIG_BYTES, ConfigError)
    if _nesting(text) > MAX_CONFIG_DEPTH:
        raise ConfigError(f"model config {path} nests deeper than {MAX_CONFIG_DEPTH} levels")
    try:
        config = json.loads(text, parse_int=_parse_int, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"model config {path} is not valid JSON: {one_line(exc, first_line=True)}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model config {path} is not a JSON object")
    validate_model_config(config)
    return config


def _nesting(text: str) -> int:
    """The deepest bracket nesting, outside strings (a linear scan, before any recursive parser runs)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_CONFIG_DEPTH:
                    return deepest
        elif char in "]}":
            depth -= 1
    return deepest


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > 19:
        raise ValueError(f"integer {digits[:20]}... has more than 19 digits")
    return int(digits)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def validate_model_config(config: dict[str, Any]) -> None:
    """Check the fields the KV layout and the simulator read. Raises ConfigError (one line)."""
    scopes = [("", config)] + [(f"{key}.", config[key]) for key in _NESTED if isinstance(config.get(key), dict)]
    for prefix, scope in scopes:
        for names, minimum in ((_POSITIVE, 1), (_NON_NEGATIVE, 0)):
            for name in names:
                value = scope.get(name)
                if value is None:
                    continue
                kind = "positive" if minimum else "non-negative"
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or value != value
                    or value in (float("inf"), float("-inf"))
                    or int(value) != value
                    or value < minimum
                ):
                    # The estimator's own wording (estimator.positive_int), so every reader says the same.
                    raise ConfigError(f"config field {prefix}{name!r} must be a {kind} integer, got {shown}")
                if value > MAX_CONFIG_INT:
                    raise ConfigError(f"config field {prefix}{name!r} is larger than {MAX_CONFIG_INT}, got {shown}")
        heads = next((scope[n] for n in ("num_attention_heads", "n_head", "num_heads") if scope.get(n)), None)
        hidden = next((scope[n] for n in ("hidden_size", "n_embd", "d_model") if scope.get(n)), None)
        if scope.get("head_dim") is None and heads and hidden and hidden < heads:
            raise ConfigError(
                f"config field {prefix}'hidden_size' ({int(hidden)}) is smaller than "
                f"{prefix}'num_attention_heads' ({int(heads)}): the head size would be 0"
            )
