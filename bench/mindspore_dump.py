"""Exact mode on MindSpore: what the dump costs per step, and what the guard's credit is worth against the
truth of MindSpore's compiled pool (tests/upstream/oracles/mindspore, built by ./dev.sh test).

    .venv/bin/python bench/mindspore_dump.py [--release 2.7.1] [--every 100] [--repeat 5]

Cost. For a serving-shaped pool state (24 x 64 MiB weights, 8 x 512 MiB KV tensors, 3,000 live
activations of up to 4 MiB between 3,000 freed ones: ~6,000 buffers), VMM on and off:
- the pool's own ``DumpDynamicMemPoolDebugInfo`` (the oracle times the call itself: ``call_ns``), which
  ``DataPrepareActor`` runs on the engine's actor thread every N graph runs, under the pool's lock;
- the probe's read (``read_dump_file``: read, bound-check, parse), which runs when a new file appears;
and per step at N graph runs per dump: (dump + read) / N. The ratio printed is against the cost of
replaying the same stream's pool operations (allocations and frees) on the same pool in the same run.

Worth. For each state, the largest single request the real pool serves (bisection on the compiled
pool), beside what each credit admits: none (counters alone, the sound bound), reserved − allocated (the
old VMM credit), and the exact figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "support"), str(ROOT / "tests" / "upstream")]
_spec = importlib.util.spec_from_file_location(
    "dump_oracle_tests", ROOT / "tests" / "upstream" / "test_oracle_mindspore_dump.py"
)
dump_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dump_tests)

from kvguard.guard.judge import activation_growth_bytes  # noqa: E402
from kvguard.sources.mindspore_dump import read_dump_file  # noqa: E402

MIB = 1 << 20


def timed_run(version: str, ops: list[dict], vmm: bool, cwd: Path) -> tuple[float, dict, list]:
    start = time.perf_counter()
    init, out = dump_tests.run(version, ops, vmm=vmm, cwd=cwd)
    return time.perf_counter() - start, init, out


RESOLUTION = 512  # the pool's alignment: bisection to one aligned step


def largest_served(version: str, state: list[dict], vmm: bool, cwd: Path, high: int) -> int:
    """The largest request the real pool serves after ``state``: bisection over multiples of RESOLUTION (the
    pool's alignment, so the answer is exact); ``high`` must be refused."""
    low, high = 0, -(-high // RESOLUTION)
    while high - low > 1:
        mid = (low + high) // 2
        _, out = dump_tests.run(
            version, state + [{"op": "malloc", "size": mid * RESOLUTION, "persistent": False}], vmm=vmm, cwd=cwd
        )
        low, high = (mid, high) if not out[-1][0] else (low, mid)
    return low * RESOLUTION


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", default="2.7.1")
    parser.add_argument("--every", type=int, default=100, help="graph runs between dumps (defrag_memory_step_freq)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    version = args.release
    print(f"MindSpore {version} compiled pool (oracle), N = {args.every}, {args.repeat} repeats; medians")
    for vmm in (True, False):
        for shape in ("small", "subpage", "mixed"):
            state = dump_tests.serving_stream(11, shape)
            with tempfile.TemporaryDirectory() as folder:
                cwd = Path(folder)
                base, dumped, reads = [], [], []
                for _ in range(args.repeat):
                    base.append(timed_run(version, state, vmm, cwd)[0])
                    _, init, out = timed_run(version, state + [{"op": "dump"}], vmm, cwd)
                    dumped.append(out[-1]["call_ns"] / 1e9)
                    path = max(cwd.glob("MemoryDebugInfo*.txt"), key=lambda p: p.stat().st_mtime_ns)
                    start = time.perf_counter()
                    figures = read_dump_file(path, vmm=vmm)
                    reads.append(time.perf_counter() - start)
                    size = path.stat().st_size
                    for old in cwd.glob("MemoryDebugInfo*.txt"):
                        old.unlink()
                dump_s = statistics.median(dumped)
                read_s = statistics.median(reads)
                per_op = statistics.median(base) / len(state)
                record, budget = out[-1], init["total_mem_size"]
                counters, exact = dump_tests.guard_memory(record), dump_tests.guard_memory(record, figures)
                room = budget - record["reserved_bytes"]
                truth = largest_served(version, state, vmm, cwd, room + record["reserved_bytes"] + 64 * MIB)

                def admitted(memory) -> int:
                    size = 0
                    step = 1 << 40
                    while step >= RESOLUTION:
                        if record["reserved_bytes"] + activation_growth_bytes(memory, size + step) <= budget:
                            size += step
                        step //= 2
                    return size

                old_credit = room + record["reserved_bytes"] - record["allocated_bytes"]
                print(
                    f"  vmm={'on ' if vmm else 'off'} {shape:8s} buffers={len(state):5d} file={size / 1e6:.2f} MB "
                    f"dump={dump_s * 1e3:6.1f} ms read={read_s * 1e3:6.1f} ms "
                    f"per step at N={args.every}: {(dump_s + read_s) / args.every * 1e3:.3f} ms "
                    f"(= {(dump_s + read_s) / args.every / per_op:.0f} x one pool op of this stream, replayed "
                    f"with its process: {per_op * 1e6:.0f} us)"
                )
                print(
                    f"      largest request: real pool {truth / MIB:8.0f} MiB | guard: counters "
                    f"{admitted(counters) / MIB:8.0f} MiB, exact {admitted(exact) / MIB:8.0f} MiB | "
                    f"old R-A credit {old_credit / MIB:8.0f} MiB"
                    f"{'  (over the truth: unsound)' if old_credit > truth else ''}"
                )
                assert admitted(counters) <= truth and admitted(exact) <= truth, "a credit above the truth"
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
