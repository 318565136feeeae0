"""`kvguard plan`'s serve defaults (kvguard.plan.serve_defaults) against the code each release runs.

The oracle is upstream's own default-setting code: ../shared/vllm-serve-defaults/vllm_serve_defaults.json (beside
the checkout; upstream source text, so never committed; built by `python3
tests/upstream/oracles/vllm_sources/serve_defaults.py`,
its PROVENANCE.md says from which wheels) holds, for every vLLM release 0.6.4-0.34.0 (and vllm-mindspore 0.5.1),
the verbatim functions and statements that set max_num_batched_tokens / max_num_seqs, read from the release's wheel
at the file and lines it names. The excerpt tests execute them on a stand-in EngineArgs whose fields start as
`vllm serve` leaves them, with only the device queries stubbed (name, total memory, compute capability), and
compare with the table. Where a release is installed for tests/upstream/vllm_real, tests/upstream/ascend_real or
tests/upstream/mindspore_real, the stored excerpt is checked against its installed source line for line. Nothing is
downloaded.

Nothing reads the excerpts at import time: where the file is missing, each test that needs them skips (even with
CI=true, until CI's ../shared holds it), naming the file and the command that builds it; the runs of the installed
releases, the CLI runs and the table's own checks run regardless.
"""

from __future__ import annotations
import __future__

import enum
import functools
import glob
import inspect
import json
import os
import re
import subprocess
import sys
import types

import pytest
from click.testing import CliRunner
from conftest import DATA, EXAMPLES, ROOT, TESTS

from kvguard.cli import main
from kvguard.plan.serve_defaults import SERVE_DEFAULTS, row_for, serve_defaults
from kvguard.vllm.eras import parse_version

GIB = 1 << 30
ORACLE_PATH = os.path.join(ROOT, "..", "shared", "vllm-serve-defaults", "vllm_serve_defaults.json")
ORACLE_BUILD = "python3 tests/upstream/oracles/vllm_sources/serve_defaults.py"
# Every vLLM release the excerpts cover (its final releases on PyPI, 0.6.4-0.34.0), listed here so that nothing
# reads the excerpts at import time; a test checks that the file holds exactly these.
RELEASES = [
    "0.6.4",
    "0.6.5",
    "0.6.6",
    "0.7.0",
    "0.7.1",
    "0.7.2",
    "0.7.3",
    "0.8.0",
    "0.8.1",
    "0.8.2",
    "0.8.3",
    "0.8.4",
    "0.8.5",
    "0.9.0",
    "0.9.1",
    "0.9.2",
    "0.10.0",
    "0.10.1",
    "0.10.2",
    "0.11.0",
    "0.11.1",
    "0.11.2",
    "0.12.0",
    "0.13.0",
    "0.14.0",
    "0.14.1",
    "0.15.0",
    "0.15.1",
    "0.16.0",
    "0.17.0",
    "0.17.1",
    "0.18.0",
    "0.18.1",
    "0.19.0",
    "0.19.1",
    "0.20.0",
    "0.20.1",
    "0.20.2",
    "0.21.0",
    "0.22.0",
    "0.22.1",
    "0.23.0",
    "0.24.0",
    "0.25.0",
    "0.25.1",
    "0.26.0",
    "0.27.0",
    "0.27.1",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
    "0.33.0",
    "0.34.0",
]
V0_RELEASES = [v for v in RELEASES if parse_version(v) < (0, 8, 0)]
V1_RELEASES = [v for v in RELEASES if parse_version(v) >= (0, 8, 0)]
LLAMA3_8B = os.path.join(DATA, "configs", "llama-3-8b-instruct")
SEED_PROFILE = os.path.join(EXAMPLES, "qwen2.5-7b-910b-profile.json")

# Devices as their runtime names them: (name, total memory, compute capability). Totals as real logs state them
# (kvguard.plan.devices); B200 and GB10 as their spec sheets (no log at hand; any size past the thresholds).
DEVICES = {
    "H100": ("NVIDIA H100 80GB HBM3", round(79.11 * GIB), (9, 0)),
    "A100-80GB": ("NVIDIA A100-SXM4-80GB", round(79.25 * GIB), (8, 0)),
    "L40S": ("NVIDIA L40S", round(44.42 * GIB), (8, 9)),
    "H200": ("NVIDIA H200", 141 * GIB, (9, 0)),
    "B200": ("NVIDIA B200", 178 * GIB, (10, 0)),
    "GB10": ("NVIDIA GB10", 119 * GIB, (12, 1)),
    # The thresholds' edges: exactly 70 GiB, a byte short of 160 GiB.
    "70GiB": ("NVIDIA device of 70 GiB", 70 * GIB, (8, 9)),
    "160GiB-1": ("NVIDIA device a byte short of 160 GiB", 160 * GIB - 1, (10, 0)),
}
# A straddling sample for the exhaustive grids: one release each side of every change in the table.
# A command's --max-num-batched-tokens / --max-num-seqs (EngineArgs' fields): each alone, below and past the defaults
# and the other's clamp, and both.
GIVEN = [
    {"max_num_batched_tokens": 1},
    {"max_num_batched_tokens": 128},
    {"max_num_batched_tokens": 100000},
    {"max_num_seqs": 1},
    {"max_num_seqs": 4},
    {"max_num_seqs": 5000},
    {"max_num_batched_tokens": 128, "max_num_seqs": 4},
]
# The reviewer's examples and their 0.10 / 0.11.0 neighbours: (release, given, max_model_len, (tokens, seqs)) as
# the release runs them on an H100 (the excerpt tests below run its code to the same numbers).
GIVEN_EXAMPLES = [
    ("0.34.0", {"max_num_batched_tokens": 128}, 8192, (128, 128)),  # sequences at most the given tokens
    ("0.34.0", {"max_num_seqs": 4}, 1024, (4096, 4)),  # tokens at most 4 x 1024
    ("0.11.0", {"max_num_batched_tokens": 128}, 8192, (128, 128)),  # 0.10.1+: sequences at most tokens
    ("0.11.0", {"max_num_seqs": 4}, 1024, (8192, 4)),  # before 0.11.1: tokens not clamped
    ("0.10.0", {"max_num_batched_tokens": 128}, 8192, (128, 1024)),  # before 0.10.1: no clamp
]
STRADDLE = [
    "0.8.0",
    "0.8.3",
    "0.8.4",
    "0.8.5",
    "0.9.0",
    "0.9.2",
    "0.10.0",
    "0.10.1",
    "0.10.2",
    "0.11.0",
    "0.11.1",
    "0.12.0",
    "0.16.0",
    "0.17.0",
    "0.20.0",
    "0.22.0",
    "0.27.1",
    "0.28.0",
    "0.32.0",
    "0.33.0",
    "0.34.0",
]


# ------------------------------------------------------------------------------------------- the excerpts


@functools.cache
def _load_oracle() -> dict | None:
    try:
        with open(ORACLE_PATH, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None


def oracle() -> dict:
    """The excerpts; where ../shared lacks them, the calling test skips (not fails, CI=true too: CI's ../shared
    does not hold them yet)."""
    data = _load_oracle()
    if data is None:
        pytest.skip(
            f"{os.path.normpath(os.path.relpath(ORACLE_PATH, ROOT))} is missing: upstream vLLM source "
            f"excerpts, kept beside the checkout, never committed; build it with `{ORACLE_BUILD}`"
        )
    return data


@pytest.fixture
def excerpts() -> dict:
    return oracle()


def test_the_excerpts_are_every_releases(excerpts):
    assert sorted(excerpts["releases"], key=parse_version) == RELEASES
    assert list(excerpts["plugins"]) == ["vllm-mindspore:0.5.1"]


# ------------------------------------------------------------------------------------------- the stand-ins


class UsageContext(enum.Enum):
    """vllm/usage/usage_lib.py's members that the default tables key on."""

    UNKNOWN_CONTEXT = "UNKNOWN_CONTEXT"
    LLM_CLASS = "LLM_CLASS"
    API_SERVER = "API_SERVER"
    OPENAI_API_SERVER = "OPENAI_API_SERVER"
    OPENAI_BATCH_RUNNER = "OPENAI_BATCH_RUNNER"
    ENGINE_CONTEXT = "ENGINE_CONTEXT"


class Platform:
    """current_platform with its device queries answered: CUDA, or a platform that reports no total memory
    (vllm-ascend's NPUPlatform: interface.py's get_device_total_memory raises NotImplementedError)."""

    def __init__(self, name: str, memory: int | None, capability: tuple[int, int] | None, cuda: bool = True):
        self.name, self.memory, self.capability, self.cuda = name, memory, capability, cuda

    def get_device_name(self, device_id: int = 0) -> str:
        return self.name

    def get_device_total_memory(self, device_id: int = 0) -> int:
        if self.memory is None:
            raise NotImplementedError
        return self.memory

    def is_device_capability(self, capability) -> bool:
        return self.capability == tuple(capability)

    def is_cuda(self) -> bool:
        return self.cuda

    def is_rocm(self) -> bool:
        return False

    def is_tpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return False


class Logger:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class SchedulerConfigFallbacks:
    """SchedulerConfig's class constants: reached only for a usage context without a table entry, never for
    OPENAI_API_SERVER; a sentinel that would show if they were."""

    DEFAULT_MAX_NUM_BATCHED_TOKENS = DEFAULT_MAX_NUM_SEQS = DEFAULT_MAX_NUM_BATCHED_TOKENS_FOR_BATCHED_DP = -1
    max_num_seqs = None


def _text(piece: dict) -> str:
    return oracle()["texts"][piece["text"]]


def _namespace(platform: Platform, use_v1: bool) -> dict:
    envs = types.SimpleNamespace(VLLM_USE_V1=use_v1)
    return {
        "UsageContext": UsageContext,
        "GiB_bytes": GIB,
        "logger": Logger(),
        "sys": sys,
        "envs": envs,
        "current_platform": platform,
        "SchedulerConfig": SchedulerConfigFallbacks,
        "EngineArgs": types.SimpleNamespace(scheduler_cls="vllm.core.scheduler.Scheduler"),
    }


def _exec(text: str, where: str, namespace: dict) -> None:
    # Annotations unevaluated: the excerpts name vLLM's types (ModelConfig, Optional) without their imports.
    exec(compile(text, where, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), namespace)


@pytest.fixture
def upstream_modules(monkeypatch):
    """`from vllm.platforms import current_platform` and `from vllm.usage.usage_lib import UsageContext` inside
    the excerpts find the stand-ins."""
    holder = types.SimpleNamespace(platform=None)

    def install(platform: Platform) -> None:
        for name in ("vllm", "vllm.usage"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        platforms = types.ModuleType("vllm.platforms")
        platforms.current_platform = platform
        usage_lib = types.ModuleType("vllm.usage.usage_lib")
        usage_lib.UsageContext = UsageContext
        monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
        monkeypatch.setitem(sys.modules, "vllm.usage.usage_lib", usage_lib)
        holder.platform = platform

    holder.install = install
    return holder


def _model_config(max_model_len: int):
    """A text-generation model (chunked prefill and prefix caching supported, no sliding window)."""
    return types.SimpleNamespace(
        max_model_len=max_model_len,
        runner_type="generate",
        is_multimodal_model=False,
        is_mm_prefix_lm=False,
        use_mla=False,
        pooler_config=None,
        model="m",
        hf_config=types.SimpleNamespace(),
        get_sliding_window=lambda: None,
        is_chunked_prefill_supported=True,
        is_prefix_caching_supported=True,
    )


def _engine_args(methods: dict, **fields):
    base = dict(
        max_num_batched_tokens=None,
        max_num_seqs=None,
        enable_chunked_prefill=None,
        enable_prefix_caching=None,
        scheduler_cls="vllm.core.scheduler.Scheduler",
        pipeline_parallel_size=1,
        tensor_parallel_size=1,
        performance_mode="balanced",
        prefix_caching_hash_algo=None,
        enable_prompt_embeds=False,
        enable_lora=False,
        enable_prompt_adapter=False,
        speculative_model=None,
        speculative_config=None,
        # 0.11.1-0.11.2's _set_default_args asks this of ModelConfig; for a generation model: both on.
        get_chunked_prefill_prefix_caching_defaults=lambda self, model_config: (True, True),
    )
    base.update(fields)
    cls = type("EngineArgs", (), {**{k: v for k, v in base.items() if callable(v)}, **methods})
    args = cls()
    for key, value in base.items():
        if not callable(value):
            setattr(args, key, value)
    return args


def run_v1(
    release: str,
    platform: Platform,
    max_model_len: int,
    performance_mode: str = "balanced",
    functions: dict[str, str] | None = None,
    given: dict[str, int] | None = None,
) -> tuple[int, int]:
    """What ``release``'s V1 default-setting code sets for `vllm serve` (OPENAI_API_SERVER); ``given``: the
    EngineArgs fields the command's flags set (max_num_batched_tokens, max_num_seqs)."""
    pieces = oracle()["releases"][release]
    namespace = _namespace(platform, use_v1=True)
    names = (
        "get_batch_defaults",
        "_set_default_args",
        "_set_default_args_v1",
        "_set_default_max_num_seqs_and_batched_tokens_args",
    )
    texts = functions or {n: _text(pieces[n]) for n in names if n in pieces}
    for name, text in texts.items():
        _exec(text, f"<vllm {release} {name}>", namespace)
    methods = {name: namespace[name] for name in texts}
    args = _engine_args(methods, performance_mode=performance_mode, **(given or {}))
    model_config = _model_config(max_model_len)
    entry = next(
        n
        for n in ("_set_default_max_num_seqs_and_batched_tokens_args", "_set_default_args", "_set_default_args_v1")
        if n in methods
    )
    if entry == "_set_default_max_num_seqs_and_batched_tokens_args":
        # 0.12+: _set_default_chunked_prefill_and_prefix_caching_args ran first: on for a generation model.
        args.enable_chunked_prefill = True
    params = list(inspect.signature(getattr(args, entry)).parameters)
    call = {
        "usage_context": UsageContext.OPENAI_API_SERVER,
        "model_config": model_config,
        "parallel_config": types.SimpleNamespace(use_batched_dp_moe=False),
    }
    getattr(args, entry)(*[call[p] for p in params])
    return args.max_num_batched_tokens, args.max_num_seqs


def run_v0(
    release: str,
    platform: Platform,
    max_model_len: int,
    device_type: str = "cuda",
    typed_chunked: bool | None = None,
    given: dict[str, int] | None = None,
) -> tuple[int, int]:
    """What ``release``'s V0 engine sets: EngineArgs' max_num_seqs default, create_engine_config's chunked-prefill
    default, then SchedulerConfig's max_num_batched_tokens default (``given``: as run_v1's)."""
    given = given or {}
    pieces = oracle()["releases"][release]
    namespace = _namespace(platform, use_v1=False)
    args = _engine_args({}, enable_chunked_prefill=typed_chunked)
    fields: dict = {**namespace, "Optional": object}
    body = "".join("    " + line + "\n" for line in _text(pieces["field_max_num_seqs"]).splitlines())
    _exec("class Fields:\n" + body, f"<vllm {release} EngineArgs>", fields)
    args.max_num_seqs = given.get("max_num_seqs", getattr(fields["Fields"], "max_num_seqs", None))
    if "post_init_max_num_seqs" in pieces:
        _exec(_text(pieces["post_init_max_num_seqs"]), f"<vllm {release} __post_init__>", {**namespace, "self": args})
    _exec(
        _text(pieces["chunked_prefill_default"]),
        f"<vllm {release} create_engine_config>",
        {
            **namespace,
            "self": args,
            "model_config": _model_config(max_model_len),
            "device_config": types.SimpleNamespace(device_type=device_type),
        },
    )
    scheduler_ns = {**namespace}
    _exec(_text(pieces["constants"]), f"<vllm {release} config.py>", scheduler_ns)
    piece = pieces["scheduler_max_num_batched_tokens"]
    tokens_given = given.get("max_num_batched_tokens")
    scheduler = types.SimpleNamespace(
        max_num_batched_tokens=tokens_given,
        enable_chunked_prefill=args.enable_chunked_prefill,
        num_scheduler_steps=1,
        max_model_len=max_model_len,
        runner_type="generate",
        task="generate",
        is_multimodal_model=False,
    )
    scheduler_ns.update(
        self=scheduler,
        max_num_batched_tokens=tokens_given,
        enable_chunked_prefill=args.enable_chunked_prefill,
        num_scheduler_steps=1,
        max_model_len=max_model_len,
        task="generate",
        is_multimodal_model=False,
    )
    _exec(_text(piece), f"<vllm {release} SchedulerConfig.{piece['in']}>", scheduler_ns)
    tokens = scheduler_ns["max_num_batched_tokens"] if piece["in"] == "__init__" else scheduler.max_num_batched_tokens
    return tokens, args.max_num_seqs


def table(
    release: str,
    device: str | None,
    max_model_len: int,
    *,
    performance_mode: str | None = None,
    vllm_version: str | None = None,
    platform: str = "cuda",
    env=None,
    typed=(),
    given: dict[str, int] | None = None,
) -> tuple[int, int]:
    name, memory, _ = DEVICES[device] if device else ("Ascend910B", 65_452_113_920, None)
    chosen = serve_defaults(
        release,
        vllm_version=parse_version(vllm_version or release.split(":")[-1]),
        memory_bytes=memory,
        device_name=name,
        max_model_len=max_model_len,
        platform=platform,
        env=env,
        flags_typed=tuple(typed),
        performance_mode=performance_mode,
        **(given or {}),
    )
    return chosen.max_num_batched_tokens, chosen.max_num_seqs


def cuda(device: str) -> Platform:
    name, memory, capability = DEVICES[device]
    return Platform(name, memory, capability)


# ------------------------------------------------------------------------------------------- the oracle runs


@pytest.mark.parametrize("release", V1_RELEASES)
def test_every_v1_release_sets_the_tables_defaults_on_each_device(release, excerpts, upstream_modules):
    for device in DEVICES:
        upstream_modules.install(cuda(device))
        assert run_v1(release, cuda(device), 4096) == table(release, device, 4096), (release, device)


@pytest.mark.parametrize("release", STRADDLE)
@pytest.mark.parametrize("max_model_len", [1, 3, 8, 65536])
def test_short_and_long_max_model_len_clamp_as_the_release_does(release, max_model_len, excerpts, upstream_modules):
    # 0.10.1+: max_num_seqs at most max_num_batched_tokens; 0.11.1+: max_num_batched_tokens at most
    # max_num_seqs * max_model_len (a 1-token model: 256 or 1024 tokens).
    for device in ("H100", "L40S", "B200"):
        upstream_modules.install(cuda(device))
        assert run_v1(release, cuda(device), max_model_len) == table(release, device, max_model_len), device


@pytest.mark.parametrize("release", [v for v in STRADDLE if parse_version(v) >= (0, 17, 0)] + ["0.16.0"])
def test_performance_mode_throughput_doubles_from_0_17(release, excerpts, upstream_modules):
    for device in ("H100", "A100-80GB", "B200"):
        upstream_modules.install(cuda(device))
        got = run_v1(release, cuda(device), 4096, performance_mode="throughput")
        assert got == table(release, device, 4096, performance_mode="throughput"), device
    assert (got != table(release, "B200", 4096)) == (parse_version(release) >= (0, 17, 0))


@pytest.mark.parametrize("release", STRADDLE)
def test_a_given_flag_clamps_only_the_defaulted_one_as_the_release_does(release, excerpts, upstream_modules):
    # 0.10.1+: a defaulted max_num_seqs is at most max_num_batched_tokens as set, a given one included; 0.11.1+:
    # a defaulted max_num_batched_tokens is at most max_num_seqs (given, or defaulted and doubled) x max_model_len.
    # A given value is never clamped, nor doubled.
    modes = ("balanced", "throughput") if parse_version(release) >= (0, 17, 0) else ("balanced",)
    for device in ("H100", "L40S", "B200"):
        upstream_modules.install(cuda(device))
        for max_model_len in (3, 1024, 65536):
            for mode in modes:
                for given in GIVEN:
                    got = run_v1(release, cuda(device), max_model_len, performance_mode=mode, given=given)
                    want = table(release, device, max_model_len, performance_mode=mode, given=given)
                    assert got == want, (device, max_model_len, mode, given)
                    for name, value in given.items():
                        assert {"max_num_batched_tokens": got[0], "max_num_seqs": got[1]}[name] == value


@pytest.mark.parametrize("release, given, max_model_len, expected", GIVEN_EXAMPLES)
def test_the_examples_given_one_flag_are_what_the_release_runs(
    release, given, max_model_len, expected, excerpts, upstream_modules
):
    upstream_modules.install(cuda("H100"))
    assert run_v1(release, cuda("H100"), max_model_len, given=given) == expected
    assert table(release, "H100", max_model_len, given=given) == expected


@pytest.mark.parametrize("release", ["vllm-ascend:0.11.0", "vllm-ascend:0.19.1", "vllm-mindspore:0.5.1"])
def test_plugins_clamp_a_defaulted_value_against_a_given_one(release, excerpts, upstream_modules):
    npu = Platform("Ascend910B3", None, None, cuda=False)
    upstream_modules.install(npu)
    vllm = "0.11.0" if release.startswith("vllm-mindspore") else release.split(":")[1]
    functions = (
        {"_set_default_args": _text(excerpts["plugins"]["vllm-mindspore:0.5.1"]["_set_default_args"])}
        if release.startswith("vllm-mindspore")
        else None
    )
    for max_model_len in (3, 1024):
        for given in GIVEN:
            got = run_v1(vllm, npu, max_model_len, functions=functions, given=given)
            assert got == table(release, None, max_model_len, vllm_version=vllm, platform="ascend", given=given), given


@pytest.mark.parametrize("release", ["0.6.4", "0.7.3"])
def test_v0_keeps_a_given_flag_and_defaults_the_other_alone(release, excerpts, upstream_modules):
    upstream_modules.install(cuda("H100"))
    for max_model_len in (1024, 65536):
        for given in GIVEN:
            assert run_v0(release, cuda("H100"), max_model_len, given=given) == table(
                release, "H100", max_model_len, given=given
            ), (max_model_len, given)


@pytest.mark.parametrize("release", V0_RELEASES)
@pytest.mark.parametrize("max_model_len", [512, 4096, 32768, 32769, 131072])
def test_every_v0_release_sets_the_tables_defaults(release, max_model_len, excerpts, upstream_modules):
    # 0.6.4-0.7.3 serve on V0 (envs.py VLLM_USE_V1 default "0"): 256 sequences on every device; chunked prefill
    # on by default past 32768 tokens on CUDA (512 tokens in 0.6.4, 2048 after), else max(max_model_len, 2048).
    assert excerpts["releases"][release]["VLLM_USE_V1_default"]["value"] == "0"
    for device in ("H100", "L40S"):
        upstream_modules.install(cuda(device))
        assert run_v0(release, cuda(device), max_model_len) == table(release, device, max_model_len), device
    npu = Platform("Ascend910B", None, None, cuda=False)
    upstream_modules.install(npu)
    assert run_v0(release, npu, max_model_len, device_type="npu") == table(
        release, "H100", max_model_len, platform="ascend"
    )


@pytest.mark.parametrize("typed", [True, False])
def test_v0_honours_a_typed_enable_chunked_prefill(typed, excerpts, upstream_modules):
    upstream_modules.install(cuda("H100"))
    flag = "--enable-chunked-prefill" if typed else "--no-enable-chunked-prefill"
    for release in ("0.6.4", "0.7.3"):
        for max_model_len in (4096, 65536):
            assert run_v0(release, cuda("H100"), max_model_len, typed_chunked=typed) == table(
                release, "H100", max_model_len, typed=(flag,)
            )


def test_the_default_engine_is_the_releases(excerpts):
    # VLLM_USE_V1's default (vllm/envs.py) is "0" through 0.7.3 and "1" from 0.8.0; 0.11.0 has no V0 path.
    for release in RELEASES:
        pieces = excerpts["releases"][release]
        v1 = (
            "_set_default_args_v0" not in pieces
            and "chunked_prefill_default" not in pieces
            or (pieces.get("VLLM_USE_V1_default", {}).get("value") == "1")
        )
        assert row_for("vllm", parse_version(release)).engine == ("V1" if v1 else "V0"), release


@pytest.mark.parametrize("release", ["0.8.0", "0.8.5", "0.9.2", "0.10.2"])
def test_vllm_use_v1_0_falls_back_to_v0s_sequences(release, excerpts, upstream_modules):
    # _set_default_args_v0 sets max_num_seqs 256 (its tokens: SchedulerConfig's, the 0.6.5-0.7.3 rule).
    upstream_modules.install(cuda("H100"))
    namespace = _namespace(cuda("H100"), use_v1=False)
    _exec(_text(excerpts["releases"][release]["_set_default_args_v0"]), release, namespace)
    args = _engine_args({"_set_default_args_v0": namespace["_set_default_args_v0"]})
    args._set_default_args_v0(_model_config(4096))
    tokens, seqs = table(release, "H100", 4096, env={"VLLM_USE_V1": "0"})
    assert (args.max_num_seqs, args.enable_chunked_prefill) == (seqs, False)
    assert tokens == max(4096, 2048)


@pytest.mark.parametrize(
    "release",
    [
        "vllm-ascend:0.11.0",
        "vllm-ascend:0.14.0",
        "vllm-ascend:0.17.0",
        "vllm-ascend:0.18.0",
        "vllm-ascend:0.19.1",
        "vllm-ascend:0.23.0",
        "vllm-ascend-310p:0.18.0",
    ],
)
def test_vllm_ascend_runs_its_vllms_code_with_no_device_memory(release, excerpts, upstream_modules):
    # NPUPlatform does not implement get_device_total_memory: vLLM's except-branch takes 0 bytes.
    vllm = release.split(":")[1]
    npu = Platform("Ascend910B3", None, None, cuda=False)
    upstream_modules.install(npu)
    for max_model_len in (1, 4096):
        assert run_v1(vllm, npu, max_model_len) == table(release, None, max_model_len, platform="ascend")


@pytest.mark.parametrize("release", ["vllm-ascend:0.7.3", "vllm-mindspore:0.2.0"])
def test_v0_plugins_are_vllm_0_7_3s_v0_off_cuda(release, excerpts, upstream_modules):
    npu = Platform("Ascend910B", None, None, cuda=False)
    upstream_modules.install(npu)
    for max_model_len in (4096, 65536):
        for typed in (None, True):
            flags = ("--enable-chunked-prefill",) if typed else ()
            assert run_v0("0.7.3", npu, max_model_len, device_type="npu", typed_chunked=typed) == table(
                release, None, max_model_len, vllm_version="0.7.3", platform="ascend", typed=flags
            )


def test_vllm_mindspore_0_5_runs_its_own_defaults(excerpts, upstream_modules):
    plugin = excerpts["plugins"]["vllm-mindspore:0.5.1"]["_set_default_args"]
    for device in ("H100", "L40S"):  # it reads no device: the same on every one
        upstream_modules.install(cuda(device))
        for max_model_len in (1, 4096):
            got = run_v1("0.11.0", cuda(device), max_model_len, functions={"_set_default_args": _text(plugin)})
            assert got == table("vllm-mindspore:0.5.1", device, max_model_len, vllm_version="0.11.0", platform="ascend")


# ------------------------------------------------------------------------------ the excerpts are the releases'


def _installed_sources(excerpts: dict) -> list[tuple[str, str]]:
    from oracles_cache import cache_root  # noqa: PLC0415

    root = cache_root()
    found = []
    for pattern in (
        "vllm-envs/vllm-*/lib/python*/site-packages/vllm/engine/arg_utils.py",
        "ascend-envs/vllm-[0-9]*/lib/python*/site-packages/vllm/engine/arg_utils.py",
    ):
        for path in glob.glob(str(root / pattern)):
            release = re.search(r"/vllm-([0-9][0-9.]*)/lib/", path)[1]
            if release in excerpts["releases"]:
                found.append((excerpts["releases"][release], path))
    for release, pieces in excerpts["plugins"].items():
        project, version = release.split(":")
        pattern = f"mindspore-envs/{project}-{version}/lib/python*/site-packages/{pieces['_set_default_args']['file']}"
        found += [({"_set_default_args": pieces["_set_default_args"]}, path) for path in glob.glob(str(root / pattern))]
    return found


@pytest.fixture
def installed(excerpts):
    sys.path.insert(0, os.path.join(TESTS, "upstream", "oracles"))
    try:
        import cache  # noqa: PLC0415

        sys.modules.setdefault("oracles_cache", cache)
        return _installed_sources(excerpts)
    finally:
        sys.path.pop(0)


def test_stored_excerpts_match_the_installed_releases(installed):
    if not installed:
        pytest.skip(
            "no vLLM release installed "
            "(tests/upstream/vllm_real/envs.py setup, tests/upstream/ascend_real/envs.py setup)"
        )
    assert len(installed) >= 1
    for pieces, path in installed:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
        for name, piece in pieces.items():
            if not piece.get("file", "").endswith("engine/arg_utils.py") or "text" not in piece:
                continue
            first, last = piece["lines"]
            stored = _text(piece).splitlines()
            real = lines[first - 1 : last]
            indent = min(len(x) - len(x.lstrip()) for x in real if x.strip())
            assert [x[indent:] for x in real] == stored, (path, name)


# ------------------------------------------------------------------------------- the installed releases, run

# Run inside a release's own environment (tests/upstream/vllm_real/envs.py): its installed EngineArgs, with only
# current_platform's device queries replaced.
RUN_INSTALLED = """
import inspect, json, sys, types
import vllm
import vllm.engine.arg_utils as au
import vllm.platforms
from vllm.usage.usage_lib import UsageContext

out = []
for case in json.loads(sys.argv[1]):
    class Platform:
        def get_device_name(self, device_id=0):
            return case["name"]
        def get_device_total_memory(self, device_id=0):
            if case["memory"] is None:
                raise NotImplementedError
            return case["memory"]
        def is_device_capability(self, capability):
            return tuple(case["capability"] or ()) == tuple(capability)
        def is_tpu(self):
            return False
        def is_cpu(self):
            return False
        def is_cuda(self):
            return case["memory"] is not None
        def is_rocm(self):
            return False
    fields = au.EngineArgs.__dataclass_fields__
    args = au.EngineArgs(model="m", **({"performance_mode": case["mode"]} if "performance_mode" in fields else {}),
                         **case.get("given", {}))
    vllm.platforms.current_platform = au.current_platform = Platform()
    model_config = types.SimpleNamespace(
        max_model_len=case["max_model_len"], runner_type="generate", is_multimodal_model=False, is_mm_prefix_lm=False,
        use_mla=False, pooler_config=None, model="m", hf_config=types.SimpleNamespace(),
        is_chunked_prefill_supported=True, is_prefix_caching_supported=True)
    name = next(n for n in ("_set_default_max_num_seqs_and_batched_tokens_args", "_set_default_args",
                            "_set_default_args_v1") if hasattr(args, n))
    if name == "_set_default_max_num_seqs_and_batched_tokens_args":
        args.enable_chunked_prefill = True   # _set_default_chunked_prefill_and_prefix_caching_args: a generation model
    if hasattr(args, "get_chunked_prefill_prefix_caching_defaults"):
        args.get_chunked_prefill_prefix_caching_defaults = lambda model_config: (True, True)
    call = {"usage_context": UsageContext.OPENAI_API_SERVER, "model_config": model_config,
            "parallel_config": types.SimpleNamespace(use_batched_dp_moe=False)}
    getattr(args, name)(*[call[p] for p in inspect.signature(getattr(args, name)).parameters])
    out.append([args.max_num_batched_tokens, args.max_num_seqs])
print(json.dumps({"version": vllm.__version__, "results": out}))
"""


def _installed_releases() -> list[str]:
    from vllm_real import envs  # noqa: PLC0415

    return envs.releases()


@pytest.mark.parametrize("release", _installed_releases())
def test_the_installed_release_sets_the_tables_defaults(release):
    from vllm_real import envs  # noqa: PLC0415

    python = envs.env_python(release)
    if python is None:
        pytest.skip(f"vLLM {release} is not set up (python3 tests/upstream/vllm_real/envs.py setup {release})")
    cases, expected = [], []
    for device, (name, memory, capability) in DEVICES.items():
        for max_model_len in (3, 4096):
            for mode in ("balanced", "throughput"):
                cases.append(
                    {
                        "name": name,
                        "memory": memory,
                        "capability": capability,
                        "mode": mode,
                        "max_model_len": max_model_len,
                    }
                )
                expected.append(list(table(release, device, max_model_len, performance_mode=mode)))
        for given in GIVEN:  # one flag given (or both): the defaulted one clamped against it
            for mode in ("balanced", "throughput"):
                cases.append(
                    {
                        "name": name,
                        "memory": memory,
                        "capability": capability,
                        "mode": mode,
                        "max_model_len": 1024,
                        "given": given,
                    }
                )
                expected.append(list(table(release, device, 1024, performance_mode=mode, given=given)))
    for release_, given, max_model_len, want in GIVEN_EXAMPLES:
        if release_ == release:
            name, memory, capability = DEVICES["H100"]
            cases.append(
                {
                    "name": name,
                    "memory": memory,
                    "capability": capability,
                    "mode": "balanced",
                    "max_model_len": max_model_len,
                    "given": given,
                }
            )
            expected.append(list(want))
    if parse_version(release) >= (0, 9, 1):  # vllm-ascend's V1 rows: NPUPlatform reports no total memory
        cases.append(
            {"name": "Ascend910B3", "memory": None, "capability": None, "mode": "balanced", "max_model_len": 4096}
        )
        expected.append(list(table(f"vllm-ascend:{release}", None, 4096, platform="ascend")))
        for given in GIVEN:
            cases.append(
                {
                    "name": "Ascend910B3",
                    "memory": None,
                    "capability": None,
                    "mode": "balanced",
                    "max_model_len": 1024,
                    "given": given,
                }
            )
            expected.append(list(table(f"vllm-ascend:{release}", None, 1024, platform="ascend", given=given)))
    proc = subprocess.run(
        [str(python), "-c", RUN_INSTALLED, json.dumps(cases)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"] == release
    for case, got, want in zip(cases, out["results"], expected):
        assert got == want, case


# ------------------------------------------------------------------------------------------- the table and CLI


def test_every_row_cites_its_source():
    for row in SERVE_DEFAULTS:
        assert row.cites and all(c.strip() for c in row.cites), row.name


@pytest.mark.parametrize(
    "release, device, expected",
    [
        ("0.6.4", "H100", (8192, 256)),  # V0: max(max_model_len 8192, 2048)
        ("0.8.3", "H100", (8192, 1024)),
        ("0.8.3", "A100", (2048, 1024)),
        ("0.8.4", "A100", (2048, 256)),
        ("0.8.5", "A100", (8192, 1024)),  # 70 GiB, before the A100 exception
        ("0.11.0", "A100", (2048, 256)),
        ("0.34.0", "H200", (8192, 1024)),
        ("0.34.0", "180GiB", (16384, 1024)),  # 160 GiB or more (B200)
        ("vllm-ascend:0.18.0", "910B", (2048, 256)),
        ("vllm-mindspore:0.2.0", "910B", (8192, 256)),  # vLLM 0.7.3's V0 off CUDA: max(max_model_len, 2048)
        ("vllm-mindspore:0.5.1", "910B", (2048, 256)),
    ],
)
def test_plan_without_the_flags_shows_each_releases_defaults(release, device, expected):
    # Releases whose profile plan does not predict (V0, 0.8.x) plan from a measured one.
    profile = ["--profile", SEED_PROFILE] if parse_version(release.split(":")[-1]) < (0, 9, 1) else []
    result = CliRunner().invoke(
        main,
        [
            "plan",
            "--json",
            "--device",
            device,
            "--vllm-version",
            release,
            "--model-config",
            LLAMA3_8B,
            *profile,
            "--",
            "vllm",
            "serve",
            "M",
            "--max-model-len",
            "8192",
        ],
    )
    assert result.exit_code in (0, 1), result.output
    settings = json.loads(result.output)["plan"]["settings"]
    got = (settings["max_num_batched_tokens"]["value"], settings["max_num_seqs"]["value"])
    assert got == expected
    source = settings["max_num_seqs"]["source"]
    assert release.split(":")[-1] in source and "other releases not read" not in source


@pytest.mark.parametrize("release, given, max_model_len, expected", GIVEN_EXAMPLES)
def test_plan_with_one_flag_given_clamps_the_other_as_the_release_does(release, given, max_model_len, expected):
    # `expected` is what the release's own code runs (the excerpt and installed-release tests above).
    flags = [f for name, value in given.items() for f in (f"--{name.replace('_', '-')}", str(value))]
    result = CliRunner().invoke(
        main,
        [
            "plan",
            "--json",
            "--device",
            "H100",
            "--vllm-version",
            release,
            "--model-config",
            LLAMA3_8B,
            "--",
            "vllm",
            "serve",
            "M",
            "--max-model-len",
            str(max_model_len),
            *flags,
        ],
    )
    assert result.exit_code in (0, 1), result.output
    settings = json.loads(result.output)["plan"]["settings"]
    got = (settings["max_num_batched_tokens"]["value"], settings["max_num_seqs"]["value"])
    assert got == expected == table(release, "H100", max_model_len, given=given)
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        assert (settings[name]["source"] == "command") == (name in given)
        if name not in given:
            assert release in settings[name]["source"]


def test_the_how_to_lists_every_row():
    with open(os.path.join(DATA, "..", "..", "docs", "how-to", "plan.md"), encoding="utf-8") as handle:
        section = handle.read().split("## Serve defaults", 1)[1].split("\n## ", 1)[0]
    listed = {line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| ")}
    projects = {"vllm": "vLLM", "vllm-ascend": "vllm-ascend", "vllm-mindspore": "vllm-mindspore"}
    for row in SERVE_DEFAULTS:
        if row.project in projects:
            assert f"{projects[row.project]} {'.'.join(map(str, row.first))}" in listed, row.name
