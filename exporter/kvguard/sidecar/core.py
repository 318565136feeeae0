"""The sidecar's view of the world: spool snapshots, device sources and vLLM, joined per rank.

The spool, the device sources and vLLM are read in the background every ``interval`` (each read
bounded in time; the spool read also in files and bytes). ``Sidecar.observe()`` takes the latest
completed reads and judges every rank with the guard; it waits only for a source's very first
read, at most ``read_timeout``. The collector, ``/guard``, ``/readyz`` and ``kvguard check`` all
render the same Observation, so they never disagree.

Dead ranks age out: a rank whose snapshot was not written for ``forget_after`` seconds (by
default FORGET_AFTER_STALE_WINDOWS stale windows), or whose process is gone where the sidecar
can tell (same host and pid namespace as the writer, and /proc shows no live process of that
pid that started before the snapshot was written), is left out of the ranks, judged nowhere, and counted by reason. Its
file stays (the sidecar may not write the spool); a restarted engine writes under new pids.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from kvguard.guard.judge import CounterWindow, GuardInput, judge, standing
from kvguard.sidecar.limits import MAX_ENGINES, MAX_LABEL_CHARS, MAX_METRICS_BYTES, MAX_MODELS, MAX_PODS, MAX_RANKS
from kvguard.sidecar.observation import (
    DUPLICATE,
    ENGINE_ID_ENV,
    NOT_WRITTEN,
    POD_KEYS,
    PROCESS_EXITED,
    RANK_LABELS,
    SPOOL,
    VLLM_METRICS,
    DeviceView,
    Observation,
    RankView,
    aged_out_text,
    pod_labels_from_env,
)
from kvguard.sidecar.poller import Poller, PollState
from kvguard.spool.io import SpoolRead, SpoolReader, own_pid_namespace
from kvguard.spool.schema import Snapshot
from kvguard.text import safe_text
from kvguard.vllm.log import StartupLog
from kvguard.vllm.log_profile import log_profile

FORGET_AFTER_STALE_WINDOWS = 4
# A process that started this long after the snapshot was written is another one under a reused
# pid (/proc/stat's btime has whole seconds). Its last write, not the probe's start: a clock
# stepped forward then still needs to pass the process's whole uptime to make it look new.
PID_REUSE_TOLERANCE_SECONDS = 2.0


@dataclass
class SidecarConfig:
    spool_dir: str | None = None
    sources: Sequence[tuple[str, Any]] = ()  # (name, object with sample() -> list[DeviceMemory])
    vllm_metrics_url: str | None = None
    startup_log: StartupLog | None = None
    log_total_memory_bytes: int | None = None  # what the startup log does not state (kvguard check flags)
    log_gpu_memory_utilization: float | None = None
    interval: float = 5.0
    stale_after: float = 30.0
    forget_after: float | None = None  # None: FORGET_AFTER_STALE_WINDOWS x stale_after
    post_mortem: bool = False  # keep every rank as last written (check --post-mortem)
    read_timeout: float = 2.0
    counter_window_seconds: float = 300.0
    one_shot: bool = False  # counters since process start, not over a window
    pod_labels: dict[str, str] = field(default_factory=pod_labels_from_env)
    # The engine these ranks belong to, the same on every pod of a multi-node engine (serve --engine-id,
    # KVGUARD_ENGINE_ID: an LWS group, a Ray cluster); "": each rank's pod, else its host (engine_of()).
    engine_id: str = field(default_factory=lambda: safe_text(os.environ.get(ENGINE_ID_ENV, ""), 253))
    max_ranks: int = MAX_RANKS
    max_engines: int = MAX_ENGINES  # distinct (engine_id, engine) label pairs
    max_models: int = MAX_MODELS  # distinct model_name labels
    max_pods: int = MAX_PODS  # distinct (namespace, pod) label pairs
    max_label_chars: int = MAX_LABEL_CHARS
    max_metrics_bytes: int = MAX_METRICS_BYTES

    def engine_of(self, pod: str, host: str) -> str:
        """The engine a rank on ``pod`` / ``host`` belongs to: the configured one, else its pod, else its host."""
        return self.engine_id or pod or host


class Sidecar:
    def __init__(self, config: SidecarConfig):
        self.config = config
        self._lock = threading.Lock()
        self._window = CounterWindow(config.counter_window_seconds)
        # From the startup log (frozen), once: its profile, and its KV cache's bytes per block
        # where the log counts the blocks itself (else vLLM's block size does, per scrape).
        log = config.startup_log
        self._log_profile, self._log_missing = (
            log_profile(log, config.log_total_memory_bytes, config.log_gpu_memory_utilization) if log else (None, None)
        )
        self._log_block_bytes = (
            log.available_kv_cache_bytes // log.num_gpu_blocks
            if log and log.available_kv_cache_bytes and log.num_gpu_blocks
            else None
        )
        self._spool_reader = SpoolReader(config.spool_dir) if config.spool_dir else None
        self._spool = Poller(SPOOL, self._read_spool, config.read_timeout) if config.spool_dir else None
        self._first_read_done = False
        # A source with a time limit of its own (npu-smi's subprocess timeout) is polled with that
        # limit, so the poller does not call a read late that the source itself would still allow.
        self._device_pollers = [
            Poller(name, source.sample, max(config.read_timeout, _own_timeout(source)))
            for name, source in config.sources
        ]
        self._vllm = None
        if config.vllm_metrics_url:
            from kvguard.vllm import metrics as vllm_metrics

            url, timeout = config.vllm_metrics_url, config.read_timeout
            self._vllm = Poller(VLLM_METRICS, lambda: vllm_metrics.fetch(url, timeout), timeout)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.forget_after = (
            config.forget_after if config.forget_after is not None else FORGET_AFTER_STALE_WINDOWS * config.stale_after
        )
        self._host = socket.gethostname()
        self._pid_namespace = own_pid_namespace()
        # What was last logged (log_changes): each source's up, each rank's state and reasons.
        self._log_lock = threading.Lock()
        self._logged_sources: dict[str, bool] = {}
        self._logged_ranks: dict[tuple, tuple] = {}
        self._logged_no_ranks: str | None = None
        # The web config's reload status, for the metrics (set by the server that has one).
        self.web_config_status: Callable[[], tuple] | None = None

    # -------------------------------------------------------------------- background reads

    def _background(self) -> list[Poller]:
        return ([self._spool] if self._spool else []) + self._device_pollers + ([self._vllm] if self._vllm else [])

    def refresh_background(self, wait: float = 0.0) -> None:
        """Start a read of the spool, every device source and vLLM (each one not already being
        read); wait at most ``wait`` for them all. Each is read at most once per call."""
        deadline = time.monotonic() + wait
        for poller in self._background():
            poller.refresh(0.0)
        for poller in self._background():
            poller.wait(max(0.0, deadline - time.monotonic()))

    def generation(self) -> tuple[int, ...]:
        """Changes whenever a background read completes or overruns: what a cached render keys on."""
        return tuple(p.generation for p in self._background())

    def start(self) -> None:
        self.refresh_background(wait=self.config.read_timeout)
        self._thread = threading.Thread(target=self._loop, name="kvguard-sidecar", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=self.config.read_timeout + 1)

    def _loop(self) -> None:
        while not self._stop.wait(self.config.interval):
            self.refresh_background()
            try:
                self.sample_counters()  # keeps the counter windows sampled between scrapes
            except Exception:  # pragma: no cover - a bad read is counted by its poller
                pass

    # -------------------------------------------------------------------- observation

    def _read_spool(self) -> SpoolRead:
        """The spool, bounded in files and bytes; a bad file is only counted, a directory that
        cannot be listed raises (the source is down, not zero ranks)."""
        reader = self._spool_reader
        assert reader is not None  # polled only with a spool directory, as the reader is made (__init__)
        result = reader.read()
        if result.listing_error is not None:
            raise OSError(f"cannot list spool directory {self.config.spool_dir}: {result.listing_error}")
        # A snapshot's device processes are never judged or exported (the device sources' are):
        # not keeping them between reads takes a third off the peak RSS of a spool at its byte
        # budget, where the last read is still held while the next one is made (bench_spool.py).
        result.snapshots[:] = [
            replace(snap, memory=replace(snap.memory, processes=())) if snap.memory.processes else snap
            for snap in result.snapshots
        ]
        return result

    def _first_reads(self) -> None:
        """Before any read has finished, wait for the first one (bounded): later calls never wait."""
        if self._first_read_done:
            return
        pollers = self._background()
        if any(p.state.success_at is None and p.state.errors_total == 0 for p in pollers):
            self.refresh_background(wait=self.config.read_timeout)
        self._first_read_done = True

    def sample_counters(self) -> None:
        """Feed every rank's allocator counters from the latest spool read to the counter
        windows, judging nothing: what a scrape would feed them, between scrapes."""
        if self.config.one_shot:
            return
        spool_read = self._spool.state.value if self._spool else None
        newest, _ = newest_per_rank((spool_read or SpoolRead()).snapshots, self._label_key)
        newest, _, _ = self._living(newest, time.time())
        with self._lock:
            self._counter_increases(newest, time.monotonic())

    def observe(self) -> Observation:
        return self._observe([(self._log_profile, self._log_missing)])[0]

    def observe_as(self, logs: Sequence[StartupLog]) -> list[Observation]:
        """One observation per log in ``logs``, each the configured startup log judged as another era row
        (kvguard.vllm.log_profile.as_row: only its profile differs), all from the same reads of every source
        judged at the same moment: ``kvguard check --from-log`` judges a log whose lines leave several rows so."""
        config = self.config
        return self._observe(
            [log_profile(log, config.log_total_memory_bytes, config.log_gpu_memory_utilization) for log in logs]
        )

    def _observe(self, log_profiles: Sequence[tuple[Any, str | None]]) -> list[Observation]:
        """An observation per (log profile, why none) pair: the sources' latest reads, the ranks judged once
        per pair (a rank whose profile is its snapshot's the same in each)."""
        config = self.config
        self._first_reads()
        sources: list[PollState] = []
        spool_read = SpoolRead()
        if self._spool:
            state = self._spool.state
            sources.append(state)
            if state.value is not None:
                spool_read = state.value
        device_states = [p.state for p in self._device_pollers]
        vllm_state = self._vllm.state if self._vllm else None
        sources.extend(device_states)
        if vllm_state:
            sources.append(vllm_state)
        with self._lock:
            judged, skipped, aged_out, cut, truncated = self._ranks(
                spool_read, vllm_state.value if vllm_state else None, log_profiles
            )
        devices = []
        for state in device_states:
            for memory in state.value or []:
                labels = {"device": memory.device, "source": state.name, **config.pod_labels}
                devices.append(DeviceView(labels, memory))
        web_config = self.web_config_status() if self.web_config_status else None
        return [
            Observation(
                ranks=ranks,
                devices=devices,
                sources=sources,
                spool_snapshots=len(spool_read.snapshots),
                skipped=skipped,
                interval_seconds=config.interval,
                spool_clamped=spool_read.clamped,
                no_ranks_why="" if ranks else self._no_ranks_why(sources, spool_read, aged_out),
                aged_out=aged_out,
                cut=cut,
                labels_truncated=truncated,
                max_metrics_bytes=config.max_metrics_bytes,
                web_config=web_config,
            )
            for ranks in judged
        ]

    def log_changes(self, observation: Observation) -> None:
        """Log what changed since the last observation, once per change: a source going down (with
        its error) or coming back, a rank's guard state or reasons, no rank left to judge. ``serve``
        calls it once per refresh (kvguard.sidecar.exposition); an unchanged world logs nothing.
        ``check`` observes once and says its verdict itself, so it does not log changes."""
        from kvguard.logs import LOGGER, event

        logger = logging.getLogger(LOGGER)
        with self._log_lock:
            for state in observation.sources:
                before = self._logged_sources.get(state.name)
                if before is None and state.up:
                    self._logged_sources[state.name] = True
                elif before is not None and before == state.up:
                    continue
                elif state.up:
                    self._logged_sources[state.name] = True
                    event(logger, logging.INFO, "source up", source=state.name)
                elif state.last_error:  # down, and a read has said why
                    self._logged_sources[state.name] = False
                    event(logger, logging.WARNING, "source down", source=state.name, error=state.last_error)
            seen: dict[tuple, tuple] = {}
            for view in observation.ranks:
                key = tuple(view.labels.get(k, "") for k in RANK_LABELS)
                now = (view.verdict.state, tuple(r.code for r in view.verdict.reasons))
                seen[key] = now
                logged = self._logged_ranks.get(key)
                if logged == now:
                    continue
                level = {"ok": logging.INFO, "warning": logging.WARNING}.get(now[0], logging.ERROR)
                event(
                    logger,
                    level,
                    "guard state",
                    pod=view.labels.get("pod", ""),
                    namespace=view.labels.get("namespace", ""),
                    rank=view.labels.get("rank", ""),
                    pid=view.labels.get("pid", ""),
                    device=view.labels.get("device", ""),
                    engine_id=view.labels.get("engine_id", ""),
                    state=now[0],
                    previous=logged[0] if logged else "",
                    reasons=",".join(now[1]),
                    headroom_bytes=view.verdict.headroom_bytes,
                )
            self._logged_ranks = seen
            why = None if observation.ranks else observation.no_ranks_why
            if why != self._logged_no_ranks and why is not None:
                event(logger, logging.WARNING, "no ranks to judge", why=why)
            self._logged_no_ranks = why

    def _no_ranks_why(self, sources: list[PollState], spool_read: SpoolRead, aged_out: Counter) -> str:
        config = self.config
        why = [f"{s.name} down: {s.last_error}" for s in sources if not s.up and s.last_error]
        if config.spool_dir and self._spool and self._spool.state.up:
            skipped = sum(spool_read.skipped.values())
            why.append(f"no snapshots in {config.spool_dir}" + (f" ({skipped} file(s) skipped)" if skipped else ""))
        if aged_out:
            why.append(aged_out_text(aged_out))
        if not config.spool_dir and config.startup_log is None and not config.vllm_metrics_url:
            why.append("no spool, startup log or vLLM metrics configured")
        return "; ".join(why) or "nothing to read"

    def _living(
        self, newest: dict[tuple, Snapshot], now_wall: float
    ) -> tuple[dict[tuple, Snapshot], Counter, set[tuple]]:
        """The ranks that have not aged out (the module's docstring), how many did, by reason, and
        the keys of those whose writer /proc shows alive here (a probe of this host and pid namespace)."""
        living: dict[tuple, Snapshot] = {}
        aged_out: Counter = Counter()
        alive: set[tuple] = set()
        if self.config.post_mortem:
            return dict(newest), aged_out, alive
        for key, snap in newest.items():
            local = snap.host == self._host and snap.pid_namespace and snap.pid_namespace == self._pid_namespace
            if now_wall - snap.written_at > self.forget_after:
                aged_out[NOT_WRITTEN] += 1
            elif local and process_gone(snap.pid, snap.written_at):
                aged_out[PROCESS_EXITED] += 1
            else:
                living[key] = snap
                if local and snap.pid > 0:
                    alive.add(key)
        return living, aged_out, alive

    def _within_caps(
        self,
        newest: dict[tuple, Snapshot],
        vllm,
        alive: AbstractSet[tuple] = frozenset(),
        now_wall: float | None = None,
    ) -> tuple[list[tuple[tuple, Snapshot]], Counter]:
        """The ranks within max_ranks and the distinct engine, model and pod caps, and how many were
        cut, by the first cap each met. Admitted liveliest first, never in label order alone (names
        that sort first would push live ranks out): believably dated before dated in the future, a
        writer /proc shows alive here (``alive``) before one it cannot, fresh before stale (written
        within stale_after of ``now_wall``), then label order. Not by the moment of writing: each
        probe rewrites at its own, and the admitted set would change from one refresh to the next."""
        config = self.config
        kept: list[tuple[tuple, Snapshot]] = []
        cut: Counter = Counter()
        engines: set = set()
        models: set = set()
        pods: set = set()
        now = time.time() if now_wall is None else now_wall
        order = sorted(
            newest.items(),
            key=lambda item: (
                item[1].clamped_from is not None,
                item[0] not in alive,
                now - item[1].written_at > config.stale_after,
                item[0],
            ),
        )
        for key, snap in order:
            pod = (key[4], key[3])
            engine = vllm.engine_for(snap.model_name, snap.engine) if vllm else None
            engine_label = (config.engine_of(key[3], snap.host), snap.engine or (engine.engine if engine else ""))
            model = snap.model_name or (engine.model_name if engine else "")
            if len(kept) >= config.max_ranks:
                cut["max_ranks"] += 1
            elif engine_label not in engines and len(engines) >= config.max_engines:
                cut["max_engines"] += 1
            elif model not in models and len(models) >= config.max_models:
                cut["max_models"] += 1
            elif pod not in pods and len(pods) >= config.max_pods:
                cut["max_pods"] += 1
            else:
                kept.append((key, snap))
                engines.add(engine_label)
                models.add(model)
                pods.add(pod)
        kept.sort(key=lambda item: item[0])
        return kept, cut

    def _truncate(self, labels: dict[str, str]) -> int:
        """Cut each label value to max_label_chars; how many were cut."""
        limit = self.config.max_label_chars
        cut = 0
        for name, value in labels.items():
            if len(value) > limit:
                labels[name] = value[:limit]
                cut += 1
        return cut

    def _ranks(
        self, spool_read: SpoolRead, vllm, log_profiles: Sequence[tuple[Any, str | None]]
    ) -> tuple[list[list[RankView]], Counter, Counter, Counter, int]:
        """The ranks judged once per (log profile, why none) pair in ``log_profiles`` (a list of views each),
        and what was skipped, aged out, cut and truncated (the same for each)."""
        config = self.config
        skipped = Counter(spool_read.skipped)
        log = config.startup_log
        now_wall, now = time.time(), time.monotonic()

        newest, duplicates = newest_per_rank(spool_read.snapshots, self._label_key)
        if duplicates:
            skipped[DUPLICATE] += duplicates
        newest, aged_out, alive = self._living(newest, now_wall)
        admitted, cut = self._within_caps(newest, vllm, alive, now_wall)
        newest = dict(admitted)
        increases = {} if config.one_shot else self._counter_increases(newest, now)

        judged: list[list[RankView]] = [[] for _ in log_profiles]
        truncated = 0
        for key, snap in admitted:
            labels = dict(zip(RANK_LABELS, key))  # already cut (_label_key); counted here
            truncated += sum(len(value) > config.max_label_chars for value in self._full_label_key(snap))
            age = max(0.0, now_wall - snap.written_at)
            stale = age > config.stale_after
            # The vLLM engine this rank belongs to (its snapshot names it, or vLLM has only one).
            engine = vllm.engine_for(snap.model_name, snap.engine) if vllm else None
            labels.update(
                model_name=snap.model_name or (engine.model_name if engine else ""),
                engine=snap.engine or (engine.engine if engine else ""),
                engine_id=config.engine_of(labels["pod"], snap.host),
            )
            truncated += self._truncate(labels)
            blocks, kv_bytes = (
                self._engine_kv_cache(engine)
                if snap.kv_cache is None
                else (snap.kv_cache.num_blocks, snap.kv_cache.kv_cache_bytes)
            )
            memory = snap.memory
            retries, ooms = increases.get(key, (memory.alloc_retries, memory.ooms))
            for views, (logged_profile, log_missing) in zip(judged, log_profiles):
                profile, origin = (
                    (snap.profile, "snapshot") if snap.profile else (logged_profile, "log" if logged_profile else None)
                )
                missing = log_missing if profile is None else None
                verdict = judge(
                    GuardInput(
                        profile,
                        kv_cache_bytes=kv_bytes,
                        memory=memory,
                        kv_cache_outside_allocator=bool(snap.kv_cache and snap.kv_cache.outside_allocator),
                        alloc_retries_increase=retries,
                        ooms_increase=ooms,
                        snapshot_stale=stale,
                        no_profile_detail=missing,
                        # MindSpore's reserved peak belongs with the snapshot's own profile.
                        reserved_peak=snap.reserved_peak if origin == "snapshot" else None,
                        unknown_profile_fields=snap.profile_unknown_fields if origin == "snapshot" else (),
                    )
                )
                at_budget = snap.budget_verdict
                verdict = standing(verdict, at_budget, kv_cache_exists=snap.kv_cache is not None)
                views.append(
                    RankView(
                        dict(labels),
                        snap,
                        profile,
                        origin,
                        blocks,
                        engine.kv_cache_usage_ratio if engine else None,
                        age,
                        stale,
                        verdict,
                        at_budget,
                    )
                )

        if not admitted and (log is not None or vllm is not None):
            # No probe: judge each engine vLLM's metrics describe (or the one the log does).
            for engine in vllm.engines if vllm and vllm.engines else (None,):
                labels = {
                    "device": "",
                    "rank": "",
                    "pid": "",
                    **config.pod_labels,
                    "model_name": engine.model_name if engine else "",
                    "engine": engine.engine if engine else "",
                    "engine_id": config.engine_of(config.pod_labels.get("pod", ""), self._host),
                }
                blocks, kv_bytes = self._engine_kv_cache(engine)
                truncated += self._truncate(labels)
                for views, (log_profile, log_missing) in zip(judged, log_profiles):
                    verdict = judge(GuardInput(log_profile, kv_cache_bytes=kv_bytes, no_profile_detail=log_missing))
                    views.append(
                        RankView(
                            dict(labels),
                            None,
                            log_profile,
                            "log" if log_profile else None,
                            blocks,
                            engine.kv_cache_usage_ratio if engine else None,
                            None,
                            False,
                            verdict,
                        )
                    )
        return judged, skipped, aged_out, cut, truncated

    def _counter_increases(self, newest: dict[tuple, Snapshot], now: float) -> dict[tuple, tuple]:
        """Feed each rank's alloc retries and OOMs to the counter window (ranks in label-key
        order) and forget the ranks gone from the spool; (retries, ooms) growth per label key.
        The caller holds the lock."""
        increases = {}
        for key, snap in sorted(newest.items()):
            window_key = (snap.host, snap.pid, snap.device)
            increases[key] = (
                self._window.observe(window_key + ("retries",), now, snap.memory.alloc_retries),
                self._window.observe(window_key + ("ooms",), now, snap.memory.ooms),
            )
        live = {(s.host, s.pid, s.device) + (c,) for s in newest.values() for c in ("retries", "ooms")}
        self._window.forget_except(live)
        return increases

    def _full_label_key(self, snap: Snapshot) -> tuple:
        """The rank's label values (RANK_LABELS) as the snapshot and the pod's environment give them."""
        pod = {k: snap.pod.get(k) or self.config.pod_labels.get(k, "") for k in POD_KEYS}
        return (
            snap.device,
            "" if snap.rank is None else str(snap.rank),
            str(snap.pid),
            pod["pod"],
            pod["namespace"],
            pod["container"],
        )

    def _label_key(self, snap: Snapshot) -> tuple:
        """The rank's label values as exported: each cut to max_label_chars before ranks are told
        apart, so that two ranks whose values differ only past the cut are one series (the newest
        snapshot is kept, the other counted as a duplicate), never two series with one label set."""
        limit = self.config.max_label_chars
        return tuple(value[:limit] for value in self._full_label_key(snap))

    def _engine_kv_cache(self, vllm) -> tuple[int | None, int | None]:
        """(blocks, bytes) the engine allocated as vLLM's metrics (``vllm``: that engine's
        VllmEngineState, or None) or the startup log tell it (a rank's probe count, where there
        is one, comes first)."""
        log = self.config.startup_log
        blocks = (vllm.num_gpu_blocks if vllm else None) or (log.num_gpu_blocks if log else None)
        block_bytes = self._log_block_bytes
        if log is not None and log.available_kv_cache_bytes and log.num_gpu_blocks is None:
            block_size = vllm.block_size if vllm else None
            log_blocks = log.kv_cache_tokens // block_size if log.kv_cache_tokens and block_size else None
            if log_blocks:
                block_bytes = log.available_kv_cache_bytes // log_blocks
        if blocks and block_bytes:
            return blocks, blocks * block_bytes
        if log is not None and log.available_kv_cache_bytes is not None:
            return blocks, max(0, log.available_kv_cache_bytes)
        return blocks, None


def _own_timeout(source: Any) -> float:
    value = getattr(source, "timeout_seconds", None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else 0.0


_boot_time: list[float] = []


def _booted_at() -> float | None:
    """Unix time of this host's boot (/proc/stat btime), or None without /proc."""
    if not _boot_time:
        try:
            with open("/proc/stat", "rb") as handle:
                for line in handle:
                    if line.startswith(b"btime "):
                        _boot_time.append(float(line.split()[1]))
                        break
        except (OSError, ValueError, IndexError):
            return None
    return _boot_time[0] if _boot_time else None


def process_gone(pid: int, written_at: float) -> bool:
    """True when /proc shows that process ``pid``, which wrote a snapshot at ``written_at`` (unix
    seconds), is no more: no process has that pid, it is a zombie, or the one that has it started
    after that write (the pid was reused). False whenever /proc cannot tell."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read(4096)
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return False
    booted = _booted_at()
    try:
        # proc(5): fields count from 3 (state) after the ")" ending comm; 22 is starttime, in ticks since boot.
        fields = stat.rsplit(b")", 1)[1].split()
        if fields[0] in (b"Z", b"X"):  # exited, not yet reaped
            return True
        start = booted + int(fields[19]) / os.sysconf("SC_CLK_TCK") if booted is not None else None
    except (IndexError, ValueError, OSError):
        return False
    return start is not None and start > written_at + PID_REUSE_TOLERANCE_SECONDS


def _recency(snap: Snapshot) -> tuple[bool, float]:
    return snap.clamped_from is None, snap.written_at


def newest_per_rank(
    snapshots: Sequence[Snapshot], label_key: Callable[[Snapshot], tuple]
) -> tuple[dict[tuple, Snapshot], int]:
    """The newest snapshot per rank label key, and how many snapshots shared a key with another."""
    newest: dict[tuple, Snapshot] = {}
    duplicates = 0
    for snap in snapshots:
        key = label_key(snap)
        if key in newest:
            duplicates += 1
            # A snapshot dated in the future (clamped) never wins over one with a believable date.
            if _recency(newest[key]) >= _recency(snap):
                continue
        newest[key] = snap
    return newest, duplicates
