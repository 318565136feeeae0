"""The era table: which release runs which formula, and how releases are named."""

import pytest

from kvguard.budget.estimator import FORMULAS
from kvguard.vllm.eras import ERAS, PROJECTS, EraError, era_for, parse_release


@pytest.mark.parametrize("release, formula", [
    ("0.11.0", "peak"), ("0.13.0", "peak"), ("0.14.0", "peak_ceil"), ("0.17.1", "peak_ceil"),
    ("0.18.0", "peak_ceil_cudagraph"), ("0.26.0", "peak_ceil_cudagraph"), ("0.27.0", "consumed"),
    ("0.33.0", "consumed"), ("0.34.0", "consumed"), ("vllm:0.35.2", "consumed"),
    ("vllm-ascend:0.13.0", "absolute_peak"), ("0.6.4", "absolute_peak"), ("0.9.0", "absolute_peak_signed"),
    ("0.9.1", "peak"), ("0.12.0", "peak"), ("vllm-ascend:0.16.0rc1", "ascend_cleared"),
    ("vllm-ascend:0.18.0", "peak"), ("vllm-ascend-310p:0.23.0", "ascend_cleared_halved"),
    ("vllm-mindspore:0.5.1", "mindspore_reserved"),
])
def test_each_release_falls_in_its_era(release, formula):
    assert era_for(release).formula == formula


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
