"""Write the real startup logs of each engine release (tests/data/logs/ascend-real/), as the harness runs it.

    .venv/bin/python tests/ascend_real/save_logs.py [RELEASE ...]

Each release starts once at VLLM_LOGGING_LEVEL=INFO (ENGINE-RELEASE.log) and once at DEBUG
(ENGINE-RELEASE-debug.log), without kvguard's plugin, on the issue's scenario (harness.ASCEND_SCENARIO).
The logs are what the engine printed, unedited; the figure the engine returned is in the README.
"""

from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from ascend_real import envs  # noqa: E402
from ascend_real.harness import run_engine  # noqa: E402

OUT = HERE.parent / "data" / "logs" / "ascend-real"


def main(argv):
    OUT.mkdir(parents=True, exist_ok=True)
    for release in argv[1:] or list(envs.RELEASES):
        for level, suffix in (("INFO", ""), ("DEBUG", "-debug")):
            result = run_engine(release, env={"VLLM_LOGGING_LEVEL": level}, plugins=False)
            path = OUT / f"{envs._name(release)}{suffix}.log"
            path.write_text("\n".join(result["log_lines"]) + "\n")
            decided = result["returned_available_bytes"]    # None on V0 (0.7.3): its worker decides blocks
            print(f"{path.name}: returned {'no byte budget (V0)' if decided is None else f'{decided} bytes'}, "
                  f"{result['kv_cache_config']['num_blocks']} blocks of {result['config']['block_size']} tokens, "
                  f"utilization {result['config']['gpu_memory_utilization']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
