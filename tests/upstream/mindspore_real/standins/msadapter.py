"""A stand-in for msadapter (MindSpore's torch API, r0.3.0: not on PyPI), by CPU torch.

vllm-mindspore 0.5.1 imports it first (vllm_mindspore/__init__.py:22) and patches a few of its names
(msadapter_patch.py:23-96: Tag, ops.vllm, utils.cpp_extension, autograd.profiler, _subclasses, cuda.CUDAGraph,
_tensor._device_to_ms); rejection_sampler.py:45 reads msadapter.finfo. Nothing else of it is on the path the
tests run. Every name is torch's; the submodules vllm-mindspore writes into are this module's own namespaces
(reading through to torch's), so its patches never land on the real torch. The memory calls msadapter answers
from MindSpore's pool are set on torch.cuda by fake_mindspore.py.
"""

from __future__ import annotations

import sys
import types

import torch


def _through(name: str, target) -> types.ModuleType:
    """A namespace of this module's own that reads what it lacks from ``target``."""
    module = types.ModuleType(f"msadapter.{name}")

    def missing(attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return getattr(target, attr)

    module.__getattr__ = missing
    sys.modules[module.__name__] = module
    return module


ops = _through("ops", torch.ops)
utils = _through("utils", torch.utils)
autograd = _through("autograd", torch.autograd)
cuda = _through("cuda", torch.cuda)
_tensor = _through("_tensor", types.SimpleNamespace())
device = torch.device
finfo = torch.finfo
__version__ = "0.3.0.standin"

# vLLM decorates a few functions with torch.compile(backend=current_platform.simple_compile_backend), which
# vllm-mindspore's AscendPlatform names "npu" (platforms/ascend.py:45 @ 0.5.1); under msadapter they run as
# MindSpore compiles them. Here the "npu" backend runs them as they are (eager), off the memory path.
from torch._dynamo import list_backends, register_backend  # noqa: E402 (after the comment that says why)

if "npu" not in list_backends(exclude_tags=()):
    register_backend(lambda gm, example_inputs: gm, name="npu")


def __getattr__(attr):
    if attr.startswith("__") and attr.endswith("__"):
        raise AttributeError(attr)
    return getattr(torch, attr)
