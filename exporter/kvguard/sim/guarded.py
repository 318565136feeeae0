"""The guard applied to a simulated serving run: what ``kvguard simulate --json`` reports as ``guard``.

``startup_verdict`` judges a scenario at the end of startup, before the first serving step, from
exactly what a real rank offers: the startup profile vLLM measured, the KV cache it sized, and
the allocator's and device's counters at that moment. ``BudgetWatch`` takes the budget-time
verdict (``guard_at_budget``): it copies the allocator the moment vLLM's profile has run and
emptied the cache (the scenario calls ``empty_cache`` once after the profile record, then sizes
and allocates the KV cache), and ``kvguard.guard.judge.judge_at_budget`` places the era's KV tensors
into that copy. ``run_guarded`` then keeps judging after
every serving step the way the sidecar does, so the grid in ``tests/guard/test_guard_grid.py`` can
say when the guard first said ``critical`` and whether that was before the OOM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvguard.guard.at_budget import counters_of
from kvguard.guard.judge import CRITICAL, BudgetInput, GuardInput, Verdict, judge, judge_at_budget
from kvguard.records import DeviceMemory
from kvguard.sim.scenario import ScenarioResult, ServingScenario
from kvguard.sim.source import record_from_scenario


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
            if grown:  # runtime memory that appeared since the last call (Device has no hook of its own)
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

    def verdict(self, pool_figures: bool = False) -> Verdict | None:
        """The budget-time verdict; None when startup never reached the budget (weights or the
        profile run failed) or vLLM refused to start (no room for one request's blocks).
        ``pool_figures``: MindSpore's exact mode (``record_from_scenario``)."""
        scenario = self.scenario
        if (
            not self.captured
            or scenario.profile is None
            or not scenario.num_blocks
            or (scenario.error and not scenario.oom)
        ):
            return None
        tensors = scenario.kv_tensor_sizes(scenario.num_blocks)
        return judge_at_budget(
            BudgetInput(
                scenario.profile, tensors, self.build, lambda model: counters_of(model, pool_figures=pool_figures)
            )
        )


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
    return judge(
        GuardInput(
            scenario.profile,
            kv_cache_bytes=planned_kv_cache_bytes(scenario),
            memory=memory,
            alloc_retries_increase=retries,
            ooms_increase=ooms,
        )
    )


def _startup(scenario: ServingScenario, pool_figures: bool = False) -> tuple[Verdict | None, DeviceMemory | None]:
    """``startup_verdict`` and the counters it judged (None, None when there is no profile)."""
    scenario.startup()
    if scenario.profile is None:
        return None, None
    memory = record_from_scenario(scenario, "sim:0", "sim", pool_figures=pool_figures)
    # Counters since the process started: at the end of startup that is the whole history.
    return _judge(scenario, memory), memory


def startup_verdict(scenario: ServingScenario, pool_figures: bool = False) -> Verdict | None:
    """The guard at the end of startup (runs ``startup()`` if needed); None when no profile exists
    (the run failed loading weights or in the profile forward, before vLLM sized anything)."""
    return _startup(scenario, pool_figures)[0]


@dataclass(frozen=True)
class GuardedRun:
    result: ScenarioResult
    startup: Verdict | None
    first_critical_step: int | None  # -1: at startup; None: never critical
    first_critical_reasons: tuple[str, ...]
    at_budget: Verdict | None = None  # before the KV cache was allocated

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
        message = (
            "startup never fixed a KV budget (no profile, or no room for one request's blocks)"
            if at_budget
            else "startup failed before vLLM measured a profile"
        )
        return {"state": None, "reasons": [{"code": "no_profile", "state": "warning", "message": message}]}
    return verdict.to_dict()


def run_guarded(scenario: ServingScenario, max_steps: int | None = None, *, pool_figures: bool = False) -> GuardedRun:
    """Run the scenario to the end, judging at startup and after every serving step.

    Retries and OOMs are counted from the end of startup, as a sidecar that started with the
    server would see them climb. ``pool_figures``: MindSpore's exact mode (the pool's own lists beside
    its counters, as ``KVGUARD_MINDSPORE_DUMP`` gives them; ``record_from_scenario``); off, the counters alone.
    """
    watch = BudgetWatch(scenario)
    startup, base = _startup(scenario, pool_figures)
    at_budget = watch.verdict(pool_figures)
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
        verdict = _judge(scenario, record_from_scenario(scenario, "sim:0", "sim", pool_figures=pool_figures), base)
        if verdict.state == CRITICAL:
            first_step, first_reasons = step_index, verdict.reason_codes
    return GuardedRun(scenario.result(), startup, first_step, first_reasons, at_budget)
