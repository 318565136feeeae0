"""Where the real, public PyTorch snapshots lie: ../shared beside the checkout, as CI lays it out.

They are fetched public data, never committed; ``KVGUARD_TORCH_SNAPSHOTS`` may name other folders,
separated by ``os.pathsep``, searched recursively.
"""

from __future__ import annotations

import glob
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED = os.path.join(os.path.dirname(REPO), "shared")
REAL_DIRS = [
    path
    for path in os.environ.get(
        "KVGUARD_TORCH_SNAPSHOTS",
        os.pathsep.join([os.path.join(SHARED, "torch-snapshots"), os.path.join(SHARED, "torch-snapshots-2")]),
    ).split(os.pathsep)
    if path
]

# The files ../shared should hold (tests/data/shared/MANIFEST.json): with the default folders, each expected
# snapshot is one test, run where its file is, skipped one by one where it is not (failed with CI=true).
with open(os.path.join(REPO, "tests", "data", "shared", "MANIFEST.json"), encoding="utf-8") as _handle:
    SHARED_MANIFEST = json.load(_handle)["folders"]


def snapshot_params(custom_id=None):
    """One pytest.param per real snapshot: under KVGUARD_TORCH_SNAPSHOTS every ``*.pickle`` found (one skipped
    param for a folder holding none); by default every file the manifest names, each marked ``shared_data``
    so that a missing one is its own skip (tests/conftest.py)."""
    params = []
    if "KVGUARD_TORCH_SNAPSHOTS" in os.environ:
        for folder in REAL_DIRS:
            found = sorted(glob.glob(os.path.join(folder, "**", "*.pickle"), recursive=True))
            name = os.path.basename(os.path.normpath(folder))
            if not found:
                params.append(
                    pytest.param(
                        None,
                        id=f"{name}:none",
                        marks=pytest.mark.skip(reason=f"no real snapshots in {folder} (KVGUARD_TORCH_SNAPSHOTS)"),
                    )
                )
            params += [pytest.param(path, id=f"{name}/{os.path.relpath(path, folder)}") for path in found]
        return params
    for name, entry in SHARED_MANIFEST.items():
        for item in entry["files"]:
            path = os.path.join(SHARED, name, item["path"])
            params.append(
                pytest.param(
                    path, id=f"{name}/{item['path']}", marks=pytest.mark.shared_data(path=path, source=entry["source"])
                )
            )
    return params
