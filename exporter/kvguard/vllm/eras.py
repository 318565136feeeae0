"""The era table: which vLLM / vllm-ascend / vllm-mindspore releases budget the KV cache how.

Each row is one release range of one project. It names the estimator formula the range's
``determine_available_memory`` runs (:data:`kvguard.budget.estimator.FORMULAS`), its defaults, the
startup-log lines it writes (:mod:`kvguard.vllm.log` reads them), the worker hooks the plugin
wraps, and the upstream file:line each of those facts follows. Paths are inside the release's
wheel (``vllm/...``); "w" is ``vllm/v1/worker/gpu_worker.py``, "mu" ``vllm/utils/mem_utils.py``
(``vllm/utils/__init__.py`` before 0.12), "wu" ``vllm/v1/worker/utils.py``.

Supporting a new release is a new row here (and a test against its wheel), not an ``if`` elsewhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvguard.budget.estimator import FORMULAS, KV_TENSOR_STYLES

PROJECTS = ("vllm", "vllm-ascend", "vllm-ascend-310p", "vllm-mindspore")
# The device allocators a release's worker runs on: CUDA's caching allocator, torch_npu's, MindSpore's pool.
ALLOCATORS = ("torch", "torch_npu", "mindspore")

# Worker methods the plugin wraps (kvguard.plugin.hooks); an era lists the ones its worker has.
HOOKS_V1 = ("init_device", "determine_available_memory", "initialize_from_config")
HOOKS_EXTENSIBLE = HOOKS_V1 + ("extend_kv_cache",)


class EraError(ValueError):
    """A release string kvguard cannot place in the table; the message is one line."""


@dataclass(frozen=True)
class Era:
    project: str
    first: tuple[int, ...]  # first release of the range
    last: tuple[int, ...] | None  # last release read to behave so (None: the newest); a release
    # belongs to the last row whose ``first`` it reaches
    formula: str  # kvguard.budget.estimator.FORMULAS key
    default_block_size: int = 16
    default_gpu_memory_utilization: float | None = 0.9  # None: resolved at run time (0.34), below
    resolved_gpu_memory_utilization: float | None = None  # what a None default resolves to without the
    extensible_gpu_memory_utilization: float | None = None  # extensible KV cache, and with it
    mla_block_size: int | None = None  # vLLM on CUDA sets this block size for MLA models (FlashMLA)
    mla_block_rule: str = "default"  # "equal": forced unless equal; "multiple": unless a multiple;
    # "default": only when --block-size is not given
    cudagraph_estimate_default: bool = False
    extensible_kv_cache_default: bool = False
    kv_cache_memory_flag: str | None = "--kv-cache-memory-bytes"
    allocator: str = "torch"  # the device allocator its worker runs on (ALLOCATORS)
    kv_tensor_style: str = "per_layer"  # how it allocates the KV cache (kvguard.budget.estimator.KV_TENSOR_STYLES)
    one_backing_from: tuple[int, ...] | None = None  # the row's first release with one backing allocation
    # for every layer (its budget arithmetic unchanged)
    expandable_segments_from: tuple[int, ...] | None = None  # the row's first release whose platform turns
    # torch_npu's expandable segments on when the operator has not set them
    profile_runs_sampler: bool = True  # the profile run ends by sampling a full batch (vLLM's _dummy_sampler_run);
    # False: it computes the logits only, and the guard adds the sampling peak (Profile.unprofiled_sampler_bytes)
    vmm_default: bool | None = None  # MindSpore's VMM as the release's env_setup sets MS_ALLOC_CONF when the
    # operator has not (None: it does not; MindSpore's own default applies)
    log_lines: tuple[str, ...] = ()  # kvguard.vllm.log line kinds this era writes
    hooks: tuple[str, ...] = HOOKS_V1
    base: str | None = None  # the vLLM release a platform plugin runs on
    checked_against: str | None = (
        None  # the wheel the tests run (tests/upstream/test_ascend_real.py, test_mindspore_real.py)
    )
    cites: tuple[str, ...] = field(default=(), compare=False)

    @property
    def name(self) -> str:
        first = version_text(self.first)
        last = (
            f"–{version_text(self.last)}"
            if self.last and self.last != self.first
            else ("+" if self.last is None else "")
        )
        return f"{self.project} {first}{last}"

    def tensor_style(self, version: tuple[int, ...] | None = None) -> str:
        """How ``version`` (a release of this row; None: its first) allocates the KV cache."""
        if self.one_backing_from is not None and version is not None and version >= self.one_backing_from:
            return "one_backing"
        return self.kv_tensor_style

    def utilization_default(self, extensible: bool = False) -> float:
        """The --gpu-memory-utilization the release runs with when none is given: its default, or (0.34)
        what ``resolved_gpu_memory_utilization`` resolves it to, with or without the extensible KV cache."""
        if self.default_gpu_memory_utilization is not None:
            return self.default_gpu_memory_utilization
        value = self.extensible_gpu_memory_utilization if extensible else self.resolved_gpu_memory_utilization
        assert value is not None, self.name
        return value

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "project": self.project,
            "formula": self.formula,
            "default_block_size": self.default_block_size,
            "default_gpu_memory_utilization": self.default_gpu_memory_utilization,
            "mla_block_size": self.mla_block_size,
            "cudagraph_estimate_default": self.cudagraph_estimate_default,
            "extensible_kv_cache_default": self.extensible_kv_cache_default,
            "kv_cache_memory_flag": self.kv_cache_memory_flag,
            "checked_against": self.checked_against,
        }


def parse_version(text: str) -> tuple[int, ...]:
    """``"0.14.0"`` as ``(0, 14, 0)``."""
    return tuple(int(p) for p in text.split("."))


_v = parse_version  # the table's short spelling


def version_text(version: tuple[int, ...]) -> str:
    return ".".join(str(p) for p in version)


# Lines every V1 release writes (kvguard.vllm.log kinds).
_V1_LINES = (
    "model_loading",
    "available_kv_cache",
    "kv_cache_size",
    "max_concurrency",
    "requested_memory",
    "kv_cache_memory_bytes",
)

# The cites of the allocator, kv_tensor_style and vmm_default cells ("mr" is v1/worker/gpu_model_runner.py,
# "amr" vllm_ascend/worker/model_runner_v1.py).
_TORCH_CITES = (
    "allocator torch: w 0.11.0:101,113,179,254-255 torch.cuda.mem_get_info, empty_cache, "
    "reset_peak_memory_stats: CUDA's caching allocator",
)
_V0_CITES = (
    "kv_tensor_style per_layer: worker/cache_engine.py 0.6.4 CacheEngine._allocate_kv_cache, one tensor "
    "(2, num_blocks, ...) per layer (not re-read; V0 has no worker hook the plugin wraps)",
) + _TORCH_CITES
_V1_EARLY_CITES = (
    "kv_tensor_style per_layer: mr 0.9.0:2002-2023 initialize_kv_cache, one torch.zeros per layer of "
    "its KVCacheTensor's size (0.8.5 not re-read; 0.11.0:3758-3777 the same)",
) + _TORCH_CITES
_ASCEND_CITES = (
    "allocator torch_npu: aw 0.11.0:207,226,231 NPUPlatform.mem_get_info (torch_npu's caching allocator)",
    "kv_tensor_style per_layer_k_v: a K and a V tensor per layer, half the page each: amr "
    "0.11.0:2997-3003 torch.zeros(size // 2) twice; 0.17.0rc1:2702-2703, 0.18.0:2795-2796 and "
    "0.23.0.post1:4227-4256 k_tensor and v_tensor of size // split factor (calc_split_factor, utils.py "
    "0.18.0:1323-1328: 2 for K = V); DeepSeek MLA splits kv_lora_rank : qk_rope_head_dim instead "
    "(amr 0.11.0:2871-2955; not modelled, one tensor of the same bytes)",
    "profile_runs_sampler False: NPUModelRunner._dummy_sampler_run computes the logits and samples nothing, "
    "'TODO: need to rum a dummy sampler for generate task' (amr 0.11.0:2596 in profile_run; 0.14.0rc1:2142-2160, "
    "0.17.0rc1:2479-2495, 0.18.0:2523-2539, 0.19.1rc1:2898-2914, 0.23.0.post1:3666-3682)",
)
_ASCEND_310P_CITES = (
    "allocator torch_npu: NPUWorker310 is an NPUWorker (310 0.18.0)",
    "kv_tensor_style per_layer_k_v: _310p/model_runner_310p.py 0.17.0rc1:300-309 and 0.18.0:299-308 "
    "a k_cache and a v_cache per attention layer (torch_npu.empty_with_format)",
    "profile_runs_sampler False: NPUModelRunner310 is an NPUModelRunner and keeps its _dummy_sampler_run, which "
    "samples nothing (_310p/model_runner_310p.py 0.14.0rc1:31, 0.18.0:50, 0.23.0.post1:66)",
)
_MINDSPORE_CITES = (
    "allocator mindspore: vllm_mindspore/__init__.py:22-27 @ 0.5.1 msadapter (torch's API on "
    "MindSpore); v1/worker/gpu_model_runner.py:642 @ 0.5.1 the KV cache by mint.zeros, in MindSpore's "
    "pool",
    "kv_tensor_style per_layer_k_v: v1/worker/gpu_model_runner.py:597-661 @ 0.5.1 "
    "_allocate_kv_cache_tensors, coef tensors of size // dtype_size // coef elements per layer, coef "
    "1 for MLAAttentionSpec / MLAQuantFullAttentionSpec (:613-614), else 2; with RingMLA "
    "(quantized MLA with ms_custom_ops, model_executor/models/utils.py:286-303) the MLA tensor is "
    "split kv_lora_rank : qk_rope_head_dim (:643-651; not modelled, the same bytes)",
    "vmm_default True: scripts.py:52 @ 0.5.1 MS_ALLOC_CONF 'enable_vmm: true, ...', set only when the "
    "variable is unset (:55-58), at import of vllm_mindspore (__init__.py:40-42)",
)
_MINDSPORE_SEED_CITES = (
    "allocator mindspore, kv_tensor_style per_layer_k_v: as vllm-mindspore 0.5 (0.2.0's model runner not read)",
    "vmm_default None: scripts.py:25-46 @ f2b96744 sets no MS_ALLOC_CONF (MindSpore's own "
    "default: on for 910B, kvguard.allocators.mindspore_releases)",
)

ERAS: tuple[Era, ...] = (
    # V0's worker: the allocated peak with the weights in it, plus the absolute non-torch memory when
    # positive; the block count floored at 0. Representative: 0.6.4 (other V0 releases not read).
    Era(
        "vllm",
        _v("0.6.4"),
        _v("0.8.4"),
        "absolute_peak",
        hooks=(),
        kv_cache_memory_flag=None,
        log_lines=(
            "model_loading",
            "v0_can_use",
            "v0_breakdown",
            "v0_results",
            "v0_blocks",
            "available_kv_cache",
            "kv_cache_size",
            "max_concurrency",
        ),
        cites=(
            "worker/worker.py 0.6.4:174-250 determine_num_available_blocks: "
            "max(int((total * util - (peak + max(non_torch, 0))) // block_bytes), 0)",
            "executor/gpu_executor.py 0.6.4:113 '# GPU blocks'",
        )
        + _V0_CITES,
    ),
    # The V1 worker before memory_profiling: the same absolute formula in bytes, not clamped. The plugin records
    # the profile from the worker's own torch.cuda reads (kvguard.plugin.inline_readings): weights_bytes is what
    # stays allocated after its empty_cache, the peak increase the allocated peak above it, the non-torch figure
    # the absolute one; tests/upstream/test_vllm_real.py runs 0.9.0's worker through vLLM's plugin loader.
    Era(
        "vllm",
        _v("0.8.5"),
        _v("0.9.0"),
        "absolute_peak_signed",
        kv_cache_memory_flag=None,
        # No "Available KV cache memory" line: 0.9.0's worker never writes it (issue 19, its real worker run;
        # the posted 0.8.5 log tests/data/logs/real/r05.log has none either).
        log_lines=("model_loading", "kv_cache_size", "max_concurrency"),
        checked_against="0.9.0",
        cites=(
            "w 0.8.5:165-212, 0.9.0:167-214 int(total * util - (allocated peak incl. weights + "
            "max(absolute non-torch, 0)))",
            "w 0.9.0:179-182 empty_cache, reset_peak_memory_stats, total from torch.cuda.mem_get_info() before "
            "profile_run (:185); :197 memory_stats()['allocated_bytes.all.peak']; :202-206 after empty_cache, "
            "memory_stats()['allocated_bytes.all.current'] and mem_get_info()[1] - mem_get_info()[0]: the reads "
            "the plugin records (no memory_profiling in 0.9.0)",
            "v1/engine/core.py 0.9.0:137 the returned bytes go to get_kv_cache_config unlogged (no "
            "available_gpu_memory_for_kv_cache)",
        )
        + _V1_EARLY_CITES,
    ),
    # memory_profiling: weights + Δ peak + Δ non-torch, total × util as a float, int(). 0.9.1-0.10.2 take
    # the init snapshot before NCCL starts (w 0.10.2:175 vs 192), so NCCL buffers are in Δ non-torch.
    Era(
        "vllm",
        _v("0.9.1"),
        _v("0.11.2"),
        "peak",
        mla_block_size=64,
        mla_block_rule="equal",
        log_lines=_V1_LINES + ("profile_peak", "era_hint"),
        checked_against="0.11.0",
        cites=(
            "w 0.11.0:183-184 requested_memory = total_memory * gpu_memory_utilization (float)",
            "w 0.11.0:279-280,302 return int(requested_memory - non_kv_cache_memory)",
            "utils/__init__.py 0.11.0:2859 non_kv = non_torch_increase + torch_peak_increase + weights_memory",
            "config/cache.py 0.11.0 gpu_memory_utilization = 0.9, block_size 16",
            "platforms/cuda.py 0.11.0:162-184 MLA block size forced to 64 unless equal (FlashMLA; CUTLASS MLA on "
            "Blackwell: 128)",
        )
        + (
            "v1/worker/gpu_model_runner.py 0.11.0:3758-3777 one torch.zeros(size, int8) per KVCacheTensor: "
            "a tensor per layer",
        )
        + _TORCH_CITES,
    ),
    Era(
        "vllm",
        _v("0.12.0"),
        _v("0.13.0"),
        "peak",
        mla_block_size=64,
        mla_block_rule="multiple",
        log_lines=_V1_LINES + ("profile_peak",),
        cites=(
            "w 0.13.0:241-244,357-359,382 the 0.11 arithmetic (float request, int())",
            "platforms/cuda.py 0.12.0:205, 0.13.0:208 MLA: a block size not a multiple of 64 is forced to 64",
        )
        + (
            "v1/worker/gpu_model_runner.py 0.11.0:3758-3777 and 0.14.0:5325-5345 a tensor per layer (0.12, "
            "0.13 not re-read)",
        )
        + _TORCH_CITES,
    ),
    Era(
        "vllm",
        _v("0.14.0"),
        _v("0.17.1"),
        "peak_ceil",
        mla_block_size=64,
        mla_block_rule="multiple",
        log_lines=_V1_LINES + ("profile_peak",),
        checked_against="0.14.0",
        cites=(
            "wu 0.14.0:258 requested_memory = math.ceil(total_memory * gpu_memory_utilization)",
            "w 0.14.0:341-343,365 return int(requested_memory - non_kv_cache_memory)",
            "mu 0.14.0:283 non_kv = non_torch_increase + torch_peak_increase + weights_memory",
            "platforms/cuda.py 0.14.0:205-235 MLA: a block size not a multiple of 64 is forced to 64 (last in 0.17.1)",
        )
        + ("v1/worker/gpu_model_runner.py 0.14.0:5325-5345 a tensor per layer",)
        + _TORCH_CITES,
    ),
    Era(
        "vllm",
        _v("0.18.0"),
        _v("0.19.1"),
        "peak_ceil_cudagraph",
        mla_block_size=64,
        log_lines=_V1_LINES + ("profile_peak",),
        cites=(
            "w 0.18.0:384-399 profile_cudagraph_memory() measured inside memory_profiling",
            "w 0.18.0:437-441 available = requested - non_kv - cudagraph (applied only if "
            "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS)",
            "envs.py 0.18.0:1636 VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS default '0'",
            "platforms/interface.py 0.18.0:427-474 MLA block size from the backend (FlashMLA: 64) only "
            "when --block-size is not given",
        )
        + ("v1/worker/gpu_model_runner.py 0.18.0:6214-6235 a tensor per layer",)
        + _TORCH_CITES,
    ),
    Era(
        "vllm",
        _v("0.20.0"),
        _v("0.26.0"),
        "peak_ceil_cudagraph",
        mla_block_size=64,
        default_gpu_memory_utilization=0.92,
        cudagraph_estimate_default=True,
        log_lines=_V1_LINES + ("profile_peak", "cudagraph"),
        checked_against="0.20.0",
        cites=(
            "envs.py 0.20.0:1725 VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS default '1'",
            "w 0.20.0:366-425 the 0.18 arithmetic, the estimate now on by default",
            "config/cache.py 0.20.0:66 gpu_memory_utilization default 0.92",
            "w 0.25.0:582 return through reserve_mm_ipc_gpu_memory (a no-op for text models)",
        )
        + ("v1/worker/gpu_model_runner.py 0.20.0:6522-6541 a tensor per layer",)
        + _TORCH_CITES,
    ),
    Era(
        "vllm",
        _v("0.27.0"),
        _v("0.33.0"),
        "consumed",
        one_backing_from=_v("0.29.0"),
        mla_block_size=64,
        default_gpu_memory_utilization=0.92,
        cudagraph_estimate_default=True,
        log_lines=_V1_LINES + ("profile_consumed", "cudagraph"),
        checked_against="0.27.0",
        cites=(
            "mu 0.27.0:317-326 total_consumed = init free - free after profile; transient_peak_headroom = "
            "after.torch_peak - after.torch_allocated; non_kv = total_consumed + transient_peak_headroom",
            "w 0.27.0:500-548 CUDA-graph estimate measured after memory_profiling, subtracted",
            "w 0.27.0:607-611 return reserve_mm_ipc_gpu_memory(int(available), ...)",
            "mu 0.27.0 MemoryProfilingResult.__repr__ 'total consumed (from mem_get_info)'",
        )
        + (
            "v1/worker/gpu_model_runner.py 0.27.0:7312-7342, 0.28.0:7447-7476 a tensor per layer (0.28 packs "
            "one backing only for DeepSeek V4 or enable_cross_layers_blocks, kv_cache_utils.py "
            "0.28.0:1274-1293: not modelled)",
            "one_backing_from 0.29: every KVCacheTensor is bytes_per_block * num_blocks "
            "(v1/core/kv_cache_utils.py 0.29.0:1437-1486, 0.30.0:1747-1796) and allocate_kv_cache calls "
            "torch.zeros(buf_size) once (v1/worker/utils.py 0.29.0:379-411, 0.30.0:389-421, 0.31.0:395-427, "
            "0.33.0:564-596; gpu_model_runner.py 0.29.0:7436, 0.30.0:7364)",
        )
        + _TORCH_CITES,
    ),
    Era(
        "vllm",
        _v("0.34.0"),
        None,
        "consumed",
        kv_tensor_style="one_backing",
        resolved_gpu_memory_utilization=0.92,
        extensible_gpu_memory_utilization=1.0,
        default_block_size=64,
        default_gpu_memory_utilization=None,
        cudagraph_estimate_default=True,
        extensible_kv_cache_default=True,
        log_lines=_V1_LINES + ("profile_consumed", "cudagraph"),
        hooks=HOOKS_EXTENSIBLE,
        checked_against="0.34.0",
        cites=(
            "config/cache.py 0.34.0:185 block_size default 64",
            "config/cache.py 0.34.0:216,494-501 gpu_memory_utilization None; resolved_gpu_memory_utilization "
            "1.0 with the extensible KV cache, else 0.92",
            "wu 0.34.0:734-781 requested_memory = ceil(total * resolved_gpu_memory_utilization)",
            "w 0.34.0:716-780 the 0.27 arithmetic, profile run under _scoped_allocator_max_split(20)",
            "v1/worker/extensible_kv_cache.py 0.34.0:592-681 the committed size is measured after warm-up",
            "w 0.34.0:1007 Worker.extend_kv_cache(num_blocks) commits it",
        )
        + (
            "v1/worker/utils.py 0.34.0:577-583, _allocate_kv_cache_buffer 629-645: one torch.zeros(raw_size); "
            "the extensible KV cache maps its pages outside the allocator",
            "config/cache.py 0.34.0:186 DEFAULT_GPU_MEMORY_UTILIZATION = 0.92 (resolved), :494-501 1.0 with the "
            "extensible KV cache (extensible)",
        )
        + _TORCH_CITES,
    ),
    # vllm-ascend X runs on vLLM X; "aw" is vllm_ascend/worker/worker.py (0.9.1: worker_v1.py).
    # 0.7.3 and 0.7.3.post1 (source archives; worker.py, model_runner.py and the lines cited in platform.py
    # the same in both, platform.py's one line later in post1) run vLLM 0.7.3's V0 engine (VLLM_USE_V1 default
    # 0, vllm/envs.py 0.7.3:503-504) with the V0 NPUWorker (aw), sized by LLMEngine._initialize_kv_caches.
    # The plugin wraps init_device only: the V0 NPUWorker has no determine_available_memory, so no profile
    # is recorded and the reserved / guard budgets cannot act.
    Era(
        "vllm-ascend",
        _v("0.7.3"),
        _v("0.7.3"),
        "ascend_free_drop",
        allocator="torch_npu",
        default_block_size=128,
        kv_cache_memory_flag=None,
        base="vllm:0.7.3",
        log_lines=("model_loading", "v0_blocks", "max_concurrency"),
        hooks=("init_device",),
        checked_against="0.7.3.post1",
        cites=(
            "aw 0.7.3:180-185 init_device: empty_cache, then init_npu_memory = mem_get_info()[0]; HCCL "
            "starts after it (:190)",
            "aw 0.7.3:239-281 determine_num_available_blocks: empty_cache, profile_run, then (no empty_cache) "
            "peak_memory = init_npu_memory - free; num_npu_blocks = max(int((total * util - peak_memory) "
            "// cache_block_size), 0)",
            "vLLM 0.7.3 engine/arg_utils.py:121 gpu_memory_utilization 0.90; platform.py 0.7.3:128-129 "
            "(0.7.3.post1:129-130) block_size None -> 128; platform.py 0.7.3:125 the V0 worker_cls "
            "vllm_ascend.worker.worker.NPUWorker",
            "no --kv-cache-memory-bytes in vLLM 0.7.3 (engine/arg_utils.py)",
            "worker/model_runner.py 0.7.3:907 'Loading model weights took %.4f GB'; vLLM 0.7.3 "
            "executor/executor_base.py:111-117 '# npu blocks: %d, # CPU blocks: %d', 'Maximum concurrency "
            "for %s tokens per request: %.2fx'",
            "allocator torch_npu: aw 0.7.3:251,259 NPUPlatform.empty_cache / mem_get_info (platform.py 0.7.3:"
            "93-102, torch.npu)",
            "kv_tensor_style per_layer: vLLM 0.7.3 worker/cache_engine.py:99-106 one torch.zeros per attention "
            "layer of AscendAttentionBackend.get_kv_cache_shape (2, num_blocks, block_size, heads, head_size) "
            "(attention/attention.py 0.7.3:166-172); its block bytes cache_engine.py:140-167",
        ),
    ),
    Era(
        "vllm-ascend",
        _v("0.9.1"),
        _v("0.14.0"),
        "absolute_peak",
        allocator="torch_npu",
        profile_runs_sampler=False,
        expandable_segments_from=_v("0.14.0"),
        kv_tensor_style="per_layer_k_v",
        default_block_size=128,
        log_lines=("model_loading", "ascend_available", "kv_cache_size", "max_concurrency"),
        hooks=HOOKS_V1,
        checked_against="0.11.0",
        cites=(
            "worker/worker_v1.py 0.11.0:219-259 the same (tests/upstream/test_ascend_real.py runs it on vLLM 0.11.0); "
            "the plugin records its profile from the torch_npu.npu reads it makes",
            "config/cache.py 0.11.0 gpu_memory_utilization 0.9; platform.py 0.11.0 block size 128",
            "aw 0.13.0:269-311 no memory_profiling: available = int(total * util - (allocated peak incl. "
            "weights + absolute non-torch if > 0)), clamped at 0",
            "aw 0.13.0:307-309 'Available memory: %d, total memory: %d' (exact bytes)",
            "worker/model_runner_v1.py 0.13.0:2395 'Loading model weights took %.4f GB'",
        )
        + _ASCEND_CITES,
    ),
    Era(
        "vllm-ascend",
        _v("0.15.0"),
        _v("0.17.0"),
        "ascend_cleared",
        allocator="torch_npu",
        profile_runs_sampler=False,
        expandable_segments_from=_v("0.15.0"),
        kv_tensor_style="per_layer_k_v",
        default_block_size=128,
        checked_against="0.17.0rc1",
        # profile_peak: vLLM's MemoryProfilingResult at DEBUG (aw 0.17.0rc1:366 logger.debug(profile_result))
        log_lines=("model_loading", "available_kv_cache", "kv_cache_size", "max_concurrency", "profile_peak"),
        cites=(
            "aw 0.17.0rc1:266-267 requested_memory = total * util (float, no ceil)",
            "aw 0.17.0rc1:339-366 available = requested - non_kv - (absolute non-torch before empty_cache - "
            "non_torch_increase): the subtrahend is in effect the non-torch memory present at startup, "
            "whatever empty_cache freed (--non-torch-cleared)",
            "vLLM 0.17.0 config/cache.py gpu_memory_utilization 0.9",
        )
        + _ASCEND_CITES,
    ),
    Era(
        "vllm-ascend",
        _v("0.18.0"),
        _v("0.18.0"),
        "peak",
        allocator="torch_npu",
        profile_runs_sampler=False,
        expandable_segments_from=_v("0.18.0"),
        kv_tensor_style="per_layer_k_v",
        default_block_size=128,
        base="vllm:0.18.0",
        checked_against="0.18.0",
        log_lines=("model_loading", "available_kv_cache", "kv_cache_size", "max_concurrency", "profile_peak"),
        cites=(
            "aw 0.18.0:327-361 available = requested - non_kv (vLLM's memory_profiling, float request)",
            "vLLM 0.18.0 config/cache.py:41 gpu_memory_utilization 0.9",
        )
        + _ASCEND_CITES,
    ),
    # vllm-ascend X runs on vLLM X and keeps its utilization default: 0.9 through vLLM 0.19, 0.92 from 0.20.
    Era(
        "vllm-ascend",
        _v("0.19.0"),
        _v("0.19.1"),
        "peak",
        allocator="torch_npu",
        profile_runs_sampler=False,
        expandable_segments_from=_v("0.19.0"),
        kv_tensor_style="per_layer_k_v",
        default_block_size=128,
        base="vllm:0.19.1",
        log_lines=(
            "model_loading",
            "available_kv_cache",
            "kv_cache_size",
            "max_concurrency",
            "kv_cache_memory_bytes",
            "profile_peak",
            "ascend_summary",
        ),
        checked_against="0.19.1rc1",
        cites=(
            "aw 0.19.1rc1:326-396 torch peak re-read before graph capture (:366-373); available = requested - "
            "non_kv (:389, requested the float total * util, :272); tests/upstream/test_ascend_real.py runs it on "
            "vLLM 0.19.1 (vllm_version_is('0.19.1') throughout)",
            "vLLM 0.19.1 config/cache.py:41 gpu_memory_utilization 0.9; vllm-ascend's check_and_update_config "
            "leaves it",
            "aw 0.19.1rc1:391 logger.debug(profile_result), :392-394 'Available KV cache memory', :541 the "
            "'Free memory on device ... Actual usage' summary; worker/model_runner_v1.py 0.19.1rc1:2977 "
            "'Loading model weights took %.4f GB'",
            "platform.py 0.19.1rc1:548-566 PYTORCH_NPU_ALLOC_CONF expandable_segments:True unless set",
            "kv_tensor_style per_layer_k_v: worker/model_runner_v1.py 0.19.1rc1:3100-3175 a k and a v tensor "
            "per attention layer",
        )
        + _ASCEND_CITES,
    ),
    Era(
        "vllm-ascend",
        _v("0.20.0"),
        _v("0.23.0"),
        "peak",
        allocator="torch_npu",
        profile_runs_sampler=False,
        expandable_segments_from=_v("0.20.0"),
        kv_tensor_style="per_layer_k_v",
        default_block_size=128,
        default_gpu_memory_utilization=0.92,
        base="vllm:0.23.0",
        # ascend_summary: "Free memory on device … Actual usage: … for NPU graph memory" (aw 0.23.0.post1:771,
        # tests/data/logs/ascend-real; vllm-ascend PR #8289, 2026-04; 0.18.0 does not write it).
        log_lines=(
            "model_loading",
            "available_kv_cache",
            "kv_cache_size",
            "max_concurrency",
            "kv_cache_memory_bytes",
            "profile_peak",
            "ascend_summary",
        ),
        checked_against="0.23.0.post1",
        cites=(
            "aw 0.23.0:527-597 torch peak re-read before graph capture; available = requested - non_kv",
            "vLLM 0.23.0 config/cache.py:67 gpu_memory_utilization 0.92 (0.20.0:66); vllm-ascend's "
            "check_and_update_config leaves it",
        )
        + _ASCEND_CITES,
    ),
    # NPUWorker310 (vllm_ascend/_310p/worker_310p.py, "310") is what vllm-ascend runs on a 310P (platform.py
    # 0.18.0:437-438
    # worker_cls when is_310p(): the device type its build wrote to _build_info.py). It inherits NPUWorker's
    # formula until 0.18, then halves it. tests/upstream/test_ascend_310p_real.py runs it on a fake 310P3.
    Era(
        "vllm-ascend-310p",
        _v("0.14.0"),
        _v("0.14.0"),
        "absolute_peak",
        allocator="torch_npu",
        profile_runs_sampler=False,
        expandable_segments_from=_v("0.14.0"),
        kv_tensor_style="per_layer_k_v",
        default_block_size=128,
        log_lines=("model_loading", "ascend_available", "kv_cache_size", "max_concurrency", "ascend_310p"),
        checked_against="0.14.0rc1",
        cites=(
            "310 0.14.0rc1:25-37 NPUWorker310 has no determine_available_memory of its own: NPUWorker's, "
            "aw 0.14.0rc1:252-294 (allocated peak incl. weights + absolute non-torch if > 0; 'Available memory: "
            "%d, total memory: %d' :291-293), the vllm-ascend 0.9.1-0.14.0 row's; the plugin records its profile "
            "from the torch_npu.npu reads it makes",
            "vLLM 0.14.0 config/cache.py:50 gpu_memory_utilization 0.9",
            "310 0.14.0rc1:35-37 'Skip warm-up atb ops for 310P device' (ascend_310p)",
        )
        + _ASCEND_310P_CITES,
    ),
    Era(
        "vllm-ascend-310p",
        _v("0.15.0"),
        _v("0.17.0"),
        "ascend_cleared",
        allocator="torch_npu",
        profile_runs_sampler=False,
        expandable_segments_from=_v("0.15.0"),
        kv_tensor_style="per_layer_k_v",
        default_block_size=128,
        log_lines=(
            "model_loading",
            "available_kv_cache",
            "kv_cache_size",
            "max_concurrency",
            "profile_peak",
            "ascend_310p",
        ),
        checked_against="0.17.0rc1",
        cites=(
            "310 0.17.0rc1:24-52 NPUWorker310 has no determine_available_memory of its own: NPUWorker's, "
            "aw 0.17.0rc1:327-372 (the vllm-ascend 0.15.0-0.17.0 row; profile_peak at :366, the budget at :367-370)",
            "vLLM 0.17.0 config/cache.py:49 gpu_memory_utilization 0.9",
            "310 0.17.0rc1:50-52 'Skip warm-up atb ops for 310P device.' (ascend_310p)",
        )
        + _ASCEND_310P_CITES,
    ),
    Era(
        "vllm-ascend-310p",
        _v("0.18.0"),
        _v("0.19.1"),
        "ascend_cleared_halved",
        allocator="torch_npu",
        profile_runs_sampler=False,
        expandable_segments_from=_v("0.18.0"),
        kv_tensor_style="per_layer_k_v",
        default_block_size=128,
        log_lines=(
            "model_loading",
            "available_kv_cache",
            "kv_cache_size",
            "max_concurrency",
            "profile_peak",
            "ascend_310p",
            "ascend_310p_available",
            "kv_cache_memory_bytes",
            "ascend_summary",
        ),
        checked_against="0.18.0",
        cites=(
            "310 0.18.0:57-105 its own determine_available_memory: available = (requested - non_kv - "
            "(non-torch memory read inside the profile before empty_cache - non_torch_increase)) // 2 (:95-97); "
            "requested = total * util, a float (aw 0.18.0:267), so the floor division of a float, "
            "truncated by int() (:105)",
            "310 0.18.0:99 logger.debug(profile_result) (profile_peak); :100-104 'Available KV cache memory: "
            "%.2f GiB' from worker_310p.py (ascend_310p_available), without '(halved for workspace)'",
            "vLLM 0.18.0 config/cache.py:41 gpu_memory_utilization 0.9 (0.19 not run: the vllm-ascend "
            "0.19.0-0.19.1 row's vLLM 0.19 default, 0.9)",
        )
        + _ASCEND_310P_CITES,
    ),
    Era(
        "vllm-ascend-310p",
        _v("0.20.0"),
        None,
        "ascend_cleared_halved",
        allocator="torch_npu",
        profile_runs_sampler=False,
        expandable_segments_from=_v("0.20.0"),
        kv_tensor_style="per_layer_k_v",
        default_block_size=128,
        default_gpu_memory_utilization=0.92,
        base="vllm:0.23.0",
        log_lines=(
            "model_loading",
            "available_kv_cache",
            "ascend_halved",
            "kv_cache_size",
            "max_concurrency",
            "profile_peak",
            "ascend_310p",
            "ascend_310p_available",
            "kv_cache_memory_bytes",
            "ascend_summary",
        ),  # 310 0.23.0.post1:117 logger.debug(profile_result)
        checked_against="0.23.0.post1",
        cites=(
            "310 0.23.0.post1:63-123 the 0.18 arithmetic (:113-115)",
            "310 0.21.0rc1 first writes 'Available KV cache memory: %.2f GiB (halved for workspace)' "
            "(310 0.23.0.post1:118-122)",
            "vLLM 0.23.0 config/cache.py:67 gpu_memory_utilization 0.92 (0.20.0:66); the 310P worker's "
            "_init_device (310 0.23.0.post1:145) requests total * util",
            "310 0.23.0.post1:40 'Using NPUWorker310 and NPUModelRunner310.', :127 the warm-up skip (ascend_310p); "
            "aw 0.23.0.post1:771 NPUWorker's summary (ascend_summary)",
            "310 0.20.2rc1+ RC devices (host and device memory shared, utils.py 0.23.0.post1:155-175 is_rc_device) "
            "halve requested - host memory used instead (310 0.23.0.post1:109-111): not modelled",
        )
        + _ASCEND_310P_CITES,
    ),
    # The seed's release: vllm-mindspore 0.2.0 at Gitee PR !428 (f2b96744, merged 2025-05-28), the release whose
    # launcher `simulate --vllm-mindspore-version 0.2.0` takes (kvguard.allocators.mindspore_releases). Its fix budgets
    # vLLM's V1 formula with the memory_reserved() increase in place of the allocated peak: the seed reported
    # Qwen2.5-7B's 37.85 GiB / 44292 blocks becoming 36.40 GiB / 42593, what this formula gives from the seed's
    # profile (examples/qwen2.5-7b-910b-profile.json, constructed from those figures; tests/budget/test_budget_cli.py).
    # 16-token blocks: the seed's own log (examples/vllm-mindspore-qwen2.5-7b.log, 708,672 tokens in 44,292
    # blocks). Not run against a wheel.
    Era(
        "vllm-mindspore",
        _v("0.2.0"),
        _v("0.2.0"),
        "mindspore_reserved",
        allocator="mindspore",
        kv_tensor_style="per_layer_k_v",
        log_lines=("model_loading", "available_kv_cache", "kv_cache_size", "max_concurrency", "platform_plugin"),
        cites=(
            "Gitee mindspore/vllm-mindspore PR !428 (f2b96744): memory_profiling's torch peak from memory_reserved()",
            "examples/vllm-mindspore-qwen2.5-7b.log: 708,672 tokens / 44,292 blocks = 16",
        )
        + _MINDSPORE_SEED_CITES,
    ),
    # vllm-mindspore 0.5 runs vLLM 0.11.0's Worker (v1/core/sched/scheduler.py:52 "Based on v0.11.0") with
    # memory_profiling replaced (vllm_mindspore/__init__.py:120, utils.py:400-478): its torch_peak_increase is
    # the memory_reserved() increase, measured before empty_cache: the seed's fix is the stock formula.
    # Run (tests/upstream/test_mindspore_real.py): 0.5.1 on vLLM 0.11.0 and MindSpore 2.7.1 returns exactly this
    # formula's
    # figure. It has no platform plugin (its dist-info entry_points.txt holds only the vllm-mindspore console
    # script; vLLM logs "No plugins for group vllm.platform_plugins found."): its logs name it by its logger's tag.
    Era(
        "vllm-mindspore",
        _v("0.5.0"),
        None,
        "mindspore_reserved",
        allocator="mindspore",
        kv_tensor_style="per_layer_k_v",
        vmm_default=True,
        default_block_size=128,
        log_lines=_V1_LINES + ("profile_peak", "mindspore_logger"),
        base="vllm:0.11.0",
        checked_against="0.5.1",
        cites=(
            "vllm_mindspore/utils.py:465,468,470,475 @ 0.5.1 after_profile measured before empty_cache; "
            "torch_peak_increase = diff_profile.torch_memory (memory_reserved)",
            "platforms/ascend.py:92-94 @ 0.5.1 block_size default 128",
            "scripts.py:52 @ 0.5.1 env_setup MS_ALLOC_CONF='enable_vmm: true, derag_memory_step_freq: -1'",
            "logger.py:33-34,73-75 @ 0.5.1 'vllm-mindspore[%(filename)s:%(lineno)d]', first written at import "
            "(mindspore_logger; no '-> vllm_mindspore:' platform_plugin line: no vllm.platform_plugins entry point)",
        )
        + _MINDSPORE_CITES,
    ),
)


# vllm-ascend sets PYTORCH_NPU_ALLOC_CONF=expandable_segments:True when the operator has not set the key (nor
# max_split_size_mb / garbage_collection_threshold), outside sleep mode: platform.py 0.14.0rc1:404-420,
# 0.15.0rc1:412-428, 0.16.0rc1:417-433, 0.17.0rc1:422-439, 0.18.0:518-535, 0.19.1rc1:548-564, 0.23.0.post1:772-789;
# 0.11.0, 0.12.0rc1 and 0.13.0 leave torch_npu's default (off). The rows' expandable_segments_from.
def expandable_segments_default(release: str | None, allocator: str) -> bool:
    """Whether the release's own launch turns torch_npu's expandable segments on (its row's
    ``expandable_segments_from``)."""
    placed = _placed(release) if allocator == "torch_npu" else None
    if not placed:
        return False
    era, version = placed
    return era.expandable_segments_from is not None and version >= era.expandable_segments_from


def _validate(eras: tuple[Era, ...]) -> None:
    for era in eras:
        assert era.project in PROJECTS and era.formula in FORMULAS, era
        assert era.allocator in ALLOCATORS and era.kv_tensor_style in KV_TENSOR_STYLES, era.name
        assert era.vmm_default is None or era.allocator == "mindspore", era.name
        assert era.expandable_segments_from is None or era.allocator == "torch_npu", era.name
        assert era.default_gpu_memory_utilization is not None or None not in (
            era.resolved_gpu_memory_utilization,
            era.extensible_gpu_memory_utilization,
        ), era.name
    for project in PROJECTS:
        rows = [e for e in eras if e.project == project]
        for earlier, later in zip(rows, rows[1:]):
            assert earlier.last is not None and earlier.last < later.first, (earlier.name, later.name)


_validate(ERAS)

_RELEASE = re.compile(
    r"^(?:(vllm|vllm-ascend-310p|vllm-ascend|vllm-mindspore|vllm_ascend|vllm_mindspore)[:=@ ]+)?v?"
    r"([0-9]{1,4}(?:\.[0-9]{1,6}){0,3})(?:[.+-]?[A-Za-z][A-Za-z0-9.+-]{0,40})?$"
)


def parse_release(text: str) -> tuple[str, tuple[int, ...]]:
    """``"0.34.0"``, ``"vllm:0.34.0"``, ``"vllm-ascend:0.18.0rc1"`` -> (project, version)."""
    match = _RELEASE.match(str(text).strip()) if isinstance(text, str) and len(text) <= 80 else None
    if not match:
        raise EraError(
            f"not a release: {str(text)[:80]!r} (expected X.Y.Z, or vllm-ascend:X.Y.Z, vllm-mindspore:X.Y.Z)"
        )
    project = (match[1] or "vllm").replace("_", "-")
    version = tuple(int(p) for p in match[2].split("."))
    return project, version + (0,) * (3 - len(version))


def era_for(release: str) -> Era:
    """The era a release belongs to; EraError (one line) for one the table does not cover."""
    project, version = parse_release(release)
    rows = [e for e in ERAS if e.project == project]
    reached = [e for e in rows if version >= e.first]
    if not reached:
        known = ", ".join(e.name for e in rows) or "none"
        raise EraError(f"{project} {version_text(version)} is older than kvguard's era table (known: {known})")
    era = reached[-1]
    later = rows[rows.index(era) + 1 :]
    # Releases between two rows that skip a minor release or more (vllm-ascend 0.8.x between 0.7.3 and 0.9.1,
    # vllm-mindspore 0.3-0.4) were not read: refused, not given the older row.
    if later and era.last is not None and version > era.last and later[0].first[:2] > (era.last[0], era.last[1] + 1):
        raise EraError(
            f"{project} {version_text(version)} falls between kvguard's era rows {era.name} and "
            f"{later[0].name}: its worker was not read"
        )
    return era


def release_text(project: str, version: tuple[int, ...]) -> str:
    return f"{project}:{version_text(version)}"


def _placed(release: str | None) -> tuple[Era, tuple[int, ...]] | None:
    if not release:
        return None
    try:
        return era_for(release), parse_release(release)[1]
    except EraError:
        return None


def profile_runs_sampler(release: str | None) -> bool:
    """Whether the release's profile run samples a full batch (its row's ``profile_runs_sampler``); True for a
    release the table does not place (vLLM's own profile run does)."""
    placed = _placed(release)
    return placed[0].profile_runs_sampler if placed else True


def allocator_for(release: str | None) -> str:
    """The device allocator the release's worker runs on (its row's ``allocator``); vLLM's own, torch's
    caching allocator, for a release the table does not place."""
    placed = _placed(release)
    return placed[0].allocator if placed else "torch"


def kv_tensor_style(release: str | None, *, formula: str | None = None, allocator: str | None = None) -> str:
    """How the release allocates its KV cache: its row's ``kv_tensor_style`` (``one_backing`` from the row's
    ``one_backing_from``). Without a release the table places: the style every row of that ``allocator``
    (narrowed to the ``formula``'s rows where any) shares, else vLLM V1's ``per_layer``."""
    placed = _placed(release)
    if placed:
        return placed[0].tensor_style(placed[1])
    rows = [e for e in ERAS if allocator is None or e.allocator == allocator]
    by_formula = [
        e for e in rows if e.formula == formula or (formula == "extensible" and e.extensible_kv_cache_default)
    ]
    styles = {e.kv_tensor_style for e in by_formula or rows}
    return styles.pop() if len(styles) == 1 else "per_layer"
