"""The probe with a source that may be read only on the engine's thread (MindSpore's, whose memory_stats()
drains the runtime pipeline and takes the engine's pending error): every read happens on the thread that calls
the step hooks, at most once per interval; the engine's own error passes back unchanged; the snapshot stays
fresh while the engine idles between steps and ages inside a step that outlasts the sample timeout.
(The same on MindSpore's real runtime: tests/upstream/test_probe_mindspore_runtime.py.)"""

from __future__ import annotations

import threading
import time

import pytest

from kvguard.probe import Probe
from kvguard.records import DeviceMemory
from kvguard.sources import EngineError, SourceError
from kvguard.spool.io import read_spool

GIB = 1 << 30


class EngineOnlySource:
    name = "engine-only"
    engine_thread_only = True

    def __init__(self):
        self.threads: list[str] = []
        self.fail_with: BaseException | None = None  # the engine's pending error, told as such
        self.broken: str | None = None  # the source's own failure

    def sample(self):
        self.threads.append(threading.current_thread().name)
        if self.broken is not None:
            raise SourceError(f"{self.name}: {self.broken}")
        if self.fail_with is not None:
            raise EngineError(self.fail_with, self.name)
        return [DeviceMemory(device="npu:0", source=self.name, allocated_bytes=GIB, reserved_bytes=2 * GIB)]


def _wait_for(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def started(tmp_path):
    source = EngineOnlySource()
    probe = Probe(str(tmp_path), source, interval=0.05).start()
    assert _wait_for(lambda: probe.status.sampling == "engine-step")
    yield probe, source, tmp_path
    probe.stop()


def test_the_probe_threads_never_read_an_engine_thread_source(started):
    probe, source, _ = started
    time.sleep(0.3)  # several of the probe's own ticks
    assert source.threads == []
    started = time.monotonic()
    for _ in range(20):
        probe.step_begin()
        time.sleep(0.01)
        probe.step_end()
    elapsed = time.monotonic() - started
    assert source.threads and set(source.threads) == {threading.current_thread().name}
    # At most one read per interval (0.05 s) of steps, and at least one.
    assert 1 <= len(source.threads) <= elapsed / 0.05 + 1


def test_the_engines_reading_is_written_by_the_probe(started):
    probe, _, spool = started
    probe.run_once()  # the plugin's first reading at init_device
    probe.step_begin()
    probe.step_end()
    assert _wait_for(lambda: len(read_spool(str(spool)).snapshots) == 1)
    snapshot = read_spool(str(spool)).snapshots[0]
    assert snapshot.memory.reserved_bytes == 2 * GIB
    assert snapshot.probe.sampling == "engine-step"
    assert snapshot.probe.engine_thread_seconds_total > 0


def test_once_serving_the_last_reading_is_rewritten_between_steps_and_not_inside_a_long_one(started):
    probe, source, spool = started
    probe.run_once()  # startup: the pool changes without steps, so no rewrite yet
    first = read_spool(str(spool)).snapshots[0]
    time.sleep(0.3)
    assert read_spool(str(spool)).snapshots[0].sequence == first.sequence
    probe.step_begin()  # the first step: a reading (due), and the engine now serves
    probe.step_end()
    reads = len(source.threads)
    assert _wait_for(lambda: read_spool(str(spool)).snapshots[0].sequence >= first.sequence + 4)
    fresh = read_spool(str(spool)).snapshots[0]
    assert fresh.written_at > first.written_at
    assert fresh.written_at - fresh.probe.sampled_at >= 0.05  # the same reading, written again later
    assert len(source.threads) == reads  # rewritten, not read again
    probe._engine_sampled = time.monotonic() + 3600  # no reading at this step's start: only the step's length counts
    probe.step_begin()  # a step that outlasts the sample timeout (0.05 s)
    time.sleep(0.2)
    during = read_spool(str(spool)).snapshots[0].sequence
    time.sleep(0.3)
    assert read_spool(str(spool)).snapshots[0].sequence == during
    probe.step_end()


def test_the_engines_own_error_is_raised_again_unchanged_on_its_thread(started):
    probe, source, _ = started
    probe.run_once()  # a first reading succeeded: the source works
    error = RuntimeError("For 'Gather', the 'input_indices' should be in the range [0, 4), but got 99")
    source.fail_with = error
    time.sleep(0.06)
    error.__cause__ = KeyError("what the engine chained")
    with pytest.raises(RuntimeError) as raised:
        probe.step_begin()
    assert raised.value is error and isinstance(error.__cause__, KeyError)  # the same object, as it was
    probe.step_end()
    assert probe.status.errors_total >= 1 and "Gather" in probe.status.last_error


def test_the_sources_own_failure_is_counted_not_raised(started):
    probe, source, _ = started
    source.broken = "The pointer[device_context] is null."
    assert probe.run_once() == 0
    time.sleep(0.06)
    probe.step_begin()
    probe.step_end()
    assert probe.status.samples_total == 0 and "device_context" in probe.status.last_error


def test_the_step_hooks_do_nothing_for_a_source_read_on_the_probes_thread(tmp_path):
    class Ordinary:
        name = "ordinary"

        def __init__(self):
            self.threads = []

        def sample(self):
            self.threads.append(threading.current_thread().name)
            return [DeviceMemory(device="cuda:0", source=self.name, allocated_bytes=GIB, reserved_bytes=GIB)]

    source = Ordinary()
    probe = Probe(str(tmp_path), source, interval=0.05).start()
    try:
        assert _wait_for(lambda: len(source.threads) >= 2)
        for _ in range(10):
            probe.step_begin()
            probe.step_end()
        assert threading.current_thread().name not in source.threads
        assert probe.status.sampling == "thread"
    finally:
        probe.stop()
