"""A startup log's profile: what its lines state, completed by the era's formula read backwards.

``kvguard check`` / the sidecar (``kvguard.sidecar.core``) and ``kvguard budget --from-log
--allocator`` both take a log's profile from here.

Where the log's lines leave several era rows (docs/explanation/log-reading.md), no row is picked:
``kvguard check`` judges the log under each of them (:func:`as_row`) and says whether the verdict
holds on all, or which rows it differs on (the worst stands).
"""

from __future__ import annotations

from dataclasses import replace

from kvguard.budget.estimator import (
    FORMULAS,
    Profile,
    ProfileError,
    required_fields,
    solve_for_budget,
    solved_field,
)
from kvguard.budget.fields import phrase
from kvguard.vllm import eras
from kvguard.vllm.log import StartupLog

# What a log's decided budget still needs from outside the log (vllm-mindspore states neither at INFO).
LOG_FILLS = ("total_memory_bytes", "gpu_memory_utilization")


def log_profile(
    log: StartupLog,
    total_memory_bytes: int | None = None,
    gpu_memory_utilization: float | None = None,
    formula: str | None = None,
) -> tuple[Profile | None, str | None]:
    """The startup log's profile, or (None, a one-line message naming what the log states and
    which figures of its era's formula it lacks).

    ``total_memory_bytes`` / ``gpu_memory_utilization`` fill what the log does not state (vllm-mindspore
    logs neither at INFO); ``formula`` is the era's where the caller names the release and the log's lines
    leave it open. With the device's size and utilization, and the KV cache vLLM decided, a log without the
    profile line still gives the peak formulas' activation peak: the era's formula read backwards
    (``estimator.solve_for_budget``: its ceil, CUDA-graph estimate, halving), the non-torch increase
    taken as 0.
    """
    fields = log.profile_fields(formula)
    if total_memory_bytes is not None:
        fields["total_memory_bytes"] = total_memory_bytes
    if gpu_memory_utilization is not None:
        fields["gpu_memory_utilization"] = gpu_memory_utilization
    budget = FORMULAS[fields["formula"]]
    peak = solved_field(fields["formula"])
    derivable = (
        budget.non_kv == "peak"
        and log.available_kv_cache_bytes is not None
        and fields.get(peak) is None
        and fields.get("non_torch_increase_bytes") is None
        and fields.get("kv_cache_memory_bytes") is None
    )
    if derivable and all(fields.get(k) is not None for k in LOG_FILLS + ("weights_bytes",)):
        try:
            value = solve_for_budget(fields, log.available_kv_cache_bytes)
        except ProfileError:
            derivable = False  # a clamped formula's negative budget: no peak gives it
        else:
            # The log's sizes are rounded to 0.01 GiB: a peak read back a few MiB below zero is no peak.
            fields[peak], fields["non_torch_increase_bytes"] = max(0, value), 0
    needs = required_fields(fields["formula"], fields.get("kv_cache_memory_bytes"))
    if all(fields.get(n) is not None for n in needs):
        return Profile(**{**{k: None for k in Profile.REQUIRED}, **fields}), None
    derived = (peak, "non_torch_increase_bytes") if derivable else ()
    missing = [phrase(n) for n in needs if fields.get(n) is None and n not in derived]
    stated = [phrase(n) for n in needs if fields.get(n) is not None]
    if log.available_kv_cache_bytes is not None:
        stated.append("the KV cache vLLM decided")
    who = log.era or log.project
    return None, (
        f"the startup log ({who}) states {', '.join(stated) or 'no profile figure'} but not "
        f"{', '.join(missing)}"
        + (" (the activation peak follows from them and the decided KV cache)" if derived else "")
        + ": without them the peak cannot be projected (give them to kvguard check "
        "as --total-memory / --gpu-memory-utilization, or run the probe: a KVGUARD_SPOOL_DIR snapshot "
        "carries the whole profile)"
    )


def candidate_rows(log: StartupLog) -> tuple[eras.Era, ...]:
    """The era rows the log's lines leave, in the table's order (one where they pin it; none for a log
    that names no release and no project's line)."""
    return tuple(e for e in eras.ERAS if e.name in log.era_candidates)


def as_row(log: StartupLog, row: eras.Era) -> StartupLog:
    """The log as if its lines had pinned ``row``, one of its candidates: what it says under that row's
    formula. A hypothesis to judge beside the others, never the log's era (its reason says so)."""
    if row.name not in log.era_candidates:
        raise ValueError(f"{row.name} is not among the log's candidate rows ({', '.join(log.era_candidates)})")
    return replace(
        log,
        era=row.name,
        era_candidates=(row.name,),
        era_reason=f"judged as {row.name}, one of the {len(log.era_candidates)} rows the lines leave",
    )
