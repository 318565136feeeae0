"""The seed story on MindSpore's real pool: does vLLM's stock budget run out where the reserved one serves?

Run on demand:  .venv/bin/python bench/seed_story.py [--seeds N] [--json FILE]

vllm-mindspore's fix (Gitee PR !428) budgets the KV cache from the profile run's *reserved* increase
instead of the allocated peak (Qwen2.5-7B: 37.85 GiB / 44292 blocks -> 36.40 GiB / 42593). The story
is that the stock budget starts fine and then runs out of memory on long requests, while the reserved
one serves. Here each run is Qwen2.5-7B-Instruct, utilization 0.9, every request long (prompts of
max_model_len/2 or more), 16 requests, under the seed era's launcher (vllm-mindspore 0.2.0: no
MS_ALLOC_CONF, so VMM on as MindSpore defaults on a 910B) and with VMM off, on a 32 GiB 910B4 and a
64 GiB 910B, stock and reserved budgets, seeds 0..N-1.

The seed era pinned MindSpore 2.6.0's pool, which the oracle cannot load (tests/upstream/oracles/mindspore/README.md);
the runs use the oldest release whose compiled pool runs here (2.7.0) and the launcher's pin today
(2.7.1). Each run's outcome comes from the real pool replaying the run's allocation stream
(bench/real_pool.py); "exact" says the model agreed with it at every op.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "exporter"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import real_pool  # noqa: E402

GIB = 1 << 30
RELEASES = ("2.7.0", "2.7.1")
DEVICES_GIB = (32, 64)
VMM = (("seed launcher (VMM on)", None), ("VMM off", "enable_vmm:False"))
BUDGETS = ("stock", "reserved")


def config(release: str, gib: int, conf: str | None, budget: str, seed: int):
    from kvguard.budget.model_config import load_model_config
    from kvguard.sim.scenario import ScenarioConfig

    return ScenarioConfig(
        model_config=load_model_config(os.path.join(ROOT, "exporter", "kvguard", "examples", "qwen2.5-7b-instruct")),
        device_memory_bytes=gib * GIB,
        gpu_memory_utilization=0.9,
        allocator="mindspore",
        budget=budget,
        long_request_fraction=1.0,
        requests=16,
        seed=seed,
        vllm_mindspore_version="0.2.0",
        mindspore_version=release,
        ms_alloc_conf=conf,
    )


def run_one(args: tuple) -> dict:
    from kvguard.sim.scenario import ServingScenario

    release, gib, (vmm_name, conf), budget, seed = args
    scenario = ServingScenario(config(release, gib, conf, budget, seed))
    oracle = real_pool.oracle_for(scenario.config)
    if oracle is None:
        raise SystemExit(f"no MindSpore {release} pool oracle: run ./dev.sh test first")
    result, truth = real_pool.run_with_truth(scenario, lambda s: s.run())
    return {
        "release": release,
        "device_gib": gib,
        "vmm": vmm_name,
        "budget": budget,
        "seed": seed,
        "kv_cache_bytes": result.kv_cache_bytes,
        "num_blocks": result.num_blocks,
        "model_outcome": _outcome(result.oom, result.oom_phase, result.oom_at_step, result.error),
        "real_outcome": truth.kind + (f" at step {truth.oom_at_step}" if truth.oom_at_step is not None else ""),
        "exact": truth.exact,
        "first_difference": truth.first_difference,
        "ops": truth.ops,
    }


def _outcome(oom: bool, phase: str | None, step: int | None, error: str | None) -> str:
    if oom:
        return (
            "serving_oom" + (f" at step {step}" if step is not None else "")
            if phase == "serving"
            else ("startup_oom" if phase == "kv_cache" else "not_started")
        )
    return "not_started" if error else "no_oom"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    started = time.monotonic()
    grid = list(itertools.product(RELEASES, DEVICES_GIB, VMM, BUDGETS, range(args.seeds)))
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(run_one, grid))
    print(f"{'release':8} {'device':6} {'pool':22} {'budget':8} {'blocks':>7}  real pool outcome per seed (exact?)")
    for key, group in itertools.groupby(rows, key=lambda r: (r["release"], r["device_gib"], r["vmm"], r["budget"])):
        group = list(group)
        outcomes = ", ".join(f"{r['real_outcome']}{'' if r['exact'] else ' (diverged)'}" for r in group)
        blocks = sorted({r["num_blocks"] for r in group if r["num_blocks"] is not None})
        print(f"{key[0]:8} {key[1]:>3}GiB {key[2]:22} {key[3]:8} {','.join(map(str, blocks)):>7}  {outcomes}")
    exact = sum(r["exact"] for r in rows)
    print(f"model exact against the real pool at every op: {exact}/{len(rows)} runs")
    for r in rows:
        if not r["exact"]:
            print(
                f"  diverged: {r['release']} {r['device_gib']}GiB {r['vmm']} {r['budget']} s{r['seed']}: "
                f"{r['first_difference']}"
            )
    print(f"({time.monotonic() - started:.0f}s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
