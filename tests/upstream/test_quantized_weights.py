"""Weights as the checkpoint stores them (issue 33, item 2): kvguard.sim.quantization against vLLM's own loader.

The oracle is the real vLLM 0.11.0 wheel (its environment from ./dev.sh test, tests/upstream/vllm_real/envs.py): each
quantized linear method's ``create_weights`` runs on CPU for a layer shape, and the bytes of the parameters it
registers are what kvguard must count, to the byte. Only the device calls are patched: the tensor-parallel
group (rank 0 of a group of the case's size), the GPU's compute capability (9.0, an H100) and the Marlin kernel
choice that capability gives (the choice itself asks ``is_cuda``, which would load the CUDA extension).
GGUF's block sizes come from the gguf-py package in the same environment, the table vLLM's GGUF method reads.
"""

import json
import os
import subprocess

import pytest
from click.testing import CliRunner
from conftest import EXAMPLES

from kvguard.budget.estimator import ConfigError
from kvguard.cli import main
from kvguard.sim.quantization import (
    GGML_BLOCKS,
    Linear,
    gguf_file_type,
    use_more_bits,
    weight_format,
    with_quantization_flag,
)
from kvguard.sim.workload import model_shape, weight_tensors

GIB = 1 << 30
QWEN = os.path.join(EXAMPLES, "qwen2.5-7b-instruct")


def qwen_config():
    with open(os.path.join(QWEN, "config.json"), encoding="utf-8") as handle:
        return json.load(handle)


# The quantization_config blocks as their producers write them: AutoAWQ's (Qwen/Qwen2.5-7B-Instruct-AWQ,
# Qwen/QwQ-32B-AWQ), optimum / AutoGPTQ's (Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4; the fields vLLM reads), and
# fp8 block-wise (deepseek-ai/DeepSeek-V3).
AWQ = {
    "bits": 4,
    "group_size": 128,
    "modules_to_not_convert": None,
    "quant_method": "awq",
    "version": "gemm",
    "zero_point": True,
}
GPTQ = {"bits": 4, "group_size": 128, "desc_act": False, "sym": True, "quant_method": "gptq"}
GPTQ_ACT = {**GPTQ, "desc_act": True}
FP8_BLOCK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
FP8_TENSOR = {"activation_scheme": "dynamic", "quant_method": "fp8"}
FP8_STATIC = {"activation_scheme": "static", "quant_method": "fp8"}

# (tensor-parallel size, input per rank, output partitions per rank, whole input): Qwen2.5-7B's qkv_proj,
# down_proj at TP1 and TP2, gate_up_proj at TP2, and a row-parallel 5120-wide layer at TP4.
SHAPES = [
    (1, 3584, [3584, 512, 512], 3584),
    (1, 18944, [3584], 18944),
    (2, 9472, [3584], 18944),
    (2, 3584, [9472, 9472], 3584),
    (4, 1280, [5120], 5120),
]
METHODS = [
    ("awq", AWQ),
    ("gptq", GPTQ),
    ("gptq", GPTQ_ACT),
    ("gptq_marlin", GPTQ),
    ("gptq_marlin", GPTQ_ACT),
    ("fp8", FP8_BLOCK),
    ("fp8", FP8_TENSOR),
    ("fp8", FP8_STATIC),
]
CASES = [
    {"method": method, "quant": quant, "tp": tp, "k": k, "parts": parts, "k_full": k_full, "n_full": sum(parts) * tp}
    for method, quant in METHODS
    for tp, k, parts, k_full in SHAPES
]

ORACLE = r"""
import json, sys, types
import torch
from vllm.distributed import parallel_state
from vllm.platforms import current_platform, interface
type(current_platform).get_device_capability = classmethod(lambda cls, device_id=0: interface.DeviceCapability(9, 0))
from vllm.model_executor.layers.quantization.kernels.mixed_precision.marlin import MarlinLinearKernel
import vllm.model_executor.layers.quantization.gptq_marlin as gptq_marlin_module
gptq_marlin_module.choose_mp_linear_kernel = lambda config: MarlinLinearKernel
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.quantization.awq import AWQConfig, AWQLinearMethod
from vllm.model_executor.layers.quantization.gptq import GPTQConfig, GPTQLinearMethod
from vllm.model_executor.layers.quantization.gptq_marlin import GPTQMarlinConfig, GPTQMarlinLinearMethod
from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod
import gguf
METHODS = {"awq": (AWQConfig, AWQLinearMethod), "gptq": (GPTQConfig, GPTQLinearMethod),
           "gptq_marlin": (GPTQMarlinConfig, GPTQMarlinLinearMethod), "fp8": (Fp8Config, Fp8LinearMethod)}
out = []
with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
    for case in json.load(sys.stdin):
        parallel_state._TP = types.SimpleNamespace(world_size=case["tp"], rank_in_group=0)
        config, method = METHODS[case["method"]]
        layer = torch.nn.Module()
        method(config.from_config(case["quant"])).create_weights(
            layer, case["k"], case["parts"], case["k_full"], case["n_full"], torch.bfloat16,
            weight_loader=lambda *a, **k: None)
        out.append(sum(p.element_size() * p.numel() for p in layer.parameters()))
blocks = {t.name: list(gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGMLQuantizationType if t in gguf.GGML_QUANT_SIZES}
print("ORACLE " + json.dumps({"bytes": out, "ggml": blocks}))
"""


@pytest.fixture(scope="module")
def vllm_oracle():
    envs = pytest.importorskip("vllm_real.envs")
    python = envs.env_python("0.11.0")
    if python is None:
        pytest.skip("vLLM 0.11.0's environment is not set up (./dev.sh test)")
    run = subprocess.run(
        [str(python), "-c", ORACLE], input=json.dumps(CASES), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("ORACLE "))
    return json.loads(line[len("ORACLE ") :])


def kvguard_bytes(case):
    quant = dict(case["quant"], quant_method="gptq_marlin") if case["method"] == "gptq_marlin" else case["quant"]
    row = case["k"] != case["k_full"]
    linear = Linear(
        "model.layers.0.mlp.down_proj", case["k"], sum(case["parts"]), len(case["parts"]), case["k_full"], row
    )
    return weight_format({"quantization_config": quant}).linear_bytes(linear, 2)


@pytest.mark.parametrize(
    "index",
    range(len(CASES)),
    ids=[
        f"{c['method']}-{'act' if c['quant'].get('desc_act') else ''}"
        f"{c['quant'].get('activation_scheme', '')}"
        f"{'-block' if c['quant'].get('weight_block_size') else ''}-tp{c['tp']}-k{c['k']}-"
        f"n{sum(c['parts'])}"
        for c in CASES
    ],
)
def test_a_quantized_linear_holds_what_vllm_0_11_0_creates(vllm_oracle, index):
    assert kvguard_bytes(CASES[index]) == vllm_oracle["bytes"][index]


def test_ggml_block_sizes_are_gguf_py_s(vllm_oracle):
    for name, (elements, block_bytes) in GGML_BLOCKS.items():
        assert vllm_oracle["ggml"][name] == [elements, block_bytes], name


# ----------------------------------------------------------------------------------------- what stays full width


def test_embeddings_norms_and_lm_head_stay_in_the_model_dtype_under_awq():
    plain = weight_tensors(model_shape(qwen_config()))
    awq = weight_tensors(model_shape({**qwen_config(), "quantization_config": AWQ}))
    # embed_tokens first, lm_head last, a norm each side of every layer: untouched (awq.py 0.11.0:84-91 quantizes
    # LinearBase only).
    assert (awq[0], awq[-1], awq[1]) == (plain[0], plain[-1], plain[1])
    assert sum(awq) < 0.4 * sum(plain)


def test_modules_to_not_convert_keeps_those_modules_at_full_width():
    keep = {**qwen_config(), "quantization_config": {**AWQ, "modules_to_not_convert": ["mlp.down_proj"]}}
    d = 2
    down = Linear("model.layers.5.mlp.down_proj", 18944, 3584)
    assert model_shape(keep).weight_format.linear_bytes(down, d) == 18944 * 3584 * d
    up = Linear("model.layers.5.mlp.gate_up_proj", 3584, 2 * 18944, 2)
    assert model_shape(keep).weight_format.linear_bytes(up, d) < 3584 * 2 * 18944 * d / 3


def test_gptq_quantizes_lm_head_only_when_the_config_says_so():
    # GPTQConfig.from_config reads "lm_head" (gptq.py 0.11.0:122-123).
    plain = weight_tensors(model_shape({**qwen_config(), "quantization_config": GPTQ}))[-1]
    quantized = weight_tensors(model_shape({**qwen_config(), "quantization_config": {**GPTQ, "lm_head": True}}))[-1]
    assert plain == 152064 * 3584 * 2
    assert quantized < plain / 3


def test_compressed_tensors_ignore_list_and_regex_keep_layers_full_width():
    quant = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "ignore": ["lm_head", "re:.*layers\\.0\\..*"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True},
            }
        },
    }
    fmt = weight_format({"quantization_config": quant})
    first = Linear("model.layers.0.self_attn.qkv_proj", 3584, 4608, 3)
    later = Linear("model.layers.1.self_attn.qkv_proj", 3584, 4608, 3)
    assert fmt.linear_bytes(first, 2) == 3584 * 4608 * 2
    # W4A16 (compressed_tensors_wNa16.py 0.11.0:98-173): packed int4, bf16 group scales, weight_shape int64 x 2.
    assert fmt.linear_bytes(later, 2) == 3584 * 4608 // 2 + 4608 * (3584 // 128) * 2 + 16


def test_compressed_tensors_w8a8_int8_is_one_byte_a_weight_and_a_scale_a_row():
    quant = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {
                    "num_bits": 8,
                    "type": "int",
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                },
            }
        },
    }
    fmt = weight_format({"quantization_config": quant})
    # compressed_tensors_w8a8_int8.py 0.11.0:57-72: int8 N x K, fp32 N x 1 per-channel scales.
    assert fmt.linear_bytes(Linear("model.layers.3.mlp.down_proj", 28672, 8192), 2) == 28672 * 8192 + 4 * 8192


def test_bitsandbytes_4_bit_with_double_quant_and_a_skipped_module():
    quant = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_quant_type": "nf4",
        "llm_int8_skip_modules": ["o_proj"],
    }
    fmt = weight_format({"quantization_config": quant})
    up = Linear("model.layers.2.mlp.gate_up_proj", 4096, 2 * 14336, 2)
    weights = 4096 * 2 * 14336
    blocks = weights // 64
    assert fmt.linear_bytes(up, 2) == weights // 2 + blocks + 4 * -(-blocks // 256)
    assert fmt.linear_bytes(Linear("model.layers.2.self_attn.o_proj", 4096, 4096), 2) == 4096 * 4096 * 2


# ----------------------------------------------------------------------------------------- GGUF


def test_gguf_file_type_is_read_from_the_file_name():
    assert gguf_file_type("/models/Qwen2.5-7B-Instruct-Q4_K_M.gguf") == "Q4_K_M"
    assert gguf_file_type("./qwen2.5-7b-instruct-q8_0.gguf") == "Q8_0"
    assert gguf_file_type("Qwen/Qwen2.5-7B-Instruct") is None
    with pytest.raises(ConfigError, match="names no file type"):
        gguf_file_type("/models/model.gguf")


def test_llama_cpp_gives_half_of_attn_v_and_ffn_down_more_bits_in_the_m_mixes():
    # use_more_bits (llama.cpp src/llama-quant.cpp): the first and last eighth and every third layer between.
    assert [i for i in range(28) if use_more_bits(i, 28)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]


def test_gguf_q8_0_is_8_5_bits_a_weight_and_q4_k_m_stores_output_at_q6_k():
    config = qwen_config()
    q8 = model_shape(with_quantization_flag(config, None, "qwen2.5-7b-instruct-q8_0.gguf"))
    down = Linear("model.layers.9.mlp.down_proj", 18944, 3584, layer=9, layers=28)
    assert q8.weight_format.linear_bytes(down, 2) == 3584 * 18944 * 34 // 32
    q4 = model_shape(with_quantization_flag(config, None, "qwen2.5-7b-instruct-q4_k_m.gguf"))
    assert weight_tensors(q4)[-1] == 152064 * 3584 // 256 * 210  # output.weight at Q6_K
    assert weight_tensors(q4)[0] == 152064 * 3584 // 256 * 144  # token_embd at Q4_K


# ----------------------------------------------------------------------------------------- whole checkpoints

QWQ_32B_AWQ = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "num_attention_heads": 40,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": AWQ,
}


def test_qwq_32b_awq_at_tp2_within_5_percent_of_the_stated_9_10_gib():
    """Issue 33's real log: QwQ-32B-AWQ at TP2 states 9.10 GiB of weights a rank (plan said 30.51 before)."""
    weights = sum(weight_tensors(model_shape(QWQ_32B_AWQ, 2)))
    assert abs(weights / GIB - 9.10) / 9.10 < 0.05


def test_plan_counts_an_awq_checkpoint_packed_and_says_so(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**qwen_config(), "quantization_config": AWQ}))
    result = CliRunner().invoke(
        main,
        [
            "plan",
            "--json",
            "--device",
            "H100",
            "--vllm-version",
            "0.11.0",
            "--model-config",
            str(tmp_path),
            "--",
            "vllm",
            "serve",
            "Qwen/x-AWQ",
            "--max-model-len",
            "8192",
        ],
    )
    assert result.exit_code == 0, result.output
    weights = json.loads(result.output)["plan"]["weights"]
    assert weights["weight_dtype"] == "awq int4 g128"
    assert weights["bytes"] < 6 * GIB


def test_plan_reads_a_gguf_file_type_from_the_served_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(qwen_config()))
    result = CliRunner().invoke(
        main,
        [
            "plan",
            "--json",
            "--device",
            "H100",
            "--vllm-version",
            "0.11.0",
            "--model-config",
            str(tmp_path),
            "--",
            "vllm",
            "serve",
            "/models/qwen2.5-7b-instruct-q4_k_m.gguf",
            "--max-model-len",
            "8192",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["plan"]["weights"]["weight_dtype"] == "gguf Q4_K_M"


def plan_weights(tmp_path, config, *serve):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = CliRunner().invoke(
        main,
        [
            "plan",
            "--json",
            "--device",
            "H100",
            "--vllm-version",
            "0.11.0",
            "--model-config",
            str(tmp_path),
            "--",
            "vllm",
            "serve",
            *serve,
            "--max-model-len",
            "8192",
        ],
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["plan"]["weights"]


def test_quantization_flag_quantizes_an_unquantized_checkpoint_in_flight(tmp_path):
    plain = plan_weights(tmp_path, qwen_config(), "Qwen/Qwen2.5-7B-Instruct")
    fp8 = plan_weights(tmp_path, qwen_config(), "Qwen/Qwen2.5-7B-Instruct", "-q", "fp8")
    bnb = plan_weights(tmp_path, qwen_config(), "Qwen/Qwen2.5-7B-Instruct", "--quantization", "bitsandbytes")
    assert (fp8["weight_dtype"], bnb["weight_dtype"]) == ("fp8", "bitsandbytes int4")
    # Linear weights are 6.53e9 of Qwen2.5-7B's 7.62e9 parameters; embeddings and lm_head stay bf16.
    linear = 28 * (3584 * 4608 + 3584 * 3584 + 3 * 3584 * 18944)
    assert plain["bytes"] - fp8["bytes"] == pytest.approx(linear, rel=1e-4)
    assert bnb["bytes"] < fp8["bytes"]


def test_the_budget_counts_the_weights_the_flag_quantizes(tmp_path):
    """Found at the stop: the weights line applied --quantization, the simulated startup behind the KV budget read
    config.json without it (15.29 GB of weights in the profile against 8.71 in the line for Qwen2.5-7B fp8)."""
    plans = {}
    for name, flags in (("plain", ()), ("fp8", ("--quantization", "fp8"))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(qwen_config()))
        command = ["plan", "--json", "--device", "H100", "--vllm-version", "0.11.0", "--model-config"]
        result = CliRunner().invoke(main, [*command, str(tmp_path / name), "--", "vllm", "serve", "Q", *flags])
        assert result.exit_code == 0, result.output
        plans[name] = json.loads(result.output)
    for out in plans.values():  # the profile's weights are the line's, placed by the allocator (rounded up)
        line, profile = out["plan"]["weights"]["bytes"], out["profile"]["weights_bytes"]
        assert line <= profile < line * 1.01
    freed = plans["plain"]["plan"]["weights"]["bytes"] - plans["fp8"]["plan"]["weights"]["bytes"]
    gained = plans["fp8"]["plan"]["decided"]["kv_cache_bytes"] - plans["plain"]["plan"]["decided"]["kv_cache_bytes"]
    assert gained == pytest.approx(freed, rel=0.02)


def test_the_checkpoints_own_quantization_config_wins_over_the_flag(tmp_path):
    awq = plan_weights(tmp_path, {**qwen_config(), "quantization_config": AWQ}, "Qwen/x-AWQ", "-q", "awq_marlin")
    assert awq["weight_dtype"] == "awq int4 g128"


def test_golden_stick_w8a8_holds_int8_weights_and_its_per_row_and_per_column_tensors():
    # a8w8.py (vllm-mindspore 0.5.1):53-97: int8 weight, fp32 deq_scale and int32 quant_bias per output row;
    # golden-stick: a bf16 input_scale and an int8 input_offset per input column; ModelSlim: one of each and a
    # bf16 beta per input column.
    down = Linear("model.layers.3.mlp.down_proj", 1152, 7168, row_parallel=True)
    golden = weight_format({"quantization_config": {"quant_method": "golden-stick"}})
    assert golden.linear_bytes(down, 2) == 1152 * 7168 + 7168 * (4 + 4) + 1152 * (2 + 1)
    slim = weight_format({"quantization_config": {"quant_method": "modelslim"}})
    assert slim.linear_bytes(down, 2) == 1152 * 7168 + 7168 * (4 + 4) + 2 * 2 + 1152 * 2


def test_fp8_ignored_layers_skip_a_fused_module_by_its_checkpoint_parts():
    # is_layer_skipped (quantization/utils/quant_utils.py 0.11.0:265-304): qkv_proj is skipped when q, k and v are.
    ignored = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    fmt = weight_format({"quantization_config": {**FP8_TENSOR, "ignored_layers": ignored}})
    qkv0 = Linear("model.layers.0.self_attn.qkv_proj", 3584, 4608, 3)
    qkv1 = Linear("model.layers.1.self_attn.qkv_proj", 3584, 4608, 3)
    assert fmt.linear_bytes(qkv0, 2) == 3584 * 4608 * 2
    assert fmt.linear_bytes(qkv1, 2) == 3584 * 4608 + 4 * 3


def test_gguf_k_quant_rows_that_are_not_whole_blocks_fall_back():
    # llama_tensor_get_type's convert_incompatible_tensor: Q4_K -> Q5_0, Q6_K -> Q8_0 when a row is not 256-wide
    # blocks. Qwen2.5-32B's down_proj row (27648) is 108 blocks; a 27600-wide row is not.
    fmt = weight_format({"quantization_config": {"quant_method": "gguf", "file_type": "Q4_K_M"}})
    whole = Linear("model.layers.9.mlp.down_proj", 27648, 5120, layer=9, layers=64)
    ragged = Linear("model.layers.9.mlp.down_proj", 27600, 5120, layer=9, layers=64)
    assert (fmt.gguf_type(whole), fmt.gguf_type(ragged)) == ("Q4_K", "Q5_0")
    more_bits = Linear("model.layers.0.mlp.down_proj", 27600, 5120, layer=0, layers=64)
    assert fmt.gguf_type(more_bits) == "Q8_0"


def test_gguf_tied_embedding_is_stored_as_the_output():
    # Without an output tensor llama.cpp quantizes token_embd with the output's rule (Q6_K for K-quants).
    tied = model_shape(with_quantization_flag({**qwen_config(), "tie_word_embeddings": True}, None, "qwen-q4_k_m.gguf"))
    tensors = weight_tensors(tied)
    assert tensors[0] == 152064 * 3584 // 256 * 210
