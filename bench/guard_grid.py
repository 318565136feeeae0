"""The guard over a grid of simulated vLLM runs: does it call every OOM, and how often falsely?

Run on demand:  .venv/bin/python bench/guard_grid.py [--quick] [--jobs N]

For each scenario (model x device x utilization x allocator x budget x seed) the simulator
starts vLLM and serves a seeded request mix; ``kvguard.sim.guarded.run_guarded`` judges it at
the end of startup and after every serving step. Prints, against the baseline of the stock
vLLM budget alone (no guard: every OOM is a surprise):

- serving OOMs: how many the guard called critical at the end of startup, and how many at any
  point before the failing step (must be all);
- runs that never OOM: how many the guard called critical at startup / at any point (the
  false-critical rate, must stay at or under 10%);
- startup failures (the KV cache allocation itself ran out): critical at the budget-time verdict
  (``guard_at_budget``, before the allocation: the only call that comes before such an OOM), and
  at the end of startup (after it).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "exporter"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GIB = 1 << 30
MODELS = {
    "qwen2.5-7b": "exporter/kvguard/examples/qwen2.5-7b-instruct/config.json",
    "llama-3-8b": "tests/data/configs/llama-3-8b-instruct/config.json",
    "mistral-nemo-12b": "tests/data/configs/mistral-nemo-instruct-2407/config.json",
    "deepseek-v2-lite": "tests/data/configs/deepseek-v2-lite-chat/config.json",
}
FULL = dict(
    models=tuple(MODELS),
    devices_gib=(32, 64, 80),
    utilizations=(0.85, 0.9, 0.95, 0.98),
    allocators=("torch", "torch_npu", "mindspore"),
    budgets=("stock", "reserved"),
    seeds=(0, 1),
    requests=32,
)
QUICK = dict(
    models=("qwen2.5-7b", "llama-3-8b", "deepseek-v2-lite"),
    devices_gib=(32, 64),
    utilizations=(0.9, 0.95, 0.98),
    allocators=("torch", "torch_npu", "mindspore"),
    budgets=("stock", "reserved"),
    seeds=(0, 1),
    requests=12,
)


@dataclass(frozen=True)
class Outcome:
    scenario: tuple
    kind: str  # "serving_oom", "startup_oom", "no_oom", "not_started", "diverged" (real_pool.py)
    critical_at_startup: bool
    critical_before_oom: bool
    critical_ever: bool
    critical_at_budget: bool = False
    truth: str = "model"  # "real_pool": a MindSpore run's outcome from the compiled pool (bench/real_pool.py)
    exact: bool | None = None  # real_pool: the model agreed with the real pool at every op


# MindSpore's exact mode (KVGUARD_MINDSPORE_DUMP: the pool's own lists beside its counters) for every run of the
# grid, or the counters alone (the default). Set by --exact-mode before the worker processes fork.
EXACT_MODE = [False]
# The peak burst after every run's requests (ScenarioConfig.peak_burst; the rule:
# bench/results/guard-grids-peak-burst-rule-2026-12-07.md). Set by --peak-burst before the workers fork.
PEAK_BURST = [False]


def run_one(scenario: tuple) -> Outcome:
    from kvguard.guard.judge import CRITICAL
    from kvguard.sim.scenario import ScenarioConfig

    model, device_gib, utilization, allocator, budget, seed, requests = scenario
    with open(os.path.join(ROOT, MODELS[model]), encoding="utf-8") as handle:
        model_config = json.load(handle)
    run, kind, caught, truth = guarded_with_truth(
        ScenarioConfig(
            model_config=model_config,
            device_memory_bytes=device_gib * GIB,
            gpu_memory_utilization=utilization,
            allocator=allocator,
            budget=budget,
            seed=seed,
            requests=requests,
        )
    )
    at_startup = run.startup is not None and run.startup.state == CRITICAL
    return Outcome(
        scenario,
        kind,
        at_startup,
        caught,
        run.critical_ever,
        run.caught_at_budget,
        "real_pool" if truth else "model",
        truth.exact if truth else None,
    )


def guarded_with_truth(config):
    """The guarded run, its outcome kind and whether the guard called it before it happened, with a
    MindSpore run's outcome taken from the real pool where its oracle is built (bench/real_pool.py).
    Returns (GuardedRun, kind, caught_before_oom, Truth or None)."""
    import real_pool

    from kvguard.sim.guarded import run_guarded
    from kvguard.sim.scenario import ServingScenario

    if PEAK_BURST[0]:
        config = dataclasses.replace(config, peak_burst=True)
    run, truth = real_pool.run_with_truth(
        ServingScenario(config), functools.partial(run_guarded, pool_figures=EXACT_MODE[0])
    )
    if truth is None:
        return run, outcome_kind(run.result), run.caught_before_oom, None
    if truth.kind == "serving_oom":
        caught = run.caught_at_budget or (
            run.first_critical_step is not None and run.first_critical_step < truth.oom_at_step
        )
    elif truth.kind == "startup_oom":
        caught = run.caught_at_budget
    else:
        caught = False
    return run, truth.kind, caught, truth


def outcome_kind(result) -> str:
    """not_started (weights do not fit, or no room for one request's blocks), serving_oom, startup_oom
    (the KV cache could not be placed) or no_oom."""
    if result.profile is None or (result.error and not result.oom):
        return "not_started"
    if result.oom:
        return "serving_oom" if result.oom_phase == "serving" else "startup_oom"
    return "no_oom"


def map_runs(run, scenarios: list[tuple], jobs: int) -> list:
    """run(scenario) for every scenario, on jobs processes, saying on stderr how far it got (a grid with
    real-pool truth runs for an hour and more on 2 cores)."""
    started = time.monotonic()
    results = []
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            for result in pool.map(run, scenarios, chunksize=8):
                results.append(result)
                _progress(len(results), len(scenarios), started)
        return results
    for scenario in scenarios:
        results.append(run(scenario))
        _progress(len(results), len(scenarios), started)
    return results


def _progress(done: int, total: int, started: float) -> None:
    if done % 200 == 0 or done == total:
        print(f"  {done}/{total} runs, {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)


def grid(spec: dict) -> list[tuple]:
    return list(
        itertools.product(
            spec["models"],
            spec["devices_gib"],
            spec["utilizations"],
            spec["allocators"],
            spec["budgets"],
            spec["seeds"],
            (spec["requests"],),
        )
    )


def measure(spec: dict, jobs: int = 1) -> dict:
    outcomes = map_runs(run_one, grid(spec), jobs)
    serving = [o for o in outcomes if o.kind == "serving_oom"]
    startup = [o for o in outcomes if o.kind == "startup_oom"]
    clean = [o for o in outcomes if o.kind == "no_oom"]
    return {
        "scenarios": len(outcomes),
        "serving_ooms": len(serving),
        "serving_ooms_critical_at_startup": sum(o.critical_at_startup for o in serving),
        "serving_ooms_critical_before_oom": sum(o.critical_before_oom for o in serving),
        "startup_ooms": len(startup),
        "startup_ooms_critical_at_startup": sum(o.critical_at_startup for o in startup),
        "startup_ooms_critical_at_budget": sum(o.critical_at_budget for o in startup),
        "no_oom": len(clean),
        "no_oom_critical_at_startup": sum(o.critical_at_startup for o in clean),
        "no_oom_critical_ever": sum(o.critical_ever for o in clean),
        "no_oom_critical_at_budget": sum(o.critical_at_budget for o in clean),
        "not_started": sum(o.kind == "not_started" for o in outcomes),
        "missed": [o.scenario for o in serving if not o.critical_before_oom],
        "false_critical": [o.scenario for o in clean if o.critical_ever],
        **truth_figures(outcomes),
    }


def truth_figures(outcomes: list) -> dict:
    """How many runs took their outcome from the real pool, and whether the model agreed at every op."""
    real = [o for o in outcomes if o.truth == "real_pool"]
    return {
        "real_pool_truth": len(real),
        "real_pool_exact": sum(bool(o.exact) for o in real),
        "diverged": [o.scenario for o in outcomes if o.kind == "diverged" or o.exact is False],
    }


def truth_line(figures: dict) -> str:
    return (
        f"outcomes from MindSpore's compiled pool: {figures['real_pool_truth']} runs, the model exact at every "
        f"op in {figures['real_pool_exact']}; diverged: {len(figures['diverged'])}"
    )


def report(figures: dict) -> str:
    def rate(n: int, d: int) -> str:
        return f"{n}/{d} ({100 * n / d:.1f}%)" if d else "0/0"

    lines = [
        f"grid: {figures['scenarios']} scenarios ({figures['not_started']} never started: weights or one request "
        f"do not fit)",
        f"serving OOMs: {figures['serving_ooms']}; baseline without the guard: 0 called",
        f"  critical at the end of startup:      "
        f"{rate(figures['serving_ooms_critical_at_startup'], figures['serving_ooms'])}",
        f"  critical before the OOM (caught):    "
        f"{rate(figures['serving_ooms_critical_before_oom'], figures['serving_ooms'])}",
        f"startup OOMs (KV cache allocation): {figures['startup_ooms']}",
        f"  critical at budget time (before):    "
        f"{rate(figures['startup_ooms_critical_at_budget'], figures['startup_ooms'])}",
        f"  critical at the end of startup:      "
        f"{rate(figures['startup_ooms_critical_at_startup'], figures['startup_ooms'])}",
        f"runs that never OOM: {figures['no_oom']}",
        f"  false critical at startup:           {rate(figures['no_oom_critical_at_startup'], figures['no_oom'])}",
        f"  false critical at budget time:       {rate(figures['no_oom_critical_at_budget'], figures['no_oom'])}",
        f"  false critical at any point:         {rate(figures['no_oom_critical_ever'], figures['no_oom'])}",
        truth_line(figures),
    ]
    return "\n".join(lines)


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every grid script takes for how its runs go (set in the parent, before the workers fork)."""
    parser.add_argument(
        "--exact-mode",
        action="store_true",
        help="judge MindSpore runs with the pool's own lists (KVGUARD_MINDSPORE_DUMP), not the counters alone",
    )
    parser.add_argument(
        "--peak-burst",
        action="store_true",
        help="after each run's requests, the profile batch as requests (ScenarioConfig.peak_burst)",
    )


def apply_run_flags(args: argparse.Namespace) -> None:
    EXACT_MODE[0] = args.exact_mode
    PEAK_BURST[0] = args.peak_burst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smaller grid the test suite runs")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    add_run_flags(parser)
    args = parser.parse_args()
    apply_run_flags(args)
    started = time.monotonic()
    figures = measure(QUICK if args.quick else FULL, args.jobs)
    print(report(figures))
    print(f"({time.monotonic() - started:.0f}s)")


if __name__ == "__main__":
    main()
