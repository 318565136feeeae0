"""Reading a Hugging Face ``config.json`` from disk (the I/O half of the KV layout)."""

from __future__ import annotations

import json
import os
from typing import Any

from kvguard.estimator import ConfigError

MAX_CONFIG_BYTES = 16 * 1024 * 1024


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
