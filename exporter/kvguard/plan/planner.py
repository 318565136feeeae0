"""The plan for one rank: the profile a release will measure, and what its formula decides from it.

Per rank, from the serve command and ``config.json``:

- weights: ``kvguard.sim.workload.weight_tensors`` (tensor by tensor, tensor-parallel sharded, each linear as
  the checkpoint stores it: ``kvguard.sim.quantization``), loaded through the platform's allocator model;
- the profile run's activation peak at ``max_num_batched_tokens``: ``forward_ops`` through the same
  allocator model, read as vLLM's ``memory_profiling`` reads it (``kvguard.sim.scenario.ServingScenario.
  startup``, the path ``kvguard simulate`` takes);
- non-torch memory: the platform's memory outside the allocator (``--non-allocator-memory``, the
  simulator's default);
- the budget: the release's era formula (``kvguard.budget.estimator``), the one ``kvguard budget`` runs.

With a measured profile (``--profile``) the prediction is replaced by it: the decided budget is then
``kvguard budget --profile``'s to the byte.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvguard.budget.estimator import (
    ConfigError,
    KVLayout,
    Profile,
    ProfileError,
    estimate,
    kv_layout_from_config,
    requested_memory_bytes,
    text_config,
)
from kvguard.plan.block_size import block_size_refusal
from kvguard.plan.command import ServeCommand
from kvguard.plan.devices import DeviceSpec
from kvguard.plan.max_len import derived_max_model_len, max_len_refusal
from kvguard.plan.outside import collective_buffers
from kvguard.plan.serve_defaults import serve_defaults
from kvguard.sim.mindformers import MindFormersPath, mindformers_path
from kvguard.sim.quantization import with_quantization_flag
from kvguard.sim.workload import model_shape, weight_tensors
from kvguard.vllm.eras import (
    ERAS,
    Era,
    EraError,
    era_for,
    expandable_segments_default,
    parse_release,
    version_text,
)

GIB = 1 << 30

# The era formulas plan predicts a profile for; the others read figures the simulator does not produce
# (V0's and vllm-ascend <= 0.14's absolute non-torch memory, vllm-ascend 0.7.3's free-memory drop, 0.34's
# extensible KV cache measured after warm-up).
PREDICTED_FORMULAS = (
    "peak",
    "peak_ceil",
    "peak_ceil_cudagraph",
    "consumed",
    "mindspore_reserved",
    "ascend_cleared",
    "ascend_cleared_halved",
)

# vLLM's own refusals, word for word (the wheel's lines).
CITE_FREE = "vllm/v1/worker/gpu_worker.py 0.11.0:185-195 (init_device)"
CITE_NO_MEMORY = "vllm/v1/core/kv_cache_utils.py 0.11.0:698-701 (check_enough_kv_cache_memory)"
CITE_TOO_SMALL = "vllm/v1/core/kv_cache_utils.py 0.11.0:703-722 (check_enough_kv_cache_memory)"
CITE_HEADS = "vllm/config/model.py 0.11.0:1045-1052 (verify_with_parallel_config)"


class PlanError(ValueError):
    """An input plan cannot plan for; the message is one line."""


def newest_release(project: str) -> str:
    """The newest release of ``project``'s newest era row: the wheel it was checked against, else its range's
    last (or first) release."""
    rows = [e for e in ERAS if e.project == project]
    if not rows:
        raise PlanError(f"no era rows for {project}")
    era = rows[-1]
    version = era.checked_against or version_text(era.last or era.first)
    return f"{project}:{version}"


def default_release(command: ServeCommand, device: DeviceSpec | None) -> str:
    """vllm-mindspore's entry point: its newest row; an Ascend device: vllm-ascend's; else vLLM's newest row."""
    if command.project:
        return newest_release(command.project)
    if device is not None and device.platform == "ascend":
        return newest_release("vllm-ascend")
    return newest_release("vllm")


def _platform(era: Era) -> str:
    return "cuda" if era.allocator == "torch" else "ascend"


def _baseline_before_distributed(era: Era, version: tuple[int, ...]) -> bool:
    """Whether the release's worker takes its baseline snapshot before the distributed init: vLLM V0's
    worker (vllm/worker/worker.py 0.7.3:161,166), which vllm-mindspore before 0.5 runs (0.2.0 pairs with vLLM
    0.7.3 and refuses V1). V1 workers snapshot after it (vllm/v1/worker/gpu_worker.py 0.11.0 init_device)."""
    return era.project == "vllm-mindspore" and version < (0, 5, 0)


def _vllm_version(era: Era, version: tuple[int, ...]) -> tuple[int, ...]:
    """The vLLM release whose config checks the release runs: vllm-mindspore 0.2.0 pairs with vLLM 0.7.3 and
    0.5.x with 0.11.0; vllm-ascend X.Y.Z with vLLM X.Y.Z."""
    if era.project == "vllm-mindspore":
        return (0, 7, 3) if version < (0, 5, 0) else (0, 11, 0)
    return version


def _mindformers(era: Era, version: tuple[int, ...], config) -> MindFormersPath | None:
    """The MindFormers network and published recipe vllm-mindspore serves the model through, if it does
    (kvguard.sim.mindformers: the simulated startup takes the same one)."""
    return mindformers_path(_launcher(version) if era.allocator == "mindspore" else None, config)


def _launcher(version: tuple[int, ...]) -> str:
    """The vllm-mindspore launcher whose defaults the simulator takes (kvguard.allocators.mindspore_releases)."""
    from kvguard.allocators.mindspore_releases import DEFAULT_LAUNCHER, SEED_LAUNCHER

    return SEED_LAUNCHER if version < (0, 5, 0) else DEFAULT_LAUNCHER


@dataclass(frozen=True)
class Settings:
    """The vLLM settings the plan runs with, each with where it came from."""

    tensor_parallel_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    block_size: int
    kv_cache_dtype: str
    kv_cache_memory_bytes: int | None
    dtype: str
    sources: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        sources = data.pop("sources")
        return {name: {"value": value, "source": sources[name]} for name, value in data.items()}


def _settings(
    command: ServeCommand,
    config: Mapping[str, Any],
    era: Era,
    release: str,
    version: tuple[int, ...],
    device_bytes: int | None,
    device_name: str,
    block_size_for: Callable[[Era, int | None, Any], int],
) -> Settings:
    sources: dict[str, str] = {}
    flags = command.flags

    def take(name: str, default: Any, source: str) -> Any:
        if name in flags:
            sources[name.replace("-", "_")] = "command"
            return flags[name]
        sources[name.replace("-", "_")] = source
        return default

    if flags.get("pipeline-parallel-size", 1) != 1:
        raise PlanError("--pipeline-parallel-size above 1 is not planned yet (one stage's weights and layers)")
    tp = take("tensor-parallel-size", 1, "vLLM's default")
    dtype = take("dtype", "auto", "vLLM's default")
    if dtype in ("float", "float32"):
        raise PlanError("--dtype float32 is not planned: the workload model runs 16-bit activations")
    try:
        length_key, derived = derived_max_model_len(text_config(config))
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    if "max-model-len" not in flags and derived is None:
        raise PlanError("give --max-model-len: the model config has none of vLLM's length keys")
    max_model_len = take(
        "max-model-len",
        None if derived is None else int(derived),
        f"vLLM's derived max_model_len (config.json {length_key}, RoPE scaling applied)",
    )
    # The release's own serve defaults (kvguard.plan.serve_defaults: the table, cited per row), the defaulted one
    # clamped against a given --max-num-batched-tokens / --max-num-seqs as the release does.
    chosen = serve_defaults(
        release,
        vllm_version=_vllm_version(era, version),
        memory_bytes=device_bytes,
        device_name=device_name,
        max_model_len=max_model_len,
        platform=_platform(era),
        env=command.env,
        flags_typed=command.ignored,
        performance_mode=flags.get("performance-mode"),
        max_num_batched_tokens=flags.get("max-num-batched-tokens"),
        max_num_seqs=flags.get("max-num-seqs"),
    )
    max_num_batched_tokens = take("max-num-batched-tokens", chosen.max_num_batched_tokens, chosen.note)
    max_num_seqs = take("max-num-seqs", chosen.max_num_seqs, chosen.note)
    utilization = take(
        "gpu-memory-utilization", era.utilization_default(extensible=False), f"the default of {era.name}"
    )
    given_block = flags.get("block-size")
    block_size = block_size_for(era, given_block, dict(config))
    sources["block_size"] = (
        "command"
        if given_block == block_size
        else (
            f"{era.name}'s MLA block size"
            if given_block is not None or block_size != era.default_block_size
            else f"the default of {era.name}"
        )
    )
    kv_cache_dtype = take("kv-cache-dtype", "auto", "vLLM's default")
    kv_memory = take("kv-cache-memory-bytes", None, "not given")
    if kv_memory is not None and era.kv_cache_memory_flag is None:
        raise PlanError(f"{era.name} has no --kv-cache-memory-bytes")
    return Settings(
        tp,
        max_model_len,
        max_num_seqs,
        max_num_batched_tokens,
        utilization,
        block_size,
        kv_cache_dtype,
        kv_memory,
        dtype,
        sources,
    )


def _dtype_config(config: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """The config with vLLM's --dtype in place of its torch_dtype (auto: the config's own)."""
    out = dict(config)
    if dtype != "auto":
        out["torch_dtype"] = {"half": "float16"}.get(dtype, dtype)
        for nested in ("text_config", "llm_config", "language_config"):
            if isinstance(out.get(nested), Mapping):
                out[nested] = {**out[nested], "torch_dtype": out["torch_dtype"]}
    return out


def _dtype_name(config: Mapping[str, Any]) -> str:
    text = text_config(config)
    name = text.get("torch_dtype") or text.get("dtype") or "bfloat16"
    name = str(name).removeprefix("torch.")
    return "bfloat16 (vLLM serves float32 checkpoints in 16-bit)" if name in ("float32", "float") else name


def make_plan(
    command: ServeCommand,
    config: Mapping[str, Any],
    *,
    release: str,
    device: DeviceSpec | None,
    block_size_for: Callable[[Era, int | None, Any], int],
    non_allocator_bytes: int | None = None,
    measured_profile: Mapping[str, Any] | None = None,
    serve: bool = True,
    search: bool = False,
    seeds: tuple[int, ...] = (0,),
) -> dict[str, Any]:
    """The plan as one JSON-able dict: ``kvguard budget --json``'s keys, then ``plan``.

    ``block_size_for(era, given, config)``: the block size the release runs (``kvguard.cli.options.
    block_size_for``, the rule ``kvguard budget`` applies: the era's default, vLLM's MLA block size on CUDA).

    Whether it fits (``plan["at_budget"]``, ``plan["serving"]``, ``plan["search"]``, ``plan["will_fit"]``):
    the guard's budget-time verdict at the decided budget (``predict_at_budget``, ``kvguard budget
    --allocator``'s call); with ``serve``, the serving run of the scenario the prediction started
    (``kvguard simulate``'s run, ``seeds[0]``); with ``search``, ``search_gpu_memory_utilization`` over
    ``seeds`` (``kvguard simulate --search-utilization``).
    """
    try:
        era = era_for(release)
        version = parse_release(release)[1]
    except EraError as exc:
        raise PlanError(str(exc)) from None
    if device is not None and device.platform != _platform(era) and device.source != "given as a size":
        raise PlanError(
            f"{era.name} runs on {_platform(era).upper() if _platform(era) == 'cuda' else 'Ascend'} "
            f"devices, not on {device.name}"
        )
    if measured_profile is None and era.formula not in PREDICTED_FORMULAS:
        raise PlanError(
            f"plan does not predict {era.name}'s profile (formula {era.formula}) yet: give a "
            f"newer --vllm-version, or a measured --profile"
        )
    if measured_profile is None and device is None:
        raise PlanError("give --device (a named device or a size), or a measured --profile")
    device_bytes = device.memory_bytes if device is not None else measured_profile.get("total_memory_bytes")
    settings = _settings(
        command, config, era, release, version, device_bytes, device.name if device else "", block_size_for
    )
    config = _dtype_config(config, settings.dtype)
    uncertainty: list[str] = []
    refusals: list[dict[str, str]] = []
    plan: dict[str, Any] = {
        "command": command.to_dict(),
        "device": device.to_dict() if device else None,
        "settings": settings.to_dict(),
        "refusals": refusals,
        "uncertainty": uncertainty,
        "at_budget": None,
        "serving": None,
        "search": None,
        "will_fit": False,
    }
    result: dict[str, Any] = {
        "vllm_version": release,
        "era": era.to_dict(),
        "block_bytes": None,
        "max_model_len": settings.max_model_len,
        "plan": plan,
    }
    # Refused before any memory is touched: the argument parser's --block-size choices, then ModelConfig's
    # max_model_len check.
    vllm_version = _vllm_version(era, version)
    given_block = command.flags.get("block-size")
    bad_block = (
        None
        if given_block is None
        else block_size_refusal(
            given_block, vllm_version, "vllm serve" if command.entry_point.endswith("serve") else "api_server.py"
        )
    )
    too_long = max_len_refusal(text_config(config), settings.max_model_len, command.env, vllm_version)
    if bad_block is not None or too_long is not None:
        refusals.extend(r for r in (bad_block, too_long) if r is not None)
        plan["will_start"] = False
        return result
    try:
        layout = kv_layout_from_config(
            config,
            block_size=settings.block_size,
            kv_cache_dtype=settings.kv_cache_dtype,
            tensor_parallel_size=settings.tensor_parallel_size,
        )
    except ConfigError as exc:
        if str(exc).startswith("Total number of attention heads"):
            refusals.append({"code": "heads_not_divisible", "message": str(exc), "cite": CITE_HEADS})
            plan["will_start"] = False
            return result
        raise PlanError(str(exc)) from None
    result["block_bytes"] = layout.block_bytes
    result["layout"] = {**asdict(layout), "page_bytes_per_layer": layout.page_bytes_per_layer}

    # The checkpoint as vLLM loads it (--quantization's in-flight method, a GGUF file's type), and the
    # MindFormers network it runs on, once: the weights line and the simulated startup count the same weights.
    mindformers = _mindformers(era, version, config)
    try:
        loaded = with_quantization_flag(config, command.flags.get("quantization"), command.model)
        shape = model_shape(loaded, settings.tensor_parallel_size, layout, mindformers=mindformers)
        tensors = weight_tensors(shape)
    except (ConfigError, ArithmeticError) as exc:
        raise PlanError(f"model config: {exc}") from None
    dtype = _dtype_name(config)
    plan["weights"] = {
        "bytes": sum(tensors),
        "tensors": len(tensors),
        "dtype": dtype,
        "weight_dtype": shape.weight_format.name or dtype,
        "quantization_cite": shape.weight_format.cite,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "experts": shape.num_experts,
        "source": "config.json (kvguard.sim.workload.weight_tensors)",
    }

    scenario = None
    if measured_profile is not None:
        fields = dict(measured_profile)
        plan["profile_source"] = "measured (--profile)"
        non_allocator = None
    else:
        scenario, fields = _predicted_profile(
            loaded, settings, era, version, release, device_bytes, non_allocator_bytes, plan, mindformers, seeds[0]
        )
        if fields is None:
            plan["will_start"] = False
            return result
        non_allocator = scenario.config.resolved_non_allocator_bytes
        plan["profile_source"] = "predicted (kvguard.sim workload model through the allocator model)"
        _predicted_uncertainty(
            era,
            settings,
            command,
            uncertainty,
            plan["non_torch"].get("collective_buffers"),
            mindformers,
        )
    fields["formula"] = era.formula
    fields["vllm_version"] = release
    if "gpu-memory-utilization" in command.flags or fields.get("gpu_memory_utilization") is None:
        fields["gpu_memory_utilization"] = settings.gpu_memory_utilization
    if settings.kv_cache_memory_bytes is not None:
        fields["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
    try:
        profile = Profile(**{**{k: None for k in Profile.REQUIRED}, **fields})
    except (ProfileError, TypeError) as exc:
        raise PlanError(f"profile: {exc}") from None

    est = estimate(profile, layout, settings.max_model_len)
    result["profile"] = profile.to_dict()
    result.update(est.to_dict())
    result["recommended_flags"] = _recommended_flags(result, era)
    decided = est.stock
    plan["decided"] = {"formula": era.formula, **decided.to_dict()}

    refusals.extend(_startup_refusals(profile, non_allocator, decided.kv_cache_bytes, layout, settings.max_model_len))
    plan["will_start"] = not refusals
    plan["at_budget"] = _at_budget(profile, layout, decided.kv_cache_bytes, era, release, non_allocator_bytes)
    if scenario is not None and serve:
        plan["serving"] = _serving(scenario, decided.kv_cache_bytes)
    if scenario is not None and search:
        plan["search"] = _search(
            scenario, seeds, era, settings, profile, layout, release, non_allocator, non_allocator_bytes
        )
    serving = plan["serving"]
    plan["will_fit"] = (
        plan["will_start"]
        and plan["at_budget"].get("verdict", {}).get("state") != "critical"
        and not (serving and serving["oom"])
    )
    return result


def _at_budget(
    profile: Profile, layout: KVLayout, kv_cache_bytes: int, era: Era, release: str, non_allocator_bytes: int | None
) -> dict[str, Any]:
    """The guard's budget-time verdict at the decided budget under the release's allocator, with its VMM and
    expandable-segments defaults: the call ``kvguard budget --allocator`` makes (kvguard.cli.budget.
    _budget_time_verdict), so both give the same verdict for the same profile."""
    from kvguard.allocators.mindspore_releases import vmm_on
    from kvguard.guard.at_budget import predict_at_budget

    allocator = era.allocator
    enable_vmm = allocator == "mindspore" and vmm_on(None, launcher_vmm=era.vmm_default)
    try:
        return predict_at_budget(
            profile,
            layout,
            kv_cache_bytes,
            allocator,
            enable_vmm=bool(enable_vmm),
            expandable_segments=expandable_segments_default(release, allocator),
            non_allocator_bytes=non_allocator_bytes,
        )
    except ValueError as exc:
        return {
            "allocator": allocator,
            "error": str(exc),
            "verdict": {
                "state": "critical",
                "reasons": [{"code": "no_free_memory", "state": "critical", "message": str(exc)}],
            },
        }


def _serving(scenario, decided_kv_cache_bytes: int) -> dict[str, Any]:
    """The serving run of the scenario the prediction started (``ServingScenario.run``, ``kvguard simulate``'s
    run): whether it runs out of memory, and where."""
    result = scenario.run()
    cfg = scenario.config
    where = None
    if result.oom:
        where = f"serving step {result.oom_at_step}" if result.oom_at_step is not None else result.oom_phase
    return {
        "oom": result.oom,
        "oom_phase": result.oom_phase,
        "oom_at_step": result.oom_at_step,
        "oom_request_bytes": result.oom_request_bytes,
        "where": where,
        "error": result.error,
        "budget": cfg.budget,
        "kv_cache_bytes": result.kv_cache_bytes,
        "num_blocks": result.num_blocks,
        "kv_cache_bytes_differs_from_decided": (
            result.kv_cache_bytes is not None and result.kv_cache_bytes != decided_kv_cache_bytes
        ),
        "steps": result.steps,
        "requests": cfg.requests,
        "requests_finished": result.requests_finished,
        "preemptions": result.preemptions,
        "seed": cfg.seed,
        "long_request_fraction": cfg.long_request_fraction,
        "device_peak_used_bytes": result.device_peak_used_bytes,
        "margin_bytes": result.device_total_bytes - result.device_peak_used_bytes,
        "source": "kvguard.sim.scenario.ServingScenario.run (kvguard simulate's serving run), a model",
    }


def _search(
    scenario,
    seeds: tuple[int, ...],
    era: Era,
    settings: Settings,
    profile: Profile,
    layout: KVLayout,
    release: str,
    non_allocator: int | None,
    non_allocator_bytes: int | None,
) -> dict[str, Any]:
    """The highest --gpu-memory-utilization (0.01 steps) at which the plan says the deployment fits: every
    seed serves without an OOM (``search_gpu_memory_utilization``, ``kvguard simulate --search-utilization``),
    vLLM's startup checks pass, and the budget-time verdict is not critical; the budget there (the era's
    formula on the same profile), and the margin it keeps: the device memory the serving runs at that
    utilization never touched (the least over ``seeds``)."""
    from kvguard.sim.scenario import run_scenario, search_gpu_memory_utilization

    found = search_gpu_memory_utilization(scenario.config, seeds, scenario.memo)
    # The search's own runs, by (utilization, seed): the margin below reads them instead of running again.
    ran = {(result.config.gpu_memory_utilization, result.config.seed): result for result in found.results}
    out: dict[str, Any] = {
        "seeds": list(seeds),
        "requested_gpu_memory_utilization": settings.gpu_memory_utilization,
        "serving_gpu_memory_utilization": found.gpu_memory_utilization,
        "recommended_gpu_memory_utilization": found.recommended_gpu_memory_utilization,
        "gpu_memory_utilization": None,
        "limited_by": None,
        "kv_cache_memory_bytes": None,
        "kv_cache_memory_flag": era.kv_cache_memory_flag,
        "margin_bytes": None,
    }
    if found.gpu_memory_utilization is not None:
        top = round(found.gpu_memory_utilization * 100)
        for hundredths in range(top, 0, -1):
            why = _unfit_at(
                hundredths / 100, settings, profile, layout, era, release, non_allocator, non_allocator_bytes
            )
            if isinstance(why, str):
                out["limited_by"] = out["limited_by"] or why
                continue
            out["gpu_memory_utilization"] = hundredths / 100
            out["limited_by"] = out["limited_by"] or "the serving simulation"
            if era.kv_cache_memory_flag is not None:
                out["kv_cache_memory_bytes"] = why
            out["margin_bytes"] = min(
                run.device_total_bytes - run.device_peak_used_bytes
                for run in (
                    ran.get((hundredths / 100, seed))
                    or run_scenario(scenario.config, scenario.memo, gpu_memory_utilization=hundredths / 100, seed=seed)
                    for seed in seeds
                )
            )
            break
    out["source"] = (
        "kvguard.sim.scenario.search_gpu_memory_utilization (kvguard simulate --search-utilization), "
        "then vLLM's startup checks and the budget-time verdict at each step down"
    )
    return out


def _unfit_at(
    utilization: float,
    settings: Settings,
    profile: Profile,
    layout: KVLayout,
    era: Era,
    release: str,
    non_allocator: int | None,
    non_allocator_bytes: int | None,
) -> int | str:
    """The KV cache the release decides at ``utilization`` from the same profile, or why the plan would not
    fit there: a startup refusal (free memory below the request, no or too little KV cache memory) or a
    critical budget-time verdict."""
    at = replace(profile, gpu_memory_utilization=utilization, kv_cache_memory_bytes=None)
    kv_cache_bytes = estimate(at, layout, settings.max_model_len).stock.kv_cache_bytes
    if _startup_refusals(at, non_allocator, kv_cache_bytes, layout, settings.max_model_len):
        return "vLLM's startup checks"
    verdict = _at_budget(at, layout, kv_cache_bytes, era, release, non_allocator_bytes)
    if verdict.get("verdict", {}).get("state") == "critical":
        return "the budget-time verdict"
    return kv_cache_bytes


def _gib(n_bytes: float) -> float:
    return round(n_bytes / GIB, 2)


def _startup_refusals(
    profile: Profile, non_allocator: int | None, kv_cache_bytes: int, layout: KVLayout, max_model_len: int
) -> list[dict[str, str]]:
    """vLLM's startup refusals for this profile and decided KV cache: free memory below the request (when the
    memory outside the allocator is known), then ``_kv_refusals``."""
    refusals: list[dict[str, str]] = []
    if non_allocator is not None:
        requested = requested_memory_bytes(profile)
        free = profile.total_memory_bytes - non_allocator
        if free < requested:
            refusals.append(
                {
                    "code": "free_below_request",
                    "cite": CITE_FREE,
                    "message": (
                        f"Free memory on device ({_gib(free)}/{_gib(profile.total_memory_bytes)} GiB) on startup is "
                        f"less than desired GPU memory utilization ({profile.gpu_memory_utilization}, "
                        f"{_gib(requested)} GiB). "
                        f"Decrease GPU memory utilization or reduce GPU memory used by other processes."
                    ),
                }
            )
    _kv_refusals(kv_cache_bytes, layout, max_model_len, refusals)
    return refusals


def _kv_refusals(available: int, layout: KVLayout, max_model_len: int, refusals: list[dict[str, str]]) -> None:
    """vLLM's check_enough_kv_cache_memory: no memory at all, or less than one max_model_len request needs."""
    if available <= 0:
        refusals.append(
            {
                "code": "no_kv_cache_memory",
                "cite": CITE_NO_MEMORY,
                "message": (
                    "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                    "initializing the engine."
                ),
            }
        )
        return
    # max_memory_usage_bytes: cdiv(max_model_len, block_size) pages on every layer.
    needed = layout.blocks_per_request(max_model_len) * layout.block_bytes
    if needed > available:
        # estimate_max_model_len: the longest request whose pages fit; one full-attention group: whole blocks.
        estimated = layout.num_blocks(available) * layout.block_size
        estimated_msg = (
            f"Based on the available memory, the estimated maximum model length is {estimated}."
            if estimated > 0
            else ""
        )
        refusals.append(
            {
                "code": "kv_cache_too_small",
                "cite": CITE_TOO_SMALL,
                "message": (
                    f"To serve at least one request with the models's max seq len ({max_model_len}), "
                    f"({needed / GIB:.2f} GiB KV cache is needed, which is larger than the available KV cache memory "
                    f"({available / GIB:.2f} GiB). {estimated_msg} Try increasing `gpu_memory_utilization` or "
                    f"decreasing "
                    f"`max_model_len` when initializing the engine."
                ),
            }
        )


def _predicted_profile(
    config,
    settings: Settings,
    era: Era,
    version,
    release: str,
    device_bytes: int,
    non_allocator_bytes: int | None,
    plan: dict[str, Any],
    mindformers: MindFormersPath | None,
    seed: int = 0,
):
    """Startup on the simulated device (kvguard simulate's path): the profile vLLM's memory_profiling would
    read, as the era's profile fields; (scenario, None) after an out-of-memory error (in plan's refusals).
    ``mindformers``: the network plan's weights were counted on (the scenario finds the same one)."""
    from kvguard.budget.estimator import FORMULAS
    from kvguard.sim.scenario import ScenarioConfig, ServingScenario

    allocator = era.allocator
    # The serving run's budget: the release's reserved-increase fix where its formula takes the reserved peak
    # (vllm-mindspore 0.2.0), else vLLM's allocated-peak one. The workload: simulate's default request mix.
    budget = "reserved" if FORMULAS[era.formula].peak == "reserved" else "stock"
    # Collective buffers (kvguard.plan.outside): vllm-mindspore 0.2.0 runs vLLM 0.7.3's V0 worker, whose
    # baseline snapshot precedes the distributed init, so HCCL's buffers grow the memory outside the allocator
    # after it: the simulated device holds them from the profile run on, and they are its non-torch increase.
    try:
        buffers = collective_buffers(
            _platform(era),
            _baseline_before_distributed(era, version),
            settings.tensor_parallel_size,
            plan["command"].get("env") or {},
            model_tp_groups=1 if mindformers is not None and mindformers.own_tp_communicator else 0,
        )
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    growth = buffers.total_bytes if buffers is not None and buffers.counted_in_budget else 0
    try:
        scenario_config = ScenarioConfig(
            model_config=config,
            device_memory_bytes=device_bytes,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            allocator=allocator,
            budget=budget,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=settings.max_model_len,
            max_num_seqs=settings.max_num_seqs,
            seed=seed,
            block_size=settings.block_size,
            kv_cache_dtype=settings.kv_cache_dtype,
            tensor_parallel_size=settings.tensor_parallel_size,
            non_allocator_bytes=non_allocator_bytes,
            profile_non_allocator_growth_bytes=growth,
            expandable_segments=expandable_segments_default(release, allocator),
            vllm_mindspore_version=_launcher(version)
            if allocator == "mindspore"
            else ScenarioConfig.vllm_mindspore_version,
        )
        if scenario_config.resolved_non_allocator_bytes >= device_bytes:
            raise PlanError("--non-allocator-memory must be smaller than the device's memory")
        scenario = ServingScenario(scenario_config)
        sim_profile = scenario.startup()
    except (ConfigError, ValueError) as exc:
        if isinstance(exc, PlanError):
            raise
        raise PlanError(str(exc)) from None
    except ArithmeticError as exc:
        raise PlanError(f"model config: {exc}") from None
    non_allocator = scenario_config.resolved_non_allocator_bytes
    plan["non_torch"] = {
        "at_startup_bytes": non_allocator,
        "increase_bytes": None,
        "source": f"the platform's memory outside the allocator ({allocator}: the simulator's "
        f"default, --non-allocator-memory), not measured",
        "collective_buffers": buffers.to_dict() if buffers else None,
    }
    if sim_profile is None:
        phase = "loading the weights" if scenario.oom_phase == "weights" else "the profile run"
        plan["refusals"].append(
            {
                "code": f"oom_{scenario.oom_phase}",
                "cite": "kvguard.sim (the allocator model)",
                "message": f"out of memory during {phase}: {scenario.oom_request_bytes} bytes "
                f"requested with {scenario.device.free_bytes} free",
            }
        )
        return scenario, None
    fields = sim_profile.to_dict()
    plan["non_torch"]["increase_bytes"] = sim_profile.non_torch_increase_bytes
    plan["weights"]["allocated_bytes"] = sim_profile.weights_bytes
    plan["activation_peak"] = {
        "allocated_increase_bytes": sim_profile.peak_allocated_increase_bytes,
        "reserved_increase_bytes": sim_profile.peak_reserved_increase_bytes,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "num_seqs": min(settings.max_num_seqs, settings.max_num_batched_tokens),
        "allocator": allocator,
        "source": "model (kvguard.sim.workload.forward_ops), not measured",
    }
    formula = era.formula
    from kvguard.budget.estimator import FORMULAS

    if FORMULAS[formula].cudagraph:
        fields["cudagraph_memory_bytes"] = 0
    if FORMULAS[formula].non_kv == "consumed":
        # 0.27+'s memory_profiling (vllm/utils/mem_utils.py 0.27.0:304-326): total consumed = init free - free
        # after the profile's empty_cache = what the allocator still reserves (the weights' segments) + the
        # non-torch increase; transient headroom = torch peak - torch allocated after = the allocated peak
        # increase.
        weights_record = next(r for r in scenario.timeline if r.phase == "weights")
        fields["total_consumed_bytes"] = weights_record.reserved_bytes + sim_profile.non_torch_increase_bytes
        fields["transient_peak_headroom_bytes"] = sim_profile.peak_allocated_increase_bytes
        fields["reserved_transient_peak_bytes"] = sim_profile.peak_reserved_increase_bytes
    if FORMULAS[formula].cleared:
        # vllm-ascend 0.15+: the non-torch memory present at startup (kvguard.budget.fields, --non-torch-cleared).
        fields["non_torch_cleared_bytes"] = non_allocator
    return scenario, fields


def _predicted_uncertainty(
    era: Era,
    settings: Settings,
    command: ServeCommand,
    out: list[str],
    buffers: Mapping[str, Any] | None = None,
    mindformers: MindFormersPath | None = None,
) -> None:
    """The notes on what the prediction did not measure, each estimate with its measured error: the per-era
    errors against real logs in ``accuracy.json`` (written by bench/plan_validation.py --write-accuracy)."""
    import json
    from importlib import resources

    try:
        eras = json.loads(resources.files("kvguard.plan").joinpath("accuracy.json").read_text(encoding="utf-8"))["eras"]
    except (OSError, ValueError, KeyError, TypeError):
        eras = {}

    def measured(figures: dict[str, Any]) -> str:
        return (
            f"median |error| {figures['median_abs_error_gib']:.2f} GiB ({figures['median_abs_error_pct']:.1f}%), "
            f"worst {figures['worst_error_gib']:+.2f} GiB ({figures['worst_error_pct']:+.1f}%) over "
            f"{figures['n']} real log(s) ({', '.join(figures['logs'])})"
        )

    model = "a model (the workload model's forward ops through the allocator model), not measured"
    activation = (eras.get(era.name) or {}).get("activation")
    if activation is not None:
        where = f"its error for {era.name}"
    else:
        # The workload model does not depend on the era; the same allocator's logs are the nearest measurement.
        nearest = next(
            (
                (name, row["activation"])
                for name, row in eras.items()
                if row.get("allocator") == era.allocator and row.get("activation")
            ),
            None,
        )
        where = (
            f"its error is UNMEASURED for {era.name}; against {nearest[0]}'s logs (the same {era.allocator} "
            f"allocator, another profile run)"
            if nearest
            else None
        )
        activation = nearest[1] if nearest else None
    if activation is None:
        out.append(
            f"activation peak: {model}; its error is UNMEASURED for {era.name} and its allocator (no real "
            f"log states it: bench/plan_validation.py)"
        )
    else:
        large = (
            "; LARGE: the budget may be off by that much, check it against a measured --profile"
            if activation.get("large")
            else ""
        )
        out.append(f"activation peak: {model}; {where}: {measured(activation)}{large}")
    weights = [row["weights"] for row in eras.values() if row.get("weights")]
    own = (eras.get(era.name) or {}).get("weights")
    note = (
        "weights: counted from config.json tensor by tensor (quantized linears as vLLM 0.11.0's "
        "create_weights makes them: kvguard.sim.quantization; rotary caches, kernel workspaces and other "
        "buffers not counted)"
        if mindformers is None
        else f"weights: counted as {era.name} loads this architecture, through MindFormers' network with its "
        f"published recipe (quant_method {mindformers.quant_method}, vocab_emb_dp "
        f"{mindformers.vocab_parallel_embedding}: kvguard.sim.mindformers); a MINDFORMERS_MODEL_CONFIG with another "
        f"recipe changes them; rotary tables and masks not counted"
    )
    if mindformers is not None:
        note += "; unmeasured for this path (no real log states its weights)"
    elif own is not None:
        note += f"; against {era.name}'s logs: {measured(own)}"
    elif weights:
        worst = max(weights, key=lambda row: abs(row["worst_error_pct"]))
        note += (
            f"; unmeasured for {era.name}; worst {worst['worst_error_pct']:+g}% over "
            f"{sum(row['n'] for row in weights)} real logs of other eras"
        )
    if any(row.get("large") for row in ([own] if own else weights)):
        note += "; LARGE for some model: check the weights against the release's 'Model loading took' line"
    out.append(note)
    if buffers and buffers["counted_in_budget"] and buffers["total_bytes"]:
        grown = (
            f"growth after vLLM's baseline snapshot: HCCL's buffers, {buffers['total_bytes'] / GIB:.2f} GiB "
            f"({buffers['communicators']} communicators x 2 x HCCL_BUFFSIZE); other communicators (the "
            f"framework's own world group, where it is not vLLM's) and runtime workspaces are counted as 0"
        )
    elif buffers and buffers["counted_in_budget"]:
        grown = "growth after vLLM's baseline snapshot: no communicator at this parallel size; workspaces counted as 0"
    else:
        grown = (
            "growth after vLLM's init snapshot (runtime workspaces; NCCL / HCCL buffers are created before it) "
            "is counted as 0"
        )
    out.append(f"non-torch memory: the platform default outside the allocator, not measured; {grown}")
    from kvguard.budget.estimator import FORMULAS

    if FORMULAS[era.formula].cudagraph and era.cudagraph_estimate_default:
        out.append(
            f"CUDA-graph memory: not modelled, counted as 0; {era.name} subtracts its estimate by default, "
            f"so the real budget is smaller by it"
        )
    if era.extensible_kv_cache_default:
        out.append(
            f"{era.name} sizes the KV cache after warm-up with its extensible KV cache by default: not "
            f"modelled; the plan is its formula without it (utilization {settings.gpu_memory_utilization:g})"
        )
    defaulted = [flag for flag in ("max-num-seqs", "max-num-batched-tokens") if flag not in command.flags]
    if defaulted:
        out.append(
            f"{' / '.join('--' + flag for flag in defaulted)} not given: "
            f"{settings.sources[defaulted[0].replace('-', '_')]}"
        )


def _recommended_flags(result: dict[str, Any], era: Era) -> list[str]:
    flags = []
    if result.get("recommended_gpu_memory_utilization") is not None:
        flags.append(f"--gpu-memory-utilization {result['recommended_gpu_memory_utilization']}")
    if era.kv_cache_memory_flag and result.get("recommended_kv_cache_memory_bytes") is not None:
        flags.append(f"{era.kv_cache_memory_flag} {result['recommended_kv_cache_memory_bytes']}")
    return flags
