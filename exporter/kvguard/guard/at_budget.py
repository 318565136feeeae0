"""The budget-time verdict from a real rank's counters: a fresh allocator model holding what the
counters say it holds, and vLLM's KV tensors placed into it (``kvguard.guard.judge.judge_at_budget``).

Used live by the vLLM plugin and by ``kvguard budget --allocator``; it needs only the allocator
models and the counter readers, never the serving simulator."""

from __future__ import annotations

from typing import Any, cast

from kvguard.allocators.base import Allocator
from kvguard.allocators.device import DEFAULT_NON_ALLOCATOR_BYTES, Device
from kvguard.allocators.mindspore_pool import DynamicMemPool
from kvguard.allocators.torch_alloc import CachingAllocator
from kvguard.budget.estimator import KVLayout, Profile, kv_cache_tensor_bytes
from kvguard.guard.judge import (
    CRITICAL,
    BudgetInput,
    Verdict,
    judge_at_budget,
    largest_fitting_blocks,
    physical_reserved_bytes,
)
from kvguard.records import DeviceMemory
from kvguard.sources import mindspore as mindspore_source, torch as torch_source
from kvguard.vllm.eras import kv_tensor_style


def counters_of(
    model: Allocator, device: str = "sim:0", source: str = "sim", *, pool_figures: bool = False
) -> DeviceMemory:
    """A sim allocator model's counters as the rank's own source reads them (MindSpore's reader for
    the pool, torch's for the caching allocator), with its device's free and total. ``pool_figures``:
    MindSpore's exact mode, the pool's own lists beside them (``DynamicMemPool.pool_figures``)."""
    free, total = model.device.mem_get_info()
    if model.name == "mindspore":
        figures = cast(DynamicMemPool, model).pool_figures() if pool_figures else None
        return mindspore_source.device_memory_from_stats(
            model.memory_stats(), device, source, free_bytes=free, total_bytes=total, figures=figures
        )
    return torch_source.device_memory_from_stats(
        model.memory_stats(), device, source, free_bytes=free, total_bytes=total
    )


def allocator_from_counters(
    kind: str, memory: DeviceMemory, *, expandable_segments: bool = False, enable_vmm: bool = False
) -> Allocator:
    """A new ``kvguard.allocators`` model of a real rank's allocator holding what its counters say it holds.

    What a rank's counters do not say (where its cached memory lies, which pool holds what) is
    taken on the safe side, with the models' own rules (only their constructors, ``malloc``,
    ``free`` and ``memory_stats`` are used):

    - the device: ``total``, and outside the allocator everything used but the allocator's
      physical reservation (``used − reserved``; MindSpore with VMM: ``physical_reserved_bytes``);
    - ``torch`` / ``torch_npu``: the reservation held as one allocated block (cached memory is
      not counted on for the KV tensors: after vLLM's ``empty_cache`` it is the free slivers of
      split segments);
    - ``mindspore``: the allocated bytes held in the persistent pool (the weights); the idle rest
      of the reservation as whole common-pool blocks of the pool's unit (``block_unit_size``), idle
      (the KV tensors go there first, as the pool would put them), and what does not make a whole
      block held as lost. With VMM, idle pages go back to the device on a miss: only the allocated
      bytes are held.
    """

    total, free = memory.total_bytes, memory.free_bytes
    reserved, allocated = memory.reserved_bytes or 0, memory.allocated_bytes or 0
    if not total or free is None:
        raise ValueError("the rank's counters lack the device's total or free memory")
    physical = physical_reserved_bytes(memory) if kind == "mindspore" and enable_vmm else reserved
    outside = max(0, total - free - physical)
    device = Device(total, min(outside, total - 1))
    if kind == "mindspore":
        pool = DynamicMemPool(device, enable_vmm=enable_vmm)
        if allocated:
            pool.malloc(allocated, persistent=True)
        if not enable_vmm:
            # The reservation not yet in the model, as whole idle common blocks of the pool's unit.
            blocks = []
            for _ in range(4096):
                unit = _common_unit(pool)
                if unit <= 0 or device.free_bytes - free < unit:
                    break
                blocks.append(pool.malloc(unit))
            for addr in blocks:
                pool.free(addr)
        held_beyond = device.free_bytes - free
        if held_beyond > 0:
            device.grow_non_allocator(held_beyond)  # block tails and slivers: not reusable
        return pool
    model = CachingAllocator(
        device, variant=kind if kind in ("torch", "torch_npu") else "torch", expandable_segments=expandable_segments
    )
    if physical:
        model.malloc(physical)
    if device.free_bytes > free:
        device.grow_non_allocator(device.free_bytes - free)
    return model


def counters_at_budget(
    profile: Profile, kind: str, *, enable_vmm: bool = False, non_allocator_bytes: int | None = None
) -> DeviceMemory:
    """The rank's counters when vLLM fixes its budget, as a startup profile implies them (``kvguard
    budget --allocator``): the weights allocated; reserved, the weights and, on MindSpore's pool without
    VMM, the profile run's reserved increase too (its ``empty_cache`` releases nothing without VMM:
    ``AscendVmmAdapter::EmptyCache``, see kvguard.allocators.mindspore_pool); outside the allocator, the
    runtime context held from the start (``non_allocator_bytes``, default the simulator's per
    allocator) plus the profile's non-torch increase."""

    held = DEFAULT_NON_ALLOCATOR_BYTES[kind] if non_allocator_bytes is None else int(non_allocator_bytes)
    weights = profile.weights_bytes
    reserved = weights
    if kind == "mindspore" and not enable_vmm:
        increase = profile.peak_reserved_increase_bytes
        if increase is None:
            increase = profile.peak_allocated_increase_bytes or 0
        reserved += increase
    outside = held + max(0, profile.non_torch_increase_bytes or 0)
    total = profile.total_memory_bytes
    free = total - outside - reserved
    if free < 0:
        raise ValueError(
            f"the profile leaves no free memory at the budget ({outside} bytes outside the "
            f"allocator, {reserved} reserved, {total} total)"
        )
    return DeviceMemory(
        device="budget",
        source=kind,
        allocated_bytes=weights,
        reserved_bytes=reserved,
        total_bytes=total,
        free_bytes=free,
        used_bytes=total - free,
    )


def predict_at_budget(
    profile: Profile,
    layout: KVLayout,
    kv_cache_bytes: int,
    kind: str,
    *,
    enable_vmm: bool = False,
    expandable_segments: bool = False,
    non_allocator_bytes: int | None = None,
    memory: DeviceMemory | None = None,
) -> dict[str, Any]:
    """The budget-time verdict for ``kv_cache_bytes`` (vLLM's budget) from a profile, and the largest
    budget the guard predicts fits: what ``kvguard budget --allocator`` prints."""

    if memory is None:
        memory = counters_at_budget(profile, kind, enable_vmm=enable_vmm, non_allocator_bytes=non_allocator_bytes)
    # The release's era row; a profile without one: the rows of this allocator (MindSpore's pool: vllm-mindspore).
    style = kv_tensor_style(profile.vllm_version, formula=profile.formula, allocator=kind)

    def build() -> Allocator:
        return allocator_from_counters(kind, memory, expandable_segments=expandable_segments, enable_vmm=enable_vmm)

    def verdict_for(blocks: int) -> Verdict:
        return judge_at_budget(BudgetInput(profile, kv_cache_tensor_bytes(layout, blocks, style), build, counters_of))

    num_blocks = layout.num_blocks(kv_cache_bytes)
    verdict = verdict_for(num_blocks)
    fits = num_blocks if verdict.state != CRITICAL else largest_fitting_blocks(verdict_for, max(0, num_blocks - 1))
    return {
        "allocator": kind,
        "enable_vmm": enable_vmm,
        "expandable_segments": expandable_segments,
        "tensor_style": style,
        "kv_cache_bytes": kv_cache_bytes,
        "num_blocks": num_blocks,
        "counters": memory.to_dict(),
        "verdict": verdict.to_dict(),
        "largest_fitting_blocks": fits,
        "largest_fitting_kv_cache_bytes": fits * layout.block_bytes,
    }


def _common_unit(pool: Allocator) -> int:
    """The common pool's block unit, from the pool's own ``memory_stats()`` (the key's spelling differs
    between MindSpore releases)."""
    for key, value in pool.memory_stats().items():
        if key.endswith("_mem_pool_stats") and not key.startswith("persistent") and isinstance(value, dict):
            unit = value.get("block_unit_size")
            return int(unit) if isinstance(unit, int) else 0
    return 0
