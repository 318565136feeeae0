"""Readers of device-memory counters, one module per backend, behind one small interface.

Like node_exporter's collectors: every source has a name, a ``sample()`` that returns one
:class:`~kvguard.records.DeviceMemory` per device it sees, and an optional ``close()``.
The probe, the sidecar and the CLI only ever talk to this interface and pick a source by
name through the registry below; none of them knows which backends exist.

A source must be cheap and thread-safe to call (the sidecar calls it on its own schedule,
under a time limit) and must fail with :class:`SourceError` and a one-line message, never
with a backend's own exception. Built-in sources are imported only when asked for, so
naming the registry never imports torch, mindspore or pynvml.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from kvguard.budget.estimator import Profile
from kvguard.records import DeviceMemory, KVCacheAllocation
from kvguard.text import one_line


class SourceError(RuntimeError):
    """A source could not read its counters; the message is one line."""


class SourceUnavailable(SourceError):
    """The backend is not present here (library not installed, no driver, no binary)."""


class EngineError(SourceError):
    """The framework's call raised an error that belongs to the engine, not to the source.

    MindSpore's ``memory_stats()`` drains the runtime pipeline and then rethrows, and clears,
    the pending asynchronous error of the engine's ops (kvguard.sources.mindspore). Once
    cleared, only a re-raise on the engine's thread hands it back: the probe, which samples
    such a source on the engine's thread, raises :attr:`original` there unchanged.
    """

    def __init__(self, original: BaseException, source: str):
        super().__init__(f"{source}: {one_line(original)}")
        self.original = original


@runtime_checkable
class Source(Protocol):
    """What every source provides. ``close()`` is optional."""

    name: str

    def sample(self) -> list[DeviceMemory]:
        """One record per device; raises SourceError on failure."""
        ...


@dataclass(frozen=True)
class RankContext:
    """What a source knows about the rank behind a device (the simulator knows everything)."""

    rank: int | None = None
    profile: Profile | None = None
    kv_cache: KVCacheAllocation | None = None


# Built-in sources, imported on first use: "module:attribute".
_BUILTIN: dict[str, str] = {
    "auto": "kvguard.sources.auto:AutoSource",
    "host": "kvguard.sources.host:HostSource",
    "mindspore": "kvguard.sources.mindspore:MindSporeSource",
    "npu-smi": "kvguard.sources.npu_smi:NpuSmiSource",
    "nvml": "kvguard.sources.nvml:NvmlSource",
    "sim": "kvguard.sim.source:SimSource",
    "torch": "kvguard.sources.torch:TorchSource",
}
_REGISTERED: dict[str, Callable[..., Source]] = {}
_LOCK = threading.Lock()


def register(name: str, factory: Callable[..., Source], *, replace: bool = False) -> None:
    """Make ``get_source(name, **options)`` call ``factory(**options)``."""
    if not name or not isinstance(name, str):
        raise ValueError("a source needs a non-empty name")
    with _LOCK:
        if not replace and (name in _REGISTERED or name in _BUILTIN):
            raise ValueError(f"source {name!r} is already registered")
        _REGISTERED[name] = factory


def unregister(name: str) -> None:
    with _LOCK:
        _REGISTERED.pop(name, None)


def source_names() -> list[str]:
    with _LOCK:
        return sorted(set(_BUILTIN) | set(_REGISTERED))


def _factory(name: str) -> Callable[..., Source]:
    with _LOCK:
        factory = _REGISTERED.get(name)
        target = _BUILTIN.get(name)
    if factory is not None:
        return factory
    if target is None:
        raise SourceError(f"unknown source {name!r} (choose from {', '.join(source_names())})")
    module_name, attribute = target.split(":")
    return getattr(importlib.import_module(module_name), attribute)


def get_source(name: str, **options: Any) -> Source:
    """Build the source called ``name``. Raises SourceError (unknown name, bad option, absent backend)."""
    factory = _factory(name)
    try:
        return factory(**options)
    except SourceError:
        raise
    except TypeError as exc:
        raise SourceError(f"source {name!r}: {one_line(exc)}") from None


def engine_thread_only(source: Any) -> bool:
    """Whether ``source`` may be sampled only on the engine's own thread, between its steps.

    A source whose read synchronises the framework's runtime (it waits for the engine's queued
    work and takes its pending errors) says so with a true ``engine_thread_only`` attribute or
    property; every other source is read from any thread. Never raises.
    """
    try:
        return bool(getattr(source, "engine_thread_only", False))
    except Exception:  # noqa: BLE001 - a property that fails: assume the careful answer
        return True


def complete_records(source: Any, records: list[DeviceMemory]) -> list[DeviceMemory]:
    """``source.complete(records)`` where the source has one: the part of a sample that reads files beside the
    counters (MindSpore's pool dump), which the probe runs on its own thread even when the counters were read on
    the engine's. Raises what the source raises; the records unchanged where it has none."""
    complete = getattr(source, "complete", None)
    if not callable(complete):
        return records
    done = complete(records)
    if not isinstance(done, list) or not all(isinstance(r, DeviceMemory) for r in done):
        raise SourceError(
            f"{getattr(source, 'name', 'source')}.complete() returned {type(done).__name__}, not a list of DeviceMemory"
        )
    return done


def source_skips(source: Any) -> int:
    """The source's ``skipped_total`` (inputs beside the counters it skipped, counted: a hostile or cut file), 0
    where it has none or it cannot be read. Never raises."""
    try:
        value = getattr(source, "skipped_total", 0)
    except Exception:  # noqa: BLE001 - an optional extra
        return 0
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def close_source(source: Any) -> None:
    """Call ``source.close()`` if it has one; never raises."""
    close = getattr(source, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001 - closing is best effort by contract
            pass


def rank_contexts(source: Any) -> Mapping[str, RankContext]:
    """The source's per-device rank context (only the simulator has one); never raises."""
    contexts = getattr(source, "rank_contexts", None)
    if not callable(contexts):
        return {}
    try:
        result = contexts()
    except Exception:  # noqa: BLE001 - an optional extra, never worth failing a sample
        return {}
    return result if isinstance(result, Mapping) else {}


def count(value: Any) -> int | None:
    """A backend's byte or event count as a non-negative int; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    if value < 0 or value in (float("inf"), float("-inf")):
        return None
    return int(value)


def free_total_used(free: Any, total: Any, used: Any = None) -> dict[str, int | None]:
    """DeviceMemory's free/total/used fields from a backend's (free, total), and its own ``used``
    count where it reports one (that wins; otherwise used is total - free)."""
    free_bytes, total_bytes, used_bytes = count(free), count(total), count(used)
    if used_bytes is None and free_bytes is not None and total_bytes is not None and total_bytes >= free_bytes:
        used_bytes = total_bytes - free_bytes
    return {"free_bytes": free_bytes, "total_bytes": total_bytes, "used_bytes": used_bytes}
