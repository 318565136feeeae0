"""A vLLM serving run on a simulated device: startup as vLLM measures it, then serving.

API (stable; the probe's ``sim`` source and ``kvguard serve --demo`` drive it)::

    from kvguard.sim.scenario import ScenarioConfig, ServingScenario

    config = ScenarioConfig(model_config=json.load(f), device_memory_bytes=32 << 30,
                            gpu_memory_utilization=0.9, allocator="mindspore", budget="stock")
    scenario = ServingScenario(config)      # nothing allocated yet
    scenario.startup()                      # weights, profile run, budget, KV cache -> Profile
    while not scenario.finished:
        record = scenario.step()            # one scheduler step -> StepRecord
        stats = scenario.memory_stats()     # the allocator's own dict, real key names
        free, total = scenario.device_memory()
    result = scenario.result()              # ScenarioResult; .to_dict() for --json

    result = ServingScenario(config).run()  # the same, start to finish

``ServingScenario`` members:

- ``startup() -> Profile``: loads the weights (MindSpore: persistent pool), runs the
  profile forward at ``max_num_batched_tokens`` the way vLLM's ``memory_profiling``
  measures it (peak stats reset before; allocated-peak increase and reserved increase
  read before ``empty_cache``), sizes the KV cache with
  ``kvguard.budget.estimator.stock_kv_cache_bytes`` or ``reserved_kv_cache_bytes`` and
  allocates it per layer as vLLM does. An OOM here ends the run (``oom_phase``). Idempotent.
- ``step() -> StepRecord``: one scheduler step (chunked prefill, FCFS, preemption when
  KV blocks run out); calls ``startup()`` first if needed; after the run is
  ``finished`` it returns the last record again.
- ``memory_stats() -> dict``: ``torch.cuda.memory_stats()``-style flattened dict for
  ``torch``/``torch_npu``, ``mindspore.runtime.memory_stats()``-style dict for ``mindspore``.
- ``device_memory() -> (free_bytes, total_bytes)``: as ``mem_get_info`` returns it.
- properties: ``profile`` (``Profile`` or None), ``kv_cache_bytes``, ``num_blocks``,
  ``oom`` (bool), ``oom_at_step`` (serving step index or None), ``oom_phase``
  (``"weights" | "profile" | "kv_cache" | "serving" | None``), ``error`` (one line or
  None, e.g. no memory for the cache blocks), ``finished``, ``step_index``,
  ``timeline`` (tuple of ``StepRecord``), ``kv_layout``, ``allocator``, ``device``.
- ``run(progress=None) -> ScenarioResult``: drives to the end; ``progress(done, total)``
  is called after each step when given.

MindSpore's pool follows one release (``mindspore_version``, default the one the
``vllm_mindspore_version`` launcher pins) under the deployment's knobs (``mindspore_mode``,
``task_sink``, ``ms_alloc_conf``, ``mempool_block_size_bytes``, ``soc_supports_vmm``); the
defaults are what that vllm-mindspore launcher sets (``sim/mindspore_releases.py``).

Everything is deterministic for a given config (the request mix comes from ``seed``).

Speed: a forward that leaves the allocator as it found it is recorded once and replayed when it meets
the same allocator state again, and decoder layers that bring the allocator back to an earlier state
are not run again (``ServingScenario._forward``; ``kvguard.allocators.base.record_steady``). Both are
exact: every counter, peak and address ends as running each op would leave it. Runs can share one
:class:`ForwardMemo` (``ServingScenario(config, memo)``), as ``search_gpu_memory_utilization`` does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from kvguard.allocators import native
from kvguard.allocators.base import AllocatorOutOfMemory, record_steady, replay_steady
from kvguard.allocators.device import DEFAULT_NON_ALLOCATOR_BYTES, Device
from kvguard.allocators.mindspore_releases import (
    DEFAULT_LAUNCHER,
    SEED_LAUNCHER,
    VLLM_MINDSPORE_LAUNCHERS,
    parse_alloc_conf,
    release,
    vmm_on,
)
from kvguard.allocators.torch_alloc import parse_alloc_conf as parse_torch_alloc_conf
from kvguard.budget.estimator import (
    KVLayout,
    Profile,
    estimate,
    kv_cache_tensor_bytes,
    kv_layout_from_config,
    positive_int,
    reserved_kv_cache_bytes,
    stock_kv_cache_bytes,
    text_config,
)
from kvguard.budget.sampler import SAMPLING_KINDS, SamplingBatch, unprofiled_sampler_peak_bytes
from kvguard.sim.mindformers import MindFormersPath, mindformers_path
from kvguard.sim.scheduler import Scheduler, Sequence
from kvguard.sim.workload import (
    ModelShape,
    forward_chunks,
    forward_ops,
    model_shape,
    weight_tensors,
)
from kvguard.vllm.eras import era_for, kv_tensor_style

ALLOCATORS = ("torch", "torch_npu", "mindspore")
# The release a run on torch or torch_npu stands for: vLLM V1 with one KV tensor per layer (its era row).
# vllm-ascend itself allocates a K and a V tensor per layer (its rows); the simulated torch_npu runs keep
# vLLM's allocation, which the guard grid's figures were measured on.
SIMULATED_VLLM = "vllm:0.11.0"
BUDGETS = ("stock", "reserved")
MIB = 1 << 20
GIB = 1 << 30


_MINDSPORE_FIELDS = (
    "vllm_mindspore_version",
    "mindspore_version",
    "mindspore_mode",
    "task_sink",
    "ms_alloc_conf",
    "mempool_block_size_bytes",
    "soc_supports_vmm",
)


@dataclass(frozen=True)
class ScenarioConfig:
    """Everything a run depends on; bytes are ints."""

    model_config: Mapping[str, Any]
    device_memory_bytes: int
    gpu_memory_utilization: float = 0.9
    allocator: str = "torch"
    budget: str = "stock"
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's max_position_embeddings, at most 32768
    max_num_seqs: int = 256
    requests: int = 64
    seed: int = 0
    long_request_fraction: float = 0.25  # share of requests with prompts of max_model_len/2 or more
    short_prompt_tokens: tuple[int, int] = (32, 1024)
    short_output_tokens: tuple[int, int] = (16, 256)
    long_output_tokens: tuple[int, int] = (16, 128)
    # How the requests sample, as (kind, share) pairs over budget.sampler.SAMPLING_KINDS; each request draws its kind
    # (from a stream of its own: the prompts and outputs stay as they were), and vLLM's sampler runs per batch
    # (budget.sampler.SamplingBatch). Default, every request top-k and top-p: since vLLM 0.8.0 --generation-config is
    # "auto" (vllm-project/vllm#12622; vllm/config/model.py 0.11.0:237), so the model's generation_config.json
    # sets the top_k, top_p and temperature of every request that does not set its own
    # (get_diff_sampling_param, :1344-1393), and chat models ship both (Qwen's, as vLLM logs it in
    # vllm-project/vllm#15281: top_k, top_p, temperature, repetition_penalty). sampling_mix=(("greedy", 1.0),)
    # is a server started with --generation-config vllm whose clients send temperature 0.
    sampling_mix: tuple[tuple[str, float], ...] = (("top_k_top_p", 1.0),)
    # After the requests drain, the batch vLLM budgets for, as real requests form it (make_peak_burst): the
    # profile run is _dummy_run(max_num_tokens) (vllm/v1/worker/gpu_model_runner.py 0.11.0:3392), and that many
    # requests waiting at once are scheduled in one step of that shape (v1/core/sched/scheduler.py 0.11.0:198,
    # :337). Off by default: the request mix alone seldom reaches it.
    peak_burst: bool = False
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    non_allocator_bytes: int | None = None  # None: DEFAULT_NON_ALLOCATOR_BYTES[allocator]
    profile_non_allocator_growth_bytes: int = 0  # runtime workspace that appears on the first forward
    # PyTorch caching allocator
    max_split_size_bytes: int | None = None
    expandable_segments: bool = False
    alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF / PYTORCH_NPU_ALLOC_CONF, as the variant parses it
    # MindSpore pool (sim/mindspore_releases.py). Defaults: what vllm-mindspore's launcher sets
    # (``vllm_mindspore_version``): its pinned MindSpore, its MS_ALLOC_CONF, PyNative with O0 jit.
    vllm_mindspore_version: str = DEFAULT_LAUNCHER
    mindspore_version: str | None = None  # None: the one the launcher pins
    mindspore_mode: str = "pynative"  # "pynative" or "graph"
    task_sink: bool = False  # from the first forward: jit_level O0/O1 run kernel by kernel, no task sink
    ms_alloc_conf: str | None = None  # None: the launcher's MS_ALLOC_CONF
    mempool_block_size_bytes: int | None = None  # MS_MEMPOOL_BLOCK_SIZE / set_memory(increase_size=)
    soc_supports_vmm: bool = True  # 910B / 910_93 with a VMM driver: VMM on unless MS_ALLOC_CONF says off
    gather_kv_on_chunked_prefill: bool | None = None  # None: True for mindspore

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"unknown allocator {self.allocator!r} (choose from {', '.join(ALLOCATORS)})")
        if self.budget not in BUDGETS:
            raise ValueError(f"unknown budget {self.budget!r} (choose from {', '.join(BUDGETS)})")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.device_memory_bytes <= 0:
            raise ValueError("device memory must be positive")
        for name in ("max_num_batched_tokens", "max_num_seqs", "requests", "block_size", "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.long_request_fraction <= 1:
            raise ValueError("long_request_fraction must be in [0, 1]")
        check_sampling_mix(self.sampling_mix)
        if self.vllm_mindspore_version not in VLLM_MINDSPORE_LAUNCHERS:
            raise ValueError(
                f"unknown vllm-mindspore launcher {self.vllm_mindspore_version!r} "
                f"(known: {', '.join(VLLM_MINDSPORE_LAUNCHERS)})"
            )
        if self.mindspore_mode not in ("pynative", "graph"):
            raise ValueError(f"mindspore_mode must be 'pynative' or 'graph', got {self.mindspore_mode!r}")
        if self.mempool_block_size_bytes is not None and self.mempool_block_size_bytes <= 0:
            raise ValueError("the mempool block size must be positive")
        if self.alloc_conf is not None:
            if self.allocator == "mindspore":
                raise ValueError("alloc_conf is PyTorch's and torch_npu's; MindSpore's pool takes ms_alloc_conf")
            self.torch_alloc_kwargs  # unknown keys and bad values fail here, in one line
        self.mindspore_release  # unknown versions and MS_ALLOC_CONF keys fail here, in one line
        self.resolved_alloc_conf.vmm_page_bytes

    @property
    def torch_alloc_kwargs(self) -> dict[str, Any]:
        """The caching allocator's options: the config's fields, then ``alloc_conf`` (which wins) parsed by
        :func:`~kvguard.allocators.torch_alloc.parse_alloc_conf` as that variant's own parser reads it."""
        kwargs: dict[str, Any] = {
            "max_split_size": self.max_split_size_bytes,
            "expandable_segments": self.expandable_segments,
        }
        if self.alloc_conf:
            kwargs.update(parse_torch_alloc_conf(self.alloc_conf, self.allocator))
        return kwargs

    @property
    def mindspore_release(self):
        launcher = VLLM_MINDSPORE_LAUNCHERS[self.vllm_mindspore_version]
        return release(self.mindspore_version or launcher.mindspore)

    @property
    def resolved_alloc_conf(self):
        if self.ms_alloc_conf is not None:
            return parse_alloc_conf(self.ms_alloc_conf, self.mindspore_release)
        launcher = VLLM_MINDSPORE_LAUNCHERS[self.vllm_mindspore_version]
        return parse_alloc_conf(launcher.ms_alloc_conf, self.mindspore_release, strict=False)

    @property
    def enable_vmm(self) -> bool:
        # jit_level O2 with GE kernels disabled is not a vllm-mindspore setting.
        return vmm_on(
            self.ms_alloc_conf,
            launcher_vmm=era_for(self.vllm_release).vmm_default,
            mindspore=self.mindspore_release,
            soc_supports_vmm=self.soc_supports_vmm,
        )

    @property
    def vllm_release(self) -> str:
        """The release the run stands for: the vllm-mindspore launcher on MindSpore's pool; vLLM V1's own
        per-layer allocation on torch and torch_npu (SIMULATED_VLLM)."""
        if self.allocator == "mindspore":
            return f"vllm-mindspore:{self.vllm_mindspore_version}"
        return SIMULATED_VLLM

    @property
    def mindformers_path(self) -> MindFormersPath | None:
        """The MindFormers network the launcher serves this model through, if it does (kvguard.sim.mindformers)."""
        launcher = self.vllm_mindspore_version if self.allocator == "mindspore" else None
        return mindformers_path(launcher, self.model_config)

    @property
    def profile_runs_sampler(self) -> bool:
        """Whether the release's profile run ends with a top-k/top-p sampler run (``workload.profile_sampler_ops``):
        vLLM V1's on CUDA does (vllm/v1/worker/gpu_model_runner.py 0.11.0:3393-3397, _dummy_sampler_run), and so
        does vllm-mindspore's, which keeps vLLM's profile_run and _dummy_sampler_run (vllm_mindspore/__init__.py
        @ 0.5.1:290-343 patches other GPUModelRunner methods; :386-403 patches the top-k/top-p functions, whose
        tensors are modelled as vLLM's); vllm-ascend's, which torch_npu stands for, computes the logits only
        (vllm_ascend/worker/model_runner_v1.py 0.11.0:2596-2598, "need to run a dummy sampler"). The seed's
        vllm-mindspore 0.2.0 runs vLLM's V0 engine, whose profile run samples with V0's sampler: not modelled, so
        its profile keeps the plain sampling ops (the seed's story tests hold it so)."""
        if self.allocator == "mindspore":
            return self.vllm_mindspore_version != SEED_LAUNCHER
        return self.allocator != "torch_npu"

    @property
    def kv_tensor_style(self) -> str:
        """How that release allocates the KV cache (its era row's kv_tensor_style)."""
        return kv_tensor_style(self.vllm_release)

    @property
    def peak_burst_requests(self) -> int:
        """How many requests the peak burst adds (make_peak_burst): 0 without one."""
        return min(self.max_num_seqs, self.max_num_batched_tokens) if self.peak_burst else 0

    @property
    def resolved_max_model_len(self) -> int:
        if self.max_model_len:
            return self.max_model_len
        value = positive_int(text_config(self.model_config), "max_position_embeddings")
        return 32768 if value is None else min(value, 32768)

    @property
    def resolved_non_allocator_bytes(self) -> int:
        if self.non_allocator_bytes is not None:
            return self.non_allocator_bytes
        return DEFAULT_NON_ALLOCATOR_BYTES[self.allocator]

    @property
    def gathers_kv(self) -> bool:
        if self.gather_kv_on_chunked_prefill is not None:
            return self.gather_kv_on_chunked_prefill
        return self.allocator == "mindspore"

    def summary(self) -> dict[str, Any]:
        """The config without the model's JSON, for reports."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "model_config"}
        for key, value in out.items():
            if isinstance(value, tuple):
                out[key] = list(value)
        out["max_model_len"] = self.resolved_max_model_len
        out["non_allocator_bytes"] = self.resolved_non_allocator_bytes
        out["gather_kv_on_chunked_prefill"] = self.gathers_kv
        if self.allocator == "mindspore":
            out["mindspore_version"] = self.mindspore_release.version
            out["enable_vmm"] = self.enable_vmm
            out["ms_alloc_conf_effective"] = dict(self.resolved_alloc_conf.items)
        else:
            for key in _MINDSPORE_FIELDS:
                out.pop(key, None)
        if self.allocator == "mindspore" or self.alloc_conf is None:
            out.pop("alloc_conf", None)
        return out


def check_sampling_mix(mix: tuple[tuple[str, float], ...]) -> None:
    """ValueError (one line) unless ``mix`` is (kind, share) pairs of known kinds, shares >= 0, some > 0."""
    try:
        kinds = [kind for kind, _ in mix]
        shares = [float(share) for _, share in mix]
    except (TypeError, ValueError):
        raise ValueError("sampling_mix must be (kind, share) pairs") from None
    unknown = [kind for kind in kinds if kind not in SAMPLING_KINDS]
    if unknown:
        raise ValueError(f"unknown sampling kind {unknown[0]!r} (known: {', '.join(SAMPLING_KINDS)})")
    if len(set(kinds)) != len(kinds):
        raise ValueError("sampling_mix names a kind twice")
    if not all(0 <= share < float("inf") for share in shares) or not sum(shares) > 0:
        raise ValueError("sampling_mix shares must be finite, at least 0, and not all 0")


def parse_sampling_mix(text: str) -> tuple[tuple[str, float], ...]:
    """``greedy:0.5,top_k_top_p:0.5`` (shares need not add up to 1) as ScenarioConfig.sampling_mix."""
    mix = []
    for item in text.split(","):
        kind, colon, share = item.strip().partition(":")
        try:
            if not colon:
                raise ValueError
            mix.append((kind.strip(), float(share)))
        except ValueError:
            raise ValueError(f"sampling mix: expected KIND:SHARE, got {item.strip()[:40]!r}") from None
    check_sampling_mix(tuple(mix))
    return tuple(mix)


@dataclass(frozen=True)
class Request:
    request_id: int
    prompt_tokens: int
    output_tokens: int
    is_long: bool
    sampling: str = "greedy"  # budget.sampler.SAMPLING_KINDS


@dataclass(frozen=True)
class StepRecord:
    """One point of the timeline: the step's peaks and its end state, in bytes."""

    step: int  # serving step index; -1 for startup phases
    phase: str  # "weights", "profile", "kv_cache", "serving"
    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_used_bytes: int
    num_running: int = 0
    num_waiting: int = 0
    num_tokens: int = 0
    kv_blocks_used: int = 0


@dataclass(frozen=True)
class ScenarioResult:
    config: ScenarioConfig
    oom: bool
    oom_at_step: int | None
    oom_phase: str | None
    oom_request_bytes: int | None
    error: str | None
    profile: Profile | None
    kv_cache_bytes: int | None
    num_blocks: int | None
    steps: int
    requests_finished: int
    preemptions: int
    memory_stats: dict[str, Any]
    device_free_bytes: int
    device_total_bytes: int
    device_peak_used_bytes: int
    timeline: tuple[StepRecord, ...] = field(repr=False, default=())
    kv_layout: KVLayout | None = None
    engine: str = "python"  # which implementation of the allocator model ran (allocators.native)

    def to_dict(self) -> dict[str, Any]:
        est = estimate(self.profile, self.kv_layout, self.config.resolved_max_model_len) if self.profile else None
        return {
            "oom": self.oom,
            "oom_at_step": self.oom_at_step,
            "oom_phase": self.oom_phase,
            "oom_request_bytes": self.oom_request_bytes,
            "error": self.error,
            "budget": self.config.budget,
            "allocator": self.config.allocator,
            "allocator_engine": self.engine,
            "kv_cache_bytes": self.kv_cache_bytes,
            "num_blocks": self.num_blocks,
            "profile": self.profile.to_dict() if self.profile else None,
            "estimate": est.to_dict() if est else None,
            "steps": self.steps,
            "requests_finished": self.requests_finished,
            "requests": self.config.requests,
            "peak_burst_requests": self.config.peak_burst_requests,
            "preemptions": self.preemptions,
            "device": {
                "total_bytes": self.device_total_bytes,
                "free_bytes": self.device_free_bytes,
                "peak_used_bytes": self.device_peak_used_bytes,
            },
            "memory_stats": _jsonable(self.memory_stats),
            "config": self.config.summary(),
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def make_requests(config: ScenarioConfig) -> list[Request]:
    """The seeded request mix: short chat-like requests and long-context ones."""
    rng = random.Random(config.seed)
    max_len = config.resolved_max_model_len
    requests = []
    for request_id in range(config.requests):
        is_long = rng.random() < config.long_request_fraction
        if is_long:
            out_lo, out_hi = config.long_output_tokens
            output = rng.randint(out_lo, out_hi)
            lo = max(1, max_len // 2)
            prompt = rng.randint(lo, max(lo, max_len - output))  # an empty range was an error before
        else:
            out_lo, out_hi = config.short_output_tokens
            output = rng.randint(out_lo, out_hi)
            lo, hi = config.short_prompt_tokens
            prompt = rng.randint(lo, max(lo, min(hi, max_len - output)))
        # vLLM refuses prompt + output > max_model_len: clamp (after the draws, so the mix of a
        # roomy max_model_len is unchanged), keeping at least one token of each.
        output = max(1, min(output, max_len - 1))
        prompt = max(1, min(prompt, max_len - output))
        requests.append(Request(request_id, prompt, output, is_long))
    # The sampling kinds from a stream of their own, so a mix changes no prompt or output length.
    kinds = sampling_draws(config, f"sampling-{config.seed}", len(requests))
    return [replace(request, sampling=kind) for request, kind in zip(requests, kinds)]


def sampling_draws(config: ScenarioConfig, stream: str, count: int) -> list[str]:
    """``count`` sampling kinds drawn one by one from the run's ``sampling_mix``, on the named random stream."""
    kinds = [kind for kind, _ in config.sampling_mix]
    weights = [float(share) for _, share in config.sampling_mix]
    rng = random.Random(stream)
    return [rng.choices(kinds, weights)[0] for _ in range(count)]


def make_peak_burst(config: ScenarioConfig) -> list[Request]:
    """The profile run's batch as requests: ``n = min(max_num_seqs, max_num_batched_tokens)`` prompts sharing
    ``max_num_batched_tokens``, the last one taking the remainder (vLLM's split, vllm/v1/worker/gpu_model_runner.py
    0.11.0:2977-2980), each answering the workload's shortest answer, sampling as the run's mix draws (a stream
    of its own, so the run's own requests are unchanged)."""
    tokens = config.max_num_batched_tokens
    count = min(config.max_num_seqs, tokens)  # peak_burst_requests, whether or not the knob is on
    max_len = config.resolved_max_model_len
    output = max(1, min(config.short_output_tokens[0], max_len - 1))
    burst = []
    for index, kind in enumerate(sampling_draws(config, f"peak-burst-{config.seed}", count)):
        prompt = tokens // count + (tokens % count if index == count - 1 else 0)
        prompt = max(1, min(prompt, max_len - output))  # vLLM refuses prompt + output > max_model_len
        burst.append(Request(config.requests + index, prompt, output, False, kind))
    return burst


def sampling_batch(scheduled: list) -> SamplingBatch:
    """The sampler's batch for a step's scheduled sequences: every one gets a row of logits, a partial prefill
    chunk's too (its token is discarded after sampling, vllm/v1/worker/gpu_model_runner.py 0.11.0:2151-2153)."""
    return SamplingBatch.of(seq.request.sampling for seq, _ in scheduled)


def make_allocator(config: ScenarioConfig, device: Device, *, task_sink: bool = True):
    """The allocator model a run takes. ``task_sink``: MindSpore's pool starts with it on, MindSpore's default
    (ms_context.cc:621 @ r2.7.rc1), until the first jit compile, which vllm-mindspore runs after loading the
    weights: startup() switches to config.task_sink there. An op stream replayed with task sink off from its
    first op (``simulate --ops --no-task-sink``) passes False."""
    if config.allocator == "mindspore":
        return native.mindspore_pool(
            device,
            version=config.mindspore_release,
            graph_mode=config.mindspore_mode == "graph",
            task_sink=task_sink,
            mempool_block_size=config.mempool_block_size_bytes,
            enable_vmm=config.enable_vmm,
            vmm_page_bytes=config.resolved_alloc_conf.vmm_page_bytes,
        )
    return native.caching_allocator(device, variant=config.allocator, **config.torch_alloc_kwargs)


class ForwardMemo:
    """Forward passes already run, for the runs of one search: op lists by (scope, step), and steady
    forwards (``kvguard.allocators.base.record_steady``) by (scope, step, allocator state).

    A scope is everything besides the allocator's state that a forward's outcome depends on: the
    model's per-rank shape and the allocator's and device's settings. Runs that differ only in their
    utilization, seed or request mix share one; their forwards from the same state replay, exactly.
    """

    # A bound on memory in long-lived processes (cleared when reached); a 3-seed search records under 1,000.
    MAX_ENTRIES = 4096

    def __init__(self) -> None:
        self.scopes: dict[tuple, int] = {}
        self.ops: dict[tuple, list] = {}
        self.chunks: dict[tuple, tuple[list, list, list]] = {}
        self.steady: dict[tuple, Any] = {}

    def scope(self, scenario: "ServingScenario") -> int:
        cfg = scenario.config
        if cfg.allocator == "mindspore":
            settings: tuple = (
                cfg.mindspore_release.version,
                cfg.mindspore_mode,
                cfg.task_sink,
                cfg.mempool_block_size_bytes,
                cfg.enable_vmm,
                cfg.resolved_alloc_conf.vmm_page_bytes,
            )
        else:
            settings = tuple(sorted(cfg.torch_alloc_kwargs.items()))
        # make_allocator's arguments, with the model's shape (the ops) and the device.
        key = (
            scenario.shape,
            cfg.allocator,
            settings,
            cfg.device_memory_bytes,
            cfg.resolved_non_allocator_bytes,
            cfg.profile_non_allocator_growth_bytes,
        )
        return self.scopes.setdefault(key, len(self.scopes))


class ServingScenario:
    """Drives one rank of a vLLM server through startup and serving on a simulated device.

    ``memo``: a :class:`ForwardMemo` shared with other runs (a search's); each run has its own otherwise.
    """

    def __init__(self, config: ScenarioConfig, memo: ForwardMemo | None = None) -> None:
        self.config = config
        # The estimator's layout first: its ConfigErrors are the ones `kvguard budget` gives for the same config.
        self.kv_layout: KVLayout = kv_layout_from_config(
            config.model_config,
            block_size=config.block_size,
            kv_cache_dtype=config.kv_cache_dtype,
            tensor_parallel_size=config.tensor_parallel_size,
        )
        self.shape: ModelShape = model_shape(
            config.model_config, config.tensor_parallel_size, self.kv_layout, mindformers=config.mindformers_path
        )
        self.device = Device(config.device_memory_bytes, config.resolved_non_allocator_bytes)
        self.allocator = make_allocator(config, self.device)
        self.requests = make_requests(config)
        self._peak_burst = make_peak_burst(config) if config.peak_burst else []
        self._scheduler = Scheduler(
            self.kv_layout.block_size,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            (Sequence(r.prompt_tokens, r.output_tokens, r) for r in self.requests),
        )
        self._timeline: list[StepRecord] = []
        self._started = False
        self.memo = memo if memo is not None else ForwardMemo()
        self._scope = self.memo.scope(self)
        self.profile: Profile | None = None
        self.kv_cache_bytes: int | None = None
        self.num_blocks: int | None = None
        self.oom = False
        self.oom_at_step: int | None = None
        self.oom_phase: str | None = None
        self.oom_request_bytes: int | None = None
        self.error: str | None = None
        self.step_index = 0
        self.requests_finished = 0
        self._kv_addrs: list[int] = []

    # ----------------------------------------------------------------- public state
    @property
    def finished(self) -> bool:
        if self.oom or self.error:
            return True
        return self._started and not self._scheduler.waiting and not self._scheduler.running and not self._peak_burst

    @property
    def timeline(self) -> tuple[StepRecord, ...]:
        return tuple(self._timeline)

    def memory_stats(self) -> dict[str, Any]:
        return self.allocator.memory_stats()

    def device_memory(self) -> tuple[int, int]:
        return self.device.mem_get_info()

    # ----------------------------------------------------------------- startup
    def _snapshot(self) -> tuple[int, int, int]:
        """(allocated peak, reserved, non-torch) as vLLM's ``MemorySnapshot.measure`` reads them."""
        free, total = self.device.mem_get_info()
        reserved = self.allocator.reserved_bytes
        return self.allocator.peak_allocated_bytes, reserved, (total - free) - reserved

    def _record(self, phase: str, step: int = -1, **extra: int) -> StepRecord:
        peak_alloc, peak_reserved = self.allocator.take_window_peaks()
        record = StepRecord(
            step=step,
            phase=phase,
            allocated_bytes=self.allocator.allocated_bytes,
            reserved_bytes=self.allocator.reserved_bytes,
            peak_allocated_bytes=peak_alloc,
            peak_reserved_bytes=peak_reserved,
            device_used_bytes=self.device.used_bytes,
            **extra,
        )
        self._timeline.append(record)
        return record

    def _record_serving(self, num_tokens: int) -> StepRecord:
        scheduler = self._scheduler
        return self._record(
            "serving",
            self.step_index,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_tokens=num_tokens,
            kv_blocks_used=(self.num_blocks or 0) - scheduler.free_blocks,
        )

    def _fail(self, phase: str, exc: AllocatorOutOfMemory) -> None:
        self.oom = True
        self.oom_phase = phase
        self.oom_request_bytes = exc.requested_bytes
        if phase == "serving":
            self.oom_at_step = self.step_index

    def startup(self) -> Profile | None:
        if self._started:
            return self.profile
        self._started = True
        cfg = self.config
        alloc = self.allocator
        persistent = cfg.allocator == "mindspore"
        _, _, init_non_torch = self._snapshot()
        # Weights: vLLM's DeviceMemoryProfiler reads the allocated increase.
        alloc.reset_peak_memory_stats()
        before_weights = alloc.allocated_bytes
        try:
            for size in weight_tensors(self.shape):
                alloc.malloc(size, persistent)
        except AllocatorOutOfMemory as exc:
            self._record("weights")
            self._fail("weights", exc)
            return None
        weights_bytes = alloc.allocated_bytes - before_weights
        self._record("weights")

        # memory_profiling(): gc + empty_cache + reset peaks, then the profile run.
        alloc.empty_cache()
        alloc.reset_peak_memory_stats()
        before_peak, before_reserved, _ = self._snapshot()
        num_tokens = cfg.max_num_batched_tokens
        num_seqs = min(cfg.max_num_seqs, num_tokens)
        if cfg.allocator == "mindspore" and not cfg.task_sink:
            alloc.jit_o0_compile()  # the profile forward is vllm-mindspore's first jit_level O0 compile
        try:
            if cfg.profile_non_allocator_growth_bytes and not self.device.grow_non_allocator(
                cfg.profile_non_allocator_growth_bytes
            ):
                raise AllocatorOutOfMemory(cfg.profile_non_allocator_growth_bytes, "runtime", self.device.free_bytes)
            self._forward(num_tokens, num_seqs, (), profile_sampler=cfg.profile_runs_sampler)
        except AllocatorOutOfMemory as exc:
            self._record("profile")
            self._fail("profile", exc)
            return None
        # vllm-mindspore reads reserved before empty_cache; the allocated peak is unaffected by it.
        after_peak, after_reserved, after_non_torch = self._snapshot()
        self._record("profile")
        alloc.empty_cache()
        self.profile = Profile(
            total_memory_bytes=self.device.capacity_bytes,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            weights_bytes=weights_bytes,
            peak_allocated_increase_bytes=after_peak - before_peak,
            peak_reserved_increase_bytes=after_reserved - before_reserved,
            non_torch_increase_bytes=after_non_torch - init_non_torch,
            unprofiled_sampler_bytes=self._unprofiled_sampler_bytes(),
        )
        kv_bytes = (
            stock_kv_cache_bytes(self.profile) if cfg.budget == "stock" else reserved_kv_cache_bytes(self.profile)
        )
        self.kv_cache_bytes = kv_bytes
        self.num_blocks = self.kv_layout.num_blocks(kv_bytes)
        if self.num_blocks <= 0:
            self.error = (
                "No available memory for the cache blocks. Try increasing "
                "`gpu_memory_utilization` when initializing the engine."
            )
            return self.profile
        max_blocks_per_request = self.kv_layout.blocks_per_request(cfg.resolved_max_model_len)
        if self.num_blocks < max_blocks_per_request:
            self.error = (
                f"the model's max seq len ({cfg.resolved_max_model_len}) is larger than the maximum "
                f"number of tokens that can be stored in KV cache "
                f"({self.num_blocks * self.kv_layout.block_size})"
            )
            return self.profile
        try:
            for size in self.kv_tensor_sizes(self.num_blocks):
                self._kv_addrs.append(alloc.malloc(size))
        except AllocatorOutOfMemory as exc:
            self._record("kv_cache")
            self._fail("kv_cache", exc)
            return self.profile
        self._scheduler.free_blocks = self.num_blocks
        self._record("kv_cache")
        return self.profile

    def _unprofiled_sampler_bytes(self) -> int | None:
        """What the plugin adds to the profile on vllm-ascend, whose profile run this one stands for on torch_npu
        (``profile_runs_sampler``; kvguard.plugin.profile.with_unprofiled_sampler): the sampling peak of the
        batch vLLM budgets for."""
        cfg = self.config
        if cfg.allocator != "torch_npu":  # only vllm-ascend's era rows leave the sampler out
            return None
        return unprofiled_sampler_peak_bytes(
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs,
            hidden_size=self.shape.hidden_size,
            vocab_size=self.shape.vocab_size,
            tensor_parallel_size=self.shape.tensor_parallel_size,
            dtype_bytes=self.shape.dtype_bytes,
        )

    def kv_tensor_sizes(self, num_blocks: int) -> tuple[int, ...]:
        return kv_cache_tensor_bytes(self.kv_layout, num_blocks, self.config.kv_tensor_style)

    # ----------------------------------------------------------------- execution
    def _ops(
        self,
        num_tokens: int,
        num_seqs: int,
        gathered: tuple[int, ...],
        profile_sampler: bool = False,
        sampling: SamplingBatch = SamplingBatch(),
    ) -> list:
        key = (self._scope, num_tokens, num_seqs, gathered, profile_sampler, sampling)
        cache = self.memo.ops
        ops = cache.get(key)
        if ops is None:
            ops = list(
                forward_ops(
                    self.shape, num_tokens, num_seqs, gathered, profile_sampler=profile_sampler, sampling=sampling
                )
            )
            if len(cache) > 256:
                cache.clear()
            cache[key] = ops
        return ops

    def _forward(
        self,
        num_tokens: int,
        num_seqs: int,
        gathered: tuple[int, ...],
        profile_sampler: bool = False,
        sampling: SamplingBatch = SamplingBatch(),
    ) -> None:
        """One forward pass; a steady one (the allocator left as it was found) is recorded, and replayed
        when the same forward meets the same allocator state again (``base.replay_steady``)."""
        allocator = self.allocator
        # Replays and skipped layers stand in for the allocator's calls: not while something watches them
        # (guarded.BudgetWatch wraps malloc and free on the instance until the budget is fixed).
        watched = "malloc" in vars(allocator) or "free" in vars(allocator)
        state = None if watched or not hasattr(allocator, "steady_state_key") else allocator.steady_state_key()
        if state is None:
            self._execute(self._ops(num_tokens, num_seqs, gathered, profile_sampler, sampling))
            return
        key = (self._scope, num_tokens, num_seqs, gathered, profile_sampler, sampling, state)
        steady = self.memo.steady
        recorded = steady.get(key)
        if recorded is not None:
            replay_steady(allocator, recorded)
            return
        chunks = self._chunks(num_tokens, num_seqs, gathered, profile_sampler, sampling)
        recorded = record_steady(allocator, lambda: self._execute_layers(*chunks))
        if allocator.steady_state_key() == state:
            if len(steady) >= ForwardMemo.MAX_ENTRIES:
                steady.clear()
            steady[key] = recorded

    def _chunks(
        self,
        num_tokens: int,
        num_seqs: int,
        gathered: tuple[int, ...],
        profile_sampler: bool = False,
        sampling: SamplingBatch = SamplingBatch(),
    ) -> tuple[list, list, list]:
        """``workload.forward_chunks``: the ops before the layers, each layer's (a repeated layer is the same
        list), the ops after."""
        key = (self._scope, num_tokens, num_seqs, gathered, profile_sampler, sampling)
        cache = self.memo.chunks
        chunks = cache.get(key)
        if chunks is None:
            chunks = forward_chunks(
                self.shape, num_tokens, num_seqs, gathered, profile_sampler=profile_sampler, sampling=sampling
            )
            if len(cache) > 256:
                cache.clear()
            cache[key] = chunks
        return chunks

    MAX_PERIOD = 4  # layers

    def _execute_layers(self, head: list, layers: list[list], tail: list) -> None:
        """``_execute`` of a forward by layers, skipping repeats: once the last ``p`` layers have brought the
        allocator back to the state it had ``p`` layers before (and the same tensors live at the same
        addresses), and the layers to come repeat those ``p`` layers, every further period would do the
        same again. Those periods are not run: their counters and peaks are added (``base.replay_steady``),
        and the state stays as it is, which is where they would leave it."""
        allocator = self.allocator
        malloc = allocator.malloc
        free = allocator.free
        state_key = allocator.steady_state_key
        live: dict[Any, int] = {}

        def run(ops: list) -> None:
            for key, size in ops:
                if size is None:
                    free(live.pop(key))
                else:
                    live[key] = malloc(size)

        try:
            run(head)
            history: list[tuple[Any, Any]] = []  # (state after the layer, its record), layer by layer
            index, count = 0, len(layers)
            while index < count:
                recorded = record_steady(allocator, lambda: run(layers[index]))
                index += 1
                state = (state_key(), tuple(live.items()))
                history.append((state, recorded))
                for period in range(1, min(self.MAX_PERIOD, len(history) - 1) + 1):
                    if history[-1 - period][0] != state:
                        continue
                    if any(layers[j] is not layers[j - period] for j in range(index, count)):
                        continue
                    repeats = (count - index) // period
                    if repeats:
                        for _, layer_record in history[-period:]:
                            replay_steady(allocator, layer_record, repeats)
                        index += repeats * period
                    history.clear()
                    break
            run(tail)
        except AllocatorOutOfMemory:
            for addr in live.values():
                free(addr)
            raise

    def _execute(self, ops: list) -> None:
        malloc = self.allocator.malloc
        free = self.allocator.free
        live: dict[Any, int] = {}
        try:
            for key, size in ops:
                if size is None:
                    free(live.pop(key))
                else:
                    live[key] = malloc(size)
        except AllocatorOutOfMemory:
            for addr in live.values():
                free(addr)
            raise

    # ----------------------------------------------------------------- serving
    def step(self) -> StepRecord:
        if not self._started:
            self.startup()
        if self.finished:
            return self._timeline[-1] if self._timeline else self._record("serving", self.step_index)
        scheduler = self._scheduler
        if self._peak_burst and not scheduler.waiting and not scheduler.running:
            # The requests have drained: the peak burst arrives at an idle engine.
            scheduler.waiting.extend(Sequence(r.prompt_tokens, r.output_tokens, r) for r in self._peak_burst)
            self._peak_burst = []
        scheduled = scheduler.schedule()
        num_tokens = sum(tokens for _, tokens in scheduled)
        gathered: tuple[int, ...] = ()
        if self.config.gathers_kv:
            gathered = tuple(seq.computed + tokens for seq, tokens in scheduled if seq.in_prefill and seq.computed > 0)
        if num_tokens:
            try:
                self._forward(num_tokens, len(scheduled), gathered, sampling=sampling_batch(scheduled))
            except AllocatorOutOfMemory as exc:
                self._fail("serving", exc)
                return self._record_serving(num_tokens)
        self.requests_finished += len(scheduler.advance(scheduled))
        record = self._record_serving(num_tokens)
        self.step_index += 1
        if not num_tokens and not scheduler.running and scheduler.waiting:
            # Nothing fits even alone: vLLM would reject such a request; drop it to stay live.
            scheduler.waiting.popleft()
        return record

    def result(self) -> ScenarioResult:
        free, total = self.device.mem_get_info()
        return ScenarioResult(
            config=self.config,
            oom=self.oom,
            oom_at_step=self.oom_at_step,
            oom_phase=self.oom_phase,
            oom_request_bytes=self.oom_request_bytes,
            error=self.error,
            profile=self.profile,
            kv_cache_bytes=self.kv_cache_bytes,
            num_blocks=self.num_blocks,
            steps=self.step_index,
            requests_finished=self.requests_finished,
            preemptions=self._scheduler.preemptions,
            engine=native.engine(self.allocator),
            memory_stats=self.allocator.memory_stats(),
            device_free_bytes=free,
            device_total_bytes=total,
            device_peak_used_bytes=self.device.peak_used_bytes,
            timeline=tuple(self._timeline),
            kv_layout=self.kv_layout,
        )

    def run(self, progress: Callable[[int, int], None] | None = None) -> ScenarioResult:
        self.startup()
        total = len(self.requests) + len(self._peak_burst)
        while not self.finished:
            self.step()
            if progress is not None:
                progress(self.requests_finished, total)
        return self.result()


def run_scenario(config: ScenarioConfig, memo: ForwardMemo | None = None, **overrides: Any) -> ScenarioResult:
    """Run ``config`` (with field overrides) start to finish; ``memo``: a :class:`ForwardMemo` to share."""
    return ServingScenario(replace(config, **overrides) if overrides else config, memo).run()


@dataclass(frozen=True)
class SearchRun:
    gpu_memory_utilization: float
    seed: int
    oom: bool
    error: str | None
    kv_cache_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "seed": self.seed,
            "oom": self.oom,
            "error": self.error,
            "kv_cache_bytes": self.kv_cache_bytes,
        }


@dataclass(frozen=True)
class UtilizationSearch:
    """The highest utilization (0.01 steps) at which every seed serves without an OOM."""

    gpu_memory_utilization: float | None
    kv_cache_memory_bytes: int | None  # the budget at that utilization, as --kv-cache-memory-bytes
    recommended_gpu_memory_utilization: float | None  # the estimator's, from the profile at the config's value
    runs: tuple[SearchRun, ...]
    results: tuple[ScenarioResult, ...] = field(default=(), repr=False, compare=False)  # the runs' own, in order

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "recommended_gpu_memory_utilization": self.recommended_gpu_memory_utilization,
            "num_runs": len(self.runs),
            "runs": [run.to_dict() for run in self.runs],
        }


def search_gpu_memory_utilization(
    config: ScenarioConfig, seeds: tuple[int, ...] = (0,), memo: ForwardMemo | None = None
) -> UtilizationSearch:
    """The highest k/100 at which no seed runs out of memory (``ok(k)``), by galloping from a guess, then
    bisection over hundredths.

    Assumes that running out of memory is monotone in the utilization (more KV cache,
    less headroom), so at the answer the workload serves and one step above it does
    not (or the answer is 1.0). A run that ends in vLLM's startup error (too little KV
    cache) is not an OOM; its error is reported in ``runs``.

    The guess is the estimator's recommendation from the startup profile (else the configured
    utilization): from there steps of 1, 2, 4, ... hundredths go up while the workload serves, or
    down until it does, and bisection settles the last bracket. A guess d hundredths off costs about
    2 log2(d) + 2 probes, where bisection from the middle costs log2(100) whatever the answer; runs
    that serve every seed are the dear ones, and the gallop spends them next to the answer.

    The runs share one :class:`ForwardMemo` (``memo``, else a new one): the startup and serving
    forwards that recur across utilizations and seeds run once.
    """
    from kvguard.budget.estimator import recommended_gpu_memory_utilization

    memo = memo if memo is not None else ForwardMemo()
    runs: list[SearchRun] = []
    results: list[ScenarioResult] = []
    kv_at: dict[int, int | None] = {}

    def ok(hundredths: int) -> bool:
        utilization = hundredths / 100
        fine = True
        for seed in seeds:
            result = run_scenario(config, memo, gpu_memory_utilization=utilization, seed=seed)
            runs.append(SearchRun(utilization, seed, result.oom, result.error, result.kv_cache_bytes))
            results.append(result)
            kv_at[hundredths] = result.kv_cache_bytes
            if result.oom:
                fine = False
                break
        return fine

    # The estimator's recommendation needs the profile only: startup, not serving.
    profile = ServingScenario(replace(config, seed=seeds[0]), memo).startup()
    recommended = recommended_gpu_memory_utilization(profile) if profile else None
    found: int | None
    if ok(100):
        found = 100
    else:
        guess = recommended if recommended is not None else config.gpu_memory_utilization
        start = min(99, max(1, round(100 * guess)))
        low, high = 0, 100  # ok(low) (0: nothing served yet), not ok(high)
        step = 1
        if ok(start):
            low = start
            while low + step < high:
                if ok(low + step):
                    low += step
                    step *= 2
                else:
                    high = low + step
        else:
            high = start
            while low == 0 and high > 1:
                probe = max(1, high - step)
                if ok(probe):
                    low = probe
                else:
                    high = probe
                    step *= 2
        while high - low > 1:
            middle = (low + high) // 2
            if ok(middle):
                low = middle
            else:
                high = middle
        found = low or None
    return UtilizationSearch(
        gpu_memory_utilization=None if found is None else found / 100,
        kv_cache_memory_bytes=None if found is None else kv_at.get(found),
        recommended_gpu_memory_utilization=recommended,
        runs=tuple(runs),
        results=tuple(results),
    )
