"""Startup facts from a vLLM / vllm-ascend / vllm-mindspore log, as people paste it.

Pure parsing: text in, a StartupLog record out. What a log does not say stays None; nothing
is invented. Each line kind below is a template of literal text and numeric slots, matched
without regular-expression backtracking: the first literal is found with ``str.find``, every
later piece must follow it (``…`` skips to the next literal), and a number is one bounded
token. Parsing is linear in the log's size whatever the text; a number longer than
:data:`MAX_NUMBER_CHARS` is refused with a one-line :class:`LogLineError`.

What people paste is not what vLLM wrote, so each line is first cleaned: colour codes (real, or
written out as ``^[[0;36m``) go, runs of blanks become one space. A line holding the start of a
template that does not match whole is tried again joined to the next one or two lines (without
their own log prefix): terminal and markdown wrapping, backslash continuations and a long
message split at a full stop all come back together. The window is three lines, so parsing stays
linear.

A file is read in blocks of whole lines, and a stretch of lines that holds none of the words any of this
could use (the templates', the hints', an OOM's; :meth:`_Reader._quiet`) is counted, not read line by
line: blank lines, junk and a tool's own chatter cost a few substring scans of the stretch. A template
that failed within its line is joined to the next ones only where they bring its first words again. What a
line says on its own (its templates' outcomes, its hints) is kept for the next time the same line comes
(:class:`_Line`, a bounded number of them): a log repeats its lines, rank after rank and restart after restart.
A line that differs from one read before only in its digits (its own time, pid or figures: the same shape) is
read from that one where no digit can change the reading (:meth:`_Line.again`), its figures from its own text.

The templates follow each release's format strings (file:line per release in
``kvguard/vllm/eras.py`` and docs/reference/eras.md, generated from it); each carries the vLLM releases that
write it, so the lines a log holds narrow down its era. OOM messages and refusals are read as
facts (:mod:`kvguard.vllm.oom`); ``kvguard check --from-log`` judges them.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from itertools import repeat
from typing import Any, BinaryIO, Callable, Iterable, Iterator

from kvguard.budget.estimator import FORMULAS, Profile, required_fields
from kvguard.vllm import eras, source_index
from kvguard.vllm.oom import ERROR_IN_METHOD, STEP_WORDS, OomFact, is_oom_line, read_oom, step_in

GIB = 1 << 30
MAX_NUMBER_CHARS = 40
# A line longer than this is not a vLLM log line; skip it rather than scan it.
MAX_LINE_CHARS = 8192
# A line is joined to the next ones only when a template began in it and it is no longer than this (real
# wrapped lines are far shorter), for at most this many templates: a bound on the work a hostile line causes.
MAX_JOIN_CHARS = 2048
MAX_JOIN_KINDS = 6
# An OOM's step is looked for in this many lines up to it; the record tag style in the first this many tags.
STEP_WINDOW_LINES = 400
MAX_TAGGED_LINES = 1000
# Lines (not blank) with no wording the index knows (source_index.line_wording), after which no more are looked
# up (hashing each line costs more than all else the reader does): MAX_WORDING_MISSES of vLLM's own records (a
# line with vLLM's tag) and of lines that cannot be a message (not UTF-8, too short or long), or
# MAX_UNTAGGED_MISSES of other lines. Other programs' output (NCCL_DEBUG=INFO, pip,
# download progress, an init container's chatter) before or between vLLM's lines counts against the larger
# bound only, so that it does not hide the wordings of the lines vLLM writes after it (found in review: 5001
# progress lines before a log changed the era of 10 corpus logs). Each different message is hashed once (up to
# MAX_CACHED_WORDINGS of them at a time).
MAX_WORDING_MISSES = 5000
MAX_UNTAGGED_MISSES = 20_000
MAX_CACHED_WORDINGS = 4096
_WORDINGS: dict[tuple[bool, bytes], str | None] = {}
_ZEROED = bytes.maketrans(b"123456789", b"000000000")
# OOM messages kept (the first stopped the engine; the rest are its echoes from other ranks).
MAX_OOMS = 16
# The end of a line kept to rejoin an anchor a hard wrap cut in two (longer than any template's first literal).
MAX_ANCHOR_CHARS = 120
# Real escape sequences, and the same written out by a paste ("^[[0;36m").
_ANSI = re.compile(r"(?:\x1b|\^\[)\[[0-9;?]{0,32}[A-Za-z]")
_BLANKS = re.compile(r"[ \t\r\f\v]{2,}|[\t\r\f\v]")
# One bounded token; the class repeats once, so matching is linear in its length.
_NUMBER = re.compile(r"[-+]?[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
# A log record's own prefix on a continuation line: "(Worker pid=1) INFO 04-12 08:21:19 [worker.py:267] ",
# "INFO 12-13 19:54:18 worker.py:243] ". Bounded repetition only.
# A host's logger may write the time first ("08:21:19  INFO [worker.py:267] "), one prefix per wrapped line.
_RECORD_PREFIX = re.compile(
    r"^.{0,160}?(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) [0-9]{2}-[0-9]{2} [0-9:.]{8,15} "
    r"|[0-9]{2}:[0-9]{2}:[0-9]{2}(?:[.,][0-9]{1,6})? {1,4}(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"{1,4})\[?[\w./-]{1,80}:[0-9]{1,6}\] ?"
)
# vLLM's record tag: "[gpu_worker.py:360]" from 0.8.0 (logger.py's "[%(fileinfo)s:%(lineno)d]"), and
# "worker.py:243]" without the bracket before (posted 0.6.4-0.7.3 logs; 0.8 logs all carry the bracket).
# A paste that dropped the time keeps the tag: "(EngineCore pid=4600) INFO [kv_cache_utils.py:1777] …". Without
# the time the level must open the line or follow vLLM's process prefix, so that other loggers' "%(asctime)s
# %(levelname)s [%(filename)s:%(lineno)d]" lines (a launcher's, a sweep script's) are not taken for vLLM's.
_TAG = re.compile(
    r"(?:(?:DEBUG|INFO|WARNING|ERROR) [0-9]{2}-[0-9]{2} [0-9:.]{8,15} (\[?)|"
    r"(?:^[ >|`\u258e]{0,8}|\(\w[\w.-]{0,40} pid=[0-9]{1,9}(?:, ip=[0-9.]{1,40})?\) {1,2})"
    r"(?:DEBUG|INFO|WARNING|ERROR) (\[))([\w./-]{1,80}\.py):([0-9]{1,6})\]"
)


# A timestamp with its year ("[2026-02-24T20:21:58Z]", journald's and docker's prefixes): the log was written
# on or after that day, so by a release published by then (vLLM's own records carry no year).
# vLLM's version banners state the release itself: "vLLM API server version %s" (entrypoints/openai/
# api_server.py 0.7.3:912, 0.11.0:1839, 0.14.0:1272), "vLLM server version %s, serving model %s" and the
# logo's "version %s" (log_version_and_model: entrypoints/utils.py 0.20.0:277-299, serve/utils/api_utils.py
# 0.27.0:323-345, common/startup.py 0.34.0:16-38), "Initializing a V1 LLM engine (v%s) with config"
# (v1/engine/core.py 0.7.3:50, 0.11.0:77, 0.34.0:153-157), V0's "Initializing an LLM engine (v%s)"
# (engine/llm_engine.py 0.6.4:249-250, read from the wheel). tests/upstream/test_vllm_real.py logs each through the
# real release's own code and logger.
# A dev, rc or post build counts as the release it is numbered after (0.29.1rc1.dev17: 0.29.1).
_BANNER = re.compile(r"(?:vLLM (?:API |gRPC )?server version |LLM engine \(v)v?([0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3})")
_LOGO_VERSION = re.compile(
    r"\bversion\s{1,4}(?:(?:\x1b|\^\[|\\033|\\x1b|\\e)\[[0-9;]{1,8}m)?v?([0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3})"
)
MAX_BANNERS = 4
_DATED = re.compile(
    r"(?<![0-9])(20[2-9][0-9]-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01]))[T ][0-9]{2}:[0-9]{2}:[0-9]{2}"
)


class LogFileError(ValueError):
    """One line saying why a log file is not read (it is not a regular file)."""


class LogLineError(ValueError):
    """A budget line whose numbers cannot be taken (too long to be a real figure); one line."""


parse_version = eras.parse_version
ALL = (parse_version("0.0.0"), None)


@dataclass(frozen=True)
class LineKind:
    """One startup line: its template, the releases that write it, and the facts it states."""

    name: str
    template: str  # literals, {fact:unit} numbers, … to skip ahead
    releases: tuple[tuple[int, ...], tuple[int, ...] | None] = ALL  # vLLM first..last writing it
    project: str | None = None  # a line only that project writes
    cite: str = ""
    also: Callable[[dict[str, str], dict[str, Any]], None] | None = field(default=None, compare=False)
    pieces: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)
    units: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    anchor: str = field(default="", compare=False, repr=False)  # the first literal, found with str.find
    # Whether no literal holds a digit: then the template reads every line of one shape (its digits made "0") alike.
    digit_free: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        pieces = tuple(_compile(self.template))
        object.__setattr__(
            self, "pieces", tuple((kind, value.partition(":")[0] if kind == "num" else value) for kind, value in pieces)
        )
        object.__setattr__(
            self, "units", {value.partition(":")[0]: value.partition(":")[2] for kind, value in pieces if kind == "num"}
        )
        object.__setattr__(self, "anchor", self.pieces[0][1])
        object.__setattr__(
            self, "digit_free", not any(kind == "lit" and _has_digit(value) for kind, value in self.pieces)
        )

    def match(self, line: str) -> dict[str, str] | None:
        spans = self.match_spans(line)[0]
        return None if spans is None else {fact: line[start:end] for fact, (start, end) in spans.items()}

    def match_reach(self, line: str) -> tuple[dict[str, str] | None, int]:
        """The facts, or None; and how much of the line decided that (``UNDECIDED`` where what follows it
        might): no text appended to a line that failed within its reach makes it match, unless the reach is
        negative (``-1 - reach``) and the text appended holds the anchor (a later occurrence is tried too)."""
        spans, reach = self.match_spans(line)
        return (None if spans is None else {fact: line[start:end] for fact, (start, end) in spans.items()}), reach

    def match_spans(self, line: str) -> tuple[dict[str, tuple[int, int]] | None, int]:
        """:meth:`match_reach` with each fact as where its figure stands in the line (start, end)."""
        anchor = self.anchor
        start = line.find(anchor)
        tries = reach = 0
        while start >= 0 and tries < MAX_ANCHOR_TRIES:
            found, looked = _match_from(self.pieces, line, start)
            if found is not None:
                return found, looked
            reach = max(reach, looked)
            tries += 1
            start = line.find(anchor, start + 1)
        # Fewer tries than the most: an occurrence of the anchor in appended text would be tried too.
        return None, reach if tries == MAX_ANCHOR_TRIES else -1 - reach


def _has_digit(text: str) -> bool:
    return any(map(text.__contains__, "0123456789"))


def _compile(template: str) -> Iterator[tuple[str, str]]:
    """``"took {weights_bytes:gib} GiB … and"`` -> (lit, "took "), (num, "weights_bytes:gib"), (lit, " GiB"),
    (skip, ""), (lit, " and"). A slot names the fact it states and its unit (gib, int, float)."""
    end = template.endswith("$")
    for part in re.split(r"(\{[a-z_0-9]+:[a-z]+\}|…)", template[:-1] if end else template):
        if not part:
            continue
        if part == "…":
            yield ("skip", "")
        elif part.startswith("{"):
            yield ("num", part[1:-1])
        else:
            yield ("lit", part)
    if end:
        yield ("end", "")


# A number token's end depends on up to this many characters after it (",ddd" of a thousands group).
_NUMBER_LOOKAHEAD = 5
UNDECIDED = sys.maxsize
MAX_ANCHOR_TRIES = 4


def _match_from(
    pieces: tuple[tuple[str, str], ...], line: str, pos: int
) -> tuple[dict[str, tuple[int, int]] | None, int]:
    """Where each fact a template states from ``pos`` stands (start, end), or None; and the reach that decided it
    (see LineKind.match_reach)."""
    found: dict[str, tuple[int, int]] = {}
    skipping = False
    reach = pos
    for kind, value in pieces:
        if kind == "skip":
            skipping = True
            continue
        if kind == "end":
            if line[pos:].strip(" .,;"):
                return None, max(reach, len(line))  # what is left stays, whatever follows
            reach = UNDECIDED
            continue
        if kind == "lit":
            if skipping:
                at = line.find(value, pos)
                if at < 0:
                    return None, UNDECIDED
                pos = at
                skipping = False
            elif not line.startswith(value, pos):
                return None, max(reach, pos + len(value))
            pos += len(value)
            reach = max(reach, pos)
            continue
        token = _NUMBER.match(line, pos)
        if token is None:
            return None, max(reach, pos + 2)  # a sign and the character after it
        text = token.group()
        if len(text) > MAX_NUMBER_CHARS:
            raise LogLineError(f"number {text[:12]}… ({len(text)} characters) is too long for a memory figure")
        pos = token.end()
        found[value] = (token.start(), pos)
        reach = max(reach, pos + _NUMBER_LOOKAHEAD)
    return found, reach


def _decimals(slot: str, key: str) -> Callable[[dict[str, str], dict[str, Any]], None]:
    def record(found: dict[str, str], f: dict[str, Any]) -> None:
        f.setdefault("_decimals", {})[key] = len(found[slot].partition(".")[2])

    return record


def _kv_cache_memory_decided(found: dict[str, str], f: dict[str, Any]) -> None:
    f.setdefault("available_kv_cache_bytes", f["kv_cache_memory_bytes"])


def _first_settled_len(found: dict[str, str], f: dict[str, Any]) -> None:
    f.setdefault("max_model_len", int(found["_settled_len"]))


def _cudagraph_utilization(found: dict[str, str], f: dict[str, Any]) -> None:
    f.setdefault("gpu_memory_utilization", f["_cudagraph_util"])


def _cudagraph_off(found: dict[str, str], f: dict[str, Any]) -> None:
    # The estimate was measured but not applied (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0): vLLM took 0.
    f.setdefault("gpu_memory_utilization", f.pop("_cudagraph_util_off"))
    f["cudagraph_memory_bytes"] = 0


def _halved(found: dict[str, str], f: dict[str, Any]) -> None:
    f["halved_for_workspace"] = True


def _refusal(reason: str) -> Callable[[dict[str, str], dict[str, Any]], None]:
    def record(found: dict[str, str], f: dict[str, Any]) -> None:
        f.setdefault("refusal", reason)

    return record


# The templates, by the releases that write them (research: the wheels' format strings; where no wheel
# was at hand, the posted logs of tests/data/logs/real, named by their manifest id).
KINDS: tuple[LineKind, ...] = (
    # Weights: "%.4f GiB and %.6f seconds" (0.10.2-0.11), "… GiB memory and …" (0.12+ v1 runner),
    # format_gib (2 decimals) from 0.14; V0's "Loading model weights took %.4f GB" divides by 2**30 too.
    LineKind(
        "model_loading",
        "Model loading took {weights_bytes:gib} GiB memory",
        releases=(parse_version("0.12.0"), None),
        also=_decimals("weights_bytes", "weights"),
        cite="v1/worker/gpu_model_runner.py 0.14.0:3906; v1/worker/gpu/model_runner.py 0.34.0:442",
    ),
    LineKind(
        "model_loading",
        "Model loading took {weights_bytes:gib} GiB and",
        releases=(parse_version("0.8.5"), parse_version("0.11.2")),
        cite="v1/worker/gpu_model_runner.py 0.11.0:2653 '%.4f GiB and %.6f seconds'; real r05 (0.8.5.dev)",
    ),
    LineKind(
        "model_loading",
        "Model loading took {weights_bytes:gib} GB",
        releases=(parse_version("0.8.0"), parse_version("0.10.1")),
        cite="v1/worker/gpu_model_runner.py 0.8.x '%.4f GB and' (issue 19's posted 0.8 logs)",
    ),
    LineKind(
        "model_loading",
        "Loading model weights took {weights_bytes:gib} GB",
        releases=(parse_version("0.6.4"), parse_version("0.8.4")),
        cite="worker/model_runner.py 0.6.4:1077; V1 gpu_model_runner.py 0.7.1 (real r19); vllm-ascend "
        "model_runner_v1.py",
    ),
    # "Initial free memory: %.2f GiB; Requested memory: %.2f (util), %.2f GiB" (<= 0.13, util 2 decimals);
    # "%s GiB; Requested memory: %f (util), %s GiB" (0.14+, util 6 decimals).
    LineKind(
        "requested_memory",
        "Initial free memory: {init_free_memory_bytes:gib} GiB; Requested memory: "
        "{gpu_memory_utilization:float} (util), {requested_memory_bytes:gib} GiB",
        releases=(parse_version("0.9.1"), None),
        also=_decimals("gpu_memory_utilization", "util"),
        cite="w 0.11.0:284-290, 0.14.0:347, 0.34.0:784",
    ),
    LineKind(
        "kv_cache_memory_bytes",
        "Initial free memory {init_free_memory_bytes:gib} GiB, reserved {kv_cache_memory_bytes:gib}…"
        "memory for KV Cache as specified by kv_cache_memory_bytes config",
        releases=(parse_version("0.9.1"), None),
        also=_kv_cache_memory_decided,
        cite="w 0.11.0:240-251, 0.14.0:299-312, 0.34.0:696-708",
    ),
    # 0.10.2-0.11 wrote "This does does not respect" in that line (w 0.11.0:245); 0.12 fixed the words.
    LineKind(
        "era_hint",
        "skipped memory profiling. This does does not respect",
        releases=(parse_version("0.9.1"), parse_version("0.11.2")),
        cite="w 0.11.0:240-251, 0.13.0:316-327",
    ),
    LineKind(
        "profile_peak",
        "Total non KV cache memory: {non_kv_cache_bytes:gib}GiB; torch peak memory increase: "
        "{peak_allocated_increase_bytes:gib}GiB; non-torch forward increase memory: "
        "{non_torch_increase_bytes:gib}GiB; weights memory: {weights_bytes:gib}GiB",
        releases=(parse_version("0.9.1"), parse_version("0.26.0")),
        cite="utils/__init__.py 0.11.0:2771-2779; mu 0.14.0:187-198",
    ),
    LineKind(
        "profile_consumed",
        "Total non KV cache memory: {non_kv_cache_bytes:gib}GiB; torch peak memory increase: "
        "{peak_allocated_increase_bytes:gib}GiB; total consumed (from mem_get_info): "
        "{total_consumed_bytes:gib}GiB; weights memory: {weights_bytes:gib}GiB",
        releases=(parse_version("0.27.0"), None),
        cite="mu 0.27.0:220-231, 0.34.0:231-242",
    ),
    LineKind(
        "init_snapshot",
        "worker init memory snapshot: …free_memory={_snapshot_free:gib}GiB, total_memory={total_memory_bytes:gib}GiB",
        releases=(parse_version("0.14.0"), None),
        cite="w 0.14.0:235; mu 0.14.0:91-102 MemorySnapshot.__repr__",
    ),
    LineKind(
        "cudagraph",
        "CUDA graph memory profiling is enabled (default since v0.21.0). The current "
        "--gpu-memory-utilization={_cudagraph_util:float} is equivalent to --gpu-memory-utilization="
        "{_cudagraph_equiv:float} without",
        releases=(parse_version("0.20.0"), None),
        cite="w 0.20.0:445-468, 0.27.0:568-591, 0.34.0:800-820",
        also=_cudagraph_utilization,
    ),
    # vllm-ascend words the same line for its ACL graphs.
    LineKind(
        "acl_graph",
        "ACL graph memory profiling is enabled (default since v0.22.1). The current "
        "--gpu-memory-utilization={_cudagraph_util:float} is equivalent to --gpu-memory-utilization="
        "{_cudagraph_equiv:float} without",
        also=_cudagraph_utilization,
        cite="vllm-ascend's NPU worker (issue 35's quote of a vllm-ascend log; no era row names it yet)",
    ),
    LineKind(
        "cudagraph",
        "CUDA graph memory profiling is enabled (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1)."
        "…The current --gpu-memory-utilization={_cudagraph_util:float} is equivalent to "
        "--gpu-memory-utilization={_cudagraph_equiv:float} without",
        releases=(parse_version("0.18.0"), parse_version("0.19.1")),
        cite="w 0.18.0:472-484, 0.19.0:453",
    ),
    # The estimate measured but not applied: 0.18/0.19's notice of the coming default, and from 0.20 the
    # warning when it is switched off; both state the utilization and what it would become.
    LineKind(
        "cudagraph_off",
        "In v0.19, CUDA graph memory profiling will be enabled by default…from {_cudagraph_util_off:float} to",
        releases=(parse_version("0.18.0"), parse_version("0.18.99")),
        also=_cudagraph_off,
        cite="w 0.18.0 (issue 19's quote: '… from 0.8200 to 0.8283'; no 0.18 wheel here)",
    ),
    LineKind(
        "cudagraph_off",
        "CUDA graph memory profiling is disabled…--gpu-memory-utilization from {_cudagraph_util_off:float} to",
        releases=(parse_version("0.18.0"), None),
        also=_cudagraph_off,
        cite="w 0.20.0:472-480, 0.27.0:595-603, 0.34.0:829",
    ),
    # The estimate line exists wherever the estimate does: 0.18 measures it too, applied or not.
    LineKind(
        "cudagraph_estimate",
        "Estimated CUDA graph memory: {cudagraph_estimate_bytes:gib} GiB total",
        releases=(parse_version("0.18.0"), None),
        cite="v1/worker/gpu_model_runner.py 0.20.0:5963-6045; w 0.18.0:384-399",
    ),
    LineKind(
        "cudagraph_pool",
        "CUDA graph pool memory: {cudagraph_actual_bytes:gib} GiB (actual), "
        "{cudagraph_estimate_bytes:gib} GiB (estimated)",
        releases=(parse_version("0.18.0"), None),
        cite="w 0.20.0:600, 0.27.0:727, 0.34.0:1113",
    ),
    LineKind(
        "graph_captured",
        "Graph capturing finished in … took {cudagraph_actual_bytes:gib} GiB",
        cite="v1/worker/gpu_model_runner.py 0.11.0:3480, 0.27.0:6914; gpu/model_runner.py 0.34.0:1217",
    ),
    # kvguard's own plugin, heard in vLLM's log: the budget it applied in place of vLLM's printed one.
    LineKind(
        "kvguard_budget",
        "kvguard: KV cache budget {_kvguard_budget:gib} GiB (",
        cite="kvguard/plugin/hooks.py _wrap_determine_available_memory, kvguard/plugin/budget.py guard_budget",
    ),
    LineKind(
        "available_kv_cache",
        "Available KV cache memory: {_available_profiled:gib} GiB",
        also=_decimals("_available_profiled", "available"),
        cite="w 0.11.0:298, 0.12.0:360, 0.13.0:376 '%.2f'; 0.14.0:358-362, 0.34.0:795-798 format_gib",
    ),
    LineKind(
        "kv_cache_size",
        " KV cache size: {kv_cache_tokens:int} tokens",
        cite="v1/core/kv_cache_utils.py 0.11.0:1079-1092; 0.34.0:1157-1176 (one line with the concurrency)",
    ),
    LineKind(
        "max_concurrency",
        "Maximum concurrency for {max_model_len:int} tokens per request: {max_concurrency:float}x",
        cite="v1/core/kv_cache_utils.py 0.11.0:1079-1092, 0.30.0:2385-2401",
    ),
    LineKind(
        "warmup_measured",
        "Memory after warmup: … GiB free, … GiB committed to the KV cache, … GiB kept for transient "
        "activations (… GiB allocated at peak, … GiB of torch reservation growth); {_warmup_blocks:int} "
        "KV cache blocks ({_warmup_kv:gib} GiB) fit within the requested ",
        releases=(parse_version("0.34.0"), None),
        cite="v1/worker/extensible_kv_cache.py 0.34.0:693-709",
    ),
    LineKind(
        "extended_kv_cache",
        "Extended KV cache to {num_gpu_blocks:int} blocks ({_extended_kv:gib} GiB)",
        releases=(parse_version("0.34.0"), None),
        cite="v1/worker/extensible_kv_cache.py 0.34.0:536-540",
    ),
    # The end-of-startup summary (compile_or_warm_up_model), read whole: its first part states the device and
    # the request; "Actual usage" the profile; the last sentence the KV cache in use.
    LineKind(
        "startup_summary",
        "Free memory on device …({init_free_memory_bytes:gib}/{total_memory_bytes:gib} GiB) "
        "on startup. Desired GPU memory utilization is ({gpu_memory_utilization:float}, "
        "{requested_memory_bytes:gib} GiB)",
        cite="w 0.11.0:372-378, 0.27.0:768-773, 0.34.0:1154-1159 (first release not known: no narrowing)",
    ),
    LineKind(
        "summary_usage_peak",
        "Actual usage is {weights_bytes:gib} GiB for weight, {peak_activation_bytes:gib} GiB "
        "for peak activation, {non_torch_memory_bytes:gib} GiB for non-torch memory, and "
        "{cudagraph_actual_bytes:gib} GiB for CUDAGraph memory",
        releases=(ALL[0], parse_version("0.26.0")),
        cite="w 0.11.0:379-382, 0.20.0:648",
    ),
    LineKind(
        "summary_usage_consumed",
        "Actual usage is {total_consumed_bytes:gib} GiB for consumed memory (weights + "
        "non-torch), {peak_activation_bytes:gib} GiB for peak activation, and {cudagraph_actual_bytes:gib} GiB "
        "for CUDAGraph memory",
        releases=(parse_version("0.27.0"), None),
        cite="w 0.27.0:774-777, 0.34.0:1160-1163",
    ),
    LineKind(
        "summary_kv_in_use",
        "Current kv cache memory in use is {_kv_in_use:gib} GiB",
        cite="w 0.11.0:389, 0.27.0:784, 0.34.0:1170",
    ),
    # vllm-ascend's NPUWorker summary (vllm-project/vllm-ascend PR #8289, real r06).
    LineKind(
        "ascend_summary",
        "Actual usage: {weights_bytes:gib} GiB for weights, {peak_activation_bytes:gib} GiB for "
        "peak activation, {non_torch_memory_bytes:gib} GiB for non-torch memory, {cudagraph_actual_bytes:gib} GiB "
        "for NPU graph memory",
        project="vllm-ascend",
        cite="vllm_ascend/worker/worker.py (PR #8289, 2026-04)",
    ),
    # Refusals: the worker stops before or instead of allocating the KV cache.
    LineKind(
        "refusal_free",
        "Free memory on device (…{init_free_memory_bytes:gib}/{total_memory_bytes:gib} GiB) on "
        "startup is less than desired GPU memory utilization ({gpu_memory_utilization:float}, "
        "{requested_memory_bytes:gib} GiB)",
        releases=(parse_version("0.9.1"), parse_version("0.13.0")),
        also=_refusal("free_memory"),
        cite="w 0.11.0:186-194, 0.12.0:240-246, 0.13.0:248-254 (no device name; 0.14 names it)",
    ),
    LineKind(
        "refusal_free",
        "Free memory on device cuda:…({init_free_memory_bytes:gib}/{total_memory_bytes:gib} GiB) "
        "on startup is less than desired GPU memory utilization ({gpu_memory_utilization:float}, "
        "{requested_memory_bytes:gib} GiB)",
        releases=(parse_version("0.14.0"), None),
        also=_refusal("free_memory"),
        cite="wu 0.14.0:262-268, 0.34.0:789-796 'Free memory on device {device_}'",
    ),
    LineKind(
        "refusal_free",
        "Free memory on device …({init_free_memory_bytes:gib}/{total_memory_bytes:gib} GiB) on "
        "startup is less than desired GPU memory utilization ({gpu_memory_utilization:float}, "
        "{requested_memory_bytes:gib} GiB)",
        also=_refusal("free_memory"),
        cite="any device name (npu:0, xpu:0)",
    ),
    LineKind(
        "refusal_profiling",
        "Error in memory profiling. Initial free memory {init_free_memory_bytes:gib} GiB, "
        "current free memory {_free_after_profile:gib} GiB",
        also=_refusal("profiling_error"),
        cite="w 0.11.0:271-276, 0.27.0:535-544, 0.34.0:755-760 (the assertion)",
    ),
    LineKind(
        "refusal_no_kv",
        "No available memory for the cache blocks",
        also=_refusal("no_kv_memory"),
        cite="v1/core/kv_cache_utils.py 0.11.0:699, 0.27.0:759; kv_cache_planning.py 0.34.0:108",
    ),
    LineKind(
        "refusal_seq_len",
        "The model's max seq len ({max_model_len:int}) is larger than the maximum number of "
        "tokens that can be stored in KV cache ({kv_cache_tokens:int})",
        releases=(parse_version("0.6.4"), parse_version("0.8.4")),
        also=_refusal("max_seq_len"),
        cite="worker/worker.py 0.6.4 raise_if_cache_size_invalid",
    ),
    LineKind(
        "refusal_seq_len_v1",
        "To serve at least one request with the models's max seq len ({max_model_len:int}), "
        "({needed_kv_cache_bytes:gib} GiB KV cache is needed, which is larger than the available KV cache "
        "memory ({_available_refused:gib} GiB)",
        releases=(parse_version("0.8.0"), parse_version("0.26.0")),
        also=_refusal("max_seq_len"),
        cite="v1/core/kv_cache_utils.py 0.11.0:716-720, 0.20.0:715-718",
    ),
    LineKind(
        "refusal_seq_len_v1",
        "To serve at least one request with the model's max seq len ({max_model_len:int}), "
        "({needed_kv_cache_bytes:gib} GiB KV cache is needed, which is larger than the available KV cache "
        "memory ({_available_refused:gib} GiB)",
        releases=(parse_version("0.27.0"), None),
        also=_refusal("max_seq_len"),
        cite="v1/core/kv_cache_utils.py 0.27.0:779-782; kv_cache_planning.py 0.34.0:125-128",
    ),
    # The same refusal cut short or re-wrapped by a paste: its first words and the model length are enough (their
    # wording, "models's" or "model's", still tells the releases apart).
    LineKind(
        "refusal_seq_len_v1",
        "To serve at least one request with the models's max seq len ({max_model_len:int})",
        releases=(parse_version("0.8.0"), parse_version("0.26.0")),
        also=_refusal("max_seq_len"),
        cite="v1/core/kv_cache_utils.py 0.11.0:716, 0.20.0:715 (the message's start)",
    ),
    LineKind(
        "refusal_seq_len_v1",
        "To serve at least one request with the model's max seq len ({max_model_len:int})",
        releases=(parse_version("0.27.0"), None),
        also=_refusal("max_seq_len"),
        cite="v1/core/kv_cache_utils.py 0.27.0:779; kv_cache_planning.py 0.34.0:125 (the message's start)",
    ),
    LineKind(
        "refusal_seq_len_v1",
        "To serve at least one request with the model…max seq len ({max_model_len:int})",
        releases=(parse_version("0.8.0"), None),
        also=_refusal("max_seq_len"),
        cite="v1/core/kv_cache_utils.py 0.11.0:716, 0.27.0:779 (the message's start)",
    ),
    # The maximum model length the engine settled on (config/model.py 0.11.0:1510, 0.34.0:2214).
    # The first one is the served model's: a speculative draft's config logs its own after it
    # (v1/worker/gpu/spec_decode/speculator_config.py 0.34.0:191).
    LineKind(
        "max_model_len",
        "Using max model len {_settled_len:int}$",
        also=_first_settled_len,
        cite="config/model.py 0.11.0:1510 'Using max model len %s', 0.34.0:2214",
    ),
    # The engine's arguments as given ("non-default args: {'model': …, 'max_model_len': 4096, …}"): what was
    # asked, taken only where no line states what the engine settled on.
    LineKind(
        "non_default_args",
        "non-default args: {…'max_model_len': {_args_len:int}",
        cite="entrypoints/utils.py log_non_default_args 0.10.0+",
    ),
    LineKind(
        "non_default_args",
        "non-default args: {…'gpu_memory_utilization': {_args_util:float}",
        cite="entrypoints/utils.py log_non_default_args 0.10.0+",
    ),
    # vllm-ascend's platform sets 128-token blocks: "Block size is set to 128 if prefix cache or chunked
    # prefill is enabled." (vllm_ascend/utils.py 0.14.0rc1:1141, 0.23.0.post1:1404; not in 0.11.0); vLLM has
    # no such line (0.34.0).
    LineKind(
        "block_size",
        "Block size is set to {block_size:int}",
        cite="vllm_ascend/utils.py 0.14.0rc1:1141, 0.23.0.post1:1404",
    ),
    # Hybrid (mamba + attention) models: the attention block size vLLM chose, in tokens.
    LineKind(
        "block_size",
        "Setting attention block size to {block_size:int} tokens",
        cite="model_executor/models/config.py 0.11.0:377, 0.14.0:477; platforms/interface.py 0.20.0:607, "
        "0.34.0:1121; platforms/xpu.py 0.34.0:519",
    ),
    LineKind(
        "free_on_startup",
        "Free memory on device (…/{total_memory_bytes:gib} GiB) on startup. Desired GPU memory "
        "utilization is ({gpu_memory_utilization:float}",
        cite="w 0.11.0:372-377",
    ),
    # V0's worker (worker/worker.py): its lines pin the V0 row (the V0 engine stayed selectable
    # until 0.10, but kvguard's table follows each release's default engine).
    LineKind(
        "v0_can_use",
        "can use total_gpu_memory ({total_memory_bytes:gib}GiB) x gpu_memory_utilization "
        "({gpu_memory_utilization:float})",
        releases=(parse_version("0.6.6"), parse_version("0.8.4")),
        cite="worker/worker.py 0.7.0 determine_num_available_blocks",
    ),
    LineKind(
        "v0_requested",
        "x gpu_memory_utilization ({_v0_util:float}) = {requested_memory_bytes:gib}GiB",
        releases=(parse_version("0.6.6"), parse_version("0.8.4")),
        cite="worker/worker.py 0.7.0",
    ),
    LineKind(
        "v0_breakdown",
        "model weights take {weights_bytes:gib}GiB; non_torch_memory takes {non_torch_increase_bytes:gib}GiB; "
        "PyTorch activation peak memory takes {peak_allocated_increase_bytes:gib}GiB; the rest of the memory "
        "reserved for KV Cache is {_available_profiled:gib}GiB",
        releases=(parse_version("0.6.6"), parse_version("0.8.4")),
        cite="worker/worker.py 0.7.0",
    ),
    # 0.6.5's "Memory profiling results:" table, one figure a line (PR #10511, real r01/r38).
    *(
        LineKind(
            "v0_table",
            f"] {figure}$",
            releases=(parse_version("0.6.5"), parse_version("0.6.5")),
            cite="worker/worker.py 0.6.5:243",
        )
        for figure in (
            "total_gpu_memory {total_memory_bytes:gib}GiB",
            "gpu_memory_utilization {gpu_memory_utilization:float}",
            "the current vLLM instance can use {requested_memory_bytes:gib}GiB",
            "model weights take {weights_bytes:gib}GiB",
            "non_torch_memory {non_torch_increase_bytes:gib}GiB",
            "PyTorch activation peak memory {peak_allocated_increase_bytes:gib}GiB",
            "available_kv_cache_memory {_available_profiled:gib}GiB",
        )
    ),
    LineKind(
        "v0_results",
        "Memory profiling results: total_gpu_memory={total_memory_bytes:gib}GiB…peak_torch_memory="
        "{peak_torch_memory_bytes:gib}GiB…non_torch_memory={non_torch_increase_bytes:gib}GiB kv_cache_size="
        "{_available_profiled:gib}GiB gpu_memory_utilization={gpu_memory_utilization:float}",
        releases=(parse_version("0.6.4"), parse_version("0.6.4")),
        cite="worker/worker.py 0.6.4:232-243",
    ),
    # "# GPU blocks: %d, # CPU blocks: %d"; later "# %s blocks" with the device name (cuda, CUDA, npu, …).
    # Anchored on the device word, not on "#": a paste that lost the first "#" must not read the CPU count.
    LineKind(
        "v0_blocks",
        "GPU blocks: {num_gpu_blocks:int}",
        releases=(parse_version("0.6.4"), parse_version("0.8.4")),
        cite="executor/gpu_executor.py 0.6.4:113; v1/core/kv_cache_utils.py 0.7.1:395 (real r19)",
    ),
    *(
        LineKind(
            "v0_blocks",
            f"{device} blocks: {{num_gpu_blocks:int}}",
            releases=(parse_version("0.6.4"), parse_version("0.8.4")),
            cite="executor/executor_base.py 0.7.0:110 '# %s blocks'",
        )
        for device in ("cuda", "CUDA")
    ),
    LineKind(
        "v0_blocks",
        "npu blocks: {num_gpu_blocks:int}",
        releases=(parse_version("0.6.4"), parse_version("0.8.4")),
        cite="executor/executor_base.py 0.8.5:112 on vllm-ascend (real r20)",
    ),
    # vllm-ascend's NPUWorker (worker_v1.py), absolute bytes.
    LineKind(
        "ascend_available",
        "Available memory: {_available_profiled:int}, total memory: {total_memory_bytes:int}",
        project="vllm-ascend",
        cite="vllm_ascend/worker/worker_v1.py 0.11.0:257; worker.py 0.13.0:309",
    ),
    LineKind(
        "ascend_halved",
        "(halved for workspace)",
        project="vllm-ascend-310p",
        also=_halved,
        cite="vllm_ascend/_310p/worker_310p.py 0.23.0.post1:118-122 NPUWorker310 (0.21.0rc1+)",
    ),
    # NPUWorker310's own lines (what vllm-ascend runs on a 310P): the ATB warm-up it skips, at every release
    # (worker_310p.py 0.14.0rc1:37, 0.17.0rc1:52, 0.18.0:109, 0.23.0.post1:127), and from 0.18 its own budget line.
    LineKind(
        "ascend_310p",
        "Skip warm-up atb ops for 310P device",
        project="vllm-ascend-310p",
        cite="vllm_ascend/_310p/worker_310p.py 0.17.0rc1:52, 0.23.0.post1:127",
    ),
    LineKind(
        "ascend_310p",
        "Using NPUWorker310 and NPUModelRunner310",
        project="vllm-ascend-310p",
        cite="vllm_ascend/_310p/worker_310p.py 0.23.0.post1:40",
    ),
    LineKind(
        "ascend_310p_available",
        "worker_310p.py:…] Available KV cache memory: {_available_profiled:gib} GiB",
        project="vllm-ascend-310p",
        cite="vllm_ascend/_310p/worker_310p.py 0.18.0:100-104, 0.23.0.post1:118-122",
    ),
    # The platform plugin a log names tells vllm-ascend and vllm-mindspore apart from vLLM. vllm-mindspore
    # 0.5 has no platform plugin: its own logger names it (issue 24: "vllm-mindspore[logger.py:75]").
    LineKind(
        "platform_plugin",
        "-> vllm_mindspore:",
        project="vllm-mindspore",
        cite="vllm/plugins/__init__.py 'Available plugins for group vllm.platform_plugins'",
    ),
    LineKind("platform_plugin", "-> vllm_ascend:", project="vllm-ascend"),
    LineKind(
        "mindspore_logger",
        "vllm-mindspore[",
        project="vllm-mindspore",
        cite="vllm_mindspore/logger.py 0.5.1:33-34,73-75 the 'vllm-mindspore[%(filename)s:%(lineno)d]' prefix",
    ),
)

# The kinds by their first literal: a line holding none of these cannot match any template.
_BY_ANCHOR: tuple[tuple[str, tuple[LineKind, ...]], ...] = tuple(
    (anchor, tuple(k for k in KINDS if k.anchor == anchor)) for anchor in dict.fromkeys(k.anchor for k in KINDS)
)
# Whether a line holds any template's first words, in one scan: most lines of a log hold none, and a line of
# MAX_LINE_CHARS then costs one pass, not one per anchor. Longest first, so a longer anchor is not hidden.
_ANY_ANCHOR = re.compile("|".join(re.escape(a) for a, _ in sorted(_BY_ANCHOR, key=lambda item: -len(item[0]))))
_LONGEST_ANCHOR = max(len(a) for a, _ in _BY_ANCHOR)


def _gate_words(words: tuple[str, ...], phrases: Iterable[str]) -> tuple[str, ...]:
    """``words``, and the longest word of each phrase that holds none of them: a text holding none of these
    holds none of the phrases. A text is scanned once per word, so few words are chosen (each held by many
    phrases); none holds a blank, so cleaning a line (:func:`_clean`) cannot make one appear."""
    kept = list(words)
    for phrase in phrases:
        if not any(word in phrase for word in kept):
            kept.append(max(phrase.split(), key=len))
    return tuple(kept)


# The anchors' words, each anchor with the first word it holds: a line is searched for the anchors whose word
# it holds, in _BY_ANCHOR's order, not for all of them.
_ANCHOR_WORDS = _gate_words(
    ("emory", "odel", "lock", "cache", "vllm", "Actual", "curren", "work", "-default", "finished", "warm-up"),
    (a for a, _ in _BY_ANCHOR),
)
_GATED_ANCHORS = tuple((next(w for w in _ANCHOR_WORDS if w in anchor), anchor, kinds) for anchor, kinds in _BY_ANCHOR)
_CANDIDATES: dict[tuple[str, ...], tuple[tuple[str, tuple["LineKind", ...]], ...]] = {}
MAX_CANDIDATE_SETS = 4096
# Two characters a hard wrap can split an anchor between: the last of one line and the first of the next.
_ANCHOR_PAIRS = frozenset(a[i : i + 2] for a, _ in _BY_ANCHOR for i in range(len(a) - 1))
_DIGIT_ANCHORS = frozenset(a for a, _ in _BY_ANCHOR if _has_digit(a))


def _anchors_in(line: str) -> tuple[tuple[str, tuple["LineKind", ...]], ...]:
    """The anchors a line may hold, in _BY_ANCHOR's order (each still to be looked for)."""
    present = tuple(filter(line.__contains__, _ANCHOR_WORDS))
    if not present:
        return ()
    found = _CANDIDATES.get(present)
    if found is None:
        if len(_CANDIDATES) >= MAX_CANDIDATE_SETS:
            _CANDIDATES.clear()
        found = _CANDIDATES[present] = tuple(
            (anchor, kinds) for word, anchor, kinds in _GATED_ANCHORS if word in present
        )
    return found


# Words that only an Ascend engine's log holds (its device, its worker files, its package).
_ASCEND_WORDS = (
    "vllm_ascend",
    "vllm-ascend",
    "NPU out of memory",
    "npu blocks",
    "NPU graph memory",
    "NPUWorker",
    "worker_v1.py",
    "model_runner_v1.py",
    "ASCEND_RT_VISIBLE_DEVICES",
    "PYTORCH_NPU_ALLOC_CONF",
    "Block size is set to 128",
)
_MINDSPORE_WORDS = ("vllm_mindspore", "vllm-mindspore", "mindspore")
_ASCEND_GATE = ("NPU", "blocks", "scend", "ASCEND", "_v1.py", "Block")  # each of _ASCEND_WORDS holds one
# A line's words that may change what the reader knows, beyond the anchors (its hints, an OOM and the step it
# happened in, a pasted command line, a written-out escape sequence). A stretch of lines holding none of these
# (nor a date, :data:`_DATE_START`) changes nothing but the line count, once the wordings are no longer looked up.
_QUIET_WORDS = _gate_words(
    (
        "emory",
        "odel",
        "cache",
        "lock",
        "aptur",
        "vllm",
        "request",
        "Actual",
        "curren",
        "warm",
        "_run",
        "work",
        "executin",
        "lize_fro",
        "plicatio",
        "-default",
        "POST",
        "\x1b[",
        "^[[",
    ),
    (
        *(a for a, _ in _BY_ANCHOR),
        *(w for w, _ in STEP_WORDS),
        "out of memory",
        "OutOfMemoryError",
        ERROR_IN_METHOD,
        "--max-model-len",
        "--gpu-memory-utilization",
    ),
)
_QUIET_WORDS_UNTIL = (
    # (hint, the words that may change it, whether it is settled)
    ("tags", (".py:",), lambda r: r.tagged >= MAX_TAGGED_LINES),
    ("frames", ("File",), lambda r: len(r.hints["frames"]) >= source_index.MAX_HINTS),
    ("ascend", _ASCEND_GATE, lambda r: r.hints["ascend"]),
    ("mindspore", ("mindspore",), lambda r: r.hints["mindspore"]),
    ("engine_core", ("(EngineCore",), lambda r: r.hints["engine_core"]),
    ("versions", ("version", "engine"), lambda r: len(r.hints["versions"]) >= MAX_BANNERS),
)
_DATE_START = re.compile(r"20[2-9][0-9]-")
# Lines are read a stretch of about this many characters at a time; a quiet stretch is counted, not read.
STRETCH_CHARS = 4096
MIN_STRETCH_CHARS = 64
MIN_STRETCH_LINES = 16  # fewer lines than this are read one by one, not looked at in smaller stretches
# The kinds some era row lists: the others (refusals, OOMs, block sizes) narrow nothing on a platform.
_ROW_KINDS = frozenset(k for e in eras.ERAS for k in e.log_lines) | {k.name for k in KINDS if k.project}


@dataclass(frozen=True)
class StartupLog:
    """What one startup log says. Sizes in bytes; log sizes carry vLLM's 0.01 GiB rounding."""

    era: str | None = None  # the era table row the lines pin down, if one
    era_candidates: tuple[str, ...] = ()  # every row consistent with the lines seen
    era_reason: str = ""  # why that row, or why not one
    project: str = "vllm"
    total_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    init_free_memory_bytes: int | None = None
    requested_memory_bytes: int | None = None
    weights_bytes: int | None = None
    peak_allocated_increase_bytes: int | None = None
    non_torch_increase_bytes: int | None = None
    non_torch_memory_bytes: int | None = None  # the summary's non-torch memory (absolute, after the profile)
    non_kv_cache_bytes: int | None = None
    total_consumed_bytes: int | None = None
    peak_activation_bytes: int | None = None  # the summary's peak activation
    cudagraph_memory_bytes: int | None = None  # what vLLM subtracted for CUDA graphs
    cudagraph_estimate_bytes: int | None = None  # the estimate, applied or not
    cudagraph_actual_bytes: int | None = None  # what capturing took
    kv_cache_memory_bytes: int | None = None  # --kv-cache-memory-bytes, as the log states it
    peak_torch_memory_bytes: int | None = None  # 0.6.4: weights + activation peak together
    available_kv_cache_bytes: int | None = None  # what vLLM decided
    needed_kv_cache_bytes: int | None = None  # a max-seq-len refusal: what one request needs
    num_gpu_blocks: int | None = None
    kv_cache_tokens: int | None = None
    block_size: int | None = None  # tokens per block, where the log states it
    max_model_len: int | None = None
    max_concurrency: float | None = None
    halved_for_workspace: bool = False
    refusal: str | None = None  # free_memory, max_seq_len, no_kv_memory, profiling_error
    ooms: tuple[OomFact, ...] = ()
    lines_matched: int = 0
    kinds_seen: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["era_candidates"] = list(self.era_candidates)
        data["kinds_seen"] = list(self.kinds_seen)
        data["ooms"] = [o.to_dict() for o in self.ooms]
        data["block_size"], data["block_size_source"] = self.effective_block_size()
        return data

    @property
    def era_row(self) -> "eras.Era | None":
        return next((e for e in eras.ERAS if e.name == self.era), None)

    @property
    def oom(self) -> OomFact | None:
        """The first OOM the log holds (the one that stopped it; later ones are its echoes)."""
        return self.ooms[0] if self.ooms else None

    @property
    def kv_cache_nonpositive(self) -> bool:
        """vLLM decided a KV cache of zero or less (it clamps it, or stops)."""
        return self.available_kv_cache_bytes is not None and self.available_kv_cache_bytes <= 0

    def effective_block_size(self) -> tuple[int | None, str]:
        """Tokens per block and where that comes from: the log's own statement, its token and block
        counts, or the era rows still in question when they all agree."""
        if self.block_size is not None:
            return self.block_size, "stated"
        if self.kv_cache_tokens and self.num_gpu_blocks:
            if self.kv_cache_tokens % self.num_gpu_blocks == 0:
                return self.kv_cache_tokens // self.num_gpu_blocks, "tokens / blocks"
        sizes = {e.default_block_size for e in eras.ERAS if e.name in self.era_candidates}
        if len(sizes) == 1:
            return sizes.pop(), "every candidate era's default"
        return None, "the candidate eras disagree" if sizes else "no era"

    def profile_fields(self, formula: str | None = None) -> dict[str, Any]:
        """The profile figures the log states, with the formula of its era where the lines pin one (or
        ``formula``, where the caller knows the release: kvguard budget --vllm-version)."""
        formulas = {e.formula for e in eras.ERAS if e.name in self.era_candidates}
        formula = formula or (
            formulas.pop() if len(formulas) == 1 else ("consumed" if self.total_consumed_bytes is not None else "peak")
        )
        fields: dict[str, Any] = {"formula": formula}
        for name in (
            "total_memory_bytes",
            "gpu_memory_utilization",
            "weights_bytes",
            "peak_allocated_increase_bytes",
            "non_torch_increase_bytes",
            "total_consumed_bytes",
            "kv_cache_memory_bytes",
        ):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.peak_torch_memory_bytes is not None and self.peak_allocated_increase_bytes is None:
            # 0.6.4's one-line results state the weights and the activation peak as one figure, the allocated
            # peak, and its formula subtracts only that sum (worker/worker.py 0.6.4:209-232): the peak is what
            # the sum holds above the weights, or, where no line states the weights, the sum stands as them.
            weights = self.weights_bytes if self.weights_bytes is not None else self.peak_torch_memory_bytes
            fields["weights_bytes"] = weights
            fields["peak_allocated_increase_bytes"] = max(0, self.peak_torch_memory_bytes - weights)
        if self.total_consumed_bytes is not None and self.non_kv_cache_bytes is not None:
            fields["transient_peak_headroom_bytes"] = max(0, self.non_kv_cache_bytes - self.total_consumed_bytes)
        elif self.total_consumed_bytes is not None and self.peak_activation_bytes is not None:
            # The summary's peak activation is the transient headroom plus the applied graph estimate
            # (w 0.27.0:527-529).
            fields["transient_peak_headroom_bytes"] = max(
                0, self.peak_activation_bytes - (self.cudagraph_memory_bytes or 0)
            )
        if FORMULAS[formula].cudagraph:
            fields["cudagraph_memory_bytes"] = self.cudagraph_memory_bytes or 0
        if FORMULAS[formula].peak == "reserved" and "peak_allocated_increase_bytes" in fields:
            # vllm-mindspore's "torch peak memory increase" is the memory_reserved() increase (utils.py:475).
            fields["peak_reserved_increase_bytes"] = fields.pop("peak_allocated_increase_bytes")
        return fields

    def profile(self) -> Profile | None:
        """The startup profile, when the log carries every part the era's formula needs (vLLM's logs
        never carry the reserved increase). Raises ProfileError when the stated figures are out of range."""
        fields = self.profile_fields()
        if any(fields.get(n) is None for n in required_fields(fields["formula"], fields.get("kv_cache_memory_bytes"))):
            return None
        return Profile(**{**{k: None for k in Profile.REQUIRED}, **fields})


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _gib(text: str) -> int:
    return int(round(_number(text) * GIB))


def _int(text: str) -> int:
    return int(_number(text))


_CONVERT = {"gib": _gib, "int": _int, "float": _number}
# Facts every worker states for itself: the engine keeps the smallest (its KV cache fits every rank; the rank
# with the least free memory is the one that refuses: v1/worker/utils.py 0.14.0:253-273 request_memory, called by
# each worker from gpu_worker.py 0.14.0:234 init_device, raises on its own rank's
# free memory, so a log of several ranks, or several attempts, is judged by its worst).
_SMALLEST = ("_available_profiled", "kv_cache_tokens", "init_free_memory_bytes")


def _store(fact: str, value: Any, f: dict[str, Any]) -> None:
    """One fact, in its unit, into the facts dict."""
    if fact == "kv_cache_tokens":
        # Each rank writes its token count, then its concurrency: keep the concurrency of the rank whose
        # count is kept (the smallest), not the last rank's.
        f["_tokens_last_smallest"] = fact not in f or value <= f[fact]
    if fact == "max_concurrency" and "max_concurrency" in f and not f.get("_tokens_last_smallest", True):
        return
    if fact in _SMALLEST and fact in f:
        value = min(value, f[fact])
    f[fact] = value


def _record(kind: LineKind, found: dict[str, str], f: dict[str, Any]) -> None:
    """What a line states, into the facts dict: each slot is a fact in its unit."""
    for fact, text in found.items():
        _store(fact, _CONVERT[kind.units[fact]](text), f)
    if kind.also is not None:
        kind.also(found, f)


def _clean(raw: str) -> str:
    # _ANSI's every match begins with one of these two (a lone ESC, frequent in binary junk, is no sequence).
    line = _ANSI.sub("", raw) if ("\x1b[" in raw or "^[[" in raw) else raw
    return _BLANKS.sub(" ", line) if ("  " in line or "\t" in line or "\r" in line) else line


def _continuation(line: str) -> str:
    """A following line without its own log prefix (and a paste's quote or indent)."""
    stripped = line.lstrip(" >")
    match = _RECORD_PREFIX.match(stripped)
    return stripped[match.end() :] if match else stripped


class _Reader:
    """One pass over a log's lines, holding the last two for joins; linear in the log's size."""

    def __init__(self) -> None:
        self.facts: dict[str, Any] = {}
        self.matched = 0
        # The kinds matched, each once (in the order first matched): a flood of one line keeps one entry.
        self.seen: dict[int, LineKind] = {}
        self.hints: dict[str, Any] = {
            "tags": set(),
            "ascend": False,
            "mindspore": False,
            "engine_core": False,
            "source_tags": set(),
            "frames": set(),
            "wordings": set(),
            "logged_on": None,
            "versions": set(),
        }
        self.ooms: list[OomFact] = []
        # Templates begun but not finished: the line number, the line, the next lines joined to it so far, each
        # kind with the reach of its failure (LineKind.match_reach), the line's length, the shapes of the line
        # and of those joined to it (each its _Line.shape), and what _waiting tells of the kinds.
        self.pending: list[
            tuple[
                int,
                str,
                tuple[str, ...],
                list[tuple[LineKind, int]],
                int,
                tuple[bytes | None, ...],
                tuple[str, ...] | None,
            ]
        ] = []
        self.previous_tail = ""
        self.recent: deque[str] = deque(maxlen=STEP_WINDOW_LINES)  # where an OOM's step is looked for
        self.tagged = 0
        self.wording_misses = 0
        self.untagged_misses = 0
        # Tags or wordings still read (each line is looked at for them); else only lines with other hints are.
        self.reading_hints = True

    def _step(self) -> str | None:
        """The step an OOM happened at: the last step word in the lines up to it (its traceback's frames,
        the worker's own lines before it)."""
        for line in reversed(self.recent):
            step = step_in(line)
            if step:
                return step
        return None

    def feed(self, number: int, raw: str) -> None:
        if len(raw) > MAX_LINE_CHARS:
            return
        kept = len(raw) <= MAX_CACHED_LINE_CHARS  # a longer line is not hashed, nor kept
        seen = _LINES.get(raw) if kept else None
        if seen is None:
            seen = _read_line(raw, number, kept)
            if kept and (seen._origin is seen or raw in _ONCE):
                if len(_LINES) >= MAX_CACHED_LINES:
                    _LINES.clear()
                _LINES[raw] = seen
            elif kept:
                # Read from its shape: kept from its second coming (a flood whose lines all differ keeps none).
                if len(_ONCE) >= MAX_CACHED_LINES:
                    _ONCE.clear()
                _ONCE.add(raw)
        line = seen.line
        if seen.hinted or self.reading_hints:
            self._hints(seen, number)
        self.recent.append(line)
        if seen.rare:
            self._rare(seen, number)
        if self.pending:
            self._retry_pending(number, seen.continuation(), seen.shape)
        # An anchor cut by a hard wrap has the last character of the line before and this one's first side by side.
        if self.previous_tail and self.previous_tail[-1] + line[:1] in _ANCHOR_PAIRS and not seen.prefixed():
            self._straddled(number, line)
        self.previous_tail = seen.tail
        if not seen.attempts:
            return
        hit, started = False, []
        for kind, found, values, reach in seen.attempts:
            # A line may state several facts (0.30+ joins the KV size and the concurrency). Kinds sharing
            # an anchor are one message's variants: a shorter one (a refusal's first words) may match where
            # a longer one broke off at a wrap ("(4.26 GiB KV cach" / "e is needed"), so those that failed
            # wait for the next lines all the same.
            if found is not None:
                if _record_values(kind, found, values, self.facts):
                    self.seen[id(kind)] = kind
                    hit = True
                    continue
                reach = UNDECIDED
            started.append((kind, reach))
        self.matched += hit
        if started and len(line) <= MAX_JOIN_CHARS:
            # Those that failed within the line fail joined to any next one (that holds not their anchor).
            waiting = [(kind, reach) for kind, reach in started[:MAX_JOIN_KINDS] if reach < 0 or reach > len(line)]
            if waiting:
                self.pending.append((number, line, (), waiting, len(line), (seen.shape,), _waiting(waiting, len(line))))

    def _rare(self, seen: "_Line", number: int) -> None:
        """What few lines hold: an OOM, the method it failed in, a pasted command line."""
        line = seen.line
        if seen.oom and len(self.ooms) < MAX_OOMS:
            oom = read_oom(line, number)
            if oom is not None:
                self.ooms.append(_with_step(oom, self._step()))
        if (
            self.ooms
            and self.ooms[-1].step is None
            and seen.error_in_method
            and number - self.ooms[-1].line <= STEP_WINDOW_LINES
        ):
            # The step no line before the OOM showed, named after its traceback by the method it failed in.
            method = line[line.index(ERROR_IN_METHOD) + len(ERROR_IN_METHOD) :].partition("'")[0]
            self.ooms[-1] = _with_step(self.ooms[-1], step_in(method))
        if seen.command:
            self._command_line(line)

    def feed_text(self, number: int, text: str) -> int:
        """Feed the lines of ``text`` (separated by "\\n", each maybe ending in "\\r"), the first numbered
        ``number``; returns the next line's number. A stretch of lines that holds no word that could change
        what is known (:meth:`_quiet`) is counted, not read line by line: the reader's work per line is a few
        substring scans of the stretch, whatever the lines hold."""
        return self._feed_stretches(number, text, STRETCH_CHARS)

    def _feed_stretches(self, number: int, text: str, size: int) -> int:
        start, end = 0, len(text)
        while start <= end:
            stop = text.find("\n", start + size)
            if stop < 0:
                stop = end
            stretch = text[start:stop]
            count = stretch.count("\n") + 1
            if self._quiet(number, stretch):
                self._skip(count, stretch[stretch.rfind("\n") + 1 :].rstrip("\r"))
                number += count
            elif count > MIN_STRETCH_LINES and size > MIN_STRETCH_CHARS:
                # A word in a stretch of many lines: its quiet parts are still counted, not read.
                number = self._feed_stretches(number, stretch, size // 8)
            elif "\r" in stretch:
                for raw in stretch.split("\n"):
                    self.feed(number, raw.rstrip("\r"))
                    number += 1
            else:
                feed = self.feed
                for raw in stretch.split("\n"):
                    feed(number, raw)
                    number += 1
            start = stop + 1
        return number

    def _quiet(self, number: int, stretch: str) -> bool:
        """Whether feeding these lines one by one would change nothing but the count: no template begun,
        no line too long to read, the wordings no longer looked up, and no word of a template, a hint
        still open, an OOM or a step in them (joined to the line before, so that a hard wrap hides none)."""
        if self.pending or len(stretch) > MAX_LINE_CHARS:
            return False
        if self._wording_open() and stretch.strip("\r\n"):
            return False
        joined = self.previous_tail + stretch.replace("\r", "").replace("\n", "")
        if any(map(joined.__contains__, _QUIET_WORDS)):
            return False
        for _, words, settled in _QUIET_WORDS_UNTIL:
            if not settled(self) and any(map(joined.__contains__, words)):
                return False
        return not _DATE_START.search(joined)

    def _skip(self, count: int, last: str) -> None:
        """``count`` quiet lines, ``last`` the last of them: what feeding them would have done."""
        self.recent.extend(repeat("", min(count, STEP_WINDOW_LINES)))  # no step word in them
        line = _clean(last)
        self.previous_tail = line[-MAX_ANCHOR_CHARS:] if len(line) <= MAX_JOIN_CHARS else ""

    def _command_line(self, line: str) -> None:
        """--gpu-memory-utilization / --max-model-len as a pasted ``vllm serve`` command states them: taken
        only where no log line states the figure (vLLM's own wording names these flags too, followed by
        "to", or by "=" and "is equivalent to", which this pattern leaves)."""
        if "equivalent to" in line:
            return
        for match in _COMMAND_FLAG.finditer(line):
            flag, value = match.group(1), match.group(2)
            if flag == "max-model-len":
                self.facts.setdefault("_cli_len", _model_len(value))
            elif value[-1] not in "kK":  # "0k" is a length's suffix: vLLM refuses it as a utilization
                self.facts.setdefault("_cli_util", float(value))

    def _retry_pending(self, number: int, tail: str, shape: bytes | None) -> None:
        """Join the lines whose template began but broke off to this one (``tail``: the line without its own
        log prefix, :func:`_continuation`), and, once, the next: with a space (a message split at a full stop
        or a soft wrap) and without (a hard wrap inside a word or number)."""
        still = []
        for start, first, tails, kinds, base, shapes, anchors in self.pending:
            parts = (first, *tails, tail)
            shapes = (*shapes, shape)
            if anchors is not None:
                # Each kind failed within the first line: none is tried again unless a later part brings its anchor
                # (as below, where each such kind is left as it was).
                for anchor in anchors:
                    if _anchor_after_first_kept(anchor, parts, shapes):
                        break
                else:
                    if number - start < 2:
                        still.append((start, first, parts[1:], kinds, base, shapes, anchors))
                    continue
            joined: list[str] | None = None
            left = []
            again: dict[str, bool] = {}  # by anchor: kinds sharing one ask once
            for kind, reach in kinds:
                # One that failed within the first line fails joined, unless a later part brings its anchor again.
                if 0 <= reach <= base:
                    left.append((kind, reach))
                    continue
                if reach < 0 and -1 - reach <= base:
                    anchor = kind.anchor
                    brought = again.get(anchor)
                    if brought is None:
                        brought = again[anchor] = _anchor_after_first_kept(anchor, parts, shapes)
                    if not brought:
                        left.append((kind, reach))
                        continue
                if joined is None:
                    joined = _joins(parts)
                if not any(self._take(kind, text, start) for text in joined):
                    left.append((kind, reach))
            if len(left) < len(kinds):
                self.matched += 1
            if left and number - start < 2:
                still.append((start, first, parts[1:], left, base, shapes, _waiting(left, base)))
        self.pending = still

    def _straddled(self, number: int, line: str) -> None:
        """A template whose first words a hard wrap cut in two: this continuation line joined, without a
        space, to the end of the line before it."""
        # Only an anchor across the join is new: it lies within the longest anchor's length of the join.
        edge = _LONGEST_ANCHOR - 1
        if not _ANY_ANCHOR.search(self.previous_tail[-edge:] + line[:edge]):
            return
        joined = self.previous_tail + line
        for anchor, kinds in _BY_ANCHOR:
            if anchor in joined and anchor not in line and anchor not in self.previous_tail:
                for kind in kinds:
                    if self._take(kind, joined, number - 1):
                        self.matched += 1

    def _take(self, kind: LineKind, line: str, number: int) -> bool:
        try:
            found = kind.match(line)
            if found is None:
                return False
            _record(kind, found, self.facts)
        except LogLineError as exc:
            raise LogLineError(f"line {number}: {exc}") from None
        except (ValueError, OverflowError):
            return False
        self.seen[id(kind)] = kind
        return True

    def _hints(self, seen: "_Line", number: int) -> None:
        hints = self.hints
        # The first tagged lines tell the tag style; reading every line's tag would say nothing more.
        tag = seen.tag() if self.tagged < MAX_TAGGED_LINES and seen.tag_gap else None
        if tag is not None:
            self.tagged += 1
            hints["tags"].add(tag[0])
            # kvguard's own lines carry its plugin's file names (kvguard/plugin/state.py, ...), not vLLM's: some
            # are also vLLM's names (vLLM has a state.py), and would be read as vLLM's lines.
            ours = seen.line[tag[2] :].lstrip().startswith("kvguard:")
            if len(hints["source_tags"]) < source_index.MAX_HINTS and not ours:
                hints["source_tags"].add(tag[1])
        wordings = hints["wordings"]
        if (
            seen.line
            and len(wordings) < source_index.MAX_HINTS
            and self.wording_misses < MAX_WORDING_MISSES
            and self.untagged_misses < MAX_UNTAGGED_MISSES
        ):
            tagged = tag is not None
            key = seen._wordings[tagged]
            if key is _UNSEEN:
                key = seen.wording(tagged)  # (_wording_open)
            if key is not None:
                wordings.add(key)
            elif tagged or not seen.may_be_words:
                self.wording_misses += 1
            else:
                self.untagged_misses += 1
        self.reading_hints = self.tagged < MAX_TAGGED_LINES or self._wording_open()
        if not seen.hinted:
            return
        if seen.dated is not None and (hints["logged_on"] is None or seen.dated < hints["logged_on"]):
            hints["logged_on"] = seen.dated
        if seen.frame_gap and len(hints["frames"]) < source_index.MAX_HINTS:
            frame = seen.frame()
            if frame is not None:
                hints["frames"].add(frame)
        if seen.ascend:
            hints["ascend"] = True
        if seen.mindspore:
            hints["mindspore"] = True
        if seen.engine_core:
            hints["engine_core"] = True
        if seen.banner_gap and len(hints["versions"]) < MAX_BANNERS:
            banner = seen.banner()
            if banner is not None:
                hints["versions"].add(banner)

    def _wording_open(self) -> bool:
        return (
            len(self.hints["wordings"]) < source_index.MAX_HINTS
            and self.wording_misses < MAX_WORDING_MISSES
            and self.untagged_misses < MAX_UNTAGGED_MISSES
        )

    def finish(self) -> StartupLog:
        return _finish(self.facts, self.matched, list(self.seen.values()), self.hints, tuple(self.ooms))


# What a line says whatever came before it, kept for the next time the same line comes (a log repeats its lines:
# each rank, each restart, a flood of one message): feeding it again costs a dict lookup and the facts it records.
# Lines of MAX_CACHED_LINE_CHARS or fewer (vLLM's are), up to MAX_CACHED_LINES of them at a time.
MAX_CACHED_LINES = 2048
MAX_CACHED_LINE_CHARS = 1024
_LINES: dict[str, "_Line"] = {}
_ONCE: set[str] = set()  # lines read from their shape once (_Reader.feed), up to MAX_CACHED_LINES at a time
_UNSEEN: Any = object()
# The first line read of each shape (the cleaned line with each digit made "0", as UTF-8), up to MAX_CACHED_SHAPES
# at a time: a line of a shape already read is read from it (:meth:`_Line.again`), not matched afresh. A flood
# whose every line has its own time, pid or figures is lines of a few shapes.
MAX_CACHED_SHAPES = 2048
_SHAPES: dict[bytes, "_Line"] = {}
# The texts holding a digit that a line's reading looks for, each with its digits made "0" (as UTF-8): the
# templates' literals and the Ascend words that hold one. A line holds such a text only where its shape holds
# the zeroed text.
_DIGIT_TEXTS = tuple(
    (text, text.encode().translate(_ZEROED))
    for text in dict.fromkeys(
        (
            *(value for kind in KINDS for piece, value in kind.pieces if piece == "lit" and _has_digit(value)),
            *(word for word in (*_ANCHOR_WORDS, *_ASCEND_GATE, *_ASCEND_WORDS) if _has_digit(word)),
        )
    )
)


def _places(line: str, text: str) -> tuple[int, ...]:
    """Where ``text`` starts in ``line``, each place."""
    places = []
    at = line.find(text)
    while at >= 0:
        places.append(at)
        at = line.find(text, at + 1)
    return tuple(places)


def _read_line(raw: str, number: int, kept: bool) -> "_Line":
    """``raw``'s own reading: from the line of its shape read before, where one is kept."""
    line = _clean(raw)
    if not kept:
        return _Line(line, number)
    key = line.encode("utf-8", "surrogatepass").translate(_ZEROED)
    origin = _SHAPES.get(key)
    if origin is not None:
        return origin.again(line, key, number)
    seen = _Line(line, number, key)
    if len(_SHAPES) >= MAX_CACHED_SHAPES:
        _SHAPES.clear()
    _SHAPES[key] = seen
    return seen


class _Line:
    """One line's own reading (its cleaned text, the templates it matches or how far it got in each, the hints
    it holds): each part the reader may skip (a tag after MAX_TAGGED_LINES, a frame after MAX_HINTS) is read
    the first time it is asked for."""

    __slots__ = (
        "line",
        "tag_gap",
        "_tag",
        "_wordings",
        "dated",
        "frame_gap",
        "_frame",
        "ascend",
        "mindspore",
        "engine_core",
        "banner_gap",
        "_banner",
        "oom",
        "error_in_method",
        "command",
        "rare",
        "hinted",
        "_prefixed",
        "_continuation",
        "tail",
        "attempts",
        "_plan",
        "_figures",
        "_shape",
        "_origin",
        "shape",
        "_cut",
    )

    def __init__(self, line: str, number: int, shape: bytes | None = None) -> None:
        """The reading of ``line`` (cleaned, :func:`_clean`), the ``number``-th line of its log; ``shape``: the line
        with each digit made "0", as UTF-8 (None for a line too long to keep)."""
        self.line = line
        self.shape = shape
        self._origin, self._shape, self._cut = self, None, None
        self.tag_gap = "] " in line
        self._tag = self._prefixed = self._continuation = self._frame = self._banner = _UNSEEN
        self._wordings: list[Any] = [_UNSEEN, _UNSEEN]
        self.dated = None
        if "20" in line:
            dated = _DATED.search(line)
            self.dated = dated.group(1) if dated else None
        self.frame_gap = 'File "' in line
        self.ascend = any(map(line.__contains__, _ASCEND_GATE)) and any(map(line.__contains__, _ASCEND_WORDS))
        self.mindspore = "mindspore" in line  # each of _MINDSPORE_WORDS holds it
        self.engine_core = "(EngineCore pid=" in line
        self.banner_gap = "version" in line or "engine (v" in line
        self.oom = is_oom_line(line)
        self.error_in_method = ERROR_IN_METHOD in line
        self.command = "--" in line
        self.rare = self.oom or self.error_in_method or self.command
        self.hinted = (
            self.dated is not None
            or self.frame_gap
            or self.ascend
            or self.mindspore
            or self.engine_core
            or self.banner_gap
        )
        self.tail = line[-MAX_ANCHOR_CHARS:] if len(line) <= MAX_JOIN_CHARS else ""
        # Each kind whose anchor the line holds: the facts it states (and their values, :func:`_values`), or
        # None and the reach of its failure (LineKind.match_reach); and where those facts stand in the line
        # (for another line of its shape, :meth:`again`).
        attempts, plan = [], []
        for anchor, kinds in _anchors_in(line):
            if anchor not in line:
                continue
            for kind in kinds:
                try:
                    spans, reach = kind.match_spans(line)
                except LogLineError as exc:
                    raise LogLineError(f"line {number}: {exc}") from None
                found = None if spans is None else {fact: line[start:end] for fact, (start, end) in spans.items()}
                attempts.append((kind, found, None if found is None else _values(kind, found), reach))
                plan.append((kind, spans, reach))
        self.attempts = tuple(attempts)
        self._plan = tuple(plan)
        # Where the facts stand, from the first figure to the last, and the text there (None: no facts).
        places = [place for _, spans, _ in plan if spans for place in spans.values()]
        if places:
            first, last = min(start for start, _ in places), max(end for _, end in places)
            self._figures: tuple[int, int, str] | None = (first, last, line[first:last])
        else:
            self._figures = None

    def again(self, line: str, key: bytes, number: int) -> "_Line":
        """The reading of ``line``, another line of this one's shape (``key``: the two with each digit made "0",
        as UTF-8), the ``number``-th of its log; read afresh where the two hold a text with digits that the
        reading looks for (a template's, an Ascend word) at other places.

        Every other search of the reading treats each digit alike (a literal without digits; a class holding all
        ten, or none: _NUMBER, _TAG, _RECORD_PREFIX, _ANSI), so it finds the same places in both lines, and the
        templates take the same steps in both: a template that stated facts here states them at the same places
        in ``line`` (their figures read from ``line``), one that failed fails there with the same reach. The date
        (:data:`_DATED` looks for "20") is read from ``line``; the parts read when first asked for (the tag, the
        wording, a frame, a banner) are read from it when asked."""
        checks = self._shape
        if checks is None:
            # The texts with digits that a line of this shape may hold (those whose zeroed form the shape holds),
            # each with the places it stands at in this line; and whether the shape may hold a date (_DATED).
            checks = self._shape = (
                tuple((text, _places(self.line, text)) for text, zeroed in _DIGIT_TEXTS if zeroed in key),
                b"0000-00-00" in key,
            )
        for text, places in checks[0]:
            if _places(line, text) != places:
                return _Line(line, number, key)
        new = _Again.__new__(_Again)
        new.line = line
        new._origin = self
        new.shape = self.shape
        new._tag = new._continuation = new._frame = new._banner = _UNSEEN
        # A wording is the same for every line of a shape (source_index.wording_text makes each run of digits one
        # mark; its other searches, _MESSAGE's too, treat each digit alike): one list, filled by whichever asks.
        new._wordings = self._wordings
        dated = None
        if checks[1] and "20" in line:
            found = _DATED.search(line)
            dated = found.group(1) if found else None
        new.dated = dated
        new.rare = self.rare
        new.hinted = self.hinted if dated is None and self.dated is None else dated is not None or self._undated
        new.tail = line[-MAX_ANCHOR_CHARS:] if len(line) <= MAX_JOIN_CHARS else ""
        # The templates' attempts: this line's where the text from the first figure to the last is the same (a
        # flood of one message with its own times and pids), else each that found facts read anew.
        figures = self._figures
        if figures is None or line[figures[0] : figures[1]] == figures[2]:
            new.attempts = self.attempts
        else:
            attempts = []
            for (kind, spans, reach), kept in zip(self._plan, self.attempts):
                if spans is not None:
                    found = {fact: line[start:end] for fact, (start, end) in spans.items()}
                    if found != kept[1]:
                        kept = (kind, found, _values(kind, found), reach)
                attempts.append(kept)
            new.attempts = tuple(attempts)
        return new

    @property
    def _undated(self) -> bool:
        """Whether the line holds a hint other than its date."""
        return self.frame_gap or self.ascend or self.mindspore or self.engine_core or self.banner_gap

    def tag(self) -> tuple[bool, tuple[str, int], int] | None:
        """vLLM's record tag (_TAG): whether it is bracketed, its (file, line), and where the message starts."""
        if self._tag is _UNSEEN:
            match = _TAG.search(self.line)
            self._tag = (
                None
                if match is None
                else (bool(match.group(1) or match.group(2)), (match.group(3), int(match.group(4))), match.end())
            )
        return self._tag

    def wording(self, tagged: bool) -> str | None:
        """The wording the index knows this line by (source_index.line_wording), or None; after its tag where
        ``tagged`` (the reader still reads tags), else from the line's start."""
        key = self._wordings[tagged]
        if key is _UNSEEN:
            line = self.line
            # Fewer characters than a wording's letters, or bytes that were not UTF-8 (no vLLM message holds
            # U+FFFD): no wording to look up.
            key = (
                _wording(line, self._tag[2] if tagged else None)
                if "\ufffd" not in line
                and source_index.MIN_WORDING_LETTERS <= len(line) <= source_index.MAX_WORDING_CHARS
                else None
            )
            if key is not None and key not in source_index.known_wordings():
                key = None
            self._wordings[tagged] = key
        return key

    @property
    def may_be_words(self) -> bool:
        """Whether the line could be a message at all (UTF-8, of a message's length): other programs' output
        counts against the larger bound (MAX_UNTAGGED_MISSES), binary junk and scraps against the smaller."""
        line = self.line
        return "\ufffd" not in line and source_index.MIN_WORDING_LETTERS <= len(line) <= source_index.MAX_WORDING_CHARS

    def frame(self) -> tuple[str, int, str] | None:
        if self._frame is _UNSEEN:
            match = source_index.FRAME.search(self.line)
            self._frame = (match.group(1), int(match.group(2)), match.group(3)) if match else None
        return self._frame

    def banner(self) -> tuple[int, ...] | None:
        if self._banner is _UNSEEN:
            line = self.line
            match = _BANNER.search(line) or (_LOGO_VERSION.search(line) if "\u2580\u2584\u2580" in line else None)
            self._banner = parse_version(match.group(1)) if match else None
        return self._banner

    def prefixed(self) -> bool:
        """Whether the line opens with a log record's own prefix (a new record, not a wrapped line's rest); the
        same for every line of its shape (_RECORD_PREFIX treats each digit alike)."""
        origin = self._origin
        if origin._prefixed is _UNSEEN:
            origin._prefixed = _RECORD_PREFIX.match(origin.line) is not None
        return origin._prefixed

    def continuation(self) -> str:
        """The line without its own log prefix (:func:`_continuation`): it starts at the same place in every line
        of its shape."""
        if self._continuation is _UNSEEN:
            origin = self._origin
            if origin._cut is None:
                self._continuation = _continuation(self.line)
                origin._cut = len(self.line) - len(self._continuation)
            else:
                self._continuation = self.line[origin._cut :]
        return self._continuation


def _origins(name: str) -> property:
    return property(lambda self: getattr(self._origin, name), doc=f"{name}: the same for every line of the shape")


class _Again(_Line):
    """A line read from the first line of its shape (:meth:`_Line.again`): its own text, tail, date and attempts;
    what every line of the shape holds alike is read from that first line (``_origin``). What the first line keeps
    for its shape (_plan, _figures, _shape, _cut, _prefixed) is left unset here: only the first line's is read."""

    __slots__ = ()
    tag_gap = _origins("tag_gap")
    frame_gap = _origins("frame_gap")
    ascend = _origins("ascend")
    mindspore = _origins("mindspore")
    engine_core = _origins("engine_core")
    banner_gap = _origins("banner_gap")
    oom = _origins("oom")
    error_in_method = _origins("error_in_method")
    command = _origins("command")


# Facts _record does more with than store.
_KEPT_BY_RULE = frozenset(("kv_cache_tokens", "max_concurrency", *_SMALLEST))


def _values(kind: LineKind, found: dict[str, str]) -> tuple[list[tuple[str, Any]], bool, bool]:
    """Each fact a match states in its unit, in the template's order; whether all converted (a figure such as
    "1e999" that does not convert ends the list); and whether recording them is storing them (no fact that
    _record keeps by a rule, nothing else to do)."""
    values = []
    try:
        for fact, text in found.items():
            values.append((fact, _CONVERT[kind.units[fact]](text)))
    except (ValueError, OverflowError):
        return values, False, False
    return values, True, kind.also is None and _KEPT_BY_RULE.isdisjoint(found)


def _record_values(
    kind: LineKind, found: dict[str, str], values: tuple[list[tuple[str, Any]], bool, bool], f: dict[str, Any]
) -> bool:
    """:func:`_record` of facts already converted (:func:`_values`); False where one did not convert (the facts
    before it recorded, as _record leaves them)."""
    converted, whole, stored = values
    if stored:
        f.update(converted)
        return True
    for fact, value in converted:
        _store(fact, value, f)
    if not whole:
        return False
    if kind.also is not None:
        try:
            kind.also(found, f)
        except (ValueError, OverflowError):
            return False
    return True


def _waiting(kinds: list[tuple[LineKind, int]], base: int) -> tuple[str, ...] | None:
    """Where every kind waiting on a line of ``base`` characters failed within it (LineKind.match_reach): the
    anchors that a later part must bring for any to be tried again (_Reader._retry_pending), each once; else
    None (some kind is tried joined whatever follows)."""
    anchors = []
    for kind, reach in kinds:
        if 0 <= reach <= base:
            continue
        if not (reach < 0 and -1 - reach <= base):
            return None
        anchors.append(kind.anchor)
    return tuple(dict.fromkeys(anchors))


def _joins(parts: tuple[str, ...]) -> list[str]:
    """A line joined to the next ones, each join with a space and without, in that order."""
    texts = [parts[0]]
    for part in parts[1:]:
        texts = [text + sep + part for text in texts for sep in (" ", "")]
    return texts


def _anchor_after_first(anchor: str, parts: tuple[str, ...]) -> bool:
    """Whether ``anchor`` may occur in a join of ``parts`` (_joins) other than inside the first part."""
    edge = len(anchor) - 1
    last = len(parts) - 1
    for index in range(1, last + 1):
        part = parts[index]
        if anchor in part or (index < last and len(part) < edge):
            return True
    for index in range(last):
        before, after = parts[index][-edge:], parts[index + 1][:edge]
        if anchor in before + " " + after or anchor in before + after:
            return True
    return False


# _anchor_after_first's answers, for lines that come again after the same lines (MAX_CACHED_JOINS at a time): by
# the lines' shapes where the anchor holds no digit (the answer is then the same for every line of a shape).
MAX_CACHED_JOINS = 1024
_AFTER_FIRST: dict[tuple[str, tuple[Any, ...]], bool] = {}


def _anchor_after_first_kept(anchor: str, parts: tuple[str, ...], shapes: tuple[bytes | None, ...]) -> bool:
    """_anchor_after_first, kept. ``shapes``: the shape of each part's line (:attr:`_Line.shape`; the first part
    the whole line, the others lines without their prefix, :meth:`_Line.continuation`, which starts at the same
    place in every line of a shape). Where ``anchor`` has no digit, the answer is told by the shapes: whether it
    lies in a part, or across two (with a blank between or none), looks at the same places of every line of a
    shape, and the parts' lengths are their shapes'."""
    key = (anchor, shapes if anchor not in _DIGIT_ANCHORS and None not in shapes else parts)
    brought = _AFTER_FIRST.get(key)
    if brought is None:
        if len(_AFTER_FIRST) >= MAX_CACHED_JOINS:
            _AFTER_FIRST.clear()
        brought = _AFTER_FIRST[key] = _anchor_after_first(anchor, parts)
    return brought


def _wording(line: str, message_at: int | None) -> str | None:
    """source_index.line_wording, once per message: a log repeats its messages (each rank, each restart)."""
    # Keyed by the message after the tag where the tag was found, else by the whole line; each digit made "0"
    # (a wording makes every figure one mark, so the lines of one message with other figures or times share it).
    # (UTF-8 keeps the text apart: no other character's bytes hold an ASCII digit; bytes translate fastest).
    cached = (
        message_at is None,
        (line if message_at is None else line[message_at:]).encode("utf-8", "surrogatepass").translate(_ZEROED),
    )
    key = _WORDINGS.get(cached, "")
    if key == "":
        if len(_WORDINGS) >= MAX_CACHED_WORDINGS:
            _WORDINGS.clear()
        key = _WORDINGS[cached] = source_index.line_wording(line, message_at)
    return key


# A flag and its value on a command line: "--max-model-len 32k", "--gpu-memory-utilization=0.95".
_COMMAND_FLAG = re.compile(
    r"(?:^|[\s'\"])--(max-model-len|gpu-memory-utilization)[ =]([0-9]{1,9}(?:\.[0-9]{1,6})?[kK]?)"
    r"(?=$|[\s'\"\\,])"
)


def _model_len(text: str) -> int:
    """vLLM's human-readable --max-model-len: 32k is 32,000, 32K is 32,768 (vllm/engine/arg_utils.py)."""
    if text.endswith("k"):
        return int(float(text[:-1]) * 1000)
    if text.endswith("K"):
        return int(float(text[:-1]) * 1024)
    return int(float(text))


def _with_step(oom: OomFact, step: str | None) -> OomFact:
    return replace(oom, step=step) if step and oom.step is None else oom


def parse_lines(lines: Iterable[str]) -> StartupLog:
    """Parse a log's lines; raises LogLineError (one line, with the line number) for a budget line
    whose numbers are too long to be real."""
    reader = _Reader()
    for number, raw in enumerate(lines, 1):
        reader.feed(number, raw)
    return reader.finish()


def _project(seen: list[LineKind], hints: dict[str, Any]) -> tuple[str, str]:
    projects = [k.project for k in seen if k.project]
    # 310P's own line is the most specific; then vllm-mindspore's (it runs on the NPU too); then vllm-ascend's.
    if "vllm-ascend-310p" in projects:
        return "vllm-ascend-310p", "it writes NPUWorker310's own lines"
    if "vllm-mindspore" in projects or hints["mindspore"]:
        return "vllm-mindspore", "it names vllm-mindspore"
    if "vllm-ascend" in projects:
        return "vllm-ascend", "it names vllm-ascend's platform plugin or writes NPUWorker's own line"
    if hints["ascend"]:
        return (
            "vllm-ascend",
            "it names the NPU, vllm_ascend or vllm-ascend's worker files, or writes vllm-ascend's words",
        )
    return "vllm", ""


def _finish(
    facts: dict[str, Any], matched: int, seen: list[LineKind], hints: dict[str, Any], ooms: tuple[OomFact, ...]
) -> StartupLog:
    project, project_reason = _project(seen, hints)
    decimals = facts.pop("_decimals", {})
    candidates, reason = _candidates(project, seen, decimals, hints)
    if project_reason:
        reason = f"{project}: {project_reason}; {reason}"
    facts["era"] = candidates[0] if len(candidates) == 1 else None
    facts["era_candidates"] = tuple(candidates)
    facts["era_reason"] = reason
    facts["project"] = project
    # What the engine was asked for, where no line states what it used: the non-default args line, then a
    # pasted command line.
    for fact, asked in (
        ("max_model_len", ("_args_len", "_cli_len")),
        ("gpu_memory_utilization", ("_args_util", "_cli_util")),
    ):
        values = [facts.pop(name) for name in asked if name in facts]
        if values and facts.get(fact) is None:
            facts[fact] = values[0]
    facts.pop("_tokens_last_smallest", None)
    snapshot_free = facts.pop("_snapshot_free", None)
    if snapshot_free is not None:
        facts.setdefault("init_free_memory_bytes", snapshot_free)
    facts.pop("_v0_util", None)
    facts.pop("_settled_len", None)
    facts.pop("_free_after_profile", None)
    util, equiv = facts.pop("_cudagraph_util", None), facts.pop("_cudagraph_equiv", None)
    delta = util - equiv if util is not None and equiv is not None else None
    total = facts.get("total_memory_bytes")
    if total is None and facts.get("requested_memory_bytes") and facts.get("gpu_memory_utilization"):
        # The requested figure is total × utilization, printed to 0.01 GiB.
        facts["total_memory_bytes"] = round(facts["requested_memory_bytes"] / facts["gpu_memory_utilization"])
        total = facts["total_memory_bytes"]
    if "cudagraph_memory_bytes" not in facts and delta is not None and total:
        facts["cudagraph_memory_bytes"] = round(delta * total)
    if "cudagraph_memory_bytes" not in facts and delta is not None and facts.get("cudagraph_estimate_bytes"):
        facts["cudagraph_memory_bytes"] = facts["cudagraph_estimate_bytes"]
    profiled = facts.pop("_available_profiled", None)
    extended = facts.pop("_extended_kv", None)
    warmup = facts.pop("_warmup_kv", None)
    warmup_blocks = facts.pop("_warmup_blocks", None)
    in_use = facts.pop("_kv_in_use", None)
    kvguard_budget = facts.pop("_kvguard_budget", None)
    refused = facts.pop("_available_refused", None)
    # What vLLM decided: 0.34's extensible KV cache commits its size after warm-up; before, the profile.
    # kvguard's plugin, when it changed the budget, logs the one applied after vLLM printed its own.
    decided = next((v for v in (extended, warmup, kvguard_budget, profiled, in_use, refused) if v is not None), None)
    if decided is not None:
        facts["available_kv_cache_bytes"] = decided
    if facts.get("num_gpu_blocks") is None and warmup_blocks is not None:
        facts["num_gpu_blocks"] = warmup_blocks
    return StartupLog(lines_matched=matched, kinds_seen=tuple(dict.fromkeys(k.name for k in seen)), ooms=ooms, **facts)


def _text(version: tuple[int, ...] | None) -> str:
    return "the newest" if version is None else eras.version_text(version)


# Plugins released under the vLLM release they run on: vllm-ascend vX.Y.Z[rcN][.postN] runs on vLLM vX.Y.Z
# (vllm-ascend docs/source/community/versioning_policy.md, "follows PEP 440 to release versions matching
# with vLLM", and its compatibility matrix: v0.9.1 - v0.9.1, v0.17.0rc1 - v0.17.0, v0.23.0 - v0.23.0), so
# the vLLM releases its vLLM lines fit name its rows. vllm-mindspore's numbers are its own.
_SAME_NUMBERED = ("vllm-ascend", "vllm-ascend-310p")


def _rows_of_releases(rows: list[eras.Era], releases: Iterable[str | tuple[int, ...]]) -> list[str]:
    """The rows (of one project, oldest first) that hold one of ``releases``: a row runs from its first
    release up to the next row's first; the newest row, where it is closed, up to its last minor release
    (a vLLM release with no plugin release of its number yet is none of them)."""
    found = [parse_version(r) if isinstance(r, str) else r for r in releases]
    kept = []
    for index, era in enumerate(rows):
        end = rows[index + 1].first if index + 1 < len(rows) else None
        if any(
            era.first <= r and (r < end if end is not None else era.last is None or r[:2] <= era.last[:2])
            for r in found
        ):
            kept.append(era.name)
    return kept


def _same_numbered_rows(
    project: str, rows: list[eras.Era], hints: dict[str, Any], among: list[str] | None = None
) -> tuple[list[str], str] | None:
    """For a plugin numbered as vLLM (``_SAME_NUMBERED``): its rows (``among`` them, where given) holding the
    vLLM releases that the log's own vLLM tags and frames fit (``source_index.fit``), and why; None when that
    names none."""
    if project not in _SAME_NUMBERED:
        return None
    # Its tags against its own source and its vLLM's (source_index._Paired). Not the wordings: the plugin
    # patches vLLM's modules and writes their messages from its own copies
    # (vllm_ascend/patch/platform/patch_message_queue.py 0.11.0:128-134, the shared-memory broadcast notice).
    fitted = source_index.fit(hints["source_tags"], hints["frames"], hints["logged_on"], plugin="vllm-ascend")
    if fitted is None:
        return None
    # Spans over every row of the project, so that a row left out of ``among`` does not widen its neighbour.
    kept = [name for name in _rows_of_releases(rows, fitted.releases) if among is None or name in among]
    if not kept:
        return None
    return kept, f"{fitted.reason}, and {project} runs on the vLLM release of its own number: {', '.join(kept)}"


def _stated(project: str, rows: list[eras.Era], versions: set[tuple[int, ...]]) -> tuple[list[str], str] | None:
    """The rows the log's own version banners name, and why; None without a banner (or for a plugin whose
    numbers are not vLLM's)."""
    if not versions or (project != "vllm" and project not in _SAME_NUMBERED):
        return None
    text = " and ".join(eras.version_text(v) for v in sorted(versions))
    kept = _rows_of_releases(rows, versions)
    plugin = f", and {project} runs on the vLLM release of its own number" if project != "vllm" else ""
    if not kept:
        return [], f"it states vLLM {text} (its version banner){plugin}: no {project} row of the table holds it"
    return kept, f"it states vLLM {text} (its version banner){plugin}"


def _candidates(
    project: str, seen: list[LineKind], decimals: dict[str, int], hints: dict[str, Any]
) -> tuple[list[str], str]:
    """The era rows of ``project`` consistent with every hint (vLLM release ranges), and why."""
    rows = [e for e in eras.ERAS if e.project == project]
    # The release the log states outranks every other hint: the rows it names, where it names any.
    stated = _stated(project, rows, hints["versions"])
    if stated is not None:
        return stated
    if not seen:
        # No memory line, but vLLM's own file:line tags or frames may still name releases (an OOM's traceback).
        plugin = _same_numbered_rows(project, rows, hints)
        if plugin is not None:
            return plugin[0], f"no startup memory line; {plugin[1]}"
        return [], "no startup memory line"
    lo, hi = parse_version("0.0.0"), None
    bounds: list[tuple[str, tuple[int, ...], tuple[int, ...] | None]] = []
    for kind in seen:
        if kind.project or kind.releases == ALL:
            continue
        bounds.append((kind.name, kind.releases[0], kind.releases[1]))
    util = decimals.get("util")
    if util is not None:
        # "%.2f (util)" up to 0.13, "%f (util)" (six decimals) from 0.14 (w 0.11.0:284-290, 0.14.0:347).
        bounds.append(
            (
                "the utilization's digits",
                *((ALL[0], parse_version("0.13.0")) if util == 2 else (parse_version("0.14.0"), None)),
            )
        )
    weights = decimals.get("weights")
    if weights is not None:
        # "%.4f" up to 0.13, format_gib (round to 2) from 0.14 (gpu_model_runner.py 0.14.0:3906).
        bounds.append(
            (
                "the weights' digits",
                *((ALL[0], parse_version("0.13.0")) if weights == 4 else (parse_version("0.14.0"), None)),
            )
        )
    if decimals.get("available", 2) < 2:
        # "%.2f" up to 0.13 always prints two; format_gib (round to 2, "%s") from 0.14 drops trailing zeros.
        bounds.append(("the KV cache figure's digits", parse_version("0.14.0"), None))
    if hints["engine_core"]:
        # The engine process is "EngineCore_DP<n>" through 0.14 (v1/engine/utils.py 0.11.0:119, 0.14.0:122),
        # "EngineCore" without data parallelism by 0.20 (0.20.0:145, 0.34.0:289).
        bounds.append(("the process name EngineCore", parse_version("0.14.1"), None))
    tags = hints["tags"]
    if tags == {True}:
        bounds.append(("[file:line] tags", parse_version("0.8.0"), None))
    elif tags == {False}:
        bounds.append(("file:line] tags", ALL[0], parse_version("0.7.3")))
    for name, first, last in bounds:
        lo = max(lo, first)
        hi = last if hi is None else (hi if last is None else min(hi, last))
    if project != "vllm":
        # Platform releases differ in which lines they write (their rows' log_lines); DEBUG lines of vLLM's
        # memory_profiling count for the rows that call it.
        before_0_5 = ""
        if project == "vllm-mindspore" and any(k.name == "platform_plugin" for k in seen):
            # It names its platform plugin ('-> vllm_mindspore:'), which 0.5 no longer has: the rows before 0.5.
            rows = [e for e in rows if e.last is not None and e.last < parse_version("0.5.0")]
            before_0_5 = "vllm-mindspore before 0.5 (it names its platform plugin, which 0.5 no longer has): "
        # vllm-ascend's own lines are a 310P's too (NPUWorker310 is an NPUWorker).
        own = (None, project, "vllm-ascend") if project == "vllm-ascend-310p" else (None, project)
        # vllm-mindspore 0.5's own logger tag ("vllm-mindspore[logger.py:75]", vllm_mindspore/logger.py:30-31,73-75
        # @ 0.5.1) counts like a line: only the rows that list it write it (the seed's 0.2.0 log has none).
        kinds = ({k.name for k in seen if k.project in own} & _ROW_KINDS) - {"platform_plugin"}
        names = [e.name for e in rows if not e.log_lines or kinds <= set(e.log_lines)]
        if not names:
            return [], (
                f"{before_0_5}its lines ({', '.join(sorted(kinds))}) fit no {project} row of the table "
                f"(an older or newer release)"
            )
        if len(names) == 1:
            return names, f"{before_0_5}only {names[0]} writes {', '.join(sorted(kinds))}"
        why = f"{before_0_5}{', '.join(sorted(kinds))} are written by each of {len(names)} rows"
        plugin = _same_numbered_rows(project, rows, hints, among=names)
        if plugin is not None:
            return plugin[0], f"{why}; {plugin[1]}"
        return names, why
    if hi is not None and hi < lo:
        return [], "its lines contradict each other (" + ", ".join(
            dict.fromkeys(f"{n} {_text(first)}–{_text(last)}" for n, first, last in bounds)
        ) + ")"
    spans = []
    for index, era in enumerate(rows):
        end = rows[index + 1].first if index + 1 < len(rows) else None
        if (hi is None or era.first <= hi) and (end is None or lo < end):
            spans.append((era, end))
    names = [era.name for era, _ in spans]
    narrowing = list(dict.fromkeys(f"{n} ({_text(first)}–{_text(last)})" for n, first, last in bounds))
    # Where the lines came from in vLLM's source (file:line tags, traceback frames, the date logged) names
    # releases, not a range: rows none of them is in are left out, unless that leaves none (the lines' own
    # wording outranks a development build's line numbers).
    fitted = source_index.fit(hints["source_tags"], hints["frames"], hints["logged_on"], hints["wordings"])
    if fitted is not None:
        inside = [
            parse_version(r)
            for r in fitted.releases
            if lo <= parse_version(r) and (hi is None or parse_version(r) <= hi)
        ]
        kept = [era.name for era, end in spans if any(era.first <= r and (end is None or r < end) for r in inside)]
        if kept:
            names = kept
            lo, hi = min(inside), max(inside)
            narrowing.append(fitted.reason)
        elif fitted.releases:
            narrowing.append(fitted.reason.replace(" fit ", " fit only releases its lines rule out: left out; ", 1))
        else:
            narrowing.append(fitted.reason + ": left out")
    span = f"vLLM {_text(lo)}" if lo == hi else f"vLLM {_text(lo)}–{_text(hi)}"
    if len(names) == 1:
        return names, f"{span} from " + ", ".join(narrowing)
    if not narrowing:
        return names, "no line names a release range (the lines are every V1 release's)"
    return names, f"{span} from " + ", ".join(narrowing) + f": {len(names)} rows"


def parse_log(text: str) -> StartupLog:
    return parse_lines(text.splitlines())


# A startup log's memory lines come in its first minutes; a file larger than this is read up to here.
MAX_LOG_BYTES = 256 * 1024 * 1024
MAX_LINE_BYTES = 4 * MAX_LINE_CHARS


def read_log_file(path: str, max_bytes: int = MAX_LOG_BYTES) -> StartupLog:
    """Parse a startup log file, bounded: regular files only, at most ``max_bytes`` read, lines
    longer than MAX_LINE_BYTES skipped (lines end at "\\n" only, as ``parse_lines`` of the file's lines
    gives). Raises LogFileError or LogLineError (one line each), or OSError when it cannot be opened."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below anyway.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise LogFileError(f"cannot read log file {path}: not a regular file")
        try:
            reader, number = _Reader(), 1
            for text in _text_blocks(handle, max_bytes):
                number = reader.feed_text(number, text)
            return reader.finish()
        except LogLineError as exc:
            raise LogLineError(f"log file {path}: {exc}") from None


def read_startup_log(path: str, oom_is_enough: bool = False) -> StartupLog:
    """``read_log_file`` for the command line: every failure is a LogFileError with one line (a missing
    or unreadable file, a number too long to be real, a file with no startup memory lines; with
    ``oom_is_enough``, as ``check`` reads it, a log holding only an OOM message is read)."""
    try:
        startup = read_log_file(path)
    except LogLineError as exc:
        raise LogFileError(str(exc)) from None
    except FileNotFoundError:
        raise LogFileError(f"log file not found: {path}") from None
    except OSError as exc:
        raise LogFileError(f"cannot read log file {path}: {exc.strerror or exc}") from None
    if startup.lines_matched == 0 and not (oom_is_enough and startup.ooms):
        raise LogFileError(f"no vLLM startup memory lines found in {path}")
    return startup


# The file is read this many bytes at a time, and decoded a block of whole lines at once.
BLOCK_BYTES = 1 << 20
_HALF_LINE = MAX_LINE_BYTES // 2


def _text_blocks(handle: BinaryIO, max_bytes: int) -> Iterator[str]:
    """The file's first ``max_bytes`` as blocks of whole lines, each block its lines decoded and joined by "\\n"
    (their own endings gone, a "\\r" before them kept). A line longer than MAX_LINE_BYTES with its ending is left
    out whole (and not numbered); the last line may lack its ending (the file's end, or ``max_bytes``'s)."""
    left = max_bytes
    carry = b""  # the start of a line the last read cut
    dropping = False  # inside a line already too long, left out up to its end
    while left > 0:
        chunk = handle.read(min(BLOCK_BYTES, left))
        if not chunk:
            break
        left -= len(chunk)
        if dropping:
            cut = chunk.find(b"\n")
            if cut < 0:
                continue
            chunk, dropping = chunk[cut + 1 :], False
        data = carry + chunk if carry else chunk
        end = data.rfind(b"\n")
        carry = data[end + 1 :]
        if len(carry) > MAX_LINE_BYTES:
            carry, dropping = b"", True
        if end >= 0:
            block = _short_lines(data[:end])
            if block is not None:
                yield block.decode("utf-8", errors="replace")
    if carry and not dropping:
        yield carry.decode("utf-8", errors="replace")


def _short_lines(block: bytes) -> bytes | None:
    """``block`` (lines joined by "\\n") without its lines of MAX_LINE_BYTES or more (MAX_LINE_BYTES + 1 with their
    ending); None when none is left."""
    # A line that long fills one of these windows with no line ending in it; most blocks have none.
    if not any(block.find(b"\n", at, at + _HALF_LINE) < 0 for at in range(0, len(block) - _HALF_LINE + 1, _HALF_LINE)):
        return block
    kept = [line for line in block.split(b"\n") if len(line) < MAX_LINE_BYTES]
    return b"\n".join(kept) if kept else None


def kinds_markdown() -> str:
    """The line kinds as a markdown table (docs/reference/log-lines.md holds it; a test keeps the two equal)."""
    rows = ["| Kind | Template | vLLM releases | Project | Source |", "|---|---|---|---|---|"]
    for kind in KINDS:
        first, last = kind.releases
        releases = (
            "any"
            if kind.releases == ALL
            else f"{_text(first)}+"
            if last is None
            else f"{'…' if first == ALL[0] else _text(first)}–{_text(last)}"
        )
        template = kind.template.replace("|", "\\|").replace("`", "'")
        rows.append(
            f"| {kind.name} | `{template}` | {releases} | {kind.project or ''} | {kind.cite.replace('|', '/')} |"
        )
    return "\n".join(rows) + "\n"
