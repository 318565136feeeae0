"""The log reader's misses on fresh real logs (issue 35), each as a test built from the wording vLLM writes
(its format strings, quoted in the issue), never from the held-out log itself.

Each test reads a file through the one reader the CLI and the sidecar use, and where the verdict is the point,
runs ``kvguard check --from-log`` itself.
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvguard.cli import main
from kvguard.vllm.log import parse_log, read_log_file

GIB = 1 << 30
PREFIX = "INFO 11-20 10:00:00 [gpu_worker.py:300] "


def write(tmp_path, *lines: str) -> str:
    path = tmp_path / "vllm.log"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def check(path: str, *flags: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["check", "--from-log", path, "--json", *flags])
    return result.exit_code, json.loads(result.output[result.output.index("{") :])


def test_a_worker_failed_with_cuda_error_out_of_memory_is_a_critical_oom(tmp_path):
    path = write(
        tmp_path,
        "ERROR 11-20 10:00:09 [core.py:700] RuntimeError: Worker failed with error "
        "'CUDA error: out of memory', please check the stack trace above for the root cause",
    )
    code, data = check(path)
    finding = next(f for f in data["log"]["findings"] if f["code"] == "oom")
    assert (code, data["state"], finding["detail"]["device"]) == (2, "critical", "cuda")


def test_the_0_6_4_one_line_profiling_results_give_a_profile_and_vllm_s_kv_cache(tmp_path):
    # worker/worker.py 0.6.4: "Memory profiling results: total_gpu_memory=%.2fGiB initial_memory_usage=%.2fGiB
    # peak_torch_memory=%.2fGiB memory_usage_post_profile=%.2fGiB non_torch_memory=%.2fGiB kv_cache_size=%.2fGiB
    # gpu_memory_utilization=%.2f": 71.26 x 0.90 - 12.50 - 0.40 = 51.23.
    path = write(
        tmp_path,
        "INFO 11-20 10:00:00 worker.py:232] Memory profiling results: total_gpu_memory=71.26GiB "
        "initial_memory_usage=12.10GiB peak_torch_memory=12.50GiB memory_usage_post_profile=12.30GiB "
        "non_torch_memory=0.40GiB kv_cache_size=51.23GiB gpu_memory_utilization=0.90",
    )
    code, data = check(path)
    assert code == 0 and data["state"] == "ok"
    assert abs(data["ranks"][0]["stock_budget_bytes"] - 51.23 * GIB) <= 0.01 * GIB


def test_vllm_ascend_s_acl_graph_line_states_the_utilization(tmp_path):
    log = read_log_file(
        write(
            tmp_path,
            PREFIX + "ACL graph memory profiling is enabled (default since v0.22.1). "
            "The current --gpu-memory-utilization=0.9200 is equivalent to "
            "--gpu-memory-utilization=0.9013 without ACL graph memory profiling.",
        )
    )
    assert log.gpu_memory_utilization == 0.92


def test_across_ranks_the_smallest_token_count_keeps_its_own_rank_s_concurrency(tmp_path):
    lines = []
    for rank, tokens, concurrency in ((0, "120,000", "29.30"), (1, "96,000", "23.44"), (2, "110,000", "26.86")):
        lines += [
            f"(VllmWorker rank={rank} pid=10{rank}) INFO 11-20 10:00:00 [kv_cache_utils.py:716] "
            f"GPU KV cache size: {tokens} tokens",
            f"(VllmWorker rank={rank} pid=10{rank}) INFO 11-20 10:00:00 [kv_cache_utils.py:720] "
            f"Maximum concurrency for 4,096 tokens per request: {concurrency}x",
        ]
    log = read_log_file(write(tmp_path, *lines))
    assert (log.kv_cache_tokens, log.max_concurrency) == (96_000, 23.44)


OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "79.19 GiB of which 1.50 GiB is free. Including non-PyTorch memory, this process has 77.68 GiB memory in "
    "use. Of the allocated memory 75.10 GiB is allocated by PyTorch, and 1.20 GiB is reserved by PyTorch but "
    "unallocated."
)


def test_an_oom_after_the_engine_s_startup_and_a_request_is_while_serving_not_graph_capture(tmp_path):
    path = write(
        tmp_path,
        PREFIX + "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 67/67",
        "INFO 11-20 10:00:30 [core.py:210] init engine (profile, create kv cache, warmup model) took 41.28 seconds",
        "INFO 11-20 10:01:00 [async_llm.py:270] Added request cmpl-1.",
        OOM,
    )
    code, data = check(path)
    finding = next(f for f in data["log"]["findings"] if f["code"] == "oom")
    assert code == 2 and finding["detail"]["step"] == "serving" and "while serving" in finding["message"]


def test_an_oom_followed_by_error_executing_method_load_model_is_while_loading_the_model(tmp_path):
    path = write(
        tmp_path,
        OOM,
        "ERROR 11-20 10:00:05 worker_base.py:467] Error executing method 'load_model'. "
        "This might cause deadlock in distributed execution.",
    )
    code, data = check(path)
    finding = next(f for f in data["log"]["findings"] if f["code"] == "oom")
    assert code == 2 and finding["detail"]["step"] == "model_loading"
    assert "while loading the model" in finding["message"]


def test_the_non_default_args_line_states_max_model_len_and_utilization():
    log = parse_log(
        "INFO 11-20 10:00:00 [utils.py:233] non-default args: {'model_tag': 'Qwen/Qwen3-8B', "
        "'model': 'Qwen/Qwen3-8B', 'max_model_len': 8192, 'gpu_memory_utilization': 0.85}"
    )
    assert (log.max_model_len, log.gpu_memory_utilization) == (8192, 0.85)


def test_a_pasted_command_line_states_max_model_len_and_utilization():
    log = parse_log("$ vllm serve Qwen/Qwen3-8B --max-model-len 32k \\\n    --gpu-memory-utilization=0.95 --port 8000")
    assert (log.max_model_len, log.gpu_memory_utilization) == (32_000, 0.95)


def test_a_line_that_states_what_the_engine_settled_on_wins_over_the_command_line():
    log = parse_log(
        "$ vllm serve m --max-model-len 32768\nINFO 11-20 10:00:00 [model.py:1510] Using max model len 16384"
    )
    assert log.max_model_len == 16_384


def test_vllm_s_own_advice_to_raise_the_utilization_is_not_a_command_line():
    log = parse_log(
        PREFIX + "To maintain the same effective KV cache size as before, increase "
        "--gpu-memory-utilization to 0.9271. To disable, set VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0"
    )
    assert log.gpu_memory_utilization is None


def test_a_refusal_wrapped_inside_a_word_keeps_its_figures(tmp_path):
    # v1/core/kv_cache_utils.py: "To serve at least one request with the model's max seq len (%d), (%.2f GiB KV
    # cache is needed, which is larger than the available KV cache memory (%.2f GiB)", cut by a hard wrap.
    path = write(
        tmp_path,
        "ERROR 05-01 10:00:00 [core.py:396] ValueError: To serve at least one request with the model's max "
        "seq len (32768), (4.26 GiB KV cach",
        "e is needed, which is larger than the available KV cache memory (2.11 GiB). Based on the available "
        "memory, the estimated maximum model length is 16208.",
    )
    code, data = check(path)
    figures = data["log"]["figures"]
    assert (code, figures["refusal"], figures["max_model_len"]) == (2, "max_seq_len", 32768)
    assert abs(figures["needed_kv_cache_bytes"] - 4.26 * GIB) <= 0.006 * GIB
    assert abs(figures["available_kv_cache_bytes"] - 2.11 * GIB) <= 0.006 * GIB


def test_v0_profile_lines_wrapped_by_the_host_s_logger_under_its_own_prefix_read_a_negative_kv_cache(tmp_path):
    # worker/worker.py 0.6.6-0.8.4: "model weights take %.2fGiB; non_torch_memory takes %.2fGiB; PyTorch activation
    # peak memory takes %.2fGiB; the rest of the memory reserved for KV Cache is %.2fGiB.", each piece of the wrapped
    # message under the host's "HH:MM:SS  LEVEL [file:line]" prefix; then V0's "No available memory for the cache
    # blocks" refusal.
    prefix = "12:34:56  INFO [worker.py:267] "
    breakdown = (
        "model weights take 21.21GiB; non_torch_memory takes 0.08GiB; PyTorch activation peak memory takes "
        "1.29GiB; the rest of the memory reserved for KV Cache is -1.36GiB."
    )
    path = write(
        tmp_path,
        prefix + "the current vLLM instance can use total_gpu_memory (23.58GiB) x gpu_memory_utilization "
        "(0.90) = 21.22GiB",
        prefix + breakdown[:70],
        prefix + breakdown[70:],
        "12:34:57  ERROR [engine.py:400] ValueError: No available memory for the cache blocks. Try "
        "increasing `gpu_memory_utilization` when initializing the engine.",
    )
    code, data = check(path)
    assert (code, data["state"]) == (2, "critical")
    assert abs(data["log"]["figures"]["available_kv_cache_bytes"] + 1.36 * GIB) <= 0.006 * GIB
    assert abs(data["log"]["figures"]["weights_bytes"] - 21.21 * GIB) <= 0.006 * GIB
