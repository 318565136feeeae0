"""A log whose lines leave several era rows is judged under each of them (issue 35, item 5).

The text of many logs cannot tell the rows apart; kvguard never pins one for it. ``kvguard check --from-log``
computes the guard's verdict under each row the lines leave, says it "holds on all N rows" or names the rows it
differs on, and lets the worst state stand (never a false all-clear). Each test runs the real CLI; the per-row
budgets are checked against ``kvguard budget --vllm-version`` of a release in that row, and against the figures
written by hand in the corpus manifest (tests/data/logs/real/MANIFEST.json), never against kvguard's own output.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
from click.testing import CliRunner
from conftest import TESTS

from kvguard.cli import main
from kvguard.vllm.log import read_log_file

HERE = TESTS
LOGS = os.path.join(HERE, "data", "logs")
REAL = os.path.join(LOGS, "real")
GIB = 1 << 30
GIB_TOLERANCE = 0.006 * GIB  # the log prints 0.01 GiB

with open(os.path.join(REAL, "MANIFEST.json"), encoding="utf-8") as _handle:
    MANIFEST = {entry["id"]: entry for entry in json.load(_handle)["logs"]}

CORPUS = sorted(glob.glob(os.path.join(LOGS, "**", "*.log"), recursive=True))
AMBIGUOUS = [path for path in CORPUS if len(read_log_file(path).era_candidates) > 1]
STATE_EXIT = {"ok": 0, "warning": 1, "critical": 2, "unknown": 3}
WORST_FIRST = ("critical", "warning", "unknown", "ok")


def check(path: str, *flags: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["check", "--from-log", path, "--json", *flags])
    assert result.exit_code in STATE_EXIT.values(), result.output
    return result.exit_code, json.loads(result.stdout)


def check_text(path: str, *flags: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["check", "--from-log", path, *flags])
    return result.exit_code, result.stdout


def budget_of(release: str, profile: dict, tmp_path) -> int:
    """What ``kvguard budget --vllm-version RELEASE --profile FILE`` gives as vLLM's KV cache budget."""
    path = tmp_path / f"profile-{release}.json"
    path.write_text(json.dumps(profile), encoding="utf-8")
    result = CliRunner().invoke(main, ["budget", "--vllm-version", release, "--profile", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["budgets"]["stock"]["kv_cache_bytes"]


def first_release(row: str) -> str:
    """The first release a row's name holds: "vllm 0.14.0–0.17.1" -> "0.14.0", "vllm 0.34.0+" -> "0.34.0"."""
    return row.split(" ", 1)[1].split("–")[0].rstrip("+")


def worst(states) -> str:
    return next(state for state in WORST_FIRST if state in set(states))


def write(tmp_path, *lines: str) -> str:
    path = tmp_path / "vllm.log"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_the_corpus_holds_logs_whose_lines_leave_several_rows():
    # The premise of the corpus tests below: without such logs they would check nothing.
    assert len(AMBIGUOUS) >= 10, [os.path.relpath(p, LOGS) for p in AMBIGUOUS]


@pytest.mark.parametrize("path", AMBIGUOUS, ids=lambda p: os.path.relpath(p, LOGS))
def test_an_ambiguous_corpus_log_is_judged_on_each_of_its_rows_and_the_worst_stands(path):
    code, data = check(path)
    log = data["log"]
    rows = log["era_verdicts"]
    assert log["era"] is None  # never pinned for it
    assert [row["era"] for row in rows] == log["era_candidates"]
    states = [row["state"] for row in rows]
    assert log["era_verdict"] == ("holds_on_all" if len(set(states)) == 1 else "differs")
    shown = next(row for row in rows if row["era"] == log["era_shown"])
    assert shown["state"] == worst(states)
    expected = "critical" if log["findings"] else worst(states)
    assert (data["state"], code) == (expected, STATE_EXIT[expected])
    for row in rows:
        # Without the device's size and utilization no corpus log states a whole profile on any row.
        assert row["state"] == "unknown" and row["profile"] is None
        assert [r["code"] for r in row["reasons"]] == ["no_profile"]


def test_an_ambiguous_corpus_log_s_text_says_the_verdict_holds_on_all_its_rows():
    code, text = check_text(os.path.join(REAL, "r09.log"))
    rows = read_log_file(os.path.join(REAL, "r09.log")).era_candidates
    assert len(rows) > 1
    eras_line = next(line for line in text.splitlines() if line.startswith("ERAS"))
    assert f"holds on all {len(rows)} rows" in eras_line and all(row in eras_line for row in rows)
    assert code == 2  # the refusal the log states is critical whatever the rows


# r48: 8x RTX PRO 6000 Blackwell (96 GB); r54: H200 NVL at --gpu-memory-utilization 0.78 (its command line).
@pytest.mark.parametrize("log_id, device", [("r48", ("95.59GiB", "0.9")), ("r54", ("139.8GiB", "0.78"))])
def test_each_row_s_kv_budget_is_what_kvguard_budget_gives_for_a_release_of_that_row(log_id, device, tmp_path):
    path = os.path.join(REAL, f"{log_id}.log")
    total, utilization = device
    code, data = check(path, "--total-memory", total, "--gpu-memory-utilization", utilization)
    rows = data["log"]["era_verdicts"]
    assert len(rows) > 1, "the premise: the log's lines leave several rows"
    decided = MANIFEST[log_id]["expect"]["available_kv_gib"] * GIB  # written by hand from the log
    judged = [row for row in rows if row["profile"] is not None]
    assert judged, "some row's formula reads the log's figures backwards"
    for row in judged:
        # The row's formula, run forwards by kvguard budget for a release of that row, gives the KV cache the
        # row's verdict was judged with, and that is the one the log states vLLM decided.
        assert budget_of(first_release(row["era"]), row["profile"], tmp_path) == row["kv_budget_bytes"]
        assert abs(row["kv_budget_bytes"] - decided) <= GIB_TOLERANCE
        assert row["state"] == "ok" and row["headroom_bytes"] > 0
    for row in rows:
        if row["profile"] is None:
            # 0.27+ budgets from the total consumed, which no line of these logs states: no verdict on that row.
            assert row["formula"] == "consumed" and row["state"] == "unknown"
            assert "total consumed" in row["reasons"][0]["message"]
    # The rows differ, ok and unknown: unknown stands (exit 3), never the ok of the rows that could be judged.
    assert data["log"]["era_verdict"] == "differs"
    assert (data["state"], code) == ("unknown", 3)
    assert data["log"]["era_shown"] in [row["era"] for row in rows if row["state"] == "unknown"]


# vLLM's wording, release by release: "Model loading took %.4f GiB and %.6f seconds" (gpu_model_runner.py
# 0.8.5-0.11.2), "Model loading took {format_gib} GiB memory and ..." (0.12.0+), the CUDA-graph notice of
# gpu_worker.py 0.20.0:445-468 and "Available KV cache memory: %.2f GiB" (0.11: gpu_worker.py:298) /
# format_gib (0.14.0:358-362). No [file:line] tags: the wording alone leaves the rows.
WEIGHTS_GIB, KV_GIB = 20.5, 45.3
PEAK_AND_CONSUMED = (
    f"INFO 11-20 10:00:01 Model loading took {WEIGHTS_GIB} GiB memory and 8.123456 seconds",
    "INFO 11-20 10:00:08 CUDA graph memory profiling is enabled (default since v0.21.0). The current "
    "--gpu-memory-utilization=0.9000 is equivalent to --gpu-memory-utilization=0.8875 without CUDA graph memory "
    "profiling. To maintain the same effective KV cache size as before, increase --gpu-memory-utilization to 0.9125.",
    f"INFO 11-20 10:00:09 Available KV cache memory: {KV_GIB} GiB",
)


def _peak_and_consumed_rows(data) -> tuple[list[dict], list[dict]]:
    rows = data["log"]["era_verdicts"]
    peak = [row for row in rows if row["formula"].startswith("peak")]
    consumed = [row for row in rows if row["formula"] == "consumed"]
    assert peak and consumed and len(peak) + len(consumed) == len(rows), "the premise: both kinds of row remain"
    return peak, consumed


def test_a_row_that_cannot_be_judged_outweighs_an_ok_on_another_row(tmp_path):
    path = write(tmp_path, *PEAK_AND_CONSUMED)
    code, data = check(path, "--total-memory", "80GiB")
    peak, consumed = _peak_and_consumed_rows(data)
    for row in peak:
        assert row["state"] == "ok"
        assert abs(row["kv_budget_bytes"] - KV_GIB * GIB) <= 1
        assert row["headroom_bytes"] >= 80 * GIB * (1 - 0.9) - 1  # at least the slack 1 - util leaves
    assert all(row["state"] == "unknown" and row["kv_budget_bytes"] is None for row in consumed)
    assert (data["state"], code) == ("unknown", 3)
    assert data["log"]["era_verdict"] == "differs" and data["log"]["era_shown"] == consumed[0]["era"]

    code, text = check_text(path, "--total-memory", "80GiB")
    eras_line = next(line for line in text.splitlines() if line.startswith("ERAS"))
    assert "differs" in eras_line
    assert f"unknown on {', '.join(row['era'] for row in consumed)}" in eras_line
    assert f"ok on {', '.join(row['era'] for row in peak)}" in eras_line
    assert f"the worst, unknown ({consumed[0]['era']}), stands" in eras_line
    assert code == 3


def test_a_critical_row_outweighs_the_rows_that_cannot_be_judged(tmp_path):
    # A 60 GiB device cannot hold the 20.5 GiB of weights and the 45.3 GiB KV cache the log states: the peak
    # rows project past it (critical); the 0.27+ rows still lack the total consumed (unknown). Critical stands.
    path = write(tmp_path, *PEAK_AND_CONSUMED)
    code, data = check(path, "--total-memory", "60GiB")
    peak, consumed = _peak_and_consumed_rows(data)
    for row in peak:
        assert row["state"] == "critical"
        assert [r["code"] for r in row["reasons"]] == ["projected_peak_exceeds_capacity"]
        assert row["headroom_bytes"] <= (60 - WEIGHTS_GIB - KV_GIB) * GIB + GIB_TOLERANCE
    assert all(row["state"] == "unknown" for row in consumed)
    assert (data["state"], code) == ("critical", 2)
    assert data["log"]["era_shown"] == peak[0]["era"]
    assert data["ranks"][0]["state"] == "critical"  # the ranks shown are the worst row's

    code, text = check_text(path, "--total-memory", "60GiB")
    assert f"critical on {', '.join(row['era'] for row in peak)}" in text
    assert f"the worst, critical ({peak[0]['era']}), stands" in text
    assert f"as {peak[0]['era']} budgets it" in text
    assert code == 2


def test_rows_whose_formulas_give_one_verdict_hold_on_all(tmp_path):
    # "Model loading took %.4f GiB and" is 0.8.5-0.11.2's wording: the signed absolute peak of 0.8.5-0.9.0 and
    # the peak of 0.9.1-0.11.2 both read the decided 45.30 GiB back into a profile that fits 80 GiB at 0.9.
    path = write(
        tmp_path,
        f"INFO 11-20 10:00:01 Model loading took {WEIGHTS_GIB:.4f} GiB and 8.123456 seconds",
        "INFO 11-20 10:00:09 Available KV cache memory: 45.30 GiB",
    )
    code, data = check(path, "--total-memory", "80GiB", "--gpu-memory-utilization", "0.9")
    rows = data["log"]["era_verdicts"]
    assert len({row["formula"] for row in rows}) > 1, "the premise: rows of different formulas remain"
    for row in rows:
        assert row["state"] == "ok"
        assert budget_of(first_release(row["era"]), row["profile"], tmp_path) == row["kv_budget_bytes"]
        assert abs(row["kv_budget_bytes"] - 45.30 * GIB) <= 1
    assert data["log"]["era_verdict"] == "holds_on_all" and (data["state"], code) == ("ok", 0)

    code, text = check_text(path, "--total-memory", "80GiB", "--gpu-memory-utilization", "0.9")
    names = ", ".join(row["era"] for row in rows)
    assert f"ERAS     the verdict holds on all {len(rows)} rows the log's lines leave ({names}): ok" in text
    assert code == 0


def test_a_log_whose_lines_pin_one_row_is_judged_on_that_row_alone():
    path = os.path.join(LOGS, "eras", "v0.27-debug.log")
    code, data = check(path)
    log = data["log"]
    assert log["era"] is not None and log["era_candidates"] == [log["era"]]
    assert log["era_verdict"] == "pinned" and log["era_shown"] == log["era"]
    assert [row["era"] for row in log["era_verdicts"]] == [log["era"]]
    assert log["era_verdicts"][0]["state"] == data["state"]
    _, text = check_text(path)
    assert "ERAS" not in text


def test_a_log_that_leaves_no_row_has_no_era_verdict(tmp_path):
    # An out-of-memory error alone (v1/engine/core.py's message) names no release: no row, none judged.
    path = write(
        tmp_path,
        "ERROR 11-20 10:00:09 RuntimeError: Worker failed with error 'CUDA error: out of memory', "
        "please check the stack trace above for the root cause",
    )
    code, data = check(path)
    assert data["log"]["era_candidates"] == [] and (data["state"], code) == ("critical", 2)
    assert (data["log"]["era_verdict"], data["log"]["era_shown"], data["log"]["era_verdicts"]) == (None, None, [])


def _example_snapshots(spool: str, with_profile: bool) -> None:
    """Two ranks' snapshots as the probe writes them (docs/gen_reference.py's example: a 64 GiB NPU), with or
    without their own startup profile."""
    import dataclasses
    import importlib.util
    import time

    from kvguard.spool.io import write_snapshot

    spec = importlib.util.spec_from_file_location("gen_reference", os.path.join(HERE, "..", "docs", "gen_reference.py"))
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    for rank in (0, 1):
        snapshot = generator.example_snapshot(rank, time.time())
        write_snapshot(spool, snapshot if with_profile else dataclasses.replace(snapshot, profile=None))


@pytest.mark.parametrize("with_profile", [True, False], ids=["snapshot profiles", "no snapshot profile"])
def test_spool_ranks_are_judged_on_each_row_only_where_they_take_the_log_s_profile(with_profile, tmp_path):
    spool = str(tmp_path / "spool")
    os.makedirs(spool)
    _example_snapshots(spool, with_profile)
    path = write(
        tmp_path,
        f"INFO 11-20 10:00:01 Model loading took {WEIGHTS_GIB:.4f} GiB and 8.123456 seconds",
        "INFO 11-20 10:00:09 Available KV cache memory: 30.00 GiB",
    )
    result = CliRunner().invoke(
        main,
        [
            "check",
            "--spool-dir",
            spool,
            "--from-log",
            path,
            "--total-memory",
            "64GiB",
            "--gpu-memory-utilization",
            "0.9",
            "--json",
        ],
    )
    data = json.loads(result.stdout)
    rows = data["log"]["era_verdicts"]
    assert len(rows) > 1
    assert [rank["profile_origin"] for rank in data["ranks"]] == ["snapshot" if with_profile else "log"] * 2
    # A rank with its own profile does not depend on the log's row; one without is judged under each row.
    assert all((row["profile"] is None) == with_profile for row in rows)
    assert all(row["state"] == data["state"] for row in rows) and data["log"]["era_verdict"] == "holds_on_all"
    assert result.exit_code == STATE_EXIT[data["state"]]


def test_the_rows_of_an_ambiguous_log_share_one_read_of_vllms_metrics():
    # Each row is the log's profile judged again on the same reads: an unresponsive --vllm-metrics-url (a
    # socket that accepts and never answers) is connected to once, and waited for once, not once per formula.
    import socket
    import threading
    import time

    path = os.path.join(REAL, "r04.log")
    from kvguard.vllm.log_profile import candidate_rows

    assert len({row.formula for row in candidate_rows(read_log_file(path))}) > 1  # several formulas to judge
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.1)
    accepted, stop = [], threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])  # held open, never answered
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        code, data = check(
            path, "--vllm-metrics-url", f"http://127.0.0.1:{server.getsockname()[1]}/metrics", "--read-timeout", "0.5"
        )
        time.sleep(0.3)  # a connection still in the backlog is accepted and counted
    finally:
        stop.set()
        thread.join()
        for connection in accepted:
            connection.close()
        server.close()
    assert len(accepted) == 1  # one connection, waited on once: not one per formula
    assert data["log"]["era_verdict"] in ("holds_on_all", "differs")
    assert data["sources"]["vllm_metrics"]["up"] is False
