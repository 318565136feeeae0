"""Run vllm-mindspore's real worker startup on a fake NPU, from kvguard's venv.

    from mindspore_real.harness import run_engine       # from tests/ (pytest puts it on sys.path)
    result = run_engine("vllm-mindspore:0.5.1", env={"KVGUARD_BUDGET": "reserved"})

The release runs in its own environment (envs.py), in a subprocess (engine_main.py), with kvguard's plugin
visible as an installed distribution (tests/upstream/vllm_real/harness.py's run_release_process, shared); the result's
keys are those of tests/upstream/ascend_real's run_engine (returned_available_bytes, config, figures, profile,
kv_cache_config, log_lines, device_calls, ...). The default scenario is the issue's, ASCEND_SCENARIO.
"""

from __future__ import annotations

import json
import pathlib
import sys

if not __package__:  # run as a script
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from ascend_real.harness import ASCEND_SCENARIO
from vllm_real import harness as vllm_harness
from vllm_real.harness import EnvironmentMissing, HarnessError  # noqa: F401

from mindspore_real import envs

HERE = pathlib.Path(__file__).resolve().parent
RELEASE = "vllm-mindspore:0.5.1"


run_engine = vllm_harness.engine_runner(
    envs, HERE / "engine_main.py", ASCEND_SCENARIO, "python3 tests/upstream/mindspore_real/envs.py setup"
)


def main(argv):
    """python tests/upstream/mindspore_real/harness.py [KEY=VALUE ...] [--env K=V] [--lines] [--no-plugins]"""
    scenario, env, lines, plugins = {}, {}, False, True
    args = iter(argv[1:])
    for arg in args:
        if arg == "--env":
            k, _, v = next(args).partition("=")
            env[k] = v
        elif arg == "--lines":
            lines = True
        elif arg == "--no-plugins":
            plugins = False
        else:
            k, _, v = arg.partition("=")
            scenario[k] = json.loads(v)
    result = run_engine(RELEASE, scenario, env, plugins=plugins, check=False)
    log_lines = result.pop("log_lines")
    print(json.dumps(result, indent=1, default=str))
    if lines:
        print("\n".join(log_lines))
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
