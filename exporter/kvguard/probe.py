"""The in-process probe: samples the allocator inside the serving process, writes the spool.

Allocated versus reserved lives only inside the serving process, so kvguard runs this
small probe there and a sidecar outside it::

    import kvguard.probe
    kvguard.probe.start("/dev/shm/kvguard", interval=5.0, source="auto")
    kvguard.probe.set_profile(profile)          # kvguard.budget.estimator.Profile, after vLLM profiled
    kvguard.probe.set_kv_cache(allocation)      # kvguard.records.KVCacheAllocation
    kvguard.probe.set_engine("qwen-7b", 0)      # served model name, engine (data-parallel) index
    kvguard.probe.stop()

Every ``interval`` seconds a daemon thread asks the source for one record per device
and atomically replaces one JSON snapshot per (host, pid, device) in the spool
(:func:`kvguard.spool.io.write_snapshot`: a temporary name outside ``*.json``, then a rename).

The probe never raises into the host process and never blocks it:

- :func:`start` with bad arguments logs one warning and returns None (the
  :class:`Probe` constructor is the strict interface: it raises ValueError);
- the source is built and sampled on a worker thread of its own; a sample that has not
  finished when the next one is due is an *overrun*: counted, and nothing is written
  until a sample finishes, so the snapshot's age shows the sidecar that the rank has no
  fresh data (a hung source blocks that worker thread only);
- a failing source (whatever it raises, SystemExit and KeyboardInterrupt included: they
  stay on the worker thread), a missing, read-only or full spool directory are counted
  (``errors_total`` for samples, ``write_errors_total`` for writes, ``overruns_total``)
  and logged once per kind;
- when the probe stops or its process dies, the snapshots stay and age.

Sources whose reads synchronise the engine (MindSpore's ``memory_stats()`` drains the runtime pipeline and
takes the engine's pending asynchronous error: kvguard.sources.mindspore) are never read from the probe's
threads. The worker thread builds the source, sees ``engine_thread_only`` and hands sampling to the engine:
the vLLM plugin calls :func:`step_begin` / :func:`step_end` around each step of the worker's
``execute_model`` and :meth:`Probe.run_once` after its startup hooks, and at the first step boundary after
``interval`` the engine's thread reads the source (there, between steps, the pipeline is drained by the
engine's own sync); the probe's thread completes (files beside the counters) and writes the record. An
error the read rethrows that the source tells is the engine's own (a second read succeeds) is raised again,
unchanged, on the engine's thread; every other failure is counted. Once the engine serves, its allocator
does not change between steps, so the probe's thread rewrites the last record each interval
(``probe.sampled_at`` says when it was read); before the first step, and inside a step that outlasts the
sample timeout, it writes nothing, and the snapshot ages. The seconds the
engine's thread spent sampling are counted (``engine_thread_seconds_total``).

Pod identity comes from the downward API through the environment: ``POD_NAME``,
``POD_NAMESPACE``, ``CONTAINER_NAME``, ``NODE_NAME`` (see docs/reference/probe.md).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from kvguard.budget.estimator import Profile
from kvguard.records import DeviceMemory, KVCacheAllocation, ReservedPeak
from kvguard.sources import (
    EngineError,
    RankContext,
    Source,
    close_source,
    complete_records,
    engine_thread_only,
    get_source,
    rank_contexts,
    source_names,
    source_skips,
)
from kvguard.spool.io import write_snapshot
from kvguard.spool.schema import POD_ENV, ProbeStatus, Snapshot
from kvguard.text import one_line

log = logging.getLogger("kvguard.probe")

DEFAULT_INTERVAL = 5.0
_ALL = None  # device key meaning "every device this probe writes"


def pod_identity(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {key: environ[name][:253] for key, name in POD_ENV.items() if environ.get(name)}


def rank_from_environment(environ: Mapping[str, str] | None = None) -> int | None:
    """``KVGUARD_RANK``, else ``RANK`` (torchrun, Ray), as a non-negative int."""
    environ = os.environ if environ is None else environ
    for name in ("KVGUARD_RANK", "RANK"):
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


@dataclass
class _Job:
    """One sample running on its own worker thread."""

    done: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)
    records: list[DeviceMemory] | None = None
    error: str | None = None
    deferred: bool = False  # the source is read on the engine's thread only: nothing sampled here


class Probe:
    """Samples one source and keeps one snapshot per device in ``spool_dir``.

    ``source`` is a registered name (built lazily on the worker thread, with
    ``source_options``) or an object with ``sample()``. ``sample_timeout`` (default: the
    interval) is how long one tick waits for a sample before counting an overrun.
    """

    def __init__(
        self,
        spool_dir: str,
        source: str | Source = "auto",
        interval: float = DEFAULT_INTERVAL,
        *,
        rank: int | None = None,
        sample_timeout: float | None = None,
        source_options: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ):
        if not isinstance(spool_dir, (str, os.PathLike)) or not str(spool_dir):
            raise ValueError("the probe needs a spool directory")
        _check_seconds("interval", interval)
        if sample_timeout is not None:
            _check_seconds("sample timeout", sample_timeout)
        if isinstance(source, str):
            if source not in source_names():
                raise ValueError(f"unknown source {source!r} (choose from {', '.join(source_names())})")
            self.source_name = source
            self._source: Source | None = None
        elif callable(getattr(source, "sample", None)):
            self.source_name = str(getattr(source, "name", type(source).__name__))
            self._source = source
        else:
            raise ValueError("source must be a source name or an object with sample()")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ValueError(f"rank must be a non-negative integer, got {rank!r}")
        self.spool_dir = os.fspath(spool_dir)
        self.interval = float(interval)
        self.sample_timeout = float(sample_timeout) if sample_timeout is not None else self.interval
        self.rank = rank if rank is not None else rank_from_environment(environ)
        self.pod = pod_identity(environ)
        self.host = socket.gethostname()
        self._source_options = dict(source_options or {})
        self._lock = threading.Lock()
        # One tick's pick-and-write at a time: a write built from older engine facts must not land
        # after one built from newer facts (run_once and the loop can tick together).
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._job: _Job | None = None
        self._started_at = time.time()
        self._samples = self._errors = self._write_errors = self._overruns = 0
        self._last_error: str | None = None
        self._logged: set[str] = set()
        self._sequence: dict[str, int] = {}
        self._written_sampled_at: dict[str, float] = {}  # per device: when its written sample began
        self._profiles: dict[str | None, Profile | None] = {}
        self._kv_caches: dict[str | None, KVCacheAllocation | None] = {}
        self._engine = ("", "")  # (served model name, engine index) of the serving engine
        self._budget_verdicts: dict[str | None, Any] = {}
        self._reserved_peaks: dict[str | None, ReservedPeak | None] = {}
        # Engine-step sampling (module docstring): set once the worker thread has built a source that must
        # be read on the engine's thread.
        self._engine_mode = False
        self._wake = threading.Event()  # the engine handed over a sample to write
        self._engine_sampled = float("-inf")  # monotonic time of the engine's last sample
        self._in_step_since: float | None = None  # monotonic start of the step in progress
        self._pending: tuple[list[DeviceMemory], float] | None = None  # (records, sampled at): to write
        self._last: tuple[list[DeviceMemory], float, float] | None = None  # (records, monotonic, unix)
        self._engine_seconds = 0.0
        # Once the engine steps, its allocator changes only inside steps; before (loading, profiling, the KV
        # cache, warm-up) it changes without one, and a rewritten reading would be an old one called fresh.
        self._serving = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Probe":
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return self
            self._stop.clear()
            self._started_at = time.time()
            self._thread = threading.Thread(target=self._loop, name="kvguard-probe", daemon=True)
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop sampling; waits at most ``timeout`` seconds for the probe thread. The snapshots stay."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        job = self._job
        if job is None or job.done.is_set():  # never close a source a hung sample is still inside
            close_source(self._source)

    def run_once(self, timeout: float | None = None) -> int:
        """One sample taken after this call began, and its write, on the caller's thread; returns the
        snapshots written. (A sample the loop started earlier is waited out, not reused: it may predate
        what the caller just did, such as loading the weights.) A source read on the engine's thread only
        is read here, on the caller's thread, which must then be the engine's (the vLLM plugin's hooks are)."""
        if not self._engine_mode:
            written = self._tick(self.sample_timeout if timeout is None else timeout, not_before=time.monotonic())
            if not self._engine_mode:
                return written
        taken = self._engine_sample_guarded()
        return self._write(*taken) if taken is not None else 0

    # ------------------------------------------------------------------ the engine's thread
    def step_begin(self) -> None:
        """The engine is about to run a step. Reads the source here when it is engine-thread-only and the
        interval has passed; raises only the engine's own pending error (:class:`EngineError`'s original)."""
        if not self._engine_mode:
            return
        now = time.monotonic()
        self._in_step_since = now
        self._serving = True
        if now - self._engine_sampled < self.interval:
            return
        taken = self._engine_sample_guarded()
        if taken is not None:
            with self._lock:
                self._pending = taken
            self._wake.set()

    def step_end(self) -> None:
        """The engine's step returned (or raised)."""
        self._in_step_since = None

    def _engine_sample_guarded(self) -> tuple[list[DeviceMemory], float] | None:
        """:meth:`_engine_sample`; the engine's own error raised again unchanged (its cause and context as they
        were: raised outside the handler), any other counted."""
        try:
            return self._engine_sample()
        except EngineError as exc:
            original = exc.original
        except Exception as exc:  # noqa: BLE001 - the probe's own bug: never the engine's problem
            self._count("internal", f"probe: {one_line(exc)}")
            return None
        _passed_through(original)
        raise original

    def _engine_sample(self) -> tuple[list[DeviceMemory], float] | None:
        """One read of the source on the calling (engine) thread: (records, monotonic start) or None."""
        started = time.monotonic()
        self._engine_sampled = started
        try:
            records = self._source.sample() if self._source is not None else None
            if not isinstance(records, list) or not all(isinstance(r, DeviceMemory) for r in records):
                raise TypeError(
                    f"source {self.source_name} returned {type(records).__name__}, not a list of DeviceMemory"
                )
        except EngineError as exc:
            # The source told it from its own failure (kvguard.sources.mindspore.read_telling_engine_errors).
            self._count("engine", f"{one_line(exc)} (raised again on the engine's thread)")
            raise
        except Exception as exc:  # noqa: BLE001 - the source's own failure: counted, never raised
            self._count("sample", f"{self.source_name}: {one_line(exc)}")
            return None
        finally:
            spent = time.monotonic() - started
            with self._lock:
                self._engine_seconds += spent
        with self._lock:
            self._samples += 1
            self._last = (records, started, time.time())
        return records, started

    # ------------------------------------------------------------------ engine facts
    def set_profile(self, profile: Profile | None, device: str | None = _ALL) -> None:
        if profile is not None and not isinstance(profile, Profile):
            raise TypeError(f"profile must be a kvguard.budget.estimator.Profile, got {type(profile).__name__}")
        with self._lock:
            self._profiles[device] = profile

    def set_kv_cache(self, kv_cache: KVCacheAllocation | None, device: str | None = _ALL) -> None:
        if kv_cache is not None and not isinstance(kv_cache, KVCacheAllocation):
            raise TypeError(f"kv_cache must be a kvguard.records.KVCacheAllocation, got {type(kv_cache).__name__}")
        with self._lock:
            self._kv_caches[device] = kv_cache

    def set_engine(self, model_name: str | None, engine: str | int | None = None) -> None:
        """The serving engine this process belongs to, as vLLM labels its own series: the served
        model name (``model_name``) and the engine index (``engine``, the data-parallel rank)."""
        if model_name is not None and not isinstance(model_name, str):
            raise TypeError(f"model_name must be a string, got {type(model_name).__name__}")
        if engine is not None and (isinstance(engine, bool) or not isinstance(engine, (str, int))):
            raise TypeError(f"engine must be a string or an index, got {type(engine).__name__}")
        with self._lock:
            self._engine = (model_name or "", "" if engine is None else str(engine))

    def set_budget_verdict(self, verdict: Any, device: str | None = _ALL) -> None:
        """The guard's budget-time verdict (``kvguard.guard.judge.judge_at_budget``), for the snapshots."""
        from kvguard.guard.judge import BUDGET, Verdict

        if verdict is not None and (not isinstance(verdict, Verdict) or verdict.phase != BUDGET):
            raise TypeError("budget verdict must be a kvguard.guard.judge.Verdict of phase 'budget'")
        with self._lock:
            self._budget_verdicts[device] = verdict

    def set_reserved_peak(self, reserved_peak: ReservedPeak | None, device: str | None = _ALL) -> None:
        """vllm-mindspore: the profile run's reserved peak by MindSpore's statistics, beside the engine's
        end-of-run figure (:class:`kvguard.records.ReservedPeak`)."""
        if reserved_peak is not None and not isinstance(reserved_peak, ReservedPeak):
            raise TypeError(f"reserved_peak must be a kvguard.records.ReservedPeak, got {type(reserved_peak).__name__}")
        with self._lock:
            self._reserved_peaks[device] = reserved_peak

    @property
    def status(self) -> ProbeStatus:
        with self._lock:
            return self._status()

    def _status(self) -> ProbeStatus:
        return ProbeStatus(
            samples_total=self._samples,
            errors_total=self._errors,
            write_errors_total=self._write_errors,
            last_error=self._last_error,
            interval_seconds=self.interval,
            overruns_total=self._overruns,
            sampling="engine-step" if self._engine_mode else "thread",
            engine_thread_seconds_total=self._engine_seconds,
            skipped_total=source_skips(self._source),
        )

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            try:
                if self._engine_mode:
                    self._engine_tick()
                else:
                    self._tick(self.sample_timeout)
            except Exception as exc:  # noqa: BLE001 - the probe thread must outlive its own bugs
                self._count("internal", f"probe: {one_line(exc)}")
            next_tick = max(next_tick + self.interval, time.monotonic())
            while not self._stop.is_set() and self._wake.wait(max(0.0, next_tick - time.monotonic())):
                self._wake.clear()
                try:
                    self._write_pending()
                except Exception as exc:  # noqa: BLE001
                    self._count("internal", f"probe: {one_line(exc)}")

    def _write_pending(self) -> int:
        with self._lock:
            pending, self._pending = self._pending, None
        return self._write(*pending) if pending is not None else 0

    def _engine_tick(self) -> int:
        """The probe thread's tick in engine-step mode: write what the engine sampled; while the engine is
        between steps (its allocator idle), rewrite the last record so that the snapshot stays fresh."""
        if self._write_pending():
            return 1
        if not self._serving:
            return 0  # not serving yet: the pool changes without steps (loading, profiling), let it age
        in_step = self._in_step_since
        if in_step is not None and time.monotonic() - in_step > self.sample_timeout:
            return 0  # a step that long may have changed everything: let the snapshot age
        with self._lock:
            last = self._last
        return self._write(last[0], last[1]) if last is not None else 0

    def _tick(self, timeout: float, not_before: float | None = None) -> int:
        job = self._sample(timeout, not_before)
        if job is None:
            return 0
        return self._write(job.records, job.started)

    def _sample(self, timeout: float, not_before: float | None = None) -> _Job | None:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                job = self._job
                if job is None:
                    job = self._job = _Job()
                    threading.Thread(
                        target=self._run_job, args=(job,), name="kvguard-probe-sample", daemon=True
                    ).start()
            if not_before is None or job.started >= not_before:
                break
            # An older sample is in flight: let it finish (it is the loop's), then take a fresh one.
            job.done.wait(max(0.0, deadline - time.monotonic()))
            with self._lock:
                if self._job is job and job.done.is_set():
                    self._job = None
            if not job.done.is_set():
                self._count("overrun", f"source {self.source_name} did not answer within {timeout:g}s", overrun=True)
                return None
        while not job.done.wait(max(0.0, min(0.1, deadline - time.monotonic()))):
            if self._stop.is_set() and threading.current_thread() is self._thread:
                return None  # stopping: do not wait out a slow source
            if time.monotonic() >= deadline:
                self._count("overrun", f"source {self.source_name} did not answer within {timeout:g}s", overrun=True)
                return None
        with self._lock:
            if self._job is job:  # a caller may have started a fresh job after this one ended
                self._job = None
        if job.deferred:
            self._engine_mode = True
            return None
        if job.error is None and job.records is None:  # the job ended without an answer or an error
            job.error = f"{self.source_name}: the sample ended without a result"
        if job.error is not None:
            self._count("sample", job.error)
            return None
        with self._lock:
            self._samples += 1
        return job

    def _run_job(self, job: _Job) -> None:
        try:
            if self._source is None:
                self._source = get_source(self.source_name, **self._source_options)
            if self._engine_mode or engine_thread_only(self._source):
                job.deferred = True  # never read here: the engine's thread reads it between steps
                return
            records = self._source.sample()
            if not isinstance(records, list) or not all(isinstance(r, DeviceMemory) for r in records):
                raise TypeError(
                    f"source {self.source_name} returned {type(records).__name__}, not a list of DeviceMemory"
                )
            job.records = records
        except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt too: counted, never escapes
            # (this is the probe's own daemon thread: nothing above it would catch them, and an escaping
            # exception would print a thread traceback on the host's stderr)
            detail = one_line(exc) if isinstance(exc, Exception) else f"{type(exc).__name__}: {one_line(exc)}"
            job.error = f"{self.source_name}: {detail}"
        finally:
            job.done.set()

    def _write(self, records: list[DeviceMemory], sampled_at: float) -> int:
        with self._write_lock:
            return self._write_locked(records, sampled_at)

    def _write_locked(self, records: list[DeviceMemory], sampled_at: float) -> int:
        try:
            records = complete_records(self._source, records)
        except Exception as exc:  # noqa: BLE001 - the records are written without what could not be added
            self._count("complete", f"{self.source_name}: {one_line(exc)}")
        contexts = rank_contexts(self._source)
        read_at = time.time() - max(0.0, time.monotonic() - sampled_at)  # the sample's start, unix seconds
        written = 0
        for record in records:
            # The loop and run_once can finish samples together: one that began before the sample
            # already written for this device is older data, and never replaces it.
            if sampled_at < self._written_sampled_at.get(record.device, float("-inf")):
                continue
            self._written_sampled_at[record.device] = sampled_at
            context = contexts.get(record.device) or RankContext()
            with self._lock:
                sequence = self._sequence[record.device] = self._sequence.get(record.device, 0) + 1
                profile = _pick(self._profiles, record.device, context.profile)
                kv_cache = _pick(self._kv_caches, record.device, context.kv_cache)
                budget_verdict = _pick(self._budget_verdicts, record.device, None)
                reserved_peak = _pick(self._reserved_peaks, record.device, None)
                status = replace(self._status(), sampled_at=read_at)
                model_name, engine = self._engine
            snapshot = Snapshot(
                written_at=time.time(),
                started_at=self._started_at,
                sequence=sequence,
                host=self.host,
                pid=os.getpid(),
                device=record.device,
                memory=record,
                rank=context.rank if context.rank is not None else self.rank,
                pod=self.pod,
                profile=profile,
                kv_cache=kv_cache,
                probe=status,
                model_name=model_name,
                engine=engine,
                budget_verdict=budget_verdict,
                reserved_peak=reserved_peak,
            )
            if self._write_one(snapshot):
                written += 1
        return written

    def _write_one(self, snapshot: Snapshot) -> bool:
        try:
            try:
                write_snapshot(self.spool_dir, snapshot)
            except FileNotFoundError:
                os.makedirs(self.spool_dir, exist_ok=True)  # the directory went away: make it once, retry
                write_snapshot(self.spool_dir, snapshot)
            return True
        except OSError as exc:
            reason = errno.errorcode.get(exc.errno or 0, "") if exc.errno else ""
            self._count(f"write:{reason}", f"write {self.spool_dir}: {exc.strerror or one_line(exc)}", write=True)
        except Exception as exc:  # noqa: BLE001 - e.g. a record that cannot be serialised
            self._count("write", f"write {self.spool_dir}: {one_line(exc)}", write=True)
        return False

    def _count(self, kind: str, message: str, *, write: bool = False, overrun: bool = False) -> None:
        with self._lock:
            if write:
                self._write_errors += 1
            else:
                self._errors += 1
            if overrun:
                self._overruns += 1
            self._last_error = message[:512]
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            log.warning("kvguard probe: %s (counted; further %s errors are logged at debug level)", message, kind)
        else:
            log.debug("kvguard probe: %s", message)


# The engine's own errors the probe raised again on the engine's thread (the last few): a caller that counts
# its own failures (the vLLM plugin's hooks) asks is_engine_error() and lets them pass. Exceptions take no
# weak references, hence a short queue.
_PASSED: deque[BaseException] = deque(maxlen=8)


def _passed_through(error: BaseException) -> None:
    _PASSED.append(error)


def is_engine_error(error: BaseException) -> bool:
    """Whether ``error`` is the engine's own pending error that a read of the probe took and raised again."""
    return any(error is passed for passed in list(_PASSED))


def _pick(explicit: Mapping[str | None, Any], device: str, from_source: Any) -> Any:
    if device in explicit:
        return explicit[device]
    if _ALL in explicit:
        return explicit[_ALL]
    return from_source


def _check_seconds(what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive number of seconds, got {value!r}")


def run_until_signalled(probe: Probe) -> None:
    """Run ``probe`` in the foreground until SIGINT or SIGTERM (``kvguard probe``)."""
    done = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: done.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    probe.start()
    try:
        while not done.wait(1.0):
            pass
    finally:
        probe.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------------- one probe per process
_PROBE: Probe | None = None
_PROBE_LOCK = threading.Lock()


def start(
    spool_dir: str, interval: float = DEFAULT_INTERVAL, source: str | Source = "auto", **options: Any
) -> Probe | None:
    """Start this process's probe (or return the running one). Never raises.

    Bad arguments (a missing spool directory, a non-positive or non-finite interval, an
    unknown source, an unknown option) log one WARNING on ``kvguard.probe`` and return
    None: the host process goes on without a probe. The :class:`Probe` constructor
    itself stays strict (ValueError). ``options``: ``rank``, ``sample_timeout``,
    ``source_options`` (see :class:`Probe`).
    """
    try:
        return start_strict(spool_dir, interval, source, **options)
    except Exception as exc:  # noqa: BLE001 - a bad argument must not take the serving process down
        log.warning("kvguard probe: not started: %s", one_line(exc))
        return None


def start_strict(
    spool_dir: str, interval: float = DEFAULT_INTERVAL, source: str | Source = "auto", **options: Any
) -> Probe:
    """:func:`start` that raises (ValueError, TypeError) for bad arguments: for callers that count
    their own failures, like the vLLM plugin."""
    global _PROBE
    with _PROBE_LOCK:
        if _PROBE is not None and _PROBE.running:
            return _PROBE
        _PROBE = Probe(spool_dir, source, interval, **options).start()
        return _PROBE


def stop(timeout: float = 2.0) -> None:
    """Stop this process's probe, if any. Never raises."""
    global _PROBE
    with _PROBE_LOCK:
        probe, _PROBE = _PROBE, None
    if probe is not None:
        try:
            probe.stop(timeout)
        except Exception as exc:  # noqa: BLE001
            log.debug("kvguard probe: stop failed: %s", one_line(exc))


def current() -> Probe | None:
    return _PROBE


def set_profile(profile: Profile | None, device: str | None = _ALL) -> bool:
    """Attach the startup profile to the snapshots. Never raises; False when not applied."""
    return _apply("set_profile", profile, device)


def set_kv_cache(kv_cache: KVCacheAllocation | None, device: str | None = _ALL) -> bool:
    """Attach the engine's KV-cache allocation to the snapshots. Never raises; False when not applied."""
    return _apply("set_kv_cache", kv_cache, device)


def set_budget_verdict(verdict: Any, device: str | None = _ALL) -> bool:
    """Attach the budget-time verdict to the snapshots. Never raises; False when not applied."""
    return _apply("set_budget_verdict", verdict, device)


def set_reserved_peak(reserved_peak: ReservedPeak | None, device: str | None = _ALL) -> bool:
    """Attach the profile run's reserved peak (vllm-mindspore) to the snapshots. Never raises; False when
    not applied."""
    return _apply("set_reserved_peak", reserved_peak, device)


def step_begin() -> None:
    """The engine's thread is about to run a step (the vLLM plugin calls this from ``execute_model``).

    Where this process's probe reads an engine-thread-only source (MindSpore), the read happens here once
    per interval. Raises nothing of kvguard's: only the engine's own pending error, which the read took
    from the runtime and hands back unchanged."""
    probe = _PROBE
    if probe is not None:
        probe.step_begin()


def step_end() -> None:
    """The engine's step returned or raised. Never raises."""
    probe = _PROBE
    if probe is not None:
        probe.step_end()


def set_engine(model_name: str | None, engine: str | int | None = None) -> bool:
    """Name the serving engine in the snapshots (vLLM's ``model_name`` and ``engine`` labels).
    Never raises; False when not applied."""
    return _apply("set_engine", model_name, engine)


def _apply(method: str, value: Any, device: Any) -> bool:
    probe = _PROBE
    if probe is None:
        return False
    try:
        getattr(probe, method)(value, device)
        return True
    except Exception as exc:  # noqa: BLE001 - a wrong value is logged and counted, never raised
        probe._count(method, f"{method}: {one_line(exc)}")
        return False


def _forget_after_fork() -> None:
    # Threads do not survive fork: the child must start its own probe (with its own pid).
    global _PROBE, _PROBE_LOCK
    _PROBE = None
    _PROBE_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
