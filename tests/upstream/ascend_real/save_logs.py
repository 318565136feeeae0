"""Write the real startup logs of each engine release (tests/data/logs/ascend-real/), as the harness runs it.

    .venv/bin/python tests/upstream/ascend_real/save_logs.py [RELEASE ...]

Each release starts once at VLLM_LOGGING_LEVEL=INFO (ENGINE-RELEASE.log) and once at DEBUG
(ENGINE-RELEASE-debug.log), without kvguard's plugin, on the issue's scenario (harness.ASCEND_SCENARIO).
The logs are what the engine printed, unedited; the figure the engine returned is in the README.
"""

from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from vllm_real import harness as vllm_harness  # noqa: E402

from ascend_real import envs  # noqa: E402
from ascend_real.harness import run_engine  # noqa: E402

OUT = HERE.parents[1] / "data" / "logs" / "ascend-real"


def main(argv):
    vllm_harness.save_logs(run_engine, [(r, envs._name(r)) for r in argv[1:] or list(envs.RELEASES)], OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
