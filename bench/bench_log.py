"""Startup-log parsing speed: regex bait against ordinary lines, each against a baseline run beside it.

The baseline is the cheapest pass any reader makes: splitting the text into lines and looking for
one substring in each. A parser that backtracks shows up as a bait/ordinary ratio far above 1.
Then the file reader (read_log_file, which read_startup_log, ``kvguard check --from-log`` and the
sidecar use) on each kind of input, in MB/s beside ``for line in file: pass`` over the same file;
``--before OLD_LOG_PY`` times another copy of kvguard/vllm/log.py beside it.

    python bench/bench_log.py [--mib 8] [--before /tmp/log.py] [--reader-only]
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
    unit = (
        "Model loading took 1" * 40
        + "Total non KV cache memory: 1GiB; " * 40
        + "KV cache size: 9," * 40
        + "Memory after warmup: " * 40
    )
    bait_line = (unit * (MAX_LINE_CHARS // len(unit) + 1))[: MAX_LINE_CHARS - 1]
    # Lines that begin templates and never finish them, short enough to be joined to the next two.
    begun = (
        "Free memory on device (" + "Actual usage is " + "Model loading took " + "To serve at least one "
        "request with the model's max seq len ("
    ) * 20
    join_line = begun[: MAX_JOIN_CHARS - 1]
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


def file_inputs(size: int) -> dict[str, bytes]:
    """The reader's inputs, each ``size`` bytes: what a log is made of, and what a hostile or broken file holds."""
    import random

    logs = os.path.join(HERE, "..", "tests", "data", "logs")
    with open(os.path.join(logs, "eras", "v0.27-debug.log"), "rb") as handle:
        memory_lines = handle.read()
    real = b""
    for folder, _, names in sorted(os.walk(logs)):
        for name in sorted(names):
            if name.endswith(".log"):
                with open(os.path.join(folder, name), "rb") as handle:
                    real += handle.read().rstrip(b"\n") + b"\n"
    rnd = random.Random(7)
    junk = b"abcdefghijklmnopqrstuvwxyz0123456789 :.[]"
    short = b"".join(bytes(rnd.choice(junk) for _ in range(rnd.randint(1, 10))) + b"\n" for _ in range(100_000))
    unit = (
        "Model loading took 1" * 40
        + "Total non KV cache memory: 1GiB; " * 40
        + "KV cache size: 9," * 40
        + "Memory after warmup: " * 40
    )
    bait = ((unit * (MAX_LINE_CHARS // len(unit) + 1))[: MAX_LINE_CHARS - 1] + "\n").encode()
    units = {
        "blank lines": b"\n",
        "short junk lines (1-10)": short,
        "real logs (tests/data/logs)": real,
        "memory lines (v0.27-debug)": memory_lines,
        "memory lines, each its time": _each_its_time(memory_lines, size),
        "memory lines, each its figures": _each_its_time(memory_lines, size, figures=True),
        "lines of MAX_LINE_CHARS-1": b"a" * (MAX_LINE_CHARS - 1) + b"\n",
        "lines over MAX_LINE_CHARS": b"a" * (MAX_LINE_CHARS + 100) + b"\n",
        "regex bait lines": bait,
        "binary junk": bytes(rnd.getrandbits(8) for _ in range(1 << 20)),
        "real logs, \\r only": real.replace(b"\n", b"\r"),
    }
    return {name: (unit * (size // len(unit) + 1))[:size] for name, unit in units.items()}


def _each_its_time(lines: bytes, size: int, figures: bool = False) -> bytes:
    """``lines`` repeated to ``size`` bytes, each line with a time and a pid of its own: a flood as a log writes
    one (no two lines alike), which no reading kept per line helps. With ``figures``, each memory figure (the
    digits of a number before GiB, GB, tokens, seconds or x) other digits too, as restarts and ranks write them."""
    import random
    import re

    stamp = re.compile(rb"[0-9]{2}:[0-9]{2}:[0-9]{2}")
    pid = re.compile(rb"pid=[0-9]+")
    figure = re.compile(rb"[0-9][0-9,.]*(?= ?(?:GiB|GB|tokens|seconds|x\b))")
    digit = re.compile(rb"[0-9]")
    rnd = random.Random(5)
    out, total, number = [], 0, 0
    units = lines.rstrip(b"\n").split(b"\n")
    while total < size:
        line = units[number % len(units)]
        line = stamp.sub(b"%02d:%02d:%02d" % (number // 3600 % 24, number // 60 % 60, number % 60), line, count=1)
        line = pid.sub(b"pid=%d" % (1000 + number % 50_000), line, count=1)
        if figures:
            line = figure.sub(lambda m: digit.sub(lambda _: b"%d" % rnd.randint(1, 9), m.group()), line)
        out.append(line)
        total += len(line) + 1
        number += 1
    return b"\n".join(out) + b"\n"


def file_throughput(size: int, before: str | None) -> None:
    """MB/s through read_startup_log's reader (read_log_file: the CLI's, the sidecar's), per kind of input, beside
    reading the same file line by line (the baseline), in CPU seconds, best of three. With ``before``, the same for
    another copy of kvguard/vllm/log.py (the reader before a change), loaded as a module of its own."""
    import importlib.util
    import tempfile

    from kvguard.vllm import source_index
    from kvguard.vllm.log import read_log_file

    readers = {"now": read_log_file}
    if before:
        spec = importlib.util.spec_from_file_location("kvguard.vllm.log_before", before)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        readers = {"before": module.read_log_file, **readers}
    source_index.known_wordings()  # the index loads once per process (not per log): not timed

    def cpu(function, path: str) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.process_time()
            function(path)
            best = min(best, time.process_time() - start)
        return best

    def lines(path: str) -> None:
        with open(path, "rb") as handle:
            for _ in handle:
                pass

    print(f"\nread_log_file, {size / (1 << 20):.0f} MiB each, CPU MB/s (x baseline time: for line in file: pass)")
    print(
        f"{'input':<30} " + " ".join(f"{name + ' MB/s':>12} {'x base':>7}" for name in readers) + f" {'base MB/s':>10}"
    )
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "input.log")
        for name, data in file_inputs(size).items():
            with open(path, "wb") as handle:
                handle.write(data)
            base = cpu(lines, path)
            row = [(len(data) / cpu(reader, path) / 1e6) for reader in readers.values()]
            print(
                f"{name:<30} "
                + " ".join(f"{mbs:>12.1f} {len(data) / mbs / 1e6 / base:>7.1f}" for mbs in row)
                + f" {len(data) / base / 1e6:>10.0f}",
                flush=True,
            )


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=8, help="size of each reader input (default 8 MiB)")
    parser.add_argument("--before", help="another copy of kvguard/vllm/log.py to time beside this one")
    parser.add_argument("--reader-only", action="store_true", help="only the file reader's MB/s")
    args = parser.parse_args()
    if not args.reader_only:
        main()
    file_throughput(args.mib << 20, args.before)
