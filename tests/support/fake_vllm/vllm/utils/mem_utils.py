"""vllm/utils/mem_utils.py's interface over the fake device: same names, fields and order of calls."""

import contextlib
import gc
import time
from dataclasses import dataclass, field

from fake_device import DEVICE


@dataclass
class MemorySnapshot:
    torch_peak: int = 0
    free_memory: int = 0
    total_memory: int = 0
    cuda_memory: int = 0
    torch_memory: int = 0
    non_torch_memory: int = 0
    timestamp: float = 0.0
    device: object = None
    auto_measure: bool = True

    def __post_init__(self):
        self.device_ = self.device or "cuda:0"
        if self.auto_measure:
            self.measure()

    def measure(self):
        # upstream: allocated_bytes.all.peak, mem_get_info, memory_reserved
        self.torch_peak = DEVICE.memory_stats(self.device_).get("allocated_bytes.all.peak", 0)
        self.free_memory, self.total_memory = DEVICE.mem_get_info(self.device_)
        self.cuda_memory = self.total_memory - self.free_memory
        self.torch_memory = DEVICE.memory_reserved(self.device_)
        self.non_torch_memory = self.cuda_memory - self.torch_memory
        self.timestamp = time.time()

    def __sub__(self, other):
        return MemorySnapshot(
            torch_peak=self.torch_peak - other.torch_peak,
            free_memory=self.free_memory - other.free_memory,
            total_memory=self.total_memory - other.total_memory,
            cuda_memory=self.cuda_memory - other.cuda_memory,
            torch_memory=self.torch_memory - other.torch_memory,
            non_torch_memory=self.non_torch_memory - other.non_torch_memory,
            timestamp=self.timestamp - other.timestamp,
            device=self.device_,
            auto_measure=False,
        )


@dataclass
class MemoryProfilingResult:
    non_kv_cache_memory: int = 0
    torch_peak_increase: int = 0
    non_torch_increase: int = 0
    weights_memory: int = 0
    before_create: MemorySnapshot = field(default_factory=MemorySnapshot)
    profile_time: float = 0.0

    def __post_init__(self):
        self.before_profile = MemorySnapshot(device=self.before_create.device_, auto_measure=False)
        self.after_profile = MemorySnapshot(device=self.before_create.device_, auto_measure=False)


@contextlib.contextmanager
def memory_profiling(baseline_snapshot, weights_memory=0):
    gc.collect()
    DEVICE.empty_cache()
    DEVICE.reset_peak_memory_stats(baseline_snapshot.device_)
    result = MemoryProfilingResult(before_create=baseline_snapshot, weights_memory=weights_memory)
    result.before_profile.measure()
    yield result
    gc.collect()
    DEVICE.empty_cache()
    result.after_profile.measure()
    diff_profile = result.after_profile - result.before_profile
    diff_from_create = result.after_profile - result.before_create
    result.torch_peak_increase = diff_profile.torch_peak
    result.non_torch_increase = diff_from_create.non_torch_memory
    result.profile_time = diff_profile.timestamp
    result.non_kv_cache_memory = result.non_torch_increase + result.torch_peak_increase + result.weights_memory
