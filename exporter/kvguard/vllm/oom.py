"""Out-of-memory messages as facts: what the allocator was asked for and what the device had.

PyTorch's caching allocators word their OOM one of two ways; both are read here:

- c10/cuda/CUDACachingAllocator.cpp since torch 2.1 (CUDA and HIP, one message):
  ``CUDA out of memory. Tried to allocate 128.00 MiB. GPU 0 has a total capacity of 11.63 GiB of
  which 21.56 MiB is free. Including non-PyTorch memory, this process has 11.07 GiB memory in use.
  Of the allocated memory 10.85 GiB is allocated by PyTorch, [with X allocated in private pools
  (e.g., CUDA Graphs),] and 36.30 MiB is reserved by PyTorch but unallocated.``
- the older form, still torch_npu's (torch_npu/csrc/core/npu/NPUCachingAllocator.cpp):
  ``NPU out of memory. Tried to allocate 22.00 MiB (NPU 6; 60.97 GiB total capacity; 10.24 GiB
  already allocated; 10.24 GiB current active; 19.79 MiB free; 10.65 GiB reserved in total by PyTorch)``

Sizes come as torch's ``format_size`` prints them (bytes, KiB, MiB, GiB). Each figure is taken by
its own bounded pattern, so a message cut short by a paste still gives the figures before the cut.
Pure parsing; no I/O.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

_UNITS = {
    "B": 1,
    "bytes": 1,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
    "KB": 1 << 10,
    "MB": 1 << 20,
    "GB": 1 << 30,
}
# One bounded number and its unit: the quantifiers are possessive in effect (no nesting, one class each).
_SIZE = r"([0-9]{1,12}(?:\.[0-9]{1,6})?) ?(bytes|B|KiB|MiB|GiB|TiB|KB|MB|GB)\b"
# (fact, pattern): each pattern is a literal anchor plus one or two sizes; re.search on a line of at most
# MAX_LINE_CHARS characters is linear (every attempt is bounded by the literal and the number's length).
_PATTERNS = (
    ("tried_bytes", re.compile(r"out of memory\. Tried to allocate " + _SIZE)),
    # torch_npu's workspace allocator words its own: "NPU out of memory. NPUWorkspaceAllocator tried to
    # allocate 180.00 MiB(NPU 1; 60.96 GiB total capacity; 86.81 MiB free)" (vllm-ascend 0.12.0rc1, real r52).
    ("tried_bytes", re.compile(r"WorkspaceAllocator tried to allocate " + _SIZE)),
    # torch 2.1 spelled it "total capacty" (real r57, torch 2.1.2); 2.2 on "total capacity".
    ("total_bytes", re.compile(r"has a total capac(?:i)?ty of " + _SIZE)),
    ("free_bytes", re.compile(r"total capac(?:i)?ty of [0-9.]{1,20} ?[KMGT]?i?B of which " + _SIZE + " is free")),
    ("process_in_use_bytes", re.compile(r"this process has " + _SIZE + " memory in use")),
    ("allocated_bytes", re.compile(r"Of the allocated memory " + _SIZE + " is allocated by PyTorch")),
    ("reserved_unallocated_bytes", re.compile(_SIZE + r" is reserved by PyTorch but unallocated")),
    # The older form: "(GPU 0; T total capacity; A already allocated; [C current active;] F free; R reserved ...".
    ("total_bytes", re.compile(_SIZE + r" total capacity")),
    ("allocated_bytes", re.compile(_SIZE + r" already allocated")),
    ("free_bytes", re.compile(r"; " + _SIZE + r" free\b")),
    ("reserved_bytes", re.compile(_SIZE + r" reserved in total by PyTorch")),
)
_DEVICES = (
    ("CUDA out of memory", "cuda"),
    ("HIP out of memory", "hip"),
    ("NPU out of memory", "npu"),
    ("XPU out of memory", "xpu"),
    # The runtime's own error, not the caching allocator's: cudaErrorMemoryAllocation as
    # "CUDA error: out of memory" (vLLM relays it as "Worker failed with error '…'"); no sizes.
    ("CUDA error: out of memory", "cuda"),
    ("HIP error: out of memory", "hip"),
    ("OutOfMemoryError", None),
)


def _bytes(number: str, unit: str) -> int:
    return int(round(float(number) * _UNITS[unit]))


@dataclass(frozen=True)
class OomFact:
    """One out-of-memory message: sizes in bytes, None where the message (or the paste) leaves them out."""

    device: str | None  # cuda, hip, npu, xpu (from the message's wording)
    line: int  # where it stands in the log
    tried_bytes: int | None = None  # the request that failed
    total_bytes: int | None = None  # the device's total capacity
    free_bytes: int | None = None  # free on the device when it failed
    allocated_bytes: int | None = None  # allocated by PyTorch
    reserved_bytes: int | None = None  # reserved by PyTorch in total (older form)
    reserved_unallocated_bytes: int | None = None  # reserved by PyTorch but unallocated (new form)
    process_in_use_bytes: int | None = None
    step: str | None = None  # kv_allocation, graph_capture, profile_run, warmup, serving

    @property
    def idle_reserved_bytes(self) -> int | None:
        """Memory PyTorch held but had not handed out: what fragmentation left unusable."""
        if self.reserved_unallocated_bytes is not None:
            return self.reserved_unallocated_bytes
        if self.reserved_bytes is not None and self.allocated_bytes is not None:
            return max(0, self.reserved_bytes - self.allocated_bytes)
        return None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["idle_reserved_bytes"] = self.idle_reserved_bytes
        return data


def is_oom_line(line: str) -> bool:
    return "out of memory" in line or "OutOfMemoryError" in line


def read_oom(line: str, number: int) -> OomFact | None:
    """The OOM figures one line states, or None when it names no device OOM."""
    device = None
    for words, name in _DEVICES:
        if words in line:
            device = name
            break
    else:
        return None
    found: dict[str, int] = {}
    for fact, pattern in _PATTERNS:
        if fact in found:
            continue
        match = pattern.search(line)
        if match is not None:
            found[fact] = _bytes(match.group(1), match.group(2))
    if device is None and not found:
        return None
    return OomFact(device=device, line=number, **found)


# Where an OOM happened, from the traceback frames and log lines before it (the last one seen wins):
# the worker methods vLLM and its platform plugins name (gpu_worker.py, gpu_model_runner.py,
# cache_engine.py; vllm_ascend worker.py / model_runner_v1.py).
STEP_WORDS = (
    ("_allocate_kv_cache", "kv_allocation"),
    ("initialize_kv_cache", "kv_allocation"),
    ("initialize_from_config", "kv_allocation"),
    ("initialize_cache", "kv_allocation"),
    ("cache_engine.py", "kv_allocation"),
    ("capture_model", "graph_capture"),
    ("Capturing cudagraphs", "graph_capture"),
    ("Capturing CUDA graph", "graph_capture"),
    ("_capture_cudagraphs", "graph_capture"),
    ("profile_run", "profile_run"),
    ("determine_available_memory", "profile_run"),
    ("determine_num_available_blocks", "profile_run"),
    ("_dummy_run", "profile_run"),
    ("compile_or_warm_up_model", "warmup"),
    ("_warm_up_model", "warmup"),
    ("warming up", "warmup"),
    ("load_model", "model_loading"),
    # V1's engine core logs this once its startup (profile, KV cache, warm-up and graph capture) is done:
    # an OOM after it is not in any of those steps.
    ("init engine (profile, create kv cache, warmup model) took", "serving"),
    ("Application startup complete", "serving"),
    ("POST /v1/", "serving"),
    ("Added request", "serving"),
    ("Received request", "serving"),
)
# vLLM's executor names the worker method an error came from after the traceback:
# "Error executing method 'load_model'. This might cause deadlock in distributed execution."
ERROR_IN_METHOD = "Error executing method '"


def step_in(line: str) -> str | None:
    found = None
    at = -1
    for words, step in STEP_WORDS:
        position = line.rfind(words)
        if position > at:
            at, found = position, step
    return found
