"""The guard on a held-out grid, fixed by rule before any tuning: does it hold out of sample?

Run on demand:  .venv/bin/python bench/guard_holdout.py [--jobs N] [--json FILE]

The rule (committed before the guard was tuned on anything; disjoint from bench/guard_grid.py's
tuning grid on every axis that grid has):

- models: every model config the repository carries that the tuning grid does not use:
  Qwen3-0.6B, Qwen2.5-7B-Instruct-FP8, Mistral-Small-3.1-24B at TP 1, and Qwen2.5-72B at TP 4
  (one rank of four; it fits no single device here);
- device sizes: 12, 16, 24, 48, 96 GiB (the tuning grid has 32, 64, 80);
- utilizations: 0.8, 0.88, 0.92, 0.96 (tuning: 0.85, 0.9, 0.95, 0.98);
- allocators: PyTorch's caching allocator plain and with expandable segments, torch_npu, and
  MindSpore's pool with VMM off and on. Once the simulator models MindSpore per release
  (``kvguard.allocators.mindspore_releases.RELEASES``, ``ScenarioConfig.mindspore_version``), the pool
  axis becomes every modelled release under its vllm-mindspore launcher's own MS_ALLOC_CONF (VMM as
  that default), and each release with VMM forced off (``ms_alloc_conf="enable_vmm:False"``);
- budgets: stock and reserved (as tuned: the budget is what the guard judges, not a tuning knob);
- seeds: 2, 3 (tuning: 0, 1); 32 requests per run (as the full tuning grid).

A second held-out grid, ``--fresh``, was written down on 2026-12-03 before the guard was changed
for MindSpore's pool budget (the change the first held-out grid's misses prompted, so that grid is
no longer strictly out of sample). It shares no device size, utilization or seed with either grid:
devices 20, 40, 56 GiB; utilizations 0.83, 0.86, 0.94; seeds 4, 5; the same models, allocators,
budgets and request count as the first (no other model configs are in the repository). It is run
once, after the change, and its figures are reported as they come.

A fourth held-out grid, ``--fourth``, was written down on 2026-12-08
(bench/results/guard-split-credit-rule-2026-12-08.md) before the guard's split-credit grading was run
on any grid: devices 14, 18, 36 GiB; utilizations 0.81, 0.84, 0.89, 0.97; seeds 8, 9. It shares no
device size, utilization or seed with the tuning grid, the first and fresh held-out grids or the third
grid (bench/guard_grid3.py); models, allocators, budgets and request count as the first.

Each run is judged as bench/guard_grid.py judges it, plus the budget-time verdict
(``kvguard.sim.guarded.BudgetWatch``). Printed: recall (OOMs called critical before they happen: a
KV-cache placement OOM only by the budget-time verdict, a serving OOM by that, at the end of
startup or at any step before the failing one) and false criticals (runs that never OOM but were
called critical at any point, budget time included), with the missed runs and why.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "exporter"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import guard_grid  # noqa: E402

GIB = 1 << 30
MODELS = {  # name: (config path, tensor-parallel size)
    "qwen3-0.6b": ("tests/data/configs/qwen3-0.6b/config.json", 1),
    "qwen2.5-7b-fp8": ("tests/data/configs/qwen2.5-7b-instruct-fp8/config.json", 1),
    "mistral-small-24b": ("tests/data/configs/mistral-small-3.1-24b-instruct-2503/config.json", 1),
    "qwen2.5-72b-tp4": ("tests/data/configs/qwen2.5-72b-instruct/config.json", 4),
}
DEVICES_GIB = (12, 16, 24, 48, 96)
UTILIZATIONS = (0.8, 0.88, 0.92, 0.96)
BUDGETS = ("stock", "reserved")
SEEDS = (2, 3)
REQUESTS = 32


def allocators() -> list[tuple[str, str, tuple]]:
    """(name, allocator, config overrides) per the rule: MindSpore per release where the simulator has them."""
    axis = [
        ("torch", "torch", ()),
        ("torch+expandable", "torch", (("expandable_segments", True),)),
        ("torch_npu", "torch_npu", ()),
    ]
    from kvguard.allocators.mindspore_releases import RELEASES

    for rel in RELEASES:
        axis.append((f"mindspore-{rel.version}", "mindspore", (("mindspore_version", rel.version),)))
        axis.append(
            (
                f"mindspore-{rel.version}-novmm",
                "mindspore",
                (("mindspore_version", rel.version), ("ms_alloc_conf", "enable_vmm:False")),
            )
        )
    return axis


FRESH_DEVICES_GIB = (20, 40, 56)
FRESH_UTILIZATIONS = (0.83, 0.86, 0.94)
FRESH_SEEDS = (4, 5)
FOURTH_DEVICES_GIB = (14, 18, 36)
FOURTH_UTILIZATIONS = (0.81, 0.84, 0.89, 0.97)
FOURTH_SEEDS = (8, 9)


def grid(fresh: bool = False, fourth: bool = False) -> list[tuple]:
    chosen = FOURTH_AXES if fourth else FRESH_AXES if fresh else FIRST_AXES
    return [
        (model, gib, util, alloc, budget, seed)
        for model, gib, util, alloc, budget, seed in itertools.product(
            MODELS, chosen["devices_gib"], chosen["utilizations"], allocators(), BUDGETS, chosen["seeds"]
        )
    ]


def disjoint_from_tuning() -> dict[str, set]:
    """Axis values the held-out grid shares with the tuning grid (all empty by the rule)."""
    full = guard_grid.FULL
    tuned_paths = set(guard_grid.MODELS.values())
    return {
        "models": {m for m, (path, _) in MODELS.items() if path in tuned_paths},
        "devices_gib": set(DEVICES_GIB) & set(full["devices_gib"]),
        "utilizations": set(UTILIZATIONS) & set(full["utilizations"]),
        "seeds": set(SEEDS) & set(full["seeds"]),
    }


def axes(devices_gib: tuple, utilizations: tuple, seeds: tuple) -> dict[str, tuple]:
    """A grid's device sizes, utilizations and seeds, keyed as guard_grid.FULL keys them."""
    return {"devices_gib": devices_gib, "utilizations": utilizations, "seeds": seeds}


FIRST_AXES = axes(DEVICES_GIB, UTILIZATIONS, SEEDS)
FRESH_AXES = axes(FRESH_DEVICES_GIB, FRESH_UTILIZATIONS, FRESH_SEEDS)
FOURTH_AXES = axes(FOURTH_DEVICES_GIB, FOURTH_UTILIZATIONS, FOURTH_SEEDS)


def shares(grid_axes: dict, *earlier: dict) -> dict[str, set]:
    """Per axis, the values ``grid_axes`` shares with any of the ``earlier`` grids' (all empty for a held-out grid)."""
    return {axis: set(values) & set().union(*(grid[axis] for grid in earlier)) for axis, values in grid_axes.items()}


def fresh_shares() -> dict[str, set]:
    """Axis values the fresh grid shares with the tuning grid or the first held-out grid (all empty)."""
    return shares(FRESH_AXES, guard_grid.FULL, FIRST_AXES)


def fourth_shares() -> dict[str, set]:
    """Axis values the fourth grid shares with any earlier grid (all empty)."""
    import guard_grid3

    return shares(FOURTH_AXES, guard_grid.FULL, FIRST_AXES, FRESH_AXES, guard_grid3.AXES)


@dataclasses.dataclass(frozen=True)
class Outcome:
    scenario: tuple
    kind: str  # "serving_oom", "startup_oom", "no_oom", "not_started", "diverged"
    critical_at_budget: bool
    critical_at_startup: bool
    critical_before_oom: bool
    critical_ever: bool
    reasons: tuple[str, ...] = ()
    truth: str = "model"  # "real_pool": from MindSpore's compiled pool (bench/real_pool.py)
    exact: bool | None = None


def run_one(scenario: tuple) -> Outcome:
    from kvguard.guard.judge import CRITICAL
    from kvguard.sim.scenario import ScenarioConfig

    model, gib, util, (_, allocator, overrides), budget, seed = scenario
    path, tp = MODELS[model]
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        model_config = json.load(handle)
    run, kind, caught, truth = guard_grid.guarded_with_truth(
        ScenarioConfig(
            model_config=model_config,
            device_memory_bytes=gib * GIB,
            gpu_memory_utilization=util,
            allocator=allocator,
            budget=budget,
            seed=seed,
            requests=REQUESTS,
            tensor_parallel_size=tp,
            **dict(overrides),
        )
    )
    reasons = (run.at_budget.reason_codes if run.at_budget else ()) + run.first_critical_reasons
    return Outcome(
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


def measure(scenarios: list[tuple], jobs: int = 1) -> dict:
    return summarize(guard_grid.map_runs(run_one, scenarios, jobs))


def _name(scenario: tuple) -> str:
    model, gib, util, alloc, budget, seed = scenario[:6]
    alloc_name = alloc[0] if isinstance(alloc, tuple) else alloc
    return f"{model} {gib}GiB u{util} {alloc_name} {budget} s{seed}"


def summarize(outcomes: list) -> dict:
    serving = [o for o in outcomes if o.kind == "serving_oom"]
    startup = [o for o in outcomes if o.kind == "startup_oom"]
    clean = [o for o in outcomes if o.kind == "no_oom"]
    ooms = serving + startup
    return {
        "scenarios": len(outcomes),
        "not_started": sum(o.kind == "not_started" for o in outcomes),
        "ooms": len(ooms),
        "ooms_called_before": sum(o.critical_before_oom for o in ooms),
        "serving_ooms": len(serving),
        "serving_ooms_called_before": sum(o.critical_before_oom for o in serving),
        "serving_ooms_called_at_budget": sum(o.critical_at_budget for o in serving),
        "kv_placement_ooms": len(startup),
        "kv_placement_ooms_called_at_budget": sum(o.critical_at_budget for o in startup),
        "no_oom": len(clean),
        "no_oom_critical_ever": sum(o.critical_ever for o in clean),
        "no_oom_critical_at_budget": sum(o.critical_at_budget for o in clean),
        "missed": [_name(o.scenario) for o in ooms if not o.critical_before_oom],
        "false_critical": [
            f"{_name(o.scenario)}: {','.join(dict.fromkeys(o.reasons))}" for o in clean if o.critical_ever
        ],
        **guard_grid.truth_figures(outcomes),
    }


def report(figures: dict, title: str) -> str:
    def rate(n: int, d: int) -> str:
        return f"{n}/{d} ({100 * n / d:.1f}%)" if d else "0/0"

    return "\n".join(
        [
            f"{title}: {figures['scenarios']} runs ({figures['not_started']} never started: weights or one request "
            f"do not fit)",
            f"  recall, OOMs called critical before they happen: "
            f"{rate(figures['ooms_called_before'], figures['ooms'])}",
            f"    KV-placement OOMs, by the budget-time verdict:  "
            f"{rate(figures['kv_placement_ooms_called_at_budget'], figures['kv_placement_ooms'])}",
            f"    serving OOMs, before the failing step:          "
            f"{rate(figures['serving_ooms_called_before'], figures['serving_ooms'])}"
            f" ({figures['serving_ooms_called_at_budget']} already at budget time)",
            f"  false criticals, runs that never OOM:             "
            f"{rate(figures['no_oom_critical_ever'], figures['no_oom'])}"
            f" ({figures['no_oom_critical_at_budget']} at budget time)",
            "  " + guard_grid.truth_line(figures),
        ]
    )


def tuning_outcomes(jobs: int) -> dict:
    """The tuning grid (bench/guard_grid.py FULL) scored the same way, budget time included."""
    return summarize(guard_grid.map_runs(_tuning_one, guard_grid.grid(guard_grid.FULL), jobs))


def _tuning_one(scenario: tuple) -> Outcome:
    model, gib, util, allocator, budget, seed, requests = scenario
    # The tuning grid's pool: VMM off, as it was tuned.
    overrides = (("ms_alloc_conf", "enable_vmm:False"),) if allocator == "mindspore" else ()
    global MODELS
    MODELS = {**MODELS, model: (guard_grid.MODELS[model], 1)}
    return run_one((model, gib, util, (allocator, allocator, overrides), budget, seed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--tuning", action="store_true", help="also score the tuning grid the same way")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--fresh", action="store_true", help="the second held-out grid (module doc), not the first")
    parser.add_argument("--fourth", action="store_true", help="the fourth held-out grid (module doc), not the first")
    guard_grid.add_run_flags(parser)
    args = parser.parse_args()
    guard_grid.apply_run_flags(args)
    started = time.monotonic()
    shared = {
        k: sorted(v)
        for k, v in {
            **disjoint_from_tuning(),
            **(fresh_shares() if args.fresh else {}),
            **(fourth_shares() if args.fourth else {}),
        }.items()
        if v
    }
    if shared:
        sys.exit(f"the held-out grid shares axis values with the tuning grid: {shared}")
    figures = {"held_out": measure(grid(fresh=args.fresh, fourth=args.fourth), args.jobs)}
    title = "fourth held-out grid" if args.fourth else "fresh held-out grid" if args.fresh else "held-out grid"
    print(report(figures["held_out"], title))
    if args.tuning:
        figures["tuning"] = tuning_outcomes(args.jobs)
        print(report(figures["tuning"], "tuning grid"))
    for name, data in figures.items():
        for line in data["missed"]:
            print(f"  missed ({name}): {line}")
    print(f"({time.monotonic() - started:.0f}s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(figures, handle, indent=2)


if __name__ == "__main__":
    main()
