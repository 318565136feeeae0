"""Where the real, public PyTorch snapshots lie: ../shared beside the checkout, as CI lays it out.

They are fetched public data, never committed; ``KVGUARD_TORCH_SNAPSHOTS`` may name other folders,
separated by ``os.pathsep``, searched recursively.
"""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(REPO), "shared")
REAL_DIRS = [path for path in os.environ.get(
    "KVGUARD_TORCH_SNAPSHOTS",
    os.pathsep.join([os.path.join(SHARED, "torch-snapshots"), os.path.join(SHARED, "torch-snapshots-2")]),
).split(os.pathsep) if path]
