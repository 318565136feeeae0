"""MindSpore's dump and the guard's credit, held against MindSpore's compiled pool (tests/upstream/oracles/mindspore).

Two claims, on every release the oracles build (2.7.0-2.10.0), VMM on and off:

1. The file the pool writes is read right. The oracle's ``{"op": "dump"}`` calls the pool's own
   ``DumpDynamicMemPoolDebugInfo`` (abstract_dynamic_mem_pool.cc:1042-1077 @ r2.7.rc1) and answers with the
   pool's member lists (``pool_lists``); ``kvguard.sources.mindspore_dump.read_dump_file`` must give the
   same used bytes, 2 MiB pages touched by used buffers and largest idle buffer of the common pool.
   ``{"op": "defrag"}`` is ``DefragMemory``, the call ``DataPrepareActor`` makes every
   ``defrag_memory_step_freq`` graph runs (data_prepare_actor.cc:1602-1613): it writes a file only when
   that value holds ``dump`` (abstract_dynamic_mem_pool.cc:424-426, 930-937).
2. The guard never judges as fitting a request the real pool refuses. After a fragmented,
   serving-shaped stream (weights, a KV cache, thousands of small live activations between freed ones),
   the guard's growth for a request (``kvguard.guard.judge.activation_growth_bytes``: counters alone, and
   with the dump's exact figures) says it fits when ``reserved + growth <= the pool's budget``; wherever it
   says so, the real pool serves the request.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path

import pytest
from alloc_engines import engine  # noqa: F401  (the fixture the pool model's comparison uses)

from kvguard.allocators import native
from kvguard.allocators.device import Device
from kvguard.allocators.ops import Op, replay_ops
from kvguard.guard.judge import activation_growth_bytes
from kvguard.records import DeviceMemory
from kvguard.sources.mindspore import with_pool_figures
from kvguard.sources.mindspore_dump import DumpReader, merged_alloc_conf, read_dump_file

REPO = Path(__file__).resolve().parents[2]
MIB, GIB = 1 << 20, 1 << 30
_spec = importlib.util.spec_from_file_location(
    "mindspore_oracle_client", REPO / "tests" / "upstream" / "oracles" / "mindspore" / "client.py"
)
oracle_client = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oracle_client)
RELEASES = oracle_client.oracle_build.RELEASES
FREE = 32 * GIB


def server(version: str):
    if os.environ.get("KVGUARD_SKIP_ORACLES") == "1":
        pytest.skip("KVGUARD_SKIP_ORACLES=1: the MindSpore pool oracle is not run")
    if oracle_client.oracle_build.oracle_path(version) is None:
        why = oracle_client.oracle_build.failure(version)
        pytest.fail(
            f"MindSpore {version} pool oracle not built ({why or 'no build'}): run ./dev.sh test", pytrace=False
        )
    return oracle_client.server(version)


def run(version: str, ops: list[dict], *, vmm: bool, cwd: Path, alloc_conf: str = "") -> tuple[dict, list]:
    """The stream on the real pool (compact output): its init record and one entry per op, the dump and
    defrag ops as their JSON records, the others as (oom, reserved, allocated)."""
    env = {
        "KVGUARD_ORACLE_DEVICE_FREE": FREE,
        "KVGUARD_ORACLE_OUTPUT": "compact",
        "KVGUARD_ORACLE_CWD": str(cwd),
        "MS_ALLOC_CONF": ",".join(filter(None, [f"enable_vmm:{'true' if vmm else 'false'}", alloc_conf])),
    }
    lines = server(version).run([json.dumps(op) for op in ops], env)
    out = []
    for line in lines[1:]:
        if line.startswith("{"):
            out.append(json.loads(line))
        else:
            assert not line.startswith("error"), line
            oom, reserved, allocated, _ = map(int, line.split())
            out.append((bool(oom), reserved, allocated))
    return json.loads(lines[0])["init"], out


# ------------------------------------------------------------------------------------ serving-shaped streams
def serving_stream(seed: int, shape: str) -> list[dict]:
    """Weights (persistent), a KV cache of 512 MiB tensors, then activations: ``small``: 3,000 buffers of up
    to 4 MiB, every other one freed (3,000 live between 3,000 idle); ``subpage``: 1.5 MiB idle pieces
    between 0.5 MiB used ones (idle memory no whole page of which is free); ``mixed``: up to 64 MiB, a
    random half freed."""
    rng = random.Random(seed)
    ops: list[dict] = [{"op": "malloc", "size": 64 * MIB, "persistent": True} for _ in range(24)]
    ops += [{"op": "malloc", "size": 512 * MIB, "persistent": False} for _ in range(8)]
    first = len(ops)
    if shape == "small":
        sizes = [rng.randint(4096, 4 * MIB) for _ in range(6000)]
        freed = range(first, first + 6000, 2)
    elif shape == "subpage":
        sizes = [(3 * MIB) // 2 if i % 2 == 0 else MIB // 2 for i in range(2400)]
        freed = range(first, first + 2400, 2)
    else:
        sizes = [rng.randint(4096, 64 * MIB) for _ in range(400)]
        freed = sorted(rng.sample(range(first, first + 400), 200))
    ops += [{"op": "malloc", "size": size, "persistent": False} for size in sizes]
    ops += [{"op": "free", "index": index} for index in freed]
    return ops


def guard_memory(record: dict, figures=None) -> DeviceMemory:
    """The rank's counters as the source reads them at the dump (reserved, allocated), with the exact
    figures when given."""
    memory = DeviceMemory(
        "npu:0",
        "mindspore",
        reserved_bytes=record["reserved_bytes"],
        allocated_bytes=record["allocated_bytes"],
        idle_bytes=0,
    )
    return memory if figures is None else with_pool_figures(memory, figures)


# ------------------------------------------------------------------------------------ 1. the file equals the pool
@pytest.mark.parametrize("vmm", [True, False], ids=["vmm", "no-vmm"])
@pytest.mark.parametrize("version", RELEASES)
def test_the_dump_read_back_equals_the_pools_own_lists(version, vmm, tmp_path):
    ops = serving_stream(1, "mixed") + [{"op": "dump"}]
    _, out = run(version, ops, vmm=vmm, cwd=tmp_path)
    truth = out[-1]["pool_lists"]
    figures = read_dump_file(tmp_path / "MemoryDebugInfo0.txt", vmm=vmm)
    common = [
        a for a in truth["allocators"] if a["persistent"] == 0 and a["stream"] == 0 and "is small : 1" not in a["brief"]
    ]
    assert (figures.used_bytes, figures.pages_touched_by_used, figures.largest_idle_common_bytes, figures.vmm) == (
        truth["used_bytes"],
        truth["pages_touched_by_used"],
        common[0]["largest_idle"],
        vmm,
    )
    assert truth["used_bytes"] == out[-1]["allocated_bytes"]


@pytest.mark.parametrize("version", RELEASES)
def test_defrag_writes_a_dump_only_when_the_alloc_conf_asks_for_it(version, tmp_path):
    ops = serving_stream(2, "mixed")[:100] + [{"op": "defrag"}, {"op": "defrag"}]
    with_dump, without = tmp_path / "with", tmp_path / "without"
    with_dump.mkdir()
    without.mkdir()
    run(version, ops, vmm=True, cwd=with_dump, alloc_conf=merged_alloc_conf("enable_vmm:true"))
    run(version, ops, vmm=True, cwd=without)
    assert sorted(p.name for p in with_dump.iterdir()) == ["MemoryDebugInfo0.txt", "MemoryDebugInfo1.txt"]
    assert list(without.iterdir()) == []


def test_the_reader_takes_the_newest_dump_and_deletes_the_older(tmp_path):
    ops = serving_stream(3, "mixed")[:60] + [{"op": "defrag"}] + serving_stream(3, "mixed")[60:120] + [{"op": "defrag"}]
    _, out = run("2.7.1", ops, vmm=False, cwd=tmp_path, alloc_conf="defrag_memory_step_freq:100dump")
    reader = DumpReader(tmp_path, not_before=0)
    figures = reader.read()
    assert figures.used_bytes == out[-1]["pool_lists"]["used_bytes"] != out[60]["pool_lists"]["used_bytes"]
    assert [p.name for p in tmp_path.iterdir()] == ["MemoryDebugInfo1.txt"]
    assert (reader.files_read, reader.files_deleted, sum(reader.skipped.values())) == (1, 1, 0)


# ------------------------------------------------------------------------------------ 2. never a false "fits"
def request_sizes(record: dict, budget: int, figures) -> list[int]:
    """Requests around every threshold the guard's verdict turns on: the room left in the budget, the
    credits (reserved − allocated, reclaimable, the largest idle buffer) above it."""
    room = budget - record["reserved_bytes"]
    marks = {
        room,
        room + record["reserved_bytes"] - record["allocated_bytes"],
        room + max(0, record["reserved_bytes"] - figures.pages_touched_by_used * 2 * MIB),
        figures.largest_idle_common_bytes,
    }
    sizes = {2 * MIB, 64 * MIB}
    for mark in marks:
        for delta in (-64 * MIB, -4 * MIB, -2 * MIB, 0, 2 * MIB, 64 * MIB):
            if mark + delta > 0:
                sizes.add(mark + delta)
    return sorted(sizes)


@pytest.mark.parametrize("shape", ["small", "subpage", "mixed"])
@pytest.mark.parametrize("vmm", [True, False], ids=["vmm", "no-vmm"])
@pytest.mark.parametrize("version", RELEASES)
def test_the_guard_never_says_a_request_fits_that_the_real_pool_refuses(version, vmm, shape, tmp_path):
    state = serving_stream(11, shape) + [{"op": "dump"}]
    init, out = run(version, state, vmm=vmm, cwd=tmp_path)
    record, budget = out[-1], init["total_mem_size"]
    figures = read_dump_file(tmp_path / "MemoryDebugInfo0.txt", vmm=vmm)
    counters, exact = guard_memory(record), guard_memory(record, figures)
    checked = 0
    for size in request_sizes(record, budget, figures):
        says_fits = {
            name: record["reserved_bytes"] + activation_growth_bytes(memory, size) <= budget
            for name, memory in (("counters", counters), ("exact", exact))
        }
        if not any(says_fits.values()):
            continue
        _, probe = run(
            version, state[:-1] + [{"op": "malloc", "size": size, "persistent": False}], vmm=vmm, cwd=tmp_path
        )
        served = not probe[-1][0]
        assert served, f"{size / MIB:.1f} MiB: the guard says it fits ({says_fits}), the real pool refuses it"
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("vmm", [True, False], ids=["vmm", "no-vmm"])
def test_a_burst_of_small_activations_the_exact_credit_admits_is_served(vmm, tmp_path):
    # The activation peak is many buffers, not one: 3 MiB each, as many as the exact credit admits.
    state = serving_stream(12, "small") + [{"op": "dump"}]
    init, out = run("2.7.1", state, vmm=vmm, cwd=tmp_path)
    record, budget = out[-1], init["total_mem_size"]
    exact = guard_memory(record, read_dump_file(tmp_path / "MemoryDebugInfo0.txt", vmm=vmm))
    count = 1
    while record["reserved_bytes"] + activation_growth_bytes(exact, (count + 1) * 3 * MIB) <= budget:
        count += 1
    burst = [{"op": "malloc", "size": 3 * MIB, "persistent": False} for _ in range(count)]
    _, probe = run("2.7.1", state[:-1] + burst, vmm=vmm, cwd=tmp_path)
    assert not any(entry[0] for entry in probe[-count:]), f"{count} x 3 MiB admitted, the real pool refuses one"


@pytest.mark.parametrize("version", RELEASES)
def test_the_old_credit_reserved_minus_allocated_says_fits_where_the_pool_refuses(version, tmp_path):
    # Why the credit changed (issue 32, item 3): under VMM, idle pieces between used ones hold whole pages
    # of nothing a miss can unmap. Crediting reserved − allocated admits a request the real pool refuses.
    state = serving_stream(11, "subpage") + [{"op": "dump"}]
    init, out = run(version, state, vmm=True, cwd=tmp_path)
    record, budget = out[-1], init["total_mem_size"]
    idle = record["reserved_bytes"] - record["allocated_bytes"]
    size = budget - record["reserved_bytes"] + idle  # the largest request that credit admits
    _, probe = run(version, state[:-1] + [{"op": "malloc", "size": size, "persistent": False}], vmm=True, cwd=tmp_path)
    assert idle >= 1 * GIB and probe[-1][0], "reserved − allocated credited a request the pool served"


@pytest.mark.usefixtures("engine")  # the pool model through native, once per engine (tests/support/alloc_engines.py)
@pytest.mark.parametrize("vmm", [True, False], ids=["vmm", "no-vmm"])
@pytest.mark.parametrize("version", RELEASES)
def test_the_pool_models_exact_figures_equal_the_real_pools_lists(version, vmm, tmp_path):
    # The simulator's exact mode (kvguard.sim.source.record_from_scenario(pool_figures=True)) gives what the
    # dump would: the model's pool_figures() against the real pool after the same stream.
    model = native.mindspore_pool(Device(FREE), version=version, enable_vmm=vmm)
    assert native.engine(model) == os.environ[native.ENV]
    state = serving_stream(5, "small")
    _, out = run(version, state + [{"op": "dump"}], vmm=vmm, cwd=tmp_path)
    ops = [
        Op("malloc", size=op["size"], persistent=op["persistent"])
        if op["op"] == "malloc"
        else Op("free", index=op["index"])
        for op in state
    ]
    for _ in replay_ops(model, ops):
        pass
    truth, figures = out[-1]["pool_lists"], model.pool_figures()
    common = next(a for a in truth["allocators"] if a["persistent"] == 0 and a["stream"] == 0)
    assert (figures.used_bytes, figures.pages_touched_by_used, figures.largest_idle_common_bytes) == (
        truth["used_bytes"],
        truth["pages_touched_by_used"],
        common["largest_idle"],
    )
