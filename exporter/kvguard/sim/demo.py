"""``kvguard serve --demo``: simulated serving ranks through the real path, probe → spool → collector.

The ranks are the simulator's vLLM startup (weights, profile run, vLLM's stock KV-cache budget,
the KV cache) followed by an open request stream (``kvguard.sim.traffic``: Poisson arrivals,
log-normal prompts prefilled in chunks, geometric outputs, requests that finish and free their
blocks), written to a spool by the real in-process probe and read back by the real sidecar. A
machine with no accelerator shows what the sidecar shows in production: allocated against
reserved memory and their gap moving from sample to sample, and a guard that trips.

Every rank serves Qwen2.5-7B on a 32 GiB torch_npu device with vLLM's stock budget, advancing
``STEPS_PER_SAMPLE`` scheduler steps per probe sample (one sample a second):

- every rank but the last at ``--gpu-memory-utilization 0.90`` with ``max_split_size_mb:256``:
  overcommitted (warning), its projected peak fits, and it serves on, its reserved memory rising and
  falling with the load;
- the last rank at 0.95, busier, and keeping ``LEAK`` bytes of device memory for every request it
  finishes: its reserved memory climbs past what the startup profile projected (warning, then
  critical once the projected peak exceeds the device), the allocator runs out of memory, the rank
  restarts with a new seed (a different arrival sequence) and is called again. A life lasts
  200-420 steps (50-105 s); critical comes after 10-170 steps (3-45 s), 7 s into the first life
  (fifteen lives measured with the guard fed as the sidecar feeds it, tests/sim/test_demo.py's Judged).

Each rank is an engine of its own, as vLLM's data-parallel ranks are (engine index = rank): its own
probe (as each vLLM worker runs one) names it, its own request stream feeds it. What a real rank's
vLLM offers beside the probe, the demo offers from the same simulated state:

- the budget-time verdict (``kvguard_guard_budget_*``): the vLLM plugin's, taken as
  ``kvguard.sim.guarded.BudgetWatch`` takes it (the allocator as it was when vLLM fixed the budget,
  the era's KV tensors placed into a copy), once per life, handed to the rank's probe;
- vLLM's own ``/metrics`` (``kvguard_kv_cache_usage_ratio`` comes from it through
  ``--vllm-metrics-url``): :class:`EngineMetricsServer` serves, on a loopback port of its own and only
  in the demo, the series vLLM's Prometheus logger writes, with vLLM's names and labels
  (vllm/v1/metrics/loggers.py at 0.14.0: labels model_name and engine, 411; num_requests_running, 430;
  num_requests_waiting, 440; kv_cache_usage_perc, 476; cache_config_info with an engine label,
  1002-1024), each HELP text saying it is the demo's simulated engine.
"""

from __future__ import annotations

import dataclasses
import http.server
import logging
import sys
import threading
from typing import Any, Callable

from kvguard.logs import LOGGER, event
from kvguard.records import DeviceMemory
from kvguard.sim.source import renumbered
from kvguard.sources import RankContext
from kvguard.text import one_line

GIB = 1 << 30
MIB = 1 << 20
STEPS_PER_SAMPLE = 4
LEAK = 4 * MIB
MODEL_NAME = "Qwen/Qwen2.5-7B-Instruct"  # the simulated model, named as vLLM names its engine
RANK = {"allocator": "torch_npu", "device_memory_bytes": 32 * GIB, "budget": "stock"}
# max_split_size_mb:256 (PYTORCH_NPU_ALLOC_CONF): on a miss the allocator hands its cached oversize
# blocks back to the device before it asks for more, so reserved follows the load instead of holding.
SERVING = {**RANK, "gpu_memory_utilization": 0.90, "max_split_size_bytes": 256 * MIB}
TRIPPING = {**RANK, "gpu_memory_utilization": 0.95}
TRIPPING_SEED = 1000
# A serving rank r > 0 draws seeds from r * SEED_STRIDE on (rank 0 from the demo's seed; restarts add one).
SEED_STRIDE = 100_003


def traffic(tripping: bool) -> Any:
    from kvguard.sim.traffic import Traffic  # noqa: PLC0415

    if tripping:
        return Traffic(arrival_rate=0.5, prompt_median_tokens=1024, leak_bytes_per_request=LEAK)
    return Traffic(arrival_rate=0.4, prompt_median_tokens=1024)


class _Life:
    """One life of one rank: what serves it and its budget watch (the verdict, once taken)."""

    def __init__(self, serving: Any):
        from kvguard.sim.guarded import BudgetWatch  # noqa: PLC0415

        self.serving = serving
        self.watch = BudgetWatch(serving.startup_scenario)
        self.verdict: Any = None
        self.judged = False


class DemoSource:
    """Simulated ranks numbered as one node's devices ``npu:0..N-1``, each its own sim source."""

    name = "sim"

    def __init__(self, ranks: int = 2, steps_per_sample: int = STEPS_PER_SAMPLE, seed: int = 0):
        from kvguard.sim.source import SimSource

        if ranks < 1:
            raise ValueError("the demo needs at least one rank")
        self._lives: list[_Life | None] = [None] * ranks
        self._sources = []
        for rank in range(ranks):
            tripping = ranks > 1 and rank == ranks - 1
            config = TRIPPING if tripping else SERVING
            rank_seed = seed + (TRIPPING_SEED if tripping else SEED_STRIDE * rank)
            self._sources.append(
                SimSource(
                    ranks=1,
                    steps_per_sample=steps_per_sample,
                    seed=rank_seed,
                    traffic=traffic(tripping),
                    on_scenario=self._watcher(rank),
                    **config,
                )
            )
        # One lock per rank: its probe steps it while the engine-metrics server reads it.
        self._locks = [threading.Lock() for _ in range(ranks)]

    def _watcher(self, rank: int) -> Callable[[Any], None]:
        def watch(serving: Any) -> None:
            self._lives[rank] = _Life(serving)

        return watch

    @property
    def ranks(self) -> int:
        return len(self._sources)

    def device(self, rank: int) -> str:
        return f"npu:{rank}"

    def sample_rank(self, rank: int) -> list[DeviceMemory]:
        with self._locks[rank]:
            return [renumbered(record, "npu", rank) for record in self._sources[rank].sample()]

    def sample(self) -> list[DeviceMemory]:
        return [record for rank in range(self.ranks) for record in self.sample_rank(rank)]

    def serving(self, rank: int) -> Any:
        """What serves demo rank ``rank`` now (a ``LiveServing``; a new one after each restart)."""
        if not 0 <= rank < self.ranks:
            raise IndexError(f"no demo rank {rank}")
        return self._sources[rank]._scenarios[0]  # noqa: SLF001 - the sim source's one rank

    def rank_contexts(self) -> dict[str, RankContext]:
        contexts = {}
        for rank in range(self.ranks):
            contexts.update(self.rank_context(rank))
        return contexts

    def rank_context(self, rank: int) -> dict[str, RankContext]:
        with self._locks[rank]:
            source = self._sources[rank]
            context = source.rank_contexts().get(source.device(0))
        return {} if context is None else {self.device(rank): dataclasses.replace(context, rank=rank)}

    def budget_verdict(self, rank: int) -> tuple[Any, bool]:
        """(the budget-time verdict of rank ``rank``'s current life, whether it is new since the last call):
        taken once, after the life's startup fixed its budget; None before that or where startup failed."""
        with self._locks[rank]:
            life = self._lives[rank]
            if life is None or life.judged or not life.watch.captured or life.serving.num_blocks is None:
                return (life.verdict if life else None), False
            life.judged = True
            life.verdict = life.watch.verdict()
            return life.verdict, True

    def rank_source(self, rank: int) -> "RankSource":
        return RankSource(self, rank)

    def engine_metrics(self) -> bytes:
        """vLLM's Prometheus series of every rank's simulated engine (module docstring), as text."""
        from prometheus_client import CollectorRegistry, generate_latest  # noqa: PLC0415

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_EngineCollector(self))
        return generate_latest(registry)

    def engine_state(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s engine as vLLM's scheduler stats say it: blocks, usage, running, waiting."""
        with self._locks[rank]:
            serving = self.serving(rank)
            blocks = serving.num_blocks
            usage = None if not blocks else (blocks - serving.free_blocks) / blocks
            return {
                "num_gpu_blocks": blocks,
                "block_size": serving.kv_layout.block_size,
                "gpu_memory_utilization": serving.config.gpu_memory_utilization,
                "kv_cache_usage": usage,
                "running": serving.num_running,
                "waiting": serving.num_waiting,
            }


class RankSource:
    """One demo rank as a source of its own, for that rank's probe; hands the probe the budget-time
    verdict once the rank's startup has fixed its budget (``on_budget_verdict``)."""

    name = "sim"

    def __init__(self, demo: DemoSource, rank: int):
        self.demo, self.rank = demo, rank
        self.on_budget_verdict: Callable[[Any], None] | None = None

    def sample(self) -> list[DeviceMemory]:
        records = self.demo.sample_rank(self.rank)
        verdict, new = self.demo.budget_verdict(self.rank)
        if new and verdict is not None and self.on_budget_verdict is not None:
            self.on_budget_verdict(verdict)
        return records

    def rank_contexts(self) -> dict[str, RankContext]:
        return self.demo.rank_context(self.rank)


SIMULATED = "kvguard demo's simulated engine: "


class _EngineCollector:
    def __init__(self, demo: DemoSource):
        self.demo = demo

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily  # noqa: PLC0415

        from kvguard.vllm.metrics import CACHE_CONFIG, USAGE_NAMES  # noqa: PLC0415 - the names the sidecar reads

        info = GaugeMetricFamily(
            CACHE_CONFIG,
            SIMULATED + "Information of the LLMEngine CacheConfig",
            labels=["block_size", "engine", "gpu_memory_utilization", "num_gpu_blocks"],
        )
        families = {
            name: GaugeMetricFamily(name, SIMULATED + text, labels=["model_name", "engine"])
            for name, text in (
                ("vllm:num_requests_running", "Number of requests in model execution batches."),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
                (USAGE_NAMES[0], "KV-cache usage. 1 means 100 percent usage."),
            )
        }
        for rank in range(self.demo.ranks):
            state, engine = self.demo.engine_state(rank), str(rank)
            if state["num_gpu_blocks"] is None:
                continue  # startup has not sized the KV cache yet
            info.add_metric(
                [str(state["block_size"]), engine, str(state["gpu_memory_utilization"]), str(state["num_gpu_blocks"])],
                1.0,
            )
            labels = [MODEL_NAME, engine]
            families["vllm:num_requests_running"].add_metric(labels, state["running"])
            families["vllm:num_requests_waiting"].add_metric(labels, state["waiting"])
            families[USAGE_NAMES[0]].add_metric(labels, state["kv_cache_usage"])
        yield info
        yield from families.values()


class EngineMetricsServer:
    """The simulated engines' ``/metrics`` on ``127.0.0.1``, a free port; :attr:`url` is what
    ``--vllm-metrics-url`` takes. Only the demo starts one."""

    def __init__(self, demo: DemoSource, host: str = "127.0.0.1", port: int = 0):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404)
                    return
                try:
                    body = demo.engine_metrics()
                except Exception as exc:  # noqa: BLE001 - one line to the scraper and the log, never a traceback
                    message = one_line(exc, with_type=True)
                    event(logging.getLogger(LOGGER), logging.ERROR, "demo engine metrics failed", error=message)
                    self._answer(500, f"error: {message}\n".encode(), "text/plain; charset=utf-8")
                    return
                self._answer(200, body, "text/plain; version=0.0.4; charset=utf-8")

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                # what escapes a handler (a scraper gone mid-answer): one log line, never a traceback
                event(
                    logging.getLogger(LOGGER),
                    logging.ERROR,
                    "demo engine request failed",
                    error=one_line(sys.exc_info()[1], with_type=True),
                )

        self._server = Server((host, port), Handler)
        self.url = f"http://{host}:{self._server.server_address[1]}/metrics"
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvguard-demo-engine", daemon=True)

    def start(self) -> "EngineMetricsServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


@dataclasses.dataclass
class Demo:
    """A running demo: one probe per rank, and the simulated engines' /metrics."""

    source: DemoSource
    probes: list
    engine_metrics: EngineMetricsServer

    @property
    def vllm_metrics_url(self) -> str:
        return self.engine_metrics.url

    def stop(self) -> None:
        for probe in self.probes:
            probe.stop()
        self.engine_metrics.stop()


def start_demo(spool_dir: str, ranks: int, interval: float = 1.0) -> Demo:
    """Start the demo ranks' probes (one per rank, engine index = rank) and their engines' /metrics."""
    from kvguard.probe import Probe

    source = DemoSource(ranks=ranks)
    server = EngineMetricsServer(source).start()
    probes = []
    try:
        for rank in range(ranks):
            rank_source = source.rank_source(rank)
            probe = Probe(
                spool_dir,
                source=rank_source,
                interval=interval,
                sample_timeout=max(interval, 5.0),
                rank=rank,
                environ={},
            )
            probe.set_engine(MODEL_NAME, rank)
            rank_source.on_budget_verdict = probe.set_budget_verdict
            probes.append(probe.start())
    except BaseException:
        Demo(source, probes, server).stop()
        raise
    return Demo(source, probes, server)
