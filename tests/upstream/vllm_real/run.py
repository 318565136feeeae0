"""Try the harness by hand:

    python3 tests/upstream/vllm_real/run.py 0.34.0 weights_bytes=15000000000 gpu_memory_utilization=0.9 \\
        --env KVGUARD_BUDGET=reserved [--no-plugins] [--lines] [--json]

Prints the returned KV budget and figures (or the whole result with --json).
Run it with kvguard's venv python (it needs Python 3.11+ only).
"""

from __future__ import annotations

import json
import sys

import harness


def _value(text):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"none": None, "true": True, "false": False}.get(text.lower(), text)


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 2
    version, scenario, env = argv[1], {}, {}
    flags = set()
    args = iter(argv[2:])
    for arg in args:
        if arg == "--env":
            key, _, value = next(args).partition("=")
            env[key] = value
        elif arg.startswith("--"):
            flags.add(arg)
        else:
            key, _, value = arg.partition("=")
            scenario[key] = _value(value)
    result = harness.run_worker(version, scenario, env, plugins="--no-plugins" not in flags, check=False)
    if "--json" in flags:
        print(json.dumps(result, indent=1, default=str))
    else:
        if not result.get("ok"):
            print(f"error: {result.get('error')}")
            print(result.get("traceback", ""))
        print(f"vllm {result.get('vllm_version')}: returned {result.get('returned_available_bytes')} bytes")
        print(
            json.dumps({k: result.get(k) for k in ("config", "figures", "extensible_kv_cache")}, indent=1, default=str)
        )
        kv = result.get("kv_cache_config") or {}
        print(f"kv cache: {kv.get('num_blocks')} blocks, groups {kv.get('groups')}")
        if "--lines" in flags:
            print("\n".join(result["log_lines"]))
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
