"""Optional C engines for the allocator models (``kvguard.allocators._ctorch``, ``._cmspool``).

Everything else is in pyproject.toml. Each engine is a second implementation of a Python model
(``torch_alloc.py``, ``mindspore_pool.py``), held equal to it by differential tests; where no C
compiler or Python headers are found, the build skips it (``optional=True``) and kvguard runs the
Python model alone (``kvguard.allocators.native``).
"""

from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent
ENGINES = [("kvguard.allocators._ctorch", "exporter/kvguard/allocators/_ctorch.c"),
           ("kvguard.allocators._cmspool", "exporter/kvguard/allocators/_cmspool.c")]

setup(ext_modules=[Extension(name, [source], optional=True, extra_compile_args=["-O2", "-std=c11"])
                   for name, source in ENGINES if (HERE / source).is_file()])
