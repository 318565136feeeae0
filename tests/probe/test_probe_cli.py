"""kvguard sample and kvguard probe: one sample, or the probe as its own process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import invoke, one_line_error

from kvguard.spool.io import read_spool


@pytest.fixture
def cli(monkeypatch):
    monkeypatch.delenv("KVGUARD_SPOOL_DIR", raising=False)
    return invoke


def test_sample_prints_json(cli):
    result = cli("sample", "--source", "host", "--json")
    data = json.loads(result.output)
    assert result.exit_code == 0
    assert data["source"] == "host"
    assert data["devices"][0]["device"] == "host" and data["devices"][0]["total_bytes"] > 0


def test_sample_prints_a_table(cli):
    result = cli("sample", "--source", "sim")
    assert result.exit_code == 0
    header, row = result.output.splitlines()
    assert header.split()[:4] == ["DEVICE", "SOURCE", "ALLOCATED", "RESERVED"]
    assert row.split()[:2] == ["cuda:0", "sim"]


def test_sample_of_an_absent_backend_is_one_line(cli):
    assert one_line_error(cli("sample", "--source", "nvml")) == "Error: nvml: NVML Shared Library Not Found"


def test_sample_of_an_unknown_source_is_one_line(cli):
    assert one_line_error(cli("sample", "--source", "rocm")).startswith("Error: unknown source 'rocm' (choose from")


def test_probe_once_writes_one_snapshot_per_simulated_rank(cli, tmp_path):
    spool = str(tmp_path / "spool")
    result = cli("probe", "--source", "sim", "--ranks", "3", "--spool-dir", spool, "--once")
    snapshots = sorted(read_spool(spool).snapshots, key=lambda s: s.rank)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"wrote 3 snapshots to {spool}"
    assert [(s.rank, s.device) for s in snapshots] == [(0, "cuda:0"), (1, "cuda:1"), (2, "cuda:2")]
    assert all(s.profile is not None and s.kv_cache is not None for s in snapshots)


def test_probe_takes_the_spool_dir_from_the_environment(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(tmp_path))
    assert cli("probe", "--source", "host", "--once").exit_code == 0
    assert [s.device for s in read_spool(str(tmp_path)).snapshots] == ["host"]


def test_probe_needs_a_spool_dir(cli):
    assert "Missing option '--spool-dir'" in one_line_error(cli("probe", "--source", "host", "--once"), code=64)


def test_ranks_apply_to_sim_only(cli, tmp_path):
    result = cli("probe", "--source", "host", "--ranks", "2", "--spool-dir", str(tmp_path), "--once")
    assert one_line_error(result, code=64) == "Error: --ranks applies to --source sim only"


@pytest.mark.parametrize("interval", ["nan", "inf", "1e400"])
def test_a_non_finite_interval_is_a_usage_error(cli, tmp_path, interval):
    result = cli("probe", "--source", "host", "--spool-dir", str(tmp_path), "--interval", interval, "--once")
    assert result.exit_code == 64, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.output.strip().splitlines()[-1].endswith("is not a finite number.")


def test_probe_once_with_a_failing_source_is_one_line(cli, tmp_path):
    pytest.importorskip("torch")
    result = cli("probe", "--source", "torch", "--spool-dir", str(tmp_path), "--once")
    assert one_line_error(result).endswith("torch: torch.cuda is not available (no device or no cuda build)")


def test_probe_once_into_an_unwritable_spool_is_one_line(cli, tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    result = cli("probe", "--source", "host", "--spool-dir", str(path), "--once")
    assert one_line_error(result).endswith(f"write {path}: Not a directory")


def test_probe_runs_until_sigterm(tmp_path):
    spool = tmp_path / "spool"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvguard",
            "probe",
            "--source",
            "sim",
            "--ranks",
            "2",
            "--interval",
            "0.05",
            "--spool-dir",
            str(spool),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(read_spool(str(spool)).snapshots) < 2:
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    snapshots = read_spool(str(spool)).snapshots
    assert process.returncode == 0, stderr
    assert sorted(s.device for s in snapshots) == ["cuda:0", "cuda:1"]
    assert {s.pid for s in snapshots} == {process.pid}
    assert "Traceback" not in stderr and os.path.isdir(spool)
