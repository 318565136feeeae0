"""An engine loop on MindSpore's real runtime (CPU backend: the same asynchronous pipeline as Ascend, with
errors surfacing at the next sync), watched by kvguard's probe as the vLLM plugin wires it.

Each step is what vLLM's worker does per ``execute_model``: the probe's ``step_begin``, the sync of the previous
step's output (``asnumpy()``, as vLLM copies sampled tokens to the host), a chain of ops queued asynchronously,
and ``step_end``. A step in ``--bad`` queues an out-of-range ``ops.gather`` as its output: the kernel fails
asynchronously and the error is pending until the next sync. Between steps the engine sleeps ``--gap`` seconds
(the scheduler's work), so that a sampler running on another thread meets the pending error.

Modes: ``probe`` (kvguard.probe.start(..., source="mindspore") and the step hooks), ``thread`` (the hazard the
probe avoids: a thread calling ``mindspore.runtime.memory_stats()`` every 1/hz seconds), ``none``.
Prints one JSON line: per step, what the engine's thread saw.

    python engine.py --mode probe --hz 20 --steps 60 --bad 5,17,33 --spool DIR
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("probe", "thread", "none"), required=True)
    parser.add_argument("--hz", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--bad", default="")
    parser.add_argument("--gap", type=float, default=0.06)
    parser.add_argument("--ops", type=int, default=8)
    parser.add_argument("--spool", default="")
    args = parser.parse_args()
    bad_steps = {int(x) for x in args.bad.split(",") if x}

    import mindspore as ms

    from kvguard import probe

    ms.set_device("CPU")
    x0 = ms.Tensor(np.ones((128, 128), np.float32))
    params = ms.Tensor(np.ones((4, 8), np.float32))
    out_of_range = ms.Tensor(np.array([0, 1, 99], np.int32))  # 99: past the 4 rows, fails in the kernel
    x0.asnumpy()

    stop = threading.Event()
    stolen: list[str] = []
    if args.mode == "probe":
        running = probe.start(args.spool, interval=1.0 / args.hz, source="mindspore")
        assert running is not None
        running.run_once()  # the plugin's first reading at init_device, on this thread
    elif args.mode == "thread":

        def sampler() -> None:
            while not stop.wait(1.0 / args.hz):
                try:
                    ms.runtime.memory_stats()
                except Exception as exc:  # noqa: BLE001 - the stolen error, recorded
                    stolen.append(type(exc).__name__)

        threading.Thread(target=sampler, daemon=True).start()

    seen = []
    pending, pending_bad = None, False
    for step in range(args.steps):
        try:
            probe.step_begin()
            try:
                if pending is not None:
                    pending.asnumpy()
                    seen.append({"step": step, "output_of_bad": pending_bad, "got": "data"})
                pending = None
                y = x0
                for _ in range(args.ops):
                    y = ms.ops.matmul(y, x0) * 1e-3
                if step in bad_steps:
                    pending, pending_bad = ms.ops.gather(params, out_of_range, 0), True
                else:
                    pending, pending_bad = y, False
            finally:
                probe.step_end()
        except Exception as exc:  # noqa: BLE001 - what the engine's thread saw
            seen.append(
                {
                    "step": step,
                    "output_of_bad": pending_bad,
                    "got": "error",
                    "error": f"{type(exc).__name__}: "
                    + (str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""),
                }
            )
            pending, pending_bad = None, False
        time.sleep(args.gap)
    if pending is not None:
        try:
            pending.asnumpy()
            seen.append({"step": args.steps, "output_of_bad": pending_bad, "got": "data"})
        except Exception as exc:  # noqa: BLE001
            seen.append({"step": args.steps, "output_of_bad": pending_bad, "got": "error", "error": type(exc).__name__})
    stop.set()
    status = probe.current().status if probe.current() is not None else None
    probe.stop()
    print(
        json.dumps(
            {
                "mindspore": ms.__version__,
                "seen": seen,
                "stolen_by_thread": stolen,
                "samples": status.samples_total if status else 0,
                "sampling": status.sampling if status else None,
                "errors": status.errors_total if status else 0,
                "engine_seconds": status.engine_thread_seconds_total if status else 0.0,
            }
        )
    )


if __name__ == "__main__":
    main()
