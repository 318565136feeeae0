"""CPU of `kvguard serve --demo`, against an idle `kvguard serve --source none` measured beside it.

Starts each as its own process on loopback, lets it warm up, then reads the process's CPU time
over the same wall-clock window (psutil ``cpu_percent``: 100 = one core busy). The demo's ranks
advance their simulated workload at every probe sample (one a second); the target is well under
10% of one core.

    python bench/bench_demo_cpu.py [--seconds 60]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
EXPORTER = os.path.join(HERE, "..", "exporter")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": EXPORTER + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-m", "kvguard", "serve", "--listen", "127.0.0.1", "--port", str(free_port()), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    options = parser.parse_args()
    demo = start("--demo")
    idle = start("--source", "none")
    try:
        time.sleep(options.warmup)
        for process in (demo, idle):
            if process.poll() is not None:
                sys.exit(f"a server exited with {process.returncode}")
        handles = [psutil.Process(demo.pid), psutil.Process(idle.pid)]
        for handle in handles:
            handle.cpu_percent(None)
        time.sleep(options.seconds)
        demo_cpu, idle_cpu = (handle.cpu_percent(None) for handle in handles)
    finally:
        for process in (demo, idle):
            process.terminate()
            process.wait(10)
    print(
        f"over {options.seconds:g} s: demo {demo_cpu:.1f}% of one core, idle server {idle_cpu:.1f}%, "
        f"demo - idle {demo_cpu - idle_cpu:.1f} points"
    )


if __name__ == "__main__":
    main()
