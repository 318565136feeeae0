"""Write vllm-mindspore 0.5.1's real startup logs (tests/data/logs/mindspore-real/), as the harness runs it.

    .venv/bin/python tests/upstream/mindspore_real/save_logs.py

The release starts once at VLLM_LOGGING_LEVEL=INFO (vllm-mindspore-0.5.1.log) and once at DEBUG
(vllm-mindspore-0.5.1-debug.log), without kvguard's plugin, on the issue's scenario (ASCEND_SCENARIO). The logs
are what the engine printed, unedited; the figure it returned is printed here and kept in the README.
"""

from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from vllm_real import harness as vllm_harness  # noqa: E402 (after the sys.path entry above)

from mindspore_real import envs  # noqa: E402 (after the sys.path entry above)
from mindspore_real.harness import run_engine  # noqa: E402 (after the sys.path entry above)

OUT = HERE.parents[1] / "data" / "logs" / "mindspore-real"


def main(argv):
    vllm_harness.save_logs(run_engine, [(r, envs._name(r)) for r in argv[1:] or list(envs.RELEASES)], OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
