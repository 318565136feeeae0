"""One rule each for the profile fields (issue 22, item 1): the budget formula read backwards, and the
one table of fields that the CLI's options, parsing, printing and messages come from."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
from click.testing import CliRunner
from conftest import EXAMPLES
from helpers import invoke

from kvguard.budget.estimator import (
    FORMULAS,
    Profile,
    ProfileError,
    profile_for_budget,
    stock_kv_cache_bytes,
)
from kvguard.budget.fields import PROFILE_FIELDS, field
from kvguard.cli import main
from kvguard.vllm.eras import era_for
from kvguard.vllm.log import parse_log
from kvguard.vllm.log_profile import log_profile

GIB = 1 << 30

# A vLLM 0.21-0.26 startup at INFO: the profile line ("Total non KV cache memory ...") is DEBUG there, so the log
# states the weights, the CUDA-graph estimate it subtracts and the KV cache it decided, not the activation peak.
# The lines are real r13's (tests/data/logs/real, club-3090 issue 127) with an 80 GiB device's figures, and the
# weights line as v1/worker/gpu_model_runner.py 0.14.0:3906 words it.
LOG_0_2X_AT_80_GIB = """\
(EngineCore pid=98) INFO 05-14 00:03:41 [gpu_model_runner.py:4512] Model loading took 14.99 GiB memory \
and 6.021334 seconds
(EngineCore pid=98) INFO 05-14 00:04:16 [gpu_model_runner.py:6143] Estimated CUDA graph memory: 0.50 GiB total
(EngineCore pid=98) INFO 05-14 00:04:17 [gpu_worker.py:475] CUDA graph memory profiling is enabled (default since \
v0.21.0). The current --gpu-memory-utilization=0.9200 is equivalent to --gpu-memory-utilization=0.9138 without CUDA \
graph memory profiling. To maintain the same effective KV cache size as before, increase --gpu-memory-utilization to \
0.9262. To disable, set VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0.
(EngineCore pid=98) INFO 05-14 00:04:17 [gpu_worker.py:460] Available KV cache memory: 55.35 GiB
(EngineCore pid=98) INFO 05-14 00:04:17 [kv_cache_utils.py:1733] GPU KV cache size: 1,036,160 tokens
"""


def test_a_0_2x_log_read_backwards_gives_the_budget_vllm_decided():
    log = parse_log(LOG_0_2X_AT_80_GIB)
    # Its INFO lines leave 0.20-0.33 open (the 0.27+ rows write the same lines); the release is named, as
    # `kvguard budget --from-log --vllm-version 0.22.0` names it.
    assert "vllm 0.20.0–0.26.0" in log.era_candidates and log.cudagraph_memory_bytes == round(0.50 * GIB)
    era = era_for("0.22.0")
    profile, missing = log_profile(log, 80 * GIB, 0.92, formula=era.formula)
    assert missing is None and profile.formula == "peak_ceil_cudagraph"
    # The activation peak follows from the decided budget: the era's formula on it decides that budget again,
    # with the ceil of the request (0.14+) and the CUDA-graph estimate (0.20+ by default) counted.
    assert stock_kv_cache_bytes(profile) == log.available_kv_cache_bytes


def _inputs(formula: str, rng: random.Random) -> dict:
    """Every input of ``formula`` but the one the inverse solves for, in the ranges a device shows."""
    total = rng.randrange(8 * GIB, 192 * GIB)
    fields = {
        "formula": formula,
        "total_memory_bytes": total,
        "gpu_memory_utilization": rng.choice([0.92, 0.9, 0.5, 1.0, round(rng.uniform(0.05, 1), 4)]),
        "weights_bytes": rng.randrange(0, total // 3),
        "peak_allocated_increase_bytes": None,
        "peak_reserved_increase_bytes": None,
        "non_torch_increase_bytes": rng.randrange(-GIB, 2 * GIB),
    }
    budget = FORMULAS[formula]
    if budget.cudagraph:
        fields["cudagraph_memory_bytes"] = rng.choice([0, rng.randrange(0, 4 * GIB)])
    if budget.cleared:
        fields["non_torch_cleared_bytes"] = rng.randrange(-GIB, 3 * GIB)
    if budget.non_kv == "consumed":
        fields["transient_peak_headroom_bytes"] = rng.randrange(0, 8 * GIB)
    if budget.non_kv == "measured_after_warmup":
        fields.update(
            init_free_memory_bytes=rng.randrange(total // 2, total),
            kv_committed_bytes=rng.randrange(0, GIB),
            kv_transient_peak_bytes=rng.randrange(0, 4 * GIB),
            torch_reserve_growth_bytes=rng.randrange(0, 4 * GIB),
        )
    return fields


@pytest.mark.parametrize("formula", list(FORMULAS))
def test_the_inverse_decides_the_given_budget_to_the_byte(formula):
    rng = random.Random(formula)
    clamped = FORMULAS[formula].floor_zero or FORMULAS[formula].non_kv == "measured_after_warmup"
    for _ in range(300):
        fields = _inputs(formula, rng)
        decided = rng.choice([0, rng.randrange(0, fields["total_memory_bytes"] // 2), rng.randrange(1, 3 * GIB)])
        if not clamped and rng.random() < 0.2:
            decided = -rng.randrange(1, 2 * GIB)  # vLLM logs a negative budget before it refuses to start
        try:
            profile = profile_for_budget(fields, decided)
        except ProfileError as exc:
            # Only a solved figure outside its field's range (a peak below zero) may refuse.
            assert "must not be negative" in str(exc), exc
            continue
        assert stock_kv_cache_bytes(profile) == decided, (fields, decided)
        given = {k: v for k, v in fields.items() if v is not None}
        assert {k: getattr(profile, k) for k in given} == given


@pytest.mark.parametrize("formula", [f for f in FORMULAS if FORMULAS[f].floor_zero])
def test_a_clamped_formula_has_no_inverse_below_zero(formula):
    fields = {**_inputs(formula, random.Random(0))}
    with pytest.raises(ProfileError, match="never decides"):
        profile_for_budget(fields, -1)


# ---------------------------------------------------------------------------- the field table


def test_the_table_holds_every_measured_field_of_the_profile_once():
    measured = [f.name for f in dataclasses.fields(Profile) if f.name not in ("formula", "vllm_version")]
    assert sorted(row.name for row in PROFILE_FIELDS) == sorted(measured)


# The device's total memory must be positive whatever the sign rule: left out.
@pytest.mark.parametrize(
    "row", [r for r in PROFILE_FIELDS if r.kind != "float" and r.name != "total_memory_bytes"], ids=lambda r: r.name
)
def test_a_field_is_signed_in_the_table_exactly_where_the_profile_takes_a_negative_figure(row):
    base = {
        "total_memory_bytes": 80 * GIB,
        "gpu_memory_utilization": 0.9,
        "weights_bytes": GIB,
        "peak_allocated_increase_bytes": GIB,
        "peak_reserved_increase_bytes": None,
        "non_torch_increase_bytes": 0,
    }
    try:
        Profile(**{**base, row.name: -1})
        accepted = True
    except ProfileError:
        accepted = False
    assert accepted == (row.kind == "signed_size")


def test_budget_help_offers_every_field_flag():
    result = CliRunner().invoke(main, ["budget", "--help"], terminal_width=200)
    flags = [row.flag for row in PROFILE_FIELDS if row.flag] + [
        row.absolute_flag for row in PROFILE_FIELDS if row.absolute_flag
    ]
    assert len(flags) == 17
    for flag in flags:
        assert f"{flag} " in result.output, flag


def test_an_era_that_adds_the_absolute_non_torch_memory_asks_for_it_by_its_own_flag():
    # vLLM 0.6.4 refuses --non-torch-increase (it adds the absolute non-torch memory): the "missing" message
    # must name the flag it takes.
    result = invoke(
        "budget",
        "--vllm-version",
        "0.6.4",
        "--total-memory",
        "80GiB",
        "--weights",
        "10GiB",
        "--peak-allocated-increase",
        "1GiB",
    )
    assert result.exit_code == 64
    assert "missing --non-torch-memory" in result.output and "--non-torch-increase" not in result.output


def test_an_era_that_adds_the_absolute_non_torch_memory_lists_it_among_what_it_takes():
    result = invoke(
        "budget",
        "--vllm-version",
        "0.6.4",
        "--total-memory",
        "80GiB",
        "--weights",
        "10GiB",
        "--peak-allocated-increase",
        "1GiB",
        "--non-torch-memory",
        "1GiB",
        "--total-consumed",
        "1GiB",
    )
    assert result.exit_code == 64
    assert "does not read --total-consumed" in result.output
    assert "--non-torch-memory" in result.output and "--non-torch-increase" not in result.output


def test_a_log_missing_figures_is_told_in_the_tables_words():
    # A vllm-mindspore log states the weights and the decided KV cache, not the device's size or utilization.
    with open(os.path.join(EXAMPLES, "vllm-mindspore-qwen2.5-7b.log"), encoding="utf-8") as handle:
        log = parse_log(handle.read())
    profile, missing = log_profile(log)
    assert profile is None
    for name in ("total_memory_bytes", "gpu_memory_utilization"):
        assert field(name).phrase in missing
    assert field("weights_bytes").phrase in missing.split(" but not ")[0]
