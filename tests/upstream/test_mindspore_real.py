"""kvguard against vllm-mindspore as it ships: release 0.5.1 runs its real code (its patches of vLLM 0.11.0, its
AscendPlatform, its ms_memory_profiling) and vLLM 0.11.0's Worker and engine-core KV sizing on MindSpore 2.7.1
(CPU) and a fake NPU, with kvguard's plugin loaded by vLLM's own load_general_plugins (tests/upstream/mindspore_real:
only MindSpore's memory bindings, torch.cuda's memory calls as msadapter answers them, and msadapter itself are
stand-ins).

The scenario is the issue's (tests/upstream/ascend_real's ASCEND_SCENARIO): a 64 GiB device, 14 GiB of weights, a
profile
run of +4 GiB allocated and +5.5 GiB reserved, 300 MiB of non-torch memory left behind. What the release returned
is the oracle. The logs it printed are kept in tests/data/logs/mindspore-real/ (save_logs.py).
Environment: `python3 tests/upstream/mindspore_real/envs.py setup` (./dev.sh test runs it).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from ascend_real.harness import ASCEND_SCENARIO
from mindspore_real import envs
from mindspore_real.harness import RELEASE, run_engine
from test_ascend_real import kvguard_budget

from kvguard.budget.estimator import reserved_kv_cache_bytes, stock_kv_cache_bytes
from kvguard.spool.io import read_spool
from kvguard.vllm.eras import era_for
from kvguard.vllm.log import read_startup_log

GIB = 1 << 30
MIB = 1 << 20
LOGS = pathlib.Path(__file__).resolve().parents[1] / "data" / "logs" / "mindspore-real"
_runs: dict = {}


def _require_env():
    """Skip when the environment is not set up here; under CI (CI=true) that is a failure."""
    if envs.env_python(RELEASE) is None:
        message = f"{RELEASE}: environment not set up (python3 tests/upstream/mindspore_real/envs.py setup)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


def run(tmp_path_factory, budget: str = "stock", **scenario):
    """One startup with kvguard's plugin; (the engine's result, the rank's snapshot)."""
    _require_env()
    key = (budget, tuple(sorted(scenario.items())))
    if key not in _runs:
        spool = tmp_path_factory.mktemp("spool-mindspore")
        result = run_engine(RELEASE, scenario, env={"KVGUARD_SPOOL_DIR": str(spool), "KVGUARD_BUDGET": budget})
        snapshots = read_spool(str(spool)).snapshots
        assert len(snapshots) == 1, f"the plugin wrote {len(snapshots)} snapshots"
        _runs[key] = (result, snapshots[0])
        _spools[key] = spool
    return _runs[key]


_spools: dict = {}


def test_the_environment_is_set_up():
    _require_env()
    assert envs.env_python(RELEASE) is not None


def test_the_row_names_the_wheel_the_tests_run():
    assert era_for(RELEASE).checked_against == "0.5.1"


def test_the_probe_reads_mindspore_on_the_workers_thread_at_its_step_boundary(tmp_path_factory):
    """On vllm-mindspore the probe reads MindSpore's pool only on the engine's thread (kvguard.probe): the
    plugin has wrapped vLLM's Worker.execute_model, the step boundary, which vllm-mindspore 0.5.1 leaves as
    vLLM's (it patches GPUModelRunner.execute_model and Worker.init_device, vllm_mindspore/__init__.py:327-328,
    434), and the rank's snapshot was read there, in engine-step mode."""
    result, snap = run(tmp_path_factory)
    assert result["execute_model_wrapped"] is True
    assert snap.probe.sampling == "engine-step"
    assert snap.probe.samples_total >= 1 and snap.probe.engine_thread_seconds_total > 0


def test_it_runs_the_releases_own_platform_and_memory_profiling(tmp_path_factory):
    """vllm-mindspore 0.5.1 on vLLM 0.11.0 and MindSpore 2.7.1: its AscendPlatform (128-token blocks,
    platforms/ascend.py:92-94) and its ms_memory_profiling in place of vLLM's (__init__.py:120), whose torch peak
    is the memory_reserved() increase at the end of the profile run (utils.py:465-475): +5.5 GiB, not the
    allocated +4 GiB."""
    result, snap = run(tmp_path_factory)
    assert (result["engine_version"], result["vllm_version"], result["mindspore_version"]) == (
        RELEASE,
        "0.11.0",
        "2.7.1",
    )
    assert result["config"]["platform"] == "AscendPlatform"
    assert result["memory_profiling"] == "vllm_mindspore.utils.ms_memory_profiling"
    assert result["profile"]["torch_peak_increase"] == 5 * GIB + 512 * MIB
    assert result["config"]["block_size"] == era_for(RELEASE).default_block_size == 128
    assert result["config"]["gpu_memory_utilization"] == era_for(RELEASE).default_gpu_memory_utilization
    # MindSpore's VMM, as env_setup sets it when the operator has not (scripts.py:52 @ 0.5.1).
    assert "enable_vmm: true" in result["ms_alloc_conf"] and era_for(RELEASE).vmm_default is True
    assert snap.profile.vllm_version == RELEASE
    assert snap.profile.formula == era_for(RELEASE).formula


def test_the_recorded_profile_reproduces_the_engines_budget_to_the_byte(tmp_path_factory):
    result, snap = run(tmp_path_factory)
    assert stock_kv_cache_bytes(snap.profile) == result["returned_available_bytes"]
    assert snap.profile.peak_reserved_increase_bytes == result["profile"]["torch_peak_increase"]
    assert snap.profile.peak_allocated_increase_bytes is None


def test_kvguard_budget_from_the_flags_gives_the_engines_figure(tmp_path_factory):
    """The flags as `kvguard budget --help` describes them, from the scenario's device figures: the
    memory_reserved() increase of the profile run (4 GiB and the 1.5 GiB block the peak could not reuse)
    and the non-torch increase since the init snapshot."""
    result, _ = run(tmp_path_factory)
    s = ASCEND_SCENARIO
    out = kvguard_budget(
        "--vllm-version",
        RELEASE,
        "--total-memory",
        s["total_memory_bytes"],
        "--weights",
        s["weights_bytes"],
        "--peak-reserved-increase",
        s["profile_transient_bytes"] + s["profile_unreusable_bytes"],
        "--non-torch-increase",
        s["profile_non_torch_bytes"],
    )
    assert out["budgets"]["stock"]["kv_cache_bytes"] == result["returned_available_bytes"]
    assert result["profile"]["non_torch_increase"] == s["profile_non_torch_bytes"]


@pytest.mark.parametrize("name", ["vllm-mindspore-0.5.1.log", "vllm-mindspore-0.5.1-debug.log"])
def test_the_real_startup_log_parses_to_the_decided_budget_and_its_blocks(name, tmp_path_factory):
    """The logs the release printed (INFO and DEBUG): recognised as vllm-mindspore 0.5 from its own logger's
    tag ("vllm-mindspore[logger.py:75]"; 0.5 has no platform plugin to name), 128-token blocks, and the KV
    cache it decided (logged to 0.01 GiB)."""
    result, _ = run(tmp_path_factory)
    text = (LOGS / name).read_text()
    assert "vllm-mindspore[logger.py:75]" in text and "-> vllm_mindspore:" not in text
    log = read_startup_log(str(LOGS / name))
    assert log.era == era_for(RELEASE).name
    assert "mindspore_logger" in log.kinds_seen
    assert log.effective_block_size()[0] == 128
    assert log.kv_cache_tokens == result["kv_cache_config"]["num_blocks"] * 128
    assert abs(log.available_kv_cache_bytes - result["returned_available_bytes"]) <= 0.005 * GIB


def test_on_a_debug_log_the_torch_peak_is_read_as_the_reserved_increase(tmp_path_factory):
    """vllm-mindspore's DEBUG line "torch peak memory increase" is its memory_reserved() increase: the profile
    the log gives takes it as the reserved increase and budgets what the engine decided (to the log's 0.01 GiB)."""
    result, _ = run(tmp_path_factory)
    profile = read_startup_log(str(LOGS / "vllm-mindspore-0.5.1-debug.log")).profile()
    assert profile is not None and profile.formula == "mindspore_reserved"
    assert profile.peak_reserved_increase_bytes == 5 * GIB + 512 * MIB
    assert profile.peak_allocated_increase_bytes is None
    assert abs(stock_kv_cache_bytes(profile) - result["returned_available_bytes"]) <= 0.01 * GIB


def test_kvguard_check_reads_the_log_as_vllm_mindspore_0_5():
    out = subprocess.run(
        [sys.executable, "-m", "kvguard", "check", "--from-log", str(LOGS / "vllm-mindspore-0.5.1-debug.log")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode in (0, 1), out.stderr
    assert out.stdout.splitlines()[0].startswith(f"LOG      {era_for(RELEASE).name}: ")


def test_kvguard_budget_reserved_changes_nothing_here_and_says_why(tmp_path_factory):
    """vllm-mindspore's own budget already takes the reserved increase (the seed fix): the reserved budget is
    the engine's, the worker returns the same bytes, and the plugin says so in one line."""
    stock, snap = run(tmp_path_factory)
    reserved, _ = run(tmp_path_factory, budget="reserved")
    assert reserved_kv_cache_bytes(snap.profile) == stock_kv_cache_bytes(snap.profile)
    assert reserved["returned_available_bytes"] == stock["returned_available_bytes"]
    said = [line for line in reserved["log_lines"] if "kvguard-log" in line and "KVGUARD_BUDGET=reserved" in line]
    assert len(said) == 1 and "reserved" in said[0], said


def test_kvguard_budget_guard_shrinks_a_budget_the_guard_predicts_does_not_fit(tmp_path_factory):
    """At utilization 0.98 the KV cache, the weights and the reserved activation peak come to more than
    MindSpore's pool may take: the guard's budget is smaller than the engine's own, and the worker returns it."""
    stock, _ = run(tmp_path_factory, gpu_memory_utilization=0.98)
    guarded, snap = run(tmp_path_factory, budget="guard", gpu_memory_utilization=0.98)
    assert 0 < guarded["returned_available_bytes"] < stock["returned_available_bytes"]
    assert guarded["kv_cache_config"]["num_blocks"] < stock["kv_cache_config"]["num_blocks"]
    assert any("KVGUARD_BUDGET=guard" in line for line in guarded["log_lines"])
    assert snap.budget_verdict is not None


def test_a_profile_run_that_releases_pool_blocks_mid_run_records_both_figures(tmp_path_factory):
    """Issue 24, the seed fix's blind spot: the pool reaches +4 GiB, hands it back (empty_cache) and ends the
    run at +1.5 GiB cached. vllm-mindspore measures +1.5 GiB (its end-of-run memory_reserved() increase) and
    budgets on it; the plugin records that figure and, beside it, the reserved peak MindSpore's max_reserved
    statistic kept (+4 GiB)."""
    result, snap = run(tmp_path_factory, profile_release_mid_run=1536 * MIB)
    assert result["profile"]["torch_peak_increase"] == 1536 * MIB
    assert stock_kv_cache_bytes(snap.profile) == result["returned_available_bytes"]
    peak = snap.reserved_peak
    assert peak is not None, "the plugin recorded no reserved peak"
    assert (peak.measured_increase_bytes, peak.peak_increase_bytes) == (1536 * MIB, 4 * GIB)
    said = [line for line in result["log_lines"] if line.startswith("INFO kvguard-log") and "reserved peak" in line]
    assert len(said) == 1 and "+4.00 GiB" in said[0] and "+1.50 GiB" in said[0], said


def test_without_a_mid_run_release_the_peak_is_what_vllm_mindspore_measured(tmp_path_factory):
    _, snap = run(tmp_path_factory)
    peak = snap.reserved_peak
    assert peak is not None and peak.peak_increase_bytes == peak.measured_increase_bytes == 5 * GIB + 512 * MIB


def test_kvguard_budget_reserved_counts_the_reserved_peak_where_the_pool_released_mid_run(tmp_path_factory):
    """Where MindSpore's reserved peak (+4 GiB) is above what vllm-mindspore measured (+1.5 GiB), the reserved
    budget takes the peak: the worker returns 2.5 GiB less than the engine decided."""
    stock, _ = run(tmp_path_factory, profile_release_mid_run=1536 * MIB)
    reserved, _ = run(tmp_path_factory, budget="reserved", profile_release_mid_run=1536 * MIB)
    assert stock["returned_available_bytes"] - reserved["returned_available_bytes"] == 4 * GIB - 1536 * MIB
    assert reserved["kv_cache_config"]["num_blocks"] < stock["kv_cache_config"]["num_blocks"]


def test_kvguard_check_on_that_run_says_the_peak_and_counts_it_in_the_overcommit(tmp_path_factory):
    """The blind spot is visible where an operator looks: kvguard check on the rank's spool (post mortem)
    gives both figures, its one-line note, and an overcommit of the 2.5 GiB the engine's figure left out."""
    run(tmp_path_factory, profile_release_mid_run=1536 * MIB)
    spool = _spools[("stock", (("profile_release_mid_run", 1536 * MIB),))]
    out = subprocess.run(
        [sys.executable, "-m", "kvguard", "check", "--spool-dir", str(spool), "--post-mortem", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rank = json.loads(out.stdout)["ranks"][0]
    assert (rank["reserved_increase_measured_bytes"], rank["reserved_peak_increase_bytes"]) == (1536 * MIB, 4 * GIB)
    assert "+4.00 GiB" in rank["reserved_peak_note"] and "+1.50 GiB" in rank["reserved_peak_note"]
    assert rank["overcommit_bytes"] == 4 * GIB - 1536 * MIB
    assert out.returncode in (1, 2), out.stderr
    text = subprocess.run(
        [sys.executable, "-m", "kvguard", "check", "--spool-dir", str(spool), "--post-mortem"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert len([line for line in text.splitlines() if "reserved peak:" in line]) == 1, text
