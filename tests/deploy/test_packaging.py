"""The artifacts the README's install block produces, installed where kvguard runs.

The default build is the pure-Python wheel (``kvguard-<version>-py3-none-any.whl``): the C engines of
the allocator models are built only when asked (``KVGUARD_BUILD_EXT=1``, setup.py). The wheel is built
once from a copy of the checkout with the README's own command, then installed into a fresh virtualenv
of each Python from 3.10 to 3.13 (this machine's pyenv interpreters; a missing one is a skip naming it),
where ``kvguard --version`` must run and, on 3.12 (vLLM's image), the plugin must load from vLLM's
entry-point group the way vLLM loads it. Dependencies come from pip's configured indexes (local here);
nothing is fetched from the network.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import tomllib
from conftest import ROOT

with open(os.path.join(ROOT, "pyproject.toml"), "rb") as _f:
    VERSION = tomllib.load(_f)["project"]["version"]
WHEEL = f"kvguard-{VERSION}-py3-none-any.whl"
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
# The README's install block, as written (see test_the_readme_names_the_wheel_the_build_produces).
BUILD = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", "dist", "."]
# What setup.py and pyproject.toml read (the rest of the tree, tests and docs, is not in the build).
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "exporter")


def _interpreter(version: str) -> str | None:
    """A CPython of this minor version on this machine: pyenv's, else one on PATH."""
    roots = [os.path.expanduser("~/.pyenv/versions"), "/opt/pyenv/versions"]
    for root in roots:
        for candidate in sorted(glob.glob(os.path.join(root, f"{version}.*", "bin", "python3"))):
            if re.fullmatch(
                rf"{re.escape(version)}\.\d+", os.path.basename(os.path.dirname(os.path.dirname(candidate)))
            ):
                return candidate
    return shutil.which(f"python{version}")


def _copy_build_inputs(destination) -> None:
    for name in BUILD_INPUTS:
        source = os.path.join(ROOT, name)
        if os.path.isdir(source):
            # In-place C engines (dev.sh builds them for the tests) are copied too: the default build
            # must leave them out all the same.
            shutil.copytree(
                source, destination / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
            )
        else:
            shutil.copy2(source, destination / name)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The README's build command run in a copy of the checkout: (the dist folder, pip's output)."""
    tree = tmp_path_factory.mktemp("checkout")
    _copy_build_inputs(tree)
    run = subprocess.run(BUILD, cwd=tree, env=_outside_the_checkout(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return tree / "dist"


def test_the_default_build_is_one_pure_python_wheel(built):
    assert sorted(os.listdir(built)) == [WHEEL]


def test_the_pure_wheel_carries_no_compiled_code(built):
    names = zipfile.ZipFile(built / WHEEL).namelist()
    assert not [n for n in names if n.endswith((".so", ".pyd", ".dylib"))]
    wheel_meta = zipfile.ZipFile(built / WHEEL).read(f"kvguard-{VERSION}.dist-info/WHEEL").decode()
    assert "Root-Is-Purelib: true" in wheel_meta and "Tag: py3-none-any" in wheel_meta
    # the engines' sources stay out too: they are built from a checkout, never at install time
    assert not [n for n in names if n.endswith(".c")]


def test_the_readme_names_the_wheel_the_build_produces():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert "python3 -m pip wheel --no-deps -w dist ." in readme
    named = set(re.findall(r"kvguard-[\w.+-]+?\.whl", readme))
    assert named == {WHEEL}


@pytest.mark.parametrize("doc", ["docs/how-to/kubernetes.md", "docs/how-to/run-beside-vllm.md"])
def test_the_deploy_docs_name_the_wheel_the_build_produces(doc):
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    named = set(re.findall(r"kvguard-[\w.+-]+?\.whl", text))
    assert named and named == {WHEEL}


def _outside_the_checkout() -> dict[str, str]:
    """The environment without conftest's PYTHONPATH: it holds the checkout's own kvguard (and its egg-info),
    which pip would take for the installed distribution."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVGUARD_BUILD_EXT")}


def _fresh_venv(python: str, where) -> str:
    subprocess.run(
        [python, "-m", "venv", str(where)], check=True, capture_output=True, timeout=120, env=_outside_the_checkout()
    )
    return str(where / "bin" / "python")


@pytest.mark.parametrize("version", PYTHONS)
def test_the_wheel_installs_and_runs_in_a_fresh_venv(version, built, tmp_path):
    python = _interpreter(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine (looked in ~/.pyenv/versions, /opt/pyenv, PATH)")
    venv_python = _fresh_venv(python, tmp_path / "venv")
    install = subprocess.run(
        [venv_python, "-m", "pip", "install", "-q", str(built / WHEEL)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_outside_the_checkout(),
    )
    assert install.returncode == 0, install.stdout + install.stderr
    kvguard = subprocess.run(
        [str(tmp_path / "venv" / "bin" / "kvguard"), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_outside_the_checkout(),
    )
    assert kvguard.returncode == 0, kvguard.stderr
    assert kvguard.stdout.strip() == f"kvguard, version {VERSION}"
    # The pure wheel runs the allocator models in Python: the engines are absent, and native.py says so.
    engines = subprocess.run(
        [
            venv_python,
            "-c",
            "from kvguard.allocators import native, torch_native as t; from kvguard.allocators.device import Device;"
            "a = native.caching_allocator(Device(1 << 30));"
            "print(type(a).__module__, t.unsupported(device=Device(1 << 30)))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=_outside_the_checkout(),
    )
    assert engines.returncode == 0, engines.stderr
    assert engines.stdout.split()[0] == "kvguard.allocators.torch_alloc"
    assert "not built" in engines.stdout


def test_the_plugin_loads_from_vllms_entry_point_group_on_python_3_12(built, tmp_path):
    """vLLM's own loader: ``entry_points(group="vllm.general_plugins")``, then ``plugin.load()`` and the call
    (vllm/plugins/__init__.py 0.34.0:36-74 load_plugins_by_group, :77-100 load_general_plugins)."""
    python = _interpreter("3.12")
    if python is None:
        pytest.skip("no Python 3.12 on this machine (vLLM's image runs 3.12)")
    venv_python = _fresh_venv(python, tmp_path / "venv")
    install = subprocess.run(
        [venv_python, "-m", "pip", "install", "-q", str(built / WHEEL)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_outside_the_checkout(),
    )
    assert install.returncode == 0, install.stdout + install.stderr
    load = subprocess.run(
        [
            venv_python,
            "-c",
            "from importlib.metadata import entry_points\n"
            "found = {p.name: p for p in entry_points(group='vllm.general_plugins')}\n"
            "register = found['kvguard'].load()\n"
            "register(); register()\n"  # vLLM calls it in every process, and may call it twice
            "print(found['kvguard'].value, register.__module__)\n",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ.get("PATH", "")},
    )
    assert load.returncode == 0, load.stderr
    assert load.stdout.split() == ["kvguard.plugin:register", "kvguard.plugin.hooks"]


def test_asked_for_the_c_engines_build_in_place_as_dev_sh_builds_them(tmp_path):
    """KVGUARD_BUILD_EXT=1 (dev.sh's test setup) builds both engines beside their sources, and they load."""
    if not shutil.which("cc") and not shutil.which("gcc"):
        pytest.skip("no C compiler here: the engines are optional, the Python models run alone")
    _copy_build_inputs(tmp_path)
    for built_before in glob.glob(str(tmp_path / "exporter" / "kvguard" / "allocators" / "*.so")):
        os.remove(built_before)
    env = {**_outside_the_checkout(), "KVGUARD_BUILD_EXT": "1"}
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    load = subprocess.run(
        [
            sys.executable,
            "-c",
            "import kvguard.allocators._ctorch as t, kvguard.allocators._cmspool as m;print(t.__file__, m.__file__)",
        ],
        cwd=tmp_path / "exporter",
        env={**_outside_the_checkout(), "PYTHONPATH": str(tmp_path / "exporter")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert load.returncode == 0, load.stderr
    assert all(path.startswith(str(tmp_path)) and path.endswith(".so") for path in load.stdout.split())
