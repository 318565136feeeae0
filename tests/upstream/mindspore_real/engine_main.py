"""Run vllm-mindspore's real startup code on a fake NPU; write a JSON result.

Invoked by harness.py as `<engine env python> tests/upstream/mindspore_real/engine_main.py IN.json OUT.json`.
It reuses tests/upstream/vllm_real (by import): the fake device's allocator model, the fake model runner, the stubs for
vLLM's compiled CUDA extensions, the engine arguments, the request / result plumbing. On top of them:

- msadapter is stood in by CPU torch (standins/msadapter.py), and MindSpore's memory bindings and torch.cuda's
  memory calls (msadapter's) are backed by the fake device (fake_mindspore.py); MindSpore itself is the real
  2.7.1 CPU build, vllm-mindspore the real 0.5.1, imported first as a deployment imports it, so its patches of
  vLLM 0.11.0 (its AscendPlatform, its ms_memory_profiling, ...) are in place;
- vLLM's own executor builds vLLM's Worker, sized by vLLM's own EngineCore._initialize_kv_caches; HCCL is
  gloo (one process), GPUModelRunner the fake runner (what it allocates is the scenario's);
- kvguard's plugin is loaded by vLLM's own ``load_general_plugins()``, as in a real deployment.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import pathlib
import sys
import types

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "vllm_real"))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "standins"))

_spec = importlib.util.spec_from_file_location("vllm_real_worker_main", HERE.parent / "vllm_real" / "worker_main.py")
vllm_worker = importlib.util.module_from_spec(_spec)  # tests/upstream/vllm_real/worker_main.py, reused
_spec.loader.exec_module(vllm_worker)

PROFILES = vllm_worker.PROFILES


def main(argv):
    return vllm_worker.run_request(argv, lambda request, result: _run(request["scenario"], result))


class _RayAbsent(importlib.abc.MetaPathFinder):
    """Ray is not installed (vllm-mindspore requires it for its Ray executor; this one-process run uses vLLM's
    UniProcExecutor). vLLM then leaves ``vllm.executor.ray_utils.RayWorkerWrapper`` None (ray_utils.py:28-100
    @ 0.11.0), which vllm-mindspore subclasses at import (executor/ray_utils.py:44 @ 0.5.1): once that module
    has run, a plain WorkerWrapperBase subclass stands in, never instantiated."""

    NAME = "vllm.executor.ray_utils"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            run(module)
            if module.RayWorkerWrapper is None:
                from vllm.worker.worker_base import WorkerWrapperBase

                module.RayWorkerWrapper = type("RayWorkerWrapper", (WorkerWrapperBase,), {})

        loader.exec_module = exec_module
        return spec


def _run(scenario, result):
    import msadapter  # noqa: F401  (the stand-in, before vllm_mindspore imports it)

    sys.meta_path.insert(0, _RayAbsent())

    import vllm_mindspore  # noqa: F401  (first, as a deployment imports it: its patches of vLLM)

    vllm_worker._stub_compiled_extensions()
    import fake_mindspore

    device = vllm_worker.scenario_device(scenario)
    fake_mindspore.install(device)

    import torch
    import vllm

    kvguard_log = logging.getLogger("kvguard")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(levelname)s kvguard-log %(message)s"))
    kvguard_log.addHandler(handler)
    kvguard_log.setLevel(logging.INFO)
    from importlib.metadata import version

    import mindspore

    result["vllm_version"] = vllm.__version__
    result["torch_version"] = torch.__version__
    result["mindspore_version"] = mindspore.__version__
    result["engine_version"] = f"vllm-mindspore:{version('vllm-mindspore')}"
    result["ms_alloc_conf"] = __import__("os").environ.get("MS_ALLOC_CONF")
    _startup(scenario, device, result)
    vllm_worker.last_probe_write()
    result["device_calls"] = dict(sorted(device.calls.items()))
    result["device_final"] = device.snapshot()


def _startup(scenario, device, result):
    import fake_runner
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    # vLLM inspects the model class in a subprocess (registry.py 0.11.0:509, _run_in_subprocess), which would
    # import vllm_mindspore without this process's stand-ins; it runs here instead (config path only).
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()
    vllm_config = vllm_worker._engine_args(scenario).create_engine_config()
    cache = vllm_config.cache_config
    result["config"] = {
        "block_size": cache.block_size,
        "gpu_memory_utilization": cache.gpu_memory_utilization,
        "kv_cache_memory_bytes": getattr(cache, "kv_cache_memory_bytes", None),
        "dtype": str(vllm_config.model_config.dtype),
        "max_model_len": vllm_config.model_config.max_model_len,
        "worker_cls": vllm_config.parallel_config.worker_cls,
        "platform": type(vllm.platforms.current_platform).__name__,
    }
    from vllm.v1.worker import gpu_worker

    # Which memory_profiling vLLM's Worker calls (vllm_mindspore/__init__.py:120 replaces vLLM's before the
    # worker module is imported), before the harness's spy wraps it.
    profiling = gpu_worker.memory_profiling
    result["memory_profiling"] = f"{profiling.__module__}.{getattr(profiling, '__wrapped__', profiling).__qualname__}"
    vllm_worker._install_fake_runner(_runner_class(fake_runner.FakeModelRunner))
    original = gpu_worker.init_distributed_environment

    def init_distributed_environment(
        world_size=-1, rank=-1, distributed_init_method="env://", local_rank=-1, backend="gloo", *args, **kwargs
    ):
        return original(world_size, rank, distributed_init_method, local_rank, "gloo", *args, **kwargs)

    gpu_worker.init_distributed_environment = init_distributed_environment

    from vllm.v1.executor.abstract import Executor

    executor = Executor.get_class(vllm_config)(vllm_config)
    worker = executor.driver_worker.worker
    runner = worker.model_runner
    core = types.SimpleNamespace(model_executor=executor, vllm_config=vllm_config)
    core.collective_rpc = executor.collective_rpc
    from vllm.v1.engine.core import EngineCore

    outcome = EngineCore._initialize_kv_caches(core, vllm_config)
    result["engine_outcome"] = repr(outcome)
    # The step boundary kvguard's plugin wraps: vLLM's own Worker.execute_model (vllm_mindspore/__init__.py
    # replaces GPUModelRunner.execute_model and Worker.init_device at import, :327-328 and :434, not this one).
    result["execute_model_wrapped"] = bool(
        getattr(gpu_worker.Worker.__dict__.get("execute_model"), "_kvguard_wrapped", False)
    )
    result["returned_available_bytes"] = getattr(core, "available_gpu_memory_for_kv_cache", None)
    result["figures"] = {
        "requested_memory": getattr(worker, "requested_memory", None),
        "init_snapshot": vllm_worker._snapshot(getattr(worker, "init_snapshot", None)),
        "model_memory_usage": getattr(runner, "model_memory_usage", None),
        "num_gpu_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
    }
    kv = runner.kv_cache_config
    if kv is not None:
        result["kv_cache_config"] = vllm_worker.kv_cache_config_dict(kv)
    result["runner_events"] = runner.events
    if PROFILES:
        result["profile"] = vllm_worker._profile_fields(PROFILES[-1])


def _runner_class(base):
    """The fake runner; with the scenario's ``profile_release_mid_run`` its profile run also has MindSpore's
    pool hand cached blocks back mid-run: the activation peak is allocated and freed, ``mindspore.runtime.
    empty_cache()`` releases it (as a failed pool expansion or an explicit empty_cache would), then a smaller
    activation of that many bytes is allocated and freed, its block left cached. The pool's reserved figure at
    the run's end is then below its peak (issue 24, "the seed fix's own blind spot")."""
    import fake_runner

    class MidRunReleaseRunner(base):
        def profile_run(self, *args, **kwargs):
            later = fake_runner.SCENARIO.get("profile_release_mid_run")
            if not later:
                return super().profile_run(*args, **kwargs)
            import mindspore

            device = fake_runner.DEVICE
            peak = fake_runner.SCENARIO["profile_transient_bytes"]
            device.alloc(peak)
            device.release(peak)
            mindspore.runtime.empty_cache()
            device.alloc(later)
            device.release(later)
            device.non_torch += fake_runner.SCENARIO.get("profile_non_torch_bytes", 0)
            self._event("profile_run", transient_bytes=peak, released_mid_run=True, later_bytes=later)

    return MidRunReleaseRunner


if __name__ == "__main__":
    sys.exit(main(sys.argv))
