"""The era table: which release runs which formula, and how releases are named."""

import pytest

from kvguard.budget.estimator import FORMULAS
from kvguard.vllm.eras import ERAS, PROJECTS, EraError, era_for, parse_release, release_text

# Which formula a release runs is checked against the release itself, not restated here: the real
# wheels' workers reproduce their budget to the byte from the era's formula (tests/upstream/test_vllm_real.py,
# tests/upstream/test_ascend_real.py). What is left to check without a wheel is how a release finds its row.


@pytest.mark.parametrize("era", ERAS, ids=lambda era: era.name)
def test_a_rows_first_and_last_release_find_that_row(era):
    for version in filter(None, (era.first, era.last)):
        assert era_for(release_text(era.project, version)) == era


@pytest.mark.parametrize("project", ["vllm", "vllm-ascend", "vllm-mindspore"])
def test_a_release_newer_than_the_table_finds_its_projects_newest_row(project):
    newest = max((era for era in ERAS if era.project == project), key=lambda era: era.first)
    assert era_for(f"{project}:99.0.0") == newest


def test_release_names_parse_with_project_and_suffixes():
    assert parse_release("vllm_ascend:0.14.0rc1") == ("vllm-ascend", (0, 14, 0))
    assert parse_release("v0.34") == ("vllm", (0, 34, 0))
    assert parse_release("vllm-mindspore@0.5.1.dev3") == ("vllm-mindspore", (0, 5, 1))


@pytest.mark.parametrize("text", ["", "latest", "0.x", "vllm-tpu:1.0", "9" * 200])
def test_a_release_that_is_not_one_is_a_one_line_error(text):
    with pytest.raises(EraError) as info:
        era_for(text)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_a_release_older_than_the_table_is_refused():
    with pytest.raises(EraError, match="older than kvguard's era table"):
        era_for("0.5.0")


def test_every_row_names_a_formula_and_cites_upstream():
    for era in ERAS:
        assert era.project in PROJECTS and era.formula in FORMULAS
        assert era.cites, era.name


def test_0_34_defaults_block_size_64_and_resolves_utilization_at_run_time():
    era = era_for("0.34.0")
    assert (era.default_block_size, era.default_gpu_memory_utilization) == (64, None)
    assert "extend_kv_cache" in era.hooks and era.extensible_kv_cache_default


def test_the_seed_release_is_a_row_and_older_vllm_mindspore_is_refused():
    # vllm-mindspore 0.2.0 (PR !428): the launcher `simulate --vllm-mindspore-version 0.2.0` takes.
    era = era_for("vllm-mindspore:0.2.0")
    assert (era.formula, era.default_block_size) == ("mindspore_reserved", 16)
    with pytest.raises(EraError, match="older than kvguard's era table"):
        era_for("vllm-mindspore:0.1.0")
