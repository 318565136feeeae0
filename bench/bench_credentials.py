"""Right credentials under a flood of wrong ones from the same address (issue 37, item 3), on demand:
``python3 bench/bench_credentials.py``.

A real ``kvguard serve`` on loopback with an exporter-toolkit web config of ``--users`` bcrypt users
(``--cost`` 10 by default, the cost of exporter-toolkit's own example, ``htpasswd -nBC 10``, "about
~70ms" in its docs/web-configuration.md; the run prints what one check costs on this machine, and the
load average, so that the figures can be read against them). An attacker process on 127.0.0.1, the
address the legitimate client uses too (a mesh proxy, SNAT), keeps ``--guessers`` keep-alive connections
sending GET /metrics with random passwords as fast as they are answered (with ``--churn``, a new
connection for each). Meanwhile this process measures, for this tree (``new``) and the last commit's
package beside it in the same run (``head``, ``git archive HEAD exporter``, or ``--head-exporter DIR``,
a copy of an ``exporter`` folder):

- cached: scrapes with a password verified before the flood, on Prometheus' keep-alive connection;
- rotated: on that same connection, the first use of each other user's password (what a scrape
  sends after its password was rotated), one every 0.5 s;
- new connection: the first use of a password on a connection of its own (a Prometheus restarted),
  from the flood's address (its 429s were issue 37's last open case: the flood's keep-alive guesses
  used up the address's tokens);
- other address: the same from 127.0.0.2, an address that sends no guesses (one address with many
  connections must not lock out the others' new logins: run with ``--guessers`` above the server's
  64-place bcrypt queue to see the last commit's lockout).

Each row: answers by status and latency p50 / p99 / max. The goal: a right password is never
refused or delayed by the guesses, scrape p99 <= 100 ms under the flood.

    python bench/bench_credentials.py [--seconds 12] [--guessers 32] [--users 96] [--cost 10]
        [--targets new,head] [--head-exporter DIR]
"""

from __future__ import annotations

import argparse
import base64
import http.client
import multiprocessing
import os
import secrets
import subprocess
import sys
import tempfile
import time

import bcrypt
from sidecar_bench import EXPORTER, ROOT, ServerProcess, free_port, percentile, scrape, write_spool


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def _guesser(port: int, connections: int, stop, churn: bool = False) -> None:
    import selectors
    import socket

    selector = selectors.DefaultSelector()

    def send(sock: socket.socket) -> None:
        token = base64.b64encode(f"user0:{secrets.token_hex(8)}".encode()).decode()
        sock.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {token}\r\n\r\n".encode())

    def open_one() -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        send(sock)

    for _ in range(connections):
        open_one()
    while not stop.is_set():
        for key, _ in selector.select(0.2):
            sock = key.fileobj
            try:
                data = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data or (churn and b"\r\n\r\n" in data):  # --churn: a new connection per guess
                selector.unregister(sock)
                sock.close()
                open_one()
            elif b"\r\n\r\n" in data:
                try:
                    send(sock)
                except OSError:
                    pass


def head_package(tmp: str, given: str | None = None) -> str:
    if given:
        return given
    out = os.path.join(tmp, "head")
    os.makedirs(out, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", "HEAD", "exporter"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", out], input=archive.stdout, check=True)
    return os.path.join(out, "exporter")


def summary(results: list[tuple[int, float]]) -> str:
    statuses: dict[int, int] = {}
    for status, _ in results:
        statuses[status] = statuses.get(status, 0) + 1
    times = [seconds * 1000 for _, seconds in results] or [0.0]
    return (
        f"{len(results):>4} answers {dict(sorted(statuses.items()))}, p50 {percentile(times, 0.5):7.1f} ms, "
        f"p99 {percentile(times, 0.99):7.1f} ms, max {max(times):7.1f} ms"
    )


def run(target: str, exporter: str, tmp: str, passwords: dict[str, str], config: str, args) -> dict[str, str]:
    spool = os.path.join(tmp, f"spool-{target}")
    write_spool(spool, 2)
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "kvguard",
        "serve",
        "--listen",
        "127.0.0.1",
        "--port",
        str(port),
        "--source",
        "none",
        "--spool-dir",
        spool,
        "--web.config.file",
        config,
    ]
    server = ServerProcess(
        "kvguard serve",
        command,
        {**os.environ, "PYTHONPATH": exporter},
        lambda: scrape(port, "/healthz", timeout=2)[0] == 200,
    )
    stop = multiprocessing.Event()
    attacker = None
    try:
        prometheus = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

        def keep_alive(user: str) -> tuple[int, float]:
            start = time.perf_counter()
            prometheus.request("GET", "/metrics", headers=basic(user, passwords[user]))
            response = prometheus.getresponse()
            response.read()
            return response.status, time.perf_counter() - start

        assert keep_alive("user0")[0] == 200  # verified before the flood
        attacker = multiprocessing.Process(target=_guesser, args=(port, args.guessers, stop, args.churn), daemon=True)
        attacker.start()
        time.sleep(2)  # the flood under way
        cached, rotated, fresh, other = [], [], [], []
        others = [user for user in passwords if user != "user0"]
        deadline = time.monotonic() + args.seconds
        step = 0
        while time.monotonic() < deadline:
            cached.append(keep_alive("user0"))
            if step % 2 == 0 and others:
                rotated.append(keep_alive(others.pop()))
            if step % 4 == 1 and others:
                user = others.pop()
                start = time.perf_counter()
                status, _, _ = scrape(port, "/metrics", basic(user, passwords[user]), timeout=60)
                fresh.append((status, time.perf_counter() - start))
            if step % 4 == 3 and others:
                user = others.pop()
                start = time.perf_counter()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=("127.0.0.2", 0))
                try:
                    conn.request("GET", "/metrics", headers=basic(user, passwords[user]))
                    response = conn.getresponse()
                    response.read()
                    other.append((response.status, time.perf_counter() - start))
                finally:
                    conn.close()
            step += 1
            time.sleep(0.25)
        prometheus.close()
        return {
            "cached": summary(cached),
            "rotated": summary(rotated),
            "new connection": summary(fresh),
            "other address": summary(other),
        }
    finally:
        stop.set()
        if attacker is not None:
            attacker.join(5)
            if attacker.is_alive():
                attacker.kill()
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--guessers", type=int, default=32)
    parser.add_argument("--users", type=int, default=96)
    parser.add_argument("--cost", type=int, default=10)
    parser.add_argument(
        "--churn",
        action="store_true",
        help="the attacker opens a new connection for each guess (what no server can tell from "
        "a first login before bcrypt)",
    )
    parser.add_argument("--targets", default="new,head")
    parser.add_argument("--head-exporter", help="the exporter folder to run as head (default: git archive HEAD)")
    args = parser.parse_args()
    passwords = {f"user{i}": secrets.token_hex(12) for i in range(args.users)}
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "web.yml")
        hashes = {
            user: bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=args.cost)).decode()
            for user, password in passwords.items()
        }
        with open(config, "w") as handle:
            handle.write("basic_auth_users:\n")
            for user, hashed in hashes.items():
                handle.write(f"  {user}: {hashed}\n")
        checks = []
        for _ in range(20):
            start = time.perf_counter()
            bcrypt.checkpw(passwords["user0"].encode(), hashes["user0"].encode())
            checks.append((time.perf_counter() - start) * 1000)
        print(
            f"bcrypt cost {args.cost}: one check {percentile(checks, 0.5):.1f} ms median, "
            f"{min(checks):.1f}-{max(checks):.1f} ms (20, idle server); load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs",
            flush=True,
        )
        for target in args.targets.split(","):
            exporter = EXPORTER if target == "new" else head_package(tmp, args.head_exporter)
            rows = run(target, exporter, tmp, passwords, config, args)
            for name, line in rows.items():
                print(f"{target:5} {name:15} {line}", flush=True)
        print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
