"""The demo's ranks serve an open request stream: counters move, and the tripping rank is called,
runs out of memory, restarts with other arrivals, and is called again.

The demo source advances by samples, not by the clock (each ``sample()`` is one probe read,
``STEPS_PER_SAMPLE`` scheduler steps), so these tests run minutes of demo time in seconds. The
verdicts come from the guard's ``judge`` and ``CounterWindow`` fed as the sidecar feeds them
(profile and KV cache from the rank's context, retries and OOMs over the window); the real
probe → spool → sidecar → server path is ``test_serve_cli.test_demo_shows_fragmentation_and_a_guard_that_trips``.
"""

from __future__ import annotations

import pytest

from kvguard.budget.model_config import bundled_model_config_path, load_model_config
from kvguard.guard.judge import CRITICAL, CounterWindow, GuardInput, judge
from kvguard.sim.demo import DemoSource
from kvguard.sim.scenario import ScenarioConfig
from kvguard.sim.traffic import LiveServing, Traffic

GIB = 1 << 30


class Judged:
    """Samples a demo source and judges every rank as the sidecar does."""

    def __init__(self, source: DemoSource):
        self.source = source
        self.window = CounterWindow(300.0)
        self.samples = 0

    def sample(self):
        records = self.source.sample()
        contexts = self.source.rank_contexts()
        rows = []
        for record in records:
            context = contexts[record.device]
            kv_bytes = context.kv_cache.kv_cache_bytes if context.kv_cache else None
            verdict = judge(
                GuardInput(
                    context.profile,
                    kv_cache_bytes=kv_bytes,
                    memory=record,
                    alloc_retries_increase=self.window.observe(
                        (record.device, "retries"), self.samples, record.alloc_retries
                    ),
                    ooms_increase=self.window.observe((record.device, "ooms"), self.samples, record.ooms),
                )
            )
            rows.append((record, verdict))
        self.samples += 1
        return rows


def test_counters_take_several_values_every_few_samples():
    judged = Judged(DemoSource(ranks=2))
    rows = [judged.sample() for _ in range(90)]
    for rank in (0, 1):
        series = [row[rank][0] for row in rows]
        for start in range(0, 90, 5):  # every window of 5 samples (5 s of demo), each counter moves
            window = series[start : start + 5]
            assert len({r.allocated_bytes for r in window}) >= 3, (rank, start)
            assert len({r.fragmentation_bytes for r in window}) >= 3, (rank, start)
        # reserved climbs as the caching allocator meets batches it has no cached block for
        assert len({r.reserved_bytes for r in series[:30]}) >= 4, rank
    # ...and on the serving rank (max_split_size_mb:256) keeps following the load after the climb
    assert len({row[0][0].reserved_bytes for row in rows[30:90]}) >= 5


def test_the_tripping_rank_is_called_runs_out_restarts_with_other_arrivals_and_is_called_again():
    source = DemoSource(ranks=2)
    judged = Judged(source)
    lives: list[dict] = [{"states": [], "allocated": [], "serving": source.serving(1)}]
    healthy_states = set()
    while len(lives) < 3 and judged.samples < 600:
        (_, healthy), (record, verdict) = judged.sample()
        healthy_states.add(healthy.state)
        if source.serving(1) is not lives[-1]["serving"]:
            lives.append({"states": [], "allocated": [], "serving": source.serving(1)})
        life = lives[-1]
        life["states"].append(verdict.state)
        life["allocated"].append(record.allocated_bytes)
        life.setdefault("codes", set()).update(verdict.reason_codes)
        if record.ooms:
            life["oom"] = True
    assert len(lives) == 3, f"two restarts expected in 600 samples, got {len(lives) - 1}"
    first, second = lives[0], lives[1]
    # Life one: warning at startup (overcommitted, but the startup projection fits), then critical as the
    # reserved memory climbs past the projection, then an OOM the allocator counts.
    assert first["states"][0] == "warning"
    assert CRITICAL in first["states"] and first.get("oom")
    assert first["states"].index(CRITICAL) < len(first["states"]) - 1  # called before the OOM sample
    assert {"overcommitted", "projected_peak_exceeds_capacity", "ooms_climbing"} <= first["codes"]
    # Life two: a new seed, so other arrivals and another series; called again.
    assert second["serving"].config.seed != first["serving"].config.seed
    assert second["serving"].arrivals != first["serving"].arrivals
    assert second["allocated"][:20] != first["allocated"][:20]
    assert second["states"][0] == "warning" and CRITICAL in second["states"] and second.get("oom")
    # The other rank serves on: overcommitted (warning), never called critical, never restarted.
    assert healthy_states == {"warning"}
    assert source.serving(0).requests_finished > 0 and not source.serving(0).oom


def live(traffic: Traffic, seed: int = 0, **config) -> LiveServing:
    return LiveServing(
        ScenarioConfig(
            model_config=load_model_config(bundled_model_config_path()),
            device_memory_bytes=32 * GIB,
            allocator="torch_npu",
            seed=seed,
            **config,
        ),
        traffic,
    )


def test_requests_arrive_as_a_seeded_poisson_process_and_finish():
    serving = live(Traffic(arrival_rate=0.25, output_mean_tokens=16, prompt_median_tokens=256))
    for _ in range(400):
        serving.step()
    # Mean gap 4 steps: about 100 arrivals in 400 steps (seeded, so the count is fixed; a Poisson
    # count with mean 100 lies in 70..130 with probability > 0.997).
    assert 70 <= len(serving.arrivals) <= 130
    gaps = [b - a for a, b in zip(serving.arrivals, serving.arrivals[1:])]
    assert 0 in gaps and max(gaps) > 8  # bursts and lulls, not a metronome
    assert serving.requests_finished > 50
    again = live(Traffic(arrival_rate=0.25, output_mean_tokens=16, prompt_median_tokens=256))
    other = live(Traffic(arrival_rate=0.25, output_mean_tokens=16, prompt_median_tokens=256), seed=1)
    for _ in range(400):
        again.step()
        other.step()
    assert again.arrivals == serving.arrivals and other.arrivals != serving.arrivals


def test_long_prompts_are_prefilled_in_chunks_of_the_token_budget():
    serving = live(
        Traffic(arrival_rate=0.05, prompt_median_tokens=20_000, prompt_sigma=0.0, output_mean_tokens=4),
        max_num_batched_tokens=2048,
    )
    tokens = []
    for _ in range(80):
        serving.step()
        tokens.append(serving.num_tokens)
    # A 20000-token prompt takes nine full 2048-token steps and a 1568-token one, then decodes.
    assert max(tokens) == 2048 and tokens.count(2048) >= 9
    assert serving.requests_finished >= 1 and not serving.oom


def test_a_forward_is_in_flight_between_steps():
    serving = live(Traffic(arrival_rate=2.0, prompt_median_tokens=2048))
    serving.step()  # startup, then a forward left part way
    baseline = serving.profile.weights_bytes
    seen = set()
    for _ in range(10):
        serving.step()
        seen.add(serving.allocator.allocated_bytes)
    kv = serving.kv_cache_bytes
    assert len(seen) >= 5 and min(seen) >= baseline + kv * 0.99


@pytest.mark.parametrize(
    "field, value",
    [
        ("arrival_rate", 0),
        ("arrival_rate", 100),
        ("prompt_median_tokens", 0),
        ("output_mean_tokens", 0),
        ("prompt_sigma", -1),
        ("leak_bytes_per_request", -1),
    ],
)
def test_bad_traffic_is_a_value_error(field, value):
    with pytest.raises(ValueError, match=field):
        Traffic(**{field: value})


# ---------------------------------------------------------------- what a real rank's vLLM gives beside the probe


def test_each_rank_is_its_own_source_and_the_whole_demo_reads_them_in_rank_order():
    source = DemoSource(ranks=3)
    records = source.sample()
    assert [r.device for r in records] == ["npu:0", "npu:1", "npu:2"]
    assert [r.device for r in source.rank_source(2).sample()] == ["npu:2"]
    assert source.rank_source(1).rank_contexts()["npu:1"].rank == 1
    seeds = {source.serving(rank).config.seed for rank in range(3)}
    assert len(seeds) == 3


def test_the_budget_time_verdict_is_taken_once_per_life_after_startup_fixed_the_budget():
    from kvguard.guard.judge import BUDGET

    source = DemoSource(ranks=2)
    assert source.budget_verdict(1) == (None, False)  # no startup yet
    handed = []
    rank = source.rank_source(1)
    rank.on_budget_verdict = handed.append
    first = source.serving(1)
    while source.serving(1) is first:
        rank.sample()
    rank.sample()  # the new life's startup
    assert len(handed) == 2 and all(v.phase == BUDGET for v in handed)
    assert handed[1] is not handed[0]
    assert handed[0].reason_codes == ("overcommitted",)  # vLLM's stock budget over the reserved-aware one


def test_the_engines_metrics_are_vllms_series_from_the_simulated_scheduler():
    from prometheus_client.parser import text_string_to_metric_families

    from kvguard.sim.demo import MODEL_NAME
    from kvguard.vllm import metrics

    source = DemoSource(ranks=2)
    for _ in range(20):
        source.sample()
    text = source.engine_metrics().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert all(f.documentation.startswith("kvguard demo's simulated engine: ") for f in families.values())
    for rank in (0, 1):
        serving = source.serving(rank)
        usage = (serving.num_blocks - serving.free_blocks) / serving.num_blocks
        values = {f.name: s for f in families.values() for s in f.samples if s.labels.get("engine") == str(rank)}
        assert values["vllm:kv_cache_usage_perc"].value == pytest.approx(usage) and 0 < usage < 1
        assert values["vllm:kv_cache_usage_perc"].labels == {"model_name": MODEL_NAME, "engine": str(rank)}
        assert values["vllm:num_requests_running"].value == serving.num_running
        assert values["vllm:num_requests_waiting"].value == serving.num_waiting
        assert values["vllm:cache_config_info"].labels["num_gpu_blocks"] == str(serving.num_blocks)
        # ...and the sidecar's own reader of vLLM's /metrics finds each engine by (model name, engine index).
        engine = metrics.parse(text).engine_for(MODEL_NAME, str(rank))
        assert engine.num_gpu_blocks == serving.num_blocks and engine.kv_cache_usage_ratio == pytest.approx(usage)


def test_the_engines_series_have_the_names_and_help_of_vllm_0_14s_prometheus_logger():
    import ast
    import pathlib

    from vllm_real import envs

    python = envs.env_python("0.14.0")
    if python is None:
        pytest.skip("vLLM 0.14.0: its environment is not set up (./dev.sh test builds it)")
    (loggers,) = pathlib.Path(python).parents[1].glob("lib/python*/site-packages/vllm/v1/metrics/loggers.py")
    tree = ast.parse(loggers.read_text(encoding="utf-8"))
    upstream = {}
    for call in ast.walk(tree):
        if isinstance(call, ast.Call):
            keywords = {k.arg: k.value for k in call.keywords}
            if isinstance(keywords.get("name"), ast.Constant) and isinstance(
                keywords.get("documentation"), ast.Constant
            ):
                upstream[keywords["name"].value] = keywords["documentation"].value
    assert '"vllm:cache_config_info"' in loggers.read_text(encoding="utf-8")
    assert 'labelnames = ["model_name", "engine"]' in loggers.read_text(encoding="utf-8")
    source = DemoSource(ranks=1)
    source.sample()
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(source.engine_metrics().decode()):
        if family.name != "vllm:cache_config_info":
            assert family.documentation == "kvguard demo's simulated engine: " + upstream[family.name]


def test_start_demo_runs_a_probe_per_rank_naming_its_engine_and_serves_the_engines_on_loopback(tmp_path):
    import time
    import urllib.request

    from kvguard.sim.demo import MODEL_NAME, start_demo
    from kvguard.spool.io import SpoolReader

    demo = start_demo(str(tmp_path), 2, interval=0.2)
    try:
        assert demo.vllm_metrics_url.startswith("http://127.0.0.1:")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            snapshots = {s.device: s for s in SpoolReader(str(tmp_path)).read().snapshots}
            if len(snapshots) == 2 and all(s.budget_verdict for s in snapshots.values()):
                break
            time.sleep(0.1)
        assert {(d, s.model_name, s.engine, s.rank) for d, s in snapshots.items()} == {
            ("npu:0", MODEL_NAME, "0", 0),
            ("npu:1", MODEL_NAME, "1", 1),
        }
        assert all(s.budget_verdict.phase == "budget" for s in snapshots.values())
        with urllib.request.urlopen(demo.vllm_metrics_url, timeout=5) as answer:
            assert b'vllm:kv_cache_usage_perc{engine="1"' in answer.read()
    finally:
        demo.stop()


def test_a_failure_in_the_engines_metrics_is_a_500_with_one_line_and_one_log_line_not_a_traceback(capfd, caplog):
    """Review: an exception in the simulated engines' /metrics reached socketserver's handle_error,
    which printed a traceback to serve's stderr, and the scraper got no answer."""
    import logging
    import urllib.error
    import urllib.request

    from kvguard.sim.demo import EngineMetricsServer

    class Failing(DemoSource):
        def engine_metrics(self) -> bytes:
            raise RuntimeError("scheduler state torn\nsecond line")

    server = EngineMetricsServer(Failing(ranks=1)).start()
    try:
        with caplog.at_level(logging.ERROR, logger="kvguard"):
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(server.url, timeout=5)
    finally:
        server.stop()
    assert answer.value.code == 500
    assert answer.value.read() == b"error: RuntimeError: scheduler state torn second line\n"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.ERROR, "demo engine metrics failed")]
    assert "Traceback" not in capfd.readouterr().err
