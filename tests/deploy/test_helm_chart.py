"""The Helm chart (helm/kvguard), exercised with the real helm binary.

Every rendered Kubernetes object is validated against the Kubernetes 1.31 strict JSON schemas that
kubernetes-validate ships (offline). The Prometheus operator's kinds (PodMonitor, ServiceMonitor,
PrometheusRule) are not in those schemas: they are validated against the JSON schemas below,
written for the fields this chart uses, following the operator's monitoring.coreos.com/v1 CRDs.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tarfile

import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import ROOT
from monitoring import (
    ALERTS_FILE,
    CUSTOM_RULES_VALUES,
    DASHBOARD_JSON,
    DASHBOARDS,
    JOINS_FILE,
    KVGUARD_METRIC,
    RECORDING_FILE,
    RULE_FILES,
    RULES_DIR,
    alerts,
    custom_rules_config,
    documented_serve_flags,
    documented_serve_port,
    rules_generator,
)

CHART = os.path.join(ROOT, "helm", "kvguard")
# The rule files each PrometheusRule carries: the release's own, and "<release>-joins".
OWN_RULE_FILES, JOIN_RULE_FILES = (RECORDING_FILE, ALERTS_FILE), (JOINS_FILE,)
KUBERNETES_VERSION = "1.31.0"
SCHEMA_ERROR = "values don't meet the specifications of the schema"

CI_VALUES = sorted(
    os.path.join("ci", name) for name in os.listdir(os.path.join(CHART, "ci")) if name.endswith("-values.yaml")
)
SIDECAR_VALUES = [path for path in CI_VALUES if os.path.basename(path).startswith("sidecar-")]
# None: the chart's defaults.
ALL_VALUES = [None, *CI_VALUES]
# Those that render a workload (mode cluster renders the dashboard and the rules only).
WORKLOAD_VALUES = [v for v in ALL_VALUES if v is None or not os.path.basename(v).startswith("cluster-")]


def _ids(values):
    return "defaults" if values is None else os.path.basename(values).removesuffix("-values.yaml")


# ----------------------------------------------------------------------------- helm


def _helm_binary() -> str:
    found = shutil.which("helm") or os.path.join(ROOT, ".tools", "helm")
    if not os.access(found, os.X_OK):
        pytest.fail("helm not found on PATH nor at .tools/helm: run ./dev.sh test, which fetches it")
    return found


@functools.lru_cache(maxsize=None)
def _helm_env() -> tuple[tuple[str, str], ...]:
    # Keep helm's cache, config and data out of the user's home.
    base = os.path.join(ROOT, ".pytest_cache", "helm-home")
    env = dict(os.environ)
    for name in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[name] = os.path.join(base, name.lower())
    return tuple(env.items())


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_helm_binary(), *args], cwd=ROOT, env=dict(_helm_env()), capture_output=True, text=True, timeout=120
    )


# No kvguard image is published: every install names where it was pushed (the chart refuses none).
IMAGE = ("--set", "image.repository=registry.example.com/kvguard")
# What is cluster-wide (dashboard, rules) renders by default only in mode cluster.
CLUSTER = ("--set", "mode=cluster")
# The same without the runbook pages (templates/runbook.yaml), whose Service the alerts link to by default:
# the rules then carry the generator's own default runbook_url, as the committed rule files do.
CLUSTER_WITHOUT_PAGES = (*CLUSTER, "--set", "runbook.enabled=false")


def template_args(values: str | None = None, *extra: str) -> list[str]:
    args = ["template", "kv", CHART, "--namespace", "serving", *IMAGE]
    if values:
        args += ["-f", os.path.join(CHART, values)]
    return [*args, *extra]


@functools.lru_cache(maxsize=None)
def _render(values: str | None, extra: tuple[str, ...]) -> tuple[dict, ...]:
    result = helm(*template_args(values, *extra))
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def render(values: str | None = None, *extra: str) -> list[dict]:
    return list(_render(values, tuple(extra)))


def only(docs: list[dict], kind: str) -> dict:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[d['kind'] for d in docs]}"
    return found[0]


def workload(docs: list[dict]) -> dict:
    """The release's workload: not the runbook pages' Deployment (templates/runbook.yaml), which a release
    with rules renders beside it."""
    found = [
        doc
        for doc in docs
        if doc["kind"] in ("Deployment", "DaemonSet")
        and doc["spec"]["template"]["metadata"].get("labels", {}).get("app.kubernetes.io/component") != "runbook"
    ]
    assert len(found) == 1, [d["kind"] for d in docs]
    return found[0]


def pod_spec(docs: list[dict]) -> dict:
    return workload(docs)["spec"]["template"]["spec"]


def kvguard_container(docs: list[dict]) -> dict:
    spec = pod_spec(docs)
    found = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == "kvguard"]
    assert len(found) == 1
    return found[0]


def serving_container(docs: list[dict]) -> dict:
    found = [c for c in pod_spec(docs)["containers"] if c["name"] != "kvguard"]
    assert len(found) == 1
    return found[0]


def env_of(container: dict) -> dict[str, dict]:
    return {item["name"]: item for item in container.get("env", [])}


def flag_values(container: dict, flag: str) -> list[str]:
    prefix = f"{flag}="
    return [arg[len(prefix) :] for arg in container["args"] if arg.startswith(prefix)]


def mount_path(container: dict, volume: str) -> str:
    found = [m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] == volume]
    assert len(found) == 1, f"{container['name']} mounts {volume} {len(found)} times"
    return found[0]


def schema_failure(*extra: str) -> subprocess.CompletedProcess:
    return helm(*template_args(None, *extra))


# ------------------------------------------------------- Prometheus operator kinds

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
    r"(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_KEY_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "key"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "key": {"type": "string", "minLength": 1},
        "optional": {"type": "boolean"},
    },
}
_METADATA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "namespace"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
        "namespace": {"type": "string"},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["matchLabels"],
    "properties": {"matchLabels": {**_STRING_MAP, "minProperties": 1}},
}
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer", "minimum": 0},
        "replacement": {"type": "string"},
        "action": {
            "enum": [
                "replace",
                "Replace",
                "keep",
                "Keep",
                "drop",
                "Drop",
                "hashmod",
                "HashMod",
                "labelmap",
                "LabelMap",
                "labeldrop",
                "LabelDrop",
                "labelkeep",
                "LabelKeep",
                "lowercase",
                "Lowercase",
                "uppercase",
                "Uppercase",
                "keepequal",
                "KeepEqual",
                "dropequal",
                "DropEqual",
            ]
        },
    },
}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string", "minLength": 1},
        "path": {"type": "string", "pattern": "^/"},
        "scheme": {"enum": ["http", "https"]},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
        "tlsConfig": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "ca": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"secret": _KEY_SELECTOR, "configMap": _KEY_SELECTOR},
                },
                "serverName": {"type": "string"},
                "insecureSkipVerify": {"type": "boolean"},
            },
        },
        "basicAuth": {
            "type": "object",
            "additionalProperties": False,
            "required": ["username", "password"],
            "properties": {"username": _KEY_SELECTOR, "password": _KEY_SELECTOR},
        },
        "relabelings": {"type": "array", "items": _RELABEL},
        "metricRelabelings": {"type": "array", "items": _RELABEL},
    },
}


def _monitor_schema(kind: str, endpoints_key: str) -> dict:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", endpoints_key],
                "properties": {
                    "selector": _LABEL_SELECTOR,
                    "namespaceSelector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array"}},
                    },
                    endpoints_key: {"type": "array", "minItems": 1, "items": _ENDPOINT},
                },
            },
        },
    }


_RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["expr"],
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "properties": {
        "alert": {"type": "string", "minLength": 1},
        "record": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
        "expr": {"type": "string", "minLength": 1},
        "for": _DURATION,
        "keep_firing_for": _DURATION,
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
}
OPERATOR_SCHEMAS = {
    "PodMonitor": _monitor_schema("PodMonitor", "podMetricsEndpoints"),
    "ServiceMonitor": _monitor_schema("ServiceMonitor", "endpoints"),
    "PrometheusRule": {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PrometheusRule"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["groups"],
                "properties": {
                    "groups": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["name", "rules"],
                            "properties": {
                                "name": {"type": "string", "minLength": 1},
                                "interval": _DURATION,
                                "limit": {"type": "integer", "minimum": 0},
                                "labels": _STRING_MAP,
                                "rules": {"type": "array", "minItems": 1, "items": _RULE},
                            },
                        },
                    }
                },
            },
        },
    },
}


# ----------------------------------------------------------------------------- lint


@pytest.mark.parametrize("values", ALL_VALUES, ids=_ids)
def test_helm_lint_strict_passes(values):
    args = ["lint", "--strict", CHART, *IMAGE]
    if values:
        args += ["-f", os.path.join(CHART, values)]
    result = helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


# ------------------------------------------------------------------ schema validity


@pytest.mark.parametrize("values", ALL_VALUES, ids=_ids)
def test_rendered_kubernetes_objects_are_valid_for_kubernetes_1_31(values):
    docs = [doc for doc in render(values) if doc["kind"] not in OPERATOR_SCHEMAS]
    assert docs
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}")


@pytest.mark.parametrize("values", ALL_VALUES, ids=_ids)
def test_rendered_operator_objects_match_their_crd_fields(values):
    for doc in render(values):
        if doc["kind"] in OPERATOR_SCHEMAS:
            jsonschema.Draft7Validator(OPERATOR_SCHEMAS[doc["kind"]]).validate(doc)


OPERATOR_MODULES = os.path.join(ROOT, ".tools", "node", "node_modules")


def _real_crd_failures(docs: list[dict]) -> subprocess.CompletedProcess:
    if not os.path.isdir(os.path.join(OPERATOR_MODULES, "@kubernetes-models", "prometheus-operator")):
        pytest.fail("@kubernetes-models/prometheus-operator not in .tools/node: run ./dev.sh test, which installs it")
    return subprocess.run(
        ["node", os.path.join(ROOT, "tests", "support", "operator_crds.mjs"), OPERATOR_MODULES],
        input=json.dumps(docs),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("values", [v for v in ALL_VALUES if v is None or "no-prometheus-operator" not in v], ids=_ids)
def test_rendered_operator_objects_pass_the_real_prometheus_operator_crd_schemas(values):
    # @kubernetes-models/prometheus-operator 6.0.0: validators compiled from the operator's own CRDs.
    docs = [doc for doc in render(values, *CLUSTER_TOO.get(values, ())) if doc["kind"] in OPERATOR_SCHEMAS]
    assert docs
    result = _real_crd_failures(docs)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_real_crd_schemas_refuse_a_bad_monitor():
    monitor = only(render(), "PodMonitor")
    monitor["spec"]["podMetricsEndpoints"][0]["scheme"] = "ftp"
    result = _real_crd_failures([monitor])
    assert result.returncode == 1 and "scheme must be equal to one of the allowed values" in result.stdout


# The defaults render no PrometheusRule (the cluster release carries it): check it there too.
CLUSTER_TOO = {None: ("--set", "prometheusRule.enabled=true")}


def test_ci_values_cover_every_kind_the_chart_renders():
    kinds = {doc["kind"] for values in CI_VALUES for doc in render(values)}
    assert kinds == {
        "ServiceAccount",
        "Service",
        "ConfigMap",
        "Deployment",
        "DaemonSet",
        "PodMonitor",
        "ServiceMonitor",
        "PrometheusRule",
        "NetworkPolicy",
    }


# ------------------------------------------------------------- rules and dashboard


def prometheus_rule(docs: list[dict], joins: bool = False) -> dict:
    """The release's own PrometheusRule, or with joins its device-join one ("<release>-joins")."""
    found = [d for d in docs if d["kind"] == "PrometheusRule" and d["metadata"]["name"].endswith("-joins") == joins]
    assert len(found) == 1, [(d["kind"], d["metadata"]["name"]) for d in docs]
    return found[0]


def rule_groups(texts) -> list[dict]:
    return [group for text in texts for group in yaml.safe_load(text)["groups"]]


def committed(paths) -> list[str]:
    texts = []
    for path in paths:
        with open(path) as handle:
            texts.append(handle.read())
    return texts


def test_prometheus_rule_groups_equal_the_rule_files():
    assert prometheus_rule(render(None, *CLUSTER_WITHOUT_PAGES))["spec"]["groups"] == rule_groups(
        committed(OWN_RULE_FILES)
    )


def test_chart_renders_the_join_rules_only_when_asked():
    assert [d for d in render(None, *CLUSTER) if d["metadata"]["name"].endswith("-joins")] == []
    docs = render(None, *CLUSTER_WITHOUT_PAGES, "--set", "prometheusRule.deviceJoins.enabled=true")
    assert prometheus_rule(docs, joins=True)["spec"]["groups"] == rule_groups(committed(JOIN_RULE_FILES))
    assert prometheus_rule(docs)["spec"]["groups"] == rule_groups(committed(OWN_RULE_FILES))
    off = render(
        None, *CLUSTER, "--set", "prometheusRule.deviceJoins.enabled=true", "--set", "prometheusRule.enabled=false"
    )
    assert [d for d in off if d["kind"] == "PrometheusRule"] == []


CUSTOM_RULES = os.path.join("ci", os.path.basename(CUSTOM_RULES_VALUES))


def _rules_by_name(groups: list[dict]) -> dict[str, dict]:
    return {rule.get("alert") or rule["record"]: rule for group in groups for rule in group["rules"]}


def test_prometheus_rules_from_non_default_values_are_what_the_generator_writes_from_them():
    # One source: the chart fills the generator's templates as dashboards/rules.py fills them.
    written = rules_generator().outputs(custom_rules_config(), output_dir=RULES_DIR, chart=False)
    docs = render(CUSTOM_RULES)
    assert prometheus_rule(docs)["spec"]["groups"] == rule_groups(written[p] for p in OWN_RULE_FILES)
    assert prometheus_rule(docs, joins=True)["spec"]["groups"] == rule_groups(written[p] for p in JOIN_RULE_FILES)


def test_empty_selectors_render_as_the_generator_writes_them(tmp_path):
    # The chart tidies what an empty selector leaves ({a="b",} and name{}) as rules.py does.
    # Mode cluster: no Service, so the runbook links are the generator's default too.
    values = {
        "mode": "cluster",
        "runbook": {"enabled": False},
        "prometheusRule": {"enabled": True, "jobSelector": "", "deviceJoins": {"enabled": True}},
    }
    (tmp_path / "empty.yaml").write_text(yaml.safe_dump(values))
    written = rules_generator().outputs(values["prometheusRule"], output_dir=RULES_DIR, chart=False)
    docs = render(str(tmp_path / "empty.yaml"))
    assert prometheus_rule(docs)["spec"]["groups"] == rule_groups(written[p] for p in OWN_RULE_FILES)
    assert prometheus_rule(docs, joins=True)["spec"]["groups"] == rule_groups(written[p] for p in JOIN_RULE_FILES)
    assert "up == 0" in str(prometheus_rule(docs)["spec"]["groups"])


def test_join_selector_values_change_the_rendered_join_rules():
    default = _rules_by_name(
        prometheus_rule(render(None, *CLUSTER, "--set", "prometheusRule.deviceJoins.enabled=true"), joins=True)["spec"][
            "groups"
        ]
    )
    custom = _rules_by_name(prometheus_rule(render(CUSTOM_RULES), joins=True)["spec"]["groups"])
    assert 'DCGM_FI_DEV_FB_USED{GPU_I_ID=""}' in default["kvguard:dcgm_fb_used_bytes"]["expr"]
    assert (
        'DCGM_FI_DEV_FB_USED{GPU_I_ID="",job="gpu-operator/nvidia-dcgm-exporter"}'
        in custom["kvguard:dcgm_fb_used_bytes"]["expr"]
    )
    assert (
        custom["kvguard:npu_hbm_used_bytes:npu_exporter"]["expr"].count(
            'npu_chip_info_hbm_used_memory{job="ascend/npu-exporter",namespace="ascend"}'
        )
        == 2
    )
    assert custom["kvguard:device_used_bytes:npu_exporter"]["expr"].startswith(
        'kvguard_device_used_bytes{pci_bus_id!="",job="llm-guard"}'
    )


def test_prometheus_rule_values_change_the_rendered_rules():
    default = _rules_by_name(prometheus_rule(render(None, *CLUSTER))["spec"]["groups"])
    custom = _rules_by_name(prometheus_rule(render(CUSTOM_RULES))["spec"]["groups"])
    assert default.keys() == custom.keys()
    assert custom["KVGuardHeadroomLow"]["expr"] == "namespace_engine:kvguard_guard_headroom_ratio:min < 0.1"
    assert custom["KVGuardFragmentationHigh"]["expr"].endswith(
        'kvguard_allocator_fragmentation_bytes{job="llm-guard"} > 4294967296'
    )
    assert custom["KVGuardOOMRiskCritical"]["for"] == "5m" and default["KVGuardOOMRiskCritical"]["for"] == "2m"
    assert (
        custom["KVGuardExporterDown"]["annotations"]["runbook_url"]
        == "https://runbooks.example.com/kvguard/kvguardexporterdown.html"
    )
    # Every rule reading a series of kvguard's own (not only recorded ones) reads it through the selector.
    reads_raw = {name for name, rule in default.items() if KVGUARD_METRIC.search(rule["expr"]) or "up{" in rule["expr"]}
    assert len(reads_raw) == 27  # 7 alerts (2 read engine rules), 9 engine and 11 pod-level recording rules
    assert all(custom[name]["expr"] != default[name]["expr"] for name in reads_raw)


def test_one_threshold_set_on_the_command_line_moves_only_its_alert():
    default = _rules_by_name(prometheus_rule(render(None, *CLUSTER))["spec"]["groups"])
    changed = _rules_by_name(
        prometheus_rule(render(None, *CLUSTER, "--set-json", "prometheusRule.thresholds.headroomRatio=0.2"))["spec"][
            "groups"
        ]
    )
    assert {name for name in default if default[name] != changed[name]} == {"KVGuardHeadroomLow"}
    assert changed["KVGuardHeadroomLow"]["expr"].endswith("< 0.2")


@pytest.mark.parametrize(
    "setting",
    [
        "prometheusRule.thresholds.headroomRatio=0.2",  # --set passes it as a string
        "prometheusRule.thresholds.headroomRatoi=1",
        "prometheusRule.for.KVGuardAllocatorOOMs=5m",
        "prometheusRule.for.KVGuardHeadroomLow=ten",
        "prometheusRule.runbookUrl=https://runbooks.example.com/kvguard",
        "prometheusRule.runbookUrl=https://runbooks.example.com/%s/%s.html",
    ],
)
def test_bad_prometheus_rule_values_are_refused_by_the_schema(setting):
    result = helm(*template_args(None, "--set", setting))
    assert result.returncode != 0
    assert SCHEMA_ERROR in result.stderr


def _runbook_urls(docs: list[dict]) -> dict[str, str]:
    return {
        rule["alert"]: rule["annotations"]["runbook_url"]
        for rule in _rules_by_name(prometheus_rule(docs)["spec"]["groups"]).values()
        if "alert" in rule
    }


@pytest.mark.parametrize(
    "extra, scheme",
    [
        ((), "http"),
        (("--set", "fullnameOverride=guard", "--set", "kvguard.port=9400"), "http"),
        (("--set", "kvguard.tls.enabled=true", "--set", "kvguard.tls.secretName=kvguard-tls"), "https"),
    ],
    ids=["defaults", "renamed", "tls"],
)
def test_without_pages_runbook_urls_go_to_the_runbook_the_releases_own_service_serves(extra, scheme):
    docs = render(None, "--set", "prometheusRule.enabled=true", "--set", "runbook.enabled=false", *extra)
    service = only(docs, "Service")
    (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "metrics"]
    host = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{port}"
    urls = _runbook_urls(docs)
    assert set(urls) == {a["alert"] for a in alerts()}
    assert urls == {name: f"{scheme}://{host}/runbook/{name.lower()}" for name in urls}


def test_a_sidecar_release_with_rules_links_each_alert_to_its_own_runbook_pages():
    """Not to the sidecar (behind the scrape's credentials, and for KVGuardExporterDown the exporter that is
    down): the release renders the pages its rules link to (templates/runbook.yaml)."""
    docs = render(None, "--set", "prometheusRule.enabled=true")
    pages = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-runbook")]
    (service,) = pages
    urls = _runbook_urls(docs)
    assert set(urls) == {a["alert"] for a in alerts()}
    host = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    assert urls == {name: f"http://{host}/{name.lower()}.html" for name in urls}


def test_a_runbook_url_value_overrides_the_service_default():
    urls = _runbook_urls(
        render(
            None,
            "--set",
            "prometheusRule.enabled=true",
            "--set",
            "prometheusRule.runbookUrl=https://wiki.example.com/ops/%s#fix",
        )
    )
    assert urls == {name: f"https://wiki.example.com/ops/{name.lower()}#fix" for name in urls}


@pytest.mark.parametrize(
    "extra",
    [
        CLUSTER_WITHOUT_PAGES,
        ("--set", "prometheusRule.enabled=true", "--set", "service.enabled=false", "--set", "runbook.enabled=false"),
    ],
    ids=["cluster-without-pages", "no-service"],
)
def test_without_pages_or_a_service_runbook_urls_are_the_generators_default_on_the_alerts_instance(extra):
    docs = render(None, *extra)
    assert [d for d in docs if d["kind"] == "Service"] == []
    urls = _runbook_urls(docs)
    assert urls == {name: rules_generator().RUNBOOK_URL % name.lower() for name in urls}
    assert all(
        url.startswith(
            "{{ with $externalLabels.kvguard_runbook_url }}{{ . }}{{ else }}http://{{ if $labels.instance }}"
        )
        for url in urls.values()
    )


def test_chart_reads_rules_and_dashboard_through_links_into_dashboards():
    for name in ("rules", "kvguard.json"):
        link = os.path.join(CHART, "files", name)
        assert os.path.islink(link), f"{link} must be a symlink, not a copy"
        target = os.path.join(DASHBOARDS, name)
        assert os.path.realpath(link) == os.path.realpath(target)


def test_dashboard_configmap_carries_the_dashboard_for_grafanas_sidecar():
    configmap = only(render(None, *CLUSTER_WITHOUT_PAGES), "ConfigMap")  # with the pages: test_runbook_pages
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    with open(DASHBOARD_JSON) as handle:
        assert json.loads(configmap["data"]["kvguard.json"]) == json.load(handle)


def test_packaged_chart_contains_the_linked_files_themselves(tmp_path):
    result = helm("package", CHART, "--destination", str(tmp_path))
    assert result.returncode == 0, result.stderr
    (archive,) = tmp_path.glob("kvguard-*.tgz")
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
        expected = {f"kvguard/files/rules/{os.path.basename(path)}": path for path in RULE_FILES}
        generator = rules_generator()
        for template in (generator.CHART_TEMPLATE, generator.JOINS_CHART_TEMPLATE):
            expected[f"kvguard/files/{os.path.basename(template)}"] = template
        expected["kvguard/files/kvguard.json"] = DASHBOARD_JSON
        for member, source in expected.items():
            assert members[member].isfile(), f"{member} is not a regular file in the package"
            with open(source, "rb") as handle:
                assert tar.extractfile(member).read() == handle.read()
        assert not [name for name in members if name.startswith("kvguard/hack/")]


def test_disabling_rules_and_dashboard_renders_neither():
    kinds = [
        doc["kind"]
        for doc in render(None, *CLUSTER, "--set", "prometheusRule.enabled=false", "--set", "dashboard.enabled=false")
    ]
    assert "PrometheusRule" not in kinds and "ConfigMap" not in kinds


# -------------------------------------------------------------------- sidecar mode


@pytest.mark.parametrize("values", [None, *SIDECAR_VALUES], ids=_ids)
def test_sidecar_and_serving_container_share_the_in_memory_spool(values):
    docs = render(values)
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    assert volumes["kvguard-spool"]["emptyDir"]["medium"] == "Memory"
    serving, kvguard = serving_container(docs), kvguard_container(docs)
    serving_path = mount_path(serving, "kvguard-spool")
    assert env_of(serving)["KVGUARD_SPOOL_DIR"]["value"] == serving_path
    assert flag_values(kvguard, "--spool-dir") == [mount_path(kvguard, "kvguard-spool")]


def test_sidecar_mounts_the_spool_read_only_and_the_serving_container_read_write():
    docs = render()
    mounts = {
        c["name"]: {m["name"]: m for m in c["volumeMounts"]} for c in (kvguard_container(docs), serving_container(docs))
    }
    assert mounts["kvguard"]["kvguard-spool"]["readOnly"] is True
    assert not mounts["vllm"]["kvguard-spool"].get("readOnly", False)


def test_native_sidecar_is_an_init_container_that_restarts_always():
    spec = pod_spec(render("ci/sidecar-native-podmonitor-values.yaml"))
    assert [c["name"] for c in spec["initContainers"]] == ["kvguard-plugin", "kvguard"]
    assert spec["initContainers"][1]["restartPolicy"] == "Always"
    assert "restartPolicy" not in spec["initContainers"][0]  # the plugin copy runs once, first
    assert [c["name"] for c in spec["containers"]] == ["vllm"]


def test_plain_sidecar_is_a_second_container():
    spec = pod_spec(render("ci/sidecar-plain-container-servicemonitor-values.yaml"))
    assert [c["name"] for c in spec["initContainers"]] == ["kvguard-plugin"]
    assert sorted(c["name"] for c in spec["containers"]) == ["kvguard", "vllm"]
    assert all("restartPolicy" not in c for c in spec["containers"])


def test_a_serving_container_named_like_kvguard_is_refused():
    result = helm(*template_args(None, "--set", "serving.name=kvguard"))
    assert result.returncode != 0
    assert (
        'serving.name and kvguard.name are both "kvguard": two containers in one pod cannot share a name'
        in result.stderr
    )


def test_native_sidecar_is_refused_below_kubernetes_1_29():
    result = helm(*template_args(None, "--kube-version", "1.28.9"))
    assert result.returncode != 0
    assert "sidecar.native=true needs Kubernetes >= 1.29" in result.stderr


def test_plain_sidecar_renders_for_kubernetes_1_28():
    spec = pod_spec(render(None, "--kube-version", "1.28.9", "--set", "sidecar.native=false"))
    assert "kvguard" in [c["name"] for c in spec["containers"]]


@pytest.mark.parametrize("values", [None, *SIDECAR_VALUES], ids=_ids)
def test_sidecar_reads_vllm_metrics_on_the_serving_port(values):
    docs = render(values)
    (serving_port,) = [p["containerPort"] for p in serving_container(docs)["ports"] if p["name"] == "http"]
    assert flag_values(kvguard_container(docs), "--vllm-metrics-url") == [f"http://127.0.0.1:{serving_port}/metrics"]


@pytest.mark.parametrize("values", [None, *SIDECAR_VALUES], ids=_ids)
def test_sidecar_labels_its_metrics_with_the_serving_container(values):
    docs = render(values)
    serving = serving_container(docs)
    assert env_of(kvguard_container(docs))["CONTAINER_NAME"]["value"] == serving["name"]
    assert env_of(serving)["CONTAINER_NAME"]["value"] == serving["name"]


def test_ascend_sidecar_requests_npus_for_the_serving_container_only():
    docs = render("ci/sidecar-ascend-vllm-mindspore-values.yaml")
    limits = serving_container(docs)["resources"]["limits"]
    assert limits["huawei.com/Ascend910"] == 4
    assert [name for name in limits if "/" in name] == ["huawei.com/Ascend910"]  # no default GPU merged in
    assert not [name for name in kvguard_container(docs)["resources"].get("limits", {}) if "/" in name]


# ------------------------------------------------------------------ daemonset mode


def test_daemonset_mode_renders_a_daemonset_and_no_serving_workload():
    docs = render("ci/daemonset-nvml-values.yaml")
    kinds = [doc["kind"] for doc in docs]
    assert "DaemonSet" in kinds and "Deployment" not in kinds
    assert [c["name"] for c in pod_spec(docs)["containers"]] == ["kvguard"]
    assert flag_values(kvguard_container(docs), "--spool-dir") == []


def test_daemonset_args_serve_no_spool_source():
    """The rendered daemonset arguments, served for real: no spool, so no spool source to be down."""
    from test_serve_cli import Served

    container = kvguard_container(render("ci/daemonset-nvml-values.yaml"))
    args = container["args"]
    assert "KVGUARD_SPOOL_DIR" not in env_of(container)
    # This machine has no GPU: keep every argument but where to listen and which device source.
    kept = [a for a in args[1:] if not a.startswith(("--listen=", "--port=", "--source="))]
    server = Served(*kept, "--source=none")
    try:
        status, body = server.get("/guard")
        assert status == 200 and "spool" not in json.loads(body)["sources"]
        assert b'source="spool"' not in server.get("/metrics")[1]
    finally:
        server.stop()


def test_nvml_daemonset_sees_every_gpu_without_requesting_any():
    docs = render("ci/daemonset-nvml-values.yaml")
    kvguard = kvguard_container(docs)
    assert flag_values(kvguard, "--source") == ["nvml"]
    assert env_of(kvguard)["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert pod_spec(docs)["runtimeClassName"] == "nvidia"
    assert not [name for name in kvguard["resources"].get("limits", {}) if name.startswith("nvidia.com/")]


def test_npu_smi_daemonset_mounts_the_hosts_npu_smi_and_driver_read_only():
    docs = render("ci/daemonset-npu-smi-values.yaml")
    kvguard = kvguard_container(docs)
    assert flag_values(kvguard, "--source") == ["npu-smi"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod_spec(docs)["volumes"] if "hostPath" in v}
    assert sorted(host_paths.values()) == ["/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/sbin/npu-smi"]
    mounts = {m["name"]: m for m in kvguard["volumeMounts"]}
    for name, path in host_paths.items():
        assert mounts[name]["mountPath"] == path and mounts[name]["readOnly"] is True


# ------------------------------------------------------------- both modes: kvguard


@pytest.mark.parametrize("values", WORKLOAD_VALUES, ids=_ids)
def test_kvguard_runs_non_root_read_only_without_privileges(values):
    docs = render(values)
    context = kvguard_container(docs)["securityContext"]
    assert context["runAsNonRoot"] is True and context["runAsUser"] != 0
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context.get("privileged", False) is False
    assert context["capabilities"]["drop"] == ["ALL"] and not context["capabilities"].get("add")


@pytest.mark.parametrize("values", WORKLOAD_VALUES, ids=_ids)
def test_kvguard_has_resources_and_a_writable_tmp(values):
    kvguard = kvguard_container(render(values))
    assert kvguard["resources"]["requests"]["memory"] and kvguard["resources"]["limits"]["memory"]
    assert mount_path(kvguard, "kvguard-tmp") == "/tmp"


@pytest.mark.parametrize("values", WORKLOAD_VALUES, ids=_ids)
def test_kvguard_probes_healthz_and_readyz_on_its_metrics_port(values):
    kvguard = kvguard_container(render(values))
    (port,) = [p for p in kvguard["ports"] if p["name"] == "metrics"]
    assert flag_values(kvguard, "--port") == [str(port["containerPort"])]
    assert kvguard["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert kvguard["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert kvguard[probe]["httpGet"]["port"] == "metrics"


@pytest.mark.parametrize("values", WORKLOAD_VALUES, ids=_ids)
def test_pod_identity_comes_from_the_downward_api(values):
    docs = render(values)
    containers = [kvguard_container(docs)]
    if workload(docs)["kind"] == "Deployment":
        containers.append(serving_container(docs))
    for container in containers:
        env = env_of(container)
        for name, field in (
            ("POD_NAME", "metadata.name"),
            ("POD_NAMESPACE", "metadata.namespace"),
            ("NODE_NAME", "spec.nodeName"),
        ):
            assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == field, (container["name"], name)
        assert env["CONTAINER_NAME"]["value"]


@pytest.mark.parametrize("values", WORKLOAD_VALUES, ids=_ids)
def test_kvguard_args_use_only_documented_serve_flags(values):
    args = kvguard_container(render(values))["args"]
    assert args[0] == "serve"
    used = {arg.split("=", 1)[0] for arg in args[1:]}
    assert used <= documented_serve_flags()


def test_limits_and_allow_auth_off_reach_kvguard_serve_as_its_parser_reads_them():
    """The chart's kvguard.limits, webConfig.allowAuthOff and runbookPublic, rendered, then parsed by the real
    `kvguard serve`."""
    from kvguard.cli import main

    args = kvguard_container(
        render(
            "ci/sidecar-web-config-values.yaml",
            "--set",
            "kvguard.limits.maxRanks=7",
            "--set",
            "kvguard.limits.maxMetricsBytes=5000000000",
            "--set",
            "kvguard.webConfig.allowAuthOff=true",
            "--set",
            "kvguard.runbookPublic=true",
        )
    )["args"]
    params = main.commands["serve"].make_context("serve", list(args[1:])).params
    assert params["web_runbook_public"] is True
    assert (params["max_ranks"], params["max_engines"], params["max_models"], params["max_pods"]) == (7, 64, 32, 64)
    assert params["max_label_length"] == 128 and params["max_metrics_bytes"] == 5_000_000_000
    assert params["web_config_allow_auth_off"] is True
    default = kvguard_container(render("ci/sidecar-web-config-values.yaml"))["args"]
    default_params = main.commands["serve"].make_context("serve", list(default[1:])).params
    assert not default_params["web_config_allow_auth_off"] and not default_params["web_runbook_public"]


def test_default_port_is_the_documented_serve_port():
    documented = documented_serve_port()
    with open(os.path.join(CHART, "values.yaml")) as handle:
        assert yaml.safe_load(handle)["kvguard"]["port"] == int(documented)


def test_fail_readiness_on_critical_passes_the_flag():
    args = kvguard_container(render(None, "--set", "kvguard.failReadinessOnCritical=true"))["args"]
    assert "--fail-readiness-on-critical" in args


# ---------------------------------------------------------------------- scraping


def _monitor_kind(values: str | None) -> str:
    chosen = {}
    if values:
        with open(os.path.join(CHART, values)) as handle:
            chosen = yaml.safe_load(handle).get("monitor", {})
    return chosen.get("kind", "PodMonitor")


@pytest.mark.parametrize("values", [v for v in WORKLOAD_VALUES if _monitor_kind(v) == "PodMonitor"], ids=_ids)
def test_pod_monitor_selects_the_pods_and_their_metrics_port(values):
    docs = render(values)
    monitor = only(docs, "PodMonitor")
    pod_labels = workload(docs)["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    container_ports = {p["name"] for p in kvguard_container(docs)["ports"]}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == {"metrics"} <= container_ports


@pytest.mark.parametrize("values", [v for v in WORKLOAD_VALUES if _monitor_kind(v) == "ServiceMonitor"], ids=_ids)
def test_service_monitor_selects_a_service_that_selects_the_pods(values):
    docs = render(values)
    monitor, service = only(docs, "ServiceMonitor"), only(docs, "Service")
    assert "PodMonitor" not in [doc["kind"] for doc in docs]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    pod_labels = workload(docs)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == monitor["spec"]["endpoints"][0]["port"]]
    assert port["targetPort"] == "metrics"


def _exporter_down_job_regex(docs: list[dict]) -> str:
    """The job KVGuardExporterDown selects, as an anchored regex (job="x" or job=~"x")."""
    rules = [rule for group in prometheus_rule(docs)["spec"]["groups"] for rule in group["rules"]]
    (expr,) = [rule["expr"] for rule in rules if rule.get("alert") == "KVGuardExporterDown"]
    ((op, value),) = re.findall(r'^up\{job(=~|=)"([^"]+)"\} == 0$', expr.strip())
    return value if op == "=~" else re.escape(value)


def _selected_service(docs: list[dict], monitor: dict) -> dict:
    """The one Service a ServiceMonitor's selector matches (the runbook pages' Service is not it)."""
    wanted = monitor["spec"]["selector"]["matchLabels"]
    (service,) = [
        d for d in docs if d["kind"] == "Service" and wanted.items() <= d["metadata"].get("labels", {}).items()
    ]
    return service


def _scrape_job(docs: list[dict], kind: str) -> str:
    """The job label the Prometheus operator gives the targets: its default, then the relabelings."""
    monitor = only(docs, kind)
    endpoints = monitor["spec"]["podMetricsEndpoints" if kind == "PodMonitor" else "endpoints"]
    job = (
        f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}"
        if kind == "PodMonitor"
        else _selected_service(docs, monitor)["metadata"]["name"]
    )
    for step in endpoints[0].get("relabelings", []):
        if (
            step.get("targetLabel") == "job"
            and step.get("action", "replace") == "replace"
            and not step.get("sourceLabels")
        ):
            job = step["replacement"]
    return job


@pytest.mark.parametrize("kind", ["PodMonitor", "ServiceMonitor"])
def test_exporter_down_alert_selects_the_scrape_job_whatever_the_release_is_called(kind):
    docs = render(
        None,
        "--set",
        "fullnameOverride=llm-guard",
        "--set",
        f"monitor.kind={kind}",
        "--set",
        "prometheusRule.enabled=true",
    )
    job = _scrape_job(docs, kind)
    assert job == "kvguard"
    assert re.fullmatch(_exporter_down_job_regex(docs), job)


def test_exporter_down_alert_follows_a_job_selector_set_with_a_relabeled_job():
    docs = render(CUSTOM_RULES)
    assert _scrape_job(docs, "PodMonitor") == "llm-guard"
    assert re.fullmatch(_exporter_down_job_regex(docs), "llm-guard")
    assert not re.fullmatch(_exporter_down_job_regex(docs), "kvguard")


def test_monitor_kind_none_renders_no_monitor():
    kinds = [doc["kind"] for doc in render("ci/sidecar-no-prometheus-operator-values.yaml")]
    assert not {"PodMonitor", "ServiceMonitor", "PrometheusRule"} & set(kinds)


def test_service_monitor_without_a_service_is_refused():
    result = helm(*template_args(None, "--set", "monitor.kind=ServiceMonitor", "--set", "service.enabled=false"))
    assert result.returncode != 0
    assert "monitor.kind=ServiceMonitor needs service.enabled=true" in result.stderr


def test_tls_serves_https_and_prometheus_checks_the_ca():
    docs = render("ci/sidecar-tls-basic-auth-values.yaml")
    kvguard = kvguard_container(docs)
    tls_dir = mount_path(kvguard, "kvguard-tls")
    assert flag_values(kvguard, "--tls-cert-file") == [f"{tls_dir}/tls.crt"]
    assert flag_values(kvguard, "--tls-key-file") == [f"{tls_dir}/tls.key"]
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    assert volumes["kvguard-tls"]["secret"]["secretName"] == "kvguard-tls"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert kvguard[probe]["httpGet"]["scheme"] == "HTTPS"
    (endpoint,) = only(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "kvguard-ca", "key": "ca.crt"}
    assert endpoint["tlsConfig"]["serverName"] == "kvguard.serving.svc"


def test_basic_auth_reads_one_secret_in_kvguard_and_in_prometheus():
    docs = render("ci/sidecar-tls-basic-auth-values.yaml")
    kvguard = kvguard_container(docs)
    user_ref = env_of(kvguard)["KVGUARD_BASIC_AUTH_USER"]["valueFrom"]["secretKeyRef"]
    assert user_ref == {"name": "kvguard-basic-auth", "key": "username"}
    assert flag_values(kvguard, "--basic-auth-user") == ["$(KVGUARD_BASIC_AUTH_USER)"]
    password_dir = mount_path(kvguard, "kvguard-basic-auth")
    assert flag_values(kvguard, "--basic-auth-password-file") == [f"{password_dir}/password"]
    (endpoint,) = only(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert endpoint["basicAuth"] == {
        "username": {"name": "kvguard-basic-auth", "key": "username"},
        "password": {"name": "kvguard-basic-auth", "key": "password"},
    }


# ------------------------------------------------------------------- values schema


@pytest.mark.parametrize(
    "args, message",
    [
        (("--set", "colour=blue"), "Additional property colour is not allowed"),
        (("--set", "kvguard.tls.enable=true"), "kvguard.tls: Additional property enable is not allowed"),
        (("--set", "serving.resources.limit.cpu=1"), "serving.resources: Additional property limit is not allowed"),
        (
            ("--set-json", 'affinity={"nodeAffinity":{"required":{}}}'),
            "affinity.nodeAffinity: Additional property required is not allowed",
        ),
        (("--set", "kvguard.port=metrics"), "kvguard.port: Invalid type. Expected: integer, given: string"),
        (("--set-string", "sidecar.native=true"), "sidecar.native: Invalid type. Expected: boolean, given: string"),
        (("--set-json", 'serving.args="--model x"'), "serving.args: Invalid type. Expected: array, given: string"),
        (("--set", "mode=statefulset"), "mode: mode must be one of the following"),
        (("--set", "monitor.kind=ServiceMonitors"), "monitor.kind: monitor.kind must be one of the following"),
        (("--set-string", "monitor.interval=15"), "monitor.interval: Does not match pattern"),
        (("--set", "kvguard.limits.maxRanks=0"), "kvguard.limits.maxRanks: Must be greater than or equal to 1"),
    ],
    ids=[
        "unknown-top-level-key",
        "unknown-nested-key",
        "unknown-key-in-kubernetes-object",
        "unknown-key-deep-in-affinity",
        "port-not-integer",
        "native-not-boolean",
        "args-not-list",
        "unknown-mode",
        "unknown-monitor-kind",
        "interval-without-unit",
        "max-ranks-zero",
    ],
)
def test_schema_refuses_bad_values(args, message):
    result = schema_failure(*args)
    assert result.returncode != 0
    assert SCHEMA_ERROR in result.stderr and message in result.stderr, result.stderr


def _load_schema() -> dict:
    with open(os.path.join(CHART, "values.schema.json")) as handle:
        return json.load(handle)


def _object_nodes(node, path="#"):
    if isinstance(node, dict):
        if node.get("type") == "object" or "object" in (node.get("type") or []) or "properties" in node:
            yield path, node
        for key, value in node.items():
            yield from _object_nodes(value, f"{path}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _object_nodes(value, f"{path}/{index}")


# Kubernetes' own free-form type (managedFields, reached through ephemeral volumes' ObjectMeta).
FREE_FORM_KUBERNETES_TYPES = {"#/definitions/io.k8s.apimachinery.pkg.apis.meta.v1.FieldsV1"}


def test_every_object_in_the_values_schema_refuses_unknown_keys():
    open_objects = {
        path
        for path, node in _object_nodes(_load_schema())
        # A map (labels, resource limits) types its values instead of listing keys.
        if node.get("additionalProperties") is not False and not isinstance(node.get("additionalProperties"), dict)
    }
    assert open_objects == FREE_FORM_KUBERNETES_TYPES


def test_values_yaml_satisfies_the_schema_with_every_key_typed():
    with open(os.path.join(CHART, "values.yaml")) as handle:
        values = yaml.safe_load(handle)
    jsonschema.Draft7Validator(_load_schema()).validate(values)


def test_embedded_kubernetes_definitions_match_kubernetes_validate_1_31():
    spec = importlib.util.spec_from_file_location(
        "update_k8s_definitions", os.path.join(CHART, "hack", "update-k8s-definitions.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    embedded = {k: v for k, v in _load_schema()["definitions"].items() if k.startswith(module.PREFIX)}
    assert module.KUBERNETES_VERSION == KUBERNETES_VERSION
    assert embedded == module.embedded_definitions(), "run helm/kvguard/hack/update-k8s-definitions.py"


# -------------------------------------------------------------------------- NOTES


@pytest.mark.parametrize(
    "values, workload_ref",
    [(None, "deploy/kv-kvguard"), ("ci/daemonset-nvml-values.yaml", "ds/kv-kvguard")],
    ids=["sidecar", "daemonset"],
)
def test_notes_tell_how_to_reach_the_metrics(tmp_path, values, workload_ref):
    # helm template leaves NOTES.txt out and helm install needs a cluster: render it through a
    # template added to a copy of the chart (links followed).
    chart = tmp_path / "kvguard"
    shutil.copytree(CHART, chart, symlinks=False)
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
        'data:\n  notes: {{ include "kvguard/templates/NOTES.txt" . | toJson }}\n'
    )
    args = ["template", "kv", str(chart), "--namespace", "serving", "--show-only", "templates/zz-notes.yaml", *IMAGE]
    if values:
        args += ["-f", os.path.join(CHART, values)]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    notes = yaml.safe_load(result.stdout)["data"]["notes"]
    assert f"kubectl -n serving port-forward {workload_ref} 10240" in notes
    assert "http://127.0.0.1:10240/metrics" in notes


# ------------------------------------------------------------------- web config


def test_web_config_mounts_the_whole_secret_and_passes_the_file():
    docs = render("ci/sidecar-web-config-values.yaml")
    kvguard = kvguard_container(docs)
    directory = mount_path(kvguard, "kvguard-web-config")
    assert flag_values(kvguard, "--web.config.file") == [f"{directory}/web-config.yml"]
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    # Whole and without subPath: the kubelet swaps the files in place, and kvguard re-reads them.
    assert volumes["kvguard-web-config"]["secret"] == {"secretName": "kvguard-web-config"}
    (mount,) = [m for m in kvguard["volumeMounts"] if m["name"] == "kvguard-web-config"]
    assert "subPath" not in mount and mount["readOnly"] is True
    assert not flag_values(kvguard, "--tls-cert-file") and not flag_values(kvguard, "--basic-auth-user")


def test_web_config_with_tls_makes_probes_and_the_monitor_use_https():
    docs = render("ci/sidecar-web-config-values.yaml")
    kvguard = kvguard_container(docs)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert kvguard[probe]["httpGet"]["scheme"] == "HTTPS"
    (endpoint,) = only(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "kvguard-ca", "key": "ca.crt"}


def test_web_config_without_a_secret_is_refused():
    result = helm(*template_args(None, "--set", "kvguard.webConfig.enabled=true"))
    assert result.returncode != 0
    assert "kvguard.webConfig.enabled needs kvguard.webConfig.secretName" in result.stderr


def test_web_config_tls_and_the_tls_shorthand_together_are_refused():
    result = helm(
        *template_args(
            None,
            "--set",
            "kvguard.webConfig.enabled=true",
            "--set",
            "kvguard.webConfig.secretName=w",
            "--set",
            "kvguard.webConfig.tls=true",
            "--set",
            "kvguard.tls.enabled=true",
            "--set",
            "kvguard.tls.secretName=t",
        )
    )
    assert result.returncode != 0
    assert "use one" in result.stderr
