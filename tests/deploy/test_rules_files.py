"""The Prometheus rule files under dashboards/rules/: shape, names, annotations and runbook links."""

from __future__ import annotations

import re

import pytest
from monitoring import (
    ALERTS_FILE,
    KVGUARD_METRIC,
    RECORDING_FILE,
    RUNBOOK,
    alerts,
    documented_metrics,
    load_yaml,
    recording_rules,
)

SEVERITIES = {"critical", "warning", "info"}
ALERT_NAMES = [a["alert"] for a in alerts()]


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces to '-'."""
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", markdown, flags=re.MULTILINE):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def test_rule_files_are_plain_prometheus_rule_groups_not_custom_resources():
    for path in (ALERTS_FILE, RECORDING_FILE):
        data = load_yaml(path)
        assert set(data) == {"groups"}, path
        assert all({"name", "rules"} <= set(group) for group in data["groups"]), path


def test_alert_file_holds_only_alerts_and_recording_file_only_recording_rules():
    assert all("alert" in rule for group in load_yaml(ALERTS_FILE)["groups"] for rule in group["rules"])
    assert all("record" in rule for group in load_yaml(RECORDING_FILE)["groups"] for rule in group["rules"])


def test_required_alerts_exist():
    required = {
        "KVGuardOOMRiskCritical",
        "KVGuardKVCacheOvercommitted",
        "KVGuardFragmentationHigh",
        "KVGuardHeadroomLow",
        "KVGuardAllocRetriesClimbing",
        "KVGuardSnapshotStale",
        "KVGuardExporterDown",
    }
    assert required <= set(ALERT_NAMES)


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_alert_name_is_camel_case_with_kvguard_prefix(name):
    assert re.fullmatch(r"KVGuard(?:[A-Z][a-z0-9]*|[A-Z]+(?=[A-Z][a-z]|$))+", name), name


def test_alert_names_are_unique():
    assert len(ALERT_NAMES) == len(set(ALERT_NAMES))


@pytest.mark.parametrize("alert", alerts(), ids=ALERT_NAMES)
def test_alert_has_severity_label_and_summary_description_runbook(alert):
    assert alert.get("labels", {}).get("severity") in SEVERITIES
    annotations = alert.get("annotations", {})
    for key in ("summary", "description", "runbook_url"):
        assert annotations.get(key, "").strip(), f"{alert['alert']} lacks {key}"


@pytest.mark.parametrize("alert", alerts(), ids=ALERT_NAMES)
def test_runbook_url_is_the_alerts_section_on_the_labelled_page_else_on_a_sidecars_runbook(alert):
    # #<alert> on the page the external label kvguard_runbook_url names, else on http://<host>/runbook, the
    # host a Prometheus template (the alert's instance, or a query's); dashboards/tests/kvguard-alerts.test.yaml
    # checks what promtool expands it to without the label, tests/deploy/test_runbook_links.py what Prometheus does
    # with it.
    url = alert["annotations"]["runbook_url"]
    assert re.fullmatch(
        r"\{\{ with \$externalLabels\.kvguard_runbook_url \}\}\{\{ \. \}\}\{\{ else \}\}"
        r"http://\{\{ .* \}\}/runbook\{\{ end \}\}#" + alert["alert"].lower(),
        url,
    ), url
    assert "github.com" not in url


def test_every_alert_has_a_section_in_the_packaged_runbook():
    with open(RUNBOOK, encoding="utf-8") as handle:
        anchors = github_anchors(handle.read())
    assert [a["alert"] for a in alerts() if a["alert"].lower() not in anchors] == []


def test_github_anchor_of_a_heading_drops_punctuation_and_lowers_case():
    assert github_anchors("## KVGuardOOMRiskCritical\n### Why: it's `slow`\n") == {
        "kvguardoomriskcritical",
        "why-its-slow",
    }


def test_recording_rule_names_follow_level_metric_operations():
    for rule in recording_rules():
        assert re.fullmatch(r"[a-z_]+:kvguard_[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]


def test_recording_rule_names_are_unique():
    names = [rule["record"] for rule in recording_rules()]
    assert len(names) == len(set(names))


def test_every_kvguard_metric_in_the_rules_is_in_docs_metrics():
    documented = documented_metrics()
    used = {name for rule in alerts() + recording_rules() for name in KVGUARD_METRIC.findall(rule["expr"])}
    assert used, "no kvguard metric found in the rules"
    assert used <= documented, f"not in docs/metrics.md: {sorted(used - documented)}"


def test_every_recording_rule_input_is_a_documented_metric_or_an_earlier_recording_rule():
    defined: set[str] = set()
    for rule in recording_rules():
        for name in re.findall(r"(?<![\w:])([a-z_]+:kvguard_[a-z0-9_]+:[a-z0-9_]+)", rule["expr"]):
            assert name in defined, f"{rule['record']} reads {name} before it is recorded"
        defined.add(rule["record"])
