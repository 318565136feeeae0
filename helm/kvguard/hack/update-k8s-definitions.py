#!/usr/bin/env python3
"""Refresh the Kubernetes definitions embedded in ../values.schema.json.

Values that are passed straight into the pod spec (affinity, tolerations, resources, security
contexts, env, volumes, probes) are checked against the Kubernetes 1.31 strict JSON schemas that
the kubernetes-validate package ships, so that an unknown key there fails `helm lint` and
`helm template` like anywhere else in the values. Helm resolves no remote references, so the
definitions these values reach are copied into the schema's "definitions", descriptions dropped.

Run after changing KUBERNETES_VERSION or ROOTS (tests/deploy/test_helm_chart.py checks they are current):

    .venv/bin/python helm/kvguard/hack/update-k8s-definitions.py
"""

from __future__ import annotations

import json
import pathlib
import re

import importlib_resources

KUBERNETES_VERSION = "1.31.0"
PREFIX = "io.k8s."
ROOTS = (
    "io.k8s.api.core.v1.Affinity",
    "io.k8s.api.core.v1.Toleration",
    "io.k8s.api.core.v1.ResourceRequirements",
    "io.k8s.api.core.v1.SecurityContext",
    "io.k8s.api.core.v1.PodSecurityContext",
    "io.k8s.api.core.v1.EnvVar",
    "io.k8s.api.core.v1.EnvFromSource",
    "io.k8s.api.core.v1.Volume",
    "io.k8s.api.core.v1.VolumeMount",
    "io.k8s.api.core.v1.Probe",
    "io.k8s.api.core.v1.LocalObjectReference",
    "io.k8s.api.core.v1.Capabilities",
    "io.k8s.api.apps.v1.DeploymentStrategy",
    "io.k8s.api.apps.v1.DaemonSetUpdateStrategy",
    "io.k8s.api.networking.v1.NetworkPolicyPeer",
    "io.k8s.apimachinery.pkg.api.resource.Quantity",
)
SCHEMA = pathlib.Path(__file__).resolve().parent.parent / "values.schema.json"
_REF = re.compile(r"^#/\$defs/(.+)$")


def kubernetes_definitions(version: str = KUBERNETES_VERSION) -> dict:
    path = importlib_resources.files("kubernetes_validate").joinpath(
        f"kubernetes-json-schema/v{version}-local-strict/_definitions.json"
    )
    return json.loads(path.read_text())["$defs"]


def _clean(node, reached: set[str]):
    """Drop descriptions and x-kubernetes extensions; point $refs at #/definitions."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "description" or key.startswith("x-kubernetes-"):
                continue
            if key == "$ref":
                name = _REF.match(value).group(1)
                reached.add(name)
                out[key] = f"#/definitions/{name}"
            else:
                out[key] = _clean(value, reached)
        return out
    if isinstance(node, list):
        return [_clean(item, reached) for item in node]
    return node


def embedded_definitions(roots=ROOTS, version: str = KUBERNETES_VERSION) -> dict:
    source = kubernetes_definitions(version)
    done: dict[str, dict] = {}
    pending = list(roots)
    while pending:
        name = pending.pop()
        if name in done:
            continue
        reached: set[str] = set()
        done[name] = _clean(source[name], reached)
        pending.extend(reached - done.keys())
    return dict(sorted(done.items()))


def main() -> None:
    schema = json.loads(SCHEMA.read_text())
    own = {k: v for k, v in schema.get("definitions", {}).items() if not k.startswith(PREFIX)}
    schema["definitions"] = {**own, **embedded_definitions()}
    SCHEMA.write_text(json.dumps(schema, indent=2) + "\n")
    print(f"{SCHEMA}: {len(schema['definitions']) - len(own)} Kubernetes {KUBERNETES_VERSION} definitions")


if __name__ == "__main__":
    main()
