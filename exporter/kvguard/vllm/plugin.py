"""vLLM integration: the probe in every worker, the startup profile, and an opt-in reserved-aware KV budget.

vLLM calls ``register()`` (entry point ``vllm.general_plugins: kvguard``) in every process
it starts: the API server, the engine core and each worker, before the worker class is
resolved. ``register()`` is idempotent, cheap, and does nothing unless asked through the
environment:

``KVGUARD_SPOOL_DIR``   start the probe in each worker, writing snapshots here.
``KVGUARD_INTERVAL``    seconds between samples (default 5).
``KVGUARD_SOURCE``      the probe's source (default ``auto``: the worker's own allocator).
``KVGUARD_MINDSPORE_DUMP``  ``1`` (every 100 graph runs) or N: exact mode on MindSpore, the pool's own dump of its
                        buffers merged into ``MS_ALLOC_CONF`` (:func:`_turn_on_mindspore_dump`), read by the probe.
``KVGUARD_BUDGET``      ``stock`` (default, vLLM's own budget) or ``reserved``: size the KV
                        cache with :func:`kvguard.budget.estimator.reserved_kv_cache_bytes`, the
                        formula of ``kvguard budget`` (never more than vLLM's own figure);
                        ``guard``: the largest budget the budget-time verdict predicts fits
                        (``kvguard.guard.judge.judge_at_budget``), never more than vLLM's figure.

It wraps three methods of the worker class (``vllm.v1.worker.gpu_worker.Worker``;
``vllm_ascend.worker.worker.NPUWorker`` and ``worker_v1.NPUWorker``), patched when their
module is imported, or at once if it already is:

- ``init_device``: starts the probe once the worker's device is set (rank = worker rank), and
  names the engine in its snapshots as vLLM's own series label it: ``model_name`` is
  ``model_config.served_model_name`` (one name: ``get_served_model_name`` keeps the first of a list,
  config/model.py 0.34.0), ``engine`` the data-parallel index (``parallel_config.data_parallel_index``,
  else ``data_parallel_rank``: the engine indices the API server's stat loggers label, loggers.py);
- ``determine_available_memory``: while it runs, the ``memory_profiling`` context manager
  it calls (whatever object that name holds in the worker's module then, vllm-mindspore's
  replacement included) is wrapped to read the allocator's reserved peak before and after
  the profile run; afterwards the result's named fields (``weights_memory``,
  ``torch_peak_increase``, ``non_torch_increase``, ``before_create.total_memory``) and
  ``cache_config.gpu_memory_utilization`` make the estimator's :class:`Profile`; vLLM 0.8.5-0.9.0's Worker
  and vllm-ascend <= 0.14's NPUWorker run no ``memory_profiling``, so their own ``torch.cuda`` /
  ``torch_npu.npu`` reads make it instead (:func:`profile_from_device_readings`,
  :mod:`kvguard.vllm.inline_readings`); on vllm-mindspore, which measures ``memory_reserved()`` at the
  profile run's end only, the run's reserved peak is read from MindSpore's own statistics too and recorded
  beside it (:func:`reserved_peak_from`; the guard counts it where it is higher);
- ``initialize_from_config``: records the KV cache vLLM allocated (``KVCacheConfig``).

Once the budget is fixed (``determine_available_memory`` returned, the KV cache not allocated yet)
the plugin also judges it: the era's KV tensors for that budget (the worker's ``get_kv_cache_spec``)
placed into a model of this rank's allocator built from its counters now
(``kvguard.guard.at_budget.allocator_from_counters``), and the serving peak beside them. The verdict goes
into the rank's snapshot at once (``budget_verdict``; ``/guard``'s ``at_budget``).

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
    ("vllm_ascend._310p.worker_310p", "NPUWorker310"),  # 310P: its own determine_available_memory (0.18+)
)
BUDGETS = ("stock", "reserved", "guard")
DEFAULT_INTERVAL = 5.0
_MARK = "_kvguard_wrapped"

hook_errors: dict[str, int] = {}  # hook name -> failures, for tests and debugging
_logged: set[str] = set()
_registered = False
_lock = threading.Lock()
_reader: Any = None  # the source that reads the reserved peak during profiling
_profile: Any = None  # this worker's startup profile, completed after 0.34's warm-up
_profile_peak: Any = None  # vllm-mindspore: the profile run's reserved peak (records.ReservedPeak)


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
            _failed(
                "settings", f"KVGUARD_INTERVAL={interval_text!r} is not a positive number; using {DEFAULT_INTERVAL:g}"
            )
            interval = DEFAULT_INTERVAL
        budget = environ.get("KVGUARD_BUDGET", "stock").strip().lower() or "stock"
        if budget not in BUDGETS:
            _failed("settings", f"KVGUARD_BUDGET={budget!r} is not one of {', '.join(BUDGETS)}; using stock")
            budget = "stock"
        return cls(
            spool_dir=environ.get("KVGUARD_SPOOL_DIR", "").strip() or None,
            interval=interval,
            source=environ.get("KVGUARD_SOURCE", "").strip() or "auto",
            budget=budget,
        )

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
        log.warning(
            "kvguard: %s: %s (vLLM continues; further %s failures are logged at debug level)", hook, message, hook
        )
    else:
        log.debug("kvguard: %s: %s", hook, message)


def _guard(hook: str, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``; its failure counted and logged, never raised, but for the engine's own pending
    error that a MindSpore read took from the runtime (kvguard.sources.EngineError): that one is raised again,
    unchanged, on this (the engine's) thread, where the engine's next sync would have raised it."""
    try:
        return function(*args)
    except Exception as exc:  # noqa: BLE001 - kvguard must never take vLLM down
        from kvguard.sources import EngineError

        if isinstance(exc, EngineError):
            original = exc.original
        elif probe_module().is_engine_error(exc):
            original = exc
        else:
            from kvguard.text import one_line

            _failed(hook, one_line(exc))
            return None
    raise original  # outside the handler: its cause and context stay as the engine made them


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
        _guard("logging", _join_vllm_logging)
        _guard("mindspore_dump", _turn_on_mindspore_dump)
        for module_name, class_name in WORKER_CLASSES:
            module = sys.modules.get(module_name)
            if module is not None:
                _guard("patch", _patch_worker_class, module, class_name)
            else:
                _PatchOnImport.watch(module_name, functools.partial(_patch_worker_class, class_name=class_name))
    except Exception as exc:  # noqa: BLE001
        from kvguard.text import one_line

        _failed("register", one_line(exc))


def _turn_on_mindspore_dump() -> None:
    """``KVGUARD_MINDSPORE_DUMP``: exact mode on MindSpore. The pool's periodic dump of its own lists
    (``MemoryDebugInfo<k>.txt``, written by ``DefragMemory`` every N graph runs when ``MS_ALLOC_CONF``'s
    ``defrag_memory_step_freq`` holds ``dump``: abstract_dynamic_mem_pool.cc:423-427, 930-937 @ r2.7.rc1) is merged
    into the user's ``MS_ALLOC_CONF`` here, in every process vLLM starts and before its worker creates the pool,
    which reads the setting once (ascend_memory_pool.cc:519-525). The probe then reads the newest file
    (kvguard.sources.mindspore_dump). Idempotent: a value that already holds ``dump`` is left as it is."""
    from kvguard.sources.mindspore_dump import ALLOC_CONF_ENV, DUMP_ENV, dump_alloc_conf

    if _settings.spool_dir is None:
        if os.environ.get(DUMP_ENV, "").strip():
            _failed(
                "mindspore_dump",
                f"{DUMP_ENV} is set but KVGUARD_SPOOL_DIR is not: no probe would read or "
                f"delete the dumps; MindSpore's dump not turned on",
            )
        return
    value = dump_alloc_conf(os.environ)
    if value is not None and value != os.environ.get(ALLOC_CONF_ENV):
        os.environ[ALLOC_CONF_ENV] = value
        log.info("kvguard: MindSpore's pool dump turned on for exact mode: %s=%s", ALLOC_CONF_ENV, value)


def _join_vllm_logging() -> None:
    """vLLM configures only its own "vllm" logger (vllm/logger.py DEFAULT_LOGGING_CONFIG, propagate False,
    0.11.0:29-53, 0.34.0), so kvguard's lines reached no handler in a vLLM process. Hand them to vLLM's
    handlers, formatted as vLLM formats its own lines, at INFO and above."""
    handlers = [h for h in logging.getLogger("vllm").handlers if h not in log.handlers]
    for handler in handlers:
        log.addHandler(handler)
    if handlers and (log.level == logging.NOTSET or log.level > logging.INFO):
        log.setLevel(logging.INFO)


def _reset_for_tests() -> None:
    global _registered, _settings, _reader
    with _lock:
        _registered = False
        hook_errors.clear()
        _logged.clear()
    _settings = Settings()
    _reader = None
    global _profile, _profile_peak
    _profile = None
    _profile_peak = None
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
    for name, wrapper in (
        ("init_device", _wrap_init_device),
        ("determine_available_memory", _wrap_determine_available_memory),
        ("initialize_from_config", _wrap_initialize_from_config),
        ("compile_or_warm_up_model", _wrap_compile_or_warm_up_model),
        ("extend_kv_cache", _wrap_extend_kv_cache),
        ("execute_model", _wrap_execute_model),
    ):
        original = worker.__dict__.get(name)
        if original is None or getattr(original, _MARK, False):
            continue
        wrapped = functools.wraps(original)(wrapper(original))
        if name in READING_AFTER:
            wrapped = functools.wraps(original)(_then_engine_reading(wrapped))
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
    # The worker's device, read by the probe's own thread: torch's current device is per thread, so a thread of
    # the probe's would read (and, through mem_get_info, open a context on) device 0 in every rank.
    index = getattr(getattr(worker, "device", None), "index", None)
    options = (
        {"device": index}
        if _settings.source in ("auto", "torch")
        and isinstance(index, int)
        and not isinstance(index, bool)
        and index >= 0
        else {}
    )
    probe.start_strict(
        _settings.spool_dir,
        _settings.interval,
        _settings.source,
        rank=rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else None,
        source_options=options,
    )
    model_name, engine = engine_identity(worker)
    probe.set_engine(model_name, engine)


def engine_identity(worker: Any) -> tuple[str | None, int | None]:
    """(served model name, engine index) of the engine this worker serves; None for what it lacks."""
    config = getattr(worker, "vllm_config", None)
    name = getattr(getattr(config, "model_config", None), "served_model_name", None)
    if isinstance(name, (list, tuple)):  # before ModelConfig resolves it, a list may stand here
        name = name[0] if name else None
    parallel = getattr(config, "parallel_config", None)
    engine = None
    for field in ("data_parallel_index", "data_parallel_rank"):
        value = getattr(parallel, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            engine = value
            break
    return (name if isinstance(name, str) and name else None), engine


def _wrap_init_device(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_device(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _guard("init_device", _ensure_probe, self)
        _guard("init_device", _first_engine_sample, self)
        _guard("init_device", _say_no_budget_hook, self)
        return result

    return init_device


# Startup steps after which a probe that reads on the engine's thread takes a reading there: the pool changes
# in them without a step (the KV cache allocated; warm-up and graph compilation), and the probe rewrites no
# reading before the engine serves (kvguard.probe).
READING_AFTER = ("initialize_from_config", "compile_or_warm_up_model")


def _then_engine_reading(function: Callable[..., Any]) -> Callable[..., Any]:
    def with_reading(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = function(self, *args, **kwargs)
        _guard("engine_reading", _engine_reading)
        return result

    return with_reading


def _engine_reading() -> None:
    running = probe_module().current() if _settings.spool_dir is not None else None
    if running is not None and running.status.sampling == "engine-step":
        running.run_once()


def _first_engine_sample(worker: Any) -> None:
    """On MindSpore the probe reads the pool on this (the engine's) thread only (kvguard.probe): take the
    first reading now, with the device set and no op queued yet, so that the rank has a snapshot before its
    first step."""
    running = probe_module().current() if _settings.spool_dir is not None else None
    if running is not None and _runs_mindspore(worker):
        running.run_once()


def probe_module() -> Any:
    from kvguard import probe

    return probe


def _wrap_execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """The step boundary (``Worker.execute_model``, vllm/v1/worker/gpu_worker.py; the engine core calls it once
    per scheduled step on the worker's own thread): where the probe reads a source that must not be read
    from another thread (MindSpore's, kvguard.probe). ``step_begin`` raises only the engine's own pending error,
    which the read took from the runtime: it passes to vLLM unchanged. Anything else of kvguard's is counted."""
    probe = probe_module()

    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            probe.step_begin()
            return original(self, *args, **kwargs)
        finally:
            probe.step_end()

    return execute_model


def _say_no_budget_hook(worker: Any) -> None:
    """A V0 worker (vllm-ascend 0.7.3) decides a block count in determine_num_available_blocks and has no
    determine_available_memory: no profile is recorded there, and the budget modes cannot act. Said once."""
    if "no_budget_hook" in _logged or hasattr(type(worker), "determine_available_memory"):
        return
    _logged.add("no_budget_hook")
    era = _era_of(running_release(worker))
    log.info(
        "kvguard: no startup profile on %s: its V0 worker decides the block count in "
        "determine_num_available_blocks, which kvguard does not wrap%s",
        era.name if era else "this engine",
        "" if _settings.budget == "stock" else f"; KVGUARD_BUDGET={_settings.budget} cannot act",
    )


# ---------------------------------------------------------------------------- the profile


class _Capture:
    """What one ``memory_profiling`` block left behind."""

    def __init__(self) -> None:
        self.result: Any = None
        self.reserved_peak_before: int | None = None
        self.reserved_peak_after: int | None = None  # the profile run's reserved peak
        self.reserved_after_exit: int | None = None  # reserved after vLLM's empty_cache()
        # vllm-mindspore: MindSpore's own reserved figures around the run (_mindspore_peak_start/_end).
        self.mindspore = False
        self.ms_reserved_start: int | None = None  # memory_reserved() after reset_peak_memory_stats()
        self.ms_reserved_max: int | None = None  # max_memory_reserved() at the run's end
        self.ms_reserved_end: int | None = None  # memory_reserved() at the run's end
        self.ms_error: str | None = None  # why they were not read


def _read_reserved() -> tuple[int | None, int | None]:
    """(reserved now, reserved peak) on this worker's device, read by the probe's source
    (``auto``: torch.cuda, torch.npu or MindSpore, whichever the worker uses)."""
    global _reader
    if _reader is None:
        from kvguard.sources import get_source

        _reader = get_source(_settings.source)
    records = _reader.sample()
    if not records:
        return None, None
    return records[0].reserved_bytes, records[0].peak_reserved_bytes


def _reserved_peak() -> int | None:
    return _read_reserved()[1]


def _reserved_now() -> int | None:
    return _read_reserved()[0]


def _wrap_memory_profiling(original: Callable[..., Any], capture: _Capture) -> Callable[..., Any]:
    @contextlib.contextmanager
    def memory_profiling(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with original(*args, **kwargs) as result:
            # Entering reset the peak statistics: the reserved peak is now the reserved memory.
            capture.result = result
            capture.reserved_peak_before = _guard("memory_profiling", _reserved_peak)
            if capture.mindspore:
                _mindspore_peak(capture, _mindspore_peak_start)
            # A profile run that raised is not read after: its error goes to vLLM as it is (and a MindSpore
            # read now would take the runtime's pending error in its place).
            yield result
            if capture.mindspore:
                _mindspore_peak(capture, _mindspore_peak_end)
            # Read before vLLM's exit runs empty_cache(): the peak the profile run reached.
            capture.reserved_peak_after = _guard("memory_profiling", _reserved_peak)
        # After vLLM's exit (empty_cache, after_profile measured): what stays reserved.
        capture.reserved_after_exit = _guard("memory_profiling", _reserved_now)

    setattr(memory_profiling, _MARK, True)
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


def _runs_mindspore(worker: Any) -> bool:
    """The running engine is vllm-mindspore on MindSpore's pool (its era row's allocator)."""
    release = running_release(worker)
    return bool(release and release.startswith("vllm-mindspore:")) and _allocator_kind(worker) == "mindspore"


def _byte_count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"mindspore.runtime.{what}() returned {value!r}, not a byte count")
    return int(value)


def _mindspore_runtime() -> Any:
    import importlib

    return importlib.import_module("mindspore.runtime")


def _ms_read(function: Callable[[], Any]) -> Any:
    """One MindSpore memory call: each goes through ``_memory_stats`` or its siblings, which drain the runtime
    pipeline and rethrow the engine's pending error; that error is told from the call's own failure by a second
    call (kvguard.sources.mindspore.read_telling_engine_errors) and raised as EngineError, the other counted."""
    from kvguard.sources.mindspore import read_telling_engine_errors

    return read_telling_engine_errors(function)


def _mindspore_peak_start(capture: _Capture) -> None:
    runtime = _mindspore_runtime()
    _ms_read(runtime.reset_peak_memory_stats)
    capture.ms_reserved_start = _byte_count(_ms_read(runtime.memory_reserved), "memory_reserved")


def _mindspore_peak_end(capture: _Capture) -> None:
    if capture.ms_reserved_start is None:
        return  # the start was not read: nothing to measure from
    runtime = _mindspore_runtime()
    capture.ms_reserved_max = _byte_count(_ms_read(runtime.max_memory_reserved), "max_memory_reserved")
    capture.ms_reserved_end = _byte_count(_ms_read(runtime.memory_reserved), "memory_reserved")


def _mindspore_peak(capture: _Capture, read: Callable[[_Capture], None]) -> None:
    """One of the two reads; a failure is kept as the capture's error, counted and logged once (never raised),
    but for the engine's own pending error, which is raised again unchanged (:func:`_guard`)."""
    from kvguard.sources import EngineError

    try:
        read(capture)
    except EngineError as exc:
        original = exc.original
    except Exception as exc:  # noqa: BLE001 - kvguard must never take vLLM down
        from kvguard.text import one_line

        message = one_line(exc)[:400]
        capture.ms_error = capture.ms_error or message
        _failed("reserved_peak", f"MindSpore's reserved peak of the profile run not read: {message}")
        return
    else:
        return
    raise original  # outside the handler: its cause and context stay as the engine made them


def reserved_peak_from(profile: Any, capture: _Capture) -> Any:
    """The profile run's reserved peak (kvguard.records.ReservedPeak) beside what vllm-mindspore measured
    (the profile's reserved increase); None where the engine is not vllm-mindspore."""
    from kvguard.records import ReservedPeak

    if not capture.mindspore or capture.result is None or profile.budget_formula.peak != "reserved":
        return None
    measured = profile.peak_reserved_increase_bytes
    start, peak, end = capture.ms_reserved_start, capture.ms_reserved_max, capture.ms_reserved_end
    if start is None or peak is None or end is None:
        return ReservedPeak(measured, None, error=capture.ms_error or "MindSpore's reserved memory not read")
    return ReservedPeak(measured, max(0, max(peak, end) - start))


def _record_reserved_peak(profile: Any, capture: _Capture) -> None:
    global _profile_peak
    reserved_peak = reserved_peak_from(profile, capture)
    _profile_peak = reserved_peak
    if reserved_peak is None:
        return
    from kvguard import probe

    probe.set_reserved_peak(reserved_peak)
    if reserved_peak.above_measured:
        from kvguard.guard.judge import reserved_peak_note

        log.info("kvguard: %s", reserved_peak_note(profile, reserved_peak))


@contextlib.contextmanager
def _global_replaced(
    function: Callable[..., Any], name: str, replacement_for: Callable[[dict, Any], Any]
) -> Iterator[None]:
    """While the block runs, the global ``name`` of the module that defines ``function`` is
    ``replacement_for(namespace, current)`` (None: left alone), and put back after unless something
    else replaced it meanwhile. The module is the one below decorators such as
    @torch.inference_mode() (functools.wraps keeps the chain in __wrapped__)."""
    namespace = getattr(inspect.unwrap(function), "__globals__", {})
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
def _profiling_captured(function: Callable[..., Any], mindspore: bool = False) -> Iterator[_Capture]:
    """While ``function`` runs, its module's ``memory_profiling`` global is wrapped (``mindspore``: reading
    MindSpore's reserved peak of the profile run too)."""
    capture = _Capture()
    capture.mindspore = mindspore

    def wrapped(namespace: dict, current: Any) -> Any:
        if callable(current) and not getattr(current, _MARK, False):
            return _wrap_memory_profiling(current, capture)
        return None

    with _global_replaced(function, "memory_profiling", wrapped):
        yield capture


def running_release(worker: Any = None) -> str | None:
    """``project:version`` of the release this worker runs: vllm-mindspore or vllm-ascend when their
    platform is loaded (310P when its worker class is), else vLLM's own version."""
    for module_name, project in (("vllm_mindspore", "vllm-mindspore"), ("vllm_ascend", "vllm-ascend")):
        module = sys.modules.get(module_name)
        if module is None:
            continue
        version = _distribution_version(project) or getattr(module, "__version__", None)
        if project == "vllm-ascend" and worker is not None and type(worker).__name__ == "NPUWorker310":
            project = "vllm-ascend-310p"
        if version:
            return f"{project}:{version}"
    version = getattr(sys.modules.get("vllm"), "__version__", None) or _distribution_version("vllm")
    return f"vllm:{version}" if version else None


def _distribution_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - no metadata: the module's own attribute, or unknown
        return None


def _utilization(cache_config: Any) -> float:
    """The utilization vLLM used: 0.34's ``resolved_gpu_memory_utilization`` (never ``None``)."""
    resolved = getattr(cache_config, "resolved_gpu_memory_utilization", None)
    value = resolved if resolved is not None else cache_config.gpu_memory_utilization
    return float(value)


def _cudagraph_applied(worker: Any, formula: Any) -> int | None:
    """The CUDA-graph estimate vLLM subtracted: 0.18+ sets ``worker.cudagraph_memory_estimate`` and
    subtracts it only when VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS is on (w 0.20.0:413-425)."""
    if not formula.cudagraph:
        return None
    estimate = getattr(worker, "cudagraph_memory_estimate", 0) or 0
    if not estimate:
        return 0
    envs = sys.modules.get("vllm.envs")
    applied = bool(getattr(envs, "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", True)) if envs else True
    return int(estimate) if applied else 0


def _era_of(release: str | None):
    from kvguard.vllm.eras import EraError, era_for

    if release is None:
        return None
    try:
        return era_for(release)
    except EraError:
        return None


def profile_from(worker: Any, capture: _Capture) -> Any:
    """The estimator's Profile, in the running release's terms, from the MemoryProfilingResult and
    the worker (its cache config, its CUDA-graph estimate)."""
    from kvguard.budget.estimator import FORMULAS, Profile

    result = capture.result
    release = running_release(worker)
    era = _era_of(release)
    formula_name = era.formula if era else "peak"
    formula = FORMULAS[formula_name]
    kv_cache_memory = getattr(worker.cache_config, "kv_cache_memory_bytes", None)
    if result is None:
        if not kv_cache_memory:
            return None
        # --kv-cache-memory-bytes: vLLM runs the profile but measures nothing (w 0.11.0:235-252).
        weights = getattr(getattr(worker, "model_runner", None), "model_memory_usage", 0)
        return Profile(
            total_memory_bytes=int(worker.init_snapshot.total_memory),
            gpu_memory_utilization=_utilization(worker.cache_config),
            weights_bytes=max(0, int(weights)),
            peak_allocated_increase_bytes=None,
            peak_reserved_increase_bytes=None,
            non_torch_increase_bytes=None,
            formula=formula_name if formula_name != "consumed" else "peak",
            vllm_version=release,
            kv_cache_memory_bytes=int(kv_cache_memory),
        )
    total = getattr(getattr(result, "before_create", None), "total_memory", 0) or getattr(
        getattr(worker, "init_snapshot", None), "total_memory", 0
    )
    reserved_increase = None
    if capture.reserved_peak_before is not None and capture.reserved_peak_after is not None:
        reserved_increase = max(0, capture.reserved_peak_after - capture.reserved_peak_before)
    peak = max(0, int(result.torch_peak_increase))
    allocated_peak = peak
    if formula.peak == "reserved":
        # vllm-mindspore's torch_peak_increase is the memory_reserved() increase (vllm_mindspore/utils.py:475).
        reserved_increase, allocated_peak = peak, None
    extra: dict[str, Any] = {}
    if formula.non_kv == "consumed":
        extra["total_consumed_bytes"] = int(result.total_consumed)
        extra["transient_peak_headroom_bytes"] = max(0, int(result.transient_peak_headroom))
        if capture.reserved_peak_after is not None and capture.reserved_after_exit is not None:
            extra["reserved_transient_peak_bytes"] = max(0, capture.reserved_peak_after - capture.reserved_after_exit)
    cudagraph = _cudagraph_applied(worker, formula)
    if cudagraph is not None:
        extra["cudagraph_memory_bytes"] = cudagraph
    if kv_cache_memory:
        extra["kv_cache_memory_bytes"] = int(kv_cache_memory)
    return Profile(
        total_memory_bytes=int(total),
        gpu_memory_utilization=_utilization(worker.cache_config),
        weights_bytes=max(0, int(result.weights_memory)),
        peak_allocated_increase_bytes=allocated_peak,
        peak_reserved_increase_bytes=reserved_increase,
        non_torch_increase_bytes=int(result.non_torch_increase),
        formula=formula_name,
        vllm_version=release,
        **extra,
    )


def _extensible(worker: Any) -> bool:
    return bool(getattr(getattr(worker, "cache_config", None), "enable_extensible_kv_cache", False))


def _reserved_budget(worker: Any, profile: Any, available: int) -> int | None:
    """The reserved-aware budget when it is smaller than vLLM's; None to keep vLLM's."""
    from kvguard.budget.estimator import reserved_kv_cache_bytes, stock_kv_cache_bytes

    if _extensible(worker):
        if "extensible_budget" not in _logged:
            _logged.add("extensible_budget")
            log.info(
                "kvguard: KVGUARD_BUDGET=reserved changes nothing here: vLLM's extensible KV cache is sized "
                "after warm-up and already keeps torch's reserved growth free"
            )
        return None
    if profile.kv_cache_memory_bytes is not None:
        return None  # --kv-cache-memory-bytes: the operator fixed the size
    from kvguard.guard.judge import with_reserved_peak

    # vllm-mindspore: MindSpore's reserved peak of the profile run where it is above the engine's figure.
    reserved = reserved_kv_cache_bytes(with_reserved_peak(profile, _profile_peak))
    if reserved is None:
        _failed("budget", "the reserved increase was not measured; keeping vLLM's KV cache budget")
        return None
    # vLLM's figure less the overcommit: what vLLM applies after the formula (its multimodal IPC
    # reserve) stays applied.
    overcommit = stock_kv_cache_bytes(profile) - reserved
    if overcommit <= 0 and profile.budget_formula.peak == "reserved" and "reserved_formula" not in _logged:
        _logged.add("reserved_formula")
        log.info(
            "kvguard: KVGUARD_BUDGET=reserved changes nothing here: this engine's own budget already takes "
            "the profile run's reserved increase (vllm-mindspore: vllm_mindspore/utils.py:475 @ 0.5.1), and "
            "its reserved peak is no higher"
        )
    return available - overcommit if overcommit > 0 else None


def _with_cleared(profile: Any, available: Any) -> Any:
    """vllm-ascend 0.15+ also subtracts the non-torch memory its profile's empty_cache cleared, a local of
    its determine_available_memory (worker.py 0.17.0rc1:339-366); it is what the returned figure leaves
    unexplained (310P: twice that, less the halving's rounding)."""
    from kvguard.budget.estimator import non_kv_cache_bytes, requested_memory_bytes

    formula = profile.budget_formula
    if not formula.cleared or not isinstance(available, int) or profile.non_torch_cleared_bytes is not None:
        return None
    scale = 2 if formula.halved else 1
    cleared = int(requested_memory_bytes(profile) - non_kv_cache_bytes(profile) - scale * available)
    import dataclasses

    return dataclasses.replace(profile, non_torch_cleared_bytes=cleared)


def _check_formula(profile: Any, available: Any) -> None:
    """Say once when kvguard's formula for this release does not reproduce vLLM's own figure."""
    from kvguard.budget.estimator import stock_kv_cache_bytes

    if not isinstance(available, int) or "formula_mismatch" in _logged:
        return
    expected = stock_kv_cache_bytes(profile)
    if expected != available:
        _logged.add("formula_mismatch")
        hook_errors["formula_mismatch"] = hook_errors.get("formula_mismatch", 0) + 1
        log.warning(
            "kvguard: vLLM (%s) budgeted %d bytes for the KV cache, kvguard's %s formula %d; "
            "kvguard's budgets for this worker may be off",
            profile.vllm_version,
            available,
            profile.formula,
            expected,
        )


@contextlib.contextmanager
def _device_readings_captured(function: Callable[..., Any]) -> Iterator[Any]:
    """While ``function`` runs, the global of its module that reaches the device (``torch_npu``, else ``torch``)
    reads through a recorder, in a worker without ``memory_profiling`` only: vLLM 0.8.5-0.9.0 and vllm-ascend
    <= 0.14 measure inline (kvguard.vllm.inline_readings)."""
    from kvguard.vllm import inline_readings

    readings = inline_readings.Readings()
    with contextlib.ExitStack() as stack:
        for name, _ in inline_readings.DEVICE_GLOBALS:
            # A recorder that cannot be made leaves the global as it is (counted, logged once).
            stack.enter_context(
                _global_replaced(
                    function, name, functools.partial(_guard, "profile", inline_readings.recorder, readings, name)
                )
            )
        yield readings


def profile_from_device_readings(worker: Any, readings: Any) -> Any:
    """The profile of what a worker that measures inline computed (its era's formula adds the absolute
    non-torch memory: kvguard.vllm.inline_readings.profile_from_readings); None for another era."""
    from kvguard.vllm.inline_readings import profile_from_readings

    release = running_release(worker)
    era = _era_of(release)
    if era is None:
        return None
    return profile_from_readings(
        readings, formula=era.formula, utilization=_utilization(worker.cache_config), release=release
    )


def _wrap_determine_available_memory(original: Callable[..., Any]) -> Callable[..., Any]:
    def determine_available_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        _guard("determine_available_memory", _ensure_probe, self)
        mindspore = _guard("reserved_peak", _runs_mindspore, self) is True
        with _profiling_captured(original, mindspore) as capture, _device_readings_captured(original) as readings:
            available = original(self, *args, **kwargs)
        profile = _guard("profile", profile_from, self, capture)
        if profile is None and capture.result is None:
            profile = _guard("profile", profile_from_device_readings, self, readings)
        if profile is None:
            if capture.result is None and "no_profile" not in _logged:
                _logged.add("no_profile")
                # Neither memory_profiling nor the inline reads of kvguard.vllm.inline_readings: nothing to read.
                log.info(
                    "kvguard: no startup profile recorded: this worker's determine_available_memory runs no "
                    "memory_profiling, so its figures stay local to it; kvguard check reports no_profile"
                    + (
                        ""
                        if _settings.budget == "stock"
                        else f" and KVGUARD_BUDGET={_settings.budget} keeps vLLM's budget"
                    )
                )
            return available
        profile = _guard("profile", _with_cleared, profile, available) or profile
        _guard("profile", _check_formula, profile, available)
        from kvguard import probe

        global _profile
        _profile = profile
        probe.set_profile(profile)
        _guard("reserved_peak", _record_reserved_peak, profile, capture)
        if not isinstance(available, int):
            return available
        budget = None
        if _settings.budget == "reserved":
            budget = _guard("budget", _reserved_budget, self, profile, available)
        elif _settings.budget == "guard":
            budget = _guard("budget", _guard_budget, self, profile, available)
        if budget is not None and budget < available:
            from kvguard.units import format_gib

            if _settings.budget == "reserved":
                log.info(
                    "kvguard: KV cache budget %s (reserved-aware, KVGUARD_BUDGET=reserved) instead of vLLM's %s",
                    format_gib(budget),
                    format_gib(available),
                )
            if hasattr(self, "available_kv_cache_memory_bytes"):
                self.available_kv_cache_memory_bytes = budget
        else:
            budget = available
        _guard("budget_verdict", _record_budget_verdict, self, profile, budget)
        return budget

    return determine_available_memory


# ---------------------------------------------------------------------------- the budget-time verdict


def _allocator_kind(worker: Any) -> str:
    """The running release's allocator (its era row's)."""
    from kvguard.vllm.eras import allocator_for

    return allocator_for(running_release(worker))


def _alloc_conf_flag(names: tuple[str, ...], key: str, default: bool) -> bool:
    """``key:True`` in the first of the ``names`` environment variables that is set (the allocators'
    comma-separated ``key:value`` config strings)."""
    for name in names:
        text = os.environ.get(name)
        if text is None:
            continue
        for item in text.split(","):
            k, _, v = item.partition(":")
            if k.strip().lower() == key:
                return v.strip().lower() in ("true", "1")
        return default
    return default


def _budget_model(worker: Any) -> tuple[Any, Any] | None:
    """(this rank's counters now, a builder of a new allocator model holding them); None when the
    source tells too little (no total or free memory)."""
    global _reader
    if _reader is None:
        from kvguard.sources import get_source

        _reader = get_source(_settings.source)
    records = _reader.sample()
    if not records or records[0].total_bytes is None or records[0].free_bytes is None:
        return None
    memory = records[0]
    kind = _allocator_kind(worker)
    vmm = False
    if kind == "mindspore":
        from kvguard.allocators.mindspore_releases import vmm_on

        era = _era_of(running_release(worker))
        vmm = vmm_on(os.environ.get("MS_ALLOC_CONF"), launcher_vmm=era.vmm_default if era else None)
    expandable = _alloc_conf_flag(
        ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
        if kind == "torch_npu"
        else ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"),
        "expandable_segments",
        False,
    )
    from kvguard.guard.at_budget import allocator_from_counters

    return memory, lambda: allocator_from_counters(kind, memory, expandable_segments=expandable, enable_vmm=vmm)


# The KV cache specs of MLA layers: vLLM's, and vllm-mindspore's quantized one (kv_cache_interface.py:30 @ 0.5.1).
_MLA_SPECS = frozenset({"MLAAttentionSpec", "MLAQuantFullAttentionSpec"})


def _layer_page(spec: Any) -> Any:
    from kvguard.budget.estimator import LayerPage

    return LayerPage(int(spec.page_size_bytes), any(cls.__name__ in _MLA_SPECS for cls in type(spec).__mro__))


def _kv_tensors_for(worker: Any, profile: Any, budget: int) -> tuple[int, ...] | None:
    """The KV tensors the era allocates for ``budget``: per layer spec (``get_kv_cache_spec``), vLLM's
    block count (``available // page_size // num_layers`` for one uniform group, kv_cache_utils.py
    0.11.0:1050-1061), the era row's style (kvguard.vllm.eras.kv_tensor_style) through the estimator's
    one rule (kv_cache_tensor_bytes)."""
    from kvguard.budget.estimator import kv_cache_tensor_bytes
    from kvguard.vllm.eras import kv_tensor_style

    specs = _kv_cache_spec(worker)
    if not specs:
        return None
    pages = [_layer_page(spec) for spec in specs.values()]
    if min(page.page_bytes for page in pages) <= 0:
        return None
    num_blocks = max(0, int(budget)) // max(page.page_bytes for page in pages) // len(pages)
    style = kv_tensor_style(profile.vllm_version, formula=profile.formula, allocator=_allocator_kind(worker))
    return kv_cache_tensor_bytes(pages, num_blocks, style)


def _kv_cache_spec(worker: Any) -> dict | None:
    """The worker's per-layer KV cache specs (``Worker.get_kv_cache_spec``, or its model runner's);
    None for a worker that has neither."""
    for owner in (worker, getattr(worker, "model_runner", None)):
        method = getattr(owner, "get_kv_cache_spec", None)
        if callable(method):
            return dict(method())
    return None


def _verdict_at(worker: Any, profile: Any, budget: int, model: tuple[Any, Any]) -> Any:
    from kvguard.guard.at_budget import counters_of
    from kvguard.guard.judge import BudgetInput, judge_at_budget

    tensors = _kv_tensors_for(worker, profile, budget)
    if tensors is None:
        return None
    _, build = model
    return judge_at_budget(BudgetInput(profile, tensors, build, counters_of, reserved_peak=_profile_peak))


def _record_budget_verdict(worker: Any, profile: Any, budget: int) -> None:
    if _settings.spool_dir is None or _extensible(worker) or not _kv_cache_spec(worker):
        return  # no probe; 0.34's extensible KV cache (sized after warm-up, outside the allocator); no specs
    model = _budget_model(worker)
    if model is None:
        return
    verdict = _verdict_at(worker, profile, budget, model)
    if verdict is None:
        return
    from kvguard import probe

    probe.set_budget_verdict(verdict)
    running = probe.current()
    if running is not None:
        running.run_once()  # into the snapshot at once: the KV allocation may be what fails next
    if verdict.state == "critical":
        log.warning(
            "kvguard: budget-time verdict critical for a %d-byte KV cache: %s",
            budget,
            "; ".join(r.message for r in verdict.reasons if r.state == "critical"),
        )


def _guard_budget(worker: Any, profile: Any, available: int) -> int | None:
    """KVGUARD_BUDGET=guard: the largest budget, at most vLLM's, whose budget-time verdict is not
    critical (bisection over whole blocks; the verdict only worsens with more blocks). None keeps
    vLLM's figure (it already fits, or nothing fits, or the guard cannot judge)."""
    from kvguard.units import format_gib

    if _extensible(worker) or profile.kv_cache_memory_bytes is not None:
        log.info(
            "kvguard: KVGUARD_BUDGET=guard changes nothing here: %s",
            "vLLM's extensible KV cache is sized after warm-up"
            if _extensible(worker)
            else "--kv-cache-memory-bytes fixed the size",
        )
        return None
    model = _budget_model(worker)
    if model is None:
        _failed("budget", "the device source gives no free/total memory; keeping vLLM's KV cache budget")
        return None
    first = _verdict_at(worker, profile, available, model)
    if first is None or first.state != "critical":
        log.info(
            "kvguard: KVGUARD_BUDGET=guard keeps vLLM's KV cache budget %s: the guard predicts it fits (%s)",
            format_gib(available),
            first.state if first else "no KV cache spec",
        )
        return None
    from kvguard.guard.judge import largest_fitting_blocks

    specs = _kv_cache_spec(worker)
    block = max(int(spec.page_size_bytes) for spec in specs.values()) * len(specs)
    low = largest_fitting_blocks(
        lambda blocks: _verdict_at(worker, profile, blocks * block, model), available // block - 1
    )
    if low == 0:
        log.warning(
            "kvguard: KVGUARD_BUDGET=guard: no KV cache budget fits by the guard's prediction; keeping vLLM's %s (%s)",
            format_gib(available),
            first.reasons[0].message,
        )
        return None
    budget = low * block
    log.info(
        "kvguard: KV cache budget %s (KVGUARD_BUDGET=guard) instead of vLLM's %s: at vLLM's the guard predicts %s (%s)",
        format_gib(budget),
        format_gib(available),
        first.reasons[0].code,
        first.reasons[0].message,
    )
    return budget


# ---------------------------------------------------------------------------- the KV cache


def _group_block_bytes(group: Any) -> int:
    """Bytes one block takes across one group's layers. ``UniformTypeKVCacheSpecs.page_size_bytes`` is
    already the sum over its layers (kv_cache_interface.py 0.11.0:275-277, 0.34.0:1354-1355)."""
    spec = group.kv_cache_spec
    if hasattr(spec, "kv_cache_specs"):
        return int(spec.page_size_bytes)
    return len(group.layer_names) * int(spec.page_size_bytes)


def kv_cache_allocation(kv_cache_config: Any, num_blocks: int | None = None, outside_allocator: bool = False) -> Any:
    """KVCacheAllocation from vLLM's KVCacheConfig, sized as vLLM sizes it: the largest group's bytes
    per block (vLLM takes the max over groups, kv_cache_utils.py 0.11.0:1050-1061, kv_cache_planning.py
    0.34.0:615-648); without groups, the tensors it allocates over the block count."""
    from kvguard.records import KVCacheAllocation

    config_blocks = int(kv_cache_config.num_blocks)
    num_blocks = config_blocks if num_blocks is None else int(num_blocks)
    if num_blocks <= 0 or config_blocks <= 0:
        return None
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    tensors = getattr(kv_cache_config, "kv_cache_tensors", None)
    if tensors is None:
        tensors = list((getattr(kv_cache_config, "tensors", None) or {}).values())
    block_bytes = max((_group_block_bytes(group) for group in groups), default=0)
    if not block_bytes and tensors:
        # Older configs without groups: what the tensors hold per block (0.34 pads its tensors to
        # the extensible capacity, so they are the fallback only).
        block_bytes = sum(int(tensor.size) for tensor in tensors) // config_blocks
    block_size = int(groups[0].kv_cache_spec.block_size) if groups else 0
    if block_bytes <= 0 or block_size <= 0:
        return None
    return KVCacheAllocation(
        num_blocks=num_blocks, block_bytes=block_bytes, block_size=block_size, outside_allocator=outside_allocator
    )


def _record_kv_cache(worker: Any, kv_cache_config: Any, num_blocks: int | None = None) -> None:
    if _extensible(worker) and num_blocks is None:
        # 0.34's extensible KV cache: the config holds the reserved capacity; the size is committed
        # after warm-up by extend_kv_cache, which records it then.
        return
    allocation = kv_cache_allocation(kv_cache_config, num_blocks, outside_allocator=_extensible(worker))
    if allocation is not None:
        from kvguard import probe

        probe.set_kv_cache(allocation)


def _wrap_initialize_from_config(original: Callable[..., Any]) -> Callable[..., Any]:
    def initialize_from_config(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, kv_cache_config, *args, **kwargs)
        _guard("initialize_from_config", _record_kv_cache, self, kv_cache_config)
        return result

    return initialize_from_config


def _wrap_extend_kv_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    """0.34: ``Worker.extend_kv_cache(num_blocks)`` commits the extensible KV cache's final size
    (w 0.34.0:1007-1010); record that block count."""

    def extend_kv_cache(self: Any, num_blocks: int, *args: Any, **kwargs: Any) -> Any:
        result = original(self, num_blocks, *args, **kwargs)
        config = getattr(self, "_kv_cache_config", None) or getattr(
            getattr(self, "model_runner", None), "kv_cache_config", None
        )
        if config is not None:
            _guard("extend_kv_cache", _record_kv_cache, self, config, num_blocks)
        return result

    return extend_kv_cache


# ---------------------------------------------------------------------------- 0.34: sized after warm-up

EXTENSIBLE_MODULE = "vllm.v1.worker.extensible_kv_cache"
_EXTENSIBLE_INPUTS = {
    "init_free_memory": "init_free_memory_bytes",
    "free_memory": "free_after_warmup_bytes",
    "committed_bytes": "kv_committed_bytes",
    "transient_peak_bytes": "kv_transient_peak_bytes",
    "torch_reserve_growth_bytes": "torch_reserve_growth_bytes",
}


def _wrap_compile_or_warm_up_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """0.34's extensible KV cache is sized at the end of warm-up by ``measure_kv_cache_bytes``
    (v1/worker/extensible_kv_cache.py 0.34.0:592-618), called with every input by keyword; while
    warm-up runs, that function is wrapped so the profile gains them (formula ``extensible``)."""

    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        module = sys.modules.get(EXTENSIBLE_MODULE) if _extensible(self) else None
        current = getattr(module, "measure_kv_cache_bytes", None) if module else None
        if not callable(current) or getattr(current, _MARK, False):
            return original(self, *args, **kwargs)
        calls: list[dict[str, Any]] = []

        def measure_kv_cache_bytes(*m_args: Any, **m_kwargs: Any) -> Any:
            result = current(*m_args, **m_kwargs)
            calls.append(m_kwargs)
            return result

        setattr(measure_kv_cache_bytes, _MARK, True)
        module.measure_kv_cache_bytes = measure_kv_cache_bytes
        try:
            return original(self, *args, **kwargs)
        finally:
            if module.measure_kv_cache_bytes is measure_kv_cache_bytes:
                module.measure_kv_cache_bytes = current
            _guard("compile_or_warm_up_model", _record_extensible_inputs, self, calls)

    return compile_or_warm_up_model


def _record_extensible_inputs(worker: Any, calls: list[dict[str, Any]]) -> None:
    """The call that sized the cache is the one with the worker's own requested memory (a second
    call, with the startup free memory, only words a warning: extensible_kv_cache.py 0.34.0:655-660)."""
    global _profile
    requested = int(getattr(worker, "requested_memory", -1))
    sizing = next((c for c in calls if c.get("requested_memory") == requested), calls[0] if calls else None)
    if sizing is None or _profile is None:
        return
    inputs = {field: int(sizing[name]) for name, field in _EXTENSIBLE_INPUTS.items()}
    import dataclasses

    _profile = dataclasses.replace(_profile, formula="extensible", **inputs)
    from kvguard import probe

    probe.set_profile(_profile)
