"""``kvguard serve --demo``: simulated serving ranks through the real path, probe → spool → collector.

The ranks are the simulator's vLLM serving scenario (``kvguard.sources.sim``), written to a
spool by the real in-process probe and read back by the real sidecar, so a machine with no
accelerator shows what the sidecar shows in production: allocated against reserved memory,
a fragmentation gap that grows while requests come and go, and a guard that trips.

Every rank but the last serves Qwen2.5-7B on a 32 GiB torch_npu device at
``--gpu-memory-utilization 0.95`` with vLLM's stock budget: it runs, overcommitted (warning),
with a live gap. The last rank runs at 0.97: its projected peak exceeds the device, the
guard says critical at startup, and the first serving step runs out of memory.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from kvguard.records import DeviceMemory
from kvguard.sources import RankContext
from kvguard.sources.sim import renumbered

GIB = 1 << 30
SERVING = {"allocator": "torch_npu", "device_memory_bytes": 32 * GIB, "gpu_memory_utilization": 0.95,
           "budget": "stock", "requests": 256, "long_request_fraction": 0.5}
TRIPPING = {**SERVING, "gpu_memory_utilization": 0.97}


class DemoSource:
    """Simulated ranks from several sim sources, numbered as one node's devices ``npu:0..N-1``."""

    name = "sim"

    def __init__(self, ranks: int = 2, steps_per_sample: int = 2, seed: int = 0):
        from kvguard.sources.sim import SimSource

        if ranks < 1:
            raise ValueError("the demo needs at least one rank")
        serving = ranks - 1 if ranks > 1 else 1
        parts = [SimSource(ranks=serving, steps_per_sample=steps_per_sample, seed=seed, **SERVING)]
        if ranks > 1:
            parts.append(SimSource(ranks=1, steps_per_sample=steps_per_sample, seed=seed + 1000, **TRIPPING))
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

    return Probe(spool_dir, source=DemoSource(ranks=ranks), interval=interval, sample_timeout=max(interval, 5.0),
                 environ={}).start()
