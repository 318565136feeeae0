"""The plain op stream (``kvguard simulate --ops``): its format, its replay, and recording one. What replays a
stream (on a model built through ``kvguard.allocators.native``, the CLI's too) runs once per engine: the Python
model and the C engine (the ``engine`` fixture, tests/support/alloc_engines.py)."""

from __future__ import annotations

import json
import os

import pytest
from alloc_engines import engine  # noqa: F401  (the fixture the replays use)
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from kvguard.allocators import native
from kvguard.allocators.device import Device
from kvguard.allocators.ops import Op, OpsError, Recorder, parse_ops, read_ops, replay_ops, write_ops
from kvguard.budget.model_config import bundled_model_config_path, load_model_config
from kvguard.cli import main
from kvguard.cli.simulate import EXIT_OOM
from kvguard.sim.scenario import ScenarioConfig, ServingScenario, make_allocator

GIB = 1 << 30
MIB = 1 << 20


def lines(*records) -> list[str]:
    return [json.dumps(record) for record in records]


def test_a_free_names_the_malloc_by_its_position_among_the_ops_blank_lines_not_counted():
    ops = parse_ops(
        [
            "",
            json.dumps({"op": "malloc", "size": 10}),
            "   ",
            json.dumps({"op": "free", "index": 0}),
            json.dumps({"op": "empty_cache"}),
        ]
    )
    assert ops == [Op("malloc", size=10), Op("free", index=0), Op("empty_cache")]


@pytest.mark.parametrize(
    "records, message",
    [
        ([{"op": "free", "index": 0}], "op 0: free index must name an earlier malloc"),
        (
            [{"op": "malloc", "size": 1}, {"op": "empty_cache"}, {"op": "free", "index": 1}],
            "op 2: free index must name an earlier malloc",
        ),
        (
            [{"op": "malloc", "size": 1}, {"op": "free", "index": 0}, {"op": "free", "index": 0}],
            "op 2: frees malloc 0 a second time",
        ),
        ([{"op": "malloc", "sz": 1}], "op 0: unknown key(s) for malloc: sz"),
        ([{"op": "alloc", "size": 1}], "op 0: unknown op 'alloc'"),
        ([{"op": "malloc", "size": -1}], "op 0: malloc size must be an integer"),
        ([{"op": "malloc", "size": 1.5}], "op 0: malloc size must be an integer"),
        ([{"op": "malloc", "size": True}], "op 0: malloc size must be an integer"),
        ([{"op": "malloc", "size": 1, "persistent": "yes"}], "op 0: persistent must be true or false"),
        ([[1, 2]], "op 0: expected a JSON object"),
    ],
)
def test_a_malformed_op_is_one_line_naming_it(records, message):
    with pytest.raises(OpsError) as raised:
        parse_ops(lines(*records))
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)


def test_a_line_that_is_not_json_is_refused_by_position():
    with pytest.raises(OpsError, match=r"^op 1: not JSON"):
        parse_ops([json.dumps({"op": "empty_cache"}), "{malloc"])


def test_a_huge_line_is_refused_without_reading_it_whole(tmp_path):
    path = tmp_path / "ops.jsonl"
    path.write_text('{"op": "malloc", "size": ' + "1" * 100_000 + "}\n")
    with pytest.raises(OpsError, match="longer than 4096 characters"):
        read_ops(str(path))


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=60), st.binary(max_size=60).map(lambda b: b.decode("latin-1"))), max_size=8))
def test_garbage_gives_ops_or_one_line_error(garbage):
    try:
        parse_ops(garbage)
    except OpsError as exc:
        assert "\n" not in str(exc)


@pytest.mark.usefixtures("engine")
def test_freeing_a_malloc_that_ran_out_of_memory_does_nothing():
    allocator = native.caching_allocator(Device(1 * GIB))
    assert native.engine(allocator) == os.environ[native.ENV]
    ops = parse_ops(
        lines(
            {"op": "malloc", "size": 100 * MIB},
            {"op": "malloc", "size": 2 * GIB},
            {"op": "free", "index": 1},
            {"op": "free", "index": 0},
        )
    )
    records = list(replay_ops(allocator, ops))
    assert [record["oom"] for record in records] == [False, True, False, False]
    assert records[1]["address"] is None
    assert records[2]["allocated_bytes"] == 100 * MIB  # the OOMed malloc's free released nothing
    assert records[3]["allocated_bytes"] == 0
    assert records[3]["peak_allocated_bytes"] == 100 * MIB


@pytest.mark.usefixtures("engine")  # the scenario's allocator and the fresh one (make_allocator), both on the engine
def test_a_recorded_serving_run_replays_to_the_same_memory_at_every_op():
    """Recorder: what a scenario asked of its allocator, replayed through a fresh one, lands the same way."""
    config = ScenarioConfig(
        model_config=load_model_config(bundled_model_config_path()),
        device_memory_bytes=24 * GIB,
        allocator="torch",
        requests=8,
        seed=1,
    )
    scenario = ServingScenario(config)
    assert native.engine(scenario.allocator) == os.environ[native.ENV]
    recorder = Recorder(scenario.allocator)
    seen: list[tuple[int, int]] = []
    inner_malloc, inner_free = recorder.malloc, recorder.free

    def malloc(size, persistent=False):
        try:
            return inner_malloc(size, persistent)
        finally:
            seen.append((recorder.allocated_bytes, recorder.reserved_bytes))

    def free(addr):
        inner_free(addr)
        seen.append((recorder.allocated_bytes, recorder.reserved_bytes))

    recorder.malloc, recorder.free = malloc, free
    scenario.allocator = recorder
    scenario.startup()
    scenario.run()
    assert len(recorder.ops) > 1000
    fresh = make_allocator(config, Device(config.device_memory_bytes, config.resolved_non_allocator_bytes))
    replayed = [
        (r["allocated_bytes"], r["reserved_bytes"])
        for r in replay_ops(fresh, recorder.ops)
        if r["kind"] != "empty_cache"
    ]
    assert replayed == seen


def test_write_ops_round_trips(tmp_path):
    ops = [Op("malloc", size=5, persistent=True), Op("malloc", size=0), Op("free", index=0), Op("empty_cache")]
    path = tmp_path / "ops.jsonl"
    with open(path, "w") as handle:
        write_ops(ops, handle)
    assert read_ops(str(path)) == ops


# ---------------------------------------------------------------------------- the CLI


def write(tmp_path, *records) -> str:
    path = tmp_path / "ops.jsonl"
    path.write_text("\n".join(lines(*records)) + "\n")
    return str(path)


@pytest.mark.usefixtures("engine")
@pytest.mark.parametrize("allocator", ["torch", "torch_npu", "mindspore"])
def test_simulate_ops_writes_one_line_per_op_and_fails_on_oom_when_asked(tmp_path, allocator):
    ops = write(
        tmp_path,
        {"op": "malloc", "size": 64 * MIB},
        {"op": "malloc", "size": 64 * GIB},
        {"op": "free", "index": 0},
        {"op": "empty_cache"},
    )
    log = tmp_path / "replay.jsonl"
    result = CliRunner().invoke(
        main,
        [
            "simulate",
            "--ops",
            ops,
            "--allocator",
            allocator,
            "--total-memory",
            "16GiB",
            "--replay-log",
            str(log),
            "--json",
            "--fail-on-oom",
        ],
    )
    assert result.exit_code == EXIT_OOM, result.output
    summary = json.loads(result.output)
    assert (summary["ops"]["count"], summary["ooms"], summary["first_oom_op"]) == (4, 1, 1)
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert [step["oom"] for step in steps] == [False, True, False, False]
    assert steps[0]["allocated_bytes"] >= 64 * MIB and steps[2]["allocated_bytes"] == 0
    assert {"reserved_bytes", "allocated_bytes", "peak_allocated_bytes", "oom"} <= set(steps[0])
    assert steps[3]["reserved_bytes"] <= steps[2]["reserved_bytes"]


def test_simulate_ops_refuses_a_bad_stream_in_one_line(tmp_path):
    ops = write(tmp_path, {"op": "free", "index": 3})
    result = CliRunner().invoke(main, ["simulate", "--ops", ops])
    assert result.exit_code == 65  # bad input
    assert result.output.strip().splitlines() == ["Error: op 0: free index must name an earlier malloc, got 3"]


def test_simulate_ops_does_not_mix_with_a_trace_or_a_search(tmp_path):
    ops = write(tmp_path, {"op": "empty_cache"})
    for extra in (["--trace", ops], ["--search-utilization"], ["--non-allocator-memory", "1GiB"]):
        result = CliRunner().invoke(main, ["simulate", "--ops", ops, *extra])
        assert result.exit_code == 64 and result.output.startswith("Error: "), (extra, result.output)  # usage


@pytest.mark.usefixtures("engine")
def test_simulate_alloc_conf_reaches_the_model_as_the_variant_parses_it(tmp_path):
    """torch_npu with expandable segments maps whole 20 MiB pages; without, a large segment is rounded to 2 MiB."""
    ops = write(tmp_path, {"op": "malloc", "size": 30 * MIB})
    runs = {}
    for conf in (None, "expandable_segments:True"):
        log = tmp_path / f"{conf}.jsonl"
        args = ["simulate", "--ops", ops, "--allocator", "torch_npu", "--replay-log", str(log)]
        result = CliRunner().invoke(main, args + (["--alloc-conf", conf] if conf else []))
        assert result.exit_code == 0, result.output
        runs[conf] = json.loads(log.read_text())["reserved_bytes"]
    assert runs == {None: 32 * MIB, "expandable_segments:True": 40 * MIB}


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--allocator", "torch_npu", "--alloc-conf", "expandable_segment:True"],
            "Error: alloc conf: unknown key 'expandable_segment' for PYTORCH_NPU_ALLOC_CONF",
        ),
        (
            ["--allocator", "mindspore", "--alloc-conf", "expandable_segments:True"],
            "Error: --alloc-conf is for --allocator torch and torch_npu; MindSpore's pool takes --ms-alloc-conf",
        ),
    ],
)
def test_simulate_alloc_conf_refuses_what_the_allocator_would_not_take(tmp_path, args, message):
    ops = write(tmp_path, {"op": "empty_cache"})
    result = CliRunner().invoke(main, ["simulate", "--ops", ops, *args])
    assert result.exit_code == 64 and result.output.strip() == message, result.output
