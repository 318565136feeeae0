"""``kvguard budget``: vLLM's KV-cache budget for a release, beside the reserved-aware one."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import click

from kvguard.budget.estimator import (
    EXTENSIBLE_INPUTS,
    FORMULAS,
    KV_CACHE_DTYPES,
    ConfigError,
    KVLayout,
    Profile,
    ProfileError,
    budget_for,
    estimate,
    formula_inputs,
    kv_layout_from_config,
    max_concurrency,
    overcommit_bytes,
    required_fields,
    stock_kv_cache_bytes,
)
from kvguard.budget.fields import FLAGGED, PROFILE_FIELDS, field
from kvguard.budget.model_config import load_model_config
from kvguard.cli.options import (
    BYTES_OR_SIZE,
    SIGNED_SIZE,
    SIZE,
    TOKENS,
    block_size_for,
    emit_json,
    era_for_release,
    format_count,
    read_log,
    renamed_option,
)
from kvguard.text import one_line
from kvguard.units import format_bytes, format_gib
from kvguard.vllm.log_profile import LOG_FILLS, log_profile

# The profile fields' flags, types, help and words are the field table's (kvguard.budget.fields); the first
# six are every era's, the rest the inputs of the eras that need them (kvguard.vllm.eras).
_KINDS = {"size": SIZE, "signed_size": SIGNED_SIZE, "float": float}


def _flag(name: str, absolute: bool = False) -> str:
    """The flag that sets a profile field (``absolute``: the era adds the absolute non-torch memory)."""
    return field(name).flag_for(absolute) or name


def _absolute(formula: str | None) -> bool:
    """V0, 0.8.5-0.9.0 and vllm-ascend <= 0.14 hold the absolute non-torch memory (--non-torch-memory)."""
    return FORMULAS[formula or "peak"].non_torch == "positive"


def _read_profile_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read(1 << 20).decode("utf-8"))
    except FileNotFoundError:
        raise click.ClickException(f"profile file not found: {path}") from None
    except OSError as exc:
        raise click.ClickException(f"cannot read profile file {path}: {exc.strerror or one_line(exc)}") from None
    except RecursionError:
        raise click.ClickException(f"profile file {path} is nested too deeply to be a profile") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise click.ClickException(f"profile file {path} is not valid JSON: {one_line(exc, first_line=True)}") from None
    try:
        return Profile.from_dict(data).to_dict()
    except (ProfileError, TypeError) as exc:
        raise click.ClickException(f"profile file {path}: {one_line(exc)}") from None


def _layout_dict(layout: KVLayout) -> dict[str, Any]:
    return {**dataclasses.asdict(layout), "page_bytes_per_layer": layout.page_bytes_per_layer}


def _profile_field_options(function):
    """One option per profile field of the table, in its order (each field's absolute twin after it)."""
    for row in reversed(FLAGGED):
        if row.absolute_flag:
            function = click.option(
                row.absolute_flag, "non_torch_memory", type=_KINDS[row.kind], help=row.absolute_help
            )(function)
        function = click.option(row.flag, row.name, type=_KINDS[row.kind], help=row.help)(function)
    return function


@click.command()
@click.option(
    "--model-config", "model_config", metavar="PATH", help="Hugging Face config.json, or a model directory holding one."
)
@click.option(
    "--vllm-version",
    "release",
    metavar="RELEASE",
    help="The release whose formula applies: X.Y.Z (vLLM), vllm-ascend:X.Y.Z, vllm-ascend-310p:X.Y.Z, "
    "vllm-mindspore:X.Y.Z. Default: the 0.9.1-0.13 formula, or the era the log shows.",
)
@click.option("--block-size", type=click.IntRange(min=1), help="Tokens per KV block (default: the era's).")
@click.option(
    "--kv-cache-dtype",
    type=click.Choice(KV_CACHE_DTYPES),
    default="auto",
    show_default=True,
    help="KV cache dtype; auto follows the model's torch_dtype.",
)
@click.option("--tensor-parallel-size", "-tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--pipeline-parallel-size", "-pp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--max-model-len", type=TOKENS, help="Tokens per request, for max concurrency (32768, 32k, 32K as vLLM reads them)."
)
@click.option(
    "--kv-cache-memory-bytes",
    "kv_cache_memory",
    type=BYTES_OR_SIZE,
    help="Block count for this much KV cache memory (vLLM's flag: bytes, or a SIZE).",
)
@renamed_option("--kv-cache-memory", "kv_cache_memory", "--kv-cache-memory-bytes", type=BYTES_OR_SIZE)
@_profile_field_options
@click.option(
    "--extensible-kv-cache/--no-extensible-kv-cache",
    default=None,
    help="0.34: whether the extensible KV cache sized the cache (default: on where the extensible inputs are given).",
)
@click.option("--profile", "profile_file", metavar="FILE", help="Startup profile JSON (the profile keys).")
@click.option("--from-log", "log_file", metavar="FILE", help="vLLM / vllm-ascend / vllm-mindspore startup log.")
@click.option(
    "--allocator",
    type=click.Choice(["torch", "torch_npu", "mindspore"]),
    help="Predict the budget-time verdict for this allocator: the era's KV tensors placed by its rules "
    "(needs --model-config).",
)
@click.option(
    "--enable-vmm/--no-enable-vmm",
    default=None,
    help="MindSpore's VMM (default: as the release's launcher sets MS_ALLOC_CONF, vllm-mindspore 0.5+: "
    "on; else MindSpore's own default, on for 910B).",
)
@click.option(
    "--expandable-segments/--no-expandable-segments",
    default=None,
    help="PyTorch's / torch_npu's expandable_segments:True (default: the release's own: on for "
    "--allocator torch_npu with vllm-ascend 0.17.0rc1+, which sets it; else off).",
)
@click.option(
    "--non-allocator-memory",
    type=SIZE,
    help="Memory held outside the allocator from the start (default: the simulator's 512 MiB for "
    "torch, 1 GiB on Ascend).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def budget(
    model_config,
    release,
    block_size,
    kv_cache_dtype,
    tensor_parallel_size,
    pipeline_parallel_size,
    max_model_len,
    kv_cache_memory,
    extensible_kv_cache,
    profile_file,
    log_file,
    allocator,
    enable_vmm,
    expandable_segments,
    non_allocator_memory,
    as_json,
    non_torch_memory=None,
    **field_flags,
):
    """vLLM's KV-cache budget beside the reserved-aware one, and the utilization that closes the gap.

    The profile comes from flags, --profile FILE or --from-log FILE; flags override the
    file, the file overrides the log. --vllm-version picks the release's formula
    (docs/reference/eras.md); a profile written by the plugin names its release itself.
    """
    # The field flags by profile field name (kvguard.budget.fields).
    flags = {row.name: field_flags.get(row.name) for row in FLAGGED}
    total_memory, gpu_memory_utilization = flags["total_memory_bytes"], flags["gpu_memory_utilization"]
    non_torch_increase = flags["non_torch_increase_bytes"]
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise click.UsageError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    _refuse_unused_allocator_options(allocator, enable_vmm, expandable_segments, non_allocator_memory)
    startup = read_log(log_file) if log_file else None
    fields: dict[str, Any] = {}
    if startup:
        fields.update(startup.profile_fields())
    file_fields: dict[str, Any] = _read_profile_file(profile_file) if profile_file else {}
    fields.update(file_fields)
    fields.update({k: v for k, v in flags.items() if v is not None})

    # The era: --vllm-version, else the profile file's own release, else the log's lines.
    era = era_for_release(release or fields.get("vllm_version"))
    if era is None and startup is not None:
        era = startup.era_row
    elif (
        release
        and era is not None
        and startup is not None
        and startup.era_candidates
        and era.name not in startup.era_candidates
    ):
        # Said, not refused: the caller may know better than the lines (a fork, a backport), but never silently.
        rows = ", ".join(startup.era_candidates)
        click.echo(
            f"kvguard budget: --vllm-version {release} is the row {era.name}, but the log's lines fit only "
            f"{rows}; the formula of {era.name} is used",
            err=True,
        )
    if extensible_kv_cache is not None and not (era and era.extensible_kv_cache_default):
        raise click.UsageError(
            f"--{'' if extensible_kv_cache else 'no-'}extensible-kv-cache is vLLM 0.34+'s "
            f"(--vllm-version 0.34.0); {era.name if era else 'without --vllm-version, the formula'} "
            f"has no extensible KV cache"
        )
    file_formula = file_fields.get("formula") or "peak"
    _non_torch_flag(era, non_torch_increase, non_torch_memory, fields)
    if era is not None:
        fields["vllm_version"] = release or fields.get("vllm_version")
        formula = era.formula
        extensible_inputs = any(fields.get(k) is not None for k in EXTENSIBLE_INPUTS)
        if era.extensible_kv_cache_default and (
            extensible_kv_cache or (extensible_kv_cache is None and extensible_inputs)
        ):
            formula = "extensible"
        fields["formula"] = formula
        if fields.get("gpu_memory_utilization") is None:
            fields["gpu_memory_utilization"] = era.utilization_default(extensible=formula == "extensible")
        if (
            FORMULAS[formula].cudagraph
            and fields.get("cudagraph_memory_bytes") is None
            and not era.cudagraph_estimate_default
        ):
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
            layout = kv_layout_from_config(
                config,
                block_size=block_size_for(era, block_size, config),
                kv_cache_dtype=kv_cache_dtype,
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
            )
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None

    profile = None
    given = {k for k, v in flags.items() if v is not None} | (
        {"non_torch_increase_bytes"} if non_torch_memory is not None else set()
    )
    needs = _era_needs(era, fields, given, file_fields, file_formula, profile_file)
    profile_keys = {f.name for f in dataclasses.fields(Profile)}
    measured = {k: v for k, v in fields.items() if k in profile_keys}
    if fields and all(fields.get(k) is not None for k in needs):
        try:
            profile = Profile(**{**{k: None for k in Profile.REQUIRED}, **measured})
        except (ProfileError, TypeError) as exc:
            raise click.ClickException(str(exc)) from None
    elif (given or profile_file) and not (startup and startup.available_kv_cache_bytes and given <= set(LOG_FILLS)):
        # Never a silent drop: a profile from flags or a file that the era cannot budget is refused (a log's
        # own decided budget stands, with --total-memory / --gpu-memory-utilization for --allocator).
        absolute = _absolute(fields.get("formula"))
        missing = [_flag(k, absolute) + field(k).hint for k in needs if fields.get(k) is None]
        era_text = f" for {era.name}" if era else ""
        extensible = ""
        if era and era.extensible_kv_cache_default and fields.get("formula") != "extensible":
            extensible = " (or, with its extensible KV cache, " + ", ".join(map(_flag, EXTENSIBLE_INPUTS)) + ")"
        raise click.UsageError(f"incomplete profile{era_text}: missing {', '.join(missing)}{extensible}")

    if kv_cache_memory is not None and layout is None:
        raise click.UsageError("--kv-cache-memory-bytes needs --model-config to count blocks")
    if layout is None and profile is None and startup is None:
        raise click.UsageError(
            "nothing to compute: give --model-config, a profile (--profile, --from-log, "
            "or --total-memory ... flags), or both"
        )

    if profile is not None:
        _refuse_growth_past_the_device(profile)
    result: dict[str, Any] = {
        "vllm_version": fields.get("vllm_version"),
        "era": era.to_dict() if era else None,
        "block_bytes": layout.block_bytes if layout else None,
    }
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
            budgets["stock"] = _decided_budget(
                startup, layout, layout.block_size if layout else block_size_for(era, block_size, config), max_model_len
            )
            if budgets["reserved"]:
                result["overcommit_bytes"] = overcommit_bytes(
                    startup.available_kv_cache_bytes, budgets["reserved"]["kv_cache_bytes"]
                )
        for key in ("overcommit_bytes", "recommended_gpu_memory_utilization", "recommended_kv_cache_memory_bytes"):
            result.setdefault(key, None)
    result["recommended_flags"] = _recommended_flags(result, era)
    if allocator:
        if profile is None and startup is not None:
            # A log without the profile line: the non-KV memory read back from the decided budget, as
            # kvguard check does (kvguard.vllm.log_profile), with --total-memory / --gpu-memory-utilization and the
            # formula of the release --vllm-version names.
            profile = log_profile(
                startup, total_memory, gpu_memory_utilization, formula=era.formula if era is not None else None
            )[0]
        result["at_budget"] = _budget_time_verdict(
            result, profile, layout, allocator, era, enable_vmm, expandable_segments, non_allocator_memory
        )

    if as_json:
        emit_json(result)
    else:
        _print_budget(result, layout)


def _era_needs(
    era,
    fields: dict[str, Any],
    given: set[str],
    file_fields: dict[str, Any],
    file_formula: str,
    profile_file: str | None,
) -> list[str]:
    """The profile fields the era's formula needs here; refuses (one line) an input it would drop: a flag
    the formula does not read, or a profile file's figure the chosen era reads otherwise or not at all."""
    formula = fields.get("formula") or "peak"
    reads = formula_inputs(formula)
    who = era.name if era else "the default formula (0.9.1-0.13; no --vllm-version)"
    absolute = _absolute(formula)
    takes = ", ".join(_flag(k, absolute) for k in reads if field(k).flag)
    unread = [_flag(row.name, absolute) for row in FLAGGED if row.name in given and row.name not in reads]
    if unread:
        raise click.UsageError(f"{who} (formula {formula}) does not read {', '.join(unread)}; it takes {takes}")
    if profile_file and formula != file_formula:
        absolute = {name: _absolute(name) for name in (formula, file_formula)}
        if (
            absolute[formula] != absolute[file_formula]
            and file_fields.get("non_torch_increase_bytes") is not None
            and "non_torch_increase_bytes" not in given
        ):
            what = "the absolute non-torch memory" if absolute[formula] else "the non-torch increase"
            raise click.UsageError(
                f"{who} adds {what}, which the profile file (formula {file_formula}) does not hold: "
                f"give it as {'--non-torch-memory' if absolute[formula] else '--non-torch-increase'}"
            )
        dropped = [
            k
            for k in file_fields
            if k not in Profile.REQUIRED
            and k not in ("formula", "vllm_version")
            and file_fields[k] is not None
            and k not in reads
        ]
        if dropped:
            raise click.UsageError(
                f"{who} (formula {formula}) does not read the profile file's {', '.join(dropped)} "
                f"(formula {file_formula}); it takes {takes}"
            )
    needs = list(required_fields(formula, fields.get("kv_cache_memory_bytes")))
    if fields.get("kv_cache_memory_bytes") is None:
        # Inputs the estimator would otherwise take as 0: vLLM 0.20+ subtracts its CUDA-graph estimate by default
        # (the 0.18-0.19 default, off, is filled in above), vllm-ascend 0.15+ the non-torch memory at startup.
        needs += [
            k
            for k in ("cudagraph_memory_bytes", "non_torch_cleared_bytes")
            if k in reads and (k != "non_torch_cleared_bytes" or FORMULAS[formula].cleared)
        ]
    return needs


def _non_torch_flag(era, non_torch_increase, non_torch_memory, fields: dict[str, Any]) -> None:
    """The non-torch input under the name of what the era's formula takes: the increase since the init
    snapshot, or (formula non_torch "positive") the absolute memory; both fill non_torch_increase_bytes."""
    absolute = era is not None and _absolute(era.formula)
    if non_torch_increase is not None and non_torch_memory is not None:
        raise click.UsageError("give --non-torch-increase or --non-torch-memory, not both")
    if non_torch_increase is not None and absolute:
        raise click.UsageError(
            f"{era.name} adds the absolute non-torch memory after empty_cache (total - free - "
            f"torch allocated), not an increase: give it as --non-torch-memory"
        )
    if non_torch_memory is not None:
        if era is None:
            raise click.UsageError(
                "--non-torch-memory needs --vllm-version: only some eras add the absolute non-torch memory"
            )
        if not absolute:
            raise click.UsageError(
                f"{era.name} takes the non-torch increase since the init snapshot: give it as --non-torch-increase"
            )
        fields["non_torch_increase_bytes"] = non_torch_memory


def _refuse_unused_allocator_options(allocator, enable_vmm, expandable_segments, non_allocator_memory) -> None:
    """The budget-time verdict's options mean nothing without it, or on an allocator without the feature."""
    given = [
        flag
        for flag, value in (
            ("--[no-]enable-vmm", enable_vmm),
            ("--[no-]expandable-segments", expandable_segments),
            ("--non-allocator-memory", non_allocator_memory),
        )
        if value is not None
    ]
    if given and allocator is None:
        raise click.UsageError(f"{', '.join(given)} set the budget-time verdict's allocator: give --allocator too")
    if enable_vmm is not None and allocator != "mindspore":
        raise click.UsageError(f"--[no-]enable-vmm is MindSpore's VMM: --allocator mindspore, not {allocator}")
    if expandable_segments is not None and allocator == "mindspore":
        raise click.UsageError("--[no-]expandable-segments is PyTorch's / torch_npu's: --allocator torch or torch_npu")


def _refuse_growth_past_the_device(profile: Profile) -> None:
    """A profile whose weights or profile-run increases exceed the device itself was mis-typed (a unit, a
    digit); say which figure, rather than print a budget of minus hundreds of GiB."""
    for name in ("weights_bytes", "peak_allocated_increase_bytes", "peak_reserved_increase_bytes"):
        value, flag = getattr(profile, name), _flag(name)
        if value is not None and value > profile.total_memory_bytes:
            raise click.ClickException(
                f"{flag} {format_gib(value)} is more than the device's total memory "
                f"({format_gib(profile.total_memory_bytes)}): check its unit"
            )


def _budget_time_verdict(
    result: dict[str, Any],
    profile,
    layout,
    allocator: str,
    era,
    enable_vmm,
    expandable_segments: bool | None,
    non_allocator_memory,
) -> dict[str, Any]:
    """``--allocator``: the guard's budget-time verdict on vLLM's budget (the log's decided figure, or the
    stock formula), and the largest budget it predicts fits (kvguard.guard.at_budget.predict_at_budget)."""
    if layout is None:
        raise click.UsageError("--allocator needs --model-config: the KV tensors are counted per layer")
    if profile is None:
        raise click.UsageError(
            "--allocator needs a complete profile (--profile, --from-log or flags): the "
            "allocator's state at the budget follows from it"
        )
    stock = (result.get("budgets") or {}).get("stock") or {}
    kv_cache = stock.get("kv_cache_bytes")
    if kv_cache is None:
        kv_cache = stock_kv_cache_bytes(profile)
    if enable_vmm is None and allocator == "mindspore":
        # MS_ALLOC_CONF unset: the release's launcher default, else MindSpore's (kvguard.allocators.mindspore_releases).
        from kvguard.allocators.mindspore_releases import vmm_on

        enable_vmm = vmm_on(None, launcher_vmm=era.vmm_default if era else None)
    enable_vmm = bool(enable_vmm)
    if expandable_segments is None:
        from kvguard.vllm.eras import expandable_segments_default

        expandable_segments = expandable_segments_default(result.get("vllm_version"), allocator)
    from kvguard.guard.at_budget import predict_at_budget

    try:
        return predict_at_budget(
            profile,
            layout,
            kv_cache,
            allocator,
            enable_vmm=enable_vmm,
            expandable_segments=expandable_segments,
            non_allocator_bytes=non_allocator_memory,
        )
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
    return {
        "kv_cache_bytes": startup.available_kv_cache_bytes,
        "num_blocks": num_blocks,
        "num_tokens": num_tokens,
        "max_concurrency": concurrency,
    }


def _print_budget(result: dict[str, Any], layout: KVLayout | None) -> None:
    out = click.echo
    if layout:
        kind = "MLA latent" if layout.is_mla else f"{layout.num_kv_heads} KV heads x {layout.head_size} head size"
        out(
            f"KV layout    {layout.num_layers} layers x {kind}, {layout.dtype_bytes} B/elem "
            f"({layout.kv_cache_dtype}), {layout.block_size} tokens/block"
        )
        out(f"Block        {result['block_bytes']:,} bytes ({format_bytes(result['block_bytes'])}) per block")
    if "num_blocks" in result:
        out(
            f"KV memory    {format_bytes(result['kv_cache_memory_bytes'])} holds {result['num_blocks']:,} blocks "
            f"= {result['num_tokens']:,} tokens"
        )
    profile = result.get("profile")
    if profile:
        total, util = profile["total_memory_bytes"], profile["gpu_memory_utilization"]
        out("")
        era = result.get("era")
        if era:
            out(
                f"Era          {era['name']} (formula {profile.get('formula', 'peak')}"
                + (
                    f", checked against the {era['project']} {era['checked_against']} wheel"
                    if era.get("checked_against")
                    else ""
                )
                + ")"
            )
        out(f"Profile      total {format_bytes(total)} x utilization {util:g} = {format_bytes(total * util)}")
        # The field table's words; total and utilization are on the line above.
        absolute = _absolute(profile.get("formula"))
        parts = [
            f"{row.word_for(absolute)} {format_bytes(profile[row.name])}"
            for row in PROFILE_FIELDS
            if row.name not in LOG_FILLS and profile.get(row.name) is not None
        ]
        if profile.get("peak_reserved_increase_bytes") is None and profile.get("formula", "peak").startswith("peak"):
            parts.append("reserved increase unknown")
        for start in range(0, len(parts), 3):
            out("             " + ", ".join(parts[start : start + 3]))
    if result.get("log"):
        log = result["log"]
        out(f"Log          {log['lines_matched']} startup lines matched (era {log['era'] or 'unknown'})")
    at_budget = result.get("at_budget")
    if at_budget:
        verdict = at_budget["verdict"]
        out("")
        out(
            f"At budget    {verdict['state'].upper()} for vLLM's {format_bytes(at_budget['kv_cache_bytes'])} "
            f"on {at_budget['allocator']}{' (VMM)' if at_budget['enable_vmm'] else ''}: "
            f"{verdict['kv_tensors']} KV tensors, headroom {format_bytes(verdict['headroom_bytes'])}"
        )
        for reason in verdict["reasons"]:
            out(f"             - {reason['code']}: {reason['message']}")
        fits = at_budget["largest_fitting_kv_cache_bytes"]
        out(f"             largest budget the guard predicts fits: {'none' if not fits else format_bytes(fits)}")
    budgets = result.get("budgets")
    if budgets:
        max_model_len = result.get("max_model_len") or (result.get("log") or {}).get("max_model_len")
        out("")
        out(
            f"{'Budget':<12} {'KV cache':>12} {'blocks':>10} {'tokens':>12} "
            f"{'concurrency' + (f' @{max_model_len}' if max_model_len else ''):>20}"
        )
        for name in ("stock", "reserved"):
            b = budgets.get(name)
            if b is None:
                out(f"{name:<12} {'unknown (needs the reserved increase)' if name == 'reserved' else 'unknown'}")
                continue
            concurrency = "-" if b["max_concurrency"] is None else f"{b['max_concurrency']:.2f}x"
            out(
                f"{name:<12} {format_bytes(b['kv_cache_bytes']):>12} {format_count(b['num_blocks']):>10} "
                f"{format_count(b['num_tokens']):>12} {concurrency:>20}"
            )
        if result.get("overcommit_bytes") is not None:
            over = result["overcommit_bytes"]
            out("")
            if over > 0:
                out(
                    f"Overcommit   {format_bytes(over)}: the stock budget grants KV cache the allocator's "
                    f"reserved peak leaves no room for"
                )
            elif result.get("reserved_counts", "").startswith("nothing"):
                out(f"Overcommit   none: the reserved-aware budget adds {result['reserved_counts']}")
            else:
                out("Overcommit   none: the stock budget fits under the reserved peak")
        if (
            result.get("recommended_gpu_memory_utilization") is not None
            or result.get("recommended_kv_cache_memory_bytes") is not None
        ):
            flags = result.get("recommended_flags") or []
            if result.get("recommended_gpu_memory_utilization") is None:
                flags = ["--gpu-memory-utilization (none is safe)"] + flags
            out(f"Recommended  {'  or  '.join(flags)}")
