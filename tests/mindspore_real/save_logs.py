"""Write vllm-mindspore 0.5.1's real startup logs (tests/data/logs/mindspore-real/), as the harness runs it.

    .venv/bin/python tests/mindspore_real/save_logs.py

The release starts once at VLLM_LOGGING_LEVEL=INFO (vllm-mindspore-0.5.1.log) and once at DEBUG
(vllm-mindspore-0.5.1-debug.log), without kvguard's plugin, on the issue's scenario (ASCEND_SCENARIO). The logs
are what the engine printed, unedited; the figure it returned is printed here and kept in the README.
"""

from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from mindspore_real import envs
from mindspore_real.harness import run_engine

OUT = HERE.parent / "data" / "logs" / "mindspore-real"


def main(argv):
    OUT.mkdir(parents=True, exist_ok=True)
    for release in argv[1:] or list(envs.RELEASES):
        for level, suffix in (("INFO", ""), ("DEBUG", "-debug")):
            result = run_engine(release, env={"VLLM_LOGGING_LEVEL": level}, plugins=False)
            path = OUT / f"{envs._name(release)}{suffix}.log"
            path.write_text("\n".join(result["log_lines"]) + "\n")
            print(f"{path.name}: returned {result['returned_available_bytes']} bytes, "
                  f"{result['kv_cache_config']['num_blocks']} blocks of {result['config']['block_size']} tokens, "
                  f"utilization {result['config']['gpu_memory_utilization']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
