"""dashboards/kvguard.json held to grafana/dashboard-linter's rules (tests/support/dashboard_lint.py).

Each rule is checked on the real dashboard, and on a copy broken for that rule, so that no check
passes because it cannot see anything.
"""

from __future__ import annotations

import copy
import subprocess

import dashboard_lint as lint
import pytest
import yaml
from dashboard_lint import all_value
from monitoring import DASHBOARD, promtool
from promql import selectors


def first_panel(d: dict, panel_type: str) -> dict:
    return next(p for p in lint.all_panels(d) if p.get("type") == panel_type)


def first_target(d: dict) -> dict:
    return first_panel(d, "timeseries")["targets"][0]


def variable(d: dict, name: str) -> dict:
    return next(v for v in lint.variables(d) if v["name"] == name)


def rename_datasource(d):
    variable(d, "datasource")["name"] = "ds"


def drop_job_variable(d):
    d["templating"]["list"].remove(variable(d, "job"))


def single_instance(d):
    variable(d, "instance")["multi"] = False


def bad_label_query(d):
    variable(d, "rank")["query"] = "label_values(kvguard_snapshot_age_seconds{, rank)"


def refresh_on_load(d):
    variable(d, "pod")["refresh"] = 1


def fixed_panel_datasource(d):
    first_panel(d, "stat")["datasource"] = {"type": "prometheus", "uid": "prom-1"}


def no_description(d):
    first_panel(d, "timeseries")["description"] = ""


def no_unit(d):
    first_panel(d, "timeseries")["fieldConfig"]["defaults"].pop("unit")


def no_targets(d):
    first_panel(d, "stat")["targets"] = []


def empty_query(d):
    first_target(d)["expr"] = " "


def fixed_rate_range(d):
    first_target(d)["expr"] = 'rate(kvguard_allocator_ooms_total{job=~"$job", instance=~"$instance"}[5m])'


def no_job_matcher(d):
    first_target(d)["expr"] = 'kvguard_allocator_reserved_bytes{instance=~"$instance"}'


def no_instance_matcher(d):
    first_target(d)["expr"] = 'kvguard_allocator_reserved_bytes{job=~"$job"}'


def raw_counter(d):
    first_target(d)["expr"] = 'kvguard_allocator_ooms_total{job=~"$job", instance=~"$instance"}'


def editable(d):
    d["editable"] = True


BREAKAGES = {
    "template-datasource-rule": rename_datasource,
    "template-job-rule": drop_job_variable,
    "template-instance-rule": single_instance,
    "template-label-promql-rule": bad_label_query,
    "template-on-time-change-reload-rule": refresh_on_load,
    "panel-datasource-rule": fixed_panel_datasource,
    "panel-title-description-rule": no_description,
    "panel-units-rule": no_unit,
    "panel-no-targets-rule": no_targets,
    "target-promql-rule": empty_query,
    "target-rate-interval-rule": fixed_rate_range,
    "target-job-rule": no_job_matcher,
    "target-instance-rule": no_instance_matcher,
    "target-counter-agg-rule": raw_counter,
    "uneditable-dashboard": editable,
}


@pytest.mark.parametrize("rule", sorted(lint.RULES))
def test_dashboard_passes_linter_rule(rule):
    assert lint.RULES[rule](DASHBOARD) == []


@pytest.mark.parametrize("rule", sorted(lint.RULES))
def test_linter_rule_reports_a_dashboard_broken_for_it(rule):
    broken = copy.deepcopy(DASHBOARD)
    BREAKAGES[rule](broken)
    assert lint.RULES[rule](broken), f"{rule} did not notice {BREAKAGES[rule].__name__}"


def test_every_rule_has_a_breakage():
    assert set(BREAKAGES) == set(lint.RULES)


def test_panels_with_value_mappings_have_a_unit_too():
    # Stricter than the linter, which lets value-mapped panels go without one.
    assert lint.panel_units(DASHBOARD, strict=True) == []


def test_prometheus_parses_every_dashboard_query(tmp_path):
    # target-promql: Prometheus' own parser, through promtool, on every query with the
    # variables at their "All" values and $__rate_interval at a duration.
    exprs = [lint.expand(t["expr"], DASHBOARD, rate_interval="5m", value=all_value) for _, t in lint.targets(DASHBOARD)]
    exprs += [
        lint.expand(lint.split_arguments(v["query"][len("label_values(") : -1])[0], DASHBOARD, value=all_value)
        for v in lint.variables(DASHBOARD)
        if v.get("type") == "query"
    ]
    exprs.append(lint.expand(DASHBOARD["annotations"]["list"][0]["expr"], DASHBOARD, value=all_value))
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dashboard:query_{i}:expr", "expr": e} for i, e in enumerate(exprs)],
            }
        ]
    }
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


def test_selectors_finds_matchers_range_and_function_but_not_label_lists():
    found = selectors('sum by (pod, rank) (rate(a_total{job=~"$job", x="1"}[$__rate_interval])) / on (pod) b')
    assert [(s.metric, s.range, s.function) for s in found] == [
        ("a_total", "$__rate_interval", "rate"),
        ("b", None, None),
    ]
    assert found[0].matcher("job").value == "$job"


def test_selectors_refuses_what_it_cannot_read():
    with pytest.raises(ValueError):
        selectors("sum(a{job=~$job})")
