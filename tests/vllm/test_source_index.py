"""The era from where a log's lines come from in vLLM's source (kvguard.vllm.source_index).

The index is read from every vLLM wheel on PyPI by tests/upstream/oracles/vllm_sources/index.py; these tests check it
covers the era table, that it answers as the wheels say (facts read by hand from the wheels, cited), and
that hostile or foreign hints cannot pin a wrong row or cost unbounded work. That a real release's own log
pins its own row is checked against the real workers in tests/upstream/test_vllm_real.py.
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
    assert not INDEX.frame_fits("0.11.0", "v1/worker/utils.py", 413, "request_memory")  # not there before 0.14


def test_tags_from_one_release_pin_its_row():
    lines = [
        "INFO 11-02 09:14:19 [gpu_worker.py:298] Available KV cache memory: 54.89 GiB",
        "INFO 11-02 09:14:19 [kv_cache_utils.py:1087] GPU KV cache size: 1,024 tokens",
    ]
    log = parse_lines(lines)
    assert log.era == "vllm 0.9.1–0.11.2", log.era_reason
    assert "file:line tag" in log.era_reason


def test_kvguard_s_own_lines_are_not_taken_for_vllm_s():
    # The plugin logs through vLLM's logger, so its lines carry its own files' tags; vLLM also has a state.py
    # (kvguard.plugin.state logs hook failures), which would be read as one of vLLM's logger calls.
    lines = [
        "INFO 11-02 09:14:19 [gpu_worker.py:298] Available KV cache memory: 54.89 GiB",
        "INFO 11-02 09:14:19 [kv_cache_utils.py:1087] GPU KV cache size: 1,024 tokens",
    ]
    ours = [
        "WARNING 11-02 09:14:19 [state.py:84] kvguard: budget: the device source gives no free/total memory; keeping"
        " vLLM's KV cache budget (vLLM continues; further budget failures are logged at debug level)",
        "INFO 11-02 09:14:19 [budget.py:180] kvguard: no budget-time verdict: PYTORCH_CUDA_ALLOC_CONF='x'",
    ]
    alone, beside = parse_lines(lines), parse_lines(ours + lines)
    assert beside.era == alone.era == "vllm 0.9.1–0.11.2"
    assert beside.era_reason == alone.era_reason and "patched" not in beside.era_reason


def test_a_date_rules_out_releases_published_after_it():
    # "Free memory on device cuda:0 (...)" is 0.14+ (wu 0.14.0:262-268); vLLM 0.15.0 was uploaded on
    # 2026-01-29 (PyPI), so a log written on 2026-01-20 is 0.14.x: the 0.14.0-0.17.1 row.
    line = (
        "[2026-01-20T10:00:00Z] ValueError: Free memory on device cuda:0 (10.0/80.0 GiB) on startup is less than "
        "desired GPU memory utilization (0.9, 72.0 GiB). Decrease GPU memory utilization or reduce GPU memory "
        "used by other processes."
    )
    assert parse_log(line).era == "vllm 0.14.0–0.17.1"
    assert parse_log(line.replace("2026-01-20", "2026-11-30")).era is None


def test_a_dated_development_build_may_be_the_next_release_in_the_making():
    # vLLM's CI on main, 2025-03-10 (vllm-project/vllm#14574, tests/data/logs/real r58): of its five tags and
    # frames, 0.7.3 (uploaded 2025-02-20) has three (v1/engine/core.py 0.7.3:249, :294 and :59), 0.8.0
    # (2025-03-18) one (:59). Built from main, its code is 0.8.0's in the making, so both stay.
    tags = {("gpu_model_runner.py", 1067), ("core.py", 302)}
    frames = {
        ("v1/engine/core.py", 294, "run_engine_core"),
        ("v1/engine/core.py", 249, "__init__"),
        ("v1/engine/core.py", 59, "__init__"),
    }
    assert source_index.fit(tags, frames).releases == ("0.7.3",)
    dated = source_index.fit(tags, frames, "2025-03-10")
    assert dated.releases == ("0.7.3", "0.8.0") and "next release" in dated.reason
    # A release's own log fits it whole: the date adds nothing.
    whole = source_index.fit({("gpu_worker.py", 298)}, set(), "2025-10-20")
    assert "0.12.0" not in whole.releases and "next release" not in whole.reason


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


NPU_OOM = (
    "(Worker_TP0 pid=1) ERROR 02-07 18:18:59 [v1/executor/multiproc_executor.py:{line}] RuntimeError: NPU out "
    "of memory. Tried to allocate 2.57 GiB (NPU 0; 60.96 GiB total capacity; 57.49 GiB already allocated; "
    "57.49 GiB current active; 1.96 GiB free; 57.62 GiB reserved in total by PyTorch)"
)


def _only_in(path: str, wanted, numbered_as=None) -> int:
    """A line at which the index has a logger call of ``path`` in some releases, all of them ``wanted`` (and, with
    ``numbered_as``, one of them among those release numbers)."""
    for line in range(1, 3000):
        fits = [r for r in INDEX.releases if INDEX.tag_fits(r, path, line)]
        if (
            fits
            and all(wanted(eras.parse_version(r)) for r in fits)
            and (numbered_as is None or any(r in numbered_as for r in fits))
        ):
            return line
    raise AssertionError(f"no such line in {path}")


def test_a_vllm_ascend_log_takes_its_row_from_the_vllm_release_of_its_number():
    # vllm-ascend vX.Y.Z runs on vLLM vX.Y.Z (its versioning policy): an NPU OOM with no memory line, whose vLLM
    # tag fits only releases inside vllm-ascend's 0.9.1-0.14.0 row, is that row (the posted r47 is one).
    path = "v1/executor/multiproc_executor.py"
    # A vLLM release some vllm-ascend release is numbered as (there is none of 0.14.1, for one).
    plugin = source_index._load(source_index.PLUGIN_INDEX_PATHS["vllm-ascend"])
    line = _only_in(path, lambda r: (0, 9, 1) <= r < (0, 15, 0), {source_index.numbered(r) for r in plugin.releases})
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


# ------------------------------------------------------------------------------------------------ wordings


def _writers(line: str) -> list[str]:
    key = source_index.line_wording(line)
    mask = INDEX.wordings.get(key, 0)
    return [r for r in sorted(INDEX.releases, key=eras.parse_version) if mask & INDEX.bit[r]]


def test_a_line_s_wording_names_the_releases_that_write_it():
    # "GPU KV cache size: %s tokens" alone (v1/core/kv_cache_utils.py 0.27.0:2235); 0.28 on joins the
    # concurrency to that line (0.28.0:1870).
    writers = _writers(
        "(EngineCore pid=1) INFO 05-01 10:00:00 [kv_cache_utils.py:2235] GPU KV cache size: 90,841 tokens"
    )
    assert "0.27.1" in writers and "0.28.0" not in writers and "0.34.0" not in writers
    # "… took %.2f seconds" (v1/engine/core.py 0.14.0:274), "… took %.2f s" (0.20.0:307); the same key with or
    # without vLLM's record prefix, whatever the figures.
    seconds = _writers("init engine (profile, create kv cache, warmup model) took 9.38 seconds")
    short = _writers(
        "INFO 05-01 10:00:00 [core.py:307] init engine (profile, create kv cache, warmup model) took 123.4 s"
    )
    assert "0.14.0" in seconds and "0.20.0" not in seconds
    assert "0.20.0" in short and "0.34.0" in short and "0.14.0" not in short
    # A line every release writes, or none does, is no hint.
    assert _writers("kvguard: KV cache budget 12.00 GiB instead of vLLM's 13.00 GiB") == []


def test_a_paste_of_bare_messages_is_dated_by_their_wording():
    # Prefixes stripped (as notes and READMEs quote them): the wordings alone bound the release.
    log = parse_log(
        "Model loading took 74.08 GiB memory and 36.573577 seconds\nAvailable KV cache memory: 32.08 GiB\n"
        "GPU KV cache size: 90,841 tokens\n"
        "init engine (profile, create kv cache, warmup model) took 9.38 s\n"
    )
    assert log.era_candidates == ("vllm 0.20.0–0.26.0", "vllm 0.27.0–0.33.0"), log.era_reason
    assert "wording" in log.era_reason


def test_many_wordings_every_release_writes_do_not_make_a_stray_tag_a_fit():
    # A development build's two tags, one of which lands on a logger call in a few releases by chance, and two
    # wordings 0.10+ all write: the tags fit no release (1 of 2), and the wordings alone bound it.
    lines = [
        "INFO 03-30 07:05:40 [config.py:228] Setting attention block size to 528 tokens to ensure that "
        "attention page size is >= mamba page size.",
        "INFO 03-30 07:05:40 [config.py:259] Padding mamba page size by 0.76% to ensure that mamba page size "
        "and attention page size are exactly equal.",
        "INFO 03-30 07:05:41 [gpu_worker.py:99999] Available KV cache memory: 8.11 GiB",
    ]
    log = parse_lines(lines)
    assert log.era is None and "fit no vLLM release" in log.era_reason, log.era_reason


def test_a_plugin_s_copies_of_vllm_messages_do_not_date_it():
    # vllm-ascend writes vLLM's messages from its own patched copies (vllm_ascend/patch/platform/
    # patch_message_queue.py 0.11.0:128-134): an NPU OOM beside vLLM's shared-memory notice, whose wording
    # the vLLM wheels write from 0.18 only, is not moved to vllm-ascend 0.18+.
    log = parse_log(
        "NPU out of memory. NPUWorkspaceAllocator tried to allocate 180.00 MiB(NPU 1; 60.96 GiB total "
        "capacity; 86.81 MiB free).\nNo available shared memory broadcast block found in 60 seconds. This "
        "typically happens when some processes are hanging or doing some time-consuming work (e.g. "
        "compilation, weight/kv cache quantization).\n"
    )
    assert log.project == "vllm-ascend" and log.oom.tried_bytes == 180 << 20
    assert "wording" not in log.era_reason and not log.era_candidates, log.era_reason


def test_the_indexer_reads_each_form_of_a_logger_message():
    import ast
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "vllm_sources_index",
        pathlib.Path(__file__).resolve().parents[2] / "tests" / "upstream" / "oracles" / "vllm_sources" / "index.py",
    )
    indexer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(indexer)
    source = """
logger.info("Available KV cache memory: %.2f GiB", x)
logger.info(f"GPU KV cache size: {n:,} tokens")
logger.warning("Padding {} by {}".format(a, b))
logger.debug("literal 100%% sure")
msg = (f"Free memory on device ({a}/{b} GiB) on startup. " f"Desired GPU memory utilization is ({c}, {d} GiB).")
logger.info(msg)
logger.info(build_message())
"""
    tree = ast.parse(source)
    assigned = indexer._assigned(tree)
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") in ("info", "warning", "debug")
    ]
    found = [indexer.message_templates(c, assigned) for c in sorted(calls, key=lambda c: c.lineno)]
    mark = source_index.MARK
    assert found[0] == {f"Available KV cache memory: {mark} GiB"}
    assert found[1] == {f"GPU KV cache size: {mark} tokens"}
    assert found[2] == {f"Padding {mark} by {mark}"}
    assert found[3] == {"literal 100%% sure"}  # no args: logging leaves "%%" as it is
    assert found[4] == {
        f"Free memory on device ({mark}/{mark} GiB) on startup. Desired GPU memory utilization is ({mark}, {mark} GiB)."
    }
    assert found[5] == set()  # built at run time: no wording
    # The key is the same for the template and for a line vLLM wrote from it.
    assert source_index.wording_key(next(iter(found[4]))) == source_index.line_wording(
        "INFO 11-02 09:14:19 [gpu_worker.py:372] Free memory on device (22.76/24.0 GiB) on startup. Desired GPU "
        "memory utilization is (0.97, 23.28 GiB)."
    )


# ------------------------------------------------------------------------------------------------ vllm-ascend's own


def test_the_vllm_ascend_index_covers_every_row_of_the_table():
    plugin = source_index._load(source_index.PLUGIN_INDEX_PATHS["vllm-ascend"])
    assert plugin is not None
    numbers = {eras.parse_version(source_index.numbered(r)) for r in plugin.releases}
    for era in eras.ERAS:
        if era.project == "vllm-ascend":
            assert any(n >= era.first and (era.last is None or n[:2] <= era.last[:2]) for n in numbers), era.name
    # Its own files, read from its own releases: vllm_ascend/worker/worker.py 0.23.0.post1:593-595 logs the KV
    # cache memory (info_once over three lines), 0.18.0:356-358 at other lines.
    assert plugin.tag_fits("0.23.0.post1", "worker.py", 593)
    assert not plugin.tag_fits("0.18.0", "worker.py", 593)


def test_a_vllm_ascend_log_is_pinned_by_the_plugin_s_own_tags():
    # vllm_ascend/utils.py 0.23.0.post1:1404 ("Block size is set to 128 if prefix cache or chunked prefill is
    # enabled.") and worker/worker.py 0.23.0.post1:593 (the KV cache line), times cut off as in the held-out r49:
    # the plugin's own source places both in vllm-ascend 0.23.0 (with vLLM 0.23.0's kv_cache_utils.py).
    log = parse_lines(
        [
            "(APIServer pid=1) INFO [utils.py:1404] Block size is set to 128 if prefix cache or chunked "
            "prefill is enabled.",
            "(Worker_PP0_TP0 pid=2) INFO [worker.py:593] Available KV cache memory: 51.98 GiB",
        ]
    )
    assert log.project == "vllm-ascend" and log.block_size == 128
    assert log.era == "vllm-ascend 0.20.0–0.23.0", log.era_reason
    assert "vllm-ascend 0.23.0" in log.era_reason
    # The same lines at line numbers neither the plugin nor its vLLM has: nothing narrows.
    forked = parse_lines(
        [
            "(APIServer pid=1) INFO [utils.py:99998] Block size is set to 128 if prefix cache or chunked "
            "prefill is enabled.",
            "(Worker_PP0_TP0 pid=2) INFO [worker.py:99999] Available KV cache memory: 51.98 GiB",
        ]
    )
    assert forked.era is None and len(forked.era_candidates) > 1


def test_a_placeholder_that_printed_words_does_not_rule_its_release_out():
    # "Using TRTLLM prefill attention (auto-detected)." is a literal in utils/flashinfer.py 0.20.0:405 and the
    # template "Using TRTLLM %s attention (auto-detected)." from 0.27.0:504: 0.27+ writes the same line.
    log = parse_log("Using TRTLLM prefill attention (auto-detected).\nAvailable KV cache memory: 32.08 GiB\n")
    assert "vllm 0.20.0–0.26.0" in log.era_candidates
    assert "vllm 0.27.0–0.33.0" in log.era_candidates and "vllm 0.34.0+" in log.era_candidates, log.era_reason


def test_figures_printed_side_by_side_hash_as_the_template():
    # "%d.%d" prints "12.4", "%d-%d" "10-20", "+%d" "+3": one figure each to the reader, one mark each here.
    for template, line in (
        ("nvcc found %d.%d for the kernels of this build", "nvcc found 12.4 for the kernels of this build"),
        ("Free locks of tokens %d-%d for the request", "Free locks of tokens 10-20 for the request"),
        ("weight cache daemon ready (+%d aliases)", "weight cache daemon ready (+3 aliases)"),
    ):
        assert source_index.wording_key(source_index.percent_template(template)) == source_index.line_wording(line)


def test_another_logger_s_tag_is_not_taken_for_vllm_s():
    # A launcher's own "%(asctime)s %(levelname)s [%(filename)s:%(lineno)d]" line before vLLM's bare lines: its
    # [utils.py:238] is not a vLLM record's tag, so it narrows nothing.
    bare = (
        "Model loading took 74.08 GiB memory and 36.573577 seconds\nAvailable KV cache memory: 32.08 GiB\n"
        "GPU KV cache size: 90,841 tokens\ninit engine (profile, create kv cache, warmup model) took 9.38 s\n"
    )
    alone = parse_log(bare)
    launcher = parse_log(
        "2026-12-20 10:00:00,123 INFO [utils.py:238] launching vllm serve with the sweep config\n" + bare
    )
    assert launcher.era_candidates == alone.era_candidates, launcher.era_reason
    # vLLM's own record with its time cut off still is one.
    assert (
        parse_lines(
            ["(EngineCore pid=7) INFO [kv_cache_utils.py:1087] GPU KV cache size: 1,024 tokens"]
        ).era_reason.find("file:line tag")
        >= 0
    )
