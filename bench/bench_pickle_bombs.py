"""Pickle bombs against ``kvguard simulate --trace``, on demand: ``python3 bench/bench_pickle_bombs.py``.

Each case runs ``kvguard simulate --trace FILE --json`` in a child process of its own, under
an address-space limit (``resource.setrlimit(RLIMIT_AS)``, ``--limit-mib``) and a wall-clock
limit (``--timeout``), so a bomb that still works takes the child down, not the machine. For
each case it prints the child's wall time, its peak RSS (``ru_maxrss`` from ``wait4``) and
the first line of what it said, beside the same figures for a real snapshot read in the same
run (the baseline: the largest real snapshot found, as ``simulate --trace`` reads it, best
of ``--repeats``).

The bombs are issue 23's and issue 37's: ``bytearray(2 GiB)`` from the allow-listed constructor,
``frozenset(bytearray(512 MiB))``, a 9-byte file storing memo index 200,000,000 (CPython's
C unpickler resizes its memo to twice the index), 5,000,000 references to one trace entry
(10 MB; the reading is quick, the replay of five million entries is not), and three more of
the same kind: references that double at each level (a 300-byte DAG of 2**64 leaves),
8,000,000 empty lists (8 MB), and a string that claims 2 GiB; then integer keys that all hash
alike (``k x (2**61 - 1)``: dict and set inserts quadratic), 2,000,000 empty sets (2 MB) and
sets filled through memo references (32 MB); then the review's: 600 copies of one stored
1,000,000-byte string by ``_codecs.encode`` (995 kB, each copy 8 bytes of file), a dict key
t = (u, u), u = (v, v), ... 28 levels deep (hashing walks 2**28 paths), one tuple of
1,000,000 items as the key of 1,000 dicts, and two equal 1,000,000-byte strings as the keys
of 1,600,000 dicts (each insert compares them).

Then the speed of reading real snapshots: ``load_snapshot_pickle`` on every real snapshot
found (``$KVGUARD_TORCH_SNAPSHOTS``, by default ``../shared/torch-snapshots*`` beside the
checkout), in CPU seconds, best of ``--repeats``, against CPython's own C unpickler
(``pickle.loads``: fast, and unbounded) on the same files in the same child.

Last, issue 23's zzuf run: ``--mutations`` copies of the smallest real snapshot over 100 kB,
bits flipped as zzuf flips them, each read and parsed in a child of its own; it counts the
outcomes and the children over 2 s or 256 MiB.

``--exporter`` measures another checkout's package (a before/after comparison).
"""

from __future__ import annotations

import argparse
import glob
import os
import pickle
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
MIB = 1 << 20

CHILD_CLI = r"""
import contextlib, io, sys
sys.path.insert(0, sys.argv[1])
import click
from kvguard.cli import main
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out):
        main(["simulate", "--trace", sys.argv[2], "--json"], standalone_mode=False)
    print("replayed")
except click.ClickException as exc:
    print("refused: " + exc.format_message())
except SystemExit as exc:
    print(f"exit {exc.code}")
except BaseException as exc:
    print(f"CRASH {exc.__class__.__name__}: {str(exc)[:200]}")
"""

CHILD_LOAD = r"""
import pickle, sys, time
sys.path.insert(0, sys.argv[1])
from kvguard.allocators.traces import load_snapshot_pickle
repeats = int(sys.argv[2])
files = [open(p, "rb").read() for p in sys.argv[3:]]
def best(load, data):
    times = []
    for _ in range(repeats):
        t = time.process_time()
        load(data)
        times.append(time.process_time() - t)
    return min(times)
ours = [best(load_snapshot_pickle, data) for data in files]
cpython = [best(pickle.loads, data) for data in files]
slowest = max(range(len(files)), key=lambda i: ours[i])
print(f"{sum(ours):.4f} {sum(cpython):.4f} {ours[slowest]:.4f} {cpython[slowest]:.4f} {sum(map(len, files))}")
"""

CHILD_MUTATED = r"""
import sys
sys.path.insert(0, sys.argv[1])
from kvguard.allocators.traces import TraceError, load_snapshot_pickle, parse_torch_snapshot
try:
    parse_torch_snapshot(load_snapshot_pickle(open(sys.argv[2], "rb").read()))
    print("read")
except TraceError as exc:
    print("refused" if "\n" not in str(exc) else "refused in more than one line")
except BaseException as exc:
    print(f"CRASH {exc.__class__.__name__}")
"""


def zzuf(data: bytes, seed: int, ratio: float) -> bytes:
    """zzuf-like bit flipping: ``ratio`` of the bits (zzuf's default 0.004), chosen by ``seed``."""
    rng = random.Random(seed)
    out = bytearray(data)
    for bit in rng.sample(range(len(data) * 8), round(len(data) * 8 * ratio)):
        out[bit // 8] ^= 1 << bit % 8
    return bytes(out)


def bombs() -> dict[str, bytes]:
    """Each bomb, built here from its opcodes (or by the pickler itself where the pickler writes it)."""
    builtins_global = lambda name: b"\x8c\x08builtins\x8c" + bytes([len(name)]) + name.encode() + b"\x93"  # noqa: E731
    entry = {"action": "alloc", "addr": 1 << 40, "size": 512, "stream": 0}
    doubling: list = [entry]
    for _ in range(64):
        doubling = [doubling, doubling]
    return {
        "bytearray(2 GiB)": (b"\x80\x04" + builtins_global("bytearray") + b"\x8a\x05\x00\x00\x00\x80\x00" + b"\x85R."),
        "frozenset(bytearray(512 MiB))": (
            b"\x80\x04"
            + builtins_global("frozenset")
            + builtins_global("bytearray")
            + b"J\x00\x00\x00\x20"
            + b"\x85R\x85R."
        ),
        "memo index 200,000,000": b"\x80\x04N" + b"r" + (200_000_000).to_bytes(4, "little") + b".",
        "5,000,000 shared references": pickle.dumps({"device_traces": [[entry] * 5_000_000]}, protocol=4),
        "DAG of 2**64 references": pickle.dumps({"device_traces": [doubling]}, protocol=4),
        "8,000,000 empty lists": b"\x80\x04" + b"]" * 8_000_000 + b".",
        "string claiming 2 GiB": b"\x80\x04X\xff\xff\xff\x7f" + b"a" * 16 + b".",
        # issue 37: keys whose hashes collide (k x (2**61 - 1) all hash to 0), and memory that
        # objects cost beyond their count (empty sets; sets filled through memo references)
        "40,000 colliding dict keys": _in_snapshot(b"}(" + b"".join(k + b"K\x00" for k in _colliding(40_000)) + b"u"),
        "100,000 colliding dict keys": _in_snapshot(b"}(" + b"".join(k + b"K\x00" for k in _colliding(100_000)) + b"u"),
        "100,000 colliding set items": _in_snapshot(b"\x8f(" + b"".join(_colliding(100_000)) + b"\x90"),
        "2,000,000 empty sets": b"\x80\x04" + b"\x8f" * 2_000_000 + b".",
        "sets of memo references, 32 MB": _memo_sets(32_000_000),
        # the review: copies the memory budget counted as objects, keys that cost more than their count
        "600 _codecs.encode copies of 1 MB": _in_snapshot(
            _stored(_binunicode(b"a" * 1_000_000))
            + _stored(b"\x8c\x06latin1")
            + _stored(b"\x8c\x07_codecs\x8c\x06encode\x93")
            + b"]("
            + b"h\x02h\x00h\x01\x86R" * 600
            + b"e"
        ),
        "tuple key 28 levels deep": _in_snapshot(
            _stored(b"N")
            + b"".join(_stored(b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86") for i in range(28))
            + b"}h\x1cNs"
        ),
        "1,000,000-item tuple key x 1,000": _in_snapshot(
            _stored(b"N") + _stored(b"(" + b"h\x00" * 1_000_000 + b"t") + b"](" + b"}h\x01Ns" * 1_000 + b"e"
        ),
        "equal 1 MB string keys x 1,600,000": _in_snapshot(
            _stored(_binunicode(b"a" * 1_000_000))
            + _stored(_binunicode(b"a" * 1_000_000))
            + _stored(b"N")
            + b"]("
            + b"}h\x00h\x02sh\x01h\x02s" * 1_600_000
            + b"e"
        ),
    }


def _stored(opcodes: bytes) -> bytes:
    """``opcodes`` push one value, MEMOIZE keeps it, POP takes it off the stack."""
    return opcodes + b"\x94" + b"0"


def _binunicode(text: bytes) -> bytes:
    return b"X" + len(text).to_bytes(4, "little") + text


def _colliding(count: int) -> list[bytes]:
    """LONG1 opcodes of ``count`` distinct integers that all hash to 0."""
    out = []
    for k in range(1, count + 1):
        value = k * ((1 << 61) - 1)
        raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        out.append(b"\x8a" + bytes([len(raw)]) + raw)
    return out


def _in_snapshot(opcodes: bytes) -> bytes:
    """A snapshot dict whose "x" is what ``opcodes`` push."""
    return b"\x80\x04}(\x8c\x0ddevice_traces](e\x8c\x01x" + opcodes + b"u."


def _memo_sets(size: int) -> bytes:
    """256 integers stored in the memo once, then sets of all 256 by BINGET, to ``size`` bytes."""
    stored = b"".join(b"M" + i.to_bytes(2, "little") + b"\x94" for i in range(256))
    one_set = b"\x8f(" + b"".join(b"h" + bytes([i]) for i in range(256)) + b"\x90"
    return b"\x80\x04" + stored + one_set * ((size - len(stored)) // len(one_set) - 1) + b"N."


def real_snapshots() -> list[str]:
    folders = os.environ.get(
        "KVGUARD_TORCH_SNAPSHOTS", os.pathsep.join([str(SHARED / "torch-snapshots"), str(SHARED / "torch-snapshots-2")])
    )
    found: list[str] = []
    for folder in filter(None, folders.split(os.pathsep)):
        found += glob.glob(os.path.join(folder, "**", "*.pickle"), recursive=True)
    return sorted(found)


def run_child(argv: list[str], limit_bytes: int, timeout_s: float) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MiB, first line of output) of one child under the limits."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=limit)
    killed = False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() - start > timeout_s:
            proc.kill()
            killed = True
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.01)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    output = proc.stdout.read().decode(errors="replace").strip().splitlines()
    if killed:
        said = f"still running at {timeout_s:.0f} s (killed)"
    elif proc.returncode < 0:
        said = f"killed by signal {-proc.returncode}"
    else:
        said = output[-1] if output else f"exit {proc.returncode}, no output"
    return wall, usage.ru_maxrss / 1024, said


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-mib", type=int, default=4096, help="address-space limit of each child (MiB)")
    parser.add_argument("--timeout", type=float, default=60.0, help="wall-clock limit of each child (s)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each real snapshot's load")
    parser.add_argument("--only", help="run only the bombs whose name contains this")
    parser.add_argument("--mutations", type=int, default=200, help="zzuf-like mutations of a real snapshot (0: none)")
    parser.add_argument("--ratio", type=float, default=0.004, help="bits flipped per bit, as zzuf's -r")
    parser.add_argument("--skip-load", action="store_true", help="leave out the speed of reading real snapshots")
    parser.add_argument(
        "--exporter",
        default=str(ROOT / "exporter"),
        help="the kvguard package's parent folder to measure (another checkout's, for a before/after)",
    )
    args = parser.parse_args()
    limit = args.limit_mib * MIB
    exporter = args.exporter
    reals = real_snapshots()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases: list[tuple[str, str, int]] = []
        if reals:
            largest = max(reals, key=os.path.getsize)
            cases.append((f"real: {os.path.relpath(largest, SHARED)}", largest, os.path.getsize(largest)))
        for index, (name, data) in enumerate(bombs().items()):
            if args.only and args.only not in name:
                continue
            path = os.path.join(tmp, f"bomb{index}.pickle")
            Path(path).write_bytes(data)
            cases.append((name, path, len(data)))
        for number, (name, path, size) in enumerate(cases):
            # The real snapshot is the baseline: best of --repeats, as the machine may be busy.
            runs = [
                run_child([sys.executable, "-c", CHILD_CLI, exporter, path], limit, args.timeout)
                for _ in range(args.repeats if reals and number == 0 else 1)
            ]
            wall, rss, said = min(runs)
            rows.append((name, size, wall, rss, said))
            print(f"{name:34} {size:>11,} B {wall:8.2f} s {rss:9.1f} MiB  {said[:110]}", flush=True)

    if rows and reals:
        base_wall, base_rss = rows[0][2], rows[0][3]
        print(f"\nratios against the real snapshot ({base_wall:.2f} s, {base_rss:.1f} MiB):")
        for name, _, wall, rss, _ in rows[1:]:
            print(f"  {name:34} time {wall / base_wall:6.2f}x  peak RSS {rss / base_rss:6.2f}x")

    if reals and not args.skip_load:
        wall, rss, said = run_child(
            [sys.executable, "-c", CHILD_LOAD, exporter, str(args.repeats), *reals], limit, args.timeout * 20
        )
        try:
            ours, cpython, slowest, slowest_cpython, size = (float(x) for x in said.split())
        except ValueError:
            print(f"\nload_snapshot_pickle on the real snapshots: {said}")
        else:
            print(
                f"\nload_snapshot_pickle on {len(reals)} real snapshots ({size / MIB:.1f} MiB), CPU seconds, best of "
                f"{args.repeats}: {ours:.3f} s in all, {ours / cpython:.2f}x CPython's unbounded C unpickler "
                f"(pickle.loads, {cpython:.3f} s); slowest file {slowest * 1000:.0f} ms "
                f"({slowest / slowest_cpython:.2f}x); child peak RSS {rss:.1f} MiB"
            )

    if reals and args.mutations:
        # issue 23: zzuf found the bomb class in 8 of 800 mutated real snapshots.
        source = min((p for p in reals if os.path.getsize(p) >= 100_000), key=os.path.getsize, default=reals[0])
        data = Path(source).read_bytes()
        outcomes: dict[str, int] = {}
        slow = heavy = 0
        worst_wall = worst_rss = 0.0
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "mutated.pickle")
            for seed in range(args.mutations):
                Path(path).write_bytes(zzuf(data, seed, args.ratio))
                wall, rss, said = run_child([sys.executable, "-c", CHILD_MUTATED, exporter, path], limit, args.timeout)
                kind = said if not said.startswith("still running") else "still running (killed)"
                outcomes[kind] = outcomes.get(kind, 0) + 1
                slow += wall > 2.0
                heavy += rss > 256
                worst_wall, worst_rss = max(worst_wall, wall), max(worst_rss, rss)
        print(
            f"\n{args.mutations} zzuf-like mutations (ratio {args.ratio}) of {os.path.relpath(source, SHARED)}, "
            f"each read and parsed in a child: {outcomes}; over 2 s: {slow}, over 256 MiB: {heavy}; "
            f"slowest {worst_wall:.2f} s, largest {worst_rss:.1f} MiB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
