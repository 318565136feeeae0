"""Shared by the dashboard and rule tests: where the files are, what docs/metrics.md promises."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import yaml
from conftest import ROOT

DASHBOARDS = os.path.join(ROOT, "dashboards")
DASHBOARD_JSON = os.path.join(DASHBOARDS, "kvguard.json")
RULES_DIR = os.path.join(DASHBOARDS, "rules")
ALERTS_FILE = os.path.join(RULES_DIR, "kvguard-alerts.yaml")
RECORDING_FILE = os.path.join(RULES_DIR, "kvguard-recording.yaml")
JOINS_FILE = os.path.join(RULES_DIR, "kvguard-joins.yaml")
RULE_FILES = (ALERTS_FILE, RECORDING_FILE, JOINS_FILE)
PROMTOOL_TESTS = os.path.join(DASHBOARDS, "tests")
METRICS_DOC = os.path.join(ROOT, "docs", "metrics.md")
# The runbook ships in the package; the sidecar serves it at /runbook (kvguard.sidecar.server).
RUNBOOK = os.path.join(ROOT, "exporter", "kvguard", "runbook.md")

# A kvguard metric name standing alone: not part of a recording rule's level:name:op.
KVGUARD_METRIC = re.compile(r"(?<![\w:])(kvguard_[a-z0-9_]+)(?![\w:])")


def load_dashboard() -> dict:
    with open(DASHBOARD_JSON, encoding="utf-8") as handle:
        return json.load(handle)


# The dashboard, read once for every test module; tests that change it work on a deep copy.
DASHBOARD = load_dashboard()


def load_yaml(path: str):
    with open(path, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def rules(path: str) -> list[dict]:
    return [rule for group in load_yaml(path)["groups"] for rule in group["rules"]]


def alerts() -> list[dict]:
    return [rule for rule in rules(ALERTS_FILE) if "alert" in rule]


def recording_rules() -> list[dict]:
    return [rule for rule in rules(RECORDING_FILE) if "record" in rule]


def documented_metrics() -> set[str]:
    """Metric names in docs/metrics.md's tables (the contract with `kvguard serve`)."""
    with open(METRICS_DOC, encoding="utf-8") as handle:
        return set(re.findall(r"^\| `(kvguard_[a-z0-9_]+)` \|", handle.read(), flags=re.MULTILINE))


def documented_serve_flags() -> set[str]:
    """The flags docs/metrics.md's "`kvguard serve` flags" section names."""
    with open(METRICS_DOC) as handle:
        section = handle.read().split("## `kvguard serve` flags", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`(--[a-z][a-z.-]*[a-z])", section))  # dots too: --web.config.file


def documented_serve_port() -> str:
    """The default of `kvguard serve --port` as docs/metrics.md's flag table gives it."""
    with open(METRICS_DOC) as handle:
        (documented,) = re.findall(r"`--port N` \| `(\d+)`", handle.read())
    return documented


def promtool() -> str:
    path = shutil.which("promtool") or ("/usr/bin/promtool" if os.access("/usr/bin/promtool", os.X_OK) else None)
    if path is None:
        pytest.fail("promtool not found: ./dev.sh test installs Debian's prometheus package")
    return path


RULES_GENERATOR = os.path.join(DASHBOARDS, "rules.py")
CUSTOM_PROMTOOL_TESTS = os.path.join(PROMTOOL_TESTS, "custom")
# The non-default rule config: a chart values file whose prometheusRule block dashboards/rules.py reads too.
CUSTOM_RULES_VALUES = os.path.join(ROOT, "helm", "kvguard", "ci", "sidecar-custom-rules-values.yaml")


def rules_generator():
    """dashboards/rules.py as a module (it is a script, not part of the package)."""
    import importlib.util
    import sys

    name = "kvguard_rules_generator"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, RULES_GENERATOR)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
    return sys.modules[name]


def custom_rules_config() -> dict:
    return load_yaml(CUSTOM_RULES_VALUES)["prometheusRule"]
