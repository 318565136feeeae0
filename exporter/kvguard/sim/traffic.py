"""Open-loop serving traffic for the demo: requests arrive, are prefilled in chunks, decode, finish.

:class:`ServingScenario` serves a fixed batch of requests queued at time 0 and reads the
counters between forward passes, where only weights and KV cache are live, so a probe sampling
it sees the same bytes every time. :class:`LiveServing` keeps the scenario's startup (weights,
profile run, vLLM's KV-cache budget, the KV cache allocated per layer: ``ServingScenario.startup``)
and serves an open stream instead, driving the same allocator through its public
``malloc`` / ``free`` with the forward passes of :func:`kvguard.sim.workload.forward_ops`:

- arrivals are a Poisson process, ``Traffic.arrival_rate`` requests per scheduler step on
  average (exponential gaps), seeded by ``ScenarioConfig.seed``, so a restart with a new seed
  gets a different arrival sequence;
- prompt lengths are log-normal (median ``prompt_median_tokens``, shape ``prompt_sigma``),
  output lengths geometric (mean ``output_mean_tokens``), both clamped to ``max_model_len``;
- each scheduler step is vLLM V1's, simplified as the scenario's is: running requests first
  (one decode token, or the next prefill chunk), then waiting ones first come first served, in
  one token budget (``max_num_batched_tokens``) and at most ``max_num_seqs`` sequences; KV
  blocks are taken per token, returned when a request finishes, and the newest request is
  preempted (recomputed later) when they run out;
- a forward pass is left in flight between calls: ``step()`` finishes the previous pass and
  runs the next one up to a seeded point, so ``memory_stats()`` read between calls sees what a
  probe thread sees when it reads while the engine thread is inside a forward (the activations
  of that batch live), and allocated, reserved and their gap move from sample to sample.

An allocator failure ends the run (``oom``), as in the scenario; the caller restarts it.
Costs about 1.5 ms of CPU per forward pass for Qwen2.5-7B (28 layers).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Any

from kvguard.allocators.base import AllocatorOutOfMemory
from kvguard.budget.estimator import Profile
from kvguard.sim.scenario import Request, ScenarioConfig, ServingScenario, sampling_batch
from kvguard.sim.scheduler import Scheduler, Sequence


@dataclass(frozen=True)
class Traffic:
    """The request stream one rank serves."""

    arrival_rate: float = 0.5  # requests per scheduler step (Poisson)
    prompt_median_tokens: int = 1024  # log-normal prompt lengths
    prompt_sigma: float = 1.0
    output_mean_tokens: int = 128  # geometric output lengths
    # Device memory each finished request leaves allocated and never freed (a per-request
    # state a cache keeps referenced): 0 for a healthy server; the demo's tripping rank leaks.
    leak_bytes_per_request: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.arrival_rate <= 64:
            raise ValueError(f"arrival_rate must be in (0, 64] requests per step, got {self.arrival_rate}")
        for name in ("prompt_median_tokens", "output_mean_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.leak_bytes_per_request <= 1 << 30:
            raise ValueError(f"leak_bytes_per_request must be in [0, 1 GiB], got {self.leak_bytes_per_request}")
        if not 0 <= self.prompt_sigma <= 4:
            raise ValueError(f"prompt_sigma must be in [0, 4], got {self.prompt_sigma}")


class LiveServing:
    """One rank: the scenario's startup, then an open request stream (module docstring).

    Offers what :class:`kvguard.sim.source.SimSource` reads from a scenario: ``config``,
    ``step()``, ``finished``, ``memory_stats()``, ``device_memory()``, ``profile``,
    ``num_blocks``, ``kv_layout``, ``oom``; plus ``arrivals`` (the arrival steps so far, for tests)
    and ``requests_finished``.
    """

    MAX_QUEUE = 4096  # waiting requests kept; later arrivals are refused (counted), so memory stays bounded

    def __init__(self, config: ScenarioConfig, traffic: Traffic | None = None) -> None:
        self.config = config
        self.traffic = traffic or Traffic()
        # requests=1: the scenario's own queued batch is unused; only its startup runs.
        self._scenario = ServingScenario(replace(config, requests=1))
        self.kv_layout = self._scenario.kv_layout
        self._rng = random.Random(config.seed)
        self._sampling_rng = random.Random(f"sampling-{config.seed}")  # as make_requests draws the kinds
        self._max_len = config.resolved_max_model_len
        self._clock = 0.0
        self._next_arrival = self._rng.expovariate(self.traffic.arrival_rate)
        self._scheduler = Scheduler(
            self.kv_layout.block_size, config.max_num_batched_tokens, config.max_num_seqs, reject_unfittable=True
        )
        self._pending: list | None = None  # the in-flight forward: (ops, next index, live addresses)
        self._started = False
        self.arrivals: list[int] = []  # the step of each arrival, in order (the first 1024)
        self._queue_full = 0  # arrivals refused because the waiting queue was full
        self.leaked_bytes = 0
        self.requests_finished = 0
        self.step_index = 0
        self.num_tokens = 0  # tokens scheduled in the last step
        self._oom = False
        self.oom_at_step: int | None = None
        self.oom_request_bytes: int | None = None

    # ------------------------------------------------------------------ what the source reads
    @property
    def profile(self) -> Profile | None:
        return self._scenario.profile

    @property
    def num_blocks(self) -> int | None:
        return self._scenario.num_blocks

    @property
    def kv_cache_bytes(self) -> int | None:
        return self._scenario.kv_cache_bytes

    @property
    def oom(self) -> bool:
        return self._oom or self._scenario.oom

    @property
    def error(self) -> str | None:
        return self._scenario.error

    @property
    def finished(self) -> bool:
        return self.oom or self._scenario.error is not None

    @property
    def allocator(self) -> Any:
        return self._scenario.allocator

    def memory_stats(self) -> dict[str, Any]:
        return self._scenario.memory_stats()

    def device_memory(self) -> tuple[int, int]:
        return self._scenario.device_memory()

    @property
    def startup_scenario(self) -> ServingScenario:
        """The scenario whose startup this serving run keeps (weights, profile run, budget, KV cache)."""
        return self._scenario

    @property
    def free_blocks(self) -> int:
        """KV-cache blocks no request holds (0 before startup)."""
        return self._scheduler.free_blocks

    @property
    def num_running(self) -> int:
        return len(self._scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self._scheduler.waiting)

    @property
    def refused(self) -> int:
        """Requests never served: the queue was full, or one could not fit even alone (vLLM rejects it)."""
        return self._queue_full + self._scheduler.rejected

    @property
    def preemptions(self) -> int:
        return self._scheduler.preemptions

    # ------------------------------------------------------------------ serving
    def step(self) -> None:
        """Finish the forward in flight, schedule the next step and run its forward part way."""
        if not self._started:
            self._started = True
            self._scenario.startup()
            self._scheduler.free_blocks = self._scenario.num_blocks or 0
        if self.finished:
            return
        try:
            self._finish_pending()
            self._arrive()
            scheduled = self._scheduler.schedule()
            num_tokens = self.num_tokens = sum(tokens for _, tokens in scheduled)
            if scheduled:
                gathered = tuple(
                    seq.computed + tokens
                    for seq, tokens in scheduled
                    if self.config.gathers_kv and seq.in_prefill and seq.computed > 0
                )
                ops = self._scenario._ops(
                    num_tokens,
                    len(scheduled),
                    gathered,  # noqa: SLF001 - its cache
                    sampling=sampling_batch(scheduled),
                )
                self._pending = [ops, 0, {}]
                self._run_pending(self._rng.randrange(len(ops)))
            self._advance(scheduled)
        except AllocatorOutOfMemory as exc:
            self._release_pending()
            self._oom = True
            self.oom_at_step = self.step_index
            self.oom_request_bytes = exc.requested_bytes
        self.step_index += 1

    def _arrive(self) -> None:
        self._clock += 1.0
        traffic = self.traffic
        while self._next_arrival <= self._clock:
            self._next_arrival += self._rng.expovariate(traffic.arrival_rate)
            mean = traffic.output_mean_tokens
            output = 1 if mean == 1 else 1 + int(math.log(1.0 - self._rng.random()) / math.log(1.0 - 1.0 / mean))
            output = min(output, self._max_len - 1)
            prompt = int(self._rng.lognormvariate(math.log(traffic.prompt_median_tokens), traffic.prompt_sigma))
            prompt = max(1, min(prompt, self._max_len - output))
            if len(self._scheduler.waiting) >= self.MAX_QUEUE:
                self._queue_full += 1
                continue
            if len(self.arrivals) < 1024:
                self.arrivals.append(self.step_index)
            kind = self._sampling_rng.choices(
                [k for k, _ in self.config.sampling_mix], [float(share) for _, share in self.config.sampling_mix]
            )[0]
            self._scheduler.waiting.append(Sequence(prompt, output, Request(0, prompt, output, False, kind)))

    def _advance(self, scheduled: list[tuple[Sequence, int]]) -> None:
        leak = self.traffic.leak_bytes_per_request
        for _ in self._scheduler.advance(scheduled):
            self.requests_finished += 1
            if leak:
                self._scenario.allocator.malloc(leak)  # kept: never freed
                self.leaked_bytes += leak

    # ------------------------------------------------------------------ the forward in flight
    def _run_pending(self, stop: int) -> None:
        ops, index, live = self._pending
        malloc = self._scenario.allocator.malloc
        free = self._scenario.allocator.free
        while index < stop:
            key, size = ops[index]
            if size is None:
                free(live.pop(key))
            else:
                live[key] = malloc(size)
            index += 1
        self._pending[1] = index

    def _finish_pending(self) -> None:
        if self._pending is not None:
            self._run_pending(len(self._pending[0]))
            self._pending = None

    def _release_pending(self) -> None:
        if self._pending is not None:
            free = self._scenario.allocator.free
            for addr in self._pending[2].values():
                free(addr)
            self._pending = None
