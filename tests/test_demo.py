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

from kvguard.sim.demo import DemoSource
from kvguard.guard.judge import CRITICAL, CounterWindow, GuardInput, judge
from kvguard.budget.model_config import bundled_model_config_path, load_model_config
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
            verdict = judge(GuardInput(
                context.profile, kv_cache_bytes=kv_bytes, memory=record,
                alloc_retries_increase=self.window.observe((record.device, "retries"), self.samples, record.alloc_retries),
                ooms_increase=self.window.observe((record.device, "ooms"), self.samples, record.ooms)))
            rows.append((record, verdict))
        self.samples += 1
        return rows


def test_counters_take_several_values_every_few_samples():
    judged = Judged(DemoSource(ranks=2))
    rows = [judged.sample() for _ in range(90)]
    for rank in (0, 1):
        series = [row[rank][0] for row in rows]
        for start in range(0, 90, 5):      # every window of 5 samples (5 s of demo), each counter moves
            window = series[start:start + 5]
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
    assert first["states"].index(CRITICAL) < len(first["states"]) - 1    # called before the OOM sample
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
    return LiveServing(ScenarioConfig(model_config=load_model_config(bundled_model_config_path()),
                                      device_memory_bytes=32 * GIB, allocator="torch_npu", seed=seed, **config),
                       traffic)


def test_requests_arrive_as_a_seeded_poisson_process_and_finish():
    serving = live(Traffic(arrival_rate=0.25, output_mean_tokens=16, prompt_median_tokens=256))
    for _ in range(400):
        serving.step()
    # Mean gap 4 steps: about 100 arrivals in 400 steps (seeded, so the count is fixed; a Poisson
    # count with mean 100 lies in 70..130 with probability > 0.997).
    assert 70 <= len(serving.arrivals) <= 130
    gaps = [b - a for a, b in zip(serving.arrivals, serving.arrivals[1:])]
    assert 0 in gaps and max(gaps) > 8          # bursts and lulls, not a metronome
    assert serving.requests_finished > 50
    again = live(Traffic(arrival_rate=0.25, output_mean_tokens=16, prompt_median_tokens=256))
    other = live(Traffic(arrival_rate=0.25, output_mean_tokens=16, prompt_median_tokens=256), seed=1)
    for _ in range(400):
        again.step()
        other.step()
    assert again.arrivals == serving.arrivals and other.arrivals != serving.arrivals


def test_long_prompts_are_prefilled_in_chunks_of_the_token_budget():
    serving = live(Traffic(arrival_rate=0.05, prompt_median_tokens=20_000, prompt_sigma=0.0, output_mean_tokens=4),
                   max_num_batched_tokens=2048)
    tokens = []
    for _ in range(80):
        serving.step()
        tokens.append(serving.num_tokens)
    # A 20000-token prompt takes nine full 2048-token steps and a 1568-token one, then decodes.
    assert max(tokens) == 2048 and tokens.count(2048) >= 9
    assert serving.requests_finished >= 1 and not serving.oom


def test_a_forward_is_in_flight_between_steps():
    serving = live(Traffic(arrival_rate=2.0, prompt_median_tokens=2048))
    serving.step()                          # startup, then a forward left part way
    baseline = serving.profile.weights_bytes
    seen = set()
    for _ in range(10):
        serving.step()
        seen.add(serving.allocator.allocated_bytes)
    kv = serving.kv_cache_bytes
    assert len(seen) >= 5 and min(seen) >= baseline + kv * 0.99


@pytest.mark.parametrize("field, value", [("arrival_rate", 0), ("arrival_rate", 100), ("prompt_median_tokens", 0),
                                          ("output_mean_tokens", 0), ("prompt_sigma", -1),
                                          ("leak_bytes_per_request", -1)])
def test_bad_traffic_is_a_value_error(field, value):
    with pytest.raises(ValueError, match=field):
        Traffic(**{field: value})
