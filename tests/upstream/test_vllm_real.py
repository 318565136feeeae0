"""kvguard against real vLLM releases: the plugin, the estimator and the log reader, checked against
what each release's own startup code returned (tests/upstream/vllm_real: the wheel's worker, engine-core KV
sizing and extensible KV cache on a fake device; only torch and platform calls are replaced).

Each release is one of the era table's rows; its environment is set up by ./dev.sh test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from vllm_real import envs
from vllm_real.harness import run_worker

from kvguard.budget.estimator import (
    FORMULAS,
    Profile,
    extensible_kv_cache_bytes,
    reserved_kv_cache_bytes,
    stock_kv_cache_bytes,
)
from kvguard.spool.io import read_spool
from kvguard.vllm.eras import era_for
from kvguard.vllm.log import parse_lines

GIB = 1 << 30
RELEASES = envs.releases()
# Fragmentation the allocated peak does not show: an earlier activation's cached block the
# profile's peak cannot reuse, so the reserved peak outgrows the allocated one by 1 GiB.
FRAGMENTED = {"profile_unreusable_bytes": GIB}
# The name the engine serves under, as an operator passes --served-model-name (a list: vLLM keeps the first).
SERVED = ["kvguard/qwen-served", "alias"]
DEFAULT_RUN = {**FRAGMENTED, "served_model_name": SERVED}
_runs: dict = {}


def run(release: str, tmp_path_factory, scenario=None, budget: str = "stock"):
    """One startup of the release with kvguard's plugin; (harness result, the rank's snapshot)."""
    key = (release, json.dumps(scenario or DEFAULT_RUN, sort_keys=True), budget)
    if key not in _runs:
        spool = tmp_path_factory.mktemp(f"spool-{release}")
        result = run_worker(
            release, scenario or DEFAULT_RUN, env={"KVGUARD_SPOOL_DIR": str(spool), "KVGUARD_BUDGET": budget}
        )
        snapshots = read_spool(str(spool)).snapshots
        assert len(snapshots) == 1, f"vLLM {release}: the plugin wrote {len(snapshots)} snapshots"
        _runs[key] = (result, snapshots[0], spool)
    return _runs[key]


def committed(result) -> int | None:
    ekv = result.get("extensible_kv_cache")
    return ekv["num_committed_blocks"] if ekv else None


def test_the_required_releases_are_set_up():
    # vllm-mindspore 0.5's base and the newest release: the issue's minimum.
    assert {"0.11.0", "0.34.0"} <= set(RELEASES)


@pytest.mark.parametrize("release", RELEASES)
def test_the_snapshot_names_the_served_model_and_the_engine_as_vllm_labels_them(release, tmp_path_factory):
    result, snap, _ = run(release, tmp_path_factory)
    # What the release itself resolved --served-model-name to (the first of the list), and data-parallel
    # engine 0: the model_name and engine labels its own /metrics series carry.
    assert result["config"]["served_model_name"] == SERVED[0]
    assert (snap.model_name, snap.engine) == (SERVED[0], "0")


@pytest.mark.parametrize("release", RELEASES)
def test_the_plugin_records_the_release_and_its_era(release, tmp_path_factory):
    _, snap, _ = run(release, tmp_path_factory)
    assert snap.profile.vllm_version == f"vllm:{release}"
    era = era_for(release)
    expected = "extensible" if era.extensible_kv_cache_default else era.formula
    assert snap.profile.formula == expected
    # vLLM's profile run samples a full batch itself (_dummy_sampler_run): the plugin adds no sampler peak.
    assert era.profile_runs_sampler and snap.profile.unprofiled_sampler_bytes is None


@pytest.mark.parametrize("release", RELEASES)
def test_the_recorded_profile_reproduces_vllms_budget_to_the_byte(release, tmp_path_factory):
    result, snap, _ = run(release, tmp_path_factory)
    profile = snap.profile
    if profile.formula == "extensible":
        # What determine_available_memory returned is 0.34's capacity, the 0.27 formula ...
        at_profile = Profile(**{**profile.to_dict(), "formula": "consumed"})
        assert stock_kv_cache_bytes(at_profile) == result["returned_available_bytes"]
        # ... and the size vLLM committed after warm-up is what measure_kv_cache_bytes allowed,
        # less at most one VMM granule per layer (blocks_within pads each layer's segment).
        budget = extensible_kv_cache_bytes(profile)
        block_bytes = snap.kv_cache.block_bytes
        layers = result["kv_cache_config"]["groups"][0]["num_layers"]
        assert 0 <= budget // block_bytes - committed(result) <= layers * (2 << 20) // block_bytes + 1
    else:
        assert stock_kv_cache_bytes(profile) == result["returned_available_bytes"]


@pytest.mark.parametrize("release", RELEASES)
def test_budget_profile_on_the_snapshot_gives_the_same_figure(release, tmp_path_factory, tmp_path):
    result, snap, _ = run(release, tmp_path_factory)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(snap.profile.to_dict()))
    out = subprocess.run(
        [sys.executable, "-m", "kvguard", "budget", "--profile", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["era"]["name"] == era_for(release).name
    assert data["budgets"]["stock"]["kv_cache_bytes"] == stock_kv_cache_bytes(snap.profile)


@pytest.mark.parametrize("release", RELEASES)
def test_the_plugin_records_the_kv_cache_vllm_allocated(release, tmp_path_factory):
    result, snap, _ = run(release, tmp_path_factory)
    config = result["kv_cache_config"]
    groups = config["groups"]
    per_block = max(g["num_layers"] * g["page_size_bytes"] for g in groups)
    assert snap.kv_cache.block_bytes == per_block
    if committed(result) is not None:
        assert (snap.kv_cache.num_blocks, snap.kv_cache.outside_allocator) == (committed(result), True)
    else:
        assert (snap.kv_cache.num_blocks, snap.kv_cache.outside_allocator) == (config["num_blocks"], False)


@pytest.mark.parametrize("release", RELEASES)
def test_kvguard_budget_reserved_changes_what_vllm_returns(release, tmp_path_factory):
    stock, stock_snap, _ = run(release, tmp_path_factory)
    reserved, snap, _ = run(release, tmp_path_factory, budget="reserved")
    if era_for(release).extensible_kv_cache_default:
        # 0.34 sizes its extensible cache after warm-up, keeping torch's reserve growth free: nothing to do.
        assert reserved["returned_available_bytes"] == stock["returned_available_bytes"]
        assert committed(reserved) == committed(stock)
        return
    expected = reserved_kv_cache_bytes(stock_snap.profile)
    assert expected < stock["returned_available_bytes"]
    assert reserved["returned_available_bytes"] == expected
    # vLLM sizes the KV cache from what it was given.
    assert reserved["kv_cache_config"]["num_blocks"] < stock["kv_cache_config"]["num_blocks"]


@pytest.mark.parametrize("release", RELEASES)
def test_kvguards_lines_are_in_vllms_own_log_and_the_log_reads_the_budget_applied(release, tmp_path_factory):
    """vLLM configures only its "vllm" logger: the plugin hands its records to vLLM's handler, so its
    budget line reaches the operator formatted as vLLM's own lines, and --from-log reads what was applied."""
    import re

    stock, _, _ = run(release, tmp_path_factory)
    reserved, _, _ = run(release, tmp_path_factory, budget="reserved")
    vllm_formatted = re.compile(r"INFO \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*(?:hooks|budget)\.py:\d+\] kvguard: ")
    heard = [line for line in reserved["log_lines"] if vllm_formatted.search(line)]
    assert heard, "no kvguard line in vLLM's log"
    if era_for(release).extensible_kv_cache_default:
        assert "KVGUARD_BUDGET=reserved changes nothing here" in heard[0]
        return
    assert "KV cache budget" in " ".join(heard)
    log = parse_lines(reserved["log_lines"])
    assert abs(log.available_kv_cache_bytes - reserved["returned_available_bytes"]) <= 0.005 * GIB + 1
    assert reserved["returned_available_bytes"] < stock["returned_available_bytes"]


@pytest.mark.parametrize("release", RELEASES)
def test_real_startup_lines_parse_to_the_decided_budget(release, tmp_path_factory):
    result, snap, _ = run(release, tmp_path_factory)
    log = parse_lines(result["log_lines"])
    # The release's own logger calls (file:line tags, kvguard.vllm.source_index) pin its row.
    assert log.era == era_for(release).name, log.era_reason
    if "available_kv_cache" not in era_for(release).log_lines:
        # 0.8.5-0.9.0 log neither the budget nor the profile: the KV cache's size in tokens is what they tell.
        assert log.available_kv_cache_bytes is None
        assert log.kv_cache_tokens == result["kv_cache_config"]["num_blocks"] * result["config"]["block_size"]
        return
    decided = (
        committed(result) * snap.kv_cache.block_bytes
        if committed(result) is not None
        else result["returned_available_bytes"]
    )
    # vLLM prints GiB to two decimals.
    assert abs(log.available_kv_cache_bytes - decided) <= 0.005 * GIB + 1
    if FORMULAS[era_for(release).formula].non_kv == "consumed":
        assert abs(log.total_consumed_bytes - snap.profile.total_consumed_bytes) <= 0.005 * GIB + 1
    else:
        assert abs(log.peak_allocated_increase_bytes - snap.profile.peak_allocated_increase_bytes) <= 0.005 * GIB
    assert abs(log.weights_bytes - snap.profile.weights_bytes) <= 0.005 * GIB + 1


@pytest.mark.parametrize("release", RELEASES)
def test_check_judges_a_healthy_startup_ok(release, tmp_path_factory):
    """A default startup leaves room: the guard must not call it critical (0.34: the KV pages mapped
    outside torch's allocator counted once). The worker has exited by now: judged post mortem."""
    _, _, spool = run(release, tmp_path_factory, scenario={})
    out = subprocess.run(
        [sys.executable, "-m", "kvguard", "check", "--spool-dir", str(spool), "--json", "--post-mortem"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    data = json.loads(out.stdout)
    assert data["ranks"][0]["state"] != "critical", data["ranks"][0]["reasons"]


def test_kv_cache_memory_bytes_is_recorded_and_reproduced(tmp_path_factory):
    result, snap, _ = run("0.11.0", tmp_path_factory, scenario={"kv_cache_memory_bytes": 40 * GIB})
    assert snap.profile.kv_cache_memory_bytes == 40 * GIB
    assert stock_kv_cache_bytes(snap.profile) == result["returned_available_bytes"] == 40 * GIB


def test_0_34_utilization_none_is_resolved_never_none(tmp_path_factory):
    result, snap, _ = run("0.34.0", tmp_path_factory)
    assert result["config"]["gpu_memory_utilization"] is None
    assert snap.profile.gpu_memory_utilization == result["config"]["resolved_gpu_memory_utilization"] == 1.0


# ---------------------------------------------------------------------------- 0.8.5-0.9.0: measured inline

# The releases whose worker measures inline, without memory_profiling (kvguard.plugin.inline_readings): the era
# rows whose formula adds the absolute non-torch memory.
INLINE_RELEASES = [r for r in RELEASES if FORMULAS[era_for(r).formula].non_torch == "positive"]


@pytest.mark.parametrize("release", INLINE_RELEASES)
def test_a_worker_without_memory_profiling_gets_its_profile_from_its_own_device_reads(release, tmp_path_factory):
    """0.9.0's determine_available_memory reads torch.cuda inline (gpu_worker.py 0.9.0:166-214) and the plugin
    records those reads. Its allocated peak holds the weights: what stays allocated after its empty_cache is the
    weights (the runner's own model_memory_usage), the rest the profile run's activation peak; its non-torch
    memory is the absolute one (here the CUDA context the device held before the worker's init snapshot)."""
    result, snap, _ = run(release, tmp_path_factory)
    scenario, profile = result["scenario"], snap.profile
    assert profile.formula == era_for(release).formula
    assert profile.total_memory_bytes == scenario["total_memory_bytes"]
    assert profile.weights_bytes == result["figures"]["model_memory_usage"] == scenario["weights_bytes"]
    assert profile.peak_allocated_increase_bytes == scenario["profile_transient_bytes"]
    # FRAGMENTED: the reserved peak outgrows the allocated one by the block the peak could not reuse.
    assert profile.peak_reserved_increase_bytes == (
        scenario["profile_transient_bytes"] + scenario["profile_unreusable_bytes"]
    )
    assert profile.non_torch_increase_bytes == scenario["init_non_torch_bytes"]


@pytest.mark.parametrize("release", INLINE_RELEASES)
def test_the_plugin_leaves_the_inline_workers_figure_and_blocks_as_vllm_computes_them(release, tmp_path_factory):
    with_plugin, _, _ = run(release, tmp_path_factory)
    alone = run_worker(release, DEFAULT_RUN, plugins=False)
    assert with_plugin["returned_available_bytes"] == alone["returned_available_bytes"]
    assert with_plugin["kv_cache_config"]["num_blocks"] == alone["kv_cache_config"]["num_blocks"]
    # No hook of kvguard's failed, and its formula gave vLLM's figure (else it says so once).
    complaints = [
        line
        for line in with_plugin["log_lines"]
        if "kvguard" in line and ("vLLM continues" in line or "may be off" in line or "no startup profile" in line)
    ]
    assert not complaints


@pytest.mark.parametrize("release", RELEASES)
def test_the_budget_time_verdict_counts_the_kv_tensors_vllm_then_allocates(release, tmp_path_factory):
    """Written at determine_available_memory, before vLLM sized its KV cache: the block count the verdict
    assumed is the one vLLM's engine core then chose, tensor for tensor (0.34's extensible cache is
    sized after warm-up, outside the allocator: no budget-time verdict there)."""
    result, snap, _ = run(release, tmp_path_factory)
    if era_for(release).extensible_kv_cache_default:
        assert snap.budget_verdict is None
        return
    verdict = snap.budget_verdict
    config = result["kv_cache_config"]
    [group] = config["groups"]
    assert verdict.phase == "budget" and verdict.kv_tensors == verdict.kv_tensors_placed == group["num_layers"]
    assert verdict.kv_cache_bytes == config["num_blocks"] * group["page_size_bytes"] * group["num_layers"]
    # The fake device does not round: placing the tensors costs nothing beyond their bytes.
    assert verdict.kv_placement_loss_bytes == 0 or verdict.kv_placement_loss_bytes < 2 * group["num_layers"] << 20


@pytest.mark.parametrize(
    "conf, verdict",
    [
        # torch accepts it (c10/cuda/CUDAAllocatorConfig.cpp); the caching-allocator model does not follow it.
        ("backend:cudaMallocAsync", False),
        # A key a newer torch may add: left out, the rest read.
        ("expandable_segments:True,a_key_of_a_newer_torch:1", True),
    ],
)
def test_an_alloc_conf_the_models_do_not_follow_leaves_the_verdict_out_without_a_failure(conf, verdict, tmp_path):
    """PYTORCH_CUDA_ALLOC_CONF as the engine runs with it, through vLLM 0.11.0's own plugin loader: a config
    the models refuse gives no budget-time verdict and one INFO line, not a hook failure; an unknown key is
    left out and the verdict given."""
    spool = tmp_path / "spool"
    result = run_worker("0.11.0", DEFAULT_RUN, env={"KVGUARD_SPOOL_DIR": str(spool), "PYTORCH_CUDA_ALLOC_CONF": conf})
    [snap] = read_spool(str(spool)).snapshots
    lines = kvguard_lines(result)
    assert not [line for line in result["log_lines"] if "kvguard" in line and "vLLM continues" in line]
    if verdict:
        assert snap.budget_verdict is not None and snap.budget_verdict.phase == "budget"
        assert not [line for line in lines if "no budget-time verdict" in line]
    else:
        assert snap.budget_verdict is None
        [line] = [line for line in lines if "no budget-time verdict" in line]
        assert "PYTORCH_CUDA_ALLOC_CONF='backend:cudaMallocAsync'" in line and "not modelled" in line


# The releases whose own KV allocator is run: every full release, and those set up for this check only
# (vllm_real.envs.LAYOUT_RELEASES: 0.30.0, the first one-backing release the era rows above do not run).
KV_ALLOCATION_RELEASES = RELEASES + [v for v in envs.LAYOUT_RELEASES if envs.env_python(v) is not None]


@pytest.mark.parametrize("release", KV_ALLOCATION_RELEASES)
def test_kv_tensor_style_is_how_the_release_allocates_its_kv_cache(release, tmp_path_factory):
    """The release's own allocator, run unchanged on its own KVCacheConfig (vllm_real.worker_main), makes the
    allocations kv_cache_tensor_bytes gives for the style kv_tensor_style names: one per layer through 0.28,
    one backing for every layer from 0.29; and the plugin's budget-time verdict counts as many."""
    from kvguard.budget.estimator import kv_cache_tensor_bytes, kv_layout_from_config
    from kvguard.budget.model_config import load_model_config
    from kvguard.vllm.eras import kv_tensor_style

    # 0.34 with its extensible KV cache off: the extensible cache maps its pages outside the allocator.
    scenario = (
        {**OVERCOMMITTED, "enable_extensible_kv_cache": False} if era_for(release).extensible_kv_cache_default else None
    )
    result, snap, _ = run(release, tmp_path_factory, scenario=scenario)
    config = result["kv_cache_config"]
    layout = kv_layout_from_config(
        load_model_config(result["scenario"]["model_dir"]), block_size=config["groups"][0]["block_size"]
    )
    assert layout.page_bytes_per_layer == config["groups"][0]["page_size_bytes"]
    style = kv_tensor_style(f"vllm:{release}")
    assert list(kv_cache_tensor_bytes(layout, config["num_blocks"], style)) == result["kv_allocations"]
    assert snap.budget_verdict.kv_tensors == len(result["kv_allocations"])


# ---------------------------------------------------------------------------- KVGUARD_BUDGET=guard

# vLLM's budget does not fit: the profile's reserved peak outgrows the allocated one by 3 GiB, more
# than the 2% slack of utilization 0.98 leaves on 80 GiB.
OVERCOMMITTED = {"profile_unreusable_bytes": 3 * GIB, "gpu_memory_utilization": 0.98}


def kvguard_lines(result) -> list[str]:
    return [line.split("kvguard-log ", 1)[1] for line in result["log_lines"] if "kvguard-log " in line]


@pytest.mark.parametrize("release", RELEASES)
def test_kvguard_budget_guard_shrinks_a_budget_the_guard_predicts_does_not_fit(release, tmp_path_factory):
    # 0.34: with its extensible KV cache off (vLLM's --no-enable-extensible-kv-cache), one backing tensor.
    scenario = {
        **OVERCOMMITTED,
        **({"enable_extensible_kv_cache": False} if era_for(release).extensible_kv_cache_default else {}),
    }
    stock, stock_snap, _ = run(release, tmp_path_factory, scenario=scenario)
    guarded, snap, _ = run(release, tmp_path_factory, scenario=scenario, budget="guard")
    if stock_snap.budget_verdict.state != "critical":
        pytest.skip(f"vLLM {release}'s own budget fits this scenario by the guard's prediction")
    assert guarded["returned_available_bytes"] < stock["returned_available_bytes"]
    assert guarded["kv_cache_config"]["num_blocks"] < stock["kv_cache_config"]["num_blocks"]
    # What vLLM then allocated is what the guard predicted fits.
    assert snap.budget_verdict.state != "critical"
    [line] = [text for text in kvguard_lines(guarded) if "KVGUARD_BUDGET=guard" in text]
    assert line.startswith("kvguard: KV cache budget ") and "instead of vLLM's" in line
    assert "projected_peak_exceeds_capacity" in line
    # Hands-off by default: the stock run logged no change.
    assert not [text for text in kvguard_lines(stock) if "KVGUARD_BUDGET" in text]


@pytest.mark.parametrize("release", ["0.9.0", "0.11.0", "0.34.0"])
def test_kvguard_budget_guard_keeps_a_budget_that_fits(release, tmp_path_factory):
    scenario = {} if release == "0.11.0" else {"gpu_memory_utilization": 0.9}
    stock, _, _ = run(release, tmp_path_factory, scenario=scenario)
    guarded, _, _ = run(release, tmp_path_factory, scenario=scenario, budget="guard")
    assert guarded["returned_available_bytes"] == stock["returned_available_bytes"]
    assert committed(guarded) == committed(stock)
    [line] = [text for text in kvguard_lines(guarded) if "KVGUARD_BUDGET=guard" in text]
    expected = (
        "changes nothing here: vLLM's extensible KV cache is sized after warm-up"
        if era_for(release).extensible_kv_cache_default
        else "keeps vLLM's KV cache budget"
    )
    assert expected in line


@pytest.mark.parametrize("logo", ["logo", "no logo"])
@pytest.mark.parametrize("release", RELEASES)
def test_the_release_s_own_version_banners_name_its_row(release, logo):
    # tests/upstream/vllm_real/banner_main.py logs, through the release's own logger, the banners its own code writes:
    # the V1 engine's, the API server's where it is inline, and log_version_and_model's (0.20+; its plain
    # "vLLM server version X, serving model M" with VLLM_DISABLE_LOG_LOGO=1, else the logo, also coloured).
    python = envs.env_python(release)
    if python is None:
        pytest.skip(f"vLLM {release}: its environment is not set up (./dev.sh test builds it)")
    env = {"VLLM_LOGGING_LEVEL": "INFO", "PATH": "/usr/bin:/bin"}
    if logo == "no logo":
        env["VLLM_DISABLE_LOG_LOGO"] = "1"
    proc = subprocess.run(
        [str(python), str(envs.HERE / "banner_main.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    banners = [
        line
        for line in lines
        if f"(v{release})" in line
        or f"version {release}" in line
        or f"version \x1b[97;1m{release}" in line
        or f"version \x1b[1m{release}" in line
    ]
    assert banners, lines[-20:]
    log = parse_lines(lines)
    assert log.era == era_for(release).name, log.era_reason
    assert f"it states vLLM {release} (its version banner)" == log.era_reason
    # Each kind of banner alone: the engine's, the API server's, the logo's (plain and coloured).
    kinds = {
        "engine": [line for line in lines if "LLM engine (v" in line],
        "server": [line for line in lines if "server version" in line],
        "logo": [line for line in lines if "\u2580\u2584\u2580" in line],
    }
    assert kinds["engine"]
    if era_for(release).first >= (0, 20, 0):  # log_version_and_model, from 0.20
        assert kinds["logo" if logo == "logo" else "server"]
    for kind, only in kinds.items():
        if only:
            assert parse_lines(only).era == era_for(release).name, (kind, only)
