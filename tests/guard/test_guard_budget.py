"""The budget-time verdict: the KV tensors placed by the allocator's own rules before the KV cache
exists (kvguard.guard.judge.judge_at_budget), in the simulator, from a real rank's counters, in the
snapshot and on /guard and /metrics."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from click.testing import CliRunner
from conftest import ROOT
from sidecar_fixtures import http_get, snapshot

from kvguard.budget.estimator import kv_cache_tensor_bytes
from kvguard.cli import main
from kvguard.guard.at_budget import allocator_from_counters, counters_of
from kvguard.guard.judge import BUDGET, CRITICAL, KV_PLACEMENT_FAILS, BudgetInput, Verdict, judge_at_budget
from kvguard.sim.guarded import BudgetWatch, record_from_scenario, run_guarded
from kvguard.sim.scenario import ScenarioConfig, ServingScenario
from kvguard.spool.schema import Snapshot
from kvguard.vllm.eras import kv_tensor_style

GIB = 1 << 30
QWEN3 = os.path.join(ROOT, "tests", "data", "configs", "qwen3-0.6b", "config.json")
QWEN25 = os.path.join(ROOT, "exporter", "kvguard", "examples", "qwen2.5-7b-instruct", "config.json")


def vmm(on: bool) -> dict:
    """MindSpore's VMM as the scenario takes it: MS_ALLOC_CONF once the pool is modelled per release."""
    fields = {f.name for f in dataclasses.fields(ScenarioConfig)}
    return {"ms_alloc_conf": f"enable_vmm:{on}"} if "ms_alloc_conf" in fields else {"enable_vmm": on}


def scenario(model=QWEN3, device_gib=12, util=0.9, allocator="mindspore", enable_vmm=False, **extra):
    with open(model) as handle:
        config = json.load(handle)
    if allocator == "mindspore":
        extra.update(vmm(enable_vmm))
    return ServingScenario(
        ScenarioConfig(
            model_config=config,
            device_memory_bytes=device_gib * GIB,
            gpu_memory_utilization=util,
            allocator=allocator,
            requests=6,
            **extra,
        )
    )


def test_the_kv_placement_oom_the_end_of_startup_verdict_missed_is_critical_at_budget():
    # The issue's case: Qwen3-0.6B on 12 GiB, MindSpore's pool: the KV cache allocation itself fails.
    run = run_guarded(scenario())
    assert run.result.oom and run.result.oom_phase == "kv_cache"
    assert run.at_budget.phase == BUDGET and run.at_budget.state == CRITICAL
    assert run.at_budget.reason_codes[0] == KV_PLACEMENT_FAILS
    assert run.caught_before_oom
    # What the pool will place before it fails is what the scenario placed (tensor by tensor).
    placed = run.at_budget.kv_tensors_placed
    assert 0 < placed < run.at_budget.kv_tensors
    assert run.result.memory_stats["total_allocated_memory"] - run.result.profile.weights_bytes == sum(
        kv_cache_tensor_bytes(run.result.kv_layout, run.result.num_blocks, "per_layer_k_v")[:placed]
    )


@pytest.mark.parametrize(
    ("allocator", "device_gib", "util", "extra"),
    [
        ("mindspore", 16, 0.75, {}),
        ("mindspore", 24, 0.8, {}),
        ("torch", 16, 0.9, {}),
        ("torch_npu", 24, 0.9, {}),
        ("torch", 16, 0.9, {"expandable_segments": True}),
    ],
)
def test_the_predicted_counters_are_the_scenarios_after_its_kv_cache(allocator, device_gib, util, extra):
    sc = scenario(device_gib=device_gib, util=util, allocator=allocator, **extra)
    watch = BudgetWatch(sc)
    sc.startup()
    assert not sc.oom
    model = watch.build()
    for size in sc.kv_tensor_sizes(sc.num_blocks):
        model.malloc(size)
    # The replay is the allocator's state: placing the era's tensors leaves the counters the run has.
    assert counters_of(model) == record_from_scenario(sc, "sim:0", "sim")


def test_watching_the_budget_changes_nothing_in_the_run():
    plain, watched = scenario(device_gib=16, util=0.85), scenario(device_gib=16, util=0.85)
    BudgetWatch(watched)
    assert plain.run().to_dict() == watched.run().to_dict()


def test_tensor_styles_follow_the_era():
    sc = scenario(model=QWEN25)
    layout = sc.kv_layout
    per_layer = 10 * layout.page_bytes_per_layer
    assert kv_cache_tensor_bytes(layout, 10, "per_layer") == (per_layer,) * 28
    assert kv_cache_tensor_bytes(layout, 10, "per_layer_k_v") == (per_layer // 2, per_layer // 2) * 28
    assert kv_cache_tensor_bytes(layout, 10, "one_backing") == (per_layer * 28,)
    assert kv_tensor_style("vllm:0.11.0") == "per_layer"
    assert kv_tensor_style("vllm:0.27.0") == "per_layer"
    assert kv_tensor_style("vllm:0.34.0") == "one_backing"
    assert kv_tensor_style("vllm-mindspore:0.5.0") == "per_layer_k_v"
    with pytest.raises(ValueError):
        kv_cache_tensor_bytes(layout, 10, "per_head")


CASES = [
    (model, gib, util, alloc, vmm)
    for model in (QWEN3, QWEN25)
    for gib in (12, 16, 32, 64)
    for util in (0.85, 0.9, 0.95)
    for alloc, vmm in (("mindspore", False), ("mindspore", True), ("torch", False), ("torch_npu", False))
]


def test_from_a_real_ranks_counters_the_verdict_errs_only_to_the_safe_side():
    """A real rank gives counters, not the allocator's history: the model built from them never
    calls a run fine that the exact replay calls critical."""
    judged = agree = 0
    for model, gib, util, alloc, vmm in CASES:
        sc = scenario(model=model, device_gib=gib, util=util, allocator=alloc, enable_vmm=vmm)
        watch = BudgetWatch(sc)
        sc.startup()
        exact = watch.verdict()
        if exact is None:
            continue
        counters = counters_of(watch.build())
        tensors = sc.kv_tensor_sizes(sc.num_blocks)
        rebuilt = judge_at_budget(
            BudgetInput(
                sc.profile, tensors, lambda: allocator_from_counters(alloc, counters, enable_vmm=vmm), counters_of
            )
        )
        judged += 1
        agree += rebuilt.state == exact.state
        if exact.state == CRITICAL:
            assert rebuilt.state == CRITICAL, (model, gib, util, alloc, vmm)
    assert judged >= 40 and agree >= 0.9 * judged


def test_simulate_json_reports_guard_at_budget_beside_guard():
    result = CliRunner().invoke(
        main,
        [
            "simulate",
            "--json",
            "--requests",
            "4",
            "--model-config",
            QWEN3,
            "--total-memory",
            "12GiB",
            "--allocator",
            "torch_npu",
            "--gpu-memory-utilization",
            "0.95",
        ],
    )
    data = json.loads(result.output)
    assert data["oom_phase"] == "kv_cache"
    assert data["guard_at_budget"]["phase"] == "budget" and data["guard_at_budget"]["state"] == "critical"
    assert data["guard"]["phase"] == "running"


def test_a_budget_verdict_round_trips_through_a_snapshot_and_refuses_junk():
    run = run_guarded(scenario())
    snap = dataclasses.replace(snapshot(), budget_verdict=run.at_budget)
    assert Snapshot.from_dict(json.loads(json.dumps(snap.to_dict()))).budget_verdict == run.at_budget
    data = run.at_budget.to_dict()
    for bad in (
        {**data, "state": "ok"},
        {**data, "reasons": [{"code": "nope", "message": "x"}]},
        {**data, "headroom_bytes": "1"},
        {**data, "phase": "later"},
    ):
        with pytest.raises(ValueError):
            Verdict.from_dict(bad)


def test_guard_and_metrics_show_the_budget_verdict_and_it_stands_until_the_kv_cache_exists(serve):
    run = run_guarded(scenario())
    before_kv = dataclasses.replace(snapshot(rank=0, pid=1), budget_verdict=run.at_budget, kv_cache=None)
    after_kv = dataclasses.replace(snapshot(rank=1, device="npu:1", pid=2), budget_verdict=run.at_budget)
    server = serve(before_kv, after_kv)
    ranks = {r["rank"]: r for r in json.loads(http_get(server, "/guard")[2])["ranks"]}
    metrics = http_get(server, "/metrics")[2].decode()
    assert ranks["0"]["state"] == "critical" and ranks["0"]["phase"] == "budget"
    assert ranks["1"]["phase"] == "running" and ranks["1"]["at_budget"]["state"] == "critical"
    assert [
        line
        for line in metrics.splitlines()
        if line.startswith("kvguard_guard_budget_severity{") and 'rank="0"' in line
    ][0].endswith(" 2.0")
    assert any(
        line.startswith("kvguard_guard_budget_reason{")
        and 'reason="kv_cache_placement_fails"' in line
        and line.endswith(" 1.0")
        for line in metrics.splitlines()
    )
    import subprocess

    from monitoring import promtool

    lint = subprocess.run([promtool(), "check", "metrics"], input=metrics.encode(), capture_output=True, timeout=60)
    assert (lint.returncode, lint.stdout + lint.stderr) == (0, b"")


def test_check_says_when_the_budget_time_verdict_stands_for_a_rank(tmp_path):
    from sidecar_fixtures import write

    run = run_guarded(scenario())
    write(tmp_path, dataclasses.replace(snapshot(), budget_verdict=run.at_budget, kv_cache=None))
    result = CliRunner().invoke(main, ["check", "--spool-dir", str(tmp_path)])
    assert result.exit_code == 2  # critical
    first = result.output.splitlines()[0]
    assert first.startswith("CRITICAL") and "(budget-time verdict: the KV cache is not allocated yet)" in first
    assert "kv_cache_placement_fails" in result.output
