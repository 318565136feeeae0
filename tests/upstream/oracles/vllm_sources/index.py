"""Where each vLLM release logs, read from the release's own wheel: the source index the log reader's
era hints use (kvguard.vllm.source_index).

A startup log tags its lines with the file and line of the logger call ("[gpu_worker.py:360]", from
vLLM 0.8.0) and its tracebacks name file, line and function. Which releases could have written them
is a fact of each release's source, so this script reads every vLLM release's wheel from PyPI and
records, per source file of ``vllm/``, the line spans of its logger calls and of its functions. A
wheel is a zip: only its central directory and its ``.py`` members are fetched, by HTTP range
requests, so a release costs a few MB, not the 250-500 MB wheel.

    python3 tests/upstream/oracles/vllm_sources/index.py [--releases 0.6.4,0.34.0] [--jobs 4]
        writes exporter/kvguard/vllm/source_index.json.gz
    python3 tests/upstream/oracles/vllm_sources/index.py --package vllm-ascend
        writes exporter/kvguard/vllm/source_index_vllm_ascend.json.gz: every vllm-ascend release on PyPI (finals,
        rcs, posts; a cp311 x86_64 wheel, else the sdist, read whole), its ``vllm_ascend/`` files

It also records each logger call's wording where its message is a literal (a %-format string, an
f-string, a str.format template), as ``kvguard.vllm.source_index.wording_text`` normalises it, and which
releases write it; a release whose template can print another release's wording (a placeholder that
prints words: "Using TRTLLM %s attention" and "Using TRTLLM prefill attention") writes that one too.
Only the hashes are stored.

Standard library and kvguard only. It needs the network (PyPI) and is run by hand when a release is added
to the era table; nothing runs it at test time. The index holds line numbers, function names and wording
hashes only, no source text.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import datetime
import gzip
import hashlib
import io
import json
import pathlib
import re
import sys
import tarfile
import urllib.request
import zipfile
from typing import Callable, Iterator

ROOT = pathlib.Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "exporter"))
from kvguard.vllm.source_index import MARK, braces_template, hash_wording, percent_template, wording_text  # noqa: E402

OUT = ROOT / "exporter" / "kvguard" / "vllm" / "source_index.json.gz"
SIMPLE = "https://pypi.org/simple/vllm/"
FIRST, LAST = (0, 6, 4), (0, 34, 0)
BLOCK = 1 << 21
# Functions are indexed where a startup or OOM traceback passes (model code is left out: its names say little).
DEF_PATHS = re.compile(
    r"^(v1/(worker|engine|core|executor)/|worker/|engine/|executor/|platforms/|utils|"
    r"model_executor/model_loader/|entrypoints/)"
)
LOG_METHODS = {
    "debug",
    "info",
    "warning",
    "warn",
    "error",
    "exception",
    "critical",
    "fatal",
    "log",
    "debug_once",
    "info_once",
    "warning_once",
}


class RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote file over HTTP range requests, read in cached blocks."""

    def __init__(self, url: str, size: int):
        self.url, self.size, self.pos, self.blocks, self.fetched = url, size, 0, {}, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def _block(self, index: int) -> bytes:
        if index not in self.blocks:
            start = index * BLOCK
            end = min(self.size, start + BLOCK) - 1
            request = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}"})
            for attempt in range(4):
                try:
                    with urllib.request.urlopen(request, timeout=60) as response:
                        data = response.read()
                    break
                except OSError:
                    if attempt == 3:
                        raise
            self.fetched += len(data)
            self.blocks[index] = data
        return self.blocks[index]

    def read(self, n=-1):
        if n < 0:
            n = self.size - self.pos
        out = bytearray()
        while n > 0 and self.pos < self.size:
            block = self._block(self.pos // BLOCK)
            offset = self.pos % BLOCK
            piece = block[offset : offset + n]
            out += piece
            self.pos += len(piece)
            n -= len(piece)
        return bytes(out)

    def readinto(self, buffer):
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


# Platform plugins indexed like vLLM: PyPI name -> (its package folder, where the index goes).
PLUGINS = {"vllm-ascend": ("vllm_ascend/", ROOT / "exporter" / "kvguard" / "vllm" / "source_index_vllm_ascend.json.gz")}
_PLUGIN_FILE = re.compile(
    r"[a-z_]+-([0-9]+\.[0-9]+\.[0-9]+(?:rc[0-9]+)?(?:\.post[0-9]+)?)"
    r"(?:-cp311-cp311-manylinux\w*x86_64\.whl|\.tar\.gz)"
)


def release_key(text: str) -> tuple[int, ...]:
    """ "0.11.0rc1" before "0.11.0" before "0.11.0.post1"."""
    match = re.fullmatch(r"([0-9]+)\.([0-9]+)\.([0-9]+)(?:rc([0-9]+))?(?:\.post([0-9]+))?", text)
    if match is None:
        raise ValueError(f"not a release number: {text}")
    x, y, z, rc, post = match.groups()
    return int(x), int(y), int(z), int(rc) if rc else 1 << 30, int(post) if post else 0


def plugin_urls(package: str) -> dict[str, tuple[str, str]]:
    """Every release of a plugin on PyPI -> (a cp311 x86_64 wheel's URL, else its sdist's; upload date)."""
    request = urllib.request.Request(
        f"https://pypi.org/simple/{package}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        page = json.loads(response.read())
    urls: dict[str, tuple[str, str]] = {}
    for entry in page["files"]:
        match = _PLUGIN_FILE.fullmatch(entry["filename"])
        if match and (match[1] not in urls or entry["filename"].endswith(".whl")):
            urls[match[1]] = (entry["url"], entry["upload-time"][:10])
    return urls


def wheel_urls() -> dict[tuple[int, ...], tuple[str, str]]:
    """Final releases FIRST..LAST -> (the URL of one x86_64 Linux wheel, its upload date), from PyPI's simple
    index in its JSON form (PEP 691; ``upload-time``, PEP 700)."""
    request = urllib.request.Request(SIMPLE, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        page = json.loads(response.read())
    urls: dict[tuple[int, ...], tuple[str, str]] = {}
    for entry in page["files"]:
        match = re.fullmatch(
            r"vllm-([0-9]+(?:\.[0-9]+){2})(?:\.post[0-9]+)?(?:-[0-9]+)?-cp\w+-\w+-manylinux\w*x86_64\.whl",
            entry["filename"],
        )
        if match:
            version = tuple(int(p) for p in match[1].split("."))
            if FIRST <= version <= LAST:
                urls.setdefault(version, (entry["url"], entry["upload-time"][:10]))
    return urls


def _size(url: str) -> int:
    request = urllib.request.Request(url, method="HEAD")
    with urllib.request.urlopen(request, timeout=60) as response:
        return int(response.headers["Content-Length"])


def _literal(node: ast.AST) -> str | None:
    """A message expression's text with its values as the mark: a string, an f-string, their concatenation;
    None for anything built otherwise (its wording is not known before run time)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = [_literal(v) if isinstance(v, ast.Constant) else MARK for v in node.values]
        return None if None in parts else "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal(node.left), _literal(node.right)
        return None if left is None or right is None else left + right
    return None


def _message(node: ast.AST) -> str | None:
    """A message expression, placeholders as the mark: a literal, ``"…" % x`` or ``"…".format(x)``."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        text = _literal(node.left)
        return None if text is None else percent_template(text)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        text = _literal(node.func.value)
        return None if text is None else braces_template(text)
    return _literal(node)


def message_templates(call: ast.Call, assigned: dict[str, set[str]]) -> set[str]:
    """The messages a logger call may write, placeholders as the mark: its literal, or (``logger.info(msg)``)
    each literal the file assigns to that name; none where it is built otherwise. logging applies
    ``msg % args`` only when there are args."""
    if not call.args:
        return set()
    first = call.args[0]
    if isinstance(first, ast.Name):
        texts = assigned.get(first.id, set())
    else:
        text = _message(first)
        texts = set() if text is None else {text}
    return {percent_template(t) for t in texts} if len(call.args) > 1 else texts


def _assigned(tree: ast.AST) -> dict[str, set[str]]:
    """Each name the file assigns a message literal to (``msg = (f"…" "…")``), with every such literal."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            text = _message(node.value)
            if text is not None:
                found.setdefault(node.targets[0].id, set()).add(text)
    return found


def index_source(text: str, with_defs: bool) -> dict:
    """One file's logger-call spans, the wording keys of its literal messages and, ``with_defs``, its function
    spans (first, last line)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return {"log": [], "defs": [], "wordings": []}
    logs, defs, wordings = [], [], set()
    assigned = _assigned(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOG_METHODS:
            target = node.func.value
            name = (
                target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else ""
            )
            if "log" in name.lower():
                logs.append([node.lineno, node.end_lineno])
                for template in message_templates(node, assigned):
                    text = wording_text(template)
                    if text is not None:
                        wordings.add(text)
        elif with_defs and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs.append([node.name, node.lineno, node.end_lineno])
    return {"log": sorted(logs), "defs": sorted(defs, key=lambda d: (d[1], d[0])), "wordings": sorted(wordings)}


def _sources(url: str, prefix: str) -> tuple[Iterator[tuple[str, str]], Callable[[], int]]:
    """The ``.py`` files under ``prefix`` of a wheel (read by ranges) or an sdist (read whole), as (path under
    the prefix, text), and how many bytes were fetched."""
    if url.endswith(".tar.gz"):
        with urllib.request.urlopen(url, timeout=300) as response:
            data = response.read()

        def from_sdist() -> Iterator[tuple[str, str]]:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as sdist:
                for member in sdist.getmembers():
                    top, _, rest = member.name.partition("/")
                    if member.isfile() and rest.startswith(prefix) and rest.endswith(".py"):
                        yield rest[len(prefix) :], sdist.extractfile(member).read().decode("utf-8", errors="replace")

        return from_sdist(), lambda: len(data)
    remote = RangeFile(url, _size(url))

    def from_wheel() -> Iterator[tuple[str, str]]:
        with zipfile.ZipFile(io.BufferedReader(remote, buffer_size=1 << 16)) as wheel:
            members = sorted(
                (i for i in wheel.infolist() if i.filename.startswith(prefix) and i.filename.endswith(".py")),
                key=lambda i: i.header_offset,
            )
            for info in members:
                yield info.filename[len(prefix) :], wheel.read(info).decode("utf-8", errors="replace")

    return from_wheel(), lambda: remote.fetched


def index_release(version, url: str, prefix: str = "vllm/") -> tuple[dict[str, str], dict[str, dict], int]:
    tree: dict[str, str] = {}
    files: dict[str, dict] = {}
    sources, fetched = _sources(url, prefix)
    for path, text in sources:
        with_defs = bool(DEF_PATHS.match(path))
        digest = hashlib.sha1(text.encode() + bytes([with_defs])).hexdigest()[:16]
        tree[path] = digest
        if digest not in files:
            files[digest] = index_source(text, with_defs)
    return tree, files, fetched()


ENDS = 6  # how much of a template's first or last literal picks the wordings it is tried against


def printable(template: str, text: str) -> bool:
    """Whether ``template`` (its marks any text, empty too) can print ``text``."""
    pieces = template.split(MARK)
    first, last = pieces[0], pieces[-1]
    if len(text) < len(first) + len(last) or not text.startswith(first) or not text.endswith(last):
        return False
    at, end = len(first), len(text) - len(last)
    for piece in pieces[1:-1]:
        at = text.find(piece, at, end)
        if at < 0:
            return False
        at += len(piece)
    return True


def credit_printable(masks: dict[str, int]) -> None:
    """Credit each wording with the releases whose templates can print it: a placeholder that prints words
    ("Using TRTLLM %s attention (auto-detected).", 0.27+) makes the line another release writes literally
    ("Using TRTLLM prefill attention (auto-detected).", 0.20-0.24), which hashes to the literal's key. A
    template whose first and last literal are both shorter than ``ENDS`` is not tried (it could print almost
    anything); the wordings it prints then name too few releases."""
    by_start: dict[str, list[str]] = {}
    by_end: dict[str, list[str]] = {}
    for text in masks:
        by_start.setdefault(text[:ENDS], []).append(text)
        by_end.setdefault(text[-ENDS:], []).append(text)
    extra: dict[str, int] = {}
    for template, mask in masks.items():
        if MARK not in template:
            continue
        pieces = template.split(MARK)
        if len(pieces[0]) >= ENDS:
            candidates = by_start.get(pieces[0][:ENDS], ())
        elif len(pieces[-1]) >= ENDS:
            candidates = by_end.get(pieces[-1][-ENDS:], ())
        else:
            continue
        for text in candidates:
            if text != template and masks[text] | mask != masks[text] and printable(template, text):
                extra[text] = extra.get(text, 0) | mask
    for text, mask in extra.items():
        masks[text] |= mask


def compact(trees: dict[str, dict[str, str]], files: dict[str, dict], uploaded: dict[str, str]) -> dict:
    """The index as stored: each file version once (files with neither logger calls nor indexed functions left
    out), spans as (start delta, length) pairs, function names interned."""
    kept = sorted(d for d in files if files[d]["log"] or files[d]["defs"])
    number = {digest: n for n, digest in enumerate(kept)}
    names: dict[str, int] = {}
    stored = []
    for digest in kept:
        log, previous = [], 0
        for start, end in files[digest]["log"]:
            log += [start - previous, end - start]
            previous = start
        defs, previous = [], 0
        for name, start, end in files[digest]["defs"]:
            defs += [names.setdefault(name, len(names)), start - previous, end - start]
            previous = start
        stored.append([log, defs])
    releases = sorted(trees, key=release_key)
    # Per wording, the releases writing it (bit i: releases[i]); those every release writes tell nothing.
    masks: dict[str, int] = {}
    for bit, version in enumerate(releases):
        for text in set().union(*(files[d]["wordings"] for d in set(trees[version].values()))):
            masks[text] = masks.get(text, 0) | (1 << bit)
    credit_printable(masks)
    everyone = (1 << len(releases)) - 1
    wordings = dict(sorted((hash_wording(text), mask) for text, mask in masks.items() if mask != everyone))
    return {
        "about": "Per vLLM release (its PyPI wheel and upload date), the line spans of each vllm/ source file's "
        "logger calls and functions; written by tests/upstream/oracles/vllm_sources/index.py. Line numbers and names "
        "only. files[n] = [logger calls as (start - previous start, end - start) pairs, functions as "
        "(names index, start - previous start, end - start) triples]. wordings: a logger message's "
        "wording_key -> the releases writing it, bit i for the i-th release oldest first (only those "
        "some releases do not write).",
        "built": datetime.date.today().isoformat(),
        "releases": {
            v: {
                "uploaded": uploaded[v],
                "files": {path: number[d] for path, d in sorted(trees[v].items()) if d in number},
            }
            for v in releases
        },
        "def_paths": DEF_PATHS.pattern,
        "names": list(names),
        "files": stored,
        "wordings": wordings,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--releases", help="first,last (default 0.6.4,0.34.0)")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument(
        "--package",
        default="vllm",
        choices=["vllm", *PLUGINS],
        help="vLLM (default) or a platform plugin (every release of it on PyPI)",
    )
    parser.add_argument("--out", help=f"where to write it (default {OUT.relative_to(ROOT)}, or the plugin's)")
    args = parser.parse_args(argv)
    global FIRST, LAST
    if args.releases:
        FIRST, LAST = (tuple(int(p) for p in v.split(".")) for v in args.releases.split(","))
    if args.package == "vllm":
        prefix, out = "vllm/", pathlib.Path(args.out or OUT)
        urls = {".".join(map(str, v)): found for v, found in wheel_urls().items()}
    else:
        prefix, default = PLUGINS[args.package]
        out = pathlib.Path(args.out or default)
        urls = plugin_urls(args.package)
    print(f"{len(urls)} releases: {', '.join(sorted(urls, key=release_key))}", file=sys.stderr)
    trees: dict[str, dict[str, str]] = {}
    files: dict[str, dict] = {}
    # Processes, not threads: reading the sources (ast) is the work, and the GIL would serialise it.
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(index_release, v, u, prefix): v for v, (u, _) in urls.items()}
        for future in concurrent.futures.as_completed(futures):
            version = futures[future]
            tree, found, fetched = future.result()
            trees[version] = tree
            files.update(found)
            print(f"  {version}: {len(tree)} files, {fetched / 2**20:.1f} MiB fetched", file=sys.stderr)
    uploaded = {v: date for v, (_, date) in urls.items()}
    data = json.dumps(compact(trees, files, uploaded), separators=(",", ":")).encode()
    out.write_bytes(gzip.compress(data, mtime=0))
    print(f"wrote {out} ({out.stat().st_size / 2**20:.2f} MiB, {len(files)} file versions)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
