"""``kvguard serve --demo``: simulated serving ranks through the real path, probe → spool → collector.

The ranks are the simulator's vLLM startup (weights, profile run, vLLM's stock KV-cache budget,
the KV cache) followed by an open request stream (``kvguard.sim.traffic``: Poisson arrivals,
log-normal prompts prefilled in chunks, geometric outputs, requests that finish and free their
blocks), written to a spool by the real in-process probe and read back by the real sidecar. A
machine with no accelerator shows what the sidecar shows in production: allocated against
reserved memory and their gap moving from sample to sample, and a guard that trips.

Every rank serves Qwen2.5-7B on a 32 GiB torch_npu device with vLLM's stock budget, advancing
``STEPS_PER_SAMPLE`` scheduler steps per probe sample (one sample a second):

- every rank but the last at ``--gpu-memory-utilization 0.90`` with ``max_split_size_mb:256``:
  overcommitted (warning), its projected peak fits, and it serves on, its reserved memory rising and
  falling with the load;
- the last rank at 0.95, busier, and keeping ``LEAK`` bytes of device memory for every request it
  finishes: its reserved memory climbs past what the startup profile projected (warning, then
  critical once the projected peak exceeds the device), the allocator runs out of memory, the rank
  restarts with a new seed (a different arrival sequence) and is called again. A life lasts
  200-420 steps (50-105 s); critical comes after 10-170 steps (3-45 s), 7 s into the first life
  (fifteen lives measured with the guard fed as the sidecar feeds it, tests/test_demo.py's Judged).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from kvguard.records import DeviceMemory
from kvguard.sources import RankContext
from kvguard.sim.source import renumbered

GIB = 1 << 30
MIB = 1 << 20
STEPS_PER_SAMPLE = 4
LEAK = 4 * MIB
RANK = {"allocator": "torch_npu", "device_memory_bytes": 32 * GIB, "budget": "stock"}
# max_split_size_mb:256 (PYTORCH_NPU_ALLOC_CONF): on a miss the allocator hands its cached oversize
# blocks back to the device before it asks for more, so reserved follows the load instead of holding.
SERVING = {**RANK, "gpu_memory_utilization": 0.90, "max_split_size_bytes": 256 * MIB}
TRIPPING = {**RANK, "gpu_memory_utilization": 0.95}


def traffic(tripping: bool) -> Any:
    from kvguard.sim.traffic import Traffic  # noqa: PLC0415

    if tripping:
        return Traffic(arrival_rate=0.5, prompt_median_tokens=1024, leak_bytes_per_request=LEAK)
    return Traffic(arrival_rate=0.4, prompt_median_tokens=1024)


class DemoSource:
    """Simulated ranks from several sim sources, numbered as one node's devices ``npu:0..N-1``."""

    name = "sim"

    def __init__(self, ranks: int = 2, steps_per_sample: int = STEPS_PER_SAMPLE, seed: int = 0):
        from kvguard.sim.source import SimSource

        if ranks < 1:
            raise ValueError("the demo needs at least one rank")
        serving = ranks - 1 if ranks > 1 else 1
        parts = [SimSource(ranks=serving, steps_per_sample=steps_per_sample, seed=seed, traffic=traffic(False),
                           **SERVING)]
        if ranks > 1:
            parts.append(SimSource(ranks=1, steps_per_sample=steps_per_sample, seed=seed + 1000,
                                   traffic=traffic(True), **TRIPPING))
        # (sim source, the number of its first device) for each part.
        self._parts: list[tuple[Any, int]] = []
        offset = 0
        for part in parts:
            self._parts.append((part, offset))
            offset += part._ranks   # noqa: SLF001 - the sim source's rank count
        self._lock = threading.Lock()

    def sample(self) -> list[DeviceMemory]:
        with self._lock:
            records = []
            for part, offset in self._parts:
                for index, record in enumerate(part.sample()):
                    records.append(renumbered(record, "npu", offset + index))
            return records

    def serving(self, rank: int) -> Any:
        """What serves demo rank ``rank`` now (a ``LiveServing``; a new one after each restart)."""
        for part, offset in self._parts:
            if offset <= rank < offset + part._ranks:   # noqa: SLF001
                return part._scenarios[rank - offset]    # noqa: SLF001
        raise IndexError(f"no demo rank {rank}")

    def rank_contexts(self) -> dict[str, RankContext]:
        with self._lock:
            contexts = {}
            for part, offset in self._parts:
                part_contexts = part.rank_contexts()
                for index in range(part._ranks):   # noqa: SLF001
                    context = part_contexts.get(part.device(index))
                    if context is not None:
                        contexts[f"npu:{offset + index}"] = dataclasses.replace(context, rank=offset + index)
            return contexts


def start_demo(spool_dir: str, ranks: int, interval: float = 1.0):
    """Start the probe over the demo ranks; returns the running Probe."""
    from kvguard.probe import Probe

    probe = Probe(spool_dir, source=DemoSource(ranks=ranks), interval=interval, sample_timeout=max(interval, 5.0),
                  environ={})
    probe.set_engine("Qwen/Qwen2.5-7B-Instruct", 0)   # the simulated model, named as vLLM names its engine
    return probe.start()
