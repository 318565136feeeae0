"""The log file reader's work per line: floods of lines that say nothing are counted, not read line by line,
and what a file parses to is what feeding its every line gives (kvguard.vllm.log.read_log_file)."""

from __future__ import annotations

import glob
import os

import pytest
from conftest import TESTS

from kvguard.vllm import log
from kvguard.vllm.log import parse_lines, read_log_file, read_startup_log

LOGS = os.path.join(TESTS, "data", "logs")
REAL = sorted(glob.glob(os.path.join(LOGS, "**", "*.log"), recursive=True))


@pytest.fixture
def fed(monkeypatch):
    """How many lines the reader fed one by one (the rest it counted as a quiet stretch)."""
    count = {"lines": 0}
    feed = log._Reader.feed

    def counted(self, number, raw):
        count["lines"] += 1
        feed(self, number, raw)

    monkeypatch.setattr(log._Reader, "feed", counted)
    return count


def _write(tmp_path, data: bytes) -> str:
    path = tmp_path / "vllm.log"
    path.write_bytes(data)
    return str(path)


def test_a_flood_of_blank_lines_is_counted_not_read_line_by_line(tmp_path, fed):
    path = _write(tmp_path, b"\n" * 2_000_000 + b"\r\n" * 100_000)
    startup = read_log_file(path)
    assert startup.lines_matched == 0 and startup.ooms == () and startup.era is None
    assert fed["lines"] < 1000
    with pytest.raises(log.LogFileError, match="no vLLM startup memory lines"):
        read_startup_log(path)


def test_a_flood_of_short_junk_lines_is_read_line_by_line_only_until_wordings_are_given_up(tmp_path, fed):
    lines = b"".join(b"junk %d\n" % (n % 1000) for n in range(300_000))
    startup = read_log_file(_write(tmp_path, lines))
    assert startup.lines_matched == 0 and startup.kinds_seen == ()
    assert fed["lines"] < log.MAX_WORDING_MISSES + 10 * log.STRETCH_CHARS


def test_binary_junk_parses_to_nothing_without_error(tmp_path, fed):
    import random

    rnd = random.Random(3)
    data = bytes(rnd.getrandbits(8) for _ in range(4 << 20))
    startup = read_log_file(_write(tmp_path, data))
    assert startup.lines_matched == 0
    assert fed["lines"] < data.count(b"\n") // 2


def _every_line(data: bytes) -> list[str]:
    """The lines feeding a file line by line reads (read_log_file's, before it counted quiet stretches)."""
    lines = [line.decode("utf-8", errors="replace").rstrip("\r") for line in data.split(b"\n")]
    if data.endswith(b"\n"):
        lines.pop()
    return lines


def _wrapped(data: bytes, width: int) -> bytes:
    return b"\n".join(line[i : i + width] for line in data.split(b"\n") for i in range(0, max(len(line), 1), width))


@pytest.mark.parametrize("path", REAL, ids=lambda p: os.path.relpath(p, LOGS))
def test_a_file_parses_to_what_feeding_its_every_line_gives(path, tmp_path):
    with open(path, "rb") as handle:
        data = handle.read()
    for variant in (data, b"\n" * 5000 + data.replace(b"\n", b"\n\n\n") + b"\n" * 5000):
        assert read_log_file(_write(tmp_path, variant)) == parse_lines(_every_line(variant))


def test_once_wordings_are_given_up_a_file_still_parses_to_what_feeding_its_every_line_gives(tmp_path):
    # Quiet stretches are skipped only once no wording is looked up: after a flood of lines that are not vLLM's.
    logs = b""
    for path in REAL:
        with open(path, "rb") as handle:
            logs += handle.read().rstrip(b"\n") + b"\n"
    flood = b"not a vLLM line\n" * (log.MAX_WORDING_MISSES + 10)
    for variant in (flood + logs, flood + _wrapped(logs, 41), flood + _wrapped(logs, 97) + b"\n" * 9000 + logs):
        assert read_log_file(_write(tmp_path, variant)) == parse_lines(_every_line(variant))


def test_a_line_across_two_read_blocks_is_one_line(tmp_path):
    line = b"INFO 11-02 09:14:19 [gpu_worker.py:563] Available KV cache memory: 54.89 GiB\n"
    before = b"x" * (log.BLOCK_BYTES - 30) + b"\n"
    startup = read_log_file(_write(tmp_path, before + line))
    assert startup.available_kv_cache_bytes == round(54.89 * log.GIB) and startup.lines_matched == 1


def test_a_line_of_max_line_bytes_with_its_ending_is_left_out_and_not_numbered(tmp_path):
    oom = b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n"
    long_line = b"y" * log.MAX_LINE_BYTES + b"\n"  # MAX_LINE_BYTES + 1 with its ending
    startup = read_log_file(_write(tmp_path, b"a\n" + long_line + oom))
    assert startup.oom is not None and startup.oom.line == 2


def test_every_anchor_step_and_hint_word_holds_a_gate_word():
    # The quiet test and the anchor search look for these words only: a phrase holding none would go unseen.
    for anchor, _ in log._BY_ANCHOR:
        assert any(word in anchor for word in log._ANCHOR_WORDS), anchor
        assert any(word in anchor for word in log._QUIET_WORDS), anchor
    for words, _ in log.STEP_WORDS:
        assert any(word in words for word in log._QUIET_WORDS), words
    for word in log._ASCEND_WORDS:
        assert any(gate in word for gate in log._ASCEND_GATE), word
    for gate in (*log._ANCHOR_WORDS, *log._QUIET_WORDS, *log._ASCEND_GATE):
        assert not any(blank in gate for blank in " \t\r\f\v"), gate


def test_a_template_cut_by_a_wrap_still_joins_after_a_failed_variant():
    # "Model loading took … GiB and" fails within the line; the "… GiB memory" variant is cut and joins.
    lines = [
        "INFO 11-02 09:14:03 [gpu_model_runner.py:5406] Model loading took 14.96 GiB mem",
        "ory and 5.374162 seconds",
    ]
    assert parse_lines(lines).weights_bytes == round(14.96 * log.GIB)


def _logs() -> bytes:
    logs = b""
    for path in REAL:
        with open(path, "rb") as handle:
            logs += handle.read().rstrip(b"\n") + b"\n"
    return logs


def test_a_line_read_again_gives_what_it_gave_read_afresh(monkeypatch):
    # Each line's own reading is kept (log._LINES) and used again: every line of the logs, then the logs again,
    # with lines whose figure does not convert and a flood of one memory line, read with and without it kept.
    text = _logs().decode("utf-8", errors="replace")
    memory = "(EngineCore_DP0 pid=2201) INFO 11-02 09:14:19 [gpu_worker.py:563] Available KV cache memory: 54.89 GiB\n"
    unconverted = (
        "INFO 11-02 09:14:03 [gpu_model_runner.py:5406] Model loading took 1e999 GiB memory\n"
        "INFO 11-02 09:14:20 [kv_cache_utils.py:2231] GPU KV cache size: 1e999 tokens\n"
        "INFO 11-02 09:14:20 [model.py:1510] Using max model len 4,096\n"
    )
    lines = (text + unconverted + memory * 500 + text + unconverted).splitlines()
    log._LINES.clear()
    kept = parse_lines(lines), parse_lines(lines)
    monkeypatch.setattr(log, "_LINES", type("Forgetful", (dict,), {"__setitem__": lambda self, key, value: None})())
    assert kept[0] == kept[1] == parse_lines(lines)


def test_the_lines_kept_are_bounded():
    log._LINES.clear()
    log._AFTER_FIRST.clear()
    lines = [f"Model loading took {n} GiB memory" for n in range(log.MAX_CACHED_LINES + 10)]
    parse_lines(lines + ["Available KV cache memory: 1 GiB " + "x" * log.MAX_CACHED_LINE_CHARS])
    assert 0 < len(log._LINES) <= log.MAX_CACHED_LINES
    assert 0 < len(log._AFTER_FIRST) <= log.MAX_CACHED_JOINS
    assert not any(len(line) > log.MAX_CACHED_LINE_CHARS for line in log._LINES)


def test_a_number_too_long_is_named_by_its_own_line_each_time_it_comes():
    line = "Available KV cache memory: " + "9" * (log.MAX_NUMBER_CHARS + 1) + " GiB"
    for lines, number in (([line], 1), (["a", "b", line], 3)):
        with pytest.raises(log.LogLineError, match=f"^line {number}: "):
            parse_lines(lines)


def test_a_wording_is_the_same_whatever_its_digits():
    # The reader keeps each line's wording by the line with its digits made "0" (log._wording).
    from kvguard.vllm import source_index

    for line in _logs().decode("utf-8", errors="replace").splitlines():
        zeroed = line.translate(str.maketrans("123456789", "000000000"))
        assert source_index.line_wording(line) == source_index.line_wording(zeroed), line
        tag = log._TAG.search(line)
        if tag:
            assert source_index.line_wording(line, tag.end()) == source_index.line_wording(zeroed, tag.end()), line


# Other programs' output before or between vLLM's lines (NCCL_DEBUG=INFO at TP8, pip, download progress): more
# lines of it than MAX_WORDING_MISSES, fewer than MAX_UNTAGGED_MISSES. Found in review: 5001 such lines before
# a log changed the era of 10 corpus logs (the wordings were given up before vLLM's lines came).
CHATTER = b"".join(
    b"node-3:%d:%d [%d] NCCL INFO Channel %02d/0 : %d[%d] -> %d[%d] via P2P/IPC\n"
    % (i, i, i % 8, i % 32, i % 8, i, (i + 1) % 8, i)
    for i in range(log.MAX_WORDING_MISSES + 1000)
)


@pytest.mark.parametrize("path", [p for p in REAL if os.sep + "real" + os.sep in p], ids=os.path.basename)
def test_other_programs_output_does_not_hide_the_wordings_of_vllms_lines(path, tmp_path):
    with open(path, "rb") as handle:
        data = handle.read()
    alone = read_log_file(path)
    lines = data.splitlines(keepends=True)
    for cut in (0, 3):
        variant = b"".join(lines[:cut]) + CHATTER + b"".join(lines[cut:])
        mixed = read_log_file(_write(tmp_path, variant))
        assert (mixed.era, mixed.era_candidates) == (alone.era, alone.era_candidates), cut


def test_wordings_are_given_up_after_enough_of_other_programs_output(tmp_path, fed):
    # The bound that keeps a flood cheap: past MAX_UNTAGGED_MISSES lines no wording is looked up.
    flood = b"".join(b"junk line number %d of a flood\n" % n for n in range(log.MAX_UNTAGGED_MISSES + 200_000))
    read_log_file(_write(tmp_path, flood))
    assert fed["lines"] < log.MAX_UNTAGGED_MISSES + 10 * log.STRETCH_CHARS
