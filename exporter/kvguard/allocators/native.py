"""Which implementation of an allocator model runs: the C engine where it is built and supports the
configuration, else the Python model.

The Python models (``torch_alloc.CachingAllocator``, ``mindspore_pool.DynamicMemPool``) are the
specification: each rule cites its upstream source there. The C engines (``_ctorch``, ``_cmspool``,
wrapped by ``torch_native`` and ``mindspore_native``) are second implementations of the same rules for
speed, held equal to the Python models by differential tests and checked against the compiled upstream
allocators by the oracle tests. The default wheel is pure Python (py3-none-any); ``KVGUARD_BUILD_EXT=1`` builds them
(``KVGUARD_BUILD_EXT=1 pip install -e .``, ``./dev.sh``'s setup; ``setup.py``), needing a C compiler and
Python's headers. Without them kvguard runs the Python models alone, with the same results.

``KVGUARD_ALLOCATOR_ENGINE=python`` forces the Python models (``auto``, the default, prefers C);
``KVGUARD_ALLOCATOR_ENGINE=c`` requires the C engines: NotImplementedError, naming the reason, where one is not
built or does not take the configuration (the tests run the models' suites on both engines so).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from kvguard.allocators.device import Device

ENV = "KVGUARD_ALLOCATOR_ENGINE"
ENGINES = ("auto", "c", "python")


def _wanted() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in ENGINES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(ENGINES)}")
    return value


def _native(module: str) -> Any | None:
    """The wrapper module of a C engine, or None where the engine was not built."""
    try:
        return importlib.import_module(f"kvguard.allocators.{module}_native")
    except ImportError:
        return None


def _engine_for(module: str, device: Device, kwargs: dict[str, Any]) -> Any | None:
    """The wrapper module whose engine runs this configuration, or None for the Python model."""
    wanted = _wanted()
    if wanted == "python":
        return None
    wrapper = _native(module)
    if wrapper is None:
        reason = f"the C engine for {module} is not built (KVGUARD_BUILD_EXT=1, setup.py)"
    else:
        reason = wrapper.unsupported(device=device, **kwargs)
    if reason is None:
        return wrapper
    if wanted == "c":
        raise NotImplementedError(f"{ENV}=c: {reason}")
    return None


def caching_allocator(device: Device, **kwargs: Any):
    """PyTorch's caching allocator model (``CachingAllocator``'s arguments)."""
    wrapper = _engine_for("torch", device, kwargs)
    if wrapper is not None:
        return wrapper.NativeCachingAllocator(device, **kwargs)
    from kvguard.allocators.torch_alloc import CachingAllocator

    return CachingAllocator(device, **kwargs)


def mindspore_pool(device: Device, **kwargs: Any):
    """MindSpore's memory pool model (``DynamicMemPool``'s arguments)."""
    wrapper = _engine_for("mindspore", device, kwargs)
    if wrapper is not None:
        return wrapper.NativeDynamicMemPool(device, **kwargs)
    from kvguard.allocators.mindspore_pool import DynamicMemPool

    return DynamicMemPool(device, **kwargs)


def built() -> bool:
    """Whether both C engines are built (and import)."""
    torch_wrapper, pool_wrapper = _native("torch"), _native("mindspore")
    return torch_wrapper is not None and torch_wrapper.Engine is not None and pool_wrapper is not None


def engine(allocator: Any) -> str:
    """'c' for a C engine, 'python' for a Python model."""
    return "c" if type(allocator).__module__.endswith("_native") else "python"
