"""A probe newer than its sidecar (the plugin upgraded in the serving image before the sidecar's image): the
sidecar judges the rank on the profile fields it knows and says which it left out, rather than dropping the
rank as an invalid snapshot. Run through `kvguard check`, as an operator's gate runs it."""

import json
import os

from click.testing import CliRunner
from sidecar_fixtures import snapshot, write

from kvguard.cli import main
from kvguard.spool.io import read_spool

CODE = "profile_fields_unknown"


def rewrite_profile(spool_dir, **extra):
    """Add keys to the profile of the one snapshot file in ``spool_dir``, as a newer writer would."""
    (name,) = [n for n in os.listdir(spool_dir) if n.endswith(".json")]
    path = os.path.join(spool_dir, name)
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    data["profile"].update(extra)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle)


def check_json(spool_dir):
    result = CliRunner().invoke(main, ["check", "--json", "--spool-dir", str(spool_dir)])
    return result.exit_code, json.loads(result.output)


def rank_of(report):
    (rank,) = report["ranks"]
    return rank


def test_a_newer_probes_profile_is_judged_on_what_this_release_knows_and_says_what_it_left_out(tmp_path):
    write(tmp_path, snapshot(kv_blocks=2000))  # 27 GiB of KV cache: within the reserved-aware budget
    base_code, base = check_json(tmp_path)
    assert base_code == 0 and rank_of(base)["state"] == "ok"

    rewrite_profile(tmp_path, future_scratch_bytes=1 << 30)
    code, report = check_json(tmp_path)
    rank = rank_of(report)
    assert code == 1 and rank["state"] == "warning"
    reasons = {r["code"]: r for r in rank["reasons"]}
    assert set(reasons) == {CODE}
    assert "future_scratch_bytes" in reasons[CODE]["message"]
    # Everything the known fields give is the same as before: the budgets, the projection.
    for key in ("stock_budget_bytes", "reserved_budget_bytes", "projected_peak_bytes", "capacity_bytes"):
        assert rank[key] == rank_of(base)[key] is not None, key


def test_a_known_field_with_a_bad_value_still_makes_the_snapshot_invalid(tmp_path):
    write(tmp_path, snapshot())
    rewrite_profile(tmp_path, future_scratch_bytes=1, weights_bytes="lots")
    result = read_spool(str(tmp_path))
    assert result.snapshots == [] and result.skipped["invalid_snapshot"] == 1


def test_a_flood_of_unknown_fields_names_eight_each_cut_short(tmp_path):
    write(tmp_path, snapshot())
    # 1,000 names of 200 characters: within the spool's 256 KiB a file
    rewrite_profile(tmp_path, **{f"field_{i:04d}_" + "x" * 189: i for i in range(1000)})
    (snap,) = read_spool(str(tmp_path)).snapshots
    assert len(snap.profile_unknown_fields) == 8
    assert snap.profile_unknown_fields[0].startswith("field_0000_") and all(
        len(name) <= 40 for name in snap.profile_unknown_fields
    )
    code, report = check_json(tmp_path)
    assert code == 1 and len(json.dumps(report)) < 20_000
