"""The C engines' sources: one style (the repository's .clang-format, checked with the pinned clang-format), one
shared header (_engine.h), and every constant they share with the Python models written once: each engine
exports its shared constants as module attributes (SHARED_CONSTANTS), compared here with the Python side, and
every other constant in the C sources is listed below as the engine's own.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

ALLOCATORS = os.path.join(ROOT, "exporter", "kvguard", "allocators")
SOURCES = ("_ctorch.c", "_cmspool.c", "_engine.h")
CLANG_FORMAT_VERSION = "23.1.5"  # pyproject.toml's dev pin (clang-format==23.1.5)


def _source(name: str) -> str:
    with open(os.path.join(ALLOCATORS, name), encoding="utf-8") as f:
        return f.read()


def _clang_format() -> str:
    """The pinned clang-format: the virtualenv's beside this Python, else one on PATH of the same version."""
    candidates = [os.path.join(os.path.dirname(sys.executable), "clang-format"), shutil.which("clang-format")]
    for path in filter(None, candidates):
        if os.path.isfile(path) and os.access(path, os.X_OK):
            version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
            if CLANG_FORMAT_VERSION in version:
                return path
    message = f"clang-format {CLANG_FORMAT_VERSION} is not installed (pip install clang-format=={CLANG_FORMAT_VERSION})"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message + "; CI=true: the style check must run", pytrace=False)
    pytest.skip(message)


# ----------------------------------------------------------------------------------------------- one style
@pytest.mark.parametrize("name", SOURCES)
def test_the_c_sources_are_formatted_with_the_repository_style(name):
    run = subprocess.run(
        [_clang_format(), "--dry-run", "--Werror", os.path.join(ALLOCATORS, name)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, f"{name} is not formatted: run .venv/bin/clang-format -i on it\n{run.stderr[:3000]}"


def test_the_style_check_fails_on_an_unformatted_source():
    # Braces on their own line and a cramped body: what the check must refuse.
    unformatted = "static int f(int a)\n{\n    if (a) { return 1; }\n  return 0;\n}\n"
    run = subprocess.run(
        [_clang_format(), "--dry-run", "--Werror", f"--assume-filename={os.path.join(ALLOCATORS, 'x.c')}"],
        input=unformatted,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0


# ----------------------------------------------------------------------------------------------- one header
@pytest.mark.parametrize("name", ["_ctorch.c", "_cmspool.c"])
def test_both_engines_take_the_shared_rules_from_the_header(name):
    text = _source(name)
    assert '#include "_engine.h"' in text
    # The model's exception, overflow checks and 128-bit types are the header's alone.
    for own in ("PyImport_ImportModule", 'AllocatorOutOfMemory"', "__builtin_", "typedef unsigned __int128"):
        assert own not in text, f"{name} spells {own} itself: it belongs in _engine.h"


def test_setup_rebuilds_both_engines_when_the_header_changes():
    setup = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    assert "exporter/kvguard/allocators/_engine.h" in setup and "depends=HEADERS" in setup


# ----------------------------------------------------------------------------------------------- constants
def _torch_side() -> dict[str, int]:
    from kvguard.allocators import torch_alloc, torch_native

    stat_cells = len(torch_alloc.STAT_ARRAYS) * len(torch_alloc.STAT_POOLS) * len(torch_alloc.STAT_FIELDS)
    return {
        "K_MIN_BLOCK_SIZE": torch_alloc.K_MIN_BLOCK_SIZE,
        "K_SMALL_SIZE": torch_alloc.K_SMALL_SIZE,
        "K_SMALL_BUFFER": torch_alloc.K_SMALL_BUFFER,
        "K_MIN_LARGE_ALLOC": torch_alloc.K_MIN_LARGE_ALLOC,
        "K_ROUND_LARGE": torch_alloc.K_ROUND_LARGE,
        "K_EXTRA_LARGE_BUFFER": torch_alloc.K_EXTRA_LARGE_BUFFER,
        "K_ROUNDUP_INTERVALS": torch_alloc.K_ROUNDUP_INTERVALS,
        "K_ROUNDUP_START_LOG2": torch_alloc.K_ROUNDUP_START_LOG2,
        "UNLIMITED": torch_alloc._UNLIMITED,
        "N_STAT_ARRAYS": len(torch_alloc.STAT_ARRAYS),
        "N_STAT_POOLS": len(torch_alloc.STAT_POOLS),
        "N_STAT_FIELDS": len(torch_alloc.STAT_FIELDS),
        # the engine's own limit, which the wrapper reads from it
        "MAX_DEVICE_BYTES": torch_native._MAX_DEVICE_BYTES,
        # its cells: the model's stat arrays, then its oversize stats (4 fields each), as torch_native reads them
        "C_OVERSIZE_ALLOCATIONS": stat_cells,
        "C_OVERSIZE_SEGMENTS": stat_cells + len(torch_alloc.STAT_FIELDS),
    }


def _mindspore_side() -> dict[str, int]:
    from kvguard.allocators import mindspore_native, mindspore_pool

    return {
        "IDLE": mindspore_pool.IDLE,
        "USED": mindspore_pool.USED,
        "EAGER_FREE": mindspore_pool.EAGER_FREE,
        "SPLIT_MIN_BYTES": mindspore_pool.K_ALIGN,
        # the engine's own limits, which the wrapper reads from it
        "SIZE_BEYOND": mindspore_native._LIMIT_BYTES,
        "STEP_LIMIT": mindspore_native._STEP_LIMIT,
    }


# What each engine defines for itself, in no Python file: sentinels, slab sizes, internal cell indexes.
ENGINE_ONLY = {
    "_ctorch.c": {
        "KVG_ENGINE",
        "HUGE_SIZE",  # a size of 2**64 or more
        "STREAM_BIAS",  # streams biased to order as uint64
        "CELL_HIGH_LIMIT",  # the range of a cell written from Python
        "SLAB_BLOCKS",
        "_PyHASH_MODULUS",  # CPython's
        "C_NUM_ALLOC_RETRIES",  # cell indexes, read through the engine's named getters
        "C_NUM_OOMS",
        "C_NUM_SYNC_ALL_STREAMS",
        "C_NUM_DEVICE_ALLOC",
        "C_NUM_DEVICE_FREE",
        "C_WINDOW_ALLOC",
        "C_WINDOW_RESERVED",
    },
    "_cmspool.c": {"KVG_ENGINE", "SLAB_BUFS"},
}
# Exported for the wrapper, and the engine's own: the number of cells (steady_cells indexes them).
EXPORTED_OWN = {"_ctorch.c": {"N_CELLS"}, "_cmspool.c": set()}
PYTHON_SIDE = {"_ctorch.c": ("_ctorch", _torch_side), "_cmspool.c": ("_cmspool", _mindspore_side)}


def _engine(name: str):
    module = PYTHON_SIDE[name][0]
    return pytest.importorskip(f"kvguard.allocators.{module}", reason=f"the C engine {module} is not built")


@pytest.mark.parametrize("name", ["_ctorch.c", "_cmspool.c"])
def test_every_shared_constant_equals_the_python_side(name):
    engine = _engine(name)
    python_side = PYTHON_SIDE[name][1]()
    compared = set(engine.SHARED_CONSTANTS) - EXPORTED_OWN[name]
    assert {constant: getattr(engine, constant) for constant in compared} == python_side


@pytest.mark.parametrize("name", ["_ctorch.c", "_cmspool.c"])
def test_every_constant_in_the_c_source_is_shared_or_the_engines_own(name):
    """A new #define (a value-like macro) must be exported and compared above, or listed as the engine's own."""
    engine = _engine(name)
    defined = set(re.findall(r"^#define (\w+)(?!\()\s", _source(name), flags=re.M))
    unclassified = defined - set(engine.SHARED_CONSTANTS) - ENGINE_ONLY[name]
    assert not unclassified, f"{name}: export these in shared_constants (and compare them here) or list them"
    assert not (ENGINE_ONLY[name] - defined), "ENGINE_ONLY names a constant the source no longer defines"


def test_the_torch_engines_stat_enums_follow_the_models_stat_names():
    from kvguard.allocators.torch_alloc import STAT_ARRAYS, STAT_FIELDS, STAT_POOLS

    text = _source("_ctorch.c")

    def enum(last: str) -> list[str]:
        body = re.search(r"enum\s*\{([^}]*\b" + last + r")\s*\}", text)
        assert body, last
        return [item.strip() for item in body.group(1).split(",")][:-1]

    assert enum("N_STAT_ARRAYS") == ["S_" + name.upper() for name in STAT_ARRAYS]
    assert enum("N_STAT_POOLS") == ["P_" + name.split("_")[0].upper() for name in STAT_POOLS]
    assert enum("N_STAT_FIELDS") == ["F_" + name.upper() for name in STAT_FIELDS]
