"""A fake CUDA device for running a real vLLM release's startup code on CPU.

Runs inside a release's environment (tests/upstream/vllm_real/envs.py), never in kvguard's own venv.
Only the device calls vLLM's worker makes are replaced (torch.cuda.*, torch.accelerator.*, the
CUDA VMM tensor of the extensible KV cache); everything else is the release's own code.

The allocator model is deliberately small. Bytes are in one of five places:
  other      used by other processes before vLLM starts (outside this process)
  non_torch  this process, outside torch's caching allocator (CUDA context, NCCL, cuBLAS)
  mapped     VMM pages this process maps outside the caching allocator (extensible KV cache)
  reserved   torch's caching allocator: segments obtained from the driver; of these,
  allocated  is what live tensors hold, and `stuck` is cached memory empty_cache cannot hand
             back (fragmentation: a freed block inside a segment that still holds a live one).
free = total - other - non_torch - mapped - reserved, as cudaMemGetInfo reports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode


@dataclasses.dataclass
class FakeDevice:
    total: int
    other: int = 0
    non_torch: int = 0
    mapped: int = 0
    allocated: int = 0
    reserved: int = 0
    stuck: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    per_process_fraction: float = 1.0
    allocator_settings: str = ""
    calls: Counter = dataclasses.field(default_factory=Counter)

    # -- the allocator model -------------------------------------------------------------------
    @property
    def free(self) -> int:
        return self.total - self.other - self.non_torch - self.mapped - self.reserved

    def alloc(self, nbytes: int) -> int:
        """Allocate nbytes through the caching allocator; reuse cached blocks first."""
        if nbytes < 0:
            raise ValueError(f"negative allocation {nbytes}")
        cached = self.reserved - self.allocated - self.stuck
        grow = max(nbytes - cached, 0)
        if grow > self.free:
            raise torch.OutOfMemoryError(
                f"fake device: CUDA out of memory. Tried to allocate {nbytes} bytes "
                f"({self.free} free, {self.reserved} reserved, {self.allocated} allocated)"
            )
        self.reserved += grow
        self.allocated += nbytes
        self._track()
        return nbytes

    def release(self, nbytes: int, *, fragment: int = 0) -> None:
        """Free nbytes; `fragment` of them stay cached in segments empty_cache cannot free."""
        self.allocated -= nbytes
        self.stuck += fragment
        assert self.allocated >= 0, "fake device: freed more than allocated"

    def empty_cache(self) -> None:
        self.reserved = self.allocated + self.stuck

    def map_pages(self, nbytes: int) -> None:
        if nbytes > self.free:
            raise torch.OutOfMemoryError(f"fake device: cannot map {nbytes} bytes ({self.free} free)")
        self.mapped += nbytes

    def _track(self) -> None:
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def reset_peak(self) -> None:
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved

    def stats(self) -> dict[str, int]:
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak_allocated,
            "reserved_bytes.all.current": self.reserved,
            "reserved_bytes.all.peak": self.peak_reserved,
            "active_bytes.all.current": self.allocated,
            "active_bytes.all.peak": self.peak_allocated,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def snapshot(self) -> dict[str, int]:
        return {
            "total": self.total,
            "free": self.free,
            "other": self.other,
            "non_torch": self.non_torch,
            "mapped": self.mapped,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "stuck": self.stuck,
            "peak_allocated": self.peak_allocated,
            "peak_reserved": self.peak_reserved,
        }


class TensorsOnMeta(TorchFunctionMode):
    """Tensors the engine itself creates on the fake device type ("cuda"; "npu" for the Ascend
    engines), from cuBLAS warm-up to small buffers, become meta tensors: shapes and dtypes are kept,
    no memory is used and nothing is charged to the fake device."""

    def __init__(self, device_type: str = "cuda") -> None:
        super().__init__()
        self.device_type = device_type

    def _on_device(self, value) -> bool:
        if isinstance(value, torch.device):
            return value.type == self.device_type
        return isinstance(value, str) and value.startswith(self.device_type)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.device:  # a device object names the fake device; only tensors move
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        if self._on_device(kwargs.get("device")):
            kwargs["device"] = "meta"
        args = tuple("meta" if self._on_device(a) else a for a in args)
        if getattr(func, "__name__", "") == self.device_type:  # Tensor.cuda() / Tensor.npu()
            return args[0].to("meta")
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinned host memory needs a CUDA build
        return func(*args, **kwargs)


def _properties(device: FakeDevice, name: str, major: int, minor: int):
    return types.SimpleNamespace(
        name=name,
        total_memory=device.total,
        major=major,
        minor=minor,
        multi_processor_count=132,
        is_integrated=False,
        L2_cache_size=50 << 20,
        uuid="GPU-00000000-0000-0000-0000-000000000000",
        warp_size=32,
        max_threads_per_multi_processor=2048,
        shared_memory_per_block_optin=232448,
        gcnArchName="",
        regs_per_multiprocessor=65536,
        pci_bus_id=0,
        pci_device_id=0,
        pci_domain_id=0,
    )


def device_functions(
    device: FakeDevice, *, name: str = "NVIDIA H100 80GB HBM3", capability: tuple[int, int] = (9, 0)
) -> dict[str, object]:
    """The torch.cuda / torch.accelerator functions the worker calls, as 'module.attr' -> fake."""

    def counted(label, fn):
        def call(*args, **kwargs):
            device.calls[label] += 1
            return fn(*args, **kwargs)

        call.__name__ = label.rsplit(".", 1)[-1]
        return call

    def set_fraction(fraction, _device=None):
        device.per_process_fraction = float(fraction)

    fakes = {
        "mem_get_info": lambda *_a, **_k: (device.free, device.total),
        "memory_stats": lambda *_a, **_k: device.stats(),
        "memory_reserved": lambda *_a, **_k: device.reserved,
        "memory_allocated": lambda *_a, **_k: device.allocated,
        "max_memory_allocated": lambda *_a, **_k: device.peak_allocated,
        "max_memory_reserved": lambda *_a, **_k: device.peak_reserved,
        "reset_peak_memory_stats": lambda *_a, **_k: device.reset_peak(),
        "empty_cache": lambda *_a, **_k: device.empty_cache(),
        "synchronize": lambda *_a, **_k: None,
        "get_device_properties": lambda *_a, **_k: _properties(device, name, *capability),
        "get_device_capability": lambda *_a, **_k: capability,
        "get_device_name": lambda *_a, **_k: name,
        "set_device": lambda *_a, **_k: None,
        "current_device": lambda *_a, **_k: 0,
        "device_count": lambda *_a, **_k: 1,
        "is_available": lambda *_a, **_k: True,
        "is_initialized": lambda *_a, **_k: True,
        "set_per_process_memory_fraction": set_fraction,
    }
    table = {}
    for attr, fn in fakes.items():
        table[f"torch.cuda.{attr}"] = counted(f"torch.cuda.{attr}", fn)
    accel = {
        "get_memory_info": fakes["mem_get_info"],
        "memory_stats": fakes["memory_stats"],
        "memory_reserved": fakes["memory_reserved"],
        "memory_allocated": fakes["memory_allocated"],
        "max_memory_allocated": fakes["max_memory_allocated"],
        "max_memory_reserved": fakes["max_memory_reserved"],
        "reset_peak_memory_stats": fakes["reset_peak_memory_stats"],
        "empty_cache": fakes["empty_cache"],
        "synchronize": fakes["synchronize"],
        "device_count": fakes["device_count"],
        "set_device_index": fakes["set_device"],
        "current_device_index": fakes["current_device"],
        "is_available": fakes["is_available"],
    }
    for attr, fn in accel.items():
        table[f"torch.accelerator.{attr}"] = counted(f"torch.accelerator.{attr}", fn)
    table["torch.cuda.memory.get_allocator_backend"] = counted(
        "torch.cuda.memory.get_allocator_backend", lambda *_a, **_k: "native"
    )

    def set_settings(settings):
        device.allocator_settings = settings

    table["torch._C._accelerator_getAllocatorSettings"] = counted(
        "torch._C._accelerator_getAllocatorSettings", lambda: device.allocator_settings
    )
    table["torch._C._accelerator_setAllocatorSettings"] = counted(
        "torch._C._accelerator_setAllocatorSettings", set_settings
    )
    return table


@contextlib.contextmanager
def patched(table: dict[str, object]):
    """Set each 'module.attr' in table for the duration; restore afterwards."""
    import importlib

    saved = []
    for dotted, value in table.items():
        module_name, attr = dotted.rsplit(".", 1)
        owner = importlib.import_module(module_name) if module_name != "torch._C" else torch._C
        saved.append((owner, attr, getattr(owner, attr, None), hasattr(owner, attr)))
        setattr(owner, attr, value)
    try:
        with TensorsOnMeta("cuda"):
            yield
    finally:
        for owner, attr, value, existed in reversed(saved):
            if existed:
                setattr(owner, attr, value)
            else:
                delattr(owner, attr)


class FakeVmmDriver:
    """The CUDA virtual-memory driver calls (cuMemAddressReserve / cuMemCreate / cuMemMap ...)
    that vLLM 0.34's vmm_unavailable_reason probe and granule_size make. The extensible KV
    cache's own pages are mapped by fake_runner.FakeExtensibleTensor on the fake device."""

    GRANULARITY = 2 << 20

    def __init__(self):
        self._next = 1 << 40

    def ensure_context(self, device_index):
        return None

    def unusable_runtime_reason(self, device_index):
        return None

    def granularity(self, device_index, *args, **kwargs):
        return self.GRANULARITY

    def reserve(self, size, *args, **kwargs):
        ptr, self._next = self._next, self._next + size
        return ptr

    def create(self, size, *args, **kwargs):
        return object()

    def map(self, *args, **kwargs):
        return None

    unmap = set_access = release = free = free_reserved = map
