"""Speed of ``kvguard plan --search`` and ``simulate --search-utilization``, and of the allocator models,
against the code at a baseline commit run beside it: ``python3 bench/bench_plan.py``.

The goals (issue 20, deliverable 5): ``plan`` and ``simulate --search-utilization`` answer within 1.5 s of
CPU for a 7B model over three seeds (2.4 s when the issue was filed) and within 2 s for Llama-3.1-70B at
TP 4 on 80 GiB (6.5 s then); the allocator models run at 1M events/s or more (490k then).

Each command is timed as a user runs it: ``python -m kvguard ...`` in a child process, its CPU time (user +
system, interpreter start and imports included), best of ``--repeats``. The baseline is the same command on
the package as it was at ``--baseline`` (``git archive`` of ``exporter/`` into a temporary folder, on
``PYTHONPATH``), run in turn with the current one, so both see the same load. The allocator models are timed
in a child process per tree and repeat, in turn, on ``bench_sim.py``'s 400,000 events (CPU time, best of
``--repeats``), each tree's as its simulator runs them (the C engines where built, ``allocators.native``).

The 70B model is Llama-3.1-70B's architecture, written below from its public config.json's fields.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "db199e2"  # kvguard plan: whether it fits (issue 20), the code the figures were measured on
QWEN_7B = ROOT / "exporter/kvguard/examples/qwen2.5-7b-instruct"
# meta-llama/Llama-3.1-70B-Instruct's config.json, its architecture fields.
LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
SEEDS = ["--seed", "0", "--seed", "1", "--seed", "2"]
GOAL_7B_S, THEN_7B_S = 1.5, 2.4
GOAL_70B_S, THEN_70B_S = 2.0, 6.5
GOAL_EVENTS = 1_000_000


def cases(llama_dir: str) -> list[tuple[str, list[str], float, float]]:
    """(name, kvguard arguments, goal seconds, seconds when the issue was filed)."""
    return [
        (
            "simulate --search-utilization, Qwen2.5-7B, 32 GiB, torch, 3 seeds",
            ["simulate", "--search-utilization", *SEEDS, "--json"],
            GOAL_7B_S,
            THEN_7B_S,
        ),
        (
            "plan --search, Qwen2.5-7B, 910B, vllm-mindspore, 3 seeds",
            [
                "plan",
                "--device",
                "910B",
                "--search",
                *SEEDS,
                "--json",
                "--",
                "vllm-mindspore",
                "serve",
                str(QWEN_7B),
                "--max-model-len",
                "32768",
            ],
            GOAL_7B_S,
            THEN_7B_S,
        ),
        (
            "simulate --search-utilization, Llama-3.1-70B, TP 4, 80 GiB, 3 seeds",
            [
                "simulate",
                "--model-config",
                llama_dir,
                "-tp",
                "4",
                "--total-memory",
                "80GiB",
                "--search-utilization",
                *SEEDS,
                "--json",
            ],
            GOAL_70B_S,
            THEN_70B_S,
        ),
        (
            "plan --search, Llama-3.1-70B, TP 4, H100 80 GiB, 3 seeds",
            [
                "plan",
                "--device",
                "H100",
                "--model-config",
                llama_dir,
                "--search",
                *SEEDS,
                "--json",
                "--",
                "vllm",
                "serve",
                "meta-llama/Llama-3.1-70B-Instruct",
                "--tensor-parallel-size",
                "4",
                "--max-model-len",
                "32768",
            ],
            GOAL_70B_S,
            THEN_70B_S,
        ),
    ]


def child_cpu_seconds(args: list[str], pythonpath: str) -> float:
    """CPU time (user + system) of ``python -m kvguard ARGS`` with the package from ``pythonpath``."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [sys.executable, "-m", "kvguard", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode == 2 and "No such option '--total-memory'" in done.stderr:
        # A tree from before simulate's --device-memory became --total-memory: the same option, its old name.
        return child_cpu_seconds(["--device-memory" if arg == "--total-memory" else arg for arg in args], pythonpath)
    if done.returncode not in (0, 3):
        raise SystemExit(f"kvguard {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def allocator_rates(pythonpath: str, repeats: int) -> dict[str, float]:
    """Events a second of each allocator model, in a child process on the package from ``pythonpath``."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    done = subprocess.run(
        [sys.executable, __file__, "--allocators-worker", str(repeats)],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if done.returncode:
        raise SystemExit(f"allocator worker failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)


def allocators_worker(repeats: int) -> None:
    """The allocator models on bench_sim's events, with the kvguard that PYTHONPATH gives (imported first, so
    bench_sim's own path to this checkout does not replace it)."""
    import kvguard  # noqa: F401 - from PYTHONPATH
    from kvguard.allocators.device import Device

    try:  # the engine the simulator runs (the C engine where built); a tree before it has the models alone
        from kvguard.allocators.native import caching_allocator as CachingAllocator, mindspore_pool as DynamicMemPool
    except ImportError:
        from kvguard.allocators.mindspore_pool import DynamicMemPool
        from kvguard.allocators.torch_alloc import CachingAllocator

    sys.path.insert(0, str(ROOT / "bench"))
    import bench_sim

    events = bench_sim.trace()
    makers = {"torch": CachingAllocator, "mindspore": DynamicMemPool}
    models = {
        name: (lambda make=makers[family], kw=kwargs: make(Device(1 << 40), **kw))
        for name, family, kwargs in bench_sim.CONFIGS
    }
    rates = {
        name: len(events) / min(bench_sim.run_allocator(make(), events) for _ in range(repeats))
        for name, make in models.items()
    }
    recorded = bench_sim.recorded_snapshot(events)
    replayed = len(recorded["device_traces"][0])
    rates["snapshot replay (recorded)"] = replayed / min(bench_sim.time_replay(recorded)[0] for _ in range(repeats))
    print(json.dumps(rates))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE, help="the commit to compare with (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each current command (best of)")
    parser.add_argument(
        "--baseline-repeats",
        type=int,
        default=1,
        help="runs of each baseline command (best of; each takes up to minutes)",
    )
    parser.add_argument("--allocators-worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.allocators_worker:
        allocators_worker(args.allocators_worker)
        return

    current = str(ROOT / "exporter")
    with tempfile.TemporaryDirectory(prefix="kvguard-bench-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.baseline, "exporter"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        baseline = str(Path(tmp) / "exporter")
        llama_dir = Path(tmp) / "llama-3.1-70b"
        llama_dir.mkdir()
        (llama_dir / "config.json").write_text(json.dumps(LLAMA_70B))
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        print(
            f"bench_plan.py {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: working tree on {commit} "
            f"against {args.baseline}; CPU seconds of `python -m kvguard ...` (imports included), best of "
            f"{args.repeats} (baseline: of {args.baseline_repeats}), run in turn"
        )
        print(f"{'command':68} {'baseline':>9} {'now':>7} {'ratio':>7}   goal: seconds / ratio (then / goal)")
        for name, kvguard_args, goal, then in cases(str(llama_dir)):
            now, before = [], []
            for repeat in range(max(args.repeats, args.baseline_repeats)):
                if repeat < args.repeats:
                    now.append(child_cpu_seconds(kvguard_args, current))
                if repeat < args.baseline_repeats:
                    before.append(child_cpu_seconds(kvguard_args, baseline))
            best, base = min(now), min(before)
            # The goal in seconds, and as a ratio (then / goal) against this machine's baseline.
            print(
                f"{name:68} {base:8.2f}s {best:6.2f}s {base / best:6.1f}x   "
                f"<= {goal:.1f} s {'met' if best <= goal else 'NOT met'} / "
                f">= {then / goal:.2f}x {'met' if base / best >= then / goal else 'NOT met'}"
            )
        print()
        print(f"allocator models, bench_sim.py's {400_000:,} events, events/s (CPU time, best of {args.repeats})")
        # One child per tree and repeat, in turn (the load a shared machine adds falls on both alike); best of each.
        rates_now: dict[str, float] = {}
        rates_before: dict[str, float] = {}
        for _ in range(args.repeats):
            for rates, tree in ((rates_now, current), (rates_before, baseline)):
                for name, rate in allocator_rates(tree, 1).items():
                    rates[name] = max(rates.get(name, 0.0), rate)
        print(f"{'model':34} {'baseline':>10} {'now':>10} {'ratio':>7}  goal {GOAL_EVENTS:,}")
        for name, rate in rates_now.items():
            base = rates_before[name]
            print(
                f"{name:34} {base:10,.0f} {rate:10,.0f} {rate / base:6.2f}x  "
                f"{'met' if rate >= GOAL_EVENTS else 'NOT met'}"
            )


if __name__ == "__main__":
    main()
