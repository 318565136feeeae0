"""`kvguard budget` through the command line: its JSON interface and its errors."""

import json
import os

import pytest
from conftest import EXAMPLES, TESTS
from helpers import kvguard

QWEN = os.path.join(EXAMPLES, "qwen2.5-7b-instruct")
SEED_PROFILE = os.path.join(EXAMPLES, "qwen2.5-7b-910b-profile.json")
GIB = 1 << 30


def budget_json(*args):
    result = kvguard("budget", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_block_bytes_from_model_config():
    assert budget_json("--model-config", QWEN)["block_bytes"] == 917_504


def test_kv_cache_memory_gives_block_and_token_counts():
    out = budget_json("--model-config", QWEN, "--kv-cache-memory-bytes", str(44292 * 917_504))
    assert (out["num_blocks"], out["num_tokens"]) == (44292, 44292 * 16)


def test_kv_cache_memory_accepts_units():
    out = budget_json("--model-config", QWEN, "--kv-cache-memory-bytes", "37.85GiB")
    assert out["num_blocks"] == int(37.85 * GIB) // 917_504


def test_profile_file_gives_both_budgets_and_the_fix():
    out = budget_json("--model-config", QWEN, "--profile", SEED_PROFILE, "--max-model-len", "32768")
    stock, reserved = out["budgets"]["stock"], out["budgets"]["reserved"]
    assert (stock["num_blocks"], reserved["num_blocks"]) == (44292, 42593)
    assert set(stock) == {"kv_cache_bytes", "num_blocks", "num_tokens", "max_concurrency"}
    assert out["overcommit_bytes"] == stock["kv_cache_bytes"] - reserved["kv_cache_bytes"]
    assert out["recommended_gpu_memory_utilization"] == 0.87
    assert out["recommended_kv_cache_memory_bytes"] == reserved["kv_cache_bytes"]


def test_flags_build_the_same_profile_as_the_file():
    with open(SEED_PROFILE) as handle:
        p = json.load(handle)
    from_flags = budget_json(
        "--model-config",
        QWEN,
        "--total-memory",
        f"{p['total_memory_bytes']}B",
        "--gpu-memory-utilization",
        str(p["gpu_memory_utilization"]),
        "--weights",
        f"{p['weights_bytes']}B",
        "--peak-allocated-increase",
        f"{p['peak_allocated_increase_bytes']}B",
        "--peak-reserved-increase",
        f"{p['peak_reserved_increase_bytes']}B",
        "--non-torch-increase",
        f"{p['non_torch_increase_bytes']}B",
    )
    assert from_flags["budgets"] == budget_json("--model-config", QWEN, "--profile", SEED_PROFILE)["budgets"]


def test_flags_override_the_profile_file():
    out = budget_json("--model-config", QWEN, "--profile", SEED_PROFILE, "--gpu-memory-utilization", "0.8")
    assert out["profile"]["gpu_memory_utilization"] == 0.8


def test_from_log_stock_is_what_vllm_decided(data_path):
    out = budget_json("--model-config", QWEN, "--from-log", data_path("logs", "v1-tp2-debug.log"))
    stock = out["budgets"]["stock"]
    assert stock["kv_cache_bytes"] == round(37.85 * GIB)
    assert stock["num_tokens"] == 708_672 and stock["num_blocks"] == 708_672 // 16
    assert stock["max_concurrency"] == 21.63
    assert out["budgets"]["reserved"] is None  # the log never carries the reserved increase


def test_from_log_plus_reserved_increase_gives_the_reserved_budget(data_path):
    out = budget_json(
        "--model-config",
        QWEN,
        "--from-log",
        data_path("logs", "v1-tp2-debug.log"),
        "--peak-reserved-increase",
        "5.72GiB",
    )
    reserved = out["budgets"]["reserved"]
    assert reserved is not None
    assert out["overcommit_bytes"] == out["budgets"]["stock"]["kv_cache_bytes"] - reserved["kv_cache_bytes"]


def test_from_log_block_count_with_a_non_default_block_size(data_path):
    out = budget_json("--from-log", data_path("logs", "vllm-ascend-2025.log"), "--block-size", "128")
    assert out["budgets"]["stock"]["num_blocks"] == 708_608 // 128


def test_from_v0_log_uses_its_block_count(data_path):
    out = budget_json("--from-log", data_path("logs", "v0-late.log"))
    assert out["budgets"]["stock"]["num_blocks"] == 28_098
    assert out["block_bytes"] is None


def test_human_output_is_a_table():
    result = kvguard("budget", "--model-config", QWEN, "--profile", SEED_PROFILE, "--max-model-len", "32768")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert any(line.split()[:1] == ["stock"] and "44,292" in line for line in lines)
    assert any(line.split()[:1] == ["reserved"] and "42,593" in line for line in lines)
    assert any("--gpu-memory-utilization 0.87" in line for line in lines)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model-config", "/nonexistent/model"], "model config not found"),
        (["--model-config", "{bad}"], "not found"),
        (["--profile", "/nonexistent.json"], "profile file not found"),
        (["--model-config", QWEN, "--kv-cache-memory-bytes", "-5GiB"], "negative"),
        (["--model-config", QWEN, "--kv-cache-memory-bytes", "lots"], "not a size"),
        (["--model-config", QWEN, "--kv-cache-memory-bytes", "3 parsecs"], "unknown size unit"),
        (["--model-config", QWEN, "--kv-cache-dtype", "int3"], "int3"),
        (
            [
                "--total-memory",
                "64GiB",
                "--gpu-memory-utilization",
                "1.5",
                "--weights",
                "1GiB",
                "--peak-allocated-increase",
                "1GiB",
                "--non-torch-increase",
                "1GiB",
            ],
            "must be in (0, 1]",
        ),
        (["--total-memory", "64GiB", "--gpu-memory-utilization", "0.9"], "incomplete profile: missing --weights"),
        ([], "nothing to compute"),
        (["--kv-cache-memory-bytes", "1GiB"], "needs --model-config"),
    ],
)
def test_bad_input_is_one_line_error_without_traceback(args, message):
    result = kvguard("budget", *args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert message in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.startswith("Error")]) == 1


def test_malformed_and_incomplete_config_files_are_one_line_errors(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 4096,')
    result = kvguard("budget", "--model-config", str(tmp_path))
    assert result.returncode == 65 and "not valid JSON" in result.stderr and "Traceback" not in result.stderr
    (tmp_path / "config.json").write_text('{"hidden_size": 4096, "torch_dtype": "bfloat16"}')
    result = kvguard("budget", "--model-config", str(tmp_path))
    assert result.returncode == 65 and "no layer count" in result.stderr


def test_profile_file_with_bad_values_is_one_line_error(tmp_path):
    with open(SEED_PROFILE) as handle:
        data = json.load(handle)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**data, "gpu_memory_utilization": 0}))
    result = kvguard("budget", "--profile", str(path))
    assert result.returncode == 65 and "gpu_memory_utilization must be in (0, 1]" in result.stderr
    path.write_text("[]")
    result = kvguard("budget", "--profile", str(path))
    assert result.returncode == 65 and "must be a JSON object" in result.stderr


def test_log_with_nothing_usable_is_one_line_error(data_path):
    result = kvguard("budget", "--from-log", data_path("logs", "garbage.log"))
    assert result.returncode == 65
    assert "no vLLM startup memory lines" in result.stderr and "Traceback" not in result.stderr


def test_log_that_is_not_a_regular_file_is_one_line_error(tmp_path):
    fifo = tmp_path / "vllm.log"
    os.mkfifo(fifo)  # no writer: opening it the ordinary way would wait forever
    result = kvguard("budget", "--from-log", str(fifo))
    assert result.returncode == 65
    assert result.stderr == f"Error: cannot read log file {fifo}: not a regular file\n"


def test_overlong_number_in_a_log_is_one_line(tmp_path):
    log = tmp_path / "huge.log"
    log.write_text("INFO [gpu_worker.py:227] Available KV cache memory: " + "7" * 400 + " GiB\n")
    result = kvguard("budget", "--from-log", str(log))
    assert result.returncode == 65
    assert (
        result.stderr == f"Error: log file {log}: line 1: number 777777777777… (400 characters) is too long "
        "for a memory figure\n"
    )


def test_tensor_parallel_size_vllm_refuses_is_vllms_one_line():
    result = kvguard("budget", "--model-config", QWEN, "-tp", "3")
    assert result.returncode == 65
    assert (
        result.stderr == "Error: Total number of attention heads (28) must be divisible by tensor parallel size (3).\n"
    )


def test_era_picks_the_formula_and_the_flag_names():
    common = (
        "--model-config",
        QWEN,
        "--total-memory",
        "64GiB",
        "--weights",
        "14.19GiB",
        "--peak-allocated-increase",
        "4.27GiB",
        "--peak-reserved-increase",
        "5.72GiB",
        "--non-torch-increase",
        "1.3GiB",
        "--gpu-memory-utilization",
        "0.9",
    )
    old, new = budget_json(*common, "--vllm-version", "0.13.0"), budget_json(*common, "--vllm-version", "0.14.0")
    assert (old["era"]["formula"], new["era"]["formula"]) == ("peak", "peak_ceil")
    assert new["budgets"]["stock"]["kv_cache_bytes"] - old["budgets"]["stock"]["kv_cache_bytes"] in (0, 1)
    assert new["vllm_version"] == "0.14.0"
    assert new["recommended_flags"][1].startswith("--kv-cache-memory-bytes ")


def test_0_34_defaults_block_size_64_and_the_extensible_utilization():
    out = budget_json(
        "--model-config",
        QWEN,
        "--vllm-version",
        "0.34.0",
        "--total-memory",
        "80GiB",
        "--weights",
        "15GiB",
        "--init-free-memory",
        "79GiB",
        "--free-after-warmup",
        "60GiB",
        "--kv-committed",
        "1GiB",
        "--kv-transient-peak",
        "2GiB",
        "--torch-reserve-growth",
        "3GiB",
    )
    assert out["layout"]["block_size"] == 64
    assert out["profile"]["formula"] == "extensible" and out["profile"]["gpu_memory_utilization"] == 1.0
    assert out["overcommit_bytes"] == 0 and out["reserved_counts"].startswith("nothing")


def test_mla_block_size_follows_vllm_on_cuda(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(
        '{"num_hidden_layers": 27, "num_attention_heads": 16, "kv_lora_rank": 512, '
        '"qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}'
    )
    forced = budget_json("--model-config", str(config), "--vllm-version", "0.11.0", "--block-size", "16")
    kept = budget_json("--model-config", str(config), "--vllm-version", "0.20.0", "--block-size", "16")
    default = budget_json("--model-config", str(config), "--vllm-version", "0.20.0")
    assert (forced["layout"]["block_size"], kept["layout"]["block_size"], default["layout"]["block_size"]) == (
        64,
        16,
        64,
    )


def test_an_older_release_than_the_table_is_a_usage_error():
    result = kvguard("budget", "--model-config", QWEN, "--vllm-version", "0.5.0")
    assert result.returncode == 64 and "older than kvguard's era table" in result.stderr


def test_consumed_era_profile_missing_an_input_names_its_flag():
    result = kvguard(
        "budget",
        "--vllm-version",
        "0.27.0",
        "--total-memory",
        "80GiB",
        "--weights",
        "15GiB",
        "--total-consumed",
        "17GiB",
    )
    assert result.returncode == 64 and "--transient-peak-headroom" in result.stderr


# ------------------------------------------------------------------ the budget-time verdict (--allocator)


def test_allocator_predicts_the_kv_placement_on_mindspores_pool_without_vmm():
    data = budget_json("--model-config", QWEN, "--profile", SEED_PROFILE, "--allocator", "mindspore", "--no-enable-vmm")
    at = data["at_budget"]
    verdict = at["verdict"]
    assert (at["allocator"], at["enable_vmm"], at["tensor_style"]) == ("mindspore", False, "per_layer_k_v")
    assert at["kv_cache_bytes"] == data["budgets"]["stock"]["kv_cache_bytes"]
    assert verdict["phase"] == "budget" and verdict["state"] == "critical"
    assert verdict["reasons"][0]["code"] == "kv_cache_placement_fails"
    assert verdict["kv_tensors"] == 2 * 28 and verdict["kv_tensors_placed"] < verdict["kv_tensors"]
    # The largest budget that fits is smaller than vLLM's, and judged on its own it is not critical.
    fits = at["largest_fitting_kv_cache_bytes"]
    assert 0 < fits < at["kv_cache_bytes"]
    again = budget_json(
        "--model-config",
        QWEN,
        "--profile",
        SEED_PROFILE,
        "--allocator",
        "mindspore",
        "--no-enable-vmm",
        "--gpu-memory-utilization",
        "0.5",
    )
    assert again["at_budget"]["verdict"]["state"] != "critical"


def test_allocator_with_vmm_places_pages_and_the_log_needs_only_what_it_lacks():
    log = os.path.join(EXAMPLES, "vllm-mindspore-qwen2.5-7b.log")
    data = budget_json(
        "--model-config",
        QWEN,
        "--from-log",
        log,
        "--total-memory",
        "64GiB",
        "--gpu-memory-utilization",
        "0.9",
        "--allocator",
        "mindspore",
    )
    at = data["at_budget"]
    assert at["enable_vmm"] is True  # vllm-mindspore's env_setup turns VMM on
    assert at["verdict"]["state"] != "critical" and at["verdict"]["kv_placement_loss_bytes"] < 2 * GIB
    assert at["kv_cache_bytes"] == data["budgets"]["stock"]["kv_cache_bytes"]


def test_allocator_on_torch_counts_one_tensor_per_layer():
    data = budget_json(
        "--model-config", QWEN, "--profile", SEED_PROFILE, "--allocator", "torch", "--vllm-version", "0.11.0"
    )
    assert data["at_budget"]["tensor_style"] == "per_layer" and data["at_budget"]["verdict"]["kv_tensors"] == 28


def test_allocator_without_a_model_config_is_a_usage_error():
    result = kvguard("budget", "--profile", SEED_PROFILE, "--allocator", "torch")
    assert result.returncode == 64 and "--allocator needs --model-config" in result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------ an era input is refused, never dropped (issue 19)


def one_line_usage_error(result):
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert result.returncode == 64 and "Traceback" not in result.stderr and len(errors) == 1, result.stderr
    return errors[0]


@pytest.mark.parametrize(
    "release, missing",
    [
        # 0.27+ budget from total consumed and the transient peak (mu 0.27.0:317-326), which a peak profile lacks.
        ("0.34.0", "missing --total-consumed, --transient-peak-headroom"),
        ("0.27.0", "missing --total-consumed, --transient-peak-headroom"),
        # 0.20+ subtract the CUDA-graph estimate by default (envs.py 0.20.0:1725).
        ("0.20.0", "missing --cudagraph-memory"),
        # vllm-ascend 0.15-0.17 also subtract the non-torch memory present at startup (worker.py 0.17.0rc1:339-366).
        ("vllm-ascend:0.17.0", "missing --non-torch-cleared"),
    ],
)
def test_a_profile_file_the_era_cannot_budget_is_refused_not_dropped(release, missing):
    result = kvguard("budget", "--profile", SEED_PROFILE, "--model-config", QWEN, "--vllm-version", release)
    assert missing in one_line_usage_error(result)


def test_0_34_names_the_extensible_inputs_as_the_alternative():
    result = kvguard("budget", "--profile", SEED_PROFILE, "--vllm-version", "0.34.0")
    assert "--init-free-memory" in one_line_usage_error(result)


@pytest.mark.parametrize("release", ["0.9.0", "0.6.4", "vllm-ascend:0.11.0"])
def test_an_increase_from_a_profile_file_is_not_taken_for_the_absolute_non_torch_memory(release):
    # The seed's profile holds the non-torch increase; these eras add the absolute memory (w 0.9.0:167-214).
    result = kvguard("budget", "--profile", SEED_PROFILE, "--vllm-version", release)
    assert "give it as --non-torch-memory" in one_line_usage_error(result)
    with open(SEED_PROFILE) as handle:
        absolute = json.load(handle)["non_torch_increase_bytes"] + GIB
    out = budget_json("--profile", SEED_PROFILE, "--vllm-version", release, "--non-torch-memory", f"{absolute}B")
    assert out["profile"]["non_torch_increase_bytes"] == absolute


@pytest.mark.parametrize(
    "args, unread",
    [
        (["--vllm-version", "0.11.0", "--cudagraph-memory", "1GiB"], "does not read --cudagraph-memory"),
        (["--vllm-version", "0.13.0", "--non-torch-cleared", "1GiB"], "does not read --non-torch-cleared"),
        (["--vllm-version", "0.11.0", "--total-consumed", "1GiB"], "does not read --total-consumed"),
        (["--vllm-version", "vllm-ascend:0.18.0", "--init-free-memory", "60GiB"], "does not read --init-free-memory"),
    ],
)
def test_a_flag_the_era_does_not_read_is_refused(args, unread):
    result = kvguard("budget", "--profile", SEED_PROFILE, *args)
    assert unread in one_line_usage_error(result)


def test_a_profile_files_figure_the_chosen_era_does_not_read_is_refused(tmp_path):
    with open(SEED_PROFILE) as handle:
        profile = {**json.load(handle), "formula": "peak_ceil_cudagraph", "cudagraph_memory_bytes": GIB}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    assert budget_json("--profile", str(path), "--vllm-version", "0.20.0")["profile"]["cudagraph_memory_bytes"] == GIB
    result = kvguard("budget", "--profile", str(path), "--vllm-version", "0.11.0")
    assert "does not read the profile file's cudagraph_memory_bytes" in one_line_usage_error(result)


def test_extensible_kv_cache_before_0_34_is_refused():
    result = kvguard("budget", "--vllm-version", "0.27.0", "--extensible-kv-cache")
    assert "--extensible-kv-cache is vLLM 0.34+'s" in one_line_usage_error(result)


def test_a_flag_beside_a_log_without_its_profile_is_refused_not_dropped():
    # The seed's log states the decided budget, not the profile: a reserved increase alone cannot be used.
    log = os.path.join(EXAMPLES, "vllm-mindspore-qwen2.5-7b.log")
    result = kvguard("budget", "--from-log", log, "--peak-reserved-increase", "5.72GiB")
    assert "incomplete profile" in one_line_usage_error(result)


# ------------------------------------------------------------------ the seed's release


def test_budget_accepts_the_seed_release_simulate_takes_and_gives_the_seeds_figure():
    """vllm-mindspore 0.2.0 (PR !428): the seed reported Qwen2.5-7B's 37.85 GiB / 44292 blocks becoming
    36.40 GiB / 42593 with 16-token blocks."""
    out = budget_json("--profile", SEED_PROFILE, "--model-config", QWEN, "--vllm-version", "vllm-mindspore:0.2.0")
    assert (out["layout"]["block_size"], out["budgets"]["stock"]["num_blocks"]) == (16, 42593)
    assert round(out["budgets"]["stock"]["kv_cache_bytes"] / GIB, 2) == 36.40
    sim = kvguard(
        "simulate", "--vllm-mindspore-version", "0.2.0", "--allocator", "mindspore", "--requests", "1", "--json"
    )
    assert sim.returncode == 0, sim.stderr


def test_the_absolute_non_torch_memory_is_printed_as_what_it_is():
    result = kvguard(
        "budget",
        "--vllm-version",
        "0.9.0",
        "--total-memory",
        "80GiB",
        "--weights",
        "15GiB",
        "--peak-allocated-increase",
        "2GiB",
        "--non-torch-memory",
        "1GiB",
    )
    assert result.returncode == 0 and "non-torch memory 1.00 GiB" in result.stdout
    assert "non-torch increase" not in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--no-enable-vmm"], "give --allocator too"),
        (["--non-allocator-memory", "1GiB"], "give --allocator too"),
        (["--allocator", "torch", "--enable-vmm"], "--allocator mindspore, not torch"),
        (["--allocator", "mindspore", "--expandable-segments"], "--allocator torch or torch_npu"),
    ],
)
def test_an_allocator_option_the_verdict_would_not_use_is_refused(args, message):
    result = kvguard("budget", "--model-config", QWEN, "--profile", SEED_PROFILE, *args)
    assert message in one_line_usage_error(result)


def test_a_vllm_version_the_log_s_lines_rule_out_is_said_not_taken_silently():
    # r02 states V0's "can use total_gpu_memory (…) x gpu_memory_utilization" lines: vLLM 0.6.4-0.8.4.
    log = os.path.join(TESTS, "data", "logs", "real", "r02.log")
    contradicted = kvguard("budget", "--from-log", log, "--vllm-version", "0.14.0")
    assert (
        "--vllm-version 0.14.0 is the row vllm 0.14.0–0.17.1, but the log's lines fit only vllm 0.6.4–0.8.4"
        in contradicted.stderr
    )
    agreed = kvguard("budget", "--from-log", log, "--vllm-version", "0.8.0")
    assert agreed.returncode == 0 and "fit only" not in agreed.stderr
