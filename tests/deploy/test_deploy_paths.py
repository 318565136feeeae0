"""Deploy paths as the cluster runs them, beyond schema validity (issue 34).

- Accelerators: one value (``serving.accelerator``: resource and count) names one vendor's device, so no
  default of one vendor merges into another vendor's pod; every rendered pod of every ci values file, in
  every mode that renders a serving pod, asks for one vendor at most.
- LeaderWorkerSet: the group's accelerators are the engine's ranks (per pod x pods = TP x PP, as the
  rendered leader command gives them), and the restart policy is one under which a container's restart
  (the kvguard sidecar's) does not recreate the group, by LWS's own code (kubernetes-sigs/lws 060ab4da,
  the commit of the CRD in ../shared/upstream-schemas):
  pkg/controllers/pod_controller.go:204-213 handleRestartPolicy acts only for RecreateGroupOnPodRestart and
  RecreateGroupAfterStart, and then on podutils.ContainerRestarted, which counts init containers' restarts
  (a native sidecar's) and regular containers' alike (pkg/utils/pod/pod_utils.go:29-45).
- KServe: the ServingRuntime under Knative (KServe's Serverless mode, its shipped default) keeps Knative's
  pod rules: one container port across all containers (knative/serving pkg/apis/serving/k8s_validation.go
  98e5ef90:512-545) and no probes on the other containers while multi-container probing is off (:548-562);
  under RawDeployment kvguard keeps its port and probes. Both pass KServe's CRD schema.
"""

from __future__ import annotations

import os
import re
import shlex

import jsonschema
import pytest
import upstream_schemas
from conftest import TESTS
from test_attach_upstream import strict, validate_core
from test_helm_chart import CI_VALUES, SIDECAR_VALUES, WORKLOAD_VALUES, _ids, env_of, helm, only, render, template_args

# Device plugins' extended resources, by vendor (the resource's domain).
VENDORS = {
    "nvidia.com": "NVIDIA",
    "huawei.com": "Huawei Ascend",
    "amd.com": "AMD",
    "habana.ai": "Intel Gaudi",
    "intel.com": "Intel",
}
LWS = ("--set", "mode=leaderworkerset")
KSERVE = ("--set", "mode=servingruntime")
KSERVE_RAW = (*KSERVE, "--set", "servingRuntime.deploymentMode=RawDeployment")


def pod_specs(doc: dict) -> list[dict]:
    """Every pod spec in a rendered object (Deployment, DaemonSet, the LWS leader and worker templates) and a
    ServingRuntime's spec, which holds containers as a pod spec does."""
    found = []
    if isinstance(doc, dict):
        if isinstance(doc.get("containers"), list):
            found.append(doc)
        for value in doc.values():
            found += pod_specs(value)
    elif isinstance(doc, list):
        for value in doc:
            found += pod_specs(value)
    return found


def vendors_asked(spec: dict) -> set[str]:
    names = set()
    for container in spec.get("initContainers", []) + spec["containers"]:
        for kind in ("limits", "requests"):
            names |= set((container.get("resources") or {}).get(kind) or {})
    return {VENDORS[name.split("/")[0]] for name in names if name.split("/")[0] in VENDORS}


def _cases():
    for values in WORKLOAD_VALUES:
        yield pytest.param(values, (), id=_ids(values))
        if values is None or values in SIDECAR_VALUES:
            yield pytest.param(values, LWS, id=f"{_ids(values)}-leaderworkerset")
            yield pytest.param(values, KSERVE_RAW, id=f"{_ids(values)}-servingruntime-raw")
            if values is None or "servicemonitor" not in values:  # Knative: PodMonitor only
                yield pytest.param(values, KSERVE, id=f"{_ids(values)}-servingruntime-serverless")


@pytest.mark.parametrize(("values", "extra"), list(_cases()))
def test_no_rendered_pod_asks_for_two_vendors(values, extra):
    specs = [spec for doc in render(values, *extra) for spec in pod_specs(doc)]
    assert specs
    for spec in specs:
        assert len(vendors_asked(spec)) <= 1, vendors_asked(spec)


@pytest.mark.parametrize("values", [v for v in CI_VALUES if "ascend" in v and v.startswith("ci/sidecar-")])
@pytest.mark.parametrize("extra", [(), LWS, KSERVE], ids=["sidecar", "leaderworkerset", "servingruntime"])
def test_an_ascend_pod_asks_for_npus_only(values, extra):
    specs = [spec for doc in render(values, *extra) for spec in pod_specs(doc)]
    serving = [c for spec in specs for c in spec["containers"] if c["name"] != "kvguard"]
    assert serving
    for container in serving:
        limits = container["resources"]["limits"]
        assert [name for name in limits if "/" in name and name.startswith("huawei.com/Ascend")]
        assert "nvidia.com/gpu" not in limits and "nvidia.com/gpu" not in container["resources"].get("requests", {})


def test_the_310p_values_ask_for_the_310p_resource_by_its_device_plugin_name():
    (serving,) = [
        c
        for spec in pod_specs(only(render("ci/sidecar-vllm-ascend-310p-values.yaml"), "Deployment"))
        for c in spec["containers"]
        if c["name"] != "kvguard"
    ]
    assert serving["resources"]["limits"]["huawei.com/Ascend310P"] == 1
    assert vendors_asked({"containers": [serving]}) == {"Huawei Ascend"}


@pytest.mark.parametrize("resource", ["nvidia.com/gpu", "huawei.com/Ascend910", "huawei.com/Ascend310P"])
def test_an_accelerator_set_in_resources_is_refused_with_the_value_to_use(resource):
    key = resource.replace(".", "\\.")
    result = helm(*template_args(None, "--set", f"serving.resources.limits.{key}=2"))
    assert result.returncode != 0
    assert f"serving.resources.limits names the accelerator {resource}" in result.stderr
    assert "serving.accelerator" in result.stderr


def test_accelerator_count_zero_asks_for_none():
    docs = render(None, "--set", "serving.accelerator.count=0")
    assert not [v for doc in docs for spec in pod_specs(doc) for v in vendors_asked(spec)]


# ----------------------------------------------------------------- LeaderWorkerSet


def _expand(text: str, env: dict[str, dict]) -> str:
    """Kubernetes' $(VAR) expansion in command and args, from the container's literal env values."""
    return re.sub(
        r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: env[m.group(1)]["value"] if "value" in env.get(m.group(1), {}) else m.group(0),
        text,
    )


def _vllm_flag(command: list[str], env: dict[str, dict], flag: str) -> int:
    words = shlex.split(" ".join(_expand(part, env) for part in command))
    values = [words[i + 1] for i, word in enumerate(words[:-1]) if word in (flag, flag.replace("-", "_"))]
    values += [word.split("=", 1)[1] for word in words if word.startswith(flag + "=")]
    if not values:
        return 1  # vLLM's default for a parallel size
    assert len(values) == 1, values
    return int(values[0])


def _serving(template: dict) -> dict:
    (container,) = [c for c in template["spec"]["containers"] if c["name"] != "kvguard"]
    return container


@pytest.mark.parametrize("values", [None, *[v for v in SIDECAR_VALUES if "ascend" in v]], ids=_ids)
def test_the_groups_accelerators_are_the_engines_ranks(values):
    lws = only(render(values, *LWS), "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    leader, worker = _serving(lws["leaderTemplate"]), _serving(lws["workerTemplate"])
    env = env_of(leader)
    ranks = _vllm_flag(leader["command"], env, "--tensor-parallel-size") * _vllm_flag(
        leader["command"], env, "--pipeline-parallel-size"
    )
    per_pod = {int(v) for c in (leader, worker) for k, v in c["resources"]["limits"].items() if "/" in k}
    assert len(per_pod) == 1  # leader and workers alike
    assert per_pod.pop() * lws["size"] == ranks
    assert ranks > 1 and lws["size"] > 1  # the default is a multi-node engine


def test_a_group_whose_accelerators_are_not_the_ranks_is_refused():
    result = helm(*template_args(None, *LWS, "--set", "leaderWorkerSet.size=3"))
    assert result.returncode != 0
    assert "tensorParallelSize x pipelineParallelSize = 16 ranks, but acceleratorsPerPod x size = 24" in result.stderr


# What handleRestartPolicy acts on (pod_controller.go 060ab4da:206-209); any other policy returns at once.
GROUP_RECREATING = {"RecreateGroupOnPodRestart", "RecreateGroupAfterStart"}


def test_a_sidecar_restart_does_not_recreate_the_group():
    lws = only(render(None, *LWS), "LeaderWorkerSet")
    policy = lws["spec"]["leaderWorkerTemplate"]["restartPolicy"]
    crd = upstream_schemas.schema("leaderworkerset.x-k8s.io_v1.json")
    field = crd["properties"]["spec"]["properties"]["leaderWorkerTemplate"]["properties"]["restartPolicy"]
    assert policy in field["enum"] and policy != "Default"  # Default: deprecated, the webhook makes it None
    assert field["default"] in GROUP_RECREATING  # so the chart must say so, not leave it out
    assert policy not in GROUP_RECREATING
    # kvguard does run as an init container there (a native sidecar), whose restarts LWS counts.
    leader_spec = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    assert [c for c in leader_spec.get("initContainers", []) if c["name"] == "kvguard"]


@pytest.mark.parametrize("policy", sorted(GROUP_RECREATING))
def test_the_group_recreating_policies_remain_a_choice_and_pass_the_crd(policy):
    lws = only(render(None, *LWS, "--set", f"leaderWorkerSet.restartPolicy={policy}"), "LeaderWorkerSet")
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == policy
    jsonschema.Draft7Validator(strict(upstream_schemas.schema("leaderworkerset.x-k8s.io_v1.json"))).validate(lws)


def test_the_deprecated_default_policy_is_not_offered():
    result = helm(*template_args(None, *LWS, "--set", "leaderWorkerSet.restartPolicy=Default"))
    assert result.returncode != 0


# ------------------------------------------------------------------------ KServe

SERVERLESS = ("Serverless", "Knative")
RAW = ("RawDeployment", "Standard")


def runtime(mode: str) -> dict:
    return only(render(None, *KSERVE, "--set", f"servingRuntime.deploymentMode={mode}"), "ServingRuntime")


@pytest.mark.parametrize("mode", SERVERLESS + RAW)
def test_the_servingruntime_passes_kserves_crd_and_kubernetes_in_each_mode(mode):
    doc = runtime(mode)
    jsonschema.Draft7Validator(
        strict(upstream_schemas.schema("serving.kserve.io_v1alpha1_servingruntime.json"))
    ).validate(doc)
    validate_core("Pod", {"spec": {"containers": doc["spec"]["containers"], "volumes": doc["spec"]["volumes"]}})


def test_kserves_default_mode_is_the_charts_default():
    """KServe's shipped inferenceservice-config says Serverless (config/configmap/inferenceservice.yaml
    aaac4e29:745): the chart's default runtime must be one Knative admits."""
    assert render(None, *KSERVE) == render(None, *KSERVE, "--set", "servingRuntime.deploymentMode=Serverless")


@pytest.mark.parametrize("mode", SERVERLESS)
def test_under_knative_one_container_port_and_no_probe_on_kvguard(mode):
    containers = runtime(mode)["spec"]["containers"]
    ports = [p for c in containers for p in c.get("ports", [])]
    assert len(ports) == 1  # validateContainersPorts: count > 1 refused
    assert containers[0]["name"] == "kserve-container" and containers[0]["ports"] == ports
    for sidecar in containers[1:]:  # validateSidecarContainer, probing off
        assert not {"livenessProbe", "readinessProbe", "startupProbe"} & set(sidecar)
    assert "initContainers" not in runtime(mode)["spec"]  # a ServingRuntime has none


# The container securityContext fields Knative's webhook lets through (knative/serving
# pkg/apis/serving/fieldmask.go, SecurityContextMask at ec4128ad): any other field set, even to false
# (privileged: false), fails the Revision's validation.
KNATIVE_SECURITY_CONTEXT = {"capabilities", "readOnlyRootFilesystem", "runAsUser", "runAsGroup", "runAsNonRoot"}


@pytest.mark.parametrize("mode", SERVERLESS)
def test_under_knative_kvguards_security_context_sets_only_fields_knative_admits(mode):
    (kvguard,) = [c for c in runtime(mode)["spec"]["containers"] if c["name"] == "kvguard"]
    assert set(kvguard["securityContext"]) <= KNATIVE_SECURITY_CONTEXT, kvguard["securityContext"]
    assert kvguard["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert kvguard["securityContext"]["runAsNonRoot"] is True
    raw = runtime("RawDeployment")["spec"]["containers"]
    (kept,) = [c for c in raw if c["name"] == "kvguard"]
    assert kept["securityContext"]["allowPrivilegeEscalation"] is False  # outside Knative it stays


@pytest.mark.parametrize("mode", SERVERLESS)
def test_under_knative_the_podmonitor_scrapes_kvguards_undeclared_port(mode):
    docs = render(None, *KSERVE, "--set", f"servingRuntime.deploymentMode={mode}")
    assert not [d for d in docs if d["kind"] == "Service"]  # no declared port to route to
    (endpoint,) = only(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert "port" not in endpoint and "portNumber" not in endpoint
    keep, ipv6, ipv4 = endpoint["relabelings"][:3]
    assert keep == {"action": "keep", "sourceLabels": ["__meta_kubernetes_pod_container_name"], "regex": "kvguard"}
    # Prometheus' port-free target: the pod IP, IPv6 bracketed by newer releases and bare by older ones
    # (prometheus/prometheus discovery/kubernetes/pod.go, "We don't have a port so we just set the address").
    for rule, address, expected in (
        (ipv6, "fd00::7", "[fd00::7]:10240"),
        (ipv6, "[fd00::7]", "[fd00::7]:10240"),
        (ipv4, "10.1.2.3", "10.1.2.3:10240"),
    ):
        # Prometheus anchors relabel regexes; Go's $1 is Python's \1 here.
        assert re.fullmatch(rule["regex"], address)
        assert re.sub(f"^(?:{rule['regex']})$", rule["replacement"].replace("$1", r"\1"), address) == expected
    assert not re.fullmatch(ipv4["regex"], "[fd00::7]:10240")  # the IPv6 result is left alone
    assert not re.fullmatch(ipv6["regex"], "10.1.2.3")


def test_a_servicemonitor_under_knative_is_refused():
    result = helm(*template_args(None, *KSERVE, "--set", "monitor.kind=ServiceMonitor"))
    assert result.returncode != 0 and "use monitor.kind=PodMonitor" in result.stderr


@pytest.mark.parametrize("mode", RAW)
def test_under_rawdeployment_kvguard_keeps_its_port_and_probes(mode):
    kvguard = [c for c in runtime(mode)["spec"]["containers"] if c["name"] == "kvguard"][0]
    assert [p["containerPort"] for p in kvguard["ports"]] == [10240]
    assert {"livenessProbe", "readinessProbe", "startupProbe"} <= set(kvguard)
    docs = render(None, *KSERVE, "--set", f"servingRuntime.deploymentMode={mode}")
    assert only(docs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_the_docs_name_both_kserve_modes():
    text = open(os.path.join(TESTS, "..", "docs", "how-to", "kubernetes.md"), encoding="utf-8").read()
    for word in (
        "Serverless",
        "RawDeployment",
        "servingRuntime.deploymentMode",
        "restartPolicy",
        "serving.accelerator",
        "acceleratorsPerPod",
    ):
        assert word in text


def _snake(rule: dict) -> dict:
    """A prometheus-operator RelabelConfig as Prometheus' relabel_config spells it."""
    return {re.sub(r"[A-Z]", lambda m: "_" + m.group(0).lower(), key): value for key, value in rule.items()}


def test_a_real_prometheus_makes_kvguards_address_from_the_knative_relabeling(tmp_path):
    """The PodMonitor's relabelings, as the operator hands them to Prometheus (relabel_configs), applied by a
    real Prometheus to the port-free targets pod discovery makes for containers without ports (file discovery
    stands in for it with the same __address__ and container label): kvguard's target gets kvguard's port, IPv4
    and bracketed IPv6 alike, and the serving container's declared-port target is dropped."""
    import json

    from test_prometheus_e2e import STARTUP_DEADLINE, kvguard_and_prometheus, kvguard_env, poll

    (endpoint,) = only(render(None, *KSERVE), "PodMonitor")["spec"]["podMetricsEndpoints"]
    targets_file = tmp_path / "targets.json"
    targets_file.write_text(
        json.dumps(
            [
                {"targets": ["10.1.2.3"], "labels": {"__meta_kubernetes_pod_container_name": "kvguard"}},
                {"targets": ["[fd00::7]"], "labels": {"__meta_kubernetes_pod_container_name": "kvguard"}},
                {"targets": ["10.1.2.3:8080"], "labels": {"__meta_kubernetes_pod_container_name": "kserve-container"}},
            ]
        )
    )
    scrape = {
        "job_name": "knative",
        "metrics_path": endpoint["path"],
        "scrape_interval": "1h",
        "file_sd_configs": [{"files": [str(targets_file)]}],
        "relabel_configs": [_snake(r) for r in endpoint["relabelings"]],
    }
    args = ["--demo", "--spool-dir", str(tmp_path / "spool"), "--interval", "1"]
    with kvguard_and_prometheus(tmp_path, args, [], env=kvguard_env(), scrape_configs=[scrape]) as stack:

        def knative(state: str, key: str) -> list[dict]:
            found = stack.api("targets", state=state)["data"][key]
            return [
                t
                for t in found
                if t.get("scrapePool") == "knative" or t.get("discoveredLabels", {}).get("job") == "knative"
            ]

        active = poll("the knative pool's targets", lambda: knative("active", "activeTargets"), STARTUP_DEADLINE)
        assert sorted(t["labels"]["instance"] for t in active) == ["10.1.2.3:10240", "[fd00::7]:10240"]
        assert {t["labels"]["job"] for t in active} == {"kvguard"}
        dropped = knative("dropped", "droppedTargets")
        assert [t["discoveredLabels"]["__address__"] for t in dropped] == ["10.1.2.3:8080"]
