"""Reading a Hugging Face ``config.json`` from disk (the I/O half of the KV layout)."""

from __future__ import annotations

import json
import os
from typing import Any

from kvguard.estimator import ConfigError

MAX_CONFIG_BYTES = 16 * 1024 * 1024
# The config `kvguard simulate` and the sim source use when given none: Qwen2.5-7B-Instruct.
BUNDLED_MODEL = "qwen2.5-7b-instruct"


def bundled_model_config_path() -> str:
    """Path of the bundled Qwen2.5-7B-Instruct ``config.json`` (package data), for ``load_model_config``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples", BUNDLED_MODEL, "config.json")


def load_model_config(path: str) -> dict[str, Any]:
    """Load ``path`` (a config.json, or a model directory holding one). Raises ConfigError."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"model config not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read model config {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"model config {path} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"model config {path} is not valid JSON: {str(exc).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model config {path} is not a JSON object")
    return config
