"""The sidecar's view of a spool others can write: future dates never hide or keep a rank."""

from __future__ import annotations

import json
import time

from kvguard.poller import Poller
from kvguard.sidecar import Sidecar, SidecarConfig
from kvguard.sources.npu_smi import NpuSmiSource
from sidecar_fixtures import snapshot, write

POD = {"pod": "", "namespace": "", "container": ""}


def test_a_future_dated_duplicate_does_not_hide_the_live_rank(tmp_path):
    live = snapshot(rank=0, pid=10, retries=1)
    forged = snapshot(rank=0, pid=10, retries=99, written_at=time.time() + 86400)
    write(tmp_path, live)
    (tmp_path / "forged.json").write_text(json.dumps(forged.to_dict()))
    observation = Sidecar(SidecarConfig(spool_dir=str(tmp_path), pod_labels=POD)).observe()
    (rank,) = observation.ranks
    assert rank.snapshot.memory.alloc_retries == 1
    assert observation.spool_clamped == 1 and observation.skipped["duplicate"] == 1


def test_a_future_dated_snapshot_goes_stale_like_any_other(tmp_path):
    write(tmp_path, snapshot(written_at=time.time() + 86400))
    sidecar = Sidecar(SidecarConfig(spool_dir=str(tmp_path), pod_labels=POD, stale_after=0.3))
    assert not sidecar.observe().ranks[0].stale
    time.sleep(0.5)
    sidecar.refresh_background(wait=2.0)
    assert sidecar.observe().ranks[0].stale


def test_a_source_always_slower_than_the_limit_still_yields_its_value_with_an_age():
    poller = Poller("slow", lambda: time.sleep(0.3) or "value", timeout=0.1)
    poller.refresh(wait=0.0)
    time.sleep(0.6)
    state = poller.state
    assert state.value == "value" and not state.up
    assert state.errors_total == 1 and "over the 0.1s limit" in state.last_error
    assert state.age_seconds() is not None


def test_a_raising_str_from_a_source_is_one_line_and_no_traceback(capfd):
    class Nasty(Exception):
        def __str__(self):
            raise RuntimeError("no")

    def read():
        raise Nasty()
    poller = Poller("nasty", read, timeout=2.0)
    poller.refresh(wait=2.0)
    assert poller.state.last_error == "Nasty"
    assert "Traceback" not in capfd.readouterr().err


def test_the_npu_smi_poller_waits_as_long_as_npu_smi_itself():
    sidecar = Sidecar(SidecarConfig(sources=[("npu-smi", NpuSmiSource(timeout=10.0))], read_timeout=2.0,
                                    pod_labels=POD))
    (poller,) = sidecar._device_pollers
    assert poller.timeout == 10.0
