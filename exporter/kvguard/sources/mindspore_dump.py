"""Exact mode on MindSpore: the pool's own buffer lists, from the dump MindSpore writes itself.

``memory_stats()`` cannot tell how much of the pool's idle memory the next request can reuse
(docs/explanation/guard.md). One route shows it: with ``MS_ALLOC_CONF=...,defrag_memory_step_freq:<N>dump``
(2.5+) the pool writes ``MemoryDebugInfo<k>.txt`` every N graph runs, listing every used, idle and
eager-free buffer. This module

- merges that option into the user's ``MS_ALLOC_CONF`` (:func:`dump_alloc_conf`, which the vLLM plugin
  calls at launch when ``KVGUARD_MINDSPORE_DUMP`` is set);
- finds the newest file this process wrote (:func:`dump_directory`, :class:`DumpReader`), parses it
  with bounds (a hostile or truncated file is a counted skip with a one-line reason), deletes the
  older ones (MindSpore never rotates them), and returns a :class:`kvguard.records.PoolFigures`.

Upstream, at r2.7.rc1 of mindspore-ai/mindspore unless a tag is named:

- ``MS_ALLOC_CONF`` is parsed once per process (``Config::GetValue``, core/utils/ms_utils.cc:56-104): one
  pair of matching quotes around the whole value is stripped (repeatedly), ``;`` counts as ``,``, items are
  ``key:value`` split at the first ``:`` and trimmed, and a later item with the same key overwrites an
  earlier one. Items without ``:`` are ignored.
- ``defrag_memory_step_freq``: its leading digits are the frequency (``sstream >> size_t``; 0 or none: the
  default 100; runtime/graph_scheduler/actor/actor_common.cc:386-404), and the pool dumps when the value
  contains ``dump`` anywhere (``enable_dump_memory_``, memory/mem_pool/abstract_dynamic_mem_pool.cc:424-426;
  v2.5.0 :352-354). Both are read once, at pool creation and at the first graph run.
- ``DataPrepareActor::PreprocessBeforePrepareData`` calls ``DefragMemory()`` every N runs of its graph, one
  count per graph actor (runtime/graph_scheduler/actor/data_prepare_actor.cc:595, 1602-1613), and
  ``DefragMemory`` dumps first (abstract_dynamic_mem_pool.cc:930-937); under VMM it then eager-frees the idle
  memory, as it does without the dump.
- The file: ``DumpDynamicMemPoolDebugInfo`` (abstract_dynamic_mem_pool.cc:1042-1077) names it
  ``MemoryDebugInfo<k>.txt``, k a per-process counter from 0, in ``GeneratePath``'s folder
  (memory/mem_pool/mem_pool_util.cc:42-75): ``memory_tracker_path`` from ``MS_ALLOC_CONF``, else ``./`` (the
  process's working directory), plus ``rank_<id>/`` once the job is distributed (the Ascend pool's rank
  getter: ``DistributedMeta`` global rank, else none; plugin/res_manager/ascend/mem_manager/
  ascend_memory_pool.cc:579-585).
- Its sections: ``In used mem buf info for <allocator>, mem_bufs size : n`` with n used buffers, then per
  allocator ``Dump debug info for <allocator>`` with ``Mem block info``, ``Free mem buf info`` (idle) and
  ``Eager free mem buf info``, each ``- total count : n`` and n lines, one JSON object a buffer
  (``MemBuf::ToJson``: ``addr_``, ``size_``, ...). ``<allocator>`` is ``MemBufAllocator::BriefInfo``:
  ``is persistent : p, stream id : s`` (2.7.0), with ``enable vmm`` and ``is small`` from 2.7.1
  (the wheel's headers).

Which vllm-mindspore paths reach the dump: only graph runs. Native models in graph mode (the default,
``enforce_eager`` off) run prefill and decode through ``ms.jit(function=self.model, jit_level="O0")``
(vllm_mindspore/model_executor/models/model_base.py:651-690 @ v0.5.1), each a graph with its own
``DataPrepareActor``, so each dumps every N of its runs. Eager mode (``--enforce-eager``, and native
models with LoRA, model_base.py:376-378 @ v0.5.1) runs op by op in PyNative, which does not pass through
``DataPrepareActor``: no dump, and the guard keeps the sound bound (no credit). MindFormers models run
their network Cell per ``phase`` (mf_models/mindformers.py:359-385 @ v0.5.1); whether that reaches
``DataPrepareActor`` was not checked on a real process.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from kvguard.allocators.mindspore_releases import VMM_PAGE_BYTES
from kvguard.records import MAX_COUNTER, PoolFigures

DUMP_ENV = "KVGUARD_MINDSPORE_DUMP"  # 1: on, every DEFAULT_EVERY graph runs; N >= 2: every N
ALLOC_CONF_ENV = "MS_ALLOC_CONF"
DEFRAG_KEY = "defrag_memory_step_freq"
TRACKER_PATH_KEY = "memory_tracker_path"
DUMP_WORD = "dump"
DEFAULT_EVERY = 100  # MindSpore's own default (actor_common.cc:387), so the defrag cadence stays
MAX_EVERY = 1_000_000
FILE_RE = re.compile(r"MemoryDebugInfo(\d{1,12})\.txt")
# Bounds. A serving pool's dump is ~108 bytes a buffer (0.76 MB for ~7,000 buffers, measured): these admit
# ~500,000 buffers and refuse anything larger as hostile.
MAX_FILE_BYTES = 64 << 20
MAX_LINES = 1_000_000
MAX_LINE_CHARS = 4096


class DumpError(ValueError):
    """Why a dump file was skipped: ``reason``, one of SKIP_REASONS (the skip counter's key), and one line."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


SKIP_REASONS = ("unreadable", "too_large", "not_text", "truncated", "malformed")


# ----------------------------------------------------------------------------------------------- MS_ALLOC_CONF
def _strip_quotes(value: str) -> str:
    """As ``Config::GetValue``: while the value starts and ends with the same quote, drop both."""
    while len(value) >= 2 and value[0] in "'\"" and value[0] == value[-1]:
        value = value[1:-1]
    return value


def alloc_conf_items(value: str | None) -> list[tuple[str | None, str]]:
    """``MS_ALLOC_CONF`` as MindSpore splits it: (key, value) per item, trimmed; (None, text) for an item
    without ``:``, which MindSpore ignores."""
    if not value:
        return []
    items: list[tuple[str | None, str]] = []
    for item in _strip_quotes(value).replace(";", ",").split(","):
        item = item.strip()
        if not item:
            continue
        key, colon, rest = item.partition(":")
        items.append((key.strip(), rest.strip()) if colon else (None, item))
    return items


def alloc_conf_value(value: str | None, key: str) -> str | None:
    """The value MindSpore reads for ``key`` (the last item with that key), or None."""
    found = None
    for item_key, item_value in alloc_conf_items(value):
        if item_key == key:
            found = item_value
    return found


def dump_every(setting: str | None) -> int | None:
    """``KVGUARD_MINDSPORE_DUMP`` as graph runs between dumps: None (off) for unset, empty, 0, false, off or
    no; DEFAULT_EVERY for 1, true, on or yes; N for an integer N from 2 to MAX_EVERY. ValueError (one line)
    for anything else."""
    text = (setting or "").strip().lower()
    if text in ("", "0", "false", "off", "no"):
        return None
    if text in ("1", "true", "on", "yes"):
        return DEFAULT_EVERY
    if text.isdigit() and 2 <= int(text) <= MAX_EVERY:
        return int(text)
    raise ValueError(f"{DUMP_ENV}={setting!r}: expected 0/1 (off/on) or the graph runs between dumps, 2 to {MAX_EVERY}")


def merged_alloc_conf(user: str | None, every: int = DEFAULT_EVERY) -> str:
    """The user's ``MS_ALLOC_CONF`` with the pool's periodic dump turned on.

    The user's other items are kept as they are. A ``defrag_memory_step_freq`` the user set wins: under VMM it
    is also how often ``DefragMemory`` eager-frees idle memory, so kvguard keeps the engine's cadence and only
    adds the word ``dump`` to it (a value that has it already is left alone). Without one, ``<every>dump``
    (every: 100, MindSpore's default, unless ``KVGUARD_MINDSPORE_DUMP`` names another)."""
    items = alloc_conf_items(user)
    current = alloc_conf_value(user, DEFRAG_KEY)
    if current is not None and DUMP_WORD in current:
        return _strip_quotes(user or "")
    digits = re.match(r"\d+", current or "")
    user_every = int(digits.group()) if digits and int(digits.group()) > 0 else None
    merged = [f"{key}:{value}" if key is not None else value for key, value in items if key != DEFRAG_KEY]
    merged.append(f"{DEFRAG_KEY}:{user_every or every}{DUMP_WORD}")
    return ",".join(merged)


def dump_alloc_conf(environ: Mapping[str, str]) -> str | None:
    """What the vLLM plugin sets ``MS_ALLOC_CONF`` to at launch, before MindSpore first reads it: the user's
    value with the dump merged in (:func:`merged_alloc_conf`) when ``KVGUARD_MINDSPORE_DUMP`` asks for it,
    else None (leave it alone). Pure; ValueError (one line) for a bad setting."""
    every = dump_every(environ.get(DUMP_ENV))
    if every is None:
        return None
    return merged_alloc_conf(environ.get(ALLOC_CONF_ENV), every)


def dump_directory(alloc_conf: str | None, cwd: str | Path, rank: int | None = None) -> Path:
    """Where the pool writes its dumps (``GeneratePath``, mem_pool_util.cc:42-75): ``memory_tracker_path``,
    else the process's working directory, plus ``rank_<rank>`` when the job is distributed."""
    base = Path(alloc_conf_value(alloc_conf, TRACKER_PATH_KEY) or ".")
    folder = base if base.is_absolute() else Path(cwd) / base
    return folder / f"rank_{rank}" if rank is not None else folder


# ----------------------------------------------------------------------------------------------- the file
_ALLOCATOR_RE = re.compile(
    r"Mem buf allocator,(?: enable vmm : (\d+),)? is persistent : (\d+), stream id : (\d+)"
    r"(?:, is small : (\d+))?"
)
_COUNT_RE = re.compile(r"(?:total count|mem_bufs size) : (\d+)\s*$")


@dataclass
class _Allocator:
    persistent: int
    stream: int
    small: int
    largest_idle: int = 0
    idle_count: int = 0
    has_used: bool = False
    sections: set = field(default_factory=set)  # of its "Dump debug info" block: blocks, idle, eager free


def _number(line: str, key: str) -> int:
    """The value of ``"key":`` in a buffer line (``MemBuf::ToJson``: ``"addr_":0x1000...,"size_":512,...``)."""
    at = line.find(key)
    if at < 0:
        raise DumpError("malformed", f"a buffer line without {key[1:-2]}: {line[:80]!r}")
    at += len(key)
    end = line.find(",", at)
    try:
        value = int(line[at : end if end >= 0 else len(line)].strip('"} '), 0)
    except ValueError:
        raise DumpError("malformed", f"a buffer line whose {key[1:-2]} is not a number: {line[:80]!r}") from None
    if not 0 <= value <= MAX_COUNTER:
        raise DumpError("malformed", "a buffer beyond 2**63")
    return value


def parse_dump(lines: list[str], vmm: bool | None = None) -> PoolFigures:
    """The figures of one ``MemoryDebugInfo`` file (its lines): the used buffers' bytes and the 2 MiB pages
    they touch, the common pool's (stream 0, not small) largest idle buffer. ``vmm``: whether the pool runs
    on VMM, where the file does not say (2.7.0's allocator lines lack ``enable vmm``). DumpError (one line)
    for a file that is malformed or cut short: every section's announced count must match its lines."""
    used: list[tuple[int, int]] = []
    allocators: dict[tuple[int, int, int], _Allocator] = {}
    file_vmm: bool | None = None
    section, expected, current = None, 0, None
    seen_any = False

    def close() -> None:
        if section is not None and expected != 0:
            raise DumpError("truncated", f"the {section} section ends {expected} line(s) short: a truncated file")

    for line in lines:
        if len(line) > MAX_LINE_CHARS:
            raise DumpError("malformed", f"a line of more than {MAX_LINE_CHARS} characters")
        text = line.strip()
        if not text:
            continue
        if expected > 0 and text.startswith("{"):
            # Only what the figures need is parsed: the used buffers' addresses and sizes, the idle sizes.
            if section == "used":
                address, length = _number(text, '"addr_":'), _number(text, '"size_":')
                if address + length > MAX_COUNTER:
                    raise DumpError("malformed", "a buffer beyond 2**63")
                used.append((address, length))
            elif section == "idle" and current is not None:
                current.largest_idle = max(current.largest_idle, _number(text, '"size_":'))
                current.idle_count += 1
            expected -= 1
            continue
        close()
        section, expected = None, 0
        allocator = _ALLOCATOR_RE.search(text)
        count = _COUNT_RE.search(text)
        if allocator is not None:
            if allocator.group(1) is not None:
                file_vmm = bool(int(allocator.group(1))) or bool(file_vmm)
            key = (int(allocator.group(2)), int(allocator.group(3)), int(allocator.group(4) or 0))
            current = allocators.setdefault(key, _Allocator(*key))
            seen_any = True
            if text.startswith("In used mem buf info"):
                if count is None:
                    raise DumpError("malformed", "a used-buffer section without its count")
                section, expected = "used", int(count.group(1))
                current.has_used = True
            elif not text.startswith("Dump debug info"):
                raise DumpError("malformed", f"an unexpected allocator line: {text[:80]!r}")
        elif text.startswith("Mem block info"):
            section, expected = "blocks", int(count.group(1)) if count else -1
        elif text.startswith("Free mem buf info"):
            section, expected = "idle", int(count.group(1)) if count else -1
        elif text.startswith("Eager free mem buf info"):
            section, expected = "eager free", int(count.group(1)) if count else -1
        elif text.startswith(("The dynamic memory pool", "stream id")):
            pass
        else:
            raise DumpError("malformed", f"an unexpected line: {text[:80]!r}")
        if section in ("blocks", "idle", "eager free"):
            if current is None:
                raise DumpError("malformed", f"a {section} section outside an allocator's block")
            current.sections.add(section)
        if expected < 0:
            raise DumpError("malformed", f"a {section} section without its count")
        if expected > MAX_LINES:
            raise DumpError("too_large", f"a {section} section announcing {expected} buffers")
    close()
    if not seen_any:
        raise DumpError("malformed", "no allocator in the file: not a MemoryDebugInfo dump, or an empty one")
    # The file has no end marker: a cut at a line boundary shows as an allocator whose block lacks a section,
    # or one that holds used buffers and has no block at all (every allocator gets one, :1064-1068).
    for allocator in allocators.values():
        if (
            allocator.has_used
            and not allocator.sections
            or allocator.sections
            and allocator.sections != {"blocks", "idle", "eager free"}
        ):
            raise DumpError("truncated", "an allocator's sections end early: a truncated file")
    pages, last_page = 0, -1
    for address, length in sorted(used):
        first, end = max(address // VMM_PAGE_BYTES, last_page + 1), (address + max(length, 1) - 1) // VMM_PAGE_BYTES
        if end >= first:
            pages += end - first + 1
            last_page = end
    common = allocators.get((0, 0, 0))
    return PoolFigures(
        vmm=bool(file_vmm if file_vmm is not None else vmm),
        used_bytes=sum(s for _, s in used),
        pages_touched_by_used=pages,
        largest_idle_common_bytes=common.largest_idle if common else 0,
    )


def read_dump_file(path: Path, vmm: bool | None = None) -> PoolFigures:
    """One file, read with bounds: DumpError (one line) when it is too large, not text, or malformed."""
    try:
        # No symlink followed, no FIFO or device waited on: only a regular file this process can read.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise DumpError("unreadable", f"{path.name} is not a regular file")
            data = handle.read(MAX_FILE_BYTES + 1)
            written_at = info.st_mtime
    except OSError as exc:
        raise DumpError("unreadable", f"cannot read {path.name}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise DumpError("too_large", f"{path.name} is larger than {MAX_FILE_BYTES >> 20} MiB")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise DumpError("not_text", f"{path.name} is not ASCII text") from None
    lines = text.split("\n", MAX_LINES)
    if len(lines) > MAX_LINES:
        raise DumpError("too_large", f"{path.name} has more than {MAX_LINES} lines")
    if not text.endswith("\n"):
        raise DumpError("truncated", f"{path.name} does not end with a newline: written now, or cut short")
    figures = parse_dump(lines, vmm)
    return PoolFigures(
        figures.vmm, figures.used_bytes, figures.pages_touched_by_used, figures.largest_idle_common_bytes, written_at
    )


def process_start_time() -> float | None:
    """Unix seconds this process started (Linux ``/proc``), or None where that cannot be read."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])
        boot = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class DumpReader:
    """The newest dump this process wrote in ``directory``, parsed once per file.

    ``not_before``: unix seconds; a file last written before it (a previous run's, in the same working
    directory) is never read nor deleted. ``read()`` returns the newest good figures, or None before the
    first; a file that fails to parse is skipped once, counted in ``skipped`` by reason, with the reason
    in ``last_error``, and the last good figures stand (the guard's freshness rule decides whether they
    still describe the pool). Older files of this process are deleted once a newer one is there, read or
    skipped, so the folder holds one dump (MindSpore never rotates them)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        not_before: float | None = None,
        vmm: bool | None = None,
        rank: int | None = None,
        delete_older: bool = True,
    ) -> None:
        self.directory = Path(directory)
        self.rank = rank  # the rank whose rank_<id> folder this is, None when not distributed
        self.not_before = not_before if not_before is not None else (process_start_time() or time.time())
        self.vmm = vmm
        self.delete_older = delete_older
        self.skipped: Counter[str] = Counter()
        self.files_read = 0
        self.files_deleted = 0
        self.last_error: str | None = None
        self._last_key: tuple | None = None
        self._figures: PoolFigures | None = None

    def _ours(self) -> list[tuple[int, int, Path]]:
        """(mtime_ns, k, path) of this process's dump files, oldest first."""
        found = []
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return []
        floor_ns = int(self.not_before * 1e9) - 1_000_000_000  # 1 s: mtime granularity and clock slack
        for entry in entries[:100_000]:
            match = FILE_RE.fullmatch(entry.name)
            if match is None:
                continue
            try:
                stat = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not entry.is_file(follow_symlinks=False) or stat.st_mtime_ns < floor_ns:
                continue
            found.append((stat.st_mtime_ns, int(match.group(1)), Path(entry.path), stat.st_size))
        found.sort()
        return [(mtime, k, path) for mtime, k, path, _ in found]

    def read(self) -> PoolFigures | None:
        files = self._ours()
        if not files:
            return self._figures
        mtime, k, path = files[-1]
        try:
            size = path.stat().st_size
        except OSError:
            return self._figures
        key = (path.name, mtime, size)
        if key != self._last_key:
            self._last_key = key
            try:
                self._figures = read_dump_file(path, self.vmm)
                self.files_read += 1
                self.last_error = None
            except DumpError as exc:
                self.skipped[exc.reason] += 1
                self.last_error = f"{path.name}: {exc}"
            # Older files go whether the newest parsed or not: files that never parse (another MindSpore's
            # format) must not pile up, 0.8 MB every N graph runs.
            if self.delete_older:
                for _, older_k, older in files[:-1]:
                    if older_k < k:
                        try:
                            older.unlink()
                            self.files_deleted += 1
                        except OSError:
                            pass
        return self._figures
