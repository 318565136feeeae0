"""The simulate plot's x-axis names the phases: weights, profile, KV cache, then serving steps."""

from __future__ import annotations

import pytest

from kvguard.budget.model_config import bundled_model_config_path, load_model_config
from kvguard.sim.scenario import ScenarioConfig, run_scenario

pytest.importorskip("matplotlib")

from kvguard.sim.plot import scenario_figure  # noqa: E402

GIB = 1 << 30


def result(**overrides):
    config = ScenarioConfig(
        model_config=load_model_config(bundled_model_config_path()), device_memory_bytes=32 * GIB, requests=8
    )
    return run_scenario(config, **overrides)


def ticks(fig):
    import matplotlib.pyplot as plt

    axis = fig.axes[-1]
    plt.close(fig)  # the artists stay readable
    return [(tick, label.get_text()) for tick, label in zip(axis.get_xticks(), axis.get_xticklabels())]


def test_the_x_axis_names_the_startup_phases_then_counts_serving_steps():
    run = result()
    fig = scenario_figure([run])
    marks = ticks(fig)
    labels = [label for _, label in marks]
    assert labels[:3] == ["weights", "profile", "KV cache"]
    steps = [(x, label) for x, label in marks[3:]]
    assert steps and all(label == str(int(x)) for x, label in steps)  # serving step n sits at x = n
    assert steps[0][1] == "0" and int(steps[-1][1]) <= run.steps - 1
    positions = [x for x, _ in marks]
    assert positions == sorted(positions) and positions[2] < 0 <= positions[3]  # startup left of step 0
    # The startup phases have room: at least a twentieth of the axis each, however long serving ran.
    assert positions[1] - positions[0] >= (run.steps - 1) / 20
    assert fig.axes[-1].get_xlabel() == "startup phase (weights, profile, KV cache), then serving step"
    # The plotted points: one per timeline record, the startup ones at the phase ticks.
    allocated = fig.axes[-1].get_lines()[0]
    assert list(allocated.get_xdata()[:3]) == positions[:3] and len(allocated.get_xdata()) == len(run.timeline)


def test_a_run_that_runs_out_in_the_profile_has_only_its_phases():
    run = result(device_memory_bytes=15 * GIB)  # the weights fit, the profile forward does not
    assert run.oom_phase == "profile"
    assert [label for _, label in ticks(scenario_figure([run]))] == ["weights", "profile"]
