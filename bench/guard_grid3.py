"""The guard on a third held-out grid: MindSpore's pool with VMM, serving shapes that fragment it, and the
requests' sampling mix. Written down on 2026-12-07 (~01:25 UTC, main at 1268825) before any tuning for it,
and never tuned on: its figures are reported as they come.

Run on demand:  .venv/bin/python bench/guard_grid3.py [--jobs N] [--json FILE]

The rule (issue 32, "a third written down before this work"):

- models: Qwen3-0.6B, Qwen2.5-7B-Instruct (the bundled config) and DeepSeek-V2-Lite-Chat (MLA, MoE), TP 1;
- device sizes: 28 and 44 GiB, utilizations 0.82, 0.87, 0.91, 0.93 (no grid before shares one: tuning
  32/64/80 GiB at 0.85-0.98, the held-out 12-96 GiB at 0.8-0.96, the fresh 20/40/56 GiB at 0.83-0.94);
- allocators: MindSpore's pool with VMM (its launcher's MS_ALLOC_CONF) at 2.7.1, 2.8.0 and 2.10.0, whose
  compiled pools give every outcome (bench/real_pool.py); 2.7.1 with VMM off; PyTorch's caching allocator
  (whose profile run samples with top-k/top-p, so the sampling axis reaches the projection there too);
- serving shapes that fragment the pool: half the requests long (prompts of max_model_len/2 or more,
  chunked-prefilled, each later chunk gathering its KV into fresh buffers on MindSpore), 48 requests, and
  max_num_batched_tokens 2048 (many chunks, many gather sizes) or 8192;
- sampling mixes: every request greedy; every request top-k and top-p; half and half
  (``ScenarioConfig.sampling_mix``);
- budgets: stock and reserved; seed 6 (no grid before uses it).

3 x 2 x 4 x 5 x 2 x 3 x 2 = 1,440 runs. Scored as bench/guard_holdout.py scores its grids: recall (OOMs
called critical before they happen) and false criticals (runs that never run out, called critical at any
point, budget time included), goals 100% and at most 5%.
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

import guard_grid  # noqa: E402
import guard_holdout  # noqa: E402

GIB = 1 << 30
MODELS = {  # name: config path
    "qwen3-0.6b": "tests/data/configs/qwen3-0.6b/config.json",
    "qwen2.5-7b": "exporter/kvguard/examples/qwen2.5-7b-instruct/config.json",
    "deepseek-v2-lite": "tests/data/configs/deepseek-v2-lite-chat/config.json",
}
DEVICES_GIB = (28, 44)
UTILIZATIONS = (0.82, 0.87, 0.91, 0.93)
ALLOCATORS = {  # name: (allocator, config overrides)
    "mindspore-2.7.1": ("mindspore", (("mindspore_version", "2.7.1"),)),
    "mindspore-2.8.0": ("mindspore", (("mindspore_version", "2.8.0"),)),
    "mindspore-2.10.0": ("mindspore", (("mindspore_version", "2.10.0"),)),
    "mindspore-2.7.1-novmm": ("mindspore", (("mindspore_version", "2.7.1"), ("ms_alloc_conf", "enable_vmm:False"))),
    "torch": ("torch", ()),
}
SHAPES = {  # name: (long_request_fraction, max_num_batched_tokens, requests)
    "long-chunked-2k": (0.5, 2048, 48),
    "long-chunked-8k": (0.5, 8192, 48),
}
SAMPLING_MIXES = {
    "greedy": (("greedy", 1.0),),
    "top_k_top_p": (("top_k_top_p", 1.0),),
    "half": (("greedy", 0.5), ("top_k_top_p", 0.5)),
}
BUDGETS = ("stock", "reserved")
SEEDS = (6,)
AXES = guard_holdout.axes(DEVICES_GIB, UTILIZATIONS, SEEDS)


def grid() -> list[tuple]:
    return list(
        itertools.product(MODELS, DEVICES_GIB, UTILIZATIONS, ALLOCATORS, BUDGETS, SEEDS, SHAPES, SAMPLING_MIXES)
    )


def shares_with_earlier_grids() -> dict[str, set]:
    """Axis values this grid shares with the tuning and both held-out grids (all empty by the rule)."""
    return guard_holdout.shares(AXES, guard_grid.FULL, guard_holdout.FIRST_AXES, guard_holdout.FRESH_AXES)


def run_one(scenario: tuple) -> guard_holdout.Outcome:
    from kvguard.guard.judge import CRITICAL
    from kvguard.sim.scenario import ScenarioConfig

    model, gib, util, alloc_name, budget, seed, shape, mix = scenario
    allocator, overrides = ALLOCATORS[alloc_name]
    long_fraction, batched_tokens, requests = SHAPES[shape]
    with open(os.path.join(ROOT, MODELS[model]), encoding="utf-8") as handle:
        model_config = json.load(handle)
    run, kind, caught, truth = guard_grid.guarded_with_truth(
        ScenarioConfig(
            model_config=model_config,
            device_memory_bytes=gib * GIB,
            gpu_memory_utilization=util,
            allocator=allocator,
            budget=budget,
            seed=seed,
            requests=requests,
            long_request_fraction=long_fraction,
            max_num_batched_tokens=batched_tokens,
            sampling_mix=SAMPLING_MIXES[mix],
            **dict(overrides),
        )
    )
    reasons = (run.at_budget.reason_codes if run.at_budget else ()) + run.first_critical_reasons
    return guard_holdout.Outcome(
        scenario,
        kind,
        run.caught_at_budget,
        run.startup is not None and run.startup.state == CRITICAL,
        caught,
        run.critical_ever,
        reasons,
        "real_pool" if truth else "model",
        truth.exact if truth else None,
    )


def name(scenario: tuple) -> str:
    model, gib, util, alloc_name, budget, seed, shape, mix = scenario
    return f"{model} {gib}GiB u{util} {alloc_name} {budget} s{seed} {shape} {mix}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    guard_grid.add_run_flags(parser)
    args = parser.parse_args()
    guard_grid.apply_run_flags(args)
    shared = {k: sorted(v) for k, v in shares_with_earlier_grids().items() if v}
    if shared:
        sys.exit(f"the third grid shares axis values with an earlier grid: {shared}")
    started = time.monotonic()
    outcomes = guard_grid.map_runs(run_one, grid(), args.jobs)
    figures = guard_holdout.summarize(outcomes)
    # summarize() names runs by the held-out grids' six axes; this grid's names carry its shape and mix too.
    clean = [o for o in outcomes if o.kind == "no_oom"]
    ooms = [o for o in outcomes if o.kind in ("serving_oom", "startup_oom")]
    figures["missed"] = [name(o.scenario) for o in ooms if not o.critical_before_oom]
    figures["false_critical"] = [
        f"{name(o.scenario)}: {','.join(dict.fromkeys(o.reasons))}" for o in clean if o.critical_ever
    ]
    print(guard_holdout.report(figures, "third grid (VMM-fragmented MindSpore serving, sampling mixes)"))
    for line in figures["missed"]:
        print(f"  missed: {line}")
    for line in figures["false_critical"]:
        print(f"  false critical: {line}")
    print(f"({time.monotonic() - started:.0f}s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(figures, handle, indent=2)


if __name__ == "__main__":
    main()
