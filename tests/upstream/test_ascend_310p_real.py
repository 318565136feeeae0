"""kvguard against vllm-ascend on a 310P: each vllm-ascend-310p era row's release runs its real NPUWorker310
(vllm_ascend/_310p/worker_310p.py) on a fake Ascend 310P3, with kvguard's plugin loaded by vLLM's own
load_general_plugins (tests/upstream/ascend_real, scenario key "soc": only torch_npu's device calls are faked).

vllm-ascend picks NPUWorker310 when its build's device type is 310P (platform.py 0.18.0:437-438, utils.py
0.18.0:703-740: the _build_info.py a 310P build writes, checked against torch_npu's SoC version 200-205 by
NPUWorker's check_ascend_device_type). The PyPI wheels are built for A2; engine_main.py sets the device type a
build for ascend310p3 writes (setup.py 0.23.0.post1:153-193). Same wheels, same environments as
tests/upstream/test_ascend_real.py (`python3 tests/upstream/ascend_real/envs.py setup`), and the same scenario: a 64
GiB device,
14 GiB of weights, a profile run of +4 GiB allocated and +5.5 GiB reserved, 300 MiB of non-torch memory left
behind, 1 GiB of it there from the start.

What NPUWorker310 returned is the oracle. The logs it printed are in tests/data/logs/ascend-real/
(vllm-ascend-310p-*.log; `python tests/upstream/test_ascend_310p_real.py save-logs` writes them again).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from ascend_real import envs
from ascend_real.harness import ASCEND_SCENARIO, run_engine

from kvguard.budget.estimator import FORMULAS, reserved_kv_cache_bytes, stock_kv_cache_bytes
from kvguard.spool.io import read_spool
from kvguard.vllm.eras import era_for, expandable_segments_default
from kvguard.vllm.log import read_startup_log

GIB = 1 << 30
MIB = 1 << 20
SOC = {"soc": "310P3"}
# The release each vllm-ascend-310p row is checked against (an env of tests/upstream/ascend_real), and the row.
# 0.14.0rc1 (on vLLM 0.14.0) has no A2 row of its own to check: envs.py builds it for this file only.
RELEASES = {
    "vllm-ascend:0.14.0rc1": "vllm-ascend-310p 0.14.0",
    "vllm-ascend:0.17.0rc1": "vllm-ascend-310p 0.15.0–0.17.0",
    "vllm-ascend:0.18.0": "vllm-ascend-310p 0.18.0–0.19.1",
    "vllm-ascend:0.23.0.post1": "vllm-ascend-310p 0.20.0+",
}
LOGS = pathlib.Path(__file__).resolve().parents[1] / "data" / "logs" / "ascend-real"
_runs: dict = {}


def as_310p(release: str) -> str:
    return release.replace("vllm-ascend:", "vllm-ascend-310p:")


def log_name(release: str, debug: str = "") -> str:
    return f"{envs._name(as_310p(release))}{debug}.log"


def run(release: str, tmp_path_factory, budget: str = "stock"):
    """One startup on the fake 310P with kvguard's plugin; (the engine's result, the rank's snapshot)."""
    key = (release, budget)
    if key not in _runs:
        spool = tmp_path_factory.mktemp(f"spool-310p-{envs._name(release)}")
        result = run_engine(release, SOC, env={"KVGUARD_SPOOL_DIR": str(spool), "KVGUARD_BUDGET": budget})
        snapshots = read_spool(str(spool)).snapshots
        assert len(snapshots) == 1, f"{release}: the plugin wrote {len(snapshots)} snapshots"
        _runs[key] = (result, snapshots[0])
    return _runs[key]


def kvguard_budget(*args) -> dict:
    from helpers import cli_args  # tests/support: here, not at the top, so that save-logs runs as a script

    out = subprocess.run(
        [sys.executable, "-m", "kvguard", "budget", *cli_args("budget", *args), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_the_310p_row_names_the_wheel_the_tests_run(release):
    era = era_for(as_310p(release))
    assert (era.name, era.checked_against) == (RELEASES[release], release.split(":")[1])


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_vllm_ascend_runs_npuworker310_on_a_310p_and_the_plugin_names_it(release, tmp_path_factory):
    result, snap = run(release, tmp_path_factory)
    assert result["config"]["worker_cls"] == "vllm_ascend._310p.worker_310p.NPUWorker310"
    assert any("Skip warm-up atb ops for 310P device" in line for line in result["log_lines"])
    assert snap.profile.vllm_version == as_310p(release)
    assert snap.profile.formula == era_for(as_310p(release)).formula


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_the_recorded_profile_reproduces_npuworker310s_budget_to_the_byte(release, tmp_path_factory):
    result, snap = run(release, tmp_path_factory)
    assert stock_kv_cache_bytes(snap.profile) == result["returned_available_bytes"]
    # What the engine then allocated: the budget in 128-token blocks of 28 layers x 262,144 bytes.
    assert result["kv_cache_config"]["num_blocks"] == result["returned_available_bytes"] // (28 * 262144)


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_the_rows_expandable_segments_default_is_what_the_platform_set(release, tmp_path_factory):
    """vllm-ascend's platform sets PYTORCH_NPU_ALLOC_CONF=expandable_segments:True from 0.14.0rc1 (none set
    before it ran); the row's expandable_segments_from says the same (0.14.0rc1 is the first release run here)."""
    result, _ = run(release, tmp_path_factory)
    conf = result["config"]["npu_alloc_conf"] or ""
    assert expandable_segments_default(as_310p(release), "torch_npu") == ("expandable_segments:True" in conf)


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_the_rows_defaults_are_the_engines(release, tmp_path_factory):
    result, snap = run(release, tmp_path_factory)
    era = era_for(as_310p(release))
    assert result["config"]["block_size"] == era.default_block_size == 128
    assert result["config"]["gpu_memory_utilization"] == era.default_gpu_memory_utilization
    assert snap.profile.gpu_memory_utilization == era.default_gpu_memory_utilization


def test_from_0_18_npuworker310_halves_what_it_would_otherwise_budget(tmp_path_factory):
    """0.14 and 0.17 inherit NPUWorker's budget (the same bytes as on an A2: tests/data/logs/ascend-real/README.md);
    0.18 computes the same difference itself and halves it (worker_310p.py 0.18.0:95-97), a float floor
    division truncated by int()."""
    oldest, _ = run("vllm-ascend:0.14.0rc1", tmp_path_factory)
    old, _ = run("vllm-ascend:0.17.0rc1", tmp_path_factory)
    new, _ = run("vllm-ascend:0.18.0", tmp_path_factory)
    assert oldest["returned_available_bytes"] == old["returned_available_bytes"] == 41_131_861_606
    assert new["returned_available_bytes"] == old["returned_available_bytes"] // 2


def _flags(release: str, result: dict) -> list:
    """The budget flags, as their help describes them, from what the engine measured: the scenario's
    device figures, and vLLM's MemoryProfilingResult where the release runs one (0.15+)."""
    s = ASCEND_SCENARIO
    flags = [
        "--vllm-version",
        as_310p(release),
        "--total-memory",
        s["total_memory_bytes"],
        "--weights",
        s["weights_bytes"],
        "--peak-allocated-increase",
        s["profile_transient_bytes"],
    ]
    formula = FORMULAS[era_for(as_310p(release)).formula]
    if formula.non_torch == "positive":
        # 0.14: total - free - torch allocated, after empty_cache: every non-torch byte in the process.
        return flags + ["--non-torch-memory", s["init_non_torch_bytes"] + s["profile_non_torch_bytes"]]
    profile = result["profile"]
    assert (profile["weights_memory"], profile["torch_peak_increase"]) == (
        s["weights_bytes"],
        s["profile_transient_bytes"],
    )
    flags += ["--non-torch-increase", profile["non_torch_increase"]]
    if formula.cleared:
        # The non-torch memory read inside the profile, before empty_cache, less the increase: in effect the
        # non-torch memory there at startup (the same reading as the vllm-ascend 0.15-0.17 row).
        flags += ["--non-torch-cleared", s["init_non_torch_bytes"]]
    return flags


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_kvguard_budget_from_the_flags_gives_the_engines_figure(release, tmp_path_factory):
    result, _ = run(release, tmp_path_factory)
    out = kvguard_budget(*_flags(release, result))
    assert out["budgets"]["stock"]["kv_cache_bytes"] == result["returned_available_bytes"]


@pytest.mark.parametrize("release", ["vllm-ascend:0.14.0rc1", "vllm-ascend:0.17.0rc1", "vllm-ascend:0.23.0.post1"])
def test_kvguard_budget_reserved_changes_what_npuworker310_returns(release, tmp_path_factory):
    stock, stock_snap = run(release, tmp_path_factory)
    reserved, _ = run(release, tmp_path_factory, budget="reserved")
    expected = reserved_kv_cache_bytes(stock_snap.profile)
    # The profile run reserved 1.5 GiB more than it allocated at its peak; 0.18+ halves what is left.
    halved = FORMULAS[era_for(as_310p(release)).formula].halved
    assert abs((stock["returned_available_bytes"] - expected) - (768 if halved else 1536) * MIB) <= 1
    assert reserved["returned_available_bytes"] == expected
    assert reserved["kv_cache_config"]["num_blocks"] < stock["kv_cache_config"]["num_blocks"]


# ------------------------------------------------------------------ the real 310P startup logs


@pytest.mark.parametrize("debug", ["", "-debug"])
@pytest.mark.parametrize("release", sorted(RELEASES))
def test_the_real_310p_log_parses_to_the_decided_budget_and_block_size(release, debug, tmp_path_factory):
    result, _ = run(release, tmp_path_factory)
    log = read_startup_log(str(LOGS / log_name(release, debug)))
    assert log.project == "vllm-ascend-310p", log.era_reason
    assert RELEASES[release] in log.era_candidates, log.era_reason
    assert log.effective_block_size()[0] == 128
    # "Available KV cache memory: %.2f GiB" (0.14: "Available memory: %d", the bytes); the token count is the
    # engine's blocks x 128.
    exact = release == "vllm-ascend:0.14.0rc1"
    assert abs(log.available_kv_cache_bytes - result["returned_available_bytes"]) <= (0 if exact else 0.005 * GIB)
    assert log.kv_cache_tokens == result["kv_cache_config"]["num_blocks"] * 128


def test_the_0_14_310p_log_names_its_row_alone():
    """NPUWorker's "Available memory" line (vllm-ascend's own) and NPUWorker310's warm-up skip: only the 0.14 row."""
    log = read_startup_log(str(LOGS / log_name("vllm-ascend:0.14.0rc1")))
    assert log.era == "vllm-ascend-310p 0.14.0", log.era_reason


def test_the_0_23_310p_log_names_its_row_alone_and_says_it_halved():
    log = read_startup_log(str(LOGS / log_name("vllm-ascend:0.23.0.post1")))
    assert (log.era, log.halved_for_workspace) == ("vllm-ascend-310p 0.20.0+", True)


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_kvguard_budget_from_the_310p_log_gives_the_engines_blocks(release, tmp_path_factory):
    result, _ = run(release, tmp_path_factory)
    out = kvguard_budget("--from-log", LOGS / log_name(release), "--model-config", ASCEND_SCENARIO["model_dir"])
    assert out["layout"]["block_size"] == 128
    assert out["budgets"]["stock"]["num_blocks"] == result["kv_cache_config"]["num_blocks"]


def save_logs() -> int:
    """Write the 310P startup logs (INFO and DEBUG, without kvguard's plugin), unedited."""
    from vllm_real import harness as vllm_harness

    vllm_harness.save_logs(run_engine, [(r, log_name(r)[: -len(".log")]) for r in sorted(RELEASES)], LOGS, SOC)
    return 0


if __name__ == "__main__":  # run from the repository root: tests/upstream is the script's directory, on sys.path
    sys.exit(
        save_logs()
        if sys.argv[1:] == ["save-logs"]
        else "use: python tests/upstream/test_ascend_310p_real.py save-logs"
    )
