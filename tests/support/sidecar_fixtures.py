"""Real-shaped spool snapshots for the collector, server and CLI tests."""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import os
import socket
import ssl
import time

from kvguard.budget.estimator import Profile, stock_kv_cache_bytes
from kvguard.records import DeviceMemory, KVCacheAllocation, ProcessMemory
from kvguard.spool.io import write_snapshot
from kvguard.spool.schema import ProbeStatus, Snapshot

GIB = 1 << 30
EXAMPLES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "exporter", "kvguard", "examples"
)


def example_profile() -> Profile:
    """Qwen2.5-7B on a 64 GiB 910B, measured by the probe (the bundled example profile)."""
    with open(os.path.join(EXAMPLES, "qwen2.5-7b-910b-profile.json")) as handle:
        return Profile.from_dict(json.load(handle))


def snapshot(
    rank: int = 0,
    device: str = "npu:0",
    pid: int = 4242,
    *,
    utilization: float | None = None,
    kv_blocks: int | None = None,
    block_bytes: int = 14 * 1024 * 1024,
    allocated: int | None = None,
    reserved: int | None = None,
    retries: int = 0,
    ooms: int = 0,
    written_at: float | None = None,
    profile: Profile | None | str = "example",
    pod: dict | None = None,
    **overrides,
) -> Snapshot:
    """One rank's snapshot, as the probe writes it: a 64 GiB NPU serving the example profile between steps.
    ``overrides`` replace any other Snapshot field (``sequence``, ``host``, ``model_name``...)."""
    if profile == "example":
        profile = example_profile()
        if utilization is not None:
            profile = Profile(**{**profile.to_dict(), "gpu_memory_utilization": utilization})
    if kv_blocks is None:  # what vLLM allocates: the stock budget in whole blocks
        kv_blocks = stock_kv_cache_bytes(profile or example_profile()) // block_bytes
    shape = profile or example_profile()
    if allocated is None:  # between steps: weights and KV cache; activations freed, their segments cached
        allocated = shape.weights_bytes + kv_blocks * block_bytes
    if reserved is None:
        reserved = allocated + (shape.peak_reserved_increase_bytes or GIB)
    now = time.time() if written_at is None else written_at
    memory = DeviceMemory(
        device=device,
        source="mindspore",
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        peak_allocated_bytes=allocated + shape.peak_allocated_increase_bytes,
        peak_reserved_bytes=reserved,
        inactive_split_bytes=256 * 1024 * 1024,
        alloc_retries=retries,
        ooms=ooms,
        total_bytes=64 * GIB,
        free_bytes=max(0, 63 * GIB - reserved),
        used_bytes=min(64 * GIB, reserved + GIB),
        processes=(ProcessMemory(pid=pid, used_bytes=55 * GIB, name="python3"),),
    )
    return dataclasses.replace(
        Snapshot(
            written_at=now,
            started_at=now - 600,
            sequence=120,
            host="node-7",
            pid=pid,
            device=device,
            memory=memory,
            rank=rank,
            pod={"pod": "vllm-0", "namespace": "llm", "container": "vllm"} if pod is None else pod,
            profile=profile,
            kv_cache=KVCacheAllocation(num_blocks=kv_blocks, block_bytes=block_bytes, block_size=16),
            probe=ProbeStatus(samples_total=120, errors_total=1, interval_seconds=5.0),
        ),
        **overrides,
    )


def write(spool_dir: str, *snapshots: Snapshot) -> None:
    for snap in snapshots:
        write_snapshot(spool_dir, snap)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SERVER_POD = {"pod": "vllm-0", "namespace": "llm", "container": "kvguard"}


def start_server(spool, *snapshots, pod_labels=None, web_config=None, **options):
    """A KVGuardServer on an ephemeral loopback port over a spool holding ``snapshots``."""
    from kvguard.sidecar.core import Sidecar, SidecarConfig
    from kvguard.sidecar.server import KVGuardServer, ServerOptions

    spool.mkdir(exist_ok=True)
    write(spool, *snapshots)
    sidecar = Sidecar(
        SidecarConfig(spool_dir=str(spool), pod_labels=dict(SERVER_POD if pod_labels is None else pod_labels))
    )
    return KVGuardServer(sidecar, ServerOptions(listen="127.0.0.1", port=0, **options), web_config=web_config).start()


def http_get(
    server,
    path: str = "/metrics",
    headers: dict | None = None,
    method: str = "GET",
    context: ssl.SSLContext | None = None,
    timeout: float = 30,
) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh loopback connection to a test server: (status, headers, body)."""
    if context is not None:
        conn = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=timeout, context=context)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def basic(user: str, password: str) -> dict:
    """The Authorization header of HTTP basic auth."""
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
