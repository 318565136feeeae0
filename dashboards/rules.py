#!/usr/bin/env python3
"""Generate kvguard's Prometheus rules from one table and a small config (a monitoring mixin's `_config`).

    python dashboards/rules.py              write dashboards/rules/*.yaml and the chart's rule template
    python dashboards/rules.py --check      exit 1 if a committed file differs from what the code writes
    python dashboards/rules.py --config my.yaml --output-dir DIR
                                            your own rules: my.yaml is shaped like the chart's
                                            prometheusRule values (jobSelector, runbookUrl, thresholds, for,
                                            deviceJoins)

The config, with DEFAULTS below as its defaults:
  jobSelector   label matchers added to every kvguard series the rules read, and to up{}
  runbookUrl    the runbook link of each alert; %s is the alert name in lower case
                (kube-prometheus' runbookURLPattern). Empty: the default, RUNBOOK_URL below: #<alertname>
                on the page the external label kvguard_runbook_url names, else on the runbook every
                sidecar serves (/runbook), on the target the alert names
  thresholds    the numbers the alerts compare against, by name
  for           each alert's `for` duration, by alert name
  deviceJoins   label matchers on the other exporters' series the join rules read:
                dcgmExporterSelector (DCGM_FI_DEV_FB_USED), npuExporterSelector
                (npu_chip_info_hbm_used_memory); empty (the default): any job
  additionalRuleLabels  labels added to every alert (routing: team, cluster, ...), as
                kube-prometheus-stack's defaultRules.additionalRuleLabels
  disabled      alerts left out, by name: {KVGuardFragmentationHigh: true} (kube-prometheus-stack's
                defaultRules.disabled)
  customRules   per alert, a severity of one's own: {KVGuardHeadroomLow: {severity: critical}}
                (kube-prometheus-stack's customRules; `for` has its own map above)

The rule table uses placeholders: ${jobSelector}, ${thresholds.NAME}, ${deviceJoins.NAME}, ${for} (the
alert's own `for`) and ${runbookUrl} (the alert's own link). A selector is the last matcher of its
braces, so an empty one leaves `{a="b",}` or `{}`: both are tidied away (`{a="b"}`, nothing) once filled.
Two outputs come from the table:
  dashboards/rules/*.yaml                      the placeholders filled from DEFAULTS: plain `groups:`
                                               files for promtool and for Prometheus without Helm;
  helm/kvguard/files/*.template.yaml           the placeholders kept, one file per PrometheusRule the
                                               chart renders (kvguard-rules: recording and alerts;
                                               kvguard-joins: the device joins). The chart's
                                               templates/_prometheusrule.tpl fills them from
                                               .Values.prometheusRule, whose defaults mirror DEFAULTS
                                               (tests/deploy/test_rules_generate.py holds them equal, and
                                               `helm template` equal to this generator for a
                                               non-default config).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import textwrap
from dataclasses import dataclass

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
RULES_DIR = os.path.join(HERE, "rules")
CHART_FILES = os.path.join(os.path.dirname(HERE), "helm", "kvguard", "files")
CHART_TEMPLATE = os.path.join(CHART_FILES, "kvguard-rules.template.yaml")
JOINS_CHART_TEMPLATE = os.path.join(CHART_FILES, "kvguard-joins.template.yaml")

PLACEHOLDER = re.compile(r"\$\{([A-Za-z][A-Za-z0-9]*(?:\.[A-Za-z][A-Za-z0-9]*)?)\}")
# Exactly one %s and no other %: what both Python's % and Go's printf (the chart) read alike.
RUNBOOK_PATTERN = re.compile(r"[^%]*%s[^%]*")
DURATION = re.compile(r"0|(?:[0-9]+(?:ms|s|m|h|d|w|y))+")
# What an empty selector leaves, as tidy() removes it; the chart's template uses the same two patterns.
TRAILING_COMMA = re.compile(r",\}")
EMPTY_MATCHERS = re.compile(r"([A-Za-z0-9_:])\{\}")


# ----------------------------------------------------------------------------- the table


def series(name: str, *matchers: str, selector: str = "jobSelector") -> str:
    """A series with its own matchers, then the config's selector (a kvguard series: the job selector)."""
    return f"{name}{{{''.join(m + ',' for m in matchers)}${{{selector}}}}}"


def threshold(name: str) -> str:
    return f"${{thresholds.{name}}}"


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    severity: str
    summary: str
    description: str
    for_: str | None  # the default `for`; None: fires on the first evaluation, no `for`
    comment: str = ""


@dataclass(frozen=True)
class Record:
    name: str
    expr: str
    comment: str = ""


@dataclass(frozen=True)
class Group:
    name: str
    rules: tuple


@dataclass(frozen=True)
class RuleFile:
    name: str  # under dashboards/rules/
    header: str
    groups: tuple
    chart: str = CHART_TEMPLATE  # the chart template (one PrometheusRule) its groups go into


# Where a rank's alert names it: the rank labels of docs/metrics.md plus the scrape's instance.
RANK = (
    'rank "{{ $labels.rank }}" on device {{ $labels.device }} ({{ $labels.namespace }}/{{ $labels.pod }}, '
    "{{ $labels.instance }})"
)
RANK_PAREN = (
    'rank "{{ $labels.rank }}" ({{ $labels.device }}, {{ $labels.namespace }}/{{ $labels.pod }}, '
    "{{ $labels.instance }})"
)
POD = "job, instance, namespace, pod"
# One serving engine, across all its pods: engine_id is the same on every pod of a multi-node engine (an
# LWS group, a Ray cluster) and defaults to the pod; engine is vLLM's data-parallel index inside it.
ENGINE = "job, namespace, model_name, engine_id, engine"
# Where an engine's alert names it.
ENGINE_TEXT = (
    'engine "{{ $labels.engine_id }}" (model "{{ $labels.model_name }}", data-parallel engine '
    '"{{ $labels.engine }}", namespace {{ $labels.namespace }})'
)

ALERTS = (
    Alert(
        "KVGuardOOMRiskCritical",
        "namespace_engine:kvguard_guard_severity:max >= 2",
        "critical",
        "A serving engine is about to run out of device memory.",
        f"kvguard's guard has judged a rank of {ENGINE_TEXT} critical for ${{for}}: its projected peak exceeds "
        "the device's capacity, or the allocator's retries or out-of-memory errors are climbing. "
        "kvguard_guard_reason and /guard on the engine's pods name the rank and the reason.",
        "2m",
        comment="One alert per engine (recording rule namespace_engine:…), not one per rank: an engine fails "
        "as a whole when any of its ranks does.",
    ),
    Alert(
        "KVGuardAllocatorOOMs",
        f"increase({series('kvguard_allocator_ooms_total')}[10m]) > 0",
        "critical",
        "The framework allocator raised out-of-memory errors.",
        f'R{RANK[1:]} raised {{{{ printf "%.0f" $value }}}} out-of-memory error(s) in the last 10 minutes: '
        "requests on it are failing.",
        None,
    ),
    Alert(
        "KVGuardKVCacheOvercommitted",
        f"{series('kvguard_kv_cache_overcommit_bytes')} > {threshold('overcommitBytes')}",
        "warning",
        "The KV cache vLLM sized is larger than the reserved-aware budget.",
        f"On {RANK_PAREN} vLLM's stock KV-cache budget exceeds the reserved-aware budget by "
        "{{ $value | humanize1024 }}B: the allocator's fragmentation is paid out of the slack that "
        "gpu_memory_utilization leaves.",
        "15m",
    ),
    Alert(
        "KVGuardFragmentationHigh",
        f"{series('kvguard_allocator_fragmentation_ratio')} > {threshold('fragmentationRatio')} and "
        f"{series('kvguard_allocator_fragmentation_bytes')} > {threshold('fragmentationBytes')}",
        "warning",
        "The allocator holds much device memory that tensors cannot use.",
        f"On {RANK_PAREN} {{{{ $value | humanizePercentage }}}} of the allocator's reserved memory (more than "
        f"{{{{ {threshold('fragmentationBytes')} | humanize1024 }}}}B) has been fragmentation (reserved minus "
        "allocated) for ${for}.",
        "15m",
        comment="Both conditions: a high ratio on a small pool is harmless, many bytes on a huge pool may be too.",
    ),
    Alert(
        "KVGuardHeadroomLow",
        f"namespace_engine:kvguard_guard_headroom_ratio:min < {threshold('headroomRatio')}",
        "warning",
        f"The projected memory peak leaves less than {{{{ {threshold('headroomRatio')} | humanizePercentage }}}} "
        "of a device free.",
        f"On the weakest rank of {ENGINE_TEXT} the headroom between the projected peak and the device's "
        "capacity is {{ $value | humanizePercentage }} of capacity (negative: the peak does not fit); "
        "kvguard_guard_headroom_bytes names the rank.",
        "10m",
        comment="vLLM sizes every rank's KV cache alike, so the engine is as close to its OOM as its "
        "weakest rank: the minimum over the engine's ranks, on every pod.",
    ),
    Alert(
        "KVGuardAllocRetriesClimbing",
        f"rate({series('kvguard_allocator_alloc_retries_total')}[5m]) > {threshold('allocRetriesPerSecond')}",
        "warning",
        "The allocator keeps flushing its cache and retrying allocations.",
        f"R{RANK_PAREN[1:]} has retried allocations after a cache flush for ${{for}} "
        '({{ printf "%.2g" $value }}/s): it is at the device\'s limit and slows down before it runs out.',
        "10m",
    ),
    Alert(
        "KVGuardSnapshotStale",
        f"{series('kvguard_snapshot_stale')} == 1",
        "warning",
        "A serving rank's probe stopped writing snapshots.",
        'The latest snapshot of rank "{{ $labels.rank }}" ({{ $labels.device }}, pid {{ $labels.pid }}, '
        "{{ $labels.namespace }}/{{ $labels.pod }}, {{ $labels.instance }}) has been older than --stale-after "
        "for ${for}: the guard judges it on old counters.",
        "5m",
    ),
    Alert(
        "KVGuardSourceDown",
        f"{series('kvguard_source_up')} == 0",
        "warning",
        "A kvguard device-level source keeps failing.",
        'Source "{{ $labels.source }}" of kvguard at {{ $labels.instance }} ({{ $labels.job }}) has failed or '
        "run past its time limit for ${for}; its series are missing or old.",
        "10m",
    ),
    Alert(
        "KVGuardExporterDown",
        f"{series('up')} == 0",
        "warning",
        "Prometheus cannot scrape a kvguard sidecar.",
        "Prometheus has failed to scrape {{ $labels.instance }} (job {{ $labels.job }}) for ${for}: no "
        "allocator, KV-cache or guard metrics come from it, and no kvguard alert can fire for its ranks.",
        "5m",
        comment='The default jobSelector, job=~".*kvguard.*", matches the Helm chart\'s monitors (they set '
        'job="kvguard" whatever the release is called); name a hand-written scrape job likewise, or '
        "set jobSelector.",
    ),
)


def by_pod(op: str, metric: str, extra: str = "") -> str:
    return f"{op} by ({POD}{extra}) ({series(metric)})"


def by_engine(op: str, metric: str, extra: str = "") -> str:
    return f"{op} by ({ENGINE}{extra}) ({series(metric)})"


ENGINES = (
    Record(
        "namespace_engine:kvguard_kv_cache_allocated_blocks:min",
        by_engine("min", "kvguard_kv_cache_allocated_blocks"),
        comment="vLLM sizes every worker's KV cache to the minimum block count over its workers "
        "(get_kv_cache_configs, vllm/v1/core/kv_cache_utils.py 0.11.0:1283-1289), and every rank of the engine holds "
        "that many: the engine's blocks, counted once however many pods and ranks it spans.",
    ),
    Record(
        "namespace_engine:kvguard_kv_cache_budget_bytes:min",
        by_engine("min", "kvguard_kv_cache_budget_bytes", ", budget"),
    ),
    Record(
        "namespace_engine:kvguard_kv_cache_overcommit_bytes:max", by_engine("max", "kvguard_kv_cache_overcommit_bytes")
    ),
    Record(
        "namespace_engine:kvguard_guard_headroom_bytes:min",
        by_engine("min", "kvguard_guard_headroom_bytes"),
        comment="The engine fails with its weakest rank: least headroom, worst guard state.",
    ),
    Record(
        "namespace_engine:kvguard_guard_headroom_ratio:min",
        f"min by ({ENGINE}) (\n"
        f"  {series('kvguard_guard_headroom_bytes')}\n"
        f"  / {series('kvguard_guard_capacity_bytes')}\n"
        ")\n",
        comment="The least headroom as a share of its own device's capacity (KVGuardHeadroomLow).",
    ),
    Record("namespace_engine:kvguard_guard_severity:max", by_engine("max", "kvguard_guard_severity")),
    Record(
        "namespace_engine:kvguard_ranks:count",
        f"count by ({ENGINE}) ({series('kvguard_guard_severity')})",
        comment="Ranks reporting, over all the engine's pods: a TP16 engine on two pods reports 16.",
    ),
    Record(
        "namespace_engine:kvguard_allocator_allocated_bytes:sum", by_engine("sum", "kvguard_allocator_allocated_bytes")
    ),
    Record(
        "namespace_engine:kvguard_allocator_reserved_bytes:sum", by_engine("sum", "kvguard_allocator_reserved_bytes")
    ),
)

DEPLOYMENT = (
    Record(
        "namespace_pod:kvguard_kv_cache_allocated_blocks:min",
        by_pod("min", "kvguard_kv_cache_allocated_blocks"),
        comment="The pod's ranks' smallest block count (an engine that spans pods: "
        "namespace_engine:kvguard_kv_cache_allocated_blocks:min counts it once).",
    ),
    Record(
        "namespace_pod:kvguard_kv_cache_budget_bytes:min", by_pod("min", "kvguard_kv_cache_budget_bytes", ", budget")
    ),
    Record("namespace_pod:kvguard_kv_cache_overcommit_bytes:max", by_pod("max", "kvguard_kv_cache_overcommit_bytes")),
    Record("namespace_pod:kvguard_guard_headroom_bytes:min", by_pod("min", "kvguard_guard_headroom_bytes")),
    Record("namespace_pod:kvguard_guard_severity:max", by_pod("max", "kvguard_guard_severity")),
    Record("namespace_pod:kvguard_allocator_allocated_bytes:sum", by_pod("sum", "kvguard_allocator_allocated_bytes")),
    Record("namespace_pod:kvguard_allocator_reserved_bytes:sum", by_pod("sum", "kvguard_allocator_reserved_bytes")),
    Record(
        "namespace_pod:kvguard_allocator_fragmentation_bytes:sum",
        by_pod("sum", "kvguard_allocator_fragmentation_bytes"),
    ),
    Record(
        "namespace_pod:kvguard_allocator_fragmentation:ratio",
        "namespace_pod:kvguard_allocator_fragmentation_bytes:sum\n"
        "  / (namespace_pod:kvguard_allocator_reserved_bytes:sum > 0)\n",
        comment="Weighted by reserved bytes, not an average of the ranks' ratios.",
    ),
    Record(
        "namespace_pod:kvguard_allocator_alloc_retries:rate5m",
        f"sum by ({POD}) (rate({series('kvguard_allocator_alloc_retries_total')}[5m]))",
    ),
    Record(
        "namespace_pod:kvguard_allocator_ooms:rate5m",
        f"sum by ({POD}) (rate({series('kvguard_allocator_ooms_total')}[5m]))",
    ),
    Record("namespace_pod:kvguard_snapshot_age_seconds:max", by_pod("max", "kvguard_snapshot_age_seconds")),
)


def by_namespace(op: str, metric: str, pod_op: str | None = None) -> Record:
    """namespace:METRIC:OP over the deployment-level namespace_pod:METRIC:POD_OP."""
    return Record(f"namespace:{metric}:{op}", f"{op} by (job, namespace) (namespace_pod:{metric}:{pod_op or op})")


NAMESPACE = (
    Record(
        "namespace:kvguard_kv_cache_allocated_blocks:sum",
        "sum by (job, namespace) (namespace_engine:kvguard_kv_cache_allocated_blocks:min)",
        comment="KV-cache blocks the namespace can serve: each engine's, once, summed over engines.",
    ),
    Record(
        "namespace:kvguard_guard_severity:max", "max by (job, namespace) (namespace_engine:kvguard_guard_severity:max)"
    ),
    Record(
        "namespace:kvguard_guard_headroom_bytes:min",
        "min by (job, namespace) (namespace_engine:kvguard_guard_headroom_bytes:min)",
    ),
    Record(
        "namespace:kvguard_kv_cache_overcommit_bytes:max",
        "max by (job, namespace) (namespace_engine:kvguard_kv_cache_overcommit_bytes:max)",
    ),
    by_namespace("sum", "kvguard_allocator_allocated_bytes"),
    by_namespace("sum", "kvguard_allocator_reserved_bytes"),
    by_namespace("sum", "kvguard_allocator_fragmentation_bytes"),
    Record(
        "namespace:kvguard_allocator_alloc_retries:rate5m",
        "sum by (job, namespace) (namespace_pod:kvguard_allocator_alloc_retries:rate5m)",
    ),
    Record(
        "namespace:kvguard_allocator_ooms:rate5m",
        "sum by (job, namespace) (namespace_pod:kvguard_allocator_ooms:rate5m)",
    ),
)

# ----------------------------------------------------------------------------- device joins
# The exporters' labels and units, with their upstream sources: the kvguard-joins.yaml header in FILES.


def dcgm(name: str, *matchers: str) -> str:
    return series(name, *matchers, selector="deviceJoins.dcgmExporterSelector")


def npu_exporter(name: str) -> str:
    return series(name, selector="deviceJoins.npuExporterSelector")


DCGM_WHOLE_GPU = dcgm("DCGM_FI_DEV_FB_USED", 'GPU_I_ID=""')  # a MIG instance's rows have GPU_I_ID
RESERVED_WITH_UUID = series("kvguard_allocator_reserved_bytes", 'device_uuid!=""')
DEVICE_WITH_BUS = series("kvguard_device_used_bytes", 'pci_bus_id!=""')
NPU_HBM_BY_BUS = (
    f'label_replace({npu_exporter("npu_chip_info_hbm_used_memory")}, "pci_bus_id", "$1", "pcie_bus_info", "(.+)")'
)

DEVICE_JOINS = (
    Record(
        "kvguard:dcgm_fb_used_bytes",
        "max by (device_uuid, pci_bus_id, gpu, modelName, hostname, Hostname) (\n"
        f'  label_replace({DCGM_WHOLE_GPU}, "device_uuid", "$1", "UUID", "(.+)")\n'
        ") * 1048576\n",
        comment="dcgm-exporter's framebuffer used in bytes, one row per whole GPU, keyed by device_uuid.",
    ),
    Record(
        "kvguard:allocator_reserved_bytes:dcgm",
        f"{RESERVED_WITH_UUID}\n"
        "  * on (device_uuid) group_left (gpu, modelName)\n"
        "  (0 * kvguard:dcgm_fb_used_bytes + 1)\n",
        comment="Each rank's allocator reserved bytes, with the GPU index and model dcgm-exporter names: "
        "one row per rank on a GPU that dcgm-exporter reports.",
    ),
    Record(
        "kvguard:gpu_outside_allocator_bytes:dcgm",
        "kvguard:dcgm_fb_used_bytes\n"
        "  - on (device_uuid) group_left ()\n"
        f"  sum by (device_uuid) ({RESERVED_WITH_UUID})\n",
        comment="What a GPU holds beyond the allocators kvguard watches on it (CUDA contexts, NCCL buffers, "
        "other processes): dcgm-exporter's framebuffer used minus its ranks' reserved bytes. One row "
        "per GPU that has kvguard ranks.",
    ),
    Record(
        "kvguard:npu_hbm_used_bytes:npu_exporter",
        "(\n"
        "  max by (pci_bus_id, id, vdie_id, model_name) (\n"
        f"    {NPU_HBM_BY_BUS}\n"
        "  ) * 1048576\n"
        ")\n"
        "and on (pci_bus_id)\n"
        "(\n"
        "  count by (pci_bus_id) (\n"
        "    max by (pci_bus_id, id) (\n"
        f"      {NPU_HBM_BY_BUS}\n"
        "    )\n"
        "  ) == 1\n"
        ")\n",
        comment="npu-exporter's HBM used in bytes, one row per chip whose PCIe address is its own, keyed by "
        "pci_bus_id (an Atlas 300I Duo's two chips print one address: they are left out).",
    ),
    Record(
        "kvguard:device_used_bytes:npu_exporter",
        f"{DEVICE_WITH_BUS}\n"
        "  * on (pci_bus_id) group_left (id, vdie_id, model_name)\n"
        "  (0 * kvguard:npu_hbm_used_bytes:npu_exporter + 1)\n",
        comment="kvguard's npu-smi device series with npu-exporter's chip id, die id and model: one row per chip.",
    ),
)


# The chart renders each chart template's groups, in this order, as one PrometheusRule: the recording
# rules and alerts as the release's own, the device joins as "<release>-joins" (off by default).
FILES = (
    RuleFile(
        "kvguard-recording.yaml",
        """\
kvguard recording rules. Tested by dashboards/tests/kvguard-recording.test.yaml (promtool test rules).

Names follow level:metric:operations.
  namespace_engine: one serving engine across all its pods (engine_id: the same on every pod of a
                  multi-node engine, by default the pod; engine: vLLM's data-parallel index in it).
  namespace_pod:  one pod's ranks. job and instance are kept: a sidecar's instance is its pod, and
                  outside Kubernetes (namespace and pod empty) instance is what keeps hosts apart.
  namespace:      all engines of a namespace and scrape job.""",
        (
            Group("kvguard.rules.engine", ENGINES),
            Group("kvguard.rules.deployment", DEPLOYMENT),
            Group("kvguard.rules.namespace", NAMESPACE),
        ),
    ),
    RuleFile(
        "kvguard-alerts.yaml",
        """\
kvguard alerting rules. Tested by dashboards/tests/kvguard-alerts.test.yaml (promtool test rules);
every alert's runbook is a section of exporter/kvguard/runbook.md: runbook_url is #<alertname> on the page
that Prometheus' external label kvguard_runbook_url names (pages that open without the scrape's
credentials: python dashboards/runbook.py --pages DIR writes them), else on the /runbook every sidecar
serves, on a target of the alert's job that is up (see RUNBOOK_URL in dashboards/rules.py).

Per-rank alerts carry the rank labels of docs/metrics.md (device, rank, pid, pod, namespace,
container) plus the scrape's job and instance; instance tells hosts apart outside Kubernetes,
where pod and namespace are empty. KVGuardOOMRiskCritical and KVGuardHeadroomLow are per engine
(job, namespace, model_name, engine_id, engine): they read kvguard-recording.yaml's
namespace_engine rules, which must be loaded too.""",
        (Group("kvguard.alerts", ALERTS),),
    ),
    RuleFile(
        "kvguard-joins.yaml",
        """\
kvguard's series joined to dcgm-exporter's and Huawei npu-exporter's on the device identity labels
(device_uuid, pci_bus_id; docs/metrics.md "Joining other exporters"). Off in the chart unless
prometheusRule.deviceJoins.enabled; tested by dashboards/tests/kvguard-joins.test.yaml and, against a
real Prometheus scraping kvguard beside both exporters' expositions, tests/deploy/test_device_joins_e2e.py.
Their selectors are config: jobSelector on kvguard's series, deviceJoins.dcgmExporterSelector and
deviceJoins.npuExporterSelector on the exporters' (empty by default: any job).

dcgm-exporter (4.5.3-4.8.2, internal/pkg/rendermetrics/render_metrics.go:47) labels every GPU series
  gpu, UUID, pci_bus_id, device ("nvidia0"), modelName, hostname (Hostname in 3.x,
  pkg/dcgmexporter/pipeline.go:299 at 3.3.9-3.6.1); GPU_I_PROFILE and GPU_I_ID on a MIG instance's
  rows, which carry the parent GPU's UUID.
  DCGM_FI_DEV_FB_USED is framebuffer memory used, in MiB.
npu-exporter (v5, collector/npu_collector.go) labels every chip series
  id (the physical chip id), model_name, vdie_id, pcie_bus_info ("0000:C1:00.0", dcmi.go's
  %04X:%02X:%02X.%X: the Bus-Id npu-smi prints, which kvguard's npu-smi source exports as pci_bus_id).
  npu_chip_info_hbm_used_memory is HBM used, in MB (MiB).

Each join's right-hand side is made unique per key first (max by the key and the labels taken
over), so two scrapes of one exporter, or two chips behind one PCIe address, can never make a
many-to-many match that fails the whole rule: they drop out of the join instead.""",
        (Group("kvguard.rules.device-joins", DEVICE_JOINS),),
        chart=JOINS_CHART_TEMPLATE,
    ),
)

# The default runbook link of the plain rule files (the Helm chart links to its own runbook pages instead):
# #<alertname> on the runbook page named by the Prometheus external label kvguard_runbook_url
# ($externalLabels in alert templates: prometheus/prometheus docs/configuration/template_reference.md,
# "Template type differences"), a page that opens without the scrape's credentials: the pages that
# dashboards/runbook.py --pages writes, served anywhere; a wiki copy of docs/runbook.md; or a sidecar's
# /runbook with --web.runbook-public. Without that label, the runbook the sidecar serves
# (kvguard.sidecar.server, /runbook, whose headings carry those ids), on the target the alert names
# ($labels.instance, host:port of the scrape), unless that target is down (up == 0: KVGuardExporterDown's own
# target), then on a kvguard target of the same job that is up. The per-engine alerts (KVGuardOOMRiskCritical,
# KVGuardHeadroomLow) aggregate instance away: for them, the instance of the engine's rank in the worst guard
# state (the pod whose /guard says why). Prometheus' template functions query, first and label
# (template_reference.md, "Queries"; every rank the guard judges exports kvguard_guard_severity). Annotations
# are templates in Prometheus and promtool alike, so dashboards/tests checks the URLs it makes, and
# tests/deploy/test_runbook_links.py fetches them from a real Prometheus. No `|`, so it fits a markdown table cell.
RUNBOOK_LABEL = "kvguard_runbook_url"
RUNBOOK_URL = (
    "{{ with $externalLabels." + RUNBOOK_LABEL + " }}{{ . }}{{ else }}http://{{ if $labels.instance }}"
    '{{ with query (print "up{job=\\"" $labels.job "\\",instance=\\"" $labels.instance "\\"} == 0") }}'
    '{{ with query (print "topk(1, up{job=\\"" $labels.job "\\"} == 1)") }}{{ label "instance" (first .) }}{{ end }}'
    "{{ else }}{{ $labels.instance }}{{ end }}{{ else }}"
    '{{ with query (print "topk(1, kvguard_guard_severity{job=\\"" $labels.job "\\",namespace=\\"" $labels.namespace '
    '"\\",engine_id=\\"" $labels.engine_id "\\"})") }}{{ label "instance" (first .) }}{{ end }}{{ end }}'
    "/runbook{{ end }}#%s"
)

DEFAULTS = {
    "jobSelector": 'job=~".*kvguard.*"',
    "runbookUrl": RUNBOOK_URL,
    "thresholds": {
        # kvguard_kv_cache_overcommit_bytes above this: vLLM's KV cache is larger than the budget.
        "overcommitBytes": 0,
        # Fragmentation alerts when both hold: this share of reserved memory, and this many bytes.
        "fragmentationRatio": 0.3,
        "fragmentationBytes": 1073741824,
        # Headroom below this share of the device's capacity.
        "headroomRatio": 0.05,
        # Allocation retries per second (5m rate) above this.
        "allocRetriesPerSecond": 0,
    },
    "for": {alert.name: alert.for_ for alert in ALERTS if alert.for_ is not None},
    "deviceJoins": {
        # Label matchers on dcgm-exporter's and npu-exporter's series; empty: any scrape job.
        "dcgmExporterSelector": "",
        "npuExporterSelector": "",
    },
    # Labels added to every alert; alerts left out by name; a severity of one's own per alert.
    "additionalRuleLabels": {},
    "disabled": {},
    "customRules": {},
}
# Config maps whose keys are not fixed by DEFAULTS: any label name, or any alert name.
OPEN_MAPS = ("additionalRuleLabels", "disabled", "customRules")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
SEVERITY = re.compile(r"[a-z]+")
# Keys of the chart's prometheusRule block that switch objects on and label them, not rule config.
CHART_ONLY = {"enabled", "labels"}


# ----------------------------------------------------------------------------- config


class ConfigError(ValueError):
    """A config the rules cannot be made from; the message is one line."""


def merge(config: dict | None) -> dict:
    """DEFAULTS overlaid with config (nested maps key by key, as Helm merges values)."""
    merged = copy.deepcopy(DEFAULTS)
    config = {k: v for k, v in (config or {}).items() if k not in CHART_ONLY}  # a chart's block, passed whole
    if isinstance(config.get("deviceJoins"), dict):
        config["deviceJoins"] = {k: v for k, v in config["deviceJoins"].items() if k != "enabled"}
    unknown = set(config) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(sorted(unknown))} (known: {', '.join(DEFAULTS)})")
    for key, value in config.items():
        if key == "runbookUrl" and value == "":  # the chart's default: its Service, else RUNBOOK_URL
            continue
        if isinstance(DEFAULTS[key], dict):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a map, got {type(value).__name__}")
            known = {a.name for a in ALERTS} if key in ("disabled", "customRules") else set(DEFAULTS[key])
            unknown = set() if key == "additionalRuleLabels" else set(value) - known
            if unknown:
                raise ConfigError(
                    f"{key}: unknown key(s): {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})"
                )
            merged[key].update(value)
        else:
            merged[key] = value
    validate(merged)
    return merged


def validate(config: dict) -> None:
    if not isinstance(config["jobSelector"], str):
        raise ConfigError("jobSelector: expected label matchers as a string, e.g. 'job=\"kvguard\"'")
    for name, value in config["deviceJoins"].items():
        if not isinstance(value, str):
            raise ConfigError(f"deviceJoins.{name}: expected label matchers as a string, e.g. 'job=\"dcgm-exporter\"'")
    if not isinstance(config["runbookUrl"], str) or not RUNBOOK_PATTERN.fullmatch(config["runbookUrl"]):
        raise ConfigError(
            f"runbookUrl: expected a URL with exactly one %s (the alert name), got {config['runbookUrl']!r}"
        )
    for name, value in config["thresholds"].items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ConfigError(f"thresholds.{name}: expected a number, got {value!r}")
    for name, value in config["for"].items():
        if not isinstance(value, str) or not DURATION.fullmatch(value):
            raise ConfigError(f"for.{name}: expected a Prometheus duration such as 5m, got {value!r}")
    for name, value in config["additionalRuleLabels"].items():
        if not isinstance(name, str) or not LABEL_NAME.fullmatch(name) or name == "severity":
            raise ConfigError(
                f"additionalRuleLabels: {name!r} is not a label name one may add (severity: use customRules)"
            )
        if not isinstance(value, str):
            raise ConfigError(f"additionalRuleLabels.{name}: expected a string, got {value!r}")
    for name, value in config["disabled"].items():
        if not isinstance(value, bool):
            raise ConfigError(f"disabled.{name}: expected true or false, got {value!r}")
    for name, value in config["customRules"].items():
        if not isinstance(value, dict) or set(value) - {"severity"}:
            raise ConfigError(f"customRules.{name}: expected {{severity: NAME}}, got {value!r}")
        if "severity" in value and (
            not isinstance(value["severity"], str) or not SEVERITY.fullmatch(value["severity"])
        ):
            raise ConfigError(
                f"customRules.{name}.severity: expected a lower-case word such as critical, got {value['severity']!r}"
            )


def number(value: int | float) -> str:
    """A threshold as PromQL and the chart write it: integral values without a fraction."""
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


# ----------------------------------------------------------------------------- rendering


def rule_data(rule: Alert | Record) -> dict:
    """One rule as a Prometheus rule mapping, placeholders kept."""
    if isinstance(rule, Record):
        return {"record": rule.name, "expr": rule.expr}
    data = {"alert": rule.name, "expr": rule.expr}
    if rule.for_ is not None:
        data["for"] = "${for}"
    data["labels"] = {"severity": rule.severity}
    data["annotations"] = {"summary": rule.summary, "description": rule.description, "runbook_url": "${runbookUrl}"}
    return data


def fill(text: str, values: dict[str, str]) -> str:
    def one(match: re.Match) -> str:
        if match.group(1) not in values:
            raise ConfigError(f"no value for placeholder ${{{match.group(1)}}} in {text!r}")
        return values[match.group(1)]

    return PLACEHOLDER.sub(one, text)


def filled(data: dict, config: dict | None) -> dict:
    """A rule mapping with its placeholders filled from config; config None keeps them."""
    if config is None:
        return data
    values = {"jobSelector": config["jobSelector"]}
    values.update({f"thresholds.{k}": number(v) for k, v in config["thresholds"].items()})
    values.update({f"deviceJoins.{k}": v for k, v in config["deviceJoins"].items()})
    if "alert" in data:
        values["runbookUrl"] = config["runbookUrl"] % data["alert"].lower()
        if data["alert"] in config["for"]:
            values["for"] = config["for"][data["alert"]]

    def walk(value):
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        return fill(value, values)

    result = walk(data)
    result["expr"] = tidy(result["expr"])
    if "alert" in data:
        severity = config["customRules"].get(data["alert"], {}).get("severity")
        result["labels"] = {
            **result["labels"],
            **({"severity": severity} if severity else {}),
            **config["additionalRuleLabels"],
        }
    return result


def tidy(expr: str) -> str:
    """An expression whose selector was empty: `{a="b",}` to `{a="b"}`, `name{}` to `name` (the chart too)."""
    return EMPTY_MATCHERS.sub(r"\1", TRAILING_COMMA.sub("}", expr))


def kept(rules: tuple, config: dict | None) -> list:
    """The rules of a group, less the alerts the config disables."""
    disabled = {name for name, off in config["disabled"].items() if off} if config else set()
    return [r for r in rules if not (isinstance(r, Alert) and r.name in disabled)]


def groups(rule_file: RuleFile, config: dict | None) -> list[dict]:
    return [
        {"name": g.name, "rules": [filled(rule_data(r), config) for r in kept(g.rules, config)]}
        for g in rule_file.groups
    ]


# ----------------------------------------------------------------------------- YAML text


def scalar(value: str, indent: int, folded: bool = False) -> str:
    """value as YAML after 'key:', readable: plain where it reads back equal, a block where multi-line."""
    pad = " " * indent
    if "\n" in value:
        return "|\n" + "".join(pad + line + "\n" for line in value.rstrip("\n").split("\n")).rstrip("\n")
    if folded:
        # Never break inside a Prometheus template action: {{ $labels.pod }} stays on one line.
        glued = re.sub(r"\{\{.*?\}\}", lambda m: m.group(0).replace(" ", "\0"), value)
        lines = [
            line.replace("\0", " ")
            for line in textwrap.wrap(
                glued, width=max(40, 110 - indent), break_long_words=False, break_on_hyphens=False
            )
        ]
        if " ".join(lines) == value and len(lines) > 1:
            return ">-\n" + "\n".join(pad + line for line in lines)
    try:
        plain_ok = yaml.safe_load(f"k: {value}") == {"k": value}
    except yaml.YAMLError:
        plain_ok = False
    return value if plain_ok else json.dumps(value, ensure_ascii=False)


def comment_lines(text: str, indent: int) -> list[str]:
    pad = " " * indent
    return [f"{pad}# {line}" for line in textwrap.wrap(text, width=100 - indent)]


def render_file(rule_file: RuleFile, config: dict | None, header: str, before: dict | None = None) -> str:
    """The file's groups as YAML text, in a fixed layout with the table's comments; before: top-level
    keys written ahead of groups (the chart template's default runbook URL)."""
    before = before or {}
    lines = [f"# {line}".rstrip() for line in header.split("\n")]
    lines += [f"{key}: {scalar(value, 2)}" for key, value in before.items()] + ["groups:"]
    table = {g.name: g for g in rule_file.groups}
    for index, group in enumerate(groups(rule_file, config)):
        if index:
            lines.append("")
        lines += [f"  - name: {scalar(group['name'], 6)}", "    rules:"]
        for rule, source in zip(group["rules"], kept(table[group["name"]].rules, config)):
            if "alert" in rule and lines[-1] != "    rules:":
                lines.append("")
            if source.comment:
                lines += comment_lines(source.comment, 6)
            first = True
            for key, value in rule.items():
                lead = "      - " if first else "        "
                first = False
                if isinstance(value, dict):
                    lines.append(f"{lead}{key}:")
                    lines += [f"          {k}: {scalar(v, 12, folded=k == 'description')}" for k, v in value.items()]
                else:
                    lines.append(f"{lead}{key}: {scalar(value, 10)}")
    text = "\n".join(lines) + "\n"
    if yaml.safe_load(text) != {**before, "groups": groups(rule_file, config)}:  # the layout must not change meaning
        raise AssertionError(f"{rule_file.name}: the YAML written does not read back as the rules")
    return text


def outputs(config: dict | None = None, output_dir: str = RULES_DIR, chart: bool = True) -> dict[str, str]:
    """path -> text of every file the generator writes."""
    merged = merge(config)
    result = {}
    for rule_file in FILES:
        header = (
            f"{rule_file.header}\n\nGenerated by dashboards/rules.py; change the rules there (or its config), not here."
        )
        result[os.path.join(output_dir, rule_file.name)] = render_file(rule_file, merged, header)
    if chart:
        for template in dict.fromkeys(f.chart for f in FILES):
            header = (
                f"kvguard's rules with their placeholders kept, for the Helm chart: {CHART_FILLER}\n"
                "fills ${jobSelector}, ${thresholds.NAME}, ${deviceJoins.NAME}, ${for} and ${runbookUrl} from\n"
                ".Values.prometheusRule. Generated by dashboards/rules.py; change the rules there, not here."
            )
            # One groups: list over the files that go into this template, in FILES order.
            groups_ = sum((f.groups for f in FILES if f.chart == template), ())
            before = {}
            if any(isinstance(rule, Alert) for group in groups_ for rule in group.rules):
                header += (
                    "\nrunbookUrl: the default pattern (RUNBOOK_URL), which the chart uses where "
                    "prometheusRule.runbookUrl\nis empty and the release has no Service of its own."
                )
                before = {"runbookUrl": DEFAULTS["runbookUrl"]}
            result[template] = render_file(RuleFile(os.path.basename(template), header, groups_), None, header, before)
    return result


CHART_FILLER = "templates/_prometheusrule.tpl"


def load_config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if isinstance(data, dict) and isinstance(data.get("prometheusRule"), dict):
        data = data["prometheusRule"]  # a chart values file: its prometheusRule block
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a map like the chart's prometheusRule values")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    parser.add_argument("--config", help="a YAML file shaped like the chart's prometheusRule values")
    parser.add_argument("--output-dir", default=RULES_DIR, help="where the rule files go (default: dashboards/rules)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config) if args.config else None
        # The chart's template does not depend on the config: written only with the default output.
        chart = os.path.abspath(args.output_dir) == RULES_DIR and not args.config
        files = outputs(config, args.output_dir, chart=chart)
    except ConfigError as exc:
        print(f"rules.py: {exc}", file=sys.stderr)
        return 2
    if args.check:
        stale = []
        for path, text in files.items():
            try:
                with open(path, encoding="utf-8") as handle:
                    current = handle.read()
            except FileNotFoundError:
                current = None
            if current != text:
                stale.append(path)
        for path in stale:
            print(f"{path} is out of date: run python dashboards/rules.py", file=sys.stderr)
        return 1 if stale else 0
    os.makedirs(args.output_dir, exist_ok=True)
    for path, text in files.items():
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
