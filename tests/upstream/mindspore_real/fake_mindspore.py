"""MindSpore's device memory calls on tests/upstream/vllm_real's fake device; everything else is MindSpore (CPU) itself.

Runs inside the vllm-mindspore environment (envs.py), never in kvguard's own venv. MindSpore's memory API is
Python over four C++ bindings of ``mindspore._c_expression``, imported by name into ``mindspore.runtime.memory``
and ``mindspore.hal.memory`` (runtime/memory.py:20-21, hal/memory.py:17-18 @ 2.7.1). Only those bindings are
replaced, in both modules, so the real ``mindspore.runtime.memory_reserved`` / ``max_memory_reserved`` /
``memory_stats`` / ``reset_peak_memory_stats`` / ``empty_cache`` (memory.py:110-241) run unchanged on top:

  _memory_stats(target)            the pool's figures as MindSpore's keys: total_reserved_memory (the fake
                                   device's reserved), total_allocated_memory, total_idle_memory,
                                   max_reserved_memory / max_allocated_memory (the peaks since the last reset,
                                   updated on every growth, as the pool's own counters are), ...
  _reset_max_mem_reserved(target)  the reserved peak := reserved now (2.6+: absolute since the reset,
  _reset_max_mem_allocated(target) kvguard.sources.mindspore), and the allocated one alike
  _empty_cache(target)             hands every cached block back (the fake device's empty_cache); the bytes
                                   released
  get_context("device_target")     "Ascend", and hal.get_device_properties the fake device's total / free
                                   memory (_on_ascend)

vllm-mindspore itself calls torch's names (``torch.cuda.empty_cache``, ``memory_reserved``, ``mem_get_info``,
... in ms_memory_profiling, utils.py:450-470 @ 0.5.1): in a deployment ``torch`` is msadapter, which answers
them from MindSpore's pool. Here torch is the CPU build (msadapter's stand-in, msadapter.py), so
``torch.cuda``'s memory calls are set to what msadapter does: the ``mindspore.runtime`` call of the same
name (memory_stats, memory_reserved, memory_allocated and their max_*, reset_peak_memory_stats, empty_cache),
and the device's free / total for mem_get_info (the runtime's aclrtGetMemInfo); set_device, synchronize,
device_count, get_device_properties ... are tests/upstream/vllm_real's fakes. Tensors vLLM creates on "cuda" become
meta tensors (tests/upstream/vllm_real's TensorsOnMeta): nothing is charged for them.
"""

from __future__ import annotations

import torch

DEVICE_NAME = "Ascend910B1"


def _stats(device) -> dict:
    """MindSpore 2.7.1's memory_stats() keys (runtime/memory.py:128-131), from the fake device's figures."""
    return {
        "total_reserved_memory": device.reserved,
        "total_allocated_memory": device.allocated,
        "total_idle_memory": device.reserved - device.allocated,
        "total_eager_free_memory": 0,
        "max_reserved_memory": device.peak_reserved,
        "max_allocated_memory": device.peak_allocated,
        "common_mem_pool_stats": {"block_unit_size": 1 << 30, "block_counts": 0, "blocks_info": {}},
        "persistent_mem_pool_stats": {"block_unit_size": 1 << 30, "block_counts": 0, "blocks_info": {}},
    }


def bindings(device) -> dict:
    """The four ``mindspore._c_expression`` memory bindings, counted on the fake device."""

    def counted(label, fn):
        def call(*args, **kwargs):
            device.calls[label] += 1
            return fn(*args, **kwargs)

        call.__name__ = label
        return call

    def reset_reserved(*_a):
        device.peak_reserved = device.reserved

    def reset_allocated(*_a):
        device.peak_allocated = device.allocated

    def empty_cache(*_a):
        before = device.reserved
        device.empty_cache()
        return before - device.reserved

    return {
        "_memory_stats": counted("ms._memory_stats", lambda *_a: _stats(device)),
        "_reset_max_mem_reserved": counted("ms._reset_max_mem_reserved", reset_reserved),
        "_reset_max_mem_allocated": counted("ms._reset_max_mem_allocated", reset_allocated),
        "_empty_cache": counted("ms._empty_cache", empty_cache),
    }


def msadapter_cuda(device) -> dict:
    """``torch.cuda``'s names as msadapter answers them: MindSpore's runtime for the pool, the fake device for
    the rest."""
    from fake_device import (
        device_functions,  # tests/upstream/vllm_real: the device queries, same semantics
    )
    from mindspore import runtime

    fakes = device_functions(device, name=DEVICE_NAME, capability=(9, 0))
    table = {attr: fn for attr, fn in fakes.items() if attr.startswith("torch.cuda.")}
    for name in (
        "memory_stats",
        "memory_reserved",
        "memory_allocated",
        "max_memory_reserved",
        "max_memory_allocated",
        "reset_peak_memory_stats",
        "empty_cache",
    ):
        table[f"torch.cuda.{name}"] = _no_arguments(getattr(runtime, name))
    return table


def _no_arguments(function):
    """``mindspore.runtime``'s call for the current device, whatever device argument torch's name was given."""

    def call(*_args, **_kwargs):
        return function()

    return call


def _on_ascend(device) -> None:
    """The context names the device a deployment runs on, "Ascend" (this CPU build cannot set it: it has no
    Ascend backend), and ``mindspore.hal.get_device_properties`` (hal/device.py:255 @ 2.7.1) answers that
    device's AscendDeviceProperties memory fields from the fake device. Only MindSpore's memory API reads
    the device target on the path run here (runtime/memory.py, hal/memory.py; vllm-mindspore 0.5.1 never does)."""
    import types

    import mindspore
    from mindspore import context, hal

    real = context.get_context

    def get_context(attr_key):
        return "Ascend" if attr_key == "device_target" else real(attr_key)

    def get_device_properties(device_id=0, device_target=None):
        device.calls["ms.hal.get_device_properties"] += 1
        return types.SimpleNamespace(name=DEVICE_NAME, total_memory=device.total, free_memory=device.free)

    context.get_context = mindspore.get_context = get_context
    hal.get_device_properties = get_device_properties


_installed = None


def install(device) -> None:
    """Replace MindSpore's memory bindings and torch.cuda's memory calls, backed by ``device``; idempotent."""
    global _installed
    if _installed is not None:
        return
    import mindspore.hal.memory as hal_memory
    import mindspore.runtime.memory as runtime_memory

    for module in (runtime_memory, hal_memory):
        for name, fn in bindings(device).items():
            setattr(module, name, fn)
    _on_ascend(device)
    import fake_device

    # msadapter takes "npu" device strings for the Ascend device (msadapter_patch.py:76-81 @ 0.5.1); vLLM's
    # process groups name current_platform.device_name, "npu" (platforms/ascend.py:43). As torch_npu does, "npu"
    # becomes torch's PrivateUse1 backend name, and tensors on it meta tensors, like those on "cuda".
    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")
    _installed = [fake_device.patched(msadapter_cuda(device)), fake_device.TensorsOnMeta("npu")]
    for context in _installed:
        context.__enter__()
