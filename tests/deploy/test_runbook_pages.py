"""The runbook a person can open (issue 34): one source, the shipped rules' thresholds, pages that load.

dashboards/runbook.template.md is the text; dashboards/runbook.py fills it with the rules' defaults for the
packaged copy (the sidecar's /runbook) and docs/runbook.md, and keeps the placeholders for the chart,
which fills them from its prometheusRule values. The chart serves the pages itself (templates/runbook.yaml):
here its rendered ConfigMap is laid out in a folder and served by the very command its Deployment runs
(Python's http.server), on loopback, and every alert's runbook_url from the rendered PrometheusRule is
fetched from it, without credentials.
"""

from __future__ import annotations

import html
import os
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import yaml
from conftest import ROOT
from monitoring import rules_generator
from test_attach_upstream import validate_core
from test_helm_chart import CLUSTER, only, render

sys.path.insert(0, os.path.join(ROOT, "dashboards"))
import runbook  # noqa: E402  (dashboards/runbook.py)

RULES = rules_generator()
ALERTS = [alert.name for alert in RULES.ALERTS]


def test_the_committed_copies_are_what_the_generator_writes():
    assert runbook.main(["--check"]) == 0


def test_every_alert_has_a_section_and_its_for_in_the_template():
    text = open(runbook.TEMPLATE, encoding="utf-8").read()
    sections = re.findall(r"^## (\S+)$", text, flags=re.M)
    assert sections == ALERTS
    for alert in RULES.ALERTS:
        if alert.for_ is not None:
            assert f"${{for.{alert.name}}}" in text, alert.name


def test_every_threshold_the_rules_compare_against_is_in_the_runbook():
    text = open(runbook.TEMPLATE, encoding="utf-8").read()
    for name in RULES.DEFAULTS["thresholds"]:
        assert f"${{thresholds.{name}}}" in text, name


def test_the_packaged_runbook_says_the_shipped_rules_numbers():
    packaged = open(runbook.PACKAGED, encoding="utf-8").read()
    alerts = {
        rule["alert"]: rule
        for group in yaml.safe_load(
            open(os.path.join(ROOT, "dashboards", "rules", "kvguard-alerts.yaml"), encoding="utf-8")
        )["groups"]
        for rule in group["rules"]
    }
    section = dict(re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", packaged, flags=re.M | re.S))
    assert "> 0.3" in alerts["KVGuardFragmentationHigh"]["expr"]
    assert "kvguard_allocator_fragmentation_ratio > 0.3" in section["KVGuardFragmentationHigh"]
    assert "< 0.05" in alerts["KVGuardHeadroomLow"]["expr"] and "0.05" in section["KVGuardHeadroomLow"]
    for name, rule in alerts.items():
        if "for" in rule:
            assert f"for {rule['for']}" in section[name].replace("For ", "for "), name


def test_a_config_of_ones_own_changes_the_text():
    filled = runbook.fill(
        open(runbook.TEMPLATE, encoding="utf-8").read(),
        {"thresholds": {"headroomRatio": 0.08}, "for": {"KVGuardExporterDown": "7m"}},
    )
    assert "a share of 0.08 of its device" in filled and "For 7m Prometheus" in filled


def test_the_docs_copy_links_resolve_from_docs():
    text = open(runbook.DOCS, encoding="utf-8").read()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert os.path.exists(os.path.join(ROOT, "docs", target)), target


# ---------------------------------------------------------------------- the chart's pages


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serve(docs: list[dict], folder) -> tuple[subprocess.Popen, int]:
    """The rendered ConfigMap in a folder, served by the Deployment's own command on loopback."""
    pages = only([d for d in docs if d["metadata"]["name"].endswith("-runbook")], "ConfigMap")["data"]
    for name, content in pages.items():
        (folder / name).write_text(content, encoding="utf-8")
    deployment = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-runbook")][0]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    command = list(container["command"])
    mount = container["volumeMounts"][0]["mountPath"]
    port = _free_port()
    command[command.index(str(container["ports"][0]["containerPort"]))] = str(port)
    command[command.index(mount)] = str(folder)
    assert command[:3] == ["python", "-m", "http.server"]
    process = subprocess.Popen(
        [sys.executable, *command[1:], "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return process, port
        except OSError:
            time.sleep(0.1)
    process.kill()
    pytest.fail("the runbook server did not start")


def _alerts(docs: list[dict]) -> dict[str, dict]:
    rule = only(docs, "PrometheusRule")
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}


@pytest.fixture(scope="module")
def cluster_docs():
    return render(None, *CLUSTER)


def test_every_alerts_runbook_link_opens_its_own_section_without_credentials(cluster_docs, tmp_path):
    process, port = _serve(cluster_docs, tmp_path)
    try:
        alerts = _alerts(cluster_docs)
        assert sorted(alerts) == sorted(ALERTS)
        for name, rule in alerts.items():
            url = urllib.parse.urlsplit(rule["annotations"]["runbook_url"])
            assert url.scheme == "http" and not url.username and not url.password
            assert url.hostname == "kv-kvguard-runbook.serving.svc"  # the runbook Service, no sidecar
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{url.path}", timeout=10) as answer:
                assert answer.status == 200
                page = html.unescape(answer.read().decode())
            assert f"<title>kvguard runbook: {name}</title>" in page
            assert f"## {name}\n" in page and "**Means.**" in page
    finally:
        process.kill()
        process.wait()


def test_the_exporter_down_link_is_not_on_an_exporter(cluster_docs):
    url = _alerts(cluster_docs)["KVGuardExporterDown"]["annotations"]["runbook_url"]
    assert "$labels" not in url and "{{" not in url and ":10240" not in url
    service = [d for d in cluster_docs if d["kind"] == "Service" and d["metadata"]["name"] == "kv-kvguard-runbook"][0]
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "runbook"


def test_the_pages_say_the_releases_own_thresholds(tmp_path):
    docs = render(
        None,
        *CLUSTER,
        "--set-json",
        "prometheusRule.thresholds.headroomRatio=0.08",
        "--set",
        "prometheusRule.for.KVGuardHeadroomLow=20m",
    )
    rule = _alerts(docs)["KVGuardHeadroomLow"]
    assert "< 0.08" in rule["expr"] and rule["for"] == "20m"
    process, port = _serve(docs, tmp_path)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/kvguardheadroomlow.html", timeout=10) as answer:
            page = html.unescape(answer.read().decode())
    finally:
        process.kill()
        process.wait()
    assert "For 20m the headroom" in page and "a share of 0.08 of its device" in page


def test_the_runbook_server_is_a_valid_locked_down_deployment(cluster_docs):
    deployment = [d for d in cluster_docs if d["kind"] == "Deployment"][0]
    validate_core("Deployment", {"spec": deployment["spec"]}, "apps/v1")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_the_runbook_image_is_the_python_the_kvguard_image_builds_on():
    dockerfile = open(os.path.join(ROOT, "Dockerfile"), encoding="utf-8").read()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", dockerfile, flags=re.M).group(1)
    values = yaml.safe_load(open(os.path.join(ROOT, "helm", "kvguard", "values.yaml"), encoding="utf-8"))
    assert f"{values['runbook']['image']['repository']}:{values['runbook']['image']['tag']}" == base


def test_without_the_pages_the_links_fall_back_as_before():
    docs = render(None, *CLUSTER, "--set", "runbook.enabled=false")
    assert not [d for d in docs if d["metadata"]["name"].endswith("-runbook")]
    url = _alerts(docs)["KVGuardAllocatorOOMs"]["annotations"]["runbook_url"]
    assert url.endswith("/runbook{{ end }}#kvguardallocatorooms")


def test_the_dashboards_runbook_link_opens_the_pages_in_the_chart(cluster_docs):
    board = [d for d in cluster_docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")][0]
    text = next(iter(board["data"].values()))
    assert "http://${instance}/runbook" not in text
    assert '"url": "http://kv-kvguard-runbook.serving.svc/index.html"' in text
