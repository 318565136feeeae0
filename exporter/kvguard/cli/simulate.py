"""``kvguard simulate``: vLLM's startup and serving on a simulated device, a recorded snapshot or an op stream
replayed exactly."""

from __future__ import annotations

import json
import os
import sys

import click
from click.core import ParameterSource

from kvguard.budget.estimator import (
    ConfigError,
)
from kvguard.budget.model_config import bundled_model_config_path, load_model_config
from kvguard.cli import exits
from kvguard.cli.exits import FlagsError
from kvguard.cli.options import SIZE, TOKENS, emit_json, format_count, renamed_option
from kvguard.plan.devices import DEVICES, DeviceError, resolve_device
from kvguard.text import one_line
from kvguard.units import format_bytes

EXIT_OOM = exits.CRITICAL  # simulate --fail-on-oom: the outcome it was asked to flag (kvguard.cli.exits)


@click.command()
@click.option(
    "--model-config",
    "model_config",
    metavar="PATH",
    help="HF config.json (or its directory). Default: the bundled Qwen2.5-7B-Instruct config.",
)
@click.option(
    "--total-memory",
    "device_memory",
    type=SIZE,
    default="32GiB",
    show_default=True,
    help="The device's total memory (32GiB: an Atlas 910B4). An exact snapshot replay (--trace "
    "SNAPSHOT.pickle) takes it only when given: a snapshot does not record its GPU's size.",
)
@renamed_option("--device-memory", "device_memory", "--total-memory", type=SIZE)
@click.option(
    "--device",
    "device_text",
    metavar="NAME|SIZE",
    help="A named device, its total as its runtime reports it (as kvguard plan takes it: "
    + ", ".join(d.name for d in DEVICES)
    + "), or a size; instead of --total-memory.",
)
@click.option(
    "--gpu-memory-utilization",
    type=click.FloatRange(0, 1, min_open=True),
    help="Default: the --vllm-version release's default, else 0.9.",
)
@click.option(
    "--allocator",
    type=click.Choice(["torch", "torch_npu", "mindspore"]),
    help="Default: the --vllm-version release's (vllm-ascend: torch_npu, vllm-mindspore: mindspore), else torch.",
)
@click.option(
    "--vllm-version",
    "vllm_version",
    metavar="RELEASE",
    help="The release whose defaults apply (X.Y.Z, vllm-ascend:X, vllm-mindspore:X; kvguard.vllm.eras): "
    "its allocator, its --gpu-memory-utilization default, torch_npu's expandable segments as its "
    "platform sets them (unless --alloc-conf says otherwise), vllm-mindspore's launcher.",
)
@click.option(
    "--budget",
    type=click.Choice(["stock", "reserved"]),
    default="stock",
    show_default=True,
    help="stock: vLLM's allocated-peak formula; reserved: vllm-mindspore's reserved-increase fix.",
)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=8192, show_default=True)
@click.option(
    "--max-model-len",
    type=TOKENS,
    help="Tokens per request (32768, 32k, 32K as vLLM reads them). Default: the model's "
    "max_position_embeddings, at most 32768.",
)
@click.option("--requests", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--long-fraction",
    type=click.FloatRange(0, 1),
    default=0.25,
    show_default=True,
    help="Share of requests with prompts of max_model_len/2 or more.",
)
@click.option(
    "--sampling-mix",
    metavar="KIND:SHARE,...",
    help="How the requests sample: shares of greedy, random, top_k, top_p and top_k_top_p, e.g. "
    "greedy:0.5,top_k_top_p:0.5; vLLM's sampler runs per batch. Default: top_k_top_p:1, every "
    "request taking the model's generation_config.json top-k and top-p, as vLLM 0.8+'s "
    "--generation-config auto applies them.",
)
@click.option(
    "--peak-burst",
    is_flag=True,
    help="After the requests, min(max_num_seqs, max_num_batched_tokens) short requests at once: the batch "
    "vLLM's profile run budgets for, as real requests form it. Does the engine survive a full batch?",
)
@click.option("--tensor-parallel-size", "-tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--non-allocator-memory",
    type=SIZE,
    help="Device memory held outside the allocator (default: 512MiB CUDA, 1GiB Ascend).",
)
@click.option(
    "--seed",
    "seeds",
    type=int,
    multiple=True,
    help="Request-mix seed (default 0); repeat it with --search-utilization to search over several.",
)
@click.option(
    "--trace",
    "trace_file",
    metavar="FILE",
    help="Replay a MindSpore memory_block.csv or a PyTorch _dump_snapshot pickle instead "
    "(a snapshot with --allocator torch is replayed exactly, every device).",
)
@click.option(
    "--ops",
    "ops_file",
    metavar="FILE",
    help="Replay a plain allocator op stream (JSON lines: malloc / free / empty_cache) through the "
    "--allocator model; --total-memory is then the device's free memory.",
)
@click.option(
    "--replay-log",
    "replay_log",
    metavar="FILE",
    help="With a snapshot --trace: one JSON line per replayed allocation; with --ops: one per op.",
)
@click.option(
    "--search-utilization",
    is_flag=True,
    help="Find the highest --gpu-memory-utilization (0.01 steps) that serves every seed without an OOM.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--plot",
    "plot_file",
    metavar="FILE.png",
    help="Write allocated/reserved/capacity over time (a relative path is the current directory's).",
)
@click.option(
    "--fail-on-oom",
    is_flag=True,
    help=f"Exit {EXIT_OOM} when the run ends in an out-of-memory error (with --search-utilization: "
    f"when no utilization serves without one).",
)
@click.option(
    "--alloc-conf",
    metavar="CONF",
    help="PyTorch's / torch_npu's allocator settings in PYTORCH_CUDA_ALLOC_CONF / PYTORCH_NPU_ALLOC_CONF "
    'syntax, e.g. "expandable_segments:True,max_split_size_mb:256" (--allocator torch, torch_npu).',
)
@click.option(
    "--mindspore-version",
    metavar="X.Y.Z",
    help="MindSpore release whose pool rules apply (2.4.0 ... 2.10.0; default: the launcher's pin).",
)
@click.option(
    "--vllm-mindspore-version",
    type=click.Choice(["0.5.1", "0.2.0"]),
    help="Whose launcher defaults to take (0.2.0: the seed fix's, PR !428). Default: the --vllm-version "
    "release's, else 0.5.1.",
)
@click.option(
    "--mindspore-mode",
    type=click.Choice(["pynative", "graph"]),
    default="pynative",
    show_default=True,
    help="MindSpore execution mode (vllm-mindspore: PyNative with jit_level O0 graphs).",
)
@click.option(
    "--task-sink/--no-task-sink",
    default=None,
    help="MindSpore's task sink (MS_CTX_ENABLE_TASK_SINK): blocks grown by adding units, not doubling "
    "(8 MiB units in graph mode). Default: MindSpore's, on (MsContext::InitBoolTypeDefaultValue, "
    "core/utils/ms_context.cc:621 @ r2.7.rc1), which an --ops stream keeps; a serving run turns it "
    "off at vllm-mindspore's first jit_level O0 compile, unless --task-sink (graph mode, jit_level "
    "O2) keeps it on.",
)
@click.option(
    "--ms-alloc-conf",
    metavar="CONF",
    help='MS_ALLOC_CONF, e.g. "enable_vmm: true, vmm_align_size: 2MB" (default: the launcher\'s; with --ops, '
    "none: MindSpore's own defaults).",
)
@click.option(
    "--mempool-block-size",
    type=SIZE,
    metavar="SIZE",
    help="Pool block unit: MS_MEMPOOL_BLOCK_SIZE=2 is 2GiB; set_memory(increase_size=...).",
)
@click.option("--no-vmm-soc", is_flag=True, help="A SoC without VMM (not 910B / 910_93): VMM off unless asked.")
def simulate(
    model_config,
    device_memory,
    device_text,
    gpu_memory_utilization,
    allocator,
    vllm_version,
    budget,
    max_num_batched_tokens,
    max_model_len,
    requests,
    long_fraction,
    sampling_mix,
    peak_burst,
    tensor_parallel_size,
    non_allocator_memory,
    seeds,
    trace_file,
    ops_file,
    replay_log,
    search_utilization,
    as_json,
    plot_file,
    fail_on_oom,
    alloc_conf,
    mindspore_version,
    vllm_mindspore_version,
    mindspore_mode,
    task_sink,
    ms_alloc_conf,
    mempool_block_size,
    no_vmm_soc,
) -> None:
    """Simulate vLLM startup and serving on a device, with a real allocator's rules.

    Loads the weights, runs the profile forward at --max-num-batched-tokens, sizes the KV
    cache with the chosen budget formula, then serves a seeded mix of short and long
    requests under chunked prefill until they finish or the allocator runs out of memory.
    """
    from kvguard.allocators.device import Device
    from kvguard.allocators.traces import TraceError, is_snapshot_pickle, load_trace, read_trace_bytes, replay
    from kvguard.sim.scenario import ScenarioConfig, ServingScenario, make_allocator, parse_sampling_mix

    if device_text is not None:
        if click.get_current_context().get_parameter_source("device_memory") is not ParameterSource.DEFAULT:
            raise FlagsError("give --device or --total-memory, not both")
        try:
            device_memory = resolve_device(device_text).memory_bytes  # kvguard.plan.devices cites each total
        except DeviceError as exc:
            raise FlagsError(str(exc)) from None
    seeds = seeds or (0,)
    seed = seeds[0]
    if len(seeds) > 1 and not search_utilization:
        raise FlagsError("give one --seed, or several with --search-utilization")
    if replay_log and not (trace_file or ops_file):
        raise FlagsError("--replay-log needs a snapshot --trace or --ops")
    if ops_file and trace_file:
        raise FlagsError("give --ops or --trace, not both")
    if search_utilization and (trace_file or ops_file):
        raise FlagsError("--search-utilization simulates a workload; it does not take --trace or --ops")
    if ops_file and non_allocator_memory is not None:
        raise FlagsError(
            "--ops takes --total-memory as the device's free memory; --non-allocator-memory does not apply"
        )

    try:
        allocator, gpu_memory_utilization, vllm_mindspore_version, expandable, block_size = _release_defaults(
            vllm_version, allocator, gpu_memory_utilization, vllm_mindspore_version
        )
    except ValueError as exc:  # a release older than the table, flags its launcher does not take
        raise FlagsError(str(exc)) from None

    if plot_file:
        _check_plot_path(plot_file)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            from kvguard.text import install_hint

            raise click.ClickException(f"--plot needs matplotlib: {install_hint('plot')}") from None
    try:
        config_dict = load_model_config(model_config or bundled_model_config_path())
    except (ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        if allocator == "mindspore" and alloc_conf:
            raise ValueError(
                "--alloc-conf is for --allocator torch and torch_npu; MindSpore's pool takes --ms-alloc-conf"
            )
        mix = {} if sampling_mix is None else {"sampling_mix": parse_sampling_mix(sampling_mix)}
        config = ScenarioConfig(
            model_config=config_dict,
            device_memory_bytes=device_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            allocator=allocator,
            budget=budget,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            requests=requests,
            long_request_fraction=long_fraction,
            peak_burst=peak_burst,
            tensor_parallel_size=tensor_parallel_size,
            non_allocator_bytes=non_allocator_memory,
            seed=seed,
            mindspore_version=mindspore_version,
            vllm_mindspore_version=vllm_mindspore_version,
            mindspore_mode=mindspore_mode,
            task_sink=bool(task_sink),
            ms_alloc_conf=ms_alloc_conf,
            mempool_block_size_bytes=mempool_block_size,
            soc_supports_vmm=not no_vmm_soc,
            alloc_conf=alloc_conf,
            expandable_segments=expandable,
            block_size=block_size,
            **mix,
        )
        if allocator != "mindspore" and (
            mindspore_version
            or ms_alloc_conf
            or mempool_block_size
            or task_sink is not None
            or no_vmm_soc
            or mindspore_mode != "pynative"
        ):
            raise ValueError("the MindSpore pool options need --allocator mindspore")
        if non_allocator_memory is not None and non_allocator_memory >= device_memory:
            raise ValueError("--non-allocator-memory must be smaller than --total-memory")
    except ConfigError as exc:  # the model config's fields
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:  # option values the allocator or the launcher would not take
        raise FlagsError(str(exc)) from None

    if ops_file:
        # No launcher runs an op stream: MindSpore's own defaults, task sink on and MS_ALLOC_CONF unset.
        _exit_on_oom(
            fail_on_oom,
            _replay_ops_file(ops_file, config, device_memory, replay_log, as_json, task_sink=task_sink is not False),
        )
        return
    if trace_file and allocator == "torch":
        try:
            data = read_trace_bytes(trace_file)
        except TraceError as exc:
            raise click.ClickException(str(exc)) from None
        if is_snapshot_pickle(data):
            if (
                click.get_current_context().get_parameter_source("device_memory") is ParameterSource.DEFAULT
                and device_text is None
            ):
                # The GPU's size bounds only expandable segments' address space (1 1/8 x total); the trace's
                # own oom entries say where the real device ran out. A guessed 32 GiB would refuse growth
                # that an 80 GiB GPU served: 170 of 199 allocations matched on a real trace, 199 unguessed.
                device_memory = SNAPSHOT_ADDRESS_SPACE_BYTES
            _exit_on_oom(fail_on_oom, _replay_snapshot_exactly(trace_file, data, device_memory, replay_log, as_json))
            return
    if replay_log:
        raise FlagsError("--replay-log needs a PyTorch snapshot --trace replayed with --allocator torch")
    if search_utilization:
        _exit_on_oom(fail_on_oom, _search_utilization(config, seeds, as_json) is None)
        return

    if trace_file:
        try:
            trace = load_trace(trace_file)
        except TraceError as exc:
            raise click.ClickException(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a reader bug on an odd file is one line, not a traceback
            raise click.ClickException(
                f"cannot read trace {trace_file}: {one_line(exc, first_line=True, with_type=True)}"[:300]
            ) from None
        device = Device(device_memory, config.resolved_non_allocator_bytes)
        target = make_allocator(config, device)
        outcome = replay(trace.events, target, sample_every=max(1, len(trace.events) // 2000))
        data = {
            "oom": outcome.oom,
            "oom_at_step": outcome.oom_at_event,
            "oom_request_bytes": outcome.oom_request_bytes,
            "trace": {
                "file": trace_file,
                "format": trace.source,
                "events": len(trace.events),
                "allocations": trace.num_allocs,
                "skipped": trace.skipped,
                "events_replayed": outcome.events_replayed,
            },
            "allocator": allocator,
            "kv_cache_bytes": None,
            "num_blocks": None,
            "profile": None,
            "peak_allocated_bytes": outcome.peak_allocated_bytes,
            "peak_reserved_bytes": outcome.peak_reserved_bytes,
            "device": {
                "total_bytes": device.capacity_bytes,
                "free_bytes": device.free_bytes,
                "peak_used_bytes": device.peak_used_bytes,
            },
            "memory_stats": {str(k): v for k, v in outcome.memory_stats.items()},
        }
        if plot_file:
            from kvguard.sim.plot import plot_replay

            _write_plot(
                plot_file, plot_replay, outcome, device_memory, plot_file, f"{trace.source} replayed on {allocator}"
            )
        if as_json:
            emit_json(data)
            _exit_on_oom(fail_on_oom, outcome.oom)
            return
        click.echo(
            f"Trace        {trace_file} ({trace.source}): {len(trace.events)} events, "
            f"{trace.num_allocs} allocations, {trace.skipped} skipped"
        )
        click.echo(f"Allocator    {allocator} on {format_bytes(device_memory)}")
        click.echo(
            f"Peaks        allocated {format_bytes(outcome.peak_allocated_bytes)}, "
            f"reserved {format_bytes(outcome.peak_reserved_bytes)}"
        )
        click.echo(
            "Outcome      "
            + (
                f"OOM at event {outcome.oom_at_event} ({format_bytes(outcome.oom_request_bytes)} requested)"
                if outcome.oom
                else "no OOM"
            )
        )
        _exit_on_oom(fail_on_oom, outcome.oom)
        return

    try:
        scenario = ServingScenario(config)
    except (ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    except ArithmeticError as exc:  # a config field the readers did not refuse: one line, never a traceback
        raise click.ClickException(f"model config: {one_line(exc)}") from None
    from kvguard.sim.guarded import BudgetWatch, startup_guard_dict, startup_verdict

    watch = BudgetWatch(scenario)  # the guard when the budget is fixed, before the KV cache
    scenario.startup()
    guard = startup_guard_dict(startup_verdict(scenario))  # the guard before serving starts
    guard_at_budget = startup_guard_dict(watch.verdict(), at_budget=True)
    if sys.stderr.isatty() and not scenario.finished:
        total = len(scenario.requests) + config.peak_burst_requests
        with click.progressbar(length=total, label="serving", file=sys.stderr) as bar:
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
        emit_json({**result.to_dict(), "guard_at_budget": guard_at_budget, "guard": guard})
        _exit_on_oom(fail_on_oom, result.oom)
        return
    profile = result.profile
    click.echo(
        f"Device       {format_bytes(device_memory)}, utilization {gpu_memory_utilization:g}, "
        f"allocator {allocator}, budget {budget}"
    )
    if allocator == "mindspore":
        click.echo(
            f"Pool         MindSpore {config.mindspore_release.version} ({config.mindspore_mode}"
            f"{', task sink' if task_sink else ''}), VMM {'on' if config.enable_vmm else 'off'}"
            + (f", block unit {format_bytes(mempool_block_size)}" if mempool_block_size else "")
        )
    if profile is not None:
        click.echo(
            f"Profile      weights {format_bytes(profile.weights_bytes)}, allocated peak +"
            f"{format_bytes(profile.peak_allocated_increase_bytes)}, reserved +"
            f"{format_bytes(profile.peak_reserved_increase_bytes)}, non-torch "
            f"{format_bytes(profile.non_torch_increase_bytes)}"
        )
    if result.kv_cache_bytes is not None:
        click.echo(f"KV cache     {format_bytes(result.kv_cache_bytes)} ({format_count(result.num_blocks)} blocks)")
    click.echo(
        f"Serving      {result.steps} steps, {result.requests_finished}/{requests + config.peak_burst_requests} "
        "requests finished"
        + (f" (the peak burst's {config.peak_burst_requests} included)" if config.peak_burst else "")
        + f", {result.preemptions} preemptions"
    )
    if guard["state"] is not None:
        click.echo(
            f"Guard        {guard['state']} at the end of startup"
            + "".join(f"; {reason['code']}" for reason in guard["reasons"])
        )
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


def _replay_ops_file(
    ops_file: str, config, device_memory: int, replay_log: str | None, as_json: bool, *, task_sink: bool
) -> bool:
    """``simulate --ops FILE``: the stream through the chosen allocator model; True when an op ran out of memory.
    MindSpore's pool takes every knob of the command; ``task_sink`` holds from the first op."""
    from dataclasses import replace

    from kvguard.allocators.device import Device
    from kvguard.allocators.ops import OpsError, read_ops, replay_ops
    from kvguard.sim.scenario import make_allocator

    try:
        ops = read_ops(ops_file)
        # The device's free memory, all of it the allocator's to ask for: the models apply their own ceilings
        # (MindSpore's pool takes 15/16 of it) as the real allocators do.
        device = Device(device_memory)
        if config.allocator == "mindspore" and config.ms_alloc_conf is None:
            config = replace(config, ms_alloc_conf="")  # unset: MindSpore reads "" as it reads no variable
        target = make_allocator(config, device, task_sink=task_sink)
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
                log_handle.write(
                    json.dumps(
                        {
                            key: record[key]
                            for key in (
                                "op",
                                "reserved_bytes",
                                "allocated_bytes",
                                "peak_allocated_bytes",
                                "oom",
                                "address",
                            )
                        }
                    )
                    + "\n"
                )
    except OSError as exc:
        raise click.ClickException(f"cannot write {replay_log}: {exc.strerror or exc}") from None
    finally:
        if log_handle is not None:
            log_handle.close()
    data = {
        "ops": {"file": ops_file, "count": len(ops), **counts},
        "allocator": config.allocator,
        "device": {"free_bytes": device_memory},
        "oom": ooms > 0,
        "ooms": ooms,
        "first_oom_op": first_oom,
        "reserved_bytes": target.reserved_bytes,
        "allocated_bytes": target.allocated_bytes,
        "peak_allocated_bytes": target.peak_allocated_bytes,
        "peak_reserved_bytes": max(peak_reserved, target.peak_reserved_bytes),
        "memory_stats": {str(k): v for k, v in target.memory_stats().items()},
    }
    if config.allocator == "mindspore":
        data["pool"] = _pool_settings(config, task_sink)
    if as_json:
        emit_json(data)
        return ooms > 0
    click.echo(
        f"Ops          {ops_file}: {len(ops)} ops ({counts['malloc']} malloc, {counts['free']} free, "
        f"{counts['empty_cache']} empty_cache)"
    )
    click.echo(f"Allocator    {config.allocator} with {format_bytes(device_memory)} free")
    if config.allocator == "mindspore":
        pool = data["pool"]
        click.echo(
            f"Pool         MindSpore {pool['mindspore_version']} ({pool['mode']}"
            f"{', task sink' if task_sink else ', no task sink'}), VMM {'on' if pool['enable_vmm'] else 'off'}"
            + (
                f", block unit {format_bytes(pool['mempool_block_size_bytes'])}"
                if pool["mempool_block_size_bytes"]
                else ""
            )
        )
    click.echo(
        f"Peaks        allocated {format_bytes(target.peak_allocated_bytes)}, "
        f"reserved {format_bytes(data['peak_reserved_bytes'])}"
    )
    click.echo(
        f"End          allocated {format_bytes(target.allocated_bytes)}, reserved {format_bytes(target.reserved_bytes)}"
    )
    click.echo("Outcome      " + (f"{ooms} out-of-memory op(s), the first at op {first_oom}" if ooms else "no OOM"))
    return ooms > 0


def _pool_settings(config, task_sink: bool) -> dict:
    """The MindSpore pool knobs a run took, as its report shows them."""
    return {
        "mindspore_version": config.mindspore_release.version,
        "mode": config.mindspore_mode,
        "task_sink": task_sink,
        "enable_vmm": config.enable_vmm,
        "vmm_page_bytes": config.resolved_alloc_conf.vmm_page_bytes,
        "mempool_block_size_bytes": config.mempool_block_size_bytes,
    }


SNAPSHOT_ADDRESS_SPACE_BYTES = 1 << 44  # 16 TiB: larger than any GPU's memory, so it never decides a replay


def _replay_snapshot_exactly(
    trace_file: str, data: bytes, device_memory: int, replay_log: str | None, as_json: bool
) -> bool:
    """``simulate --trace SNAPSHOT.pickle``: every device, seeded, at the recorded addresses."""
    from kvguard.allocators.snapshot import SnapshotError, replay_snapshot
    from kvguard.allocators.traces import TraceError, load_snapshot_pickle, parse_torch_snapshot

    log_handle = None
    try:
        snapshot = load_snapshot_pickle(data)
        traces = snapshot.get("device_traces")
        parse_torch_snapshot(snapshot)  # the reader's checks and one-line messages, first device
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
        raise click.ClickException(
            f"cannot replay snapshot {trace_file}: {one_line(exc, first_line=True, with_type=True)}"[:300]
        ) from None
    finally:
        if log_handle is not None:
            log_handle.close()
    allocs = sum(d.allocs for d in devices)
    matched = sum(d.allocs_matched for d in devices)
    ooms = sum(d.ooms for d in devices)
    payload = {
        "oom": ooms > 0,
        "allocator": "torch",
        "trace": {
            "file": trace_file,
            "format": "torch_snapshot",
            "exact": True,
            "events": sum(d.events for d in devices),
            "allocations": allocs,
            "allocations_matched": matched,
            "devices": [d.to_dict() for d in devices],
        },
    }
    if as_json:
        emit_json(payload)
        return payload["oom"]
    click.echo(
        f"Trace        {trace_file} (torch_snapshot): {len(devices)} device(s), {payload['trace']['events']} events"
    )
    for d in devices:
        click.echo(
            f"Device {d.device:<5} {d.allocs_matched}/{d.allocs} allocations at the recorded address; "
            f"end state {'equal' if d.end_state_matches else 'differs'} ({d.end_state_detail}); "
            f"reserved {format_bytes(d.reserved_bytes)}, allocated {format_bytes(d.allocated_bytes)}"
            + (f"; {d.ooms_matched}/{d.ooms} OOMs reproduced" if d.ooms else "")
            + (
                f"; {d.preexisting_frees} frees of blocks from before recording "
                f"({d.preexisting_extended} sizes extended)"
                if d.preexisting_frees
                else ""
            )
        )
    click.echo(f"Outcome      {matched}/{allocs} allocations matched")
    return payload["oom"]


def _search_utilization(config, seeds: tuple[int, ...], as_json: bool) -> float | None:
    """``simulate --search-utilization``: a gallop from the estimator's recommendation, then bisection, over 0.01
    steps, every seed at each probe; the utilization found (None: every one runs out of memory)."""
    from kvguard.sim.scenario import search_gpu_memory_utilization

    try:
        search = search_gpu_memory_utilization(config, seeds)
    except (ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    except ArithmeticError as exc:
        raise click.ClickException(f"model config: {one_line(exc)}") from None
    if as_json:
        emit_json({"search": search.to_dict(), "config": config.summary()})
        return search.gpu_memory_utilization
    found = search.gpu_memory_utilization
    click.echo(
        f"Search       {config.allocator}, budget {config.budget}, seeds {', '.join(map(str, seeds))}: "
        f"{len(search.runs)} runs"
    )
    if found is None:
        click.echo("Outcome      no utilization serves without an OOM (0.01 already runs out of memory)")
        return None
    above = f"; {found + 0.01:.2f} runs out of memory" if found < 1.0 else ""
    click.echo(f"Outcome      highest utilization without an OOM: {found:.2f}{above}")
    if search.kv_cache_memory_bytes is not None:
        click.echo(
            f"KV cache     {format_bytes(search.kv_cache_memory_bytes)} at {found:.2f} "
            f"(--kv-cache-memory-bytes {search.kv_cache_memory_bytes})"
        )
    if search.recommended_gpu_memory_utilization is not None:
        click.echo(f"Estimator    recommends {search.recommended_gpu_memory_utilization:.2f} from the same profile")
    return found


def _release_defaults(
    release: str | None, allocator: str | None, utilization: float | None, vllm_mindspore_version: str | None
) -> tuple[str, float, str, bool, int]:
    """The allocator, utilization and vllm-mindspore launcher a run takes: the options given, else the
    ``release``'s era row (kvguard.vllm.eras), else torch, 0.9 and 0.5.1; whether torch_npu's expandable
    segments start on, as the release's platform sets them; and the release's default block size (else 16)."""
    from kvguard.vllm.eras import era_for, expandable_segments_default, parse_release

    if release is None:
        return allocator or "torch", utilization or 0.9, vllm_mindspore_version or "0.5.1", False, 16
    era = era_for(release)  # EraError (a ValueError): one line
    project, version = parse_release(release)
    if project == "vllm-mindspore":
        launcher = "0.2.0" if version < (0, 5, 0) else "0.5.1"
        if vllm_mindspore_version not in (None, launcher):
            raise ValueError(
                f"--vllm-version {release} runs vllm-mindspore {launcher}'s launcher, not "
                f"--vllm-mindspore-version {vllm_mindspore_version}"
            )
        vllm_mindspore_version = launcher
    allocator = allocator or era.allocator
    return (
        allocator,
        utilization or era.utilization_default(),
        vllm_mindspore_version or "0.5.1",
        expandable_segments_default(release, allocator),
        era.default_block_size,
    )


def _check_plot_path(path: str) -> None:
    """Refuse a --plot target that cannot be written before the run, not after it."""
    if not path.lower().endswith(".png"):
        raise FlagsError(f"--plot writes a PNG: give a file name ending in .png, not {path!r}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise click.ClickException(f"--plot: directory {parent} does not exist")
    if os.path.isdir(path):
        raise click.ClickException(f"--plot: {path} is a directory")


def _write_plot(path: str, plot, *args) -> None:
    try:
        plot(*args)
    except OSError as exc:
        raise click.ClickException(f"cannot write plot {path}: {exc.strerror or one_line(exc)}") from None
    except (ValueError, RuntimeError) as exc:
        raise click.ClickException(f"cannot write plot {path}: {one_line(exc, first_line=True)}") from None
