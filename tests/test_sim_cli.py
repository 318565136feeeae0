"""``kvguard simulate``: flags, JSON, plot, trace replay, one-line errors."""

import builtins
import json
import pickle

import pytest
from click.testing import CliRunner

from kvguard.cli import main

STORY = ["simulate", "--device-memory", "32GiB", "--allocator", "mindspore", "--gpu-memory-utilization", "0.9",
         "--requests", "4", "--long-fraction", "1"]


def invoke(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_json_reports_the_stock_oom_with_profile_and_stats():
    result = invoke(*STORY, "--budget", "stock", "--json")
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["oom"] is True and data["oom_at_step"] == 0
    assert data["num_blocks"] > 0 and data["kv_cache_bytes"] > 0
    assert data["profile"]["weights_bytes"] == 15_231_233_024
    assert "total_reserved_memory" in data["memory_stats"]


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
    result = CliRunner().invoke(main, [*STORY, "--plot", "x.png"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == ["Error: --plot needs matplotlib: pip install 'kvguard[plot]'"]


def test_trace_replay_json(tmp_path):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [[
        {"action": "alloc", "addr": 1, "size": 12 << 20}, {"action": "alloc", "addr": 2, "size": 12 << 20},
    ]]}))
    result = invoke("simulate", "--trace", str(path), "--device-memory", "20MiB", "--non-allocator-memory", "0",
                    "--json")
    data = json.loads(result.output)
    assert (data["oom"], data["oom_at_step"]) == (True, 1)
    assert data["trace"]["format"] == "torch_snapshot"


def test_unreadable_trace_is_a_one_line_error(tmp_path):
    path = tmp_path / "bad.pickle"
    path.write_bytes(b"\x80\x04garbage")
    result = CliRunner().invoke(main, ["simulate", "--trace", str(path)])
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1
    assert result.output.startswith("Error: cannot read snapshot pickle")


def test_missing_model_config_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(main, ["simulate", "--model-config", str(tmp_path / "nope.json")])
    assert result.exit_code == 1
    assert result.output.strip().startswith("Error: model config not found")
