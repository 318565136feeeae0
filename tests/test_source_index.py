"""The era from where a log's lines come from in vLLM's source (kvguard.vllm.source_index).

The index is read from every vLLM wheel on PyPI by oracles/vllm_sources/index.py; these tests check it
covers the era table, that it answers as the wheels say (facts read by hand from the wheels, cited), and
that hostile or foreign hints cannot pin a wrong row or cost unbounded work. That a real release's own log
pins its own row is checked against the real workers in tests/test_vllm_real.py.
"""

from __future__ import annotations

from kvguard.vllm import eras, source_index
from kvguard.vllm.log import parse_lines, parse_log

INDEX = source_index._load()


def test_the_index_covers_every_vllm_row_of_the_era_table():
    assert INDEX is not None
    releases = [eras.parse_version(r) for r in INDEX.releases]
    for era in eras.ERAS:
        if era.project == "vllm":
            inside = [r for r in releases if r >= era.first and (era.last is None or r <= era.last)]
            assert inside, f"no release of {era.name} in the source index"
    assert min(releases) == (0, 6, 4) and max(releases) >= (0, 34, 0)


def test_a_logger_call_is_where_the_wheel_has_it():
    # vllm/v1/worker/gpu_worker.py 0.11.0:298 logger.info("Available KV cache memory: %.2f GiB", ...), and
    # 0.14.0:358-362 the same call over five lines; 0.11.0 has no logger call at 359.
    assert INDEX.tag_fits("0.11.0", "gpu_worker.py", 298)
    assert INDEX.tag_fits("0.14.0", "gpu_worker.py", 360)
    assert not INDEX.tag_fits("0.11.0", "gpu_worker.py", 359)
    # A longer path is matched by its trailing parts.
    assert INDEX.tag_fits("0.11.0", "v1/worker/gpu_worker.py", 298)
    assert not INDEX.tag_fits("0.11.0", "v0/worker/gpu_worker.py", 298)


def test_a_traceback_frame_is_inside_the_function_it_names():
    # vllm/v1/worker/utils.py 0.20.0:413 raises in request_memory (wu 0.20.0:413-419, the free-memory refusal).
    assert INDEX.frame_fits("0.20.0", "v1/worker/utils.py", 413, "request_memory")
    assert not INDEX.frame_fits("0.20.0", "v1/worker/utils.py", 413, "init_device")
    assert not INDEX.frame_fits("0.11.0", "v1/worker/utils.py", 413, "request_memory")   # not there before 0.14


def test_tags_from_one_release_pin_its_row():
    lines = ["INFO 11-02 09:14:19 [gpu_worker.py:298] Available KV cache memory: 54.89 GiB",
             "INFO 11-02 09:14:19 [kv_cache_utils.py:1087] GPU KV cache size: 1,024 tokens"]
    log = parse_lines(lines)
    assert log.era == "vllm 0.9.1–0.11.2", log.era_reason
    assert "file:line tag" in log.era_reason


def test_a_date_rules_out_releases_published_after_it():
    # "Free memory on device cuda:0 (...)" is 0.14+ (wu 0.14.0:262-268); vLLM 0.15.0 was uploaded on
    # 2026-01-29 (PyPI), so a log written on 2026-01-20 is 0.14.x: the 0.14.0-0.17.1 row.
    line = ("[2026-01-20T10:00:00Z] ValueError: Free memory on device cuda:0 (10.0/80.0 GiB) on startup is less than "
            "desired GPU memory utilization (0.9, 72.0 GiB). Decrease GPU memory utilization or reduce GPU memory "
            "used by other processes.")
    assert parse_log(line).era == "vllm 0.14.0–0.17.1"
    assert parse_log(line.replace("2026-01-20", "2026-11-30")).era is None


def test_foreign_tags_are_left_out_and_unfitting_ones_pin_nothing():
    base = "INFO 11-02 09:14:19 [gpu_worker.py:298] Available KV cache memory: 54.89 GiB"
    # A plugin's own file (no vLLM release has it) says nothing about vLLM's release.
    foreign = parse_lines([base, "INFO 11-02 09:14:19 [kvguard_plugin_xyz.py:12] kvguard: hello"])
    assert foreign.era == "vllm 0.9.1–0.11.2"
    # Line numbers no release has (a fork): the tags are left out, and the reason says so.
    forked = parse_lines(["INFO 11-02 09:14:19 [gpu_worker.py:99999] Available KV cache memory: 54.89 GiB"])
    assert forked.era is None and "fit no vLLM release" in forked.era_reason


def test_a_flood_of_distinct_tags_is_bounded():
    lines = [f"INFO 11-02 09:14:19 [gpu_worker.py:{n}] Available KV cache memory: 1.00 GiB" for n in range(1, 20001)]
    log = parse_lines(lines)
    assert log.lines_matched == 20000
    assert "64 file:line tags" in log.era_reason


NPU_OOM = ("(Worker_TP0 pid=1) ERROR 02-07 18:18:59 [v1/executor/multiproc_executor.py:{line}] RuntimeError: NPU out "
           "of memory. Tried to allocate 2.57 GiB (NPU 0; 60.96 GiB total capacity; 57.49 GiB already allocated; "
           "57.49 GiB current active; 1.96 GiB free; 57.62 GiB reserved in total by PyTorch)")


def _only_in(path: str, wanted) -> int:
    """A line at which the index has a logger call of ``path`` in some releases, all of them ``wanted``."""
    for line in range(1, 3000):
        fits = [r for r in INDEX.releases if INDEX.tag_fits(r, path, line)]
        if fits and all(wanted(eras.parse_version(r)) for r in fits):
            return line
    raise AssertionError(f"no such line in {path}")


def test_a_vllm_ascend_log_takes_its_row_from_the_vllm_release_of_its_number():
    # vllm-ascend vX.Y.Z runs on vLLM vX.Y.Z (its versioning policy): an NPU OOM with no memory line, whose vLLM
    # tag fits only releases inside vllm-ascend's 0.9.1-0.14.0 row, is that row (the posted r47 is one).
    path = "v1/executor/multiproc_executor.py"
    line = _only_in(path, lambda r: (0, 9, 1) <= r < (0, 15, 0))
    log = parse_lines([NPU_OOM.format(line=line)])
    assert log.project == "vllm-ascend" and log.ooms
    assert log.era == "vllm-ascend 0.9.1–0.14.0", log.era_reason
    assert "runs on the vLLM release of its own number" in log.era_reason


def test_a_vllm_release_newer_than_every_vllm_ascend_row_names_none():
    # vllm-ascend's newest row is closed (0.20.0-0.23.0): a vLLM release after it has no plugin release yet.
    newest = max(e.last for e in eras.ERAS if e.project == "vllm-ascend")
    path = "v1/executor/multiproc_executor.py"
    line = _only_in(path, lambda r: r[:2] > newest[:2])
    log = parse_lines([NPU_OOM.format(line=line)])
    assert log.project == "vllm-ascend" and log.era is None and log.era_candidates == ()
    # Without the tag nothing names a row either.
    assert parse_lines([NPU_OOM.replace(" [v1/executor/multiproc_executor.py:{line}]", "")]).era_candidates == ()
