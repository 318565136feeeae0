"""vLLM's derived maximum model length, and its refusal of a longer ``--max-model-len``, in its own words.

``_get_and_verify_max_len`` runs when vLLM builds its ModelConfig, before any device memory is touched:
a ``--max-model-len`` above the length derived from ``config.json`` is refused unless
``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is ``1`` or ``true`` (``vllm/envs.py`` 0.7.3:445-448, 0.11.0:795-798).

Read from the wheels (the installed releases under ~/.cache/kvguard):

- the derivation: the smallest of the length keys present; ``model_max_length`` wins when set; RoPE scaling
  multiplies by ``factor`` unless its type is ``su``, ``longrope`` or ``llama3`` (``yarn`` starts from
  ``original_max_position_embeddings``), never for Gemma 3 (``vllm/config/model.py`` 0.11.0:1763-1858;
  the same steps in ``vllm/config.py`` 0.7.3:2453-2550). The tokenizer's ``model_max_length`` can lower it
  further: plan reads no tokenizer_config.json and says so.
- the words: two wordings, below. vLLM 0.11.0 through 0.34.0 raise the same text (``vllm/config/model.py``
  0.11.0:1893-1911, 0.14.0:2004-2026, 0.20.0:2162-2184, 0.27.0:2361-2383, 0.34.0:2706-2728); 0.7.3 the older
  one (``vllm/config.py`` 0.7.3:2564-2578). Releases 0.8-0.10 were not read: plan gives them the newer text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# vllm/config/model.py 0.11.0:1773-1792 possible_keys, in vLLM's order.
LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
CITE_NEW = "vllm/config/model.py 0.11.0:1893-1911 (_get_and_verify_max_len; same text to 0.34.0)"
CITE_OLD = "vllm/config.py 0.7.3:2564-2578 (_get_and_verify_max_len)"
_WARNING = (
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses relative position "
    "encoding (RoPE), positions exceeding derived_max_model_len lead to nan. If the model uses absolute "
    "position encoding, positions exceeding derived_max_model_len will cause a CUDA array out-of-bounds "
    "error."
)


def derived_max_model_len(text: Mapping[str, Any]) -> tuple[str | None, int | float | None]:
    """(the key it came from, vLLM's derived length) from the text config; (None, None) when no key is set."""
    derived: int | float = float("inf")
    key = None
    for name in LENGTH_KEYS:
        value = text.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value < derived:
                key = name
            derived = min(derived, value)
    model_max_length = text.get("model_max_length")
    if model_max_length:
        key, derived = "model_max_length", model_max_length
    if derived == float("inf"):
        return None, None
    scaling = text.get("rope_scaling")
    if isinstance(scaling, Mapping) and "gemma3" not in str(text.get("model_type", "")):
        rope_type = scaling.get("rope_type", scaling.get("type"))  # transformers' patch_rope_scaling
        if rope_type not in ("su", "longrope", "llama3"):
            factor = _number(scaling.get("factor", 1.0), "rope_scaling.factor")
            if rope_type == "yarn" and "original_max_position_embeddings" in scaling:
                derived = _number(
                    scaling["original_max_position_embeddings"], "rope_scaling.original_max_position_embeddings"
                )
            derived = derived * factor
    if not 1 <= derived < float("inf"):
        raise ValueError(f"model config: the derived max_model_len ({key}) is {derived!r}, not a positive length")
    return key, derived


def _number(value: Any, name: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"model config: {name} is not a number ({str(value)[:40]!r})")
    return value


def long_max_model_len_allowed(env: Mapping[str, str]) -> bool:
    """vllm/envs.py: VLLM_ALLOW_LONG_MAX_MODEL_LEN, "1" or "true" (case-insensitive, stripped)."""
    return env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")


def max_len_refusal(
    text: Mapping[str, Any], max_model_len: int, env: Mapping[str, str], vllm_version: tuple[int, ...]
) -> dict[str, str] | None:
    """vLLM's refusal of ``max_model_len`` (its ValueError, word for word), or None when it starts."""
    key, derived = derived_max_model_len(text)
    if derived is None or max_model_len <= derived or long_max_model_len_allowed(env):
        return None
    model_max_length = text.get("model_max_length")
    if model_max_length is not None and max_model_len <= model_max_length:
        return None
    msg = (
        f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
        f"({key}={derived} or model_max_length={model_max_length} in model's config.json)."
    )
    if vllm_version < (0, 8):
        message = (
            f"{msg} This may lead to incorrect model outputs or CUDA errors. To allow overriding this "
            f"maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
        )
        cite = CITE_OLD
    else:
        message = f"{msg} To allow overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. {_WARNING}"
        cite = CITE_NEW
    return {"code": "max_model_len_above_derived", "cite": cite, "message": message}
