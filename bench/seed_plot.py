"""Regenerate docs/sim-seed.png: the seed story, stock vs reserved budget, from the simulator.

Run on demand:  .venv/bin/python bench/seed_plot.py [OUT.png]

Qwen2.5-7B-Instruct on a 32 GiB device, MindSpore's pool under the seed era's launcher
(vllm-mindspore 0.2.0 at PR !428: no MS_ALLOC_CONF, so VMM on as MindSpore defaults on a 910B) with
MindSpore 2.7.0's pool, the oldest release whose compiled pool runs as the oracle (the seed era pinned
2.6.0's, which does not load here), utilization 0.9, long requests, seed 0 — the scenario README.md
describes. Both panels are simulator runs, and bench/seed_story.py checks each against the real pool
op by op. Nothing here is drawn by hand.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "exporter"))

from kvguard.budget.model_config import load_model_config  # noqa: E402
from kvguard.sim.plot import plot_scenario  # noqa: E402
from kvguard.sim.scenario import ScenarioConfig, run_scenario  # noqa: E402

GIB = 1 << 30


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "docs", "sim-seed.png")
    config = ScenarioConfig(
        model_config=load_model_config(os.path.join(ROOT, "exporter", "kvguard", "examples", "qwen2.5-7b-instruct")),
        device_memory_bytes=32 * GIB,
        gpu_memory_utilization=0.9,
        allocator="mindspore",
        long_request_fraction=1.0,
        requests=16,
        seed=0,
        vllm_mindspore_version="0.2.0",
        mindspore_version="2.7.0",
    )
    results = [run_scenario(config, budget=budget) for budget in ("stock", "reserved")]
    for result in results:
        data = result.to_dict()
        print(
            f"{data['budget']:>8}: oom={data['oom']} at step {data['oom_at_step']}, "
            f"{data['num_blocks']} blocks, {data['requests_finished']} requests finished"
        )
    plot_scenario(results, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
