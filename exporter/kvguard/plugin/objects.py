"""The vLLM objects the plugin reads, as the attributes it reads of them (``typing.Protocol``).

Only what the plugin touches, under the names vLLM gives it; attributes that some releases lack are read with
``getattr`` and a default where they are used, and are not declared here. The citations are where each
release defines them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class MemorySnapshot(Protocol):
    """``vllm.utils.MemorySnapshot`` (utils/__init__.py 0.11.0; utils/mem_utils.py 0.14+)."""

    total_memory: int


class MemoryProfilingResult(Protocol):
    """What ``memory_profiling`` yields (``MemoryProfilingResult``, utils/__init__.py 0.11.0; 0.34's adds
    ``total_consumed`` and ``transient_peak_headroom``, read in the ``consumed`` era only); vllm-mindspore's
    ``ms_memory_profiling`` yields the same fields (vllm_mindspore/utils.py:465-475 @ 0.5.1)."""

    weights_memory: float
    torch_peak_increase: int
    non_torch_increase: int
    before_create: MemorySnapshot
    total_consumed: int
    transient_peak_headroom: int


class CacheConfig(Protocol):
    """``vllm.config.CacheConfig``: ``gpu_memory_utilization``; read where present: 0.34's
    ``resolved_gpu_memory_utilization`` and ``enable_extensible_kv_cache``, ``kv_cache_memory_bytes`` (0.11+)."""

    gpu_memory_utilization: float


class ModelConfig(Protocol):
    """``vllm.config.ModelConfig``: the served name (a list before it is resolved)."""

    served_model_name: str | Sequence[str] | None


class ParallelConfig(Protocol):
    """``vllm.config.ParallelConfig``: ``data_parallel_index`` (0.14+) and ``data_parallel_rank``, read where
    present."""


class VllmConfig(Protocol):
    """``vllm.config.VllmConfig``."""

    model_config: ModelConfig
    parallel_config: ParallelConfig


class KVCacheSpec(Protocol):
    """A layer's ``KVCacheSpec`` (v1/kv_cache_interface.py): bytes and tokens per block.
    ``UniformTypeKVCacheSpecs`` also holds ``kv_cache_specs`` (0.11.0:275-277)."""

    @property
    def page_size_bytes(self) -> int: ...

    @property
    def block_size(self) -> int: ...


class KVCacheGroupSpec(Protocol):
    """``KVCacheGroupSpec`` (v1/kv_cache_interface.py): the layers that share one spec."""

    layer_names: Sequence[str]
    kv_cache_spec: KVCacheSpec


class KVCacheTensor(Protocol):
    """``KVCacheTensor`` (v1/kv_cache_interface.py): one allocated backing."""

    size: int


class KVCacheConfig(Protocol):
    """``KVCacheConfig`` (v1/kv_cache_interface.py): ``num_blocks``; read where present: ``kv_cache_groups``,
    ``kv_cache_tensors`` (older configs: a ``tensors`` mapping)."""

    num_blocks: int


class HasKVCacheSpec(Protocol):
    """A worker or model runner that names its layers' KV cache specs (``get_kv_cache_spec``)."""

    def get_kv_cache_spec(self) -> Mapping[str, KVCacheSpec]: ...


class Worker(Protocol):
    """A vLLM worker (``vllm.v1.worker.gpu_worker.Worker``, vllm-ascend's ``NPUWorker``, ...): read where present
    as well: ``rank``, ``device``, ``vllm_config``, ``model_runner``, ``cudagraph_memory_estimate`` (0.18+),
    ``requested_memory`` and ``_kv_cache_config`` (0.34), ``available_kv_cache_memory_bytes``."""

    cache_config: CacheConfig
    init_snapshot: MemorySnapshot
