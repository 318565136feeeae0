"""Snapshot pickles are read within budgets: every bomb is a one-line TraceError.

The bombs are issue 23's (``bytearray(2 GiB)`` from an allow-listed constructor,
``frozenset(bytearray(512 MiB))``, a 9-byte pickle storing memo index 200,000,000,
5,000,000 shared references) and their relatives, each built here from a few bytes of
opcodes or by CPython's own pickler. What the reader does build is checked against
CPython's unpickler: the oracle for what a pickle means. Times and memory are measured by
``bench/bench_pickle_bombs.py``, not here.
"""

import glob
import os
import pickle
import random
from collections import OrderedDict

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st
from real_snapshots import REAL_DIRS  # tests/support/real_snapshots.py

from kvguard.allocators.traces import (
    SNAPSHOT_MAX_BYTES,
    SNAPSHOT_MAX_CONTAINER_ITEMS,
    SNAPSHOT_MAX_DEPTH,
    SNAPSHOT_MAX_KEY_WORK,
    SNAPSHOT_MAX_MEMORY_BYTES,
    SNAPSHOT_MAX_OBJECTS,
    SNAPSHOT_MAX_SAME_HASH,
    SNAPSHOT_MAX_STRING_BYTES,
    SNAPSHOT_MAX_VALUES,
    TraceError,
    load_snapshot_pickle,
    parse_torch_snapshot,
    read_trace_bytes,
)
from kvguard.cli import main


def budget(limit: int) -> str:
    return f"over the budget of {limit:,}"


def stack_global(module: str, name: str) -> bytes:
    """SHORT_BINUNICODE module, SHORT_BINUNICODE name, STACK_GLOBAL."""
    return b"\x8c" + bytes([len(module)]) + module.encode() + b"\x8c" + bytes([len(name)]) + name.encode() + b"\x93"


ENTRY = {"action": "alloc", "addr": 0x7F0000000000, "size": 512, "stream": 0}


def real_shaped_snapshot() -> dict:
    """A small snapshot in ``_dump_snapshot``'s shape: entries and blocks share frame dicts, as torch's do."""
    frames = [{"filename": f"/model/layer{i}.py", "line": 10 + i, "name": f"forward{i}"} for i in range(6)]
    entries, blocks = [], []
    addr = 0x7F0000000000
    for i in range(24):
        stack = [frames[(i + k) % len(frames)] for k in range(3)]
        entries.append(
            {
                "action": "alloc",
                "addr": addr + 512 * i,
                "size": 512,
                "stream": 0,
                "frames": stack,
                "time_us": 1_700_000_000_000_000 + i,
                "compile_context": "N/A",
                "user_metadata": "",
            }
        )
        if i % 3 == 0:
            entries.append(
                {"action": "free_completed", "addr": addr + 512 * i, "size": 512, "stream": 0, "frames": stack}
            )
        blocks.append(
            {
                "address": addr + 512 * i,
                "size": 512,
                "requested_size": 500,
                "state": "active_allocated",
                "frames": stack,
            }
        )
    return {
        "segments": [
            {
                "device": 0,
                "address": addr,
                "total_size": 2 << 20,
                "allocated_size": 512 * 24,
                "active_size": 512 * 24,
                "requested_size": 500 * 24,
                "stream": 0,
                "segment_type": "small",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": frames[:2],
                "blocks": blocks,
            }
        ],
        "device_traces": [entries],
        "allocator_settings": {
            "PYTORCH_CUDA_ALLOC_CONF": "",
            "max_split_size": -1,
            "garbage_collection_threshold": 0.0,
            "expandable_segments": False,
            "roundup_power2_divisions": {"1": 0, "2": 0},
        },
        "external_annotations": [],
    }


# ----------------------------------------------------------------------------- the bombs
BOMBS = {
    # issue 23: a 59-byte file calling the allow-listed bytearray with a count of 2 GiB (34 bytes here)
    "bytearray(2 GiB)": (
        b"\x80\x04" + stack_global("builtins", "bytearray") + b"\x8a\x05\x00\x00\x00\x80\x00" + b"\x85R.",
        r"bytearray of an int \(a pickled bytearray holds bytes\)",
    ),
    "frozenset(bytearray(512 MiB))": (
        b"\x80\x04"
        + stack_global("builtins", "frozenset")
        + stack_global("builtins", "bytearray")
        + b"J\x00\x00\x00\x20"
        + b"\x85R\x85R.",
        r"bytearray of an int",
    ),
    # issue 23: PROTO 4, NONE, LONG_BINPUT 200,000,000, STOP
    "memo index 200,000,000": (
        b"\x80\x04N" + b"r" + (200_000_000).to_bytes(4, "little") + b".",
        r"memo index 200,000,000 stored where the next is 0",
    ),
    "string claiming 2 GiB": (
        b"\x80\x04X\xff\xff\xff\x7f" + b"a" * 16 + b".",
        r"2,147,483,647 bytes in one string, " + budget(SNAPSHOT_MAX_STRING_BYTES),
    ),
    "memo reference never stored": (
        b"\x80\x04N\x94h\x05.",
        r"cannot read snapshot pickle: memo index 5 was never stored \(1 entries\)",
    ),
    "set of a count": (b"\x80\x04" + stack_global("builtins", "set") + b"J\x00\x00\x00\x20\x85R.", r"set of an int"),
    "a class outside the allow-list": (
        b"\x80\x04" + stack_global("os", "system") + b"\x8c\x02id\x85R.",
        r"refusing to load os\.system",
    ),
    "an opcode no snapshot has": (
        b"\x80\x04N2.",
        r"cannot read snapshot pickle: DUP \(not an opcode of a pickle of dicts, "
        r"lists and numbers\) at byte 3",
    ),
}


@pytest.mark.parametrize("name", BOMBS)
def test_small_bomb_is_a_one_line_trace_error(name):
    data, message = BOMBS[name]
    with pytest.raises(TraceError, match=message) as caught:
        load_snapshot_pickle(data)
    assert "\n" not in str(caught.value)


def test_five_million_shared_references_are_refused_by_the_container_budget():
    # issue 23's 10 MB file: one trace entry referred to 5,000,000 times, each reference a BINGET.
    data = pickle.dumps({"device_traces": [[ENTRY] * 5_000_000]}, protocol=4)
    with pytest.raises(TraceError, match=r"items in one list, " + budget(SNAPSHOT_MAX_CONTAINER_ITEMS)):
        load_snapshot_pickle(data)


def test_references_that_double_at_each_level_are_refused_by_the_value_budget():
    # 64 levels of [x, x]: a few hundred bytes that a walk of the tree would never finish.
    doubling: list = [ENTRY]
    for _ in range(64):
        doubling = [doubling, doubling]
    data = pickle.dumps({"device_traces": [doubling]}, protocol=4)
    assert len(data) < 1000
    with pytest.raises(
        TraceError, match=r"values with every shared reference counted in full, " + budget(SNAPSHOT_MAX_VALUES)
    ):
        load_snapshot_pickle(data)


def test_a_shared_segment_list_is_counted_for_every_reference():
    # 2,000 references to one segment whose 100,000 blocks are one shared dict: small objects, a huge walk.
    segment = {"address": 0, "total_size": 512, "blocks": [{"size": 512, "state": "active_allocated"}] * 100_000}
    data = pickle.dumps({"segments": [segment] * 2_000, "device_traces": [[]]}, protocol=4)
    with pytest.raises(TraceError, match=r"values with every shared reference counted in full"):
        load_snapshot_pickle(data)


def test_millions_of_empty_lists_are_refused_by_the_object_budget():
    data = b"\x80\x04" + b"]" * (SNAPSHOT_MAX_OBJECTS + 1) + b"."
    with pytest.raises(TraceError, match=r"2,000,001 objects, " + budget(SNAPSHOT_MAX_OBJECTS)):
        load_snapshot_pickle(data)


# ----------------------------------------------------------------------------- round three
HASH_MODULUS = (1 << 61) - 1  # k x this hashes to 0 for every k (sys.hash_info.modulus)


def long1(value: int) -> bytes:
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def colliding(count: int) -> list[bytes]:
    """LONG1 opcodes of ``count`` distinct integers that all hash alike."""
    return [long1(k * HASH_MODULUS) for k in range(1, count + 1)]


def in_snapshot(opcodes: bytes) -> bytes:
    """A snapshot dict whose "x" is what ``opcodes`` push."""
    return b"\x80\x04}(\x8c\x0ddevice_traces](e\x8c\x01x" + opcodes + b"u."


COLLIDING = {
    # 40,000 such keys (559 kB) took 25.6 s, 100,000 (1.4 MB) over 120 s: each insert walks the others.
    # 2,000 keep this test quick either way (bench/bench_pickle_bombs.py times the large ones).
    "dict keys, SETITEMS": b"}(" + b"".join(key + b"K\x00" for key in colliding(2_000)) + b"u",
    "dict keys, SETITEM": b"}" + b"".join(key + b"K\x00s" for key in colliding(2_000)),
    "set items, ADDITEMS": b"\x8f(" + b"".join(colliding(2_000)) + b"\x90",
    "frozenset items, FROZENSET": b"(" + b"".join(colliding(2_000)) + b"\x91",
    "set([...]), REDUCE": stack_global("builtins", "set") + b"](" + b"".join(colliding(2_000)) + b"e\x85R",
}


@pytest.mark.parametrize("name", COLLIDING)
def test_keys_whose_hashes_collide_are_refused_before_they_are_inserted(name):
    with pytest.raises(TraceError, match=rf"more than {SNAPSHOT_MAX_SAME_HASH} keys with one hash in one"):
        load_snapshot_pickle(in_snapshot(COLLIDING[name]))


def test_integer_keys_below_two_to_the_64_read_as_cpythons_unpickler_reads_them():
    # Below 2**64 at most 8 integers share a hash: a dict of all of them is a snapshot's, not a bomb.
    keys = {k * HASH_MODULUS + 7: k for k in range(8)} | {k: -k for k in range(-3, 300)}
    data = pickle.dumps({"device_traces": [], "x": keys, "y": set(keys)}, protocol=4)
    assert load_snapshot_pickle(data) == pickle.loads(data)


def test_two_million_empty_sets_are_refused_by_the_memory_budget():
    # 2 MB of EMPTY_SET: 2,000,000 objects (within that budget) made 467 MiB.
    data = b"\x80\x04" + b"\x8f" * SNAPSHOT_MAX_OBJECTS + b"."
    with pytest.raises(TraceError, match=r"bytes of memory, " + budget(SNAPSHOT_MAX_MEMORY_BYTES)):
        load_snapshot_pickle(data)


def test_sets_filled_through_memo_references_are_refused_by_the_memory_budget():
    # 256 integers stored once, then sets of all 256 by BINGET: 2 bytes of file per 64 bytes of set.
    stored = b"".join(b"M" + i.to_bytes(2, "little") + b"\x94" for i in range(256))
    one_set = b"\x8f(" + b"".join(b"h" + bytes([i]) for i in range(256)) + b"\x90"
    data = b"\x80\x04" + stored + one_set * (SNAPSHOT_MAX_BYTES // len(one_set) - 3) + b"N."
    assert len(data) <= SNAPSHOT_MAX_BYTES
    with pytest.raises(TraceError, match=r"bytes of memory, " + budget(SNAPSHOT_MAX_MEMORY_BYTES)):
        load_snapshot_pickle(data)


def test_a_container_that_holds_itself_is_refused():
    looped: list = [ENTRY]
    looped.append(looped)
    with pytest.raises(TraceError, match=r"a container that holds itself"):
        load_snapshot_pickle(pickle.dumps({"device_traces": [looped]}, protocol=4))


def test_tuples_nested_past_the_depth_budget_are_refused_before_they_are_hashed():
    # Hashing a tuple recurses in C: a million nested tuples as a dict key would overflow the C stack.
    data = b"\x80\x04}N" + b"\x85" * 1_000_000 + b"Ns."
    with pytest.raises(TraceError, match=rf"tuples nested over {SNAPSHOT_MAX_DEPTH} deep"):
        load_snapshot_pickle(data)


def test_a_pickle_one_byte_over_the_byte_budget_is_refused():
    data = b"\x80\x04" + b"N" * (SNAPSHOT_MAX_BYTES - 3) + b"N."
    with pytest.raises(TraceError, match=r"33,554,433 bytes, " + budget(SNAPSHOT_MAX_BYTES)):
        load_snapshot_pickle(data)


def test_reading_a_snapshot_file_stops_one_byte_past_the_budget(tmp_path):
    path = tmp_path / "huge.pickle"
    with open(path, "wb") as handle:
        handle.write(b"\x80\x04")
        handle.truncate(64 * SNAPSHOT_MAX_BYTES)  # sparse: nothing written past the header
    with pytest.raises(TraceError, match=r"is over the budget of 33,554,432 bytes"):
        read_trace_bytes(str(path))


def test_a_csv_trace_is_read_whole(tmp_path):
    path = tmp_path / "memory_block.csv"
    path.write_bytes(b"start_time_stamp,end_time_stamp,size\n" + b"1,2,512\n" * 10)
    assert read_trace_bytes(str(path)).count(b"\n") == 11


def test_a_truncated_snapshot_says_where_its_data_ends():
    data = pickle.dumps(real_shaped_snapshot(), protocol=4)
    cut = data[: len(data) // 2]
    with pytest.raises(TraceError, match=rf"the data ends at byte {len(cut):,}"):
        load_snapshot_pickle(cut)


# ----------------------------------------------------------------------------- round four
def stored(opcodes: bytes) -> bytes:
    """``opcodes`` push one value, MEMOIZE keeps it, POP takes it off the stack."""
    return opcodes + b"\x94" + b"0"


def binunicode(text: bytes) -> bytes:
    return b"X" + len(text).to_bytes(4, "little") + text


def binbytes(raw: bytes) -> bytes:
    return b"B" + len(raw).to_bytes(4, "little") + raw


COPIES = {
    # (memo 0, 1, 2 stored first; then one copy, REDUCE of what they hold)
    "_codecs.encode(str, 'latin1')": (
        stored(binunicode(b"a" * 1_000_000)) + stored(b"\x8c\x06latin1") + stored(stack_global("_codecs", "encode")),
        b"h\x02h\x00h\x01\x86R",
    ),
    "bytearray(bytes)": (
        stored(binbytes(b"a" * 1_000_000)) + stored(stack_global("builtins", "bytearray")),
        b"h\x01h\x00\x85R",
    ),
    "bytearray(str, 'latin-1')": (
        stored(binunicode(b"a" * 1_000_000))
        + stored(b"\x8c\x07latin-1")
        + stored(stack_global("builtins", "bytearray")),
        b"h\x02h\x00h\x01\x86R",
    ),
}


@pytest.mark.parametrize("name", COPIES)
def test_copies_of_a_stored_string_are_counted_by_their_bytes(name):
    # Each REDUCE copies 1,000,000 bytes from 8 or 6 bytes of file: 600 copies (a 995 kB file) made 565 MiB,
    # counted as 600 objects of 64 bytes. 300 copies are over the memory budget by their bytes alone.
    setup, copy = COPIES[name]
    data = in_snapshot(setup + b"](" + copy * 300 + b"e")
    assert len(data) < 1_003_000
    with pytest.raises(TraceError, match=r"bytes of memory, " + budget(SNAPSHOT_MAX_MEMORY_BYTES)) as caught:
        load_snapshot_pickle(data)
    assert "\n" not in str(caught.value)


def doubling_tuple(depth: int) -> bytes:
    """Stored as memo ``depth``: t = (u, u), u = (v, v), ... ``depth`` levels over None, each level stored
    once and referred to twice. Hashing it walks all 2**depth paths (CPython keeps no tuple's hash)."""
    return stored(b"N") + b"".join(stored(b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86") for i in range(depth))


DEEP_KEYS = {
    # 24 levels: 0.9 s to hash before; 28 levels (a 135-byte file) took 19 s.
    "dict key, SETITEM": b"}h\x18Ns",
    "dict key, SETITEMS": b"}(h\x18Nu",
    "set item, ADDITEMS": b"\x8f(h\x18\x90",
    "frozenset item, FROZENSET": b"(h\x18\x91",
    "set([...]) item, REDUCE": stack_global("builtins", "set") + b"](h\x18e\x85R",
}


@pytest.mark.parametrize("name", DEEP_KEYS)
def test_a_key_that_holds_tuples_is_refused_before_it_is_hashed(name):
    data = in_snapshot(doubling_tuple(24) + DEEP_KEYS[name])
    with pytest.raises(TraceError, match=r"key that holds a tuple or frozenset \(hashing it walks every path"):
        load_snapshot_pickle(data)


def test_a_long_tuple_key_used_again_and_again_is_refused_by_the_key_work_budget():
    # One tuple of 200,000 items (400 kB of BINGET) as the key of 200 dicts: 80,000,000 items hashed.
    long_tuple = stored(b"N") + stored(b"(" + b"h\x00" * 200_000 + b"t")
    data = in_snapshot(long_tuple + b"](" + b"}h\x01Ns" * 200 + b"e")
    with pytest.raises(TraceError, match=r"steps hashing and comparing keys, " + budget(SNAPSHOT_MAX_KEY_WORK)):
        load_snapshot_pickle(data)


def test_equal_long_strings_as_keys_are_refused_by_the_key_work_budget():
    # Two equal strings of 1,000,000 bytes, distinct objects: each insert of the second compares them (47 us);
    # an 18 MB file of 1,600,000 such dicts would compare for 75 s.
    two = stored(binunicode(b"a" * 1_000_000)) + stored(binunicode(b"a" * 1_000_000))
    data = in_snapshot(two + b"](" + b"}h\x00Nsh\x01Ns" * 1_000 + b"e")
    with pytest.raises(TraceError, match=r"steps hashing and comparing keys, " + budget(SNAPSHOT_MAX_KEY_WORK)):
        load_snapshot_pickle(data)


def test_hash_counts_are_kept_per_container_not_per_reused_id():
    # Each frozenset's items were counted under the id of a list gone right after: the next list, at the same
    # address, went on from its count, and the 17th frozenset({1.5}) was refused.
    value = {
        "device_traces": [],
        "x": [frozenset({1.5}) for _ in range(40)],
        "y": [{(1, "a"): 0, (2, "b"): 1}, {(3,), (4, 5)}],
    }
    data = pickle.dumps(value, protocol=4)
    assert load_snapshot_pickle(data) == pickle.loads(data)
    # dicts dropped as soon as built (POP): the next dict may have the same id
    dropped = b"".join(b"}G?\xf8\x00\x00\x00\x00\x00\x00Ns0" for _ in range(40))
    assert load_snapshot_pickle(in_snapshot(dropped + b"N")) == {"device_traces": [], "x": None}


def test_simulate_refuses_a_bomb_in_one_line(tmp_path):
    path = tmp_path / "bomb.pickle"
    path.write_bytes(BOMBS["memo index 200,000,000"][0])
    result = CliRunner().invoke(main, ["simulate", "--trace", str(path)])
    assert result.exit_code == 65  # bad input
    assert result.output.strip().splitlines() == [
        "Error: not a plain snapshot pickle: memo index 200,000,000 stored where the next is 0 at byte 3"
    ]


# ----------------------------------------------------------------------------- what is built
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_the_reader_builds_what_cpythons_unpickler_builds(protocol):
    value = real_shaped_snapshot()
    value["extras"] = {
        "set": {1, 2, 3},
        "frozenset": frozenset({"a", ("b", 2)}),
        "bytes": b"\x00\xff",
        "bytearray": bytearray(b"abc"),
        "ordered": OrderedDict([("z", 1), ("a", 2)]),
        "floats": [0.5, -1e300, float("inf")],
        "flags": (True, False, None),
        "ints": [0, -1, 255, 256, 65535, 65536, -(1 << 31), (1 << 64) + 1, -(1 << 200)],
        "text": "snapshot \u00e9\u4e2d\U0001f600",
        "empty": ((), [], {}, "", b""),
        "long": "x" * 70_000,
        "tuples": [(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)],
    }
    data = pickle.dumps(value, protocol=protocol)
    assert load_snapshot_pickle(data) == pickle.loads(data)


def test_shared_values_stay_shared():
    snapshot = load_snapshot_pickle(pickle.dumps(real_shaped_snapshot(), protocol=4))
    entries = snapshot["device_traces"][0]
    assert entries[0]["frames"] is entries[1]["frames"]  # the alloc and its free share one list
    assert entries[0]["frames"][0] is snapshot["segments"][0]["frames"][0]


def real_snapshots():
    found = []
    for folder in REAL_DIRS:
        found += glob.glob(os.path.join(folder, "**", "*.pickle"), recursive=True)
    small = sorted(path for path in found if os.path.getsize(path) <= 256 * 1024)
    largest = max(found, key=os.path.getsize, default=None)
    return small + [largest] if largest else [pytest.param(None, marks=pytest.mark.skip("no real snapshots"))]


@pytest.mark.parametrize("path", real_snapshots(), ids=lambda p: os.path.basename(p) if p else "none")
def test_a_real_snapshot_reads_as_cpythons_unpickler_reads_it(path):
    data = open(path, "rb").read()
    assert load_snapshot_pickle(data) == pickle.loads(data)


# ----------------------------------------------------------------------------- mutations
def read_or_refuse(data: bytes) -> None:
    """A mutated snapshot is read and parsed, or refused in one line; nothing else may come out."""
    try:
        parse_torch_snapshot(load_snapshot_pickle(data))
    except TraceError as exc:
        assert "\n" not in str(exc), str(exc)


def test_bit_flips_give_a_snapshot_or_a_one_line_trace_error():
    # zzuf-like: one to four bits flipped at random, 800 seeds of the same snapshot.
    data = pickle.dumps(real_shaped_snapshot(), protocol=4)
    outcomes = {"read": 0, "refused": 0}
    for seed in range(800):
        rng = random.Random(seed)
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            bit = rng.randrange(len(data) * 8)
            mutated[bit // 8] ^= 1 << bit % 8
        try:
            parse_torch_snapshot(load_snapshot_pickle(bytes(mutated)))
            outcomes["read"] += 1
        except TraceError as exc:
            assert "\n" not in str(exc), str(exc)
            outcomes["refused"] += 1
    assert min(outcomes.values()) > 0, outcomes  # the mutations reach both outcomes


@settings(
    max_examples=300, deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    edits=st.lists(
        st.tuples(st.integers(min_value=0), st.integers(0, 255), st.sampled_from("rid")), min_size=1, max_size=6
    )
)
def test_byte_edits_give_a_snapshot_or_a_one_line_trace_error(edits):
    data = bytearray(pickle.dumps(real_shaped_snapshot(), protocol=4))
    for where, byte, how in edits:
        at = where % len(data)
        if how == "r":
            data[at] = byte
        elif how == "i":
            data.insert(at, byte)
        elif len(data) > 1:
            del data[at]
    read_or_refuse(bytes(data))
