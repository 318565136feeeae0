"""Optional C engines for the allocator models (``kvguard.allocators._ctorch``, ``._cmspool``).

Everything else is in pyproject.toml. The default build is the pure-Python wheel
(``kvguard-<version>-py3-none-any.whl``): it installs on every Python >= 3.10 and every platform,
vLLM's image (3.12) and aarch64 hosts included, and kvguard runs the Python models
(``kvguard.allocators.native`` falls back to them where the engines are absent).

``KVGUARD_BUILD_EXT=1`` builds the engines too: ``KVGUARD_BUILD_EXT=1 pip install -e .`` (what
``./dev.sh test`` runs; the tests hold each engine equal to its Python model) or
``KVGUARD_BUILD_EXT=1 python3 setup.py build_ext --inplace``. A wheel built so is tagged for one
Python and platform (``kvguard-<version>-cp311-cp311-linux_x86_64.whl``). Asked for, a failed build
is an error, not a silent fallback.
"""

import os
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent
ENGINES = [
    ("kvguard.allocators._ctorch", "exporter/kvguard/allocators/_ctorch.c"),
    ("kvguard.allocators._cmspool", "exporter/kvguard/allocators/_cmspool.c"),
]
# What both engines include: a change to it rebuilds both.
HEADERS = ["exporter/kvguard/allocators/_engine.h"]
BUILD_EXT = os.environ.get("KVGUARD_BUILD_EXT", "").strip() == "1"

setup(
    ext_modules=[
        Extension(name, [source], depends=HEADERS, extra_compile_args=["-O2", "-std=c11"])
        for name, source in ENGINES
        if BUILD_EXT and (HERE / source).is_file()
    ]
)
