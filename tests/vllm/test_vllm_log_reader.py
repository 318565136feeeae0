"""The log file reader's work per line: floods of lines that say nothing are counted, not read line by line,
and what a file parses to is what feeding its every line gives (kvguard.vllm.log.read_log_file)."""

from __future__ import annotations

import glob
import os
import re

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


# Lines of one shape (each digit made "0") are read from the first of them (log._SHAPES, _Line.again): only what
# no digit changes is taken from it. Each pair below is one shape whose texts with digits differ in meaning.
SHAPE_PAIRS = (
    # A template whose own text holds digits: the first matches (cudagraph, acl_graph), the second is no such line.
    (
        "(EngineCore_DP0 pid=2201) INFO 11-02 09:14:19 [gpu_worker.py:579] CUDA graph memory profiling is enabled "
        "(default since v0.21.0). The current --gpu-memory-utilization=0.9200 is equivalent to "
        "--gpu-memory-utilization=0.9115 without CUDA graph memory profiling.",
        "(EngineCore_DP0 pid=2201) INFO 11-02 09:14:19 [gpu_worker.py:579] CUDA graph memory profiling is enabled "
        "(default since v0.22.0). The current --gpu-memory-utilization=0.9200 is equivalent to "
        "--gpu-memory-utilization=0.9115 without CUDA graph memory profiling.",
    ),
    (
        "INFO 11-02 09:14:19 [worker_310p.py:12] Available KV cache memory: 3.50 GiB",
        "INFO 11-02 09:14:19 [worker_320p.py:12] Available KV cache memory: 3.50 GiB",
    ),
    (
        "INFO 11-02 09:14:19 [worker.py:1] Skip warm-up atb ops for 310P device",
        "INFO 11-02 09:14:19 [worker.py:1] Skip warm-up atb ops for 320P device",
    ),
    # An Ascend word with a digit (a hint), a date (_DATED tests its digits), a version banner.
    (
        "INFO 11-02 09:14:19 [platform.py:12] Block size is set to 128",
        "INFO 11-02 09:14:19 [platform.py:12] Block size is set to 256",
    ),
    (
        "[2026-02-24T20:21:58Z] INFO 11-02 09:14:19 [gpu_worker.py:563] Available KV cache memory: 54.89 GiB",
        "[1026-02-24T20:21:58Z] INFO 11-02 09:14:19 [gpu_worker.py:563] Available KV cache memory: 54.89 GiB",
    ),
    (
        "INFO 09-12 10:00:01 [api_server.py:1] vLLM API server version 0.11.0",
        "INFO 09-12 10:00:01 [api_server.py:1] vLLM API server version 0.14.0",
    ),
    # The same template, other figures: each line states its own (one does not convert at all).
    (
        "INFO 11-02 09:14:19 [gpu_worker.py:563] Available KV cache memory: 54.89 GiB",
        "INFO 11-02 09:14:19 [gpu_worker.py:563] Available KV cache memory: 12.34 GiB",
    ),
    (
        "INFO 11-02 09:14:20 [kv_cache_utils.py:2231] GPU KV cache size: 2e099 tokens",
        "INFO 11-02 09:14:20 [kv_cache_utils.py:2231] GPU KV cache size: 1e999 tokens",
    ),
)


def _afresh(lines, monkeypatch) -> log.StartupLog:
    """``lines`` read with nothing kept from line to line (each line read in full)."""
    with monkeypatch.context() as patch:
        forgetful = type("Forgetful", (dict,), {"__setitem__": lambda self, key, value: None})
        patch.setattr(log, "_LINES", forgetful())
        patch.setattr(log, "_SHAPES", forgetful())
        return parse_lines(lines)


@pytest.mark.parametrize("pair", SHAPE_PAIRS, ids=lambda pair: pair[1][-40:])
def test_lines_of_one_shape_each_read_as_themselves(pair, monkeypatch):
    first, second = pair
    zeroed = str.maketrans("123456789", "000000000")
    assert first != second and first.translate(zeroed) == second.translate(zeroed)
    for one, other in (pair, pair[::-1]):
        log._SHAPES.clear()
        log._LINES.clear()
        log._read_line(one, 1, True)
        again, fresh = log._read_line(other, 2, True), log._Line(log._clean(other), 2)
        for name in ("line", "tail", "dated", "ascend", "hinted", "rare"):
            assert getattr(again, name) == getattr(fresh, name), name
        assert [(k.name, found, values, reach) for k, found, values, reach in again.attempts] == [
            (k.name, found, values, reach) for k, found, values, reach in fresh.attempts
        ]
        assert again.banner() == fresh.banner() and again.tag() == fresh.tag()
        assert parse_lines([one, other]) == _afresh([one, other], monkeypatch)
    # The two say different things (else the pair would test nothing).
    assert _afresh([first], monkeypatch) != _afresh([second], monkeypatch)


def test_the_cudagraph_line_of_another_release_is_not_taken_from_its_shape():
    log._SHAPES.clear()
    log._LINES.clear()
    first, second = SHAPE_PAIRS[0]
    assert parse_lines([first]).lines_matched == 1
    assert parse_lines([first, second]).lines_matched == 1
    assert parse_lines([second]).lines_matched == 0


_TIME = re.compile(r"[0-9]{2}:[0-9]{2}:[0-9]{2}")
_PID = re.compile(r"pid=[0-9]+")


@pytest.mark.parametrize("path", REAL, ids=lambda p: os.path.relpath(p, LOGS))
def test_a_log_whose_lines_share_shapes_reads_as_each_line_afresh(path, monkeypatch):
    # Every line, then copies of it with other digits (one shape: each copy read from the first); and the log three
    # times over with a time and a pid of its own on each line (a flood as vLLM writes one): what a line says is
    # its own, read from its shape or not, and the times and pids change no figure.
    import random

    rnd = random.Random(path)
    with open(path, encoding="utf-8", errors="replace") as handle:
        lines = handle.read().splitlines()
    shaped = [
        copy
        for line in lines
        for copy in (line, re.sub(r"[0-9]", lambda m: str(rnd.randint(0, 9)), line), re.sub(r"[0-9]", "9", line))
    ]
    log._SHAPES.clear()
    assert parse_lines(shaped) == _afresh(shaped, monkeypatch)
    timed = [
        _PID.sub(f"pid={1000 + n}", _TIME.sub(f"{n // 3600 % 24:02d}:{n // 60 % 60:02d}:{n % 60:02d}", line, 1), 1)
        for n, line in enumerate(lines * 3)
    ]
    log._SHAPES.clear()
    varied = parse_lines(timed)
    assert varied == _afresh(timed, monkeypatch) == parse_lines(lines * 3)


def _digits_alike(pattern) -> list:
    """What in ``pattern`` tells one ASCII digit from another: a literal digit, or a class holding some digits
    and not all ten."""
    from re import _constants as c, _parser

    told: list = []

    def walk(items) -> None:
        for op, value in items:
            if op is c.LITERAL and "0" <= chr(value) <= "9":
                told.append(chr(value))
            elif op is c.IN:
                chars: set[int] = set()
                for kind, item in value:
                    if kind is c.LITERAL:
                        chars.add(item)
                    elif kind is c.RANGE:
                        chars.update(range(item[0], item[1] + 1))
                    elif kind is c.CATEGORY and item in (c.CATEGORY_DIGIT, c.CATEGORY_WORD):
                        chars.update(range(48, 58))
                digits = chars & set(range(48, 58))
                if digits and digits != set(range(48, 58)):
                    told.append(value)
            elif op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
                walk(value[2])
            elif op is c.SUBPATTERN:
                walk(value[3])
            elif op is c.BRANCH:
                for branch in value[1]:
                    walk(branch)
            elif op in (c.ASSERT, c.ASSERT_NOT):
                walk(value[1])

    walk(_parser.parse(pattern.pattern, pattern.flags))
    return told


def test_the_searches_a_shape_shares_treat_every_digit_alike():
    # _Line.again takes from the first line of a shape what these find; _DATED is read from each line.
    from kvguard.vllm import oom, source_index

    for pattern in (
        log._NUMBER,
        log._TAG,
        log._RECORD_PREFIX,
        log._ANSI,
        log._BLANKS,
        source_index._MESSAGE,
        source_index._FIGURE,
        source_index._MARKS,
        source_index._NOT_LETTERS,
    ):
        assert _digits_alike(pattern) == [], pattern.pattern
    assert _digits_alike(log._DATED)  # the checker sees digits where a pattern tells them apart
    words = (*log._ANCHOR_WORDS, *log._MINDSPORE_WORDS, oom.ERROR_IN_METHOD, "out of memory", "OutOfMemoryError")
    assert not any(log._has_digit(word) for word in words)
    texts = {text for text, _ in log._DIGIT_TEXTS}
    for kind in log.KINDS:
        held = {value for piece, value in kind.pieces if piece == "lit" and log._has_digit(value)}
        assert held <= texts and kind.digit_free == (not held), kind.template
    assert {w for w in (*log._ASCEND_GATE, *log._ASCEND_WORDS) if log._has_digit(w)} <= texts


def test_a_utilization_with_a_length_suffix_on_a_pasted_command_is_left_out_not_a_traceback(tmp_path):
    # The flag pattern takes "32k" for --max-model-len; "--gpu-memory-utilization=0k" made float() raise.
    import subprocess
    import sys

    log = tmp_path / "pasted.log"
    log.write_text("$ vllm serve /models/qwen --gpu-memory-utilization=0k --max-model-len 32k\n")
    out = subprocess.run(
        [sys.executable, "-m", "kvguard", "check", "--from-log", str(log)], capture_output=True, text=True, timeout=60
    )
    assert "Traceback" not in out.stderr and "could not convert" not in out.stderr, out.stderr
    from kvguard.vllm.log import read_log_file

    assert read_log_file(str(log)).gpu_memory_utilization is None
    log.write_text("$ vllm serve /models/qwen --gpu-memory-utilization=0.85 --max-model-len 32k\n")
    assert read_log_file(str(log)).gpu_memory_utilization == 0.85
