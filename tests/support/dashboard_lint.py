"""grafana/dashboard-linter's default rules, as Python checks over a dashboard's JSON.

The linter is a Go tool and Go modules are out of reach here, so each rule it runs by default
on a Prometheus dashboard is re-stated below from its source (grafana/dashboard-linter, lint/
rule_*.go), with the rule's own name. Each check returns a list of problems; [] means clean.
LogQL rules are left out: the dashboard has no Loki targets.

Where a check is stricter than the linter it says so.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Callable, Iterator

from promql import selectors

# Panel types the linter's panel and target rules look at (lint/lint.go, rule_target_promql.go).
PANELS_WITH_QUERIES = {"singlestat", "gauge", "table-old", "stat", "state-timeline", "timeseries", "graph"}
PANELS_WITH_UNITS = {"stat", "singlestat", "graph", "table-old", "timeseries", "gauge"}
PANELS_WITH_DATASOURCE = {"singlestat", "graph", "table-old", "timeseries"}

# lint/rule_panel_units.go: the units Grafana knows (valueFormats/categories.ts), the subset a
# kvguard dashboard could want plus the common ones; anything else is reported.
VALID_UNITS = {
    "none",
    "string",
    "short",
    "percent",
    "percentunit",
    "bytes",
    "decbytes",
    "bits",
    "decbits",
    "kbytes",
    "deckbytes",
    "mbytes",
    "decmbytes",
    "gbytes",
    "decgbytes",
    "tbytes",
    "dectbytes",
    "binBps",
    "Bps",
    "hertz",
    "ns",
    "µs",
    "ms",
    "s",
    "m",
    "h",
    "d",
    "dtdurationms",
    "dtdurations",
    "cps",
    "ops",
    "reqps",
    "rps",
    "wps",
    "iops",
    "cpm",
    "opm",
    "bool",
    "bool_yes_no",
    "bool_on_off",
    "celsius",
    "watt",
}

# lint/variables.go: Grafana's global variables, with the values the linter substitutes.
RATE_INTERVAL_SAMPLE = "8869990787ms"
GLOBAL_SAMPLES = {
    "__rate_interval": RATE_INTERVAL_SAMPLE,
    "__interval": "4867856611ms",
    "__range": "6069770749ms",
    "__auto": "12345ms",
}
DATASOURCE_UIDS = {"$datasource", "${datasource}"}
LABEL_FUNCTIONS = {"label_names", "label_values", "metrics", "query_result"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def all_panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # a collapsed row keeps its panels inside


def variables(dashboard: dict) -> list[dict]:
    return dashboard.get("templating", {}).get("list", [])


def all_value(variable: dict) -> str:
    """A variable's value at "All": its allValue, else Grafana's default regex."""
    return variable.get("allValue") or ".*"


def expand(
    expr: str, dashboard: dict, rate_interval: str = RATE_INTERVAL_SAMPLE, value: Callable[[dict], str] | None = None
) -> str:
    """expr with Grafana's variables replaced: globals by sample durations, dashboard variables by
    value(variable) (default: the variable's name, as the linter does)."""
    by_name = {v["name"]: v for v in variables(dashboard)}

    def substitute(match: re.Match) -> str:
        name = next(g for g in match.groups() if g)
        if name == "__rate_interval":
            return rate_interval
        if name in GLOBAL_SAMPLES:
            return GLOBAL_SAMPLES[name]
        if name in by_name:
            return value(by_name[name]) if value else name
        raise ValueError(f"unknown variable ${name} in {expr!r}")

    return _VARIABLE.sub(substitute, expr)


def _prometheus_dashboard(dashboard: dict) -> bool:
    return any(v.get("type") == "datasource" and v.get("query") == "prometheus" for v in variables(dashboard))


def _uid(datasource) -> str | None:
    return datasource.get("uid") if isinstance(datasource, dict) else datasource


def targets(dashboard: dict) -> Iterator[tuple[dict, dict]]:
    for panel in all_panels(dashboard):
        if panel.get("type") in PANELS_WITH_QUERIES:
            for target in panel.get("targets", []):
                yield panel, target


# ----------------------------------------------------------------------------- dashboard rules


def template_datasource(dashboard: dict) -> list[str]:
    """template-datasource-rule: a templated data source, named 'datasource', labelled 'Data source'."""
    templated = [v for v in variables(dashboard) if v.get("type") == "datasource"]
    if not templated:
        return ["does not have a templated data source"]
    problems = []
    for v in templated:
        query = str(v.get("query", ""))
        names = {f"{query.lower()}_datasource"} | ({"datasource"} if len(templated) == 1 else set())
        labels = {f"{query.title()} data source"} | ({"Data source"} if len(templated) == 1 else set())
        if v.get("name") not in names:
            problems.append(f"data source variable named {v.get('name')!r}, should be one of {sorted(names)}")
        if v.get("label") not in labels:
            problems.append(f"data source variable labelled {v.get('label')!r}, should be one of {sorted(labels)}")
    return problems


def _template(dashboard: dict, name: str) -> list[str]:
    """template-job-rule and template-instance-rule: lint/rule_template_job.go checkTemplate()."""
    if not _prometheus_dashboard(dashboard):
        return []
    variable = next((v for v in variables(dashboard) if v.get("name") == name), None)
    if variable is None:
        return [f"is missing the {name} template"]
    problems = []
    if _uid(variable.get("datasource")) not in DATASOURCE_UIDS:
        problems.append(f"{name} template should use datasource '$datasource'")
    if variable.get("type") != "query":
        problems.append(f"{name} template should be a Prometheus query")
    if variable.get("label") != name.title():
        problems.append(f"{name} template should be labelled {name.title()!r}")
    if not variable.get("multi"):
        problems.append(f"{name} template should be a multi select")
    if variable.get("allValue") != ".+":
        problems.append(f"{name} template allValue should be '.+'")
    return problems


def split_arguments(text: str) -> list[str]:
    depth, start, parts, quote = 0, 0, [], None
    for i, char in enumerate(text):
        if quote:
            quote = None if char == quote and text[i - 1] != "\\" else quote
        elif char in "\"'`":
            quote = char
        elif char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


def template_label_promql(dashboard: dict) -> list[str]:
    """template-label-promql-rule: query variables use label_values() & co. over a valid selector.

    Stricter than the linter, which accepts any query whose start parses: here the function's
    first argument must read as PromQL and label_values' label must be a label name.
    """
    if not _prometheus_dashboard(dashboard):
        return []
    problems = []
    for v in variables(dashboard):
        if v.get("type") != "query":
            continue
        query = v.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        match = re.fullmatch(r"([a-z_]+)\((.+)\)", query or "")
        if not match or match.group(1) not in LABEL_FUNCTIONS:
            problems.append(f"template {v['name']!r}: invalid templated label query {query!r}")
            continue
        arguments = split_arguments(match.group(2))
        try:
            if match.group(1) == "label_values" and len(arguments) == 2:
                if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", arguments[1]):
                    raise ValueError(f"{arguments[1]!r} is not a label name")
            selectors(expand(arguments[0], dashboard))
        except (ValueError, IndexError) as exc:
            problems.append(f"template {v['name']!r}: {exc}")
    return problems


def template_on_time_change_reload(dashboard: dict) -> list[str]:
    """template-on-time-change-reload-rule: query variables refresh on time range change (2)."""
    return [
        f"template {v['name']!r} refresh is {v.get('refresh')!r}, should be 2"
        for v in variables(dashboard)
        if v.get("type") == "query" and v.get("refresh") != 2
    ]


def uneditable_dashboard(dashboard: dict) -> list[str]:
    """uneditable-dashboard: a generated dashboard is not edited in Grafana."""
    return ["is editable, it should be set to 'editable: false'"] if dashboard.get("editable", True) else []


# ----------------------------------------------------------------------------- panel rules


def panel_datasource(dashboard: dict) -> list[str]:
    """panel-datasource-rule: panels use the templated data source.

    Stricter than the linter: stat panels are held to it too, not only graph/timeseries/singlestat.
    """
    allowed = {f"${v['name']}" for v in variables(dashboard) if v.get("type") == "datasource"}
    allowed |= {f"${{{v['name']}}}" for v in variables(dashboard) if v.get("type") == "datasource"}
    return [
        f"panel {p.get('title')!r} uses data source {_uid(p.get('datasource'))!r}"
        for p in all_panels(dashboard)
        if p.get("type") in PANELS_WITH_DATASOURCE | {"stat"} and _uid(p.get("datasource")) not in allowed
    ]


def panel_title_description(dashboard: dict) -> list[str]:
    """panel-title-description-rule: every panel has a title and a description."""
    return [
        f"panel {p.get('title')!r} has no title or description"
        for p in all_panels(dashboard)
        if p.get("type") in PANELS_WITH_UNITS and not (p.get("title") and p.get("description"))
    ]


def _unit(panel: dict) -> str:
    config = panel.get("fieldConfig") or {}
    for override in config.get("overrides", []):
        for prop in override.get("properties", []):
            if prop.get("id") == "unit":
                return prop.get("value") or ""
    return config.get("defaults", {}).get("unit", "")


def _has_value_mappings(panel: dict) -> bool:
    config = panel.get("fieldConfig") or {}
    overrides = [prop for o in config.get("overrides", []) for prop in o.get("properties", [])]
    return bool(config.get("defaults", {}).get("mappings")) or any(
        prop.get("id") == "mappings" and prop.get("value") for prop in overrides
    )


def panel_units(dashboard: dict, strict: bool = False) -> list[str]:
    """panel-units-rule: a valid unit, unless the panel maps values to text.

    strict=True also holds panels with value mappings to a unit (kvguard's choice).
    """
    problems = []
    for panel in all_panels(dashboard):
        if panel.get("type") not in PANELS_WITH_UNITS:
            continue
        if panel.get("type") == "stat" and (panel.get("options", {}).get("reduceOptions", {}).get("fields") or ""):
            continue
        if _has_value_mappings(panel) and not strict:
            continue
        if _unit(panel) not in VALID_UNITS:
            problems.append(f"panel {panel.get('title')!r} has no or an invalid unit: {_unit(panel)!r}")
    return problems


def panel_no_targets(dashboard: dict) -> list[str]:
    """panel-no-targets-rule."""
    return [
        f"panel {p.get('title')!r} has no targets"
        for p in all_panels(dashboard)
        if p.get("type") in PANELS_WITH_UNITS and not p.get("targets")
    ]


# ----------------------------------------------------------------------------- target rules


def target_promql(dashboard: dict) -> list[str]:
    """target-promql-rule, the part that needs no Prometheus: every target has a query that reads
    as PromQL here. Prometheus' own parser judges each query in tests/deploy/test_dashboard_lint.py
    (promtool) and tests/deploy/test_prometheus_e2e.py (HTTP API)."""
    if not _prometheus_dashboard(dashboard):
        return []
    problems = []
    for panel, target in targets(dashboard):
        expr = target.get("expr", "")
        if not expr.strip():
            problems.append(f"panel {panel.get('title')!r} target {target.get('refId')} has an empty query")
            continue
        try:
            selectors(expand(expr, dashboard))  # tokenizes first: a query it cannot read raises there
        except ValueError as exc:
            problems.append(f"panel {panel.get('title')!r} target {target.get('refId')}: {exc}")
    return problems


def target_rate_interval(dashboard: dict) -> list[str]:
    """target-rate-interval-rule: rate() and irate() ranges are $__rate_interval.

    Stricter than the linter: every range selector in the dashboard is $__rate_interval.
    """
    problems = []
    for panel, target in targets(dashboard):
        for selector in selectors(expand(target.get("expr", ""), dashboard)):
            if selector.range is not None and selector.range != RATE_INTERVAL_SAMPLE:
                problems.append(
                    f"panel {panel.get('title')!r} target {target.get('refId')}: "
                    f"{selector.metric}[{selector.range}] should use $__rate_interval"
                )
    return problems


def _required_matcher(dashboard: dict, label: str) -> list[str]:
    """target-job-rule and target-instance-rule: lint/rule_target_job_instance.go, every selector has
    label=~"$label"."""
    if not _prometheus_dashboard(dashboard):
        return []
    problems = []
    for panel, target in targets(dashboard):
        for selector in selectors(target.get("expr", "").replace("$__rate_interval", "5m")):
            matcher = selector.matcher(label)
            if matcher is None or matcher.op != "=~" or matcher.value != f"${label}":
                problems.append(
                    f"panel {panel.get('title')!r} target {target.get('refId')}: "
                    f'{selector.metric} lacks {label}=~"${label}"'
                )
    return problems


def target_counter_agg(dashboard: dict) -> list[str]:
    """target-counter-agg-rule: a counter (name ending in _total) is read through rate, irate or increase."""
    problems = []
    for panel, target in targets(dashboard):
        for selector in selectors(expand(target.get("expr", ""), dashboard)):
            if (selector.metric or "").endswith("_total") and not (
                selector.range is not None and selector.function in ("rate", "irate", "increase")
            ):
                problems.append(
                    f"panel {panel.get('title')!r} target {target.get('refId')}: "
                    f"counter {selector.metric} is not aggregated with rate, irate or increase"
                )
    return problems


RULES: dict[str, Callable[[dict], list[str]]] = {
    "template-datasource-rule": template_datasource,
    "template-job-rule": partial(_template, name="job"),
    "template-instance-rule": partial(_template, name="instance"),
    "template-label-promql-rule": template_label_promql,
    "template-on-time-change-reload-rule": template_on_time_change_reload,
    "panel-datasource-rule": panel_datasource,
    "panel-title-description-rule": panel_title_description,
    "panel-units-rule": panel_units,
    "panel-no-targets-rule": panel_no_targets,
    "target-promql-rule": target_promql,
    "target-rate-interval-rule": target_rate_interval,
    "target-job-rule": partial(_required_matcher, label="job"),
    "target-instance-rule": partial(_required_matcher, label="instance"),
    "target-counter-agg-rule": target_counter_agg,
    "uneditable-dashboard": uneditable_dashboard,
}
