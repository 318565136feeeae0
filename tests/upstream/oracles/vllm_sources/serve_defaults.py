"""The code with which each vLLM release sets ``vllm serve``'s max_num_batched_tokens / max_num_seqs defaults.

Read from each release's own wheel, it is the oracle tests/plan/test_plan_serve_defaults.py runs
kvguard.plan.serve_defaults' table against.

For every final vLLM release 0.6.4-0.34.0 (the first x86_64 manylinux wheel PyPI lists for it) this script reads
``vllm/engine/arg_utils.py``, ``vllm/config.py`` and ``vllm/envs.py`` (by HTTP range requests, as index.py does:
the wheel's central directory and those three members only) and keeps, verbatim and dedented, with the file and
lines each comes from:

- EngineArgs' default-setting methods (``_set_default_args``, ``_set_default_args_v0``, ``_set_default_args_v1``,
  ``get_batch_defaults``, ``_set_default_max_num_seqs_and_batched_tokens_args``), its ``max_num_seqs`` field and
  ``__post_init__``'s ``if self.max_num_seqs is None`` statement;
- before 0.8.0 (V0): create_engine_config's chunked-prefill default (``max_model_len = ...`` through the
  ``if self.enable_chunked_prefill is None`` statement after ``use_long_context``), SchedulerConfig's
  ``max_num_batched_tokens is None`` statement (in ``__init__`` or ``__post_init__``) and config.py's
  ``*_MAX_NUM_BATCHED_TOKENS`` module constants;
- envs.py's ``VLLM_USE_V1`` default (its value and lines only);

and, for the platform plugins that replace that code, vllm-mindspore 0.5.1 (its cp311 wheel): its own
``_set_default_args`` (vllm_mindspore/engine/arg_utils.py), where ``vllm_mindspore/__init__.py`` installs it over
EngineArgs', and the vLLM release it runs on (0.11.0, a fact of the plugin, stated below).

    python3 tests/upstream/oracles/vllm_sources/serve_defaults.py [--out PATH] [--src DIR [--offline]] [--jobs 4]
    [--date D]
        writes ../shared/vllm-serve-defaults/vllm_serve_defaults.json beside the checkout (its about states the
        read date: today, or --date)
        --src DIR keeps the wheels' members in DIR/<release>/ and DIR/vllm-mindspore-0.5.1/ and reuses those there
        (a DONE file marks each complete); --offline reads only DIR, asking PyPI nothing

Standard library and kvguard only. It needs the network (PyPI) and is run by hand when a release is added to
kvguard.plan.serve_defaults; nothing runs it at test time. Its output holds upstream source text, so it is not
committed: it lives in ../shared (see PROVENANCE.md there), and the tests that need it skip where it is missing.
Texts are keyed by sha256[:12] of the excerpt; the JSON is written with sorted keys, so a rebuild from the same
wheels on the same date is byte-identical.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import datetime
import hashlib
import io
import json
import pathlib
import re
import sys
import tempfile
import textwrap
import urllib.request
import zipfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import index  # noqa: E402  (tests/upstream/oracles/vllm_sources/index.py: RangeFile, wheel_urls, FIRST..LAST)

ROOT = index.ROOT
OUT = ROOT.parent / "shared" / "vllm-serve-defaults" / "vllm_serve_defaults.json"
# The wheel members read from each vLLM release.
VLLM_FILES = ("vllm/engine/arg_utils.py", "vllm/config.py", "vllm/envs.py")
FUNCS = (
    "_set_default_args",
    "_set_default_args_v0",
    "_set_default_args_v1",
    "get_batch_defaults",
    "_set_default_max_num_seqs_and_batched_tokens_args",
)
V1_ONLY = (0, 8, 0)  # from here create_engine_config has no V0 chunked-prefill default and config.py no V0 scheduler
# Platform plugins that replace EngineArgs._set_default_args: (PyPI project, release, its wheel's tag, the module
# holding the function, where the plugin installs it, the vLLM release it runs on). vllm-mindspore 0.5.1 is built on
# vLLM 0.11.0 (its v1/core/sched/scheduler.py: "Based on v0.11.0 branch"; tests/upstream/mindspore_real runs it on
# 0.11.0).
PLUGINS = (
    (
        "vllm-mindspore",
        "0.5.1",
        "cp311-none-any",
        "vllm_mindspore/engine/arg_utils.py",
        "vllm_mindspore/__init__.py",
        "0.11.0",
    ),
)
ABOUT = (
    "Verbatim excerpts of the code that sets `vllm serve`'s max_num_batched_tokens / max_num_seqs defaults, read "
    "from each release's PyPI wheel (vLLM: the first x86_64 manylinux wheel PyPI lists for every final release "
    "0.6.4-0.34.0, its .py members fetched by range requests as tests/upstream/oracles/vllm_sources/index.py does; "
    "vllm-mindspore 0.5.1: its py3 wheel) at the files and lines named; texts keyed by sha256[:12] of the "
    "excerpt, dedented. kvguard.plan.serve_defaults is the table; tests/plan/test_plan_serve_defaults.py runs these "
    "excerpts with only the device queries stubbed, and checks them against the releases installed for "
    "tests/upstream/vllm_real and tests/upstream/ascend_real. Read {date} for kvguard issue 33."
)


def release_key(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


# ------------------------------------------------------------------------------------------------ fetching


def _members(url: str, names: set[str], into: pathlib.Path) -> int:
    """Write the wheel members ``names`` (those it has) under ``into``; the bytes fetched."""
    remote = index.RangeFile(url, index._size(url))
    with zipfile.ZipFile(io.BufferedReader(remote, buffer_size=1 << 16)) as wheel:
        for name in wheel.namelist():
            if name in names:
                path = into / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(wheel.read(name))
    return remote.fetched


def fetch_vllm(src: pathlib.Path, release: str, url: str, uploaded: str) -> str:
    into = src / release
    if (into / "DONE").exists():
        return f"{release}: kept"
    fetched = _members(url, set(VLLM_FILES), into)
    (into / "DONE").write_text(uploaded)
    return f"{release}: {fetched / 2**20:.1f} MiB fetched"


def plugin_wheel(project: str, release: str, tag: str) -> tuple[str, str]:
    """(URL, file name) of a plugin release's wheel with ``tag``, from PyPI's simple index (PEP 691)."""
    request = urllib.request.Request(
        f"https://pypi.org/simple/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        page = json.loads(response.read())
    want = f"{project.replace('-', '_')}-{release}-{tag}.whl"
    for entry in page["files"]:
        if entry["filename"] == want:
            return entry["url"], entry["filename"]
    raise SystemExit(f"{want} is not on PyPI")


def fetch_plugin(src: pathlib.Path, project: str, release: str, tag: str, files: tuple[str, ...]) -> str:
    into = src / f"{project}-{release}"
    if not (into / "DONE").exists():
        url, name = plugin_wheel(project, release, tag)
        _members(url, set(files), into)
        (into / "DONE").write_text(name)
    return (into / "DONE").read_text().strip()


# ------------------------------------------------------------------------------------------------ reading


def seg(lines: list[str], node: ast.AST) -> tuple[int, int, str]:
    """A node's first line (its decorators' if any), last line and text, dedented."""
    start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
    return start, node.end_lineno, textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno])) + "\n"


def cls(tree: ast.AST, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def is_none_test(stmt: ast.AST, attr: str, on_self: bool = True) -> bool:
    """``if self.<attr> is None`` (``on_self``) or ``if <attr> is None``."""
    if not isinstance(stmt, ast.If):
        return False
    test = stmt.test
    if not (isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.Is)):
        return False
    left = test.left
    if on_self:
        return (
            isinstance(left, ast.Attribute)
            and left.attr == attr
            and isinstance(left.value, ast.Name)
            and left.value.id == "self"
        )
    return isinstance(left, ast.Name) and left.id == attr


def _target(node: ast.Assign) -> str | None:
    return getattr(node.targets[0], "id", None)


class Texts:
    """The excerpts, each once, keyed by sha256[:12]."""

    def __init__(self):
        self.texts: dict[str, str] = {}

    def keep(self, text: str) -> str:
        key = hashlib.sha256(text.encode()).hexdigest()[:12]
        self.texts[key] = text
        return key


def read_vllm(root: pathlib.Path, version: tuple[int, ...], texts: Texts) -> dict:
    """One release's pieces, from its members under ``root``."""
    pieces: dict[str, dict] = {}
    arg_utils = "vllm/engine/arg_utils.py"
    src = (root / arg_utils).read_text()
    lines = src.splitlines()

    def piece(file: str, start: int, end: int, text: str, **extra) -> dict:
        return {"file": file, "lines": [start, end], "text": texts.keep(text), **extra}

    for node in cls(ast.parse(src), "EngineArgs").body:
        if isinstance(node, ast.FunctionDef) and node.name in FUNCS:
            pieces[node.name] = piece(arg_utils, *seg(lines, node))
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "max_num_seqs":
            pieces["field_max_num_seqs"] = piece(arg_utils, *seg(lines, node))
        if isinstance(node, ast.FunctionDef) and node.name == "__post_init__":
            for stmt in node.body:
                if is_none_test(stmt, "max_num_seqs"):
                    pieces["post_init_max_num_seqs"] = piece(arg_utils, *seg(lines, stmt))
        if isinstance(node, ast.FunctionDef) and node.name == "create_engine_config" and version < V1_ONLY:
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.Assign) and _target(stmt) == "use_long_context":
                    before = body[i - 1]
                    first = before if isinstance(before, ast.Assign) and _target(before) == "max_model_len" else stmt
                    chunk = body[i + 1]
                    assert is_none_test(chunk, "enable_chunked_prefill"), version
                    start, end = first.lineno, chunk.end_lineno
                    text = textwrap.dedent("\n".join(lines[start - 1 : end])) + "\n"
                    pieces["chunked_prefill_default"] = piece(arg_utils, start, end, text)
    # V0's SchedulerConfig default (config.py), with the module constants it reads.
    config = root / "vllm/config.py"
    if config.exists() and version < V1_ONLY:
        csrc = config.read_text()
        clines = csrc.splitlines()
        ctree = ast.parse(csrc)
        for node in cls(ctree, "SchedulerConfig").body:
            if isinstance(node, ast.FunctionDef) and node.name in ("__init__", "__post_init__"):
                for stmt in node.body:
                    if is_none_test(stmt, "max_num_batched_tokens") or is_none_test(
                        stmt, "max_num_batched_tokens", on_self=False
                    ):
                        pieces["scheduler_max_num_batched_tokens"] = piece(
                            "vllm/config.py", *seg(clines, stmt), **{"in": node.name}
                        )
        constants = [
            n
            for n in ctree.body
            if isinstance(n, ast.Assign) and (_target(n) or "").endswith("_MAX_NUM_BATCHED_TOKENS")
        ]
        pieces["constants"] = {
            "file": "vllm/config.py",
            "lines": [[n.lineno, n.end_lineno] for n in constants],
            "text": texts.keep("".join(seg(clines, n)[2] for n in constants)),
        }
    envs = (root / "vllm/envs.py").read_text()
    match = re.search(r'"VLLM_USE_V1":\s*\n\s*lambda: bool\(int\(os.getenv\("VLLM_USE_V1", "([01])"\)\)\)', envs)
    if match:
        line = envs[: match.start()].count("\n") + 1
        pieces["VLLM_USE_V1_default"] = {"file": "vllm/envs.py", "lines": [line, line + 1], "value": match[1]}
    return pieces


def read_plugin(root: pathlib.Path, module: str, init: str, runs_on: str, wheel: str, texts: Texts) -> dict:
    """A plugin's own ``_set_default_args`` (a module-level function) and the lines of its ``__init__`` that
    install it: from ``from <module> import _set_default_args`` to ``...EngineArgs._set_default_args = ...``."""
    src = (root / module).read_text()
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "_set_default_args")
    start, end, text = seg(src.splitlines(), node)
    package = module[:-3].replace("/", ".")
    first = last = None
    for stmt in ast.parse((root / init).read_text()).body:
        if (
            isinstance(stmt, ast.ImportFrom)
            and stmt.module == package
            and any(a.name == "_set_default_args" for a in stmt.names)
        ):
            first = stmt.lineno
        if (
            first is not None
            and isinstance(stmt, ast.Assign)
            and isinstance(stmt.targets[0], ast.Attribute)
            and stmt.targets[0].attr == "_set_default_args"
            and ast.unparse(stmt.targets[0].value).endswith("EngineArgs")
        ):
            last = stmt.end_lineno
            break
    assert first is not None and last is not None, f"{init} does not install _set_default_args"
    return {
        "_set_default_args": {
            "file": module,
            "lines": [start, end],
            "text": texts.keep(text),
            "installed_at": {"file": init, "lines": [first, last]},
            "runs_on": f"vllm:{runs_on}",
            "wheel": wheel,
        }
    }


def build(src: pathlib.Path, offline: bool, jobs: int, date: str) -> dict:
    if offline:
        releases = [
            p.name
            for p in src.iterdir()
            if re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+", p.name)
            and (p / "DONE").exists()
            and index.FIRST <= release_key(p.name) <= index.LAST
        ]
    else:
        urls = {".".join(map(str, v)): found for v, found in index.wheel_urls().items()}
        releases = list(urls)
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            for line in pool.map(lambda v: fetch_vllm(src, v, *urls[v]), sorted(releases, key=release_key)):
                print(f"  {line}", file=sys.stderr)
    releases.sort(key=release_key)
    print(f"{len(releases)} releases: {', '.join(releases)}", file=sys.stderr)
    texts = Texts()
    out_releases = {v: read_vllm(src / v, release_key(v), texts) for v in releases}
    plugins = {}
    for project, release, tag, module, init, runs_on in PLUGINS:
        root = src / f"{project}-{release}"
        if offline:
            if not (root / "DONE").exists():
                raise SystemExit(f"--offline: {root} has not been fetched")
            wheel = (root / "DONE").read_text().strip()
        else:
            wheel = fetch_plugin(src, project, release, tag, (module, init))
        plugins[f"{project}:{release}"] = read_plugin(root, module, init, runs_on, wheel, texts)
    return {"about": ABOUT.format(date=date), "plugins": plugins, "releases": out_releases, "texts": texts.texts}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=str(OUT),
        help="where to write it (default ../shared/vllm-serve-defaults/vllm_serve_defaults.json beside the checkout)",
    )
    parser.add_argument("--src", help="keep (and reuse) the wheels' members here (default: a temporary folder)")
    parser.add_argument("--offline", action="store_true", help="read only --src's releases; ask PyPI nothing")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--date", default=datetime.date.today().isoformat(), help="the read date the about states")
    args = parser.parse_args(argv)
    if args.offline and not args.src:
        parser.error("--offline needs --src")
    with tempfile.TemporaryDirectory() as scratch:
        src = pathlib.Path(args.src or scratch)
        src.mkdir(parents=True, exist_ok=True)
        data = build(src, args.offline, args.jobs, args.date)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1, sort_keys=True)
    print(
        f"wrote {out}: {len(data['releases'])} releases, {len(data['plugins'])} plugin(s), {len(data['texts'])} "
        f"texts ({sum(len(t) for t in data['texts'].values())} characters)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
