"""What the sidecar benchmarks share: a real ``kvguard serve`` subprocess on loopback over a spool
of real-shaped snapshots, its resident memory (peak and current), and timed scrapes.

Not a benchmark itself; bench_flood.py, bench_spool.py and bench_metrics.py import it.
"""

from __future__ import annotations

import base64
import http.client
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXPORTER = os.path.join(ROOT, "exporter")
sys.path.insert(0, EXPORTER)
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))  # sidecar_fixtures: the tests' real-shaped snapshots

import psutil  # noqa: E402
from sidecar_fixtures import free_port, snapshot  # noqa: E402

from kvguard.records import ProcessMemory  # noqa: E402
from kvguard.spool.io import write_snapshot  # noqa: E402

MIB = 1 << 20
AUTH_USER, AUTH_PASSWORD = "bench", "bench-password"


def write_spool(spool_dir: str, ranks: int, processes: int = 1) -> int:
    """``ranks`` valid snapshots (one rank each, ``processes`` device processes each); their total bytes."""
    os.makedirs(spool_dir, exist_ok=True)
    for rank in range(ranks):
        snap = snapshot(rank=rank, device=f"npu:{rank % 16}", pid=10_000 + rank)
        if processes > 1:
            procs = tuple(
                ProcessMemory(pid=20_000 + i, used_bytes=(1 + i) << 30, name=f"python3-worker-{i}")
                for i in range(processes)
            )
            snap = replace(snap, memory=replace(snap.memory, processes=procs))
        write_snapshot(spool_dir, snap)
    return sum(entry.stat().st_size for entry in os.scandir(spool_dir))


class ServerProcess:
    """A server process on 127.0.0.1, started and waited for until ``ready()``; RSS, peak RSS, threads
    and ``stop()``. kvguard's sidecar here; bench_attacks.py runs node_exporter with it too."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], ready) -> None:
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self._stderr, env=env)
        self.process = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + 60
        while True:
            try:
                if ready():
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._stderr.seek(0)
                raise SystemExit(f"{name} did not start: {self._stderr.read().decode(errors='replace')[-2000:]}")
            time.sleep(0.1)

    def rss(self) -> int:
        return self.process.memory_info().rss

    def reset_peak(self) -> None:
        """Start a new peak-RSS window (Linux: writing 5 to clear_refs resets VmHWM)."""
        try:
            with open(f"/proc/{self.proc.pid}/clear_refs", "w") as handle:
                handle.write("5")
        except OSError:
            pass

    def peak_rss(self) -> int | None:
        """The kernel's peak RSS since the last reset_peak() (VmHWM), or None where there is none."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as handle:
                for line in handle:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def threads(self) -> int:
        return self.process.num_threads()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


class Served(ServerProcess):
    """``python -m kvguard serve`` on 127.0.0.1, started and waited for; ``stop()`` ends it."""

    def __init__(self, spool_dir: str | None, *args: str, auth: bool = False, interval: float = 5.0):
        self.port = free_port()
        self.auth = auth
        command = [
            sys.executable,
            "-m",
            "kvguard",
            "serve",
            "--listen",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--source",
            "none",
            "--interval",
            str(interval),
            *args,
        ]
        if spool_dir:
            command += ["--spool-dir", spool_dir]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [EXPORTER, os.environ.get("PYTHONPATH")]))}
        if auth:
            command += ["--basic-auth-user", AUTH_USER]
            env["KVGUARD_BASIC_AUTH_PASSWORD"] = AUTH_PASSWORD
        super().__init__("kvguard serve", command, env, lambda: scrape(self.port, "/healthz", timeout=2)[0] == 200)

    def headers(self) -> dict[str, str]:
        if not self.auth:
            return {}
        token = base64.b64encode(f"{AUTH_USER}:{AUTH_PASSWORD}".encode()).decode()
        return {"Authorization": f"Basic {token}"}


def slowloris(port: int, connections: int, stop, deadline: float = float("inf"), on_open=lambda: None) -> int:
    """``connections`` partial request heads to /metrics on 127.0.0.1:``port``, one more byte each every
    0.5 s, closed ones re-opened, until ``stop`` is set or ``deadline`` (monotonic) passes. ``on_open``
    is called per connection opened; returns how many were re-opened."""
    head = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "

    def open_one() -> socket.socket:
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        on_open()
        return sock

    socks = [open_one() for _ in range(connections)]
    first = [True] * connections
    reopened = 0
    while not stop.is_set() and time.monotonic() < deadline:
        for index, sock in enumerate(socks):
            try:
                sock.send(head if first[index] else b"a")
                first[index] = False
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                sock.close()
                socks[index], first[index] = open_one(), True
                reopened += 1
        stop.wait(0.5)
    for sock in socks:
        sock.close()
    return reopened


class PeakSampler:
    """Samples a process's RSS every ``period`` seconds in a thread, as a cross-check of VmHWM."""

    def __init__(self, served: Served, period: float = 0.02):
        self.served, self.period, self.peak = served, period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.served.rss())
            except psutil.Error:
                return
            self._stop.wait(self.period)

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def scrape(
    port: int,
    path: str = "/metrics",
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
    connection: http.client.HTTPConnection | None = None,
) -> tuple[int, bytes, float]:
    """(status, body, seconds) of one GET, on a new connection unless ``connection`` is given."""
    own = connection is None
    conn = connection or http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    start = time.perf_counter()
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        body = response.read()
        return response.status, body, time.perf_counter() - start
    finally:
        if own:
            conn.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """'median (min-max)' of repeated figures."""
    return f"{fmt.format(median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def raise_fd_limit(wanted: int) -> int:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard, max(soft, wanted))
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target
