"""The ``kvguard`` command line: one click group, one function per subcommand."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any

import click
from click.core import ParameterSource

from kvguard import __version__
from kvguard.budget.estimator import (
    EXTENSIBLE_INPUTS, FORMULAS, KV_CACHE_DTYPES, ConfigError, KVLayout, Profile, ProfileError, budget_for,
    estimate, formula_inputs, kv_layout_from_config, max_concurrency, overcommit_bytes, required_fields,
    stock_kv_cache_bytes,
)
from kvguard.budget.model_config import bundled_model_config_path, load_model_config
from kvguard.units import format_bytes, format_gib, parse_size


class SizeType(click.ParamType):
    """SIZE: bytes, or a number with a unit (37.85GiB, 512MiB, 64GB)."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class SignedSizeType(SizeType):
    """A SIZE that may be negative (vLLM's non-torch increase can be)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, str) and value.strip().startswith("-"):
            return -super().convert(value.strip()[1:], param, ctx)
        return super().convert(value, param, ctx)


SIZE = SizeType()
SIGNED_SIZE = SignedSizeType()


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf (which compare as in range or unbounded)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{number} is not a finite number.", param, ctx)
        return number


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


class _Group(click.Group):
    """The kvguard group: an exception no command turned into a one-line error is still one line
    (``KVGUARD_DEBUG=1`` re-raises it, traceback and all)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit,
                KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001
            if os.environ.get("KVGUARD_DEBUG"):
                raise
            from kvguard.sources import one_line

            detail = one_line(exc)
            error = click.ClickException(f"internal error: {type(exc).__name__}" + (f": {detail}" if detail else "")
                                         + " (KVGUARD_DEBUG=1 shows the traceback)")
            error.exit_code = 2
            raise error from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="kvguard")
def main() -> None:
    """kvguard: allocator memory exporter and KV-cache OOM guard for LLM serving.

    Shows allocated versus reserved device memory for every rank, the KV-cache budget
    vLLM computed at startup beside the reserved-aware one, and warns before the OOM.
    """


# ---------------------------------------------------------------------------- budget

# Profile field -> the flag that sets it. The first six are every era's; the rest are the inputs of
# the eras that need them (kvguard.vllm.eras; README "vLLM eras").
_PROFILE_FLAGS = {
    "total_memory_bytes": "--total-memory",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "weights_bytes": "--weights",
    "peak_allocated_increase_bytes": "--peak-allocated-increase",
    "peak_reserved_increase_bytes": "--peak-reserved-increase",
    "non_torch_increase_bytes": "--non-torch-increase",
    "total_consumed_bytes": "--total-consumed",
    "transient_peak_headroom_bytes": "--transient-peak-headroom",
    "reserved_transient_peak_bytes": "--reserved-transient-peak",
    "cudagraph_memory_bytes": "--cudagraph-memory",
    "init_free_memory_bytes": "--init-free-memory",
    "free_after_warmup_bytes": "--free-after-warmup",
    "kv_committed_bytes": "--kv-committed",
    "kv_transient_peak_bytes": "--kv-transient-peak",
    "torch_reserve_growth_bytes": "--torch-reserve-growth",
    "non_torch_cleared_bytes": "--non-torch-cleared",
}
def _read_profile_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read(1 << 20).decode("utf-8"))
    except FileNotFoundError:
        raise click.ClickException(f"profile file not found: {path}") from None
    except OSError as exc:
        raise click.ClickException(f"cannot read profile file {path}: {exc.strerror or exc}") from None
    except RecursionError:
        raise click.ClickException(f"profile file {path} is nested too deeply to be a profile") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise click.ClickException(f"profile file {path} is not valid JSON: {str(exc).splitlines()[0]}") from None
    try:
        return Profile.from_dict(data).to_dict()
    except (ProfileError, TypeError) as exc:
        raise click.ClickException(f"profile file {path}: {exc}") from None


def _read_log(path: str):
    from kvguard.vllm.log import LogFileError, read_startup_log

    try:
        return read_startup_log(path)
    except LogFileError as exc:
        raise click.ClickException(str(exc)) from None


def _layout_dict(layout: KVLayout) -> dict[str, Any]:
    return {**dataclasses.asdict(layout), "page_bytes_per_layer": layout.page_bytes_per_layer}


def _era(release: str | None):
    if release is None:
        return None
    from kvguard.vllm.eras import EraError, era_for
    try:
        return era_for(release)
    except EraError as exc:
        raise click.UsageError(str(exc)) from None


def _block_size(era, block_size: int | None, config: Any) -> int:
    """The era's default block size, and vLLM's MLA block size on CUDA where the era forces one."""
    from kvguard.budget.estimator import _text_config
    is_mla = isinstance(config, dict) and "kv_lora_rank" in _text_config(config)
    if era and is_mla and era.mla_block_size:
        forced, rule = era.mla_block_size, era.mla_block_rule
        if block_size is None or (rule == "equal" and block_size != forced) \
                or (rule == "multiple" and block_size % forced):
            return forced
        return block_size
    if block_size is not None:
        return block_size
    return era.default_block_size if era else 16


_SIZE_HELP = {
    "--total-consumed": "0.27+: free device memory at the init snapshot minus after the profile run.",
    "--transient-peak-headroom": "0.27+: allocated peak minus allocated after the profile run.",
    "--reserved-transient-peak": "0.27+: reserved peak minus reserved after the profile run (kvguard's).",
    "--cudagraph-memory": "0.18+: the CUDA-graph memory estimate vLLM subtracted (0 when disabled).",
    "--init-free-memory": "0.34 extensible KV cache: free device memory at the init snapshot.",
    "--free-after-warmup": "0.34 extensible KV cache: free device memory after warm-up.",
    "--kv-committed": "0.34 extensible KV cache: KV pages committed at the measurement.",
    "--kv-transient-peak": "0.34 extensible KV cache: the transient peak it keeps free.",
    "--torch-reserve-growth": "0.34 extensible KV cache: torch's reserved growth over the sizing steps.",
    "--non-torch-cleared": "vllm-ascend 0.15-0.17 and 310P: non-torch memory read inside the profile before "
                           "empty_cache (total - free - memory_reserved()) less the non-torch increase: in effect "
                           "the non-torch memory already there at startup (ACL context, HCCL), whatever "
                           "empty_cache freed (vllm_ascend/worker/worker.py 0.17.0rc1:344-363).",
}


def _era_size_options(function):
    for flag in reversed(list(_SIZE_HELP)):
        function = click.option(flag, type=SIGNED_SIZE if flag in ("--total-consumed", "--non-torch-cleared")
                                else SIZE, help=_SIZE_HELP[flag])(function)
    return function


@main.command()
@click.option("--model-config", "model_config", metavar="PATH",
              help="Hugging Face config.json, or a model directory holding one.")
@click.option("--vllm-version", "release", metavar="RELEASE",
              help="The release whose formula applies: X.Y.Z (vLLM), vllm-ascend:X.Y.Z, vllm-ascend-310p:X.Y.Z, "
                   "vllm-mindspore:X.Y.Z. Default: the 0.9.1-0.13 formula, or the era the log shows.")
@click.option("--block-size", type=click.IntRange(min=1), help="Tokens per KV block (default: the era's).")
@click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto", show_default=True,
              help="KV cache dtype; auto follows the model's torch_dtype.")
@click.option("--tensor-parallel-size", "-tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--pipeline-parallel-size", "-pp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--max-model-len", type=click.IntRange(min=1), help="Tokens per request, for max concurrency.")
@click.option("--kv-cache-memory", type=SIZE, help="Block count for this much KV cache memory.")
@click.option("--total-memory", type=SIZE, help="Device memory vLLM saw at startup (mem_get_info total).")
@click.option("--gpu-memory-utilization", type=float,
              help="vLLM's --gpu-memory-utilization, in (0, 1] (default: the era's resolved default).")
@click.option("--weights", type=SIZE, help="Model weights memory.")
@click.option("--peak-allocated-increase", type=SIZE,
              help="Increase of allocated_bytes.all.peak during the profile run.")
@click.option("--peak-reserved-increase", type=SIZE, help="Increase of memory_reserved() during the profile run.")
@click.option("--non-torch-increase", type=SIGNED_SIZE,
              help="Increase of non-torch memory since the init snapshot (vLLM's non_torch_increase); the eras "
                   "that add the absolute non-torch memory take --non-torch-memory instead.")
@click.option("--non-torch-memory", type=SIGNED_SIZE,
              help="vLLM V0, V1 0.8.5-0.9.0 and vllm-ascend <= 0.14: the absolute non-torch memory after the "
                   "profile's empty_cache (total - free - torch allocated), which their formula adds when "
                   "positive (vllm_ascend/worker/worker_v1.py 0.11.0:245-251).")
@_era_size_options
@click.option("--extensible-kv-cache/--no-extensible-kv-cache", default=None,
              help="0.34: whether the extensible KV cache sized the cache (default: on where the "
                   "extensible inputs are given).")
@click.option("--profile", "profile_file", metavar="FILE", help="Startup profile JSON (the profile keys).")
@click.option("--from-log", "log_file", metavar="FILE", help="vLLM / vllm-ascend / vllm-mindspore startup log.")
@click.option("--allocator", type=click.Choice(["torch", "torch_npu", "mindspore"]),
              help="Predict the budget-time verdict for this allocator: the era's KV tensors placed by its rules "
                   "(needs --model-config).")
@click.option("--enable-vmm/--no-enable-vmm", default=None,
              help="MindSpore's VMM (default: on for vllm-mindspore, whose env_setup sets it; off otherwise).")
@click.option("--expandable-segments/--no-expandable-segments", default=None,
              help="PyTorch's / torch_npu's expandable_segments:True (default: the release's own: on for "
                   "--allocator torch_npu with vllm-ascend 0.17.0rc1+, which sets it; else off).")
@click.option("--non-allocator-memory", type=SIZE,
              help="Memory held outside the allocator from the start (default: the simulator's 512 MiB for "
                   "torch, 1 GiB on Ascend).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def budget(model_config, release, block_size, kv_cache_dtype, tensor_parallel_size, pipeline_parallel_size,
           max_model_len, kv_cache_memory, total_memory, gpu_memory_utilization, weights, peak_allocated_increase,
           peak_reserved_increase, non_torch_increase, total_consumed, transient_peak_headroom,
           reserved_transient_peak, cudagraph_memory, init_free_memory, free_after_warmup, kv_committed,
           kv_transient_peak, torch_reserve_growth, non_torch_cleared, extensible_kv_cache, profile_file, log_file,
           allocator, enable_vmm, expandable_segments, non_allocator_memory, as_json, non_torch_memory=None):
    """vLLM's KV-cache budget beside the reserved-aware one, and the utilization that closes the gap.

    The profile comes from flags, --profile FILE or --from-log FILE; flags override the
    file, the file overrides the log. --vllm-version picks the release's formula (README,
    "vLLM eras"); a profile written by the plugin names its release itself.
    """
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise click.UsageError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    _refuse_unused_allocator_options(allocator, enable_vmm, expandable_segments, non_allocator_memory)
    startup = _read_log(log_file) if log_file else None
    fields: dict[str, Any] = {}
    if startup:
        fields.update(startup.profile_fields())
    file_fields: dict[str, Any] = _read_profile_file(profile_file) if profile_file else {}
    fields.update(file_fields)
    flags = {"total_memory_bytes": total_memory, "gpu_memory_utilization": gpu_memory_utilization,
             "weights_bytes": weights, "peak_allocated_increase_bytes": peak_allocated_increase,
             "peak_reserved_increase_bytes": peak_reserved_increase, "non_torch_increase_bytes": non_torch_increase,
             "total_consumed_bytes": total_consumed, "transient_peak_headroom_bytes": transient_peak_headroom,
             "reserved_transient_peak_bytes": reserved_transient_peak, "cudagraph_memory_bytes": cudagraph_memory,
             "init_free_memory_bytes": init_free_memory, "free_after_warmup_bytes": free_after_warmup,
             "kv_committed_bytes": kv_committed, "kv_transient_peak_bytes": kv_transient_peak,
             "torch_reserve_growth_bytes": torch_reserve_growth, "non_torch_cleared_bytes": non_torch_cleared}
    fields.update({k: v for k, v in flags.items() if v is not None})

    # The era: --vllm-version, else the profile file's own release, else the log's lines.
    era = _era(release or fields.get("vllm_version"))
    if era is None and startup is not None:
        era = startup.era_row
    if extensible_kv_cache is not None and not (era and era.extensible_kv_cache_default):
        raise click.UsageError(f"--{'' if extensible_kv_cache else 'no-'}extensible-kv-cache is vLLM 0.34+'s "
                               f"(--vllm-version 0.34.0); {era.name if era else 'without --vllm-version, the formula'} "
                               f"has no extensible KV cache")
    file_formula = file_fields.get("formula") or "peak"
    _non_torch_flag(era, non_torch_increase, non_torch_memory, fields)
    if era is not None:
        fields["vllm_version"] = release or fields.get("vllm_version")
        formula = era.formula
        extensible_inputs = any(fields.get(k) is not None for k in EXTENSIBLE_INPUTS)
        if era.extensible_kv_cache_default and (extensible_kv_cache or (extensible_kv_cache is None
                                                                         and extensible_inputs)):
            formula = "extensible"
        fields["formula"] = formula
        if fields.get("gpu_memory_utilization") is None:
            default = era.default_gpu_memory_utilization
            if default is None:   # 0.34: resolved_gpu_memory_utilization (config/cache.py 0.34.0:494-501)
                default = 1.0 if formula == "extensible" else 0.92
            fields["gpu_memory_utilization"] = default
        if FORMULAS[formula].cudagraph and fields.get("cudagraph_memory_bytes") is None \
                and not era.cudagraph_estimate_default:
            fields["cudagraph_memory_bytes"] = 0

    config = None
    layout = None
    if block_size is None and startup is not None:
        # The log's own block size: stated (a hybrid model's), tokens / blocks, or every candidate
        # era's default when they agree (vllm-ascend 0.15+: 128), before the era's default.
        block_size = startup.effective_block_size()[0]
    if model_config:
        try:
            config = load_model_config(model_config)
            layout = kv_layout_from_config(config, block_size=_block_size(era, block_size, config),
                                           kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tensor_parallel_size,
                                           pipeline_parallel_size=pipeline_parallel_size)
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None

    profile = None
    given = {k for k, v in flags.items() if v is not None} | ({"non_torch_increase_bytes"}
                                                             if non_torch_memory is not None else set())
    needs = _era_needs(era, fields, given, file_fields, file_formula, profile_file)
    measured = {k: v for k, v in fields.items() if k in _PROFILE_FLAGS or k in ("formula", "vllm_version",
                                                                                  "kv_cache_memory_bytes")}
    if fields and all(fields.get(k) is not None for k in needs):
        try:
            profile = Profile(**{**{k: None for k in Profile.REQUIRED}, **measured})
        except (ProfileError, TypeError) as exc:
            raise click.ClickException(str(exc)) from None
    elif (given or profile_file) and not (startup and startup.available_kv_cache_bytes and given <= _LOG_FILLS):
        # Never a silent drop: a profile from flags or a file that the era cannot budget is refused (a log's
        # own decided budget stands, with --total-memory / --gpu-memory-utilization for --allocator).
        missing = [_PROFILE_FLAGS.get(k, k) + _MISSING_HINT.get(k, "") for k in needs if fields.get(k) is None]
        era_text = f" for {era.name}" if era else ""
        extensible = ""
        if era and era.extensible_kv_cache_default and fields.get("formula") != "extensible":
            extensible = (" (or, with its extensible KV cache, " + ", ".join(_PROFILE_FLAGS[k] for k in
                                                                           EXTENSIBLE_INPUTS) + ")")
        raise click.UsageError(f"incomplete profile{era_text}: missing {', '.join(missing)}{extensible}")

    if kv_cache_memory is not None and layout is None:
        raise click.UsageError("--kv-cache-memory needs --model-config to count blocks")
    if layout is None and profile is None and startup is None:
        raise click.UsageError("nothing to compute: give --model-config, a profile (--profile, --from-log, "
                               "or --total-memory ... flags), or both")

    if profile is not None:
        _refuse_growth_past_the_device(profile)
    result: dict[str, Any] = {"vllm_version": fields.get("vllm_version"),
                              "era": era.to_dict() if era else None,
                              "block_bytes": layout.block_bytes if layout else None}
    if layout:
        result["layout"] = _layout_dict(layout)
    if kv_cache_memory is not None:
        held = budget_for(kv_cache_memory, layout)
        result["kv_cache_memory_bytes"] = kv_cache_memory
        result["num_blocks"] = held.num_blocks
        result["num_tokens"] = held.num_tokens
    result["max_model_len"] = max_model_len
    if profile:
        result["profile"] = profile.to_dict()
        result.update(estimate(profile, layout, max_model_len).to_dict())
    if startup:
        result["log"] = startup.to_dict()
        budgets = result.setdefault("budgets", {"stock": None, "reserved": None})
        if startup.available_kv_cache_bytes is not None:
            # From a log, the stock budget is what vLLM decided, not a recomputation.
            budgets["stock"] = _decided_budget(startup, layout, layout.block_size if layout else
                                               _block_size(era, block_size, config), max_model_len)
            if budgets["reserved"]:
                result["overcommit_bytes"] = overcommit_bytes(startup.available_kv_cache_bytes,
                                                              budgets["reserved"]["kv_cache_bytes"])
        for key in ("overcommit_bytes", "recommended_gpu_memory_utilization", "recommended_kv_cache_memory_bytes"):
            result.setdefault(key, None)
    result["recommended_flags"] = _recommended_flags(result, era)
    if allocator:
        if profile is None and startup is not None:
            # A log without the profile line: the non-KV memory read back from the decided budget, as
            # kvguard check does (kvguard.sidecar.core.log_profile), with --total-memory / --gpu-memory-utilization.
            from kvguard.sidecar.core import log_profile
            profile = log_profile(startup, total_memory, gpu_memory_utilization)[0]
        if enable_vmm is None and era is None and startup is not None and allocator == "mindspore":
            # A vllm-mindspore log older than the table (no era row) still ran its launcher's VMM.
            enable_vmm = startup.project == "vllm-mindspore"
        result["at_budget"] = _budget_time_verdict(result, profile, layout, allocator, era, enable_vmm,
                                                   expandable_segments, non_allocator_memory)

    if as_json:
        _emit_json(result)
    else:
        _print_budget(result, layout)


# What a log's decided budget still uses when its profile is incomplete (--allocator: kvguard.sidecar.core.log_profile).
_LOG_FILLS = {"total_memory_bytes", "gpu_memory_utilization"}
_MISSING_HINT = {
    "cudagraph_memory_bytes": " (the CUDA-graph estimate it subtracts; 0 if VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0)",
    "non_torch_cleared_bytes": " (the non-torch memory present at startup, which it also subtracts)",
}


def _era_needs(era, fields: dict[str, Any], given: set[str], file_fields: dict[str, Any], file_formula: str,
               profile_file: str | None) -> list[str]:
    """The profile fields the era's formula needs here; refuses (one line) an input it would drop: a flag
    the formula does not read, or a profile file's figure the chosen era reads otherwise or not at all."""
    formula = fields.get("formula") or "peak"
    reads = formula_inputs(formula)
    who = era.name if era else "the default formula (0.9.1-0.13; no --vllm-version)"
    takes = ", ".join(_PROFILE_FLAGS[k] for k in reads if k in _PROFILE_FLAGS)
    unread = [_PROFILE_FLAGS[k] for k in _PROFILE_FLAGS if k in given and k not in reads]
    if unread:
        raise click.UsageError(f"{who} (formula {formula}) does not read {', '.join(unread)}; it takes {takes}")
    if profile_file and formula != file_formula:
        absolute = {name: FORMULAS[name].non_torch == "positive" for name in (formula, file_formula)}
        if absolute[formula] != absolute[file_formula] and file_fields.get("non_torch_increase_bytes") is not None \
                and "non_torch_increase_bytes" not in given:
            what = "the absolute non-torch memory" if absolute[formula] else "the non-torch increase"
            raise click.UsageError(f"{who} adds {what}, which the profile file (formula {file_formula}) does not hold: "
                                   f"give it as {'--non-torch-memory' if absolute[formula] else '--non-torch-increase'}")
        dropped = [k for k in file_fields if k not in Profile.REQUIRED and k not in ("formula", "vllm_version")
                   and file_fields[k] is not None and k not in reads]
        if dropped:
            raise click.UsageError(f"{who} (formula {formula}) does not read the profile file's {', '.join(dropped)} "
                                   f"(formula {file_formula}); it takes {takes}")
    needs = list(required_fields(formula, fields.get("kv_cache_memory_bytes")))
    if fields.get("kv_cache_memory_bytes") is None:
        # Inputs the estimator would otherwise take as 0: vLLM 0.20+ subtracts its CUDA-graph estimate by default
        # (the 0.18-0.19 default, off, is filled in above), vllm-ascend 0.15+ the non-torch memory at startup.
        needs += [k for k in ("cudagraph_memory_bytes", "non_torch_cleared_bytes") if k in reads
                  and (k != "non_torch_cleared_bytes" or FORMULAS[formula].cleared)]
    return needs


def _non_torch_flag(era, non_torch_increase, non_torch_memory, fields: dict[str, Any]) -> None:
    """The non-torch input under the name of what the era's formula takes: the increase since the init
    snapshot, or (formula non_torch "positive") the absolute memory; both fill non_torch_increase_bytes."""
    absolute = era is not None and FORMULAS[era.formula].non_torch == "positive"
    if non_torch_increase is not None and non_torch_memory is not None:
        raise click.UsageError("give --non-torch-increase or --non-torch-memory, not both")
    if non_torch_increase is not None and absolute:
        raise click.UsageError(f"{era.name} adds the absolute non-torch memory after empty_cache (total - free - "
                               f"torch allocated), not an increase: give it as --non-torch-memory")
    if non_torch_memory is not None:
        if era is None:
            raise click.UsageError("--non-torch-memory needs --vllm-version: only some eras add the absolute "
                                   "non-torch memory")
        if not absolute:
            raise click.UsageError(f"{era.name} takes the non-torch increase since the init snapshot: give it as "
                                   f"--non-torch-increase")
        fields["non_torch_increase_bytes"] = non_torch_memory


def _refuse_unused_allocator_options(allocator, enable_vmm, expandable_segments, non_allocator_memory) -> None:
    """The budget-time verdict's options mean nothing without it, or on an allocator without the feature."""
    given = [flag for flag, value in (("--[no-]enable-vmm", enable_vmm), ("--[no-]expandable-segments",
                                                                          expandable_segments),
                                      ("--non-allocator-memory", non_allocator_memory)) if value is not None]
    if given and allocator is None:
        raise click.UsageError(f"{', '.join(given)} set the budget-time verdict's allocator: give --allocator too")
    if enable_vmm is not None and allocator != "mindspore":
        raise click.UsageError(f"--[no-]enable-vmm is MindSpore's VMM: --allocator mindspore, not {allocator}")
    if expandable_segments is not None and allocator == "mindspore":
        raise click.UsageError("--[no-]expandable-segments is PyTorch's / torch_npu's: --allocator torch or torch_npu")


def _refuse_growth_past_the_device(profile: Profile) -> None:
    """A profile whose weights or profile-run increases exceed the device itself was mis-typed (a unit, a
    digit); say which figure, rather than print a budget of minus hundreds of GiB."""
    for name, flag in (("weights_bytes", "--weights"), ("peak_allocated_increase_bytes", "--peak-allocated-increase"),
                       ("peak_reserved_increase_bytes", "--peak-reserved-increase")):
        value = getattr(profile, name)
        if value is not None and value > profile.total_memory_bytes:
            raise click.ClickException(f"{flag} {format_gib(value)} is more than the device's total memory "
                                       f"({format_gib(profile.total_memory_bytes)}): check its unit")


def _budget_time_verdict(result: dict[str, Any], profile, layout, allocator: str, era, enable_vmm,
                         expandable_segments: bool | None, non_allocator_memory) -> dict[str, Any]:
    """``--allocator``: the guard's budget-time verdict on vLLM's budget (the log's decided figure, or the
    stock formula), and the largest budget it predicts fits (kvguard.sim.guarded.predict_at_budget)."""
    if layout is None:
        raise click.UsageError("--allocator needs --model-config: the KV tensors are counted per layer")
    if profile is None:
        raise click.UsageError("--allocator needs a complete profile (--profile, --from-log or flags): the "
                               "allocator's state at the budget follows from it")
    stock = (result.get("budgets") or {}).get("stock") or {}
    kv_cache = stock.get("kv_cache_bytes")
    if kv_cache is None:
        kv_cache = stock_kv_cache_bytes(profile)
    if enable_vmm is None:
        enable_vmm = allocator == "mindspore" and bool(era and era.project == "vllm-mindspore")
    if expandable_segments is None:
        from kvguard.vllm.eras import expandable_segments_default
        expandable_segments = expandable_segments_default(result.get("vllm_version"), allocator)
    from kvguard.sim.guarded import predict_at_budget

    try:
        return predict_at_budget(profile, layout, kv_cache, allocator, enable_vmm=enable_vmm,
                                 expandable_segments=expandable_segments,
                                 non_allocator_bytes=non_allocator_memory)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def _recommended_flags(result: dict[str, Any], era) -> list[str]:
    """vLLM's own flag names for the recommendation (--kv-cache-memory-bytes since 0.10.2)."""
    flags = []
    if result.get("recommended_gpu_memory_utilization") is not None:
        flags.append(f"--gpu-memory-utilization {result['recommended_gpu_memory_utilization']}")
    flag = era.kv_cache_memory_flag if era else "--kv-cache-memory-bytes"
    if flag and result.get("recommended_kv_cache_memory_bytes") is not None:
        flags.append(f"{flag} {result['recommended_kv_cache_memory_bytes']}")
    return flags


def _decided_budget(startup, layout: KVLayout | None, block_size: int, max_model_len: int | None) -> dict[str, Any]:
    num_blocks = startup.num_gpu_blocks
    num_tokens = startup.kv_cache_tokens
    if num_blocks is None and num_tokens is not None:
        num_blocks = num_tokens // (layout.block_size if layout else block_size)
    if num_blocks is None and layout is not None:
        num_blocks = layout.num_blocks(startup.available_kv_cache_bytes)
    if num_tokens is None and num_blocks is not None:
        num_tokens = num_blocks * (layout.block_size if layout else block_size)
    concurrency = None
    if not max_model_len or startup.max_model_len == max_model_len:
        concurrency = startup.max_concurrency
    if concurrency is None and max_model_len and layout and num_blocks is not None:
        concurrency = max_concurrency(num_blocks, layout, max_model_len)
    return {"kv_cache_bytes": startup.available_kv_cache_bytes, "num_blocks": num_blocks,
            "num_tokens": num_tokens, "max_concurrency": concurrency}


def _fmt_int(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


_PROFILE_WORDS = {
    "weights_bytes": "weights", "peak_allocated_increase_bytes": "allocated peak increase",
    "peak_reserved_increase_bytes": "reserved increase", "non_torch_increase_bytes": "non-torch increase",
    "total_consumed_bytes": "total consumed", "transient_peak_headroom_bytes": "transient peak",
    "reserved_transient_peak_bytes": "reserved transient peak", "cudagraph_memory_bytes": "CUDA graphs",
    "kv_cache_memory_bytes": "--kv-cache-memory-bytes", "init_free_memory_bytes": "free at init",
    "free_after_warmup_bytes": "free after warm-up", "kv_committed_bytes": "KV committed",
    "kv_transient_peak_bytes": "KV transient peak", "torch_reserve_growth_bytes": "torch reserve growth",
    "non_torch_cleared_bytes": "non-torch cleared",
}


def _print_budget(result: dict[str, Any], layout: KVLayout | None) -> None:
    out = click.echo
    if layout:
        kind = "MLA latent" if layout.is_mla else f"{layout.num_kv_heads} KV heads x {layout.head_size} head size"
        out(f"KV layout    {layout.num_layers} layers x {kind}, {layout.dtype_bytes} B/elem "
            f"({layout.kv_cache_dtype}), {layout.block_size} tokens/block")
        out(f"Block        {result['block_bytes']:,} bytes ({format_bytes(result['block_bytes'])}) per block")
    if "num_blocks" in result:
        out(f"KV memory    {format_bytes(result['kv_cache_memory_bytes'])} holds {result['num_blocks']:,} blocks "
            f"= {result['num_tokens']:,} tokens")
    profile = result.get("profile")
    if profile:
        total, util = profile["total_memory_bytes"], profile["gpu_memory_utilization"]
        out("")
        era = result.get("era")
        if era:
            out(f"Era          {era['name']} (formula {profile.get('formula', 'peak')}"
                + (f", checked against the {era['project']} {era['checked_against']} wheel"
                   if era.get("checked_against") else "")
                + ")")
        out(f"Profile      total {format_bytes(total)} x utilization {util:g} = {format_bytes(total * util)}")
        # V0, 0.8.5-0.9.0 and vllm-ascend <= 0.14 hold the absolute non-torch memory in that field (--non-torch-memory).
        absolute = FORMULAS[profile.get("formula", "peak")].non_torch == "positive"
        words = {**_PROFILE_WORDS, **({"non_torch_increase_bytes": "non-torch memory"} if absolute else {})}
        parts = [f"{words[key]} {format_bytes(value)}" for key, value in profile.items()
                 if key in words and value is not None]
        if profile.get("peak_reserved_increase_bytes") is None and profile.get("formula", "peak").startswith("peak"):
            parts.append("reserved increase unknown")
        for start in range(0, len(parts), 3):
            out("             " + ", ".join(parts[start:start + 3]))
    if result.get("log"):
        log = result["log"]
        out(f"Log          {log['lines_matched']} startup lines matched (era {log['era'] or 'unknown'})")
    at_budget = result.get("at_budget")
    if at_budget:
        verdict = at_budget["verdict"]
        out("")
        out(f"At budget    {verdict['state'].upper()} for vLLM's {format_bytes(at_budget['kv_cache_bytes'])} "
            f"on {at_budget['allocator']}{' (VMM)' if at_budget['enable_vmm'] else ''}: "
            f"{verdict['kv_tensors']} KV tensors, headroom {format_bytes(verdict['headroom_bytes'])}")
        for reason in verdict["reasons"]:
            out(f"             - {reason['code']}: {reason['message']}")
        fits = at_budget["largest_fitting_kv_cache_bytes"]
        out(f"             largest budget the guard predicts fits: "
            f"{'none' if not fits else format_bytes(fits)}")
    budgets = result.get("budgets")
    if budgets:
        mml = result.get("max_model_len") or (result.get("log") or {}).get("max_model_len")
        out("")
        out(f"{'Budget':<12} {'KV cache':>12} {'blocks':>10} {'tokens':>12} "
            f"{'concurrency' + (f' @{mml}' if mml else ''):>20}")
        for name in ("stock", "reserved"):
            b = budgets.get(name)
            if b is None:
                out(f"{name:<12} {'unknown (needs the reserved increase)' if name == 'reserved' else 'unknown'}")
                continue
            conc = "-" if b["max_concurrency"] is None else f"{b['max_concurrency']:.2f}x"
            out(f"{name:<12} {format_bytes(b['kv_cache_bytes']):>12} {_fmt_int(b['num_blocks']):>10} "
                f"{_fmt_int(b['num_tokens']):>12} {conc:>20}")
        if result.get("overcommit_bytes") is not None:
            over = result["overcommit_bytes"]
            out("")
            if over > 0:
                out(f"Overcommit   {format_bytes(over)}: the stock budget grants KV cache the allocator's "
                    f"reserved peak leaves no room for")
            elif result.get("reserved_counts", "").startswith("nothing"):
                out(f"Overcommit   none: the reserved-aware budget adds {result['reserved_counts']}")
            else:
                out("Overcommit   none: the stock budget fits under the reserved peak")
        if result.get("recommended_gpu_memory_utilization") is not None or \
                result.get("recommended_kv_cache_memory_bytes") is not None:
            flags = result.get("recommended_flags") or []
            if result.get("recommended_gpu_memory_utilization") is None:
                flags = ["--gpu-memory-utilization (none is safe)"] + flags
            out(f"Recommended  {'  or  '.join(flags)}")


# ---------------------------------------------------------------------------- simulate

EXIT_OOM = 3   # simulate --fail-on-oom; click keeps 1 (ClickException) and 2 (usage)


@main.command()
@click.option("--model-config", "model_config", metavar="PATH",
              help="HF config.json (or its directory). Default: the bundled Qwen2.5-7B-Instruct config.")
@click.option("--device-memory", type=SIZE, default="32GiB", show_default=True,
              help="Device capacity (32GiB: an Atlas 910B4). An exact snapshot replay (--trace SNAPSHOT.pickle) "
                   "takes it only when given: a snapshot does not record its GPU's size.")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=0.9,
              show_default=True)
@click.option("--allocator", type=click.Choice(["torch", "torch_npu", "mindspore"]), default="torch",
              show_default=True)
@click.option("--budget", type=click.Choice(["stock", "reserved"]), default="stock", show_default=True,
              help="stock: vLLM's allocated-peak formula; reserved: vllm-mindspore's reserved-increase fix.")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=8192, show_default=True)
@click.option("--max-model-len", type=click.IntRange(min=1),
              help="Default: the model's max_position_embeddings, at most 32768.")
@click.option("--requests", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--long-fraction", type=click.FloatRange(0, 1), default=0.25, show_default=True,
              help="Share of requests with prompts of max_model_len/2 or more.")
@click.option("--tensor-parallel-size", "-tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--non-allocator-memory", type=SIZE,
              help="Device memory held outside the allocator (default: 512MiB CUDA, 1GiB Ascend).")
@click.option("--seed", "seeds", type=int, multiple=True,
              help="Request-mix seed (default 0); repeat it with --search-utilization to search over several.")
@click.option("--trace", "trace_file", metavar="FILE",
              help="Replay a MindSpore memory_block.csv or a PyTorch _dump_snapshot pickle instead "
                   "(a snapshot with --allocator torch is replayed exactly, every device).")
@click.option("--ops", "ops_file", metavar="FILE",
              help="Replay a plain allocator op stream (JSON lines: malloc / free / empty_cache) through the "
                   "--allocator model; --device-memory is then the device's free memory.")
@click.option("--replay-log", "replay_log", metavar="FILE",
              help="With a snapshot --trace: one JSON line per replayed allocation; with --ops: one per op.")
@click.option("--search-utilization", is_flag=True,
              help="Find the highest --gpu-memory-utilization (0.01 steps) that serves every seed without an OOM.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--plot", "plot_file", metavar="FILE.png",
              help="Write allocated/reserved/capacity over time (a relative path is the current directory's).")
@click.option("--fail-on-oom", is_flag=True,
              help=f"Exit {EXIT_OOM} when the run ends in an out-of-memory error (with --search-utilization: "
                   f"when no utilization serves without one).")
@click.option("--alloc-conf", metavar="CONF",
              help='PyTorch\'s / torch_npu\'s allocator settings in PYTORCH_CUDA_ALLOC_CONF / PYTORCH_NPU_ALLOC_CONF '
                   'syntax, e.g. "expandable_segments:True,max_split_size_mb:256" (--allocator torch, torch_npu).')
@click.option("--mindspore-version", metavar="X.Y.Z",
              help="MindSpore release whose pool rules apply (2.4.0 ... 2.10.0; default: the launcher's pin).")
@click.option("--vllm-mindspore-version", type=click.Choice(["0.5.1", "0.2.0"]), default="0.5.1", show_default=True,
              help="Whose launcher defaults to take (0.2.0: the seed fix's, PR !428).")
@click.option("--mindspore-mode", type=click.Choice(["pynative", "graph"]), default="pynative", show_default=True,
              help="MindSpore execution mode (vllm-mindspore: PyNative with jit_level O0 graphs).")
@click.option("--task-sink/--no-task-sink", default=False, show_default=True,
              help="Task sink (graph mode, jit_level O2): 8 MiB units, blocks grown by adding units.")
@click.option("--ms-alloc-conf", metavar="CONF",
              help='MS_ALLOC_CONF, e.g. "enable_vmm: true, vmm_align_size: 2MB" (default: the launcher\'s).')
@click.option("--mempool-block-size", type=SIZE, metavar="SIZE",
              help="Pool block unit: MS_MEMPOOL_BLOCK_SIZE=2 is 2GiB; set_memory(increase_size=...).")
@click.option("--no-vmm-soc", is_flag=True, help="A SoC without VMM (not 910B / 910_93): VMM off unless asked.")
def simulate(model_config, device_memory, gpu_memory_utilization, allocator, budget, max_num_batched_tokens,
             max_model_len, requests, long_fraction, tensor_parallel_size, non_allocator_memory, seeds, trace_file,
             ops_file, replay_log, search_utilization, as_json, plot_file, fail_on_oom, alloc_conf, mindspore_version,
             vllm_mindspore_version, mindspore_mode, task_sink, ms_alloc_conf, mempool_block_size, no_vmm_soc) -> None:
    """Simulate vLLM startup and serving on a device, with a real allocator's rules.

    Loads the weights, runs the profile forward at --max-num-batched-tokens, sizes the KV
    cache with the chosen budget formula, then serves a seeded mix of short and long
    requests under chunked prefill until they finish or the allocator runs out of memory.

    \b
    Exit codes:
      0  the run finished (an OOM too, unless --fail-on-oom)
      1  bad input: a one-line error
      2  usage error, or an internal error
      3  --fail-on-oom and the run (scenario, trace replay) ended in an OOM, an op of
         an --ops stream ran out of memory, or the search found no utilization without one
    """
    from kvguard.allocators.device import Device
    from kvguard.sim.scenario import ScenarioConfig, ServingScenario, make_allocator
    from kvguard.allocators.traces import TraceError, is_snapshot_pickle, load_trace, read_trace_bytes, replay

    seeds = seeds or (0,)
    seed = seeds[0]
    if len(seeds) > 1 and not search_utilization:
        raise click.ClickException("give one --seed, or several with --search-utilization")
    if replay_log and not (trace_file or ops_file):
        raise click.ClickException("--replay-log needs a snapshot --trace or --ops")
    if ops_file and trace_file:
        raise click.ClickException("give --ops or --trace, not both")
    if search_utilization and (trace_file or ops_file):
        raise click.ClickException("--search-utilization simulates a workload; it does not take --trace or --ops")
    if ops_file and non_allocator_memory is not None:
        raise click.ClickException("--ops takes --device-memory as the device's free memory; "
                                   "--non-allocator-memory does not apply")

    if plot_file:
        _check_plot_path(plot_file)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.ClickException("--plot needs matplotlib: pip install 'kvguard[plot]'") from None
    try:
        if allocator == "mindspore" and alloc_conf:
            raise ValueError("--alloc-conf is for --allocator torch and torch_npu; MindSpore's pool takes "
                             "--ms-alloc-conf")
        config_dict = load_model_config(model_config or bundled_model_config_path())
        config = ScenarioConfig(
            model_config=config_dict, device_memory_bytes=device_memory,
            gpu_memory_utilization=gpu_memory_utilization, allocator=allocator, budget=budget,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, requests=requests,
            long_request_fraction=long_fraction, tensor_parallel_size=tensor_parallel_size,
            non_allocator_bytes=non_allocator_memory, seed=seed, mindspore_version=mindspore_version,
            vllm_mindspore_version=vllm_mindspore_version, mindspore_mode=mindspore_mode, task_sink=task_sink,
            ms_alloc_conf=ms_alloc_conf, mempool_block_size_bytes=mempool_block_size,
            soc_supports_vmm=not no_vmm_soc, alloc_conf=alloc_conf)
        if allocator != "mindspore" and (mindspore_version or ms_alloc_conf or mempool_block_size or task_sink
                                         or no_vmm_soc or mindspore_mode != "pynative"):
            raise ValueError("the MindSpore pool options need --allocator mindspore")
        if non_allocator_memory is not None and non_allocator_memory >= device_memory:
            raise ValueError("--non-allocator-memory must be smaller than --device-memory")
    except (ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None

    if ops_file:
        _exit_on_oom(fail_on_oom, _replay_ops_file(ops_file, config, device_memory, replay_log, as_json))
        return
    if trace_file and allocator == "torch":
        try:
            data = read_trace_bytes(trace_file)
        except TraceError as exc:
            raise click.ClickException(str(exc)) from None
        if is_snapshot_pickle(data):
            if click.get_current_context().get_parameter_source("device_memory") is ParameterSource.DEFAULT:
                # The GPU's size bounds only expandable segments' address space (1 1/8 x total); the trace's
                # own oom entries say where the real device ran out. A guessed 32 GiB would refuse growth
                # that an 80 GiB GPU served: 170 of 199 allocations matched on a real trace, 199 unguessed.
                device_memory = SNAPSHOT_ADDRESS_SPACE_BYTES
            _exit_on_oom(fail_on_oom, _replay_snapshot_exactly(trace_file, data, device_memory, replay_log, as_json))
            return
    if replay_log:
        raise click.ClickException("--replay-log needs a PyTorch snapshot --trace replayed with --allocator torch")
    if search_utilization:
        _exit_on_oom(fail_on_oom, _search_utilization(config, seeds, as_json) is None)
        return

    if trace_file:
        try:
            trace = load_trace(trace_file)
        except TraceError as exc:
            raise click.ClickException(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a reader bug on an odd file is one line, not a traceback
            raise click.ClickException(f"cannot read trace {trace_file}: {exc.__class__.__name__}: "
                                       f"{str(exc).splitlines()[0] if str(exc) else ''}"[:300]) from None
        device = Device(device_memory, config.resolved_non_allocator_bytes)
        target = make_allocator(config, device)
        outcome = replay(trace.events, target, sample_every=max(1, len(trace.events) // 2000))
        data = {
            "oom": outcome.oom, "oom_at_step": outcome.oom_at_event, "oom_request_bytes": outcome.oom_request_bytes,
            "trace": {"file": trace_file, "format": trace.source, "events": len(trace.events),
                      "allocations": trace.num_allocs, "skipped": trace.skipped,
                      "events_replayed": outcome.events_replayed},
            "allocator": allocator, "kv_cache_bytes": None, "num_blocks": None, "profile": None,
            "peak_allocated_bytes": outcome.peak_allocated_bytes, "peak_reserved_bytes": outcome.peak_reserved_bytes,
            "device": {"total_bytes": device.capacity_bytes, "free_bytes": device.free_bytes,
                       "peak_used_bytes": device.peak_used_bytes},
            "memory_stats": {str(k): v for k, v in outcome.memory_stats.items()},
        }
        if plot_file:
            from kvguard.sim.plot import plot_replay
            _write_plot(plot_file, plot_replay, outcome, device_memory, plot_file,
                        f"{trace.source} replayed on {allocator}")
        if as_json:
            _emit_json(data)
            _exit_on_oom(fail_on_oom, outcome.oom)
            return
        click.echo(f"Trace        {trace_file} ({trace.source}): {len(trace.events)} events, "
                   f"{trace.num_allocs} allocations, {trace.skipped} skipped")
        click.echo(f"Allocator    {allocator} on {format_bytes(device_memory)}")
        click.echo(f"Peaks        allocated {format_bytes(outcome.peak_allocated_bytes)}, "
                   f"reserved {format_bytes(outcome.peak_reserved_bytes)}")
        click.echo("Outcome      " + (f"OOM at event {outcome.oom_at_event} "
                                      f"({format_bytes(outcome.oom_request_bytes)} requested)"
                                      if outcome.oom else "no OOM"))
        _exit_on_oom(fail_on_oom, outcome.oom)
        return

    try:
        scenario = ServingScenario(config)
    except (ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    except ArithmeticError as exc:   # a config field the readers did not refuse: one line, never a traceback
        raise click.ClickException(f"model config: {exc}") from None
    from kvguard.sim.guarded import BudgetWatch, startup_guard_dict, startup_verdict
    watch = BudgetWatch(scenario)       # the guard when the budget is fixed, before the KV cache
    scenario.startup()
    guard = startup_guard_dict(startup_verdict(scenario))   # the guard before serving starts
    guard_at_budget = startup_guard_dict(watch.verdict(), at_budget=True)
    if sys.stderr.isatty() and not scenario.finished:
        with click.progressbar(length=len(scenario.requests), label="serving", file=sys.stderr) as bar:
            done = 0

            def advance(finished: int, _total: int) -> None:
                nonlocal done
                bar.update(finished - done)
                done = finished

            result = scenario.run(progress=advance)
    else:
        result = scenario.run()
    if plot_file:
        from kvguard.sim.plot import plot_scenario
        _write_plot(plot_file, plot_scenario, [result], plot_file)
    if as_json:
        _emit_json({**result.to_dict(), "guard_at_budget": guard_at_budget, "guard": guard})
        _exit_on_oom(fail_on_oom, result.oom)
        return
    profile = result.profile
    click.echo(f"Device       {format_bytes(device_memory)}, utilization {gpu_memory_utilization:g}, "
               f"allocator {allocator}, budget {budget}")
    if allocator == "mindspore":
        click.echo(f"Pool         MindSpore {config.mindspore_release.version} ({config.mindspore_mode}"
                   f"{', task sink' if task_sink else ''}), VMM {'on' if config.enable_vmm else 'off'}"
                   + (f", block unit {format_bytes(mempool_block_size)}" if mempool_block_size else ""))
    if profile is not None:
        click.echo(f"Profile      weights {format_bytes(profile.weights_bytes)}, allocated peak +"
                   f"{format_bytes(profile.peak_allocated_increase_bytes)}, reserved +"
                   f"{format_bytes(profile.peak_reserved_increase_bytes)}, non-torch "
                   f"{format_bytes(profile.non_torch_increase_bytes)}")
    if result.kv_cache_bytes is not None:
        click.echo(f"KV cache     {format_bytes(result.kv_cache_bytes)} ({_fmt_int(result.num_blocks)} blocks)")
    click.echo(f"Serving      {result.steps} steps, {result.requests_finished}/{requests} requests finished, "
               f"{result.preemptions} preemptions")
    if guard["state"] is not None:
        click.echo(f"Guard        {guard['state']} at the end of startup"
                   + "".join(f"; {reason['code']}" for reason in guard["reasons"]))
    if result.error:
        click.echo(f"Error        {result.error}")
    if result.oom:
        where = f"serving step {result.oom_at_step}" if result.oom_at_step is not None else result.oom_phase
        click.echo(f"Outcome      OOM during {where} ({format_bytes(result.oom_request_bytes)} requested)")
    elif not result.error:
        click.echo("Outcome      no OOM")
    _exit_on_oom(fail_on_oom, result.oom)


def _exit_on_oom(fail_on_oom: bool, oom: bool) -> None:
    """``--fail-on-oom``: exit EXIT_OOM after the report when the run ended in an OOM."""
    if fail_on_oom and oom:
        click.get_current_context().exit(EXIT_OOM)


def _replay_ops_file(ops_file: str, config, device_memory: int, replay_log: str | None, as_json: bool) -> bool:
    """``simulate --ops FILE``: the stream through the chosen allocator model; True when an op ran out of memory."""
    from kvguard.allocators.device import Device
    from kvguard.allocators.ops import OpsError, read_ops, replay_ops
    from kvguard.sim.scenario import make_allocator

    try:
        ops = read_ops(ops_file)
        # The device's free memory, all of it the allocator's to ask for: the models apply their own ceilings
        # (MindSpore's pool takes 15/16 of it) as the real allocators do.
        device = Device(device_memory)
        target = make_allocator(config, device)
    except (OpsError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    counts = {"malloc": 0, "free": 0, "empty_cache": 0}
    ooms = 0
    first_oom = None
    peak_reserved = 0
    log_handle = None
    try:
        if replay_log:
            try:
                log_handle = open(replay_log, "w", encoding="utf-8")
            except OSError as exc:
                raise click.ClickException(f"cannot write {replay_log}: {exc.strerror or exc}") from None
        for record in replay_ops(target, ops):
            counts[record["kind"]] += 1
            peak_reserved = max(peak_reserved, record["reserved_bytes"])
            if record["oom"]:
                ooms += 1
                if first_oom is None:
                    first_oom = record["op"]
            if log_handle is not None:
                log_handle.write(json.dumps({key: record[key] for key in (
                    "op", "reserved_bytes", "allocated_bytes", "peak_allocated_bytes", "oom", "address")}) + "\n")
    except OSError as exc:
        raise click.ClickException(f"cannot write {replay_log}: {exc.strerror or exc}") from None
    finally:
        if log_handle is not None:
            log_handle.close()
    data = {
        "ops": {"file": ops_file, "count": len(ops), **counts},
        "allocator": config.allocator, "device": {"free_bytes": device_memory},
        "oom": ooms > 0, "ooms": ooms, "first_oom_op": first_oom,
        "reserved_bytes": target.reserved_bytes, "allocated_bytes": target.allocated_bytes,
        "peak_allocated_bytes": target.peak_allocated_bytes,
        "peak_reserved_bytes": max(peak_reserved, target.peak_reserved_bytes),
        "memory_stats": {str(k): v for k, v in target.memory_stats().items()},
    }
    if as_json:
        _emit_json(data)
        return ooms > 0
    click.echo(f"Ops          {ops_file}: {len(ops)} ops ({counts['malloc']} malloc, {counts['free']} free, "
               f"{counts['empty_cache']} empty_cache)")
    click.echo(f"Allocator    {config.allocator} with {format_bytes(device_memory)} free")
    click.echo(f"Peaks        allocated {format_bytes(target.peak_allocated_bytes)}, "
               f"reserved {format_bytes(data['peak_reserved_bytes'])}")
    click.echo(f"End          allocated {format_bytes(target.allocated_bytes)}, "
               f"reserved {format_bytes(target.reserved_bytes)}")
    click.echo("Outcome      " + (f"{ooms} out-of-memory op(s), the first at op {first_oom}" if ooms else "no OOM"))
    return ooms > 0


SNAPSHOT_ADDRESS_SPACE_BYTES = 1 << 44   # 16 TiB: larger than any GPU's memory, so it never decides a replay


def _replay_snapshot_exactly(trace_file: str, data: bytes, device_memory: int, replay_log: str | None,
                             as_json: bool) -> bool:
    """``simulate --trace SNAPSHOT.pickle``: every device, seeded, at the recorded addresses."""
    from kvguard.allocators.snapshot import SnapshotError, replay_snapshot
    from kvguard.allocators.traces import TraceError, load_snapshot_pickle, parse_torch_snapshot

    log_handle = None
    try:
        snapshot = load_snapshot_pickle(data)
        traces = snapshot.get("device_traces")
        parse_torch_snapshot(snapshot)        # the reader's checks and one-line messages, first device
        for device, trace in enumerate(traces):
            if trace:
                parse_torch_snapshot(snapshot, device)
        log = None
        if replay_log:
            try:
                log_handle = open(replay_log, "w", encoding="utf-8")
            except OSError as exc:
                raise click.ClickException(f"cannot write --replay-log {replay_log}: {exc.strerror}") from None
            write = log_handle.write

            def log(device: int, index: int, addr: int, size: int) -> None:
                write(f'{{"device": {device}, "index": {index}, "addr": {addr}, "size": {size}}}\n')
        devices = replay_snapshot(snapshot, address_space_bytes=device_memory, log=log)
    except (TraceError, SnapshotError) as exc:
        raise click.ClickException(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - an odd snapshot is one line, not a traceback
        raise click.ClickException(f"cannot replay snapshot {trace_file}: {exc.__class__.__name__}: "
                                   f"{str(exc).splitlines()[0] if str(exc) else ''}"[:300]) from None
    finally:
        if log_handle is not None:
            log_handle.close()
    allocs = sum(d.allocs for d in devices)
    matched = sum(d.allocs_matched for d in devices)
    ooms = sum(d.ooms for d in devices)
    payload = {
        "oom": ooms > 0,
        "allocator": "torch",
        "trace": {"file": trace_file, "format": "torch_snapshot", "exact": True,
                  "events": sum(d.events for d in devices), "allocations": allocs, "allocations_matched": matched,
                  "devices": [d.to_dict() for d in devices]},
    }
    if as_json:
        _emit_json(payload)
        return payload["oom"]
    click.echo(f"Trace        {trace_file} (torch_snapshot): {len(devices)} device(s), "
               f"{payload['trace']['events']} events")
    for d in devices:
        click.echo(f"Device {d.device:<5} {d.allocs_matched}/{d.allocs} allocations at the recorded address; "
                   f"end state {'equal' if d.end_state_matches else 'differs'} ({d.end_state_detail}); "
                   f"reserved {format_bytes(d.reserved_bytes)}, allocated {format_bytes(d.allocated_bytes)}"
                   + (f"; {d.ooms_matched}/{d.ooms} OOMs reproduced" if d.ooms else "")
                   + (f"; {d.preexisting_frees} frees of blocks from before recording "
                      f"({d.preexisting_extended} sizes extended)" if d.preexisting_frees else ""))
    click.echo(f"Outcome      {matched}/{allocs} allocations matched")
    return payload["oom"]


def _search_utilization(config, seeds: tuple[int, ...], as_json: bool) -> float | None:
    """``simulate --search-utilization``: bisection over 0.01 steps, every seed at each probe; the
    utilization found (None: every one runs out of memory)."""
    from kvguard.sim.scenario import search_gpu_memory_utilization

    try:
        search = search_gpu_memory_utilization(config, seeds)
    except (ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    except ArithmeticError as exc:
        raise click.ClickException(f"model config: {exc}") from None
    if as_json:
        _emit_json({"search": search.to_dict(), "config": config.summary()})
        return search.gpu_memory_utilization
    found = search.gpu_memory_utilization
    click.echo(f"Search       {config.allocator}, budget {config.budget}, seeds {', '.join(map(str, seeds))}: "
               f"{len(search.runs)} runs")
    if found is None:
        click.echo("Outcome      no utilization serves without an OOM (0.01 already runs out of memory)")
        return None
    above = f"; {found + 0.01:.2f} runs out of memory" if found < 1.0 else ""
    click.echo(f"Outcome      highest utilization without an OOM: {found:.2f}{above}")
    if search.kv_cache_memory_bytes is not None:
        click.echo(f"KV cache     {format_bytes(search.kv_cache_memory_bytes)} at {found:.2f} "
                   f"(--kv-cache-memory-bytes {search.kv_cache_memory_bytes})")
    if search.recommended_gpu_memory_utilization is not None:
        click.echo(f"Estimator    recommends {search.recommended_gpu_memory_utilization:.2f} from the same profile")
    return found


def _check_plot_path(path: str) -> None:
    """Refuse a --plot target that cannot be written before the run, not after it."""
    if not path.lower().endswith(".png"):
        raise click.ClickException(f"--plot writes a PNG: give a file name ending in .png, not {path!r}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise click.ClickException(f"--plot: directory {parent} does not exist")
    if os.path.isdir(path):
        raise click.ClickException(f"--plot: {path} is a directory")


def _write_plot(path: str, plot, *args) -> None:
    try:
        plot(*args)
    except OSError as exc:
        raise click.ClickException(f"cannot write plot {path}: {exc.strerror or exc}") from None
    except (ValueError, RuntimeError) as exc:
        raise click.ClickException(f"cannot write plot {path}: {str(exc).splitlines()[0] if str(exc) else exc}") \
            from None


# ---------------------------------------------------------------------------- sample / probe

def _build_source(source_name: str, options: dict[str, Any]):
    from kvguard.sources import SourceError, get_source
    try:
        return get_source(source_name, **options)
    except SourceError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--source", "source_name", default="auto", show_default=True, metavar="NAME",
              help="auto, host, mindspore, npu-smi, nvml, sim, torch.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def sample(source_name, as_json):
    """Read a source once and print one line per device (allocator split where the source has it)."""
    from kvguard.sources import SourceError, close_source
    source = _build_source(source_name, {})
    try:
        records = source.sample()
    except SourceError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        close_source(source)
    if as_json:
        _emit_json({"source": source_name, "devices": [record.to_dict() for record in records]})
        return
    if not records:
        click.echo(f"{source_name}: no device to report")
        return
    click.echo(f"{'DEVICE':<10} {'SOURCE':<10} {'ALLOCATED':>11} {'RESERVED':>11} {'PEAK RES.':>11} "
               f"{'FRAG.':>11} {'USED':>11} {'TOTAL':>11} PROCESSES")
    for r in records:
        processes = ", ".join(f"{p.pid}={format_bytes(p.used_bytes)}" for p in r.processes) or "-"
        click.echo(f"{r.device:<10} {r.source:<10} {format_bytes(r.allocated_bytes):>11} "
                   f"{format_bytes(r.reserved_bytes):>11} {format_bytes(r.peak_reserved_bytes):>11} "
                   f"{format_bytes(r.fragmentation_bytes):>11} {format_bytes(r.used_bytes):>11} "
                   f"{format_bytes(r.total_bytes):>11} {processes}")


@main.command()
@click.option("--source", "source_name", default="auto", show_default=True, metavar="NAME",
              help="auto, host, mindspore, npu-smi, nvml, sim, torch.")
@click.option("--spool-dir", required=True, envvar="KVGUARD_SPOOL_DIR", metavar="DIR",
              help="Where to write the snapshots [env KVGUARD_SPOOL_DIR].")
@click.option("--interval", type=FiniteFloatRange(0, min_open=True), default=5.0, show_default=True,
              help="Seconds between samples.")
@click.option("--once", is_flag=True, help="Sample and write once, then exit.")
@click.option("--ranks", type=click.IntRange(1, 64), help="Simulated ranks (--source sim).")
@click.option("--steps-per-sample", type=click.IntRange(min=1),
              help="Scheduler steps each simulated rank takes per sample (--source sim).")
def probe(source_name, spool_dir, interval, once, ranks, steps_per_sample):
    """Run the probe as its own process: one snapshot per device in the spool, every --interval seconds."""
    from kvguard.probe import Probe, run_until_signalled
    options = {key: value for key, value in (("ranks", ranks), ("steps_per_sample", steps_per_sample))
               if value is not None}
    if options and source_name != "sim":
        flag = "--ranks" if "ranks" in options else "--steps-per-sample"
        raise click.ClickException(f"{flag} applies to --source sim only")
    source = _build_source(source_name, options)
    try:
        runner = Probe(spool_dir, source, interval)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if once:
        import logging
        logging.getLogger("kvguard.probe").setLevel(logging.ERROR)   # the one-line error below says it
        written = runner.run_once(timeout=max(interval, 30.0))
        runner.stop()
        if not written:
            raise click.ClickException(runner.status.last_error or f"{source_name}: no device to sample")
        click.echo(f"wrote {written} snapshot{'s' if written != 1 else ''} to {spool_dir}")
        return
    click.echo(f"kvguard probe: {source_name} every {interval:g}s into {spool_dir} (Ctrl-C to stop)", err=True)
    run_until_signalled(runner)

from kvguard.cli import serve as cli_serve  # noqa: E402,F401  (registers serve and check)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
