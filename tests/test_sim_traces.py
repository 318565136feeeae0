"""Reading and replaying real allocation traces: MindSpore memory_block.csv, PyTorch snapshot pickles."""

import os
import pickle

import pytest

from kvguard.sim.device import Device
from kvguard.sim.mindspore_pool import DynamicMemPool
from kvguard.sim.torch_alloc import CachingAllocator
from kvguard.sim.traces import (TraceError, TraceEvent, load_snapshot_pickle, load_trace, parse_memory_block_csv,
                                parse_torch_snapshot, replay)

MIB = 1 << 20

# The header MemoryTrackerEnabled::Dump writes (every cell ends with a comma), then rows:
# a weight kept to the end (-1), an activation freed at 5, a workspace at 4..6, a SOMAS row.
MEMORY_BLOCK_CSV = """\
start_time_stamp,end_time_stamp,device_addr,stream_id,pool_type,size,file_name,line_num,type,producer_task,task_name,node_name,graph_name,user_tasks,
1,-1,0x12c0000000,0,persistent,1048576,,,Weight,1,Default/Load,load,kernel_graph_0,{},
2,5,0x12c0100000,0,common,3145728,,,OutputData,2,Default/MatMul-op0,MatMul,kernel_graph_0,{3-},
4,6,0x12c0400000,0,common,512,,,WorkSpace,4,Default/Add-op1,Add,kernel_graph_0,{},
-1,-1,0x12c0600000,0,common,4096,,,InSideSomas,5,Default/Mul-op2,Mul,kernel_graph_0,{},
"""


def test_memory_block_csv_orders_allocations_and_frees_by_timestamp():
    trace = parse_memory_block_csv(MEMORY_BLOCK_CSV)
    assert trace.events == (
        TraceEvent(0, 1048576, True, 0),
        TraceEvent(1, 3145728, False, 0),
        TraceEvent(2, 512, False, 0),
        TraceEvent(1, None, False, 0),
        TraceEvent(2, None, False, 0),
    )
    assert trace.skipped == 1   # the SOMAS row has no timestamps


def test_memory_block_csv_without_header_uses_the_replay_parser_positions():
    row = "3,7,0xabc,0,common,2048,,,,OutputData,"
    trace = parse_memory_block_csv(row + "\n")
    assert trace.events == (TraceEvent(0, 2048, False, 0), TraceEvent(0, None, False, 0))


def test_memory_block_csv_replays_on_the_mindspore_pool():
    pool = DynamicMemPool(Device(8 << 30))
    result = replay(parse_memory_block_csv(MEMORY_BLOCK_CSV).events, pool)
    assert not result.oom
    assert result.peak_allocated_bytes == 1048576 + 3145728 + 512
    stats = result.memory_stats
    assert stats["total_allocated_memory"] == 1048576           # the weight is still held
    assert stats["persistent_mem_pool_stats"]["block_counts"] == 1


def snapshot(trace_entries):
    return {"segments": [], "device_traces": [trace_entries], "allocator_settings": {}}


ENTRIES = [
    {"action": "segment_alloc", "addr": 0x7f0000000000, "size": 20 * MIB, "stream": 0},
    {"action": "alloc", "addr": 0x7f0000000000, "size": 3 * MIB, "stream": 0, "frames": []},
    {"action": "alloc", "addr": 0x7f0000300000, "size": 5 * MIB, "stream": 0, "frames": []},
    {"action": "free_requested", "addr": 0x7f0000000000, "size": 3 * MIB, "stream": 0},
    {"action": "free_completed", "addr": 0x7f0000000000, "size": 3 * MIB, "stream": 0},
    {"action": "free_completed", "addr": 0x7e0000000000, "size": 1 * MIB, "stream": 0},  # before recording
]


def test_snapshot_trace_keeps_allocs_and_completed_frees():
    trace = parse_torch_snapshot(snapshot(ENTRIES))
    assert trace.events == (
        TraceEvent(0x7f0000000000, 3 * MIB), TraceEvent(0x7f0000300000, 5 * MIB), TraceEvent(0x7f0000000000, None),
    )
    assert trace.skipped == 1


def test_snapshot_trace_without_free_completed_uses_free_requested():
    entries = [e for e in ENTRIES if e["action"] != "free_completed"]
    assert parse_torch_snapshot(snapshot(entries)).events[-1] == TraceEvent(0x7f0000000000, None)


def test_snapshot_trace_replays_on_the_caching_allocator(tmp_path):
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot(ENTRIES)))
    result = replay(load_trace(str(path)).events, CachingAllocator(Device(1 << 30)))
    assert result.memory_stats["allocated_bytes.all.current"] == 5 * MIB
    assert result.memory_stats["reserved_bytes.all.current"] == 20 * MIB


class Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_snapshot_pickle_with_objects_is_refused_without_running_them():
    data = pickle.dumps({"device_traces": [[Exploit()]]})
    with pytest.raises(TraceError, match="refusing to load"):
        load_snapshot_pickle(data)


def test_snapshot_without_device_traces_is_an_error():
    with pytest.raises(TraceError, match="no device_traces"):
        parse_torch_snapshot({"segments": []})


def test_replay_stops_at_the_first_oom():
    events = [TraceEvent(i, 30 * MIB) for i in range(5)]
    result = replay(events, CachingAllocator(Device(100 * MIB)))
    assert (result.oom, result.oom_at_event, result.oom_request_bytes) == (True, 3, 30 * MIB)
    assert result.memory_stats["num_ooms"] == 1
