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
from conftest import ROOT
from monitoring import (
    ALERTS_FILE,
    CUSTOM_RULES_VALUES,
    KVGUARD_METRIC,
    RULE_FILES,
    RULES_DIR,
    RULES_GENERATOR,
    custom_rules_config,
    load_yaml,
    rules_generator,
)

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
    for path in RULE_FILES:
        for group in load_yaml(str(tmp_path / os.path.basename(path)))["groups"]:
            rules.update({rule.get("alert") or rule["record"]: rule for rule in group["rules"]})
    return rules


def test_regenerating_gives_the_committed_rules_and_chart_templates():
    result = generate("--check")
    assert result.returncode == 0, result.stderr


def test_every_committed_rule_file_and_chart_template_is_generated():
    written = set(GENERATOR.outputs())
    assert {os.path.join(RULES_DIR, name) for name in os.listdir(RULES_DIR)} | {
        GENERATOR.CHART_TEMPLATE,
        GENERATOR.JOINS_CHART_TEMPLATE,
    } == written
    assert set(RULE_FILES) <= written


@pytest.mark.parametrize("name", [os.path.basename(p) for p in RULE_FILES])
def test_check_fails_when_any_rule_file_is_stale(tmp_path, name):
    assert generate("--output-dir", str(tmp_path)).returncode == 0
    (tmp_path / name).write_text((tmp_path / name).read_text().replace("expr:", "expr: ", 1))
    result = generate("--check", "--output-dir", str(tmp_path))
    assert result.returncode == 1 and f"{name} is out of date" in result.stderr


def test_the_default_output_is_the_committed_files(tmp_path):
    assert generate("--output-dir", str(tmp_path)).returncode == 0
    for path in RULE_FILES:
        with open(path, encoding="utf-8") as handle:
            assert (tmp_path / os.path.basename(path)).read_text() == handle.read()


def test_chart_values_defaults_are_the_generators_defaults():
    values = load_yaml(VALUES)["prometheusRule"]
    values["deviceJoins"].pop("enabled")
    # Except the runbook link: empty, the chart's own default (its Service; tests/deploy/test_helm_chart.py).
    assert values.pop("runbookUrl") == ""
    defaults = {k: v for k, v in GENERATOR.DEFAULTS.items() if k != "runbookUrl"}
    assert {k: v for k, v in values.items() if k not in GENERATOR.CHART_ONLY} == defaults


def test_an_empty_runbook_url_is_the_default(tmp_path):
    assert generated(tmp_path / "empty", {"runbookUrl": ""}) == generated(tmp_path / "default")


def test_the_chart_template_carries_the_default_runbook_url_for_releases_without_a_service():
    assert (
        load_yaml(GENERATOR.CHART_TEMPLATE)["runbookUrl"] == GENERATOR.RUNBOOK_URL == GENERATOR.DEFAULTS["runbookUrl"]
    )
    assert "runbookUrl" not in load_yaml(GENERATOR.JOINS_CHART_TEMPLATE)  # no alerts there


def test_chart_schema_names_exactly_the_configs_thresholds_and_alerts():
    schema = load_yaml(SCHEMA)["properties"]["prometheusRule"]["properties"]
    assert set(schema["thresholds"]["properties"]) == set(GENERATOR.DEFAULTS["thresholds"])
    assert set(schema["for"]["properties"]) == set(GENERATOR.DEFAULTS["for"])
    assert set(schema["deviceJoins"]["properties"]) == set(GENERATOR.DEFAULTS["deviceJoins"]) | {"enabled"}
    for key in ("thresholds", "for", "deviceJoins"):
        assert schema[key]["additionalProperties"] is False, key


def test_every_alert_with_a_for_duration_has_one_in_the_config():
    with_for = {a["alert"] for a in load_yaml(ALERTS_FILE)["groups"][0]["rules"] if "for" in a}
    assert with_for == set(GENERATOR.DEFAULTS["for"])


def test_a_config_changes_only_the_rules_it_names(tmp_path):
    default = generated(tmp_path / "default")
    changed = generated(
        tmp_path / "changed", {"thresholds": {"headroomRatio": 0.2}, "for": {"KVGuardSnapshotStale": "7m"}}
    )
    differing = {name for name in default if default[name] != changed[name]}
    assert differing == {"KVGuardHeadroomLow", "KVGuardSnapshotStale"}
    assert changed["KVGuardHeadroomLow"]["expr"].endswith("< 0.2")
    assert "less than {{ 0.2 | humanizePercentage }}" in changed["KVGuardHeadroomLow"]["annotations"]["summary"]
    assert changed["KVGuardSnapshotStale"]["for"] == "7m"
    assert "for 7m:" in changed["KVGuardSnapshotStale"]["annotations"]["description"]


def selectors(expr: str, metric: re.Pattern) -> list[str]:
    """The matchers in braces after each series of metric in expr ('' where it has none)."""
    return [re.match(r"\{([^}]*)\}|", expr[m.end() :]).group(1) or "" for m in metric.finditer(expr)]


def test_the_job_selector_is_on_every_kvguard_series_and_on_up(tmp_path):
    rules = generated(tmp_path, custom_rules_config())
    read = 0
    for name, rule in rules.items():
        for matchers in selectors(rule["expr"], KVGUARD_METRIC):
            read += 1
            assert matchers == 'job="llm-guard"' or matchers.endswith(',job="llm-guard"'), (name, rule["expr"])
    assert read == 31  # 7 alerts' 7 (2 read engine rules), 9 engine rules' 10, 11 pod-level, 3 joins
    assert rules["KVGuardExporterDown"]["expr"] == 'up{job="llm-guard"} == 0'


@pytest.mark.parametrize(
    "metric, key",
    [("DCGM_FI_DEV_FB_USED", "dcgmExporterSelector"), ("npu_chip_info_hbm_used_memory", "npuExporterSelector")],
)
def test_each_exporter_selector_is_on_that_exporters_series_only(tmp_path, metric, key):
    selector = custom_rules_config()["deviceJoins"][key]
    default, custom = generated(tmp_path / "default"), generated(tmp_path / "custom", {"deviceJoins": {key: selector}})
    pattern = re.compile(rf"(?<![\w:]){metric}(?![\w:])")
    reading = {name for name, rule in default.items() if pattern.search(rule["expr"])}
    assert reading and {name for name in default if default[name] != custom[name]} == reading
    for name in reading:
        for before, after in zip(selectors(default[name]["expr"], pattern), selectors(custom[name]["expr"], pattern)):
            assert after == (f"{before},{selector}" if before else selector), (name, custom[name]["expr"])


def test_an_empty_job_selector_leaves_no_empty_matchers(tmp_path):
    rules = generated(tmp_path, {"jobSelector": ""})
    assert rules["KVGuardExporterDown"]["expr"] == "up == 0"
    assert rules["kvguard:allocator_reserved_bytes:dcgm"]["expr"].startswith(
        'kvguard_allocator_reserved_bytes{device_uuid!=""}\n'
    )
    assert not [name for name, rule in rules.items() if ",}" in rule["expr"] or "{}" in rule["expr"]]


def test_runbook_url_pattern_takes_the_alert_name_in_lower_case(tmp_path):
    rules = generated(tmp_path, custom_rules_config())
    assert (
        rules["KVGuardOOMRiskCritical"]["annotations"]["runbook_url"]
        == "https://runbooks.example.com/kvguard/kvguardoomriskcritical.html"
    )


def test_a_chart_values_file_is_read_for_its_prometheus_rule_block(tmp_path):
    result = generate("--config", CUSTOM_RULES_VALUES, "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert 'job="llm-guard"' in (tmp_path / "kvguard-alerts.yaml").read_text()


def test_the_charts_own_values_file_is_a_config_giving_the_defaults(tmp_path):
    # Chart-only switches in the prometheusRule block (enabled, labels, deviceJoins.enabled) are not rule config.
    result = generate("--config", VALUES, "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    for path in RULE_FILES:
        assert (tmp_path / os.path.basename(path)).read_text() == open(path).read()


@pytest.mark.parametrize(
    "config, message",
    [
        ({"thresholds": {"fragmentationRatoi": 0.5}}, "thresholds: unknown key(s): fragmentationRatoi"),
        ({"jobSelectr": 'job="x"'}, "unknown config key(s): jobSelectr"),
        ({"runbookUrl": "https://runbooks.example.com/kvguard"}, "runbookUrl: expected a URL with exactly one %s"),
        ({"runbookUrl": "https://x/%s/%d"}, "runbookUrl: expected a URL with exactly one %s"),
        ({"thresholds": {"headroomRatio": "5%"}}, "thresholds.headroomRatio: expected a number"),
        ({"for": {"KVGuardHeadroomLow": "ten minutes"}}, "for.KVGuardHeadroomLow: expected a Prometheus duration"),
        ({"for": {"KVGuardAllocatorOOMs": "5m"}}, "for: unknown key(s): KVGuardAllocatorOOMs"),
        ({"thresholds": [0.5]}, "thresholds: expected a map"),
        ({"deviceJoins": {"dcgmSelector": 'job="dcgm"'}}, "deviceJoins: unknown key(s): dcgmSelector"),
        (
            {"deviceJoins": {"npuExporterSelector": ["job=npu"]}},
            "deviceJoins.npuExporterSelector: expected label matchers",
        ),
    ],
)
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
    assert [GENERATOR.number(v) for v in (0, 1073741824, 1073741824.0, 0.3, 0.05, 1e-05, -2)] == [
        "0",
        "1073741824",
        "1073741824",
        "0.3",
        "0.05",
        "1e-05",
        "-2",
    ]


@pytest.mark.parametrize(
    "template, expected",
    [
        (
            "CHART_TEMPLATE",
            {"jobSelector", "for", "runbookUrl"} | {f"thresholds.{name}" for name in GENERATOR.DEFAULTS["thresholds"]},
        ),
        (
            "JOINS_CHART_TEMPLATE",
            {"jobSelector"} | {f"deviceJoins.{name}" for name in GENERATOR.DEFAULTS["deviceJoins"]},
        ),
    ],
)
def test_each_chart_template_keeps_its_placeholders_and_nothing_else_of_the_config(template, expected):
    text = str(load_yaml(getattr(GENERATOR, template))["groups"])  # the rules, not the header's comments
    assert set(re.findall(r"\$\{([^}]+)\}", text)) == expected
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
        match = re.fullmatch(r"\[?(KVGuard\w+)(?:\]\([\w./]*runbook\.md#\w+\))?", cells[0]) if len(cells) >= 4 else None
        if match:
            rows[match.group(1)] = (cells[2], cells[3])
    return rows


@pytest.mark.parametrize("doc", [os.path.join("docs", "dashboards.md")])  # the README links there (issue 22)
def test_the_docs_alert_tables_give_the_default_for_and_severity_of_every_alert(doc):
    rules = load_yaml(ALERTS_FILE)["groups"][0]["rules"]
    expected = {a["alert"]: (GENERATOR.DEFAULTS["for"].get(a["alert"], "—"), a["labels"]["severity"]) for a in rules}
    assert alert_table(os.path.join(ROOT, doc)) == expected


def test_the_docs_show_the_default_runbook_url_as_the_generator_writes_it():
    with open(os.path.join(ROOT, "docs", "dashboards.md"), encoding="utf-8") as handle:
        assert f"  {GENERATOR.RUNBOOK_URL}\n" in handle.read()
