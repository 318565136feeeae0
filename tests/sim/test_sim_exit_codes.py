"""``kvguard simulate --fail-on-oom``: exit 2 (critical) after the report when the run ends in an OOM; the
other codes are the table's (64 usage, 65 bad input: kvguard.cli.exits)."""

from __future__ import annotations

import json
import os
import pickle

import pytest
from click.testing import CliRunner
from conftest import ROOT

from kvguard.cli import main
from kvguard.cli.simulate import EXIT_OOM

# MindSpore's pool with VMM off (MS_ALLOC_CONF=enable_vmm:False) and vLLM's stock budget runs out of
# memory at the first serving step of Mistral-Nemo at 0.9 on a 32 GiB device: the pool may use only
# 15/16 of the memory free at its start, less 10 MiB, and the 1 GiB blocks' tails take the rest.
STORY = [
    "simulate",
    "--total-memory",
    "32GiB",
    "--allocator",
    "mindspore",
    "--gpu-memory-utilization",
    "0.9",
    "--requests",
    "4",
    "--long-fraction",
    "1",
    "--ms-alloc-conf",
    "enable_vmm:False",
    "--model-config",
    os.path.join(ROOT, "tests", "data", "configs", "mistral-nemo-instruct-2407"),
]


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_the_oom_code_is_the_table_s_critical():
    assert EXIT_OOM == 2


@pytest.mark.parametrize("as_json", [False, True])
def test_a_scenario_that_runs_out_exits_2_with_the_flag_and_0_without(as_json):
    extra = ["--json"] if as_json else []
    without = run(*STORY, "--budget", "stock", *extra)
    with_flag = run(*STORY, "--budget", "stock", *extra, "--fail-on-oom")
    assert (without.exit_code, with_flag.exit_code) == (0, EXIT_OOM)
    assert with_flag.output == without.output  # the full report first, then the exit code
    if as_json:
        assert json.loads(with_flag.output)["oom"] is True
    else:
        assert "Outcome      OOM during serving step 0" in with_flag.output


def test_a_scenario_that_serves_exits_0_with_the_flag():
    # The same run with VMM on (MindSpore's default on a 910B) serves under either budget.
    result = run(*STORY, "--budget", "reserved", "--ms-alloc-conf", "enable_vmm:True", "--fail-on-oom")
    assert result.exit_code == 0 and "Outcome      no OOM" in result.output


def snapshot(tmp_path, entries):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [entries]}))
    return str(path)


@pytest.mark.parametrize("as_json", [False, True])
def test_a_what_if_trace_replay_that_runs_out_exits_2(tmp_path, as_json):
    trace = snapshot(
        tmp_path, [{"action": "alloc", "addr": 1, "size": 12 << 20}, {"action": "alloc", "addr": 2, "size": 12 << 20}]
    )
    args = [
        "simulate",
        "--trace",
        trace,
        "--total-memory",
        "20MiB",
        "--non-allocator-memory",
        "0",
        "--allocator",
        "torch_npu",
        *(["--json"] if as_json else []),
    ]
    assert run(*args).exit_code == 0
    result = run(*args, "--fail-on-oom")
    assert result.exit_code == EXIT_OOM
    assert (json.loads(result.output)["oom"] is True) if as_json else "Outcome      OOM at event 1" in result.output
    roomy = run(
        "simulate",
        "--trace",
        trace,
        "--total-memory",
        "64MiB",
        "--non-allocator-memory",
        "0",
        "--allocator",
        "torch_npu",
        "--fail-on-oom",
    )
    assert roomy.exit_code == 0 and "no OOM" in roomy.output


def test_an_exact_snapshot_replay_with_a_recorded_oom_exits_2(tmp_path):
    trace = snapshot(
        tmp_path,
        [
            {"action": "alloc", "addr": 1 << 30, "size": 12 << 20, "stream": 0},
            {"action": "oom", "addr": 0, "size": 64 << 30, "stream": 0},
        ],
    )
    args = ["simulate", "--trace", trace, "--json"]
    plain = run(*args)
    assert plain.exit_code == 0 and json.loads(plain.output)["oom"] is True
    assert run(*args, "--fail-on-oom").exit_code == EXIT_OOM
    clean = snapshot(tmp_path, [{"action": "alloc", "addr": 1 << 30, "size": 12 << 20, "stream": 0}])
    assert run("simulate", "--trace", clean, "--fail-on-oom").exit_code == 0


def test_a_search_that_finds_no_utilization_exits_2():
    # 15 GiB holds the weights but not the profile forward: every utilization runs out of memory.
    args = ["simulate", "--total-memory", "15GiB", "--requests", "2", "--search-utilization"]
    assert run(*args).exit_code == 0
    result = run(*args, "--fail-on-oom")
    assert result.exit_code == EXIT_OOM and "no utilization serves without an OOM" in result.output
    json_result = run(*args, "--json", "--fail-on-oom")
    assert json_result.exit_code == EXIT_OOM
    assert json.loads(json_result.output)["search"]["gpu_memory_utilization"] is None


def test_a_search_that_finds_one_exits_0():
    result = run(*STORY, "--budget", "reserved", "--search-utilization", "--fail-on-oom")
    assert result.exit_code == 0 and "highest utilization without an OOM" in result.output


def test_usage_is_64_and_bad_input_65_never_the_oom_code():
    assert CliRunner().invoke(main, ["simulate", "--seed", "1", "--seed", "2", "--fail-on-oom"]).exit_code == 64
    assert CliRunner().invoke(main, ["simulate", "--fail-on-oom=yes"]).exit_code == 64
    assert CliRunner().invoke(main, ["simulate", "--trace", "/nonexistent.csv", "--fail-on-oom"]).exit_code == 65


def test_help_lists_the_exit_codes():
    # As click wraps it: at blanks, and after a hyphen ("exit-" / "codes.md").
    text = " ".join(CliRunner().invoke(main, ["simulate", "--help"]).output.split())
    text = text.replace("exit- codes", "exit-codes")
    assert (
        "Exit codes: 0 ok; 2 an OOM, with --fail-on-oom; 64 usage error; 65 bad input; 70 internal error; "
        "130 interrupted; 141 output closed (docs/reference/exit-codes.md)."
    ) in text
