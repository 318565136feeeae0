"""Parsing real startup log excerpts of each vLLM era."""

import os

import pytest
from conftest import TESTS

from kvguard.vllm.log import parse_lines, parse_log

GIB = 1 << 30


def read(data_path, name):
    with open(data_path("logs", name), encoding="utf-8", errors="replace") as handle:
        return parse_log(handle.read())


def test_v1_lines_with_colour_codes_and_worker_prefixes(data_path):
    log = read(data_path, "v1-tp2-debug.log")
    # The a-D profile line (0.9.1-0.26) and "Model loading took … GiB and" (0.12 added "memory"): one era.
    assert log.era == "vllm 0.9.1–0.11.2" and log.era_candidates == ("vllm 0.9.1–0.11.2",)
    assert "model_loading (0.8.5–0.11.2)" in log.era_reason and "profile_peak (0.9.1–0.26.0)" in log.era_reason
    assert log.kv_cache_tokens == 708_672
    assert (log.max_model_len, log.max_concurrency) == (32_768, 21.63)


def test_v1_takes_the_smallest_worker_budget_as_the_engine_does(data_path):
    log = read(data_path, "v1-tp2-debug.log")
    assert log.available_kv_cache_bytes == round(37.85 * GIB)


def test_v1_debug_profile_and_free_memory_lines_give_a_full_profile(data_path):
    log = read(data_path, "v1-tp2-debug.log")
    profile = log.profile()
    assert profile.total_memory_bytes == 64 * GIB
    assert profile.gpu_memory_utilization == 0.9
    assert profile.weights_bytes == round(14.19 * GIB)
    assert profile.peak_allocated_increase_bytes == round(4.27 * GIB)
    assert profile.non_torch_increase_bytes == round(1.30 * GIB)
    assert profile.peak_reserved_increase_bytes is None


def test_v0_late_breakdown_and_block_count(data_path):
    log = read(data_path, "v0-late.log")
    assert log.era == "vllm 0.6.4–0.8.4"
    assert log.total_memory_bytes == round(79.15 * GIB)
    assert log.gpu_memory_utilization == 0.90
    assert log.weights_bytes == round(14.99 * GIB)
    assert log.non_torch_increase_bytes == round(0.14 * GIB)
    assert log.peak_allocated_increase_bytes == round(1.23 * GIB)
    assert log.available_kv_cache_bytes == round(54.88 * GIB)
    assert log.num_gpu_blocks == 28_098
    assert (log.max_model_len, log.max_concurrency) == (8192, 54.88)


def test_v0_negative_values_parse(data_path):
    log = read(data_path, "v0-negative-non-torch.log")
    assert log.non_torch_increase_bytes == -round(0.51 * GIB)
    assert log.available_kv_cache_bytes == -round(0.94 * GIB)
    assert log.num_gpu_blocks == 0


def test_v06_results_line_keeps_weights_and_activations_together_and_gives_a_profile(data_path):
    log = read(data_path, "v0.6.4.log")
    assert log.era == "vllm 0.6.4–0.8.4"
    assert log.peak_torch_memory_bytes == round(16.23 * GIB)
    assert log.peak_allocated_increase_bytes is None  # the log does not separate it
    assert log.available_kv_cache_bytes == round(54.87 * GIB)
    assert log.num_gpu_blocks == 28_093
    # Its formula subtracts the allocated peak (weights and activations together) and the non-torch memory:
    # the profile read from the line reproduces vLLM's own KV cache figure (79.15 x 0.90 - 16.23 - 0.14).
    from kvguard.budget.estimator import stock_kv_cache_bytes

    profile = log.profile()
    assert profile is not None
    assert abs(stock_kv_cache_bytes(profile) - 54.87 * GIB) <= 0.01 * GIB


def test_vllm_ascend_byte_exact_available_memory(data_path):
    log = read(data_path, "vllm-ascend-2025.log")
    assert log.project == "vllm-ascend"
    # "Available memory: N, total memory: M" is NPUWorker's own formula, before 0.15 (aw 0.13.0:307-309).
    assert log.era == "vllm-ascend 0.9.1–0.14.0"
    assert log.available_kv_cache_bytes == 40_638_086_144
    assert log.total_memory_bytes == 65_452_113_920


def test_loading_model_weights_gb_label_is_gib(data_path):
    # vLLM divides by 2**30 and prints "GB".
    assert read(data_path, "v0.6.4.log").weights_bytes == round(14.9888 * GIB)


def test_garbage_log_matches_nothing(data_path):
    log = read(data_path, "garbage.log")
    assert log.lines_matched == 0 and log.available_kv_cache_bytes is None


def test_overlong_lines_are_skipped_not_scanned():
    log = parse_log("Available KV cache memory: 1.00 GiB" + "x" * 10_000)
    assert log.lines_matched == 0


# ------------------------------------------------------------------ reading a log file, bounded


def test_read_log_file_parses_a_real_log(data_path):
    from kvguard.vllm.log import read_log_file

    assert read_log_file(data_path("logs", "v1-tp2-debug.log")) == read(data_path, "v1-tp2-debug.log")


def test_read_log_file_refuses_a_device_in_one_line():
    import pytest

    from kvguard.vllm.log import LogFileError, read_log_file

    with pytest.raises(LogFileError) as error:
        read_log_file("/dev/zero")  # endless, no newline: never iterated
    assert str(error.value) == "cannot read log file /dev/zero: not a regular file"


def test_read_log_file_skips_an_overlong_line_and_keeps_the_rest(data_path, tmp_path):
    from kvguard.vllm.log import MAX_LINE_BYTES, read_log_file

    with open(data_path("logs", "v1-tp2-debug.log"), "rb") as handle:
        real = handle.read()
    path = tmp_path / "vllm.log"
    # An overlong line whose tail would match if it were taken for a line of its own, then the real log.
    path.write_bytes(b"x" * (3 * MAX_LINE_BYTES) + b" Available KV cache memory: 1.00 GiB\n" + real)
    assert read_log_file(str(path)) == read(data_path, "v1-tp2-debug.log")


def test_read_log_file_stops_at_its_byte_cap(data_path):
    from kvguard.vllm.log import read_log_file

    path = data_path("logs", "v1-tp2-debug.log")
    assert read_log_file(path, max_bytes=10).lines_matched == 0


# ---------------------------------------------------------------------------- every era's lines


def era_log(data_path, name):
    return read(data_path, os.path.join("eras", name))


def test_0_27_debug_profile_gives_the_consumed_profile(data_path):
    log = era_log(data_path, "v0.27-debug.log")
    # Its lines are every 0.27+ release's; 7 of its 8 file:line tags are vLLM 0.27.0/0.27.1's logger calls
    # (kvguard.vllm.source_index), which 0.34 moved.
    assert log.era_candidates == ("vllm 0.27.0–0.33.0",)
    assert log.weights_bytes == round(14.96 * GIB)
    assert log.total_consumed_bytes == round(15.87 * GIB)
    assert log.available_kv_cache_bytes == round(54.89 * GIB)
    # The CUDA-graph note states the utilization it takes away: (0.92 - 0.9115) x total.
    assert log.cudagraph_memory_bytes == round((0.92 - 0.9115) * log.total_memory_bytes)
    profile = log.profile()
    assert profile.formula == "consumed"
    assert profile.transient_peak_headroom_bytes == round(17.3 * GIB) - round(15.87 * GIB)
    # The decided budget and the recomputed one agree to the log's 0.01 GiB rounding.
    from kvguard.budget.estimator import stock_kv_cache_bytes

    assert abs(stock_kv_cache_bytes(profile) - log.available_kv_cache_bytes) < 0.05 * GIB


def test_0_34_extensible_cache_decides_its_size_after_warm_up(data_path):
    log = era_log(data_path, "v0.34-extensible.log")
    assert log.era == "vllm 0.34.0+"
    assert log.weights_bytes == round(14.25 * GIB)
    # "Available KV cache memory: 63.2 GiB" is the capacity; the committed size is what vLLM decided.
    assert log.available_kv_cache_bytes == round(57.16 * GIB)
    assert log.num_gpu_blocks == 42816
    # The one 0.30+ line carries both the KV size and the concurrency.
    assert (log.kv_cache_tokens, log.max_model_len, log.max_concurrency) == (2_740_224, 32_768, 83.62)


def test_kv_cache_memory_bytes_line_of_0_11(data_path):
    log = era_log(data_path, "v0.11-kv-cache-memory-bytes.log")
    assert log.era == "vllm 0.9.1–0.11.2"  # "does does": 0.11 and before
    assert log.kv_cache_memory_bytes == log.available_kv_cache_bytes == 40 * GIB
    assert log.init_free_memory_bytes == round(78.53515625 * GIB)
    assert log.weights_bytes == round(14.9595 * GIB)


def test_310p_halving_names_its_worker(data_path):
    log = era_log(data_path, "vllm-ascend-310p.log")
    # "(halved for workspace)" from worker_310p.py: 0.21.0rc1+, the row from 0.20 (vLLM 0.20+'s 0.92 default).
    assert (log.project, log.era, log.halved_for_workspace) == ("vllm-ascend-310p", "vllm-ascend-310p 0.20.0+", True)
    assert log.available_kv_cache_bytes == round(11.87 * GIB)
    assert log.weights_bytes == round(14.3005 * GIB)


def test_bundled_example_log_is_labelled_with_its_real_era():
    from conftest import EXAMPLES

    with open(os.path.join(EXAMPLES, "vllm-mindspore-qwen2.5-7b.log")) as handle:
        log = parse_log(handle.read())
    assert log.weights_bytes == round(14.1852 * GIB)  # "Model loading took 14.1852 GiB and 21.47 seconds"
    # It names vllm-mindspore's platform plugin, which 0.5 no longer has (issue 24): the seed's release, the
    # 0.2.0 row, with the seed's 16-token blocks (708,672 tokens in 44,292 blocks), not 0.5's 128.
    assert (log.project, log.era, log.era_candidates) == (
        "vllm-mindspore",
        "vllm-mindspore 0.2.0",
        ("vllm-mindspore 0.2.0",),
    )
    assert "before 0.5" in log.era_reason
    assert log.effective_block_size() == (16, "every candidate era's default")


def test_requested_memory_line_tells_0_13_from_0_14_by_its_digits():
    old = parse_log("DEBUG Initial free memory: 78.53 GiB; Requested memory: 0.90 (util), 71.28 GiB")
    new = parse_log(
        "DEBUG [gpu_worker.py:347] Initial free memory: 78.53 GiB; Requested memory: 0.920000 (util), 72.87 GiB"
    )
    assert old.era_candidates == ("vllm 0.9.1–0.11.2", "vllm 0.12.0–0.13.0")
    # With its tag (a paste that dropped the time keeps it): w 0.11.0:284-290 is that call; 0.12 and 0.13 have
    # it elsewhere.
    tagged = parse_log(
        "DEBUG [gpu_worker.py:290] Initial free memory: 78.53 GiB; Requested memory: 0.90 (util), 71.28 GiB"
    )
    assert tagged.era == "vllm 0.9.1–0.11.2", tagged.era_reason
    assert "vllm 0.12.0–0.13.0" not in new.era_candidates and "vllm 0.14.0–0.17.1" in new.era_candidates
    assert new.gpu_memory_utilization == 0.92 and new.requested_memory_bytes == round(72.87 * GIB)


def test_an_overlong_number_on_a_budget_line_is_one_line_error():
    from kvguard.vllm.log import LogLineError

    with pytest.raises(LogLineError, match=r"^line 2: number 999999999999… \(400 characters\) is too long"):
        parse_log("INFO start\nINFO Available KV cache memory: " + "9" * 400 + " GiB\n")


def test_regex_bait_is_skipped_without_error():
    bait = "Model loading took " * 150 + "Available KV cache memory: " * 100 + "(" * 2000  # < MAX_LINE_CHARS
    log = parse_log("\n".join([bait] * 20))
    assert log.lines_matched == 0 and log.weights_bytes is None


# ------------------------------------------------------------------ what people paste (issue 19)
# Lines below render the format strings of the release each test names (file:line cited), with the
# prefix vLLM's logger writes; the real logs users posted are in tests/data/logs/real (test_real_logs.py).


def _prefix(message, file_line="gpu_worker.py:563", pid="Worker_TP0 pid=447"):
    return f"({pid}) INFO 08-14 14:07:22 [{file_line}] {message}"


def test_a_terminal_wrapped_line_reads_as_the_whole():
    # worker/worker.py 0.7.0's breakdown, as posted in vllm-project/vllm#15598 (real r14), cut at 80 columns.
    line = (
        "(RayWorkerWrapper pid=1463574, ip=192.168.10.60) INFO 03-27 10:29:01 [worker.py:267] model weights take "
        "20.64GiB; non_torch_memory takes 0.28GiB; PyTorch activation peak memory takes 1.52GiB; the rest of the "
        "memory reserved for KV Cache is 21.20GiB."
    )
    whole = parse_log(line)
    wrapped = parse_log("\n".join(line[i : i + 80] for i in range(0, len(line), 80)))
    assert whole.available_kv_cache_bytes == round(21.20 * GIB)
    for name in (
        "weights_bytes",
        "non_torch_increase_bytes",
        "peak_allocated_increase_bytes",
        "available_kv_cache_bytes",
    ):
        assert getattr(wrapped, name) == getattr(whole, name), name


def test_the_0_27_summary_is_read_whole_even_split_at_its_full_stops():
    # w 0.27.0:767-786 (compile_or_warm_up_model), figures of a 79.19 GiB device.
    summary = (
        "Free memory on device (70.12/79.19 GiB) on startup. Desired GPU memory utilization is (0.92, 72.86 "
        "GiB). Actual usage is 16.1 GiB for consumed memory (weights + non-torch), 1.42 GiB for peak "
        "activation, and 0.51 GiB for CUDAGraph memory. Replace gpu_memory_utilization config with "
        "`--kv-cache-memory=59678851072` (55.58 GiB) to fit into requested memory, or "
        "`--kv-cache-memory=67529234432` (62.89 GiB) to fully utilize gpu memory. Current kv cache memory in "
        "use is 55.34 GiB."
    )
    for text in (
        _prefix(summary, "gpu_worker.py:786"),
        "\n".join(_prefix(part, "gpu_worker.py:786") for part in summary.replace(". ", ".\n").splitlines()),
    ):
        log = parse_log(text)
        assert (log.init_free_memory_bytes, log.total_memory_bytes) == (round(70.12 * GIB), round(79.19 * GIB))
        assert (log.gpu_memory_utilization, log.requested_memory_bytes) == (0.92, round(72.86 * GIB))
        assert log.total_consumed_bytes == round(16.1 * GIB) and log.peak_activation_bytes == round(1.42 * GIB)
        assert log.cudagraph_actual_bytes == round(0.51 * GIB)
        assert log.available_kv_cache_bytes == round(55.34 * GIB)
        assert log.era_candidates == ("vllm 0.27.0–0.33.0", "vllm 0.34.0+")


def test_the_v1_max_seq_len_refusal_is_a_fact_and_names_its_wording_era():
    # v1/core/kv_cache_utils.py 0.27.0:779-782 ("model's"; up to 0.26 "models's").
    log = parse_log(
        _prefix(
            "ValueError: To serve at least one request with the model's max seq len (131072), "
            "(16.00 GiB KV cache is needed, which is larger than the available KV cache memory "
            "(8.69 GiB). Based on the available memory, the estimated maximum model length is 71168.",
            "core.py:1100",
            "EngineCore pid=12",
        )
    )
    assert (log.refusal, log.max_model_len) == ("max_seq_len", 131072)
    assert (log.needed_kv_cache_bytes, log.available_kv_cache_bytes) == (16 * GIB, round(8.69 * GIB))
    assert log.era_candidates == ("vllm 0.27.0–0.33.0", "vllm 0.34.0+")


def test_the_new_torch_oom_message_states_every_figure():
    # c10/cuda/CUDACachingAllocator.cpp (torch 2.1+), as posted in FlashML-org/FreeToken#168.
    log = parse_log(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 128.00 MiB. GPU 0 has a total "
        "capacity of 11.63 GiB of which 21.56 MiB is free. Including non-PyTorch memory, this process has "
        "11.07 GiB memory in use. Of the allocated memory 10.85 GiB is allocated by PyTorch, with 22.00 MiB "
        "allocated in private pools (e.g., CUDA Graphs), and 36.30 MiB is reserved by PyTorch but "
        "unallocated."
    )
    oom = log.oom
    assert (oom.device, oom.tried_bytes, oom.total_bytes) == ("cuda", 128 << 20, round(11.63 * GIB))
    assert oom.free_bytes == round(21.56 * (1 << 20)) and oom.allocated_bytes == round(10.85 * GIB)
    assert oom.reserved_unallocated_bytes == round(36.30 * (1 << 20)) == oom.idle_reserved_bytes
    assert oom.process_in_use_bytes == round(11.07 * GIB)


def test_torch_2_1_s_misspelt_capacity_and_torch_npu_s_workspace_oom_are_read():
    # torch 2.1 wrote "total capacty" (vllm-project/vllm#2140, torch 2.1.2; the held-out r57).
    log = parse_log(
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 518.00 MiB. GPU 0 has a "
        "total capacty of 21.67 GiB of which 4.06 MiB is free. Process 1 has 21.65 GiB memory in use."
    )
    assert (log.oom.total_bytes, log.oom.free_bytes) == (round(21.67 * GIB), round(4.06 * (1 << 20)))
    # torch_npu's workspace allocator, as vllm-ascend 0.12.0rc1 printed it (the held-out r52).
    npu = parse_log(
        "NPU out of memory. NPUWorkspaceAllocator tried to allocate 180.00 MiB(NPU 1; 60.96 GiB total "
        "capacity; 86.81 MiB free). If you want to reduce memory usage, take a try to set the environment "
        "variable TASK_QUEUE_ENABLE=1."
    )
    assert (npu.oom.device, npu.oom.tried_bytes, npu.oom.total_bytes) == ("npu", 180 << 20, round(60.96 * GIB))


def test_the_model_length_the_engine_settled_on_is_read():
    # config/model.py 0.34.0:2214 logger.info("Using max model len %s", max_model_len); a longer line is not it.
    assert parse_log(_prefix("Using max model len 4096", "model.py:2214")).max_model_len == 4096
    assert parse_log(_prefix("Using max model len 4096 for the draft", "model.py:2214")).max_model_len is None
    # The served model's comes first; a speculative draft's config logs its own after it
    # (v1/worker/gpu/spec_decode/speculator_config.py 0.34.0:191).
    both = (
        _prefix("Using max model len 32768", "model.py:2214")
        + "\n"
        + _prefix("Using max model len 2048", "model.py:2214")
    )
    assert parse_log(both).max_model_len == 32768


def test_the_disabled_cuda_graph_estimate_states_the_utilization_and_subtracts_nothing():
    # w 0.20.0:472-480: the estimate measured, not applied.
    log = parse_log(
        _prefix(
            "CUDA graph memory profiling is disabled (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0). "
            "Without it, CUDA graph memory is not accounted for during KV cache allocation, which may "
            "require lowering --gpu-memory-utilization to avoid OOM. Consider re-enabling it (the "
            "default as of v0.21.0) and increasing --gpu-memory-utilization from 0.9350 to 0.9595.",
            "gpu_worker.py:473",
        )
    )
    assert (log.gpu_memory_utilization, log.cudagraph_memory_bytes) == (0.935, 0)
    # The wheels write this wording in 0.20.0-0.23.0 only (0.18/0.19 word their notice "In v0.19, …").
    assert log.era == "vllm 0.20.0–0.26.0", log.era_reason
    assert "wording" in log.era_reason


def test_cuda_graph_pool_and_capture_lines():
    # w 0.20.0:600 and v1/worker/gpu_model_runner.py 0.20.0:6134.
    log = parse_log(
        _prefix(
            "CUDA graph pool memory: 2.0 GiB (actual), 1.59 GiB (estimated), difference: 0.41 GiB (20.5%).",
            "gpu_worker.py:600",
        )
        + "\n"
        + _prefix("Graph capturing finished in 12 secs, took 1.42 GiB", "gpu_model_runner.py:6134")
    )
    assert log.cudagraph_estimate_bytes == round(1.59 * GIB)
    assert log.cudagraph_actual_bytes == round(1.42 * GIB)  # the later line: what capture took


def test_a_hybrid_models_block_size_is_read_not_invented(data_path):
    log = read(data_path, os.path.join("real", "r30.log"))
    assert log.effective_block_size() == (544, "stated")


def test_a_lost_hash_does_not_turn_the_cpu_count_into_the_gpu_count(data_path):
    # "GPU blocks: 1952, # CPU blocks: 2048" posted without its leading '#' (vllm-project/vllm#10517, real r22).
    assert read(data_path, os.path.join("real", "r22.log")).num_gpu_blocks == 1952


def test_vllm_ascend_at_debug_gets_its_rows_and_their_128_token_blocks():
    # vllm_ascend/worker/worker.py 0.18.0:356-358: the profile result at DEBUG, then the budget; the
    # profile's repr is vLLM 0.18's (mu: "Memory profiling takes ...").
    log = parse_log(
        "\n".join(
            [
                "INFO 11-20 10:00:00 [__init__.py:43] - ascend -> vllm_ascend:register",
                "DEBUG 11-20 10:01:00 [worker.py:356] Memory profiling takes 9.13 seconds. Total non KV cache memory: "
                "18.30GiB; torch peak memory increase: 4.00GiB; non-torch forward increase memory: 0.30GiB; "
                "weights memory: "
                "14.00GiB.",
                "INFO 11-20 10:01:00 [worker.py:358] Available KV cache memory: 39.30 GiB",
            ]
        )
    )
    from kvguard.vllm import eras

    assert log.project == "vllm-ascend"
    # vllm-ascend rows that run vLLM's memory_profiling (0.15+), and of those the ones whose worker.py has its
    # logger calls at 356 and 358 (the plugin's own source index: 0.18.0 on, not 0.15.0rc1-0.17.0rc1).
    runs_profiling = [e.name for e in eras.ERAS if e.project == "vllm-ascend" and e.first >= (0, 15, 0)]
    assert "vllm-ascend 0.18.0" in log.era_candidates and set(log.era_candidates) <= set(runs_profiling)
    assert "vllm-ascend 0.15.0–0.17.0" not in log.era_candidates, log.era_reason
    assert log.effective_block_size() == (128, "every candidate era's default")


def test_vllm_mindspore_0_5_is_told_by_its_own_logger_and_measures_reserved():
    # vllm_mindspore/logger.py (0.5): "%(levelname)s %(asctime)s vllm-mindspore[%(filename)s:%(lineno)d]", line 75
    # announces it; the profile repr is vLLM 0.11's, whose "torch peak" vllm-mindspore measures as reserved.
    log = parse_log(
        "\n".join(
            [
                "INFO 11-20 10:00:00 vllm-mindspore[logger.py:75] The config of vllm-mindspore logger has been updated "
                "successfully.",
                "DEBUG 11-20 10:01:00 [gpu_worker.py:278] Memory profiling takes 9.13 seconds. "
                "Total non KV cache memory: 19.80GiB; torch peak memory increase: 5.50GiB; "
                "non-torch forward increase memory: 0.30GiB; weights memory: "
                "14.00GiB.",
                "INFO 11-20 10:01:00 [gpu_worker.py:298] Available KV cache memory: 37.80 GiB",
            ]
        )
    )
    assert (log.project, log.era) == ("vllm-mindspore", "vllm-mindspore 0.5.0+")
    fields = log.profile_fields()
    assert fields["peak_reserved_increase_bytes"] == round(5.5 * GIB) and "peak_allocated_increase_bytes" not in fields
    assert log.effective_block_size() == (128, "every candidate era's default")


def test_lines_that_begin_templates_and_never_finish_are_skipped():
    # Their cost is bench/bench_log.py's ("regex bait lines", against reading the lines alone), not a time here.
    bait = ("Free memory on device (" * 30 + "Actual usage is " * 30 + "Model loading took " * 30)[:2000]
    log = parse_log("\n".join([bait] * 3000))
    assert log.lines_matched == 0 and log.profile() is None


def _budget_json(*args):
    import json

    from click.testing import CliRunner

    from kvguard.cli import main

    result = CliRunner().invoke(main, ["budget", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_budget_from_a_log_whose_candidate_eras_agree_counts_128_token_blocks(tmp_path):
    # The vllm-ascend DEBUG log above: three candidate rows, each with 128-token blocks (not vLLM's 16).
    from conftest import EXAMPLES

    path = tmp_path / "vllm-ascend.log"
    path.write_text(
        "INFO 11-20 10:00:00 [__init__.py:43] - ascend -> vllm_ascend:register\n"
        "INFO 11-20 10:01:00 [worker.py:358] Available KV cache memory: 39.30 GiB\n"
    )
    data = _budget_json("--from-log", str(path), "--model-config", os.path.join(EXAMPLES, "qwen2.5-7b-instruct"))
    # Qwen2.5-7B: 28 layers x 4 KV heads x 128 x 2 (K, V) x 2 bytes = 56 KiB a token.
    assert data["layout"]["block_size"] == 128
    assert data["budgets"]["stock"]["num_blocks"] == round(39.30 * GIB) // (128 * 56 * 1024)


def test_budget_from_a_hybrid_models_log_uses_the_block_size_it_states(tmp_path, data_path):
    from conftest import EXAMPLES

    path = tmp_path / "hybrid.log"
    with open(data_path("logs", "real", "r30.log"), encoding="utf-8") as handle:
        path.write_text(handle.read())
    data = _budget_json("--from-log", str(path), "--model-config", os.path.join(EXAMPLES, "qwen2.5-7b-instruct"))
    assert data["layout"]["block_size"] == 544  # not vLLM's default 16: "Setting attention block size to 544"


def test_the_docs_table_of_line_kinds_is_the_code_s():
    from kvguard.vllm.log import kinds_markdown

    docs = os.path.join(TESTS, "..", "docs", "reference", "log-lines.md")
    with open(docs, encoding="utf-8") as handle:
        assert kinds_markdown() in handle.read()


# ------------------------------------------------------------------ the Ascend engines' real logs (issue 24)
# tests/data/logs/ascend-real: what each vllm-ascend release printed on tests/upstream/ascend_real's fake NPU
# (its README gives what each must parse to: the era row, the decided budget, 128-token blocks).
ASCEND_REAL = {
    "0.11.0": ("vllm-ascend 0.9.1–0.14.0", 41_131_861_606, 717_184),
    "0.17.0rc1": ("vllm-ascend 0.15.0–0.17.0", 41_131_861_606, 717_184),
    "0.18.0": ("vllm-ascend 0.18.0", 42_205_603_430, 736_000),
    "0.19.1rc1": ("vllm-ascend 0.19.0–0.19.1", 42_205_603_430, 736_000),
    "0.23.0.post1": ("vllm-ascend 0.20.0–0.23.0", 43_579_992_965, 759_936),
}


@pytest.mark.parametrize("debug", ["", "-debug"])
@pytest.mark.parametrize("release", sorted(ASCEND_REAL))
def test_a_real_vllm_ascend_log_gets_its_row_its_budget_and_128_token_blocks(data_path, release, debug):
    row, decided, tokens = ASCEND_REAL[release]
    log = read(data_path, os.path.join("ascend-real", f"vllm-ascend-{release}{debug}.log"))
    assert log.project == "vllm-ascend" and row in log.era_candidates, log.era_reason
    assert log.effective_block_size()[0] == 128
    # 0.11 states the bytes; later releases print GiB to two decimals.
    assert abs(log.available_kv_cache_bytes - decided) <= (0 if release == "0.11.0" else 0.005 * GIB)
    assert log.kv_cache_tokens == tokens


@pytest.mark.parametrize("debug", ["", "-debug"])
def test_a_real_vllm_ascend_0_7_3_v0_log_gets_its_row_its_blocks_and_128_token_blocks(data_path, debug):
    """vLLM 0.7.3's V0 engine states the block count NPUWorker decided ("# npu blocks: 5530", README), no bytes."""
    log = read(data_path, os.path.join("ascend-real", f"vllm-ascend-0.7.3.post1{debug}.log"))
    assert log.project == "vllm-ascend" and log.era_candidates == ("vllm-ascend 0.7.3",), log.era_reason
    assert log.effective_block_size()[0] == 128
    assert log.num_gpu_blocks == 5530
    assert log.available_kv_cache_bytes is None


# tests/data/logs/ascend-real/vllm-ascend-310p-*: the same releases on a fake 310P, where vllm-ascend runs
# NPUWorker310 (tests/upstream/test_ascend_310p_real.py; the README's second table): the rows every log fits, what
# NPUWorker310 returned, the tokens of its blocks. NPUWorker310's lines fit several rows from 0.17 on; vLLM's
# own file:line tags in the same log name the vLLM release, and vllm-ascend runs on the one of its number.
ASCEND_310P_REAL = {
    "0.14.0rc1": (("vllm-ascend-310p 0.14.0",), 41_131_861_606, 717_184),
    "0.17.0rc1": (("vllm-ascend-310p 0.15.0–0.17.0",), 41_131_861_606, 717_184),
    "0.18.0": (("vllm-ascend-310p 0.18.0–0.19.1",), 20_565_930_803, 358_528),
    "0.23.0.post1": (("vllm-ascend-310p 0.20.0+",), 21_253_125_570, 370_560),
}


@pytest.mark.parametrize("debug", ["", "-debug"])
@pytest.mark.parametrize("release", sorted(ASCEND_310P_REAL))
def test_a_real_310p_log_is_told_from_an_a2_one_and_gets_its_rows_and_128_token_blocks(data_path, release, debug):
    rows, decided, tokens = ASCEND_310P_REAL[release]
    log = read(data_path, os.path.join("ascend-real", f"vllm-ascend-310p-{release}{debug}.log"))
    # Every 310P log says "Skip warm-up atb ops for 310P device"; before 0.21 no other line of it names the 310P.
    assert (log.project, log.era_candidates) == ("vllm-ascend-310p", rows), log.era_reason
    # 0.18.0 and 0.23.0.post1 write "Block size is set to 128 if prefix cache or chunked prefill is enabled."
    # (vllm_ascend/utils.py 0.23.0.post1:1404); the 0.14.0rc1 and 0.17.0rc1 runs do not.
    stated = release in ("0.18.0", "0.23.0.post1")
    assert log.effective_block_size() == (128, "stated" if stated else "every candidate era's default")
    assert abs(log.available_kv_cache_bytes - decided) <= (0 if release == "0.14.0rc1" else 0.005 * GIB)
    assert log.kv_cache_tokens == tokens


def test_the_bundled_example_log_budgets_its_own_16_token_blocks():
    """Issue 19: it printed 5,536 blocks (128-token ones) beside 708,672 tokens; the seed's row says 16."""
    from conftest import EXAMPLES

    data = _budget_json(
        "--from-log",
        os.path.join(EXAMPLES, "vllm-mindspore-qwen2.5-7b.log"),
        "--model-config",
        os.path.join(EXAMPLES, "qwen2.5-7b-instruct"),
    )
    assert data["layout"]["block_size"] == 16
    assert (data["budgets"]["stock"]["num_blocks"], data["budgets"]["stock"]["num_tokens"]) == (44_292, 708_672)


# vLLM's version banners (kvguard.vllm.log._BANNER, format strings cited there) state the release itself.
@pytest.mark.parametrize(
    "line, row",
    [
        ("INFO 07-14 10:00:00 [api_server.py:1839] vLLM API server version 0.9.2", "vllm 0.9.1–0.11.2"),
        (
            "(EngineCore_DP0 pid=1) INFO 10-01 00:00:00 [core.py:77] Initializing a V1 LLM engine "
            "(v0.11.1rc2.dev40+g1234abc) with config: model='Qwen/Qwen3-8B'",
            "vllm 0.9.1–0.11.2",
        ),
        (
            "INFO 03-02 00:00:00 [utils.py:299] vLLM server version 0.21.0, serving model Qwen/Qwen3-8B",
            "vllm 0.20.0–0.26.0",
        ),
        (
            "(APIServer pid=1) INFO 03-02 00:00:00 [utils.py:299]  \x1b[93m\u2584\u2584\x1b[0m "
            "\x1b[94m\u2584\u2588\x1b[0m "
            "\x1b[97;1m\u2588     \u2588     \u2588 \u2580\u2584\u2580 \u2588\x1b[0m  version \x1b[97;1m0.27.1\x1b[0m",
            "vllm 0.27.0–0.33.0",
        ),
        (
            "INFO 12-01 00:00:00 llm_engine.py:234] Initializing an LLM engine (v0.6.4.post1) with config: model='x'",
            "vllm 0.6.4–0.8.4",
        ),
    ],
)
def test_a_version_banner_pins_the_row_of_the_release_it_states(line, row):
    log = parse_lines([line, "INFO 12-01 00:00:00 [gpu_worker.py:298] Available KV cache memory: 8.11 GiB"])
    assert log.era == row, log.era_reason
    assert "its version banner" in log.era_reason


def test_a_banner_older_than_the_table_names_no_row_and_a_plugin_banner_its_own():
    old = parse_lines(
        [
            "INFO 04-01 00:00:00 llm_engine.py:234] Initializing an LLM engine (v0.4.2) with config: x",
            "INFO 04-01 00:00:00 llm_engine.py:300] # GPU blocks: 100, # CPU blocks: 200",
        ]
    )
    assert old.era is None and old.era_candidates == () and "no vllm row" in old.era_reason
    assert old.num_gpu_blocks == 100
    # vllm-ascend vX.Y.Z runs on vLLM vX.Y.Z: vLLM's banner in an NPU log names the plugin's row.
    npu = parse_lines(
        [
            "INFO 02-07 18:00:00 [api_server.py:1272] vLLM API server version 0.13.0",
            "RuntimeError: NPU out of memory. Tried to allocate 2.57 GiB (NPU 0; 60.96 GiB total capacity; "
            "57.49 GiB already allocated; 57.49 GiB current active; 1.96 GiB free; 57.62 GiB reserved in "
            "total by PyTorch)",
        ]
    )
    assert (npu.project, npu.era) == ("vllm-ascend", "vllm-ascend 0.9.1–0.14.0"), npu.era_reason


def test_banners_are_bounded_and_a_version_in_other_words_is_not_one():
    flood = [f"INFO 01-01 00:00:00 [api_server.py:1] vLLM API server version 0.{n}.0" for n in range(6, 40)]
    log = parse_lines(flood)
    assert len(log.era_reason) < 400
    # Only vLLM's own banner wording counts: a package list or a model name saying "version" does not.
    other = parse_lines(
        [
            "torch version 2.5.1",
            "transformers version 4.57.0",
            "INFO 11-02 09:14:19 [gpu_worker.py:298] Available KV cache memory: 54.89 GiB",
        ]
    )
    assert "banner" not in other.era_reason and other.era == "vllm 0.9.1–0.11.2"
