"""The probe on MindSpore's real runtime: it never takes the engine's errors.

``mindspore.runtime.memory_stats()`` drains the runtime pipeline and rethrows, and clears, the pending
asynchronous error (memory_py.cc:65, async_rqueue.cc:201-203, ms_exception.h:55-62 @ r2.7.rc1). Called from a
thread of its own, a sampler takes the engine's error and the engine's next sync returns data. The probe reads
MindSpore on the engine's thread at step boundaries instead (kvguard.probe).

Each case runs tests/upstream/mindspore_runtime/engine.py in a process of its own on one MindSpore release (CPU backend,
the same pipeline as Ascend): an engine loop whose steps queue an out-of-range ``ops.gather`` now and then, the
probe started as the docs say (``source="mindspore"``) and the step hooks the vLLM plugin installs. Releases:
those of the compiled-pool oracle (tests/upstream/oracles/mindspore/build.py), set up by
tests/upstream/mindspore_runtime/envs.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest
from mindspore_runtime import envs

from kvguard.spool.io import read_spool

HERE = pathlib.Path(__file__).resolve().parents[1]
ENGINE = HERE / "upstream" / "mindspore_runtime" / "engine.py"
EXPORTER = HERE.parent / "exporter"
BAD_STEPS = (4, 11, 19, 26)
STEPS = 32


def _python(release: str) -> pathlib.Path:
    python = envs.python_for(release)
    if python is None:
        message = (
            f"MindSpore {release}: environment not set up (python3 tests/upstream/mindspore_runtime/envs.py setup)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return python


def _run(release: str, mode: str, hz: float, spool: pathlib.Path, gap: float = 0.06) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(EXPORTER), os.environ.get("PYTHONPATH")])),
        "GLOG_v": "3",
    }
    proc = subprocess.run(
        [
            str(_python(release)),
            str(ENGINE),
            "--mode",
            mode,
            "--hz",
            str(hz),
            "--steps",
            str(STEPS),
            "--bad",
            ",".join(map(str, BAD_STEPS)),
            "--spool",
            str(spool),
            "--gap",
            str(gap),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["mindspore"] == release
    return result


def _bad_outputs(result: dict) -> list[dict]:
    return [seen for seen in result["seen"] if seen["output_of_bad"]]


@pytest.mark.parametrize("hz", [1, 20])
@pytest.mark.parametrize("release", envs.RELEASES)
def test_the_engines_asynchronous_error_surfaces_on_its_own_thread_with_the_probe_running(release, hz, tmp_path):
    result = _run(release, "probe", hz, tmp_path)
    bad = _bad_outputs(result)
    assert [seen["got"] for seen in bad] == ["error"] * len(BAD_STEPS), bad
    assert all("Gather" in seen["error"] for seen in bad), bad
    assert not [seen for seen in result["seen"] if not seen["output_of_bad"] and seen["got"] != "data"]
    # The probe did sample, on the engine's thread: the first reading plus about one per interval.
    assert result["sampling"] == "engine-step"
    assert result["samples"] >= (2 if hz == 1 else 10), result
    snapshots = read_spool(str(tmp_path)).snapshots
    assert len(snapshots) == 1 and snapshots[0].probe.sampling == "engine-step"
    assert snapshots[0].memory.source == "mindspore"


@pytest.mark.parametrize("release", envs.RELEASES)
def test_a_sampler_on_a_thread_of_its_own_takes_the_engines_error(release, tmp_path):
    """The hazard the probe avoids, on the same harness: memory_stats() from another thread at 20 Hz takes the
    pending error, and the engine's sync of the failed gather returns data."""
    result = _run(release, "thread", 20, tmp_path, gap=0.15)  # three of the sampler's ticks per pending error
    bad = _bad_outputs(result)
    assert len(bad) == len(BAD_STEPS)
    assert any(seen["got"] == "data" for seen in bad), bad
    assert result["stolen_by_thread"]
