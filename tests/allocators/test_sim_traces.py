"""Reading and replaying real allocation traces: MindSpore memory_block.csv, PyTorch snapshot pickles."""

import os
import pickle

import pytest

from kvguard.allocators.device import Device
from kvguard.allocators.mindspore_pool import DynamicMemPool
from kvguard.allocators.torch_alloc import CachingAllocator
from kvguard.allocators.traces import (
    TraceError,
    TraceEvent,
    load_snapshot_pickle,
    load_trace,
    parse_memory_block_csv,
    parse_torch_snapshot,
    replay,
)

MIB = 1 << 20

# The header MemoryTrackerEnabled::Dump writes (mem_tracker.cc's block_csv: every cell ends with a
# comma; type is column 9, after actual_peak_memory, file_name and line_num, as memory_py.cc's replay
# parser reads it), then rows: a weight kept to the end (-1), an activation freed at 5, a workspace
# at 4..6, a SOMAS row.
MEMORY_BLOCK_HEADER = (
    "start_time_stamp,end_time_stamp,device_addr,stream_id,pool_type,size,actual_peak_memory,"
    "file_name,line_num,type,producer_task,task_name,node_name,graph_name,user_tasks,"
    "python_stack,\n"
)
MEMORY_BLOCK_CSV = (
    MEMORY_BLOCK_HEADER
    + """\
1,-1,0x12c0000000,0,persistent,1048576,1048576,,,Weight,1,Default/Load,load,kernel_graph_0,{},,
2,5,0x12c0100000,0,common,3145728,4194304,,,OutputData,2,Default/MatMul-op0,MatMul,kernel_graph_0,{3-},,
4,6,0x12c0400000,0,common,512,4195328,,,WorkSpace,4,Default/Add-op1,Add,kernel_graph_0,{},,
-1,-1,0x12c0600000,0,common,4096,0,,,InSideSomas,5,Default/Mul-op2,Mul,kernel_graph_0,{},,
"""
)


def test_memory_block_csv_orders_allocations_and_frees_by_timestamp():
    trace = parse_memory_block_csv(MEMORY_BLOCK_CSV)
    assert trace.events == (
        TraceEvent(0, 1048576, True, 0),
        TraceEvent(1, 3145728, False, 0),
        TraceEvent(2, 512, False, 0),
        TraceEvent(1, None, False, 0),
        TraceEvent(2, None, False, 0),
    )
    assert trace.skipped == 1  # the SOMAS row has no timestamps


def test_memory_block_csv_without_header_uses_the_replay_parser_positions():
    row = "3,7,0xabc,0,common,2048,2048,,,OutputData,"
    trace = parse_memory_block_csv(row + "\n")
    assert trace.events == (TraceEvent(0, 2048, False, 0), TraceEvent(0, None, False, 0))


def test_headerless_and_headed_rows_agree_on_the_type_column():
    # The same rows with and without the tracker's header: the weight is persistent either way.
    body = MEMORY_BLOCK_CSV.split("\n", 1)[1]
    assert parse_memory_block_csv(body).events == parse_memory_block_csv(MEMORY_BLOCK_CSV).events
    assert parse_memory_block_csv(body).events[0] == TraceEvent(0, 1048576, True, 0)


@pytest.mark.parametrize("cell", ["1e400", "inf", "-inf", "nan"])
def test_memory_block_csv_with_a_non_finite_size_is_refused(cell):
    text = MEMORY_BLOCK_HEADER + f"1,-1,0x12c0000000,0,common,{cell},0,,,OutputData,1,a,b,g,{{}},,\n"
    with pytest.raises(TraceError, match=r"^memory_block.csv row 1: not a finite number"):
        parse_memory_block_csv(text)


def test_memory_block_csv_with_a_negative_size_is_refused():
    text = MEMORY_BLOCK_HEADER + "1,-1,0x12c0000000,0,common,-4096,0,,,OutputData,1,a,b,g,{},,\n"
    with pytest.raises(TraceError, match=r"^memory_block.csv row 1: negative size -4096$"):
        parse_memory_block_csv(text)


def test_memory_block_csv_with_a_byte_order_mark_keeps_its_header(tmp_path):
    # Saved by a spreadsheet: a UTF-8 BOM before "start_time_stamp" must not turn the header into a row.
    path = tmp_path / "memory_block.csv"
    path.write_bytes(MEMORY_BLOCK_CSV.encode("utf-8-sig"))
    trace = load_trace(str(path))
    assert trace.events == parse_memory_block_csv(MEMORY_BLOCK_CSV).events


def test_memory_block_csv_the_csv_module_cannot_read_is_a_trace_error():
    # A stray carriage return inside an unquoted cell: csv.Error, not a ValueError. (Not an oversized
    # cell: importing mindspore raises the csv module's field size limit for the whole process.)
    text = MEMORY_BLOCK_HEADER + "1,-1,0x1,0,common,4096,0,,,Output\rData,1,a,b,g,{},,\n"
    with pytest.raises(TraceError, match="not a readable CSV: new-line character seen in unquoted field"):
        parse_memory_block_csv(text)


def test_memory_block_csv_replays_on_the_mindspore_pool():
    pool = DynamicMemPool(Device(8 << 30))
    result = replay(parse_memory_block_csv(MEMORY_BLOCK_CSV).events, pool)
    assert not result.oom
    assert result.peak_allocated_bytes == 1048576 + 3145728 + 512
    stats = result.memory_stats
    assert stats["total_allocated_memory"] == 1048576  # the weight is still held
    assert stats["persistent_mem_pool_stats"]["block_counts"] == 1


def snapshot(trace_entries):
    return {"segments": [], "device_traces": [trace_entries], "allocator_settings": {}}


ENTRIES = [
    {"action": "segment_alloc", "addr": 0x7F0000000000, "size": 20 * MIB, "stream": 0},
    {"action": "alloc", "addr": 0x7F0000000000, "size": 3 * MIB, "stream": 0, "frames": []},
    {"action": "alloc", "addr": 0x7F0000300000, "size": 5 * MIB, "stream": 0, "frames": []},
    {"action": "free_requested", "addr": 0x7F0000000000, "size": 3 * MIB, "stream": 0},
    {"action": "free_completed", "addr": 0x7F0000000000, "size": 3 * MIB, "stream": 0},
    {"action": "free_completed", "addr": 0x7E0000000000, "size": 1 * MIB, "stream": 0},  # before recording
]


def test_snapshot_trace_keeps_allocs_and_completed_frees():
    trace = parse_torch_snapshot(snapshot(ENTRIES))
    assert trace.events == (
        TraceEvent(0x7F0000000000, 3 * MIB),
        TraceEvent(0x7F0000300000, 5 * MIB),
        TraceEvent(0x7F0000000000, None),
    )
    assert trace.skipped == 1


def test_snapshot_trace_without_free_completed_uses_free_requested():
    entries = [e for e in ENTRIES if e["action"] != "free_completed"]
    assert parse_torch_snapshot(snapshot(entries)).events[-1] == TraceEvent(0x7F0000000000, None)


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


@pytest.mark.parametrize(
    ("snap", "message"),
    [
        ({"device_traces": [5]}, r"device_traces\[0\] is an int, not a list of entries"),
        (snapshot([7]), r"device_traces\[0\]\[0\] is an int, not a dict"),
        (snapshot([{"action": ["alloc"], "addr": 1, "size": 4096}]), r"\[0\]\[0\]: action is a list, not a string"),
        (
            snapshot([{"action": "alloc", "addr": 1, "size": 4096, "stream": "abc"}]),
            r"\[0\]\[0\] \(alloc\): stream is a str, not an integer",
        ),
        (
            snapshot(
                [{"action": "alloc", "addr": 1, "size": 4096}, {"action": "free_completed", "addr": [1], "size": 4096}]
            ),
            r"\[0\]\[1\] \(free_completed\): addr is a list, not an integer",
        ),
        (snapshot([{"action": "alloc", "addr": 1, "size": 4096.0}]), r"\(alloc\): size is a float, not an integer"),
        (snapshot([{"action": "alloc", "addr": 1, "size": -100000}]), r"\(alloc\): negative size -100000$"),
    ],
)
def test_snapshot_with_fields_of_the_wrong_type_is_a_trace_error(snap, message):
    # Well-formed pickles (they load) whose entries do not have _dump_snapshot's types.
    with pytest.raises(TraceError, match=message):
        parse_torch_snapshot(snap)


def test_snapshot_segment_entries_are_not_type_checked():
    # Entries that are not replayed keep whatever fields the recording allocator gave them.
    entries = [{"action": "segment_alloc", "addr": None, "size": "?"}, {"action": "alloc", "addr": 1, "size": 8}]
    assert parse_torch_snapshot(snapshot(entries)).events == (TraceEvent(1, 8),)


def test_snapshot_without_device_traces_is_an_error():
    with pytest.raises(TraceError, match="no device_traces"):
        parse_torch_snapshot({"segments": []})


def test_replay_stops_at_the_first_oom():
    events = [TraceEvent(i, 30 * MIB) for i in range(5)]
    result = replay(events, CachingAllocator(Device(100 * MIB)))
    assert (result.oom, result.oom_at_event, result.oom_request_bytes) == (True, 3, 30 * MIB)
    assert result.memory_stats["num_ooms"] == 1
