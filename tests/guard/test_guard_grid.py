"""The guard over a grid of simulated vLLM runs (bench/guard_grid.py --quick): every serving OOM
is called critical before it happens, with MindSpore's counters alone (no credit for idle memory: they
cannot tell what the next peak may reuse) and in exact mode (the pool's own lists, KVGUARD_MINDSPORE_DUMP);
in exact mode false criticals stay at or under 10%. Each run ends with the peak burst (``--peak-burst``,
bench/results/guard-grids-peak-burst-rule-2026-12-07.md): the batch vLLM budgets for, which the guard projects,
formed by real requests, so the truth reaches what the guard speaks of."""

from __future__ import annotations

import os
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import guard_grid  # noqa: E402

_MEASURED: dict[str, dict] = {}


def measured(mode: str) -> dict:
    if mode not in _MEASURED:
        guard_grid.EXACT_MODE[0] = mode == "exact"
        guard_grid.PEAK_BURST[0] = True
        try:
            result = guard_grid.measure(guard_grid.QUICK, jobs=min(os.cpu_count() or 1, 8))
        finally:
            guard_grid.EXACT_MODE[0] = guard_grid.PEAK_BURST[0] = False
        print(f"\n{mode}:\n" + guard_grid.report(result))
        _MEASURED[mode] = result
    return _MEASURED[mode]


@pytest.fixture(params=["counters", "exact"])
def figures(request):
    return measured(request.param)


def test_the_grid_has_serving_ooms_and_clean_runs_to_judge(figures):
    assert figures["serving_ooms"] >= 10 and figures["no_oom"] >= 50


def test_every_serving_oom_is_critical_before_it_happens(figures):
    assert figures["missed"] == []


def test_every_serving_oom_is_already_critical_at_the_end_of_startup(figures):
    assert figures["serving_ooms_critical_at_startup"] == figures["serving_ooms"]


def test_every_failed_kv_cache_allocation_is_critical_at_budget_time_before_it(figures):
    assert figures["startup_ooms_critical_at_budget"] == figures["startup_ooms"]


def test_false_criticals_on_runs_that_never_oom_stay_at_or_under_ten_percent_in_exact_mode():
    # The counters alone take the sound bound (no credit for idle memory): their false criticals are reported
    # (bench/results), not bounded.
    figures = measured("exact")
    assert figures["no_oom_critical_ever"] <= 0.10 * figures["no_oom"], figures["false_critical"]
