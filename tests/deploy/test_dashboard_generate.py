"""dashboards/generate.py and the dashboard it writes: regenerated equals committed, and the
panels, variables and units the issue asks for."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import dashboard_lint as lint
import pytest
from monitoring import DASHBOARD, DASHBOARDS, KVGUARD_METRIC, RUNBOOK, documented_metrics

GENERATOR = os.path.join(DASHBOARDS, "generate.py")

PANELS = [p for p in lint.all_panels(DASHBOARD) if p["type"] != "row"]


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, GENERATOR, *args], capture_output=True, text=True, timeout=120)


def metrics_of(panel: dict) -> set[str]:
    return {name for t in panel["targets"] for name in KVGUARD_METRIC.findall(t["expr"])}


def test_regenerating_gives_the_committed_dashboard():
    result = generate("--check")
    assert result.returncode == 0, result.stderr


def test_check_fails_when_the_committed_file_differs(tmp_path):
    stale = tmp_path / "kvguard.json"
    stale.write_text(json.dumps({**DASHBOARD, "title": "edited by hand"}, indent=2))
    result = generate("--check", "--output", str(stale))
    assert result.returncode == 1
    assert "out of date" in result.stderr


def test_generator_writes_the_file_it_checks(tmp_path):
    out = tmp_path / "kvguard.json"
    assert generate("--output", str(out)).returncode == 0
    assert generate("--check", "--output", str(out)).returncode == 0
    assert json.loads(out.read_text())["uid"] == "kvguard"


def test_dashboard_uses_a_current_schema_version():
    assert DASHBOARD["schemaVersion"] >= 41


def test_panels_are_timeseries_and_stat_only():
    assert {p["type"] for p in PANELS} == {"timeseries", "stat"}


def test_variables_are_datasource_cluster_job_instance_namespace_model_engine_pod_rank_device():
    names = [v["name"] for v in lint.variables(DASHBOARD)]
    assert names[0] == "datasource"
    assert set(names) == {
        "datasource",
        "cluster",
        "job",
        "instance",
        "namespace",
        "model_name",
        "engine_id",
        "pod",
        "rank",
        "device",
    }


def test_every_panel_that_groups_by_engine_id_selects_by_it():
    """The per-engine panels group by engine_id (as the namespace_engine rules do): the engine_id variable
    narrows them to one engine, like the pod and rank variables narrow the per-rank panels."""
    grouped = [t["expr"] for p in PANELS for t in p.get("targets", []) if "engine_id" in t["expr"]]
    assert grouped
    for expr in grouped:
        assert 'engine_id=~"$engine_id"' in expr, expr


@pytest.mark.parametrize("name", ["cluster", "namespace", "model_name", "engine_id", "pod", "rank", "device"])
def test_kvguard_label_variables_match_empty_values_when_all(name):
    # Outside Kubernetes pod and namespace are "", and rank is "" when the probe does not know
    # it: "All" must not hide those series, so these variables use .* rather than .+.
    variable = next(v for v in lint.variables(DASHBOARD) if v["name"] == name)
    assert variable["includeAll"] and variable["allValue"] == ".*"


@pytest.mark.parametrize(
    "metric",
    [
        "kvguard_allocator_allocated_bytes",
        "kvguard_allocator_reserved_bytes",
        "kvguard_guard_capacity_bytes",
        "kvguard_device_total_bytes",
        "kvguard_allocator_fragmentation_bytes",
        "kvguard_allocator_fragmentation_ratio",
        "kvguard_kv_cache_allocated_bytes",
        "kvguard_kv_cache_budget_bytes",
        "kvguard_kv_cache_overcommit_bytes",
        "kvguard_guard_headroom_bytes",
        "kvguard_guard_severity",
        "kvguard_allocator_alloc_retries_total",
        "kvguard_allocator_ooms_total",
        "kvguard_snapshot_age_seconds",
        "kvguard_source_up",
        "kvguard_kv_cache_usage_ratio",
    ],
)
def test_a_panel_shows_the_metric_the_issue_asks_for(metric):
    assert any(metric in metrics_of(p) for p in PANELS)


def test_allocated_reserved_and_capacity_share_one_panel_per_device():
    wanted = {"kvguard_allocator_allocated_bytes", "kvguard_allocator_reserved_bytes", "kvguard_guard_capacity_bytes"}
    panel = next(p for p in PANELS if wanted <= metrics_of(p))
    assert all(re.search(r"by \([^)]*\bdevice\b", t["expr"]) for t in panel["targets"])


def test_kv_cache_allocated_is_plotted_against_both_budgets():
    panel = next(p for p in PANELS if "kvguard_kv_cache_budget_bytes" in metrics_of(p))
    assert "kvguard_kv_cache_allocated_bytes" in metrics_of(panel)
    assert any("{{budget}}" in t["legendFormat"] for t in panel["targets"])


def test_guard_state_per_rank_maps_severity_to_state_names():
    panel = next(p for p in PANELS if p["title"] == "Guard state per rank")
    mapped = panel["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert {k: v["text"] for k, v in mapped.items()} == {"0": "ok", "1": "warning", "2": "critical"}
    assert "rank" in re.search(r"by \(([^)]*)\)", panel["targets"][0]["expr"]).group(1)


@pytest.mark.parametrize("suffix, unit", [("_bytes", "bytes"), ("_ratio", "percentunit"), ("_seconds", "s")])
def test_panels_of_one_base_unit_use_the_grafana_unit(suffix, unit):
    # bytes is Grafana's IEC unit (KiB, MiB, GiB); percentunit reads 0-1 ratios.
    # A quotient of two byte counts (headroom over capacity) is a ratio, whatever its inputs' unit.
    panels = [
        p
        for p in PANELS
        if metrics_of(p)
        and all(m.endswith(suffix) for m in metrics_of(p))
        and not any(" / " in t["expr"] for t in p["targets"])
    ]
    assert panels
    assert {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in panels} == {p["title"]: unit for p in panels}


def test_every_kvguard_metric_on_the_dashboard_is_in_docs_metrics():
    used = {m for p in PANELS for m in metrics_of(p)}
    used |= {m for v in lint.variables(DASHBOARD) for m in KVGUARD_METRIC.findall(str(v.get("query", "")))}
    assert used - documented_metrics() == set()


def test_panel_ids_are_unique():
    ids = [p["id"] for p in lint.all_panels(DASHBOARD)]
    assert len(ids) == len(set(ids))


def test_panels_fit_the_grid_without_overlapping():
    cells = set()
    for panel in lint.all_panels(DASHBOARD):
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not mine & cells, panel["title"]
        cells |= mine


def test_runbook_panel_names_exist_on_the_dashboard():
    with open(RUNBOOK, encoding="utf-8") as handle:
        text = re.sub(r"\s+", " ", handle.read())
    named = set(re.findall(r'"([A-Z][^"]+)"(?= (?:and "[^"]+" )?panels?\b)', text))
    assert named and named <= {p["title"] for p in PANELS}


def stat_thresholds(title: str) -> list:
    panel = next(p for p in PANELS if p["title"] == title)
    return [(step["value"], step["color"]) for step in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]


def test_headroom_panels_turn_orange_where_their_alert_fires():
    # KVGuardHeadroomLow's threshold, from the rules' defaults (helm values.yaml mirrors them).
    ratio = load_yaml_values()["prometheusRule"]["thresholds"]["headroomRatio"]
    for title in ("Least headroom", "Engine headroom (weakest rank)"):
        assert stat_thresholds(title) == [(None, "red"), (0, "orange"), (ratio, "green")], title


def test_the_fragmentation_panel_turns_red_at_its_alerts_ratio():
    ratio = load_yaml_values()["prometheusRule"]["thresholds"]["fragmentationRatio"]
    assert stat_thresholds("Highest fragmentation ratio") == [(None, "green"), (ratio, "red")]


def test_a_rules_config_moves_the_panels_thresholds_with_the_alerts(tmp_path):
    config = tmp_path / "rules.yaml"
    config.write_text("thresholds:\n  headroomRatio: 0.1\n  fragmentationRatio: 0.5\n")
    out = tmp_path / "kvguard.json"
    result = generate("--config", str(config), "--output", str(out))
    assert result.returncode == 0, result.stderr
    panels = {p["title"]: p for p in lint.all_panels(json.loads(out.read_text()))}
    steps = panels["Engine headroom (weakest rank)"]["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps] == [None, 0, 0.1]
    assert "50%" in panels["Fragmentation ratio"]["description"]


def test_a_bad_rules_config_is_one_line(tmp_path):
    config = tmp_path / "rules.yaml"
    config.write_text("thresholds:\n  headroomRatio: lots\n")
    result = generate("--config", str(config), "--output", str(tmp_path / "x.json"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr


def test_the_guard_reasons_and_the_budget_time_verdict_are_above_the_fold():
    first_row_end = next(
        p["gridPos"]["y"] for p in lint.all_panels(DASHBOARD) if p["type"] == "row" and p["title"] != "Overview"
    )
    above = {p["title"] for p in PANELS if p["gridPos"]["y"] < first_row_end}
    assert {
        "Engine state",
        "Guard state per rank",
        "Why: guard reasons per rank",
        "Budget-time verdict per rank",
    } <= above
    why = next(p for p in PANELS if p["title"] == "Why: guard reasons per rank")
    assert "kvguard_guard_reason" in why["targets"][0]["expr"] and "{{reason}}" in why["targets"][0]["legendFormat"]


def load_yaml_values() -> dict:
    import yaml

    with open(os.path.join(DASHBOARDS, "..", "helm", "kvguard", "values.yaml"), encoding="utf-8") as handle:
        return yaml.safe_load(handle)
