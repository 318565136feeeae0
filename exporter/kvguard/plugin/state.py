"""The plugin's settings and the state it keeps per process: what was registered, the hooks' failure counts, the
device reader of the profile run, this worker's startup profile, and what was already said once.

Every other module of the wing reads this state through the module (``state.settings``), never by copying a
name: :func:`kvguard.plugin.hooks.register` replaces ``settings`` once the environment is read.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    from kvguard.budget.estimator import Profile
    from kvguard.records import ReservedPeak
    from kvguard.sources import Source

log = logging.getLogger("kvguard.plugin")

BUDGETS = ("stock", "reserved", "guard")
DEFAULT_INTERVAL = 5.0
MARK = "_kvguard_wrapped"  # set on every function kvguard wraps: a second wrap is skipped

T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    spool_dir: str | None = None
    interval: float = DEFAULT_INTERVAL
    source: str = "auto"
    budget: str = "stock"

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        environ = os.environ if environ is None else environ
        interval_text = environ.get("KVGUARD_INTERVAL", "").strip()
        try:
            interval = float(interval_text) if interval_text else DEFAULT_INTERVAL
            if not interval > 0 or interval == float("inf"):
                raise ValueError
        except ValueError:
            failed(
                "settings", f"KVGUARD_INTERVAL={interval_text!r} is not a positive number; using {DEFAULT_INTERVAL:g}"
            )
            interval = DEFAULT_INTERVAL
        budget = environ.get("KVGUARD_BUDGET", "stock").strip().lower() or "stock"
        if budget not in BUDGETS:
            failed("settings", f"KVGUARD_BUDGET={budget!r} is not one of {', '.join(BUDGETS)}; using stock")
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


hook_errors: dict[str, int] = {}  # hook name -> failures, for tests and debugging
logged: set[str] = set()  # the hooks whose first failure was logged, and the notes said once
lock = threading.Lock()
registered = False
settings = Settings()
reader: Source | None = None  # the source that reads the reserved peak during profiling
profile: Profile | None = None  # this worker's startup profile, completed after 0.34's warm-up
profile_peak: ReservedPeak | None = None  # vllm-mindspore: the profile run's reserved peak


def failed(hook: str, message: str) -> None:
    """Count a failure; log the first of each hook at WARNING, the rest at DEBUG."""
    with lock:
        hook_errors[hook] = hook_errors.get(hook, 0) + 1
        first = hook not in logged
        logged.add(hook)
    if first:
        log.warning(
            "kvguard: %s: %s (vLLM continues; further %s failures are logged at debug level)", hook, message, hook
        )
    else:
        log.debug("kvguard: %s: %s", hook, message)


def said(note: str) -> bool:
    """Whether the note (or the first failure of a hook of that name) was already logged."""
    return note in logged


def once(note: str) -> bool:
    """True the first time only: a note logged once per process."""
    with lock:
        first = note not in logged
        logged.add(note)
    return first


def guard(hook: str, function: Callable[..., T], *args: object) -> T | None:
    """``function(*args)``; its failure counted and logged, never raised, but for the engine's own pending
    error that a MindSpore read took from the runtime (kvguard.sources.EngineError): that one is raised again,
    unchanged, on this (the engine's) thread, where the engine's next sync would have raised it."""
    try:
        return function(*args)
    except Exception as exc:  # noqa: BLE001 - kvguard must never take vLLM down
        from kvguard import probe
        from kvguard.sources import EngineError

        original: BaseException
        if isinstance(exc, EngineError):
            original = exc.original
        elif probe.is_engine_error(exc):
            original = exc
        else:
            from kvguard.text import one_line

            failed(hook, one_line(exc))
            return None
    raise original  # outside the handler: its cause and context stay as the engine made them


def device_reader() -> Source:
    """The probe's source, made once per process: reads this worker's device (``KVGUARD_SOURCE``)."""
    global reader
    if reader is None:
        from kvguard.sources import get_source

        reader = get_source(settings.source)
    return reader


def read_reserved() -> tuple[int | None, int | None]:
    """(reserved now, reserved peak) on this worker's device, read by the probe's source
    (``auto``: torch.cuda, torch.npu or MindSpore, whichever the worker uses)."""
    records = device_reader().sample()
    if not records:
        return None, None
    return records[0].reserved_bytes, records[0].peak_reserved_bytes


def reset_for_tests() -> None:
    """Forget everything but the patches already made (kvguard.plugin.hooks.reset_for_tests forgets the watch)."""
    global registered, settings, reader, profile, profile_peak
    with lock:
        registered = False
        hook_errors.clear()
        logged.clear()
    settings = Settings()
    reader = None
    profile = None
    profile_peak = None
