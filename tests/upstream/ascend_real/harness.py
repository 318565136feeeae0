"""Run a vllm-ascend release's real worker startup on a fake NPU, from kvguard's venv.

    from ascend_real.harness import run_engine          # from tests/ (pytest puts it on sys.path)
    result = run_engine("vllm-ascend:0.18.0", ASCEND_SCENARIO, env={"KVGUARD_BUDGET": "reserved"})

The release runs in its own environment (envs.py), in a subprocess (engine_main.py), with kvguard's
plugin visible as an installed distribution as tests/upstream/vllm_real/harness.py arranges it; the result's keys
are those of vllm_real.harness.run_worker (returned_available_bytes, config, figures, profile,
kv_cache_config, log_lines, device_calls, ...).
"""

from __future__ import annotations

import json
import pathlib
import sys

if not __package__:  # run as a script
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from vllm_real import harness as vllm_harness
from vllm_real.harness import EnvironmentMissing, HarnessError  # noqa: E402,F401  (the same errors as the vLLM harness)

from ascend_real import envs  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
GiB = 1 << 30
MiB = 1 << 20

# The scenario: a 64 GiB device, 14 GiB of weights, a profile run of +4 GiB allocated and
# +5.5 GiB reserved (an earlier 1.5 GiB activation block the peak cannot reuse), 300 MiB of non-torch
# memory left behind; 1 GiB of non-torch memory (HCCL, the ACL context) before the worker's snapshot.
ASCEND_SCENARIO = {
    "model_dir": str(vllm_harness.EXAMPLE_MODEL),
    "total_memory_bytes": 64 * GiB,
    "other_process_bytes": 0,
    "init_non_torch_bytes": 1 * GiB,
    "weights_bytes": 14 * GiB,
    "profile_transient_bytes": 4 * GiB,
    "profile_unreusable_bytes": 1536 * MiB,
    "profile_residual_bytes": 0,
    "profile_non_torch_bytes": 300 * MiB,
    "profile_fragment_bytes": 0,
    "cudagraph_bytes": 0,
    "max_model_len": 4096,
    "enforce_eager": True,
}


def available_releases() -> list[str]:
    return [r for r in envs.RELEASES if envs.env_python(r) is not None]


run_engine = vllm_harness.engine_runner(
    envs, HERE / "engine_main.py", ASCEND_SCENARIO, "python3 tests/upstream/ascend_real/envs.py setup"
)


def main(argv):
    """python tests/upstream/ascend_real/harness.py RELEASE [KEY=VALUE ...] [--env K=V] [--lines]"""
    release, scenario, env = argv[1], {}, {}
    args = iter(argv[2:])
    lines = False
    for arg in args:
        if arg == "--env":
            k, _, v = next(args).partition("=")
            env[k] = v
        elif arg == "--lines":
            lines = True
        else:
            k, _, v = arg.partition("=")
            scenario[k] = json.loads(v)
    result = run_engine(release, scenario, env, check=False)
    log_lines = result.pop("log_lines")
    print(json.dumps(result, indent=1, default=str))
    if lines:
        print("\n".join(log_lines))
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
