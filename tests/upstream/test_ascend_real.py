"""kvguard against the Ascend engines as they ship: each vllm-ascend era row's release runs its real
NPUWorker (and vLLM's own engine-core KV sizing) on a fake NPU, with kvguard's plugin loaded by vLLM's
own load_general_plugins (tests/upstream/ascend_real: only torch_npu's device calls are faked).

The scenario is the issue's: a 64 GiB device, 14 GiB of weights, a profile run of +4 GiB allocated and
+5.5 GiB reserved, 300 MiB of non-torch memory left behind, 1 GiB of it (ACL context, HCCL) from the start.
What each release returned is the oracle; the plugin's profile, `kvguard budget` and the reserved /
guard budgets are checked against it. Environments: `python3 tests/upstream/ascend_real/envs.py setup`.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest
from ascend_real import envs
from ascend_real.harness import ASCEND_SCENARIO, run_engine
from helpers import cli_args

from kvguard.budget.estimator import FORMULAS, reserved_kv_cache_bytes, stock_kv_cache_bytes
from kvguard.budget.sampler import unprofiled_sampler_peak_bytes
from kvguard.spool.io import read_spool
from kvguard.vllm.eras import era_for

GIB = 1 << 30
MIB = 1 << 20
ASCEND = [r for r in envs.RELEASES if r.startswith("vllm-ascend:") and r not in envs.V0_RELEASES]
_runs: dict = {}


def run(release: str, tmp_path_factory, budget: str = "stock", **scenario):
    """One startup with kvguard's plugin; (the engine's result, the rank's snapshot)."""
    key = (release, budget, json.dumps(scenario, sort_keys=True))
    if key not in _runs:
        spool = tmp_path_factory.mktemp(f"spool-{envs._name(release)}")
        result = run_engine(release, scenario, env={"KVGUARD_SPOOL_DIR": str(spool), "KVGUARD_BUDGET": budget})
        snapshots = read_spool(str(spool)).snapshots
        assert len(snapshots) == 1, f"{release}: the plugin wrote {len(snapshots)} snapshots"
        _runs[key] = (result, snapshots[0])
    return _runs[key]


def kvguard_budget(*args) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "kvguard", "budget", *cli_args("budget", *args), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_every_ascend_era_row_release_is_set_up():
    missing = [r for r in envs.RELEASES if envs.env_python(r) is None]
    assert not missing, f"not set up (python3 tests/upstream/ascend_real/envs.py setup): {missing}"


@pytest.mark.parametrize("release", ASCEND)
def test_the_row_names_the_wheel_the_tests_run(release):
    project, version = release.split(":")
    assert era_for(release).checked_against == version


@pytest.mark.parametrize("release", ASCEND)
def test_the_plugin_records_the_release_and_its_era(release, tmp_path_factory):
    result, snap = run(release, tmp_path_factory)
    assert result["engine_version"] == release
    assert snap.profile.vllm_version == release
    assert snap.profile.formula == era_for(release).formula


@pytest.mark.parametrize("release", ASCEND)
def test_the_recorded_profile_reproduces_the_engines_budget_to_the_byte(release, tmp_path_factory):
    result, snap = run(release, tmp_path_factory)
    assert stock_kv_cache_bytes(snap.profile) == result["returned_available_bytes"]
    assert result["config"]["block_size"] == era_for(release).default_block_size == 128


@pytest.mark.parametrize("release", ASCEND)
def test_the_rows_utilization_default_is_the_engines(release, tmp_path_factory):
    result, snap = run(release, tmp_path_factory)
    assert result["config"]["gpu_memory_utilization"] == era_for(release).default_gpu_memory_utilization
    assert snap.profile.gpu_memory_utilization == result["config"]["gpu_memory_utilization"]


def test_on_0_11_the_profile_is_what_npuworker_read(tmp_path_factory):
    """No memory_profiling: the plugin records NPUWorker's own reads. Its allocated peak holds the weights
    (14 GiB stay allocated after empty_cache, +4 GiB above), the reserved peak +5.5 GiB, and the absolute
    non-torch memory is all of it, 1 GiB + 300 MiB."""
    _, snap = run("vllm-ascend:0.11.0", tmp_path_factory)
    p = snap.profile
    assert (p.weights_bytes, p.peak_allocated_increase_bytes, p.peak_reserved_increase_bytes) == (
        14 * GIB,
        4 * GIB,
        5 * GIB + 512 * MIB,
    )
    assert p.non_torch_increase_bytes == GIB + 300 * MIB


def test_on_0_17_the_cleared_term_is_the_startup_non_torch_memory(tmp_path_factory):
    """vllm-ascend 0.17's extra subtrahend (worker.py 0.17.0rc1:344-363) comes out as the 1 GiB of non-torch
    memory there before the profile, although the profile's empty_cache freed nothing."""
    _, snap = run("vllm-ascend:0.17.0rc1", tmp_path_factory)
    assert snap.profile.non_torch_cleared_bytes == ASCEND_SCENARIO["init_non_torch_bytes"]


def _samples_in(source: pathlib.Path, class_name: str, method: str) -> bool | None:
    """Whether ``class_name`` in that file defines ``method`` (None: it does not) and, if so, whether that
    calls a sampler (``self.sampler(...)``, as vLLM's own ``_dummy_sampler_run`` does) or only computes the
    logits."""
    tree = ast.parse(source.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    calls = {ast.unparse(call.func) for call in ast.walk(item) if isinstance(call, ast.Call)}
                    assert "self.model.compute_logits" in calls, f"{method} computes no logits: read it again"
                    return any(name.endswith("sampler") for name in calls)
    return None


def _site_packages(release: str) -> pathlib.Path:
    (found,) = envs.env_dir(release).glob("lib/python3*/site-packages")
    return found


@pytest.mark.parametrize("release", ASCEND)
def test_the_releases_profile_run_samples_nothing_as_its_row_says(release):
    """The era column profile_runs_sampler, read from the release's own source: NPUModelRunner's
    _dummy_sampler_run computes the logits and calls no sampler (its TODO says so), and the 310P runner,
    where the release has one, keeps it."""
    site = _site_packages(release)
    runner = site / "vllm_ascend" / "worker" / "model_runner_v1.py"
    # 0.11.0's profile_run computes the logits itself; later releases call vLLM's profile_run, which ends in
    # the _dummy_sampler_run NPUModelRunner overrides.
    dummy = _samples_in(runner, "NPUModelRunner", "_dummy_sampler_run")
    assert (_samples_in(runner, "NPUModelRunner", "profile_run") if dummy is None else dummy) is False
    runner_310p = site / "vllm_ascend" / "_310p" / "model_runner_310p.py"
    if runner_310p.is_file():
        assert _samples_in(runner_310p, "NPUModelRunner310", "_dummy_sampler_run") is None
        assert _samples_in(runner_310p, "NPUModelRunner310", "profile_run") is None
    assert era_for(release).profile_runs_sampler is False


@pytest.mark.parametrize("release", ASCEND)
def test_the_plugin_adds_the_sampling_peak_the_profile_run_left_out(release, tmp_path_factory):
    """Worked out from the engine's own config objects (the model's hidden size, vocabulary and dtype, the
    scheduler's limits), with the formula tests/budget/test_sampler_peak.py checks against vLLM's dtypes."""
    result, snap = run(release, tmp_path_factory)
    c = result["config"]
    names = ("hidden_size", "vocab_size", "dtype_bytes", "tensor_parallel_size", "max_num_seqs")
    expected = unprofiled_sampler_peak_bytes(
        max_num_batched_tokens=c["max_num_batched_tokens"], **{name: c[name] for name in names}
    )
    assert snap.profile.unprofiled_sampler_bytes == expected > 0


def _flags(release: str, result: dict) -> list:
    """The budget flags, as their help describes them, from what the engine measured: the scenario's device
    figures (the fake device's state), and vLLM's MemoryProfilingResult where the release runs one."""
    s = ASCEND_SCENARIO
    flags = [
        "--vllm-version",
        release,
        "--total-memory",
        s["total_memory_bytes"],
        "--weights",
        s["weights_bytes"],
        "--peak-allocated-increase",
        s["profile_transient_bytes"],
    ]
    formula = FORMULAS[era_for(release).formula]
    if formula.non_torch == "positive":
        # total - free - torch allocated, after empty_cache: every non-torch byte in the process.
        flags += ["--non-torch-memory", s["init_non_torch_bytes"] + s["profile_non_torch_bytes"]]
    else:
        flags += ["--non-torch-increase", result["profile"]["non_torch_increase"]]
        assert result["profile"]["weights_memory"] == s["weights_bytes"]
        assert result["profile"]["torch_peak_increase"] == s["profile_transient_bytes"]
    if formula.cleared:
        flags += ["--non-torch-cleared", s["init_non_torch_bytes"]]
    return flags


@pytest.mark.parametrize("release", ASCEND)
def test_kvguard_budget_from_the_flags_gives_the_engines_figure(release, tmp_path_factory):
    result, _ = run(release, tmp_path_factory)
    out = kvguard_budget(*_flags(release, result))
    assert out["budgets"]["stock"]["kv_cache_bytes"] == result["returned_available_bytes"]


def test_the_increase_flag_is_refused_where_the_formula_takes_the_absolute_non_torch_memory():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvguard",
            "budget",
            "--vllm-version",
            "vllm-ascend:0.11.0",
            "--total-memory",
            "64GiB",
            "--weights",
            "14GiB",
            "--peak-allocated-increase",
            "4GiB",
            "--non-torch-increase",
            "300MiB",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 64 and "--non-torch-memory" in out.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("release", ASCEND)
def test_kvguard_budget_reserved_changes_what_the_worker_returns(release, tmp_path_factory):
    stock, stock_snap = run(release, tmp_path_factory)
    reserved, _ = run(release, tmp_path_factory, budget="reserved")
    expected = reserved_kv_cache_bytes(stock_snap.profile)
    # The profile run reserved 1.5 GiB more than it allocated at its peak: that much less KV cache.
    assert stock["returned_available_bytes"] - expected == 1536 * MIB
    assert reserved["returned_available_bytes"] == expected
    assert reserved["kv_cache_config"]["num_blocks"] < stock["kv_cache_config"]["num_blocks"]


@pytest.mark.parametrize("release", ["vllm-ascend:0.11.0", "vllm-ascend:0.23.0.post1"])
def test_kvguard_budget_guard_shrinks_a_budget_the_guard_predicts_does_not_fit(release, tmp_path_factory):
    """At utilization 0.98 the KV cache, the weights, the reserved activation peak and the non-torch memory
    come to more than the 64 GiB device: the guard's budget is smaller than the engine's own."""
    stock, _ = run(release, tmp_path_factory, gpu_memory_utilization=0.98)
    guarded, _ = run(release, tmp_path_factory, budget="guard", gpu_memory_utilization=0.98)
    assert 0 < guarded["returned_available_bytes"] < stock["returned_available_bytes"]
    assert any("KVGUARD_BUDGET=guard" in line for line in guarded["log_lines"])


@pytest.mark.parametrize("release", ASCEND)
def test_budget_allocator_torch_npu_follows_the_releases_expandable_segments(release, tmp_path_factory):
    """What the release's own platform left in PYTORCH_NPU_ALLOC_CONF (none set before it ran) is what
    `budget --allocator torch_npu` assumes for it."""
    result, snap = run(release, tmp_path_factory)
    conf = result["config"]["npu_alloc_conf"] or ""
    profile = tmp_path_factory.mktemp("profile") / "profile.json"
    profile.write_text(json.dumps(snap.profile.to_dict()))
    out = kvguard_budget(
        "--profile", profile, "--model-config", ASCEND_SCENARIO["model_dir"], "--allocator", "torch_npu"
    )
    assert out["at_budget"]["expandable_segments"] == ("expandable_segments:True" in conf)


def test_the_absolute_flag_is_refused_where_the_formula_takes_the_increase():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvguard",
            "budget",
            "--vllm-version",
            "vllm-ascend:0.18.0",
            "--total-memory",
            "64GiB",
            "--weights",
            "14GiB",
            "--peak-allocated-increase",
            "4GiB",
            "--non-torch-memory",
            "1.3GiB",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 64 and "--non-torch-increase" in out.stderr.strip().splitlines()[-1]


# ------------------------------------------------------------------ vllm-ascend 0.7.3: vLLM 0.7.3's V0 engine
# NPUWorker.determine_num_available_blocks (vllm_ascend/worker/worker.py 0.7.3:239-281) decides a block count from
# the drop in free memory since init_device's snapshot, read after the profile run with no empty_cache between.
# LLMEngine._initialize_kv_caches (vLLM 0.7.3) sizes the cache with it; the plugin can wrap init_device only.
V0 = list(envs.V0_RELEASES)


def run_v0(release: str, tmp_path_factory, budget: str = "stock"):
    key = (release, budget, "v0")
    if key not in _runs:
        spool = tmp_path_factory.mktemp(f"spool-{envs._name(release)}")
        result = run_engine(release, env={"KVGUARD_SPOOL_DIR": str(spool), "KVGUARD_BUDGET": budget})
        _runs[key] = (result, read_spool(str(spool)).snapshots)
    return _runs[key]


@pytest.mark.parametrize("release", V0)
def test_v0_the_row_names_the_wheel_and_the_engine_runs_its_defaults(release, tmp_path_factory):
    result, _ = run_v0(release, tmp_path_factory)
    era = era_for(release)
    assert era.checked_against == release.split(":")[1] and era_for("vllm-ascend:0.7.3") is era
    assert result["engine_version"] == release and result["vllm_version"] == "0.7.3"
    assert result["config"]["worker_cls"] == "vllm_ascend.worker.worker.NPUWorker"
    assert result["config"]["block_size"] == era.default_block_size == 128
    assert result["config"]["gpu_memory_utilization"] == era.default_gpu_memory_utilization == 0.9


@pytest.mark.parametrize("release", V0)
def test_v0_kvguard_budget_from_the_flags_gives_the_engines_block_count(release, tmp_path_factory):
    """--total-consumed as its help says: free memory at the init snapshot minus after the profile run. Here that
    is the weights, what torch_npu's pool still reserves after the run (the +5.5 GiB reserved peak: no
    empty_cache before the read) and the 300 MiB of non-torch memory the run left."""
    result, _ = run_v0(release, tmp_path_factory)
    s = ASCEND_SCENARIO
    consumed = (
        s["weights_bytes"] + s["profile_transient_bytes"] + s["profile_unreusable_bytes"] + s["profile_non_torch_bytes"]
    )
    figures = result["figures"]
    # The fake device agrees: the worker's init snapshot, less what is free after the profile run.
    after_profile = next(e for e in result["runner_events"] if e["event"] == "profile_run")["device"]
    assert figures["init_npu_memory"] - after_profile["free"] == consumed
    out = kvguard_budget(
        "--vllm-version",
        release,
        "--total-memory",
        s["total_memory_bytes"],
        "--weights",
        s["weights_bytes"],
        "--total-consumed",
        consumed,
        "--model-config",
        s["model_dir"],
        "--max-model-len",
        s["max_model_len"],
    )
    assert out["era"]["formula"] == "ascend_free_drop"
    assert out["block_bytes"] == figures["block_bytes"]
    assert out["budgets"]["stock"]["num_blocks"] == figures["num_gpu_blocks"] == result["kv_cache_config"]["num_blocks"]
    # One (2, blocks, 128, heads, head size) tensor per layer (vLLM 0.7.3 worker/cache_engine.py:99-106).
    assert figures["kv_cache_tensors"] == [[2, figures["num_gpu_blocks"], 128, 4, 128]] * 28
    # A pool that kept its blocks: the drop already holds the reserved peak, so the reserved-aware budget is the same.
    reserved = kvguard_budget(
        "--vllm-version",
        release,
        "--total-memory",
        s["total_memory_bytes"],
        "--weights",
        s["weights_bytes"],
        "--total-consumed",
        consumed,
        "--reserved-transient-peak",
        0,
    )
    assert reserved["budgets"]["reserved"]["kv_cache_bytes"] == reserved["budgets"]["stock"]["kv_cache_bytes"]
    assert reserved["overcommit_bytes"] == 0


@pytest.mark.parametrize("release", V0)
def test_v0_the_plugin_records_no_profile_and_the_reserved_budget_cannot_act(release, tmp_path_factory):
    """The V0 NPUWorker has no determine_available_memory: the plugin starts its probe in init_device (a snapshot,
    no profile), and KVGUARD_BUDGET=reserved leaves the engine's block count as it was."""
    stock, snapshots = run_v0(release, tmp_path_factory)
    reserved, _ = run_v0(release, tmp_path_factory, budget="reserved")
    assert len(snapshots) == 1 and snapshots[0].profile is None
    assert reserved["figures"]["num_gpu_blocks"] == stock["figures"]["num_gpu_blocks"]
    assert era_for(release).hooks == ("init_device",)
    # ... and says so, once, in vLLM's own log (formatted by vLLM's handler: "hooks.py:N] kvguard: ...").
    said = [
        line
        for line in reserved["log_lines"]
        if "hooks.py:" in line and "kvguard: no startup profile on vllm-ascend 0.7.3" in line
    ]
    assert len(said) == 1 and "KVGUARD_BUDGET=reserved cannot act" in said[0], reserved["log_lines"][-20:]
