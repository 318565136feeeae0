"""The allocator models' own test files, run on both implementations (as msgpack runs its suite with and
without its extension): the Python model (the specification) and the C engine.

A test file builds its allocators through ``kvguard.allocators.native`` and uses the ``engine`` fixture
(``pytestmark = pytest.mark.usefixtures("engine")``): every test then runs once with
``KVGUARD_ALLOCATOR_ENGINE=python`` and once with ``=c``, which makes ``native`` build the C engine or fail
(never a silent fallback to the model). A test that reads what only the Python model has (its internals, its
trace-replay methods, a subclass of it) is marked ``@python_only``, with a one-line reason beside it.
"""

from __future__ import annotations

import pytest

from kvguard.allocators import native

ENGINES = ("python", "c")


@pytest.fixture(params=ENGINES)
def engine(request, monkeypatch) -> str:
    """The implementation this test runs on: 'python' or 'c' (KVGUARD_ALLOCATOR_ENGINE is set to it)."""
    if request.param == "c" and not native.built():
        pytest.skip("the C engines are not built here (KVGUARD_BUILD_EXT=1 python setup.py build_ext --inplace)")
    monkeypatch.setenv(native.ENV, request.param)
    return request.param


# Runs the test on the Python model alone.
python_only = pytest.mark.parametrize("engine", ["python"], indirect=True)
