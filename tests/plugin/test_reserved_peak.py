"""The seed fix's blind spot: vllm-mindspore's profile measures reserved memory at the run's END.

vllm-mindspore's ``ms_memory_profiling`` takes ``memory_reserved()`` after the profile run, before its
``empty_cache`` (vllm_mindspore/utils.py:465-475 @ 0.5.1). When MindSpore's pool hands cached blocks back
during the run, that end-of-run increase is less than the reserved memory the run reached, and the seed
fix's budget (and, before this, kvguard's overcommit of 0) trusts it. The plugin therefore also reads
MindSpore's own statistic around the run (``reset_peak_memory_stats`` at its start, ``max_memory_reserved``
at its end, mindspore/runtime/memory.py:170-241 @ 2.7.1) and records it beside the engine's figure; the
guard counts the peak where it is higher, and ``kvguard check`` and ``/guard`` say so.

The engine here is a scripted stand-in that measures in vllm-mindspore's order (cited below) on
tests/support/fake_vllm's
device (2 GiB pool segments), with ``mindspore.runtime``'s memory calls answered from that device, so that check,
/guard and the failure paths can be driven quickly; the real vllm-mindspore 0.5.1 (its own ms_memory_profiling on
MindSpore 2.7.1) shows the same blind spot in tests/upstream/test_mindspore_real.py. The last test puts MindSpore
2.7.1's own compiled pool (tests/upstream/oracles/mindspore)
under the same run: the real pool's reserved figure falls mid-run while its max reserved statistic stays.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import sys
import threading
import types

import pytest

pytest.importorskip("torch")  # tests/support/fake_vllm's Worker keeps vLLM's @torch.inference_mode()

from helpers import invoke  # noqa: E402
from sidecar_fixtures import http_get, start_server  # noqa: E402
from test_vllm_plugin import fake_vllm, snapshots  # noqa: E402,F401 - fake_vllm is a fixture

from kvguard import plugin  # noqa: E402
from kvguard.allocators.ops import Op  # noqa: E402
from kvguard.records import ReservedPeak  # noqa: E402
from kvguard.sources import (
    register as register_source,  # noqa: E402
    unregister,
)
from kvguard.sources.mindspore import device_memory_from_stats  # noqa: E402

GIB, MIB = 1 << 30, 1 << 20
UTILIZATION = 0.85  # below the point where MindSpore's pool budget (15/16 of free memory) binds first


def _device():
    """The device the fake vLLM measures (tests/support/fake_vllm/fake_device.py, or the real pool below)."""
    return sys.modules["vllm.utils.mem_utils"].DEVICE


# ---------------------------------------------------------------------------- the engine


@contextlib.contextmanager
def ms_memory_profiling(baseline_snapshot, weights_memory):
    """The measurement order of vllm_mindspore/utils.py:400-478 @ 0.5.1, over the fake device (``torch.cuda`` there is
    msadapter's, MindSpore's pool; vLLM 0.11.0's MemorySnapshot.measure takes ``torch_memory`` from
    ``memory_reserved()``, vllm/utils/__init__.py 0.11.0:2740)."""
    from vllm.utils.mem_utils import MemoryProfilingResult

    gc.collect()
    _device().empty_cache()
    _device().reset_peak_memory_stats()
    result = MemoryProfilingResult(before_create=baseline_snapshot, weights_memory=weights_memory)
    result.before_profile.measure()
    yield result
    # measure memory before empty cache to get maximum reserved memory  (utils.py:464-465)
    result.after_profile.measure()
    gc.collect()
    _device().empty_cache()
    diff_profile = result.after_profile - result.before_profile
    diff_from_create = result.after_profile - result.before_create
    result.torch_peak_increase = diff_profile.torch_memory
    result.non_torch_increase = diff_from_create.non_torch_memory
    result.profile_time = diff_profile.timestamp
    result.non_kv_cache_memory = result.non_torch_increase + result.torch_peak_increase + result.weights_memory


# vllm_mindspore/__init__.py:120 @ 0.5.1: ``vllm.utils.memory_profiling = ms_memory_profiling``, before vLLM's
# worker module imports the name; the worker below finds it as its module's global, as vLLM's does.
memory_profiling = ms_memory_profiling


def determine_available_memory(self):
    """vllm/v1/worker/gpu_worker.py 0.11.0:254-276, the lines the budget takes."""
    _device().empty_cache()
    _device().reset_peak_memory_stats()
    with memory_profiling(
        self.init_snapshot, weights_memory=int(self.model_runner.model_memory_usage)
    ) as profile_result:
        self.model_runner.profile_run()
    self.non_torch_memory = profile_result.non_torch_increase
    self.peak_activation_memory = profile_result.torch_peak_increase
    self.available_kv_cache_memory_bytes = self.requested_memory - profile_result.non_kv_cache_memory
    return int(self.available_kv_cache_memory_bytes)


class ProfileRun:
    """The model runner: weights at load; in the profile run, ``activations`` allocated together and freed,
    then (``release``) the pool hands its cached blocks back (``mindspore.runtime.empty_cache()``), and
    ``then`` allocated and freed before the run ends."""

    def __init__(self, activations, release, then=1 * GIB, weights=16 * GIB, non_torch_growth=512 * MIB):
        self.weights, self.activations, self.release, self.then = weights, activations, release, then
        self.non_torch_growth = non_torch_growth
        self.model_memory_usage = 0

    def load_model(self):
        _device().malloc(self.weights)
        self.model_memory_usage = self.weights

    def get_kv_cache_spec(self):
        """Four layers of 8 KV heads of 128 (tests/support/fake_vllm): what the budget-time verdict places."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype_size=2)
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(4)}

    def profile_run(self):
        device = _device()
        handles = [device.malloc(size) for size in self.activations]
        device.non_torch += self.non_torch_growth
        for handle in handles:
            device.free(handle)
        if self.release:
            sys.modules["mindspore.runtime"].empty_cache()
        device.free(device.malloc(self.then))


class FakeMindSporeRuntime(types.ModuleType):
    """``mindspore.runtime``'s memory calls (mindspore/runtime/memory.py @ 2.7.1) answered from the device's
    pool: ``memory_reserved`` (:142), ``max_memory_reserved`` (:170, the largest reserved figure since the
    last reset, kept by the device at every growth), ``reset_peak_memory_stats`` (:214), ``empty_cache``
    (:198), ``memory_stats`` (:110, its reserved, allocated and peak keys). Calls are recorded."""

    def __init__(self):
        super().__init__("mindspore.runtime")
        self.calls: list[str] = []

    def memory_reserved(self):
        self.calls.append("memory_reserved")
        return _device().reserved

    def max_memory_reserved(self):
        self.calls.append("max_memory_reserved")
        return _device().peak_reserved

    def reset_peak_memory_stats(self):
        self.calls.append("reset_peak_memory_stats")
        _device().reset_peak_memory_stats()

    def empty_cache(self):
        self.calls.append("empty_cache")
        _device().empty_cache()

    def memory_stats(self):
        device = _device()
        return {
            "total_reserved_memory": device.reserved,
            "total_allocated_memory": device.allocated,
            "max_reserved_memory": device.peak_reserved,
            "max_allocated_memory": device.peak_allocated,
        }


class FakeMindSporeSource:
    """The probe's source on this rank: MindSpore's memory_stats(), read by kvguard's own key reader."""

    name = "fake-mindspore"

    def sample(self):
        free, total = _device().mem_get_info()
        return [
            device_memory_from_stats(
                sys.modules["mindspore.runtime"].memory_stats(), "npu:0", free_bytes=free, total_bytes=total
            )
        ]


@pytest.fixture
def engine(fake_vllm, monkeypatch):  # noqa: F811 - the fixture imported above
    """vllm-mindspore 0.5.1 loaded (its module; its era row: MindSpore's pool, the reserved formula), the
    fake MindSpore runtime, the probe on; ``engine(runner, device=None)`` starts a worker (rank 0)."""
    runtime = FakeMindSporeRuntime()
    mindspore = types.ModuleType("mindspore")
    mindspore.runtime = runtime
    vllm_mindspore = types.ModuleType("vllm_mindspore")
    vllm_mindspore.__version__ = "0.5.1"
    for name, module in (("mindspore", mindspore), ("mindspore.runtime", runtime), ("vllm_mindspore", vllm_mindspore)):
        monkeypatch.setitem(sys.modules, name, module)
    register_source("fake-mindspore", FakeMindSporeSource, replace=True)
    monkeypatch.setenv("KVGUARD_SOURCE", "fake-mindspore")
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
    monkeypatch.setattr(gpu_worker.Worker, "determine_available_memory", determine_available_memory)

    def start(runner, device=None, utilization=UTILIZATION):
        if device is not None:
            monkeypatch.setattr(sys.modules["vllm.utils.mem_utils"], "DEVICE", device)
            monkeypatch.setattr(gpu_worker, "DEVICE", device)
        plugin.register()
        worker = gpu_worker.Worker(gpu_memory_utilization=utilization, model_runner=runner)
        worker.init_device()
        worker.load_model()
        return worker

    start.runtime = runtime
    start.spool = fake_vllm
    yield start
    unregister("fake-mindspore")


def stock_budget(weights, reserved_increase, non_torch_increase=512 * MIB, total=64 * GIB, utilization=UTILIZATION):
    """vllm-mindspore's budget on vLLM 0.11.0: ``requested - (weights + reserved increase + non-torch
    increase)`` (gpu_worker.py 0.11.0:273, utils.py:478), written out here."""
    return int(total * utilization - (weights + reserved_increase + non_torch_increase))


def check(spool):
    result = invoke("check", "--spool-dir", str(spool))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def guard_rank(spool):
    server = start_server(spool)
    try:
        status, _, body = http_get(server, "/guard")
    finally:
        server.stop()
    assert status == 200
    [rank] = json.loads(body)["ranks"]
    return rank


# ---------------------------------------------------------------------------- a run that releases mid-run


def test_a_run_that_releases_blocks_mid_run_records_the_peak_beside_the_end_of_run_figure(engine):
    # 2 GiB segments: two 1.5 GiB activations take +3 GiB allocated, +4 GiB reserved; the pool then hands
    # its cached segments back, and a last 1 GiB activation leaves +2 GiB reserved when the run ends.
    worker = engine(ProfileRun(activations=(1536 * MIB, 1536 * MIB), release=True))
    available = worker.determine_available_memory()
    assert available == stock_budget(16 * GIB, 2 * GIB)  # vllm-mindspore's budget, untouched (stock)
    [snap] = snapshots(engine.spool)
    assert snap.profile.peak_reserved_increase_bytes == 2 * GIB  # what vllm-mindspore measured
    assert snap.reserved_peak == ReservedPeak(measured_increase_bytes=2 * GIB, peak_increase_bytes=4 * GIB)
    # the end-of-run increase (2) < the allocated peak (3) < the reserved peak (4)
    assert snap.profile.peak_reserved_increase_bytes < 3 * GIB < snap.reserved_peak.peak_increase_bytes
    # the budget-time verdict, judged before the KV cache exists, counts the peak too
    at_budget = snap.budget_verdict
    assert (at_budget.reserved_increase_measured_bytes, at_budget.reserved_peak_increase_bytes) == (2 * GIB, 4 * GIB)
    assert at_budget.reserved_peak_note and "overcommitted" in at_budget.reason_codes
    calls = engine.runtime.calls
    assert calls.count("reset_peak_memory_stats") == 1 and calls.count("max_memory_reserved") == 1
    assert calls.index("reset_peak_memory_stats") < calls.index("empty_cache") < calls.index("max_memory_reserved")
    assert plugin.hook_errors == {}

    code, output = check(engine.spool)
    over = stock_budget(16 * GIB, 2 * GIB) - stock_budget(16 * GIB, 4 * GIB)
    assert over == 2 * GIB
    assert code == 1 and "overcommitted: the KV cache" in output and "by 2.00 GiB" in output
    [line] = [line for line in output.splitlines() if "reserved peak:" in line]
    assert "+4.00 GiB, above the +2.00 GiB vllm-mindspore measured at the run's end" in line
    assert "released blocks during the run" in line

    rank = guard_rank(engine.spool)
    assert rank["reserved_increase_measured_bytes"] == 2 * GIB
    assert rank["reserved_peak_increase_bytes"] == 4 * GIB
    assert rank["reserved_peak_note"] == line.split("reserved peak: ", 1)[1]
    assert rank["overcommit_bytes"] == over
    assert rank["stock_budget_bytes"] == available
    assert rank["reserved_budget_bytes"] == stock_budget(16 * GIB, 4 * GIB)


def test_a_run_without_a_mid_run_release_shows_no_difference_and_no_extra_line(engine):
    worker = engine(ProfileRun(activations=(1536 * MIB, 1536 * MIB), release=False))
    assert worker.determine_available_memory() == stock_budget(16 * GIB, 4 * GIB)
    [snap] = snapshots(engine.spool)
    assert snap.reserved_peak == ReservedPeak(measured_increase_bytes=4 * GIB, peak_increase_bytes=4 * GIB)
    code, output = check(engine.spool)
    assert "reserved peak" not in output and "overcommitted" not in output
    rank = guard_rank(engine.spool)
    assert (rank["reserved_increase_measured_bytes"], rank["reserved_peak_increase_bytes"]) == (4 * GIB, 4 * GIB)
    assert rank["reserved_peak_note"] is None and rank["overcommit_bytes"] == 0


def test_the_reserved_budget_takes_the_peak(engine, monkeypatch):
    monkeypatch.setenv("KVGUARD_BUDGET", "reserved")
    worker = engine(ProfileRun(activations=(1536 * MIB, 1536 * MIB), release=True))
    assert worker.determine_available_memory() == stock_budget(16 * GIB, 4 * GIB)


@pytest.mark.parametrize("peak_read", [True, False])
def test_the_guard_budget_judges_with_the_peak(engine, monkeypatch, peak_read):
    # At 0.9 the KV cache vLLM budgets, with the 4 GiB peak beside it, outgrows MindSpore's pool budget (15/16
    # of the memory free when the pool started): with the peak the guard cuts the budget; with only the
    # end-of-run 2 GiB it predicts the cache fits and keeps vLLM's.
    monkeypatch.setenv("KVGUARD_BUDGET", "guard")
    if not peak_read:
        monkeypatch.delattr(FakeMindSporeRuntime, "max_memory_reserved")
    worker = engine(ProfileRun(activations=(1536 * MIB, 1536 * MIB), release=True), utilization=0.9)
    stock = stock_budget(16 * GIB, 2 * GIB, utilization=0.9)
    budget = worker.determine_available_memory()
    if peak_read:
        assert stock - GIB < budget < stock
    else:
        assert budget == stock


def test_a_peak_that_cannot_be_read_is_absent_counted_and_said(engine, monkeypatch):
    # A build without it: AttributeError at the run's end. vLLM's figure and run are untouched.
    monkeypatch.delattr(FakeMindSporeRuntime, "max_memory_reserved")
    worker = engine(ProfileRun(activations=(1536 * MIB, 1536 * MIB), release=True))
    assert worker.determine_available_memory() == stock_budget(16 * GIB, 2 * GIB)
    [snap] = snapshots(engine.spool)
    assert snap.reserved_peak.measured_increase_bytes == 2 * GIB and snap.reserved_peak.peak_increase_bytes is None
    assert "max_memory_reserved" in snap.reserved_peak.error
    assert plugin.hook_errors == {"reserved_peak": 1}
    _, output = check(engine.spool)
    [line] = [line for line in output.splitlines() if "reserved peak:" in line]
    assert "was not read from MindSpore" in line and "end-of-run reserved increase" in line
    assert guard_rank(engine.spool)["reserved_peak_increase_bytes"] is None


def test_other_engines_make_no_mindspore_call_and_record_no_peak(fake_vllm, monkeypatch):  # noqa: F811
    runtime = FakeMindSporeRuntime()
    monkeypatch.setitem(sys.modules, "mindspore.runtime", runtime)  # importable, but vLLM's own worker runs
    monkeypatch.setenv("KVGUARD_SPOOL_DIR", str(fake_vllm))
    plugin.register()
    gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
    worker = gpu_worker.Worker()
    worker.init_device()
    worker.load_model()
    worker.determine_available_memory()
    [snap] = snapshots(fake_vllm)
    assert snap.profile is not None and snap.reserved_peak is None
    assert runtime.calls == [] and plugin.hook_errors == {}


# ---------------------------------------------------------------------------- MindSpore's real pool


class RealPool:
    """MindSpore 2.7.1's compiled pool (tests/upstream/oracles/mindspore, the allocator issue's oracle) as the device:
    every figure is the real pool's after the ops so far (the stream is replayed from its start for each
    new reading). ``history``: the real pool's (reserved, max reserved) after each op."""

    def __init__(self, version, total=64 * GIB, non_torch=1 * GIB):
        from test_oracle_mindspore import oracle, oracle_client

        oracle(version)  # built, or the test fails (skips under KVGUARD_SKIP_ORACLES=1) saying how
        self.client, self.version = oracle_client, version
        self.total, self.non_torch = total, non_torch
        self.ops: list[Op] = []
        self._records: list[dict] = []
        self._lock = threading.Lock()  # the probe's thread reads too; the oracle serves one stream at once

    def _last(self):
        with self._lock:
            if len(self._records) != len(self.ops):
                _, self._records = self.client.replay(
                    self.version, list(self.ops), free=self.total - self.non_torch, vmm=False, task_sink=True
                )
        return (
            self._records[-1]
            if self._records
            else {"reserved_bytes": 0, "allocated_bytes": 0, "peak_reserved_bytes": 0, "peak_allocated_bytes": 0}
        )

    @property
    def history(self):
        self._last()
        return [(r["reserved_bytes"], r["peak_reserved_bytes"]) for r in self._records]

    def malloc(self, size):
        self.ops.append(Op("malloc", size))
        if self._last()["oom"]:
            raise MemoryError(f"the real pool could not allocate {size} bytes")
        return len(self.ops) - 1

    def free(self, handle):
        self.ops.append(Op("free", index=handle))

    def empty_cache(self):
        self.ops.append(Op("empty_cache"))

    def reset_peak_memory_stats(self, device=None):
        # The harness has no reset op: its max is the pool's since start, which is the max since here
        # as long as nothing has been released before (checked).
        record = self._last()
        assert record["peak_reserved_bytes"] == record["reserved_bytes"]

    reserved = property(lambda self: self._last()["reserved_bytes"])
    allocated = property(lambda self: self._last()["allocated_bytes"])
    peak_reserved = property(lambda self: self._last()["peak_reserved_bytes"])
    peak_allocated = property(lambda self: self._last()["peak_allocated_bytes"])

    def memory_stats(self, device=None):
        return {"allocated_bytes.all.peak": self.peak_allocated}

    def memory_reserved(self, device=None):
        return self.reserved

    def mem_get_info(self, device=None):
        return self.total - self.reserved - self.non_torch, self.total


def test_the_real_pool_releases_blocks_mid_run_and_its_max_reserved_stays_at_the_peak(engine):
    from test_oracle_mindspore import PINNED

    pool = RealPool(PINNED)
    # The shape on MindSpore's own pool (no VMM): 14 GiB of weights; 1.5 + 1.5 + 1 GiB of
    # activations; an empty_cache mid-run; a last 1.5 GiB activation.
    worker = engine(
        ProfileRun(activations=(1536 * MIB, 1536 * MIB, 1024 * MIB), release=True, then=1536 * MIB, weights=14 * GIB),
        device=pool,
    )
    start = len(pool.ops)
    worker.determine_available_memory()
    run = pool.history[start:]
    reserved_start = run[0][0]
    reserved = [r for r, _ in run]
    peak = max(reserved)
    released_at = next(i for i in range(1, len(reserved)) if reserved[i] < reserved[i - 1])
    # the real pool's reserved figure falls mid-run, its max reserved statistic stays at the peak
    assert reserved[released_at] < peak and run[released_at][1] == peak
    assert all(max_reserved == peak for _, max_reserved in run[released_at:])

    [snap] = snapshots(engine.spool)
    measured = snap.profile.peak_reserved_increase_bytes
    allocated_peak = pool._records[-1]["peak_allocated_bytes"] - 14 * GIB
    assert snap.reserved_peak == ReservedPeak(
        measured_increase_bytes=measured, peak_increase_bytes=peak - reserved_start
    )
    assert measured < allocated_peak < peak - reserved_start  # measured 2 GiB < 4 GiB < 5 GiB on 2.7.1
    [line] = [line for line in check(engine.spool)[1].splitlines() if "reserved peak:" in line]
    assert "released blocks during the run" in line


# ---------------------------------------------------------------------------- the snapshot field


def test_the_snapshot_field_round_trips_and_hostile_values_are_refused():
    import dataclasses

    from sidecar_fixtures import snapshot

    from kvguard.guard.judge import BUDGET, Verdict
    from kvguard.spool.schema import Snapshot, SnapshotError, decode_snapshot

    at_budget = Verdict(state="ok", reasons=(), phase=BUDGET, reserved_peak_note="\x1b[31mreleased")
    snap = dataclasses.replace(
        snapshot(), reserved_peak=ReservedPeak(2 * GIB, None, error="no\x00reading"), budget_verdict=at_budget
    )
    data = json.loads(json.dumps(snap.to_dict()))
    assert data["reserved_peak"] == {
        "measured_increase_bytes": 2 * GIB,
        "peak_increase_bytes": None,
        "error": "no\x00reading",
    }
    decoded = Snapshot.from_dict(data)
    assert decoded.reserved_peak.measured_increase_bytes == 2 * GIB and "\x00" not in decoded.reserved_peak.error
    assert "\x1b" not in decoded.budget_verdict.reserved_peak_note  # text from a file is made safe
    del data["reserved_peak"]
    assert Snapshot.from_dict(data).reserved_peak is None  # an older snapshot
    for bad in (
        {"measured_increase_bytes": -1},
        {"peak_increase_bytes": True},
        {"peak_increase_bytes": 1 << 64},
        {"error": 7},
        [1, 2],
    ):
        data["reserved_peak"] = bad
        with pytest.raises(SnapshotError) as info:
            decode_snapshot(json.dumps(data).encode())
        assert info.value.reason == "invalid_snapshot" and "reserved_peak" in str(info.value)


def test_a_budget_verdict_with_a_note_round_trips_and_a_non_text_note_is_refused():
    from kvguard.guard.judge import BUDGET, Verdict

    verdict = Verdict(
        state="ok",
        reasons=(),
        phase=BUDGET,
        reserved_increase_measured_bytes=2 * GIB,
        reserved_peak_increase_bytes=4 * GIB,
        reserved_peak_note="the pool released blocks",
    )
    assert Verdict.from_dict(json.loads(json.dumps(verdict.to_dict()))) == verdict
    with pytest.raises(ValueError, match="reserved_peak_note"):
        Verdict.from_dict({**verdict.to_dict(), "reserved_peak_note": 5})
