"""Parsing real startup log excerpts of each vLLM era."""

import os

import pytest

from kvguard.vllm.log import parse_log

GIB = 1 << 30


def read(data_path, name):
    with open(data_path("logs", name), encoding="utf-8", errors="replace") as handle:
        return parse_log(handle.read())


def test_v1_lines_with_colour_codes_and_worker_prefixes(data_path):
    log = read(data_path, "v1-tp2-debug.log")
    # The a-D profile line and "Free memory on device": a V1 release before 0.27, not one era.
    assert log.era is None
    assert log.era_candidates == ("vllm 0.9.1–0.11.2", "vllm 0.12.0–0.13.0", "vllm 0.14.0–0.17.1",
                                  "vllm 0.18.0–0.19.1", "vllm 0.20.0–0.26.0")
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


def test_v06_results_line_keeps_weights_and_activations_together(data_path):
    log = read(data_path, "v0.6.4.log")
    assert log.era == "vllm 0.6.4–0.8.4"
    assert log.peak_torch_memory_bytes == round(16.23 * GIB)
    assert log.peak_allocated_increase_bytes is None  # the log does not separate it
    assert log.available_kv_cache_bytes == round(54.87 * GIB)
    assert log.num_gpu_blocks == 28_093
    assert log.profile() is None


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
        read_log_file("/dev/zero")   # endless, no newline: never iterated
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
    assert log.era_candidates == ("vllm 0.27.0–0.33.0", "vllm 0.34.0+")
    assert log.weights_bytes == round(14.96 * GIB)
    assert log.total_consumed_bytes == round(15.87 * GIB)
    assert log.available_kv_cache_bytes == round(54.89 * GIB)
    # The CUDA-graph note states the utilization it takes away: (0.92 - 0.9115) x total.
    assert log.cudagraph_memory_bytes == round((0.92 - 0.9115) * log.total_memory_bytes)
    profile = log.profile()
    assert profile.formula == "consumed"
    assert profile.transient_peak_headroom_bytes == round(17.3 * GIB) - round(15.87 * GIB)
    # The decided budget and the recomputed one agree to the log's 0.01 GiB rounding.
    from kvguard.estimator import stock_kv_cache_bytes
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
    assert log.era == "vllm 0.9.1–0.11.2"   # "does does": 0.11 and before
    assert log.kv_cache_memory_bytes == log.available_kv_cache_bytes == 40 * GIB
    assert log.init_free_memory_bytes == round(78.53515625 * GIB)
    assert log.weights_bytes == round(14.9595 * GIB)


def test_310p_halving_names_its_worker(data_path):
    log = era_log(data_path, "vllm-ascend-310p.log")
    assert (log.project, log.era, log.halved_for_workspace) == ("vllm-ascend-310p", "vllm-ascend-310p 0.18.0+", True)
    assert log.available_kv_cache_bytes == round(11.87 * GIB)
    assert log.weights_bytes == round(14.3005 * GIB)


def test_bundled_example_log_now_carries_the_weights():
    from conftest import EXAMPLES
    with open(os.path.join(EXAMPLES, "vllm-mindspore-qwen2.5-7b.log")) as handle:
        log = parse_log(handle.read())
    assert log.weights_bytes == round(14.1852 * GIB)   # "Model loading took 14.1852 GiB and 21.47 seconds"
    assert (log.project, log.era) == ("vllm-mindspore", "vllm-mindspore 0.5.0+")


def test_requested_memory_line_tells_0_13_from_0_14_by_its_digits():
    old = parse_log("DEBUG [gpu_worker.py:290] Initial free memory: 78.53 GiB; Requested memory: 0.90 (util), 71.28 GiB")
    new = parse_log("DEBUG [gpu_worker.py:347] Initial free memory: 78.53 GiB; Requested memory: 0.920000 (util), "
                    "72.87 GiB")
    assert old.era_candidates == ("vllm 0.9.1–0.11.2", "vllm 0.12.0–0.13.0")
    assert "vllm 0.12.0–0.13.0" not in new.era_candidates and "vllm 0.14.0–0.17.1" in new.era_candidates
    assert new.gpu_memory_utilization == 0.92 and new.requested_memory_bytes == round(72.87 * GIB)


def test_an_overlong_number_on_a_budget_line_is_one_line_error():
    from kvguard.vllm.log import LogLineError
    with pytest.raises(LogLineError, match=r"^line 2: number 999999999999… \(400 characters\) is too long"):
        parse_log("INFO start\nINFO Available KV cache memory: " + "9" * 400 + " GiB\n")


def test_regex_bait_is_skipped_without_error():
    bait = "Model loading took " * 150 + "Available KV cache memory: " * 100 + "(" * 2000   # < MAX_LINE_CHARS
    log = parse_log("\n".join([bait] * 20))
    assert log.lines_matched == 0 and log.weights_bytes is None
