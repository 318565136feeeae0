"""``KVGUARD_BUDGET``: the plugin's budget decisions, taken once vLLM's ``determine_available_memory`` returned
and before the KV cache is allocated, and the budget-time verdict recorded with them.

- ``reserved``: the budget of :func:`kvguard.budget.estimator.reserved_kv_cache_bytes`, the formula of ``kvguard
  budget`` (never more than vLLM's own figure) (:func:`reserved_budget`);
- ``guard``: the largest budget the budget-time verdict predicts fits (``kvguard.guard.judge.judge_at_budget``),
  never more than vLLM's figure (:func:`guard_budget`);
- every mode: the verdict for the budget applied, into the rank's snapshot at once (``budget_verdict``;
  ``/guard``'s ``at_budget``) (:func:`record_budget_verdict`). The era's KV tensors for that budget (the
  worker's ``get_kv_cache_spec``) are placed into a model of this rank's allocator built from its counters
  now (``kvguard.guard.at_budget.allocator_from_counters``), with the serving peak beside them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

from kvguard.plugin import state
from kvguard.plugin.profile import allocator_kind, era_of, extensible, kv_cache_spec, layer_page, running_release
from kvguard.plugin.state import log

if TYPE_CHECKING:
    from kvguard.allocators.base import Allocator
    from kvguard.budget.estimator import Profile
    from kvguard.guard.judge import Verdict
    from kvguard.records import DeviceMemory

# (this rank's counters now, a builder of a new allocator model holding them)
BudgetModel = tuple["DeviceMemory", Callable[[], "Allocator"]]

# Where each caching allocator reads its config, first set first: torch_npu's own, then torch's.
ALLOC_CONF_ENVS = {
    "torch_npu": ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"),
    "torch": ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"),
}


def reserved_budget(worker: object, profile: Profile, available: int) -> int | None:
    """The reserved-aware budget when it is smaller than vLLM's; None to keep vLLM's."""
    from kvguard.budget.estimator import reserved_kv_cache_bytes, stock_kv_cache_bytes

    if extensible(worker):
        if state.once("extensible_budget"):
            log.info(
                "kvguard: KVGUARD_BUDGET=reserved changes nothing here: vLLM's extensible KV cache is sized "
                "after warm-up and already keeps torch's reserved growth free"
            )
        return None
    if profile.kv_cache_memory_bytes is not None:
        return None  # --kv-cache-memory-bytes: the operator fixed the size
    from kvguard.guard.judge import with_reserved_peak

    # vllm-mindspore: MindSpore's reserved peak of the profile run where it is above the engine's figure.
    reserved = reserved_kv_cache_bytes(with_reserved_peak(profile, state.profile_peak))
    if reserved is None:
        state.failed("budget", "the reserved increase was not measured; keeping vLLM's KV cache budget")
        return None
    # vLLM's figure less the overcommit: what vLLM applies after the formula (its multimodal IPC
    # reserve) stays applied.
    overcommit = stock_kv_cache_bytes(profile) - reserved
    if overcommit <= 0 and profile.budget_formula.peak == "reserved" and state.once("reserved_formula"):
        log.info(
            "kvguard: KVGUARD_BUDGET=reserved changes nothing here: this engine's own budget already takes "
            "the profile run's reserved increase (vllm-mindspore: vllm_mindspore/utils.py:475 @ 0.5.1), and "
            "its reserved peak is no higher"
        )
    return available - overcommit if overcommit > 0 else None


def check_formula(profile: Profile, available: object) -> None:
    """Say once when kvguard's formula for this release does not reproduce vLLM's own figure."""
    from kvguard.budget.estimator import stock_kv_cache_bytes

    if not isinstance(available, int) or state.said("formula_mismatch"):
        return
    expected = stock_kv_cache_bytes(profile)
    if expected != available:
        state.once("formula_mismatch")
        state.hook_errors["formula_mismatch"] = state.hook_errors.get("formula_mismatch", 0) + 1
        log.warning(
            "kvguard: vLLM (%s) budgeted %d bytes for the KV cache, kvguard's %s formula %d; "
            "kvguard's budgets for this worker may be off",
            profile.vllm_version,
            available,
            profile.formula,
            expected,
        )


# ---------------------------------------------------------------------------- the budget-time verdict


class NotModelled(Exception):
    """The rank's allocator runs in a way the allocator models do not follow (``backend:cudaMallocAsync``, a
    value its config refuses): there is no budget-time verdict to give, and nothing failed."""


def expandable_segments(kind: str) -> bool:
    """Whether the caching allocator of ``kind`` runs with ``expandable_segments``: the first of its config
    variables that is set (:data:`ALLOC_CONF_ENVS`), read by the one parser of those strings,
    :func:`kvguard.allocators.torch_alloc.parse_alloc_conf`. Keys a newer torch may know are left out; a
    string the parser refuses (``backend:cudaMallocAsync``, a bad value) raises :class:`NotModelled`.
    MindSpore's pool has none (its ``MS_ALLOC_CONF`` is read by :func:`budget_model`)."""
    variant = "torch_npu" if kind == "torch_npu" else "torch"
    if kind == "mindspore":
        return False
    for name in ALLOC_CONF_ENVS[variant]:
        text = os.environ.get(name)
        if text is not None:
            from kvguard.allocators.torch_alloc import parse_alloc_conf

            try:
                conf = parse_alloc_conf(text, variant, skip_unknown_keys=True)
            except ValueError as exc:
                raise NotModelled(f"{name}={text!r}: {exc}") from None
            return bool(conf.get("expandable_segments", False))
    return False


def budget_model(worker: object) -> BudgetModel | None:
    """(this rank's counters now, a builder of a new allocator model holding them); None when the
    source tells too little (no total or free memory). :class:`NotModelled` when the allocator's config
    is one the models do not follow."""
    records = state.device_reader().sample()
    if not records or records[0].total_bytes is None or records[0].free_bytes is None:
        return None
    memory = records[0]
    kind = allocator_kind(worker)
    vmm = False
    if kind == "mindspore":
        from kvguard.allocators.mindspore_releases import vmm_on

        era = era_of(running_release(worker))
        vmm = vmm_on(os.environ.get("MS_ALLOC_CONF"), launcher_vmm=era.vmm_default if era else None)
    expandable = expandable_segments(kind)
    from kvguard.guard.at_budget import allocator_from_counters

    return memory, lambda: allocator_from_counters(kind, memory, expandable_segments=expandable, enable_vmm=vmm)


def kv_tensors_for(worker: object, profile: Profile, budget: int) -> tuple[int, ...] | None:
    """The KV tensors the era allocates for ``budget``: per layer spec (``get_kv_cache_spec``), vLLM's
    block count (``available // page_size // num_layers`` for one uniform group, kv_cache_utils.py
    0.11.0:1050-1061), the era row's style (kvguard.vllm.eras.kv_tensor_style) through the estimator's
    one rule (kv_cache_tensor_bytes)."""
    from kvguard.budget.estimator import kv_cache_tensor_bytes
    from kvguard.vllm.eras import kv_tensor_style

    specs = kv_cache_spec(worker)
    if not specs:
        return None
    pages = [layer_page(spec) for spec in specs.values()]
    if min(page.page_bytes for page in pages) <= 0:
        return None
    num_blocks = max(0, int(budget)) // max(page.page_bytes for page in pages) // len(pages)
    style = kv_tensor_style(profile.vllm_version, formula=profile.formula, allocator=allocator_kind(worker))
    return kv_cache_tensor_bytes(pages, num_blocks, style)


def verdict_at(worker: object, profile: Profile, budget: int, model: BudgetModel) -> Verdict | None:
    """The budget-time verdict for ``budget`` bytes of KV cache; None for a worker without KV cache specs."""
    from kvguard.guard.at_budget import counters_of
    from kvguard.guard.judge import BudgetInput, judge_at_budget

    tensors = kv_tensors_for(worker, profile, budget)
    if tensors is None:
        return None
    _, build = model
    return judge_at_budget(BudgetInput(profile, tensors, build, counters_of, reserved_peak=state.profile_peak))


def record_budget_verdict(worker: object, profile: Profile, budget: int) -> None:
    """The verdict for the budget applied, into the rank's snapshot at once; said at WARNING when critical."""
    if state.settings.spool_dir is None or extensible(worker) or not kv_cache_spec(worker):
        return  # no probe; 0.34's extensible KV cache (sized after warm-up, outside the allocator); no specs
    try:
        model = budget_model(worker)
    except NotModelled as exc:
        if state.once("budget_verdict_not_modelled"):
            log.info("kvguard: no budget-time verdict: %s", exc)
        return
    if model is None:
        return
    verdict = verdict_at(worker, profile, budget, model)
    if verdict is None:
        return
    from kvguard import probe

    probe.set_budget_verdict(verdict)
    running = probe.current()
    if running is not None:
        running.run_once()  # into the snapshot at once: the KV allocation may be what fails next
    if verdict.state == "critical":
        log.warning(
            "kvguard: budget-time verdict critical for a %d-byte KV cache: %s",
            budget,
            "; ".join(r.message for r in verdict.reasons if r.state == "critical"),
        )


def guard_budget(worker: object, profile: Profile, available: int) -> int | None:
    """KVGUARD_BUDGET=guard: the largest budget, at most vLLM's, whose budget-time verdict is not
    critical (bisection over whole blocks; the verdict only worsens with more blocks). None keeps
    vLLM's figure (it already fits, or nothing fits, or the guard cannot judge)."""
    from kvguard.units import format_gib

    if extensible(worker) or profile.kv_cache_memory_bytes is not None:
        log.info(
            "kvguard: KVGUARD_BUDGET=guard changes nothing here: %s",
            "vLLM's extensible KV cache is sized after warm-up"
            if extensible(worker)
            else "--kv-cache-memory-bytes fixed the size",
        )
        return None
    try:
        model = budget_model(worker)
    except NotModelled as exc:
        log.info("kvguard: KVGUARD_BUDGET=guard changes nothing here: %s", exc)
        return None
    if model is None:
        state.failed("budget", "the device source gives no free/total memory; keeping vLLM's KV cache budget")
        return None
    first = verdict_at(worker, profile, available, model)
    if first is None or first.state != "critical":
        log.info(
            "kvguard: KVGUARD_BUDGET=guard keeps vLLM's KV cache budget %s: the guard predicts it fits (%s)",
            format_gib(available),
            first.state if first else "no KV cache spec",
        )
        return None
    from kvguard.guard.judge import largest_fitting_blocks

    specs = kv_cache_spec(worker) or {}
    block = max(int(spec.page_size_bytes) for spec in specs.values()) * len(specs)
    low = largest_fitting_blocks(
        lambda blocks: verdict_at(worker, profile, blocks * block, model), available // block - 1
    )
    if low == 0:
        log.warning(
            "kvguard: KVGUARD_BUDGET=guard: no KV cache budget fits by the guard's prediction; keeping vLLM's %s (%s)",
            format_gib(available),
            first.reasons[0].message,
        )
        return None
    budget = low * block
    log.info(
        "kvguard: KV cache budget %s (KVGUARD_BUDGET=guard) instead of vLLM's %s: at vLLM's the guard predicts %s (%s)",
        format_gib(budget),
        format_gib(available),
        first.reasons[0].code,
        first.reasons[0].message,
    )
    return budget
