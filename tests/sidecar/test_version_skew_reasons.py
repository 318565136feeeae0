"""A newer probe's budget-time verdict with a reason code this release does not know (a rollout's skew, the
verdict side of tests/sidecar/test_version_skew.py): the rank is judged, the reason kept with the state the newer
release gave it, under `reason_unknown`; before, the whole snapshot was invalid and the rank went unwatched."""

import dataclasses
import json
import os

from click.testing import CliRunner
from sidecar_fixtures import snapshot, write

from kvguard.cli import main
from kvguard.guard.judge import BUDGET, Reason, Verdict
from kvguard.spool.io import read_spool


def budget_snapshot(tmp_path, state):
    """A rank between the budget and its KV cache, its budget-time verdict written by a newer release."""
    verdict = Verdict(state="warning", reasons=(Reason("overcommitted", "placeholder"),), phase=BUDGET)
    write(tmp_path, dataclasses.replace(snapshot(kv_blocks=2000), budget_verdict=verdict, kv_cache=None))
    (name,) = [n for n in os.listdir(tmp_path) if n.endswith(".json")]
    path = os.path.join(tmp_path, name)
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    data["budget_verdict"].update(
        state=state,
        reasons=[{"code": "kv_cache_tail\x1b[31m_lost" + "x" * 100, "state": state, "message": "a newer reason"}],
    )
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle)


def test_a_newer_critical_reason_stands_for_the_rank_with_its_state(tmp_path):
    budget_snapshot(tmp_path, "critical")
    result = CliRunner().invoke(main, ["check", "--json", "--spool-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output  # critical: the newer release's word kept
    (rank,) = json.loads(result.output)["ranks"]
    (reason,) = [r for r in rank["reasons"] if r["code"] == "reason_unknown"]
    assert reason["state"] == "critical"
    # Its code at the head of the message, letters, digits and underscores only, cut at 40.
    assert reason["message"].startswith("[kv_cache_tail??31m_lostxxx")
    assert "\x1b" not in reason["message"] and len(reason["message"].split("]")[0]) <= 41


def test_a_newer_warning_reason_is_a_warning_and_a_bad_state_still_invalid(tmp_path):
    budget_snapshot(tmp_path, "warning")
    (snap,) = read_spool(str(tmp_path)).snapshots
    assert [(r.code, r.state) for r in snap.budget_verdict.reasons] == [("reason_unknown", "warning")]
    budget_snapshot(tmp_path, "fatal")
    assert read_spool(str(tmp_path)).skipped["invalid_snapshot"] == 1


def test_a_budget_time_verdict_standing_for_the_rank_keeps_the_newer_probes_unknown_fields(tmp_path):
    # A newer probe, between the budget and the KV cache: its budget-time verdict (critical) stands for the rank,
    # and the live verdict's word that the profile holds fields this release does not know stays with it.
    budget_snapshot(tmp_path, "critical")
    (name,) = [n for n in os.listdir(tmp_path) if n.endswith(".json")]
    path = os.path.join(tmp_path, name)
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    data["profile"]["future_scratch_bytes"] = 1 << 30
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle)
    result = CliRunner().invoke(main, ["check", "--json", "--spool-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    (rank,) = json.loads(result.output)["ranks"]
    assert rank["state"] == "critical"
    codes = [r["code"] for r in rank["reasons"]]
    assert codes == ["reason_unknown", "profile_fields_unknown"], codes
    (unknown,) = [r for r in rank["reasons"] if r["code"] == "profile_fields_unknown"]
    assert "future_scratch_bytes" in unknown["message"]
