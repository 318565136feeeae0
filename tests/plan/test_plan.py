"""`kvguard plan`: the seed's two serve commands planned in one command each, the decided budget equal to
`kvguard budget --profile`'s for the same profile (one formula), vLLM's flag spellings, and one-line errors."""

import json
import os

import pytest
from click.testing import CliRunner
from conftest import DATA, EXAMPLES
from helpers import one_line_error

from kvguard.cli import main
from kvguard.plan.command import CommandError, human_readable_int, parse_serve_command
from kvguard.plan.devices import DeviceError, resolve_device

GIB = 1 << 30
QWEN = os.path.join(EXAMPLES, "qwen2.5-7b-instruct")
SEED_PROFILE = os.path.join(EXAMPLES, "qwen2.5-7b-910b-profile.json")
LLAMA3_8B = os.path.join(DATA, "configs", "llama-3-8b-instruct")
MANIFEST = os.path.join(DATA, "logs", "real", "MANIFEST.json")

# DeepSeek-V3's architecture as its Hugging Face config.json states it (deepseek-ai/DeepSeek-V3, the fields a
# plan reads; the file itself is not committed).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "first_k_dense_replace": 3,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}
# The seed's DeepSeek-V3 command, as posted.
SEED_DSV3 = (
    "vllm",
    "serve",
    "deepseek-ai/DeepSeek-V3",
    "--tensor-parallel-size",
    "16",
    "--max-num-seqs=192",
    "--max_model_len=32768",
    "--max-num-batched-tokens=16384",
    "--gpu-memory-utilization=0.9",
)


def read(path):
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def run(*args):
    return CliRunner().invoke(main, list(args))


def plan_json(*args, code=0):
    result = run("plan", "--json", *args)
    assert result.exit_code == code, result.output
    return json.loads(result.output)


@pytest.fixture
def dsv3(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    return str(path)


# ----------------------------------------------------------------------------------------- the seed's commands


def test_seed_qwen_7b_on_a_64_gib_910b_is_one_command():
    out = plan_json("--device", "910B", "--", "vllm-mindspore", "serve", QWEN, "--max-model-len", "32768")
    plan = out["plan"]
    assert out["era"]["project"] == "vllm-mindspore" and plan["release_source"] == "default"
    assert plan["device"]["memory_bytes"] == 65_452_113_920  # what its runtime reports (tests/plan/test_plan_seed.py)
    assert plan["will_start"] and plan["refusals"] == []
    # vllm-mindspore 0.5's block size (platforms/ascend.py:92-94 @ 0.5.1), not a constant of plan's.
    assert plan["settings"]["block_size"] == {"value": 128, "source": "the default of vllm-mindspore 0.5.0+"}
    decided = plan["decided"]
    assert decided["num_blocks"] == decided["kv_cache_bytes"] // out["block_bytes"]
    assert decided["max_concurrency"] == decided["num_blocks"] / (32768 // 128)
    # Qwen2.5-7B-Instruct's safetensors index states total_size 15,231,233,024 bytes (bf16; the bundled profile's
    # weights): the seed published no weights line, and the example log is constructed, not evidence.
    assert abs(plan["weights"]["bytes"] - 15_231_233_024) / 15_231_233_024 < 0.02
    assert any("not measured" in note for note in plan["uncertainty"])


def test_seed_deepseek_v3_tp16_on_a_64_gib_910b_is_one_command(dsv3):
    out = plan_json(
        "--device", "910B", "--model-config", dsv3, "--vllm-version", "vllm-mindspore:0.2.0", "--", *SEED_DSV3
    )
    plan = out["plan"]
    settings = {name: row["value"] for name, row in plan["settings"].items()}
    assert settings == {
        "tensor_parallel_size": 16,
        "max_model_len": 32768,
        "max_num_seqs": 192,
        "max_num_batched_tokens": 16384,
        "gpu_memory_utilization": 0.9,
        "block_size": 16,
        "kv_cache_dtype": "auto",
        "kv_cache_memory_bytes": None,
        "dtype": "auto",
    }
    # vllm-mindspore 0.2.0 serves DeepSeek-V3 only through MindFormers, whose published recipe is golden-stick's
    # int8 W8A8 (kvguard.sim.mindformers), whatever the fp8 config.json says: 910B has no fp8.
    assert plan["weights"]["weight_dtype"] == "mindformers ptq int8 (W8A8)"
    assert plan["weights"]["tensor_parallel_size"] == 16
    # One MLA latent per token (512 + 64, bf16) on 61 layers: the block the seed's published 8719 blocks in
    # 9.13 GiB were counted in (9.13 GiB / 8719 = 1.1244 MB a block).
    assert out["block_bytes"] == 61 * 16 * (512 + 64) * 2
    assert abs(9.13 * GIB / 8719 - out["block_bytes"]) / out["block_bytes"] < 1e-3
    assert out["layout"]["is_mla"] and out["layout"]["num_kv_heads"] == 1
    assert plan["will_start"]
    decided = plan["decided"]
    assert decided["num_tokens"] == decided["num_blocks"] * 16
    assert decided["max_concurrency"] == decided["num_blocks"] / 2048
    assert plan["activation_peak"]["max_num_batched_tokens"] == 16384


def test_text_summary_is_one_screen(dsv3):
    result = run(
        "plan",
        "--device",
        "910B",
        "--model-config",
        dsv3,
        "--vllm-version",
        "vllm-mindspore:0.2.0",
        "--",
        *SEED_DSV3,
        "--trust-remote-code",
        "--port",
        "8000",
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) <= 24
    assert lines[0].endswith("ignored: --trust-remote-code --port")
    assert any(line.startswith("KV cache ") for line in lines)
    assert any(line.startswith("Outcome      vLLM starts") for line in lines)


# ----------------------------------------------------------------------------------------- one formula

RELEASES = [
    ("vllm-mindspore:0.2.0", "910B"),
    ("vllm-mindspore:0.5.1", "910B"),
    ("0.11.0", "H100"),
    ("0.14.0", "A100-40GB"),
    ("0.20.0", "H200"),
    ("0.27.0", "H100"),
    ("0.34.0", "H100"),
    ("vllm-ascend:0.17.0rc1", "910B"),
    ("vllm-ascend:0.18.0", "910B4"),
    ("vllm-ascend-310p:0.18.0", "910B"),
]


@pytest.mark.parametrize("release,device", RELEASES)
def test_decided_budget_is_budget_profiles_for_the_same_profile(tmp_path, release, device):
    out = plan_json(
        "--device",
        device,
        "--vllm-version",
        release,
        "--model-config",
        LLAMA3_8B,
        "--",
        "vllm",
        "serve",
        "meta-llama/Meta-Llama-3-8B",
        "--max-model-len",
        "8192",
    )
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(out["profile"]))
    budget = run(
        "budget",
        "--json",
        "--profile",
        str(profile),
        "--vllm-version",
        release,
        "--model-config",
        LLAMA3_8B,
        "--max-model-len",
        "8192",
        "--block-size",
        str(out["layout"]["block_size"]),
    )
    assert budget.exit_code == 0, budget.output
    decided = dict(out["plan"]["decided"])
    assert decided.pop("formula") == out["era"]["formula"]
    assert decided == json.loads(budget.output)["budgets"]["stock"]


def test_a_measured_profile_decides_budget_profiles_budget():
    # The seed's measured profile (Qwen2.5-7B on a 64 GiB 910B): vllm-mindspore 0.2.0's fix gave 42593
    # blocks where the stock formula gave 44292 (the seed's figures).
    args = ("--profile", SEED_PROFILE, "--vllm-version", "vllm-mindspore:0.2.0", "--model-config", QWEN)
    out = plan_json(*args, "--", "vllm", "serve", "Qwen/Qwen2.5-7B-Instruct", "--max-model-len", "32768")
    assert out["plan"]["decided"]["num_blocks"] == 42593
    budget = run(
        "budget",
        "--json",
        "--profile",
        SEED_PROFILE,
        "--vllm-version",
        "vllm-mindspore:0.2.0",
        "--model-config",
        QWEN,
        "--max-model-len",
        "32768",
    )
    assert budget.exit_code == 0, budget.output
    decided = dict(out["plan"]["decided"])
    decided.pop("formula")
    assert decided == json.loads(budget.output)["budgets"]["stock"]


# ----------------------------------------------------------------------------------------- weights vs real logs


def test_weights_against_the_real_logs_that_state_them():
    """Meta-Llama-3-8B (r01 TP1, r38 TP2: vLLM's "Loading model weights took ... GB", GiB): within 2%.
    Held-out logs are not used."""
    logs = {entry["id"]: entry for entry in json.loads(read(MANIFEST))["logs"]}
    for log_id, tp in (("r01", 1), ("r38", 2)):
        entry = logs[log_id]
        assert not entry["held_out"]
        assert "Meta-Llama-3-8B" in read(os.path.join(DATA, "logs", "real", f"{log_id}.log"))
        out = plan_json(
            "--device",
            "H100",
            "--vllm-version",
            "0.11.0",
            "--model-config",
            LLAMA3_8B,
            "--",
            "vllm",
            "serve",
            "meta-llama/Meta-Llama-3-8B",
            f"-tp={tp}",
            "--max-model-len",
            "8192",
        )
        stated = entry["expect"]["weights_gib"] * GIB
        error = (out["plan"]["weights"]["bytes"] - stated) / stated
        assert abs(error) < 0.02, (log_id, error)


# ----------------------------------------------------------------------------------------- flag spellings


@pytest.mark.parametrize(
    "words",
    [
        ["vllm", "serve", "M", "--max-model-len", "4096", "--tensor-parallel-size", "2"],
        ["vllm", "serve", "M", "--max_model_len=4096", "--tensor_parallel_size=2"],
        ["vllm", "serve", "M", "--max-model-len=4K", "-tp", "2"],
        ["vllm", "serve", "--model", "M", "--max_model_len", "4096", "-tp=2"],
        [
            "python3",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model=M",
            "--max-model-len",
            "4096",
            "--tensor-parallel-size=2",
        ],
        [
            "VLLM_USE_V1=1",
            "/usr/bin/python",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            "M",
            "--max-model-len",
            "4096",
            "--tensor_parallel_size",
            "2",
        ],
    ],
)
def test_vllm_spellings_read_the_same(words):
    command = parse_serve_command(words)
    assert command.model == "M"
    assert command.flags == {"max-model-len": 4096, "tensor-parallel-size": 2}
    assert command.ignored == ()


def test_vllm_mindspore_entry_points_name_their_project():
    for words in (
        ["vllm-mindspore", "serve", "M"],
        ["python", "-m", "vllm_mindspore.entrypoints", "vllm.entrypoints.openai.api_server", "--model", "M"],
    ):
        command = parse_serve_command(words)
        assert (command.project, command.model) == ("vllm-mindspore", "M")


def test_unknown_flags_are_ignored_and_listed():
    command = parse_serve_command(
        [
            "vllm",
            "serve",
            "M",
            "--host",
            "0.0.0.0",
            "--trust-remote-code",
            "--served-model-name=x",
            "--max-num-seqs",
            "8",
            "--enforce-eager",
        ]
    )
    assert command.flags == {"max-num-seqs": 8}
    assert command.ignored == ("--host", "--trust-remote-code", "--served-model-name", "--enforce-eager")
    command = parse_serve_command(
        ["vllm", "serve", "M", "--served-model-name", "a", "b", "--seed", "-1", "--block-size", "32"]
    )
    assert (command.flags, command.ignored) == ({"block-size": 32}, ("--served-model-name", "--seed"))


def test_human_readable_ints_are_vllms():
    # engine/arg_utils.py 0.11.0:1740-1778: decimal lower-case, binary upper-case.
    assert [human_readable_int(t) for t in ("1k", "1K", "25.6k", "2M", "4096")] == [1000, 1024, 25600, 2 << 20, 4096]


def test_defaults_come_from_the_release_row():
    out = plan_json(
        "--device",
        "H100",
        "--vllm-version",
        "0.20.0",
        "--model-config",
        LLAMA3_8B,
        "--",
        "vllm",
        "serve",
        "M",
        "--max-model-len",
        "8192",
    )
    settings = out["plan"]["settings"]
    # vLLM 0.20's 0.92 (config/cache.py 0.20.0:66) and vllm-ascend's 128-token blocks are rows' cells.
    assert settings["gpu_memory_utilization"] == {"value": 0.92, "source": "the default of vllm 0.20.0–0.26.0"}
    out = plan_json(
        "--device",
        "910B",
        "--vllm-version",
        "vllm-ascend:0.18.0",
        "--model-config",
        LLAMA3_8B,
        "--",
        "vllm",
        "serve",
        "M",
        "--max-model-len",
        "8192",
    )
    assert out["plan"]["settings"]["block_size"]["value"] == 128
    assert out["plan"]["settings"]["gpu_memory_utilization"]["value"] == 0.9


def test_devices_by_name_and_size():
    # The runtime's reported totals (plan/devices.py cites each): torch's "total capacity of 139.80 GiB" on an
    # H200, below the 141 GB of its spec sheet, which stays the label.
    assert resolve_device("h200").memory_bytes == round(139.80 * GIB)
    assert resolve_device("h200").label == "141 GB HBM3e"
    assert resolve_device("910b4").memory_bytes == 31_662_800_896
    assert resolve_device("910b4").label == "32 GB HBM"
    assert resolve_device("A100") == resolve_device("A100-80GB")
    assert resolve_device("48GiB", "ascend").platform == "ascend"
    with pytest.raises(DeviceError):
        resolve_device("TPU-v9")


# ----------------------------------------------------------------------------------------- refusals


def test_heads_not_divisible_is_vllms_refusal():
    result = run(
        "plan",
        "--json",
        "--device",
        "H100",
        "--vllm-version",
        "0.11.0",
        "--model-config",
        LLAMA3_8B,
        "--",
        "vllm",
        "serve",
        "M",
        "-tp",
        "3",
    )
    assert result.exit_code == 2, result.output  # vLLM would refuse to start
    refusal = json.loads(result.output)["plan"]["refusals"][0]
    assert refusal["message"] == ("Total number of attention heads (32) must be divisible by tensor parallel size (3).")


def test_kv_cache_too_small_for_max_model_len_is_vllms_refusal():
    result = run(
        "plan",
        "--json",
        "--device",
        "32GiB",
        "--vllm-version",
        "vllm-ascend:0.18.0",
        "--model-config",
        LLAMA3_8B,
        "--",
        "vllm",
        "serve",
        "M",
        "--max-model-len",
        "8192",
        "--gpu-memory-utilization",
        "0.5",
    )
    assert result.exit_code == 2, result.output  # vLLM would refuse to start
    out = json.loads(result.output)
    assert [r["code"] for r in out["plan"]["refusals"]] == ["kv_cache_too_small"]
    message = out["plan"]["refusals"][0]["message"]
    # vLLM 0.11.0's words (kv_cache_utils.py:703-722), "models's" and all; 8192 tokens of Llama-3-8B's
    # 128 KiB a token (32 layers x 8 KV heads x 128 x 2 x 2 B) are 1.00 GiB.
    assert message.startswith(
        "To serve at least one request with the models's max seq len (8192), (1.00 GiB KV "
        "cache is needed, which is larger than the available KV cache memory ("
    )
    decided = out["plan"]["decided"]
    assert f"the estimated maximum model length is {decided['num_tokens']}." in message
    assert decided["num_tokens"] < 8192


def test_free_memory_below_the_request_is_vllms_refusal():
    result = run(
        "plan",
        "--json",
        "--device",
        "910B",
        "--vllm-version",
        "vllm-ascend:0.18.0",
        "--model-config",
        LLAMA3_8B,
        "--",
        "vllm",
        "serve",
        "M",
        "--max-model-len",
        "8192",
        "--gpu-memory-utilization",
        "0.99",
    )
    assert result.exit_code == 2, result.output  # vLLM would refuse to start
    refusal = json.loads(result.output)["plan"]["refusals"][0]
    assert refusal["code"] == "free_below_request"
    # A 910B reports 65,452,113,920 B (60.96 GiB); 1 GiB outside the allocator leaves 59.96; 0.99 of it is 60.35.
    assert refusal["message"].startswith(
        "Free memory on device (59.96/60.96 GiB) on startup is less than desired "
        "GPU memory utilization (0.99, 60.35 GiB)."
    )


# ----------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "tail,words",
    [
        (["--max-model-len", "abc"], "--max-model-len: 'abc' is not valid"),
        (["--gpu-memory-utilization=1.5"], "--gpu-memory-utilization: '1.5' is not valid (must be in (0, 1])"),
        (["--max-num-seqs", "0"], "--max-num-seqs: '0' is not valid"),
        (["--dtype", "int3"], "--dtype: 'int3' is not valid"),
        (["--max-model-len"], "--max-model-len needs a value"),
        (["--max-model-len", "1.5K"], "--max-model-len: '1.5K' is not valid (decimals"),
    ],
)
def test_malformed_values_are_one_line(tail, words):
    result = run("plan", "--device", "H100", "--model-config", LLAMA3_8B, "--", "vllm", "serve", "M", *tail)
    assert words in one_line_error(result, code=64)  # a malformed vLLM flag: usage, as vLLM's argparse says


# 64: the command line (plan's flags, the serve command after --); 65: what plan cannot use or predict.
@pytest.mark.parametrize(
    "args,words,code",
    [
        (["--device", "H100", "--model-config", LLAMA3_8B, "--", "vllm", "run", "M"], "not a vLLM serve command", 64),
        (["--device", "H100", "--", "vllm", "serve", "/nowhere/model"], "give --model-config PATH", 65),
        (["--device", "TPU", "--model-config", LLAMA3_8B, "--", "vllm", "serve", "M"], "unknown --device", 64),
        (["--model-config", LLAMA3_8B, "--", "vllm", "serve", "M"], "give --device", 65),
        (
            [
                "--device",
                "H100",
                "--vllm-version",
                "vllm-ascend:0.18.0",
                "--model-config",
                LLAMA3_8B,
                "--",
                "vllm",
                "serve",
                "M",
            ],
            "runs on Ascend devices, not on H100",
            65,
        ),
        (
            ["--device", "H100", "--vllm-version", "0.6.4", "--model-config", LLAMA3_8B, "--", "vllm", "serve", "M"],
            "plan does not predict",
            65,
        ),
        (
            ["--device", "H100", "--vllm-version", "banana", "--model-config", LLAMA3_8B, "--", "vllm", "serve", "M"],
            "not a release",
            64,
        ),
        (
            ["--device", "H100", "--model-config", LLAMA3_8B, "--", "vllm", "serve", "M", "-pp", "2"],
            "--pipeline-parallel-size above 1",
            65,
        ),
        (["--device", "H100", "--model-config", LLAMA3_8B, "--"], "no serve command", 64),
    ],
)
def test_bad_input_is_one_line(args, words, code):
    assert words in one_line_error(run("plan", *args), code=code)


def test_parser_errors_are_command_errors():
    with pytest.raises(CommandError):
        parse_serve_command(["vllm", "serve", "M", "stray"])


def test_kv_cache_memory_bytes_fixes_the_budget():
    out = plan_json(
        "--device",
        "H100",
        "--vllm-version",
        "0.14.0",
        "--model-config",
        LLAMA3_8B,
        "--",
        "vllm",
        "serve",
        "M",
        "--max-model-len",
        "8192",
        "--kv-cache-memory-bytes",
        "8G",
    )
    decided = out["plan"]["decided"]
    assert decided["kv_cache_bytes"] == 8 << 30
    # Llama-3-8B: 32 layers x 8 KV heads x (128 + 128) x 2 B x 16 tokens = 2 MiB a block.
    assert (out["block_bytes"], decided["num_blocks"]) == (2 << 20, 4096)


def test_unset_batch_flags_take_vllms_serve_defaults_for_the_device():
    # engine/arg_utils.py 0.11.0:1605-1623: 8192 tokens / 1024 sequences from 70 GiB (not an A100), else 2048 / 256.
    for device, expected in (("H100", (8192, 1024)), ("A100", (2048, 256)), ("910B", (2048, 256))):
        release = "0.11.0" if device != "910B" else "vllm-ascend:0.18.0"
        settings = plan_json(
            "--device",
            device,
            "--vllm-version",
            release,
            "--model-config",
            LLAMA3_8B,
            "--",
            "vllm",
            "serve",
            "M",
            "--max-model-len",
            "8192",
        )["plan"]["settings"]
        assert (settings["max_num_batched_tokens"]["value"], settings["max_num_seqs"]["value"]) == expected


# ----------------------------------------------------------------------------------------- whether it fits

LLAMA_SERVE = ("--", "vllm", "serve", "meta-llama/Meta-Llama-3-8B", "--max-model-len", "8192")


def test_the_budget_time_verdict_is_budget_allocators_for_the_same_profile(tmp_path):
    out = plan_json("--device", "H100", "--vllm-version", "0.11.0", "--model-config", LLAMA3_8B, *LLAMA_SERVE)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(out["profile"]))
    budget = run(
        "budget",
        "--json",
        "--profile",
        str(profile),
        "--vllm-version",
        "0.11.0",
        "--model-config",
        LLAMA3_8B,
        "--max-model-len",
        "8192",
        "--allocator",
        "torch",
    )
    assert budget.exit_code == 0, budget.output
    assert out["plan"]["at_budget"]["verdict"] == json.loads(budget.output)["at_budget"]["verdict"]


def test_a_plan_that_starts_but_will_not_fit_says_so_and_exits_0():
    args = (
        "--device",
        "H100",
        "--vllm-version",
        "0.11.0",
        "--model-config",
        LLAMA3_8B,
        *LLAMA_SERVE,
        "--gpu-memory-utilization",
        "0.99",
    )
    plan = plan_json(*args)["plan"]
    assert plan["will_start"] and not plan["will_fit"]
    verdict = plan["at_budget"]["verdict"]
    assert verdict["state"] == "critical" and verdict["headroom_bytes"] < 0
    # The largest KV cache that fits is below what vLLM decided.
    assert plan["at_budget"]["largest_fitting_kv_cache_bytes"] < plan["decided"]["kv_cache_bytes"]
    text = run("plan", *args)
    assert text.exit_code == 0, text.output
    assert "Outcome      vLLM's checks pass, but it will not fit: the budget-time verdict is CRITICAL" in text.output


def test_the_serving_run_is_the_planned_one():
    plan = plan_json("--device", "910B", "--", "vllm-mindspore", "serve", QWEN, "--max-model-len", "32768")["plan"]
    serving = plan["serving"]
    # vllm-mindspore's formula takes the reserved peak, so the simulated run budgets with it; the cache it
    # sized is the one the plan decided, and the run kept below the device.
    assert serving["budget"] == "reserved"
    assert serving["kv_cache_bytes"] == plan["decided"]["kv_cache_bytes"]
    assert not serving["oom"] and serving["requests_finished"] == serving["requests"]
    assert 0 < serving["margin_bytes"] == plan["device"]["memory_bytes"] - serving["device_peak_used_bytes"]
    assert plan["will_fit"]


def test_search_finds_the_highest_utilization_at_which_the_plan_fits_for_every_seed():
    base = ("--device", "H100", "--vllm-version", "0.11.0", "--model-config", LLAMA3_8B, *LLAMA_SERVE)
    found = plan_json("--search", "--seed", "0", "--seed", "1", *base)["plan"]["search"]
    best = found["gpu_memory_utilization"]
    assert found["seeds"] == [0, 1] and 0.5 < best <= found["serving_gpu_memory_utilization"] <= 1.0
    assert found["margin_bytes"] > 0 and found["kv_cache_memory_flag"] == "--kv-cache-memory-bytes"

    def plan_at(utilization, seed):
        return plan_json("--seed", str(seed), *base, "--gpu-memory-utilization", f"{utilization:.2f}")["plan"]

    # At the utilization found the plan fits for every seed, with the KV cache the search named; one step
    # above it, it does not for some seed (or the answer was the top).
    at_best = [plan_at(best, seed) for seed in (0, 1)]
    assert all(plan["will_fit"] for plan in at_best)
    assert at_best[0]["decided"]["kv_cache_bytes"] == found["kv_cache_memory_bytes"]
    assert found["margin_bytes"] == min(plan["serving"]["margin_bytes"] for plan in at_best)
    if best < 1.0:
        assert not all(plan_at(best + 0.01, seed)["will_fit"] for seed in (0, 1))
