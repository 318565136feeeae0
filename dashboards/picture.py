#!/usr/bin/env python3
"""Draw what the Grafana dashboard shows for the demo: every panel's queries, run against a real Prometheus.

    python dashboards/picture.py                       a 150-second demo run into docs/dashboard-demo.png
    python dashboards/picture.py --seconds 20 --output /tmp/board.png

No Grafana runs here, so this stands in for one: it starts `kvguard serve --demo` (simulated ranks through
the real probe, spool and collector, plus the host source) and Prometheus scraping it every second with
the shipped recording rules, waits --seconds, then asks Prometheus for each panel's targets of
dashboards/kvguard.json over the run, with every variable at "All" (its allValue) and $__rate_interval at
4 s (Grafana's: 4 x the 1 s scrape), and draws the panels where the dashboard's grid puts them: time series
as lines, stat panels as their last values. Prometheus is `prometheus` on PATH or /usr/bin/prometheus.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DASHBOARD = os.path.join(HERE, "kvguard.json")
RECORDING = os.path.join(HERE, "rules", "kvguard-recording.yaml")
OUTPUT = os.path.join(ROOT, "docs", "dashboard-demo.png")
RATE_INTERVAL = "4s"
DPI = 60
ROW_INCHES = 0.42  # per grid row (Grafana's rows are 30 px; a column is 1/24 of the 24-inch width)
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def panels(dashboard: dict) -> list[dict]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found += panel.get("panels", [])  # a collapsed row keeps its panels inside
    return [p for p in found if p["type"] != "row"]


def expand(expr: str, dashboard: dict) -> str:
    """expr with each variable at "All" (its allValue) and Grafana's $__rate_interval."""
    values = {v["name"]: v.get("allValue") or ".*" for v in dashboard["templating"]["list"]}
    values["__rate_interval"] = RATE_INTERVAL

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise ValueError(f"unknown variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(value, expr)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.load(answer)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextlib.contextmanager
def demo_and_prometheus(work: str):
    """`kvguard serve --demo` and Prometheus scraping it every second; yields Prometheus' URL once ready."""
    prometheus_binary = shutil.which("prometheus") or "/usr/bin/prometheus"
    kvguard_port, prometheus_port = _free_port(), _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(ROOT, "exporter"), os.environ.get("PYTHONPATH")])),
        "POD_NAME": "vllm-demo-0",
        "POD_NAMESPACE": "demo",
        "CONTAINER_NAME": "vllm",
    }
    log = open(os.path.join(work, "processes.log"), "wb")
    kvguard = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvguard",
            "serve",
            "--demo",
            "--listen",
            "127.0.0.1",
            "--port",
            str(kvguard_port),
            "--spool-dir",
            os.path.join(work, "spool"),
            "--source",
            "host",
            "--interval",
            "1",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [RECORDING],
        "scrape_configs": [
            {
                "job_name": "kvguard",
                "static_configs": [
                    {"targets": [f"127.0.0.1:{kvguard_port}"], "labels": {"namespace": "demo", "pod": "vllm-demo-0"}}
                ],
            }
        ],
    }
    with open(os.path.join(work, "prometheus.yml"), "w", encoding="utf-8") as handle:
        yaml.safe_dump(config, handle)
    prometheus = subprocess.Popen(
        [
            prometheus_binary,
            f"--config.file={os.path.join(work, 'prometheus.yml')}",
            f"--storage.tsdb.path={os.path.join(work, 'data')}",
            f"--web.listen-address=127.0.0.1:{prometheus_port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{prometheus_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            for name, process in (("kvguard", kvguard), ("prometheus", prometheus)):
                if process.poll() is not None:
                    raise SystemExit(f"{name} exited with {process.returncode}; see {log.name}")
            with contextlib.suppress(OSError):
                if _get(f"{url}/api/v1/query?query=up")["data"]["result"]:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"Prometheus did not scrape kvguard within 60 s; see {log.name}")
            time.sleep(0.5)
        yield url
    finally:
        _stop(prometheus)
        _stop(kvguard)
        log.close()


def series_of(url: str, dashboard: dict, start: float, end: float) -> dict[int, list[tuple[str, list, list]]]:
    """Per panel id: (legend, times, values) of every series its targets return over [start, end]."""
    drawn = {}
    for panel in panels(dashboard):
        lines = []
        for target in panel.get("targets", []):
            query = urllib.parse.urlencode(
                {"query": expand(target["expr"], dashboard), "start": start, "end": end, "step": "1"}
            )
            answer = _get(f"{url}/api/v1/query_range?{query}")
            if answer.get("status") != "success":
                raise SystemExit(f"{panel['title']}: {answer.get('error')}")
            for result in answer["data"]["result"]:
                legend = re.sub(
                    r"\{\{\s*(\w+)\s*\}\}",
                    lambda m: result["metric"].get(m.group(1), ""),
                    target.get("legendFormat") or str(result["metric"]),
                )
                times = [float(t) - start for t, _ in result["values"]]
                values = [float(v) for _, v in result["values"]]
                lines.append((legend, times, values))
        drawn[panel["id"]] = lines
    return drawn


def _scaled(panel: dict, values: list[float]) -> tuple[list[float], str]:
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
    if unit in ("bytes", "decbytes"):
        return [v / 2**30 for v in values], "GiB"
    if unit == "percentunit":
        return [v * 100 for v in values], "%"
    return values, unit if unit not in ("none", "short") else ""


def draw(dashboard: dict, drawn: dict, seconds: float, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = panels(dashboard)
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"] + shown)
    figure = plt.figure(figsize=(24, bottom * ROW_INCHES))
    figure.suptitle(
        f"{dashboard['title']}: kvguard serve --demo, {seconds:.0f} s scraped every second by "
        "Prometheus (every variable at All)",
        fontsize=14,
        y=0.999,
    )
    for panel in shown:
        grid = panel["gridPos"]
        axes = figure.add_axes(
            [
                grid["x"] / 24 + 0.004,
                1 - (grid["y"] + grid["h"]) / bottom + 0.004,
                grid["w"] / 24 - 0.008,
                grid["h"] / bottom - 0.012,
            ]
        )
        axes.set_title(panel["title"], fontsize=9, loc="left")
        lines = drawn.get(panel["id"], [])
        if not lines:
            axes.text(0.5, 0.5, "No data", ha="center", va="center", color="grey", transform=axes.transAxes)
            axes.set_xticks([])
            axes.set_yticks([])
        elif panel["type"] == "stat":
            axes.set_axis_off()
            text = []
            for legend, _, values in lines[:6]:
                scaled, unit = _scaled(panel, values[-1:])
                text.append(f"{legend[:40]}: {scaled[0]:.3g} {unit}".rstrip())
            if len(lines) > 6:
                text.append(f"... {len(lines) - 6} more")
            axes.text(0.02, 0.9, "\n".join(text), va="top", fontsize=8, transform=axes.transAxes, family="monospace")
        else:
            for legend, times, values in lines:
                scaled, unit = _scaled(panel, values)
                axes.plot(times, scaled, label=legend[:48], linewidth=1)
            axes.set_ylabel(unit, fontsize=8)
            axes.tick_params(labelsize=7)
            if len(lines) <= 8:
                axes.legend(fontsize=6, loc="upper left")
    figure.savefig(output, dpi=DPI)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150.0, help="how long the demo runs (default 150)")
    parser.add_argument("--output", default=OUTPUT, help=f"the PNG to write (default {os.path.relpath(OUTPUT, ROOT)})")
    args = parser.parse_args(argv)
    with open(DASHBOARD, encoding="utf-8") as handle:
        dashboard = json.load(handle)
    with tempfile.TemporaryDirectory(prefix="kvguard-picture-") as work, demo_and_prometheus(work) as url:
        start = time.time()
        time.sleep(args.seconds)
        drawn = series_of(url, dashboard, start, time.time())
    draw(dashboard, drawn, args.seconds, args.output)
    empty = [p["title"] for p in panels(dashboard) if not drawn[p["id"]]]
    print(
        f"wrote {args.output}: {len(drawn) - len(empty)} of {len(drawn)} panels with data"
        + (f"; no data: {', '.join(empty)}" if empty else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
