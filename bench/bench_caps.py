"""A spool writer against the sidecar's memory and /metrics size (issue 37, item 1), on demand:
``python3 bench/bench_caps.py``.

Round three's attack: any process that can write the spool decides what the sidecar exports. Here
``--files`` snapshots (10,000 by default), each with every text field at its length cap (model
name 253 characters of backslashes, which escaping doubles; pod, namespace, container 253; engine
16) and a model, pod and engine of its own. A real ``kvguard serve`` on loopback (``--interval 1``)
reads it while, for ``--seconds``:

- 8 threads scrape /metrics in every Accept type and escaping prometheus_client answers (text and
  OpenMetrics, versions, escaping=underscores/dots/values/allow-utf-8, ``*/*``), gzipped and not;
- 4 threads read /guard;
- 8 slow readers each ask for /metrics on a connection with a 4 KiB receive window and read
  nothing for 5 s, then reconnect (so each can hold a different refresh's body).

It prints the largest /metrics answer (text, uncompressed), the series in it, the server's peak
RSS (VmHWM) and the ranks it says it cut, for this tree (``new``) and, beside it in the same run,
the last commit's package (``head``, ``git archive HEAD exporter``) over ``--head-files`` files
(fewer by default: before the caps one scrape of 4,096 such files took tens of seconds and
hundreds of MB). Goals: /metrics < 5 MB and peak RSS < 128 MiB at any spool content.

    python bench/bench_caps.py [--files 10000] [--head-files 1000] [--seconds 20] [--targets new,head]
        [--shared-names]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace

from sidecar_bench import EXPORTER, MIB, ROOT, ServerProcess, free_port, scrape, snapshot, write_snapshot

ACCEPTS = (
    [""]
    + ["*/*"]
    + [f"text/plain; version={v}" for v in ("0.0.4", "1.0.0")]
    + [f"application/openmetrics-text; version={v}" for v in ("0.0.1", "1.0.0")]
    + [
        f"{kind}; version=1.0.0; escaping={e}"
        for kind in ("text/plain", "application/openmetrics-text")
        for e in ("underscores", "dots", "values", "allow-utf-8")
    ]
)


def write_hostile_spool(spool_dir: str, files: int, shared_names: bool = False) -> int:
    """``files`` snapshots with every text field at its cap and a model, pod and engine of their own
    (with ``shared_names``, one for all: then the caps on ranks and bytes are what cut)."""
    os.makedirs(spool_dir, exist_ok=True)
    for index in range(files):
        tag = "0-" if shared_names else f"{index}-"
        snap = snapshot(
            rank=index,
            device=f"cuda:{index % 16}",
            pid=10_000 + index,
            pod={
                "pod": (tag + "p" * 253)[:253],
                "namespace": (tag + "n" * 253)[:253],
                "container": (tag + "c" * 253)[:253],
            },
        )
        snap = replace(
            snap, model_name=(tag + "\\" * 253)[:253], engine=("0" if shared_names else str(index))[-16:].rjust(16, "9")
        )
        write_snapshot(spool_dir, snap)
    return sum(entry.stat().st_size for entry in os.scandir(spool_dir))


def head_package(tmp: str) -> str:
    """The last commit's kvguard package, unpacked under ``tmp``; the folder to put on PYTHONPATH."""
    out = os.path.join(tmp, "head")
    os.makedirs(out)
    archive = subprocess.run(["git", "-C", ROOT, "archive", "HEAD", "exporter"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", out], input=archive.stdout, check=True)
    return os.path.join(out, "exporter")


def serve(exporter: str, spool_dir: str) -> tuple[ServerProcess, int]:
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
        "--interval",
        "1",
        "--spool-dir",
        spool_dir,
    ]
    env = {**os.environ, "PYTHONPATH": exporter}
    return ServerProcess("kvguard serve", command, env, lambda: scrape(port, "/healthz", timeout=2)[0] == 200), port


def slow_reader(port: int, stop: threading.Event) -> None:
    while not stop.is_set():
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            stop.wait(5)
        except OSError:
            stop.wait(0.5)
        finally:
            sock.close()


def attack(port: int, seconds: float) -> tuple[int, int, int]:
    """Run the load; (largest text /metrics bytes, its series, scrapes answered)."""
    stop = threading.Event()
    largest = [0, 0]
    answered = [0]

    def scraper(offset: int) -> None:
        index = offset
        while not stop.is_set():
            accept = ACCEPTS[index % len(ACCEPTS)]
            gzipped = (index // len(ACCEPTS)) % 2 == 1
            headers = {"Accept": accept, "Accept-Encoding": "gzip" if gzipped else "identity"}
            try:
                status, body, _ = scrape(port, "/metrics", headers, timeout=120)
            except OSError:
                continue
            answered[0] += status == 200
            if status == 200 and not gzipped and accept.startswith("text/plain; version=0.0.4"):
                if len(body) > largest[0]:
                    largest[:] = [len(body), sum(1 for line in body.splitlines() if line and line[:1] != b"#")]
            index += 1

    def guard_reader() -> None:
        while not stop.is_set():
            try:
                scrape(port, "/guard", timeout=120)
            except OSError:
                pass

    threads = [threading.Thread(target=scraper, args=(i,), daemon=True) for i in range(8)]
    threads += [threading.Thread(target=guard_reader, daemon=True) for _ in range(4)]
    threads += [threading.Thread(target=slow_reader, args=(port, stop), daemon=True) for _ in range(8)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join(150)
    if not largest[0]:  # no text answer in time: one more, waited for
        status, body, _ = scrape(port, "/metrics", {"Accept": "text/plain; version=0.0.4"}, timeout=300)
        largest[:] = [len(body), sum(1 for line in body.splitlines() if line and line[:1] != b"#")]
    return largest[0], largest[1], answered[0]


def cut_ranks(port: int) -> str:
    status, body, _ = scrape(port, "/metrics", {"Accept": "text/plain; version=0.0.4"}, timeout=300)
    lines = [
        line.decode()
        for line in body.splitlines()
        if line.startswith((b"kvguard_ranks_cut{", b"kvguard_label_values_truncated "))
    ]
    return (
        ", ".join(
            line.split("{")[-1].replace('reason="', "").replace('"}', "") if "{" in line else line for line in lines
        )
        or "(not exported)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--head-files", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--targets", default="new,head")
    parser.add_argument(
        "--shared-names",
        action="store_true",
        help="one model, pod and engine for all files (the rank and byte caps cut, not the others)",
    )
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for target in args.targets.split(","):
            files = args.files if target == "new" else args.head_files
            spool = os.path.join(tmp, f"spool-{target}")
            size = write_hostile_spool(spool, files, args.shared_names)
            exporter = EXPORTER if target == "new" else head_package(tmp)
            server, port = serve(exporter, spool)
            try:
                scrape(port, "/metrics", timeout=300)  # the first read and render
                server.reset_peak()
                body_bytes, series, answered = attack(port, args.seconds)
                peak = server.peak_rss() or server.rss()
                cut = cut_ranks(port)
            finally:
                server.stop()
            rows.append((target, files, size, body_bytes, series, answered, peak, cut))
            print(
                f"{target:5} {files:>6,} files ({size / MIB:5.1f} MiB): largest /metrics {body_bytes / 1e6:8.2f} MB, "
                f"{series:>8,} series, {answered:>5,} scrapes answered, peak RSS {peak / MIB:7.1f} MiB; cut: {cut}",
                flush=True,
            )
    by_target = {row[0]: row for row in rows}
    if "new" in by_target and "head" in by_target:
        new, head = by_target["new"], by_target["head"]
        print(
            f"\nnew / head: /metrics bytes {new[3] / head[3]:.3f}x, peak RSS {new[6] / head[6]:.2f}x "
            f"(new over {new[1]:,} files, head over {head[1]:,})"
        )
    goals = [row for row in rows if row[0] == "new"]
    for row in goals:
        print(
            f"goals (new): /metrics < 5 MB: {'yes' if row[3] < 5e6 else 'NO'}; "
            f"peak RSS < 128 MiB: {'yes' if row[6] < 128 * MIB else 'NO'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
