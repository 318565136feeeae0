"""The V0 startup of vllm-ascend 0.7.3 (on vLLM 0.7.3's V0 engine), for engine_main.py.

vLLM 0.7.3 runs V0 unless VLLM_USE_V1=1 (vllm/envs.py 0.7.3:503-504); its NPUPlatform then names the V0
worker vllm_ascend.worker.worker.NPUWorker (platform.py 0.7.3:116-126). Here vLLM's own V0 executor
(UniProcExecutor, built by LLMEngine._get_executor_cls) builds that worker, and vLLM's own
LLMEngine._initialize_kv_caches sizes it: determine_num_available_blocks, then initialize_cache (which
logs '# npu blocks' and the maximum concurrency, and allocates the KV cache through the real CacheEngine,
on meta tensors). The NPUModelRunner is the fake runner, as in engine_main.py.

Beyond engine_main.py's fakes: vLLM 0.7.3's triton MoE module is a stub (_stub_triton_moe), VLLM_HOST_IP is the
loopback address, and swap_space is 0 (default 4 GiB), so that no 4 GiB CPU swap cache is zeroed on the test
machine; that changes the CPU block count only (num_cpu_blocks, worker.py 0.7.3:273-276).
"""

from __future__ import annotations

import importlib
import os
import types


def is_v0() -> bool:
    """Whether the installed vLLM runs V0 here (vLLM 0.7.3: VLLM_USE_V1 defaults to 0; later releases default to
    1 or no longer have the variable)."""
    import vllm.envs

    return not getattr(vllm.envs, "VLLM_USE_V1", True)


def _v0_runner_class(npu_runner_class):
    """The fake runner with V0's constructor: NPUWorker builds it with keywords only (worker.py 0.7.3:113-118)."""
    base = npu_runner_class()

    class FakeV0NPUModelRunner(base):
        def __init__(self, vllm_config, kv_cache_dtype=None, is_driver_worker=False, **kwargs):
            super().__init__(vllm_config, "npu:0")
            self.kv_cache_dtype = kv_cache_dtype
            self.is_driver_worker = is_driver_worker

    return FakeV0NPUModelRunner


def _stub_triton_moe(vllm_worker):
    """vLLM 0.7.3's fused_moe/fused_moe.py imports triton unconditionally (line 9), and vllm-ascend's patches import
    it through vLLM's MiniCPM model (patch/patch_minicpm.py 0.7.3.post1:20 -> models/minicpm.py 0.7.3:39). There is
    no triton here (vllm.triton_utils: HAS_TRITON False), and its MoE kernels never run on this path: that one
    module is a stub, as vLLM's compiled extensions are (tests/upstream/vllm_real/worker_main.py)."""
    import vllm.triton_utils  # noqa: F401  (HAS_TRITON decided first)

    vllm_worker._stub_module("vllm.model_executor.layers.fused_moe.fused_moe")


def startup(scenario, device, result, vllm_worker, patch_worker_module, npu_runner_class):
    import vllm.plugins

    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    vllm.plugins.load_general_plugins()
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()
    _stub_triton_moe(vllm_worker)
    args = vllm_worker._engine_args(scenario)
    args.swap_space = 0
    vllm_config = args.create_engine_config()
    cache = vllm_config.cache_config
    result["config"] = {
        "block_size": cache.block_size,
        "gpu_memory_utilization": cache.gpu_memory_utilization,
        "kv_cache_memory_bytes": None,
        "dtype": str(vllm_config.model_config.dtype),
        "max_model_len": vllm_config.model_config.max_model_len,
        "worker_cls": vllm_config.parallel_config.worker_cls,
        "npu_alloc_conf": os.environ.get("PYTORCH_NPU_ALLOC_CONF"),
        "engine": "v0",
    }
    module_name, _, _ = vllm_config.parallel_config.worker_cls.rpartition(".")
    worker_module = importlib.import_module(module_name)
    patch_worker_module(worker_module)
    worker_module.NPUModelRunner = _v0_runner_class(npu_runner_class)

    from vllm.engine.llm_engine import LLMEngine

    executor = LLMEngine._get_executor_cls(vllm_config)(vllm_config=vllm_config)
    worker = executor.driver_worker.worker
    runner = worker.model_runner
    engine = types.SimpleNamespace(model_executor=executor, cache_config=cache)
    LLMEngine._initialize_kv_caches(engine)
    block_bytes = worker.get_cache_block_size_bytes()
    result["engine_outcome"] = f"num_gpu_blocks={cache.num_gpu_blocks} num_cpu_blocks={cache.num_cpu_blocks}"
    result["returned_available_bytes"] = None  # V0 returns blocks, not bytes
    result["figures"] = {
        "init_npu_memory": getattr(worker, "init_npu_memory", None),
        "model_memory_usage": getattr(runner, "model_memory_usage", None),
        "num_gpu_blocks": cache.num_gpu_blocks,
        "num_cpu_blocks": cache.num_cpu_blocks,
        "block_size": cache.block_size,
        "block_bytes": block_bytes,
        "gpu_memory_utilization": cache.gpu_memory_utilization,
        "kv_cache_tensors": [list(t.shape) for t in worker.gpu_cache[0]] if worker.gpu_cache else [],
    }
    result["kv_cache_config"] = {"num_blocks": cache.num_gpu_blocks, "num_tensors": len(worker.gpu_cache[0])}
    result["runner_events"] = runner.events
