"""The device reads of a worker that budgets without ``memory_profiling``, recorded as it makes them.

Two workers measure inline in ``determine_available_memory``, with the same arithmetic (the era rows whose
formula adds the absolute non-torch memory, non_torch ``"positive"``):

- vLLM V1 0.8.5-0.9.0, ``vllm/v1/worker/gpu_worker.py`` 0.9.0:166-214 through its module's ``torch``:
  ``empty_cache``, ``reset_peak_memory_stats`` (:179-180), ``mem_get_info()`` (the total, :182),
  ``profile_run`` (:185), ``mem_get_info()`` (free, for an assert, :187), ``memory_stats()
  ["allocated_bytes.all.peak"]`` (:197), ``empty_cache``, ``memory_stats()["allocated_bytes.all.current"]``
  (:202-204), ``mem_get_info()[1] - mem_get_info()[0]`` (:205-206), and returns ``int(total * util - (peak +
  non-torch if > 0))`` (:207-214);
- vllm-ascend through 0.14 (worker.py 0.14.0rc1:252-294, worker_v1.py 0.11.0:219-259): the same through
  ``torch_npu.npu`` for the stats and the last two ``mem_get_info`` (its total and first free through
  ``torch.npu``), clamped at 0.

While the plugin runs such a method, the module's global (``torch_npu`` where the module has one, else
``torch``) is a stand-in whose device namespace (``.npu``, ``.cuda``) passes every call through unchanged and
keeps what ``memory_stats()`` and ``mem_get_info()`` returned; :func:`profile_from_readings` turns them into
the estimator's Profile, whose stock budget is the worker's own figure to the byte.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, TypeVar

from kvguard.budget.estimator import FORMULAS, Profile

# The worker module's global that reaches the device, and its device namespace; the first the module holds.
DEVICE_GLOBALS = (("torch_npu", "npu"), ("torch", "cuda"))

T = TypeVar("T")


class Readings:
    """What the worker read, in order: ``memory_stats()`` dicts and ``mem_get_info()`` (free, total) pairs;
    ``error``: why one of them could not be kept (the worker's own call returned all the same)."""

    def __init__(self) -> None:
        self.stats: list[dict[str, int]] = []
        self.mem_info: list[tuple[int, int]] = []
        self.error: str | None = None

    def keep(self, into: list[T], value: Callable[[], T]) -> None:
        try:
            into.append(value())
        except Exception as exc:  # noqa: BLE001 - a reading kvguard cannot keep never fails the worker's call
            from kvguard.text import one_line

            self.error = self.error or one_line(exc)


class _RecordingDevice:
    def __init__(self, device: Any, readings: Readings) -> None:
        self._device, self._readings = device, readings

    def memory_stats(self, *args: Any, **kwargs: Any) -> Any:
        stats = self._device.memory_stats(*args, **kwargs)
        self._readings.keep(self._readings.stats, lambda: dict(stats))
        return stats

    def mem_get_info(self, *args: Any, **kwargs: Any) -> Any:
        info = self._device.mem_get_info(*args, **kwargs)
        self._readings.keep(self._readings.mem_info, lambda: (int(info[0]), int(info[1])))
        return info

    def __getattr__(self, name: str) -> Any:
        return getattr(self._device, name)


class RecordingModule:
    """``torch`` or ``torch_npu`` as the worker sees it while recorded: its device namespace records, the rest
    is the module's own."""

    def __init__(self, module: Any, device_attr: str, readings: Readings) -> None:
        self._module = module
        setattr(self, device_attr, _RecordingDevice(getattr(module, device_attr), readings))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def recorder(readings: Readings, name: str, namespace: Mapping[str, Any], current: Any) -> RecordingModule | None:
    """The stand-in for global ``name`` of a worker module (``namespace``), or None to leave it: only in a module
    without ``memory_profiling`` (one that measures inline), and only for the first of :data:`DEVICE_GLOBALS` the
    module holds."""
    if "memory_profiling" in namespace or current is None or isinstance(current, RecordingModule):
        return None
    chosen = next(
        ((global_name, attr) for global_name, attr in DEVICE_GLOBALS if hasattr(namespace.get(global_name), attr)), None
    )
    if chosen is None or chosen[0] != name:
        return None
    return RecordingModule(current, chosen[1], readings)


def profile_from_readings(
    readings: Readings, *, formula: str, utilization: float, release: str | None
) -> Profile | None:
    """The profile of what the worker computed, for an era whose formula adds the absolute non-torch memory
    (``absolute_peak``, ``absolute_peak_signed``); None for another era or readings not made so; ValueError
    when one of the worker's reads could not be kept.

    The worker's allocated peak since ``reset_peak_memory_stats`` holds the weights: it is split into what
    stays allocated after ``empty_cache`` (``weights_bytes``: the weights, as the guard counts them) and the
    increase above it, whose sum is the worker's peak to the byte; the reserved peak is split alike. The
    total is the one the worker multiplies by the utilization (its first ``mem_get_info`` read here); the
    non-torch figure the absolute one it adds (the last two reads' total - free, less torch's allocated)."""
    if FORMULAS[formula].non_torch != "positive":
        return None
    if readings.error is not None:
        raise ValueError(f"the worker's device reads were not all kept: {readings.error}")
    if len(readings.stats) < 2 or len(readings.mem_info) < 2:
        return None
    peak = int(readings.stats[0]["allocated_bytes.all.peak"])
    reserved_peak = readings.stats[0].get("reserved_bytes.all.peak")
    allocated = int(readings.stats[-1]["allocated_bytes.all.current"])
    total = readings.mem_info[0][1]
    used = readings.mem_info[-2][1] - readings.mem_info[-1][0]
    if not 0 <= allocated <= peak:
        return None
    return Profile(
        total_memory_bytes=int(total),
        gpu_memory_utilization=utilization,
        weights_bytes=allocated,
        peak_allocated_increase_bytes=peak - allocated,
        peak_reserved_increase_bytes=(max(0, int(reserved_peak) - allocated) if reserved_peak is not None else None),
        non_torch_increase_bytes=int(used - allocated),
        formula=formula,
        vllm_version=release,
    )
