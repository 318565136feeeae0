"""End to end: a real Prometheus scrapes kvguard beside a fake dcgm-exporter and a fake npu-exporter
(static expositions with their real metric names and labels, served on loopback), loads
dashboards/rules/kvguard-joins.yaml, and every join has exactly one row per device.

kvguard runs as `kvguard serve` over a spool that the real probe fills from the sim source (two
simulated CUDA ranks, with the sim's stable UUIDs and PCI addresses) and a real npu-smi source that
runs a stand-in `npu-smi` printing a recorded 8 x 910B3 table. The fake exporters answer for the
same devices by UUID (dcgm-exporter) and by PCIe address (npu-exporter), numbered differently from
kvguard's device labels, so only the identity labels can match them. The chart's switch for these
rules is in tests/deploy/test_helm_chart.py, promtool's lint of them in tests/deploy/test_rules_promtool.py.
"""

from __future__ import annotations

import os
import stat

import pytest
from conftest import TESTS
from helpers import LoopbackHTTP, reply
from monitoring import JOINS_FILE
from test_prometheus_e2e import STARTUP_DEADLINE, Stack, kvguard_and_prometheus, poll

from kvguard.probe import Probe
from kvguard.sim.source import SimSource, sim_identity
from kvguard.sources.npu_smi import device_memory_from_npu_smi, parse_npu_smi_info

NPU_FIXTURE = os.path.join(TESTS, "data", "npu-smi", "910b3-24.1.rc1-vllm-tp8.txt")
MIB = 1 << 20

# dcgm-exporter's GPU index for each simulated rank's GPU (not kvguard's cuda:N), and a GPU no rank uses.
DCGM_GPU_OF_RANK = {0: "3", 1: "5"}
IDLE_GPU_UUID = "GPU-0d1e2f30-4152-6374-8596-a7b8c9d0e1f2"


def dcgm_exposition() -> str:
    """DCGM_FI_DEV_FB_USED as dcgm-exporter 4.x renders it (render_metrics.go:47), MiB."""
    lines = ["# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).", "# TYPE DCGM_FI_DEV_FB_USED gauge"]
    rows = [(gpu, *sim_identity("cuda", rank), 30000 + 1000 * rank) for rank, gpu in DCGM_GPU_OF_RANK.items()]
    rows.append(("6", IDLE_GPU_UUID, "00000000:C1:00.0", 0))
    for gpu, uuid, bus, used in rows:
        lines.append(
            f'DCGM_FI_DEV_FB_USED{{gpu="{gpu}",UUID="{uuid}",pci_bus_id="{bus}",device="nvidia{gpu}",'
            f'modelName="NVIDIA H200",hostname="node-7"}} {used}'
        )
    # A MIG instance of GPU 6: its parent's UUID with GPU_I_ID; not a whole GPU.
    lines.append(
        f'DCGM_FI_DEV_FB_USED{{gpu="6",UUID="{IDLE_GPU_UUID}",pci_bus_id="00000000:C1:00.0",device="nvidia6",'
        f'modelName="NVIDIA H200",GPU_I_PROFILE="1g.18gb",GPU_I_ID="9",hostname="node-7"}} 120'
    )
    return "\n".join(lines) + "\n"


def npu_chips():
    with open(NPU_FIXTURE) as handle:
        return device_memory_from_npu_smi(parse_npu_smi_info(handle.read()))


def npu_exporter_exposition() -> str:
    """npu_chip_info_hbm_used_memory as npu-exporter v5 writes it (npu_collector.go), MB; its id is the
    physical chip id, here numbered backwards from npu-smi's NPU ids."""
    lines = [
        "# HELP npu_chip_info_hbm_used_memory the npu hbm used memory",
        "# TYPE npu_chip_info_hbm_used_memory gauge",
    ]
    for index, chip in enumerate(npu_chips()):
        die = f"{0x3A4F2C10 + index:08X}-91B0D7E2-00000000-5C1E7A93-{index:08X}"
        lines.append(
            f'npu_chip_info_hbm_used_memory{{id="{7 - index}",model_name="Ascend910B3",vdie_id="{die}",'
            f'pcie_bus_info="{chip.pci_bus_id}"}} {chip.used_bytes // MIB}'
        )
    return "\n".join(lines) + "\n"


def static_endpoint(text: str) -> LoopbackHTTP:
    """A static /metrics on a loopback port."""
    body = text.encode()
    return LoopbackHTTP(lambda request: reply(request, 200, body, "text/plain; version=0.0.4"))


@pytest.fixture(scope="module")
def joined(tmp_path_factory):
    work = tmp_path_factory.mktemp("joins")
    spool, bin_dir = work / "spool", work / "bin"
    spool.mkdir()
    bin_dir.mkdir()
    fake = bin_dir / "npu-smi"
    fake.write_text(f"#!/bin/sh\nexec cat '{NPU_FIXTURE}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    dcgm, npu = static_endpoint(dcgm_exposition()), static_endpoint(npu_exporter_exposition())
    probe = Probe(str(spool), source=SimSource(ranks=2, allocator="torch"), interval=1.0).start()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    scrape = [
        {"job_name": name, "static_configs": [{"targets": [exposition.target]}]}
        for name, exposition in (("dcgm-exporter", dcgm), ("npu-exporter", npu))
    ]
    try:
        with kvguard_and_prometheus(
            work,
            ["--spool-dir", str(spool), "--source", "npu-smi", "--interval", "1"],
            [JOINS_FILE],
            env=env,
            scrape_configs=scrape,
        ) as stack:
            poll("all three targets up", lambda: len(stack.instant("up == 1")["data"]["result"]) == 3, STARTUP_DEADLINE)
            # Both kvguard ranks and all 8 chips scraped, then a rule evaluation after that.
            poll(
                "kvguard's ranks and chips",
                lambda: (
                    len(stack.instant('kvguard_allocator_reserved_bytes{device_uuid!=""}')["data"]["result"]) == 2
                    and len(stack.instant('kvguard_device_used_bytes{source="npu-smi"}')["data"]["result"]) == 8
                ),
                STARTUP_DEADLINE,
            )
            yield stack
    finally:
        probe.stop()
        dcgm.close()
        npu.close()


def rows(stack: Stack, expr: str, expected: int) -> list[dict]:
    """The query's rows once it has ``expected`` of them (rules need an evaluation after the data)."""
    answer = poll(
        f"{expected} rows of {expr}",
        lambda: (lambda r: r if len(r) == expected else None)(stack.instant(expr)["data"]["result"]),
        STARTUP_DEADLINE,
    )
    return [row["metric"] for row in answer]


def test_each_rank_joins_the_one_gpu_dcgm_exporter_reports_for_its_uuid(joined):
    found = rows(joined, "kvguard:allocator_reserved_bytes:dcgm", 2)
    by_uuid = {row["device_uuid"]: row for row in found}
    for rank, gpu in DCGM_GPU_OF_RANK.items():
        uuid, bus = sim_identity("cuda", rank)
        row = by_uuid[uuid]
        assert (row["device"], row["rank"], row["gpu"], row["modelName"], row["pci_bus_id"]) == (
            f"cuda:{rank}",
            str(rank),
            gpu,
            "NVIDIA H200",
            bus,
        )


def test_each_gpu_with_ranks_has_one_row_of_memory_outside_the_allocators(joined):
    found = rows(joined, "kvguard:gpu_outside_allocator_bytes:dcgm", 2)
    assert sorted(row["device_uuid"] for row in found) == sorted(sim_identity("cuda", r)[0] for r in (0, 1))
    # Whole GPUs only: the idle GPU's MIG row never joins, its whole-GPU row has no ranks.
    assert len(rows(joined, "kvguard:dcgm_fb_used_bytes", 3)) == 3


def test_each_npu_chip_joins_the_one_npu_exporter_chip_at_its_pcie_address(joined):
    found = rows(joined, "kvguard:device_used_bytes:npu_exporter", 8)
    by_device = {row["device"]: row for row in found}
    for index, chip in enumerate(npu_chips()):
        row = by_device[chip.device]
        assert (row["pci_bus_id"], row["id"], row["model_name"]) == (chip.pci_bus_id, str(7 - index), "Ascend910B3")
        assert row["vdie_id"].endswith(f"-{index:08X}")


def documented_joins() -> list[str]:
    """The ad-hoc queries of docs/metrics.md "Joining other exporters", comments dropped."""
    with open(os.path.join(TESTS, "..", "docs", "metrics.md")) as handle:
        text = handle.read()
    section = text[text.index("## Joining other exporters") :]
    block = section[
        section.index("```promql") + len("```promql") : section.index("```", section.index("```promql") + 9)
    ]
    queries = [
        " ".join(line for line in chunk.splitlines() if line.strip() and not line.strip().startswith("#"))
        for chunk in block.strip().split("\n\n")
    ]
    assert len(queries) == 2, queries
    return queries


def test_the_documented_ad_hoc_joins_have_one_row_per_device(joined):
    dcgm_join, npu_join = documented_joins()
    assert sorted(r["device_uuid"] for r in rows(joined, dcgm_join, 2)) == sorted(
        sim_identity("cuda", rank)[0] for rank in (0, 1)
    )
    assert sorted(r["device"] for r in rows(joined, npu_join, 8)) == sorted(c.device for c in npu_chips())
