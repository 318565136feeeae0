"""Simulated serving ranks: the simulator's vLLM scenario, one per rank, read like real devices.

Each rank runs its own :class:`kvguard.sim.scenario.ServingScenario` (seed + rank). Every
sample advances each rank by ``steps_per_sample`` scheduler steps and reads the
scenario's ``memory_stats()`` with the *same* key-reading code as the real sources
(:func:`kvguard.sources.torch.device_memory_from_stats` for the torch and torch_npu allocators,
:func:`kvguard.sources.mindspore.device_memory_from_stats` for MindSpore's pool), so
simulated and real counters take one path to the spool.

With ``traffic`` (a :class:`kvguard.sim.traffic.Traffic`), each rank serves an open request
stream instead (:class:`kvguard.sim.traffic.LiveServing`: Poisson arrivals, chunked prefill,
requests that finish, a forward pass in flight when the counters are read), so the counters
move from sample to sample; ``kvguard serve --demo`` uses it.

A scenario that finishes (all requests served, OOM, or no room for the cache) is shown
once in its final state, then restarted with a new seed (so a new arrival sequence), so a demo
runs forever. The source also tells the probe each rank's startup Profile and KV-cache
allocation (``rank_contexts()``), which the probe writes into that rank's snapshot.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import replace
from typing import Any, Callable, Mapping

from kvguard.budget.estimator import ConfigError
from kvguard.budget.model_config import bundled_model_config_path, load_model_config
from kvguard.records import DeviceMemory, KVCacheAllocation
from kvguard.sources import RankContext, SourceError, mindspore as mindspore_source, torch as torch_source
from kvguard.text import one_line

_DEVICE_PREFIX = {"torch": "cuda", "torch_npu": "npu", "mindspore": "npu"}
MAX_RANKS = 64


def record_from_scenario(scenario: Any, device: str, source: str, *, pool_figures: bool = False) -> DeviceMemory:
    """A scenario's allocator and device counters through the real sources' reader: MindSpore's
    for the ``mindspore`` allocator, torch's for ``torch`` and ``torch_npu``. ``pool_figures``: MindSpore's
    exact mode, the pool's own lists beside the counters, as its dump gives them
    (``kvguard.sources.mindspore_dump``; the model knows its buffers: ``DynamicMemPool.pool_figures``)."""
    free, total = scenario.device_memory()
    if scenario.config.allocator == "mindspore":
        figures = scenario.allocator.pool_figures() if pool_figures else None
        return mindspore_source.device_memory_from_stats(
            scenario.memory_stats(), device, source, free_bytes=free, total_bytes=total, figures=figures
        )
    return torch_source.device_memory_from_stats(
        scenario.memory_stats(), device, source, free_bytes=free, total_bytes=total
    )


def sim_identity(prefix: str, rank: int) -> tuple[str, str]:
    """A simulated device's (device_uuid, pci_bus_id): the same for a rank in every run and restart,
    written as the real sources write them (NVML ``GPU-<uuid>``, ``%08X:%02X:%02X.0``; npu-smi's
    ``Bus-Id``), from a name-based UUID that no real device has."""
    if prefix == "cuda":
        return f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'kvguard-sim:cuda:{rank}')}", f"00000000:{0x18 + rank:02X}:00.0"
    return f"npu-phy-{rank}", f"0000:{0x80 + rank:02X}:00.0"


def renumbered(record: DeviceMemory, prefix: str, index: int) -> DeviceMemory:
    """``record`` as device ``prefix:index`` of one node, with that device's simulated identity (for
    callers that number several sim sources' ranks as one node's devices, like the demo)."""
    device_uuid, pci_bus_id = sim_identity(prefix, index)
    return replace(record, device=f"{prefix}:{index}", device_uuid=device_uuid, pci_bus_id=pci_bus_id)


def _live_serving(traffic: Any) -> Any:
    """A scenario factory serving ``traffic`` (a ``Traffic``) as an open request stream."""
    from kvguard.sim.traffic import LiveServing  # noqa: PLC0415

    return lambda config: LiveServing(config, traffic)


class SimSource:
    """``ranks`` simulated serving ranks. ``scenario`` options go to ``ScenarioConfig``
    (``allocator``, ``budget``, ``device_memory_bytes``, ``gpu_memory_utilization``, ``requests``, …);
    ``traffic`` serves an open request stream instead of ``requests`` queued at once (module docstring).
    ``on_scenario`` is called with each new scenario before its first step (the demo watches its budget)."""

    name = "sim"

    def __init__(
        self,
        ranks: int = 1,
        steps_per_sample: int = 1,
        seed: int = 0,
        model_config: Mapping[str, Any] | str | None = None,
        traffic: Any = None,
        on_scenario: Callable[[Any], None] | None = None,
        **scenario: Any,
    ):
        for what, value, low, high in (
            ("ranks", ranks, 1, MAX_RANKS),
            ("steps per sample", steps_per_sample, 1, 10**6),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise SourceError(f"sim {what} must be an integer from {low} to {high}, got {value!r}")
        # Imported here: the simulator is only loaded when a sim source is built.
        from kvguard.sim.scenario import ScenarioConfig, ServingScenario  # noqa: PLC0415

        self._scenario_class = ServingScenario if traffic is None else _live_serving(traffic)
        if model_config is None:
            model_config = load_model_config(bundled_model_config_path())
        elif isinstance(model_config, str):
            try:
                model_config = load_model_config(model_config)
            except ConfigError as exc:
                raise SourceError(f"sim model config {model_config}: {one_line(exc)}") from None
        scenario.setdefault("device_memory_bytes", 32 << 30)
        try:
            self._base = ScenarioConfig(model_config=model_config, seed=seed, **scenario)
        except (TypeError, ValueError) as exc:
            raise SourceError(f"sim scenario: {one_line(exc)}") from None
        self._ranks = ranks
        self._on_scenario = on_scenario
        self._steps = steps_per_sample
        self._prefix = _DEVICE_PREFIX[self._base.allocator]
        self._lock = threading.Lock()
        self._generation = [0] * ranks
        self._scenarios = [self._new(rank) for rank in range(ranks)]
        self._shown_final = [False] * ranks
        self.restarts = 0

    def _new(self, rank: int) -> Any:
        from dataclasses import replace  # noqa: PLC0415

        # Seeds never repeat across ranks and restarts: rank r, generation g -> seed + r + ranks * g.
        seed = self._base.seed + rank + self._ranks * self._generation[rank]
        scenario = self._scenario_class(replace(self._base, seed=seed))
        if self._on_scenario is not None:
            self._on_scenario(scenario)
        return scenario

    def device(self, rank: int) -> str:
        return f"{self._prefix}:{rank}"

    def sample(self) -> list[DeviceMemory]:
        with self._lock:
            try:
                return [self._advance(rank) for rank in range(self._ranks)]
            except SourceError:
                raise
            except Exception as exc:  # noqa: BLE001 - a simulator bug is a failed read, not a crash
                raise SourceError(f"sim: {one_line(exc)}") from None

    def _advance(self, rank: int) -> DeviceMemory:
        scenario = self._scenarios[rank]
        if scenario.finished and self._shown_final[rank]:
            self._generation[rank] += 1
            self.restarts += 1
            scenario = self._scenarios[rank] = self._new(rank)
            self._shown_final[rank] = False
        for _ in range(self._steps):  # the first step() runs startup()
            if scenario.finished:
                break
            scenario.step()
        if scenario.finished:
            self._shown_final[rank] = True
        return renumbered(record_from_scenario(scenario, self.device(rank), self.name), self._prefix, rank)

    def rank_contexts(self) -> dict[str, RankContext]:
        with self._lock:
            contexts = {}
            for rank, scenario in enumerate(self._scenarios):
                kv_cache = None
                if scenario.num_blocks:
                    kv_cache = KVCacheAllocation(
                        num_blocks=scenario.num_blocks,
                        block_bytes=scenario.kv_layout.block_bytes,
                        block_size=scenario.kv_layout.block_size,
                    )
                contexts[self.device(rank)] = RankContext(rank=rank, profile=scenario.profile, kv_cache=kv_cache)
            return contexts
