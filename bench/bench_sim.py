"""Allocator-simulator speed, on demand: ``python3 bench/bench_sim.py``.

Prints alloc/free events per second on one core for each allocator model (the Python model, and
its C engine where it is built, ``kvguard.allocators.native``), as a ratio
against two baselines measured in the same run (a plain dict insert/delete loop and a
naive first-fit allocator that scans a Python list), the speed of exact snapshot replay
(``kvguard simulate --trace SNAPSHOT.pickle``: seed, replay, end-state check) on a
snapshot recorded from the torch model on the same events, and on each real snapshot in
``$KVGUARD_TORCH_SNAPSHOTS`` when set, and the wall time of the default ``kvguard
simulate`` scenario (Qwen2.5-7B-Instruct, 32 GiB, utilization 0.9) with either engine.

Events a second are timed in this process's CPU time (``time.process_time``): the code is
single-threaded, so that is one core's time, and other load on a shared machine (which
only delays the process) does not count. Each figure is the best of its repeats; the
spread column is how much slower the slowest repeat was.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "exporter"))

from kvguard.allocators.device import Device  # noqa: E402
from kvguard.allocators.mindspore_pool import DynamicMemPool  # noqa: E402
from kvguard.allocators.snapshot import replay_snapshot  # noqa: E402
from kvguard.allocators.torch_alloc import CachingAllocator  # noqa: E402
from kvguard.allocators.traces import load_snapshot_pickle  # noqa: E402
from kvguard.sim.scenario import ScenarioConfig, ServingScenario  # noqa: E402

GIB = 1 << 30
EVENTS = 400_000
LIVE = 256


def trace(seed: int = 0, events: int = EVENTS) -> list[tuple[int, int]]:
    """(slot, size) pairs: size > 0 allocates into slot, 0 frees it. Activation-like sizes."""
    rng = random.Random(seed)
    sizes = [
        rng.choice((4096, 65536, 512 * 1024, 3 << 20, 14 << 20, 58 << 20, 300 << 20)) + rng.randrange(0, 4096)
        for _ in range(4096)
    ]
    live: list[int] = []
    out: list[tuple[int, int]] = []
    slot = 0
    while len(out) < events:
        if live and (len(live) >= LIVE or rng.random() < 0.5):
            out.append((live.pop(rng.randrange(len(live))), 0))
        else:
            out.append((slot, sizes[slot % len(sizes)]))
            live.append(slot)
            slot += 1
    return out


def run_allocator(allocator, events) -> float:
    addrs: dict[int, int] = {}
    malloc, free = allocator.malloc, allocator.free
    start = time.process_time()
    for slot, size in events:
        if size:
            addrs[slot] = malloc(size)
        else:
            free(addrs.pop(slot))
    return time.process_time() - start


def run_dict(events) -> float:
    table: dict[int, int] = {}
    start = time.process_time()
    for slot, size in events:
        if size:
            table[slot] = size
        else:
            del table[slot]
    return time.process_time() - start


class ListScanAllocator:
    """The naive baseline: first fit by scanning a list of free (addr, size) holes."""

    def __init__(self, capacity: int) -> None:
        self.holes = [(0, capacity)]
        self.used: dict[int, int] = {}

    def malloc(self, size: int) -> int:
        size = -(-size // 512) * 512
        for i, (addr, hole) in enumerate(self.holes):
            if hole >= size:
                if hole == size:
                    del self.holes[i]
                else:
                    self.holes[i] = (addr + size, hole - size)
                self.used[addr] = size
                return addr
        raise MemoryError(size)

    def free(self, addr: int) -> None:
        size = self.used.pop(addr)
        self.holes.append((addr, size))
        if len(self.holes) > 64:  # coalesce now and then, as a simple allocator would
            self.holes.sort()
            merged = [self.holes[0]]
            for a, s in self.holes[1:]:
                last_a, last_s = merged[-1]
                if last_a + last_s == a:
                    merged[-1] = (last_a, last_s + s)
                else:
                    merged.append((a, s))
            self.holes = merged


def recorded_snapshot(events: list[tuple[int, int]]) -> dict:
    """A ``_dump_snapshot``-shaped dict of the torch model running ``events`` from empty."""
    model = CachingAllocator(Device(1 << 40))
    entries = []
    addrs: dict[int, int] = {}
    for slot, size in events:
        if size:
            before = len(model._segments)
            addr = model.malloc(size)
            if len(model._segments) > before:
                seg = model._segments[-1]
                entries.append({"action": "segment_alloc", "addr": seg.base, "size": seg.size, "stream": 0})
            addrs[slot] = addr
            entries.append({"action": "alloc", "addr": addr, "size": size, "stream": 0})
        else:
            addr = addrs.pop(slot)
            requested = model.block_at(addr).requested
            model.free(addr)
            entries.append({"action": "free_completed", "addr": addr, "size": requested, "stream": 0})
    segments = [
        {
            "device": 0,
            "address": s["address"],
            "total_size": s["total_size"],
            "stream": 0,
            "segment_type": "small" if s["small"] else "large",
            "is_expandable": False,
            "blocks": [
                {
                    "address": b["address"],
                    "size": b["size"],
                    "requested_size": 0,
                    "state": "active_allocated" if b["allocated"] else "inactive",
                }
                for b in s["blocks"]
            ],
        }
        for s in model.snapshot_segments()
    ]
    return {"segments": segments, "device_traces": [entries], "allocator_settings": {}}


def time_replay(snapshot: dict) -> tuple[float, int, int, int]:
    start = time.process_time()
    devices = replay_snapshot(snapshot, address_space_bytes=80 * GIB)
    seconds = time.process_time() - start
    return (
        seconds,
        sum(d.events for d in devices),
        sum(d.allocs for d in devices),
        sum(d.allocs_matched for d in devices),
    )


# The configurations timed, each on the Python model and on its C engine: (name, model family, arguments).
CONFIGS = (
    ("torch caching allocator", "torch", {}),
    ("torch_npu caching allocator", "torch", {"variant": "torch_npu"}),
    ("torch, expandable_segments", "torch", {"expandable_segments": True}),
    ("mindspore pool", "mindspore", {}),
)


def models() -> tuple[dict[str, Any], list[str]]:
    """Makers of each configuration's Python model and, where built (kvguard.allocators.native), its C
    engine ("..., C"); and the names of the C rows that cannot run."""
    from kvguard.allocators import native as engines_module

    python = {"torch": CachingAllocator, "mindspore": DynamicMemPool}
    native = {}
    for family, attribute in (("torch", "NativeCachingAllocator"), ("mindspore", "NativeDynamicMemPool")):
        wrapper = engines_module._native(family)  # None where the engine's module does not import
        native[family] = (wrapper, getattr(wrapper, attribute, None))
    makers: dict[str, Any] = {}
    engines: dict[str, Any] = {}
    missing = []
    for name, family, kwargs in CONFIGS:
        makers[name] = lambda cls=python[family], kw=kwargs: cls(Device(1 << 40), **kw)
        wrapper, cls = native[family]
        if wrapper is not None and wrapper.unsupported(device=Device(1 << 40), **kwargs) is None:
            engines[f"{name}, C"] = lambda cls=cls, kw=kwargs: cls(Device(1 << 40), **kw)
        else:
            missing.append(f"{name}, C")
    return {**makers, **engines}, missing


def spread(times: list[float]) -> str:
    """How much slower the slowest repeat was than the best, in percent."""
    return f"{100 * (max(times) / min(times) - 1):5.0f}%"


def main() -> None:
    events = trace()
    n = len(events)
    dict_times = [run_dict(events) for _ in range(3)]
    scan_times = [run_allocator(ListScanAllocator(1 << 40), events) for _ in range(3)]
    dict_s, scan_s = min(dict_times), min(scan_times)
    rows = [("dict insert/delete (baseline)", dict_times), ("list-scan first fit (baseline)", scan_times)]
    makers, missing = models()
    for name, make in makers.items():
        rows.append((name, [run_allocator(make(), events) for _ in range(3)]))
    print(f"{n} alloc/free events, {LIVE} live at most, one core (CPU time), best of 3")
    print(f"{'model':34} {'events/s':>12} {'x dict':>8} {'x list-scan':>12} {'spread':>7}")
    for name, times in rows:
        seconds = min(times)
        print(f"{name:34} {n / seconds:12,.0f} {dict_s / seconds:8.3f} {scan_s / seconds:12.2f} {spread(times)}")
    for name in missing:
        print(f"{name:34} {'not built':>12}")

    recorded = recorded_snapshot(events)
    replay_times = [time_replay(recorded)[0] for _ in range(3)]
    replay_s = min(replay_times)
    replayed = sum(1 for e in recorded["device_traces"][0])
    print(
        f"{'snapshot replay (recorded above)':34} {replayed / replay_s:12,.0f} "
        f"{dict_s * replayed / n / replay_s:8.3f}"
        f" {scan_s * replayed / n / replay_s:12.2f} {spread(replay_times)}"
    )
    folder = os.environ.get("KVGUARD_TORCH_SNAPSHOTS")
    if folder:
        print()
        print(f"real snapshots in {folder} (whole replay: seed, every device, end-state check; CPU time, best of 3)")
        total_events = total_seconds = worst_seconds = 0.0
        total_allocs = total_matched = 0
        paths = sorted(path for part in folder.split(os.pathsep) if part for path in Path(part).rglob("*.pickle"))
        for path in paths:
            snapshot = load_snapshot_pickle(path.read_bytes())
            gc.collect()  # the loaded pickle's objects are collected here, not inside the first replay
            runs = [time_replay(snapshot) for _ in range(3)]
            seconds, count, allocs, matched = min(runs)
            total_events += count
            total_seconds += seconds
            worst_seconds += max(runs)[0]
            total_allocs += allocs
            total_matched += matched
            rate = f"{count / seconds:10,.0f}" if seconds else f"{'-':>10}"
            print(f"  {path.name[:60]:60} {matched:6}/{allocs:<6} {rate} events/s")
        print(
            f"  all: {total_matched}/{total_allocs} allocations matched, "
            f"{total_events / total_seconds:,.0f} events/s "
            f"(x dict {dict_s * total_events / n / total_seconds:.3f}, "
            f"x list-scan {scan_s * total_events / n / total_seconds:.2f}; "
            f"spread {spread([total_seconds, worst_seconds]).strip()})"
        )

    config = json.loads((ROOT / "exporter/kvguard/examples/qwen2.5-7b-instruct/config.json").read_text())
    print()
    print("default scenario: Qwen2.5-7B-Instruct, 32 GiB, utilization 0.9, 64 requests, seed 0")
    for engine in ("python", "auto"):
        os.environ["KVGUARD_ALLOCATOR_ENGINE"] = engine
        for allocator in ("torch", "torch_npu", "mindspore"):
            for budget in ("stock", "reserved"):
                scenario = ServingScenario(
                    ScenarioConfig(
                        model_config=config, device_memory_bytes=32 * GIB, allocator=allocator, budget=budget
                    )
                )
                start = time.perf_counter()
                result = scenario.run()
                seconds = time.perf_counter() - start
                print(
                    f"  {allocator:9} {budget:8} {result.engine:6} {seconds:6.2f} s  steps={result.steps:4}  "
                    f"oom={result.oom}"
                )
    os.environ.pop("KVGUARD_ALLOCATOR_ENGINE")


if __name__ == "__main__":
    main()
