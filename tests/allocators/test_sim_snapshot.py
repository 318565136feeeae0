"""Exact replay of PyTorch ``_dump_snapshot`` pickles.

Two kinds of input:

- small snapshots written here in ``_dump_snapshot``'s format, each with addresses worked
  out by hand from the allocator's rules (``c10/cuda/CUDACachingAllocator.cpp``);
- real public snapshots, every ``*.pickle`` under each folder (subfolders too) of
  ``KVGUARD_TORCH_SNAPSHOTS`` (paths separated by ``os.pathsep``), by default
  ``../shared/torch-snapshots`` and ``../shared/torch-snapshots-2`` beside the checkout (see
  their PROVENANCE files). Each file tests/data/shared/MANIFEST.json names is one test; a missing one is
  its own skip, naming it and its source (a failure with CI=true).
"""

import json
import pickle

import pytest
from click.testing import CliRunner
from real_snapshots import snapshot_params  # tests/support/real_snapshots.py

from kvguard.allocators.snapshot import SnapshotError, replay_snapshot
from kvguard.allocators.traces import load_snapshot_pickle
from kvguard.cli import main

MIB = 1 << 20
BASE = 0x7F0000000000
SETTINGS = {
    "PYTORCH_CUDA_ALLOC_CONF": "",
    "max_split_size": -1,
    "garbage_collection_threshold": 0.0,
    "expandable_segments": False,
    "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)},
}


def real_snapshots():
    """One param per real snapshot: each file tests/data/shared/MANIFEST.json names, a missing one its own skip
    (or every pickle under KVGUARD_TORCH_SNAPSHOTS' folders)."""
    return snapshot_params()


def segment(address, total, blocks, small=False, expandable=False, device=0):
    return {
        "device": device,
        "address": address,
        "total_size": total,
        "stream": 0,
        "segment_type": "small" if small else "large",
        "is_expandable": expandable,
        "blocks": [{"address": a, "size": s, "requested_size": r, "state": st} for a, s, r, st in blocks],
    }


def entry(action, addr, size):
    return {"action": action, "addr": addr, "size": size, "stream": 0}


def alloc(addr, size):
    return entry("alloc", addr, size)


def free(addr, size):
    return [entry("free_requested", addr, size), entry("free_completed", addr, size)]


def snapshot(segments, trace, settings=SETTINGS, devices=1):
    traces = [[] for _ in range(devices)]
    traces[0] = trace
    return {"segments": segments, "device_traces": traces, "allocator_settings": settings}


def test_a_block_allocated_before_recording_is_seeded_and_freed():
    # Recording began with a 4 MiB tensor at the start of a 20 MiB segment. Freed, the segment is
    # one free block again, so the next 8 MiB request lands at its start.
    snap = snapshot(
        [
            segment(
                BASE,
                20 * MIB,
                [(BASE, 8 * MIB, 8 * MIB, "active_allocated"), (BASE + 8 * MIB, 12 * MIB, 0, "inactive")],
            )
        ],
        free(BASE, 4 * MIB) + [alloc(BASE, 8 * MIB)],
    )
    [device] = replay_snapshot(snap, address_space_bytes=80 << 30)
    assert (device.allocs, device.allocs_matched) == (1, 1)
    assert device.preexisting_frees == 1 and device.seeded_segments == 1
    assert device.end_state_matches
    assert device.reserved_bytes == 20 * MIB and device.allocated_bytes == 8 * MIB


def test_an_unsplit_remainder_is_inferred_from_where_the_trace_allocates_next():
    # A 4 MiB tensor from before recording sits in a block of 4.5 MiB (a 0.5 MiB remainder is not
    # split off in the large pool). The trace's next allocation starts where that block ends.
    p_end = BASE + 4 * MIB + 512 * 1024
    snap = snapshot(
        [segment(BASE, 20 * MIB, [(BASE, 20 * MIB, 0, "inactive")])],
        [alloc(p_end, 2 * MIB)] + free(BASE, 4 * MIB) + free(p_end, 2 * MIB),
    )
    [device] = replay_snapshot(snap, address_space_bytes=80 << 30)
    assert device.allocs_matched == 1
    assert device.preexisting_extended == 1
    assert device.end_state_matches


def test_new_segments_take_the_address_the_trace_recorded():
    snap = snapshot(
        [
            segment(
                BASE + 0x1000000000,
                2 * MIB,
                [
                    (BASE + 0x1000000000, 512, 100, "active_allocated"),
                    (BASE + 0x1000000000 + 512, 2 * MIB - 512, 0, "inactive"),
                ],
                small=True,
            )
        ],
        [entry("segment_alloc", BASE + 0x1000000000, 2 * MIB), alloc(BASE + 0x1000000000, 100)],
    )
    [device] = replay_snapshot(snap, address_space_bytes=80 << 30)
    assert (device.segment_allocs, device.segment_allocs_matched, device.allocs_matched) == (1, 1, 1)
    assert device.end_state_matches


def test_an_end_state_that_differs_is_reported():
    # The trace leaves a 4 MiB tensor allocated, but the recorded end state has its segment all free.
    snap = snapshot(
        [
            segment(BASE, 20 * MIB, [(BASE, 20 * MIB, 0, "inactive")]),
            segment(BASE + 40 * MIB, 20 * MIB, [(BASE + 40 * MIB, 20 * MIB, 0, "inactive")]),
        ],
        [alloc(BASE, 4 * MIB)],
    )
    [device] = replay_snapshot(snap, address_space_bytes=80 << 30)
    assert device.allocs_matched == 1
    assert not device.end_state_matches
    assert device.end_state_detail == "1 of 2 recorded segments equal; 1 modelled segments differ"


def test_overlapping_recorded_blocks_are_a_one_line_error():
    snap = snapshot(
        [
            segment(
                BASE,
                20 * MIB,
                [
                    (BASE, 8 * MIB, 8 * MIB, "active_allocated"),
                    (BASE + 4 * MIB, 8 * MIB, 8 * MIB, "active_allocated"),
                    (BASE + 12 * MIB, 8 * MIB, 0, "inactive"),
                ],
            )
        ],
        [],
    )
    with pytest.raises(SnapshotError, match=r"^snapshot segments: seeded block at 0x7f0000400000 does not fit"):
        replay_snapshot(snap, address_space_bytes=80 << 30)


def test_a_segment_stream_or_request_of_the_wrong_type_is_a_one_line_error():
    bad_stream = segment(BASE, 20 * MIB, [(BASE, 20 * MIB, 0, "inactive")])
    bad_stream["stream"] = "7"
    bad_request = segment(BASE, 20 * MIB, [(BASE, 20 * MIB, 2.5, "active_allocated")])
    for seg, message in (
        (bad_stream, r"segments\[0\]\.stream is not a non-negative integer"),
        (bad_request, r"segments\[0\] has a block whose requested_size is not an integer"),
    ):
        with pytest.raises(SnapshotError, match=message):
            replay_snapshot(snapshot([seg], []), address_space_bytes=80 << 30)


def test_an_allocation_no_device_could_serve_is_a_one_line_error():
    snap = snapshot([], [alloc(BASE, 1 << 63)])
    with pytest.raises(SnapshotError, match=r"device_traces\[0\]\[0\] \(alloc\): 9223372036854775808 bytes cannot"):
        replay_snapshot(snap, address_space_bytes=80 << 30)


def test_an_address_past_64_bits_is_a_one_line_error():
    snap = snapshot([], [alloc(1 << 64, 4096)])
    with pytest.raises(SnapshotError, match=r"addr and size must be below 2\*\*64"):
        replay_snapshot(snap, address_space_bytes=80 << 30)


def test_a_recorded_oom_is_a_request_the_cache_cannot_serve():
    snap = snapshot(
        [segment(BASE, 20 * MIB, [(BASE, 20 * MIB, 0, "inactive")])],
        [
            {"action": "oom", "size": 30 * MIB, "device_free": 1 << 20, "stream": 0},
            {"action": "oom", "size": 8 * MIB, "device_free": 1 << 20, "stream": 0},
        ],
    )
    [device] = replay_snapshot(snap, address_space_bytes=80 << 30)
    # 30 MiB does not fit the cached 20 MiB block: reproduced. 8 MiB does fit: not reproduced.
    assert (device.ooms, device.ooms_matched) == (2, 1)


def test_expandable_segments_grow_in_20_mib_pages_from_the_first_mapped_address():
    settings = {**SETTINGS, "expandable_segments": True}
    snap = snapshot(
        [
            segment(
                BASE,
                40 * MIB,
                [
                    (BASE, 16 * MIB, 16 * MIB, "active_allocated"),
                    (BASE + 16 * MIB, 16 * MIB, 16 * MIB, "active_allocated"),
                    (BASE + 32 * MIB, 8 * MIB, 0, "inactive"),
                ],
                expandable=True,
            )
        ],
        [
            entry("segment_map", BASE, 20 * MIB),
            alloc(BASE, 16 * MIB),
            entry("segment_map", BASE + 20 * MIB, 20 * MIB),
            alloc(BASE + 16 * MIB, 16 * MIB),
        ],
        settings,
    )
    [device] = replay_snapshot(snap, address_space_bytes=80 << 30)
    assert (device.allocs_matched, device.maps_matched) == (2, 2)
    assert device.end_state_matches
    # Expandable segments never count in the segment statistic.
    assert device.memory_stats["segment.all.current"] == 0
    assert device.segment_bytes == (40 * MIB,)


def test_every_device_is_replayed():
    snap = snapshot(
        [
            segment(BASE, 20 * MIB, [(BASE, 20 * MIB, 0, "inactive")]),
            segment(BASE * 2, 2 * MIB, [(BASE * 2, 2 * MIB, 0, "inactive")], small=True, device=1),
        ],
        [alloc(BASE, 4 * MIB)],
        devices=2,
    )
    snap["device_traces"][1] = [alloc(BASE * 2, 1000)] + free(BASE * 2, 1000)
    devices = replay_snapshot(snap, address_space_bytes=80 << 30)
    assert [(d.device, d.allocs_matched) for d in devices] == [(0, 1), (1, 1)]


def test_a_wrong_model_shows_as_a_mismatch_not_a_pass():
    # The trace claims the second 12 MiB request went to a new segment, though the freed one fits.
    snap = snapshot([segment(BASE, 12 * MIB, [(BASE, 12 * MIB, 0, "inactive")])], [alloc(BASE + 0x100000000, 12 * MIB)])
    [device] = replay_snapshot(snap, address_space_bytes=80 << 30)
    assert (device.allocs, device.allocs_matched, device.first_mismatch_index) == (1, 0, 0)


def test_a_malformed_entry_is_a_one_line_error(tmp_path):
    snap = snapshot([], [{"action": "alloc", "addr": "0x10", "size": 5, "stream": 0}])
    with pytest.raises(SnapshotError, match="addr, size and stream"):
        replay_snapshot(snap, address_space_bytes=80 << 30)
    path = tmp_path / "bad.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=4))
    result = CliRunner().invoke(main, ["simulate", "--trace", str(path)])
    assert result.exit_code == 65
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1


def test_cli_json_and_replay_log(tmp_path):
    snap = snapshot(
        [
            segment(
                BASE,
                20 * MIB,
                [(BASE, 8 * MIB, 8 * MIB, "active_allocated"), (BASE + 8 * MIB, 12 * MIB, 0, "inactive")],
            )
        ],
        free(BASE, 4 * MIB) + [alloc(BASE, 8 * MIB)],
    )
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=4))
    log = tmp_path / "replay.jsonl"
    result = CliRunner().invoke(main, ["simulate", "--trace", str(path), "--json", "--replay-log", str(log)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    [device] = data["trace"]["devices"]
    assert {
        k: device[k]
        for k in (
            "device",
            "reserved_bytes",
            "allocated_bytes",
            "inactive_split_bytes",
            "segment_bytes",
            "allocs",
            "allocs_matched",
        )
    } == {
        "device": 0,
        "reserved_bytes": 20 * MIB,
        "allocated_bytes": 8 * MIB,
        "inactive_split_bytes": 12 * MIB,
        "segment_bytes": [20 * MIB],
        "allocs": 1,
        "allocs_matched": 1,
    }
    # index 2: the position of the alloc in device_traces[0] (after free_requested, free_completed).
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        {"device": 0, "index": 2, "addr": BASE, "size": 8 * MIB}
    ]


EXPANDABLE = {**SETTINGS, "expandable_segments": True}


def test_a_dump_without_history_replays_its_end_state():
    # _dump_snapshot without _record_memory_history: empty device traces, the segments as they are.
    # Device 0 holds an ordinary segment and a 40 MiB mapped range of an expandable one; device 1 a
    # small segment. Nothing happens, so each device's end state is its start state.
    exp = BASE + 0x1000000000
    snap = snapshot(
        [
            segment(
                BASE,
                20 * MIB,
                [(BASE, 8 * MIB, 8 * MIB, "active_allocated"), (BASE + 8 * MIB, 12 * MIB, 0, "inactive")],
            ),
            segment(
                exp,
                40 * MIB,
                [
                    (exp, 16 * MIB, 0, "inactive"),
                    (exp + 16 * MIB, 8 * MIB, 8 * MIB - 100, "active_allocated"),
                    (exp + 24 * MIB, 16 * MIB, 0, "inactive"),
                ],
                expandable=True,
            ),
            segment(
                BASE * 2,
                2 * MIB,
                [(BASE * 2, 512, 300, "active_allocated"), (BASE * 2 + 512, 2 * MIB - 512, 0, "inactive")],
                small=True,
                device=1,
            ),
        ],
        [],
        EXPANDABLE,
        devices=2,
    )
    devices = replay_snapshot(snap, address_space_bytes=80 << 30)
    assert [(d.device, d.history_recorded, d.events, d.allocs) for d in devices] == [(0, False, 0, 0), (1, False, 0, 0)]
    assert all(d.end_state_matches for d in devices)
    assert [(d.reserved_bytes, d.allocated_bytes) for d in devices] == [(60 * MIB, 16 * MIB), (2 * MIB, 512)]
    assert "no history recorded" in devices[0].end_state_detail


def test_the_cli_reports_a_dump_without_history_instead_of_refusing_it(tmp_path):
    snap = snapshot(
        [
            segment(
                BASE,
                20 * MIB,
                [(BASE, 8 * MIB, 8 * MIB, "active_allocated"), (BASE + 8 * MIB, 12 * MIB, 0, "inactive")],
            )
        ],
        [],
    )
    path = tmp_path / "nohistory.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=4))
    result = CliRunner().invoke(main, ["simulate", "--trace", str(path)])
    assert result.exit_code == 0, result.output
    assert "0 events" in result.output and "no history recorded" in result.output
    data = json.loads(CliRunner().invoke(main, ["simulate", "--trace", str(path), "--json"]).output)
    [device] = data["trace"]["devices"]
    assert (data["trace"]["events"], device["history_recorded"], device["end_state_matches"]) == (0, False, True)


def test_an_expandable_segment_mapped_before_recording_serves_the_traces_allocations():
    # 40 MiB (two 20 MiB pages) were mapped before recording, a 16 MiB tensor at the start; the trace
    # maps nothing. Best fit inside the mapped pages: A (8 MiB) and B (4 MiB) follow the tensor; A is
    # freed; C (6 MiB) takes A's 8 MiB block, the smaller of the two free ones, splitting off 2 MiB.
    a, b = BASE + 16 * MIB, BASE + 24 * MIB
    snap = snapshot(
        [
            segment(
                BASE,
                40 * MIB,
                [
                    (BASE, 16 * MIB, 16 * MIB, "active_allocated"),
                    (a, 6 * MIB, 6 * MIB, "active_allocated"),
                    (a + 6 * MIB, 2 * MIB, 0, "inactive"),
                    (b, 4 * MIB, 4 * MIB, "active_allocated"),
                    (b + 4 * MIB, 12 * MIB, 0, "inactive"),
                ],
                expandable=True,
            )
        ],
        [alloc(a, 8 * MIB), alloc(b, 4 * MIB)] + free(a, 8 * MIB) + [alloc(a, 6 * MIB)],
        EXPANDABLE,
    )
    [device] = replay_snapshot(snap, address_space_bytes=80 << 30)
    assert (device.allocs, device.allocs_matched, device.maps) == (3, 3, 0)
    assert device.end_state_matches, device.end_state_detail
    assert device.reserved_bytes == 40 * MIB


def test_growth_past_the_pages_mapped_before_recording_maps_the_next_page():
    # One 20 MiB page was mapped before recording, a 16 MiB tensor at its start. An 8 MiB request
    # starts in the free 4 MiB left and maps the next page for the rest (find_expandable_block).
    snap = snapshot(
        [
            segment(
                BASE,
                40 * MIB,
                [
                    (BASE, 16 * MIB, 16 * MIB, "active_allocated"),
                    (BASE + 16 * MIB, 8 * MIB, 8 * MIB, "active_allocated"),
                    (BASE + 24 * MIB, 16 * MIB, 0, "inactive"),
                ],
                expandable=True,
            )
        ],
        [entry("segment_map", BASE + 20 * MIB, 20 * MIB), alloc(BASE + 16 * MIB, 8 * MIB)],
        EXPANDABLE,
    )
    [device] = replay_snapshot(snap, address_space_bytes=80 << 30)
    assert (device.allocs_matched, device.maps, device.maps_matched) == (1, 1, 1)
    assert device.end_state_matches, device.end_state_detail


def test_pages_the_trace_unmaps_were_mapped_before_recording():
    # Two pages were mapped before recording; empty_cache unmapped the second, wholly free one.
    snap = snapshot(
        [
            segment(
                BASE,
                20 * MIB,
                [(BASE, 4 * MIB, 4 * MIB, "active_allocated"), (BASE + 4 * MIB, 16 * MIB, 0, "inactive")],
                expandable=True,
            )
        ],
        [entry("segment_unmap", BASE + 20 * MIB, 20 * MIB)],
        EXPANDABLE,
    )
    [device] = replay_snapshot(snap, address_space_bytes=80 << 30)
    assert (device.unmaps, device.unmaps_matched) == (1, 1)
    assert device.end_state_matches, device.end_state_detail
    assert device.reserved_bytes == 20 * MIB


def test_a_block_from_before_recording_in_pages_the_trace_maps_is_a_one_line_error():
    snap = snapshot(
        [
            segment(
                BASE,
                20 * MIB,
                [(BASE, 4 * MIB, 4 * MIB, "active_allocated"), (BASE + 4 * MIB, 16 * MIB, 0, "inactive")],
                expandable=True,
            )
        ],
        [entry("segment_map", BASE, 20 * MIB)],
        EXPANDABLE,
    )
    with pytest.raises(
        SnapshotError,
        match=r"^snapshot segments: the block at 0x7f0000000000, allocated before "
        r"recording began, lies in expandable-segment pages that the trace maps$",
    ):
        replay_snapshot(snap, address_space_bytes=80 << 30)


@pytest.mark.parametrize("path", real_snapshots())
def test_real_snapshot_replays_at_every_recorded_address(path):
    with open(path, "rb") as handle:
        snap = load_snapshot_pickle(handle.read())
    devices = replay_snapshot(snap, address_space_bytes=80 << 30)
    assert devices, "no device replayed"
    for device in devices:
        assert device.allocs_matched == device.allocs, device.to_dict()
        assert device.end_state_matches, device.end_state_detail
        assert device.ooms_matched == device.ooms
        assert device.segment_frees_matched == device.segment_frees
        assert (device.maps_matched, device.unmaps_matched) == (device.maps, device.unmaps)
        assert device.frees_skipped == 0
        # Reserved and allocated bytes are the recorded segments' own sums.
        recorded = [s for s in snap["segments"] if s.get("device", 0) == device.device]
        assert device.reserved_bytes == sum(s["total_size"] for s in recorded)
        assert device.allocated_bytes == sum(
            b["size"] for s in recorded for b in s["blocks"] if b["state"] != "inactive"
        )


def test_without_device_memory_a_replay_does_not_guess_the_gpus_size(tmp_path):
    # An expandable segment grown to 40 GiB, as on an 80 GB GPU. The CLI's 32 GiB default would bound its
    # address space at 36 GiB and refuse the growth; a snapshot does not record its GPU's size, so an exact
    # replay takes --total-memory only when it is given.
    gib = 1 << 30
    settings = {**SETTINGS, "expandable_segments": True}
    snap = snapshot(
        [segment(BASE, 40 * gib, [(BASE, 40 * gib, 40 * gib, "active_allocated")], expandable=True)],
        [entry("segment_map", BASE, 40 * gib), alloc(BASE, 40 * gib)],
        settings,
    )
    path = tmp_path / "big.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=4))

    def matched(*args):
        result = CliRunner().invoke(main, ["simulate", "--trace", str(path), "--json", *args])
        assert result.exit_code == 0, result.output
        [device] = json.loads(result.output)["trace"]["devices"]
        return device["allocs_matched"], device["end_state_matches"]

    assert matched() == (1, True)
    assert matched("--total-memory", "80GiB") == (1, True)
    smaller = CliRunner().invoke(main, ["simulate", "--trace", str(path), "--total-memory", "32GiB"])
    assert (smaller.exit_code, smaller.output) == (
        65,
        "Error: snapshot device_traces[0][1] (alloc): 42949672960 bytes cannot be served on any device\n",
    )  # asked for
