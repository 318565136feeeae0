"""What a startup log itself proves: refusals, a KV cache of zero or less, and OOMs, with a post-mortem.

``kvguard check --from-log`` judges these before (and beside) the guard's projection of the log's
profile: a log that states vLLM refused to start, decided no KV cache, or ran out of memory is
critical whatever the profile would have projected. Pure logic on a :class:`StartupLog`.

The post-mortem of an OOM follows what the allocator's message states (:mod:`kvguard.vllm.oom`):

- fragmentation: PyTorch held at least the failed request reserved but unallocated (its pool could
  not hand out idle memory of the right shape);
- budget overrun: the device had less free than the request, and PyTorch held too little idle to
  cover it: more was promised (KV cache, graphs, activations) than the device holds.

The room it would have taken is the shortfall, ``tried − free`` (rounded up to a MiB): a budget that
much smaller fits. It is stated as the utilization and the ``--kv-cache-memory-bytes`` that give it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvguard.units import format_bytes, format_gib
from kvguard.vllm.log import StartupLog
from kvguard.vllm.oom import OomFact

CRITICAL = "critical"
MIB = 1 << 20
STEP_WORDS = {
    "model_loading": "while loading the model",
    "kv_allocation": "while allocating the KV cache",
    "graph_capture": "while capturing CUDA graphs",
    "profile_run": "during the profile run",
    "warmup": "during warm-up",
    "serving": "while serving",
}
ALLOC_CONF = {
    "npu": "PYTORCH_NPU_ALLOC_CONF=expandable_segments:True",
    "hip": "PYTORCH_HIP_ALLOC_CONF=expandable_segments:True",
}


@dataclass(frozen=True)
class LogFinding:
    code: str  # vllm_refused, kv_cache_nonpositive, oom
    state: str
    message: str
    detail: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "state": self.state, "message": self.message, "detail": self.detail or {}}


def _floor_hundredths(utilization: float) -> float:
    """A utilization rounded down to the 0.01 a user types."""
    return math.floor(utilization * 100) / 100


def judge_log(
    log: StartupLog, total_memory_bytes: int | None = None, gpu_memory_utilization: float | None = None
) -> list[LogFinding]:
    """The log's own critical facts (empty when it states none)."""
    total = log.total_memory_bytes or total_memory_bytes
    util = log.gpu_memory_utilization or gpu_memory_utilization
    findings = []
    if log.refusal:
        findings.append(LogFinding("vllm_refused", CRITICAL, _refusal_text(log, total)))
    if log.kv_cache_nonpositive and log.refusal != "no_kv_memory":
        findings.append(
            LogFinding(
                "kv_cache_nonpositive",
                CRITICAL,
                f"vLLM decided a KV cache of {format_gib(log.available_kv_cache_bytes)}: the weights and the profile "
                f"took all of the requested memory; it cannot serve a request"
                + (
                    f" (lower the weights or --max-model-len, or raise --gpu-memory-utilization above {util})"
                    if util
                    else ""
                ),
            )
        )
    if log.oom is not None:
        text, detail = post_mortem(log.oom, log, total, util)
        findings.append(LogFinding("oom", CRITICAL, text, detail))
    return findings


def _refusal_text(log: StartupLog, total: int | None) -> str:
    if log.refusal == "free_memory":
        text = "vLLM refused to start: the device's free memory"
        if log.init_free_memory_bytes is not None and total:
            text += f" ({format_gib(log.init_free_memory_bytes)} of {format_gib(total)})"
        text += " was less than the memory it was asked to take"
        if log.requested_memory_bytes is not None:
            text += f" ({format_gib(log.requested_memory_bytes)})"
        if log.init_free_memory_bytes is not None and total:
            fits = _floor_hundredths(log.init_free_memory_bytes / total)
            text += (
                f"; --gpu-memory-utilization {fits:.2f} would fit what was free"
                if fits > 0
                else "; another process holds the device"
            )
        return text
    if log.refusal == "max_seq_len":
        text = (
            f"vLLM refused to start: one request of max_model_len {log.max_model_len or '?'} tokens needs more KV cache"
        )
        if log.kv_cache_tokens is not None:
            text += f" than the {log.kv_cache_tokens:,} tokens it got; --max-model-len {log.kv_cache_tokens} fits"
        elif log.needed_kv_cache_bytes is not None and log.available_kv_cache_bytes is not None:
            text += (
                f" ({format_gib(log.needed_kv_cache_bytes)}) than it got ({format_gib(log.available_kv_cache_bytes)})"
            )
        return text + " (or raise --gpu-memory-utilization)"
    if log.refusal == "no_kv_memory":
        return (
            "vLLM refused to start: no memory was left for the KV cache (weights, activations and CUDA graphs "
            "took all of total x --gpu-memory-utilization)"
        )
    if log.refusal == "profiling_error":
        return (
            "vLLM refused to start: free memory grew during its profile run (another process released "
            "memory), so no budget could be computed; run it alone on the device"
        )
    return f"vLLM refused to start ({log.refusal})"


def post_mortem(oom: OomFact, log: StartupLog, total: int | None, util: float | None) -> tuple[str, dict[str, Any]]:
    """One line on an OOM: what failed, where, fragmentation or overrun, and what budget would have fit."""
    total = oom.total_bytes or total
    where = STEP_WORDS.get(oom.step or "", "at a step the log does not show")
    device = (oom.device or "device").upper()
    parts = [f"{device} out of memory {where}"]
    if oom.tried_bytes is not None:
        asked = f"asked for {format_bytes(oom.tried_bytes)}"
        if oom.free_bytes is not None:
            asked += f" with {format_bytes(oom.free_bytes)} free"
        if total:
            asked += f" of {format_bytes(total)}"
        parts.append(asked)
    idle = oom.idle_reserved_bytes
    detail: dict[str, Any] = {
        "step": oom.step,
        "device": oom.device,
        "tried_bytes": oom.tried_bytes,
        "free_bytes": oom.free_bytes,
        "idle_reserved_bytes": idle,
        "cause": None,
        "shortfall_bytes": None,
        "gpu_memory_utilization_fits": None,
        "kv_cache_memory_bytes_fits": None,
    }
    if oom.tried_bytes is not None and idle is not None and idle >= oom.tried_bytes:
        detail["cause"] = "fragmentation"
        parts.append(
            f"fragmentation: PyTorch held {format_bytes(idle)} reserved but unallocated, more than the "
            f"request; {ALLOC_CONF.get(oom.device or '', 'PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True')} "
            f"lets it reuse that"
        )
        return "; ".join(parts), detail
    if oom.tried_bytes is None:
        parts.append("the message states no sizes: the cause cannot be told")
        return "; ".join(parts), detail
    if oom.free_bytes is not None and oom.free_bytes >= oom.tried_bytes:
        detail["cause"] = "device_limit"
        parts.append(
            "the device reported more free than the request: a limit other than free memory refused it "
            "(a memory fraction, a unified-memory carve-out, or the driver's own fragmentation)"
        )
        return "; ".join(parts), detail
    detail["cause"] = "budget_overrun"
    shortfall = oom.tried_bytes - (oom.free_bytes or 0)
    shortfall = max(MIB, -(-shortfall // MIB) * MIB)
    detail["shortfall_bytes"] = shortfall
    fits = []
    if total and util:
        lower = _floor_hundredths(util - shortfall / total)
        if lower > 0:
            detail["gpu_memory_utilization_fits"] = lower
            fits.append(f"--gpu-memory-utilization {lower:.2f} (from {util})")
    decided = log.available_kv_cache_bytes
    if decided is not None and decided > shortfall:
        detail["kv_cache_memory_bytes_fits"] = decided - shortfall
        fits.append(f"--kv-cache-memory-bytes {decided - shortfall} (the KV cache was {format_gib(decided)})")
    overrun = f"budget overrun: the device lacked {format_bytes(shortfall)} and PyTorch held " + (
        f"only {format_bytes(idle)} idle" if idle is not None else "no idle memory it reported"
    )
    parts.append(overrun)
    if fits:
        parts.append("a budget smaller by that would have left room: " + " or ".join(fits))
    elif not (total and util):
        parts.append("give --total-memory and --gpu-memory-utilization to say what utilization would have fit")
    return "; ".join(parts), detail
