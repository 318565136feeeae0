"""The chart as operators install it: one copy of what is cluster-wide, real defaults, and the
conventions (alert overrides, listen, NetworkPolicy, the serving container's limits, one container
label), rendered with the real helm."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from conftest import ROOT
from monitoring import DASHBOARD_JSON, RULES_DIR, rules_generator
from test_helm_chart import (
    CHART,
    CLUSTER,
    CLUSTER_WITHOUT_PAGES,
    IMAGE,
    SCHEMA_ERROR,
    env_of,
    flag_values,
    helm,
    kvguard_container,
    only,
    pod_spec,
    prometheus_rule,
    render,
    rule_groups,
    serving_container,
)

OWN_RULE_FILES = [os.path.join(RULES_DIR, name) for name in ("kvguard-recording.yaml", "kvguard-alerts.yaml")]


def release(name: str, namespace: str, *extra: str) -> list[dict]:
    result = helm("template", name, CHART, "--namespace", namespace, *extra)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def dashboards(docs: list[dict]) -> list[tuple[str, dict]]:
    return [(key, json.loads(text)) for d in docs if d["kind"] == "ConfigMap" for key, text in d["data"].items()]


# ----------------------------------------------------------- real defaults (item 4)


def test_a_default_install_fails_only_for_the_image_the_readme_explains():
    result = helm("template", "kv", CHART, "--namespace", "serving")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "image.repository is required" in errors[0], result.stderr
    assert "Dockerfile" in errors[0] and 'README, "Install"' in errors[0]
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        readme = handle.read()
    assert "docker build -t" in readme and "--set image.repository=" in readme


def test_the_cluster_release_needs_no_image():
    docs = release("kvguard", "monitoring", *CLUSTER)
    kinds = sorted(d["kind"] for d in docs)
    # the PodMonitor: attached workloads; the ConfigMap, Deployment and Service beside the dashboard's
    # ConfigMap: the runbook pages (templates/runbook.yaml), served from a public Python image
    assert kinds == ["ConfigMap", "ConfigMap", "Deployment", "PodMonitor", "PrometheusRule", "Service"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    assert [c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]] == ["python:3.11-slim"]
    assert sorted(d["kind"] for d in release("kvguard", "monitoring", *CLUSTER_WITHOUT_PAGES)) == [
        "ConfigMap",
        "PodMonitor",
        "PrometheusRule",
    ]


# ------------------------------------------------- one copy of what is cluster-wide (item 3)


def test_two_releases_beside_the_cluster_one_yield_one_dashboard_and_one_rule_set():
    beside = (
        release("qwen", "serving", *IMAGE)
        + release("llama", "serving", *IMAGE)
        + release("gpus", "monitoring", *IMAGE, "--set", "mode=daemonset")
    )
    docs = release("kvguard", "monitoring", *CLUSTER_WITHOUT_PAGES) + beside
    assert [(key, board["uid"]) for key, board in dashboards(docs)] == [("kvguard.json", "kvguard")]
    rules = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert [r["metadata"]["name"] for r in rules] == ["kvguard"]
    assert rules[0]["spec"]["groups"] == rule_groups(open(p).read() for p in OWN_RULE_FILES)
    # and one copy of the runbook pages, the cluster release's
    pages = [
        d["metadata"]["name"]
        for d in release("kvguard", "monitoring", *CLUSTER) + beside
        if d["metadata"]["name"].endswith("-runbook")
    ]
    assert sorted(pages) == ["kvguard-runbook"] * 3  # its ConfigMap, Deployment and Service


def test_per_release_copies_have_their_own_key_uid_and_title_and_the_same_panels():
    with open(DASHBOARD_JSON, encoding="utf-8") as handle:
        committed = json.load(handle)
    copies = dashboards(
        release("qwen", "serving", *IMAGE, "--set", "dashboard.enabled=true")
        + release("llama", "serving", *IMAGE, "--set", "dashboard.enabled=true")
        + release("qwen", "other", *IMAGE, "--set", "dashboard.enabled=true")
    )
    keys = [key for key, _ in copies]
    uids = [board["uid"] for _, board in copies]
    titles = [board["title"] for _, board in copies]
    assert len(set(keys)) == len(set(uids)) == len(set(titles)) == 3
    assert keys[0] == "kvguard-serving-qwen-kvguard.json"
    assert all(len(uid) <= 40 and uid != "kvguard" for uid in uids)  # Grafana's uid limit
    assert titles[0] == f"{committed['title']} (serving/qwen-kvguard)"
    for _, board in copies:
        assert {k: v for k, v in board.items() if k not in ("uid", "title")} == {
            k: v for k, v in committed.items() if k not in ("uid", "title")
        }


def test_per_release_rules_are_named_after_the_release():
    names = {
        prometheus_rule(release(name, "serving", *IMAGE, "--set", "prometheusRule.enabled=true"))["metadata"]["name"]
        for name in ("qwen", "llama")
    }
    assert names == {"qwen-kvguard", "llama-kvguard"}


# ------------------------------------------------------ alert overrides (item 5)

OVERRIDES = {
    "additionalRuleLabels": {"team": "llm-serving", "cluster": "eu-1"},
    "disabled": {"KVGuardFragmentationHigh": True, "KVGuardSourceDown": False},
    "customRules": {"KVGuardHeadroomLow": {"severity": "critical"}},
}


def test_alert_overrides_render_as_the_generator_writes_them(tmp_path):
    path = tmp_path / "overrides.yaml"
    path.write_text(yaml.safe_dump({"prometheusRule": OVERRIDES}))
    docs = render(None, *CLUSTER_WITHOUT_PAGES, "-f", str(path))
    written = rules_generator().outputs(OVERRIDES, output_dir=RULES_DIR, chart=False)
    assert prometheus_rule(docs)["spec"]["groups"] == rule_groups(written[p] for p in OWN_RULE_FILES)


def test_alert_overrides_label_disable_and_reseverity_exactly_what_they_name(tmp_path):
    path = tmp_path / "overrides.yaml"
    path.write_text(yaml.safe_dump({"prometheusRule": OVERRIDES}))
    alerts = {
        r["alert"]: r
        for g in prometheus_rule(render(None, *CLUSTER, "-f", str(path)))["spec"]["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    default = {
        r["alert"]: r
        for g in prometheus_rule(render(None, *CLUSTER))["spec"]["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    assert set(default) - set(alerts) == {"KVGuardFragmentationHigh"}
    for name, alert in alerts.items():
        severity = "critical" if name == "KVGuardHeadroomLow" else default[name]["labels"]["severity"]
        assert alert["labels"] == {"severity": severity, "team": "llm-serving", "cluster": "eu-1"}, name
        assert {k: v for k, v in alert.items() if k != "labels"} == {
            k: v for k, v in default[name].items() if k != "labels"
        }


@pytest.mark.parametrize(
    "setting",
    [
        "prometheusRule.disabled.KVGuardNoSuchAlert=true",
        "prometheusRule.customRules.KVGuardHeadroomLow.severity=Page Me",
        "prometheusRule.customRules.KVGuardHeadroomLow.for=5m",
        "prometheusRule.additionalRuleLabels.severity=critical",
        "prometheusRule.additionalRuleLabels.bad-label=x",
    ],
)
def test_bad_alert_overrides_are_refused_by_the_schema(setting):
    result = helm("template", "kv", CHART, *IMAGE, "--set", setting)
    assert result.returncode != 0 and SCHEMA_ERROR in result.stderr, result.stderr


# --------------------------------------------------------------- conventions (item 5)


def test_listen_is_a_value_and_ipv6_passes_through():
    assert flag_values(kvguard_container(render()), "--listen") == ["0.0.0.0"]
    docs = render("ci/sidecar-networkpolicy-ipv6-values.yaml")
    assert flag_values(kvguard_container(docs), "--listen") == ["[::]"]
    assert flag_values(kvguard_container(docs), "--log.format") == ["json"]


def test_the_network_policy_admits_only_the_named_peers_to_kvguard_and_anyone_to_vllm():
    docs = render("ci/sidecar-networkpolicy-ipv6-values.yaml")
    policy = only(docs, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == only(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    metrics, serving = policy["spec"]["ingress"]
    assert metrics["ports"] == [{"port": 10240, "protocol": "TCP"}]
    assert metrics["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    assert serving == {"ports": [{"port": 8000, "protocol": "TCP"}]}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert not [d for d in render() if d["kind"] == "NetworkPolicy"]


def test_the_serving_container_has_a_memory_limit_and_no_privilege_escalation():
    serving = serving_container(render())
    assert serving["resources"]["limits"]["memory"] and serving["resources"]["requests"]["memory"]
    assert serving["securityContext"]["allowPrivilegeEscalation"] is False
    assert serving["securityContext"]["capabilities"]["drop"] == ["ALL"]


@pytest.mark.parametrize("kind", ["PodMonitor", "ServiceMonitor"])
def test_every_series_names_the_serving_container(kind):
    # up{} takes the target's container (kvguard's port's container) unless relabelled; the rank and
    # device series carry CONTAINER_NAME through honorLabels. Both must say the serving container.
    docs = render(None, "--set", f"monitor.kind={kind}")
    monitor = only(docs, kind)
    endpoint = (monitor["spec"].get("podMetricsEndpoints") or monitor["spec"]["endpoints"])[0]
    relabel = [r for r in endpoint["relabelings"] if r.get("targetLabel") == "container"]
    assert relabel == [{"action": "replace", "targetLabel": "container", "replacement": "vllm"}]
    assert env_of(kvguard_container(docs))["CONTAINER_NAME"]["value"] == "vllm"


def test_vllm_plugins_without_kvguard_is_refused_and_with_it_accepted():
    refused = helm(
        "template",
        "kv",
        CHART,
        *IMAGE,
        "--set",
        "serving.env[0].name=VLLM_PLUGINS",
        "--set",
        "serving.env[0].value=lora_resolver",
    )
    assert refused.returncode != 0 and 'VLLM_PLUGINS="lora_resolver" without kvguard' in refused.stderr
    docs = render(
        None, "--set", "serving.env[0].name=VLLM_PLUGINS", "--set", "serving.env[0].value=lora_resolver\\,kvguard"
    )
    assert env_of(serving_container(docs))["VLLM_PLUGINS"]["value"] == "lora_resolver,kvguard"


def test_the_plugin_reaches_the_serving_container_through_a_shared_volume():
    docs = render()
    spec = pod_spec(docs)
    (init,) = [c for c in spec["initContainers"] if c["name"] == "kvguard-plugin"]
    serving = serving_container(docs)
    path = init["command"][-1]
    assert {m["name"]: m["mountPath"] for m in init["volumeMounts"]} == {"kvguard-plugin": path}
    mounts = {m["name"]: m for m in serving["volumeMounts"]}
    assert mounts["kvguard-plugin"]["mountPath"] == path and mounts["kvguard-plugin"]["readOnly"] is True
    assert env_of(serving)["PYTHONPATH"]["value"] == path
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    off = render(None, "--set", "sidecar.plugin.enabled=false")
    assert "PYTHONPATH" not in env_of(serving_container(off))
    assert [c["name"] for c in pod_spec(off)["initContainers"]] == ["kvguard"]


def test_the_engine_id_value_reaches_kvguard():
    docs = render(None, "--set", "kvguard.engineId=$(LWS_NAME)-$(LWS_GROUP_INDEX)")
    assert env_of(kvguard_container(docs))["KVGUARD_ENGINE_ID"]["value"] == "$(LWS_NAME)-$(LWS_GROUP_INDEX)"
    assert "KVGUARD_ENGINE_ID" not in env_of(kvguard_container(render()))
