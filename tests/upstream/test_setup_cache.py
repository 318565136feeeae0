"""tests/upstream/oracles/cache.py's disk pass, which ``./dev.sh test`` runs after its setup: retired wheels keep
their names
(and sizes) for the markers that digest them, and files the environments share become one copy."""

from __future__ import annotations

import os
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "upstream", "oracles"))
import cache  # noqa: E402


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGUARD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write(path, data: bytes, mode=0o644):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_a_retired_wheel_keeps_its_name_and_size_and_small_ones_stay(root):
    wheels = root / "wheels"
    big = write(wheels / "vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl", os.urandom(64 * 1024))
    small = write(wheels / "click-8.1.7-py3-none-any.whl", b"x" * 100)
    assert cache.retire_wheels(wheels, min_bytes=4096) == 64 * 1024
    assert not big.exists() and small.exists()
    found = cache.find_wheel(wheels, "vllm-0.11.0-*.whl")
    assert found == big and cache.wheel_size(found) == 64 * 1024
    assert cache.find_wheel(wheels, "vllm-0.14.0-*.whl") is None
    # A download after retiring: the file is found again, and retiring it again keeps one ledger line.
    write(big, os.urandom(64 * 1024))
    assert cache.find_wheel(wheels, "vllm-0.11.0-*.whl").exists()
    cache.retire_wheels(wheels, min_bytes=4096)
    assert (wheels / cache.RETIRED).read_text().count("vllm-0.11.0") == 1


def test_identical_files_become_one_copy_and_others_stay_apart(root, tmp_path):
    shared = os.urandom(10_000)
    a = write(root / "vllm-envs" / "vllm-0.11.0" / "site" / "numpy.so", shared, 0o755)
    b = write(root / "vllm-envs" / "vllm-0.14.0" / "site" / "numpy.so", shared, 0o755)
    c = write(tmp_path / "venv" / "site" / "numpy.so", shared, 0o755)
    other_mode = write(root / "ascend-envs" / "x" / "numpy.so", shared, 0o644)
    different = write(root / "vllm-envs" / "vllm-0.20.0" / "site" / "numpy.so", shared[:-1] + b"!", 0o755)
    before = cache.disk_bytes([root, tmp_path / "venv"])
    assert cache.link_duplicates([root, tmp_path / "venv"]) == 2
    assert a.stat().st_ino == b.stat().st_ino == c.stat().st_ino
    assert other_mode.stat().st_ino != a.stat().st_ino and different.stat().st_ino != a.stat().st_ino
    assert a.read_bytes() == b.read_bytes() == c.read_bytes() == shared
    assert different.read_bytes().endswith(b"!")
    assert before - cache.disk_bytes([root, tmp_path / "venv"]) >= 2 * 10_000
    assert cache.link_duplicates([root, tmp_path / "venv"]) == 0  # a second pass finds nothing to do


def test_slim_drops_bytecode_once_per_build(root):
    env = root / "vllm-envs" / "vllm-0.11.0"
    pyc = write(env / "lib" / "site" / "__pycache__" / "m.cpython-311.pyc", b"c" * 5000)
    other = write(root / "vllm-envs" / "vllm-0.14.0" / "lib" / "__pycache__" / "n.cpython-311.pyc", b"d" * 5000)
    write(root / "wheels" / "vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl", b"w" * (cache.RETIRE_FROM_BYTES + 1))
    line = cache.slim(None)
    assert not pyc.exists() and not other.exists() and "retired 0.0 GB" in line and "dropped" in line
    # Bytecode the tests write back is kept while nothing is rebuilt.
    write(pyc, b"c" * 5000)
    write(other, b"d" * 5000)
    assert "nothing rebuilt" in cache.slim(None) and pyc.exists()
    # Another venv (a fresh clone's) is linked, but rebuilds no environment: the bytecode stays.
    venv = root.parent / "clone" / ".venv"
    write(venv / "lib" / "python3.11" / "site-packages" / "numpy.so", b"n" * 5000)
    assert "linked" in cache.slim(venv) and pyc.exists() and other.exists()
    # A rebuilt environment is a new folder: its bytecode goes again, the other environment's stays.
    os.rename(env, root / "old")
    write(pyc, b"c" * 5000)
    assert "dropped" in cache.slim(venv) and not pyc.exists() and other.exists()
