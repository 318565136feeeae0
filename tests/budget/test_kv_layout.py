"""KV layout from real Hugging Face config.json files, as vLLM sizes a block."""

import json
import os

import pytest
from conftest import DATA, EXAMPLES

from kvguard.budget.estimator import ConfigError, kv_layout_from_config
from kvguard.budget.model_config import load_model_config

QWEN_7B = os.path.join(EXAMPLES, "qwen2.5-7b-instruct")


def config(name):
    return load_model_config(os.path.join(DATA, "configs", name))


def test_qwen25_7b_block_is_917504_bytes():
    layout = kv_layout_from_config(load_model_config(QWEN_7B))
    # 28 layers x 2 (K and V) x 16 tokens x 4 KV heads x 128 head size x 2 bytes (bf16)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_size, layout.dtype_bytes) == (28, 4, 128, 2)
    assert layout.block_bytes == 917_504


def test_seed_figure_44292_blocks_round_trips():
    layout = kv_layout_from_config(load_model_config(QWEN_7B))
    assert layout.num_blocks(44292 * 917_504) == 44292
    assert layout.num_blocks(44292 * 917_504 - 1) == 44291


def test_model_directory_or_file_path_both_load():
    assert load_model_config(QWEN_7B) == load_model_config(os.path.join(QWEN_7B, "config.json"))


def test_gqa_uses_num_key_value_heads_not_attention_heads():
    layout = kv_layout_from_config(config("llama-3-8b-instruct"))
    assert layout.num_kv_heads == 8
    assert layout.block_bytes == 32 * 2 * 16 * 8 * 128 * 2


def test_missing_num_key_value_heads_falls_back_to_attention_heads():
    cfg = config("llama-3-8b-instruct")
    del cfg["num_key_value_heads"]
    assert kv_layout_from_config(cfg).num_kv_heads == 32


def test_explicit_head_dim_wins_over_hidden_size_division():
    # Mistral-Nemo: hidden 5120 / 32 heads would be 160; the config says 128.
    layout = kv_layout_from_config(config("mistral-nemo-instruct-2407"))
    assert layout.head_size == 128
    assert layout.block_bytes == 40 * 2 * 16 * 8 * 128 * 2


def test_mla_stores_one_latent_per_token_without_factor_two():
    layout = kv_layout_from_config(config("deepseek-v2-lite-chat"))
    assert layout.is_mla and layout.num_kv_heads == 1
    assert layout.head_size == 512 + 64
    assert layout.block_bytes == 27 * 16 * 576 * 2


def test_mla_latent_is_not_split_by_tensor_parallelism():
    cfg = config("deepseek-v2-lite-chat")
    assert kv_layout_from_config(cfg, tensor_parallel_size=2).block_bytes == kv_layout_from_config(cfg).block_bytes


def test_mla_fp8_ds_mla_packs_656_bytes_per_token():
    layout = kv_layout_from_config(config("deepseek-v2-lite-chat"), kv_cache_dtype="fp8_ds_mla")
    assert layout.block_bytes == 27 * 16 * 656


def test_tensor_parallel_divides_kv_heads():
    layout = kv_layout_from_config(config("qwen2.5-72b-instruct"), tensor_parallel_size=4)
    assert layout.num_kv_heads == 2
    assert layout.block_bytes == 80 * 2 * 16 * 2 * 128 * 2


def test_tensor_parallel_beyond_kv_heads_replicates_one_head():
    layout = kv_layout_from_config(config("qwen2.5-72b-instruct"), tensor_parallel_size=16)
    assert layout.num_kv_heads == 1


def test_pipeline_parallel_takes_the_fullest_stage():
    # 32 layers over 3 stages: vLLM's partition is 11, 11, 10; the 11-layer stage sets the count.
    layout = kv_layout_from_config(config("llama-3-8b-instruct"), pipeline_parallel_size=3)
    assert layout.num_layers == 11
    assert layout.block_bytes == 11 * 2 * 16 * 8 * 128 * 2


def test_fp8_kv_cache_is_one_byte_per_element():
    layout = kv_layout_from_config(config("llama-3-8b-instruct"), kv_cache_dtype="fp8_e4m3")
    assert layout.dtype_bytes == 1
    assert layout.block_bytes == 32 * 2 * 16 * 8 * 128


def test_weight_quantization_does_not_change_auto_kv_dtype():
    layout = kv_layout_from_config(config("qwen2.5-7b-instruct-fp8"))
    assert layout.dtype_bytes == 2
    assert layout.block_bytes == 917_504


def test_nested_text_config_of_a_multimodal_model():
    layout = kv_layout_from_config(config("mistral-small-3.1-24b-instruct-2503"))
    # The language model's 40 layers and 8 KV heads, not the vision tower's 24 layers.
    assert (layout.num_layers, layout.num_kv_heads, layout.head_size, layout.dtype_bytes) == (40, 8, 128, 2)


def test_block_size_scales_block_bytes():
    cfg = load_model_config(QWEN_7B)
    assert kv_layout_from_config(cfg, block_size=128).block_bytes == 8 * 917_504


def test_float32_checkpoint_is_served_in_16_bit():
    cfg = {**load_model_config(QWEN_7B), "torch_dtype": "float32"}
    assert kv_layout_from_config(cfg).dtype_bytes == 2


def test_newer_dtype_key_is_read():
    cfg = load_model_config(QWEN_7B)
    del cfg["torch_dtype"]
    cfg["dtype"] = "float16"
    assert kv_layout_from_config(cfg).dtype_bytes == 2


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.pop("num_hidden_layers"), "no layer count"),
        (lambda c: (c.pop("num_attention_heads"), c.pop("num_key_value_heads")), "no head count"),
        (lambda c: c.update(num_hidden_layers="28"), "num_hidden_layers"),
        (lambda c: c.update(torch_dtype="float64"), "unknown model dtype"),
        (lambda c: c.update(num_hidden_layers=float("inf")), "'num_hidden_layers' must be a positive integer, got inf"),
    ],
)
def test_config_without_what_a_layout_needs_is_refused(mutate, message):
    cfg = load_model_config(QWEN_7B)
    mutate(cfg)
    with pytest.raises(ConfigError, match=message):
        kv_layout_from_config(cfg)


def test_one_check_of_integer_config_fields_serves_the_estimator_and_the_simulator():
    from kvguard.budget.estimator import positive_int
    from kvguard.sim.scenario import ScenarioConfig

    assert positive_int({"a": None, "b": 4.0}, "a", "b") == 4
    assert positive_int({"n": 0}, "n", minimum=0) == 0
    with pytest.raises(ConfigError, match="^config field 'n' must be a non-negative integer, got -1$"):
        positive_int({"n": -1}, "n", minimum=0)
    with pytest.raises(ConfigError, match=r"^config field 'n' must be a positive integer, got 'xxx+\.\.\.$"):
        positive_int({"n": "x" * 1000}, "n")
    cfg = load_model_config(QWEN_7B)
    nested = {"architectures": ["X"], "text_config": {**cfg, "max_position_embeddings": 4096}}
    assert ScenarioConfig(model_config=nested, device_memory_bytes=1 << 30).resolved_max_model_len == 4096
    with pytest.raises(ConfigError, match="'max_position_embeddings' must be a positive integer, got 0.5"):
        ScenarioConfig(
            model_config={**cfg, "max_position_embeddings": 0.5}, device_memory_bytes=1 << 30
        ).resolved_max_model_len


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ConfigError, match="unknown KV cache dtype"):
        kv_layout_from_config(load_model_config(QWEN_7B), kv_cache_dtype="int4")


def test_malformed_config_file_is_a_config_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"num_hidden_layers": 28,')
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_config(str(path))


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_model_config(str(tmp_path / "nope"))


def test_config_json_array_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="not a JSON object"):
        load_model_config(str(path))


def test_kv_tensor_style_follows_the_release_that_allocated_the_cache():
    """One int8 tensor per layer through vLLM 0.28 (v1/worker/gpu_model_runner.py 0.28.0:7473, one per
    KVCacheTensor of page_size * num_blocks, v1/core/kv_cache_utils.py 0.28.0:1384-1403); from 0.29 every
    KVCacheTensor has the whole size and allocate_kv_cache makes one backing (v1/worker/utils.py
    0.29.0:395-411). tests/upstream/test_vllm_real.py runs the real allocators of 0.11-0.34 and 0.30."""
    from kvguard.budget.estimator import kv_cache_tensor_bytes
    from kvguard.vllm.eras import kv_tensor_style

    layout = kv_layout_from_config(load_model_config(QWEN_7B))
    styles = {v: kv_tensor_style(f"vllm:{v}") for v in ("0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.33.0")}
    assert styles == {
        "0.27.0": "per_layer",
        "0.28.0": "per_layer",
        "0.29.0": "one_backing",
        "0.30.0": "one_backing",
        "0.33.0": "one_backing",
    }
    assert len(kv_cache_tensor_bytes(layout, 100, styles["0.28.0"])) == 28
    assert kv_cache_tensor_bytes(layout, 100, styles["0.29.0"]) == (100 * layout.block_bytes,)
