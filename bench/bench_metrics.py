"""/metrics for 16 ranks: kvguard's server against a bare prometheus_client HTTP server serving the
very same series, scraped interleaved in the same run; median and p99 latency and their ratios.

kvguard serve runs over a spool of 16 real-shaped snapshots. Its /metrics text is parsed into
metric families (prometheus_client.parser), and a second process serves those families with
prometheus_client.start_http_server and a custom collector: the same series, the same bytes,
rendered by the library on every scrape. Both run in processes of their own; this one only
scrapes, alternating which server goes first. Each variant is a fresh connection per scrape
(prometheus_client's server closes after each response), plain text and gzip as Prometheus asks;
the keep-alive row is kvguard alone, as Prometheus scrapes it. Goal (issue 13): median and p99
each <= 1.2x the bare client's.

    python bench/bench_metrics.py [--rounds 3] [--scrapes 300]
"""

from __future__ import annotations

import argparse
import atexit
import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sidecar_bench import Served, free_port, median, percentile, scrape, spread, write_spool  # noqa: E402

RANKS = 16
GOAL_RATIO = 1.2
VARIANTS = {"text": {}, "gzip": {"Accept-Encoding": "gzip"}}


def serve_bare(exposition_file: str, port: int) -> None:
    """The bare client: the parsed families, served by prometheus_client's own HTTP server."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import Collector

    with open(exposition_file, encoding="utf-8") as handle:
        text = handle.read()

    families = list(text_string_to_metric_families(text))

    class Parsed(Collector):
        def collect(self):
            return iter(families)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Parsed())
    start_http_server(port, addr="127.0.0.1", registry=registry)
    while True:
        time.sleep(3600)


def start_bare(text: bytes) -> tuple[subprocess.Popen, int]:
    handle = tempfile.NamedTemporaryFile("wb", suffix=".prom", delete=False)
    handle.write(text)
    handle.close()
    port = free_port()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--bare", handle.name, str(port)])
    atexit.register(os.unlink, handle.name)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if scrape(port, timeout=2)[0] == 200:
                return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the bare prometheus_client server did not start")


def same_series(a: bytes, b: bytes) -> bool:
    from prometheus_client.parser import text_string_to_metric_families

    def series(text: bytes) -> set:
        return {
            (s.name, tuple(sorted(s.labels.items())))
            for f in text_string_to_metric_families(text.decode())
            for s in f.samples
        }

    return series(a) == series(b)


def render_costs(spool: str, runs: int = 30) -> tuple[float, float, float]:
    """In this process: (kvguard's encoder, the library's generate_latest, observation + collection),
    best of ``runs`` seconds, for the same families: what a scrape after a refresh pays."""
    from prometheus_client.exposition import generate_latest

    from kvguard.sidecar.collector import families
    from kvguard.sidecar.core import Sidecar, SidecarConfig
    from kvguard.sidecar.exposition import Exposition, _Pinned, encode

    sidecar = Sidecar(SidecarConfig(spool_dir=spool, pod_labels={}))
    exposition = Exposition(sidecar)
    exposition.body("", False)
    metrics = list(exposition._collect())
    best = [float("inf")] * 3
    for _ in range(runs):
        for index, work in enumerate(
            (
                lambda: encode(metrics, ""),
                lambda: generate_latest(_Pinned(metrics)),
                lambda: list(families(sidecar.observe())),
            )
        ):
            start = time.perf_counter()
            work()
            best[index] = min(best[index], time.perf_counter() - start)
    return best[0], best[1], best[2]


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--bare":
        serve_bare(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scrapes", type=int, default=300, help="scrapes of each server per variant and round")
    args = parser.parse_args()

    spool = tempfile.mkdtemp(prefix="kvguard-bench-metrics-")
    write_spool(spool, RANKS)
    served = Served(spool)
    bare = None
    try:
        status, text, _ = scrape(served.port)
        assert status == 200
        bare, bare_port = start_bare(text)
        assert same_series(text, scrape(bare_port)[1]), "the bare server does not serve the same series"
        ratios: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
        figures: dict[str, list[tuple[float, float, float, float]]] = {v: [] for v in VARIANTS}
        keep_alive: list[tuple[float, float]] = []
        for _ in range(args.rounds):
            for variant, headers in VARIANTS.items():
                ours, theirs = [], []
                for i in range(args.scrapes):
                    order = (
                        ((served.port, ours), (bare_port, theirs))
                        if i % 2
                        else ((bare_port, theirs), (served.port, ours))
                    )
                    for port, into in order:
                        status, _, took = scrape(port, headers=headers)
                        assert status == 200
                        into.append(took)
                figure = (median(ours), percentile(ours, 0.99), median(theirs), percentile(theirs, 0.99))
                figures[variant].append(figure)
                ratios[variant].append((figure[0] / figure[2], figure[1] / figure[3]))
            conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
            try:
                kept = [scrape(served.port, connection=conn, headers=VARIANTS["gzip"])[2] for _ in range(args.scrapes)]
            finally:
                conn.close()
            keep_alive.append((median(kept), percentile(kept, 0.99)))
        ours, library, observe = render_costs(spool)
    finally:
        served.stop()
        if bare is not None:
            bare.kill()
            bare.wait()
        shutil.rmtree(spool, ignore_errors=True)

    print(
        f"/metrics for {RANKS} ranks ({len(text) / 1000:.0f} kB of text), {args.rounds} round(s) of "
        f"{args.scrapes} interleaved scrapes per server and variant; median (min-max) over rounds"
    )
    print(
        f"{'variant':<22} {'kvguard median ms':>20} {'p99 ms':>18} {'bare median ms':>18} {'p99 ms':>18} "
        f"{'median ratio':>18} {'p99 ratio':>18}"
    )
    ok = True
    for variant in VARIANTS:
        rows = figures[variant]
        print(
            f"{variant + ', new connection':<22} "
            + " ".join(
                f"{spread([row[i] * 1000 for row in rows], '{:.2f}'):>{w}}"
                for i, w in ((0, 20), (1, 18), (2, 18), (3, 18))
            )
            + f" {spread([r[0] for r in ratios[variant]]):>18} {spread([r[1] for r in ratios[variant]]):>18}"
        )
        ok &= all(m <= GOAL_RATIO and p <= GOAL_RATIO for m, p in ratios[variant])
    print(
        f"{'gzip, keep-alive':<22} {spread([k[0] * 1000 for k in keep_alive], '{:.2f}'):>20} "
        f"{spread([k[1] * 1000 for k in keep_alive], '{:.2f}'):>18}   (kvguard only: Prometheus keeps the connection)"
    )
    print(
        f"one render after a refresh, in-process, best of 30: observation + families {observe * 1000:.2f} ms; "
        f"encoding them {ours * 1000:.2f} ms against the library's generate_latest {library * 1000:.2f} ms "
        f"({ours / library:.2f}x)"
    )
    print(f"goal: median and p99 each <= {GOAL_RATIO:g}x the bare client's: " + ("met" if ok else "MISSED"))


if __name__ == "__main__":
    main()
