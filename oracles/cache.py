"""The one cache root every setup script shares: the allocator oracles (oracles/*/build.py) and the
real-upstream test environments (tests/vllm_real/envs.py, tests/ascend_real/envs.py).

Standard library only: these scripts run before the virtualenv exists (``./dev.sh test``).
``KVGUARD_CACHE`` overrides it; otherwise ``${XDG_CACHE_HOME:-~/.cache}/kvguard``.
"""

from __future__ import annotations

import os
import pathlib


def cache_root() -> pathlib.Path:
    if os.environ.get("KVGUARD_CACHE"):
        return pathlib.Path(os.environ["KVGUARD_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(xdg) / "kvguard"
