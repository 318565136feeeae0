"""Which vLLM releases could have written a log, from where its lines say they come.

vLLM tags every record with the file and line of the logger call ("[gpu_worker.py:360]", logger.py's
"[%(fileinfo)s:%(lineno)d]", from 0.8.0), and a traceback names each frame's file, line and function.
``source_index.json.gz`` holds, for every vLLM release from 0.6.4 to 0.34.0, the line spans of each
``vllm/`` source file's logger calls and (in the worker, engine, executor, platform, config, utils and
loader files) its functions, read from the release's PyPI wheel by ``tests/upstream/oracles/vllm_sources/index.py``.
A release fits a log when every tag falls on one of its logger calls in a file of that name, and every
frame inside a function of that name in that file.

A line's wording is a hint too, tagged or not: the index holds, for every logger call whose message is a
literal (a %-format string, an f-string, a str.format template), the releases that write it, keyed by a
hash of its words with every number and placeholder made one mark (``wording_key``; no source text is
stored). Only wordings that some releases write and others do not are kept. A line matching none (a
plugin's own, a message built at run time, a placeholder that printed words) says nothing.

Tags of files no release has (a plugin's own, such as vllm-ascend's or kvguard's) are left out. A
vllm-ascend log is weighed against ``source_index_vllm_ascend.json.gz`` too, the same index over every
vllm-ascend release on PyPI (``_Paired``: each with the vLLM release of its number). A fork,
a patched or a development build fits no release; its hints are then left unused, and the reason says so.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import re
from dataclasses import dataclass

from kvguard.vllm import eras

INDEX_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "source_index.json.gz")
# A platform plugin's own index, the same form, over every release of it on PyPI (rcs and posts too).
PLUGIN_INDEX_PATHS = {
    "vllm-ascend": os.path.join(os.path.dirname(os.path.abspath(__file__)), "source_index_vllm_ascend.json.gz")
}
# Hints kept per log: enough to pin a release, a bound on the work a hostile log causes.
MAX_HINTS = 64
# A traceback frame inside vLLM's package: '  File ".../vllm/v1/worker/gpu_worker.py", line 283, in init_device'.
FRAME = re.compile(r'File "[^"]{0,300}?/vllm/([\w/]{1,120}\.py)", line ([0-9]{1,6}), in (\w{1,80})')


# Placeholders of a logger call's message: %-style (with %(name)s), str.format's {…}, an f-string's values.
_PERCENT = re.compile(
    r"%(?:\([^)]{0,40}\))?[-#0 +]{0,4}(?:\*|[0-9]{1,3})?(?:\.(?:\*|[0-9]{1,3}))?[hlL]?[diouxXeEfFgGcrsa%]"
)
_BRACES = re.compile(r"\{\{|\}\}|\{[^{}]{0,40}\}")
MARK = "\x00"
# A number as vLLM prints one: "8,192", "207.73", "-1", "1e-05".
_FIGURE = re.compile(r"[-+]?[0-9]+(?:[.,][0-9]+)*(?:[eE][-+]?[0-9]+)?")
# Marks with only a separator or a sign between them are one: "%d.%d" prints "12.4", "%d-%d" "10-20" (one
# figure, or a signed one, to _FIGURE).
_MARKS = re.compile("[-+]?" + MARK + "(?:[-+.,]?" + MARK + ")*")
_NOT_LETTERS = re.compile(r"[\W\d_]+")
# Fewer letters than this say too little to tell releases apart ("%s: %s", "Done %d").
MIN_WORDING_LETTERS = 12
# A record's own prefix, up to its message: "(EngineCore pid=1) INFO 04-12 08:21:19 [core.py:94] ", and
# "INFO 12-13 19:54:18 worker.py:243] " (0.6-0.7), also with the time stripped ("INFO [core.py:94] ").
_MESSAGE = re.compile(
    r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) {1,2}(?:[0-9]{2}-[0-9]{2} [0-9:.]{8,15} )?"
    r"\[?[\w./-]{1,80}\.py:[0-9]{1,6}\] ?"
)
MAX_LINE_CHARS = 2048
# A longer line (a config dump, a paste of many records as one) is not hashed: vLLM's messages are shorter.
MAX_WORDING_CHARS = 1024


def percent_template(text: str) -> str:
    """A %-format message (logging's ``msg % args``) with each placeholder made the mark ("%%" is "%")."""
    return _PERCENT.sub(lambda m: "%" if m.group() == "%%" else MARK, text)


def braces_template(text: str) -> str:
    """A str.format template with each field made the mark ("{{" is "{")."""
    return _BRACES.sub(lambda m: m.group()[0] if m.group() in ("{{", "}}") else MARK, text)


def wording_text(message: str) -> str | None:
    """A message's wording: its first line, every number and placeholder one mark, blanks one space; None where
    it has too few letters to say anything. The same for a template and for a line vLLM wrote from it where
    its placeholders printed numbers (a placeholder that printed words: ``tests/upstream/oracles/vllm_sources/index.py``
    credits its release with the wordings it can print)."""
    first = message.split("\n", 1)[0]
    if len(first) > MAX_LINE_CHARS:
        return None
    text = " ".join(_MARKS.sub(MARK, _FIGURE.sub(MARK, first)).split())
    if len(_NOT_LETTERS.sub("", text)) < MIN_WORDING_LETTERS:
        return None
    return text


def hash_wording(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=6).hexdigest()


def wording_key(message: str) -> str | None:
    """The index's key of a message's wording (``wording_text``, hashed: the index keeps no source text)."""
    text = wording_text(message)
    return None if text is None else hash_wording(text)


def line_wording(line: str, message_at: int | None = None) -> str | None:
    """The wording key of a log line's message: from ``message_at`` where the caller already found the end of
    vLLM's record tag, else after the record prefix where it has one, else the whole line (a paste that kept
    the messages only)."""
    if len(line) > MAX_WORDING_CHARS:
        return None
    if message_at is None:
        found = _MESSAGE.search(line)
        message_at = found.end() if found else None
    message = line[message_at:] if message_at is not None else line.strip().lstrip(">▎|` ").rstrip("` ")
    return wording_key(message)


@dataclass(frozen=True)
class Fit:
    releases: tuple[str, ...]  # the releases every hint fits ("0.15.0", ...), oldest first
    hints: int  # how many hints were weighed
    reason: str


class _Index:
    def __init__(self, data: dict):
        releases = data["releases"]
        self.releases: list[str] = list(releases)
        self.uploaded: dict[str, str] = {r: releases[r]["uploaded"] for r in releases}
        self.trees: dict[str, dict[str, int]] = {r: releases[r]["files"] for r in releases}
        names = data["names"]
        self.def_paths = re.compile(data["def_paths"])  # the files whose functions are indexed
        self.logs: list[list[tuple[int, int]]] = []
        self.defs: list[list[tuple[str, int, int]]] = []
        for log, defs in data["files"]:
            spans, start = [], 0
            for i in range(0, len(log), 2):
                start += log[i]
                spans.append((start, start + log[i + 1]))
            self.logs.append(spans)
            functions, start = [], 0
            for i in range(0, len(defs), 3):
                start += defs[i + 1]
                functions.append((names[defs[i]], start, start + defs[i + 2]))
            self.defs.append(functions)
        # Per release, a file name (and every trailing part of its path) -> the file versions it may be.
        self.by_suffix: dict[str, dict[str, list[int]]] = {}
        for release, tree in self.trees.items():
            suffixes: dict[str, list[int]] = {}
            for path, number in tree.items():
                parts = path.split("/")
                for i in range(len(parts)):
                    suffixes.setdefault("/".join(parts[i:]), []).append(number)
            self.by_suffix[release] = suffixes
        # Names no release has: a plugin's or the launcher's own files (vllm-ascend's, kvguard's), not vLLM's.
        self.known = set().union(*self.by_suffix.values())
        # Wording key -> the releases writing it (bit i: the i-th release, oldest first).
        self.wordings: dict[str, int] = data.get("wordings", {})
        self.bit = {release: 1 << i for i, release in enumerate(self.releases)}  # the file's order: oldest first

    def wording_fits(self, release: str, key: str) -> bool:
        return bool(self.wordings[key] & self.bit[release])

    def tag_fits(self, release: str, name: str, line: int) -> bool:
        return any(
            start <= line <= end for number in self.by_suffix[release].get(name, ()) for start, end in self.logs[number]
        )

    def frame_fits(self, release: str, path: str, line: int, function: str) -> bool:
        number = self.trees[release].get(path)
        return number is not None and any(
            name == function and start <= line <= end for name, start, end in self.defs[number]
        )


@functools.lru_cache(maxsize=2)
def _load(path: str = INDEX_PATH) -> _Index | None:
    try:
        with gzip.open(path, "rb") as handle:
            return _Index(json.loads(handle.read()))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def numbered(release: str) -> str:
    """A plugin release as the vLLM release it is numbered after: "0.23.0rc1", "0.23.0.post1" -> "0.23.0"."""
    return eras.version_text(eras.parse_release(release)[1])


class _Paired:
    """A platform plugin's releases, each with the vLLM release of its number (vllm-ascend vX.Y.Z runs on vLLM
    vX.Y.Z): a line of its log comes from the plugin's source or from that vLLM's, so a tag fits a plugin
    release where it falls on a logger call in either (their files share names: worker.py, utils.py), and a
    frame (vLLM's files only) where vLLM's has it. No wordings: the plugin writes vLLM's messages from its own
    patched copies (vllm_ascend/patch/platform/patch_message_queue.py 0.11.0:128-134)."""

    def __init__(self, plugin: _Index, vllm: _Index):
        self.plugin, self.vllm = plugin, vllm
        self.releases = plugin.releases
        self.uploaded = plugin.uploaded
        self.base = {r: numbered(r) if numbered(r) in vllm.trees else None for r in plugin.releases}
        self.known = plugin.known | vllm.known
        self.def_paths = vllm.def_paths
        self.wordings: dict[str, int] = {}

    def tag_fits(self, release: str, name: str, line: int) -> bool:
        base = self.base[release]
        return self.plugin.tag_fits(release, name, line) or (base is not None and self.vllm.tag_fits(base, name, line))

    def frame_fits(self, release: str, path: str, line: int, function: str) -> bool:
        base = self.base[release]
        return base is not None and self.vllm.frame_fits(base, path, line, function)

    def wording_fits(self, release: str, key: str) -> bool:
        return False


@functools.lru_cache(maxsize=2)
def _paired(plugin: str) -> _Paired | None:
    path = PLUGIN_INDEX_PATHS.get(plugin)
    own, vllm = (_load(path) if path else None), _load()
    return _Paired(own, vllm) if own is not None and vllm is not None else None


def known_wordings() -> dict[str, int]:
    """The index's wording keys (empty without an index)."""
    index = _load()
    return index.wordings if index is not None else {}


def _best(scores: dict[str, int], count: int, published: list[str]) -> tuple[tuple[str, ...], str] | None:
    """The releases that fit every one of ``count`` hints, or (a development build between two releases fits
    neither whole) those that fit the most, if that is most of them (at least two, and 60 %); None when
    neither holds."""
    best = max(scores.values(), default=0)
    fitting = tuple(r for r in published if scores[r] == best)
    if best == count:
        return fitting, "fit"
    if best >= 2 and best >= 0.6 * count:
        return fitting, f"best fit ({best} of {count}: a development or patched build)"
    return None


def _with_upcoming(found: tuple[tuple[str, ...], str] | None, upcoming: str) -> tuple[tuple[str, ...], str] | None:
    """A best fit (``_best``'s development build) with the first release published after the log's date."""
    if found is None or not found[1].startswith("best fit") or upcoming in found[0]:
        return found
    return found[0] + (upcoming,), f"{found[1][:-1]}, or the next release's in the making)"


def _span(releases: tuple[str, ...]) -> str:
    return releases[0] if len(releases) == 1 else f"{releases[0]}–{releases[-1]}"


def fit(
    tags: set[tuple[str, int]],
    frames: set[tuple[str, int, str]],
    logged_on: str | None = None,
    wordings: set[str] = frozenset(),
    plugin: str | None = None,
) -> Fit | None:
    """The releases whose source every tag (file name, line), frame (path under vllm/, line, function) and
    wording (``line_wording``) fits, and (``logged_on``, a "YYYY-MM-DD" the log states) that were published by
    then; None when there is no hint (or no index).

    Where the lines come from (tags, frames) and what they say (wordings) are weighed apart, each by
    ``_best``, so that many wordings every release writes cannot make a coincidental tag look like a fit;
    then the releases both name, or where they name none in common, those either names.

    ``plugin`` (a platform plugin numbered as vLLM, with an index of its own): the plugin's releases, each
    with its vLLM's source (``_Paired``), named as the vLLM releases of their numbers; without its index,
    vLLM's alone, as before."""
    index = (_paired(plugin) if plugin else None) or _load()
    if index is None:
        return None
    if not isinstance(index, _Paired):
        return _fit(index, tags, frames, logged_on, wordings, "vLLM")
    found = _fit(index, tags, frames, logged_on, wordings, plugin)
    return found and Fit(tuple(dict.fromkeys(numbered(r) for r in found.releases)), found.hints, found.reason)


def _fit(
    index,
    tags: set[tuple[str, int]],
    frames: set[tuple[str, int, str]],
    logged_on: str | None,
    wordings: set[str],
    family: str,
) -> Fit | None:
    tags = {tag for tag in tags if tag[0] in index.known}
    frames = {frame for frame in frames if index.def_paths.match(frame[0])}
    wordings = {key for key in wordings if key in index.wordings}
    published = [r for r in index.releases if logged_on is None or index.uploaded[r] <= logged_on]
    dated = f", published by {logged_on}" if logged_on else ""
    if not tags and not frames and not wordings:
        if logged_on is None or len(published) == len(index.releases):
            return None
        if not published:
            return Fit((), 0, f"logged on {logged_on}, before any release in the table")
        return Fit(tuple(published), 0, f"logged on {logged_on}: {family} {published[-1]} or older")
    count = len(tags) + len(frames) + len(wordings)
    where = ", ".join(
        part
        for part in (
            f"{len(tags)} file:line tag{'s' if len(tags) != 1 else ''}" if tags else "",
            f"{len(frames)} traceback frame{'s' if len(frames) != 1 else ''}" if frames else "",
        )
        if part
    )
    said = f"{len(wordings)} wording{'s' if len(wordings) != 1 else ''}" if wordings else ""
    placed = (
        _best(
            {
                r: sum(index.tag_fits(r, name, line) for name, line in tags)
                + sum(index.frame_fits(r, path, line, function) for path, line, function in frames)
                for r in published
            },
            len(tags) + len(frames),
            published,
        )
        if where
        else None
    )
    worded = (
        _best({r: sum(index.wording_fits(r, key) for key in wordings) for r in published}, len(wordings), published)
        if said
        else None
    )
    if logged_on is not None and len(published) < len(index.releases):
        # A development build fits no release whole; made on main by that date, its code is the next
        # release's in the making, so that release is as likely as the last one published.
        upcoming = min((r for r in index.releases if index.uploaded[r] > logged_on), key=index.uploaded.__getitem__)
        placed, worded = (_with_upcoming(found, upcoming) for found in (placed, worded))
    parts = []
    if placed is not None:
        parts.append(f"its {where}{dated} {placed[1]} {family} {_span(placed[0])}")
    if worded is not None:
        parts.append(f"its {said}{dated} {worded[1]} {family} {_span(worded[0])}")
    if placed is None and worded is None:
        what = " and ".join(part for part in (where, said) if part)
        unfit = f"its {what} fit no {family} release's source (a fork, a patched or a development build)"
        if logged_on is None or len(published) == len(index.releases):
            return Fit((), count, unfit)
        # The date still holds: such a build was made from a published release's code or later.
        return Fit(
            tuple(published),
            count,
            f"{unfit}; logged on {logged_on}: {family} {published[-1]} or older"
            if published
            else f"{unfit}; logged on {logged_on}, before any release in the table",
        )
    if placed is not None and worded is not None:
        # Where they share none, one of them misleads (a stray tag, a patched message): either may be right.
        both = tuple(r for r in placed[0] if r in worded[0])
        fitting = both or tuple(r for r in published if r in placed[0] or r in worded[0])
        joined = "; ".join(parts) + ("" if both else ": they share none, so either")
    else:
        fitting = (placed or worded)[0]
        joined = parts[0]
        if where and placed is None:
            joined = (
                f"its {where} fit no {family} release's source (a fork, a patched or a development build): left "
                f"out; {joined}"
            )
    return Fit(
        fitting, count, f"{joined} ({len(fitting)} of {len(index.releases)} releases: {family} {_span(fitting)})"
    )


def version(text: str) -> tuple[int, ...]:
    return eras.parse_version(text)
