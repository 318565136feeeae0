"""Startup facts from a vLLM / vllm-ascend / vllm-mindspore log.

Pure parsing: text in, a StartupLog record out. What a log does not say stays None; nothing
is invented. Each line kind below is a template of literal text and numeric slots, matched
without regular-expression backtracking: the first literal is found with ``str.find``, every
later piece must follow it (``…`` skips to the next literal), and a number is one bounded
token. Parsing is linear in the log's size whatever the text; a number longer than
:data:`MAX_NUMBER_CHARS` is refused with a one-line :class:`LogLineError`.

The templates follow each release's format strings (file:line per release in
``kvguard/vllm/eras.py`` and the README's era table); each carries the vLLM releases that
write it, so the lines a log holds narrow down its era.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO, Callable, Iterable, Iterator

from kvguard.estimator import FORMULAS, Profile, required_fields
from kvguard.vllm import eras

GIB = 1 << 30
MAX_NUMBER_CHARS = 40
# A line longer than this is not a vLLM log line; skip it rather than scan it.
MAX_LINE_CHARS = 8192
_ANSI = re.compile(r"\x1b\[[0-9;?]{0,32}[A-Za-z]")
# One bounded token; the class repeats once, so matching is linear in its length.
_NUMBER = re.compile(r"[-+]?[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")


class LogFileError(ValueError):
    """One line saying why a log file is not read (it is not a regular file)."""


class LogLineError(ValueError):
    """A budget line whose numbers cannot be taken (too long to be a real figure); one line."""


V = eras._v
ALL = (V("0.0.0"), None)


@dataclass(frozen=True)
class LineKind:
    """One startup line: its template, the releases that write it, and the facts it states."""

    name: str
    template: str                      # literals, {fact:unit} numbers, … to skip ahead
    releases: tuple[tuple[int, ...], tuple[int, ...] | None] = ALL   # vLLM first..last writing it
    project: str | None = None         # a line only that project writes
    cite: str = ""
    also: Callable[[dict[str, str], dict[str, Any]], None] | None = field(default=None, compare=False)
    pieces: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)
    units: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        pieces = tuple(_compile(self.template))
        object.__setattr__(self, "pieces", tuple((kind, value.partition(":")[0] if kind == "num" else value)
                                                 for kind, value in pieces))
        object.__setattr__(self, "units", {value.partition(":")[0]: value.partition(":")[2]
                                           for kind, value in pieces if kind == "num"})

    def match(self, line: str) -> dict[str, str] | None:
        kind, anchor = self.pieces[0]
        start = line.find(anchor)
        tries = 0
        while start >= 0 and tries < 4:
            found = _match_from(self.pieces, line, start)
            if found is not None:
                return found
            tries += 1
            start = line.find(anchor, start + 1)
        return None


def _compile(template: str) -> Iterator[tuple[str, str]]:
    """``"took {weights_bytes:gib} GiB … and"`` -> (lit, "took "), (num, "weights_bytes:gib"), (lit, " GiB"),
    (skip, ""), (lit, " and"). A slot names the fact it states and its unit (gib, int, float)."""
    for part in re.split(r"(\{[a-z_]+:[a-z]+\}|…)", template):
        if not part:
            continue
        if part == "…":
            yield ("skip", "")
        elif part.startswith("{"):
            yield ("num", part[1:-1])
        else:
            yield ("lit", part)


def _match_from(pieces: tuple[tuple[str, str], ...], line: str, pos: int) -> dict[str, str] | None:
    found: dict[str, str] = {}
    skipping = False
    for kind, value in pieces:
        if kind == "skip":
            skipping = True
            continue
        if kind == "lit":
            if skipping:
                at = line.find(value, pos)
                if at < 0:
                    return None
                pos = at
                skipping = False
            elif not line.startswith(value, pos):
                return None
            pos += len(value)
            continue
        token = _NUMBER.match(line, pos)
        if token is None:
            return None
        text = token.group()
        if len(text) > MAX_NUMBER_CHARS:
            raise LogLineError(f"number {text[:12]}… ({len(text)} characters) is too long for a memory figure")
        found[value] = text
        pos = token.end()
    return found


def _util_decimals(found: dict[str, str], f: dict[str, Any]) -> None:
    # "%.2f (util)" up to 0.13, "%f (util)" (six decimals) from 0.14: it tells the eras apart.
    f["_util_decimals"] = len(found["gpu_memory_utilization"].partition(".")[2])


def _kv_cache_memory_decided(found: dict[str, str], f: dict[str, Any]) -> None:
    f.setdefault("available_kv_cache_bytes", f["kv_cache_memory_bytes"])


def _cudagraph_utilization(found: dict[str, str], f: dict[str, Any]) -> None:
    f.setdefault("gpu_memory_utilization", f["_cudagraph_util"])


def _halved(found: dict[str, str], f: dict[str, Any]) -> None:
    f["halved_for_workspace"] = True


# The templates, by the releases that write them (research: the wheels' format strings).
KINDS: tuple[LineKind, ...] = (
    # Weights: "%.4f GiB and %.6f seconds" (0.10.2-0.11), "… GiB memory and …" (0.12+ v1 runner),
    # format_gib from 0.14; V0's "Loading model weights took %.4f GB" divides by 2**30 too.
    LineKind("model_loading", "Model loading took {weights_bytes:gib} GiB",
             cite="v1/worker/gpu_model_runner.py 0.11.0:2653, 0.14.0:3906; v1/worker/gpu/model_runner.py 0.34.0:442"),
    LineKind("model_loading", "Loading model weights took {weights_bytes:gib} GB",
             cite="worker/model_runner.py 0.6.4:1077; vllm-ascend model_runner_v1.py"),
    # "Initial free memory: %.2f GiB; Requested memory: %.2f (util), %.2f GiB" (<= 0.13, util 2 decimals);
    # "%s GiB; Requested memory: %f (util), %s GiB" (0.14+, util 6 decimals).
    LineKind("requested_memory", "Initial free memory: {init_free_memory_bytes:gib} GiB; Requested memory: "
             "{gpu_memory_utilization:float} (util), {requested_memory_bytes:gib} GiB", releases=(V("0.9.1"), None),
             also=_util_decimals,
             cite="w 0.11.0:284-290, 0.14.0:347, 0.34.0:784"),
    LineKind("kv_cache_memory_bytes", "Initial free memory {init_free_memory_bytes:gib} GiB, reserved {kv_cache_memory_bytes:gib}…"
             "memory for KV Cache as specified by kv_cache_memory_bytes config", releases=(V("0.9.1"), None),
             also=_kv_cache_memory_decided,
             cite="w 0.11.0:240-251, 0.14.0:299-312, 0.34.0:696-708"),
    # 0.10.2-0.11 wrote "This does does not respect" in that line (w 0.11.0:245); 0.12 fixed the words.
    LineKind("era_hint", "skipped memory profiling. This does does not respect", releases=(V("0.9.1"), V("0.11.2")),
             cite="w 0.11.0:240-251, 0.13.0:316-327"),
    LineKind("profile_peak", "Total non KV cache memory: {non_kv_cache_bytes:gib}GiB; torch peak memory increase: "
             "{peak_allocated_increase_bytes:gib}GiB; non-torch forward increase memory: "
             "{non_torch_increase_bytes:gib}GiB; weights memory: {weights_bytes:gib}GiB",
             releases=(V("0.9.1"), V("0.26.0")), cite="utils/__init__.py 0.11.0:2771-2779; mu 0.14.0:187-198"),
    LineKind("profile_consumed", "Total non KV cache memory: {non_kv_cache_bytes:gib}GiB; torch peak memory increase: "
             "{peak_allocated_increase_bytes:gib}GiB; total consumed (from mem_get_info): "
             "{total_consumed_bytes:gib}GiB; weights memory: {weights_bytes:gib}GiB",
             releases=(V("0.27.0"), None), cite="mu 0.27.0:220-231, 0.34.0:231-242"),
    LineKind("init_snapshot", "worker init memory snapshot: …free_memory={_snapshot_free:gib}GiB, "
             "total_memory={total_memory_bytes:gib}GiB",
             releases=(V("0.14.0"), None), cite="w 0.14.0:235; mu 0.14.0:91-102 MemorySnapshot.__repr__"),
    LineKind("cudagraph", "CUDA graph memory profiling is enabled (default since v0.21.0). The current "
             "--gpu-memory-utilization={_cudagraph_util:float} is equivalent to --gpu-memory-utilization="
             "{_cudagraph_equiv:float} without",
             releases=(V("0.20.0"), None), cite="w 0.20.0:445-468, 0.27.0:568-591, 0.34.0:800-820",
             also=_cudagraph_utilization),
    LineKind("cudagraph", "CUDA graph memory profiling is enabled (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1)."
             "…The current --gpu-memory-utilization={_cudagraph_util:float} is equivalent to "
             "--gpu-memory-utilization={_cudagraph_equiv:float} without", releases=(V("0.18.0"), V("0.19.1")), cite="w 0.18.0:472-484, 0.19.0:453"),
    LineKind("cudagraph_estimate", "Estimated CUDA graph memory: {cudagraph_memory_bytes:gib} GiB total",
             releases=(V("0.20.0"), None), cite="v1/worker/gpu_model_runner.py 0.20.0:5963-6045"),
    LineKind("available_kv_cache", "Available KV cache memory: {_available_profiled:gib} GiB",
             cite="w 0.11.0:298, 0.14.0:358-362, 0.34.0:795-798"),
    LineKind("kv_cache_size", " KV cache size: {kv_cache_tokens:int} tokens",
             cite="v1/core/kv_cache_utils.py 0.11.0:1079-1092; 0.34.0:1157-1176 (one line with the concurrency)"),
    LineKind("max_concurrency", "Maximum concurrency for {max_model_len:int} tokens per request: {max_concurrency:float}x",
             cite="v1/core/kv_cache_utils.py 0.11.0:1079-1092, 0.30.0:2385-2401"),
    LineKind("warmup_measured", "Memory after warmup: … GiB free, … GiB committed to the KV cache, … GiB kept for transient "
             "activations (… GiB allocated at peak, … GiB of torch reservation growth); {_warmup_blocks:int} "
             "KV cache blocks ({_warmup_kv:gib} GiB) fit within the requested ",
             releases=(V("0.34.0"), None), cite="v1/worker/extensible_kv_cache.py 0.34.0:693-709"),
    LineKind("extended_kv_cache", "Extended KV cache to {num_gpu_blocks:int} blocks ({_extended_kv:gib} GiB)",
             releases=(V("0.34.0"), None), cite="v1/worker/extensible_kv_cache.py 0.34.0:536-540"),
    LineKind("free_on_startup", "Free memory on device (…/{total_memory_bytes:gib} GiB) on startup. Desired GPU memory "
             "utilization is ({gpu_memory_utilization:float}", cite="w 0.11.0:185-195 (the refusal when free < requested)"),
    # V0's worker (worker/worker.py): its lines pin the V0 row (the V0 engine stayed selectable
    # until 0.10, but kvguard's table follows each release's default engine).
    LineKind("v0_can_use", "can use total_gpu_memory ({total_memory_bytes:gib}GiB) x gpu_memory_utilization "
             "({gpu_memory_utilization:float})",
             releases=(V("0.6.4"), V("0.8.4")), cite="worker/worker.py 0.7.0 determine_num_available_blocks"),
    LineKind("v0_breakdown", "model weights take {weights_bytes:gib}GiB; non_torch_memory takes {non_torch_increase_bytes:gib}GiB; "
             "PyTorch activation peak memory takes {peak_allocated_increase_bytes:gib}GiB; the rest of the memory "
             "reserved for KV Cache is {_available_profiled:gib}GiB",
             releases=(V("0.6.4"), V("0.8.4")), cite="worker/worker.py 0.7.0"),
    LineKind("v0_results", "Memory profiling results: total_gpu_memory={total_memory_bytes:gib}GiB…peak_torch_memory="
             "{peak_torch_memory_bytes:gib}GiB…non_torch_memory={non_torch_increase_bytes:gib}GiB kv_cache_size="
             "{_available_profiled:gib}GiB gpu_memory_utilization={gpu_memory_utilization:float}",
             releases=(V("0.6.4"), V("0.6.4")), cite="worker/worker.py 0.6.4:232-243"),
    # "# GPU blocks: %d, # CPU blocks: %d"; later "# %s blocks" with the device name (cuda, CUDA, npu, …).
    LineKind("v0_blocks", "# … blocks: {num_gpu_blocks:int}", releases=(V("0.6.4"), V("0.8.4")),
             cite="executor/gpu_executor.py 0.6.4:113; executor/executor_base.py 0.7.0:110"),
    # vllm-ascend's NPUWorker (worker_v1.py), absolute bytes.
    LineKind("ascend_available", "Available memory: {_available_profiled:int}, total memory: {total_memory_bytes:int}", project="vllm-ascend",
             cite="vllm_ascend/worker/worker_v1.py determine_available_memory (2025-07 .. 2025-11)"),
    LineKind("ascend_halved", "(halved for workspace)", project="vllm-ascend-310p", also=_halved,
             cite="vllm_ascend/worker/worker_310p.py NPUWorker310"),
    # The platform plugin a log names tells vllm-ascend and vllm-mindspore apart from vLLM.
    LineKind("platform_plugin", "-> vllm_mindspore:", project="vllm-mindspore",
             cite="vllm/plugins/__init__.py 'Available plugins for group vllm.platform_plugins'"),
    LineKind("platform_plugin", "-> vllm_ascend:", project="vllm-ascend"),
)

# Quick reject: a line with none of these cannot match any template.
_KEYS = tuple(sorted({k.pieces[0][1] for k in KINDS}, key=len))


@dataclass(frozen=True)
class StartupLog:
    """What one startup log says. Sizes in bytes; log sizes carry vLLM's 0.01 GiB rounding."""

    era: str | None = None                       # the era table row the lines pin down, if one
    era_candidates: tuple[str, ...] = ()         # every row consistent with the lines seen
    project: str = "vllm"
    total_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    init_free_memory_bytes: int | None = None
    requested_memory_bytes: int | None = None
    weights_bytes: int | None = None
    peak_allocated_increase_bytes: int | None = None
    non_torch_increase_bytes: int | None = None
    non_kv_cache_bytes: int | None = None
    total_consumed_bytes: int | None = None
    cudagraph_memory_bytes: int | None = None
    kv_cache_memory_bytes: int | None = None     # --kv-cache-memory-bytes, as the log states it
    peak_torch_memory_bytes: int | None = None   # 0.6.4: weights + activation peak together
    available_kv_cache_bytes: int | None = None  # what vLLM decided
    num_gpu_blocks: int | None = None
    kv_cache_tokens: int | None = None
    max_model_len: int | None = None
    max_concurrency: float | None = None
    halved_for_workspace: bool = False
    lines_matched: int = 0
    kinds_seen: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["era_candidates"] = list(self.era_candidates)
        data["kinds_seen"] = list(self.kinds_seen)
        return data

    @property
    def era_row(self) -> "eras.Era | None":
        return next((e for e in eras.ERAS if e.name == self.era), None)

    def profile_fields(self) -> dict[str, Any]:
        """The profile figures the log states, with the formula of its era where the lines pin one."""
        formulas = {e.formula for e in eras.ERAS if e.name in self.era_candidates}
        formula = formulas.pop() if len(formulas) == 1 else ("consumed" if self.total_consumed_bytes is not None
                                                              else "peak")
        fields: dict[str, Any] = {"formula": formula}
        for name in ("total_memory_bytes", "gpu_memory_utilization", "weights_bytes",
                     "peak_allocated_increase_bytes", "non_torch_increase_bytes", "total_consumed_bytes",
                     "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.total_consumed_bytes is not None and self.non_kv_cache_bytes is not None:
            fields["transient_peak_headroom_bytes"] = max(0, self.non_kv_cache_bytes - self.total_consumed_bytes)
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


def _record(kind: LineKind, found: dict[str, str], f: dict[str, Any]) -> None:
    """What a line states, into the facts dict: each slot is a fact in its unit."""
    for fact, text in found.items():
        value = _CONVERT[kind.units[fact]](text)
        if fact == "_available_profiled" and fact in f:
            value = min(value, f[fact])     # every worker logs its own; the engine keeps the smallest
        f[fact] = value
    if kind.also is not None:
        kind.also(found, f)


def parse_lines(lines: Iterable[str]) -> StartupLog:
    """Parse a log's lines; raises LogLineError (one line, with the line number) for a budget line
    whose numbers are too long to be real."""
    facts: dict[str, Any] = {}
    matched = 0
    seen: list[LineKind] = []
    for number, raw in enumerate(lines, 1):
        if len(raw) > MAX_LINE_CHARS:
            continue
        if not any(key in raw for key in _KEYS):
            continue
        line = _ANSI.sub("", raw) if "\x1b" in raw else raw
        hit = False
        for kind in KINDS:
            # A line may state several facts (0.30+ joins the KV size and the concurrency).
            try:
                found = kind.match(line)
                if found is None:
                    continue
                _record(kind, found, facts)
            except LogLineError as exc:
                raise LogLineError(f"line {number}: {exc}") from None
            except (ValueError, OverflowError):
                continue
            hit = True
            seen.append(kind)
        matched += hit
    return _finish(facts, matched, seen)


def _finish(facts: dict[str, Any], matched: int, seen: list[LineKind]) -> StartupLog:
    projects = [k.project for k in seen if k.project]
    # 310P's own line is the most specific; then a platform plugin's.
    project = "vllm-ascend-310p" if "vllm-ascend-310p" in projects else (projects[0] if projects else "vllm")
    candidates = _candidates(project, seen, facts.pop("_util_decimals", None))
    facts["era"] = candidates[0] if len(candidates) == 1 else None
    facts["era_candidates"] = tuple(candidates)
    facts["project"] = project
    snapshot_free = facts.pop("_snapshot_free", None)
    if snapshot_free is not None:
        facts.setdefault("init_free_memory_bytes", snapshot_free)
    util, equiv = facts.pop("_cudagraph_util", None), facts.pop("_cudagraph_equiv", None)
    delta = util - equiv if util is not None and equiv is not None else None
    total = facts.get("total_memory_bytes")
    if total is None and facts.get("requested_memory_bytes") and facts.get("gpu_memory_utilization"):
        # The requested figure is total × utilization, printed to 0.01 GiB.
        facts["total_memory_bytes"] = round(facts["requested_memory_bytes"] / facts["gpu_memory_utilization"])
        total = facts["total_memory_bytes"]
    if "cudagraph_memory_bytes" not in facts and delta is not None and total:
        facts["cudagraph_memory_bytes"] = round(delta * total)
    profiled = facts.pop("_available_profiled", None)
    extended = facts.pop("_extended_kv", None)
    warmup = facts.pop("_warmup_kv", None)
    warmup_blocks = facts.pop("_warmup_blocks", None)
    # What vLLM decided: 0.34's extensible KV cache commits its size after warm-up; before, the profile.
    decided = extended if extended is not None else warmup if warmup is not None else profiled
    if decided is not None:
        facts["available_kv_cache_bytes"] = decided
    if facts.get("num_gpu_blocks") is None and warmup_blocks is not None:
        facts["num_gpu_blocks"] = warmup_blocks
    return StartupLog(lines_matched=matched, kinds_seen=tuple(dict.fromkeys(k.name for k in seen)), **facts)


def _candidates(project: str, seen: list[LineKind], util_decimals: int | None) -> list[str]:
    """The era rows of ``project`` consistent with every line seen (vLLM release ranges)."""
    lo, hi = V("0.0.0"), None
    for kind in seen:
        if kind.project:
            continue
        first, last = kind.releases
        lo = max(lo, first)
        hi = last if hi is None else (hi if last is None else min(hi, last))
    if util_decimals is not None:
        # "%.2f (util)" up to 0.13, "%f (util)" (six decimals) from 0.14 (w 0.11.0:284-290, 0.14.0:347).
        if util_decimals == 2:
            hi = V("0.13.0") if hi is None else min(hi, V("0.13.0"))
        else:
            lo = max(lo, V("0.14.0"))
    if not seen:
        return []
    rows = [e for e in eras.ERAS if e.project == project]
    if project != "vllm":
        # Platform releases differ in which lines they write (their rows' log_lines).
        kinds = {k.name for k in seen if k.project is None or k.project == project} - {"platform_plugin"}
        return [e.name for e in rows if not e.log_lines or kinds <= set(e.log_lines)]
    names = []
    for index, era in enumerate(rows):
        end = rows[index + 1].first if index + 1 < len(rows) else None
        if (hi is None or era.first <= hi) and (end is None or lo < end):
            names.append(era.name)
    return names


def parse_log(text: str) -> StartupLog:
    return parse_lines(text.splitlines())


# A startup log's memory lines come in its first minutes; a file larger than this is read up to here.
MAX_LOG_BYTES = 256 * 1024 * 1024
MAX_LINE_BYTES = 4 * MAX_LINE_CHARS


def read_log_file(path: str, max_bytes: int = MAX_LOG_BYTES) -> StartupLog:
    """Parse a startup log file, bounded: regular files only, at most ``max_bytes`` read, lines
    longer than MAX_LINE_BYTES skipped. Raises LogFileError or LogLineError (one line each), or
    OSError when it cannot be opened."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below anyway.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise LogFileError(f"cannot read log file {path}: not a regular file")
        try:
            return parse_lines(_bounded_lines(handle, max_bytes))
        except LogLineError as exc:
            raise LogLineError(f"log file {path}: {exc}") from None


def read_startup_log(path: str) -> StartupLog:
    """``read_log_file`` for the command line: every failure is a LogFileError with one line (a missing
    or unreadable file, a number too long to be real, a file with no startup memory lines)."""
    try:
        startup = read_log_file(path)
    except LogLineError as exc:
        raise LogFileError(str(exc)) from None
    except FileNotFoundError:
        raise LogFileError(f"log file not found: {path}") from None
    except OSError as exc:
        raise LogFileError(f"cannot read log file {path}: {exc.strerror or exc}") from None
    if startup.lines_matched == 0:
        raise LogFileError(f"no vLLM startup memory lines found in {path}")
    return startup


def _bounded_lines(handle: BinaryIO, max_bytes: int) -> Iterator[str]:
    left = max_bytes
    while left > 0:
        line = handle.readline(min(MAX_LINE_BYTES + 1, left))
        if not line:
            return
        left -= len(line)
        if len(line) > MAX_LINE_BYTES:
            # Overlong: drop it and the rest of it, still counting what is read.
            while left > 0 and not line.endswith(b"\n"):
                line = handle.readline(min(MAX_LINE_BYTES + 1, left))
                if not line:
                    return
                left -= len(line)
            continue
        yield line.decode("utf-8", errors="replace")
