"""The ``vllm serve`` defaults of max_num_batched_tokens and max_num_seqs, release by release.

When a serve command leaves ``--max-num-batched-tokens`` or ``--max-num-seqs`` out, vLLM chooses it
from the usage context (``vllm serve`` is ``OPENAI_API_SERVER``), the engine (V0 / V1), the device's total
memory and name, ``max_model_len``, and (from 0.10.1) the other one as finally set, a given one included: a
defaulted value is clamped, a given one never. Each row of :data:`SERVE_DEFAULTS` is the rule from its ``first``
release until the next row, with the upstream file:line it follows (the first and last release it was read
in). Paths are inside the release's wheel; "a" is ``vllm/engine/arg_utils.py``, "c" ``vllm/config.py``.
Every vLLM release from 0.6.4 to 0.34.0 was read; tests/plan/test_plan_serve_defaults.py runs the releases' own
default-setting code (excerpts in ../shared/vllm-serve-defaults/, not committed; built by
tests/upstream/oracles/vllm_sources/serve_defaults.py) against this table.

Not modelled: TPU and CPU platforms' numbers, pooling and multimodal models' floors (V0's 32768 / 5120-token
floors, 0.22's multimodal prefix-LM floor), 0.20's batched data-parallel MoE default,
V0 with a sliding-window, LoRA or speculative-decoding model past 32K (V0 keeps chunked prefill off then),
V1 with ``--no-enable-chunked-prefill``, and V1 before 0.8 (``VLLM_USE_V1=1``, an opt-in then).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvguard.vllm.eras import parse_release, version_text

GIB = 1 << 30
V0_LONG_CONTEXT = 32768  # a V0 model past this many tokens turns chunked prefill on (CUDA only)


@dataclass(frozen=True)
class Tier:
    """One branch of a release's device test: the first tier whose conditions hold gives the numbers."""

    max_num_batched_tokens: int
    max_num_seqs: int
    min_memory_gib: int | None = None  # total device memory at least this many GiB
    name_has: tuple[str, ...] = ()  # the device name (lower case) holds one of these
    name_lacks: tuple[str, ...] = ()  # ... and none of these

    def holds(self, memory_bytes: int, name: str) -> bool:
        if self.min_memory_gib is not None and memory_bytes < self.min_memory_gib * GIB:
            return False
        if self.name_has and not any(part in name for part in self.name_has):
            return False
        return not any(part in name for part in self.name_lacks)

    def describe(self) -> str:
        parts = (
            ([f"{self.min_memory_gib} GiB or more"] if self.min_memory_gib is not None else [])
            + ([f"named {' or '.join(n.upper() for n in self.name_has)}"] if self.name_has else [])
            + ([f"not {' or '.join(n.upper() for n in self.name_lacks)}"] if self.name_lacks else [])
        )
        return ", ".join(parts)


@dataclass(frozen=True)
class ServeDefaults:
    """The serve defaults from ``first`` (a vLLM release, or a platform plugin's) to the next row."""

    project: str
    first: tuple[int, ...]
    engine: str  # "V0" or "V1": the engine ``vllm serve`` runs by default
    tiers: tuple[Tier, ...]  # the last holds always
    cites: tuple[str, ...]
    v0_chunked_tokens: int | None = None  # V0 with chunked prefill on; off: max(max_model_len, tiers' tokens)
    # The clamps apply to a defaulted value only, against the other as set (given or defaulted): tokens first.
    seqs_at_most_tokens: bool = False  # max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
    tokens_at_most_seqs_x_len: bool = False  # max_num_batched_tokens = min(max_num_seqs * max_model_len, ...)
    throughput_doubles: bool = False  # --performance-mode throughput doubles each defaulted one
    device_unread: bool = False  # the platform does not report its memory: vLLM sees 0 bytes
    base: str | None = None  # a platform plugin's: the vLLM rule it inherits ("vllm": same number)
    engine_env: bool = False  # VLLM_USE_V1=0 selects V0 (0.8.0-0.10.2)

    @property
    def name(self) -> str:
        return f"{self.project} {version_text(self.first)}"


_SMALL = Tier(2048, 256)
_H100_NAMES = ("h100", "h200")

SERVE_DEFAULTS: tuple[ServeDefaults, ...] = (
    ServeDefaults(
        "vllm",
        (0, 6, 4),
        "V0",
        (_SMALL,),
        v0_chunked_tokens=512,
        cites=(
            "a 0.6.4:123 max_num_seqs 256",
            "c 0.6.4:1103-1118 SchedulerConfig: chunked prefill 512, else max(max_model_len, 2048)",
            "a 0.6.4:996-1020 chunked prefill on by default past 32768 tokens on CUDA (no sliding window, LoRA, "
            "speculative decoding; not multimodal)",
        ),
    ),
    ServeDefaults(
        "vllm",
        (0, 6, 5),
        "V0",
        (_SMALL,),
        v0_chunked_tokens=2048,
        cites=(
            "a 0.6.5:210, 0.7.3:224 max_num_seqs 256 if not VLLM_USE_V1 (envs.py 0.7.3:503-504 default '0')",
            "c 0.6.5:1333-1348, 0.7.3:1521-1536 SchedulerConfig: chunked prefill 2048, else max(max_model_len, 2048)",
            "a 0.6.5:1065-1093, 0.7.3:1165-1194 chunked prefill on by default past 32768 tokens on CUDA",
        ),
    ),
    # V1 by default from 0.8.0 (envs.py 0.8.0:522-523 VLLM_USE_V1 default '1'; VLLM_USE_V1=0 or a feature V1
    # lacks falls back to _set_default_args_v0: max_num_seqs 256, the 0.6.5 row's tokens).
    ServeDefaults(
        "vllm",
        (0, 8, 0),
        "V1",
        (Tier(8192, 1024, name_has=_H100_NAMES), Tier(2048, 1024)),
        engine_env=True,
        cites=(
            "a 0.8.0:1662-1720, 0.8.3:1612-1674 _set_default_args_v1: 8192 tokens on a device named H100 / H200, "
            "else 2048; max_num_seqs 1024",
            "a 0.8.0:1606-1660 _set_default_args_v0 (VLLM_USE_V1=0): max_num_seqs 256; c 0.8.0:1657-1674",
        ),
    ),
    ServeDefaults(
        "vllm",
        (0, 8, 4),
        "V1",
        (Tier(8192, 1024, name_has=_H100_NAMES), _SMALL),
        engine_env=True,
        cites=("a 0.8.4:1634-1697 _set_default_args_v1: 8192 / 1024 on a device named H100 / H200, else 2048 / 256",),
    ),
    ServeDefaults(
        "vllm",
        (0, 8, 5),
        "V1",
        (Tier(8192, 1024, min_memory_gib=70), _SMALL),
        engine_env=True,
        cites=(
            "a 0.8.5:1565-1624 _set_default_args_v1: 8192 / 1024 with 70 GiB or more "
            "(get_device_total_memory), else 2048 / 256",
        ),
    ),
    ServeDefaults(
        "vllm",
        (0, 9, 0),
        "V1",
        (Tier(8192, 1024, min_memory_gib=70, name_lacks=("a100",)), _SMALL),
        engine_env=True,
        cites=(
            "a 0.9.0:1460-1549, 0.10.0:1526-1657 _set_default_args_v1: 8192 / 1024 with 70 GiB or more on a device "
            "not named A100 (PR #17885), else 2048 / 256",
        ),
    ),
    ServeDefaults(
        "vllm",
        (0, 10, 1),
        "V1",
        (Tier(8192, 1024, min_memory_gib=70, name_lacks=("a100",)), _SMALL),
        engine_env=True,
        seqs_at_most_tokens=True,
        cites=(
            "a 0.10.1:1584-1715, 0.10.2:1615-1746 _set_default_args_v1: the 0.9 numbers, max_num_seqs at most "
            "max_num_batched_tokens",
        ),
    ),
    ServeDefaults(
        "vllm",
        (0, 11, 0),
        "V1",
        (Tier(8192, 1024, min_memory_gib=70, name_lacks=("a100",)), _SMALL),
        seqs_at_most_tokens=True,
        cites=("a 0.11.0:1540-1682 _set_default_args (V1 only; 1605-1623 the numbers)",),
    ),
    ServeDefaults(
        "vllm",
        (0, 11, 1),
        "V1",
        (Tier(8192, 1024, min_memory_gib=70, name_lacks=("a100",)), _SMALL),
        seqs_at_most_tokens=True,
        tokens_at_most_seqs_x_len=True,
        cites=(
            "a 0.11.1:1864-1944 get_batch_defaults, 1946-2042 _set_default_args: max_num_batched_tokens at most "
            "max_num_seqs * max_model_len",
            "a 0.12.0:1799-1879, 1966-2022, 0.16.0:1848-1929, 2006-2062 get_batch_defaults, "
            "_set_default_max_num_seqs_and_batched_tokens_args: the same",
        ),
    ),
    ServeDefaults(
        "vllm",
        (0, 17, 0),
        "V1",
        (Tier(8192, 1024, min_memory_gib=70, name_lacks=("a100",)), _SMALL),
        seqs_at_most_tokens=True,
        tokens_at_most_seqs_x_len=True,
        throughput_doubles=True,
        cites=(
            "a 0.17.0:1945-2026, 2101-2167 and 0.27.1:2515-2596, 2712-2801 get_batch_defaults, "
            "_set_default_max_num_seqs_and_batched_tokens_args: --performance-mode throughput doubles both "
            "(config/vllm.py 0.17.0:320 default 'balanced')",
        ),
    ),
    ServeDefaults(
        "vllm",
        (0, 28, 0),
        "V1",
        (Tier(16384, 1024, min_memory_gib=160), Tier(8192, 1024, min_memory_gib=70, name_lacks=("a100",)), _SMALL),
        seqs_at_most_tokens=True,
        tokens_at_most_seqs_x_len=True,
        throughput_doubles=True,
        cites=(
            "a 0.28.0:2553-2644 get_batch_defaults: 16384 / 1024 with 160 GiB or more (B200, B300), then the 70 GiB "
            "rule; 0.32.0:2894-2985 the same",
        ),
    ),
    ServeDefaults(
        "vllm",
        (0, 33, 0),
        "V1",
        (
            Tier(16384, 1024, min_memory_gib=160),
            Tier(8192, 1024, min_memory_gib=70, name_lacks=("a100", "gb10")),
            _SMALL,
        ),
        seqs_at_most_tokens=True,
        tokens_at_most_seqs_x_len=True,
        throughput_doubles=True,
        cites=(
            "a 0.33.0:2940-3039, 0.34.0:2977-3076 get_batch_defaults: GB10 (compute capability 12.1) kept on the "
            "small tier; 0.34.0:3188-3277 _set_default_max_num_seqs_and_batched_tokens_args",
        ),
    ),
    # vllm-ascend X runs vLLM X's rule. 0.7.3: vLLM 0.7.3's V0, chunked prefill never on by default (not CUDA).
    ServeDefaults(
        "vllm-ascend",
        (0, 7, 3),
        "V0",
        (_SMALL,),
        base="vllm",
        cites=(
            "inherits vLLM 0.7.3 V0 (vllm/engine/arg_utils.py 0.7.3:224, vllm/config.py 0.7.3:1521-1536); "
            "arg_utils.py 0.7.3:1176 chunked prefill by default only when device_type == 'cuda'",
        ),
    ),
    # From 0.9.1 V1: NPUPlatform reports no total memory, so vLLM's except-branch takes 0 bytes: the small tier.
    ServeDefaults(
        "vllm-ascend",
        (0, 9, 1),
        "V1",
        (_SMALL,),
        base="vllm",
        device_unread=True,
        cites=(
            "inherits vLLM X's rule at 0 bytes: vllm/platforms/interface.py 0.11.0:268-270 get_device_total_memory "
            "raises NotImplementedError and NPUPlatform does not override it (vllm_ascend/platform.py 0.11.0, "
            "0.19.1rc1; 0.23.0.post1:275-281 'DO NOT IMPLEMENT'), so get_batch_defaults' except-branch sets "
            "device_memory = 0",
        ),
    ),
    ServeDefaults(
        "vllm-ascend-310p",
        (0, 14, 0),
        "V1",
        (_SMALL,),
        base="vllm",
        device_unread=True,
        cites=("as vllm-ascend: NPUWorker310 runs on NPUPlatform (no get_device_total_memory)",),
    ),
    # vllm-mindspore 0.2.0 pairs with vLLM 0.7.3 (V0); 0.5 replaces vLLM 0.11.0's _set_default_args.
    ServeDefaults(
        "vllm-mindspore",
        (0, 2, 0),
        "V0",
        (_SMALL,),
        base="vllm",
        cites=(
            "inherits vLLM 0.7.3 V0 (vllm/engine/arg_utils.py 0.7.3:224, vllm/config.py 0.7.3:1521-1536), chunked "
            "prefill by default only on CUDA; vllm-mindspore 0.2.0's own argument handling not read",
        ),
    ),
    ServeDefaults(
        "vllm-mindspore",
        (0, 5, 0),
        "V1",
        (_SMALL,),
        seqs_at_most_tokens=True,
        cites=(
            "vllm_mindspore/engine/arg_utils.py:32-118 @ 0.5.1 its own _set_default_args (installed over vLLM 0.11.0's "
            "at vllm_mindspore/__init__.py:122-124): 2048 / 256 on every device (it skips the memory query), "
            "max_num_seqs at most max_num_batched_tokens",
        ),
    ),
)


@dataclass(frozen=True)
class Chosen:
    """The defaults a serve command runs with, and why."""

    max_num_batched_tokens: int
    max_num_seqs: int
    row: ServeDefaults
    engine: str
    note: str


def row_for(project: str, version: tuple[int, ...]) -> ServeDefaults:
    rows = [r for r in SERVE_DEFAULTS if r.project == project and version >= r.first]
    if not rows:
        raise ValueError(f"no serve-defaults row for {project} {version_text(version)}")
    return rows[-1]


def _v0_chunked(flags_typed: tuple[str, ...], max_model_len: int, platform: str) -> bool:
    if "--enable-chunked-prefill" in flags_typed:
        return True
    if "--no-enable-chunked-prefill" in flags_typed:
        return False
    return max_model_len > V0_LONG_CONTEXT and platform == "cuda"


def serve_defaults(
    release: str,
    *,
    vllm_version: tuple[int, ...],
    memory_bytes: int | None,
    device_name: str,
    max_model_len: int,
    platform: str,
    env: Mapping[str, str] | None = None,
    flags_typed: tuple[str, ...] = (),
    performance_mode: str | None = None,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
) -> Chosen:
    """The max_num_batched_tokens and max_num_seqs ``release``'s ``vllm serve`` runs with. ``max_num_batched_tokens``
    / ``max_num_seqs``: the command's flags where given (kept as given; the defaulted one is clamped against
    them as the release does); ``vllm_version``: the vLLM release underneath (a plugin's pair); ``flags_typed``:
    the boolean flags as typed (``--enable-chunked-prefill``); ``env``: the command's environment
    (``VLLM_USE_V1``)."""
    project, version = parse_release(release)
    row = row_for(project, version)
    rule = row
    if row.base == "vllm" and row.engine == "V1":
        # The plugin inherits the vLLM release's clamps; its device test sees what the platform reports.
        rule = row_for("vllm", vllm_version)
    engine = row.engine
    if rule.engine_env and (env or {}).get("VLLM_USE_V1") == "0":
        engine = "V0"
    memory = 0 if row.device_unread or memory_bytes is None else memory_bytes
    name = "" if row.device_unread else device_name.lower()
    if engine == "V0":
        # A plugin's V0 is its vLLM's; V1's fallback (VLLM_USE_V1=0) is V0's last rule.
        v0 = (
            row
            if row.engine == "V0" and row.base is None
            else row_for("vllm", vllm_version if row.engine == "V0" else (0, 7, 3))
        )
        # V0 sets each on its own (EngineArgs' field, SchedulerConfig's default): no clamp against the other.
        seqs = v0.tiers[-1].max_num_seqs if max_num_seqs is None else max_num_seqs
        chunked = _v0_chunked(flags_typed, max_model_len, platform)
        tokens = (
            max_num_batched_tokens
            if max_num_batched_tokens is not None
            else ((v0.v0_chunked_tokens or 0) if chunked else max(max_model_len, v0.tiers[-1].max_num_batched_tokens))
        )
        how = f"V0, chunked prefill {'on' if chunked else 'off'}"
    else:
        tier = next(t for t in rule.tiers if t.holds(memory, name))
        doubles = 2 if rule.throughput_doubles and performance_mode == "throughput" else 1
        tokens = tier.max_num_batched_tokens * doubles if max_num_batched_tokens is None else max_num_batched_tokens
        seqs = tier.max_num_seqs * doubles if max_num_seqs is None else max_num_seqs
        clamps = []
        # As upstream orders them: the defaulted tokens against the sequences as set, then the defaulted
        # sequences against the tokens as set (a 0.17+ doubled default before either).
        if rule.tokens_at_most_seqs_x_len and max_num_batched_tokens is None and seqs * max_model_len < tokens:
            tokens = seqs * max_model_len
            clamps.append(f"max_num_batched_tokens at most max_num_seqs x max_model_len ({tokens})")
        if (rule.seqs_at_most_tokens or row.seqs_at_most_tokens) and max_num_seqs is None and tokens < seqs:
            seqs = tokens
            clamps.append(f"max_num_seqs at most max_num_batched_tokens ({seqs})")
        how = (
            "V1, "
            + ("the platform reports no memory: " if row.device_unread else "")
            + (
                f"{tier.describe() or ('every device' if len(rule.tiers) == 1 else 'the small tier')}: "
                f"{tier.max_num_batched_tokens} / {tier.max_num_seqs}"
            )
            + "".join(f", {c}" for c in clamps)
        )
    cite = _expand(row.cites[0]) + ("" if rule is row else f"; {_expand(rule.cites[0])}")
    note = f"the serve default of {project} {version_text(version)} ({how}; the {row.name}+ rule: {cite})"
    return Chosen(tokens, seqs, row, engine, note)


def _expand(cite: str) -> str:
    """A cite with the table's short paths spelled out."""
    for short, path in (("a ", "vllm/engine/arg_utils.py "), ("c ", "vllm/config.py ")):
        if cite.startswith(short):
            return path + cite[len(short) :]
    return cite
