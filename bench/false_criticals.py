"""Were the guard's false criticals wrong, or did the workload just not reach the risk they named?

Run on demand:  .venv/bin/python bench/false_criticals.py FIGURES.json [--grid held_out|tuning] [--fresh]

A false critical (bench/guard_holdout.py) is a run the guard called critical that never ran out of
memory. The guard projects the worst case vLLM itself budgets for: a batch of
``max_num_batched_tokens``, the profile run's own forward, on top of weights and KV cache. The grids'
32 requests seldom schedule such a batch. So each false critical is run again to its end, and then one
profile-size forward is added (``ServingScenario._ops(max_num_batched_tokens, ...)``, what vLLM's
profile run executes), its sampler as a batch of greedy and top-k/top-p requests runs it
(``budget.sampler.PROFILE_SAMPLING``: the profile run's own sampler, and what any mixed batch of the default
sampling mix reaches), and the whole stream is replayed on the allocator that decides it: MindSpore's
compiled pool where its oracle is built (bench/real_pool.py), else the model.

- ``risk real``: that batch runs out of memory. The call named a real risk the workload did not hit.
- ``too strict``: that batch fits; printed with the room left (pool budget or device less the batch's
  reserved peak).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "exporter"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import guard_grid  # noqa: E402
import guard_holdout  # noqa: E402
import real_pool  # noqa: E402

GIB = 1 << 30


def worst_batch(scenario: tuple) -> dict:
    """The run to its end, then one profile-size forward: did it run out, on which allocator, with how
    much room."""
    from kvguard.allocators.base import AllocatorOutOfMemory
    from kvguard.budget.sampler import PROFILE_SAMPLING
    from kvguard.sim.scenario import ScenarioConfig, ServingScenario

    model, gib, util, (_, allocator, overrides), budget, seed = scenario
    path, tp = guard_holdout.MODELS[model]
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        model_config = json.load(handle)
    config = ScenarioConfig(
        model_config=model_config,
        device_memory_bytes=gib * GIB,
        gpu_memory_utilization=util,
        allocator=allocator,
        budget=budget,
        seed=seed,
        requests=guard_holdout.REQUESTS,
        tensor_parallel_size=tp,
        **dict(overrides),
    )
    scenario_run = ServingScenario(config)
    oracle = real_pool.oracle_for(config)
    recording = real_pool.record(scenario_run)
    result = scenario_run.run()
    if result.oom or result.error:
        return {"run": guard_holdout._name(scenario), "verdict": "not a clean run", "truth": "model"}
    served = len(recording.recorder.ops)
    pool = scenario_run.allocator
    tokens = config.max_num_batched_tokens
    try:
        scenario_run._execute(
            scenario_run._ops(tokens, min(config.max_num_seqs, tokens), (), sampling=PROFILE_SAMPLING)
        )
        model_oom = False
    except AllocatorOutOfMemory:
        model_oom = True
    states = recording.recorder.states[served:]
    truth = "model"
    if oracle is not None:
        real = real_pool.replay(oracle, recording, config.enable_vmm)
        if any(r["oom"] for r in real[:served]):
            return {
                "run": guard_holdout._name(scenario),
                "verdict": "the real pool ran out while serving",
                "truth": "real_pool",
            }
        states, truth = real[served:], "real_pool"
    oom = any(state["oom"] for state in states)
    peak = max((state["reserved_bytes"] for state in states), default=0)
    limit = getattr(pool.allocator, "total_mem_size", None) or config.device_memory_bytes
    return {
        "run": guard_holdout._name(scenario),
        "verdict": "risk real" if oom else "too strict",
        "truth": truth,
        "model_agrees": model_oom == oom,
        "batch_tokens": tokens,
        "room_gib": None if oom else round((limit - peak) / GIB, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("figures", help="the JSON bench/guard_holdout.py --json wrote")
    parser.add_argument("--grid", default="held_out", help="held_out (default) or tuning")
    parser.add_argument("--fresh", action="store_true", help="the figures are of the --fresh grid")
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    with open(args.figures, encoding="utf-8") as handle:
        figures = json.load(handle)[args.grid]
    wanted = {line.split(":", 1)[0] for line in figures["false_critical"]}
    scenarios = [s for s in guard_holdout.grid(fresh=args.fresh) if guard_holdout._name(s) in wanted]
    rows = guard_grid.map_runs(worst_batch, scenarios, args.jobs)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
        room = f", {row['room_gib']} GiB left" if row.get("room_gib") is not None else ""
        print(f"  {row['verdict']}: {row['run']} ({row['truth']}{room})")
    print(
        f"{len(rows)} false criticals with a profile-size batch added after serving: "
        + ", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items()))
    )


if __name__ == "__main__":
    main()
