"""The package's layers, read from its source (issue 22, item 2): each module imports only its own layer or
the ones below, no module imports another module's private names, and the imports make no circle.

The order, lowest first: the base modules (records, units, text, files, logs); the allocator models; the
budget; what kvguard knows of vLLM releases (``kvguard.vllm``); the sources; the guard; the spool; the
probe; the vLLM plugin (``kvguard.plugin``: wiring); the serving simulator; the sidecar; the command line. Every
static import counts, function-local ones too: a lazy import is still a dependency.

The source registry (``kvguard.sources``) names ``kvguard.sim.source:SimSource`` as a string that
``importlib`` resolves only when ``--source sim`` is asked for. That is a registry entry, not an import:
the simulator plugs itself into the sources' protocol, as node_exporter's collectors register by name.
"""

from __future__ import annotations

import ast
import os

import pytest
from conftest import ROOT

PACKAGE_DIR = os.path.join(ROOT, "exporter", "kvguard")

BASE = ("kvguard", "kvguard.units", "kvguard.text", "kvguard.textfile", "kvguard.records", "kvguard.logs")
# Lowest first; a module belongs to the last (most specific) prefix that matches it.
LAYERS = (
    BASE,
    ("kvguard.allocators",),
    ("kvguard.budget",),
    ("kvguard.vllm",),
    ("kvguard.sources",),
    ("kvguard.guard",),
    ("kvguard.spool",),
    ("kvguard.probe",),
    ("kvguard.plugin",),
    ("kvguard.sim",),
    ("kvguard.plan",),
    ("kvguard.sidecar",),
    ("kvguard.cli", "kvguard.__main__"),
)


def layer_of(module: str) -> int:
    found = None
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix != "kvguard" and module.startswith(prefix + ".")):
                if found is None or len(prefix) > found[1]:
                    found = (rank, len(prefix))
    assert found is not None, f"{module} is in no layer: add it to LAYERS"
    return found[0]


def all_modules() -> dict[str, str]:
    """Module name -> file, for every module of the package."""
    modules = {}
    for folder, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                relative = os.path.relpath(os.path.join(folder, name), os.path.dirname(PACKAGE_DIR))[:-3]
                parts = relative.split(os.sep)
                if parts[-1] == "__init__":
                    parts.pop()
                modules[".".join(parts)] = os.path.join(folder, name)
    return modules


MODULES = all_modules()


def resolve(module: str, path: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported kvguard module, name taken from it or None, line) for every static import in ``module``."""
    path = MODULES[module]
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    found = []
    aliases: dict[str, str] = {}  # a local name bound to a kvguard module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvguard":
                    found.append((alias.name, None, node.lineno))
                    if alias.asname:
                        aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = resolve(module, path, node)
            if source.split(".")[0] != "kvguard":
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in MODULES:
                    found.append((submodule, None, node.lineno))
                    aliases[alias.asname or alias.name] = submodule
                else:
                    found.append((source, alias.name, node.lineno))
    for node in ast.walk(tree):  # estimator._text_config through a module alias
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            found.append((aliases[node.value.id], node.attr, node.lineno))
    return found


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_the_walk_sees_every_layer_and_the_known_imports():
    # The walk itself: every layer has modules, and imports known to exist are found (a walk that found
    # nothing would pass every test below).
    assert {layer_of(module) for module in MODULES} == set(range(len(LAYERS)))
    assert (
        "kvguard.budget.estimator",
        "Profile",
    ) in {entry[:2] for entry in imports("kvguard.probe")}
    assert "kvguard.cli.options" in {entry[0] for entry in imports("kvguard.cli.simulate")}
    assert layer_of("kvguard.plugin.hooks") > layer_of("kvguard.probe") > layer_of("kvguard.vllm.eras")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_module_imports_only_its_layer_or_below(module):
    rank = layer_of(module)
    upward = sorted(
        {
            f"line {line}: {target}"
            for target, _, line in imports(module)
            if target in MODULES and layer_of(target) > rank
        }
    )
    assert not upward, f"{module} imports from above its layer: {upward}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_another_modules_private_names(module):
    private = sorted(
        {
            f"line {line}: {target}.{name}"
            for target, name, line in imports(module)
            if name is not None and is_private(name) and target != module
        }
    )
    assert not private, f"{module} uses private names of other modules: {private}"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycles_finds_a_circle_and_passes_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert cycles({"a": {"a"}}) == [["a"]]


def test_the_imports_make_no_circle():
    graph = {
        module: {target for target, _, _ in imports(module) if target in MODULES and target != module}
        for module in MODULES
    }
    assert cycles(graph) == []
