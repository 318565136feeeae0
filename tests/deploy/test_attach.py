"""Attaching kvguard to a vLLM Deployment or StatefulSet that already runs: the chart's mode attach
renders a strategic-merge patch, and the real kubectl applies it (`kubectl patch --local`, offline)
and builds it into a kustomize overlay (`kubectl kustomize`). The results are validated against the
Kubernetes 1.31 strict schemas (kubernetes-validate), as the chart's own objects are."""

from __future__ import annotations

import os
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml
from conftest import ROOT
from test_helm_chart import CHART, IMAGE, KUBERNETES_VERSION, env_of, flag_values, helm

DATA = os.path.join(ROOT, "tests", "data", "attach")
WORKLOADS = {  # file, attach values
    "Deployment": (
        "vllm-deployment.yaml",
        {"kind": "Deployment", "name": "mistral-7b", "container": "mistral-7b", "port": 8000},
    ),
    "StatefulSet": (
        "vllm-statefulset.yaml",
        {"kind": "StatefulSet", "name": "qwen", "container": "server", "port": 8080},
    ),
}


def kubectl(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    found = shutil.which("kubectl") or os.path.join(ROOT, ".tools", "kubectl")
    if not os.access(found, os.X_OK):
        pytest.fail("kubectl not found on PATH nor at .tools/kubectl: run ./dev.sh test, which fetches it")
    return subprocess.run(
        [found, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "KUBECONFIG": os.devnull},
    )


def patch_text(attach: dict, *extra: str) -> str:
    sets = [arg for key, value in attach.items() for arg in ("--set", f"attach.{key}={value}")]
    result = helm(
        "template", "kvguard-attach", CHART, "--namespace", "serving", *IMAGE, "--set", "mode=attach", *sets, *extra
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


@pytest.fixture(scope="module", params=sorted(WORKLOADS))
def attached(request, tmp_path_factory):
    """(original, patched by kubectl patch, built by kubectl kustomize, attach values)."""
    name, attach = WORKLOADS[request.param]
    work = tmp_path_factory.mktemp(request.param)
    (work / "kvguard-patch.yaml").write_text(patch_text(attach))
    original = os.path.join(DATA, name)
    result = kubectl(
        "patch",
        "--local",
        "-f",
        original,
        "--type",
        "strategic",
        "--patch-file",
        str(work / "kvguard-patch.yaml"),
        "-o",
        "yaml",
    )
    assert result.returncode == 0, result.stderr
    patched = yaml.safe_load(result.stdout)
    shutil.copy(original, work / name)
    (work / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [name],
                "patches": [{"path": "kvguard-patch.yaml"}],
            }
        )
    )
    result = kubectl("kustomize", str(work))
    assert result.returncode == 0, result.stderr
    built = yaml.safe_load(result.stdout)
    return load(original), patched, built, attach


def containers(doc: dict) -> dict[str, dict]:
    spec = doc["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


def test_the_patched_workload_is_valid_for_kubernetes_1_31(attached):
    _, patched, built, _ = attached
    for doc in (patched, built):
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{'.'.join(map(str, exc.path))}: {exc.message}")


def test_kustomize_and_kubectl_patch_make_the_same_workload(attached):
    _, patched, built, _ = attached
    assert built["spec"] == patched["spec"]


def test_the_serving_container_keeps_everything_and_gains_the_spool_and_plugin(attached):
    original, patched, _, attach = attached
    before, after = containers(original)[attach["container"]], containers(patched)[attach["container"]]
    assert {k: v for k, v in after.items() if k not in ("env", "volumeMounts")} == {
        k: v for k, v in before.items() if k not in ("env", "volumeMounts")
    }
    assert [e for e in after["env"] if e in before.get("env", [])] == before.get("env", [])
    added = {e["name"]: e["value"] for e in after["env"] if e not in before.get("env", [])}
    assert added == {"KVGUARD_SPOOL_DIR": "/run/kvguard", "PYTHONPATH": "/opt/kvguard-plugin"}
    mounts = {m["name"]: m["mountPath"] for m in after["volumeMounts"]}
    assert mounts["kvguard-spool"] == "/run/kvguard" and mounts["kvguard-plugin"] == "/opt/kvguard-plugin"
    assert all(m in after["volumeMounts"] for m in before["volumeMounts"])


def test_kvguard_runs_as_the_native_sidecar_after_the_plugin_copy(attached):
    original, patched, _, attach = attached
    spec = patched["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["kvguard-plugin", "kvguard"]
    kvguard = spec["initContainers"][1]
    assert kvguard["restartPolicy"] == "Always"
    assert flag_values(kvguard, "--spool-dir") == ["/run/kvguard"]
    assert flag_values(kvguard, "--vllm-metrics-url") == [f"http://127.0.0.1:{attach['port']}/metrics"]
    assert env_of(kvguard)["CONTAINER_NAME"]["value"] == attach["container"]
    assert [c["name"] for c in spec["containers"]] == [
        c["name"] for c in original["spec"]["template"]["spec"]["containers"]
    ]


def test_volumes_and_selector_are_kept_and_the_pods_are_labelled_for_the_cluster_podmonitor(attached):
    original, patched, _, attach = attached
    names = [v["name"] for v in patched["spec"]["template"]["spec"]["volumes"]]
    assert all(v["name"] in names for v in original["spec"]["template"]["spec"].get("volumes", []))
    assert {"kvguard-spool", "kvguard-plugin", "kvguard-tmp"} <= set(names)
    assert patched["spec"]["selector"] == original["spec"]["selector"]
    labels = patched["spec"]["template"]["metadata"]["labels"]
    assert labels == {
        **original["spec"]["template"]["metadata"]["labels"],
        "kvguard.dev/scrape": "true",
        "kvguard.dev/container": attach["container"],
    }


def test_the_cluster_releases_podmonitor_scrapes_attached_pods_in_any_namespace():
    result = helm("template", "kvguard", CHART, "--namespace", "monitoring", "--set", "mode=cluster")
    assert result.returncode == 0, result.stderr
    (monitor,) = [d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "PodMonitor"]
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["selector"]["matchLabels"] == {"kvguard.dev/scrape": "true"}
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == "metrics"  # the kvguard container's port name in the patch
    assert {
        "action": "replace",
        "sourceLabels": ["__meta_kubernetes_pod_label_kvguard_dev_container"],
        "targetLabel": "container",
    } in endpoint["relabelings"]


def test_the_patch_alone_is_what_mode_attach_renders():
    docs = [d for d in yaml.safe_load_all(patch_text(WORKLOADS["Deployment"][1])) if d]
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [("Deployment", "mistral-7b")]
    assert "selector" not in docs[0]["spec"]  # a patch: never an object helm could install
