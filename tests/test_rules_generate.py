"""dashboards/rules.py, the one source of the rules: regenerated equals committed, its config is the
chart's prometheusRule values, and a config changes what it names and nothing else."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys

import pytest
import yaml

from monitoring import (
    ALERTS_FILE, CUSTOM_RULES_VALUES, KVGUARD_METRIC, RECORDING_FILE, RULES_GENERATOR, custom_rules_config,
    load_yaml, rules_generator,
)
from conftest import ROOT

GENERATOR = rules_generator()
VALUES = os.path.join(ROOT, "helm", "kvguard", "values.yaml")
SCHEMA = os.path.join(ROOT, "helm", "kvguard", "values.schema.json")


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, RULES_GENERATOR, *args], capture_output=True, text=True, timeout=120)


def generated(tmp_path, config: dict | None = None) -> dict[str, list[dict]]:
    """alert or record name -> rule, as the generator writes them for config."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    args = ["--output-dir", str(tmp_path)]
    if config is not None:
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
        args += ["--config", str(tmp_path / "config.yaml")]
    result = generate(*args)
    assert result.returncode == 0, result.stderr
    rules = {}
    for name in ("kvguard-recording.yaml", "kvguard-alerts.yaml"):
        for group in load_yaml(str(tmp_path / name))["groups"]:
            rules.update({rule.get("alert") or rule["record"]: rule for rule in group["rules"]})
    return rules


def test_regenerating_gives_the_committed_rules_and_chart_template():
    result = generate("--check")
    assert result.returncode == 0, result.stderr


def test_check_fails_when_a_rule_file_was_edited_by_hand(tmp_path):
    assert generate("--output-dir", str(tmp_path)).returncode == 0
    edited = tmp_path / "kvguard-alerts.yaml"
    edited.write_text(edited.read_text().replace("for: 2m", "for: 3m"))
    result = generate("--check", "--output-dir", str(tmp_path))
    assert result.returncode == 1
    assert "kvguard-alerts.yaml is out of date" in result.stderr


def test_the_default_output_is_the_committed_files(tmp_path):
    assert generate("--output-dir", str(tmp_path)).returncode == 0
    for path in (ALERTS_FILE, RECORDING_FILE):
        with open(path, encoding="utf-8") as handle:
            assert (tmp_path / os.path.basename(path)).read_text() == handle.read()


def test_chart_values_defaults_are_the_generators_defaults():
    values = load_yaml(VALUES)["prometheusRule"]
    assert {k: v for k, v in values.items() if k not in ("enabled", "labels", "deviceJoins")} == GENERATOR.DEFAULTS


def test_chart_schema_names_exactly_the_configs_thresholds_and_alerts():
    schema = load_yaml(SCHEMA)["properties"]["prometheusRule"]["properties"]
    assert set(schema["thresholds"]["properties"]) == set(GENERATOR.DEFAULTS["thresholds"])
    assert set(schema["for"]["properties"]) == set(GENERATOR.DEFAULTS["for"])
    assert schema["thresholds"]["additionalProperties"] is False and schema["for"]["additionalProperties"] is False


def test_every_alert_with_a_for_duration_has_one_in_the_config():
    with_for = {a["alert"] for a in load_yaml(ALERTS_FILE)["groups"][0]["rules"] if "for" in a}
    assert with_for == set(GENERATOR.DEFAULTS["for"])


def test_a_config_changes_only_the_rules_it_names(tmp_path):
    default = generated(tmp_path / "default")
    changed = generated(tmp_path / "changed", {"thresholds": {"headroomRatio": 0.2},
                                               "for": {"KVGuardSnapshotStale": "7m"}})
    differing = {name for name in default if default[name] != changed[name]}
    assert differing == {"KVGuardHeadroomLow", "KVGuardSnapshotStale"}
    assert changed["KVGuardHeadroomLow"]["expr"].endswith("< 0.2")
    assert "less than {{ 0.2 | humanizePercentage }}" in changed["KVGuardHeadroomLow"]["annotations"]["summary"]
    assert changed["KVGuardSnapshotStale"]["for"] == "7m"
    assert "for 7m:" in changed["KVGuardSnapshotStale"]["annotations"]["description"]


def test_the_job_selector_is_on_every_kvguard_series_and_on_up(tmp_path):
    rules = generated(tmp_path, custom_rules_config())
    for name, rule in rules.items():
        for match in KVGUARD_METRIC.finditer(rule["expr"]):
            assert rule["expr"][match.end():].startswith('{job="llm-guard"}'), (name, rule["expr"])
    assert rules["KVGuardExporterDown"]["expr"] == 'up{job="llm-guard"} == 0'


def test_runbook_url_pattern_takes_the_alert_name_in_lower_case(tmp_path):
    rules = generated(tmp_path, custom_rules_config())
    assert rules["KVGuardOOMRiskCritical"]["annotations"]["runbook_url"] == \
        "https://runbooks.example.com/kvguard/kvguardoomriskcritical.html"


def test_a_chart_values_file_is_read_for_its_prometheus_rule_block(tmp_path):
    result = generate("--config", CUSTOM_RULES_VALUES, "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert 'job="llm-guard"' in (tmp_path / "kvguard-alerts.yaml").read_text()


def test_the_charts_own_values_file_is_a_config_giving_the_defaults(tmp_path):
    # Chart-only switches in the prometheusRule block (enabled, labels, deviceJoins) are not rule config.
    result = generate("--config", VALUES, "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    for name in ("kvguard-alerts.yaml", "kvguard-recording.yaml"):
        assert (tmp_path / name).read_text() == open(os.path.join(ROOT, "dashboards", "rules", name)).read()


@pytest.mark.parametrize("config, message", [
    ({"thresholds": {"fragmentationRatoi": 0.5}}, "thresholds: unknown key(s): fragmentationRatoi"),
    ({"jobSelectr": 'job="x"'}, "unknown config key(s): jobSelectr"),
    ({"runbookUrl": "https://runbooks.example.com/kvguard"}, "runbookUrl: expected a URL with exactly one %s"),
    ({"runbookUrl": "https://x/%s/%d"}, "runbookUrl: expected a URL with exactly one %s"),
    ({"thresholds": {"headroomRatio": "5%"}}, "thresholds.headroomRatio: expected a number"),
    ({"for": {"KVGuardHeadroomLow": "ten minutes"}}, "for.KVGuardHeadroomLow: expected a Prometheus duration"),
    ({"for": {"KVGuardAllocatorOOMs": "5m"}}, "for: unknown key(s): KVGuardAllocatorOOMs"),
    ({"thresholds": [0.5]}, "thresholds: expected a map"),
])
def test_a_bad_config_is_refused_in_one_line(tmp_path, config, message):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = generate("--config", str(path), "--output-dir", str(tmp_path / "out"))
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "out").exists()


def test_a_missing_config_file_is_one_line(tmp_path):
    result = generate("--config", str(tmp_path / "nope.yaml"), "--output-dir", str(tmp_path / "out"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "cannot read config" in result.stderr


def test_thresholds_are_written_as_promql_numbers():
    assert [GENERATOR.number(v) for v in (0, 1073741824, 1073741824.0, 0.3, 0.05, 1e-05, -2)] == \
        ["0", "1073741824", "1073741824", "0.3", "0.05", "1e-05", "-2"]


def test_the_chart_template_keeps_every_placeholder_and_nothing_else_of_the_config():
    text = str(load_yaml(GENERATOR.CHART_TEMPLATE))       # the rules, not the header's comments
    placeholders = set(re.findall(r"\$\{([^}]+)\}", text))
    assert placeholders == {"jobSelector", "for", "runbookUrl"} | {
        f"thresholds.{name}" for name in GENERATOR.DEFAULTS["thresholds"]}
    assert "kvguard.*" not in text and "github.com" not in text


def test_merge_leaves_the_defaults_untouched():
    before = copy.deepcopy(GENERATOR.DEFAULTS)
    GENERATOR.merge({"thresholds": {"headroomRatio": 0.5}, "for": {"KVGuardHeadroomLow": "1h"}})
    assert GENERATOR.DEFAULTS == before


def alert_table(path: str) -> dict[str, tuple[str, str]]:
    """alert name -> (For, Severity) from a markdown table whose first column names the alert."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"\[?(KVGuard\w+)(?:\]\(runbook\.md#\w+\))?", cells[0]) if len(cells) >= 4 else None
        if match:
            rows[match.group(1)] = (cells[2], cells[3])
    return rows


@pytest.mark.parametrize("doc", ["README.md", os.path.join("docs", "dashboards.md")])
def test_the_docs_alert_tables_give_the_default_for_and_severity_of_every_alert(doc):
    rules = load_yaml(ALERTS_FILE)["groups"][0]["rules"]
    expected = {a["alert"]: (GENERATOR.DEFAULTS["for"].get(a["alert"], "—"), a["labels"]["severity"]) for a in rules}
    assert alert_table(os.path.join(ROOT, doc)) == expected
