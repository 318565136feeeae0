"""vLLM integration: the probe in every worker, the startup profile, and an opt-in reserved-aware KV budget.

vLLM calls ``register()`` (entry point ``vllm.general_plugins: kvguard``) in every process
it starts: the API server, the engine core and each worker, before the worker class is
resolved. ``register()`` is idempotent, cheap, and does nothing unless asked through the
environment:

``KVGUARD_SPOOL_DIR``   start the probe in each worker, writing snapshots here.
``KVGUARD_INTERVAL``    seconds between samples (default 5).
``KVGUARD_SOURCE``      the probe's source (default ``auto``: the worker's own allocator).
``KVGUARD_BUDGET``      ``stock`` (default, vLLM's own budget) or ``reserved``: size the KV
                        cache with :func:`kvguard.estimator.reserved_kv_cache_bytes`, the
                        formula of ``kvguard budget`` (never more than vLLM's own figure).

It wraps three methods of the worker class (``vllm.v1.worker.gpu_worker.Worker``;
``vllm_ascend.worker.worker.NPUWorker`` and ``worker_v1.NPUWorker``), patched when their
module is imported, or at once if it already is:

- ``init_device``: starts the probe once the worker's device is set (rank = worker rank);
- ``determine_available_memory``: while it runs, the ``memory_profiling`` context manager
  it calls (whatever object that name holds in the worker's module then, vllm-mindspore's
  replacement included) is wrapped to read the allocator's reserved peak before and after
  the profile run; afterwards the result's named fields (``weights_memory``,
  ``torch_peak_increase``, ``non_torch_increase``, ``before_create.total_memory``) and
  ``cache_config.gpu_memory_utilization`` make the estimator's :class:`Profile`;
- ``initialize_from_config``: records the KV cache vLLM allocated (``KVCacheConfig``).

Every hook is wrapped: a failure is logged once, counted (:data:`hook_errors`), and the
original method's result passes through untouched. kvguard never makes vLLM fail.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import inspect
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

log = logging.getLogger("kvguard.vllm.plugin")

# (module, class) of the worker classes whose methods kvguard wraps.
WORKER_CLASSES = (
    ("vllm.v1.worker.gpu_worker", "Worker"),
    ("vllm_ascend.worker.worker", "NPUWorker"),
    ("vllm_ascend.worker.worker_v1", "NPUWorker"),
)
BUDGETS = ("stock", "reserved")
DEFAULT_INTERVAL = 5.0
_MARK = "_kvguard_wrapped"

hook_errors: dict[str, int] = {}      # hook name -> failures, for tests and debugging
_logged: set[str] = set()
_registered = False
_lock = threading.Lock()
_reader: Any = None                   # the source that reads the reserved peak during profiling


@dataclass(frozen=True)
class Settings:
    spool_dir: str | None = None
    interval: float = DEFAULT_INTERVAL
    source: str = "auto"
    budget: str = "stock"

    @classmethod
    def from_environment(cls, environ: Any = None) -> "Settings":
        environ = os.environ if environ is None else environ
        interval_text = environ.get("KVGUARD_INTERVAL", "").strip()
        try:
            interval = float(interval_text) if interval_text else DEFAULT_INTERVAL
            if not interval > 0 or interval == float("inf"):
                raise ValueError
        except ValueError:
            _failed("settings", f"KVGUARD_INTERVAL={interval_text!r} is not a positive number; "
                                f"using {DEFAULT_INTERVAL:g}")
            interval = DEFAULT_INTERVAL
        budget = environ.get("KVGUARD_BUDGET", "stock").strip().lower() or "stock"
        if budget not in BUDGETS:
            _failed("settings", f"KVGUARD_BUDGET={budget!r} is not one of {', '.join(BUDGETS)}; using stock")
            budget = "stock"
        return cls(spool_dir=environ.get("KVGUARD_SPOOL_DIR", "").strip() or None, interval=interval,
                   source=environ.get("KVGUARD_SOURCE", "").strip() or "auto", budget=budget)

    @property
    def enabled(self) -> bool:
        return self.spool_dir is not None or self.budget != "stock"


_settings = Settings()


def _failed(hook: str, message: str) -> None:
    """Count a failure; log the first of each hook at WARNING, the rest at DEBUG."""
    with _lock:
        hook_errors[hook] = hook_errors.get(hook, 0) + 1
        first = hook not in _logged
        _logged.add(hook)
    if first:
        log.warning("kvguard: %s: %s (vLLM continues; further %s failures are logged at debug level)",
                    hook, message, hook)
    else:
        log.debug("kvguard: %s: %s", hook, message)


def _guard(hook: str, function: Callable[..., Any], *args: Any) -> Any:
    try:
        return function(*args)
    except Exception as exc:  # noqa: BLE001 - kvguard must never take vLLM down
        from kvguard.sources import one_line
        _failed(hook, one_line(exc))
        return None


# ---------------------------------------------------------------------------- register

def register() -> None:
    """vLLM's general-plugin hook. Never raises."""
    global _registered, _settings
    try:
        with _lock:
            if _registered:
                return
            _registered = True
        _settings = Settings.from_environment()
        if not _settings.enabled:
            return
        for module_name, class_name in WORKER_CLASSES:
            module = sys.modules.get(module_name)
            if module is not None:
                _guard("patch", _patch_worker_class, module, class_name)
            else:
                _PatchOnImport.watch(module_name, functools.partial(_patch_worker_class, class_name=class_name))
    except Exception as exc:  # noqa: BLE001
        _failed("register", str(exc))


def _reset_for_tests() -> None:
    global _registered, _settings, _reader
    with _lock:
        _registered = False
        hook_errors.clear()
        _logged.clear()
    _settings = Settings()
    _reader = None
    _PatchOnImport.forget()


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Calls ``patch(module)`` right after one of the watched modules is first executed."""

    _instance: "_PatchOnImport | None" = None

    def __init__(self) -> None:
        self.targets: dict[str, Callable[[Any], None]] = {}

    @classmethod
    def watch(cls, module_name: str, patch: Callable[[Any], None]) -> None:
        if cls._instance is None:
            cls._instance = cls()
            sys.meta_path.insert(0, cls._instance)
        cls._instance.targets[module_name] = patch

    @classmethod
    def forget(cls) -> None:
        if cls._instance is not None:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(cls._instance)
            cls._instance = None

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        patch = self.targets.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            try:
                spec = finder.find_spec(fullname, path, target)
            except Exception:  # noqa: BLE001 - another finder's trouble is not ours to raise
                continue
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Callable[[Any], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _guard("patch", self._patch, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _patch_worker_class(module: Any, class_name: str) -> None:
    worker = getattr(module, class_name, None)
    if worker is None:
        return
    for name, wrapper in (("init_device", _wrap_init_device),
                          ("determine_available_memory", _wrap_determine_available_memory),
                          ("initialize_from_config", _wrap_initialize_from_config)):
        original = worker.__dict__.get(name)
        if original is None or getattr(original, _MARK, False):
            continue
        wrapped = functools.wraps(original)(wrapper(original))
        setattr(wrapped, _MARK, True)
        setattr(worker, name, wrapped)


# ---------------------------------------------------------------------------- the probe

def _ensure_probe(worker: Any) -> None:
    if _settings.spool_dir is None:
        return
    from kvguard import probe
    rank = getattr(worker, "rank", None)
    # The strict start (returns the running probe, if any): a bad setting raises here and is
    # counted and logged once by _guard.
    probe._start(_settings.spool_dir, _settings.interval, _settings.source,
                 rank=rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else None)


def _wrap_init_device(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_device(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _guard("init_device", _ensure_probe, self)
        return result
    return init_device


# ---------------------------------------------------------------------------- the profile

class _Capture:
    """What one ``memory_profiling`` block left behind."""

    def __init__(self) -> None:
        self.result: Any = None
        self.reserved_peak_before: int | None = None
        self.reserved_peak_after: int | None = None


def _reserved_peak() -> int | None:
    """The allocator's reserved peak on this worker's device, read by the probe's source
    (``auto``: torch.cuda, torch.npu or MindSpore, whichever the worker uses)."""
    global _reader
    if _reader is None:
        from kvguard.sources import get_source
        _reader = get_source(_settings.source)
    records = _reader.sample()
    return records[0].peak_reserved_bytes if records else None


def _wrap_memory_profiling(original: Callable[..., Any], capture: _Capture) -> Callable[..., Any]:
    @contextlib.contextmanager
    def memory_profiling(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with original(*args, **kwargs) as result:
            # Entering reset the peak statistics: the reserved peak is now the reserved memory.
            capture.result = result
            capture.reserved_peak_before = _guard("memory_profiling", _reserved_peak)
            try:
                yield result
            finally:
                # Read before vLLM's exit runs empty_cache(): the peak the profile run reached.
                capture.reserved_peak_after = _guard("memory_profiling", _reserved_peak)
    setattr(memory_profiling, _MARK, True)
    return memory_profiling


@contextlib.contextmanager
def _profiling_captured(function: Callable[..., Any]) -> Iterator[_Capture]:
    """While ``function`` runs, its module's ``memory_profiling`` global is wrapped."""
    capture = _Capture()
    # The global lives in the module that defines the method, below decorators such as
    # @torch.inference_mode() (functools.wraps keeps the chain in __wrapped__).
    namespace = getattr(inspect.unwrap(function), "__globals__", {})
    current = namespace.get("memory_profiling")
    wrapped = None
    if callable(current) and not getattr(current, _MARK, False):
        wrapped = _wrap_memory_profiling(current, capture)
        namespace["memory_profiling"] = wrapped
    try:
        yield capture
    finally:
        if wrapped is not None and namespace.get("memory_profiling") is wrapped:
            namespace["memory_profiling"] = current


def profile_from(worker: Any, capture: _Capture) -> Any:
    """The estimator's Profile from a MemoryProfilingResult and the worker's cache config."""
    from kvguard.estimator import Profile

    result = capture.result
    if result is None:
        return None
    total = getattr(getattr(result, "before_create", None), "total_memory", 0) \
        or getattr(getattr(worker, "init_snapshot", None), "total_memory", 0)
    reserved_increase = None
    if capture.reserved_peak_before is not None and capture.reserved_peak_after is not None:
        reserved_increase = max(0, capture.reserved_peak_after - capture.reserved_peak_before)
    return Profile(
        total_memory_bytes=int(total),
        gpu_memory_utilization=float(worker.cache_config.gpu_memory_utilization),
        weights_bytes=max(0, int(result.weights_memory)),
        peak_allocated_increase_bytes=max(0, int(result.torch_peak_increase)),
        peak_reserved_increase_bytes=reserved_increase,
        non_torch_increase_bytes=int(result.non_torch_increase),
    )


def _reserved_budget(profile: Any, available: int) -> int | None:
    """The reserved-aware budget when it is smaller than vLLM's; None to keep vLLM's."""
    from kvguard.estimator import reserved_kv_cache_bytes

    reserved = reserved_kv_cache_bytes(profile)
    if reserved is None:
        _failed("budget", "the reserved increase was not measured; keeping vLLM's KV cache budget")
        return None
    return reserved if reserved < available else None


def _wrap_determine_available_memory(original: Callable[..., Any]) -> Callable[..., Any]:
    def determine_available_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        _guard("determine_available_memory", _ensure_probe, self)
        with _profiling_captured(original) as capture:
            available = original(self, *args, **kwargs)
        profile = _guard("profile", profile_from, self, capture)
        if profile is None:
            if capture.result is None and "no_profile" not in _logged:
                _logged.add("no_profile")
                log.info("kvguard: this worker's determine_available_memory ran no memory_profiling; "
                         "no startup profile recorded")
            return available
        from kvguard import probe
        probe.set_profile(profile)
        if _settings.budget != "reserved" or not isinstance(available, int):
            return available
        budget = _guard("budget", _reserved_budget, profile, available)
        if budget is None:
            return available
        from kvguard.units import format_gib
        log.info("kvguard: KV cache budget %s (reserved-aware, KVGUARD_BUDGET=reserved) instead of "
                 "vLLM's %s", format_gib(budget), format_gib(available))
        if hasattr(self, "available_kv_cache_memory_bytes"):
            self.available_kv_cache_memory_bytes = budget
        return budget
    return determine_available_memory


# ---------------------------------------------------------------------------- the KV cache

def kv_cache_allocation(kv_cache_config: Any) -> Any:
    """KVCacheAllocation from vLLM's KVCacheConfig (``kv_cache_groups``; ``kv_cache_tensors`` or the
    older ``tensors`` dict as a fallback for the block size in bytes)."""
    from kvguard.spool import KVCacheAllocation

    num_blocks = int(kv_cache_config.num_blocks)
    if num_blocks <= 0:
        return None
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    block_bytes = sum(len(group.layer_names) * int(group.kv_cache_spec.page_size_bytes) for group in groups)
    if not block_bytes:
        tensors = getattr(kv_cache_config, "kv_cache_tensors", None)
        if tensors is None:
            tensors = list((getattr(kv_cache_config, "tensors", None) or {}).values())
        block_bytes = sum(int(tensor.size) for tensor in tensors) // num_blocks
    block_size = int(groups[0].kv_cache_spec.block_size) if groups else 0
    if block_bytes <= 0 or block_size <= 0:
        return None
    return KVCacheAllocation(num_blocks=num_blocks, block_bytes=block_bytes, block_size=block_size)


def _record_kv_cache(kv_cache_config: Any) -> None:
    allocation = kv_cache_allocation(kv_cache_config)
    if allocation is not None:
        from kvguard import probe
        probe.set_kv_cache(allocation)


def _wrap_initialize_from_config(original: Callable[..., Any]) -> Callable[..., Any]:
    def initialize_from_config(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, kv_cache_config, *args, **kwargs)
        _guard("initialize_from_config", _record_kv_cache, kv_cache_config)
        return result
    return initialize_from_config
