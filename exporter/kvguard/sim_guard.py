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
from kvguard.sources.sim import record_from_scenario


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
    startup, base = _startup(scenario)
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
    return GuardedRun(scenario.result(), startup, first_step, first_reasons)
