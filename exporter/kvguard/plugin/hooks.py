"""The wiring: :func:`register`, vLLM's general-plugin hook, and the wrappers it sets on the worker classes'
methods (:data:`WORKER_CLASSES`), patched when their module is imported, or at once if it already is.

Every hook is wrapped: a failure is logged once, counted (``kvguard.plugin.state.hook_errors``), and the
original method's result passes through untouched. kvguard never makes vLLM fail.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvguard.plugin import budget, state
from kvguard.plugin.capture import device_readings_captured, profiling_captured
from kvguard.plugin.objects import KVCacheConfig, Worker
from kvguard.plugin.profile import (
    Capture,
    engine_identity,
    era_of,
    extensible,
    kv_cache_allocation,
    profile_from,
    profile_from_device_readings,
    reserved_peak_from,
    running_release,
    runs_mindspore,
    with_cleared,
    with_extensible_inputs,
    with_unprofiled_sampler,
)
from kvguard.plugin.state import Settings, log

if TYPE_CHECKING:
    from kvguard.budget.estimator import Profile

# (module, class) of the worker classes whose methods kvguard wraps.
WORKER_CLASSES = (
    ("vllm.v1.worker.gpu_worker", "Worker"),
    ("vllm_ascend.worker.worker", "NPUWorker"),
    ("vllm_ascend.worker.worker_v1", "NPUWorker"),
    ("vllm_ascend._310p.worker_310p", "NPUWorker310"),  # 310P: its own determine_available_memory (0.18+)
)

Method = Callable[..., Any]  # a worker method: self, then vLLM's arguments


# ---------------------------------------------------------------------------- register


def register() -> None:
    """vLLM's general-plugin hook. Never raises."""
    try:
        with state.lock:
            if state.registered:
                return
            state.registered = True
        state.settings = Settings.from_environment()
        if not state.settings.enabled:
            return
        state.guard("logging", _join_vllm_logging)
        state.guard("mindspore_dump", _turn_on_mindspore_dump)
        for module_name, class_name in WORKER_CLASSES:
            module = sys.modules.get(module_name)
            if module is not None:
                state.guard("patch", patch_worker_class, module, class_name)
            else:
                _PatchOnImport.watch(module_name, functools.partial(patch_worker_class, class_name=class_name))
    except Exception as exc:  # noqa: BLE001
        from kvguard.text import one_line

        state.failed("register", one_line(exc))


def _turn_on_mindspore_dump() -> None:
    """``KVGUARD_MINDSPORE_DUMP``: exact mode on MindSpore. The pool's periodic dump of its own lists
    (``MemoryDebugInfo<k>.txt``, written by ``DefragMemory`` every N graph runs when ``MS_ALLOC_CONF``'s
    ``defrag_memory_step_freq`` holds ``dump``: abstract_dynamic_mem_pool.cc:423-427, 930-937 @ r2.7.rc1) is merged
    into the user's ``MS_ALLOC_CONF`` here, in every process vLLM starts and before its worker creates the pool,
    which reads the setting once (ascend_memory_pool.cc:519-525). The probe then reads the newest file
    (kvguard.sources.mindspore_dump). Idempotent: a value that already holds ``dump`` is left as it is."""
    from kvguard.sources.mindspore_dump import ALLOC_CONF_ENV, DUMP_ENV, dump_alloc_conf

    if state.settings.spool_dir is None:
        if os.environ.get(DUMP_ENV, "").strip():
            state.failed(
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


def reset_for_tests() -> None:
    """A fresh process's state: nothing registered, counted or watched (patched classes stay patched)."""
    state.reset_for_tests()
    _PatchOnImport.forget()


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Calls ``patch(module)`` right after one of the watched modules is first executed."""

    _instance: "_PatchOnImport | None" = None

    def __init__(self) -> None:
        self.targets: dict[str, Callable[[ModuleType], None]] = {}

    @classmethod
    def watch(cls, module_name: str, patch: Callable[[ModuleType], None]) -> None:
        if cls._instance is None:
            cls._instance = cls()
            sys.meta_path.insert(0, cls._instance)
        cls._instance.targets[module_name] = patch

    @classmethod
    def forget(cls) -> None:
        if cls._instance is not None:
            try:
                sys.meta_path.remove(cls._instance)
            except ValueError:
                pass
            cls._instance = None

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
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
    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        state.guard("patch", self._patch, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def patch_worker_class(module: ModuleType, class_name: str) -> None:
    """Wrap the methods of ``module.class_name`` that kvguard hooks, each once (a wrapped one is skipped)."""
    worker = getattr(module, class_name, None)
    if worker is None:
        return
    wrappers: tuple[tuple[str, Callable[[Method], Method]], ...] = (
        ("init_device", _wrap_init_device),
        ("determine_available_memory", _wrap_determine_available_memory),
        ("initialize_from_config", _wrap_initialize_from_config),
        ("compile_or_warm_up_model", _wrap_compile_or_warm_up_model),
        ("extend_kv_cache", _wrap_extend_kv_cache),
        ("execute_model", _wrap_execute_model),
    )
    for name, wrapper in wrappers:
        original = worker.__dict__.get(name)
        if original is None or getattr(original, state.MARK, False):
            continue
        wrapped = functools.wraps(original)(wrapper(original))
        if name in READING_AFTER:
            wrapped = functools.wraps(original)(_then_engine_reading(wrapped))
        setattr(wrapped, state.MARK, True)
        setattr(worker, name, wrapped)


# ---------------------------------------------------------------------------- the probe


def _ensure_probe(worker: Worker) -> None:
    settings = state.settings
    if settings.spool_dir is None:
        return
    from kvguard import probe

    rank = getattr(worker, "rank", None)
    # The strict start (returns the running probe, if any): a bad setting raises here and is
    # counted and logged once by state.guard.
    # The worker's device, read by the probe's own thread: torch's current device is per thread, so a thread of
    # the probe's would read (and, through mem_get_info, open a context on) device 0 in every rank.
    index = getattr(getattr(worker, "device", None), "index", None)
    options = (
        {"device": index}
        if settings.source in ("auto", "torch")
        and isinstance(index, int)
        and not isinstance(index, bool)
        and index >= 0
        else {}
    )
    probe.start_strict(
        settings.spool_dir,
        settings.interval,
        settings.source,
        rank=rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else None,
        source_options=options,
    )
    model_name, engine = engine_identity(worker)
    probe.set_engine(model_name, engine)


def _wrap_init_device(original: Method) -> Method:
    def init_device(self: Worker, *args: object, **kwargs: object) -> object:
        result = original(self, *args, **kwargs)
        state.guard("init_device", _ensure_probe, self)
        state.guard("init_device", _first_engine_sample, self)
        state.guard("init_device", _say_no_budget_hook, self)
        return result

    return init_device


# Startup steps after which a probe that reads on the engine's thread takes a reading there: the pool changes
# in them without a step (the KV cache allocated; warm-up and graph compilation), and the probe rewrites no
# reading before the engine serves (kvguard.probe).
READING_AFTER = ("initialize_from_config", "compile_or_warm_up_model")


def _then_engine_reading(function: Method) -> Method:
    def with_reading(self: Worker, *args: object, **kwargs: object) -> object:
        result = function(self, *args, **kwargs)
        state.guard("engine_reading", _engine_reading)
        return result

    return with_reading


def _engine_reading() -> None:
    from kvguard import probe

    running = probe.current() if state.settings.spool_dir is not None else None
    if running is not None and running.status.sampling == "engine-step":
        running.run_once()


def _first_engine_sample(worker: Worker) -> None:
    """On MindSpore the probe reads the pool on this (the engine's) thread only (kvguard.probe): take the
    first reading now, with the device set and no op queued yet, so that the rank has a snapshot before its
    first step."""
    from kvguard import probe

    running = probe.current() if state.settings.spool_dir is not None else None
    if running is not None and runs_mindspore(worker):
        running.run_once()


def _wrap_execute_model(original: Method) -> Method:
    """The step boundary (``Worker.execute_model``, vllm/v1/worker/gpu_worker.py; the engine core calls it once
    per scheduled step on the worker's own thread): where the probe reads a source that must not be read
    from another thread (MindSpore's, kvguard.probe). ``step_begin`` raises only the engine's own pending error,
    which the read took from the runtime: it passes to vLLM unchanged. Anything else of kvguard's is counted."""
    from kvguard import probe

    def execute_model(self: Worker, *args: object, **kwargs: object) -> object:
        try:
            probe.step_begin()
            return original(self, *args, **kwargs)
        finally:
            probe.step_end()

    return execute_model


def _say_no_budget_hook(worker: Worker) -> None:
    """A V0 worker (vllm-ascend 0.7.3) decides a block count in determine_num_available_blocks and has no
    determine_available_memory: no profile is recorded there, and the budget modes cannot act. Said once."""
    if state.said("no_budget_hook") or hasattr(type(worker), "determine_available_memory"):
        return
    state.once("no_budget_hook")
    era = era_of(running_release(worker))
    log.info(
        "kvguard: no startup profile on %s: its V0 worker decides the block count in "
        "determine_num_available_blocks, which kvguard does not wrap%s",
        era.name if era else "this engine",
        "" if state.settings.budget == "stock" else f"; KVGUARD_BUDGET={state.settings.budget} cannot act",
    )


# ---------------------------------------------------------------------------- the profile and the budget


def _record_reserved_peak(profile: Profile, capture: Capture) -> None:
    reserved_peak = reserved_peak_from(profile, capture)
    state.profile_peak = reserved_peak
    if reserved_peak is None:
        return
    from kvguard import probe

    probe.set_reserved_peak(reserved_peak)
    if reserved_peak.above_measured:
        from kvguard.guard.judge import reserved_peak_note

        log.info("kvguard: %s", reserved_peak_note(profile, reserved_peak))


def _wrap_determine_available_memory(original: Method) -> Method:
    def determine_available_memory(self: Worker, *args: object, **kwargs: object) -> object:
        state.guard("determine_available_memory", _ensure_probe, self)
        mindspore = state.guard("reserved_peak", runs_mindspore, self) is True
        with profiling_captured(original, mindspore) as capture, device_readings_captured(original) as readings:
            available = original(self, *args, **kwargs)
        profile = state.guard("profile", profile_from, self, capture)
        if profile is None and capture.result is None:
            profile = state.guard("profile", profile_from_device_readings, self, readings)
        if profile is None:
            if capture.result is None and state.once("no_profile"):
                # Neither memory_profiling nor the inline reads of kvguard.plugin.inline_readings: nothing to read.
                log.info(
                    "kvguard: no startup profile recorded: this worker's determine_available_memory runs no "
                    "memory_profiling, so its figures stay local to it; kvguard check reports no_profile"
                    + (
                        ""
                        if state.settings.budget == "stock"
                        else f" and KVGUARD_BUDGET={state.settings.budget} keeps vLLM's budget"
                    )
                )
            return available
        profile = state.guard("profile", with_cleared, profile, available) or profile
        profile = state.guard("profile", with_unprofiled_sampler, self, profile) or profile
        state.guard("profile", budget.check_formula, profile, available)
        from kvguard import probe

        state.profile = profile
        probe.set_profile(profile)
        state.guard("reserved_peak", _record_reserved_peak, profile, capture)
        if not isinstance(available, int):
            return available
        applied = None
        if state.settings.budget == "reserved":
            applied = state.guard("budget", budget.reserved_budget, self, profile, available)
        elif state.settings.budget == "guard":
            applied = state.guard("budget", budget.guard_budget, self, profile, available)
        if applied is not None and applied < available:
            from kvguard.units import format_gib

            if state.settings.budget == "reserved":
                log.info(
                    "kvguard: KV cache budget %s (reserved-aware, KVGUARD_BUDGET=reserved) instead of vLLM's %s",
                    format_gib(applied),
                    format_gib(available),
                )
            if hasattr(self, "available_kv_cache_memory_bytes"):
                self.available_kv_cache_memory_bytes = applied
        else:
            applied = available
        state.guard("budget_verdict", budget.record_budget_verdict, self, profile, applied)
        return applied

    return determine_available_memory


# ---------------------------------------------------------------------------- the KV cache


def _record_kv_cache(worker: Worker, kv_cache_config: KVCacheConfig, num_blocks: int | None = None) -> None:
    if extensible(worker) and num_blocks is None:
        # 0.34's extensible KV cache: the config holds the reserved capacity; the size is committed
        # after warm-up by extend_kv_cache, which records it then.
        return
    allocation = kv_cache_allocation(kv_cache_config, num_blocks, outside_allocator=extensible(worker))
    if allocation is not None:
        from kvguard import probe

        probe.set_kv_cache(allocation)


def _wrap_initialize_from_config(original: Method) -> Method:
    def initialize_from_config(self: Worker, kv_cache_config: KVCacheConfig, *args: object, **kwargs: object) -> object:
        result = original(self, kv_cache_config, *args, **kwargs)
        state.guard("initialize_from_config", _record_kv_cache, self, kv_cache_config)
        return result

    return initialize_from_config


def _wrap_extend_kv_cache(original: Method) -> Method:
    """0.34: ``Worker.extend_kv_cache(num_blocks)`` commits the extensible KV cache's final size
    (w 0.34.0:1007-1010); record that block count."""

    def extend_kv_cache(self: Worker, num_blocks: int, *args: object, **kwargs: object) -> object:
        result = original(self, num_blocks, *args, **kwargs)
        config = getattr(self, "_kv_cache_config", None) or getattr(
            getattr(self, "model_runner", None), "kv_cache_config", None
        )
        if config is not None:
            state.guard("extend_kv_cache", _record_kv_cache, self, config, num_blocks)
        return result

    return extend_kv_cache


# ---------------------------------------------------------------------------- 0.34: sized after warm-up

EXTENSIBLE_MODULE = "vllm.v1.worker.extensible_kv_cache"


def _wrap_compile_or_warm_up_model(original: Method) -> Method:
    """0.34's extensible KV cache is sized at the end of warm-up by ``measure_kv_cache_bytes``
    (v1/worker/extensible_kv_cache.py 0.34.0:592-618), called with every input by keyword; while
    warm-up runs, that function is wrapped so the profile gains them (formula ``extensible``)."""

    def compile_or_warm_up_model(self: Worker, *args: object, **kwargs: object) -> object:
        module = sys.modules.get(EXTENSIBLE_MODULE) if extensible(self) else None
        current = getattr(module, "measure_kv_cache_bytes", None) if module else None
        if module is None or not callable(current) or getattr(current, state.MARK, False):
            return original(self, *args, **kwargs)
        calls: list[dict[str, Any]] = []

        def measure_kv_cache_bytes(*m_args: object, **m_kwargs: Any) -> object:
            result = current(*m_args, **m_kwargs)
            calls.append(m_kwargs)
            return result

        setattr(measure_kv_cache_bytes, state.MARK, True)
        setattr(module, "measure_kv_cache_bytes", measure_kv_cache_bytes)
        try:
            return original(self, *args, **kwargs)
        finally:
            if getattr(module, "measure_kv_cache_bytes", None) is measure_kv_cache_bytes:
                setattr(module, "measure_kv_cache_bytes", current)
            state.guard("compile_or_warm_up_model", _record_extensible_inputs, self, calls)

    return compile_or_warm_up_model


def _record_extensible_inputs(worker: Worker, calls: list[dict[str, Any]]) -> None:
    """The profile gains the inputs of the call that sized the cache
    (:func:`kvguard.plugin.profile.with_extensible_inputs`)."""
    requested = int(getattr(worker, "requested_memory", -1))
    if state.profile is None:
        return
    profile = with_extensible_inputs(state.profile, calls, requested)
    if profile is None:
        return
    state.profile = profile
    from kvguard import probe

    probe.set_profile(profile)
