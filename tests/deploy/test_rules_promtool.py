"""promtool check rules and promtool test rules over dashboards/rules and dashboards/tests, and over the
rules dashboards/rules.py writes from a non-default config (dashboards/tests/custom)."""

from __future__ import annotations

import copy
import functools
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from monitoring import (
    CUSTOM_PROMTOOL_TESTS,
    JOINS_FILE,
    PROMTOOL_TESTS,
    RULE_FILES,
    RULES_GENERATOR,
    alerts,
    custom_rules_config,
    load_yaml,
    promtool,
    recording_rules,
    rules,
)

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
    return {
        case["expr"].strip()
        for path in TEST_FILES
        for test in load_yaml(path)["tests"]
        for case in test.get("promql_expr_test", [])
    }


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
    untested = [r["record"] for r in recording_rules() + rules(JOINS_FILE) if r["record"] not in tested]
    assert not untested


# ---------------------------------------- a non-default config (helm/kvguard/ci/sidecar-custom-rules-values.yaml)

CUSTOM_TEST_FILES = sorted(glob.glob(os.path.join(CUSTOM_PROMTOOL_TESTS, "*.test.yaml")))


def custom_rules(directory, config: dict) -> str:
    """The generator's rules for config in directory/rules, with copies of the custom promtool tests beside them."""
    rules_dir = directory / "rules"
    rules_dir.mkdir(parents=True)
    (directory / "config.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [sys.executable, RULES_GENERATOR, "--config", str(directory / "config.yaml"), "--output-dir", str(rules_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for path in CUSTOM_TEST_FILES:
        shutil.copy(path, directory)
    return str(rules_dir)


@pytest.fixture(scope="module")
def custom_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("custom")
    custom_rules(directory, custom_rules_config())
    return directory


def failed_cases(output: str) -> set[tuple[str, str]]:
    """(alertname, eval time) of every alert case promtool reports as failed."""
    return set(re.findall(r"alertname: (\w+), time: (\w+),", output))


def test_promtool_check_rules_passes_on_the_custom_config(custom_dir):
    result = run("check", "rules", "--lint=all", "--lint-fatal", *sorted(glob.glob(str(custom_dir / "rules" / "*"))))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", [os.path.basename(p) for p in CUSTOM_TEST_FILES])
def test_promtool_unit_tests_pass_on_the_custom_config(custom_dir, name):
    result = run("test", "rules", str(custom_dir / name))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", [a["alert"] for a in alerts()])
def test_every_alert_has_a_firing_and_a_non_firing_unit_test_on_the_custom_config(name):
    counts = {"firing": 0, "not_firing": 0}
    for test in load_yaml(os.path.join(CUSTOM_PROMTOOL_TESTS, "kvguard-alerts.test.yaml"))["tests"]:
        for case in test.get("alert_rule_test", []):
            if case["alertname"] == name:
                counts["firing" if case.get("exp_alerts") else "not_firing"] += 1
    assert counts["firing"] >= 1 and counts["not_firing"] >= 1, counts


def test_the_custom_tests_fail_with_default_thresholds_and_for_exactly_where_those_decide(tmp_path):
    # Same job selector and runbook pattern, default thresholds and `for`: each case below flips.
    config = {k: v for k, v in custom_rules_config().items() if k not in ("thresholds", "for")}
    custom_rules(tmp_path, config)
    result = run("test", "rules", str(tmp_path / "kvguard-alerts.test.yaml"))
    assert result.returncode != 0
    assert failed_cases(result.stdout + result.stderr) == {
        ("KVGuardOOMRiskCritical", "4m"),
        ("KVGuardOOMRiskCritical", "6m"),  # fires after 2m
        ("KVGuardKVCacheOvercommitted", "20m"),
        ("KVGuardKVCacheOvercommitted", "35m"),  # 256 MiB > 0, 15m
        ("KVGuardFragmentationHigh", "20m"),
        ("KVGuardFragmentationHigh", "35m"),  # 40% and 2 GiB fire
        ("KVGuardHeadroomLow", "21m"),  # 8% is over 5%
        ("KVGuardAllocRetriesClimbing", "15m"),
        ("KVGuardAllocRetriesClimbing", "26m"),  # 0.017/s > 0
        ("KVGuardSnapshotStale", "7m"),
        ("KVGuardSnapshotStale", "11m"),
        ("KVGuardSourceDown", "15m"),
        ("KVGuardSourceDown", "21m"),
        ("KVGuardExporterDown", "7m"),
        ("KVGuardExporterDown", "11m"),
    }


def failed_exprs(output: str) -> set[str]:
    """The expression of every promql_expr_test case promtool reports as failed."""
    return set(re.findall(r'expr: "([^"]+)", time:', output))


def test_the_custom_join_tests_fail_with_the_default_exporter_selectors(tmp_path):
    # Same jobSelector, any dcgm-exporter or npu-exporter job: the series the selectors left out join in.
    config = copy.deepcopy(custom_rules_config())
    del config["deviceJoins"]["dcgmExporterSelector"], config["deviceJoins"]["npuExporterSelector"]
    custom_rules(tmp_path, config)
    result = run("test", "rules", str(tmp_path / "kvguard-joins.test.yaml"))
    assert result.returncode != 0
    assert failed_exprs(result.stdout + result.stderr) == {
        "kvguard:dcgm_fb_used_bytes",
        "kvguard:gpu_outside_allocator_bytes:dcgm",  # the canary's 75000 MiB
        "kvguard:npu_hbm_used_bytes:npu_exporter",
        "kvguard:device_used_bytes:npu_exporter",  # 2 chips at C1
    }


def test_the_custom_tests_fail_with_the_default_job_selector(tmp_path):
    config = {k: v for k, v in custom_rules_config().items() if k != "jobSelector"}
    custom_rules(tmp_path, config)
    for name in [os.path.basename(p) for p in CUSTOM_TEST_FILES]:
        assert run("test", "rules", str(tmp_path / name)).returncode != 0, name
