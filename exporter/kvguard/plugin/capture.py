"""What the plugin reads while vLLM's profile run runs (``determine_available_memory``), by replacing, for that
call only, a global of the worker's module:

- ``memory_profiling`` (whatever object that name holds then, vllm-mindspore's replacement included): the
  allocator's reserved peak before and after the profile run, and what stays reserved after vLLM's
  ``empty_cache`` (:func:`profiling_captured`); on vllm-mindspore, MindSpore's own reserved peak of the run too;
- ``torch_npu`` / ``torch`` in a worker without ``memory_profiling``, which measures inline (vLLM 0.8.5-0.9.0,
  vllm-ascend <= 0.14): a recorder of its device reads (:func:`device_readings_captured`,
  :mod:`kvguard.plugin.inline_readings`).

Each global is put back after the call, unless something else replaced it meanwhile.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, ContextManager

from kvguard.plugin import inline_readings, state
from kvguard.plugin.objects import MemoryProfilingResult
from kvguard.plugin.profile import Capture

# A global's stand-in: from the module's namespace and the global's current value, the replacement (None: none).
Replacement = Callable[[MutableMapping[str, Any], Any], Any]


def _reserved_peak() -> int | None:
    return state.read_reserved()[1]


def _reserved_now() -> int | None:
    return state.read_reserved()[0]


def _wrap_memory_profiling(
    original: Callable[..., ContextManager[MemoryProfilingResult]], capture: Capture
) -> Callable[..., ContextManager[MemoryProfilingResult]]:
    @contextlib.contextmanager
    def memory_profiling(*args: object, **kwargs: object) -> Iterator[MemoryProfilingResult]:
        with original(*args, **kwargs) as result:
            # Entering reset the peak statistics: the reserved peak is now the reserved memory.
            capture.result = result
            capture.reserved_peak_before = state.guard("memory_profiling", _reserved_peak)
            if capture.mindspore:
                _mindspore_peak(capture, _mindspore_peak_start)
            # A profile run that raised is not read after: its error goes to vLLM as it is (and a MindSpore
            # read now would take the runtime's pending error in its place).
            yield result
            if capture.mindspore:
                _mindspore_peak(capture, _mindspore_peak_end)
            # Read before vLLM's exit runs empty_cache(): the peak the profile run reached.
            capture.reserved_peak_after = state.guard("memory_profiling", _reserved_peak)
        # After vLLM's exit (empty_cache, after_profile measured): what stays reserved.
        capture.reserved_after_exit = state.guard("memory_profiling", _reserved_now)

    setattr(memory_profiling, state.MARK, True)
    return memory_profiling


# ---------------------------------------------------------------------------- vllm-mindspore's reserved peak
#
# vllm-mindspore's ms_memory_profiling measures memory_reserved() at the profile run's END, before its
# empty_cache (result.after_profile.measure(), then torch_peak_increase = the torch_memory difference:
# vllm_mindspore/utils.py:465-475 @ 0.5.1). When the pool releases cached blocks during the run (an
# empty_cache, a failed expansion), that is less than the reserved memory the run reached. So on that engine
# the plugin also reads MindSpore's own peak statistic around the run (mindspore/runtime/memory.py @ 2.7.1):
# at the start, once the original's entry has run (its own reset, utils.py:452, and before_profile.measure(),
# :459), reset_peak_memory_stats() (:214) and memory_reserved() (:142); at the end, before the original's
# after_profile.measure() (:465), max_memory_reserved() (:170) and memory_reserved(). The peak increase is
# max(max, end) - start: 2.6+ report peaks since the reset; max() keeps it exact if a build reports less.


def _byte_count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"mindspore.runtime.{what}() returned {value!r}, not a byte count")
    return int(value)


def _mindspore_runtime() -> Any:
    import importlib

    return importlib.import_module("mindspore.runtime")


def _ms_read(function: Callable[[], object]) -> object:
    """One MindSpore memory call: each goes through ``_memory_stats`` or its siblings, which drain the runtime
    pipeline and rethrow the engine's pending error; that error is told from the call's own failure by a second
    call (kvguard.sources.mindspore.read_telling_engine_errors) and raised as EngineError, the other counted."""
    from kvguard.sources.mindspore import read_telling_engine_errors

    return read_telling_engine_errors(function)


def _mindspore_peak_start(capture: Capture) -> None:
    runtime = _mindspore_runtime()
    _ms_read(runtime.reset_peak_memory_stats)
    capture.ms_reserved_start = _byte_count(_ms_read(runtime.memory_reserved), "memory_reserved")


def _mindspore_peak_end(capture: Capture) -> None:
    if capture.ms_reserved_start is None:
        return  # the start was not read: nothing to measure from
    runtime = _mindspore_runtime()
    capture.ms_reserved_max = _byte_count(_ms_read(runtime.max_memory_reserved), "max_memory_reserved")
    capture.ms_reserved_end = _byte_count(_ms_read(runtime.memory_reserved), "memory_reserved")


def _mindspore_peak(capture: Capture, read: Callable[[Capture], None]) -> None:
    """One of the two reads; a failure is kept as the capture's error, counted and logged once (never raised),
    but for the engine's own pending error, which is raised again unchanged (:func:`kvguard.plugin.state.guard`)."""
    from kvguard.sources import EngineError

    try:
        read(capture)
    except EngineError as exc:
        original = exc.original
    except Exception as exc:  # noqa: BLE001 - kvguard must never take vLLM down
        from kvguard.text import one_line

        message = one_line(exc)[:400]
        capture.ms_error = capture.ms_error or message
        state.failed("reserved_peak", f"MindSpore's reserved peak of the profile run not read: {message}")
        return
    else:
        return
    raise original  # outside the handler: its cause and context stay as the engine made them


# ---------------------------------------------------------------------------- the worker module's globals


@contextlib.contextmanager
def _global_replaced(function: Callable[..., object], name: str, replacement_for: Replacement) -> Iterator[None]:
    """While the block runs, the global ``name`` of the module that defines ``function`` is
    ``replacement_for(namespace, current)`` (None: left alone), and put back after unless something
    else replaced it meanwhile. The module is the one below decorators such as
    @torch.inference_mode() (functools.wraps keeps the chain in __wrapped__)."""
    namespace: MutableMapping[str, Any] = getattr(inspect.unwrap(function), "__globals__", {})
    current = namespace.get(name)
    replacement = replacement_for(namespace, current)
    if replacement is not None:
        namespace[name] = replacement
    try:
        yield
    finally:
        if replacement is not None and namespace.get(name) is replacement:
            namespace[name] = current


@contextlib.contextmanager
def profiling_captured(function: Callable[..., object], mindspore: bool = False) -> Iterator[Capture]:
    """While ``function`` runs, its module's ``memory_profiling`` global is wrapped (``mindspore``: reading
    MindSpore's reserved peak of the profile run too)."""
    capture = Capture()
    capture.mindspore = mindspore

    def wrapped(namespace: MutableMapping[str, Any], current: Any) -> Any:
        if callable(current) and not getattr(current, state.MARK, False):
            return _wrap_memory_profiling(current, capture)
        return None

    with _global_replaced(function, "memory_profiling", wrapped):
        yield capture


@contextlib.contextmanager
def device_readings_captured(function: Callable[..., object]) -> Iterator[inline_readings.Readings]:
    """While ``function`` runs, the global of its module that reaches the device (``torch_npu``, else ``torch``)
    reads through a recorder, in a worker without ``memory_profiling`` only: vLLM 0.8.5-0.9.0 and vllm-ascend
    <= 0.14 measure inline (kvguard.plugin.inline_readings)."""
    readings = inline_readings.Readings()
    with contextlib.ExitStack() as stack:
        for name, _ in inline_readings.DEVICE_GLOBALS:
            # A recorder that cannot be made leaves the global as it is (counted, logged once).
            stack.enter_context(
                _global_replaced(
                    function, name, functools.partial(state.guard, "profile", inline_readings.recorder, readings, name)
                )
            )
        yield readings
