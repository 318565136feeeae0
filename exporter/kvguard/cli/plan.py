"""``kvguard plan``: what a vLLM release will decide at startup, from the serve command and config.json alone."""

from __future__ import annotations

import json
from typing import Any

import click

from kvguard.budget.estimator import ConfigError, Profile, ProfileError
from kvguard.budget.model_config import load_model_config
from kvguard.cli import exits
from kvguard.cli.exits import FlagsError
from kvguard.cli.options import SIZE, block_size_for, emit_json, format_count
from kvguard.plan.command import CommandError, parse_serve_command
from kvguard.plan.devices import DEVICES, DeviceError, resolve_device
from kvguard.plan.planner import PlanError, default_release, make_plan
from kvguard.text import one_line
from kvguard.units import format_bytes
from kvguard.vllm.eras import EraError, era_for

EXIT_REFUSED = exits.CRITICAL  # vLLM would refuse to start: the outcome plan flags (kvguard.cli.exits)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option(
    "--model-config",
    "model_config",
    metavar="PATH",
    help="The model's config.json, or its directory (default: MODEL when it is a local directory "
    "holding one). Nothing is downloaded.",
)
@click.option(
    "--device",
    "device_text",
    metavar="NAME|SIZE",
    help="A named device (" + ", ".join(d.name for d in DEVICES) + ") or a size such as 64GiB.",
)
@click.option(
    "--vllm-version",
    "release",
    metavar="RELEASE",
    help="X.Y.Z (vLLM), vllm-ascend:X.Y.Z or vllm-mindspore:X.Y.Z. Default: vllm-mindspore's newest row "
    "for its entry point, vllm-ascend's on an Ascend device, else vLLM's newest row.",
)
@click.option(
    "--non-allocator-memory",
    type=SIZE,
    help="Device memory outside the allocator at startup (default: the simulator's 512 MiB on CUDA, 1 GiB on Ascend).",
)
@click.option(
    "--profile",
    "profile_file",
    metavar="FILE",
    help="A measured startup profile (kvguard budget's profile JSON) in place of the prediction.",
)
@click.option(
    "--search",
    is_flag=True,
    help="Also search the highest --gpu-memory-utilization (0.01 steps) that serves every --seed without an "
    "OOM, as kvguard simulate --search-utilization does (a few seconds).",
)
@click.option(
    "--seed",
    "seeds",
    type=int,
    multiple=True,
    help="Request-mix seed of the serving simulation (default 0); repeat it for --search.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object (kvguard budget --json's keys, then plan)."
)
@click.argument("serve_command", nargs=-1, type=click.UNPROCESSED, metavar="-- SERVE COMMAND")
def plan(
    model_config, device_text, release, non_allocator_memory, profile_file, search, seeds, as_json, serve_command
) -> None:
    """Plan a vLLM deployment before launch: weights, activation peak and the KV cache vLLM will decide.

    \b
    kvguard plan --device 910B -- vllm serve /models/Qwen2.5-7B-Instruct --max-model-len 32768
    kvguard plan --device H100 --model-config config.json -- python -m vllm.entrypoints.openai.api_server
        --model deepseek-ai/DeepSeek-V3 --tensor-parallel-size 16

    Per rank: the weights from config.json, the profile run's activation peak at
    --max-num-batched-tokens from the workload model through the platform's allocator model,
    the memory outside the allocator, then what the release's formula decides: KV bytes,
    blocks, tokens, maximum concurrency, and whether vLLM refuses to start (its own message).
    Then whether it fits: the guard's budget-time verdict at that budget under the release's
    allocator (kvguard budget --allocator's), a serving simulation of the predicted run
    (kvguard simulate's), and with --search the highest safe utilization and its margin.
    """
    try:  # the command line: plan's own flags and the serve command after --
        command = parse_serve_command(serve_command)
        device = resolve_device(device_text) if device_text else None
        if release:
            era_for(release)
    except (CommandError, DeviceError, EraError) as exc:
        raise FlagsError(one_line(exc)) from None
    try:
        path = model_config or _model_dir(command.model)
        config = load_model_config(path)
        measured = _read_profile(profile_file) if profile_file else None
        chosen = release or default_release(command, device)
        if device is not None and device.source == "given as a size":
            device = resolve_device(device_text, "cuda" if era_for(chosen).allocator == "torch" else "ascend")
        result = make_plan(
            command,
            config,
            release=chosen,
            device=device,
            block_size_for=block_size_for,
            non_allocator_bytes=non_allocator_memory,
            measured_profile=measured,
            search=search,
            seeds=tuple(seeds) or (0,),
        )
    except (ConfigError, DeviceError, PlanError, ValueError) as exc:
        raise click.ClickException(one_line(exc)) from None
    except ArithmeticError as exc:  # a config field the readers did not refuse: one line, never a traceback
        raise click.ClickException(f"model config: {one_line(exc)}") from None
    result["plan"]["release_source"] = "--vllm-version" if release else "default"
    if as_json:
        emit_json(result)
    else:
        _print_plan(result)
    if not result["plan"]["will_start"]:
        click.get_current_context().exit(EXIT_REFUSED)


def _model_dir(model: str | None) -> str:
    import os

    if model and os.path.isfile(os.path.join(model, "config.json")):
        return model
    raise ConfigError(
        f"no config.json for {('model ' + repr(model[:80])) if model else 'the command (no MODEL)'}: "
        f"give --model-config PATH (plan downloads nothing)"
    )


def _read_profile(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read(1 << 20).decode("utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read profile file {path}: {exc.strerror or one_line(exc)}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"profile file {path} is not valid JSON: {one_line(exc, first_line=True)}") from None
    try:
        return Profile.from_dict(data).to_dict()
    except (ProfileError, TypeError) as exc:
        raise ValueError(f"profile file {path}: {one_line(exc)}") from None


def _print_plan(result: dict[str, Any]) -> None:
    out = click.echo
    plan = result["plan"]
    command = plan["command"]
    ignored = command["ignored"]
    out(
        f"Command      {command['entry_point']} {command['model'] or ''}".rstrip()
        + (f"; ignored: {' '.join(ignored)}" if ignored else "")
    )
    era = result["era"]
    device = plan.get("device")
    out(
        f"Release      {era['name']} (formula {era['formula']}; {result['vllm_version']}, {plan['release_source']})"
        + (f" on {device['name']} ({format_bytes(device['memory_bytes'])})" if device else "")
    )
    s = {name: row["value"] for name, row in plan["settings"].items()}
    out(
        f"Settings     TP {s['tensor_parallel_size']}, max_model_len {s['max_model_len']}, max_num_seqs "
        f"{s['max_num_seqs']}, max_num_batched_tokens {s['max_num_batched_tokens']}, utilization "
        f"{s['gpu_memory_utilization']:g}, block {s['block_size']}"
        + (f", --kv-cache-memory-bytes {s['kv_cache_memory_bytes']}" if s["kv_cache_memory_bytes"] else "")
    )
    weights = plan.get("weights")
    if weights:
        out(
            f"Weights      {format_bytes(weights['bytes'])} per rank ({weights['weight_dtype']} weights, "
            f"{weights['dtype']} activations, {weights['tensors']} tensors, TP {weights['tensor_parallel_size']})"
        )
    profile = result.get("profile")
    if profile and plan.get("activation_peak"):
        peak = plan["activation_peak"]
        out(
            f"Activation   allocated peak +{format_bytes(peak['allocated_increase_bytes'])}, reserved "
            f"+{format_bytes(peak['reserved_increase_bytes'])} at {peak['max_num_batched_tokens']} tokens "
            f"({peak['allocator']} allocator model; a model, not measured)"
        )
    elif profile:
        out(
            f"Profile      measured: weights {format_bytes(profile['weights_bytes'])}, total "
            f"{format_bytes(profile['total_memory_bytes'])}"
        )
    if plan.get("non_torch"):
        nt = plan["non_torch"]
        out(
            f"Non-torch    {format_bytes(nt['at_startup_bytes'])} outside the allocator at startup (platform "
            f"default, not measured)"
            + (
                f"; +{format_bytes(nt['increase_bytes'])} after the baseline (collective buffers)"
                if nt.get("increase_bytes")
                else ""
            )
        )
    decided = plan.get("decided")
    if decided:
        concurrency = "-" if decided["max_concurrency"] is None else f"{decided['max_concurrency']:.2f}x"
        out(
            f"KV cache     {format_bytes(decided['kv_cache_bytes'])} = {format_count(decided['num_blocks'])} blocks "
            f"= {format_count(decided['num_tokens'])} tokens; "
            f"max concurrency {concurrency} at {result['max_model_len']}"
        )
        reserved = (result.get("budgets") or {}).get("reserved")
        if reserved and reserved["kv_cache_bytes"] != decided["kv_cache_bytes"]:
            out(
                f"Reserved     {format_bytes(reserved['kv_cache_bytes'])} = {format_count(reserved['num_blocks'])} "
                f"blocks with the allocator's reserved peak"
                + (
                    f"; recommended {'  or  '.join(result['recommended_flags'])}"
                    if result.get("recommended_flags")
                    else ""
                )
            )
    at_budget = plan.get("at_budget")
    if at_budget and at_budget.get("error"):
        out(f"At budget    CRITICAL on {at_budget['allocator']}: {at_budget['error']}")
    elif at_budget:
        verdict = at_budget["verdict"]
        fits = at_budget["largest_fitting_kv_cache_bytes"]
        out(
            f"At budget    {verdict['state'].upper()} on {at_budget['allocator']}"
            f"{' (VMM)' if at_budget['enable_vmm'] else ''}"
            f"{' (expandable segments)' if at_budget['expandable_segments'] else ''}"
            f": headroom {format_bytes(verdict['headroom_bytes'])}"
            + "".join(f"; {reason['code']}" for reason in verdict["reasons"])
            + (
                ""
                if verdict["state"] != "critical"
                else f"; largest budget that fits {'none' if not fits else format_bytes(fits)}"
            )
        )
    serving = plan.get("serving")
    if serving:
        where = (
            f"OOM during {serving['where']} ({format_bytes(serving['oom_request_bytes'])} requested)"
            if serving["oom"]
            else (serving["error"] or f"no OOM, margin {format_bytes(serving['margin_bytes'])}")
        )
        out(
            f"Serving      {serving['requests_finished']}/{serving['requests']} requests in {serving['steps']} steps "
            f"(seed {serving['seed']}, a model): {where}"
        )
    found = plan.get("search")
    if found:
        if found["gpu_memory_utilization"] is None:
            out("Safe         no utilization serves without an OOM")
        else:
            kv = found["kv_cache_memory_bytes"]
            out(
                f"Safe         --gpu-memory-utilization {found['gpu_memory_utilization']:.2f} at most "
                f"(margin {format_bytes(found['margin_bytes'])}; limited by {found['limited_by']})"
                + (f", or {found['kv_cache_memory_flag']} {kv}" if kv is not None else "")
            )
    if plan["refusals"]:
        for refusal in plan["refusals"]:
            out(f"Refused      {refusal['message']} [{refusal['cite']}]")
    elif plan["will_fit"]:
        out("Outcome      vLLM starts and fits")
    else:
        why = []
        if (at_budget or {}).get("verdict", {}).get("state") == "critical":
            why.append("the budget-time verdict is CRITICAL")
        if serving and serving["oom"]:
            why.append(f"the simulated run runs out of memory during {serving['where']}")
        out(f"Outcome      vLLM's checks pass, but it will not fit: {'; '.join(why)}")
    for note in plan["uncertainty"]:
        out(f"Uncertain    {note}")
