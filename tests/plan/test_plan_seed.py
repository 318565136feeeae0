"""`kvguard plan` on the seed's own numbers (issue 33): devices plan with the total their runtime reports, the
seed's two published runs as regression targets, HCCL's buffers outside the allocator, and vLLM's refusal of a
max_model_len above the derived one, in vLLM's words (checked against the real vLLM 0.11.0 wheel).

The seed published, for vllm-mindspore 0.2.0 on 64 GB 910Bs (docs/explanation/seed-story.md; tests/plan/test_plan.py's
DeepSeek-V3 command): Qwen2.5-7B-Instruct TP1, 37.85 GiB / 44,292 blocks with vLLM's stock (allocated-peak)
formula and 36.40 GiB / 42,593 with the reserved fix; DeepSeek-V3 TP16, 9.13 GiB / 8,719 and 8.54 GiB / 8,150.
Those figures are the expected values here; nothing is copied from plan's output.
"""

import dataclasses
import json
import os
import re
import subprocess

import pytest
from click.testing import CliRunner
from conftest import DATA, EXAMPLES
from test_plan import DEEPSEEK_V3, SEED_DSV3

from kvguard.budget.estimator import Profile, estimate
from kvguard.cli import main
from kvguard.plan.devices import DEVICES, resolve_device
from kvguard.plan.max_len import derived_max_model_len

GIB = 1 << 30
MIB = 1 << 20
QWEN = os.path.join(EXAMPLES, "qwen2.5-7b-instruct")
REAL = os.path.join(DATA, "logs", "real")
# The seed's Qwen command: TP1, 32768 tokens; vllm-mindspore 0.2.0 runs vLLM 0.7.3's V0 engine, whose profile
# run takes max(max_model_len, 2048) = 32768 batched tokens without chunked prefill (vllm/config.py 0.7.3:1528-1536)
# and 256 sequences (EngineArgs.max_num_seqs).
SEED_QWEN = (
    "vllm-mindspore",
    "serve",
    "Qwen/Qwen2.5-7B-Instruct",
    "--max-model-len",
    "32768",
    "--max-num-batched-tokens",
    "32768",
    "--max-num-seqs",
    "256",
)
PUBLISHED = {
    "qwen": {"stock": (37.85, 44292), "reserved": (36.40, 42593)},
    "dsv3": {"stock": (9.13, 8719), "reserved": (8.54, 8150)},
}


def read(path):
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def plan_json(*args, code=0):
    result = CliRunner().invoke(main, ["plan", "--json", *args])
    assert result.exit_code == (0 if code is None else code), result.output
    return json.loads(result.output)


def both_formulas(out):
    """(GiB, blocks) with vLLM's stock formula (allocated peak) and with vllm-mindspore 0.2.0's reserved fix,
    from the plan's one predicted profile."""
    profile = Profile.from_dict(out["profile"])
    block = out["block_bytes"]
    figures = {}
    for name, formula in (("stock", "peak"), ("reserved", "mindspore_reserved")):
        kv = estimate(dataclasses.replace(profile, formula=formula)).stock.kv_cache_bytes
        figures[name] = (kv / GIB, kv // block)
    return figures


@pytest.fixture(scope="module")
def seed_plans(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv3") / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    qwen = plan_json(
        "--device", "910B", "--vllm-version", "vllm-mindspore:0.2.0", "--model-config", QWEN, "--", *SEED_QWEN
    )
    dsv3 = plan_json(
        "--device", "910B", "--vllm-version", "vllm-mindspore:0.2.0", "--model-config", str(path), "--", *SEED_DSV3
    )
    return {"qwen": qwen, "dsv3": dsv3}


def within(model, formula, seed_plans, tolerance):
    gib, blocks = both_formulas(seed_plans[model])[formula]
    published_gib, published_blocks = PUBLISHED[model][formula]
    assert abs(gib - published_gib) / published_gib < tolerance, (model, formula, gib, published_gib)
    assert abs(blocks - published_blocks) / published_blocks < tolerance, (model, formula, blocks, published_blocks)


# ----------------------------------------------------------------------------------------- devices


def test_a_910b_plans_with_the_total_its_runtime_reports_in_a_real_log():
    totals = set(re.findall(r"total memory: (\d+)", read(os.path.join(REAL, "r39.log"))))
    assert totals == {str(resolve_device("910B").memory_bytes)}
    stated = re.search(r"([0-9.]+) GiB total capacity", read(os.path.join(REAL, "r47.log")))[1]
    assert f"{resolve_device('910B').memory_bytes / GIB:.2f}" == stated


def test_an_a100_80gb_plans_with_the_total_vllm_printed_for_one():
    stated = re.search(r"Free memory on device \([0-9.]+/([0-9.]+) GiB\)", read(os.path.join(REAL, "r43.log")))[1]
    assert f"{resolve_device('A100').memory_bytes / GIB:.2f}" == stated


def test_every_named_device_plans_below_its_spec_size_and_keeps_the_spec_as_a_label():
    for device in DEVICES:
        spec_gb = int(re.match(r"(\d+) GB", device.label)[1])
        assert device.label and device.label_source and device.source
        if device.source.startswith("NOT CITED"):
            continue
        # The runtime never reports the spec's "GB" read as GiB.
        assert device.memory_bytes < spec_gb * GIB, device.name


def test_plan_budgets_from_the_reported_total(seed_plans):
    out = seed_plans["qwen"]
    assert out["plan"]["device"]["memory_bytes"] == 65_452_113_920
    assert out["plan"]["device"]["label"] == "64 GB HBM"
    assert out["profile"]["total_memory_bytes"] == 65_452_113_920


# ----------------------------------------------------------------------------------------- the seed's runs


def test_seed_qwen_reserved_fix_within_2_percent_of_published(seed_plans):
    within("qwen", "reserved", seed_plans, 0.02)


@pytest.mark.xfail(
    strict=True,
    reason="the workload model's allocated peak at 32768 tokens (3.69 GiB) is above what "
    "the published pair implies on a 60.96 GiB device (at most 2.82 GiB with any "
    "non-torch increase): MindSpore's allocated statistic is not modelled; "
    "-2.3% today (docs/how-to/plan.md)",
)
def test_seed_qwen_stock_formula_within_2_percent_of_published(seed_plans):
    within("qwen", "stock", seed_plans, 0.02)


@pytest.mark.parametrize("formula", ["stock", "reserved"])
def test_seed_deepseek_v3_within_10_percent_of_published(seed_plans, formula):
    within("dsv3", formula, seed_plans, 0.10)


def test_dsv3_weights_per_rank_are_what_the_seed_releases_mindformers_loader_holds(seed_plans):
    """vllm-mindspore 0.2.0 serves DeepSeek-V3 only through MindFormers (registry.py r0.2:32-42), from the published
    W8A8 recipe (predict_deepseek3_671b_w8a8.yaml @ MindFormers 5b25f655: vocab_emb_dp False, quant_method ptq).
    Each tensor one rank holds at TP 16, written from the loader (deepseekv3_weight_processor.py r0.2) and
    create_ptq (deepseek_v3.py r0.2:150-165), not from plan's code."""
    tp, hidden, vocab = 16, 7168, 129280
    bf16, int8 = 2, 1
    per_row = 4 + 4  # int32 quant_bias + fp32 deq_scale per output row (attention, :428-506)
    per_tensor = bf16 + int8  # one input_scale and one int8 input_offset (attention, :435-447)

    def attention(k, n, beta):  # int8 weight, its per-row and per-tensor extras, a bf16 beta per input column
        return k * n * int8 + n * per_row + per_tensor + (k * bf16 if beta else 0)

    def feed_forward(k, n):  # int8 weight, a bf16 weight_scale per output row (:115-399)
        return k * n * int8 + n * bf16

    total = vocab * hidden * bf16  # tok_embeddings, whole on every rank (:401-408; VocabEmbedding)
    total += hidden * bf16 + (vocab // tp) * hidden * bf16  # final norm; lm_head split by rows, bf16 (:410-425)
    for layer in range(61):
        total += (2 * hidden + 1536 + 512) * bf16  # input, post-attention, q_a and kv_a layernorms
        total += attention(hidden, 1536, True)  # q_a_proj (q2l), replicated
        total += attention(hidden, 512 + 64, True)  # kv_a_proj_with_mqa (kv2l), replicated
        total += attention(1536, 128 * (128 + 64) // tp, True)  # q_b_proj (l2q), split by rows
        total += 512 * 128 * (128 + 128) // tp * bf16  # kv_b_proj (lkv2kv): blacklisted, bf16
        total += attention(128 * 128 // tp, hidden, False)  # o_proj (wo), split by columns
        if layer < 3:  # first_k_dense_replace
            total += feed_forward(hidden, 2 * 18432 // tp) + feed_forward(18432 // tp, hidden)
        else:
            total += 256 * hidden * bf16 + 256 * 4  # router (bf16 nn.Dense) and its fp32 e_score_correction_bias
            total += 256 * (feed_forward(hidden, 2 * 2048 // tp) + feed_forward(2048 // tp, hidden))  # all 256
            total += feed_forward(hidden, 2 * 2048 // tp) + feed_forward(2048 // tp, hidden)  # the shared expert
    weights = seed_plans["dsv3"]["plan"]["weights"]
    assert weights["weight_dtype"] == "mindformers ptq int8 (W8A8)"
    assert weights["bytes"] == total  # 42.06 GiB; 40.18 counted as vLLM's fp8 model, before issue 33's rule


def test_only_the_mindformers_only_architectures_of_0_2_x_take_mindformers_path(seed_plans, tmp_path):
    # Qwen2 has a native model in 0.2.0 (registry.py r0.2:32-35), the default backend: its plan is vLLM's.
    assert seed_plans["qwen"]["plan"]["weights"]["weight_dtype"] == "bfloat16"
    # vllm-mindspore 0.5.1 (V1, native DeepSeek): the checkpoint's own fp8, vLLM's vocab-parallel embedding.
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    later = plan_json(
        "--device", "910B", "--vllm-version", "vllm-mindspore:0.5.1", "--model-config", str(path), "--", *SEED_DSV3
    )
    assert later["plan"]["weights"]["weight_dtype"] == "fp8"
    assert later["plan"]["weights"]["bytes"] < seed_plans["dsv3"]["plan"]["weights"]["bytes"] - GIB
    # Another model of the architecture (a 16B MoE's shape) has no published recipe at that commit: read as
    # vLLM's model, as its config.json says, on 0.2.0 too (review: the 671B's W8A8 recipe halved its weights).
    small = {**DEEPSEEK_V3, "hidden_size": 2048, "num_hidden_layers": 27, "n_routed_experts": 64}
    small.pop("quantization_config")
    path.write_text(json.dumps(small))
    flags = ("--device", "910B", "--model-config", str(path), "--", "vllm", "serve", "m", "--tensor-parallel-size", "2")
    seed_release, later_release = (
        plan_json("--vllm-version", f"vllm-mindspore:{release}", *flags) for release in ("0.2.0", "0.5.1")
    )
    assert seed_release["plan"]["weights"]["weight_dtype"] == "bfloat16"
    assert seed_release["plan"]["weights"]["bytes"] == later_release["plan"]["weights"]["bytes"]


def test_simulate_with_the_seed_release_holds_the_same_weights_as_plan(seed_plans, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    flags = "--allocator mindspore --vllm-mindspore-version 0.2.0 --tensor-parallel-size 16 --requests 1"
    command = ["simulate", "--json", "--model-config", str(path), "--total-memory", "65452113920B", *flags.split()]
    result = CliRunner().invoke(main, command)
    assert result.exit_code in (0, 1), result.output
    simulated = json.loads(result.output)["profile"]["weights_bytes"]
    assert simulated == seed_plans["dsv3"]["profile"]["weights_bytes"]


def test_the_seed_block_sizes_are_the_published_ones(seed_plans):
    # 37.85 GiB / 44,292 blocks and 9.13 GiB / 8,719 blocks: the published pairs fix each block's bytes.
    assert abs(37.85 * GIB / 44292 - seed_plans["qwen"]["block_bytes"]) / seed_plans["qwen"]["block_bytes"] < 1e-3
    assert abs(9.13 * GIB / 8719 - seed_plans["dsv3"]["block_bytes"]) / seed_plans["dsv3"]["block_bytes"] < 1e-3


# ----------------------------------------------------------------------------------------- outside the allocator


def test_hccl_buffers_at_tp16_are_three_communicators_of_twice_200_mb(seed_plans):
    non_torch = seed_plans["dsv3"]["plan"]["non_torch"]
    # vLLM's world and TP groups of 16 ranks, and MindFormers' own TP group (deepseek3_model_infer.py
    # 5b25f655:1105-1114, made eagerly by parallel_state.py :237-330), which the network's all-reduces run on.
    assert non_torch["collective_buffers"]["communicators"] == 3
    assert non_torch["increase_bytes"] == 3 * 2 * 200 * MIB
    assert seed_plans["dsv3"]["profile"]["non_torch_increase_bytes"] == 3 * 2 * 200 * MIB


def test_hccl_buffsize_in_the_command_sizes_the_buffers(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    out = plan_json(
        "--device",
        "910B",
        "--vllm-version",
        "vllm-mindspore:0.2.0",
        "--model-config",
        str(path),
        "--",
        "HCCL_BUFFSIZE=100",
        *SEED_DSV3,
    )
    assert out["plan"]["non_torch"]["increase_bytes"] == 3 * 2 * 100 * MIB


def test_no_collective_buffers_at_tp1_nor_in_a_v1_budget(seed_plans):
    assert seed_plans["qwen"]["plan"]["non_torch"]["increase_bytes"] == 0
    out = plan_json(
        "--device",
        "910B",
        "--vllm-version",
        "vllm-mindspore:0.5.1",
        "--model-config",
        QWEN,
        "--",
        "vllm-mindspore",
        "serve",
        "Q",
        "-tp",
        "2",
        "--max-model-len",
        "8192",
    )
    assert out["plan"]["non_torch"]["collective_buffers"]["counted_in_budget"] is False
    assert out["plan"]["non_torch"]["increase_bytes"] == 0


# ----------------------------------------------------------------------------------------- vLLM's refusals


def test_max_model_len_above_the_derived_one_is_refused_in_vllms_words():
    result = CliRunner().invoke(
        main,
        [
            "plan",
            "--device",
            "H100",
            "--vllm-version",
            "0.11.0",
            "--model-config",
            QWEN,
            "--",
            "vllm",
            "serve",
            "Q",
            "--max-model-len",
            "200000",
        ],
    )
    assert result.exit_code == 2, result.output  # vLLM would refuse to start
    assert "starts" not in result.output
    assert (
        "User-specified max_model_len (200000) is greater than the derived max_model_len "
        "(max_position_embeddings=32768 or model_max_length=None in model's config.json)"
    ) in result.output


def test_vllm_allow_long_max_model_len_lets_it_start():
    out = plan_json(
        "--device",
        "H100",
        "--vllm-version",
        "0.11.0",
        "--model-config",
        QWEN,
        "--",
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1",
        "vllm",
        "serve",
        "Q",
        "--max-model-len",
        "40000",
    )
    assert not any(r["code"] == "max_model_len_above_derived" for r in out["plan"]["refusals"])


def test_vllm_mindspore_0_2_0_refuses_in_vllm_0_7_3s_words():
    out = plan_json(
        "--device",
        "910B",
        "--vllm-version",
        "vllm-mindspore:0.2.0",
        "--model-config",
        QWEN,
        "--",
        "vllm-mindspore",
        "serve",
        "Q",
        "--max-model-len",
        "65536",
        code=2,
    )
    refusal = out["plan"]["refusals"][0]
    assert refusal["cite"].startswith("vllm/config.py 0.7.3")
    assert refusal["message"].endswith(
        "This may lead to incorrect model outputs or CUDA errors. To allow "
        "overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
    )


ORACLE_CONFIGS = [
    {"model_type": "qwen2", "max_position_embeddings": 32768},
    {
        "model_type": "qwen2",
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    },
    {
        "model_type": "llama",
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    {"model_type": "gpt2", "n_positions": 1024, "max_position_embeddings": 2048},
    {
        "model_type": "deepseek_v3",
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
]
ORACLE = r"""
import json, sys, types
from vllm.config.model import _get_and_verify_max_len
from vllm.transformers_utils.config import patch_rope_scaling_dict
out = []
for fields in json.load(sys.stdin):
    # The attributes vLLM reads, as its config loader leaves them (patch_rope_scaling: "type" -> "rope_type").
    config = types.SimpleNamespace(**fields)
    if getattr(config, "rope_scaling", None):
        patch_rope_scaling_dict(config.rope_scaling)
    derived = _get_and_verify_max_len(config, None, None, False, None)
    try:
        _get_and_verify_max_len(config, None, 10**7, False, None)
        message = None
    except ValueError as exc:
        message = str(exc)
    out.append([derived, message])
print(json.dumps(out))
"""


def test_derived_length_and_refusal_match_the_real_vllm_0_11_0():
    """The wheel's _get_and_verify_max_len on the same configs (its environment from ./dev.sh test)."""
    envs = pytest.importorskip("vllm_real.envs")
    python = envs.env_python("0.11.0")
    if python is None:
        pytest.skip("vLLM 0.11.0's environment is not set up (./dev.sh test)")
    run = subprocess.run(
        [str(python), "-c", ORACLE], input=json.dumps(ORACLE_CONFIGS), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    from kvguard.plan.max_len import max_len_refusal

    for fields, (derived, message) in zip(ORACLE_CONFIGS, json.loads(run.stdout.splitlines()[-1])):
        assert int(derived_max_model_len(fields)[1]) == derived, fields
        assert max_len_refusal(fields, 10**7, {}, (0, 11, 0))["message"] == message, fields


# ----------------------------------------------------------------------------------------- --block-size


def test_a_block_size_outside_the_parsers_choices_is_refused_before_anything_starts():
    result = CliRunner().invoke(
        main,
        [
            "plan",
            "--device",
            "H100",
            "--vllm-version",
            "0.11.0",
            "--model-config",
            QWEN,
            "--",
            "vllm",
            "serve",
            "Q",
            "--block-size",
            "24",
            "--max-model-len",
            "8192",
        ],
    )
    assert result.exit_code == 2, result.output  # vLLM would refuse to start
    assert "starts" not in result.output
    assert (
        "vllm serve: error: argument --block-size: invalid choice: 24 (choose from 1, 8, 16, 32, 64, 128)"
        in result.output
    )


@pytest.mark.parametrize(
    "release,block,refused",
    [("0.11.0", 256, True), ("0.14.0", 256, False), ("0.20.0", 24, False), ("vllm-mindspore:0.2.0", 1, True)],
)
def test_the_block_size_choices_follow_the_release(release, block, refused):
    device = "910B" if "mindspore" in release else "H100"
    out = plan_json(
        "--device",
        device,
        "--vllm-version",
        release,
        "--model-config",
        QWEN,
        "--",
        "vllm",
        "serve",
        "Q",
        "--block-size",
        str(block),
        "--max-model-len",
        "8192",
        code=2 if refused else None,
    )
    codes = [r["code"] for r in out["plan"]["refusals"]]
    assert ("block_size_invalid_choice" in codes) == refused


BLOCK_ORACLE = r"""
import sys
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()     # the parser asks for a platform; no device here
from vllm.engine.arg_utils import EngineArgs
from vllm.utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm serve")
EngineArgs.add_cli_args(parser)
parser.parse_args(["--block-size", "24"])
"""


def test_the_block_size_refusal_is_the_real_vllm_0_11_0_parsers():
    envs = pytest.importorskip("vllm_real.envs")
    python = envs.env_python("0.11.0")
    if python is None:
        pytest.skip("vLLM 0.11.0's environment is not set up (./dev.sh test)")
    run = subprocess.run([str(python), "-c", BLOCK_ORACLE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    from kvguard.plan.block_size import block_size_refusal

    assert block_size_refusal(24, (0, 11, 0), "vllm serve")["message"] == run.stderr.strip().splitlines()[-1]


def test_a_rope_factor_that_is_not_a_number_is_a_one_line_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                **json.loads(read(os.path.join(QWEN, "config.json"))),
                "rope_scaling": {"rope_type": "yarn", "factor": "4x"},
            }
        )
    )
    result = CliRunner().invoke(
        main, ["plan", "--device", "H100", "--model-config", str(path), "--", "vllm", "serve", "Q"]
    )
    assert result.exit_code == 65, result.output
    assert result.output.strip().splitlines() == ["Error: model config: rope_scaling.factor is not a number ('4x')"]
