"""Ground truth for a simulated MindSpore run, from MindSpore's own compiled pool.

The guard grids (bench/guard_grid.py, bench/guard_holdout.py) judge the guard by whether a run ran
out of memory, and where. For a MindSpore run that outcome is taken from the real pool:

1. the run is recorded as it goes (``kvguard.allocators.ops.Recorder``: every malloc, free and
   empty_cache, the jit_level O0 compile that clears task sink, the model's state after each op,
   and the op count at the end of each phase and serving step);
2. the recorded stream is replayed through the real ``DefaultAscendMemoryPool`` of that release
   (``tests/upstream/oracles/mindspore/``, built by ./dev.sh test) on a fake device with the free memory the
   run's pool started with, under the run's VMM setting;
3. the real pool's first out-of-memory op, mapped back to its phase and serving step, is the run's
   outcome. The guard itself still saw only the model's ``memory_stats()`` keys, as on a real rank.

Where the real pool and the model agree at every op (out of memory, reserved, allocated, address)
the stream is also the one the real pool would have been asked, so the outcome is exact. Where
they differ the run is ``diverged``: its outcome is the real pool's up to the first difference and
is reported, never silently taken from the model. Releases the oracle cannot load (2.4-2.6), graph
mode and runtime memory growing mid-run have no oracle: ``truth()`` returns None for them.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "mindspore_oracle_client", os.path.join(ROOT, "tests", "upstream", "oracles", "mindspore", "client.py")
)
oracle_client = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oracle_client)

COMPARED = ("oom", "reserved_bytes", "allocated_bytes", "address")


@dataclass
class Recording:
    """What a scenario asked of its pool: the recorder and the op count at each phase's end."""

    recorder: Any
    free_at_start: int
    marks: list[tuple[int, str, int]]  # (ops so far, phase, serving step or -1), in order

    def where(self, position: int) -> tuple[str, int]:
        """The phase (and serving step) that op ``position`` belonged to."""
        for count, phase, step in self.marks:
            if position < count:
                return phase, step
        return self.marks[-1][1:] if self.marks else ("weights", -1)


@dataclass(frozen=True)
class Truth:
    kind: str  # "serving_oom", "startup_oom", "no_oom", "not_started"; "diverged": the model
    # ran out where the real pool served, so the rest of the run is unknown
    oom_at_step: int | None  # serving step of the real OOM
    exact: bool  # the model agreed with the real pool at every op
    first_difference: str | None
    ops: int


def record(scenario) -> Recording:
    """Install before ``startup()`` (and before any other wrapper, e.g. sim_guard's BudgetWatch)."""
    recorder = _truth_recorder(scenario.allocator)
    recording = Recording(recorder, scenario.device.free_bytes, [])
    scenario.allocator = recorder
    original = scenario._record

    def _record(phase: str, step: int = -1, **extra: int):
        recording.marks.append((len(recorder.ops), phase, step))
        return original(phase, step, **extra)

    scenario._record = _record
    return recording


def oracle_for(config) -> str | None:
    """The release whose built oracle replays the run, or None where there is none (see the module doc)."""
    if (
        config.allocator != "mindspore"
        or config.mindspore_mode != "pynative"
        or config.profile_non_allocator_growth_bytes
        or config.mempool_block_size_bytes
    ):
        return None
    version = config.mindspore_release.version
    return version if oracle_client.oracle_build.oracle_path(version) else None


def replay(oracle: str, recording: Recording, enable_vmm: bool) -> list[dict]:
    """The real pool's record after each op of the recorded stream (``oracle``: the release)."""
    return oracle_client.replay(
        oracle,
        recording.recorder.ops,
        free=recording.free_at_start,
        vmm=enable_vmm,
        task_sink=True,
        compiled_at=recording.recorder.compiled_at,
        compact=True,
    )[1]


def truth(recording: Recording, result, enable_vmm: bool, oracle: str) -> Truth:
    """The run's outcome on the real pool, checked against the model's state after each op."""
    real = replay(oracle, recording, enable_vmm)
    model_states = recording.recorder.states
    difference = None
    for position, (r, m) in enumerate(zip(real, model_states)):
        for key in COMPARED:
            if r.get(key) != m[key]:
                difference = f"op {position}: {key} real {r.get(key)} model {m[key]}"
                break
        if difference:
            break
    ops = len(real)
    first_oom = next((position for position, r in enumerate(real) if r["oom"]), None)
    if first_oom is None:
        if result.oom:  # the model ran out where the real pool served: what followed is unknown
            return Truth("diverged", None, False, difference or "the model ran out, the real pool did not", ops)
        kind = "not_started" if result.profile is None or result.error else "no_oom"
        return Truth(kind, None, difference is None, difference, ops)
    phase, step = recording.where(first_oom)
    if phase in ("weights", "profile"):
        kind, step = "not_started", None
    elif phase == "kv_cache":
        kind, step = "startup_oom", None
    else:
        kind = "serving_oom"
    return Truth(kind, step, difference is None, difference, ops)


def _truth_recorder(pool):
    """A Recorder that also keeps the model's COMPARED fields after each op (``.states``). Its methods
    are the class's, so a wrapper that patches and later unpatches the instance (BudgetWatch) keeps them."""
    from kvguard.allocators.base import AllocatorOutOfMemory
    from kvguard.allocators.ops import Recorder

    class TruthRecorder(Recorder):
        def __init__(self, allocator: Any) -> None:
            super().__init__(allocator)
            self.states: list[dict] = []

        def _note(self, oom: bool, address: int | None) -> None:
            pool = self.allocator
            self.states.append(
                {
                    "oom": oom,
                    "reserved_bytes": pool.reserved_bytes,
                    "allocated_bytes": pool.allocated_bytes,
                    "address": address,
                }
            )

        def malloc(self, size: int, persistent: bool = False) -> int:
            try:
                address = super().malloc(size, persistent)
            except AllocatorOutOfMemory:
                self._note(True, None)
                raise
            self._note(False, address)
            return address

        def free(self, addr: int) -> None:
            super().free(addr)
            self._note(False, None)

        def empty_cache(self) -> None:
            super().empty_cache()
            self._note(False, None)

    return TruthRecorder(pool)


def run_with_truth(scenario, run) -> tuple[Any, Truth | None]:
    """``run(scenario)`` (e.g. sim_guard.run_guarded) recorded, and its outcome on the real pool."""
    oracle = oracle_for(scenario.config)
    if oracle is None:
        return run(scenario), None
    recording = record(scenario)
    outcome = run(scenario)
    result = outcome.result if hasattr(outcome, "result") else outcome
    return outcome, truth(recording, result, scenario.config.enable_vmm, oracle)
