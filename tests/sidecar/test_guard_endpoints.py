"""/guard and /readyz on a real server on loopback: judging no rank is never an all-clear, and
/readyz states the same overall state /guard gives."""

from __future__ import annotations

import json
import os

from sidecar_fixtures import http_get, snapshot


def get(server, path: str):
    status, _, body = http_get(server, path)
    return status, body.decode()


def test_an_empty_spool_is_a_no_ranks_warning_on_guard_and_readyz(serve, tmp_path):
    server = serve()
    status, body = get(server, "/guard")
    guard = json.loads(body)
    assert status == 200 and guard["state"] == "warning" and guard["ranks"] == []
    assert guard["reasons"] == [
        {
            "code": "no_ranks",
            "state": "warning",
            "message": f"no rank judged (no snapshots in {tmp_path / 'spool'}): the guard cannot say the KV cache fits",
        }
    ]
    status, body = get(server, "/readyz")
    assert status == 200  # a sidecar with nothing to judge yet is ready; it says it judged nothing
    assert body == f"ready\nguard: warning; no_ranks: {guard['reasons'][0]['message']}\n"


def test_an_unlistable_spool_names_the_source_on_guard(serve, tmp_path):
    server = serve()
    os.rmdir(tmp_path / "spool")
    (tmp_path / "spool").write_text("not a directory")
    server.sidecar.refresh_background(wait=5)
    guard = json.loads(get(server, "/guard")[1])
    assert guard["state"] == "warning" and guard["sources"]["spool"]["up"] is False
    assert (
        guard["reasons"][0]["code"] == "no_ranks"
        and "spool down: cannot list spool directory" in guard["reasons"][0]["message"]
    )


def test_readyz_states_the_rank_state_guard_gives(serve):
    server = serve(snapshot())
    assert json.loads(get(server, "/guard")[1])["state"] == "warning"  # the stock budget is overcommitted
    assert get(server, "/readyz") == (200, "ready\nguard: warning\n")


def test_with_the_flag_only_critical_fails_readiness_not_no_ranks(serve):
    assert get(serve(fail_readiness_on_critical=True), "/readyz")[0] == 200
    status, body = get(serve(snapshot(utilization=0.99), fail_readiness_on_critical=True), "/readyz")
    assert status == 503 and body.startswith("critical: rank 0 device npu:0: projected_peak_exceeds_capacity")
