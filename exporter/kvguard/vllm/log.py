"""Startup facts from a vLLM / vllm-ascend / vllm-mindspore log.

Pure parsing: text in, a StartupLog record out. What a log does not say stays None;
nothing is invented. The lines recognised, by era (strings from vLLM's source, see
README "Reading a startup log"):

V1 (``vllm/v1/worker/gpu_worker.py``, ``vllm/v1/core/kv_cache_utils.py``)
    Available KV cache memory: 37.85 GiB
    GPU KV cache size: 708,672 tokens
    Maximum concurrency for 32,768 tokens per request: 21.63x
    Model loading took 14.2487 GiB and 5.37 seconds
    Free memory on device (59.69/64.00 GiB) on startup. Desired GPU memory utilization is (0.9, 57.60 GiB)
    Memory profiling takes 5.20 seconds. Total non KV cache memory: 19.75GiB; torch peak memory increase:
        4.26GiB; non-torch forward increase memory: 1.30GiB; weights memory: 14.19GiB.   (DEBUG)
V0, late 2024 to removal (``vllm/worker/worker.py``)
    the current vLLM instance can use total_gpu_memory (79.15GiB) x gpu_memory_utilization (0.90) = 71.24GiB
    model weights take 14.99GiB; non_torch_memory takes 0.14GiB; PyTorch activation peak memory takes
        1.23GiB; the rest of the memory reserved for KV Cache is 54.88GiB.
    # GPU blocks: 5102, # CPU blocks: 4681      (also "# cuda blocks", "# npu blocks")
    Loading model weights took 14.9888 GB       (GiB despite the label: divided by 2**30)
V0, v0.6.4 era
    Memory profiling results: total_gpu_memory=79.15GiB initial_memory_usage=15.40GiB
        peak_torch_memory=16.23GiB memory_usage_post_profile=15.54GiB non_torch_memory=0.14GiB
        kv_cache_size=54.88GiB gpu_memory_utilization=0.90
vllm-ascend, 2025-07 to 2025-11 (``worker_v1.py``)
    Available memory: 40638086144, total memory: 65452113920
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO, Iterable, Iterator

from kvguard.estimator import Profile

GIB = 1 << 30
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_NUM = r"(-?[0-9][0-9,]*(?:\.[0-9]+)?)"


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _gib(text: str) -> int:
    return int(round(_number(text) * GIB))


@dataclass(frozen=True)
class StartupLog:
    """What one startup log says. Sizes in bytes; log sizes carry 0.01 GiB rounding."""

    era: str | None = None                       # "v1", "v0", "v0.6", "vllm-ascend"
    total_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    weights_bytes: int | None = None
    peak_allocated_increase_bytes: int | None = None
    non_torch_increase_bytes: int | None = None
    peak_torch_memory_bytes: int | None = None   # v0.6 era: weights + activation peak together
    available_kv_cache_bytes: int | None = None  # what vLLM decided
    num_gpu_blocks: int | None = None
    kv_cache_tokens: int | None = None
    max_model_len: int | None = None
    max_concurrency: float | None = None
    lines_matched: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def profile(self) -> Profile | None:
        """The startup profile, when the log carries every part of it (vLLM's logs never carry
        the reserved increase)."""
        parts = (self.total_memory_bytes, self.gpu_memory_utilization, self.weights_bytes,
                 self.peak_allocated_increase_bytes, self.non_torch_increase_bytes)
        if any(p is None for p in parts):
            return None
        return Profile(
            total_memory_bytes=self.total_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            weights_bytes=self.weights_bytes,
            peak_allocated_increase_bytes=self.peak_allocated_increase_bytes,
            peak_reserved_increase_bytes=None,
            non_torch_increase_bytes=self.non_torch_increase_bytes,
        )


# (pattern, handler(match, facts)) — each handler records what its line states.
def _v1_available(m, f):
    # Every worker logs its own; the engine keeps the smallest.
    value = _gib(m[1])
    f["available_kv_cache_bytes"] = value if f.get("available_kv_cache_bytes") is None \
        else min(value, f["available_kv_cache_bytes"])
    f.setdefault("era", "v1")


def _v1_kv_tokens(m, f):
    f["kv_cache_tokens"] = int(_number(m[1]))
    f.setdefault("era", "v1")


def _concurrency(m, f):
    f["max_model_len"] = int(_number(m[1]))
    f["max_concurrency"] = _number(m[2])


def _model_loading(m, f):
    f["weights_bytes"] = _gib(m[1])


def _free_on_startup(m, f):
    f["total_memory_bytes"] = _gib(m[2])
    f["gpu_memory_utilization"] = _number(m[3])


def _v1_profile(m, f):
    f["peak_allocated_increase_bytes"] = _gib(m[1])
    f["non_torch_increase_bytes"] = _gib(m[2])
    f["weights_bytes"] = _gib(m[3])
    f.setdefault("era", "v1")


def _v0_can_use(m, f):
    f["total_memory_bytes"] = _gib(m[1])
    f["gpu_memory_utilization"] = _number(m[2])
    f["era"] = "v0"


def _v0_breakdown(m, f):
    f["weights_bytes"] = _gib(m[1])
    f["non_torch_increase_bytes"] = _gib(m[2])
    f["peak_allocated_increase_bytes"] = _gib(m[3])
    f["available_kv_cache_bytes"] = _gib(m[4])
    f["era"] = "v0"


def _v0_blocks(m, f):
    f["num_gpu_blocks"] = int(_number(m[1]))


def _v06_results(m, f):
    f["total_memory_bytes"] = _gib(m[1])
    f["peak_torch_memory_bytes"] = _gib(m[2])
    f["non_torch_increase_bytes"] = _gib(m[3])
    f["available_kv_cache_bytes"] = _gib(m[4])
    f["gpu_memory_utilization"] = _number(m[5])
    f["era"] = "v0.6"


def _ascend_available(m, f):
    f["available_kv_cache_bytes"] = int(_number(m[1]))
    f["total_memory_bytes"] = int(_number(m[2]))
    f["era"] = "vllm-ascend"


_GIB_UNIT = r"\s*Gi?B"
_PATTERNS = [
    (re.compile(r"Available KV cache memory:\s*" + _NUM + _GIB_UNIT), _v1_available),
    (re.compile(r"(?:GPU|NPU|CUDA|XPU)?\s*KV cache size:\s*" + _NUM + r"\s*tokens"), _v1_kv_tokens),
    (re.compile(r"Maximum concurrency for\s*" + _NUM + r"\s*tokens per request:\s*" + _NUM + r"\s*x"), _concurrency),
    (re.compile(r"(?:Model loading took|Loading model weights took)\s*" + _NUM + _GIB_UNIT), _model_loading),
    (re.compile(r"Free memory on device \(\s*" + _NUM + r"\s*/\s*" + _NUM + _GIB_UNIT
                + r"\s*\) on startup\. Desired GPU memory utilization is \(\s*" + _NUM), _free_on_startup),
    (re.compile(r"torch peak memory increase:\s*" + _NUM + _GIB_UNIT + r";\s*non-torch forward increase memory:\s*"
                + _NUM + _GIB_UNIT + r";\s*weights memory:\s*" + _NUM + _GIB_UNIT), _v1_profile),
    (re.compile(r"can use total_gpu_memory \(\s*" + _NUM + _GIB_UNIT + r"\s*\) x gpu_memory_utilization \(\s*"
                + _NUM + r"\s*\)"), _v0_can_use),
    (re.compile(r"model weights take\s*" + _NUM + _GIB_UNIT + r";\s*non_torch_memory takes\s*" + _NUM + _GIB_UNIT
                + r";\s*PyTorch activation peak memory takes\s*" + _NUM + _GIB_UNIT
                + r";\s*the rest of the memory reserved for KV Cache is\s*" + _NUM + _GIB_UNIT), _v0_breakdown),
    (re.compile(r"#\s*(?:GPU|gpu|cuda|CUDA|npu|NPU|xpu|XPU|tpu|TPU|hpu|HPU)\s+blocks:\s*" + _NUM), _v0_blocks),
    (re.compile(r"Memory profiling results: total_gpu_memory=" + _NUM + r"GiB.*?peak_torch_memory=" + _NUM
                + r"GiB.*?non_torch_memory=" + _NUM + r"GiB\s+kv_cache_size=" + _NUM
                + r"GiB\s+gpu_memory_utilization=" + _NUM), _v06_results),
    (re.compile(r"Available memory:\s*" + _NUM + r",\s*total memory:\s*" + _NUM), _ascend_available),
]

# A line longer than this is not a vLLM log line; skip it rather than run regexes over it.
MAX_LINE_CHARS = 8192


def parse_lines(lines: Iterable[str]) -> StartupLog:
    facts: dict[str, Any] = {}
    matched = 0
    for raw in lines:
        if len(raw) > MAX_LINE_CHARS:
            continue
        line = _ANSI.sub("", raw)
        if "KV" not in line and "memory" not in line and "blocks" not in line and "Memory" not in line \
                and "weights" not in line and "concurrency" not in line:
            continue
        for pattern, handler in _PATTERNS:
            match = pattern.search(line)
            if match:
                try:
                    handler(match, facts)
                except ValueError:
                    continue
                matched += 1
    return StartupLog(lines_matched=matched, **facts)


def parse_log(text: str) -> StartupLog:
    # vLLM V0 logs its multi-line profile as one record; each part still sits on its own line.
    return parse_lines(text.splitlines())


# A startup log's memory lines come in its first minutes; a file larger than this is read up to here.
MAX_LOG_BYTES = 256 * 1024 * 1024
MAX_LINE_BYTES = 4 * MAX_LINE_CHARS


class LogFileError(ValueError):
    """One line saying why a log file is not read (it is not a regular file)."""


def read_log_file(path: str, max_bytes: int = MAX_LOG_BYTES) -> StartupLog:
    """Parse a startup log file, bounded: regular files only, at most ``max_bytes`` read, lines
    longer than MAX_LINE_BYTES skipped. Raises LogFileError, or OSError when it cannot be opened."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below anyway.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise LogFileError(f"cannot read log file {path}: not a regular file")
        return parse_lines(_bounded_lines(handle, max_bytes))


def _bounded_lines(handle: BinaryIO, max_bytes: int) -> Iterator[str]:
    left = max_bytes
    while left > 0:
        line = handle.readline(min(MAX_LINE_BYTES + 1, left))
        if not line:
            return
        left -= len(line)
        if len(line) > MAX_LINE_BYTES:
            # Overlong: drop it and the rest of it, still counting what is read.
            while left > 0 and not line.endswith(b"\n"):
                line = handle.readline(min(MAX_LINE_BYTES + 1, left))
                if not line:
                    return
                left -= len(line)
            continue
        yield line.decode("utf-8", errors="replace")
