"""vLLM's own /metrics as the guard's input: real exposition text, and endpoints that misbehave."""

from __future__ import annotations

import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler

import pytest
from helpers import LoopbackHTTP, reply, wait_for, within
from sidecar_fixtures import snapshot, write
from test_collector import POD, scrape, scrape_within, value

from kvguard.sidecar.core import Sidecar, SidecarConfig
from kvguard.vllm import metrics as vllm_metrics
from kvguard.vllm.log import parse_lines

# As vLLM V1 exposes it (vllm/v1/metrics/loggers.py): CacheConfig fields as labels, usage 0-1.
VLLM_TEXT = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",\
enable_prefix_caching="True",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",\
num_gpu_blocks="44292",num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",\
swap_space="4",swap_space_bytes="4294967296"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.4213
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 12.0
"""


# Two data-parallel engines as vLLM 0.14+ labels them (vllm/v1/metrics/loggers.py 0.34.0:499-500, 1114-1135):
# one cache_config_info per engine with an engine label and no model_name; the other series carry both.
DP2_TEXT = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",\
gpu_memory_utilization="0.9",num_gpu_blocks="44292",num_gpu_blocks_override="None"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="1",\
gpu_memory_utilization="0.9",num_gpu_blocks="43960",num_gpu_blocks_override="None"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen-7b"} 12.0
vllm:num_requests_running{engine="1",model_name="qwen-7b"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen-7b"} 0.4213
vllm:kv_cache_usage_perc{engine="1",model_name="qwen-7b"} 0.0871
"""


# A num_gpu_blocks no float can hold (vLLM would never say it; a broken or hostile endpoint might).
HUGE_BLOCKS_TEXT = VLLM_TEXT.replace('num_gpu_blocks="44292"', 'num_gpu_blocks="1' + "0" * 400 + '"')


class FakeVllm(LoopbackHTTP):
    """A loopback /metrics endpoint that answers, hangs, or talks nonsense."""

    def __init__(self, mode: str):
        self.mode = mode
        self.release = threading.Event()
        super().__init__(self.answer)

    def answer(self, request: BaseHTTPRequestHandler) -> None:
        if self.mode == "hang":
            self.release.wait()
            return
        if self.mode == "drip":  # headers, then one byte at a time, never the end
            request.send_response(200)
            request.end_headers()
            while not self.release.wait(0.02):
                try:
                    request.wfile.write(b"#")
                    request.wfile.flush()
                except OSError:
                    return
            return
        reply(
            request,
            *{
                "ok": (200, VLLM_TEXT.encode()),
                "dp2": (200, DP2_TEXT.encode()),
                "huge": (200, HUGE_BLOCKS_TEXT.encode()),
                "garbage": (200, b"\x00\xffthis is {not} metrics\n}}}{{\n"),
                "error": (500, b"internal error"),
            }[self.mode],
        )

    def close(self):
        self.release.set()
        super().close()


@pytest.fixture
def fake_vllm():
    servers = []

    def start(mode):
        server = FakeVllm(mode)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def tp2_log(data_path):
    with open(data_path("logs", "v1-tp2-debug.log"), encoding="utf-8") as handle:
        return parse_lines(handle)


def polled(server: FakeVllm, wait: float = 5, **options) -> Sidecar:
    """A sidecar reading ``server``'s /metrics (and ``options``), after its first poll or ``wait`` seconds."""
    sidecar = Sidecar(SidecarConfig(vllm_metrics_url=server.url, pod_labels=dict(POD), **options))
    sidecar.refresh_background(wait=wait)
    return sidecar


def test_parse_reads_blocks_block_size_utilization_and_usage():
    state = vllm_metrics.parse(VLLM_TEXT)
    assert (state.num_gpu_blocks, state.block_size, state.gpu_memory_utilization) == (44292, 16, 0.9)
    assert state.kv_cache_usage_ratio == pytest.approx(0.4213)


def test_parse_rejects_text_without_vllm_kv_facts():
    with pytest.raises(vllm_metrics.VllmMetricsError, match="no vllm:cache_config_info"):
        vllm_metrics.parse("# TYPE up gauge\nup 1\n")


def test_vllm_blocks_times_log_block_bytes_are_the_kv_cache_allocated(fake_vllm, data_path):
    server = fake_vllm("ok")
    startup = tp2_log(data_path)
    sidecar = polled(server, startup_log=startup)
    samples = scrape(sidecar)
    block_bytes = startup.available_kv_cache_bytes // (startup.kv_cache_tokens // 16)
    assert value(samples, "kvguard_kv_cache_allocated_blocks") == 44292
    assert value(samples, "kvguard_kv_cache_allocated_bytes") == 44292 * block_bytes
    assert value(samples, "kvguard_kv_cache_usage_ratio") == pytest.approx(0.4213)
    assert value(samples, "kvguard_source_up", source="vllm_metrics") == 1


def test_vllm_usage_is_attached_to_every_spool_rank(fake_vllm, tmp_path):
    server = fake_vllm("ok")
    write(tmp_path, snapshot(rank=0, pid=1), snapshot(rank=1, device="npu:1", pid=2))
    sidecar = polled(server, spool_dir=str(tmp_path))
    assert [v for _, v in scrape(sidecar)["kvguard_kv_cache_usage_ratio"]] == [pytest.approx(0.4213)] * 2


def test_parse_keeps_one_state_per_engine():
    state = vllm_metrics.parse(DP2_TEXT)
    assert [(e.engine, e.model_name, e.num_gpu_blocks, e.kv_cache_usage_ratio) for e in state.engines] == [
        ("0", "qwen-7b", 44292, pytest.approx(0.4213)),
        ("1", "qwen-7b", 43960, pytest.approx(0.0871)),
    ]
    assert state.engine_for("qwen-7b", "1").num_gpu_blocks == 43960
    assert state.engine_for() is None  # two engines, nothing to tell them apart
    assert state.engine_for("other-model", "1") is None


def test_an_engine_label_flood_is_cut_at_max_engines():
    text = "".join(f'vllm:kv_cache_usage_perc{{engine="{i}",model_name="m"}} 0.5\n' for i in range(1000))
    state = vllm_metrics.parse("# TYPE vllm:kv_cache_usage_perc gauge\n" + text)
    assert len(state.engines) == vllm_metrics.MAX_ENGINES
    assert [e.engine for e in state.engines[:3]] == ["0", "1", "2"]


def test_data_parallel_ranks_each_get_their_own_engines_facts(fake_vllm, tmp_path):
    server = fake_vllm("dp2")
    write(
        tmp_path,
        replace(snapshot(rank=0, pid=1, device="cuda:0"), model_name="qwen-7b", engine="0", kv_cache=None),
        replace(snapshot(rank=1, pid=2, device="cuda:1"), model_name="qwen-7b", engine="1", kv_cache=None),
    )
    sidecar = polled(server, spool_dir=str(tmp_path))
    samples = scrape(sidecar)
    assert value(samples, "kvguard_kv_cache_usage_ratio", rank=0, engine="0", model_name="qwen-7b") == pytest.approx(
        0.4213
    )
    assert value(samples, "kvguard_kv_cache_usage_ratio", rank=1, engine="1", model_name="qwen-7b") == pytest.approx(
        0.0871
    )
    assert value(samples, "kvguard_kv_cache_allocated_blocks", rank=1, engine="1") == 43960


def test_without_a_probe_each_engine_is_judged_apart(fake_vllm):
    server = fake_vllm("dp2")
    sidecar = polled(server)
    samples = scrape(sidecar)
    assert [
        (labels["engine"], labels["model_name"], v) for labels, v in samples["kvguard_kv_cache_allocated_blocks"]
    ] == [("0", "qwen-7b", 44292), ("1", "qwen-7b", 43960)]
    assert len(samples["kvguard_guard_severity"]) == 2


def test_ranks_that_do_not_name_their_engine_get_no_guessed_usage_from_two(fake_vllm, tmp_path):
    server = fake_vllm("dp2")
    write(tmp_path, snapshot(rank=0, pid=1))
    sidecar = polled(server, spool_dir=str(tmp_path))
    samples = scrape(sidecar)
    assert "kvguard_kv_cache_usage_ratio" not in samples
    assert value(samples, "kvguard_guard_severity", rank=0, engine="", model_name="") in (0, 1, 2)


@pytest.mark.parametrize("mode, error", [("garbage", "not Prometheus metrics text"), ("error", "HTTP 500")])
def test_a_vllm_endpoint_that_misbehaves_is_a_down_source_with_one_line(fake_vllm, mode, error):
    server = fake_vllm(mode)
    sidecar = polled(server)
    samples = scrape(sidecar)
    assert value(samples, "kvguard_source_up", source="vllm_metrics") == 0
    message = sidecar.observe().guard_dict()["sources"]["vllm_metrics"]["last_error"]
    assert error in message and "\n" not in message


def test_a_vllm_endpoint_that_hangs_is_cut_off_at_the_read_timeout(fake_vllm):
    server = fake_vllm("hang")
    sidecar = polled(server, wait=0.0, read_timeout=0.2)
    scrape_within(sidecar)
    # The read itself ends at the socket timeout; poll until it has, with a deadline.
    wait_for(lambda: sidecar.observe().guard_dict()["sources"]["vllm_metrics"]["errors_total"] >= 1, seconds=15)
    sources = sidecar.observe().guard_dict()["sources"]["vllm_metrics"]
    assert sources["up"] is False and sources["errors_total"] >= 1


def test_a_non_http_url_is_refused():
    with pytest.raises(vllm_metrics.VllmMetricsError, match="not an http"):
        vllm_metrics.fetch("file:///etc/passwd", timeout=1)


def test_a_vllm_endpoint_that_trickles_is_cut_off_at_the_read_timeout(fake_vllm):
    server = fake_vllm("drip")
    with pytest.raises(vllm_metrics.VllmMetricsError) as error:
        within(30, lambda: vllm_metrics.fetch(server.url, timeout=0.3), "a read of a trickling endpoint")
    assert str(error.value) == f"{server.url}: no complete answer within 0.3s"


def test_after_a_trickling_read_is_cut_off_the_next_poll_runs(fake_vllm):
    server = fake_vllm("drip")
    sidecar = Sidecar(SidecarConfig(vllm_metrics_url=server.url, read_timeout=0.3, pod_labels=dict(POD)))
    errors = 0
    for _ in range(600):  # a new read starts only once the one before it has ended
        sidecar.refresh_background(wait=30)
        errors = sidecar.observe().guard_dict()["sources"]["vllm_metrics"]["errors_total"]
        if errors >= 2:
            break
        threading.Event().wait(0.05)
    assert errors >= 2, "the first read never ended, so no second read started"


def test_a_block_count_no_float_can_hold_never_fails_a_scrape(fake_vllm):
    server = fake_vllm("huge")
    sidecar = polled(server)
    samples = scrape(sidecar)
    assert "kvguard_kv_cache_allocated_blocks" not in samples
    assert value(samples, "kvguard_kv_cache_usage_ratio") == pytest.approx(0.4213)


def test_a_block_count_no_float_can_hold_is_ignored_with_a_log_too(fake_vllm, data_path):
    server = fake_vllm("huge")
    startup = tp2_log(data_path)
    sidecar = polled(server, startup_log=startup)
    samples = scrape(sidecar)
    assert "kvguard_kv_cache_allocated_blocks" not in samples
    assert value(samples, "kvguard_kv_cache_allocated_bytes") == startup.available_kv_cache_bytes
