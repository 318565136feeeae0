"""The attach paths for LeaderWorkerSet, KServe and vLLM's production-stack, rendered and validated.

Each upstream kind is validated against its own upstream schema, read from ../shared/upstream-schemas/
as upstream keeps it (tests/support/upstream_schemas.py; commits in tests/data/upstream/MANIFEST.json): the
LeaderWorkerSet and ServingRuntime CRDs' openAPIV3Schema, made strict (unknown fields refused, as `kubectl apply`'s
server-side field validation does), and production-stack's own values.schema.json. What those CRDs
copy from Kubernetes (pod templates, containers, volumes) is validated with kubernetes-validate's
Kubernetes 1.31 strict schemas instead.
"""

from __future__ import annotations

import copy
import os

import jsonschema
import kubernetes_validate
import pytest
import upstream_schemas
import yaml
from conftest import ROOT
from test_helm_chart import KUBERNETES_VERSION, env_of, flag_values, only, pod_spec, render

PRODUCTION_STACK_VALUES = os.path.join(ROOT, "helm", "examples", "production-stack-values.yaml")


def upstream(name: str) -> dict:
    return upstream_schemas.schema(name)


def strict(schema):
    """The CRD schema as the API server applies it with strict field validation: objects with
    declared properties refuse others (x-kubernetes-preserve-unknown-fields keeps a subtree open)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def validate_core(kind: str, body: dict, api_version: str = "v1") -> None:
    doc = {"apiVersion": api_version, "kind": kind, "metadata": {"name": "x", "namespace": "serving"}, **body}
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{kind}: {'.'.join(map(str, exc.path))}: {exc.message}")


def containers_of(spec: dict) -> dict[str, dict]:
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


# ----------------------------------------------------------------- LeaderWorkerSet


@pytest.fixture(scope="module")
def lws() -> dict:
    return only(render(None, "--set", "mode=leaderworkerset"), "LeaderWorkerSet")


def test_the_leaderworkerset_passes_the_lws_v1_crd_schema(lws):
    jsonschema.Draft7Validator(strict(upstream("leaderworkerset.x-k8s.io_v1.json"))).validate(lws)


@pytest.mark.parametrize("role", ["leaderTemplate", "workerTemplate"])
def test_both_pod_templates_are_valid_kubernetes_pod_templates(lws, role):
    validate_core("PodTemplate", {"template": lws["spec"]["leaderWorkerTemplate"][role]})


@pytest.mark.parametrize("role", ["leaderTemplate", "workerTemplate"])
def test_every_pod_of_the_group_names_one_engine_from_the_lws_labels(lws, role):
    from kvguard.sidecar.observation import ENGINE_ID_ENV

    kvguard = containers_of(lws["spec"]["leaderWorkerTemplate"][role]["spec"])["kvguard"]
    env = env_of(kvguard)
    # kubernetes-sigs/lws site/content/en/docs/reference/labels-annotations-and-environment-variables.md
    assert (
        env["LWS_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['leaderworkerset.sigs.k8s.io/name']"
    )
    assert (
        env["LWS_GROUP_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']"
    )
    assert env[ENGINE_ID_ENV]["value"] == "$(LWS_NAME)-$(LWS_GROUP_INDEX)"
    names = list(env)
    assert names.index("LWS_NAME") < names.index(ENGINE_ID_ENV)  # $(VAR) expands only earlier vars


def test_the_leader_serves_and_the_workers_join_its_ray_cluster(lws):
    template = lws["spec"]["leaderWorkerTemplate"]
    leader = containers_of(template["leaderTemplate"]["spec"])
    worker = containers_of(template["workerTemplate"]["spec"])
    assert "multi-node-serving.sh leader" in leader["vllm"]["command"][-1]
    assert "vllm serve" in leader["vllm"]["command"][-1]
    assert "multi-node-serving.sh worker --ray_address=$(LWS_LEADER_ADDRESS)" in worker["vllm"]["command"][-1]
    assert "readinessProbe" in leader["vllm"] and "readinessProbe" not in worker["vllm"]
    assert flag_values(leader["kvguard"], "--vllm-metrics-url") and not flag_values(
        worker["kvguard"], "--vllm-metrics-url"
    )
    for pods in (leader, worker):  # each pod's ranks write its own spool, which its kvguard reads
        assert env_of(pods["vllm"])["KVGUARD_SPOOL_DIR"]["value"] == flag_values(pods["kvguard"], "--spool-dir")[0]
        assert pods["kvguard"]["restartPolicy"] == "Always"


def test_the_podmonitor_scrapes_leader_and_workers(lws):
    docs = render(None, "--set", "mode=leaderworkerset")
    selector = only(docs, "PodMonitor")["spec"]["selector"]["matchLabels"]
    for role in ("leaderTemplate", "workerTemplate"):
        labels = lws["spec"]["leaderWorkerTemplate"][role]["metadata"]["labels"]
        assert selector.items() <= labels.items()


# ----------------------------------------------------------------------- KServe


@pytest.fixture(scope="module")
def runtime() -> dict:
    return only(render(None, "--set", "mode=servingruntime"), "ServingRuntime")


def test_the_servingruntime_passes_the_kserve_v1alpha1_crd_schema(runtime):
    jsonschema.Draft7Validator(strict(upstream("serving.kserve.io_v1alpha1_servingruntime.json"))).validate(runtime)


def test_its_containers_and_volumes_are_valid_kubernetes_ones(runtime):
    spec = runtime["spec"]
    validate_core("Pod", {"spec": {"containers": spec["containers"], "volumes": spec["volumes"]}})


def test_kserve_container_writes_the_spool_kvguard_reads_and_kvguard_reads_vllm_on_kserves_port(runtime):
    containers = containers_of(runtime["spec"])
    vllm, kvguard = containers["kserve-container"], containers["kvguard"]
    assert env_of(vllm)["KVGUARD_SPOOL_DIR"]["value"] == flag_values(kvguard, "--spool-dir")[0]
    assert flag_values(kvguard, "--vllm-metrics-url") == ["http://127.0.0.1:8080/metrics"]
    assert env_of(kvguard)["CONTAINER_NAME"]["value"] == "kserve-container"
    assert "restartPolicy" not in kvguard  # a ServingRuntime has no init containers
    assert vllm["args"][0] == "/mnt/models"  # where KServe's storage initializer puts the model


def test_the_pods_kserve_makes_carry_the_labels_the_podmonitor_selects(runtime):
    monitor = only(render(None, "--set", "mode=servingruntime"), "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= runtime["spec"]["labels"].items()
    relabel = [
        r for r in monitor["spec"]["podMetricsEndpoints"][0]["relabelings"] if r.get("targetLabel") == "container"
    ]
    assert relabel == [{"action": "replace", "targetLabel": "container", "replacement": "kserve-container"}]


# --------------------------------------------------------- vLLM production-stack


@pytest.fixture(scope="module")
def stack_values() -> dict:
    with open(PRODUCTION_STACK_VALUES, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def declared_keys(values, schema, path="") -> list[str]:
    """Keys of values the schema does not declare, where it declares properties (its own schema
    leaves additionalProperties open, so a misspelt key would pass it silently)."""
    missing = []
    if isinstance(values, dict) and isinstance(schema, dict) and "properties" in schema:
        for key, value in values.items():
            if key not in schema["properties"]:
                missing.append(f"{path}{key}")
            else:
                missing += declared_keys(value, schema["properties"][key], f"{path}{key}.")
    elif isinstance(values, list) and isinstance(schema, dict) and "items" in schema:
        for index, item in enumerate(values):
            missing += declared_keys(item, schema["items"], f"{path}{index}.")
    return missing


def test_the_values_pass_production_stacks_own_schema_and_name_only_its_keys(stack_values):
    schema = upstream("production-stack.values.schema.json")
    jsonschema.Draft202012Validator(schema).validate(stack_values)
    assert declared_keys(stack_values, schema) == []


def test_the_stacks_engine_pod_parts_are_valid_kubernetes_ones(stack_values):
    (model,) = stack_values["servingEngineSpec"]["modelSpec"]
    init = model["initContainer"]
    validate_core(
        "Pod",
        {
            "spec": {
                "initContainers": [
                    {
                        "name": init["name"],
                        "image": init["image"],
                        "command": init["command"],
                        "volumeMounts": init["extraVolumeMounts"],
                    }
                ],
                "containers": [
                    {
                        "name": "vllm",
                        "image": "vllm/vllm-openai:v0.11.0",
                        "env": model["env"],
                        "volumeMounts": model["extraVolumeMounts"],
                    }
                ],
                "volumes": model["extraVolumes"],
            }
        },
    )


def test_the_stacks_plugin_copy_is_the_charts_own(stack_values):
    (model,) = stack_values["servingEngineSpec"]["modelSpec"]
    (chart_init,) = [c for c in pod_spec(render())["initContainers"] if c["name"] == "kvguard-plugin"]
    assert model["initContainer"]["command"] == chart_init["command"]


def test_the_node_kvguard_reads_the_host_spool_the_engines_write(stack_values):
    (model,) = stack_values["servingEngineSpec"]["modelSpec"]
    host = next(v for v in model["extraVolumes"] if v["name"] == "kvguard-spool")["hostPath"]["path"]
    engine_path = next(m for m in model["extraVolumeMounts"] if m["name"] == "kvguard-spool")["mountPath"]
    assert {e["name"]: e.get("value") for e in model["env"]}["KVGUARD_SPOOL_DIR"] == engine_path
    docs = render(None, "--set", "mode=daemonset", "--set", f"daemonset.spoolHostPath={host}")
    spec = pod_spec(docs)
    kvguard = containers_of(spec)["kvguard"]
    volume = next(v for v in spec["volumes"] if v["name"] == "kvguard-spool")
    assert volume["hostPath"]["path"] == host
    mount = next(m for m in kvguard["volumeMounts"] if m["name"] == "kvguard-spool")
    assert mount["readOnly"] is True and flag_values(kvguard, "--spool-dir") == [mount["mountPath"]]
    validate_core(
        "DaemonSet",
        copy.deepcopy(
            {k: v for k, v in only(docs, "DaemonSet").items() if k not in ("apiVersion", "kind", "metadata")}
        ),
        "apps/v1",
    )


@pytest.mark.parametrize(
    "schema, kind, mutate",
    [
        (
            "leaderworkerset.x-k8s.io_v1.json",
            "LeaderWorkerSet",
            lambda d: d["spec"]["leaderWorkerTemplate"].update(sizee=2),
        ),
        (
            "leaderworkerset.x-k8s.io_v1.json",
            "LeaderWorkerSet",
            lambda d: d["spec"]["leaderWorkerTemplate"].update(restartPolicy="Always"),
        ),
        (
            "serving.kserve.io_v1alpha1_servingruntime.json",
            "ServingRuntime",
            lambda d: d["spec"].update(initContainers=[]),
        ),
    ],
)
def test_the_crd_schemas_refuse_what_the_upstream_api_refuses(schema, kind, mutate):
    mode = "leaderworkerset" if kind == "LeaderWorkerSet" else "servingruntime"
    doc = copy.deepcopy(only(render(None, "--set", f"mode={mode}"), kind))
    mutate(doc)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(strict(upstream(schema))).validate(doc)
