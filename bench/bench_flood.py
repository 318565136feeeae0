"""The sidecar under a header flood and a slowloris, with and without basic auth: peak RSS and the
latency of a normal scrape while the attack is on, each against the same process idle.

A real ``kvguard serve`` subprocess on loopback over a 2-rank spool. The attackers run in a process
of their own (so the scraper here does not share an interpreter lock with them):

- header flood: 40 connections, each sends a request line and 98 headers of 65 KB, then stalls
  until the server closes it, and reconnects at once;
- slowloris: 2,000 connections, each sends a partial request head and then one byte every half
  second, and reconnects whenever the server closes it.

Meanwhile a normal scrape of /metrics (with credentials under auth) runs every 0.25 s. Goals
(issue 13): peak RSS < 128 MiB, every normal scrape answered within 1 s.

    python bench/bench_flood.py [--repeats 2] [--seconds 4]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import selectors
import shutil
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sidecar_bench import MIB, PeakSampler, Served, median, raise_fd_limit, scrape, slowloris, spread, write_spool  # noqa: E402

FLOOD_CONNECTIONS, FLOOD_HEADERS, FLOOD_HEADER_BYTES = 40, 98, 65_000
SLOWLORIS_CONNECTIONS = 2_000
GOAL_RSS = 128 * MIB
GOAL_SCRAPE_SECONDS = 1.0


def _header_flood(port: int, stop, counter) -> None:
    """FLOOD_CONNECTIONS connections at once, each re-opened as soon as the server closes it."""
    line = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    header = b"X-Flood: " + b"a" * FLOOD_HEADER_BYTES + b"\r\n"
    selector = selectors.DefaultSelector()
    state: dict[socket.socket, list] = {}

    def open_one() -> None:
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        state[sock] = [line + header * FLOOD_HEADERS, 0]  # what is left to send, sent
        selector.register(sock, selectors.EVENT_WRITE | selectors.EVENT_READ)
        counter.value += 1

    for _ in range(FLOOD_CONNECTIONS):
        open_one()
    while not stop.is_set():
        for key, events in selector.select(timeout=0.1):
            sock = key.fileobj
            data, sent = state[sock]
            dead = False
            try:
                if events & selectors.EVENT_READ and not sock.recv(65536):
                    dead = True
                elif events & selectors.EVENT_WRITE and sent < len(data):
                    state[sock][1] += sock.send(data[sent : sent + 262144])
                    if state[sock][1] >= len(data):  # all sent: stall, only watch for the close
                        selector.modify(sock, selectors.EVENT_READ)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                dead = True
            if dead:
                selector.unregister(sock)
                del state[sock]
                sock.close()
                open_one()
    for sock in state:
        sock.close()


def _slowloris(port: int, stop, counter) -> None:
    """SLOWLORIS_CONNECTIONS partial heads, one more byte each every 0.5 s; closed ones re-opened."""

    def opened() -> None:
        counter.value += 1

    slowloris(port, SLOWLORIS_CONNECTIONS, stop, on_open=opened)


ATTACKS = {"header flood": _header_flood, "slowloris": _slowloris}


def run_one(spool: str, attack: str, auth: bool, seconds: float) -> dict:
    served = Served(spool, auth=auth)
    try:
        headers = served.headers()
        idle_latencies = []
        for _ in range(12):
            status, body, took = scrape(served.port, headers=headers)
            assert status == 200 and b"kvguard_guard_state" in body, status
            idle_latencies.append(took)
        time.sleep(0.3)
        idle_rss = served.rss()
        idle_threads = served.threads()
        served.reset_peak()
        stop = multiprocessing.Event()
        counter = multiprocessing.Value("l", 0)
        attacker = multiprocessing.Process(target=ATTACKS[attack], args=(served.port, stop, counter), daemon=True)
        flood_latencies, failures, threads = [], 0, idle_threads
        with PeakSampler(served) as sampler:
            attacker.start()
            time.sleep(0.5)  # let the attack open its connections
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                try:
                    status, body, took = scrape(served.port, headers=headers, timeout=10)
                    if status != 200 or b"kvguard_guard_state" not in body:
                        failures += 1
                    flood_latencies.append(took)
                except OSError:
                    failures += 1
                    flood_latencies.append(10.0)
                threads = max(threads, served.threads())
                time.sleep(0.25)
            stop.set()
            attacker.join(timeout=10)
            if attacker.is_alive():
                attacker.terminate()
        peak = max(filter(None, [served.peak_rss(), sampler.peak]))
        return {
            "idle_rss": idle_rss,
            "peak_rss": peak,
            "idle_threads": idle_threads,
            "threads": threads,
            "idle_scrape": median(idle_latencies),
            "flood_median": median(flood_latencies),
            "flood_max": max(flood_latencies),
            "failures": failures,
            "scrapes": len(flood_latencies),
            "connections": counter.value,
        }
    finally:
        served.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds each attack lasts")
    args = parser.parse_args()
    raise_fd_limit(SLOWLORIS_CONNECTIONS + 1024)
    spool = tempfile.mkdtemp(prefix="kvguard-bench-flood-")
    scenarios = [(attack, auth) for attack in ATTACKS for auth in (False, True)]
    results: dict[tuple, list[dict]] = {s: [] for s in scenarios}
    try:
        write_spool(spool, 2)
        for _ in range(args.repeats):
            for attack, auth in scenarios:  # interleaved: every scenario once per round
                results[(attack, auth)].append(run_one(spool, attack, auth, args.seconds))
    finally:
        shutil.rmtree(spool, ignore_errors=True)

    print(f"kvguard serve under attack, {args.repeats} run(s) of {args.seconds:g} s each; median (min-max) over runs")
    print(
        f"{'attack':<22} {'idle RSS':>9} {'peak RSS MiB':>18} {'x idle':>16} {'threads':>9} "
        f"{'idle ms':>7} {'scrape ms, median':>19} {'max ms':>18} {'max x idle':>18} {'failed':>6} {'conns':>7}"
    )
    ok = True
    for (attack, auth), runs in results.items():
        name = attack + (" + auth" if auth else "")
        peak = [r["peak_rss"] / MIB for r in runs]
        ratio = [r["peak_rss"] / r["idle_rss"] for r in runs]
        flood_max = [r["flood_max"] * 1000 for r in runs]
        max_ratio = [r["flood_max"] / r["idle_scrape"] for r in runs]
        failures = sum(r["failures"] for r in runs)
        print(
            f"{name:<22} {median([r['idle_rss'] / MIB for r in runs]):>9.1f} {spread(peak, '{:.1f}'):>18} "
            f"{spread(ratio):>16} {max(r['threads'] for r in runs):>4}/{runs[0]['idle_threads']:<4} "
            f"{median([r['idle_scrape'] * 1000 for r in runs]):>7.1f} "
            f"{spread([r['flood_median'] * 1000 for r in runs], '{:.1f}'):>19} {spread(flood_max, '{:.0f}'):>18} "
            f"{spread(max_ratio, '{:.1f}'):>18} {failures:>6} {median([r['connections'] for r in runs]):>7.0f}"
        )
        ok &= max(peak) * MIB < GOAL_RSS and max(flood_max) / 1000 <= GOAL_SCRAPE_SECONDS and failures == 0
    print(
        f"goals: peak RSS < {GOAL_RSS // MIB} MiB and every normal scrape within {GOAL_SCRAPE_SECONDS:g} s: "
        + ("met" if ok else "MISSED")
    )
    print("(threads: most seen during the attack / idle; conns: connections the attacker opened in one run)")


if __name__ == "__main__":
    main()
