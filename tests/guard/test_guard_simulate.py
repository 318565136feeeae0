"""``kvguard simulate --json`` carries the guard's verdict at the end of startup, before serving."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvguard.cli import main


def simulate(*args):
    result = CliRunner().invoke(main, ["simulate", "--json", "--requests", "8", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_a_run_that_ooms_while_serving_was_critical_at_startup():
    data = simulate("--allocator", "torch_npu", "--gpu-memory-utilization", "0.97")
    assert data["oom"] and data["oom_phase"] == "serving"
    assert data["guard"]["state"] == "critical"
    assert "projected_peak_exceeds_capacity" in [r["code"] for r in data["guard"]["reasons"]]


def test_a_stock_budget_that_fits_is_a_warning_with_its_overcommit():
    data = simulate("--allocator", "torch_npu", "--gpu-memory-utilization", "0.9")
    assert not data["oom"]
    assert data["guard"]["state"] == "warning"
    assert data["guard"]["overcommit_bytes"] > 0


def test_the_reserved_budget_is_ok():
    data = simulate("--allocator", "torch", "--budget", "reserved")
    assert data["guard"]["state"] == "ok" and data["guard"]["reasons"] == []


def test_a_run_that_never_profiled_has_no_verdict_and_says_why():
    data = simulate("--total-memory", "12GiB")
    assert data["guard"]["state"] is None
    assert data["guard"]["reasons"][0]["code"] == "no_profile"
