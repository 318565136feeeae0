"""The guard applied to a simulated serving run: what ``kvguard simulate --json`` reports as ``guard``.

``startup_verdict`` judges a scenario at the end of startup, before the first serving step, from
exactly what a real rank offers: the startup profile vLLM measured, the KV cache it sized, and
the allocator's and device's counters at that moment. ``BudgetWatch`` takes the budget-time
verdict (``guard_at_budget``): it copies the allocator the moment vLLM's profile has run and
emptied the cache (the scenario calls ``empty_cache`` once after the profile record, then sizes
and allocates the KV cache), and ``kvguard.guard.judge.judge_at_budget`` places the era's KV tensors
into that copy. ``run_guarded`` then keeps judging after
every serving step the way the sidecar does, so the grid in ``tests/test_guard_grid.py`` can
say when the guard first said ``critical`` and whether that was before the OOM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvguard.budget.estimator import kv_cache_tensor_bytes
from kvguard.guard.judge import (CRITICAL, BudgetInput, GuardInput, Verdict, judge, judge_at_budget,
                           physical_reserved_bytes)
from kvguard.records import DeviceMemory
from kvguard.sim.scenario import ScenarioResult, ServingScenario
from kvguard.sources import mindspore as mindspore_source
from kvguard.sources import torch as torch_source
from kvguard.sim.source import record_from_scenario


def counters_of(model: Any, device: str = "sim:0", source: str = "sim") -> DeviceMemory:
    """A sim allocator model's counters as the rank's own source reads them (MindSpore's reader for
    the pool, torch's for the caching allocator), with its device's free and total."""
    free, total = model.device.mem_get_info()
    reader = mindspore_source if model.name == "mindspore" else torch_source
    return reader.device_memory_from_stats(model.memory_stats(), device, source, free_bytes=free, total_bytes=total)


def scenario_tensor_style(scenario: ServingScenario) -> str:
    """The KV tensor style of the release the scenario stands for: vllm-mindspore on MindSpore's
    pool, vLLM V1 (0.9-0.27, one tensor per layer) on torch and torch_npu."""
    return "per_layer_k_v" if scenario.config.allocator == "mindspore" else "per_layer"


class BudgetWatch:
    """Install before ``startup()``: records the scenario's allocator calls (``malloc``, ``free``,
    ``empty_cache``, peak resets; the device's non-allocator growth) until vLLM's budget is fixed
    (the profile run's ``empty_cache``), so that ``build()`` makes a new model in exactly that state
    by replaying them: the models are deterministic, so the replay is the state, addresses included.
    Only the allocators' public API is used; recording stops at the budget."""

    # jit_o0_compile: MindSpore's pool leaves task sink at the first compile (sim/mindspore_pool.py).
    _CALLS = ("malloc", "free", "empty_cache", "reset_peak_memory_stats", "jit_o0_compile")

    def __init__(self, scenario: ServingScenario) -> None:
        self.scenario = scenario
        self.events: list[tuple[str, tuple]] = []
        self.captured = False
        self._initial_non_allocator = scenario.device.non_allocator_bytes
        allocator, device = scenario.allocator, scenario.device
        self._names = [name for name in self._CALLS if hasattr(allocator, name)]
        for name in self._names:
            setattr(allocator, name, self._recording(allocator, name, getattr(allocator, name)))
        self._non_allocator = device.non_allocator_bytes

    def _recording(self, allocator: Any, name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            grown = self.scenario.device.non_allocator_bytes - self._non_allocator
            if grown:   # runtime memory that appeared since the last call (Device has no hook of its own)
                self.events.append(("grow", (grown,), {}))
                self._non_allocator += grown
            result = original(*args, **kwargs)
            self.events.append((name, args, kwargs))
            if name == "empty_cache" and self.scenario.timeline and self.scenario.timeline[-1].phase == "profile":
                self._stop()
            return result
        return call

    def _stop(self) -> None:
        self.captured = True
        for name in self._names:
            self.scenario.allocator.__dict__.pop(name, None)

    def build(self) -> Any:
        """A new allocator model, on a new device, in the state the scenario's had at the budget."""
        from kvguard.allocators.device import Device
        from kvguard.sim.scenario import make_allocator

        config = self.scenario.config
        device = Device(config.device_memory_bytes, self._initial_non_allocator)
        model = make_allocator(config, device)
        for event in self.events:
            if event[0] == "grow":
                device.grow_non_allocator(*event[1])
            else:
                name, args, kwargs = event
                getattr(model, name)(*args, **kwargs)
        return model

    def verdict(self) -> Verdict | None:
        """The budget-time verdict; None when startup never reached the budget (weights or the
        profile run failed) or vLLM refused to start (no room for one request's blocks)."""
        scenario = self.scenario
        if not self.captured or scenario.profile is None or not scenario.num_blocks or \
                (scenario.error and not scenario.oom):
            return None
        tensors = kv_cache_tensor_bytes(scenario.kv_layout, scenario.num_blocks, scenario_tensor_style(scenario))
        return judge_at_budget(BudgetInput(scenario.profile, tensors, self.build, counters_of))


def planned_kv_cache_bytes(scenario: ServingScenario) -> int | None:
    """The KV cache vLLM sized (whole blocks), whether or not allocating it succeeded."""
    if scenario.num_blocks is None:
        return None
    return scenario.num_blocks * scenario.kv_layout.block_bytes


def _judge(scenario: ServingScenario, memory: DeviceMemory, base: DeviceMemory | None = None) -> Verdict:
    """The guard on ``memory``, retries and OOMs counted since ``base`` (None: since the process started)."""
    if base is None:
        retries, ooms = memory.alloc_retries, memory.ooms
    else:
        retries = (memory.alloc_retries or 0) - (base.alloc_retries or 0)
        ooms = (memory.ooms or 0) - (base.ooms or 0)
    return judge(GuardInput(scenario.profile, kv_cache_bytes=planned_kv_cache_bytes(scenario), memory=memory,
                            alloc_retries_increase=retries, ooms_increase=ooms))


def _startup(scenario: ServingScenario) -> tuple[Verdict | None, DeviceMemory | None]:
    """``startup_verdict`` and the counters it judged (None, None when there is no profile)."""
    scenario.startup()
    if scenario.profile is None:
        return None, None
    memory = record_from_scenario(scenario, "sim:0", "sim")
    # Counters since the process started: at the end of startup that is the whole history.
    return _judge(scenario, memory), memory


def startup_verdict(scenario: ServingScenario) -> Verdict | None:
    """The guard at the end of startup (runs ``startup()`` if needed); None when no profile exists
    (the run failed loading weights or in the profile forward, before vLLM sized anything)."""
    return _startup(scenario)[0]


@dataclass(frozen=True)
class GuardedRun:
    result: ScenarioResult
    startup: Verdict | None
    first_critical_step: int | None      # -1: at startup; None: never critical
    first_critical_reasons: tuple[str, ...]
    at_budget: Verdict | None = None     # before the KV cache was allocated

    @property
    def caught_at_budget(self) -> bool:
        return self.at_budget is not None and self.at_budget.state == CRITICAL

    @property
    def caught_at_startup(self) -> bool:
        return self.startup is not None and self.startup.state == CRITICAL

    @property
    def critical_ever(self) -> bool:
        return self.caught_at_budget or self.first_critical_step is not None

    @property
    def caught_before_oom(self) -> bool:
        """Critical strictly before the failing allocation: a KV-cache OOM only by the budget-time
        verdict; a serving OOM by that, or at startup, or at a step before the failing one."""
        if self.caught_at_budget:
            return self.result.oom
        if self.first_critical_step is None or self.result.oom_phase == "kv_cache":
            return False
        return self.result.oom_at_step is not None and self.first_critical_step < self.result.oom_at_step

    def guard_dict(self) -> dict[str, Any]:
        return startup_guard_dict(self.startup)


def startup_guard_dict(verdict: Verdict | None, at_budget: bool = False) -> dict[str, Any]:
    if verdict is None:
        message = ("startup never fixed a KV budget (no profile, or no room for one request's blocks)"
                   if at_budget else "startup failed before vLLM measured a profile")
        return {"state": None, "reasons": [{"code": "no_profile", "state": "warning", "message": message}]}
    return verdict.to_dict()


def run_guarded(scenario: ServingScenario, max_steps: int | None = None) -> GuardedRun:
    """Run the scenario to the end, judging at startup and after every serving step.

    Retries and OOMs are counted from the end of startup, as a sidecar that started with the
    server would see them climb.
    """
    watch = BudgetWatch(scenario)
    startup, base = _startup(scenario)
    at_budget = watch.verdict()
    first_step: int | None = None
    first_reasons: tuple[str, ...] = ()
    if startup is not None and startup.state == CRITICAL:
        first_step, first_reasons = -1, startup.reason_codes
    steps = 0
    while not scenario.finished and (max_steps is None or steps < max_steps):
        step_index = scenario.step_index
        scenario.step()
        steps += 1
        if first_step is not None or startup is None or scenario.oom:
            continue
        verdict = _judge(scenario, record_from_scenario(scenario, "sim:0", "sim"), base)
        if verdict.state == CRITICAL:
            first_step, first_reasons = step_index, verdict.reason_codes
    return GuardedRun(scenario.result(), startup, first_step, first_reasons, at_budget)


# ------------------------------------------------------------------ a real rank's allocator, from its counters

def allocator_from_counters(kind: str, memory: DeviceMemory, *, expandable_segments: bool = False,
                            enable_vmm: bool = False) -> Any:
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
    from kvguard.allocators.device import Device
    from kvguard.allocators.mindspore_pool import DynamicMemPool
    from kvguard.allocators.torch_alloc import CachingAllocator

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
            device.grow_non_allocator(held_beyond)    # block tails and slivers: not reusable
        return pool
    model = CachingAllocator(device, variant=kind if kind in ("torch", "torch_npu") else "torch",
                             expandable_segments=expandable_segments)
    if physical:
        model.malloc(physical)
    if device.free_bytes > free:
        device.grow_non_allocator(device.free_bytes - free)
    return model


def counters_at_budget(profile: Any, kind: str, *, enable_vmm: bool = False,
                       non_allocator_bytes: int | None = None) -> DeviceMemory:
    """The rank's counters when vLLM fixes its budget, as a startup profile implies them (``kvguard
    budget --allocator``): the weights allocated; reserved, the weights and, on MindSpore's pool without
    VMM, the profile run's reserved increase too (its ``empty_cache`` releases nothing without VMM:
    ``AscendVmmAdapter::EmptyCache``, see kvguard.allocators.mindspore_pool); outside the allocator, the
    runtime context held from the start (``non_allocator_bytes``, default the simulator's per
    allocator) plus the profile's non-torch increase."""
    from kvguard.sim.scenario import DEFAULT_NON_ALLOCATOR_BYTES

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
        raise ValueError(f"the profile leaves no free memory at the budget ({outside} bytes outside the "
                         f"allocator, {reserved} reserved, {total} total)")
    return DeviceMemory(device="budget", source=kind, allocated_bytes=weights, reserved_bytes=reserved,
                        total_bytes=total, free_bytes=free, used_bytes=total - free)


def predict_at_budget(profile: Any, layout: Any, kv_cache_bytes: int, kind: str, *, enable_vmm: bool = False,
                      expandable_segments: bool = False, non_allocator_bytes: int | None = None,
                      memory: DeviceMemory | None = None) -> dict[str, Any]:
    """The budget-time verdict for ``kv_cache_bytes`` (vLLM's budget) from a profile, and the largest
    budget the guard predicts fits: what ``kvguard budget --allocator`` prints."""
    from kvguard.budget.estimator import kv_tensor_style
    from kvguard.guard.judge import largest_fitting_blocks

    if memory is None:
        memory = counters_at_budget(profile, kind, enable_vmm=enable_vmm, non_allocator_bytes=non_allocator_bytes)
    style = "per_layer_k_v" if kind == "mindspore" else kv_tensor_style(profile.formula, profile.vllm_version)

    def build() -> Any:
        return allocator_from_counters(kind, memory, expandable_segments=expandable_segments, enable_vmm=enable_vmm)

    def verdict_for(blocks: int) -> Verdict:
        return judge_at_budget(BudgetInput(profile, kv_cache_tensor_bytes(layout, blocks, style), build, counters_of))

    num_blocks = layout.num_blocks(kv_cache_bytes)
    verdict = verdict_for(num_blocks)
    fits = num_blocks if verdict.state != CRITICAL else largest_fitting_blocks(verdict_for, max(0, num_blocks - 1))
    return {"allocator": kind, "enable_vmm": enable_vmm, "expandable_segments": expandable_segments,
            "tensor_style": style, "kv_cache_bytes": kv_cache_bytes, "num_blocks": num_blocks,
            "counters": memory.to_dict(), "verdict": verdict.to_dict(),
            "largest_fitting_blocks": fits, "largest_fitting_kv_cache_bytes": fits * layout.block_bytes}


def _common_unit(pool: Any) -> int:
    """The common pool's block unit, from the pool's own ``memory_stats()`` (the key's spelling differs
    between MindSpore releases)."""
    for key, value in pool.memory_stats().items():
        if key.endswith("_mem_pool_stats") and not key.startswith("persistent") and isinstance(value, dict):
            unit = value.get("block_unit_size")
            return int(unit) if isinstance(unit, int) else 0
    return 0
