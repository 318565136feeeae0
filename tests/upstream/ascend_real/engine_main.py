"""Run one vllm-ascend release's real startup code on a fake NPU; write a JSON result.

Invoked by harness.py as `<engine env python> tests/upstream/ascend_real/engine_main.py IN.json OUT.json`.
It reuses tests/upstream/vllm_real (by import): the fake device's allocator model, the fake model runner,
the stubs for vLLM's compiled CUDA extensions, the engine arguments. On top of them:

- a fake ``torch_npu`` (fake_torch_npu.py) backs torch.npu's memory calls with the fake
  device; the real ``NPUPlatform`` is vLLM's current platform; the real ``NPUWorker`` is built by vLLM's
  own executor and sized by vLLM's own EngineCore._initialize_kv_caches. HCCL is replaced by gloo (one
  process), and NPUModelRunner by the fake runner (what it allocates is the scenario's).
- kvguard's plugin is loaded by vLLM's own ``load_general_plugins()``, as in a real deployment.
"""

from __future__ import annotations

import logging
import os
import pathlib
import sys
import types

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "vllm_real"))
sys.path.insert(0, str(HERE))

import importlib.util  # noqa: E402

_spec = importlib.util.spec_from_file_location("vllm_real_worker_main", HERE.parent / "vllm_real" / "worker_main.py")
vllm_worker = importlib.util.module_from_spec(_spec)  # tests/upstream/vllm_real/worker_main.py, reused
_spec.loader.exec_module(vllm_worker)

PROFILES = vllm_worker.PROFILES
NPU_WORKER_MODULES = ("vllm_ascend.worker.worker", "vllm_ascend.worker.worker_v1")


def main(argv):
    return vllm_worker.run_request(argv, lambda request, result: _run(request["scenario"], result))


def _run(scenario, result):
    vllm_worker._stub_compiled_extensions()
    import fake_torch_npu

    device = vllm_worker.scenario_device(scenario)
    # "soc": the chip the fake NPU claims (fake_torch_npu.SOCS); "310P3" makes vllm-ascend pick NPUWorker310.
    device_type = fake_torch_npu.use_soc(scenario.get("soc", "910B1"))
    fake_torch_npu.install(device)
    if device_type != "A2":
        _as_built_for(device_type)

    import torch
    import vllm
    import vllm.logger

    if not logging.getLogger("vllm").handlers and hasattr(vllm.logger, "_configure_vllm_root_logger"):
        vllm.logger._configure_vllm_root_logger()
    kvguard_log = logging.getLogger("kvguard")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(levelname)s kvguard-log %(message)s"))
    kvguard_log.addHandler(handler)
    kvguard_log.setLevel(logging.INFO)
    result["vllm_version"] = vllm.__version__
    result["torch_version"] = torch.__version__

    from importlib.metadata import version

    result["engine_version"] = f"vllm-ascend:{version('vllm-ascend')}"
    # The platform plugin vLLM would resolve (vllm_ascend:register names it); its device calls go to
    # the fake torch.npu.
    import vllm.platforms
    from vllm_ascend.platform import NPUPlatform

    vllm.platforms._current_platform = NPUPlatform()
    import engine_v0  # vllm-ascend 0.7.3: vLLM 0.7.3's V0 engine (engine_v0.py)

    if engine_v0.is_v0():
        engine_v0.startup(scenario, device, result, vllm_worker, _patch_worker_module, _npu_runner_class)
    else:
        _startup(scenario, device, result)
    vllm_worker.last_probe_write()
    result["device_calls"] = dict(sorted(device.calls.items()))
    result["device_final"] = device.snapshot()


def _as_built_for(device_type):
    """vllm-ascend as its build for another chip would be: _build_info.py's device type (the PyPI wheels are
    built for A2; check_ascend_device_type, utils.py 0.18.0:720-740, asserts it matches the chip's SoC), and
    on 0.20.2rc1+ an EP card (Atlas 300I Duo), not RC: is_rc_device (utils.py 0.23.0.post1:155-175) would
    otherwise ask this machine's lspci."""
    import vllm_ascend._build_info as build_info

    build_info.__device_type__ = device_type
    utils = sys.modules.get("vllm_ascend.utils")
    if utils is not None:
        utils._ascend_device_type = None
    if device_type == "_310P":
        import vllm_ascend.utils as utils

        if hasattr(utils, "is_rc_device"):
            utils._IS_RC_DEVICE = False


class FakeNPUModelRunner:
    """The fake runner (tests/upstream/vllm_real/fake_runner.py) with the calls NPUWorker makes beyond vLLM's."""

    def eplb_warmup(self, *args, **kwargs):
        return None

    def _dummy_run(self, *args, **kwargs):
        return None

    def capture_model(self, *args, **kwargs):
        return super().capture_model(*args, **kwargs)


def _npu_runner_class():
    import fake_runner

    return type("FakeNPUModelRunner", (FakeNPUModelRunner, fake_runner.FakeModelRunner), {})


def _patch_worker_module(module):
    """What the fake NPU cannot run, in the NPUWorker's module: the model runner (the scenario's
    allocations), HCCL (gloo, one process), the ATB warm-up kernel."""
    module.NPUModelRunner = _npu_runner_class()
    original = module.init_distributed_environment

    def init_distributed_environment(
        world_size=-1, rank=-1, distributed_init_method="env://", local_rank=-1, backend="gloo", *args, **kwargs
    ):
        return original(world_size, rank, distributed_init_method, local_rank, "gloo", *args, **kwargs)

    module.init_distributed_environment = init_distributed_environment
    worker_cls = getattr(module, "NPUWorker", None)
    if worker_cls is not None and "_warm_up_atb" in vars(worker_cls):
        worker_cls._warm_up_atb = lambda self: None
    vllm_worker._spy_on_memory_profiling(module)


def _startup(scenario, device, result):
    import importlib

    import vllm.plugins

    vllm.plugins.load_general_plugins()
    # vLLM inspects lazily registered model classes in a subprocess, which would import the real
    # torch_npu; the fake one lives in this process, so the inspection runs here (config path only).
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
        # what the platform's check_and_update_config left for torch_npu's allocator (0.17.0rc1+ sets it)
        "npu_alloc_conf": os.environ.get("PYTORCH_NPU_ALLOC_CONF"),
        # what a full batch's sampling is sized by, as vLLM's own config objects hold it
        "hidden_size": vllm_config.model_config.get_hidden_size(),
        "vocab_size": vllm_config.model_config.get_vocab_size(),
        "dtype_bytes": vllm_config.model_config.dtype.itemsize,
        "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
        "max_num_seqs": vllm_config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
    }
    module_name, _, _ = vllm_config.parallel_config.worker_cls.rpartition(".")
    worker_module = importlib.import_module(module_name)
    if hasattr(worker_module, "NPUWorker310"):
        # 310P: NPUWorker310 is an NPUWorker (_310p/worker_310p.py 0.18.0:27) that builds NPUModelRunner310 and,
        # from 0.18, runs its own memory_profiling; HCCL and the rest are in NPUWorker's module.
        worker_module.NPUModelRunner310 = _npu_runner_class()
        vllm_worker._spy_on_memory_profiling(worker_module)
        worker_module = importlib.import_module("vllm_ascend.worker.worker")
    _patch_worker_module(worker_module)

    from vllm.v1.executor.abstract import Executor

    executor = Executor.get_class(vllm_config)(vllm_config)
    worker = executor.driver_worker.worker
    runner = worker.model_runner
    core = types.SimpleNamespace(model_executor=executor, vllm_config=vllm_config)
    core.collective_rpc = executor.collective_rpc
    from vllm.v1.engine.core import EngineCore

    outcome = EngineCore._initialize_kv_caches(core, vllm_config)
    result["engine_outcome"] = repr(outcome)
    result["returned_available_bytes"] = getattr(core, "available_gpu_memory_for_kv_cache", None)
    result["figures"] = {
        "init_npu_memory": getattr(worker, "init_npu_memory", None),
        "model_memory_usage": getattr(runner, "model_memory_usage", None),
        "num_gpu_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "gpu_memory_utilization": cache.gpu_memory_utilization,
    }
    kv = runner.kv_cache_config
    if kv is not None:
        result["kv_cache_config"] = vllm_worker.kv_cache_config_dict(kv)
    result["runner_events"] = runner.events
    if PROFILES:
        result["profile"] = vllm_worker._profile_fields(PROFILES[-1])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
