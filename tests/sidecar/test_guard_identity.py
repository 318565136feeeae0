"""/guard names each rank by the same identity labels its series carry on /metrics: device_uuid and
pci_bus_id of its device, model_name and engine of the vLLM engine it serves ("" where unknown)."""

from __future__ import annotations

import dataclasses
import json

from prometheus_client.parser import text_string_to_metric_families
from sidecar_fixtures import http_get, snapshot

IDENTITY = ("device_uuid", "pci_bus_id", "model_name", "engine")


def get(server, path: str) -> bytes:
    status, _, body = http_get(server, path)
    assert status == 200, path
    return body


def with_identity(snap, device_uuid: str, pci_bus_id: str, model_name: str, engine: str):
    memory = dataclasses.replace(snap.memory, device_uuid=device_uuid, pci_bus_id=pci_bus_id)
    return dataclasses.replace(snap, memory=memory, model_name=model_name, engine=engine)


def test_guard_gives_each_rank_the_identity_labels_of_its_series(serve):
    server = serve(
        with_identity(
            snapshot(rank=0, device="cuda:0", pid=10),
            "GPU-8c6b5a0e-2f7c-9d1a-33b2-5e9f0c1d2a3b",
            "00000000:3B:00.0",
            "qwen-7b",
            "0",
        ),
        with_identity(
            snapshot(rank=1, device="cuda:1", pid=11),
            "GPU-1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718",
            "00000000:86:00.0",
            "qwen-7b",
            "1",
        ),
        snapshot(rank=2, device="npu:0", pid=12),
    )  # no identity known: empty, as on its series
    guard = {r["rank"]: r for r in json.loads(get(server, "/guard"))["ranks"]}
    assert {rank: tuple(r[k] for k in IDENTITY) for rank, r in guard.items()} == {
        "0": ("GPU-8c6b5a0e-2f7c-9d1a-33b2-5e9f0c1d2a3b", "00000000:3B:00.0", "qwen-7b", "0"),
        "1": ("GPU-1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718", "00000000:86:00.0", "qwen-7b", "1"),
        "2": ("", "", "", ""),
    }
    # The same values as the rank's series on /metrics.
    (family,) = [
        f
        for f in text_string_to_metric_families(get(server, "/metrics").decode())
        if f.name == "kvguard_guard_severity"
    ]
    series = {s.labels["rank"]: tuple(s.labels[k] for k in IDENTITY) for s in family.samples}
    assert series == {rank: tuple(r[k] for k in IDENTITY) for rank, r in guard.items()}
