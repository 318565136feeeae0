import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
EXAMPLES = os.path.join(ROOT, "exporter", "kvguard", "examples")

# Tests run against the source tree even when the package is not installed.
sys.path.insert(0, os.path.join(ROOT, "exporter"))


@pytest.fixture
def data_path():
    def path(*parts: str) -> str:
        return os.path.join(DATA, *parts)
    return path
