import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
DATA = os.path.join(ROOT, "tests", "data")
EXAMPLES = os.path.join(ROOT, "exporter", "kvguard", "examples")

# Tests run against the source tree even when the package is not installed, and so do the
# `python -m kvguard` subprocesses they start (they inherit PYTHONPATH).
EXPORTER = os.path.join(ROOT, "exporter")
sys.path.insert(0, EXPORTER)
# The tests' shared helpers (tests/support: fixtures, the monitoring stack, fakes) are importable by name from
# every folder, and so are the real-upstream harnesses (tests/upstream).
SUPPORT = os.path.join(TESTS, "support")
UPSTREAM = os.path.join(TESTS, "upstream")
sys.path[1:1] = [SUPPORT, UPSTREAM]
if os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] != EXPORTER:
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [EXPORTER, os.environ.get("PYTHONPATH")]))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "upstream: runs real upstream code (vLLM, vllm-ascend and vllm-mindspore wheels, MindSpore's runtime, the "
        "compiled allocator oracles); every test under tests/upstream has it. -m 'not upstream' is the fast run",
    )
    config.addinivalue_line(
        "markers",
        "shared_data(path, source): the test reads a file of ../shared (fetched "
        "public data, never committed): skipped where it is missing, failed with CI=true",
    )


def pytest_runtest_setup(item):
    # One skip per missing file of ../shared, naming the file and where it comes from: never a silent gap.
    # In CI (CI=true), where the folder must be laid out, a missing file is a failure.
    for marker in item.iter_markers("shared_data"):
        path = marker.kwargs["path"]
        if os.path.isfile(path):
            continue
        message = (
            f"{os.path.relpath(path, os.path.dirname(ROOT))} is missing: ../shared beside the checkout holds "
            f"{marker.kwargs['source']} (tests/data/shared/MANIFEST.json lists the files)"
        )
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message + "; CI=true: the data must be there", pytrace=False)
        pytest.skip(message)


@pytest.fixture
def data_path():
    def path(*parts: str) -> str:
        return os.path.join(DATA, *parts)

    return path


@pytest.fixture
def serve(tmp_path):
    """Start KVGuardServers over a spool of snapshots (sidecar_fixtures.start_server); all stop afterwards."""
    from sidecar_fixtures import start_server

    servers = []

    def start(*snapshots, **options):
        server = start_server(tmp_path / "spool", *snapshots, **options)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if os.path.commonpath([str(item.path), UPSTREAM]) == UPSTREAM:
            item.add_marker(pytest.mark.upstream)
