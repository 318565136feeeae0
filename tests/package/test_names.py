"""Names that point at what exists: every dotted name of the package (``kvguard.<module>[.<attr>...]``)
and every repository path (``exporter/...``, ``docs/...``, ``kvguard/...py``) that the README, the docs,
the package's docstrings, comments and messages, the benchmarks, the dashboards' generators and the Helm
chart mention must name a module, attribute or file that is there; and the README's layout names the
package's folders and modules as they are."""

from __future__ import annotations

import dataclasses
import glob
import importlib
import inspect
import os
import re
import types

import pytest
import yaml
from conftest import ROOT

PACKAGE = os.path.join(ROOT, "exporter", "kvguard")

# --------------------------------------------------------------------------- what is scanned


def _text_files_under(folder: str, suffixes: tuple[str, ...]) -> list[str]:
    """Files under folder with one of the suffixes; symlinks are left to the file they point at."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):  # os.walk does not enter symlinked folders
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            path = os.path.join(dirpath, name)
            if name.endswith(suffixes) and not os.path.islink(path):
                found.append(path)
    return found


def _sources() -> list[str]:
    files = [os.path.join(ROOT, "README.md")]
    files += glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    files += glob.glob(os.path.join(ROOT, "docs", "*.py"))
    files += _text_files_under(PACKAGE, (".py", ".md"))
    files += glob.glob(os.path.join(ROOT, "bench", "*.py"))
    files += glob.glob(os.path.join(ROOT, "dashboards", "*.py"))
    files += _text_files_under(os.path.join(ROOT, "helm"), (".yaml", ".tpl", ".txt", ".md", ".py"))
    return sorted(os.path.relpath(f, ROOT) for f in files if os.path.isfile(f) and not os.path.islink(f))


SOURCES = _sources()

# --------------------------------------------------------------------------- dotted names

# kvguard.<name>[.<name>...], optionally module:attr (an entry point). Not after a word character, a dot
# (`.Values.kvguard.tls`), a slash (`helm/kvguard.x`) or a dash; Prometheus metric names (kvguard_...) have
# no dot after kvguard and never match. A trailing `(`, `:`, backtick or full stop is not part of the name.
DOTTED = re.compile(r"(?<![\w./$-])kvguard((?:\.[A-Za-z_]\w*)+)(?::([A-Za-z_]\w*))?")

# The last part of a file name, not an attribute: `dashboards/kvguard.json`, `kvguard.md`.
FILE_SUFFIXES = {"py", "md", "c", "h", "json", "yaml", "yml", "txt", "tpl", "gz", "png", "log"}


def _helm_namespace() -> dict[str, str]:
    """kvguard.<head> that the chart means: its values under `kvguard:` and its named templates."""
    chart = os.path.join(ROOT, "helm", "kvguard")
    with open(os.path.join(chart, "values.yaml"), encoding="utf-8") as handle:
        heads = {key: "a value of the Helm chart (values.yaml kvguard.*)" for key in yaml.safe_load(handle)["kvguard"]}
    for path in _text_files_under(chart, (".tpl", ".yaml", ".txt")):
        with open(path, encoding="utf-8") as handle:
            for head in re.findall(r'define\s+"kvguard\.(\w+)', handle.read()):
                heads.setdefault(head, "a Helm template name")
    return heads


# kvguard.<head> that names something other than the package (unless <head> is a module of it as well).
NOT_THE_PACKAGE = {
    "rules": "a Prometheus rule group (dashboards/rules.py: kvguard.rules.engine, ...)",
    "alerts": "a Prometheus rule group (dashboards/rules.py)",
    "snapshot": "the spool file's KIND (kvguard.spool.schema.KIND)",
    "dev": "the pod-label domain kvguard.dev/",
    "serving": "a DNS name in the chart's CI values (kvguard.serving.svc)",
    **_helm_namespace(),
}

# Names a source makes rather than cites.
MADE_NAMES = {
    "kvguard.vllm.log_before": "bench/bench_log.py loads an older log.py (--before) as this module",
}

# Names the package has only while a class's instances live: dataclass fields without a default,
# attributes set in __init__, __slots__, NamedTuple fields.


def _instance_attribute(klass: type, attr: str) -> bool:
    for base in inspect.getmro(klass):
        if base is object:
            continue
        if attr in getattr(base, "__annotations__", {}) or attr in getattr(base, "__slots__", ()):
            return True
        if dataclasses.is_dataclass(base) and attr in {f.name for f in dataclasses.fields(base)}:
            return True
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(attr)}\s*(?::[^=\n]*)?=(?!=)", source):
            return True
    return False


_UNRESOLVED = object()


def _import_longest_prefix(parts: list[str]) -> tuple[types.ModuleType, int]:
    """The longest importable module prefix of parts, and how many parts it takes."""
    for count in range(len(parts), 0, -1):
        name = ".".join(parts[:count])
        try:
            return importlib.import_module(name), count
        except ModuleNotFoundError as error:
            # Only "this name is no module" moves on; a module that fails to import fails the test.
            if error.name is None or not name.startswith(error.name) or not error.name.startswith("kvguard"):
                raise
    raise AssertionError("kvguard itself does not import")


def stale_reason(name: str) -> str | None:
    """None if the dotted name (kvguard.a.b[:c]) is a module or an attribute of one, else why not."""
    dotted, _, entry_attr = name.partition(":")
    parts = dotted.split(".")
    if entry_attr:
        parts.append(entry_attr)
    module, count = _import_longest_prefix(parts)
    obj: object = module
    for index in range(count, len(parts)):
        attr = parts[index]
        if obj is _UNRESOLVED:
            return None  # an instance attribute's attribute: nothing to look up without an instance
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif isinstance(obj, type) and _instance_attribute(obj, attr):
            obj = _UNRESOLVED
        elif isinstance(obj, types.ModuleType) and attr in getattr(obj, "__annotations__", {}):
            obj = _UNRESOLVED
        else:
            where = ".".join(parts[:index])
            kind = "module" if isinstance(obj, types.ModuleType) else type(obj).__name__
            return f"{where} ({kind}) has no {attr}"
    return None


def dotted_names(text: str) -> list[tuple[int, str]]:
    """(line, name) for every package name in text; chart keys, file names and domains are left out."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in DOTTED.finditer(line):
            parts = match.group(1)[1:].split(".")
            if parts[-1] in FILE_SUFFIXES or line[match.end() : match.end() + 1] == "/":
                continue  # a file (kvguard.json) or a domain (kvguard.dev/scrape)
            if parts[0] in NOT_THE_PACKAGE and not _is_package_module(parts[0]):
                continue
            name = "kvguard." + ".".join(parts)
            if match.group(2):
                name += ":" + match.group(2)
            if name not in MADE_NAMES:
                found.append((number, name))
    return found


def _is_package_module(head: str) -> bool:
    return os.path.isfile(os.path.join(PACKAGE, head + ".py")) or os.path.isfile(
        os.path.join(PACKAGE, head, "__init__.py")
    )


# --------------------------------------------------------------------------- repository paths

OUR_TOP_FOLDERS = ("exporter", "tests", "bench", "docs", "helm", "dashboards", "oracles", "kvguard")

# A path that starts after a word character, a dot, a slash, a dash or `~` is part of a longer path
# (`vllm/worker/gpu_worker.py`, `../docs/x.md`, a URL) and is not checked here: test_docs follows links.
PATH = re.compile(r"(?<![\w./~-])(?:" + "|".join(OUR_TOP_FOLDERS) + r")/[\w./-]*")

# A pattern, not a path: a glob or a brace list goes on after it (`tests/test_sim_*.py`,
# `plugin/{hooks,state}.py`, `bench/results/<name>`), or it holds a placeholder (YYYY-MM-DD, rNN).
PATTERN_GOES_ON = "*{<[$"
PLACEHOLDER = re.compile(r"([A-Z])\1+(?![a-z])")

# Other projects' files under a folder name the repository also has, as the sources cite them.
UPSTREAM_PATHS = {
    "docs/deployment/frameworks/lws.md": "vLLM's LWS guide",
    "docs/web-configuration.md": "prometheus/exporter-toolkit's web config format",
    "docs/source/community/versioning_policy.md": "vllm-ascend's versioning policy",
    "docs/configuration/template_reference.md": "prometheus/prometheus's alert templates",
}


def repository_paths(text: str) -> list[tuple[int, str]]:
    """(line, path) for every path of this repository in text: files and folders, not patterns."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in PATH.finditer(line):
            path = match.group(0).rstrip(".")
            if line[match.end() : match.end() + 1] in tuple(PATTERN_GOES_ON) or PLACEHOLDER.search(path):
                continue
            if path.rstrip("/") not in UPSTREAM_PATHS:
                found.append((number, path))
    return found


def path_is_there(path: str) -> bool:
    if path.startswith("kvguard/"):  # the package by its import name
        return os.path.exists(os.path.join(ROOT, "exporter", path))
    return os.path.exists(os.path.join(ROOT, path))


# --------------------------------------------------------------------------- the checks


def stale_mentions(text: str) -> list[str]:
    stale = []
    for number, name in dotted_names(text):
        reason = stale_reason(name)
        if reason:
            stale.append(f"line {number}: {name} ({reason})")
    for number, path in repository_paths(text):
        if not path_is_there(path):
            stale.append(f"line {number}: {path} (no such file)")
    return stale


def _read(relpath: str) -> str:
    with open(os.path.join(ROOT, relpath), encoding="utf-8") as handle:
        return handle.read()


def test_the_scanner_finds_good_names_and_flags_a_stale_one():
    text = (
        "See `kvguard.records.KVCacheAllocation`, kvguard.budget.estimator.Profile(...) and\n"
        "kvguard.cli:main; the field kvguard.records.DeviceMemory.device: a string.\n"
        'log = logging.getLogger("kvguard.probe")  # exporter/kvguard/records.py, kvguard/probe.py.\n'
        "kvguard_allocator_ooms_total, .Values.kvguard.tls.enabled, dashboards/kvguard.json,\n"
        "vllm/worker/gpu_worker.py\n"
        "kvguard.records.NoSuchRecord and kvguard.nosuchmodule.thing, exporter/kvguard/nowhere.py\n"
        "tests/test_sim_*.py, exporter/kvguard/plugin/{hooks,state}.py, bench/results/x-YYYY-MM-DD.txt,\n"
        "bench/results/\n"
    )
    assert dotted_names(text) == [
        (1, "kvguard.records.KVCacheAllocation"),
        (1, "kvguard.budget.estimator.Profile"),
        (2, "kvguard.cli:main"),
        (2, "kvguard.records.DeviceMemory.device"),
        (3, "kvguard.probe"),
        (6, "kvguard.records.NoSuchRecord"),
        (6, "kvguard.nosuchmodule.thing"),
    ]
    assert repository_paths(text) == [
        (3, "exporter/kvguard/records.py"),
        (3, "kvguard/probe.py"),
        (4, "dashboards/kvguard.json"),
        (6, "exporter/kvguard/nowhere.py"),
        (8, "bench/results/"),
    ]
    assert stale_mentions(text) == [
        "line 6: kvguard.records.NoSuchRecord (kvguard.records (module) has no NoSuchRecord)",
        "line 6: kvguard.nosuchmodule.thing (kvguard (module) has no nosuchmodule)",
        "line 6: exporter/kvguard/nowhere.py (no such file)",
    ]


def test_the_walk_finds_names_and_paths_in_every_kind_of_source():
    names = {relpath: dotted_names(_read(relpath)) for relpath in SOURCES}
    paths = {relpath: repository_paths(_read(relpath)) for relpath in SOURCES}
    assert sum(map(len, names.values())) > 300 and sum(map(len, paths.values())) > 300
    for top in ("README.md", "docs/", "exporter/kvguard/", "bench/", "dashboards/"):
        assert any(names[f] or paths[f] for f in SOURCES if f.startswith(top)), top
    assert any(paths[f] for f in SOURCES if f.startswith("helm/")), "helm/"


def test_the_upstream_paths_are_not_ours_and_still_cited():
    cited = {path for relpath in SOURCES for path in re.findall(r"[\w./-]+", _read(relpath))}
    for path, whose in UPSTREAM_PATHS.items():
        assert not os.path.exists(os.path.join(ROOT, path)), f"{path} is ours now, not {whose}"
        assert path in cited, f"{path} ({whose}) is cited nowhere: drop it from UPSTREAM_PATHS"


@pytest.mark.parametrize("relpath", SOURCES)
def test_every_package_name_and_repository_path_exists(relpath):
    stale = stale_mentions(_read(relpath))
    note = ""
    if relpath.startswith("helm/"):
        note = (
            "\n(in the chart, kvguard.<name> is the package's unless <name> is a key of values.yaml's kvguard: "
            'or a template\'s, define "kvguard.<name>")'
        )
    assert not stale, f"{relpath} names what is not there:\n  " + "\n  ".join(stale) + note


# --------------------------------------------------------------------------- the README's layout


def _layout_block() -> list[str]:
    """The README's fenced block that lays out the folders, from `exporter/kvguard/` on."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", _read("README.md"), flags=re.M | re.S)
    block = next(b for b in blocks if re.search(r"^exporter/kvguard/\s", b, flags=re.M))
    return block.splitlines()


def _layout_entries() -> list[tuple[str, list[str], str]]:
    """(folder the names are under, names of the first column, description) for each entry of the layout."""
    entries: list[tuple[str, list[str], str]] = []
    for line in _layout_block():
        indent = len(line) - len(line.lstrip(" "))
        first, _, description = line.strip().partition("  ")
        if indent == 0:
            entries.append(("", first.split(), description.strip()))
        elif indent == 2:
            entries.append(("exporter/kvguard/", first.split(), description.strip()))
        elif entries:  # a description that goes on
            under, names, text = entries[-1]
            entries[-1] = (under, names, f"{text} {line.strip()}")
    return entries


def _modules_in(description: str) -> list[str]:
    """The bare module names a folder's description lists: `eras, log, oom`, `(torch_alloc, mindspore_pool + ...)`,
    `one module per command: budget plan simulate`."""
    per = re.search(r"one module per [\w ]+?:\s*([\w ,]+)", description)
    names = re.split(r"[ ,]+", per.group(1).strip()) if per else []
    for segment in re.split(r"[:;()]", description):
        items = [item.strip() for item in re.split(r"[,+]", segment)]
        if len(items) >= 2:
            names += [item for item in items if re.fullmatch(r"[a-z_][a-z0-9_]*", item)]
    return list(dict.fromkeys(names))


def test_the_readme_layout_names_only_what_exists():
    entries = _layout_entries()
    assert sum(1 for under, _, _ in entries if under) > 10, "the layout's package entries were not found"
    missing = []
    for under, names, description in entries:
        for name in names:
            if not os.path.exists(os.path.join(ROOT, under, name)):
                missing.append(f"{under}{name}")
        if not under or not names:
            continue
        folder = os.path.join(ROOT, under, names[0]) if names[0].endswith("/") else os.path.join(ROOT, under)
        for file in re.findall(r"(?<![\w./-])(\w+\.(?:py|c|json|md))\b", description):
            if not os.path.exists(os.path.join(folder, file)):
                missing.append(f"{os.path.relpath(folder, ROOT)}/{file} (said of {names[0]})")
        for module in _modules_in(description) if names[0].endswith("/") else ():
            if not os.path.exists(os.path.join(folder, module + ".py")):
                missing.append(f"{os.path.relpath(folder, ROOT)}/{module}.py (said of {names[0]})")
        for path in re.findall(r"(?<![\w./-])(?:" + "|".join(OUR_TOP_FOLDERS) + r")/[\w./-]+", description):
            if not path_is_there(path.rstrip(".")):
                missing.append(f"{path} (said of {names[0]})")
    assert not missing, "README.md's layout names what is not there: " + ", ".join(missing)


def test_the_readme_layout_names_every_folder_and_module_of_the_package():
    named = {name for under, names, _ in _layout_entries() if under for name in names}
    folders = {
        f"{entry}/"
        for entry in os.listdir(PACKAGE)
        if os.path.isdir(os.path.join(PACKAGE, entry)) and not entry.startswith((".", "__"))
    }
    modules = {
        entry for entry in os.listdir(PACKAGE) if entry.endswith(".py") and entry not in ("__init__.py", "__main__.py")
    }
    unnamed = sorted(f for f in folders if not any(n.startswith(f) for n in named))
    unnamed += sorted(modules - named)
    assert not unnamed, "README.md's layout does not name: " + ", ".join(unnamed)
