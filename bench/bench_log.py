"""Startup-log parsing speed: regex bait against ordinary lines, each against a baseline run beside it.

The baseline is the cheapest pass any reader makes: splitting the text into lines and looking for
one substring in each. A parser that backtracks shows up as a bait/ordinary ratio far above 1.

    python bench/bench_log.py
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "exporter"))

from kvguard.vllm.log import MAX_JOIN_CHARS, MAX_LINE_CHARS, parse_log  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def best_of(function, text: str, runs: int = 5) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        function(text)
        best = min(best, time.perf_counter() - start)
    return best


def baseline(text: str) -> int:
    return sum("GiB" in line for line in text.splitlines())


def main() -> None:
    with open(os.path.join(HERE, "..", "tests", "data", "logs", "eras", "v0.27-debug.log")) as handle:
        ordinary_line = handle.read()
    unit = ("Model loading took 1" * 40 + "Total non KV cache memory: 1GiB; " * 40
            + "KV cache size: 9," * 40 + "Memory after warmup: " * 40)
    bait_line = (unit * (MAX_LINE_CHARS // len(unit) + 1))[:MAX_LINE_CHARS - 1]
    # Lines that begin templates and never finish them, short enough to be joined to the next two.
    begun = ("Free memory on device (" + "Actual usage is " + "Model loading took " + "To serve at least one "
             "request with the model's max seq len (") * 20
    join_line = begun[:MAX_JOIN_CHARS - 1]
    size = 2 << 20
    ordinary = (ordinary_line * (size // len(ordinary_line) + 1))[:size]
    bait = ((bait_line + "\n") * (size // len(bait_line) + 1))[:size]
    join_bait = ((join_line + "\n") * (size // len(join_line) + 1))[:size]
    print(f"{'input (2 MiB)':<16} {'parse s':>9} {'baseline s':>11} {'x baseline':>11}")
    for name, text in (("ordinary lines", ordinary), ("regex bait", bait), ("join bait", join_bait)):
        parsed, base = best_of(parse_log, text), best_of(baseline, text)
        print(f"{name:<16} {parsed:>9.3f} {base:>11.4f} {parsed / base:>11.1f}")
    print(f"bait / ordinary time ratio: {best_of(parse_log, bait) / best_of(parse_log, ordinary):.2f}")
    print(f"join bait / ordinary time ratio: {best_of(parse_log, join_bait) / best_of(parse_log, ordinary):.2f}")
    file_throughput(ordinary, bait)


def file_throughput(ordinary: str, bait: str) -> None:
    """MB/s through read_log_file (the one reader of the CLI, the sidecar and the tests), per kind of input,
    beside reading the same file line by line (the baseline)."""
    import tempfile

    from kvguard.vllm.log import read_log_file

    inputs = {
        "ordinary lines": ordinary.encode(),
        "regex bait": bait.encode(),
        "plain max-length lines": (("a" * (MAX_LINE_CHARS - 1) + "\n") * ((2 << 20) // MAX_LINE_CHARS)).encode(),
        "one 16 MB line": b"x" * (16 << 20),
        "100 kB lines": (b"GiB " * 25_000 + b"\n") * 160,
        "short plain lines": (b"y" * 79 + b"\n") * 26_000,
    }
    print(f"\n{'read_log_file':<24} {'MB/s':>8} {'baseline MB/s':>14}")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "input.log")
        for name, data in inputs.items():
            with open(path, "wb") as handle:
                handle.write(data)
            reader = best_of(lambda p: read_log_file(p), path, runs=3)
            baseline = best_of(lambda p: sum(1 for _ in open(p, "rb")), path, runs=3)
            print(f"{name:<24} {len(data) / reader / 1e6:>8.1f} {len(data) / baseline / 1e6:>14.1f}")


if __name__ == "__main__":
    main()
