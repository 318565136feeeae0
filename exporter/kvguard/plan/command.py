"""A vLLM serve command line, read as vLLM's argument parser reads the flags ``kvguard plan`` uses.

Entry points: ``vllm serve MODEL ...``; ``python -m vllm.entrypoints.openai.api_server --model MODEL ...``;
vllm-mindspore's ``vllm-mindspore serve MODEL ...`` (its console script) and ``python -m
vllm_mindspore.entrypoints vllm.entrypoints.openai.api_server ...``. Leading ``VAR=value`` words
(environment assignments) are kept in ``env``: plan reads the ones that size memory (``HCCL_BUFFSIZE``,
``VLLM_ALLOW_LONG_MAX_MODEL_LEN``).

Flags: vLLM's spellings, dashes or underscores (vLLM's FlexibleArgumentParser takes both), ``--flag=value``
or ``--flag value``; the last of a repeated flag wins, as argparse does. ``--max-model-len``,
``--max-num-batched-tokens`` and ``--kv-cache-memory-bytes`` take vLLM's human-readable integers
(``32k`` = 32000, ``32K`` = 32768: engine/arg_utils.py 0.11.0:233-240,1740-1778 ``human_readable_int``).
Flags plan does not use are ignored and listed; a flag's malformed value is refused in one line.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from kvguard.budget.estimator import KV_CACHE_DTYPES


class CommandError(ValueError):
    """A serve command plan cannot read; the message is one line."""


def human_readable_int(text: str) -> int:
    """vLLM's ``human_readable_int`` (engine/arg_utils.py 0.11.0:1740-1778): ``1k`` 1000, ``1K`` 1024,
    ``25.6k`` 25600; no decimals with a binary suffix."""
    value = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        decimal = {"k": 10**3, "m": 10**6, "g": 10**9}
        binary = {"K": 2**10, "M": 2**20, "G": 2**30}
        if suffix in decimal:
            return int(float(number) * decimal[suffix])
        if suffix in binary:
            if "." in number:
                raise ValueError(f"decimals are not allowed with binary suffixes like {suffix}")
            return int(number) * binary[suffix]
    return int(value)


def _positive_int(text: str) -> int:
    value = int(text.strip())
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _positive_human_int(text: str) -> int:
    value = human_readable_int(text)
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _utilization(text: str) -> float:
    value = float(text.strip())
    if not math.isfinite(value) or not 0 < value <= 1:
        raise ValueError("must be in (0, 1]")
    return value


def _choice(choices: tuple[str, ...]):
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"choose from {', '.join(choices)}")
        return text

    return parse


# --dtype: vLLM's choices (config/model.py ModelDType, 0.11.0); float32 is refused by the planner.
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")

# The flags plan reads: canonical name -> parser. Names are vLLM's, dashes for underscores.
VALUE_FLAGS: dict[str, Any] = {
    "model": str,
    "tensor-parallel-size": _positive_int,
    "pipeline-parallel-size": _positive_int,
    "max-model-len": _positive_human_int,
    "max-num-seqs": _positive_int,
    "max-num-batched-tokens": _positive_human_int,
    "gpu-memory-utilization": _utilization,
    "kv-cache-memory-bytes": _positive_human_int,
    "block-size": _positive_int,
    "dtype": _choice(DTYPES),
    "kv-cache-dtype": _choice(KV_CACHE_DTYPES),
    "quantization": str,
    "performance-mode": _choice(("balanced", "interactivity", "throughput")),  # vLLM 0.17+
}
SHORT = {"tp": "tensor-parallel-size", "pp": "pipeline-parallel-size", "q": "quantization"}
# vLLM flags without a value (store_true / BooleanOptionalAction): never take the next word as theirs.
BOOLEAN_FLAGS = frozenset(
    {
        "trust-remote-code",
        "enforce-eager",
        "enable-prefix-caching",
        "enable-chunked-prefill",
        "disable-log-requests",
        "enable-log-requests",
        "disable-log-stats",
        "enable-expert-parallel",
        "enable-auto-tool-choice",
        "disable-custom-all-reduce",
        "enable-lora",
        "disable-sliding-window",
        "disable-cascade-attn",
        "enable-sleep-mode",
        "skip-tokenizer-init",
        "enable-eplb",
        "async-scheduling",
        "disable-frontend-multiprocessing",
        "enable-server-load-tracking",
        "headless",
    }
)

_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PYTHON = re.compile(r"^(?:.*/)?python(?:[0-9.]*)?$")


@dataclass(frozen=True)
class ServeCommand:
    """What the command line says, before defaults."""

    entry_point: str  # "vllm serve", "api_server", "vllm-mindspore serve", ...
    project: str | None  # "vllm-mindspore" when the entry point is its own; else None
    model: str | None
    flags: dict[str, Any] = field(default_factory=dict)  # canonical name -> parsed value
    ignored: tuple[str, ...] = ()  # flags plan does not use, as typed
    env: dict[str, str] = field(default_factory=dict)  # leading VAR=value words (HCCL_BUFFSIZE=100, ...)

    def get(self, name: str, default: Any = None) -> Any:
        return self.flags.get(name, default)

    def to_dict(self) -> dict[str, Any]:
        return {
            "entry_point": self.entry_point,
            "project": self.project,
            "model": self.model,
            "flags": dict(self.flags),
            "ignored": list(self.ignored),
            "env": dict(self.env),
        }


def _entry(words: list[str]) -> tuple[str, str | None, list[str], bool]:
    """(entry point, project, the words after it, whether a positional MODEL may follow)."""
    while words and _ENV.match(words[0]):
        words = words[1:]
    if not words:
        raise CommandError("no serve command after --: give e.g. -- vllm serve MODEL --tensor-parallel-size 1")
    head = os.path.basename(words[0])
    if head in ("vllm", "vllm-mindspore") and len(words) > 1 and words[1] == "serve":
        return f"{head} serve", ("vllm-mindspore" if head == "vllm-mindspore" else None), words[2:], True
    if _PYTHON.match(words[0]) and len(words) > 2 and words[1] == "-m":
        module = words[2]
        if module == "vllm.entrypoints.openai.api_server":
            return "api_server", None, words[3:], False
        if (
            module == "vllm_mindspore.entrypoints"
            and len(words) > 3
            and words[3] == "vllm.entrypoints.openai.api_server"
        ):
            return "vllm_mindspore api_server", "vllm-mindspore", words[4:], False
    shown = " ".join(words[:3])[:80]
    raise CommandError(
        f"not a vLLM serve command: {shown!r} (expected `vllm serve MODEL ...`, `python -m "
        f"vllm.entrypoints.openai.api_server --model MODEL ...`, or vllm-mindspore's `vllm-mindspore "
        f"serve MODEL ...` / `python -m vllm_mindspore.entrypoints vllm.entrypoints.openai.api_server ...`)"
    )


def parse_serve_command(words: list[str] | tuple[str, ...]) -> ServeCommand:
    """Read a serve command (the words after ``kvguard plan ... --``); CommandError (one line) otherwise."""
    words = list(words)
    env: dict[str, str] = {}
    for word in words:
        if not _ENV.match(word):
            break
        name, value = word.split("=", 1)
        env[name] = value
    entry, project, rest, positional = _entry(words)
    model = None
    if positional and rest and not rest[0].startswith("-"):
        model, rest = rest[0], rest[1:]
    flags: dict[str, Any] = {}
    ignored: list[str] = []
    i = 0
    while i < len(rest):
        word = rest[i]
        i += 1
        if not word.startswith("-") or word in ("-", "--"):
            raise CommandError(f"unexpected word {word[:60]!r} in the serve command (a flag's value without its flag?)")
        name, has_value, value = word.lstrip("-"), "=" in word, None
        if has_value:
            name, value = name.split("=", 1)
        canonical = name.replace("_", "-")
        if word.startswith("-") and not word.startswith("--"):
            canonical = SHORT.get(canonical, canonical)
        if canonical in VALUE_FLAGS:
            if not has_value:
                if i >= len(rest) or (rest[i].startswith("-") and not _number(rest[i])):
                    raise CommandError(f"{word} needs a value")
                value = rest[i]
                i += 1
            try:
                flags[canonical] = VALUE_FLAGS[canonical](value)
            except (ValueError, TypeError) as exc:
                reason = str(exc) if not str(exc).startswith("invalid literal") else "not a number"
                raise CommandError(f"--{canonical}: {value[:40]!r} is not valid ({reason[:80]})") from None
            continue
        # A flag plan does not use: the words up to the next flag are its value(s) (--served-model-name a b,
        # --seed -1); a boolean flag takes none.
        if not has_value and canonical not in BOOLEAN_FLAGS and not canonical.startswith("no-"):
            while i < len(rest) and (not rest[i].startswith("-") or _number(rest[i])):
                i += 1
        ignored.append(word.split("=", 1)[0])
    if "model" in flags:
        if model is not None and flags["model"] != model:
            raise CommandError(f"two models: {model[:60]!r} and --model {flags['model'][:60]!r}")
        model = flags.pop("model")
    return ServeCommand(entry, project, model, flags, tuple(ignored), env)


def _number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
