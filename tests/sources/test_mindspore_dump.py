"""kvguard.sources.mindspore_dump: the dump option merged into MS_ALLOC_CONF, and MindSpore's
MemoryDebugInfo file read with bounds.

The files in tests/data/mindspore_dump are what MindSpore 2.7.1's compiled pool wrote
(``DumpDynamicMemPoolDebugInfo``, tests/upstream/oracles/mindspore with ``{"op": "dump"}``) after 60 seeded ops, with
the
pool's own member lists beside them (``*-pool-lists.json``). tests/upstream/test_oracle_mindspore_dump.py holds the
reader against every release's pool directly."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kvguard.sources.mindspore_dump import (
    DEFAULT_EVERY,
    MAX_FILE_BYTES,
    DumpError,
    DumpReader,
    alloc_conf_value,
    dump_alloc_conf,
    dump_directory,
    dump_every,
    merged_alloc_conf,
    parse_dump,
    read_dump_file,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "mindspore_dump"
MIB = 1 << 20


def real_dump(vmm: bool) -> tuple[str, dict]:
    name = "2.7.1-vmm" if vmm else "2.7.1-no-vmm"
    truth = json.loads((DATA / f"{name}-pool-lists.json").read_text())
    return (DATA / f"{name}-MemoryDebugInfo0.txt").read_text(), truth


# ------------------------------------------------------------------------------------ MS_ALLOC_CONF
def test_without_a_user_value_the_dump_runs_at_mindspores_own_frequency():
    # actor_common.cc:386-404 @ r2.7.rc1: 100 graph runs unless configured, so the defrag cadence is unchanged.
    assert DEFAULT_EVERY == 100
    assert merged_alloc_conf(None) == "defrag_memory_step_freq:100dump"


def test_the_users_other_keys_are_kept():
    assert (
        merged_alloc_conf("enable_vmm:true, memory_tracker:False")
        == "enable_vmm:true,memory_tracker:False,defrag_memory_step_freq:100dump"
    )


def test_a_frequency_the_user_set_wins_and_gains_the_dump():
    # Under VMM it is also how often DefragMemory eager-frees: kvguard keeps the engine's cadence.
    assert (
        merged_alloc_conf("enable_vmm:true;defrag_memory_step_freq:20", every=50)
        == "enable_vmm:true,defrag_memory_step_freq:20dump"
    )


def test_a_value_that_dumps_already_is_left_alone():
    assert (
        merged_alloc_conf("'defrag_memory_step_freq:7dump,enable_vmm:true'")
        == "defrag_memory_step_freq:7dump,enable_vmm:true"
    )


def test_a_user_value_mindspore_reads_as_zero_takes_the_requested_frequency():
    # "sstream >> size_t" of "abc" is 0, which MindSpore treats as unset (100).
    assert merged_alloc_conf("defrag_memory_step_freq:abc", every=40) == "defrag_memory_step_freq:40dump"


def test_the_merged_value_reads_back_as_mindspore_parses_it():
    # ms_utils.cc:56-104: quotes stripped, ";" as ",", the last item of a key wins.
    merged = merged_alloc_conf('"defrag_memory_step_freq:5 ; enable_vmm:false ; defrag_memory_step_freq:30"')
    assert alloc_conf_value(merged, "defrag_memory_step_freq") == "30dump"
    assert alloc_conf_value(merged, "enable_vmm") == "false"


@pytest.mark.parametrize(
    "setting, every", [(None, None), ("", None), ("0", None), ("off", None), ("1", 100), ("true", 100), ("250", 250)]
)
def test_the_setting_reads_as_off_on_or_a_frequency(setting, every):
    assert dump_every(setting) == every


@pytest.mark.parametrize("setting", ["-3", "1.5", "lots", "99999999999"])
def test_a_bad_setting_is_one_line(setting):
    with pytest.raises(ValueError, match="KVGUARD_MINDSPORE_DUMP") as info:
        dump_every(setting)
    assert "\n" not in str(info.value)


def test_the_plugins_function_leaves_ms_alloc_conf_alone_when_off():
    assert dump_alloc_conf({"MS_ALLOC_CONF": "enable_vmm:true"}) is None
    assert (
        dump_alloc_conf({"MS_ALLOC_CONF": "enable_vmm:true", "KVGUARD_MINDSPORE_DUMP": "1"})
        == "enable_vmm:true,defrag_memory_step_freq:100dump"
    )


def test_the_dump_folder_follows_generate_path():
    # mem_pool_util.cc:42-75: memory_tracker_path or ./, plus rank_<id>/ once distributed.
    assert dump_directory("enable_vmm:true", "/srv/run") == Path("/srv/run")
    assert dump_directory("memory_tracker_path:/data/ms", "/srv/run", rank=3) == Path("/data/ms/rank_3")
    assert dump_directory("memory_tracker_path:logs", "/srv/run") == Path("/srv/run/logs")


# ------------------------------------------------------------------------------------ the file
@pytest.mark.parametrize("vmm", [True, False], ids=["vmm", "no-vmm"])
def test_a_real_dump_reads_as_the_pools_own_lists(vmm):
    text, truth = real_dump(vmm)
    figures = parse_dump(text.split("\n"))
    common = next(a for a in truth["allocators"] if a["persistent"] == 0 and a["stream"] == 0)
    assert (figures.vmm, figures.used_bytes, figures.pages_touched_by_used, figures.largest_idle_common_bytes) == (
        vmm,
        truth["used_bytes"],
        truth["pages_touched_by_used"],
        common["largest_idle"],
    )


def test_without_the_vmm_flag_2_7_0s_allocator_lines_take_the_callers_word():
    # r2.7.rc1's BriefInfo has no "enable vmm" / "is small" (abstract_dynamic_mem_pool.h:271-275).
    text, _ = real_dump(True)
    old = text.replace("enable vmm : 1, ", "").replace(", is small : 0, is customized : 0.", ".")
    assert parse_dump(old.split("\n"), vmm=True).vmm
    assert not parse_dump(old.split("\n"), vmm=False).vmm


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.95])
def test_a_truncated_dump_is_an_error_not_figures(cut, tmp_path):
    text, _ = real_dump(True)
    path = tmp_path / "MemoryDebugInfo0.txt"
    path.write_text(text[: int(len(text) * cut)].rsplit("\n", 1)[0] + "\n")
    with pytest.raises(DumpError) as info:
        read_dump_file(path)
    assert info.value.reason == "truncated"


@pytest.mark.parametrize(
    "hostile, reason",
    [
        ("\x00\xff garbage", "not_text"),
        (
            "In used mem buf info for Mem buf allocator, is persistent : 0, stream id : 0., mem_bufs size : 1\n"
            '{"addr_":0x10,"size_":99999999999999999999}\n',
            "malformed",
        ),
        (
            "In used mem buf info for Mem buf allocator, is persistent : 0, stream id : 0., mem_bufs size : 1\n"
            + "{"
            + "x" * 5000
            + "}\n",
            "malformed",
        ),
        (
            "Dump debug info for Mem buf allocator, is persistent : 0, stream id : 0.\n"
            "Free mem buf info - total count : 999999999999\n",
            "too_large",
        ),
        ("hello\n", "malformed"),
        ("\n", "malformed"),
    ],
)
def test_a_hostile_file_is_a_one_line_skip_reason(hostile, reason, tmp_path):
    path = tmp_path / "MemoryDebugInfo0.txt"
    path.write_bytes(hostile.encode("latin-1"))
    with pytest.raises(DumpError) as info:
        read_dump_file(path)
    assert info.value.reason == reason and "\n" not in str(info.value)


def test_a_file_beyond_the_size_cap_is_not_read(tmp_path):
    path = tmp_path / "MemoryDebugInfo0.txt"
    with open(path, "wb") as handle:
        handle.truncate(MAX_FILE_BYTES + 1)
    with pytest.raises(DumpError) as info:
        read_dump_file(path)
    assert info.value.reason == "too_large"


# ------------------------------------------------------------------------------------ the reader
def write(folder: Path, k: int, text: str, mtime: float) -> Path:
    path = folder / f"MemoryDebugInfo{k}.txt"
    path.write_text(text)
    os.utime(path, (mtime, mtime))
    return path


def test_the_reader_skips_a_bad_newest_file_counts_it_and_keeps_the_last_good_figures(tmp_path):
    text, truth = real_dump(False)
    now = time.time()
    write(tmp_path, 0, text, now - 5)
    reader = DumpReader(tmp_path, not_before=now - 60)
    good = reader.read()
    assert good.used_bytes == truth["used_bytes"]
    write(tmp_path, 1, text[: len(text) // 2], now)  # being written, or cut short
    assert reader.read() is good
    assert reader.read() is good  # skipped once, not re-read
    assert reader.skipped == {"truncated": 1} and "MemoryDebugInfo1.txt" in reader.last_error
    # The older file goes all the same (its figures stay in memory): files that never parse must not pile up.
    assert not (tmp_path / "MemoryDebugInfo0.txt").exists() and (tmp_path / "MemoryDebugInfo1.txt").exists()
    write(tmp_path, 1, text, now + 1)  # the same file, now whole: read again
    assert reader.read() is not good and reader.read().used_bytes == truth["used_bytes"]


def test_files_that_never_parse_do_not_pile_up(tmp_path):
    now = time.time()
    reader = DumpReader(tmp_path, not_before=now - 60)
    for k in range(5):
        write(tmp_path, k, "not MindSpore's dump\n", now + k)
        assert reader.read() is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["MemoryDebugInfo4.txt"]
    assert sum(reader.skipped.values()) == 5


def test_a_fifo_in_place_of_a_dump_is_a_counted_skip_not_a_hang(tmp_path):
    os.mkfifo(tmp_path / "MemoryDebugInfo0.txt")
    reader = DumpReader(tmp_path, not_before=time.time() - 60)
    assert reader.read() is None
    assert reader.skipped == {}  # not a regular file: never opened


def test_a_previous_runs_files_are_neither_read_nor_deleted(tmp_path):
    text, _ = real_dump(True)
    now = time.time()
    old = write(tmp_path, 4, text, now - 3600)
    reader = DumpReader(tmp_path, not_before=now - 10)
    assert reader.read() is None
    write(tmp_path, 0, text, now)
    assert reader.read() is not None and old.exists()


def test_the_reader_reads_the_newest_file_and_deletes_this_processs_older_ones(tmp_path):
    vmm_text, vmm_truth = real_dump(True)
    text, _ = real_dump(False)
    now = time.time()
    write(tmp_path, 0, text, now - 2)
    write(tmp_path, 1, vmm_text, now - 1)
    (tmp_path / "notes.txt").write_text("kept")
    reader = DumpReader(tmp_path, not_before=now - 60)
    figures = reader.read()
    assert (figures.vmm, figures.pages_touched_by_used) == (True, vmm_truth["pages_touched_by_used"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["MemoryDebugInfo1.txt", "notes.txt"]
    assert figures.written_at == pytest.approx(now - 1, abs=0.01)


def test_a_missing_folder_gives_no_figures(tmp_path):
    assert DumpReader(tmp_path / "absent", not_before=0).read() is None
