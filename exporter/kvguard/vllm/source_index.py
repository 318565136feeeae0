"""Which vLLM releases could have written a log, from where its lines say they come.

vLLM tags every record with the file and line of the logger call ("[gpu_worker.py:360]", logger.py's
"[%(fileinfo)s:%(lineno)d]", from 0.8.0), and a traceback names each frame's file, line and function.
``source_index.json.gz`` holds, for every vLLM release from 0.6.4 to 0.34.0, the line spans of each
``vllm/`` source file's logger calls and (in the worker, engine, executor, platform, config, utils and
loader files) its functions, read from the release's PyPI wheel by ``oracles/vllm_sources/index.py``.
A release fits a log when every tag falls on one of its logger calls in a file of that name, and every
frame inside a function of that name in that file.

Tags of files no release has (a plugin's own, such as vllm-ascend's or kvguard's) are left out. A fork,
a patched or a development build fits no release; its hints are then left unused, and the reason says so.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import re
from dataclasses import dataclass

from kvguard.vllm import eras

INDEX_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "source_index.json.gz")
# Hints kept per log: enough to pin a release, a bound on the work a hostile log causes.
MAX_HINTS = 64
# A traceback frame inside vLLM's package: '  File ".../vllm/v1/worker/gpu_worker.py", line 283, in init_device'.
FRAME = re.compile(r'File "[^"]{0,300}?/vllm/([\w/]{1,120}\.py)", line ([0-9]{1,6}), in (\w{1,80})')


@dataclass(frozen=True)
class Fit:
    releases: tuple[str, ...]   # the releases every hint fits ("0.15.0", ...), oldest first
    hints: int                  # how many hints were weighed
    reason: str


class _Index:
    def __init__(self, data: dict):
        releases = data["releases"]
        self.releases: list[str] = list(releases)
        self.uploaded: dict[str, str] = {r: releases[r]["uploaded"] for r in releases}
        self.trees: dict[str, dict[str, int]] = {r: releases[r]["files"] for r in releases}
        names = data["names"]
        self.def_paths = re.compile(data["def_paths"])    # the files whose functions are indexed
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

    def tag_fits(self, release: str, name: str, line: int) -> bool:
        return any(start <= line <= end for number in self.by_suffix[release].get(name, ())
                   for start, end in self.logs[number])

    def frame_fits(self, release: str, path: str, line: int, function: str) -> bool:
        number = self.trees[release].get(path)
        return number is not None and any(name == function and start <= line <= end
                                          for name, start, end in self.defs[number])


@functools.lru_cache(maxsize=1)
def _load() -> _Index | None:
    try:
        with gzip.open(INDEX_PATH, "rb") as handle:
            return _Index(json.loads(handle.read()))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def fit(tags: set[tuple[str, int]], frames: set[tuple[str, int, str]], logged_on: str | None = None) -> Fit | None:
    """The releases whose source every tag (file name, line) and frame (path under vllm/, line, function)
    fits, and (``logged_on``, a "YYYY-MM-DD" the log states) that were published by then; None when there is
    no hint (or no index).

    A development build between two releases fits neither whole: where no release fits every hint, the
    releases that fit the most are taken, if that is most of them (at least two, and 60 %)."""
    index = _load()
    if index is None:
        return None
    tags = {tag for tag in tags if tag[0] in index.known}
    frames = {frame for frame in frames if index.def_paths.match(frame[0])}
    published = [r for r in index.releases if logged_on is None or index.uploaded[r] <= logged_on]
    dated = f", published by {logged_on}" if logged_on else ""
    if not tags and not frames:
        if logged_on is None or len(published) == len(index.releases):
            return None
        if not published:
            return Fit((), 0, f"logged on {logged_on}, before any release in the table")
        return Fit(tuple(published), 0, f"logged on {logged_on}: vLLM {published[-1]} or older")
    scores = {r: sum(index.tag_fits(r, name, line) for name, line in tags)
              + sum(index.frame_fits(r, path, line, function) for path, line, function in frames)
              for r in published}
    count = len(tags) + len(frames)
    what = " and ".join(part for part in (
        f"{len(tags)} file:line tag{'s' if len(tags) != 1 else ''}" if tags else "",
        f"{len(frames)} traceback frame{'s' if len(frames) != 1 else ''}" if frames else "") if part)
    best = max(scores.values(), default=0)
    fitting = tuple(r for r in published if scores[r] == best)
    if best == count:
        how = "fit"
    elif best >= 2 and best >= 0.6 * count:
        how = f"best fit ({best} of {count}: a development or patched build)"
    else:
        unfit = f"its {what} fit no vLLM release's source (a fork, a patched or a development build)"
        if logged_on is None or len(published) == len(index.releases):
            return Fit((), count, unfit)
        # The date still holds: such a build was made from a published release's code or later.
        return Fit(tuple(published), count, f"{unfit}; logged on {logged_on}: vLLM {published[-1]} or older"
                   if published else f"{unfit}; logged on {logged_on}, before any release in the table")
    span = fitting[0] if len(fitting) == 1 else f"{fitting[0]}–{fitting[-1]}"
    return Fit(fitting, count, f"its {what}{dated} {how} vLLM {span} ({len(fitting)} of {len(index.releases)} "
                               f"releases)")


def version(text: str) -> tuple[int, ...]:
    return eras.parse_version(text)
