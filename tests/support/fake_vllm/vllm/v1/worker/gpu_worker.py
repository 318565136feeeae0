"""vllm/v1/worker/gpu_worker.py's Worker over the fake device: the methods kvguard wraps."""

from types import SimpleNamespace

import torch
from fake_device import DEVICE, GIB

from vllm.utils.mem_utils import MemorySnapshot, memory_profiling


class FakeModelRunner:
    """Weights are allocated at load; the profile run allocates activations and some non-torch memory."""

    def __init__(self, weights=16 * GIB, activations=(1536 << 20, 1536 << 20), non_torch_growth=512 << 20):
        self.weights = weights
        self.activations = activations
        self.non_torch_growth = non_torch_growth
        self.model_memory_usage = 0
        self.kv_caches = []

    def load_model(self):
        DEVICE.malloc(self.weights)
        self.model_memory_usage = self.weights

    def profile_run(self):
        handles = [DEVICE.malloc(size) for size in self.activations]
        DEVICE.non_torch += self.non_torch_growth  # e.g. NCCL buffers on the first forward
        self.non_torch_growth = 0
        for handle in handles:
            DEVICE.free(handle)

    def initialize_kv_cache(self, kv_cache_config):
        for tensor in kv_cache_config.kv_cache_tensors:
            self.kv_caches.append(DEVICE.malloc(tensor.size))


class Worker:
    def __init__(self, gpu_memory_utilization=0.9, kv_cache_memory_bytes=None, rank=0, local_rank=0, model_runner=None):
        self.cache_config = SimpleNamespace(
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            num_gpu_blocks=None,
        )
        self.rank = rank
        self.local_rank = local_rank
        self.model_runner = model_runner or FakeModelRunner()

    def init_device(self):
        self.device = f"cuda:{self.local_rank}"
        DEVICE.empty_cache()
        self.init_snapshot = MemorySnapshot(device=self.device)
        self.requested_memory = self.init_snapshot.total_memory * self.cache_config.gpu_memory_utilization

    def load_model(self):
        self.model_runner.load_model()

    @torch.inference_mode()
    def determine_available_memory(self):
        if kv_cache_memory_bytes := self.cache_config.kv_cache_memory_bytes:
            self.model_runner.profile_run()
            return kv_cache_memory_bytes
        with memory_profiling(
            self.init_snapshot, weights_memory=int(self.model_runner.model_memory_usage)
        ) as profile_result:
            self.model_runner.profile_run()
            profile_torch_peak = DEVICE.memory_stats(self.device).get("allocated_bytes.all.peak", 0)
        profile_result.torch_peak_increase = profile_torch_peak - profile_result.before_profile.torch_peak
        profile_result.non_kv_cache_memory = (
            profile_result.non_torch_increase + profile_result.torch_peak_increase + profile_result.weights_memory
        )
        self.non_torch_memory = profile_result.non_torch_increase
        self.peak_activation_memory = profile_result.torch_peak_increase
        self.available_kv_cache_memory_bytes = self.requested_memory - profile_result.non_kv_cache_memory
        return int(self.available_kv_cache_memory_bytes)

    def initialize_from_config(self, kv_cache_config):
        self.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def execute_model(self, scheduler_output):
        """One step (vllm/v1/worker/gpu_worker.py execute_model): here it returns what it was given, or raises it
        when that is an exception (an engine's own error)."""
        if isinstance(scheduler_output, BaseException):
            raise scheduler_output
        return scheduler_output
