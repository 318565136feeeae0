"""The guard over a grid of simulated vLLM runs (bench/guard_grid.py --quick): every serving OOM
is called critical before it happens, and false criticals stay at or under 10%."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import guard_grid  # noqa: E402


@pytest.fixture(scope="module")
def figures():
    result = guard_grid.measure(guard_grid.QUICK, jobs=min(os.cpu_count() or 1, 8))
    print("\n" + guard_grid.report(result))
    return result


def test_the_grid_has_serving_ooms_and_clean_runs_to_judge(figures):
    assert figures["serving_ooms"] >= 10 and figures["no_oom"] >= 50


def test_every_serving_oom_is_critical_before_it_happens(figures):
    assert figures["missed"] == []


def test_every_serving_oom_is_already_critical_at_the_end_of_startup(figures):
    assert figures["serving_ooms_critical_at_startup"] == figures["serving_ooms"]


def test_every_failed_kv_cache_allocation_is_critical_at_budget_time_before_it(figures):
    assert figures["startup_ooms_critical_at_budget"] == figures["startup_ooms"]


def test_false_criticals_on_runs_that_never_oom_stay_at_or_under_ten_percent(figures):
    assert figures["no_oom_critical_ever"] <= 0.10 * figures["no_oom"], figures["false_critical"]
