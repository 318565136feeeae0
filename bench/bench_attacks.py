"""The sidecar under issue 23's attacks, all at once, beside the previous commit's server, two
server libraries and Debian's prometheus-node-exporter: /healthz latency, a normal scrape's p99,
503s, peak RSS.

A real ``kvguard serve`` subprocess on loopback over the 64-rank spool of the other benches
(sidecar_bench.write_spool), with basic auth from an exporter-toolkit web config (one bcrypt user,
cost 10). Attackers run in processes of their own, each bounded in connections and time and
stopping by itself:

- slow readers: 8 connections with a 1 KiB receive window, each pipelining 200 GETs of /metrics
  and never reading (re-opened when the server closes one, at most 50 times in all);
- slowloris: 400 connections, each a partial request head and one more byte every 0.5 s;
- password flood: 32 keep-alive connections sending GET /metrics with a random password, as fast
  as they are answered; in the scenario "flood from 32 sources", each from an address of its own
  (127.0.0.2-33), so that a per-source limit lets 32 guesses a second through to bcrypt;
- ordinary clients: 256 keep-alive connections with valid credentials, each GET /metrics again as
  soon as its answer is in (wrk -c256).

Meanwhile this process probes /healthz every 0.1 s and scrapes /metrics (valid credentials) every
0.25 s, each on a new connection, as the kubelet and Prometheus do. Scenarios: idle, the password
flood alone, the flood from 32 sources (not run by default), everything at once. Goals (issue 23):
/healthz <= 100 ms (max), scrape p99 <= 1 s under everything, no 503 below 256 clients, peak RSS
<= 128 MiB, scrape p99 <= 100 ms under the password flood. ``--cpus 1`` runs each server under
``taskset -c 1`` (the attackers and this process are not pinned), for a server short of CPU.

Targets: ``new`` (this working tree), ``head`` (the server of the last commit: sidecar/server.py,
webconfig.py and exposition.py from ``git show HEAD:...`` over a copy of this tree's package),
``h11`` and ``cheroot`` (this tree's application, endpoints and auth behind an asyncio server on
h11, or behind cheroot's WSGI server: bench/alt_servers.py; bench-only dependencies,
``.venv/bin/pip install h11==0.16.0 cheroot==11.1.2``, left out when not installed),
``node_exporter`` (when /usr/bin/prometheus-node-exporter exists; it has no /healthz, so its probe
is ``/`` with credentials, and it serves its own metrics, not kvguard's).

    python bench/bench_attacks.py [--repeats 2] [--seconds 8] [--targets new,head,h11,cheroot,node_exporter]
        [--scenarios "idle,password flood,everything at once"] [--cpus LIST] [--plain]
        [--write bench/results/attacks-YYYY-MM-DD.txt]
"""

from __future__ import annotations

import argparse
import base64
import datetime
import importlib.util
import multiprocessing
import os
import secrets
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sidecar_bench import (
    EXPORTER,
    MIB,
    ROOT,
    ServerProcess,
    median,
    percentile,
    raise_fd_limit,
    slowloris as slowloris_connections,
    write_spool,
)  # noqa: E402
from sidecar_fixtures import free_port  # noqa: E402

RANKS = 64
USER, PASSWORD = "prometheus", "bench-password"
SLOW_READERS, SLOW_PIPELINE, SLOW_REOPENS = 8, 200, 50
SLOWLORIS = 400
FLOOD = 32
ORDINARY = 256
PROBE_PERIOD, SCRAPE_PERIOD = 0.1, 0.25
ATTACK_GRACE = 30.0  # an attacker ends itself this long after its planned end, whatever happens
GOALS = {"healthz_max": 0.100, "scrape_p99": 1.0, "flood_scrape_p99": 0.100, "rss": 128 * MIB}
NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"
# The modules that make the server, taken from the last commit for the ``head`` target.
SERVER_MODULES = ("sidecar/server.py", "sidecar/webconfig.py", "sidecar/exposition.py")
# kvguard's application behind a server library (alt_servers.py; bench-only: pip install h11 cheroot).
LIBRARY_SERVERS = ("h11", "cheroot")
HERE = os.path.dirname(os.path.abspath(__file__))
# What Prometheus 2.x/3.x sends with a scrape (scrape/scrape.go, acceptHeader and Accept-Encoding);
# --plain drops it, as wrk does: the uncompressed text then (461 kB for 64 ranks, against 17 kB).
SCRAPER_HEADERS = (
    "Accept: application/openmetrics-text;version=1.0.0;q=0.75,text/plain;version=0.0.4;q=0.5,"
    "*/*;q=0.1\r\nAccept-Encoding: gzip\r\n"
)


def _auth(password: str) -> str:
    return "Basic " + base64.b64encode(f"{USER}:{password}".encode()).decode()


# ------------------------------------------------------------------------------ targets


class Target(ServerProcess):
    """One server process on 127.0.0.1, with the paths the attacks probe and scrape."""

    def __init__(
        self, name: str, command: list[str], env: dict[str, str], port: int, probe_path: str, scrape_path: str
    ):
        self.name, self.port, self.probe_path, self.scrape_path = name, port, probe_path, scrape_path
        super().__init__(
            name, command, env, lambda: request(self.port, self.probe_path, _auth(PASSWORD), timeout=2)[0] == 200
        )


def web_config(directory: str) -> str:
    import bcrypt

    path = os.path.join(directory, "web.yml")
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=10)).decode()
    with open(path, "w") as handle:
        handle.write(f"basic_auth_users:\n  {USER}: {hashed}\n")
    return path


def head_package(directory: str) -> str:
    """This tree's package with the last commit's server, web config and exposition modules."""
    root = os.path.join(directory, "head")
    if os.path.isdir(root):  # made by an earlier repeat
        return root
    shutil.copytree(
        os.path.join(EXPORTER, "kvguard"), os.path.join(root, "kvguard"), ignore=shutil.ignore_patterns("__pycache__")
    )
    for module in SERVER_MODULES:
        text = subprocess.run(
            ["git", "-C", ROOT, "show", f"HEAD:exporter/kvguard/{module}"], check=True, capture_output=True
        ).stdout
        with open(os.path.join(root, "kvguard", module), "wb") as handle:
            handle.write(text)
    return root


def start_target(name: str, directory: str, spool: str, config: str, cpus: str | None = None) -> Target:
    port = free_port()
    pin = ["taskset", "-c", cpus] if cpus else []
    if name == "node_exporter":
        command = [NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{port}", f"--web.config.file={config}"]
        return Target(name, pin + command, dict(os.environ), port, "/", "/metrics")
    package = head_package(directory) if name == "head" else EXPORTER
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package, os.environ.get("PYTHONPATH")]))}
    if name in LIBRARY_SERVERS:
        command = [sys.executable, os.path.join(HERE, "alt_servers.py"), name, "--port", str(port)]
    else:
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
        ]
    command += ["--interval", "5", "--spool-dir", spool, "--web.config.file", config]
    return Target(name, pin + command, env, port, "/healthz", "/metrics")


def available(name: str) -> bool:
    """node_exporter where Debian's package is installed; the library servers where their library is."""
    if name == "node_exporter":
        return os.path.exists(NODE_EXPORTER)
    if name in LIBRARY_SERVERS:
        return importlib.util.find_spec(name) is not None
    return True


# ------------------------------------------------------------------------------ one request, timed


def request(
    port: int, path: str, authorization: str | None, timeout: float = 10.0, extra: str = ""
) -> tuple[int, float]:
    """(status, seconds) of one GET on a new connection, the body read to its end."""
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        auth = f"Authorization: {authorization}\r\n" if authorization else ""
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}{extra}Connection: close\r\n\r\n".encode())
        data = bytearray()
        while chunk := sock.recv(262144):
            data += chunk
    status = int(bytes(data[:32]).split()[1]) if data.startswith(b"HTTP/") else 0
    return status, time.perf_counter() - start


def timed_request(port: int, path: str, authorization: str | None, **kwargs) -> tuple[float, bool]:
    """(seconds, failed) for one request; a request that could not be made counts as 10 s, failed."""
    try:
        status, took = request(port, path, authorization, **kwargs)
    except OSError:
        return 10.0, True
    return took, status != 200


# ------------------------------------------------------------------------------ attackers


def _answer(state: dict, buffer: bytearray) -> int | None:
    """The status of the first complete answer in ``buffer`` (Content-Length or chunked), removed
    from it; None while it is incomplete."""
    if state["need"] is None:
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(buffer[:end]).decode("latin-1").lower()
        state["status"], state["close"] = int(head.split()[1]), "connection: close" in head
        state["chunked"] = "transfer-encoding: chunked" in head
        length = int(head.split("content-length:")[1].split()[0]) if "content-length:" in head else 0
        state["need"] = end + 4 + (0 if state["chunked"] else length)
    if state["chunked"]:  # walk the chunks from where the head ends; the last one has size 0
        at = state["need"]
        while True:
            line_end = buffer.find(b"\r\n", at)
            if line_end < 0:
                return None
            size = int(bytes(buffer[at:line_end]).split(b";")[0], 16)
            if size == 0:
                if len(buffer) < line_end + 4:
                    return None
                state["need"], state["chunked"] = line_end + 4, False
                break
            if len(buffer) < line_end + 2 + size + 2:
                state["need"] = at
                return None
            at = line_end + 2 + size + 2
    if len(buffer) < state["need"]:
        return None
    del buffer[: state["need"]]
    state["need"] = None
    return state["status"]


def _clients(port: int, count: int, make_request, stop, counts, deadline: float, sources: int = 1) -> None:
    """``count`` keep-alive connections, each sending make_request() again as soon as its answer
    (Content-Length or chunked) is in; counts[0..3]: 200, 503, other statuses, connections re-opened.
    With ``sources`` > 1, connection i comes from 127.0.0.(2 + i % sources): that many addresses."""
    selector = selectors.DefaultSelector()

    def open_one(index: int) -> None:
        sock = socket.socket()
        if sources > 1:
            sock.bind((f"127.0.0.{2 + index % sources}", 0))
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        state = {"buffer": bytearray(), "need": None, "index": index}
        selector.register(sock, selectors.EVENT_WRITE, state)

    for index in range(count):
        open_one(index)
    local = [0, 0, 0, 0]
    last_flush = time.monotonic()
    while not stop.is_set() and time.monotonic() < deadline:
        for key, events in selector.select(timeout=0.1):
            sock, state = key.fileobj, key.data
            try:
                if events & selectors.EVENT_WRITE:
                    sock.send(make_request())  # a short request: all of it fits
                    selector.modify(sock, selectors.EVENT_READ, state)
                    continue
                chunk = sock.recv(1 << 20)
                if not chunk:
                    raise ConnectionResetError
                buffer = state["buffer"]
                buffer += chunk
                while (status := _answer(state, buffer)) is not None:
                    local[0 if status == 200 else 1 if status == 503 else 2] += 1
                    if state["close"]:
                        raise ConnectionResetError
                    sock.send(make_request())
            except (BlockingIOError, InterruptedError):
                pass
            except (OSError, ValueError):  # closed, reset, or an answer it cannot frame: a new one
                selector.unregister(sock)
                sock.close()
                local[3] += 1
                open_one(state["index"])
        if time.monotonic() - last_flush > 0.5:
            for i in range(4):
                counts[i] += local[i]
            local, last_flush = [0, 0, 0, 0], time.monotonic()
    for i in range(4):
        counts[i] += local[i]
    for key in list(selector.get_map().values()):
        key.fileobj.close()


def ordinary(port: int, stop, counts, deadline: float, extra: str) -> None:
    line = f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {_auth(PASSWORD)}\r\n{extra}\r\n".encode()
    _clients(port, ORDINARY, lambda: line, stop, counts, deadline)


def password_flood(port: int, stop, counts, deadline: float, extra: str) -> None:
    def guess() -> bytes:
        return (
            f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {_auth(secrets.token_hex(8))}\r\n\r\n".encode()
        )

    _clients(port, FLOOD, guess, stop, counts, deadline)


def password_flood_sources(port: int, stop, counts, deadline: float, extra: str) -> None:
    """The same flood from FLOOD addresses, one per connection: the per-source limit lets each
    through once a second, so the server's bcrypt pool is busy all the time."""

    def guess() -> bytes:
        return (
            f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {_auth(secrets.token_hex(8))}\r\n\r\n".encode()
        )

    _clients(port, FLOOD, guess, stop, counts, deadline, sources=FLOOD)


def slow_readers(port: int, stop, counts, deadline: float, extra: str) -> None:
    """SLOW_READERS connections pipelining SLOW_PIPELINE GETs with a 1 KiB window, never reading."""
    line = f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {_auth(PASSWORD)}\r\n\r\n".encode()
    del extra  # the slow readers ask for the uncompressed text: the most to leave unread

    def open_one() -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.settimeout(5)
        sock.connect(("127.0.0.1", port))
        try:
            sock.sendall(line * SLOW_PIPELINE)
        except OSError:
            pass
        sock.setblocking(False)
        return sock

    socks = [open_one() for _ in range(SLOW_READERS)]
    reopened = 0
    while not stop.is_set() and time.monotonic() < deadline:
        for index, sock in enumerate(socks):
            try:  # never reads an answer: only asks the kernel whether the server closed it
                closed = sock.recv(1, socket.MSG_PEEK) == b""
            except (BlockingIOError, InterruptedError):
                closed = False
            except OSError:
                closed = True
            if closed and reopened < SLOW_REOPENS:
                sock.close()
                socks[index] = open_one()
                reopened += 1
        stop.wait(0.2)
    counts[3] += reopened
    for sock in socks:
        sock.close()


def slowloris(port: int, stop, counts, deadline: float, extra: str) -> None:
    counts[3] += slowloris_connections(port, SLOWLORIS, stop, deadline)


SCENARIOS = {
    "idle": (),
    "password flood": (password_flood,),
    "flood from 32 sources": (password_flood_sources,),
    "everything at once": (slow_readers, slowloris, password_flood, ordinary),
}


# ------------------------------------------------------------------------------ one run


def run_one(target: Target, scenario: str, seconds: float, extra: str) -> dict:
    authorization = _auth(PASSWORD)
    for _ in range(3):  # the valid credentials verified (and the body made) before anything starts
        request(target.port, target.scrape_path, authorization, extra=extra)
    stop = multiprocessing.Event()
    attackers = []
    counts = {}
    deadline = time.monotonic() + seconds + 2 + ATTACK_GRACE
    time.sleep(0.3)
    target.reset_peak()
    peak = target.rss()
    for attack in SCENARIOS[scenario]:
        counts[attack.__name__] = multiprocessing.Array("q", 4)
        attackers.append(
            multiprocessing.Process(
                target=attack, args=(target.port, stop, counts[attack.__name__], deadline, extra), daemon=True
            )
        )
    for attacker in attackers:
        attacker.start()
    if attackers:
        time.sleep(1.5)  # the attack's connections open and fill their windows
    probes, scrapes, probe_fail, scrape_fail = [], [], 0, 0
    end = time.monotonic() + seconds
    next_probe = next_scrape = time.monotonic()
    while time.monotonic() < end:
        now = time.monotonic()
        if now >= next_probe:
            took, failed = timed_request(
                target.port, target.probe_path, authorization if target.name == "node_exporter" else None
            )
            probes.append(took)
            probe_fail += failed
            next_probe = time.monotonic() + PROBE_PERIOD
        if now >= next_scrape:
            took, failed = timed_request(target.port, target.scrape_path, authorization, extra=extra)
            scrapes.append(took)
            scrape_fail += failed
            next_scrape = time.monotonic() + SCRAPE_PERIOD
        peak = max(peak, target.rss())
        time.sleep(0.005)
    stop.set()
    for attacker in attackers:
        attacker.join(timeout=ATTACK_GRACE)
        if attacker.is_alive():
            attacker.kill()
    peak = max(peak, target.peak_rss() or 0)
    result = {
        "healthz_p50": median(probes),
        "healthz_max": max(probes),
        "probe_failures": probe_fail,
        "scrape_p50": median(scrapes),
        "scrape_p99": percentile(scrapes, 0.99),
        "scrape_max": max(scrapes),
        "scrape_failures": scrape_fail,
        "rss": peak,
    }
    if "ordinary" in counts:
        ok, busy, other, reopened = counts["ordinary"][:]
        result.update(ordinary_200=ok, ordinary_503=busy, ordinary_other=other, ordinary_reopened=reopened)
    for name in ("password_flood", "password_flood_sources"):
        if name in counts:
            result["flood_answers"] = sum(counts[name][:3])
    return result


def fmt(value: float, unit: str = "ms") -> str:
    return f"{value * 1000:.0f}" if unit == "ms" else f"{value / MIB:.0f}"


def spread(values: list[float], unit: str = "ms") -> str:
    ordered = sorted(values)
    if len(ordered) == 1:
        return fmt(ordered[0], unit)
    return f"{fmt(median(ordered), unit)} ({fmt(ordered[0], unit)}-{fmt(ordered[-1], unit)})"


def report(results: dict[tuple[str, str], list[dict]], repeats: int, seconds: float) -> list[str]:
    lines = [
        f"{repeats} run(s) of {seconds:.0f} s per cell; median (min-max) over runs; times in ms, RSS in MiB; "
        "10000 ms is the client's 10 s timeout (no answer); 'failed': probes and scrapes not answered 200; "
        "'503' and 'ordinary 200': the 256 ordinary clients' answers, summed over runs",
        f"{'target':<14} {'scenario':<21} {'healthz p50':>12} {'healthz max':>14} {'scrape p50':>12} "
        f"{'scrape p99':>14} {'failed':>7} {'503':>6} {'ordinary 200':>13} {'peak RSS':>10}",
    ]
    for (target, scenario), runs in results.items():
        lines.append(
            f"{target:<14} {scenario:<21} {spread([r['healthz_p50'] for r in runs]):>12} "
            f"{spread([r['healthz_max'] for r in runs]):>14} {spread([r['scrape_p50'] for r in runs]):>12} "
            f"{spread([r['scrape_p99'] for r in runs]):>14} "
            f"{sum(r['probe_failures'] + r['scrape_failures'] for r in runs):>7} "
            f"{sum(r.get('ordinary_503', 0) for r in runs):>6} "
            f"{sum(r.get('ordinary_200', 0) for r in runs):>13} {spread([r['rss'] for r in runs], 'MiB'):>10}"
        )
    return lines


def verdicts(results: dict[tuple[str, str], list[dict]]) -> list[str]:
    lines = []
    for target in sorted({t for t, _ in results}):
        every = results.get((target, "everything at once"), [])
        flood = results.get((target, "password flood"), [])
        if not every or not flood:
            continue
        checks = [
            ("/healthz max <= 100 ms under everything", all(r["healthz_max"] <= GOALS["healthz_max"] for r in every)),
            ("scrape p99 <= 1 s under everything", all(r["scrape_p99"] <= GOALS["scrape_p99"] for r in every)),
            ("no 503 for 256 ordinary clients", all(r.get("ordinary_503", 0) == 0 for r in every)),
            ("peak RSS <= 128 MiB", all(r["rss"] <= GOALS["rss"] for r in every + flood)),
            (
                "scrape p99 <= 100 ms under the password flood",
                all(r["scrape_p99"] <= GOALS["flood_scrape_p99"] for r in flood),
            ),
        ]
        if (target, "flood from 32 sources") in results:
            checks.append(
                (
                    "... and under the flood from 32 sources",
                    all(
                        r["scrape_p99"] <= GOALS["flood_scrape_p99"] for r in results[(target, "flood from 32 sources")]
                    ),
                )
            )
        lines.append(f"{target}: " + "; ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in checks))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--targets", default="new,head,h11,cheroot,node_exporter")
    parser.add_argument(
        "--scenarios",
        default="idle,password flood,everything at once",
        help=f"comma-separated, of: {', '.join(SCENARIOS)}",
    )
    parser.add_argument("--plain", action="store_true", help="scrape as wrk does: no Accept, no gzip")
    parser.add_argument("--cpus", help="run each server under taskset -c CPUS")
    parser.add_argument("--write", help="append the report to this file")
    args = parser.parse_args()
    raise_fd_limit(8192)
    known = ("new", "head", *LIBRARY_SERVERS, "node_exporter")
    for name in args.targets.split(","):
        if name not in known:
            parser.error(f"unknown target {name!r}; known: {', '.join(known)}")
        if not available(name):
            print(
                f"bench_attacks: target {name} left out: "
                f"{NODE_EXPORTER if name == 'node_exporter' else 'the Python package ' + name} is not installed",
                file=sys.stderr,
            )
    targets = [t for t in args.targets.split(",") if available(t)]
    scenarios = args.scenarios.split(",")
    for scenario in scenarios:
        if scenario not in SCENARIOS:
            parser.error(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    results: dict[tuple[str, str], list[dict]] = {}
    load_before = os.getloadavg()[0]
    loads: list[float] = []  # the 1-min load after each cell: the other jobs on the shared machine
    with tempfile.TemporaryDirectory(prefix="kvguard-attacks-") as directory:
        spool = os.path.join(directory, "spool")
        write_spool(spool, RANKS)
        config = web_config(directory)
        for repeat in range(args.repeats):
            for name in targets:  # interleaved, so a busy moment of the shared machine hits each
                target = start_target(name, directory, spool, config, args.cpus)
                try:
                    for scenario in scenarios:
                        result = run_one(target, scenario, args.seconds, "" if args.plain else SCRAPER_HEADERS)
                        results.setdefault((name, scenario), []).append(result)
                        loads.append(os.getloadavg()[0])
                        print(
                            f"run {repeat + 1} {name:<14} {scenario:<21} "
                            + " ".join(
                                f"{k}={v * 1000:.0f}ms"
                                if isinstance(v, float)
                                else f"{k}={v / MIB:.0f}MiB"
                                if k == "rss"
                                else f"{k}={v}"
                                for k, v in result.items()
                            ),
                            flush=True,
                        )
                finally:
                    target.stop()
    commit = subprocess.run(
        ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", ROOT, "status", "--porcelain"] + [f"exporter/kvguard/{module}" for module in SERVER_MODULES],
        capture_output=True,
        text=True,
    ).stdout.strip()
    header = [
        f"bench_attacks.py, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"commit {commit}{' + working tree (new server)' if dirty else ''}; {RANKS} ranks; "
        f"{os.cpu_count()} CPUs shared with other jobs (1-min load {load_before:.1f} before, "
        f"{min(loads, default=0):.1f}-{max(loads, default=0):.1f} after the cells, "
        f"{os.getloadavg()[0]:.1f} after){'; servers pinned to CPU ' + args.cpus if args.cpus else ''}; scrapes "
        f"{'as wrk (no Accept, no gzip)' if args.plain else 'as Prometheus (OpenMetrics, gzip)'}",
        *(
            ["head = the server of commit " + commit + " (its server.py, webconfig.py, exposition.py)"]
            if "head" in targets
            else []
        ),
    ]
    lines = header + report(results, args.repeats, args.seconds) + verdicts(results)
    print("\n".join(lines))
    if args.write:
        with open(args.write, "a") as handle:
            handle.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
