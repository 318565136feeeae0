"""The upstream API schemas the attach paths are validated against (tests/deploy/test_attach_upstream.py).

No registry reachable here ships them (npm has no @kubernetes-models package for LeaderWorkerSet or
KServe; production-stack's chart is published on GitHub Pages only), and data fetched from public
repositories is not committed here. So the files lie, exactly as upstream keeps them, in
``../shared/upstream-schemas/`` beside the checkout (as CI lays it out), or in the folder
``KVGUARD_UPSTREAM_SCHEMAS`` names; tests/data/upstream/MANIFEST.json names each one's repository,
commit and path. A missing file skips its tests with one line naming it.

From a CRD the version's openAPIV3Schema is taken, descriptions dropped, and the subtrees the CRD copies
from Kubernetes (pod templates, containers, volumes: ``left_open`` in the manifest) left open: the
tests validate those with kubernetes-validate's Kubernetes schemas instead.
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDER = os.environ.get("KVGUARD_UPSTREAM_SCHEMAS") or os.path.join(os.path.dirname(REPO), "shared", "upstream-schemas")
with open(os.path.join(REPO, "tests", "data", "upstream", "MANIFEST.json"), encoding="utf-8") as _handle:
    MANIFEST = json.load(_handle)
OPEN = {"x-kubernetes-preserve-unknown-fields": True}  # any value: validated elsewhere


def _strip(node, open_keys: frozenset):
    if isinstance(node, dict):
        return {k: (OPEN if k in open_keys else _strip(v, open_keys)) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_strip(v, open_keys) for v in node]
    return node


@functools.lru_cache(maxsize=None)
def _load(name: str) -> str:
    entry = MANIFEST[name]
    path = os.path.join(FOLDER, entry["file"])
    if not os.path.isfile(path):
        pytest.skip(
            f"{entry['file']} ({entry['repository']}@{entry['commit'][:12]}:{entry['path']}) is not in "
            f"{FOLDER}: see tests/support/upstream_schemas.py"
        )
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def schema(name: str) -> dict:
    """The schema ``name`` (a key of the manifest), as the tests apply it."""
    entry = MANIFEST[name]
    text = _load(name)
    if "version" not in entry:
        return json.loads(text)
    crd = yaml.safe_load(text)
    (found,) = [v for v in crd["spec"]["versions"] if v["name"] == entry["version"]]
    return _strip(found["schema"]["openAPIV3Schema"], frozenset(entry.get("left_open", ())))
