"""Allocator simulator: PyTorch's caching allocator, torch_npu's variant, MindSpore's pool,
and vLLM-shaped workloads driving them on a simulated device.

Pure logic: nothing here reads files or talks to devices, except ``traces`` (readers of
recorded traces) and ``plot`` (matplotlib), which the CLI imports on demand.
See ``kvguard.sim.scenario`` for the stepper API.
"""

from .base import Allocator, SimOutOfMemory
from .device import Device
from .mindspore_pool import DynamicMemPool
from .scenario import ScenarioConfig, ScenarioResult, ServingScenario, StepRecord, run_scenario
from .torch_alloc import CachingAllocator

__all__ = ["Allocator", "CachingAllocator", "Device", "DynamicMemPool", "ScenarioConfig", "ScenarioResult",
           "ServingScenario", "SimOutOfMemory", "StepRecord", "run_scenario"]
