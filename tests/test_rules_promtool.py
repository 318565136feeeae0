"""promtool check rules and promtool test rules over dashboards/rules and dashboards/tests."""

from __future__ import annotations

import functools
import glob
import os
import subprocess

import pytest
import yaml

from monitoring import PROMTOOL_TESTS, RULE_FILES, alerts, load_yaml, promtool, recording_rules

TEST_FILES = sorted(glob.glob(os.path.join(PROMTOOL_TESTS, "*.test.yaml")))


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120)


@functools.cache
def alert_cases() -> dict[str, dict[str, int]]:
    """alertname -> how many firing and non-firing cases the promtool test files hold (read once)."""
    cases: dict[str, dict[str, int]] = {}
    for path in TEST_FILES:
        for test in load_yaml(path)["tests"]:
            for case in test.get("alert_rule_test", []):
                counts = cases.setdefault(case["alertname"], {"firing": 0, "not_firing": 0})
                counts["firing" if case.get("exp_alerts") else "not_firing"] += 1
    return cases


def expressions_under_test() -> set[str]:
    return {case["expr"].strip() for path in TEST_FILES for test in load_yaml(path)["tests"]
            for case in test.get("promql_expr_test", [])}


def test_promtool_check_rules_passes_with_lint_fatal():
    result = run("check", "rules", "--lint=all", "--lint-fatal", *RULE_FILES)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", TEST_FILES, ids=os.path.basename)
def test_promtool_unit_tests_pass(path):
    result = run("test", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules_fails_on_a_wrong_expectation(tmp_path):
    # The harness must be able to fail: the same test with an alert expected where none fires.
    source = os.path.join(PROMTOOL_TESTS, "kvguard-alerts.test.yaml")
    data = load_yaml(source)
    data["rule_files"] = [os.path.join(PROMTOOL_TESTS, f) for f in data["rule_files"]]
    case = data["tests"][0]["alert_rule_test"][0]
    case["exp_alerts"] = [{"exp_labels": {"severity": "critical"}}]
    broken = tmp_path / "broken.test.yaml"
    broken.write_text(yaml.safe_dump(data))
    assert run("test", "rules", str(broken)).returncode != 0


@pytest.mark.parametrize("name", [a["alert"] for a in alerts()])
def test_every_alert_has_a_firing_and_a_non_firing_unit_test(name):
    counts = alert_cases().get(name, {"firing": 0, "not_firing": 0})
    assert counts["firing"] >= 1, f"{name} has no promtool case where it fires"
    assert counts["not_firing"] >= 1, f"{name} has no promtool case where it stays quiet"


def test_every_recording_rule_has_a_promql_unit_test():
    tested = expressions_under_test()
    untested = [r["record"] for r in recording_rules() if r["record"] not in tested]
    assert not untested
