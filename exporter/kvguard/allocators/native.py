"""Which implementation of an allocator model runs: the C engine where it is built and supports the
configuration, else the Python model.

The Python models (``torch_alloc.CachingAllocator``, ``mindspore_pool.DynamicMemPool``) are the
specification: each rule cites its upstream source there. The C engines (``_ctorch``, ``_cmspool``,
wrapped by ``torch_native`` and ``mindspore_native``) are second implementations of the same rules for
speed, held equal to the Python models by differential tests and checked against the compiled upstream
allocators by the oracle tests. The default wheel is pure Python (py3-none-any); ``KVGUARD_BUILD_EXT=1`` builds them
(``KVGUARD_BUILD_EXT=1 pip install -e .``, ``./dev.sh``'s setup; ``setup.py``), needing a C compiler and
Python's headers. Without them kvguard runs the Python models alone, with the same results.

``KVGUARD_ALLOCATOR_ENGINE=python`` forces the Python models (``auto``, the default, prefers C).
"""

from __future__ import annotations

import os
from typing import Any

from kvguard.allocators.device import Device

ENV = "KVGUARD_ALLOCATOR_ENGINE"
ENGINES = ("auto", "python")


def _wanted() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in ENGINES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(ENGINES)}")
    return value


def _native(module: str) -> Any | None:
    """The wrapper module of a C engine, or None where the engine was not built."""
    try:
        if module == "torch":
            from kvguard.allocators import torch_native as wrapper
        else:
            from kvguard.allocators import mindspore_native as wrapper
    except ImportError:
        return None
    return wrapper


def caching_allocator(device: Device, **kwargs: Any):
    """PyTorch's caching allocator model (``CachingAllocator``'s arguments)."""
    wrapper = _native("torch") if _wanted() == "auto" else None
    if wrapper is not None and wrapper.unsupported(device=device, **kwargs) is None:
        return wrapper.NativeCachingAllocator(device, **kwargs)
    from kvguard.allocators.torch_alloc import CachingAllocator

    return CachingAllocator(device, **kwargs)


def mindspore_pool(device: Device, **kwargs: Any):
    """MindSpore's memory pool model (``DynamicMemPool``'s arguments)."""
    wrapper = _native("mindspore") if _wanted() == "auto" else None
    if wrapper is not None and wrapper.unsupported(device=device, **kwargs) is None:
        return wrapper.NativeDynamicMemPool(device, **kwargs)
    from kvguard.allocators.mindspore_pool import DynamicMemPool

    return DynamicMemPool(device, **kwargs)


def engine(allocator: Any) -> str:
    """'c' for a C engine, 'python' for a Python model."""
    return "c" if type(allocator).__module__.endswith("_native") else "python"
