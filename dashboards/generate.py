#!/usr/bin/env python3
"""Generate dashboards/kvguard.json, the kvguard Grafana dashboard, with grafana-foundation-sdk.

    python dashboards/generate.py            write dashboards/kvguard.json
    python dashboards/generate.py --check    exit 1 if the committed file differs from the code

The metric names are the contract of docs/metrics.md. Every query filters on the dashboard's
variables; `$__rate_interval` is the range of every rate. The rules the dashboard is held to
(grafana/dashboard-linter's) are tests in tests/deploy/test_dashboard_lint.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from grafana_foundation_sdk.builders import common as common_builder, dashboard as dash, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common, dashboard as model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rules  # noqa: E402 - the rules' config: the panels' thresholds are the alerts' own

OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kvguard.json")

UID = "kvguard"
TITLE = "kvguard: allocator memory and KV-cache guard"
# The SDK's "next" build (pyproject pins it) carries Grafana 12's classic dashboard model and writes
# its schemaVersion, 41; the default build pip calls "latest" is Grafana 10.1's (schema 36).
SCHEMA_VERSION = 41

DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")

# Matchers, by the labels a family carries (docs/metrics.md). job and instance come from the
# scrape; instance tells hosts apart outside Kubernetes, where pod and namespace are empty.
# Sidecar-level families (sources, spool) carry no pod labels of their own, but a PodMonitor or
# ServiceMonitor adds namespace and pod target labels; where none are added, ".*" still matches.
# cluster: a target label many multi-cluster setups add (absent, ".*" still matches).
SIDECAR = 'cluster=~"$cluster", job=~"$job", instance=~"$instance", namespace=~"$namespace", pod=~"$pod"'
DEVICE = SIDECAR + ', device=~"$device"'
RANK = DEVICE + ', model_name=~"$model_name", engine_id=~"$engine_id", rank=~"$rank"'
# One engine across its pods, grouped as the namespace_engine:… recording rules group it. The panels
# aggregate the rank series themselves, so the pod, instance and rank variables still select.
PER_ENGINE = "namespace, model_name, engine_id, engine"
ENGINE_LEGEND = "{{engine_id}} engine {{engine}} ({{model_name}})"

RANK_LEGEND = "{{pod}} rank {{rank}} ({{device}})"
PER_DEVICE = "instance, namespace, pod, device"
PER_RANK = "instance, namespace, pod, rank, device"

GUARD_STATES = {"0": ("ok", "green"), "1": ("warning", "orange"), "2": ("critical", "red")}


# ----------------------------------------------------------------------------- variables


def datasource_variable() -> dash.DatasourceVariable:
    return (
        dash.DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .description("The Prometheus that scrapes the kvguard sidecars.")
    )


def query_variable(name: str, label: str, query: str, all_value: str, description: str) -> dash.QueryVariable:
    return (
        dash.QueryVariable(name)
        .label(label)
        .query(query)
        .datasource(DATASOURCE)
        .description(description)
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_CASE_INSENSITIVE_ASC)
        .multi(True)
        .include_all(True)
        .all_value(all_value)
        .current(model.VariableOption(selected=True, text="All", value="$__all"))
    )


def variables() -> list:
    # Rank- and device-level families both carry namespace, pod and device.
    any_family = '{__name__=~"kvguard_snapshot_age_seconds|kvguard_device_total_bytes", %s}'
    return [
        datasource_variable(),
        query_variable(
            "cluster",
            "Cluster",
            "label_values(kvguard_build_info, cluster)",
            ".*",
            "Cluster, where the scrape adds a cluster label (empty where it does not).",
        ),
        query_variable(
            "job",
            "Job",
            'label_values(kvguard_build_info{cluster=~"$cluster"}, job)',
            ".+",
            "Scrape job of the kvguard sidecars.",
        ),
        query_variable(
            "namespace",
            "Namespace",
            "label_values(%s, namespace)" % (any_family % 'cluster=~"$cluster", job=~"$job"'),
            ".*",
            "Kubernetes namespace of the serving pods (empty outside Kubernetes).",
        ),
        query_variable(
            "model_name",
            "Model",
            'label_values(kvguard_snapshot_age_seconds{cluster=~"$cluster", job=~"$job", '
            'namespace=~"$namespace"}, model_name)',
            ".*",
            "Served model name, as vLLM labels its own series (empty where unknown).",
        ),
        query_variable(
            "engine_id",
            "Engine",
            'label_values(kvguard_snapshot_age_seconds{cluster=~"$cluster", job=~"$job", '
            'namespace=~"$namespace", model_name=~"$model_name"}, engine_id)',
            ".*",
            "Engine across its pods (engine_id: the LeaderWorkerSet group, else the pod); the "
            "per-engine panels group by it.",
        ),
        query_variable(
            "pod",
            "Pod",
            "label_values(%s, pod)" % (any_family % 'job=~"$job", namespace=~"$namespace"'),
            ".*",
            "Serving pod with its kvguard sidecar (a multi-node engine spans several).",
        ),
        query_variable(
            "instance",
            "Instance",
            'label_values(kvguard_build_info{job=~"$job"}, instance)',
            ".+",
            "Scrape target: one kvguard sidecar (the only host identity outside Kubernetes).",
        ),
        query_variable(
            "rank",
            "Rank",
            'label_values(kvguard_snapshot_age_seconds{job=~"$job", instance=~"$instance", '
            'namespace=~"$namespace", pod=~"$pod", model_name=~"$model_name", engine_id=~"$engine_id"}, rank)',
            ".*",
            "Serving rank (tensor / pipeline parallel worker).",
        ),
        query_variable(
            "device",
            "Device",
            "label_values(%s, device)"
            % (any_family % 'job=~"$job", instance=~"$instance", namespace=~"$namespace", pod=~"$pod"'),
            ".*",
            "Device as the source names it (npu:0, cuda:3, host).",
        ),
    ]


# ----------------------------------------------------------------------------- panels


def target(expr: str, legend: str, ref_id: str, instant: bool = False) -> prometheus.Dataquery:
    query = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref_id).datasource(DATASOURCE)
    return query.instant() if instant else query.range()


def with_targets(panel, targets: list[tuple[str, str]], instant: bool = False):
    for index, (expr, legend) in enumerate(targets):
        panel = panel.with_target(target(expr, legend, chr(ord("A") + index), instant))
    return panel


def series_panel(
    title: str,
    description: str,
    unit: str,
    targets: list[tuple[str, str]],
    width: int = 12,
    height: int = 8,
    minimum: float | None = None,
    maximum: float | None = None,
    fill: int = 10,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .span(width)
        .height(height)
        .fill_opacity(fill)
        .line_width(1)
        .span_nulls(False)
        .legend(
            common_builder.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["lastNotNull", "max"])
        )
        .tooltip(
            common_builder.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING)
        )
    )
    if minimum is not None:
        panel = panel.min(minimum)
    if maximum is not None:
        panel = panel.max(maximum)
    return with_targets(panel, targets)


def stat_panel(
    title: str,
    description: str,
    unit: str,
    targets: list[tuple[str, str]],
    width: int = 4,
    height: int = 4,
    thresholds: list[tuple[float | None, str]] | None = None,
    mappings: dict[str, tuple[str, str]] | None = None,
    decimals: int | None = None,
    text_mode: common.BigValueTextMode = common.BigValueTextMode.AUTO,
) -> stat.Panel:
    panel = (
        stat.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .span(width)
        .height(height)
        .reduce_options(common_builder.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .graph_mode(common.BigValueGraphMode.NONE)
        .text_mode(text_mode)
    )
    if thresholds:
        panel = panel.thresholds(
            dash.ThresholdsConfig()
            .mode(model.ThresholdsMode.ABSOLUTE)
            .steps([model.Threshold(value=value, color=color) for value, color in thresholds])
        )
    if mappings:
        panel = panel.mappings(
            [
                model.ValueMap(
                    options={
                        value: model.ValueMappingResult(text=text, color=color, index=index)
                        for index, (value, (text, color)) in enumerate(mappings.items())
                    }
                )
            ]
        )
    if decimals is not None:
        panel = panel.decimals(decimals)
    return with_targets(panel, targets, instant=True)


GUARD_THRESHOLDS = [(None, "green"), (1, "orange"), (2, "red")]


def percent(ratio: float) -> str:
    return f"{ratio * 100:g}%"


def overview_row(board: dash.Dashboard, config: dict) -> None:
    thresholds = config["thresholds"]
    headroom_ratio, fragmentation_ratio = thresholds["headroomRatio"], thresholds["fragmentationRatio"]
    board.with_row(dash.Row("Overview"))
    board.with_panel(
        stat_panel(
            "Engine state",
            "Per serving engine, across all its pods (a multi-node engine is one): its worst rank's guard "
            "state (recording rule namespace_engine:kvguard_guard_severity:max; KVGuardOOMRiskCritical fires "
            "on it).",
            "none",
            [(f"max by ({PER_ENGINE}) (kvguard_guard_severity{{{RANK}}})", ENGINE_LEGEND)],
            width=8,
            thresholds=GUARD_THRESHOLDS,
            mappings=GUARD_STATES,
        )
    )
    board.with_panel(
        stat_panel(
            "Engine headroom (weakest rank)",
            "Per serving engine: its weakest rank's headroom as a share of that rank's device "
            "(namespace_engine:kvguard_guard_headroom_ratio:min). Orange below the KVGuardHeadroomLow "
            f"threshold ({percent(headroom_ratio)} of capacity, from the rules' config), red below zero: the "
            "projected peak does not fit.",
            "percentunit",
            [
                (
                    f"min by ({PER_ENGINE}) "
                    f"(kvguard_guard_headroom_bytes{{{RANK}}} / kvguard_guard_capacity_bytes{{{RANK}}})",
                    ENGINE_LEGEND,
                )
            ],
            width=8,
            thresholds=[(None, "red"), (0, "orange"), (headroom_ratio, "green")],
            decimals=1,
        )
    )
    board.with_panel(
        stat_panel(
            "Engine KV-cache blocks",
            "Per serving engine: the KV-cache blocks it holds, counted once however many pods and ranks it "
            "spans (vLLM gives every rank the smallest block count of its workers; "
            "namespace_engine:kvguard_kv_cache_allocated_blocks:min).",
            "short",
            [(f"min by ({PER_ENGINE}) (kvguard_kv_cache_allocated_blocks{{{RANK}}})", ENGINE_LEGEND)],
            width=8,
        )
    )
    board.with_panel(
        stat_panel(
            "Guard state per rank",
            'The kvguard guard\'s current state of every selected rank: ok, warning or critical. "Why" beside '
            "it names the reasons; /guard on the sidecar gives them as sentences.",
            "none",
            [(f"max by ({PER_RANK}) (kvguard_guard_severity{{{RANK}}})", RANK_LEGEND)],
            width=12,
            height=6,
            thresholds=GUARD_THRESHOLDS,
            mappings=GUARD_STATES,
        )
    )
    board.with_panel(
        stat_panel(
            "Why: guard reasons per rank",
            "Every reason the guard reports for a selected rank now (kvguard_guard_reason == 1): "
            "projected_peak_exceeds_capacity, alloc_retries_climbing, ooms_climbing, overcommitted, "
            "live_reserved_exceeds_projection, snapshot_stale, no_profile, profile_fields_unknown. "
            "Empty: every rank is ok.",
            "none",
            [(f"max by ({PER_RANK}, reason) (kvguard_guard_reason{{{RANK}}} == 1)", RANK_LEGEND + ": {{reason}}")],
            width=12,
            height=6,
            thresholds=[(None, "orange")],
            text_mode=common.BigValueTextMode.NAME,
        )
    )
    board.with_panel(
        stat_panel(
            "Budget-time verdict per rank",
            "The guard's verdict when vLLM fixed its KV budget, before the KV cache existed (the KV tensors "
            "placed by the allocator's own rules): critical means the KV cache's allocation itself was "
            "predicted to fail. Only ranks whose vLLM plugin judged at budget time.",
            "none",
            [(f"max by ({PER_RANK}) (kvguard_guard_budget_severity{{{RANK}}})", RANK_LEGEND)],
            width=12,
            thresholds=GUARD_THRESHOLDS,
            mappings=GUARD_STATES,
        )
    )
    board.with_panel(
        stat_panel(
            "Budget-time reasons",
            "Every reason of the budget-time verdict (kvguard_guard_budget_reason == 1), e.g. "
            "kv_cache_placement_fails.",
            "none",
            [
                (
                    f"max by ({PER_RANK}, reason) (kvguard_guard_budget_reason{{{RANK}}} == 1)",
                    RANK_LEGEND + ": {{reason}}",
                )
            ],
            width=12,
            thresholds=[(None, "orange")],
            text_mode=common.BigValueTextMode.NAME,
        )
    )
    board.with_panel(
        stat_panel(
            "Worst guard state",
            "The worst kvguard guard state over the selected ranks: ok, warning (KV cache overcommitted, "
            "snapshot stale, no profile) or critical (projected peak exceeds the device, allocator retries "
            "or OOMs climbing).",
            "none",
            [(f"max(kvguard_guard_severity{{{RANK}}})", "worst state")],
            thresholds=GUARD_THRESHOLDS,
            mappings=GUARD_STATES,
        )
    )
    board.with_panel(
        stat_panel(
            "Least headroom",
            "The smallest headroom over the selected ranks, as a share of the rank's device: capacity minus "
            "the projected peak (weights + KV cache + reserved activation peak + non-torch). Orange below "
            f"KVGuardHeadroomLow's {percent(headroom_ratio)}, red below zero: the peak does not fit.",
            "percentunit",
            [
                (
                    f"min(kvguard_guard_headroom_bytes{{{RANK}}} / kvguard_guard_capacity_bytes{{{RANK}}})",
                    "least headroom",
                )
            ],
            thresholds=[(None, "red"), (0, "orange"), (headroom_ratio, "green")],
            decimals=1,
        )
    )
    board.with_panel(
        stat_panel(
            "Largest overcommit",
            "How far vLLM's stock KV-cache budget exceeds the reserved-aware budget, on the worst selected "
            "rank. Non-zero: the allocator's fragmentation is paid from the slack gpu_memory_utilization leaves.",
            "bytes",
            [(f"max(kvguard_kv_cache_overcommit_bytes{{{RANK}}})", "largest overcommit")],
            thresholds=[(None, "green"), (1, "orange")],
        )
    )
    board.with_panel(
        stat_panel(
            "Highest fragmentation ratio",
            "Fragmentation (reserved minus allocated) over reserved bytes, on the worst selected rank. Red "
            f"above KVGuardFragmentationHigh's ratio ({percent(fragmentation_ratio)}; the alert also needs "
            "the bytes over its threshold).",
            "percentunit",
            [(f"max(kvguard_allocator_fragmentation_ratio{{{RANK}}})", "highest ratio")],
            thresholds=[(None, "green"), (fragmentation_ratio, "red")],
            decimals=1,
        )
    )
    board.with_panel(
        stat_panel(
            "Stale snapshots",
            "Selected ranks whose latest probe snapshot is older than the sidecar's --stale-after.",
            "none",
            [(f"sum(kvguard_snapshot_stale{{{RANK}}})", "stale ranks")],
            thresholds=[(None, "green"), (1, "orange")],
        )
    )
    board.with_panel(
        stat_panel(
            "Sources down",
            "Device-level sources (nvml, npu-smi, host, ...) and vLLM metrics reads whose last read failed "
            "or ran past --read-timeout, over the selected sidecars.",
            "none",
            [(f"sum(1 - kvguard_source_up{{{SIDECAR}}})", "sources down")],
            thresholds=[(None, "green"), (1, "red")],
        )
    )


def memory_row(board: dash.Dashboard, config: dict) -> None:
    board.with_row(dash.Row("Device memory"))
    board.with_panel(
        series_panel(
            "Allocator memory per device",
            "Per device: bytes the framework allocator handed to tensors (allocated), bytes it holds from the "
            "device (reserved), the capacity the guard measures against (the startup profile's total memory) "
            "and the device total as the device-level source reports it.",
            "bytes",
            [
                (
                    f"sum by ({PER_DEVICE}) (kvguard_allocator_allocated_bytes{{{RANK}}})",
                    "{{pod}} {{device}} allocated",
                ),
                (f"sum by ({PER_DEVICE}) (kvguard_allocator_reserved_bytes{{{RANK}}})", "{{pod}} {{device}} reserved"),
                (f"max by ({PER_DEVICE}) (kvguard_guard_capacity_bytes{{{RANK}}})", "{{pod}} {{device}} capacity"),
                (f"max by ({PER_DEVICE}) (kvguard_device_total_bytes{{{DEVICE}}})", "{{pod}} {{device}} device total"),
            ],
            fill=0,
            minimum=0,
        )
    )
    board.with_panel(
        series_panel(
            "Device memory (driver view)",
            "What the device-level source (nvml, npu-smi, host) sees: memory used by all processes, and by each "
            "serving process (reserved plus context overhead), against the device total.",
            "bytes",
            [
                (f"max by ({PER_DEVICE}) (kvguard_device_used_bytes{{{DEVICE}}})", "{{pod}} {{device}} used"),
                (
                    f"max by ({PER_DEVICE}, pid) (kvguard_device_process_used_bytes{{{DEVICE}}})",
                    "{{pod}} {{device}} pid {{pid}}",
                ),
                (f"max by ({PER_DEVICE}) (kvguard_device_total_bytes{{{DEVICE}}})", "{{pod}} {{device}} total"),
            ],
            fill=0,
            minimum=0,
        )
    )


def fragmentation_row(board: dash.Dashboard, config: dict) -> None:
    thresholds = config["thresholds"]
    board.with_row(dash.Row("Fragmentation"))
    board.with_panel(
        series_panel(
            "Fragmentation bytes",
            "Per rank: reserved minus allocated, memory the allocator holds that tensors cannot use, and the part "
            "of it locked in split segments that cannot be released (torch inactive_split_bytes).",
            "bytes",
            [
                (f"kvguard_allocator_fragmentation_bytes{{{RANK}}}", RANK_LEGEND + " fragmentation"),
                (f"kvguard_allocator_inactive_split_bytes{{{RANK}}}", RANK_LEGEND + " inactive split"),
            ],
            minimum=0,
        )
    )
    board.with_panel(
        series_panel(
            "Fragmentation ratio",
            "Per rank: fragmentation bytes over reserved bytes. The KVGuardFragmentationHigh alert fires above "
            f"{percent(thresholds['fragmentationRatio'])} when more than "
            f"{thresholds['fragmentationBytes'] / 2**30:g} GiB is fragmented.",
            "percentunit",
            [(f"kvguard_allocator_fragmentation_ratio{{{RANK}}}", RANK_LEGEND)],
            minimum=0,
            maximum=1,
        )
    )


def kv_cache_row(board: dash.Dashboard, config: dict) -> None:
    board.with_row(dash.Row("KV cache"))
    board.with_panel(
        series_panel(
            "KV cache against the stock and reserved budgets",
            "Per rank: the KV cache the engine allocated, vLLM's stock budget (sized from the allocated "
            "activation peak) and the reserved-aware budget (sized from the reserved peak). A KV cache above "
            "the reserved budget is overcommitted.",
            "bytes",
            [
                (f"kvguard_kv_cache_allocated_bytes{{{RANK}}}", RANK_LEGEND + " allocated"),
                (f"kvguard_kv_cache_budget_bytes{{{RANK}}}", RANK_LEGEND + " {{budget}} budget"),
            ],
            fill=0,
        )
    )
    board.with_panel(
        series_panel(
            "KV-cache blocks per engine",
            "KV-cache blocks per serving engine, across its pods: vLLM gives every worker the smallest block "
            "count over its workers, so the engine holds its weakest rank's count; the largest rank shows what "
            "the others could hold.",
            "short",
            [
                (
                    f"min by ({PER_ENGINE}) (kvguard_kv_cache_allocated_blocks{{{RANK}}})",
                    ENGINE_LEGEND + " min over ranks",
                ),
                (
                    f"max by ({PER_ENGINE}) (kvguard_kv_cache_allocated_blocks{{{RANK}}})",
                    ENGINE_LEGEND + " max over ranks",
                ),
            ],
            fill=0,
        )
    )
    board.with_panel(
        series_panel(
            "vLLM KV-cache usage",
            "Fraction of KV-cache blocks in use, from vLLM's vllm:kv_cache_usage_perc. Only when the sidecar "
            "reads vLLM's /metrics (--vllm-metrics-url).",
            "percentunit",
            [(f"kvguard_kv_cache_usage_ratio{{{RANK}}}", RANK_LEGEND)],
            width=24,
            minimum=0,
            maximum=1,
        )
    )


def guard_row(board: dash.Dashboard, config: dict) -> None:
    board.with_row(dash.Row("Guard"))
    board.with_panel(
        series_panel(
            "Overcommit",
            "Per rank: how far vLLM's stock KV-cache budget exceeds the reserved-aware budget (0 when it does not).",
            "bytes",
            [(f"kvguard_kv_cache_overcommit_bytes{{{RANK}}}", RANK_LEGEND)],
            width=8,
            minimum=0,
        )
    )
    board.with_panel(
        series_panel(
            "Headroom",
            "Per rank: device capacity minus the projected peak. Below zero the projected peak does not fit; "
            f"KVGuardHeadroomLow fires under {percent(config['thresholds']['headroomRatio'])} of capacity on an "
            "engine's weakest rank.",
            "bytes",
            [(f"kvguard_guard_headroom_bytes{{{RANK}}}", RANK_LEGEND)],
            width=8,
        )
    )
    board.with_panel(
        series_panel(
            "Projected peak against capacity",
            "Per rank: the guard's projected device peak (weights + KV cache allocated + reserved activation "
            "peak + non-torch) against the capacity it must fit in.",
            "bytes",
            [
                (f"kvguard_guard_projected_peak_bytes{{{RANK}}}", RANK_LEGEND + " projected peak"),
                (f"kvguard_guard_capacity_bytes{{{RANK}}}", RANK_LEGEND + " capacity"),
            ],
            width=8,
            fill=0,
            minimum=0,
        )
    )


def profile_row(board: dash.Dashboard, config: dict) -> None:
    board.with_row(dash.Row("Startup profile"))
    board.with_panel(
        series_panel(
            "Startup profile per rank",
            "What vLLM's profiling run measured on each rank, as the budget formulas read it: the weights, the "
            "activation peak's increase in allocated and in reserved memory (their gap is the fragmentation "
            "vLLM's stock budget does not see), and the memory outside the allocator.",
            "bytes",
            [
                (f"kvguard_profile_weights_bytes{{{RANK}}}", RANK_LEGEND + " weights"),
                (f"kvguard_profile_activation_peak_bytes{{{RANK}}}", RANK_LEGEND + " activation peak ({{measure}})"),
                (f"kvguard_profile_non_torch_bytes{{{RANK}}}", RANK_LEGEND + " non-torch"),
            ],
            width=16,
            fill=0,
        )
    )
    board.with_panel(
        stat_panel(
            "gpu_memory_utilization per rank",
            "vLLM's gpu_memory_utilization on each rank, from its startup profile.",
            "percentunit",
            [(f"max by ({PER_RANK}) (kvguard_profile_gpu_memory_utilization_ratio{{{RANK}}})", RANK_LEGEND)],
            width=8,
            height=8,
            decimals=2,
        )
    )


def allocator_row(board: dash.Dashboard, config: dict) -> None:
    board.with_row(dash.Row("Allocator retries and OOMs"))
    board.with_panel(
        series_panel(
            "Allocator retries",
            "Per rank, per second: allocations that succeeded only after the allocator flushed its cache and "
            "retried. Sustained retries mean the rank is at the device's limit.",
            "ops",
            [
                (
                    f"sum by ({PER_RANK}) (rate(kvguard_allocator_alloc_retries_total{{{RANK}}}[$__rate_interval]))",
                    RANK_LEGEND,
                )
            ],
            minimum=0,
        )
    )
    board.with_panel(
        series_panel(
            "Allocator OOMs",
            "Per rank, per second: out-of-memory errors the framework allocator raised.",
            "ops",
            [(f"sum by ({PER_RANK}) (rate(kvguard_allocator_ooms_total{{{RANK}}}[$__rate_interval]))", RANK_LEGEND)],
            minimum=0,
        )
    )


def probe_row(board: dash.Dashboard, config: dict) -> None:
    board.with_row(dash.Row("Probes and sources"))
    board.with_panel(
        series_panel(
            "Snapshot age",
            "Per rank: seconds since the in-process probe wrote the rank's latest snapshot. Past the sidecar's "
            "--stale-after the rank is stale and the guard judges it on old counters.",
            "s",
            [(f"kvguard_snapshot_age_seconds{{{RANK}}}", RANK_LEGEND)],
            width=8,
            fill=0,
            minimum=0,
        )
    )
    board.with_panel(
        series_panel(
            "Probe errors",
            "Per rank, per second: samples the in-process probe failed to take or write.",
            "ops",
            [(f"sum by ({PER_RANK}) (rate(kvguard_probe_errors_total{{{RANK}}}[$__rate_interval]))", RANK_LEGEND)],
            width=8,
            minimum=0,
        )
    )
    board.with_panel(
        series_panel(
            "Spool snapshots and skipped files",
            "Snapshots the sidecar read from the spool at its last scrape, and spool files it skipped, by reason.",
            "short",
            [
                (f"sum by (instance) (kvguard_spool_snapshots{{{SIDECAR}}})", "{{instance}} snapshots"),
                (
                    f"sum by (instance, reason) (kvguard_spool_skipped_files{{{SIDECAR}}})",
                    "{{instance}} skipped: {{reason}}",
                ),
            ],
            width=8,
            fill=0,
            minimum=0,
        )
    )
    board.with_panel(
        stat_panel(
            "Source health",
            "Per sidecar and source: up when the source's last read succeeded within --read-timeout.",
            "none",
            [(f"min by (instance, source) (kvguard_source_up{{{SIDECAR}}})", "{{instance}} {{source}}")],
            width=8,
            height=8,
            thresholds=[(None, "red"), (1, "green")],
            mappings={"0": ("down", "red"), "1": ("up", "green")},
        )
    )
    board.with_panel(
        series_panel(
            "Source read duration and cache age",
            "Per source: how long its last completed read took, and the age of the value a scrape is served "
            "(reads run in the background; a scrape never waits on them).",
            "s",
            [
                (
                    f"max by (instance, source) (kvguard_source_read_duration_seconds{{{SIDECAR}}})",
                    "{{instance}} {{source}} read duration",
                ),
                (
                    f"max by (instance, source) (kvguard_source_cache_age_seconds{{{SIDECAR}}})",
                    "{{instance}} {{source}} cache age",
                ),
            ],
            width=8,
            fill=0,
            minimum=0,
        )
    )
    board.with_panel(
        series_panel(
            "Source errors",
            "Per source, per second: reads that failed or ran past --read-timeout.",
            "ops",
            [
                (
                    f"sum by (instance, source) (rate(kvguard_source_errors_total{{{SIDECAR}}}[$__rate_interval]))",
                    "{{instance}} {{source}}",
                )
            ],
            width=8,
            minimum=0,
        )
    )


# ----------------------------------------------------------------------------- dashboard


def alerts_annotation() -> dash.AnnotationQuery:
    """Marks on every time series where a kvguard alert fired (Prometheus' ALERTS series)."""
    return (
        dash.AnnotationQuery()
        .name("kvguard alerts")
        .datasource(DATASOURCE)
        .enable(True)
        .hide(False)
        .icon_color("red")
        .expr('ALERTS{alertname=~"KVGuard.*", alertstate="firing", job=~"$job", namespace=~"$namespace"}')
    )


def build(config: dict | None = None) -> model.Dashboard:
    config = rules.merge(config)
    board = (
        dash.Dashboard(TITLE)
        .uid(UID)
        .description(
            "kvguard: the framework allocator's allocated vs reserved memory per rank, "
            "fragmentation, vLLM's KV-cache budget against the reserved-aware one, the OOM "
            "guard's verdict, and the health of kvguard's probes and sources."
        )
        .tags(["kvguard", "vllm", "llm-serving", "memory"])
        .readonly()  # generated: change dashboards/generate.py, not the dashboard in Grafana
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("browser")
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        # The runbook every sidecar serves (kvguard/runbook.md at /runbook), on the instance selected.
        .link(
            dash.DashboardLink("Runbook")
            .type(model.DashboardLinkType.LINK)
            .url("http://${instance}/runbook")
            .target_blank(True)
            .icon("doc")
        )
        .annotation(alerts_annotation())
        .variables(variables())
    )
    for row in (
        overview_row,
        memory_row,
        fragmentation_row,
        kv_cache_row,
        guard_row,
        profile_row,
        allocator_row,
        probe_row,
    ):
        row(board, config)
    built = board.build()
    if built.schema_version != SCHEMA_VERSION:
        raise SystemExit(
            f"grafana-foundation-sdk writes schemaVersion {built.schema_version}, not "
            f"{SCHEMA_VERSION}: install the build pyproject.toml pins"
        )
    for panel_id, panel in enumerate(built.panels or [], start=1):
        panel.id_val = panel_id
    return built


def render(config: dict | None = None) -> str:
    return json.dumps(build(config), cls=JSONEncoder, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed file instead of writing")
    parser.add_argument("--output", default=OUTPUT, help="where to write (default: dashboards/kvguard.json)")
    parser.add_argument(
        "--config",
        help="the rules' config (a YAML file shaped like the chart's prometheusRule "
        "values, as dashboards/rules.py --config reads it): the panels' thresholds follow it",
    )
    args = parser.parse_args(argv)
    try:
        rendered = render(rules.load_config(args.config) if args.config else None)
    except rules.ConfigError as exc:
        print(f"generate.py: {exc}", file=sys.stderr)
        return 2
    if args.check:
        try:
            with open(args.output, encoding="utf-8") as handle:
                current = handle.read()
        except FileNotFoundError:
            current = None
        if current != rendered:
            print(f"{args.output} is out of date: run python dashboards/generate.py", file=sys.stderr)
            return 1
        return 0
    with open(args.output, "w", encoding="utf-8") as handle:
        handle.write(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
