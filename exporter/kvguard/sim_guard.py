"""The guard applied to a simulated serving run: what ``kvguard simulate --json`` reports as ``guard``.

``startup_verdict`` judges a scenario at the end of startup, before the first serving step, from
exactly what a real rank offers: the startup profile vLLM measured, the KV cache it sized, and
the allocator's and device's counters at that moment. ``run_guarded`` then keeps judging after
every serving step the way the sidecar does, so the grid in ``tests/test_guard_grid.py`` can
say when the guard first said ``critical`` and whether that was before the OOM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvguard.guard import CRITICAL, GuardInput, Verdict, judge
from kvguard.records import DeviceMemory
from kvguard.sim.scenario import ScenarioResult, ServingScenario
from kvguard.sources import mindspore as mindspore_source
from kvguard.sources import torch as torch_source


def device_memory(scenario: ServingScenario, device: str = "sim:0") -> DeviceMemory:
    """The scenario's allocator and device counters as a probe would record them."""
    free, total = scenario.device_memory()
    stats = scenario.memory_stats()
    convert = mindspore_source if scenario.config.allocator == "mindspore" else torch_source
    return convert.device_memory_from_stats(stats, device, source="sim", free_bytes=free, total_bytes=total)


def planned_kv_cache_bytes(scenario: ServingScenario) -> int | None:
    """The KV cache vLLM sized (whole blocks), whether or not allocating it succeeded."""
    if scenario.num_blocks is None:
        return None
    return scenario.num_blocks * scenario.kv_layout.block_bytes


def startup_verdict(scenario: ServingScenario) -> Verdict | None:
    """The guard at the end of startup (runs ``startup()`` if needed); None when no profile exists
    (the run failed loading weights or in the profile forward, before vLLM sized anything)."""
    scenario.startup()
    if scenario.profile is None:
        return None
    memory = device_memory(scenario)
    # Counters since the process started: at the end of startup that is the whole history.
    return judge(GuardInput(scenario.profile, kv_cache_bytes=planned_kv_cache_bytes(scenario), memory=memory,
                            alloc_retries_increase=memory.alloc_retries, ooms_increase=memory.ooms))


@dataclass(frozen=True)
class GuardedRun:
    result: ScenarioResult
    startup: Verdict | None
    first_critical_step: int | None      # -1: at startup; None: never critical
    first_critical_reasons: tuple[str, ...]

    @property
    def caught_at_startup(self) -> bool:
        return self.startup is not None and self.startup.state == CRITICAL

    @property
    def caught_before_oom(self) -> bool:
        """Critical strictly before the failing step (at startup counts for any later OOM)."""
        if self.first_critical_step is None:
            return False
        if self.result.oom_phase == "kv_cache":
            return self.first_critical_step == -1
        return self.result.oom_at_step is not None and self.first_critical_step < self.result.oom_at_step

    def guard_dict(self) -> dict[str, Any]:
        return startup_guard_dict(self.startup)


def startup_guard_dict(verdict: Verdict | None) -> dict[str, Any]:
    if verdict is None:
        return {"state": None, "reasons": [{"code": "no_profile", "state": "warning",
                                            "message": "startup failed before vLLM measured a profile"}]}
    return verdict.to_dict()


def run_guarded(scenario: ServingScenario, max_steps: int | None = None) -> GuardedRun:
    """Run the scenario to the end, judging at startup and after every serving step.

    Retries and OOMs are counted from the end of startup, as a sidecar that started with the
    server would see them climb.
    """
    startup = startup_verdict(scenario)
    first_step: int | None = None
    first_reasons: tuple[str, ...] = ()
    if startup is not None and startup.state == CRITICAL:
        first_step, first_reasons = -1, startup.reason_codes
    base = device_memory(scenario) if startup is not None else None
    steps = 0
    while not scenario.finished and (max_steps is None or steps < max_steps):
        step_index = scenario.step_index
        scenario.step()
        steps += 1
        if first_step is not None or startup is None or scenario.oom:
            continue
        memory = device_memory(scenario)
        verdict = judge(GuardInput(
            scenario.profile, kv_cache_bytes=planned_kv_cache_bytes(scenario), memory=memory,
            alloc_retries_increase=(memory.alloc_retries or 0) - (base.alloc_retries or 0),
            ooms_increase=(memory.ooms or 0) - (base.ooms or 0)))
        if verdict.state == CRITICAL:
            first_step, first_reasons = step_index, verdict.reason_codes
    return GuardedRun(scenario.result(), startup, first_step, first_reasons)
