"""Were the third grid's all-greedy false criticals wrong, or did the clients' sampling only spare them?

Run on demand:  .venv/bin/python bench/greedy_twins.py FIGURES.json [--jobs N]

FIGURES.json is what ``bench/guard_grid3.py --exact-mode --peak-burst --json`` wrote. For each false critical of
the all-greedy sampling mix, its twin (the same run with every request top-k/top-p) is run the same way and
reported: a serving OOM there means the guard named the risk of the requests vLLM serves by default. vLLM's
``--generation-config`` is ``"auto"`` (vllm/config/model.py 0.11.0:237), so a request that sets no sampling
parameters takes the model's generation config (``get_diff_sampling_param``, :1344-1352; logged as "Using default
chat sampling params from model", vllm/entrypoints/openai/serving_chat.py 0.11.0:139). Qwen's generation configs
sample with top-k and top-p: vLLM 0.10.1.1 printed Qwen2-7B-Instruct's as top-k 20, top-p 0.8 in the log r65 comes
from (dennislee22/vLLM-benchmarking log/vllm-7B-1gpuA10080GB-0.25GRAM.log, after r65's excerpt ends). Only a client
that asks for greedy sampling gets vLLM's greedy fast path (``all_greedy``, vllm/v1/sample/sampler.py 0.11.0:159).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "exporter"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import guard_grid  # noqa: E402
import guard_grid3  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("figures", help="the JSON bench/guard_grid3.py --exact-mode --peak-burst --json wrote")
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    guard_grid.EXACT_MODE[0] = guard_grid.PEAK_BURST[0] = True
    with open(args.figures, encoding="utf-8") as handle:
        figures = json.load(handle)
    greedy = [line.split(": ")[0] for line in figures["false_critical"] if line.split(": ")[0].endswith(" greedy")]
    by_name = {guard_grid3.name(scenario): scenario for scenario in guard_grid3.grid()}
    twins = [by_name[name][:-1] + ("top_k_top_p",) for name in greedy]
    outcomes = guard_grid.map_runs(guard_grid3.run_one, twins, args.jobs)
    counts: collections.Counter = collections.Counter()
    for name, outcome in zip(greedy, outcomes):
        called = " (called before it)" if outcome.critical_before_oom else ""
        counts[(outcome.kind, bool(outcome.critical_before_oom))] += 1
        print(f"  {name}: its top-k/top-p twin {outcome.kind}{called}")
    print(
        f"{len(greedy)} all-greedy false criticals of {len(figures['false_critical'])}; their top-k/top-p twins: "
        + ", ".join(f"{n} {kind}{' called before' if called else ''}" for (kind, called), n in sorted(counts.items()))
    )


if __name__ == "__main__":
    main()
