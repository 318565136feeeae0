"""kvguard's torch_npu allocator model against torch_npu's real NPUCachingAllocator, step by step.

The oracle is the PyPI wheel torch-npu==2.13.0 running on kvguard's CPU torch 2.13.0 under fake
CANN libraries (tests/upstream/oracles/torch_npu/, built by ``./dev.sh test``): every placement rule is
torch_npu's compiled code, only the device is fake. Each case replays seeded random op streams
(kvguard.allocators.ops format) through the real allocator (tests/upstream/oracles/torch_npu/worker.py, a subprocess)
and through ``native.caching_allocator(variant="torch_npu", **parse_alloc_conf(conf))`` once per engine
(the Python model and the C engine, tests/support/alloc_engines.py), and asserts that
reserved, allocated and peak allocated bytes, out-of-memory, the returned address and the
device's used bytes agree after every op. The model takes its segments' base addresses from the
fake device's own rule, so that addresses compare as they are.

Without the oracle built, these tests fail and say how to build it; KVGUARD_SKIP_ORACLES=1 makes
them skips instead. The second half specifies ``parse_alloc_conf`` (no oracle needed).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest
from alloc_engines import engine  # noqa: F401  (the fixture the model comparisons use)
from conftest import ROOT

from kvguard.allocators import native
from kvguard.allocators.device import Device
from kvguard.allocators.ops import Op, replay_ops, write_ops
from kvguard.allocators.torch_alloc import parse_alloc_conf

REPO = ROOT
ORACLE = os.path.join(REPO, "tests", "upstream", "oracles", "torch_npu")
GiB, MiB = 1 << 30, 1 << 20
STEPS = 800

_spec = importlib.util.spec_from_file_location("torch_npu_oracle_build", os.path.join(ORACLE, "build.py"))
oracle_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oracle_build)


# ----------------------------------------------------------------- the op streams
def random_ops(seed: int, steps: int = STEPS) -> list[Op]:
    """57% malloc, 40% free of a random live block, 3% empty_cache. Sizes: 1% 0 bytes, 34% up to
    1 MiB (small pool), 45% log-uniform 1-256 MiB, 20% log-uniform 256 MiB-4 GiB (near a 16 GiB
    device's limit, so out-of-memory and the retry path come up)."""
    rng = random.Random(seed)
    ops: list[Op] = []
    live: list[int] = []
    for _ in range(steps):
        r = rng.random()
        if r < 0.03:
            ops.append(Op("empty_cache"))
        elif r < 0.43 and live:
            ops.append(Op("free", index=live.pop(rng.randrange(len(live)))))
        else:
            k = rng.random()
            if k < 0.01:
                size = 0
            elif k < 0.35:
                size = rng.randint(1, MiB)
            elif k < 0.8:
                size = int(2 ** rng.uniform(20, 28))
            else:
                size = int(2 ** rng.uniform(28, 32))
            live.append(len(ops))
            ops.append(Op("malloc", size=size))
    return ops


# ----------------------------------------------------------------- the cases
@dataclass(frozen=True)
class Case:
    conf: str  # PYTORCH_NPU_ALLOC_CONF, "" for unset
    total: int  # the fake device's bytes
    seeds: tuple[int, ...]
    env: tuple[tuple[str, str], ...] = ()  # more for the fake device (SoC, CANN version)
    model: tuple[tuple[str, object], ...] = ()  # what those mean for the model
    id: str = ""

    @property
    def expandable(self) -> bool:
        return bool(parse_alloc_conf(self.conf, "torch_npu").get("expandable_segments"))


# The fake device reports a CANN and a driver version when asked: CANN 9.1.0 with driver 25.0.RC1
# is at least CANN 8.1.RC1 and driver 25.0.RC1, which page_size:1g needs (IsMallocPage1GMem), and
# CANN 9.1.0 on an Ascend950 SoC drops the 32-byte pad (AddPadSize).
CANN_91 = (("FAKE_CANN_VERSION", "9.1.0"), ("FAKE_DRIVER_VERSION", "25.0.RC1"))
ASCEND950 = (("FAKE_SOC_NAME", "Ascend950PR"),) + CANN_91
NO_PAD = (("add_pad_size", False),)

CASES = [
    Case("", 64 * GiB, (1, 2), id="unset-64g"),
    Case("", 16 * GiB, (1, 2, 3), id="unset-16g"),
    Case("expandable_segments:True", 64 * GiB, (1, 2), id="expandable-64g"),
    Case("expandable_segments:True", 16 * GiB, (1, 2, 3), id="expandable-16g"),
    Case(
        "expandable_segments:True,base_addr_aligned_kb:0,large_segment_size_mb:32",
        16 * GiB,
        (2,),
        id="expandable-align0-large32m",
    ),
    Case(
        "expandable_segments:True,base_addr_aligned_kb:5,segment_size_mb:64",
        16 * GiB,
        (2,),
        id="expandable-align5k-segment64m",
    ),
    Case(
        "large_segment_size_mb:48,max_non_split_rounding_mb:400,max_split_size_mb:100,"
        "roundup_power2_divisions:[2:4,256:8,>:2]",
        16 * GiB,
        (1, 2),
        id="large48m-split100m-nonsplit400m-roundup",
    ),
    Case("garbage_collection_threshold:0.5,per_process_memory_fraction:0.75", 16 * GiB, (1, 2), id="gc-fraction"),
    Case("per_process_memory_fraction:0.5,max_split_size_mb:200", 16 * GiB, (1, 2), id="fraction-split200m"),
    Case("throw_on_npumalloc_oom:True", 16 * GiB, (1, 2), id="throw-on-npumalloc-oom"),
    Case("page_size:1g", 16 * GiB, (1, 2), env=ASCEND950, model=NO_PAD, id="ascend950-1g"),
    Case("expandable_segments:True,page_size:1g", 16 * GiB, (2,), env=CANN_91, id="expandable-1g"),
]


def fake_address_rule(expandable: bool):
    """Where the fake device puts the n-th segment (tests/upstream/oracles/torch_npu/fake_acl.c): aclrtMalloc from
    1 << 40 in 2 MiB steps; aclrtReserveMemAddress from 1 << 44 in 1 GiB steps."""
    cursor = [1 << 44 if expandable else 1 << 40]
    step = GiB if expandable else 2 * MiB

    def base(size: int, small: bool) -> int:
        address = cursor[0]
        cursor[0] += -(-size // step) * step
        return address

    return base


def model_options(case: Case) -> dict:
    return dict(parse_alloc_conf(case.conf, "torch_npu"), **dict(case.model))


def model_steps(case: Case, ops: list[Op], without: str | None = None) -> list[dict]:
    """The model's steps on the engine the ``engine`` fixture chose (KVGUARD_ALLOCATOR_ENGINE, read by ``native``)."""
    kwargs = model_options(case)
    kwargs.pop(without, None)
    allocator = native.caching_allocator(Device(case.total), variant="torch_npu", **kwargs)
    assert native.engine(allocator) == os.environ[native.ENV]
    allocator.segment_address = fake_address_rule(case.expandable)
    steps = []
    for record in replay_ops(allocator, ops):
        record["device_used_bytes"] = allocator.device.allocator_bytes
        steps.append(record)
    return steps


# ----------------------------------------------------------------- running the oracle
def oracle_env() -> dict[str, str] | None:
    """The worker's environment, None when the oracle is not built (a skip with KVGUARD_SKIP_ORACLES=1)."""
    paths = oracle_build.worker_env()
    if paths is None:
        if os.environ.get("KVGUARD_SKIP_ORACLES") == "1":
            pytest.skip("torch_npu oracle not built (KVGUARD_SKIP_ORACLES=1)")
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTORCH_", "FAKE_"))}
    env.update(paths)
    env["TASK_QUEUE_ENABLE"] = "1"  # torch_npu's default, pinned: empty_cache differs without the queue (worker.py)
    return env


def built(runs: dict | None) -> dict:
    if runs is None:  # failed here, in the test, so that it counts as a failure (not a setup error)
        pytest.fail("torch_npu oracle not built: run ./dev.sh test", pytrace=False)
    return runs


def run_real(case: Case, env: dict[str, str], folder: str) -> dict[int, list[dict]]:
    """The real allocator's steps per seed: one worker process for the case's seeds."""
    paths = []
    for seed in case.seeds:
        path = os.path.join(folder, f"{case.id}-{seed}.jsonl")
        with open(path, "w") as handle:
            write_ops(random_ops(seed), handle)
        paths.append(path)
    env = dict(env, FAKE_NPU_TOTAL=str(case.total), **dict(case.env))
    if case.conf:
        env["PYTORCH_NPU_ALLOC_CONF"] = case.conf
    proc = subprocess.run(
        [sys.executable, os.path.join(ORACLE, "worker.py"), *paths],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise AssertionError(f"{case.id}: the oracle worker failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out: dict[int, list[dict]] = {seed: [] for seed in case.seeds}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            out[case.seeds[record["stream"]]].append(record)
    return out


# Confs on the edge of the real parser's rules (c10/core/AllocatorConfig.cpp, NPUAllocatorConfig.cpp):
# whether torch_npu starts with each one is asked of torch_npu itself.
PARSER_CONFS = ("max_split_size_mb:20", "expandable_segments:true", "large_segment_size_mb:64,max_split_size_mb:32")


def real_parser_accepts(conf: str, env: dict[str, str], path: str) -> bool:
    """Whether torch_npu starts and serves one malloc (``path``, an op stream) under ``conf``."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ORACLE, "worker.py"), path],
        env=dict(env, PYTORCH_NPU_ALLOC_CONF=conf),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode == 0


@pytest.fixture(scope="module")
def real_runs():
    """Every case's real steps, and the real parser's verdict on PARSER_CONFS (keyed by the conf),
    two worker processes at a time (importing torch_npu takes seconds)."""
    env = oracle_env()
    if env is None:
        return None
    with tempfile.TemporaryDirectory() as folder, concurrent.futures.ThreadPoolExecutor(2) as pool:
        one_malloc = os.path.join(folder, "one-malloc.jsonl")
        with open(one_malloc, "w") as handle:
            write_ops([Op("malloc", size=1000)], handle)
        futures = {case.id: pool.submit(run_real, case, env, folder) for case in CASES}
        futures.update({conf: pool.submit(real_parser_accepts, conf, env, one_malloc) for conf in PARSER_CONFS})
        return {name: future.result() for name, future in futures.items()}


COMPARED = ("reserved_bytes", "allocated_bytes", "peak_allocated_bytes", "oom", "address", "device_used_bytes")


def first_difference(real: list[dict], model: list[dict]) -> str | None:
    if len(real) != len(model):
        return f"the oracle reported {len(real)} steps for {len(model)} ops"
    for step, (r, m) in enumerate(zip(real, model)):
        for key in COMPARED:
            if r.get(key) != m.get(key):
                return (
                    f"first difference at step {step} ({r['op']}), {key}: real {r.get(key)} model {m.get(key)}; "
                    f"real {json.dumps({k: r.get(k) for k in COMPARED})}"
                )
    return None


# The model comparisons run once per engine (the ``engine`` fixture: the Python model, the C engine).
@pytest.mark.usefixtures("engine")
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_the_model_equals_torch_npu_at_every_step(case, real_runs):
    for seed in case.seeds:
        difference = first_difference(built(real_runs)[case.id][seed], model_steps(case, random_ops(seed)))
        assert difference is None, f"{case.id} seed {seed}: {difference}"


OPTION_CASES = [case for case in CASES if set(model_options(case)) - {"expandable_segments"}]


@pytest.mark.usefixtures("engine")
@pytest.mark.parametrize("case", OPTION_CASES, ids=[case.id for case in OPTION_CASES])
def test_every_option_in_a_case_is_one_the_streams_exercise(case, real_runs):
    """Without any one of its options, the model no longer matches the real allocator: so each
    option the grid claims to check does change what these streams do."""
    for option in set(model_options(case)) - {"expandable_segments"}:
        assert any(
            first_difference(built(real_runs)[case.id][seed], model_steps(case, random_ops(seed), option))
            for seed in case.seeds
        ), f"{case.id}: the model matches without {option}"


def test_the_streams_reach_out_of_memory_and_zero_byte_requests(real_runs):
    """The grid is only a test if the real allocator meets the hard paths: out of memory on the
    16 GiB device, and 0-byte requests (null, nothing allocated)."""
    real = built(real_runs)["unset-16g"]
    assert sum(step["oom"] for steps in real.values() for step in steps if step["op"] == "malloc") > 10
    zero = [
        step
        for seed, steps in real.items()
        for op, step in zip(random_ops(seed), steps)
        if op.kind == "malloc" and op.size == 0
    ]
    assert zero and all(step["address"] == 0 for step in zero)


# ----------------------------------------------------------------- parse_alloc_conf
@pytest.mark.parametrize("conf", PARSER_CONFS)
def test_parse_alloc_conf_accepts_what_torch_npu_accepts(conf, real_runs):
    try:
        parse_alloc_conf(conf, "torch_npu")
    except ValueError:
        accepted = False
    else:
        accepted = True
    assert accepted == built(real_runs)[conf]


def test_an_unset_conf_gives_the_defaults():
    assert parse_alloc_conf("", "torch_npu") == {}


def test_expandable_segments_as_vllm_ascend_sets_it():
    assert parse_alloc_conf("expandable_segments:True", "torch_npu") == {"expandable_segments": True}


def test_sizes_are_read_in_mib():
    assert parse_alloc_conf("max_split_size_mb:200, large_segment_size_mb:64", "torch") == {
        "max_split_size": 200 * MiB,
        "large_segment_size": 64 * MiB,
    }


def test_a_divisions_list_fills_below_its_first_bound_and_after_the_last():
    # Intervals by lower bound: 1, 2, 4, ... 32768 MiB. 2 MiB is interval 1 (and fills interval 0),
    # 256 MiB interval 8; ">" fills 9 onwards; intervals 2-7 are named by nothing and stay 0.
    table = parse_alloc_conf("roundup_power2_divisions:[2:4,256:8,>:2]", "torch_npu")["roundup_power2_divisions"]
    assert table == (4, 4, 0, 0, 0, 0, 0, 0, 8, 2, 2, 2, 2, 2, 2, 2)


def test_a_memory_fraction_below_one_caps_the_allocator():
    assert parse_alloc_conf("per_process_memory_fraction:0.5", "torch_npu") == {"memory_fraction": 0.5}
    assert parse_alloc_conf("per_process_memory_fraction:1.0", "torch_npu") == {}


def test_keys_that_place_nothing_are_checked_and_dropped():
    assert parse_alloc_conf("pinned_use_background_threads:True,multi_stream_lazy_reclaim:False", "torch_npu") == {}
    with pytest.raises(ValueError, match="multi_stream_lazy_reclaim"):
        parse_alloc_conf("multi_stream_lazy_reclaim:yes", "torch_npu")


@pytest.mark.parametrize(
    "text, key",
    [
        ("bogus:1", "bogus"),
        ("page_size:2m", "page_size"),
        ("base_addr_aligned_kb:17", "base_addr_aligned_kb"),
        ("segment_size_mb:10", "segment_size_mb"),
        ("max_split_size_mb:10", "max_split_size_mb"),
        ("large_segment_size_mb:10", "large_segment_size_mb"),
        ("garbage_collection_threshold:1.0", "garbage_collection_threshold"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions"),
        ("expandable_segments:true", "expandable_segments"),
        ("max_split_size_mb", "max_split_size_mb"),
        ("expandable_segments:True,max_split_size_mb:200", "max_split_size_mb"),
    ],
)
def test_a_bad_npu_conf_is_a_one_line_error_naming_the_key(text, key):
    with pytest.raises(ValueError, match=key) as raised:
        parse_alloc_conf(text, "torch_npu")
    assert "\n" not in str(raised.value)


def test_each_variant_accepts_only_its_own_parser_s_keys():
    with pytest.raises(ValueError, match="base_addr_aligned_kb"):
        parse_alloc_conf("base_addr_aligned_kb:0", "torch")
    with pytest.raises(ValueError, match="graph_capture_record_stream_reuse"):
        parse_alloc_conf("graph_capture_record_stream_reuse:True", "torch_npu")
    assert parse_alloc_conf("graph_capture_record_stream_reuse:True", "torch") == {}


def test_a_backend_the_model_does_not_follow_is_refused_not_ignored():
    with pytest.raises(ValueError, match="cudaMallocAsync"):
        parse_alloc_conf("backend:cudaMallocAsync", "torch")
    assert parse_alloc_conf("backend:native", "torch") == {}
