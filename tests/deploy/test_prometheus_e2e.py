"""End to end: a real Prometheus scrapes `kvguard serve --demo` and loads the rule files; every
dashboard query, variable query and rule expression evaluates through its HTTP API.

The demo serves its simulated ranks through the real probe, spool and collector; `--source host`
adds a real device-level source (host memory, device="host"), so the device panels have data. Each demo
rank is an engine of its own with a budget-time verdict and vLLM's own /metrics (kvguard.sim.demo), which
the sidecar reads as it reads a real vLLM's: every dashboard query has data, none is excused.

Both processes run on free loopback ports with their own config and data directories, and are
stopped afterwards. Scrape and evaluation intervals are 1 s; every wait polls with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

import dashboard_lint as lint
import pytest
import yaml
from dashboard_lint import all_value
from monitoring import ALERTS_FILE, DASHBOARD, RECORDING_FILE, alerts, recording_rules
from sidecar_fixtures import free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
# Grafana's $__rate_interval: max(4 × scrape interval, step + scrape interval) = 4 s at 1 s scrapes.
RATE_INTERVAL = "4s"
RANGE_SECONDS = 20
STARTUP_DEADLINE = 60.0
# Once the stack is up (the fixture waits for it), data is there or it is not: wait briefly.
DATA_DEADLINE = 10.0

# The demo's sidecar runs as in a pod (downward API), so namespace and pod have values.
POD_ENV = {"POD_NAMESPACE": "llm", "POD_NAME": "qwen-demo-0", "CONTAINER_NAME": "kvguard"}


def poll(what: str, check, deadline_seconds: float, interval: float = 0.25):
    """check() until it returns something truthy; fail with what was last seen at the deadline."""
    deadline, last = time.monotonic() + deadline_seconds, None
    while time.monotonic() < deadline:
        try:
            result = check()
        except (OSError, urllib.error.URLError, ValueError) as exc:
            result, last = None, exc
        else:
            last = result
        if result:
            return result
        time.sleep(interval)
    pytest.fail(f"timed out waiting for {what}; last seen: {last!r}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@dataclass
class Stack:
    prometheus_url: str
    kvguard_url: str

    def api(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.prometheus_url}/api/v1/{path}?{query}", timeout=10) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:  # 400 / 422 carry the error as JSON
            return json.load(exc)

    def instant(self, expr: str) -> dict:
        return self.api("query", query=expr)

    def range(self, expr: str) -> dict:
        end = time.time()
        return self.api("query_range", query=expr, start=end - RANGE_SECONDS, end=end, step="1")


@contextlib.contextmanager
def kvguard_and_prometheus(
    work, kvguard_args: list[str], rule_files: list[str], env: dict[str, str], scrape_configs: list[dict] = ()
):
    """`kvguard serve KVGUARD_ARGS` and a real Prometheus scraping it (job "kvguard", and scrape_configs)
    every second with rule_files, on free loopback ports, logs in work/; yields their Stack once
    Prometheus is ready, and stops both afterwards. Either exiting early fails the test with its log."""
    if not os.access(PROMETHEUS, os.X_OK):
        pytest.fail("prometheus not found: ./dev.sh test installs Debian's prometheus package")
    kvguard_port, prometheus_port = free_port(), free_port()
    logs = {name: open(work / f"{name}.log", "wb") for name in ("kvguard", "prometheus")}
    kvguard = subprocess.Popen(
        [sys.executable, "-m", "kvguard", "serve", "--listen", "127.0.0.1", "--port", str(kvguard_port), *kvguard_args],
        env=env,
        stdout=logs["kvguard"],
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": list(rule_files),
        # A cluster target label, as multi-cluster setups add one: the dashboard's $cluster reads it.
        "scrape_configs": [
            {
                "job_name": "kvguard",
                "static_configs": [{"targets": [f"127.0.0.1:{kvguard_port}"], "labels": {"cluster": "e2e"}}],
            },
            *scrape_configs,
        ],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    prometheus = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{prometheus_port}",
            "--log.level=warn",
        ],
        stdout=logs["prometheus"],
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    stack = Stack(f"http://127.0.0.1:{prometheus_port}", f"http://127.0.0.1:{kvguard_port}")
    try:

        def ready() -> bool:
            for name, process in (("kvguard", kvguard), ("prometheus", prometheus)):
                if process.poll() is not None:
                    pytest.fail(
                        f"{name} exited with {process.returncode}: "
                        f"{(work / f'{name}.log').read_text(errors='replace')[-2000:]}"
                    )
            with urllib.request.urlopen(f"{stack.prometheus_url}/-/ready", timeout=2) as response:
                return response.status == 200

        poll("Prometheus to be ready", ready, STARTUP_DEADLINE)
        yield stack
    finally:
        stop(prometheus)
        stop(kvguard)
        for handle in logs.values():
            handle.close()


def serve_supports_demo() -> bool:
    result = subprocess.run(
        [sys.executable, "-m", "kvguard", "serve", "--help"],
        capture_output=True,
        text=True,
        env=kvguard_env(),
        timeout=60,
    )
    return result.returncode == 0 and "--demo" in result.stdout


def kvguard_env() -> dict[str, str]:
    return {**os.environ, **POD_ENV}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not serve_supports_demo():
        pytest.fail("`kvguard serve --demo` is not available")
    work = tmp_path_factory.mktemp("e2e")
    args = ["--demo", "--spool-dir", str(work / "spool"), "--source", "host", "--interval", "1"]
    with kvguard_and_prometheus(work, args, [RECORDING_FILE, ALERTS_FILE], env=kvguard_env()) as stack:
        # Enough scrapes for rates over $__rate_interval, and a rule evaluation after them.
        poll(
            "kvguard to be scraped 5 times",
            lambda: stack.instant('count_over_time(up{job="kvguard"}[1m]) >= 5 and up{job="kvguard"} == 1')["data"][
                "result"
            ],
            STARTUP_DEADLINE,
        )
        yield stack


def dashboard_queries() -> list[tuple[str, str, str, bool]]:
    """(panel title, refId, expression with variables at "All", instant?) for every target."""
    return [
        (
            panel["title"],
            target["refId"],
            lint.expand(target["expr"], DASHBOARD, rate_interval=RATE_INTERVAL, value=all_value),
            bool(target.get("instant")),
        )
        for panel, target in lint.targets(DASHBOARD)
    ]


QUERIES = dashboard_queries()
QUERY_IDS = [f"{title} {ref}" for title, ref, _, _ in QUERIES]


def evaluate(stack: Stack, expr: str, instant: bool) -> dict:
    return stack.instant(expr) if instant else stack.range(expr)


def test_dashboard_has_queries_to_run():
    assert len(QUERIES) >= 30


@pytest.mark.parametrize("title, ref, expr, instant", QUERIES, ids=QUERY_IDS)
def test_dashboard_query_evaluates_without_error(stack, title, ref, expr, instant):
    answer = evaluate(stack, expr, instant)
    assert answer["status"] == "success", answer.get("error")
    assert not answer.get("warnings")


@pytest.mark.parametrize("title, ref, expr, instant", QUERIES, ids=QUERY_IDS)
def test_dashboard_query_has_data(stack, title, ref, expr, instant):
    poll(f"data for {title} {ref}: {expr}", lambda: evaluate(stack, expr, instant)["data"]["result"], DATA_DEADLINE)


def test_the_kv_cache_usage_comes_from_each_demo_engines_vllm_metrics(stack):
    # One series per demo rank, each its own engine (engine = rank), read from the demo's simulated vLLM.
    found = poll(
        "kvguard_kv_cache_usage_ratio per engine",
        lambda: stack.instant('kvguard_kv_cache_usage_ratio{job="kvguard"}')["data"]["result"],
        DATA_DEADLINE,
    )
    assert {(r["metric"]["rank"], r["metric"]["engine"]) for r in found} == {("0", "0"), ("1", "1")}
    assert all(0 <= float(r["value"][1]) <= 1 for r in found)


@pytest.mark.parametrize(
    "variable", [v for v in lint.variables(DASHBOARD) if v["type"] == "query"], ids=lambda v: v["name"]
)
def test_variable_query_finds_values(stack, variable):
    # label_values(selector, label) is Grafana's /api/v1/label/<label>/values?match[]=selector.
    selector, label = lint.split_arguments(variable["query"][len("label_values(") : -1])
    selector = lint.expand(selector, DASHBOARD, value=all_value)
    answer = poll(
        f"values of ${variable['name']}",
        lambda: stack.api(f"label/{label}/values", **{"match[]": selector})["data"],
        DATA_DEADLINE,
    )
    assert answer


def test_alerts_annotation_query_evaluates(stack):
    expr = lint.expand(DASHBOARD["annotations"]["list"][0]["expr"], DASHBOARD, value=all_value)
    assert stack.range(expr)["status"] == "success"


def loaded_rules(stack: Stack) -> list[dict]:
    return [rule for group in stack.api("rules")["data"]["groups"] for rule in group["rules"]]


def test_prometheus_loaded_every_rule(stack):
    names = {rule["name"] for rule in loaded_rules(stack)}
    assert names == {a["alert"] for a in alerts()} | {r["record"] for r in recording_rules()}


def test_every_rule_is_healthy(stack):
    def all_evaluated():
        rules = loaded_rules(stack)
        return rules if all(rule["health"] != "unknown" for rule in rules) else None

    unhealthy = {
        rule["name"]: rule.get("lastError")
        for rule in poll("every rule evaluated", all_evaluated, 30)
        if rule["health"] != "ok"
    }
    assert not unhealthy


@pytest.mark.parametrize("rule", alerts() + recording_rules(), ids=lambda r: r.get("alert") or r["record"])
def test_rule_expression_evaluates_without_error(stack, rule):
    answer = stack.instant(rule["expr"])
    assert answer["status"] == "success", answer.get("error")


@pytest.mark.parametrize("record", [r["record"] for r in recording_rules()])
def test_recording_rule_records_series(stack, record):
    poll(f"series of {record}", lambda: stack.instant(record)["data"]["result"], DATA_DEADLINE)


def test_the_demos_tripping_rank_makes_oom_risk_critical_pending_or_firing(stack):
    # The demo's last rank turns critical within seconds of each start (docs: `kvguard serve --demo`).
    def oom_risk():
        return [
            a for a in stack.api("alerts")["data"]["alerts"] if a["labels"]["alertname"] == "KVGuardOOMRiskCritical"
        ]

    found = poll("KVGuardOOMRiskCritical", oom_risk, DATA_DEADLINE)
    assert {a["labels"]["namespace"] for a in found} == {"llm"}
