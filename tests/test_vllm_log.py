"""Parsing real startup log excerpts of each vLLM era."""

from kvguard.vllm.log import parse_log

GIB = 1 << 30


def read(data_path, name):
    with open(data_path("logs", name), encoding="utf-8", errors="replace") as handle:
        return parse_log(handle.read())


def test_v1_lines_with_colour_codes_and_worker_prefixes(data_path):
    log = read(data_path, "v1-tp2-debug.log")
    # The a-D profile line and "Free memory on device": a V1 release before 0.27, not one era.
    assert log.era is None
    assert log.era_candidates == ("vllm 0.10.2–0.13.0", "vllm 0.14.0–0.17.1", "vllm 0.18.0–0.19.1",
                                  "vllm 0.20.0–0.26.0")
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
    assert log.era == "vllm 0.6.4–0.10.1"
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
    assert log.era == "vllm 0.6.4–0.10.1"
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
