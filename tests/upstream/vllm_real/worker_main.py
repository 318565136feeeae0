"""Run one vLLM release's real startup code on a fake device; print a JSON result.

Invoked by harness.py as `<release env python> tests/upstream/vllm_real/worker_main.py IN.json OUT.json`
in a subprocess of that release's environment. It builds a real VllmConfig from a local
config.json (offline), the real in-process executor (UniProcExecutor) with the real
gpu_worker.Worker, and drives vLLM's own engine-core KV-cache initialisation
(EngineCore._initialize_kv_caches): determine_available_memory, get_kv_cache_configs,
initialize_from_config, compile_or_warm_up_model and, on releases with the extensible KV cache,
measure_kv_cache_blocks / extend_kv_cache. What is faked is listed in README.md.
"""

from __future__ import annotations

import inspect
import json
import logging
import socket
import sys
import time
import traceback
import types


class _Unavailable:
    """A compiled CUDA kernel: importable, never callable on the fake device."""

    def __init__(self, name):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.name}: a CUDA kernel, not available on the fake device")

    def __bool__(self):
        return False


def _stub_module(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)

    def missing(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{name}.{attr}")

    module.__getattr__ = missing
    sys.modules.setdefault(name, module)
    return module


def _stub_compiled_extensions():
    """vLLM's compiled CUDA extensions (vllm._C*, the bundled flash-attention) cannot load on a
    CPU-only torch. The startup path under test runs none of their kernels, so only their import
    is replaced; flash-attention reports itself unsupported, as on a machine without it."""
    for name in (
        "vllm._C",
        "vllm._C_stable_libtorch",
        "vllm._moe_C",
        "vllm._flashmla_C",
        "vllm._flashmla_extension_C",
        # flash-attention's Triton rotary kernel (0.11), which imports triton itself
        "vllm.vllm_flash_attn.ops.triton.rotary",
    ):
        _stub_module(name)
    # The sleep-mode allocator is absent, as in a build without it (ROCm's): device_allocator/cumem.py then
    # takes its ModuleNotFoundError branch (0.9.0:47-60, 0.34.0 the same) instead of loading libcudart,
    # which 0.9.0's gpu_worker.py reaches at import (:13; later releases import it in sleep mode only).
    sys.modules.setdefault("vllm.cumem_allocator", None)
    try:  # older releases import it without the kernels, which then report unsupported
        import vllm.vllm_flash_attn  # noqa: F401
    except ImportError:
        unsupported = dict(
            FA2_AVAILABLE=False,
            FA3_AVAILABLE=False,
            is_fa_version_supported=lambda *a, **k: False,
            fa_version_unsupported_reason=lambda *a, **k: "no CUDA on the fake device",
        )
        for name in [m for m in sys.modules if m.startswith("vllm.vllm_flash_attn")]:
            del sys.modules[name]
        _stub_module("vllm.vllm_flash_attn", __path__=[], **unsupported)
        _stub_module("vllm.vllm_flash_attn.flash_attn_interface", **unsupported)
    import torch

    # The ops those extensions would register (torch.ops._C.*): capability queries some modules
    # make at import time answer "not supported"; kernels are absent (hasattr is False), as in
    # a build without them.
    torch.ops._C = _StubOps("_C")
    torch.ops._C_cache_ops = _StubOps("_C_cache_ops")
    torch.ops._C_cuda_utils = _StubOps("_C_cuda_utils")
    torch.ops._C_custom_ar = _StubOps("_C_custom_ar")


class _StubOps:
    QUERIES = ("supports", "supported", "is_", "has_")

    def __init__(self, namespace):
        self.namespace = namespace

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if any(q in name for q in self.QUERIES):
            return lambda *a, **k: False
        raise AttributeError(f"torch.ops.{self.namespace}.{name}: no CUDA kernels on the fake device")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv):
    return run_request(argv, lambda request, result: _run(request, request["scenario"], result))


def run_request(argv, run) -> int:
    """Read the request (argv[1]), ``run(request, result)``, and write the result (argv[2]): every
    failure as data (error and traceback), never as a hang or a lost result."""
    in_path, out_path = argv[1], argv[2]
    with open(in_path) as f:
        request = json.load(f)
    result: dict = {"ok": False}
    t0 = time.perf_counter()
    try:
        run(request, result)
        result["ok"] = True
    except BaseException as exc:  # report every failure as data, never as a hang
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    result["seconds"] = round(time.perf_counter() - t0, 3)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0


def _run(request, scenario, result):
    _stub_compiled_extensions()
    import fake_device
    import torch
    import vllm

    # vLLM's logging as its entry points set it up (older releases do it at import): the
    # handler on stdout, at VLLM_LOGGING_LEVEL, before the plugins load.
    import vllm.logger
    import vllm.platforms

    if not logging.getLogger("vllm").handlers and hasattr(vllm.logger, "_configure_vllm_root_logger"):
        vllm.logger._configure_vllm_root_logger()
    result["vllm_version"] = vllm.__version__
    result["torch_version"] = torch.__version__
    # kvguard's own log lines (the plugin's logger is not vLLM's), on the same stdout.
    kvguard_log = logging.getLogger("kvguard")
    kvguard_handler = logging.StreamHandler(sys.stdout)
    kvguard_handler.setFormatter(logging.Formatter("%(levelname)s kvguard-log %(message)s"))
    kvguard_log.addHandler(kvguard_handler)
    kvguard_log.setLevel(logging.INFO)

    # vLLM's loggers at DEBUG, formatted as vLLM formats them.
    # The real CUDA platform class (no NVML on this machine): its device queries go through
    # the patched torch.cuda functions below.
    from vllm.platforms.cuda import NonNvmlCudaPlatform

    vllm.platforms._current_platform = NonNvmlCudaPlatform()
    NonNvmlCudaPlatform.dist_backend = "gloo"  # one rank, on loopback; NCCL needs a GPU

    device = scenario_device(scenario)
    table = fake_device.device_functions(device)

    with fake_device.patched(table):
        _startup(request, scenario, device, result)
        last_probe_write()
    result["device_calls"] = dict(sorted(device.calls.items()))
    result["device_final"] = device.snapshot()


def last_probe_write() -> None:
    """A serving process lives on after startup and its probe keeps writing; this one exits now, so
    the kvguard probe vLLM's plugin started (if any) writes once more, on the fake device."""
    probe_module = sys.modules.get("kvguard.probe")
    running = probe_module.current() if probe_module else None
    if running is not None:
        running.run_once(timeout=5)


def kv_cache_config_dict(kv) -> dict:
    """The KVCacheConfig vLLM built: its block count, tensor count and groups."""
    import fake_runner

    return {
        "num_blocks": kv.num_blocks,
        "num_tensors": len(fake_runner.kv_cache_tensors(kv)),
        "groups": [
            {
                "num_layers": len(g.layer_names),
                "spec": type(g.kv_cache_spec).__name__,
                "page_size_bytes": g.kv_cache_spec.page_size_bytes,
                "block_size": g.kv_cache_spec.block_size,
            }
            for g in kv.kv_cache_groups
        ],
    }


def scenario_device(scenario):
    """The fake device the scenario describes, handed to the fake model runner with the scenario."""
    import fake_device
    import fake_runner

    device = fake_device.FakeDevice(
        total=scenario["total_memory_bytes"],
        other=scenario.get("other_process_bytes", 0),
        non_torch=scenario.get("init_non_torch_bytes", 0),
    )
    fake_runner.DEVICE = device
    fake_runner.SCENARIO = scenario
    return device


def _engine_args(scenario):
    from vllm.engine.arg_utils import EngineArgs

    kwargs = dict(
        model=scenario["model_dir"],
        skip_tokenizer_init=True,
        load_format="dummy",
        max_model_len=scenario.get("max_model_len", 4096),
        tensor_parallel_size=1,
        enforce_eager=scenario.get("enforce_eager", False),
        seed=0,
    )
    if "gpu_memory_utilization" in scenario:
        kwargs["gpu_memory_utilization"] = scenario["gpu_memory_utilization"]
    if scenario.get("kv_cache_memory_bytes") is not None:
        kwargs["kv_cache_memory_bytes"] = scenario["kv_cache_memory_bytes"]
    if scenario.get("block_size") is not None:
        kwargs["block_size"] = scenario["block_size"]
    if scenario.get("enable_extensible_kv_cache") is not None:
        kwargs["enable_extensible_kv_cache"] = scenario["enable_extensible_kv_cache"]
    if scenario.get("max_num_seqs") is not None:
        kwargs["max_num_seqs"] = scenario["max_num_seqs"]
    if scenario.get("served_model_name") is not None:
        kwargs["served_model_name"] = scenario["served_model_name"]
    return EngineArgs(**kwargs)


def _startup(request, scenario, device, result):
    import fake_runner
    import vllm.plugins

    # Plugins first, as vLLM loads them in every process (vllm/plugins/__init__.py).
    vllm.plugins.load_general_plugins()

    vllm_config = _engine_args(scenario).create_engine_config()
    cache = vllm_config.cache_config
    result["config"] = {
        "block_size": cache.block_size,
        "gpu_memory_utilization": cache.gpu_memory_utilization,
        "resolved_gpu_memory_utilization": getattr(cache, "resolved_gpu_memory_utilization", None),
        "kv_cache_memory_bytes": getattr(cache, "kv_cache_memory_bytes", None),
        "enable_extensible_kv_cache": getattr(cache, "enable_extensible_kv_cache", None),
        "dtype": str(vllm_config.model_config.dtype),
        "max_model_len": vllm_config.model_config.max_model_len,
        "worker_cls": vllm_config.parallel_config.worker_cls,
        "served_model_name": vllm_config.model_config.served_model_name,
    }

    _install_fake_runner(fake_runner.FakeModelRunner)

    from vllm.v1.executor.abstract import Executor

    executor_cls = Executor.get_class(vllm_config)
    executor = executor_cls(vllm_config)
    worker = executor.driver_worker.worker
    runner = worker.model_runner

    # What the executor handed the engine core, per worker: through 0.9.x the core keeps no
    # available_gpu_memory_for_kv_cache (v1/engine/core.py 0.9.0:137), so it is read here.
    determined = []
    determine = executor.determine_available_memory

    def determine_available_memory(*args, **kwargs):
        determined.append(determine(*args, **kwargs))
        return determined[-1]

    executor.determine_available_memory = determine_available_memory
    core = types.SimpleNamespace(model_executor=executor, vllm_config=vllm_config)
    core.collective_rpc = executor.collective_rpc
    from vllm.v1.engine.core import EngineCore

    init = EngineCore._initialize_kv_caches
    outcome = init(core, vllm_config)
    result["engine_outcome"] = repr(outcome)

    figures = {
        "available_kv_cache_memory_bytes": getattr(worker, "available_kv_cache_memory_bytes", None),
        "requested_memory": getattr(worker, "requested_memory", None),
        "init_snapshot": _snapshot(getattr(worker, "init_snapshot", None)),
        "non_torch_memory": getattr(worker, "non_torch_memory", None),
        "peak_activation_memory": getattr(worker, "peak_activation_memory", None),
        "total_consumed": getattr(worker, "total_consumed", None),
        "cudagraph_memory_estimate": getattr(worker, "cudagraph_memory_estimate", None),
        "model_memory_usage": getattr(runner, "model_memory_usage", None),
        "num_gpu_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
    }
    result["figures"] = figures
    result["returned_available_bytes"] = getattr(core, "available_gpu_memory_for_kv_cache", None)
    if result["returned_available_bytes"] is None and determined and isinstance(determined[-1], list):
        [result["returned_available_bytes"]] = determined[-1]  # one rank
    kv = runner.kv_cache_config
    if kv is not None:
        result["kv_cache_config"] = {
            **kv_cache_config_dict(kv),
            "tensors": [
                {"size": t.size, "shared_by": list(getattr(t, "shared_by", None) or getattr(t, "layers", []))}
                for t in fake_runner.kv_cache_tensors(kv)
            ][:4],
        }
        result["kv_allocations"] = _real_kv_allocations(vllm_config, kv)
    ext = getattr(runner, "extensible_kv_cache", None)
    if ext is not None:
        result["extensible_kv_cache"] = {
            "capacity_blocks": ext.capacity_blocks,
            "num_committed_blocks": ext.num_committed_blocks,
            "bytes_per_block": ext.bytes_per_block,
            "physical_bytes": ext.physical_bytes,
            "reserved_headroom_bytes": ext.reserved_headroom_bytes,
            "torch_reserve_growth_bytes": ext.torch_reserve_growth_bytes,
            "torch_memory_limit": ext.torch_memory_limit,
        }
    result["runner_events"] = runner.events
    if PROFILES:
        result["profile"] = _profile_fields(PROFILES[-1])


REAL_RUNNERS: dict = {}  # the release's own GPUModelRunner classes, kept before the fake replaces them


def _real_kv_allocations(vllm_config, kv):
    """The byte size of each backing allocation the release's own KV allocator makes for the KVCacheConfig its
    kv_cache_utils built: v1/worker/utils.py allocate_kv_cache where the release has it (0.29+), else
    GPUModelRunner._allocate_kv_cache_tensors; run unchanged on the meta device (no memory), its int8
    torch.zeros counted. Through 0.9.x the runner has neither: its initialize_kv_cache allocates inline, per layer,
    a tensor of the attention backend's shape for exactly that layer's KVCacheTensor.size (num_blocks = size //
    page_size_bytes, gpu_model_runner.py 0.9.0:2002-2023); it needs the attention backends, so it is not run here,
    and the sizes are those of the KVCacheConfig's tensors, which its kv_cache_utils built."""
    import torch
    from vllm.v1.worker import utils as worker_utils

    real_runner = REAL_RUNNERS.get("vllm.v1.worker.gpu_model_runner")
    if not hasattr(worker_utils, "allocate_kv_cache") and not hasattr(real_runner, "_allocate_kv_cache_tensors"):
        import fake_runner

        return [tensor.size for tensor in fake_runner.kv_cache_tensors(kv)]

    device = torch.device("meta")
    sizes = []
    real_zeros = torch.zeros

    def zeros(*args, **kwargs):
        tensor = real_zeros(*args, **kwargs)
        if tensor.dtype == torch.int8:
            sizes.append(tensor.numel())
        return tensor

    torch.zeros = zeros
    try:
        if hasattr(worker_utils, "allocate_kv_cache"):
            worker_utils.allocate_kv_cache(kv, device, vllm_config.cache_config.get_resolved_kv_cache_layout())
        else:
            runner = types.SimpleNamespace(device=device, runner_only_attn_layers=set())
            REAL_RUNNERS["vllm.v1.worker.gpu_model_runner"]._allocate_kv_cache_tensors(runner, kv)
    finally:
        torch.zeros = real_zeros
    return sizes


def _snapshot(snap):
    if snap is None:
        return None
    return {k: v for k, v in vars(snap).items() if isinstance(v, (int, float))}


def _install_fake_runner(cls):
    """Put the fake runner where this release's Worker builds its GPUModelRunner."""
    import importlib

    gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
    _spy_on_memory_profiling(gpu_worker)
    if hasattr(gpu_worker, "HAS_TRITON"):
        gpu_worker.HAS_TRITON = True  # Triton is a GPU compiler; the fake runner needs none
    if hasattr(gpu_worker, "GPUModelRunner"):
        gpu_worker.GPUModelRunner = cls
    for name in ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner"):
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        if hasattr(module, "GPUModelRunner"):
            REAL_RUNNERS.setdefault(name, module.GPUModelRunner)
            module.GPUModelRunner = cls
    _replace_kernel_warmups(gpu_worker)
    _gloo_for_nccl(gpu_worker)
    try:
        ext = importlib.import_module("vllm.v1.worker.extensible_kv_cache")
        from fake_runner import FakeExtensibleTensor

        ext.ExtensibleTensor = FakeExtensibleTensor
        import fake_device

        driver = fake_device.FakeVmmDriver()
        for name in ("vllm.utils.vmm_driver", "vllm.utils.extensible_tensor"):
            importlib.import_module(name).get_vmm_driver = lambda: driver
    except ImportError:
        pass


def _gloo_for_nccl(gpu_worker):
    """0.9.0's init_worker_distributed_environment passes no backend (gpu_worker.py 0.9.0:337-353), so
    init_distributed_environment takes its default, NCCL (distributed/parallel_state.py 0.9.0:910-916), which
    a CPU torch lacks; one rank on loopback needs only gloo (the platform's dist_backend on later releases)."""
    import functools

    original = getattr(gpu_worker, "init_distributed_environment", None)
    if original is None or "backend" in inspect.signature(gpu_worker.init_worker_distributed_environment).parameters:
        return

    @functools.wraps(original)
    def init_distributed_environment(*args, **kwargs):
        if len(args) < 5:
            kwargs.setdefault("backend", "gloo")
        return original(*args, **kwargs)

    gpu_worker.init_distributed_environment = init_distributed_environment


PROFILES: list = []


def _spy_on_memory_profiling(gpu_worker):
    """Keep the MemoryProfilingResult vLLM's own memory_profiling yields (it runs unchanged)."""
    import contextlib

    original = getattr(gpu_worker, "memory_profiling", None)
    if original is None:
        return

    @contextlib.contextmanager
    def memory_profiling(*args, **kwargs):
        with original(*args, **kwargs) as profile:
            PROFILES.append(profile)
            yield profile

    gpu_worker.memory_profiling = memory_profiling


def _profile_fields(profile):
    out = {}
    for name, value in vars(profile).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
        elif hasattr(value, "free_memory"):
            out[name] = _snapshot(value)
    for name in ("total_consumed", "transient_peak_headroom"):  # properties on some releases
        if name not in out and isinstance(getattr(profile, name, None), (int, float)):
            out[name] = getattr(profile, name)
    out["repr"] = repr(profile)
    return out


def _replace_kernel_warmups(gpu_worker):
    """Warm-up passes that run model kernels (JIT/kernel warm-up) have nothing to run on the fake
    device. The 0.34 sizing warm-up keeps vLLM's own measurement (warmup._measure_sizing_step)
    around one fake step that allocates the scenario's warm-up transient."""
    for name in ("kernel_warmup", "warmup_kernels"):
        if hasattr(gpu_worker, name):
            setattr(gpu_worker, name, lambda *args, **kwargs: None)
    if hasattr(gpu_worker, "run_kv_cache_sizing_warmup"):
        from vllm.v1.worker.gpu import warmup

        def sizing_warmup(model_runner, *args, **kwargs):
            with warmup._measure_sizing_step(model_runner):
                model_runner.warmup_step()

        gpu_worker.run_kv_cache_sizing_warmup = sizing_warmup


if __name__ == "__main__":
    sys.exit(main(sys.argv))
