"""The held-out grid's rule (bench/guard_holdout.py): fixed before tuning, disjoint from the tuning grid."""

from __future__ import annotations

import os
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import guard_holdout  # noqa: E402


def test_the_held_out_grid_shares_no_axis_value_with_the_tuning_grid():
    assert guard_holdout.disjoint_from_tuning() == {
        "models": set(),
        "devices_gib": set(),
        "utilizations": set(),
        "seeds": set(),
    }


def test_every_held_out_model_config_exists_and_the_grid_covers_the_rule():
    for path, _ in guard_holdout.MODELS.values():
        assert os.path.isfile(os.path.join(guard_holdout.ROOT, path)), path
    names = [name for name, _, _ in guard_holdout.allocators()]
    assert {"torch", "torch+expandable", "torch_npu"} <= set(names)
    # Every modelled MindSpore release, once under its launcher's MS_ALLOC_CONF and once with VMM off.
    from kvguard.allocators.mindspore_releases import RELEASES

    for release in RELEASES:
        overrides = [
            dict(o)
            for _, allocator, o in guard_holdout.allocators()
            if allocator == "mindspore" and dict(o).get("mindspore_version") == release.version
        ]
        assert sorted(o.get("ms_alloc_conf", "") for o in overrides) == ["", "enable_vmm:False"], release.version


def test_the_fresh_held_out_grid_shares_no_axis_value_with_either_earlier_grid():
    assert guard_holdout.fresh_shares() == {"devices_gib": set(), "utilizations": set(), "seeds": set()}
    assert len(guard_holdout.grid(fresh=True)) == (
        len(guard_holdout.MODELS) * 3 * 3 * len(guard_holdout.allocators()) * len(guard_holdout.BUDGETS) * 2
    )
