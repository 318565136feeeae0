"""``kvguard simulate``: flags, JSON, plot, trace replay, one-line errors."""

import builtins
import json
import pickle
from importlib import resources

import pytest
from helpers import invoke, one_line_error

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
]


def test_json_reports_the_run_with_profile_and_stats():
    # vllm-mindspore 0.5.1's defaults: MindSpore 2.7.1, VMM on; the stock budget serves (story tests).
    result = invoke(*STORY, "--budget", "stock", "--json")
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["oom"] is False and data["requests_finished"] == 4
    assert data["num_blocks"] > 0 and data["kv_cache_bytes"] > 0
    assert data["profile"]["weights_bytes"] == 15_231_233_024
    assert "total_reserved_memory" in data["memory_stats"]
    assert (data["config"]["mindspore_version"], data["config"]["enable_vmm"]) == ("2.7.1", True)
    assert data["config"]["ms_alloc_conf_effective"] == {"enable_vmm": "true"}


def test_vmm_off_makes_the_reserved_budget_fail_placing_the_kv_cache():
    # The seed setting without VMM (tests/sim/test_sim_scenario.py: delta reserved 0 < delta allocated).
    result = invoke(*STORY, "--budget", "reserved", "--ms-alloc-conf", "enable_vmm:False", "--json")
    data = json.loads(result.output)
    assert (data["oom"], data["oom_phase"], data["config"]["enable_vmm"]) == (True, "kv_cache", False)


def test_mindspore_version_selects_the_release_key_spellings():
    data = json.loads(
        invoke(*STORY, "--mindspore-version", "2.4.0", "--ms-alloc-conf", "enable_vmm:False", "--json").output
    )
    assert "total_allocatd_memory" in data["memory_stats"] and "commom_mem_pool_stats" in data["memory_stats"]
    data = json.loads(invoke(*STORY, "--mindspore-version", "2.10", "--json").output)
    assert "total_allocated_memory" in data["memory_stats"] and "common_mem_pool_stats" in data["memory_stats"]


def test_mempool_block_size_sets_the_common_unit():
    data = json.loads(
        invoke(*STORY, "--ms-alloc-conf", "enable_vmm:False", "--mempool-block-size", "4GiB", "--json").output
    )
    common = data["memory_stats"]["commom_mem_pool_stats"]
    # The first common block opens while 30 GiB are free (the weights spill into it): 4 GiB.
    assert [info["block_memory_size"] for info in common["blocks_info"].values()][0] == 4 << 30
    assert data["memory_stats"]["persistent_mem_pool_stats"]["block_unit_size"] == 1 << 30
    assert data["config"]["mempool_block_size_bytes"] == 4 << 30


def test_text_summary_names_the_pool():
    result = invoke(*STORY, "--vllm-mindspore-version", "0.2.0")
    assert "Pool         MindSpore 2.6.0 (pynative), VMM on" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--ms-alloc-conf", "enable_vmm: true, derag_memory_step_freq: -1"],
            "Error: MS_ALLOC_CONF key 'derag_memory_step_freq' is not one MindSpore 2.7.1 reads",
        ),
        (["--mindspore-version", "3.1"], "Error: unknown MindSpore version '3.1'"),
        (["--ms-alloc-conf", "vmm_align_size:3MB"], "Error: MS_ALLOC_CONF vmm_align_size must be a positive multiple"),
    ],
)
def test_bad_mindspore_options_are_one_line_errors(args, message):
    result = invoke(*STORY, *args)
    assert result.exit_code == 64  # an option value the allocator would not take
    assert result.output.startswith(message) and result.output.count("\n") == 1


def test_mindspore_options_with_another_allocator_are_refused():
    result = invoke("simulate", "--allocator", "torch", "--ms-alloc-conf", "enable_vmm:True")
    assert result.exit_code == 64 and "need --allocator mindspore" in result.output


def test_json_same_seed_same_output():
    args = (*STORY, "--budget", "reserved", "--json", "--seed", "3")
    assert invoke(*args).output == invoke(*args).output


def test_reserved_budget_text_summary():
    result = invoke(*STORY, "--budget", "reserved")
    assert result.exit_code == 0
    assert "Outcome      no OOM" in result.output
    assert "4/4 requests finished" in result.output


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.png"
    result = invoke(*STORY, "--plot", str(path))
    assert result.exit_code == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_one_line_error(monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    result = invoke(*STORY, "--plot", "x.png")
    assert result.exit_code == 65
    assert result.output.strip().splitlines() == [
        "Error: --plot needs matplotlib: from the clone: .venv/bin/pip install -e '.[plot]' (a built wheel: "
        "pip install 'kvguard-*.whl[plot]')"
    ]


def test_trace_replay_json(tmp_path):
    path = tmp_path / "snap.pickle"
    path.write_bytes(
        pickle.dumps(
            {
                "device_traces": [
                    [
                        {"action": "alloc", "addr": 1, "size": 12 << 20},
                        {"action": "alloc", "addr": 2, "size": 12 << 20},
                    ]
                ]
            }
        )
    )
    # Another allocator than the snapshot's own: a what-if replay on the given device.
    result = invoke(
        "simulate",
        "--trace",
        str(path),
        "--total-memory",
        "20MiB",
        "--non-allocator-memory",
        "0",
        "--allocator",
        "torch_npu",
        "--json",
    )
    data = json.loads(result.output)
    assert (data["oom"], data["oom_at_step"]) == (True, 1)
    assert data["trace"]["format"] == "torch_snapshot"


def test_unreadable_trace_is_a_one_line_error(tmp_path):
    path = tmp_path / "bad.pickle"
    path.write_bytes(b"\x80\x04garbage")
    result = invoke("simulate", "--trace", str(path))
    assert result.exit_code == 65
    assert len(result.output.strip().splitlines()) == 1
    assert result.output.startswith("Error: cannot read snapshot pickle")


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([{"action": "alloc", "addr": 1, "size": 4096, "stream": "abc"}], "stream is a str, not an integer"),
        ([{"action": ["alloc"], "addr": 1, "size": 4096}], "action is a list, not a string"),
        (
            [{"action": "alloc", "addr": 1, "size": 4096}, {"action": "free_completed", "addr": [1]}],
            "addr is a list, not an integer",
        ),
    ],
)
def test_snapshot_with_odd_field_types_is_a_one_line_error(tmp_path, entries, message):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [entries]}))
    assert one_line_error(invoke("simulate", "--trace", str(path))).endswith(message)


def test_snapshot_whose_device_trace_is_not_a_list_is_a_one_line_error(tmp_path):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [5]}))
    assert one_line_error(invoke("simulate", "--trace", str(path))) == (
        "Error: snapshot device_traces[0] is an int, not a list of entries"
    )


def test_an_unexpected_reader_failure_is_a_one_line_error(tmp_path, monkeypatch):
    # Whatever a reader bug raises on an odd file reaches the user as one line, never a traceback.
    import kvguard.allocators.traces as traces

    def broken(path):
        raise RecursionError("maximum recursion depth exceeded\nmore")

    monkeypatch.setattr(traces, "load_trace", broken)
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 1, "size": 4}]]}))
    assert (
        one_line_error(invoke("simulate", "--trace", str(path), "--allocator", "torch_npu"))
        == f"Error: cannot read trace {path}: RecursionError: maximum recursion depth exceeded"
    )
    import kvguard.allocators.snapshot as snapshot

    def broken_replay(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded\nmore")

    monkeypatch.setattr(snapshot, "replay_snapshot", broken_replay)
    assert one_line_error(invoke("simulate", "--trace", str(path))) == (
        f"Error: cannot replay snapshot {path}: RecursionError: maximum recursion depth exceeded"
    )


def test_plot_into_a_missing_directory_is_refused_before_the_run(tmp_path):
    target = tmp_path / "missing" / "run.png"
    result = invoke(*STORY, "--plot", str(target))
    assert one_line_error(result) == f"Error: --plot: directory {target.parent} does not exist"
    assert "Device" not in result.output  # refused up front: nothing simulated


def test_plot_to_a_name_that_is_not_png_is_refused(tmp_path):
    target = tmp_path / "run.jpg"
    assert one_line_error(invoke(*STORY, "--plot", str(target)), code=64) == (
        f"Error: --plot writes a PNG: give a file name ending in .png, not {str(target)!r}"
    )


def test_plot_that_cannot_be_saved_is_a_one_line_error(tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / ("x" * 300 + ".png")  # the directory exists; the name is too long to create
    result = invoke(*STORY, "--plot", str(target), "--json")
    assert result.exit_code == 65
    assert result.output.strip().splitlines()[-1] == f"Error: cannot write plot {target}: File name too long"
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_attention_heads", "0", "'num_attention_heads' must be a positive integer, got 0"),
        ("hidden_size", "1e400", "'hidden_size' must be a positive integer, got inf"),
    ],
)
def test_odd_model_config_fields_are_one_line_errors(tmp_path, field, value, message):
    # The bundled config with one field overridden, written as JSON text (1e400 has no Python literal).
    bundled = (resources.files("kvguard") / "examples" / "qwen2.5-7b-instruct" / "config.json").read_text()
    path = tmp_path / "config.json"
    path.write_text(bundled.rstrip().rstrip("}") + f', "{field}": {value}}}')  # the last duplicate key wins
    assert json.loads(path.read_text())[field] == json.loads(value)
    result = invoke("simulate", "--model-config", str(path))
    assert one_line_error(result) == f"Error: config field {message}"


def test_missing_model_config_is_a_one_line_error(tmp_path):
    result = invoke("simulate", "--model-config", str(tmp_path / "nope.json"))
    assert result.exit_code == 65
    assert result.output.strip().startswith("Error: model config not found")


def test_progress_bar_is_drawn_on_a_terminal_stderr(tmp_path):
    # stderr is a pseudo-terminal, as in an interactive shell: the serving progress bar is drawn there,
    # and stdout (a file here) gets only the summary.
    import os
    import subprocess
    import sys

    master, slave = os.openpty()
    out = tmp_path / "stdout.txt"
    with open(out, "wb") as stdout:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvguard", *STORY, "--budget", "reserved"],
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=slave,
        )
    os.close(slave)
    drawn = b""
    try:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(master)
        process.wait(timeout=120)
    assert process.returncode == 0, drawn
    text = drawn.decode("utf-8", "replace")
    assert "serving" in text and "100%" in text
    assert "serving" not in out.read_text() and "Outcome      no OOM" in out.read_text()


def test_no_progress_bar_when_stderr_is_not_a_terminal(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "kvguard", *STORY, "--budget", "reserved"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stderr == ""


# --vllm-version: the release's own defaults (kvguard.vllm.eras), the expandable segments its platform sets.
RELEASE_RUN = ("simulate", "--total-memory", "64GiB", "--requests", "8", "--json")


def _sim(*args):
    result = invoke(*RELEASE_RUN, *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_a_vllm_ascend_release_runs_on_torch_npu_with_its_utilization_and_128_token_blocks():
    data = _sim("--vllm-version", "vllm-ascend:0.23.0.post1")
    assert data["allocator"] == "torch_npu"
    assert data["profile"]["gpu_memory_utilization"] == 0.92  # vLLM 0.23 config/cache.py:67
    stock = data["estimate"]["budgets"]["stock"]
    assert stock["num_tokens"] == stock["num_blocks"] * 128  # vllm-ascend platform.py block size 128
    # Given options still win.
    given = _sim(
        "--vllm-version", "vllm-ascend:0.23.0.post1", "--gpu-memory-utilization", "0.8", "--allocator", "torch"
    )
    assert (given["allocator"], given["profile"]["gpu_memory_utilization"]) == ("torch", 0.8)


def test_torch_npus_expandable_segments_follow_the_releases_platform():
    """vllm-ascend turns expandable segments on from 0.14 (platform.py 0.14.0rc1:404-420; 0.13.0 does not): the
    simulated profile run's reserved increase is the one with them on, unless --alloc-conf says otherwise."""

    def reserved(*args):
        return _sim(*args)["profile"]["peak_reserved_increase_bytes"]

    on = reserved("--allocator", "torch_npu", "--alloc-conf", "expandable_segments:True")
    off = reserved("--allocator", "torch_npu", "--alloc-conf", "expandable_segments:False")
    assert on != off
    assert reserved("--vllm-version", "vllm-ascend:0.14.0", "--gpu-memory-utilization", "0.9") == on
    assert reserved("--vllm-version", "vllm-ascend:0.13.0", "--gpu-memory-utilization", "0.9") == off
    assert reserved("--vllm-version", "vllm-ascend:0.23.0", "--alloc-conf", "expandable_segments:False") == off


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--vllm-version", "vllm-ascend:0.8.5"), "falls between kvguard's era rows"),
        (("--vllm-version", "not-a-release"), "not a release"),
        (("--vllm-version", "vllm-mindspore:0.2.0", "--vllm-mindspore-version", "0.5.1"), "0.2.0's launcher"),
    ],
)
def test_a_release_it_cannot_place_is_one_line(args, words):
    assert words in one_line_error(invoke("simulate", *args), code=64)


# A named device is simulated with the total its runtime reports, as plan takes it (kvguard.plan.devices):
# a "64 GB" 910B prints "total memory: 65452113920" (tests/data/logs/real/r39.log, vllm-ascend PR #2139), an
# H100 "total capacity of 79.11 GiB" (vllm-project/vllm#27508).
@pytest.mark.parametrize(
    ("device", "total"), [("910B", 65_452_113_920), ("h100", round(79.11 * (1 << 30))), ("48GiB", 48 << 30)]
)
def test_a_named_device_is_simulated_with_its_runtime_total(device, total):
    result = invoke("simulate", "--device", device, "--requests", "2", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["device"]["total_bytes"] == total


def test_a_named_device_with_its_runtime_total_in_the_text_report():
    result = invoke("simulate", "--device", "910B", "--requests", "2")
    assert result.exit_code == 0, result.output
    assert "Device       60.96 GiB" in result.output


def test_device_and_total_memory_together_are_a_usage_error():
    assert "--device or --total-memory" in one_line_error(
        invoke("simulate", "--device", "H100", "--total-memory", "80GiB"), code=64
    )


def test_an_unknown_device_is_a_usage_error_naming_the_known_ones():
    assert "910B4, 910B" in one_line_error(invoke("simulate", "--device", "TPU-v9"), code=64)
