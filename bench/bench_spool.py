"""The sidecar over a spool at the spool's own limits, scraped by 8 clients at once: peak RSS and
the slowest scrape, against the same scrapers over a 1-rank spool in the same run.

Two spools at the limits, each of MAX_SPOOL_FILES valid snapshots (one rank each): "4096 small"
with one device process per snapshot (about 5 MB, the spool of issue 13), and "4096 full" with
each padded with device processes so that together they come just under MAX_SPOOL_READ_BYTES,
the most one spool read takes in. Half the scrapers ask as Prometheus does (OpenMetrics, gzip), half as curl does (text,
no gzip), so every refresh is rendered in both formats. Each scraper scrapes back to back for
``--seconds`` (several refreshes at --interval). Goals (issue 13): peak RSS <= 200 MiB, every
scrape <= 5 s.

    python bench/bench_spool.py [--repeats 2] [--seconds 11]   (about 80 s)

``--junk`` measures instead what junk does to the spool read itself (issue 37, item 5): 4,096 files
``junk-<i>-cuda_0.json`` holding ``{}``, dated now + 9 s (inside the clock tolerance, so read first),
beside one live rank; three reads in a row by one SpoolReader, for this tree and for the last
commit's package (``git archive HEAD exporter``) in the same run: ranks found and milliseconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sidecar_bench import MIB, PeakSampler, Served, median, scrape, spread, write_spool  # noqa: E402

from kvguard.spool.io import MAX_SPOOL_FILES, MAX_SPOOL_READ_BYTES  # noqa: E402

SCRAPERS = 8
PROMETHEUS = {
    "Accept": "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;"
    "version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.2,*/*;q=0.1",
    "Accept-Encoding": "gzip",
}
CURL = {"Accept": "*/*"}
GOAL_RSS = 200 * MIB
GOAL_SCRAPE_SECONDS = 5.0


def processes_to_fill(files: int, budget: int) -> int:
    """Device processes per snapshot so that ``files`` snapshots come just under ``budget`` bytes."""
    probe = tempfile.mkdtemp(prefix="kvguard-bench-size-")
    try:
        one = write_spool(os.path.join(probe, "a"), 8, processes=1) / 8
        two = write_spool(os.path.join(probe, "b"), 8, processes=11) / 8
    finally:
        shutil.rmtree(probe)
    per_process = (two - one) / 10
    return max(1, int((budget * 0.97 / files - one) / per_process) + 1)


def run_one(spool: str, seconds: float, interval: float) -> dict:
    served = Served(spool, interval=interval)
    try:
        idle_rss = served.rss()
        served.reset_peak()
        latencies: list[float] = []
        failures = [0]
        sizes: dict[str, int] = {}
        deadline = time.monotonic() + seconds

        def scraper(headers: dict[str, str], kind: str) -> None:
            while time.monotonic() < deadline:
                try:
                    status, body, took = scrape(served.port, headers=headers, timeout=60)
                except OSError:
                    failures[0] += 1
                    continue
                if status != 200:
                    failures[0] += 1
                sizes[kind] = len(body)
                latencies.append(took)

        threads = [
            threading.Thread(target=scraper, args=(PROMETHEUS, "gzip") if i % 2 else (CURL, "text"))
            for i in range(SCRAPERS)
        ]
        with PeakSampler(served) as sampler:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        peak = max(filter(None, [served.peak_rss(), sampler.peak]))
        return {
            "idle_rss": idle_rss,
            "peak_rss": peak,
            "slowest": max(latencies),
            "median": median(latencies),
            "scrapes": len(latencies),
            "failures": failures[0],
            "sizes": sizes,
        }
    finally:
        served.stop()


JUNK_CHILD = r"""
import os, sys, tempfile, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
from kvguard.spool.io import SpoolReader, write_snapshot
from sidecar_fixtures import snapshot
spool = tempfile.mkdtemp()
write_snapshot(spool, snapshot())
soon = time.time() + 9
for index in range(4096):
    path = os.path.join(spool, f"junk-{index}-cuda_0.json")
    with open(path, "w") as handle:
        handle.write("{}")
    os.utime(path, (soon, soon))
reader = SpoolReader(spool)
for _ in range(3):
    start = time.perf_counter()
    read = reader.read()
    print(f"{len(read.snapshots)} {1000 * (time.perf_counter() - start):.0f}")
"""


def junk_reads() -> None:
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", root, "archive", "HEAD", "exporter"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        for target, exporter in (("head", os.path.join(tmp, "exporter")), ("new", os.path.join(root, "exporter"))):
            out = subprocess.run(
                [sys.executable, "-c", JUNK_CHILD, exporter, os.path.join(root, "tests", "support")],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.split("\n")
            reads = [line.split() for line in out if line]
            print(
                f"{target:5} 4,096 junk files + 1 live rank, 3 reads: "
                + "; ".join(f"{ranks} rank(s) in {ms} ms" for ranks, ms in reads)
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=11.0, help="seconds the 8 scrapers run per server")
    parser.add_argument("--interval", type=float, default=5.0, help="the sidecar's --interval")
    parser.add_argument("--junk", action="store_true", help="time the spool read under junk instead (issue 37)")
    args = parser.parse_args()
    if args.junk:
        junk_reads()
        return
    root = tempfile.mkdtemp(prefix="kvguard-bench-spool-")
    try:
        processes = processes_to_fill(MAX_SPOOL_FILES, MAX_SPOOL_READ_BYTES)
        spools = {
            "1 rank": (1, processes),
            "4096 small": (MAX_SPOOL_FILES, 1),
            "4096 full": (MAX_SPOOL_FILES, processes),
        }
        paths, sizes = {}, {}
        for name, (ranks, per_snapshot) in spools.items():
            paths[name] = os.path.join(root, name.replace(" ", "-"))
            sizes[name] = write_spool(paths[name], ranks, processes=per_snapshot)
        results: dict[str, list[dict]] = {name: [] for name in spools}
        for _ in range(args.repeats):  # interleaved: every spool once per round
            for name in spools:
                results[name].append(run_one(paths[name], args.seconds, args.interval))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"{SCRAPERS} parallel scrapers for {args.seconds:g} s, --interval {args.interval:g}; "
        f"{args.repeats} run(s), median (min-max); read budget {MAX_SPOOL_FILES} files, "
        f"{MAX_SPOOL_READ_BYTES / MIB:.0f} MiB; full: {processes} device processes per snapshot"
    )
    print(
        f"{'spool':<11} {'MiB':>5} {'idle RSS':>9} {'peak RSS MiB':>20} {'slowest scrape s':>20} "
        f"{'median scrape s':>20} {'scrapes':>8} {'failed':>6} {'body text/gzip MB':>18}"
    )
    for name, runs in results.items():
        body = runs[0]["sizes"]
        print(
            f"{name:<11} {sizes[name] / MIB:>5.1f} {median([r['idle_rss'] / MIB for r in runs]):>9.1f} "
            f"{spread([r['peak_rss'] / MIB for r in runs], '{:.1f}'):>20} "
            f"{spread([r['slowest'] for r in runs], '{:.3f}'):>20} {spread([r['median'] for r in runs], '{:.3f}'):>20} "
            f"{median([r['scrapes'] for r in runs]):>8.0f} {sum(r['failures'] for r in runs):>6} "
            f"{body.get('text', 0) / 1e6:>9.2f}/{body.get('gzip', 0) / 1e6:.2f}"
        )
    ok = True
    one_runs = results["1 rank"]
    for name in ("4096 small", "4096 full"):
        runs = results[name]
        print(
            f"{name} / 1 rank: peak RSS "
            f"{spread([f['peak_rss'] / o['peak_rss'] for f, o in zip(runs, one_runs)])}x, slowest scrape "
            f"{spread([f['slowest'] / o['slowest'] for f, o in zip(runs, one_runs)], '{:.0f}')}x"
        )
        ok &= all(r["peak_rss"] <= GOAL_RSS and r["slowest"] <= GOAL_SCRAPE_SECONDS and not r["failures"] for r in runs)
    print(
        f"goals: peak RSS <= {GOAL_RSS // MIB} MiB and every scrape <= {GOAL_SCRAPE_SECONDS:g} s at the limits: "
        + ("met" if ok else "MISSED")
    )


if __name__ == "__main__":
    main()
