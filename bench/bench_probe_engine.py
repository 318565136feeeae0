"""What the probe costs the engine it watches, on MindSpore's real runtime (CPU backend: the pipeline of Ascend).

An engine loop as vLLM's worker runs it: per step the probe's step hooks (kvguard.plugin.hooks wraps
``execute_model`` with them), a chain of ops queued on the runtime pipeline, and a sync of the step's output.
Three ways, timed in turn in one run (ABC CBA ABC ...), each for ``--seconds``:
  none       no probe;
  probe      kvguard.probe.start(spool, interval, source="mindspore") and the step hooks: the reads happen on the
             engine's thread at step boundaries (the probe's way since issue 32);
  thread     a thread of its own calling mindspore.runtime.memory_stats() every interval (the way before).
Prints the engine's op rate in each, the ratios to ``none`` (goal for ``probe`` at 1 Hz: within 1 %), and the
probe's cost per reading on the engine's thread (its engine_thread_seconds_total / samples).

    .venv/bin/python bench/bench_probe_engine.py [--hz 1] [--seconds 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import numpy as np


def run(mode: str, hz: float, seconds: float, ops_per_step: int, size: int) -> dict:
    import mindspore as ms

    from kvguard import probe

    x0 = ms.Tensor(np.ones((size, size), np.float32))
    stop = threading.Event()
    spool = tempfile.mkdtemp(prefix="kvguard-bench-")
    if mode == "probe":
        probe.start(spool, interval=1.0 / hz, source="mindspore").run_once()
    elif mode == "thread":

        def sampler() -> None:
            while not stop.wait(1.0 / hz):
                ms.runtime.memory_stats()

        threading.Thread(target=sampler, daemon=True).start()
    ops = steps = 0
    started = time.perf_counter()
    cpu_started = time.process_time()
    while time.perf_counter() - started < seconds:
        probe.step_begin()
        try:
            y = x0
            for _ in range(ops_per_step):
                y = ms.ops.matmul(y, x0) * 1e-3
            y.asnumpy()  # the step's output to the host, as vLLM's sampled tokens
        finally:
            probe.step_end()
        ops += ops_per_step
        steps += 1
    elapsed = time.perf_counter() - started
    stop.set()
    status = probe.current().status if probe.current() is not None else None
    probe.stop()
    return {
        "ops_per_s": ops / elapsed,
        "steps": steps,
        "cpu_s": time.process_time() - cpu_started,
        "samples": status.samples_total if status else 0,
        "engine_seconds": status.engine_thread_seconds_total if status else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hz", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--ops-per-step", type=int, default=20)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--modes", default="none,probe,thread", help="which ways to time, none first")
    args = parser.parse_args()
    import mindspore as ms

    ms.set_device("CPU")
    modes = tuple(args.modes.split(","))
    if modes[0] != "none" or not set(modes) <= {"none", "probe", "thread"}:
        parser.error("--modes: none first, then probe and/or thread")
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    run("none", args.hz, 1.0, args.ops_per_step, args.size)  # warm-up: kernels compiled, pool grown
    for round_index in range(args.rounds):
        # ABBA: every other round runs the ways in reverse, so a drift within a round (a warming cache, the last
        # way's threads winding down) does not favour one way.
        for mode in modes if round_index % 2 == 0 else tuple(reversed(modes)):
            results[mode].append(run(mode, args.hz, args.seconds, args.ops_per_step, args.size))
    base = statistics.median(r["ops_per_s"] for r in results["none"])
    # Each round's rate over the same round's `none`, run just before it: a load that comes and goes on the
    # machine moves both, so the median of these paired ratios is the steadier figure.
    paired = {
        mode: statistics.median(r["ops_per_s"] / n["ops_per_s"] for r, n in zip(results[mode], results["none"]))
        for mode in modes
    }
    print(
        f"MindSpore {ms.__version__}, CPU backend; {args.ops_per_step} matmuls {args.size}x{args.size} and one sync "
        f"per step; sampling at {args.hz:g} Hz; {args.rounds} rounds of {args.seconds:g} s each, interleaved"
    )
    print(f"{'mode':8} {'ops/s (median)':>15} {'ratio of medians':>17} {'median paired ratio':>20}")
    for mode in modes:
        rates = [r["ops_per_s"] for r in results[mode]]
        print(f"{mode:8} {statistics.median(rates):15.1f} {statistics.median(rates) / base:17.4f} {paired[mode]:20.4f}")
    samples = sum(r["samples"] for r in results.get("probe", []))
    seconds = sum(r["engine_seconds"] for r in results.get("probe", []))
    if samples:
        print(
            f"probe: {samples} readings on the engine's thread, {seconds / samples * 1e6:.1f} us each "
            f"(engine_thread_seconds_total / samples_total), {seconds / (args.rounds * args.seconds) * 100:.4f} % "
            f"of the engine's time"
        )


if __name__ == "__main__":
    main()
