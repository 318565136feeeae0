"""The C engine (``torch_native.NativeCachingAllocator``) against the Python model it implements
(``torch_alloc.CachingAllocator``), op by op.

Seeded random op streams run on both, each on its own device, over every constructor option the
engine takes, on devices small enough that out-of-memory, both retry paths, garbage collection and
expandable segments' unmapping happen. After every op: the returned address or the error (class and
message), every statistic (the model's stat arrays, counters and window peaks, cell by cell), the
device's bytes and peak, and the engine's own invariants (``_check``). Every few ops and at the end:
``memory_stats()``, the free lists, the segments and their layout; and ``steady_state_key()`` must
tell the same states apart as the model's does. tests/upstream/test_oracle_torch_npu.py runs the engine
against torch_npu's compiled allocator.
"""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest

from kvguard.allocators.base import AllocatorOutOfMemory, record_steady, replay_steady
from kvguard.allocators.device import Device
from kvguard.allocators.torch_alloc import STAT_ARRAYS, CachingAllocator, parse_alloc_conf
from kvguard.allocators.torch_native import NativeCachingAllocator, unsupported

pytestmark = pytest.mark.skipif(unsupported() is not None, reason=str(unsupported()))

MIB, GIB = 1 << 20, 1 << 30
OPS = 700
SEEDS = (1, 2)
FULL_EVERY = 25  # ops between memory_stats() / layout comparisons


def fake_segment_address():
    """A segment_address callback like the torch_npu oracle's fake device: aclrtMalloc from 1 << 40
    in 2 MiB steps, expandable reservations from 1 << 44 in 1 GiB steps."""
    cursors = {False: 1 << 40, True: 1 << 44}

    def base(size: int, small: bool) -> int | None:
        expandable = size > 8 * GIB  # an expandable reservation (1 1/8 x the device)
        step = GIB if expandable else 2 * MIB
        address = cursors[expandable]
        cursors[expandable] += -(-size // step) * step
        return address

    return base


# (id, device bytes, variant, alloc conf, constructor options besides the conf, set_memory_fraction)
CONFIGS = [
    ("torch", 256 * MIB, "torch", "", {}, None),
    ("torch-split32m", 256 * MIB, "torch", "max_split_size_mb:32", {}, None),
    (
        "torch-large24m-split32m-nonsplit60m",
        256 * MIB,
        "torch",
        "large_segment_size_mb:24,max_split_size_mb:32,max_non_split_rounding_mb:60",
        {},
        None,
    ),
    ("torch-roundup4", 256 * MIB, "torch", "roundup_power2_divisions:4", {}, None),
    ("torch-roundup-table", 256 * MIB, "torch", "roundup_power2_divisions:[1:2,4:8,16:1,>:4]", {}, None),
    ("torch-gc-fraction", 256 * MIB, "torch", "garbage_collection_threshold:0.5", {}, 0.75),
    ("torch-fraction-split32m", 256 * MIB, "torch", "max_split_size_mb:32", {}, 0.5),
    ("torch-expandable", 256 * MIB, "torch", "expandable_segments:True", {}, None),
    ("torch-expandable-split32m", 256 * MIB, "torch", "expandable_segments:True,max_split_size_mb:32", {}, None),
    (
        "torch-expandable-gc-fraction",
        256 * MIB,
        "torch",
        "expandable_segments:True,garbage_collection_threshold:0.6",
        {},
        0.8,
    ),
    ("npu", 256 * MIB, "torch_npu", "", {}, None),
    ("npu-split32m", 256 * MIB, "torch_npu", "max_split_size_mb:32", {}, None),
    ("npu-no-pad-1g", 3 * GIB, "torch_npu", "page_size:1g", {"add_pad_size": False}, None),
    ("npu-expandable", 256 * MIB, "torch_npu", "expandable_segments:True", {}, None),
    (
        "npu-expandable-align5k-segment64m",
        512 * MIB,
        "torch_npu",
        "expandable_segments:True,base_addr_aligned_kb:5,segment_size_mb:64",
        {},
        None,
    ),
    (
        "npu-expandable-align0-large32m",
        256 * MIB,
        "torch_npu",
        "expandable_segments:True,base_addr_aligned_kb:0,large_segment_size_mb:32",
        {},
        None,
    ),
    ("npu-expandable-1g", 3 * GIB, "torch_npu", "expandable_segments:True,page_size:1g", {}, None),
    (
        "npu-fraction-gc",
        256 * MIB,
        "torch_npu",
        "per_process_memory_fraction:0.75,garbage_collection_threshold:0.5",
        {},
        None,
    ),
    ("npu-throw-on-oom", 256 * MIB, "torch_npu", "throw_on_npumalloc_oom:True", {}, None),
    (
        "npu-throw-on-oom-fraction",
        256 * MIB,
        "torch_npu",
        "throw_on_npumalloc_oom:True,per_process_memory_fraction:0.5",
        {},
        None,
    ),
]
IDS = [config[0] for config in CONFIGS]


def build(cls, device_bytes: int, variant: str, conf: str, options: dict, fraction: float | None):
    allocator = cls(Device(device_bytes, 16 * MIB), variant=variant, **dict(parse_alloc_conf(conf, variant), **options))
    if fraction is not None:
        allocator.set_memory_fraction(fraction)
    return allocator


def request_size(rng: random.Random, device_bytes: int) -> int:
    """Mostly sizes on the rules' boundaries or anywhere between them; now and then 0, a negative
    size, one past the device, or one past 64 bits."""
    kind = rng.random()
    if kind < 0.02:
        return 0
    if kind < 0.03:
        return rng.choice((-1, -511, -(1 << 40)))
    if kind < 0.04:
        return rng.choice((device_bytes + 1, (1 << 64) - 511, (1 << 64) + 3, 1 << 80))
    if kind < 0.1:
        return rng.choice(
            (
                1,
                480,
                481,
                512,
                513,
                MIB - 32,
                MIB,
                MIB + 1,
                2 * MIB,
                10 * MIB - 1,
                10 * MIB,
                20 * MIB,
                32 * MIB,
                52 * MIB,
                100 * MIB,
            )
        )
    whole = rng.random() < 0.5
    if kind < 0.5:
        return rng.randint(1, 8) * (MIB // 8) if whole else rng.randint(1, MIB)
    if kind < 0.82:
        return rng.randint(1, 9) * MIB if whole else rng.randint(MIB + 1, 10 * MIB - 1)
    return rng.randint(10, 72) * MIB if whole else rng.randint(10 * MIB, 72 * MIB)


def op_stream(seed: int, device_bytes: int) -> list[tuple]:
    """Phases of 100 ops alternate growing (into out-of-memory) and draining (so that growth reuses
    split and merged blocks). Frees undo a random live malloc, by its op index."""
    rng = random.Random(seed)
    ops: list[tuple] = []
    live: list[int] = []
    for index in range(OPS):
        free_share = 0.4 if index // 100 % 2 == 0 else 0.7
        roll = rng.random()
        if roll < 0.025:
            ops.append(("empty_cache",))
        elif roll < 0.035:
            ops.append(("reset_peak_memory_stats",))
        elif roll < 0.05:
            ops.append(("take_window_peaks",))
        elif roll < 0.055:
            ops.append(("grow", 8 * MIB))
        elif roll < 0.06:
            ops.append(("free_unknown", rng.choice((1 << 40, 12345, -1, 1 << 70))))
        elif live and roll < 0.06 + free_share:
            ops.append(("free", live.pop(rng.randrange(len(live)))))
        else:
            stream = rng.choice((0,) * 12 + (1, -3))
            ops.append(("malloc", request_size(rng, device_bytes), stream))
            live.append(index)
    return ops


def outcome(call) -> tuple:
    try:
        return ("ok", call())
    except AllocatorOutOfMemory as error:
        return ("oom", str(error), error.requested_bytes, error.free_bytes, error.allocator)
    except Exception as error:  # noqa: BLE001 - the class and message are what is compared
        return (type(error).__name__, str(error))


def apply(allocator, op: tuple, addresses: dict[int, int], index: int) -> tuple:
    kind = op[0]
    if kind == "malloc":
        result = outcome(lambda: allocator.malloc(op[1], stream=op[2]) if op[2] else allocator.malloc(op[1]))
        if result[0] == "ok":
            addresses[index] = result[1]
        return result
    if kind == "free":
        if op[1] not in addresses:  # its malloc ran out of memory
            return ("skipped",)
        return outcome(lambda: allocator.free(addresses.pop(op[1])))
    if kind == "free_unknown":
        return outcome(lambda: allocator.free(op[1]))
    if kind == "grow":
        return ("ok", allocator.device.grow_non_allocator(op[1]))
    return outcome(getattr(allocator, kind))


def python_cells(model: CachingAllocator) -> list[int]:
    """The model's statistics in the engine's cell order (torch_native / _ctorch.c)."""
    cells = [value for name in STAT_ARRAYS for stat in model._stats[name] for value in stat]
    cells += model._oversize_allocations + model._oversize_segments
    cells += [
        model.num_alloc_retries,
        model.num_ooms,
        model.num_sync_all_streams,
        model.num_device_alloc,
        model.num_device_free,
        model._window_alloc,
        model._window_reserved,
    ]
    return cells


def device_state(allocator) -> tuple:
    device = allocator.device
    return device.allocator_bytes, device.non_allocator_bytes, device.peak_used_bytes, device.free_bytes


def layout(allocator) -> tuple:
    return (
        allocator.free_block_sizes(True),
        allocator.free_block_sizes(False),
        allocator.segments(),
        allocator.segment_layout(),
        allocator.snapshot_segments(),
    )


def same_partition(keys_a: list, keys_b: list) -> bool:
    """Whether two key sequences tell the same positions apart (a[i] == a[j] exactly when b[i] == b[j])."""

    def classes(keys: list) -> list:
        seen: dict = {}
        return [None if key is None else seen.setdefault(key, len(seen)) for key in keys]

    return classes(keys_a) == classes(keys_b)


def run_both(config: tuple, seed: int, setup=None) -> tuple[CachingAllocator, NativeCachingAllocator, list]:
    _, device_bytes, variant, conf, options, fraction = config
    model = build(CachingAllocator, device_bytes, variant, conf, options, fraction)
    native = build(NativeCachingAllocator, device_bytes, variant, conf, options, fraction)
    if setup is not None:
        setup(model)
        setup(native)
    model_addresses: dict[int, int] = {}
    native_addresses: dict[int, int] = {}
    model_keys, native_keys, results = [], [], []
    for index, op in enumerate(op_stream(seed, device_bytes)):
        expected = apply(model, op, model_addresses, index)
        got = apply(native, op, native_addresses, index)
        assert got == expected, f"op {index} {op}"
        assert list(native._stat_cells()) == python_cells(model), f"statistics after op {index} {op}"
        assert device_state(native) == device_state(model), f"device after op {index} {op}"
        native._check()
        model_keys.append(model.steady_state_key())
        native_keys.append(native.steady_state_key())
        if index % FULL_EVERY == 0:
            assert native.memory_stats() == model.memory_stats(), f"memory_stats after op {index}"
            assert layout(native) == layout(model), f"layout after op {index}"
        results.append(expected)
    assert native.memory_stats() == model.memory_stats()
    assert layout(native) == layout(model)
    assert same_partition(model_keys, native_keys)
    return model, native, results


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_the_engine_equals_the_model_after_every_op(config, seed):
    model, native, results = run_both(config, seed)
    stats = model.memory_stats()
    # The streams must reach what they are meant to compare.
    assert stats["num_ooms"] > 0 or model.throw_on_npumalloc_oom
    assert stats["num_alloc_retries"] > 0 or model.throw_on_npumalloc_oom
    assert any(r[0] == "KeyError" for r in results) and any(r[0] == "oom" for r in results)
    assert stats["allocation.small_pool.allocated"] > 0 and stats["allocation.large_pool.allocated"] > 0
    assert stats["inactive_split.all.allocated"] > 0 or model.expandable_segments
    assert stats["num_device_free"] > 0


def model_run(config: tuple, seed: int, without: str | None = None) -> list:
    """The model alone on a config's stream: (result, statistics) per op, optionally without one option."""
    _, device_bytes, variant, conf, options, fraction = config
    kwargs = dict(parse_alloc_conf(conf, variant), **options)
    kwargs.pop(without, None)
    model = CachingAllocator(Device(device_bytes, 16 * MIB), variant=variant, **kwargs)
    if fraction is not None and without != "set_memory_fraction":
        model.set_memory_fraction(fraction)
    addresses: dict[int, int] = {}
    return [
        (apply(model, op, addresses, index), python_cells(model))
        for index, op in enumerate(op_stream(seed, device_bytes))
    ]


# Options that change nothing in their config, as the model has it: garbage collection never
# releases expandable blocks (_garbage_collect_cached_blocks), and below a memory fraction of 1 the
# allowed-maximum check refuses a segment before throw_on_npumalloc_oom would (_alloc_block).
NO_EFFECT = {
    ("torch-expandable-gc-fraction", "garbage_collection_threshold"),
    ("npu-throw-on-oom-fraction", "throw_on_npumalloc_oom"),
}
OPTION_CASES = [
    (config, option)
    for config in CONFIGS
    for option in [
        *set(parse_alloc_conf(config[3], config[2])) - {"expandable_segments"},
        *config[4],
        *(["set_memory_fraction"] if config[5] is not None else []),
    ]
    if (config[0], option) not in NO_EFFECT
]


@pytest.mark.parametrize("config, option", OPTION_CASES, ids=[f"{c[0]}-without-{o}" for c, o in OPTION_CASES])
def test_every_option_in_the_grid_changes_what_its_stream_does(config, option):
    """Without any one of its options a config's stream runs differently: so the comparison above
    covers each option's rule (garbage collection, the oversize release, throw_on_npumalloc_oom...)."""
    assert any(model_run(config, seed) != model_run(config, seed, without=option) for seed in SEEDS)


def test_trace_replay_callbacks_are_followed():
    """segment_address places segments (the oracle test's fake device rule), on_map sees every mapping."""
    maps: dict[str, list] = {"model": [], "native": []}

    def setup(allocator):
        allocator.segment_address = fake_segment_address()
        key = "native" if isinstance(allocator, NativeCachingAllocator) else "model"
        allocator.on_map = lambda addr, size: maps[key].append((addr, size))

    model, native, _ = run_both(("expandable", 256 * MIB, "torch", "expandable_segments:True", {}, None), 3, setup)
    assert maps["native"] == maps["model"] and maps["model"]
    assert native.steady_state_key() is None and model.steady_state_key() is None


def test_a_smaller_address_space_total_sizes_expandable_reservations():
    def setup(allocator):
        allocator.address_space_total = 64 * MIB

    model, native, _ = run_both(("expandable", 256 * MIB, "torch", "expandable_segments:True", {}, None), 4, setup)
    assert native.expandable_reservation(False) == model.expandable_reservation(False) == (20 * MIB, 80 * MIB)


# ----------------------------------------------------------------- bad input
ODD_SIZES = [
    -5,
    -(1 << 63),
    0,
    True,
    (1 << 63) - 1,
    1 << 63,
    (1 << 64) - 1,
    (1 << 64) - 511,
    1 << 64,
    1 << 100,
    1000.0,
    1e30,
    float("nan"),
    "x",
    "",
    None,
    [1],
    b"\x01",
]


@pytest.mark.parametrize(
    "variant, conf",
    [
        ("torch", ""),
        ("torch_npu", ""),
        ("torch", "roundup_power2_divisions:4"),
        ("torch", "expandable_segments:True,max_split_size_mb:32"),
    ],
)
@pytest.mark.parametrize("size", ODD_SIZES, ids=repr)
def test_an_odd_size_does_what_the_model_does(variant, conf, size):
    model, native = (
        build(cls, 256 * MIB, variant, conf, {}, None) for cls in (CachingAllocator, NativeCachingAllocator)
    )
    for allocator in (model, native):  # something cached, so that a release path has work
        allocator.free(allocator.malloc(3 * MIB))
        allocator.free(allocator.malloc(40 * MIB))
    expected = outcome(lambda: model.malloc(size))
    assert outcome(lambda: native.malloc(size)) == expected
    assert list(native._stat_cells()) == python_cells(model)
    assert layout(native) == layout(model)
    if expected[0] == "ok" and expected[1]:
        model.free(expected[1])
        native.free(expected[1])
        assert list(native._stat_cells()) == python_cells(model)
    native._check()


@pytest.mark.parametrize("size", [100.0, 0.5, (1 << 9) - 33.0], ids=repr)
def test_a_float_size_the_model_would_store_is_refused(size):
    """The model rounds a small float up to 512 bytes and keeps the float as ``requested`` (its
    statistics become floats); the engine refuses it."""
    model = CachingAllocator(Device(GIB))
    assert isinstance(model.malloc(size), int)
    native = NativeCachingAllocator(Device(GIB))
    with pytest.raises(TypeError, match="malloc size must be an int, not float"):
        native.malloc(size)
    assert native.allocated_bytes == 0 and native.device.allocator_bytes == 0


def test_a_request_past_64_bits_on_another_stream_is_out_of_memory():
    """The model packs (stream, size, address) into one int, so a size of 2**64 or more spills into
    the stream's bits: on stream 1 it is then served from a cached 20 MiB block. The engine keeps
    the three apart and runs out of memory, as it does (and the model does) on stream 0."""
    native = NativeCachingAllocator(Device(16 * GIB))
    native.free(native.malloc(5 * MIB, stream=1))
    for stream in (0, 1):
        with pytest.raises(AllocatorOutOfMemory, match=f"allocating {1 << 64} bytes"):
            native.malloc(1 << 64, stream=stream)
    assert native.allocated_bytes == 0


def test_a_negative_size_below_int64_is_refused():
    native = NativeCachingAllocator(Device(GIB))
    with pytest.raises(OverflowError):
        native.malloc(-(1 << 64))
    assert native.allocated_bytes == 0


def test_requested_bytes_past_int64_are_counted_as_in_the_model():
    """Negative requests down to -2**63, three times over and freed: the statistics (128-bit cells)
    leave the int64 range exactly as the model's Python ints do."""
    model, native = CachingAllocator(Device(GIB)), NativeCachingAllocator(Device(GIB))
    for allocator in (model, native):
        addresses = [allocator.malloc(-(1 << 63)) for _ in range(3)]
        for addr in addresses:
            allocator.free(addr)
    assert list(native._stat_cells()) == python_cells(model)
    assert native.memory_stats() == model.memory_stats()
    assert native.memory_stats()["requested_bytes.all.freed"] == -3 << 63
    native._check()


def test_freed_totals_past_int64_are_counted_as_in_the_model():
    """A device the engine takes (under 2**62 bytes): nine frees of 2**60 bytes take the freed totals
    past 2**63, where int64 cells wrapped negative."""
    model, native = CachingAllocator(Device(1 << 61)), NativeCachingAllocator(Device(1 << 61))
    for allocator in (model, native):
        for _ in range(9):
            allocator.free(allocator.malloc(1 << 60))
        allocator.empty_cache()
    assert list(native._stat_cells()) == python_cells(model)
    assert native.memory_stats() == model.memory_stats()
    assert native.memory_stats()["allocated_bytes.all.freed"] == 9 << 60


def test_a_device_that_grows_past_the_engine_s_limit_still_counts_exactly():
    """A device whose capacity is raised after construction grants segments of 2**62 bytes and more:
    reserved and allocated bytes go past 2**63 as in the model, not wrapped."""
    model, native = CachingAllocator(Device(GIB)), NativeCachingAllocator(Device(GIB))
    for allocator in (model, native):
        allocator.device.capacity_bytes = 1 << 70
        for size in (1 << 62, 1 << 62, (1 << 62) - (1 << 41)):
            allocator.free(allocator.malloc(size))
            allocator.malloc(size)
    assert list(native._stat_cells()) == python_cells(model)
    assert native.memory_stats() == model.memory_stats()
    assert native.reserved_bytes == model.reserved_bytes == 3 * (1 << 62) - (1 << 41)
    native._check()


def test_cells_written_from_python_take_ints_past_int64_within_a_bound():
    """base.record_steady / replay_steady write cells: any int within +-2**100 is kept exactly,
    beyond that an OverflowError (never a wrap)."""
    native = NativeCachingAllocator(Device(GIB))
    cells = native._stat_cells()
    for value in (1 << 63, -(1 << 63) - 5, (1 << 100) - 1, -(1 << 100)):
        cells[0] = value
        assert cells[0] == value
        native.num_ooms = value
        assert native.num_ooms == value
    for value in (1 << 100, -(1 << 100) - 1, 1 << 200):
        with pytest.raises(OverflowError):
            cells[0] = value
        with pytest.raises(OverflowError):
            native.num_ooms = value
    with pytest.raises(TypeError):
        cells[0] = 1.0


@pytest.mark.parametrize("stream", ["a", None, 1.0, 1 << 70])
def test_a_stream_that_is_not_an_int64_is_refused(stream):
    native = NativeCachingAllocator(Device(GIB))
    with pytest.raises((TypeError, OverflowError)):
        native.malloc(4096, stream=stream)
    assert native.allocated_bytes == 0 and native.segments() == []


ODD_ADDRESSES = [0, None, "", 0.0, False, 12345, -1, 1 << 70, 2.0**40, float(1 << 40) + 0.5, "x", (1 << 40,), [1]]


@pytest.mark.parametrize("variant", ["torch", "torch_npu"])
@pytest.mark.parametrize("addr", ODD_ADDRESSES, ids=repr)
def test_freeing_an_odd_address_does_what_the_model_does(variant, addr):
    model, native = CachingAllocator(Device(GIB), variant=variant), NativeCachingAllocator(Device(GIB), variant=variant)
    assert model.malloc(4096) == native.malloc(4096) == 1 << 40
    assert outcome(lambda: native.free(addr)) == outcome(lambda: model.free(addr))
    assert list(native._stat_cells()) == python_cells(model)
    native._check()


def test_freeing_twice_is_a_key_error_as_in_the_model():
    model, native = CachingAllocator(Device(GIB)), NativeCachingAllocator(Device(GIB))
    for allocator in (model, native):
        allocator.free(allocator.malloc(4096))
    assert outcome(lambda: native.free(1 << 40)) == outcome(lambda: model.free(1 << 40)) == ("KeyError", str(1 << 40))


def test_a_constructor_option_the_model_refuses_is_refused_with_its_message():
    for kwargs in (
        {"variant": "cuda"},
        {"max_split_size": 10 * MIB},
        {"add_pad_size": False},
        {"garbage_collection_threshold": 1.5},
        {"variant": "torch_npu", "segment_size": MIB},
    ):
        expected = outcome(lambda: CachingAllocator(Device(GIB), **kwargs))
        assert expected[0] == "ValueError"
        assert outcome(lambda: NativeCachingAllocator(Device(GIB), **kwargs)) == expected
        assert unsupported(**kwargs) is None


def test_what_the_engine_does_not_take_is_named_and_refused():
    assert unsupported(device=Device(1 << 40), max_split_size=64 * MIB) is None
    reason = unsupported(device=Device(1 << 62))
    assert reason and "2**62" in reason
    with pytest.raises(NotImplementedError, match="2\\*\\*62"):
        NativeCachingAllocator(Device(1 << 62))
    assert unsupported(max_split_size=1 << 64)
    with pytest.raises(NotImplementedError, match="max_split_size"):
        NativeCachingAllocator(Device(GIB), max_split_size=1 << 64)
    native = NativeCachingAllocator(Device(GIB))
    for call in (
        lambda: native.seed_segment(1 << 40, 2 * MIB, True, []),
        lambda: native.seed_segments([]),
        lambda: native.release_segment_at(1 << 40),
        lambda: native.unmap_range(1 << 40, 2 * MIB),
        lambda: native.seed_expandable_segment(1 << 40, 2 * MIB, True, [], []),
    ):
        with pytest.raises(NotImplementedError, match="Python model"):
            call()


def test_a_segment_past_the_64_bit_address_space_is_an_error_not_a_wrap():
    native = NativeCachingAllocator(Device(GIB))
    native._next_addr = (1 << 64) - MIB
    with pytest.raises(OverflowError, match="64-bit address space"):
        native.malloc(4096)
    native._check()


def test_a_call_from_inside_a_call_is_refused():
    native = NativeCachingAllocator(Device(GIB), expandable_segments=True)
    errors = []

    def on_map(addr: int, size: int) -> None:
        try:
            native.malloc(4096)
        except RuntimeError as error:
            errors.append(str(error))

    native.on_map = on_map
    native.malloc(4096)
    assert errors and "inside one of its own calls" in errors[0]
    native._check()


def test_a_key_whose_eq_frees_the_block_it_is_compared_with_cannot_free_it_twice():
    """free(key) with a non-int key compares it with the allocated addresses: its __eq__ runs while
    the engine is busy, so a free from inside it is refused (it freed the block twice, corrupting the
    free lists: later calls looped forever)."""
    native = NativeCachingAllocator(Device(GIB))
    addr, kept = native.malloc(4096), native.malloc(4096)

    class Key:
        def __hash__(self) -> int:
            return hash(addr)

        def __eq__(self, other: object) -> bool:
            native.free(addr)
            return True

    with pytest.raises(RuntimeError, match="inside one of its own calls"):
        native.free(Key())
    native._check()
    assert native.memory_stats()["allocation.all.current"] == 2
    native.free(addr)
    native.free(kept)
    native._check()
    assert native.allocated_bytes == 0


def test_a_key_with_a_hash_no_int_address_has_is_not_found():
    """A dict of int addresses holds hashes below 2**61 - 1 only: a key hashing above it is a KeyError
    in the model even when it compares equal to an address."""
    model, native = CachingAllocator(Device(GIB)), NativeCachingAllocator(Device(GIB))
    for allocator in (model, native):
        allocator._next_addr = 1 << 62  # hash(1 << 62) == 2
    addr = model.malloc(4096)
    assert native.malloc(4096) == addr

    class Key:
        def __hash__(self) -> int:
            return (1 << 61) + 1  # 2 + the modulus

        def __eq__(self, other: object) -> bool:
            return other == addr

    key = Key()
    assert outcome(lambda: native.free(key)) == outcome(lambda: model.free(key)) == ("KeyError", str(key))
    assert native.allocated_bytes == model.allocated_bytes == 4096


def test_segment_address_may_move_the_next_address_before_returning_none():
    """The model reads _next_addr after the segment_address callback; so does the engine."""
    results = []
    for cls in (CachingAllocator, NativeCachingAllocator):
        allocator = cls(Device(GIB))

        def base(size: int, small: bool, allocator=allocator) -> None:
            allocator._next_addr += 1 << 30
            return None

        allocator.segment_address = base
        results.append(
            ([allocator.malloc(size) for size in (4096, 3 * MIB, 50 * MIB)], allocator.segments(), allocator._next_addr)
        )
    assert results[0] == results[1]
    assert results[0][0][0] == (1 << 40) + (1 << 30)


def test_an_expandable_reservation_past_64_bits_is_an_error_not_a_wrap():
    """1 1/8 x a device capacity raised near 2**64 after construction: the engine's reservation
    wrapped to a small one; now the new segment is refused, nothing taken from the device."""
    native = NativeCachingAllocator(Device(GIB), expandable_segments=True)
    native.device.capacity_bytes = (1 << 64) - GIB
    with pytest.raises(OverflowError, match="64-bit address space"):
        native.malloc(4096)
    native._check()
    assert native.segments() == [] and native.device.allocator_bytes == 0


def test_a_granted_request_past_64_bits_is_an_error_and_the_segment_stays_cached():
    """A request of 2**64 bytes or more is kept as 2**64 - 1; a device grown after construction may
    grant that (a segment at address 0): the engine refuses to count it as allocated."""
    native = NativeCachingAllocator(Device(GIB))
    native.device.capacity_bytes = 1 << 80
    native._next_addr = 0
    with pytest.raises(OverflowError, match="2\\*\\*64 bytes or more"):
        native.malloc(1 << 64)
    native._check()
    assert native.allocated_bytes == 0 and native.segments() == [(0, (1 << 64) - 1, False)]
    native.empty_cache()
    assert native.segments() == [] and native.device.allocator_bytes == 0


def test_the_engine_s_own_constructor_refuses_ints_it_would_wrap():
    """Engine(...) (what NativeCachingAllocator passes the model's settings to) and _set_fraction take
    unsigned 64-bit ints; PyArg's "K" wrapped -1 to 2**64 - 1."""
    from kvguard.allocators._ctorch import Engine

    args = [
        Device(GIB),
        "torch",
        lambda size: 0,
        0,
        False,
        0,
        20 * MIB,
        20 * MIB,
        False,
        20 * MIB,
        (1 << 64) - 1,
        False,
        (0,) * 16,
        0.0,
        False,
        GIB,
    ]
    for index in (3, 5, 6, 7, 9, 10, 15):
        for bad in (-1, 1 << 64):
            wrong = list(args)
            wrong[index] = bad
            with pytest.raises(OverflowError):
                Engine(*wrong)
    engine = Engine(*args)
    with pytest.raises(OverflowError):
        engine._set_fraction(-1, True)
    assert engine.allowed_memory_maximum == 0 and not engine.set_fraction


def test_the_engine_is_initialised_once_even_from_inside_its_constructor():
    """The divisions table is iterated (Python code) before the settings are stored: an __init__ from
    there makes the outer one fail, not overwrite (and leak) what the inner one stored."""
    from kvguard.allocators._ctorch import Engine

    engine = Engine.__new__(Engine)

    def args(name: str, divisions) -> list:
        return [
            Device(GIB),
            name,
            lambda size: 0,
            0,
            False,
            0,
            20 * MIB,
            20 * MIB,
            False,
            20 * MIB,
            (1 << 64) - 1,
            False,
            divisions,
            0.0,
            False,
            GIB,
        ]

    class Divisions:
        def __iter__(self):
            Engine.__init__(engine, *args("inner", (0,) * 16))
            return iter((0,) * 16)

    with pytest.raises(RuntimeError, match="initialised once"):
        Engine.__init__(engine, *args("outer", Divisions()))
    assert engine.name == "inner"


@pytest.mark.parametrize("call", ["segments", "_engine_ranges"])
def test_introspection_survives_a_finalizer_that_releases_segments_under_it(call):
    """Building the answer's tuples can start a garbage collection whose finalizers free blocks and
    release segments: the engine copies what it reports first (segments() read freed segments, a
    use after free, and returned a mix of the states before and after)."""
    native = NativeCachingAllocator(Device(8 * GIB))
    # Called as native.segments(), with no bound method made (whose allocation could collect first).
    answer = {"segments": lambda: native.segments(), "_engine_ranges": lambda: native._engine_ranges()}[call]
    live = [native.malloc(3 * MIB) for _ in range(200)]
    before = answer()
    fired = []

    class Finalizer:
        def __del__(self) -> None:
            if not fired:
                fired.append(True)
                for addr in live:
                    native.free(addr)
                native.empty_cache()
                for _ in range(50):
                    native.malloc(5 * MIB)

    def arm() -> None:
        finalizer = Finalizer()
        finalizer.cycle = finalizer  # only a collection frees it

    thresholds = gc.get_threshold()
    gc.collect()
    arm()
    gc.set_threshold(6)  # a collection a few tuples into the answer
    try:
        got = answer()
    finally:
        gc.set_threshold(*thresholds)
    assert fired
    assert got in (before, answer())
    native._check()


def test_steady_state_key_survives_a_device_that_allocates_while_it_is_read():
    """steady_state_key reads the device's attributes (Python code) after the segments: a new segment
    made from there cleared the cached segment key the engine was about to use (SystemError)."""
    capacity = Device.capacity_bytes

    class Sneaky(Device):
        __slots__ = ("allocator", "armed")

        @property
        def capacity_bytes(self) -> int:
            if getattr(self, "armed", False):
                self.armed = False
                self.allocator.malloc(50 * MIB)
            return capacity.__get__(self)

        @capacity_bytes.setter
        def capacity_bytes(self, value: int) -> None:
            capacity.__set__(self, value)

    keys = {}
    for cls in (CachingAllocator, NativeCachingAllocator):
        device = Sneaky(GIB)
        allocator = device.allocator = cls(device)
        allocator.malloc(4096)
        before = allocator.steady_state_key()
        device.armed = True
        during = allocator.steady_state_key()
        keys[cls] = (during is not None, during == before, during == allocator.steady_state_key())
    assert keys[NativeCachingAllocator] == keys[CachingAllocator] == (True, True, False)


# ----------------------------------------------------------------- what callers rely on
def test_malloc_and_free_are_the_engine_s_c_methods():
    native = NativeCachingAllocator(Device(GIB))
    assert type(native.malloc).__name__ == type(native.free).__name__ == "builtin_function_or_method"


def test_malloc_and_free_can_be_wrapped_on_the_instance():
    """sim/guarded.py wraps malloc and free on the instance and later pops the wrappers."""
    native = NativeCachingAllocator(Device(GIB))
    calls = []
    original = native.malloc
    native.malloc = lambda *args, **kwargs: calls.append(args) or original(*args, **kwargs)
    assert "malloc" in vars(native)
    native.free(native.malloc(4096))
    native.__dict__.pop("malloc")
    native.malloc(4096)
    assert calls == [(4096,)]


def test_steady_forwards_record_and_replay_as_on_the_model():
    """base.record_steady / replay_steady see the same cells in the same order on both."""
    model, native = CachingAllocator(Device(GIB)), NativeCachingAllocator(Device(GIB))
    sizes = [3 * MIB, 4096, 40 * MIB, 700 * 1024, 12 * MIB]

    def forward(allocator):
        addresses = [allocator.malloc(size) for size in sizes]
        for addr in reversed(addresses):
            allocator.free(addr)

    for allocator in (model, native):
        forward(allocator)  # warm: the cache now holds what a forward needs
        allocator.reset_peak_memory_stats()
        allocator.take_window_peaks()
    assert [len(cells) for cells in native.steady_cells()] == [len(cells) for cells in model.steady_cells()]
    key = native.steady_state_key()
    recorded = record_steady(native, lambda: forward(native))
    assert recorded == record_steady(model, lambda: forward(model))
    assert native.steady_state_key() == key
    replay_steady(native, recorded, times=5)
    replay_steady(model, recorded, times=5)
    assert native.memory_stats() == model.memory_stats()
    assert native.take_window_peaks() == model.take_window_peaks()
    assert device_state(native) == device_state(model)


def test_steady_state_key_tells_apart_states_that_differ_only_in_unmapped_pages():
    """Two expandable states with the same free lists, segments and device bytes: one keeps its
    first and third 20 MiB blocks with the second's pages unmapped, the other its first two."""
    keys = {}
    for cls in (CachingAllocator, NativeCachingAllocator):
        states = []
        for freed in (1, 2):
            allocator = cls(Device(GIB), expandable_segments=True)
            blocks = [allocator.malloc(20 * MIB) for _ in range(3)]
            allocator.free(blocks[freed])
            allocator.empty_cache()
            states.append(
                (
                    allocator.steady_state_key(),
                    allocator.device.allocator_bytes,
                    allocator.free_block_sizes(False),
                    allocator.segments(),
                )
            )
        assert states[0][1:] == states[1][1:]
        keys[cls] = states[0][0] == states[1][0]
    assert keys == {CachingAllocator: False, NativeCachingAllocator: False}


def test_steady_state_key_is_none_with_garbage_collection():
    native = NativeCachingAllocator(Device(GIB), garbage_collection_threshold=0.5)
    assert native.steady_state_key() is not None
    native.set_memory_fraction(0.8)
    assert native.steady_state_key() is None


def test_the_public_settings_read_as_the_model_s():
    for kwargs in (
        {},
        {"variant": "torch_npu", "expandable_segments": True, "segment_size": 64 * MIB},
        {"roundup_power2_divisions": {"2": 4}, "memory_fraction": 0.5},
    ):
        model, native = CachingAllocator(Device(GIB), **kwargs), NativeCachingAllocator(Device(GIB), **kwargs)
        for name in (
            "name",
            "pad",
            "base_addr_aligned",
            "large_segment_size",
            "max_non_split_rounding_size",
            "page_size_1g",
            "large_page_size",
            "max_split_size",
            "expandable_segments",
            "roundup_power2_divisions",
            "garbage_collection_threshold",
            "throw_on_npumalloc_oom",
            "allowed_memory_maximum",
            "set_fraction",
            "address_space_total",
            "segment_address",
            "on_map",
        ):
            assert getattr(native, name) == getattr(model, name), name
        for size in (0, 1, 480, 513, MIB, 3 * MIB + 7, 10 * MIB, 123456789, (1 << 64) - 1):
            assert native.round_size(size) == model.round_size(size)
            assert native._engine_round_size(size) == min(model.round_size(size), (1 << 64) - 1)
            assert native.segment_size(model.round_size(size)) == model.segment_size(model.round_size(size))
        assert native.expandable_reservation(True) == model.expandable_reservation(True)


def test_fits_in_cache_and_block_at_answer_as_the_model():
    model, native = CachingAllocator(Device(GIB)), NativeCachingAllocator(Device(GIB))
    for allocator in (model, native):
        kept = allocator.malloc(5 * MIB)
        allocator.free(allocator.malloc(3 * MIB))
    for size in (512, MIB, 3 * MIB, 13 * MIB, 15 * MIB, 100 * MIB):
        for stream in (0, 1):
            assert native.fits_in_cache(size, stream) == model.fits_in_cache(size, stream)
    for addr in (kept, kept + 5 * MIB):
        expected, got = model.block_at(addr), native.block_at(addr)
        for name in ("addr", "size", "requested", "small", "allocated", "mapped", "stream"):
            assert getattr(got, name) == getattr(expected, name)
    with pytest.raises(KeyError):
        native.block_at(12345)


def test_many_engines_leave_no_memory_behind():
    def churn() -> None:
        for seed in range(20):
            native = NativeCachingAllocator(Device(256 * MIB), expandable_segments=seed % 2 == 1)
            native.steady_cells()
            native.steady_state_key()
            rng = random.Random(seed)
            live = []
            for _ in range(200):
                if live and rng.random() < 0.45:
                    native.free(live.pop(rng.randrange(len(live))))
                else:
                    try:
                        live.append(native.malloc(request_size(rng, 256 * MIB)))
                    except (AllocatorOutOfMemory, OverflowError):
                        pass
            native.empty_cache()

    churn()  # warm caches (types, interned ints, the allocator's slabs)
    gc.collect()
    tracemalloc.start()
    try:
        churn()
        gc.collect()
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(5):
            churn()
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < 64 * 1024, f"{after - before} bytes more after 100 more engines"


def test_the_serving_scenario_runs_the_same_on_both_engines(monkeypatch):
    """The simulator end to end (steady forwards recorded and replayed, guarded wrapping), for both
    variants, with and without expandable segments."""
    import json
    from pathlib import Path

    from kvguard.allocators import native
    from kvguard.sim.scenario import ScenarioConfig, ServingScenario

    small = json.loads(
        (Path(__file__).resolve().parents[1] / "data" / "configs" / "qwen3-0.6b" / "config.json").read_text()
    )
    runs = {}
    for engine in ("python", "auto"):
        monkeypatch.setenv(native.ENV, engine)
        for allocator, conf in (("torch", ""), ("torch_npu", "expandable_segments:True")):
            config = ScenarioConfig(
                model_config=small,
                device_memory_bytes=8 * GIB,
                gpu_memory_utilization=0.9,
                allocator=allocator,
                requests=8,
                seed=1,
                alloc_conf=conf,
            )
            scenario = ServingScenario(config)
            result = scenario.run()
            runs[engine, allocator] = (native.engine(scenario.allocator), result)
    for allocator in ("torch", "torch_npu"):
        (python_engine, python), (c_engine, c) = runs["python", allocator], runs["auto", allocator]
        assert (python_engine, c_engine) == ("python", "c")
        assert {**python.to_dict(), "allocator_engine": None} == {**c.to_dict(), "allocator_engine": None}
        assert python.timeline == c.timeline
