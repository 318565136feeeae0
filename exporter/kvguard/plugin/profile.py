"""Pure conversions from what vLLM's objects hold to kvguard's records: the startup profile (the estimator's
:class:`~kvguard.budget.estimator.Profile`), the KV cache vLLM allocated (``KVCacheAllocation``), the profile
run's reserved peak (``ReservedPeak``), the engine's identity and the running release.

Nothing here patches, logs or keeps state: each function reads the objects it is given (and ``sys.modules``,
for the release that is loaded) and returns a record, or None where the objects tell too little.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvguard.plugin.objects import (
    CacheConfig,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MemoryProfilingResult,
    Worker,
)

if TYPE_CHECKING:
    from kvguard.budget.estimator import BudgetFormula, LayerPage, Profile
    from kvguard.plugin.inline_readings import Readings
    from kvguard.records import KVCacheAllocation, ReservedPeak
    from kvguard.vllm.eras import Era

# The KV cache specs of MLA layers: vLLM's, and vllm-mindspore's quantized one (kv_cache_interface.py:30 @ 0.5.1).
_MLA_SPECS = frozenset({"MLAAttentionSpec", "MLAQuantFullAttentionSpec"})


class Capture:
    """What one ``memory_profiling`` block left behind."""

    def __init__(self) -> None:
        self.result: MemoryProfilingResult | None = None
        self.reserved_peak_before: int | None = None
        self.reserved_peak_after: int | None = None  # the profile run's reserved peak
        self.reserved_after_exit: int | None = None  # reserved after vLLM's empty_cache()
        # vllm-mindspore: MindSpore's own reserved figures around the run (kvguard.plugin.capture).
        self.mindspore = False
        self.ms_reserved_start: int | None = None  # memory_reserved() after reset_peak_memory_stats()
        self.ms_reserved_max: int | None = None  # max_memory_reserved() at the run's end
        self.ms_reserved_end: int | None = None  # memory_reserved() at the run's end
        self.ms_error: str | None = None  # why they were not read


# ---------------------------------------------------------------------------- the engine and its release


def engine_identity(worker: object) -> tuple[str | None, int | None]:
    """(served model name, engine index) of the engine this worker serves; None for what it lacks."""
    config = getattr(worker, "vllm_config", None)
    name = getattr(getattr(config, "model_config", None), "served_model_name", None)
    if isinstance(name, (list, tuple)):  # before ModelConfig resolves it, a list may stand here
        name = name[0] if name else None
    parallel = getattr(config, "parallel_config", None)
    engine = None
    for field in ("data_parallel_index", "data_parallel_rank"):
        value = getattr(parallel, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            engine = value
            break
    return (name if isinstance(name, str) and name else None), engine


def running_release(worker: object = None) -> str | None:
    """``project:version`` of the release this worker runs: vllm-mindspore or vllm-ascend when their
    platform is loaded (310P when its worker class is), else vLLM's own version."""
    for module_name, project in (("vllm_mindspore", "vllm-mindspore"), ("vllm_ascend", "vllm-ascend")):
        module = sys.modules.get(module_name)
        if module is None:
            continue
        version = _distribution_version(project) or getattr(module, "__version__", None)
        if project == "vllm-ascend" and worker is not None and type(worker).__name__ == "NPUWorker310":
            project = "vllm-ascend-310p"
        if version:
            return f"{project}:{version}"
    version = getattr(sys.modules.get("vllm"), "__version__", None) or _distribution_version("vllm")
    return f"vllm:{version}" if version else None


def _distribution_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - no metadata: the module's own attribute, or unknown
        return None


def era_of(release: str | None) -> Era | None:
    """The release's era row (kvguard.vllm.eras); None for an unknown release."""
    from kvguard.vllm.eras import EraError, era_for

    if release is None:
        return None
    try:
        return era_for(release)
    except EraError:
        return None


def allocator_kind(worker: object) -> str:
    """The running release's allocator (its era row's)."""
    from kvguard.vllm.eras import allocator_for

    return allocator_for(running_release(worker))


def runs_mindspore(worker: object) -> bool:
    """The running engine is vllm-mindspore on MindSpore's pool (its era row's allocator)."""
    release = running_release(worker)
    return bool(release and release.startswith("vllm-mindspore:")) and allocator_kind(worker) == "mindspore"


def extensible(worker: object) -> bool:
    """0.34's extensible KV cache is on (``cache_config.enable_extensible_kv_cache``)."""
    return bool(getattr(getattr(worker, "cache_config", None), "enable_extensible_kv_cache", False))


# ---------------------------------------------------------------------------- the profile


def utilization(cache_config: CacheConfig) -> float:
    """The utilization vLLM used: 0.34's ``resolved_gpu_memory_utilization`` (never ``None``)."""
    resolved = getattr(cache_config, "resolved_gpu_memory_utilization", None)
    value = resolved if resolved is not None else cache_config.gpu_memory_utilization
    return float(value)


def _cudagraph_applied(worker: Worker, formula: BudgetFormula) -> int | None:
    """The CUDA-graph estimate vLLM subtracted: 0.18+ sets ``worker.cudagraph_memory_estimate`` and
    subtracts it only when VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS is on (w 0.20.0:413-425)."""
    if not formula.cudagraph:
        return None
    estimate = getattr(worker, "cudagraph_memory_estimate", 0) or 0
    if not estimate:
        return 0
    envs = sys.modules.get("vllm.envs")
    applied = bool(getattr(envs, "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", True)) if envs else True
    return int(estimate) if applied else 0


def profile_from(worker: Worker, capture: Capture) -> Profile | None:
    """The estimator's Profile, in the running release's terms, from the MemoryProfilingResult and
    the worker (its cache config, its CUDA-graph estimate)."""
    from kvguard.budget.estimator import FORMULAS, Profile

    result = capture.result
    release = running_release(worker)
    era = era_of(release)
    formula_name = era.formula if era else "peak"
    formula = FORMULAS[formula_name]
    kv_cache_memory = getattr(worker.cache_config, "kv_cache_memory_bytes", None)
    if result is None:
        if not kv_cache_memory:
            return None
        # --kv-cache-memory-bytes: vLLM runs the profile but measures nothing (w 0.11.0:235-252).
        weights = getattr(getattr(worker, "model_runner", None), "model_memory_usage", 0)
        return Profile(
            total_memory_bytes=int(worker.init_snapshot.total_memory),
            gpu_memory_utilization=utilization(worker.cache_config),
            weights_bytes=max(0, int(weights)),
            peak_allocated_increase_bytes=None,
            peak_reserved_increase_bytes=None,
            non_torch_increase_bytes=None,
            formula=formula_name if formula_name != "consumed" else "peak",
            vllm_version=release,
            kv_cache_memory_bytes=int(kv_cache_memory),
        )
    total = getattr(getattr(result, "before_create", None), "total_memory", 0) or getattr(
        getattr(worker, "init_snapshot", None), "total_memory", 0
    )
    reserved_increase = None
    if capture.reserved_peak_before is not None and capture.reserved_peak_after is not None:
        reserved_increase = max(0, capture.reserved_peak_after - capture.reserved_peak_before)
    peak = max(0, int(result.torch_peak_increase))
    allocated_peak: int | None = peak
    if formula.peak == "reserved":
        # vllm-mindspore's torch_peak_increase is the memory_reserved() increase (vllm_mindspore/utils.py:475).
        reserved_increase, allocated_peak = peak, None
    extra: dict[str, int] = {}
    if formula.non_kv == "consumed":
        extra["total_consumed_bytes"] = int(result.total_consumed)
        extra["transient_peak_headroom_bytes"] = max(0, int(result.transient_peak_headroom))
        if capture.reserved_peak_after is not None and capture.reserved_after_exit is not None:
            extra["reserved_transient_peak_bytes"] = max(0, capture.reserved_peak_after - capture.reserved_after_exit)
    cudagraph = _cudagraph_applied(worker, formula)
    if cudagraph is not None:
        extra["cudagraph_memory_bytes"] = cudagraph
    if kv_cache_memory:
        extra["kv_cache_memory_bytes"] = int(kv_cache_memory)
    return Profile(
        total_memory_bytes=int(total),
        gpu_memory_utilization=utilization(worker.cache_config),
        weights_bytes=max(0, int(result.weights_memory)),
        peak_allocated_increase_bytes=allocated_peak,
        peak_reserved_increase_bytes=reserved_increase,
        non_torch_increase_bytes=int(result.non_torch_increase),
        formula=formula_name,
        vllm_version=release,
        **extra,  # type: ignore[arg-type]  # the optional byte counts, by name
    )


def profile_from_device_readings(worker: Worker, readings: Readings) -> Profile | None:
    """The profile of what a worker that measures inline computed (its era's formula adds the absolute
    non-torch memory: kvguard.plugin.inline_readings.profile_from_readings); None for another era."""
    from kvguard.plugin.inline_readings import profile_from_readings

    release = running_release(worker)
    era = era_of(release)
    if era is None:
        return None
    return profile_from_readings(
        readings, formula=era.formula, utilization=utilization(worker.cache_config), release=release
    )


def with_cleared(profile: Profile, available: object) -> Profile | None:
    """vllm-ascend 0.15+ also subtracts the non-torch memory its profile's empty_cache cleared, a local of
    its determine_available_memory (worker.py 0.17.0rc1:339-366); it is what the returned figure leaves
    unexplained (310P: twice that, less the halving's rounding)."""
    from kvguard.budget.estimator import non_kv_cache_bytes, requested_memory_bytes

    formula = profile.budget_formula
    if not formula.cleared or not isinstance(available, int) or profile.non_torch_cleared_bytes is not None:
        return None
    scale = 2 if formula.halved else 1
    # A profile whose non-KV figure is unknown (None) raises TypeError here: counted by the hook, as before.
    cleared = int(requested_memory_bytes(profile) - non_kv_cache_bytes(profile) - scale * available)  # type: ignore[operator]
    return dataclasses.replace(profile, non_torch_cleared_bytes=cleared)


def with_unprofiled_sampler(worker: Worker, profile: Profile) -> Profile | None:
    """A release whose profile run samples nothing (its era row's ``profile_runs_sampler`` is False: vllm-ascend
    V1) measured no sampler: the profile with the sampling peak of the batch vLLM budgets for
    (``kvguard.budget.sampler.unprofiled_sampler_peak_bytes``), from the engine's own config: the model's
    hidden size, vocabulary and dtype, tensor parallelism, and the scheduler's max_num_seqs and
    max_num_batched_tokens. None where the row's profile run samples, for a pooling model (no sampler), or
    where the config tells too little."""
    from kvguard.budget.sampler import unprofiled_sampler_peak_bytes
    from kvguard.vllm.eras import profile_runs_sampler

    if profile_runs_sampler(profile.vllm_version) or profile.unprofiled_sampler_bytes is not None:
        return None
    if getattr(getattr(worker, "model_runner", None), "is_pooling_model", False):
        return None
    config = getattr(worker, "vllm_config", None)
    model: Any = getattr(config, "model_config", None)
    scheduler: Any = getattr(config, "scheduler_config", None)
    parallel: Any = getattr(config, "parallel_config", None)
    try:
        figures = {
            "hidden_size": model.get_hidden_size(),
            "vocab_size": model.get_vocab_size(),
            "dtype_bytes": model.dtype.itemsize,
            "tensor_parallel_size": getattr(parallel, "tensor_parallel_size", 1),
            "max_num_seqs": scheduler.max_num_seqs,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        }
    except (AttributeError, TypeError):
        return None
    if not all(isinstance(value, int) and not isinstance(value, bool) and value > 0 for value in figures.values()):
        return None
    return dataclasses.replace(profile, unprofiled_sampler_bytes=unprofiled_sampler_peak_bytes(**figures))


def with_extensible_inputs(profile: Profile, calls: list[dict[str, int]], requested: int) -> Profile | None:
    """0.34's extensible KV cache, sized at the end of warm-up by ``measure_kv_cache_bytes``: the profile with
    the inputs of the call that sized the cache, the one with the worker's own requested memory (a second
    call, with the startup free memory, only words a warning: extensible_kv_cache.py 0.34.0:655-660); formula
    ``extensible``. None without such a call."""
    sizing = next((c for c in calls if c.get("requested_memory") == requested), calls[0] if calls else None)
    if sizing is None:
        return None
    inputs = {field: int(sizing[name]) for name, field in EXTENSIBLE_INPUTS.items()}
    return dataclasses.replace(profile, formula="extensible", **inputs)  # type: ignore[arg-type]


# measure_kv_cache_bytes's keyword (v1/worker/extensible_kv_cache.py 0.34.0:592-618) -> the Profile's field.
EXTENSIBLE_INPUTS = {
    "init_free_memory": "init_free_memory_bytes",
    "free_memory": "free_after_warmup_bytes",
    "committed_bytes": "kv_committed_bytes",
    "transient_peak_bytes": "kv_transient_peak_bytes",
    "torch_reserve_growth_bytes": "torch_reserve_growth_bytes",
}


def reserved_peak_from(profile: Profile, capture: Capture) -> ReservedPeak | None:
    """The profile run's reserved peak (kvguard.records.ReservedPeak) beside what vllm-mindspore measured
    (the profile's reserved increase); None where the engine is not vllm-mindspore."""
    from kvguard.records import ReservedPeak

    if not capture.mindspore or capture.result is None or profile.budget_formula.peak != "reserved":
        return None
    measured = profile.peak_reserved_increase_bytes
    start, peak, end = capture.ms_reserved_start, capture.ms_reserved_max, capture.ms_reserved_end
    if start is None or peak is None or end is None:
        return ReservedPeak(measured, None, error=capture.ms_error or "MindSpore's reserved memory not read")
    return ReservedPeak(measured, max(0, max(peak, end) - start))


# ---------------------------------------------------------------------------- the KV cache


def layer_page(spec: KVCacheSpec) -> LayerPage:
    """One layer's bytes per block, and whether it is an MLA layer (its spec class or a base of it)."""
    from kvguard.budget.estimator import LayerPage

    return LayerPage(int(spec.page_size_bytes), any(cls.__name__ in _MLA_SPECS for cls in type(spec).__mro__))


def kv_cache_spec(worker: object) -> dict[str, KVCacheSpec] | None:
    """The worker's per-layer KV cache specs (``Worker.get_kv_cache_spec``, or its model runner's);
    None for a worker that has neither."""
    for owner in (worker, getattr(worker, "model_runner", None)):
        method = getattr(owner, "get_kv_cache_spec", None)
        if callable(method):
            specs: Mapping[str, KVCacheSpec] = method()
            return dict(specs)
    return None


def _group_block_bytes(group: KVCacheGroupSpec) -> int:
    """Bytes one block takes across one group's layers. ``UniformTypeKVCacheSpecs.page_size_bytes`` is
    already the sum over its layers (kv_cache_interface.py 0.11.0:275-277, 0.34.0:1354-1355)."""
    spec = group.kv_cache_spec
    if hasattr(spec, "kv_cache_specs"):
        return int(spec.page_size_bytes)
    return len(group.layer_names) * int(spec.page_size_bytes)


def kv_cache_allocation(
    kv_cache_config: KVCacheConfig, num_blocks: int | None = None, outside_allocator: bool = False
) -> KVCacheAllocation | None:
    """KVCacheAllocation from vLLM's KVCacheConfig, sized as vLLM sizes it: the largest group's bytes
    per block (vLLM takes the max over groups, kv_cache_utils.py 0.11.0:1050-1061, kv_cache_planning.py
    0.34.0:615-648); without groups, the tensors it allocates over the block count."""
    from kvguard.records import KVCacheAllocation

    config_blocks = int(kv_cache_config.num_blocks)
    num_blocks = config_blocks if num_blocks is None else int(num_blocks)
    if num_blocks <= 0 or config_blocks <= 0:
        return None
    groups: list[KVCacheGroupSpec] = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    tensors = getattr(kv_cache_config, "kv_cache_tensors", None)
    if tensors is None:
        tensors = list((getattr(kv_cache_config, "tensors", None) or {}).values())
    block_bytes = max((_group_block_bytes(group) for group in groups), default=0)
    if not block_bytes and tensors:
        # Older configs without groups: what the tensors hold per block (0.34 pads its tensors to
        # the extensible capacity, so they are the fallback only).
        block_bytes = sum(int(tensor.size) for tensor in tensors) // config_blocks
    block_size = int(groups[0].kv_cache_spec.block_size) if groups else 0
    if block_bytes <= 0 or block_size <= 0:
        return None
    return KVCacheAllocation(
        num_blocks=num_blocks, block_bytes=block_bytes, block_size=block_size, outside_allocator=outside_allocator
    )
