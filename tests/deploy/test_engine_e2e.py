"""A multi-node engine reads as one engine in a real Prometheus.

DeepSeek-V3 at tensor-parallel 16 spans two pods (an LWS group: ranks 0-7 on the leader pod ds-0,
8-15 on the worker pod ds-0-1). Each pod has its own sidecar reading its own spool, both started with
KVGUARD_ENGINE_ID=ds-0 as the chart's LWS example sets it. Beside it, a TP8 engine on one pod (ds-1)
whose sidecar names no engine: its engine is its pod. A real Prometheus (Debian's) scrapes the three
sidecars every second with kvguard's recording rules and alerts loaded, and the engine rules must
count ds-0's blocks once (vLLM gives every rank the minimum over its workers, kv_cache_utils.py
0.11.0:1283-1289), take its least headroom from the worker pod's weakest rank, and its worst state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest
import yaml
from monitoring import ALERTS_FILE, RECORDING_FILE
from sidecar_fixtures import GIB, free_port, snapshot, write
from test_prometheus_e2e import PROMETHEUS, STARTUP_DEADLINE, poll, stop

ENGINE_LABELS = {"job": "kvguard", "namespace": "llm", "model_name": "deepseek-v3", "engine": "0"}
DS0_BLOCKS, DS1_BLOCKS = 1000, 1200
# (pod, KVGUARD_ENGINE_ID for its sidecar, ranks, KV blocks per rank)
PODS = (
    ("ds-0", "ds-0", range(0, 8), DS0_BLOCKS),
    ("ds-0-1", "ds-0", range(8, 16), DS0_BLOCKS),
    ("ds-1", "", range(0, 8), DS1_BLOCKS),
)
WEAKEST_RANK = 12  # on the worker pod: its allocator holds 6 GiB more than its peers'


def rank_snapshot(pod: str, rank: int, blocks: int):
    base = snapshot(
        rank,
        device=f"npu:{rank % 8}",
        pid=1000 + rank,
        kv_blocks=blocks,
        pod={"pod": pod, "namespace": "llm", "container": "vllm"},
    )
    if rank == WEAKEST_RANK and pod == "ds-0-1":
        memory = base.memory
        base = snapshot(
            rank,
            device=f"npu:{rank % 8}",
            pid=1000 + rank,
            kv_blocks=blocks,
            reserved=memory.reserved_bytes + 6 * GIB,
            pod={"pod": pod, "namespace": "llm", "container": "vllm"},
        )
    return dataclasses.replace(base, model_name="deepseek-v3", engine="0")


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


@contextlib.contextmanager
def three_sidecars_and_prometheus(work):
    if not os.access(PROMETHEUS, os.X_OK):
        pytest.fail("prometheus not found: ./dev.sh test installs Debian's prometheus package")
    processes, logs, targets = [], [], []
    try:
        for pod, engine_id, ranks, blocks in PODS:
            spool = work / pod
            spool.mkdir()
            write(str(spool), *(rank_snapshot(pod, rank, blocks) for rank in ranks))
            port = free_port()
            env = {
                **os.environ,
                "POD_NAME": pod,
                "POD_NAMESPACE": "llm",
                "CONTAINER_NAME": "vllm",
                "KVGUARD_ENGINE_ID": engine_id,
            }
            log = open(work / f"{pod}.log", "wb")
            logs.append(log)
            processes.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "kvguard",
                        "serve",
                        "--listen",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--spool-dir",
                        str(spool),
                        "--source",
                        "none",
                        "--interval",
                        "1",
                        "--stale-after",
                        "600",
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            targets.append(f"127.0.0.1:{port}")
        prometheus_port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [RECORDING_FILE, ALERTS_FILE],
            "scrape_configs": [{"job_name": "kvguard", "honor_labels": True, "static_configs": [{"targets": targets}]}],
        }
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        log = open(work / "prometheus.log", "wb")
        logs.append(log)
        processes.append(
            subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={work / 'prometheus.yml'}",
                    f"--storage.tsdb.path={work / 'data'}",
                    f"--web.listen-address=127.0.0.1:{prometheus_port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        yield f"http://127.0.0.1:{prometheus_port}", [f"http://{t}" for t in targets]
    finally:
        for process in reversed(processes):
            stop(process)
        for log in logs:
            log.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("engines")
    with three_sidecars_and_prometheus(work) as (prometheus, sidecars):

        def query(expr: str) -> dict:
            url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
            return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in get_json(url)["data"]["result"]}

        # Every sidecar scraped, and the namespace rule (the last to evaluate) has both engines in it.
        poll("three sidecars up", lambda: len(query('up{job="kvguard"} == 1')) == 3, STARTUP_DEADLINE)
        poll(
            "the engine rules over both engines",
            lambda: (
                list(query("namespace:kvguard_kv_cache_allocated_blocks:sum").values()) == [DS0_BLOCKS + DS1_BLOCKS]
                or None
            ),
            STARTUP_DEADLINE,
        )
        # Every rule group has evaluated over all three sidecars (groups run on their own schedules).
        poll(
            "every rule over every pod",
            lambda: (
                all(
                    len(query(f"count by (pod) ({metric})")) == 3
                    for metric in ("namespace_pod:kvguard_kv_cache_allocated_blocks:min", "kvguard_guard_severity")
                )
                and all(
                    len(query(rule)) == 2
                    for rule in (
                        "namespace_engine:kvguard_guard_headroom_bytes:min",
                        "namespace_engine:kvguard_guard_headroom_ratio:min",
                        "namespace_engine:kvguard_guard_severity:max",
                        "namespace_engine:kvguard_ranks:count",
                    )
                )
                and sorted(query("namespace_engine:kvguard_ranks:count").values()) == [8, 16]
                or None
            ),
            STARTUP_DEADLINE,
        )
        yield query, sidecars


def by_engine(result: dict) -> dict[str, float]:
    engines = {}
    for labels, value in result.items():
        labels = dict(labels)
        engine_id = labels.pop("engine_id")
        labels.pop("__name__", None)
        labels.pop("budget", None)
        assert labels == ENGINE_LABELS
        engines[engine_id] = value
    return engines


def test_a_two_pod_engine_has_its_blocks_counted_once_beside_a_second_engine(stack):
    query, _ = stack
    assert by_engine(query("namespace_engine:kvguard_kv_cache_allocated_blocks:min")) == {
        "ds-0": DS0_BLOCKS,
        "ds-1": DS1_BLOCKS,
    }
    # Per pod, the two-pod engine would count twice.
    assert sum(query("namespace_pod:kvguard_kv_cache_allocated_blocks:min").values()) == 2 * DS0_BLOCKS + DS1_BLOCKS


def test_every_rank_of_both_pods_counts_toward_one_engine(stack):
    query, _ = stack
    assert by_engine(query("namespace_engine:kvguard_ranks:count")) == {"ds-0": 16, "ds-1": 8}


def test_the_engines_least_headroom_is_its_weakest_rank_on_the_worker_pod(stack):
    query, sidecars = stack
    # What each sidecar's guard says per rank: the oracle the rule aggregates.
    guards = {pod: get_json(f"{url}/guard") for (pod, _, _, _), url in zip(PODS, sidecars)}
    headroom = {(pod, int(r["rank"])): r["headroom_bytes"] for pod, g in guards.items() for r in g["ranks"]}
    weakest = min(headroom[("ds-0-1", rank)] for rank in range(8, 16))
    leader = min(headroom[("ds-0", rank)] for rank in range(8))
    assert headroom[("ds-0-1", WEAKEST_RANK)] == weakest < leader
    engines = by_engine(query("namespace_engine:kvguard_guard_headroom_bytes:min"))
    assert engines == {"ds-0": weakest, "ds-1": min(headroom[("ds-1", rank)] for rank in range(8))}


def test_the_engines_state_is_its_worst_ranks(stack):
    query, sidecars = stack
    severity = {"ok": 0, "warning": 1, "critical": 2}
    worst = {
        engine: max(
            severity[r["state"]]
            for (pod, engine_id, _, _), url in zip(PODS, sidecars)
            if (engine_id or pod) == engine
            for r in get_json(f"{url}/guard")["ranks"]
        )
        for engine in ("ds-0", "ds-1")
    }
    assert by_engine(query("namespace_engine:kvguard_guard_severity:max")) == worst


def test_each_rank_series_names_its_engine(stack):
    query, _ = stack
    pods_of = {}
    for labels, _ in query("kvguard_guard_severity").items():
        labels = dict(labels)
        pods_of.setdefault(labels["engine_id"], set()).add(labels["pod"])
    assert pods_of == {"ds-0": {"ds-0", "ds-0-1"}, "ds-1": {"ds-1"}}


@pytest.mark.parametrize(
    "title, rule",
    [
        ("Engine KV-cache blocks", "namespace_engine:kvguard_kv_cache_allocated_blocks:min"),
        ("Engine headroom (weakest rank)", "namespace_engine:kvguard_guard_headroom_ratio:min"),
        ("Engine state", "namespace_engine:kvguard_guard_severity:max"),
    ],
)
def test_the_dashboards_engine_panels_read_what_the_engine_rules_record(stack, title, rule):
    import dashboard_lint as lint
    from dashboard_lint import all_value
    from monitoring import DASHBOARD

    query, _ = stack
    panel = next(p for p in lint.all_panels(DASHBOARD) if p.get("title") == title)
    expr = lint.expand(panel["targets"][0]["expr"], DASHBOARD, value=all_value)
    panel_values = {dict(labels)["engine_id"]: value for labels, value in query(expr).items()}
    assert panel_values == by_engine(query(rule))
