"""Tests that read ../shared (fetched public data, never committed) say so one by one when it is missing, and
fail in CI (CI=true), where the folder must be laid out (issue 35)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import TESTS
from real_snapshots import SHARED_MANIFEST, snapshot_params

HERE = TESTS

MODULE = """
import pytest

@pytest.mark.parametrize("path", [
    pytest.param("/nonexistent/shared/torch-snapshots/a.pickle", id="a",
                 marks=pytest.mark.shared_data(path="/nonexistent/shared/torch-snapshots/a.pickle",
                                               source="public snapshots (PROVENANCE.md)")),
    pytest.param("/nonexistent/shared/torch-snapshots/b.pickle", id="b",
                 marks=pytest.mark.shared_data(path="/nonexistent/shared/torch-snapshots/b.pickle",
                                               source="public snapshots (PROVENANCE.md)")),
])
def test_reads(path):
    open(path, "rb").close()
"""


def run(tmp_path, ci: str | None):
    (tmp_path / "test_needs_shared.py").write_text(MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    env.pop("CI", None)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            "-rsf",
            "-q",
            str(tmp_path / "test_needs_shared.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_each_missing_shared_file_is_its_own_skip_naming_it_and_its_source(tmp_path):
    result = run(tmp_path, None)
    assert "2 skipped" in result.stdout, result.stdout
    for name in ("a.pickle", "b.pickle"):
        assert (
            f"torch-snapshots/{name} is missing: ../shared beside the checkout holds public snapshots "
            f"(PROVENANCE.md)" in result.stdout
        )


def test_in_ci_a_missing_shared_file_fails(tmp_path):
    result = run(tmp_path, "true")
    assert result.returncode == 1 and "2 errors" in result.stdout, result.stdout  # failed at setup
    assert "CI=true: the data must be there" in result.stdout


def test_every_real_snapshot_the_manifest_names_is_one_test():
    if "KVGUARD_TORCH_SNAPSHOTS" in os.environ:
        return
    expected = sum(len(entry["files"]) for entry in SHARED_MANIFEST.values())
    params = snapshot_params()
    assert len(params) == expected >= 64
    assert all(any(m.name == "shared_data" for m in p.marks) for p in params)
