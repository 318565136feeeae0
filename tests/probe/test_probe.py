"""The in-process probe: snapshots in the spool, and every way a source or the disk can fail it."""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest

from kvguard import probe as probe_module
from kvguard.budget.estimator import Profile
from kvguard.probe import Probe, pod_identity
from kvguard.records import DeviceMemory, KVCacheAllocation
from kvguard.sources import RankContext, SourceError
from kvguard.spool.io import read_spool
from kvguard.spool.schema import SCHEMA_VERSION, snapshot_filename

GIB = 1 << 30
PROFILE = Profile(
    total_memory_bytes=64 * GIB,
    gpu_memory_utilization=0.9,
    weights_bytes=15 * GIB,
    peak_allocated_increase_bytes=GIB,
    peak_reserved_increase_bytes=2 * GIB,
    non_torch_increase_bytes=0,
)
KV = KVCacheAllocation(num_blocks=1000, block_bytes=917504, block_size=16)
ENV = {"POD_NAME": "vllm-0", "POD_NAMESPACE": "serving", "CONTAINER_NAME": "vllm", "NODE_NAME": "node-7"}


def record(device="npu:0", allocated=10 * GIB, reserved=12 * GIB):
    return DeviceMemory(device=device, source="test", allocated_bytes=allocated, reserved_bytes=reserved)


class Fixed:
    name = "fixed"

    def __init__(self, *devices):
        self.devices = devices or ("npu:0",)

    def sample(self):
        return [record(device) for device in self.devices]


class Failing:
    name = "failing"

    def __init__(self):
        self.fail = True

    def sample(self):
        if self.fail:
            raise SourceError("mindspore: The pointer[device_context] is null.")
        return [record()]


class Hanging:
    """A source whose sample blocks until the test releases it."""

    name = "hanging"

    def __init__(self):
        self.release = threading.Event()
        self.entered = threading.Event()

    def sample(self):
        self.entered.set()
        self.release.wait()
        return [record()]


@pytest.fixture
def spool(tmp_path):
    return str(tmp_path / "spool")


def read(spool):
    result = read_spool(spool)
    assert not result.skipped, result.errors
    return {s.device: s for s in result.snapshots}


def test_one_snapshot_per_device_with_identity(spool):
    written = Probe(spool, Fixed("npu:0", "npu:1"), 5.0, rank=2, environ=ENV).run_once()
    snapshots = read(spool)
    assert written == 2
    assert sorted(snapshots) == ["npu:0", "npu:1"]
    snap = snapshots["npu:1"]
    assert (snap.schema, snap.pid, snap.rank, snap.device) == (SCHEMA_VERSION, os.getpid(), 2, "npu:1")
    assert snap.pod == {"pod": "vllm-0", "namespace": "serving", "container": "vllm", "node": "node-7"}
    assert snap.memory == record("npu:1")
    assert snap.probe.samples_total == 1 and snap.probe.interval_seconds == 5.0


def test_pod_identity_comes_from_downward_api_variables():
    assert pod_identity({"POD_NAME": "p", "NODE_NAME": "n", "OTHER": "x"}) == {"pod": "p", "node": "n"}
    assert pod_identity({}) == {}


def test_rank_defaults_to_the_environment(spool):
    Probe(spool, Fixed(), environ={"RANK": "5"}).run_once()
    assert read(spool)["npu:0"].rank == 5


def test_each_write_replaces_the_snapshot_atomically(spool):
    runner = Probe(spool, Fixed(), environ={})
    for _ in range(3):
        runner.run_once()
    assert sorted(os.listdir(spool)) == [snapshot_filename(runner.host, os.getpid(), "npu:0")]
    assert read(spool)["npu:0"].sequence == 3


def test_profile_and_kv_cache_set_after_start_are_written(spool):
    runner = Probe(spool, Fixed(), environ={})
    runner.run_once()
    runner.set_profile(PROFILE)
    runner.set_kv_cache(KV)
    runner.run_once()
    snap = read(spool)["npu:0"]
    assert (snap.profile, snap.kv_cache) == (PROFILE, KV)


def test_a_device_specific_profile_beats_the_probe_wide_one(spool):
    other = Profile(**{**PROFILE.to_dict(), "weights_bytes": 1})
    runner = Probe(spool, Fixed("npu:0", "npu:1"), environ={})
    runner.set_profile(PROFILE)
    runner.set_profile(other, device="npu:1")
    runner.run_once()
    snapshots = read(spool)
    assert (snapshots["npu:0"].profile, snapshots["npu:1"].profile) == (PROFILE, other)


def test_rank_context_from_the_source_is_written(spool):
    class Ranked(Fixed):
        def rank_contexts(self):
            return {"npu:1": RankContext(rank=1, profile=PROFILE, kv_cache=KV)}

    Probe(spool, Ranked("npu:0", "npu:1"), environ={}).run_once()
    snapshots = read(spool)
    assert (snapshots["npu:1"].rank, snapshots["npu:1"].profile, snapshots["npu:1"].kv_cache) == (1, PROFILE, KV)
    assert snapshots["npu:0"].profile is None


def test_wrong_profile_type_is_refused_by_the_probe(spool):
    with pytest.raises(TypeError, match="kvguard.budget.estimator.Profile"):
        Probe(spool, Fixed()).set_profile(PROFILE.to_dict())


def test_a_failing_source_is_counted_and_writes_nothing(spool):
    source = Failing()
    runner = Probe(spool, source, environ={})
    assert runner.run_once() == 0
    assert not os.path.exists(spool)
    source.fail = False
    runner.run_once()
    status = read(spool)["npu:0"].probe
    assert (status.samples_total, status.errors_total) == (1, 1)
    assert status.last_error == "failing: mindspore: The pointer[device_context] is null."


def test_a_source_returning_garbage_is_counted(spool):
    class Garbage:
        name = "garbage"

        def sample(self):
            return {"npu:0": 1}

    runner = Probe(spool, Garbage(), environ={})
    assert runner.run_once() == 0
    assert runner.status.errors_total == 1
    assert "not a list of DeviceMemory" in runner.status.last_error


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt()])
def test_a_source_raising_a_base_exception_is_an_error_not_a_sample(spool, exc, monkeypatch):
    class Exiting:
        name = "exiting"

        def sample(self):
            raise exc

    escaped = []
    monkeypatch.setattr(threading, "excepthook", escaped.append)  # a thread traceback on the host's stderr
    runner = Probe(spool, Exiting(), environ={})
    assert runner.run_once() == 0
    status = runner.status
    assert (status.samples_total, status.errors_total) == (0, 1)
    assert status.last_error.startswith(f"exiting: {type(exc).__name__}")
    assert escaped == []
    assert not os.path.exists(spool)


def test_a_source_that_cannot_be_built_is_counted(spool):
    runner = Probe(spool, "torch", source_options={"backend": "rocm"}, environ={})
    assert runner.run_once() == 0
    assert runner.status.last_error == "torch: unknown torch backend 'rocm' (choose from auto, cuda, npu)"


def test_a_hanging_source_is_an_overrun_and_never_blocks_the_caller(spool):
    source = Hanging()
    runner = Probe(spool, source, environ={})
    assert runner.run_once(timeout=0.05) == 0
    assert runner.run_once(timeout=0.05) == 0
    assert source.entered.is_set()
    assert (runner.status.overruns_total, runner.status.errors_total) == (2, 2)
    assert runner.status.last_error == "source hanging did not answer within 0.05s"
    assert not os.path.exists(spool)  # no fresh data: the snapshot ages instead
    source.release.set()
    assert runner.run_once(timeout=30) == 1
    assert read(spool)["npu:0"].probe.overruns_total == 2


def test_a_hanging_source_is_sampled_once_at_a_time(spool):
    source = Hanging()
    calls = []
    original = source.sample
    source.sample = lambda: calls.append(1) or original()
    runner = Probe(spool, source, environ={})
    for _ in range(3):
        runner.run_once(timeout=0.01)
    assert len(calls) == 1  # callers wait on the hung sample, they never start another
    source.release.set()
    assert runner.run_once(timeout=30) == 1
    assert len(calls) == 2  # then one fresh sample: the hung one predates this call


class Gated:
    """A source that reads its value when a sample starts, then waits for the test's gate."""

    name = "gated"

    def __init__(self):
        self.allocated = 10 * GIB
        self.gate = threading.Event()
        self.entered = threading.Event()

    def sample(self):
        allocated = self.allocated
        self.entered.set()
        self.gate.wait(30)
        return [record(allocated=allocated, reserved=allocated)]


def test_run_once_never_writes_a_sample_taken_before_it_was_called(spool):
    # vLLM's plugin calls run_once right after loading the weights; a sample the probe's own loop began
    # before the load must not be what that call writes (it once did, under load: 0 bytes allocated).
    source = Gated()
    runner = Probe(spool, source, 3600, environ={}).start()
    try:
        assert source.entered.wait(30)  # the loop's sample is in flight, holding 10 GiB
        source.allocated = 16 * GIB  # the caller now loads more
        done = []
        caller = threading.Thread(target=lambda: done.append(runner.run_once(timeout=30)))
        caller.start()
        source.gate.set()
        caller.join(30)
        assert done == [1]
        assert read(spool)["npu:0"].memory.allocated_bytes == 16 * GIB
    finally:
        runner.stop(timeout=30)


def test_stop_returns_while_the_source_hangs(spool):
    source = Hanging()
    runner = Probe(spool, source, 0.01, sample_timeout=60, environ={}).start()
    assert source.entered.wait(30)
    runner.stop(timeout=30)
    assert not runner.running
    source.release.set()


def test_the_loop_writes_without_being_asked(spool):
    runner = Probe(spool, Fixed(), 0.01, environ={}).start()
    try:
        for _ in range(3000):
            if os.path.exists(spool) and read(spool):
                break
            threading.Event().wait(0.01)
    finally:
        runner.stop()
    assert read(spool)["npu:0"].sequence >= 1


def test_a_missing_spool_directory_is_created(spool):
    runner = Probe(spool, Fixed(), environ={})
    assert not os.path.exists(spool)
    assert runner.run_once() == 1
    assert runner.status.write_errors_total == 0
    assert "npu:0" in read(spool)


def test_a_spool_path_that_is_a_file_is_counted(tmp_path):
    path = tmp_path / "spool"
    path.write_text("not a directory")
    runner = Probe(str(path), Fixed(), environ={})
    assert runner.run_once() == 0
    assert runner.status.write_errors_total == 1
    assert runner.status.last_error == f"write {path}: Not a directory"


def test_a_read_only_spool_is_counted(tmp_path, monkeypatch):
    # What creating a file in a read-only directory gives a non-root user; patched so that the test
    # also runs as root (who may write there anyway).
    path = tmp_path / "spool"
    path.mkdir()

    def read_only(*args, dir=None, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", os.path.join(dir or "", "x.tmp"))

    monkeypatch.setattr("kvguard.spool.io.tempfile.mkstemp", read_only)
    runner = Probe(str(path), Fixed(), environ={})
    assert runner.run_once() == 0
    assert runner.status.write_errors_total == 1
    assert runner.status.last_error == f"write {path}: Permission denied"
    assert os.listdir(path) == []


def test_a_full_disk_is_counted_and_leaves_no_temporary_file(spool, monkeypatch):
    os.makedirs(spool)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("kvguard.spool.io.os.replace", no_space)
    runner = Probe(spool, Fixed(), environ={})
    assert runner.run_once() == 0
    assert runner.status.last_error == f"write {spool}: No space left on device"
    assert os.listdir(spool) == []


def test_a_planted_symlink_is_replaced_not_followed(spool, tmp_path):
    os.makedirs(spool)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    runner = Probe(spool, Fixed(), environ={})
    os.symlink(victim, os.path.join(spool, snapshot_filename(runner.host, os.getpid(), "npu:0")))
    runner.run_once()
    assert victim.read_text() == "keep"
    assert read(spool)["npu:0"].memory == record()


def test_snapshot_json_carries_the_documented_keys(spool):
    Probe(spool, Fixed(), environ={}).run_once()
    [name] = os.listdir(spool)
    with open(os.path.join(spool, name)) as handle:
        data = json.load(handle)
    assert set(data) >= {
        "kind",
        "schema",
        "written_at",
        "started_at",
        "sequence",
        "host",
        "pid",
        "rank",
        "device",
        "pod",
        "memory",
        "profile",
        "kv_cache",
        "probe",
    }
    assert set(data["probe"]) == {
        "samples_total",
        "errors_total",
        "write_errors_total",
        "last_error",
        "sampling",
        "sampled_at",
        "engine_thread_seconds_total",
        "skipped_total",
        "interval_seconds",
        "overruns_total",
    }


def test_bad_arguments_are_refused_at_construction(spool):
    with pytest.raises(ValueError, match="interval must be a positive number"):
        Probe(spool, Fixed(), 0)
    with pytest.raises(ValueError, match="unknown source 'gpu'"):
        Probe(spool, "gpu")
    with pytest.raises(ValueError, match="rank must be a non-negative integer"):
        Probe(spool, Fixed(), rank=-1)


# ---------------------------------------------------------------------------- the process-wide probe


@pytest.fixture
def global_probe():
    probe_module.stop()
    yield probe_module
    probe_module.stop()


@pytest.mark.parametrize(
    ("args", "options", "message"),
    [
        ((0,), {}, "interval must be a positive number of seconds, got 0"),
        ((float("nan"),), {}, "interval must be a positive number of seconds, got nan"),
        ((5.0, "gpu"), {}, "unknown source 'gpu'"),
        ((5.0, "auto"), {"rank": -1}, "rank must be a non-negative integer, got -1"),
        ((5.0, "auto"), {"colour": "blue"}, "unexpected keyword argument 'colour'"),
    ],
)
def test_start_with_bad_arguments_warns_once_and_returns_none(global_probe, spool, caplog, args, options, message):
    with caplog.at_level("WARNING", logger="kvguard.probe"):
        assert global_probe.start(spool, *args, **options) is None
    assert global_probe.current() is None
    [warning] = [r for r in caplog.records if r.name == "kvguard.probe"]
    assert warning.levelname == "WARNING" and message in warning.getMessage()


def test_start_returns_the_running_probe(global_probe, spool):
    first = global_probe.start(spool, 60, Fixed())
    assert global_probe.start(spool, 60, Fixed()) is first
    assert global_probe.current() is first and first.running


def test_set_profile_without_a_probe_does_nothing(global_probe):
    assert global_probe.set_profile(PROFILE) is False
    assert global_probe.set_kv_cache(KV) is False


def test_module_set_profile_never_raises_on_a_wrong_value(global_probe, spool):
    running = global_probe.start(spool, 60, Fixed())
    assert global_probe.set_profile({"weights_bytes": 1}) is False
    assert running.status.errors_total == 1
    assert global_probe.set_kv_cache(KV) is True


def test_stop_leaves_the_snapshot_to_age(global_probe, spool):
    running = global_probe.start(spool, 60, Fixed())
    running.run_once()
    global_probe.stop()
    assert global_probe.current() is None
    assert not running.running
    assert "npu:0" in read(spool)


class UnprintableError(Exception):
    def __str__(self):
        raise RuntimeError("__str__ itself fails")


class Unprintable:
    name = "unprintable"

    def sample(self):
        raise UnprintableError()


def test_an_exception_whose_str_raises_is_counted_not_printed(spool, capfd):
    probe = Probe(spool, Unprintable(), interval=0.05)
    probe.start()
    try:
        for _ in range(200):
            if probe.status.errors_total >= 3:
                break
            threading.Event().wait(0.02)
    finally:
        probe.stop()
    assert probe.status.errors_total >= 3
    assert probe.status.last_error == "unprintable: UnprintableError"
    assert "Traceback" not in capfd.readouterr().err


def test_set_engine_names_the_engine_in_every_snapshot_and_refuses_wrong_types(tmp_path):
    from kvguard.spool.io import read_spool

    class One:
        name = "one"

        def sample(self):
            from kvguard.records import DeviceMemory

            return [DeviceMemory(device="cuda:0", source="one", allocated_bytes=1)]

    probe_ = Probe(str(tmp_path), source=One(), interval=1.0)
    probe_.set_engine("qwen-7b", 2)
    probe_.run_once()
    [snap] = read_spool(str(tmp_path)).snapshots
    assert (snap.model_name, snap.engine) == ("qwen-7b", "2")
    with pytest.raises(TypeError):
        probe_.set_engine(["qwen"], 0)
    with pytest.raises(TypeError):
        probe_.set_engine("qwen", True)
